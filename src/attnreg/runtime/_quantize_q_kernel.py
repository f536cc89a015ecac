"""The fused Triton form of :func:`attnreg.runtime.quantize_q_fp8`: two launches.

Why: the torch form is twelve launches (~26 us inside a graph at q ``[8, 128, 576]`` on
the H200, most of the FlashMLA plugin's FP8 decode overhead, issue 31).  This module is
imported only when a CUDA q reaches ``quantize_q_fp8`` (it imports triton; the runtime
package itself must import without it), and the torch form stays the specification:
every byte of ``q_fp8`` and the descale are the same, dead rows included.

How:

1. ``_row_amax``: grid ``(rows, spans)``; each program takes max|q| over its span of one
   row into ``partial[row, span]`` (float32; NaN counted as inf; 0 for a dead row, whose
   q is never read, so a stale inf / NaN there cannot reach the scale).
2. ``_scale_cast``: the same grid; every program reduces all of ``partial`` (at most
   ~``_TARGET_PROGRAMS`` floats, from L2), derives the power-of-two descale exactly as the
   torch form does (IEEE division by 448, clamp to float32's smallest normal, a
   non-finite max -> 1, round up through the float32 bits), scales its span in float32
   and rounds to e4m3 with torch's own conversion written out in integer ops; program
   ``(0, 0)`` writes the descale.

Why the conversion is written out instead of ``.to(tl.float8e4nv)``: Triton's cast is
``cvt.rn.satfinite`` on sm90 (inf -> 448), torch's (c10 ``fp8e4m3fn_from_fp32_value``)
gave NaN for |x| >= 464 before torch 2.12 and saturates to 448 after; only a live
inf / NaN row (scale 1) reaches that range, and the two must still agree there.  Which
of the two torch does is read once from torch's own CPU cast (:data:`SATURATES`).

Why float32 for every dtype: ``x * 2**-e`` is exact in float32 for bf16 / fp16 / fp32
inputs except where it falls below float32's normal range, and those values round to a
signed zero in e4m3 whichever way they got there; the torch form's bf16 multiply rounds
to bf16 only in that same range.  So one float32 path gives torch's bits for all three.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["SATURATES", "pow2_scale", "quantize_q_fp8_fused", "supports"]

#: elements per block of one program's loop (4 warps: 16 a thread, two 16-byte bf16 loads)
_BLOCK = 2048
#: programs per launch to aim for (~4 per H200 SM); caps the partials a program reduces
_TARGET_PROGRAMS = 512
#: partial maxima loaded per step of the reduction in ``_scale_cast``
_BLOCK_P = 1024

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _torch_cast_saturates() -> bool | None:
    """True if torch's float32 -> float8_e4m3fn cast saturates (|x| > 464 and inf give
    448), False if it gives NaN there (torch < 2.12), None for anything else (then the
    fused path is not used: its bits could not be torch's)."""
    probe = torch.tensor([470.0, 480.0, 1e30, math.inf, -math.inf, math.nan, 464.0])
    got = probe.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    if got == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7E]:
        return True
    if got == [0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0x7F, 0x7E]:
        return False
    return None


#: how torch's own e4m3 cast treats an overflow (read from torch on the CPU at import)
SATURATES = _torch_cast_saturates()


