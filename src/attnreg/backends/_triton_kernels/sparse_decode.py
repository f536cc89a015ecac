"""Sparse (DSA) MLA over a paged latent cache: each query row attends its top-k slots.

Contract (docs/sparse.md): ``indices[r]`` (int32, ``top_k`` entries) lists pool slots
``page * page_size + offset`` or -1 (no key); a slot listed twice counts twice; no
causal mask.  A row with no valid entry gets zeros and an LSE of ``-inf``.  Values
other than -1 and a pool slot must be refused before the launch (the runtime does:
the kernel masks only -1, and reads any other value as a slot).

Design
------
* One program per (block of ``BLOCK_H`` heads, query row): it walks the row's index
  list in tiles of ``BLOCK_N`` entries, gathers those rows of the cache (576 values:
  512 latent, then 64 rope; the latent tile is K for the scores and V for ``P @ V``,
  loaded once) and runs the exp2 online softmax in fp32, as the dense decode does
  (``kv_tile`` and ``_dot`` are shared with it).
* Capturable: the grid is ``(head blocks, rows)`` and the loop bound is ``top_k``,
  both shape facts; the indices are read on the device only.  Nothing is allocated and
  no host value is read per call.
* A tile whose entries are all -1 leaves the running max at ``-inf``; the softmax
  subtracts a finite stand-in then, so no ``-inf - -inf`` NaN reaches the accumulator.
* No split over the index list: at top-k 2048 a row is 32 tiles of 64, and the rows of
  a decode batch times the head blocks fill the grid only at larger batches (not tuned).
* Rows of the pool's own dtype (bf16 or fp16, the dense pool format); no fp8 rows.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from ._common import (
    LN2,
    LOG2E,
    Q_DTYPES,
    _dot,
    check_index,
    check_lse,
    check_tensor,
    dot_upcast,
    kv_tile,
    next_pow2,
)
from ._launch import BoundLaunch, direct_context

__all__ = ["mla_sparse_decode"]

D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE

#: this module: BoundLaunch looks the kernel up here at each JIT launch
_KERNELS = sys.modules[__name__]


@triton.jit
def _mla_sparse_kernel(
    Q, KV, IDX, OUT, LSE,
    qk_scale,
    stride_qr, stride_qh,
    stride_kvp, stride_kvr,
    stride_ir,
    stride_or, stride_oh,
    stride_lse_r,
    H, top_k,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_V: tl.constexpr, D_PE: tl.constexpr, UPCAST: tl.constexpr, STORE_LSE: tl.constexpr,
):
    hb = tl.program_id(0)
    r = tl.program_id(1)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_pe = D_V + tl.arange(0, D_PE)
    DT: tl.constexpr = Q.dtype.element_ty

    q_row = Q + r.to(tl.int64) * stride_qr + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(q_row + offs_pe[None, :], mask=mask_h[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)

    idx_row = IDX + r.to(tl.int64) * stride_ir
    for k0 in range(0, top_k, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + offs_k, mask=offs_k < top_k, other=-1)
        valid = slot != -1
        slot = tl.where(valid, slot, 0).to(tl.int64)
        row = (slot // PAGE_SIZE) * stride_kvp + (slot % PAGE_SIZE) * stride_kvr
        k_lat, k_pe, v = kv_tile(KV, row, offs_d, offs_pe, valid, DT, True, False, False)
        qk = _dot(q_pe, k_pe, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), UPCAST)
        qk = _dot(q_lat, k_lat, qk, UPCAST) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # all -1 so far: m_new is -inf; subtract 0 instead (p and alpha come out 0, not NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(DT), v, acc, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]      # a row with no key: acc is 0, so is o
    out = OUT + r.to(tl.int64) * stride_or + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, o.to(OUT.dtype.element_ty), mask=mask_h[:, None])
    if STORE_LSE:  # natural log (m_i, l_i are in the log2 domain)
        row_lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        tl.store(LSE + r.to(tl.int64) * stride_lse_r + offs_h, row_lse, mask=mask_h)


def _config(num_heads: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): the dense decode's head blocks (16 / 32
    / 64 heads, the wgmma M tile at 64), 32-entry index tiles (a gather per entry).

    Five stages: the first count at which Triton 3.6 gives the gathered tile two shared
    buffers at 16 heads (three at 64: 94 / 185 KB; offline sm90 compile), so the next
    tile's gather no longer waits for this tile's last read.  H100, top-k 2048, graph
    replay, page 1 (``scripts/probe_triton_sparse_stages.py``, 2026-12-07): 153.8 / 143.2
    us against 172.1 / 182.8 at two stages (32 / 128 rows, 16 heads), 193.6 vs 257.6
    (32 rows, 64 heads), 383.1 vs 496.6 (128 rows, 128 heads); page 64 12-26% faster too.
    """
    block_h = min(64, max(16, next_pow2(num_heads)))
    return block_h, 32, 4 if block_h <= 16 else 8, 5


