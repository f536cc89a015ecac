"""``attnreg.runtime.quantize_q_fp8`` (issue 31: the FlashMLA plugin's FP8 decode paid
+47 us for rounding q inside the graph): fewer device ops, the same bits as the
frexp-based rounding it replaced (kept here as the specification), over bf16 / fp16 /
float32, magnitudes from 0 to fp16's overflow, exact powers of two, stale inf / NaN rows
left out by ``live_rows`` and live inf / NaN rows; and the fused Triton form that CUDA
tensors run (two launches) gives the torch form's bytes: under the Triton interpreter
on the CPU, and on a GPU with ``pytest -m gpu tests/runtime/test_quantize_q_fp8.py``
(the same bits, two launches, a capture with host syncs forbidden)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.runtime import quantize_q_fp8  # noqa: E402
from attnreg.runtime.dtypes import FP8_E4M3_MAX  # noqa: E402

from ._dispatch_ops import RecordOps  # noqa: E402

FREE = {"aten.view", "aten.detach", "aten.reshape", "aten.scalar_tensor", "aten._unsafe_view"}


def _spec(q: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding as it was written before issue 31 (frexp of the ratio)."""
    row_amax = q.abs().amax(dim=(-2, -1)).float()
    amax = torch.where(live, row_amax, torch.zeros_like(row_amax)).amax()
    ratio = torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    descale = ((exponent.to(torch.int32) + 127) << 23).view(torch.float32).reshape(1)
    wide = q if q.dtype in (torch.bfloat16, torch.float32) else q.float()
    return (wide * torch.reciprocal(descale).to(wide.dtype)).to(torch.float8_e4m3fn), descale


MAGNITUDES = ([0.0, 1e-30, 1e-8, 1e-3, 0.5, 1.0, 64.0, 448.0, 896.0, 1e4, 6e4]
              + [2.0 ** k for k in range(-20, 16, 3)] + [448 * 2.0 ** k for k in range(-8, 8)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_same_bits_as_the_frexp_rounding(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(31)
    for magnitude in MAGNITUDES:
        for variant in range(3):
            rows = 1 + variant
            q = torch.randn(rows, 1, 4, 576, generator=gen) * magnitude
            if variant == 1:
                q.view(-1)[7] = magnitude  # the max an exact (power-of-two) ratio
            q = q.to(dtype)
            live = torch.ones(rows, 1, dtype=torch.bool)
            if rows > 1:  # a stale padded row: left out of the scale
                live[-1] = False
                q[-1] = float("inf") if variant == 1 else float("nan")
            got, want = quantize_q_fp8(q, live), _spec(q, live)
            assert torch.equal(got[1], want[1]), (dtype, magnitude, variant)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_live_non_finite_row_rounds_as_before(value: float):
    q = torch.randn(2, 1, 4, 576, dtype=torch.bfloat16)
    q[0, 0, 0, 0] = value
    live = torch.ones(2, 1, dtype=torch.bool)
    got, want = quantize_q_fp8(q, live), _spec(q, live)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))



@pytest.mark.parametrize("live_dtype", [torch.bool, torch.int32])
def test_no_rows_an_idle_ranks_batch_rounds_to_nothing_with_the_smallest_scale(live_dtype):
    # seen on an H100 (2026-12-07): the padded_rows claim's idle replay (bs = 0) of an fp8-q
    # decode raised from amax() of no element, as would an engine's eager idle forward
    q = torch.empty(0, 16, 576, dtype=torch.bfloat16)
    q8, descale = quantize_q_fp8(q, torch.empty(0, dtype=live_dtype))
    assert q8.shape == q.shape and q8.dtype == torch.float8_e4m3fn
    assert descale.shape == (1,) and descale.item() == torch.finfo(torch.float32).tiny
    # as max|q| = 0 over live rows gives
    zeros = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    assert torch.equal(descale, quantize_q_fp8(zeros, torch.ones(1, dtype=torch.bool))[1])


def test_twelve_device_ops_three_over_q():
    q, live = torch.randn(4, 1, 16, 576, dtype=torch.bfloat16), torch.ones(4, 1, dtype=torch.bool)
    with RecordOps() as seen:
        quantize_q_fp8(q, live)
    compute = [op for op in seen.ops if op not in FREE]
    assert len(compute) == 12, compute  # was 18 (_spec)
    # the passes over q: the inf-norm, the scaling, the cast
    assert compute[0] == "aten.linalg_vector_norm" and compute[-2:] == [
        "aten.mul", "aten._to_copy"]


# -- the fused Triton form (attnreg.runtime._quantize_q_kernel) ---------------------------
# On the CPU it runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
# without CUDA), called directly: quantize_q_fp8 itself sends only CUDA tensors to it.
# Every byte is compared with the torch form, dead rows included, except where q holds a
# NaN: torch's own NaN sign there depends on its code path (a bf16 NaN times 1 is 0x7FC0
# for 16 elements and 0xFFFF for 64 on this CPU), so both sides must give an e4m3 NaN.

def _fused():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from attnreg.runtime import _quantize_q_kernel

    return _quantize_q_kernel


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor],
                      want: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, what: object
                      ) -> None:
    assert got[1].dtype == torch.float32 and got[1].shape == (1,)
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), (what, got[1], want[1])
    assert got[0].shape == want[0].shape and got[0].dtype == torch.float8_e4m3fn
    g, w = got[0].view(torch.uint8), want[0].view(torch.uint8)
    nan = torch.isnan(q)
    bad = (g != w) & ~nan
    assert not bad.any(), (what, bad.sum().item(), q[bad][:6], g[bad][:6], w[bad][:6])
    assert ((g[nan] & 0x7F) == 0x7F).all() and ((w[nan] & 0x7F) == 0x7F).all(), what


