"""Rounding q to fp8 e4m3 the way ``KernelConstraints.q_compute_dtype`` declares it.

attnreg's convention (docs/decisions.md, "A kernel that rounds q declares it"): one
power-of-two scale per batch, the smallest ``s`` with ``max|q| / s <= 448`` over the
batch's real query rows, then one round to nearest fp8 e4m3.  The conformance oracle
(``attnreg.testing.workload.round_q``) rounds the same way, bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_E4M3_MAX", "quantize_q_fp8"]

FP8_E4M3_MAX = 448.0


def quantize_q_fp8(q: torch.Tensor, live_rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8, descale)``: ``q`` rounded to float8_e4m3fn with one power-of-two scale.

    ``live_rows`` (bool, ``q``'s leading dims before the last two: one entry per query
    row) says which rows set the scale (padded rows of a replayed graph hold stale
    values, possibly inf or NaN, and are left out).  ``descale`` is float32 ``(1,)``
    with ``q ~ q_fp8 * descale``; ``max|q| = 0`` gives the smallest normal float32
    scale, never 0.  No host read: it runs inside a captured graph.
    """
    row_amax = q.abs().amax(dim=(-2, -1)).float()
    # torch.where, not a product: a stale padded row holding inf or NaN must not leak in
    amax = torch.where(live_rows, row_amax, torch.zeros_like(row_amax)).amax()
    ratio = torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power is kept
    # 2**exponent from its float32 bits: exact on every device (pow / exp2 need not be)
    descale = ((exponent.to(torch.int32) + 127) << 23).view(torch.float32).reshape(1)
    q_fp8 = (q.float() / descale).to(torch.float8_e4m3fn)
    return q_fp8, descale