def _validate(q, kv_cache, indices, out, lse) -> None:
    check_tensor("q", q, ndim=3, dtypes=Q_DTYPES)
    if q.shape[2] != D_QK:
        raise ValueError(f"q: expected last dim {D_QK} (512 latent + 64 rope), got shape "
                         f"{tuple(q.shape)}")
    # rows in q's own dtype: a bf16 pool serves bf16 queries
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(q.dtype,), device=q.device)
    if kv_cache.shape[2] != D_QK:
        raise ValueError(f"kv_cache: expected [num_pages, page_size, {D_QK}], got shape "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(2) != 1:
        raise ValueError("kv_cache: rows must be contiguous")
    rows, heads = q.shape[0], q.shape[1]
    check_index("indices", indices, ndim=2, device=q.device, shape0=rows)
    if indices.shape[1] < 1:
        raise ValueError(f"indices: expected [rows, top_k >= 1], got {tuple(indices.shape)}")
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
    if tuple(out.shape) != (rows, heads, D_LATENT):
        raise ValueError(f"out: expected shape {(rows, heads, D_LATENT)}, got "
                         f"{tuple(out.shape)}")
    check_lse(lse, rows, heads, q.device)


def _meta(t) -> tuple:
    return t.dtype, t.shape, t.stride(), t.device


#: request key -> its bound launch (validated once per distinct shapes / strides / dtypes)
_PLANS: dict[tuple, BoundLaunch | None] = {}
_MAX_PLANS = 256


def _bind(q, kv_cache, indices, out, lse) -> BoundLaunch | None:
    rows, heads = q.shape[0], q.shape[1]
    if rows == 0 or heads == 0:
        return None
    block_h, block_n, warps, stages = _config(heads)
    store_lse = lse is not None
    return BoundLaunch(
        _KERNELS, "_mla_sparse_kernel", (triton.cdiv(heads, block_h), rows, 1),
        ints=(q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
              indices.stride(0), out.stride(0), out.stride(1),
              lse.stride(0) if store_lse else 0, heads, indices.shape[1]),
        constexprs=(kv_cache.shape[1], block_h, block_n, D_LATENT, D_ROPE,
                    dot_upcast(q.dtype), store_lse),
        options=dict(num_warps=warps, num_stages=stages),
        dtypes=(q.dtype, kv_cache.dtype, indices.dtype, out.dtype,
                torch.float32 if store_lse else out.dtype))


def mla_sparse_decode(q, kv_cache, indices, out, *, sm_scale, lse=None):
    """Sparse absorbed MLA: row ``r`` of ``q`` attends the cache slots ``indices[r]``.

    CUDA-graph capturable: the launch depends only on shapes, strides and dtypes
    (checked once per distinct set), the indices are read on the device.

    Parameters
    ----------
    q : Tensor [R, H, 576], bf16 or fp16
        One query row per decode sequence (or per new token of an extend batch).
    kv_cache : Tensor [num_pages, page_size, 576], dtype of q
        Slot ``s`` is ``kv_cache[s // page_size, s % page_size]``.
    indices : int32 Tensor [R, top_k]
        Pool slots or -1 (no key).  Any other value must be refused by the caller
        first (:func:`attnreg.runtime.refusals.sparse_index_problems`): the kernel
        reads it as a slot.
    out : Tensor [R, H, 512], dtype of q
        Written in place and returned; zeros for a row without a valid entry.
    sm_scale : float
        Softmax scale of the 576-wide dot.
    lse : Tensor [R, H] float32, optional
        Also write the natural log of each (row, head)'s summed ``exp(sm_scale * q . k)``;
        ``-inf`` for a row without a valid entry.

    Raises
    ------
    ValueError
        On a wrong shape, dtype or device, or int64 indices; before any launch.
    """
    try:
        key = (_meta(q), _meta(kv_cache), _meta(indices), _meta(out),
               None if lse is None else _meta(lse))
    except (AttributeError, TypeError, IndexError):
        key = None
    if key is None or key not in _PLANS:
        _validate(q, kv_cache, indices, out, lse)
        launch = _bind(q, kv_cache, indices, out, lse)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = launch
    else:
        launch = _PLANS[key]
    if launch is None:
        return out
    tensors = (q, kv_cache, indices, out, out if lse is None else lse)
    launch(tensors, (float(sm_scale) * LOG2E,), direct_context())
    return out
