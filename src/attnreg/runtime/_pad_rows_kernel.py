"""One Triton launch that sets the padding rows of a captured output to a value, and only them.

Why: ``GraphState.fill_padded_rows`` ran ``masked_fill_`` over the whole output, which
reads and writes every element of every row (torch's masked fill is an elementwise
kernel): +3 to +7 us per layer at the P1 decode shapes on the H200, most of what
attnreg's captured decode added over the raw kernels (issue 31).  A replay's padding rows
are few (often none), so this kernel reads one int32 flag per row and writes only the
flagged rows.

This module imports triton; it is imported only when a CUDA tensor reaches
``attnreg.runtime.graph_buffers.fill_flagged_rows``, so importing the runtime never
imports triton.  The torch form (``masked_fill_``) stays the specification: the same
rows get the same value, the others are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["can_launch_dependent", "fill_flagged_rows_fused", "supports"]

#: elements one program writes per step (4 warps: 8 per thread, a 16-byte bf16 store)
_BLOCK = 1024
#: programs per row at most without a source; a row of more blocks loops (a flagged row
#: is written by up to this many programs, an unflagged one costs each of them one 4-byte
#: load)
_MAX_SPANS = 8
#: with a source every row is written, so one program per block (up to this many per row):
#: 8 programs looping over a row's blocks took 3.4-3.5 us inside a graph for a 1 MiB
#: decode output ([8, 128, 512] bf16; [1, 128, 512]: 3.4 us), about twice the plain copy
#: of the same bytes (1.4-1.7 us; H200, scripts/profile_peers_kernels.py)
_MAX_COPY_SPANS = 1024

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["row_stride", "src_stride", "n", "blocks_per_span"])
def _fill_flagged_rows(t_ptr, flags_ptr, src_ptr, value, row_stride, src_stride, n,
                       blocks_per_span, HAS_SRC: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:
        # Launched as a programmatic dependent of the kernel before it: every program
        # waits here until that kernel has finished and its writes are visible, before it
        # reads anything (the flags too: whatever wrote them is ordered before that kernel,
        # and an engine's kernel may itself be a dependent launch), so this launch's
        # completion still means the previous kernel's.
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    span = tl.program_id(1)
    flag = tl.load(flags_ptr + row)
    base = t_ptr + row.to(tl.int64) * row_stride
    if flag != 0:
        v = tl.full([BLOCK], value, tl.float32).to(t_ptr.dtype.element_ty)
        for i in range(blocks_per_span):
            offs = (span * blocks_per_span + i) * BLOCK + tl.arange(0, BLOCK)
            tl.store(base + offs, v, mask=offs < n)
    elif HAS_SRC:  # a live row: the kernel's output row, copied
        src = src_ptr + row.to(tl.int64) * src_stride
        for i in range(blocks_per_span):
            offs = (span * blocks_per_span + i) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(base + offs, tl.load(src + offs, mask=m), mask=m)


_PDL_BY_DEVICE: dict[int, bool] = {}


def can_launch_dependent(device: torch.device) -> bool:
    """Whether the fill can be launched as a programmatic dependent launch on ``device``:
    sm90 and later, with a triton that has ``gdc_wait``.  Asked once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    known = _PDL_BY_DEVICE.get(index)
    if known is None:
        known = (torch.cuda.get_device_capability(index)[0] >= 9
                 and hasattr(tl.extra.cuda, "gdc_wait"))
        _PDL_BY_DEVICE[index] = known
    return known


def _rows_contiguous(t: torch.Tensor) -> bool:
    # every row's elements contiguous (the row stride itself is free)
    return t[0].is_contiguous() if t.shape[0] else True


def supports(t: torch.Tensor, flags: torch.Tensor, src: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes ``t`` (rows of contiguous bf16 / fp16 / fp32 elements),
    ``flags`` (int32, one per row of ``t``, contiguous) and ``src`` (None, or ``t``'s shape
    and dtype with contiguous rows)."""
    if t.dtype not in _DTYPES or t.dim() == 0 or flags.dtype != torch.int32:
        return False
    if flags.dim() != 1 or flags.shape[0] < t.shape[0] or flags.stride(0) != 1:
        return False
    if t.device != flags.device or not _rows_contiguous(t):
        return False
    if src is None:
        return True
    return (src.shape == t.shape and src.dtype == t.dtype and src.device == t.device
            and _rows_contiguous(src))


def fill_flagged_rows_fused(t: torch.Tensor, flags: torch.Tensor, value: float,
                            src: torch.Tensor | None = None, *,
                            dependent_launch: bool = False) -> None:
    """Set every row ``r`` of ``t`` with ``flags[r] != 0`` to ``value``, in place, and (with
    ``src``) every other row to ``src``'s: one launch, no allocation, no host sync
    (capture-safe).

    ``dependent_launch`` (where :func:`can_launch_dependent`): launch it as a programmatic
    dependent of the kernel before it, so its launch overlaps that kernel's end instead of
    following its completion; every program waits for that kernel before it reads or
    writes anything.  Off by default, and the runtime does not ask for it: the fill after
    FlashMLA's fp8 decode is the one launch attnreg's captured decode adds over the raw
    kernel (issue 31, peers.wrapper), and whether this takes its cost away is
    ``scripts/probe_padding_launch.py``'s to measure on an sm90 device first."""
    rows = t.shape[0]
    if rows == 0:
        return
    n = t[0].numel()
    if n == 0:
        return
    blocks = triton.cdiv(n, _BLOCK)
    has_src = src is not None
    spans = min(blocks, _MAX_COPY_SPANS if has_src else _MAX_SPANS)
    blocks_per_span = triton.cdiv(blocks, spans)
    pdl = dependent_launch and t.is_cuda and can_launch_dependent(t.device)
    extra = {"launch_pdl": True} if pdl else {}
    _fill_flagged_rows[(rows, spans)](t, flags, src if has_src else t, float(value),
                                      t.stride(0), src.stride(0) if has_src else 0, n,
                                      blocks_per_span, HAS_SRC=has_src, BLOCK=_BLOCK,
                                      PDL=pdl, num_warps=4, **extra)