def _both(q: torch.Tensor, live: torch.Tensor, what: object = None) -> None:
    from attnreg.runtime.dtypes import _quantize_q_fp8_torch

    fused = _fused()
    assert fused.supports(q, live), what
    _assert_same_bits(fused.quantize_q_fp8_fused(q, live), _quantize_q_fp8_torch(q, live), q,
                      what)


FUSED_MAGNITUDES = [0.0, 448.0, 1e-30, 896.0, 1e-6, 448 * 2.0 ** -30, 0.3, 2.0 ** 7, 1.0,
                    448 * 2.0 ** 7, 6e4, 3e38]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_kernel_gives_the_torch_forms_bits(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(310)
    top = torch.finfo(dtype).max
    for k, magnitude in enumerate(FUSED_MAGNITUDES):
        magnitude = min(magnitude, top / 8)  # randn reaches ~5 sigma; no inf from scaling
        q = torch.randn(4, 4, 576, generator=gen) * magnitude
        flat = q.view(-1)
        if k % 2:  # the max is the magnitude: 448 * 2**k gives an exact power-of-two ratio
            q = (torch.rand(4, 4, 576, generator=gen) * 2 - 1) * magnitude
            flat = q.view(-1)
            flat[5] = -magnitude
        flat[11:40] = -0.0  # negative zeros stay negative
        flat[40:80] *= 2.0 ** -20  # values that land in e4m3's subnormals or round to 0
        q = q.to(dtype)
        q[3] = float("nan") if k % 3 else float("inf")  # a stale padded row
        live = torch.tensor([True, True, True, False])
        _both(q, live, (dtype, magnitude))


def test_the_tiling_does_not_change_the_bits(monkeypatch: pytest.MonkeyPatch):
    """Spans of several blocks, a row split over programs, and the reduction of the
    partial maxima in several steps."""
    fused = _fused()
    gen = torch.Generator().manual_seed(311)
    q = (torch.randn(5, 3, 200, generator=gen) * 37).bfloat16()
    q[1, 2, 17] = -1500.0  # the max: not in the first block of its row
    live = torch.tensor([True, True, False, True, True])
    q[2] = float("inf")
    for block, target, block_p in [(64, 2, 2), (128, 64, 4), (256, 1, 1)]:
        monkeypatch.setattr(fused, "_BLOCK", block)
        monkeypatch.setattr(fused, "_TARGET_PROGRAMS", target)
        monkeypatch.setattr(fused, "_BLOCK_P", block_p)
        _both(q, live, (block, target, block_p))


def test_strided_q_and_masks_read_in_place():
    gen = torch.Generator().manual_seed(312)
    # heads and dim swapped in memory: not one run of H x D (the kernel's strided path),
    # and the output keeps q's strides as torch's multiply does
    q = (torch.randn(3, 576, 4, generator=gen) * 3).bfloat16().transpose(-2, -1)
    _both(q, torch.tensor([True, False, True]), "transposed")
    from attnreg.runtime.dtypes import _quantize_q_fp8_torch

    fused = _fused()
    assert (fused.quantize_q_fp8_fused(q, torch.ones(3, dtype=torch.bool))[0].stride()
            == _quantize_q_fp8_torch(q, torch.ones(3, dtype=torch.bool))[0].stride())
    # a slice of a wider buffer (rows not adjacent)
    wide = (torch.randn(4, 2, 640, generator=gen) * 9).half()
    _both(wide[..., :576], torch.tensor([True, True, False, True]), "sliced")
    # trtllm_mla's mask: [B] expanded over the draft tokens (stride 0), q [B, q_len, H, D]
    q4 = (torch.randn(3, 2, 4, 576, generator=gen) * 700).bfloat16()
    seq_lens = torch.tensor([5, 0, 2])
    q4[1] = float("nan")
    _both(q4, (seq_lens > 0)[:, None].expand(3, 2), "expanded mask")
    # three leading dims, and none (q [H, D] with a 0-d mask)
    _both(q4.view(3, 2, 1, 4, 576), torch.ones(3, 2, 1, dtype=torch.bool), "three dims")
    _both(q4[0, 0], torch.tensor(True), "no leading dim")


def test_all_dead_rows_and_live_non_finite_rows():
    gen = torch.Generator().manual_seed(313)
    q = (torch.randn(3, 4, 576, generator=gen) * 5).bfloat16()
    q[1] = float("nan")
    _both(q, torch.zeros(3, dtype=torch.bool), "all dead")  # the smallest normal scale
    for value in (float("inf"), float("-inf"), float("nan")):
        q = (torch.randn(3, 4, 576, generator=gen) * 5).bfloat16()
        q[0, 0, :8] = torch.tensor([449.0, 464.0, 465.0, 470.0, 480.0, 1e30, -600.0, 1e-30])
        q[0, 1, 3] = value  # scale 1: every value above is cast as it is
        _both(q, torch.ones(3, dtype=torch.bool), value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_casts_as_torch_does(dtype: torch.dtype):
    """A live inf sets the scale to 1, so each of the 65536 patterns of q's dtype is cast
    unscaled: the kernel's written-out e4m3 conversion against torch's, everywhere
    (subnormals, signed zeros, the rounding ties, overflow, NaN)."""
    q = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    q = q.reshape(1, 64, 1024).clone()
    q[0, 0, 0] = float("inf")
    _both(q, torch.ones(1, dtype=torch.bool), dtype)


def test_float32_patterns_cast_as_torch_does():
    gen = torch.Generator().manual_seed(314)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (1, 64, 1024), generator=gen, dtype=torch.int64)
    q = bits.to(torch.int32).view(torch.float32).clone()
    # and the e4m3 rounding boundaries: the midpoints between neighbours, and one ulp off
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1])])
    q.view(-1)[1 : 1 + edges.numel()] = edges
    q[0, 0, 0] = float("inf")
    _both(q, torch.ones(1, dtype=torch.bool), "float32")


