"""``attnreg.runtime.quantize_q_fp8`` (issue 31: the FlashMLA plugin's FP8 decode paid
+47 us for rounding q inside the graph): fewer device ops, the same bits as the
frexp-based rounding it replaced (kept here as the specification), over bf16 / fp16 /
float32, magnitudes from 0 to fp16's overflow, exact powers of two, stale inf / NaN rows
left out by ``live_rows`` and live inf / NaN rows."""

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



def test_twelve_device_ops_three_over_q():
    q, live = torch.randn(4, 1, 16, 576, dtype=torch.bfloat16), torch.ones(4, 1, dtype=torch.bool)
    with RecordOps() as seen:
        quantize_q_fp8(q, live)
    compute = [op for op in seen.ops if op not in FREE]
    assert len(compute) == 12, compute  # was 18 (_spec)
    # the passes over q: the inf-norm, the scaling, the cast
    assert compute[0] == "aten.linalg_vector_norm" and compute[-2:] == [
        "aten.mul", "aten._to_copy"]