@triton.jit
def _block_offsets(span, i, blocks_per_span, n, sh, sd,
                   D: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """Element offsets (from a row's base) of block ``i`` of ``span`` in a row of ``n``
    = H x D elements with strides ``sh`` / ``sd``, and the mask of those inside the row."""
    offs = (span * blocks_per_span + i) * BLOCK + tl.arange(0, BLOCK)
    if FLAT:
        return offs, offs < n
    return (offs // D) * sh + (offs % D) * sd, offs < n


#: Triton compiles a variant per "is 1 / is a multiple of 16" of each int argument; the
#: counts of rows and spans would give every bucket shape its own, for no faster code
@triton.jit(do_not_specialize=["l_s0", "l_s1", "rows1", "blocks_per_span", "spans"])
def _row_amax(q_ptr, live_ptr, partial_ptr,
              q_sr, q_sh, q_sd, l_s0, l_s1, rows1, n, blocks_per_span, spans,
              D: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    span = tl.program_id(1)
    live = tl.load(live_ptr + (row // rows1) * l_s0 + (row % rows1) * l_s1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if live != 0:  # a dead row's q is not read: its max is 0 whatever it holds
        base = q_ptr + row.to(tl.int64) * q_sr
        for i in range(blocks_per_span):
            offs, mask = _block_offsets(span, i, blocks_per_span, n, q_sh, q_sd, D, FLAT, BLOCK)
            x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            # NaN as inf: the torch form's max propagates NaN, and both give scale 1
            a = tl.where(x != x, float("inf"), tl.abs(x))
            acc = tl.maximum(acc, a)
    tl.store(partial_ptr + row * spans + span, tl.max(acc, axis=0))


@triton.jit
def _e4m3_bits(y, SATURATE: tl.constexpr):
    """torch's float32 -> float8_e4m3fn (c10 ``fp8e4m3fn_from_fp32_value``), as int32."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # below 2**-6 (e4m3's smallest normal): add 2**14 in float32 and keep the low bits,
    # the float add doing the round to nearest even at e4m3's subnormal step 2**-9
    # (2**14 is the float32 with bits 141 << 23)
    small = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # normal: rebias the exponent and round the mantissa to 3 bits, ties to even
    normal = (a + ((7 - 127) << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    if SATURATE:
        normal = tl.where(normal == 0x7F, 0x7E, normal)  # a carry into NaN saturates
        over = tl.where(a > 0x7F800000, 0x7F, 0x7E)  # NaN stays NaN, inf / overflow 448
    else:
        over = tl.full(a.shape, 0x7F, tl.int32)
    r = tl.where(a >= (1087 << 20), over, tl.where(a < (121 << 23), small, normal))
    return r | sign


@triton.jit
def pow2_scale(amax):
    """``(scale, 1 / scale)``: the smallest power of two with ``amax / scale <= 448`` (fp8
    e4m3's largest value), both exact (from the float32 bits); an all-zero max gets the
    smallest normal float32, a non-finite one (inf / NaN) 1, as the torch form
    (``_quantize_q_fp8_torch``) and the oracle (``testing.workload.round_q``) give.  Per
    batch here, per row in the Triton decode's fp8 query rows: one formula for both."""
    # amax / 448 rounded as IEEE does (``/`` may lower to div.full, up to 2 ulp off: 448 *
    # 2**k would then round up a power), clamped to the smallest normal float32
    ratio = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    ratio = tl.where((amax == float("inf")) | (amax != amax), 1.0, ratio)
    # the next power of two from the bits: a nonzero mantissa rounds the exponent up
    e_bits = (ratio.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    return (e_bits.to(tl.float32, bitcast=True),
            ((254 << 23) - e_bits).to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["blocks_per_span", "spans", "n_partial"])
def _scale_cast(q_ptr, partial_ptr, out_ptr, descale_ptr,
                q_sr, q_sh, q_sd, o_sr, o_sh, o_sd, n, blocks_per_span, spans, n_partial,
                D: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_P: tl.constexpr, SATURATE: tl.constexpr):
    row = tl.program_id(0)
    span = tl.program_id(1)
    m = tl.zeros([BLOCK_P], dtype=tl.float32)
    for start in range(0, n_partial, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        m = tl.maximum(m, tl.load(partial_ptr + offs, mask=offs < n_partial, other=0.0))
    descale, inv = pow2_scale(tl.max(m, axis=0))
    if (row == 0) & (span == 0):
        tl.store(descale_ptr, descale)
    q_base = q_ptr + row.to(tl.int64) * q_sr
    o_base = out_ptr + row.to(tl.int64) * o_sr
    for i in range(blocks_per_span):
        q_offs, mask = _block_offsets(span, i, blocks_per_span, n, q_sh, q_sd, D, FLAT, BLOCK)
        o_offs, _ = _block_offsets(span, i, blocks_per_span, n, o_sh, o_sd, D, FLAT, BLOCK)
        x = tl.load(q_base + q_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_base + o_offs, _e4m3_bits(x * inv, SATURATE).to(tl.uint8), mask=mask)


def supports(q: torch.Tensor, live_rows: torch.Tensor) -> bool:
    """Whether :func:`quantize_q_fp8_fused` takes these inputs (else the torch form runs):
    q bf16 / fp16 / fp32 of rank >= 2 with at least one element, its leading dims
    collapsible into one row dim, ``live_rows`` bool or int32 (nonzero = live) of exactly
    those dims on q's device, and a torch whose e4m3 overflow rule is known
    (:data:`SATURATES`)."""
    if SATURATES is None or q.dtype not in _DTYPES or q.dim() < 2 or q.numel() == 0:
        return False
    if (live_rows.dtype not in (torch.bool, torch.int32)
            or tuple(live_rows.shape) != tuple(q.shape[:-2])):
        return False
    if live_rows.device != q.device:
        return False
    return _rows_view(q) is not None


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, H, D]`` without a copy, or None when its leading dims do not
    collapse into one stride."""
    rows = math.prod(t.shape[:-2])
    try:
        return t.view(rows, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return None


def _live_2d(live: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``live`` as uint8 (a bool mask) or int32 with (inner size, outer stride, inner
    stride): row ``r`` is at ``(r // inner) * s0 + (r % inner) * s1``, so an expanded mask
    (stride 0) is read in place.  Only a mask of three or more dims that do not collapse
    is copied.  The kernel reads ``!= 0`` either way."""
    if live.dtype == torch.bool:
        live = live.view(torch.uint8)
    if live.dim() == 0:
        return live, 1, 0, 0
    if live.dim() == 1:
        return live, live.shape[0], 0, live.stride(0)
    live = live.flatten(0, -2)  # a view unless the outer dims do not collapse
    return live, live.shape[1], live.stride(0), live.stride(1)


def quantize_q_fp8_fused(q: torch.Tensor, live_rows: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_q_fp8`` in two Triton launches, the same bits (see the module doc).

    Callers check :func:`supports` first.  Allocates only its outputs and one float32
    buffer of partial maxima, all sized by q's shape, and reads nothing on the host: it
    can be captured in a CUDA graph.  ``q_fp8`` has q's strides when q is dense (as
    ``torch.empty_like`` gives them), else it is contiguous.
    """
    q3 = _rows_view(q)
    assert q3 is not None and SATURATES is not None, "call supports() first"
    rows, heads, dim = q3.shape
    n = heads * dim
    out = torch.empty_like(q, dtype=torch.float8_e4m3fn)
    o3 = out.view(rows, heads, dim).view(torch.uint8)
    blocks = triton.cdiv(n, _BLOCK)
    spans = max(1, min(blocks, _TARGET_PROGRAMS // rows))
    blocks_per_span = triton.cdiv(blocks, spans)
    spans = triton.cdiv(blocks, blocks_per_span)
    partial = torch.empty(rows * spans, dtype=torch.float32, device=q.device)
    descale = torch.empty(1, dtype=torch.float32, device=q.device)
    live, rows1, l_s0, l_s1 = _live_2d(live_rows)
    # the row of H x D elements as one run of n: q's and out's (flat index = h * D + d)
    flat = (q3.stride(2) == 1 and q3.stride(1) == dim
            and o3.stride(2) == 1 and o3.stride(1) == dim)
    grid = (rows, spans)
    # enable_fp_fusion=False: no multiply-add contracted into an fma, whose single rounding
    # is not the two roundings the torch form does (triton 3.9's sm90 PTX of these
    # kernels has none either way)
    _row_amax[grid](q3, live, partial, q3.stride(0), q3.stride(1), q3.stride(2),
                    l_s0, l_s1, rows1, n, blocks_per_span, spans,
                    D=dim, FLAT=flat, BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
    _scale_cast[grid](q3, partial, o3, descale,
                      q3.stride(0), q3.stride(1), q3.stride(2),
                      o3.stride(0), o3.stride(1), o3.stride(2),
                      n, blocks_per_span, spans, rows * spans,
                      D=dim, FLAT=flat, BLOCK=_BLOCK, BLOCK_P=_BLOCK_P,
                      SATURATE=SATURATES, num_warps=4, enable_fp_fusion=False)
    return out, descale