def test_an_int32_mask_is_nonzero_live_in_both_forms():
    """The FlashMLA plugin passes a decode's seq_lens as the mask (no ``> 0`` launch):
    a length-0 (padded) sequence is dead, any other length live, as the bool mask says."""
    from attnreg.runtime.dtypes import _quantize_q_fp8_torch

    gen = torch.Generator().manual_seed(316)
    q = torch.randn(5, 4, 576, generator=gen).to(torch.bfloat16)
    q[1], q[4] = float("inf"), float("nan")  # stale padded rows
    seq_lens = torch.tensor([7, 0, 1, 4096, 0], dtype=torch.int32)
    want = _quantize_q_fp8_torch(q, seq_lens != 0)
    _assert_same_bits(_quantize_q_fp8_torch(q, seq_lens), want, q, "torch form")
    _both(q, seq_lens, "fused form")
    _assert_same_bits(_fused().quantize_q_fp8_fused(q, seq_lens), want, q, "fused vs bool")


def test_supports_leaves_the_rest_to_the_torch_form():
    fused = _fused()
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    assert fused.supports(q, torch.ones(2, dtype=torch.bool))
    assert not fused.supports(q, torch.ones(2, 1, dtype=torch.bool))  # broadcast: torch's
    assert fused.supports(q, torch.ones(2, dtype=torch.int32))  # seq_lens as the mask
    assert not fused.supports(q, torch.ones(2, dtype=torch.int64))
    assert not fused.supports(q.to(torch.float8_e4m3fn), torch.ones(2, dtype=torch.bool))
    assert not fused.supports(q[:0], torch.ones(0, dtype=torch.bool))
    # leading dims that do not collapse into one stride: torch's
    assert not fused.supports(q.view(2, 1, 4, 576).expand(2, 3, 4, 576).transpose(0, 1),
                              torch.ones(3, 2, dtype=torch.bool))


# -- on the GPU: the dispatch, the same bits, two launches, and a captured graph --------

