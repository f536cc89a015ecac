"""Kernels of one backend that differ per pool dtype: an oracle that rounds q as a kernel's
``q_compute_dtype`` declares, and capture claims run with what each kernel accepts."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Platform,
    SplitKV,
    Vendor,
)
from attnreg.testing.claims import (
    Check,
    ClaimKind,
    Combo,
    expand_claims,
    kernel_q_compute_dtype,
    kernel_q_rounding,
)
from attnreg.testing.workload import round_q

BF16 = frozenset({DType.BF16})


def _caps() -> Capabilities:
    def kernel(kv: DType, compute: DType | None, heads: tuple[int, ...]) -> KernelConstraints:
        return KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),),
                                 BF16, frozenset({kv}), page_sizes=(64,), head_counts=heads,
                                 q_compute_dtype=compute)
    full = GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                            pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED)
    return Capabilities("demo", Platform.parse("cuda:sm90"), frozenset({Vendor.CUDA}),
                        (kernel(DType.BF16, None, (1, 16, 128)),
                         kernel(DType.FP8_E4M3, DType.FP8_E4M3, (16, 128))), (full,))


def _combo(kv: DType) -> Combo:
    return Combo(ForwardMethod.MLA, Phase.DECODE, DType.BF16, kv, 64, 16, (576, 512))


def test_the_kernel_serving_the_combination_decides():
    assert kernel_q_compute_dtype(_caps(), _combo(DType.FP8_E4M3)) is DType.FP8_E4M3
    assert kernel_q_compute_dtype(_caps(), _combo(DType.BF16)) is None
    assert kernel_q_compute_dtype(_caps(), _combo(DType.FP16)) is None  # no kernel serves it


def test_round_q_uses_one_power_of_two_scale_and_one_rounding():
    q = (torch.randn(5, 16, 576, generator=torch.Generator().manual_seed(0)) * 7).bfloat16()
    got = round_q(q, DType.FP8_E4M3)
    amax = float(q.float().abs().max())
    scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448.0))).item()
    assert amax / scale <= 448.0 < 2 * amax / scale
    want = (q.float() / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(got, want)
    # the rounding is real: fp8 keeps 3 mantissa bits
    assert not torch.equal(got, q.float())


def test_an_exact_power_of_two_ratio_keeps_its_scale():
    q = torch.full((1, 1, 576), 448.0 * 8).bfloat16()
    assert torch.equal(round_q(q, DType.FP8_E4M3), q.float())


@pytest.mark.parametrize("scale_per", ["batch", "row"])
def test_round_q_of_an_idle_batch_is_empty(scale_per: str):
    """The padded_rows claim's idle replay (no request) has no query row: the oracle rounds
    nothing (amax of no element raised, refuting every fp8-q padded_rows claim)."""
    got = round_q(torch.empty(0, 16, 576, dtype=torch.bfloat16), DType.FP8_E4M3, scale_per)
    assert got.shape == (0, 16, 576) and got.dtype == torch.float32


def test_round_q_per_row_gives_each_token_head_row_its_own_scale():
    """q_compute_scale "row" (a kernel rounding q on chip, e.g. triton's fp8 score dots):
    each (token, head) row is rounded as a one-row batch would be, so a row far below
    the batch's largest keeps fp8's resolution instead of falling into its subnormals."""
    g = torch.Generator().manual_seed(1)
    gains = torch.tensor([1024.0, 1.0, 1.0 / 512])[None, :, None]
    q = (torch.randn(4, 3, 576, generator=g) * gains).bfloat16()
    got = round_q(q, DType.FP8_E4M3, "row")
    for t in range(4):
        for h in range(3):
            assert torch.equal(got[t, h], round_q(q[t, h][None, None], DType.FP8_E4M3)[0, 0])
    small = q[:, 2].float()
    row_err = (got[:, 2] - small).abs().max()
    batch_err = (round_q(q, DType.FP8_E4M3)[:, 2] - small).abs().max()
    assert row_err < batch_err / 10
    with pytest.raises(ValueError, match="scale_per"):
        round_q(q, DType.FP8_E4M3, "token")


def test_the_serving_kernel_says_how_q_is_scaled():
    row = KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),), BF16,
                            frozenset({DType.FP8_E4M3}), page_sizes=(64,), min_heads=33,
                            q_compute_dtype=DType.FP8_E4M3, q_compute_scale="row")
    low = replace(row, min_heads=1, max_heads=32, q_compute_dtype=None,
                  q_compute_scale="batch")
    full = GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                            pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED)
    caps = Capabilities("demo", Platform.parse("cuda:sm90"), frozenset({Vendor.CUDA}),
                        (low, row), (full,))
    fp8 = replace(_combo(DType.FP8_E4M3), num_heads=64)
    assert kernel_q_rounding(caps, fp8) == {"q_compute_dtype": DType.FP8_E4M3,
                                            "q_compute_scale": "row"}
    assert kernel_q_rounding(caps, replace(fp8, num_heads=32)) == {
        "q_compute_dtype": None, "q_compute_scale": "batch"}
    with pytest.raises(ValueError, match="q_compute_scale"):
        replace(row, q_compute_scale="token")


def test_no_compute_dtype_leaves_q_alone_and_other_dtypes_are_refused():
    q = torch.randn(2, 3, 576).bfloat16()
    assert round_q(q, None) is q
    with pytest.raises(ValueError, match="only to fp8_e4m3"):
        round_q(q, DType.FP16)


def test_a_capture_claim_for_another_pool_uses_a_head_count_its_kernel_accepts():
    # the bf16 kernel's base has 1 head, which the fp8 kernel does not take
    replays = [c.combo for c in expand_claims(_caps(), "cuda")
               if c.kind is ClaimKind.CAPTURE and c.check is Check.REPLAY]
    assert sorted((c.kv_dtype.value, c.num_heads) for c in replays) == [("bf16", 1),
                                                                       ("fp8_e4m3", 16)]


def test_an_fp8_computing_kernel_is_held_to_the_fp8_tolerance_and_only_it():
    from attnreg.testing.batches import batch_spec
    from attnreg.testing.workload import TOLERANCES, Workload, compare

    spec = batch_spec("single_decode", "cpu")
    expected = torch.zeros(spec.num_tokens, 2, 512)
    # an error between the bf16 and the fp8 tolerance
    out = expected + (TOLERANCES[DType.BF16].atol + TOLERANCES[DType.FP8_E4M3].atol) / 2

    def held_to(compute: DType | None) -> DType:
        work = Workload.__new__(Workload)
        object.__setattr__(work, "q_compute_dtype", compute)
        return work.tolerance_dtype(DType.BF16)

    assert held_to(None) is DType.BF16
    assert held_to(DType.FP8_E4M3) is DType.FP8_E4M3
    assert compare(out, expected, held_to(None), spec) is not None
    assert compare(out, expected, held_to(DType.FP8_E4M3), spec) is None