def _cuda_cases():  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(315)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, heads in [(1, 16), (8, 128), (37, 64), (128, 16)]:
            for magnitude in (0.0, 1e-6, 1.0, 448.0, 3e4):
                q = (torch.randn(rows, heads, 576, generator=gen, device="cuda")
                     * magnitude).to(dtype)
                q.view(-1)[3] = magnitude
                q.view(-1)[4:20] = -0.0
                live = torch.rand(rows, generator=gen, device="cuda") < 0.8
                live[0] = True
                if rows > 1:
                    q[-1], live[-1] = float("nan"), False
                yield (dtype, rows, heads, magnitude), q, live
        q = torch.randn(4, 16, 576, generator=gen, device="cuda").to(dtype)
        q[2, 3, :4] = torch.tensor([float("inf"), 470.0, 1e4, float("nan")])
        yield (dtype, "live inf"), q, torch.ones(4, dtype=torch.bool, device="cuda")


@pytest.mark.gpu
def test_on_cuda_quantize_q_fp8_is_the_fused_kernel_with_the_torch_forms_bits():
    from attnreg.runtime.dtypes import _quantize_q_fp8_torch

    _fused()
    for what, q, live in _cuda_cases():
        with RecordOps() as seen:
            got = quantize_q_fp8(q, live)
        assert "aten.linalg_vector_norm" not in seen.ops, (what, seen.ops)
        _assert_same_bits(got, _quantize_q_fp8_torch(q, live), q, what)


@pytest.mark.gpu
def test_on_cuda_two_launches():
    from torch.profiler import ProfilerActivity, profile

    _fused()
    q = torch.randn(8, 128, 576, device="cuda", dtype=torch.bfloat16)
    live = torch.ones(8, dtype=torch.bool, device="cuda")
    quantize_q_fp8(q, live)  # compiles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        quantize_q_fp8(q, live)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    assert sorted(e.name for e in kernels) == ["_row_amax", "_scale_cast"], [
        e.name for e in kernels]


@pytest.mark.gpu
def test_on_cuda_it_captures_without_a_host_sync_and_replays_with_new_values():
    from attnreg.runtime import GraphRunner
    from attnreg.runtime.dtypes import _quantize_q_fp8_torch

    _fused()
    q = torch.randn(16, 128, 576, device="cuda", dtype=torch.bfloat16)
    live = torch.ones(16, dtype=torch.bool, device="cuda")
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    # forbid_sync: a host read inside the captured call raises; the warm-up compiles
    graph = GraphRunner("cuda", forbid_sync=True).capture(
        lambda: outs.append(quantize_q_fp8(q, live)))
    q8, descale = outs[-1]
    for step, magnitude in enumerate([1.0, 3e3, 1e-5]):
        q.copy_(torch.randn_like(q) * magnitude)
        live.copy_(torch.arange(16, device="cuda") < 16 - 3 * step)
        q[15] = float("nan")  # stale (dead from the second step on)
        graph.replay()
        want = _quantize_q_fp8_torch(q, live)
        _assert_same_bits((q8, descale), want, q, magnitude)


def test_one_power_of_two_scale_formula_serves_the_batch_and_the_row_rounding():
    """``pow2_scale`` is what the runtime's fused rounding (one scale per batch) and the
    Triton decode's fp8 query rows (one per row) both call: for each max it gives the
    oracle's scale (``testing.workload.round_q``: frexp of max / 448) and its exact
    reciprocal, 1 for a non-finite max (the triton decode gave inf and -inf there before
    it shared this formula) and the smallest normal float32 for a zero max."""
    if _pow2_scales is None:
        pytest.skip("triton is not installed")
    values = MAGNITUDES + [448 * 2.0 ** k * (1 + 2.0 ** -23) for k in (-3, 0, 5)]
    values += [float("inf"), float("nan")]
    n = triton.next_power_of_2(len(values))
    amax = torch.zeros(n)
    amax[: len(values)] = torch.tensor(values)
    scale, inv = torch.empty(n), torch.empty(n)
    _pow2_scales[(1,)](amax, scale, inv, N=n)
    ratio = torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(ratio)
    want = torch.ldexp(torch.ones_like(ratio), exponent - (mantissa == 0.5).to(exponent.dtype))
    want = torch.where(torch.isfinite(amax), want, 1.0)
    assert torch.equal(scale, want), (amax, scale, want)
    assert torch.equal(inv * scale, torch.ones(n)), "an exact reciprocal"


try:  # module level: the interpreter resolves a kernel's globals in its module
    import triton
    import triton.language as tl

    from attnreg.runtime._quantize_q_kernel import pow2_scale

    @triton.jit
    def _pow2_scales(amax_ptr, scale_ptr, inv_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        scale, inv = pow2_scale(tl.load(amax_ptr + offs))
        tl.store(scale_ptr + offs, scale)
        tl.store(inv_ptr + offs, inv)
except ImportError:
    _pow2_scales = None
