"""Absorbed MLA extend / prefill with a cached prefix, over the paged latent cache.

Sequence ``b`` has ``E_b = qo_indptr[b+1] - qo_indptr[b]`` new query tokens whose K/V are
already in the cache at positions ``prefix_lens[b] .. seq_lens[b]-1``.  Query ``i`` sits
at position ``prefix_lens[b] + i`` and attends to cache positions ``0 .. prefix_lens[b]+i``.

Design
------
* A program owns ``BLOCK_Q`` consecutive queries x ``BLOCK_H`` heads of one sequence,
  flattened into ``ROWS = BLOCK_Q * BLOCK_H`` (64 on a GPU) rows of one MMA tile: all
  heads share the latent KV, so every streamed KV tile feeds 64 rows whether the model
  has 16 heads (4 queries x 16 heads) or 128 (1 query x 64 heads).
* The grid is ``(cdiv(max_extend_len, BLOCK_Q), head blocks, B)``: static given the batch
  and a Python-int bound on the extend length, so the launch can be captured in a CUDA
  graph and replayed with any lengths within the bound; programs past a sequence's
  extend length return at once.  Lengths are read on the device only.
* Two KV phases: tiles wholly below the causal diagonal of the block's first query run
  without any mask; only the last tiles evaluate the per-row causal mask.
* Same score split as decode (512 latent + 64 rope dots), latent tile reused as V,
  fp32 online softmax in the exp2 domain, fp8 cache converted in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    KV_FP8_DTYPE,
    LOG2E,
    _dot,
    check_index,
    check_kv_scale,
    check_tensor,
    dot_upcast,
    next_pow2,
)
from .decode import D_LATENT, D_ROPE, check_absorbed_inputs


@triton.jit
def _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row, n0, q_pos, kv_end, scale,
                     stride_kvp, stride_kvr,
                     PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr,
                     D_PE: tl.constexpr, MASK: tl.constexpr, KV_FP8: tl.constexpr,
                     UPCAST: tl.constexpr, ISOLATE_QK: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_V)
    offs_pe = D_V + tl.arange(0, D_PE)
    if MASK:
        mask_n = offs_n < kv_end
        page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    else:
        page = tl.load(pt_row + offs_n // PAGE_SIZE)
    row = page.to(tl.int64) * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvr
    kv_row = KV + row[:, None]
    if MASK:
        kv = tl.load(kv_row + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        kpe = tl.load(kv_row + offs_pe[None, :], mask=mask_n[:, None], other=0.0)
    else:
        kv = tl.load(kv_row + offs_d[None, :])
        kpe = tl.load(kv_row + offs_pe[None, :])
    if KV_FP8:
        kv = kv.to(q_nope.dtype)
        kpe = kpe.to(q_nope.dtype)
    if ISOLATE_QK:
        # Same device as the decode kernel (see decode.py): the score dots sit in the
        # regions of always-true runtime ifs so that Triton does not lay them out as
        # "chained" dots, which at 64 rows and 8 warps would make both warpgroups compute
        # the whole score tile.  p16 is loop-carried for the same reason as there.
        qk_pe = tl.zeros([q_nope.shape[0], BLOCK_N], dtype=tl.float32)
        if kv_end > n0:
            qk_pe = _dot(q_pe, tl.trans(kpe), qk_pe, UPCAST)
        alpha = tl.full([q_nope.shape[0]], 1.0, dtype=tl.float32)
        m_new = m_i
        l_new = l_i
        if n0 < kv_end:
            qk = _dot(q_nope, tl.trans(kv), qk_pe, UPCAST) * scale
            if MASK:
                ok = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
                qk = tl.where(ok, qk, float("-inf"))
            # A row whose every column here is masked keeps its (finite, see caller) max.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_new = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(kv.dtype)
        acc = acc * alpha[:, None]
        acc = _dot(p16, kv, acc, UPCAST)
        return acc, m_new, l_new, p16
    else:
        qk = _dot(q_pe, tl.trans(kpe), tl.zeros([q_nope.shape[0], BLOCK_N], dtype=tl.float32),
                  UPCAST)
        qk = _dot(q_nope, tl.trans(kv), qk, UPCAST)
        qk = qk * scale
        if MASK:
            ok = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(kv.dtype), kv, acc, UPCAST)
        return acc, m_new, l_i, p16


@triton.jit
def _mla_extend_kernel(
    Q, KV, PT, PREFIX, SEQ, QO, OUT, KVS,
    qk_scale, kv_scale,
    stride_qt, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ot, stride_oh,
    H,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SCALE_PTR: tl.constexpr, UPCAST: tl.constexpr,
    ISOLATE_QK: tl.constexpr,
):
    qb = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(QO + b)
    ext = tl.load(QO + b + 1) - q_start
    if qb * BLOCK_Q >= ext:
        return
    prefix = tl.load(PREFIX + b)
    seq_len = tl.load(SEQ + b)

    if KV_SCALE_PTR:
        kvs = tl.load(KVS).to(tl.float32)
    else:
        kvs = kv_scale
    scale = qk_scale * kvs

    ROWS: tl.constexpr = BLOCK_Q * BLOCK_H
    r = tl.arange(0, ROWS)
    qi = qb * BLOCK_Q + r // BLOCK_H
    h = hb * BLOCK_H + r % BLOCK_H
    mask_r = (qi < ext) & (h < H)
    q_pos = prefix + qi
    offs_d = tl.arange(0, D_V)
    offs_pe = D_V + tl.arange(0, D_PE)
    q_row = Q + (q_start + qi).to(tl.int64) * stride_qt + h * stride_qh
    q_nope = tl.load(q_row[:, None] + offs_d[None, :], mask=mask_r[:, None], other=0.0)
    q_pe = tl.load(q_row[:, None] + offs_pe[None, :], mask=mask_r[:, None], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_V], dtype=tl.float32)

    q_first = prefix + qb * BLOCK_Q
    q_last = prefix + tl.minimum(qb * BLOCK_Q + BLOCK_Q, ext) - 1
    kv_end = tl.minimum(q_last + 1, seq_len)
    # Tiles entirely <= the block's first query position (and inside kv_end): no mask.
    full_end = tl.minimum((q_first + 1) // BLOCK_N, kv_end // BLOCK_N) * BLOCK_N
    full_end = tl.maximum(full_end, 0)
    pt_row = PT + b.to(tl.int64) * stride_ptb
    p16 = tl.zeros([ROWS, BLOCK_N], dtype=Q.dtype.element_ty)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i, p16 = _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row,
                                              n0, q_pos, kv_end, scale, stride_kvp,
                                              stride_kvr, PAGE_SIZE, BLOCK_N, D_V, D_PE,
                                              False, KV_FP8, UPCAST, ISOLATE_QK)
    # Column 0 is visible to every row, so after the first tile every row max is finite.
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i, p16 = _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row,
                                              n0, q_pos, kv_end, scale, stride_kvp,
                                              stride_kvr, PAGE_SIZE, BLOCK_N, D_V, D_PE,
                                              True, KV_FP8, UPCAST, ISOLATE_QK)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc * (kvs / l_safe)[:, None]
    o_row = OUT + (q_start + qi).to(tl.int64) * stride_ot + h * stride_oh
    tl.store(o_row[:, None] + offs_d[None, :], o.to(OUT.dtype.element_ty), mask=mask_r[:, None])


def _extend_config(num_heads: int):
    """(BLOCK_H, BLOCK_Q, BLOCK_N, num_warps, num_stages, isolate_qk): 64 MMA rows per
    program, 8 warps (the 64 x 512 fp32 accumulator), un-chained score dots."""
    block_h = min(64, next_pow2(max(1, num_heads)))
    block_q = max(1, 64 // block_h)
    return block_h, block_q, 32, 8, 2, True


def mla_extend(q, kv_cache, page_table, seq_lens, prefix_lens, qo_indptr, out, *, sm_scale,
               kv_scale=1.0, max_extend_len=None):
    """Absorbed MLA extend (prefill with a cached prefix) over a paged latent cache.

    Parameters
    ----------
    q : Tensor [T_total, H, 576], bf16 or fp16
        Absorbed queries of all sequences, ragged by ``qo_indptr``.
    kv_cache : Tensor [num_pages, page_size, 576]
        q's dtype or float8_e4m3fn; the new tokens' K/V are already written.
    page_table : int32 Tensor [>= B, max_pages_per_seq]
    seq_lens : int32 Tensor [B]
        ``prefix_lens + extend_lens``.
    prefix_lens : int32 Tensor [B]
        Cached tokens before the first new query of each sequence.
    qo_indptr : int32 Tensor [B + 1]
        Query offsets; sequence b owns rows ``qo_indptr[b] : qo_indptr[b+1]`` of q / out.
    out : Tensor [T_total, H, 512], dtype of q
        Written in place (rows past ``qo_indptr[B]`` are left untouched) and returned.
    sm_scale : float
    kv_scale : float or 1-element floating Tensor
    max_extend_len : int, optional
        Python-int upper bound on every extend length; fixes the grid.  Required under
        CUDA-graph capture; when None it is read from ``qo_indptr`` on the host (a sync).

    Raises
    ------
    ValueError
        On wrong shapes, dtypes, devices or int64 index tensors, before any launch.
    """
    ps = check_absorbed_inputs(q, kv_cache)
    dev = q.device
    T, H, _ = q.shape
    check_index("qo_indptr", qo_indptr, ndim=1, device=dev)
    B = qo_indptr.shape[0] - 1
    if B < 0:
        raise ValueError("qo_indptr: expected B + 1 >= 1 entries, got an empty tensor")
    check_index("page_table", page_table, ndim=2, device=dev)
    if page_table.shape[0] < B:
        raise ValueError(f"page_table: expected >= {B} rows (len(qo_indptr) - 1), got shape "
                         f"{tuple(page_table.shape)}")
    check_index("seq_lens", seq_lens, ndim=1, device=dev, shape0=B)
    check_index("prefix_lens", prefix_lens, ndim=1, device=dev, shape0=B)
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
    if tuple(out.shape) != (T, H, D_LATENT):
        raise ValueError(f"out: expected shape {(T, H, D_LATENT)}, got {tuple(out.shape)}")
    check_kv_scale(kv_scale, kv_cache)
    if max_extend_len is None:
        # Host read: fine outside capture; a graph caller must pass the bound.
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if B > 0 else 0
    if not isinstance(max_extend_len, int) or max_extend_len < 0:
        raise ValueError(f"max_extend_len: expected a Python int >= 0 or None, got "
                         f"{max_extend_len!r}")
    if B == 0 or H == 0 or max_extend_len == 0:
        return out

    block_h, block_q, block_n, warps, stages, isolate = _extend_config(H)
    is_fp8 = KV_FP8_DTYPE is not None and kv_cache.dtype == KV_FP8_DTYPE
    scale_ptr = isinstance(kv_scale, torch.Tensor)
    grid = (triton.cdiv(max_extend_len, block_q), triton.cdiv(H, block_h), B)
    _mla_extend_kernel[grid](
        q, kv_cache, page_table, prefix_lens, seq_lens, qo_indptr, out,
        kv_scale if scale_ptr else q,
        float(sm_scale) * LOG2E, 1.0 if scale_ptr else float(kv_scale),
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        H,
        PAGE_SIZE=ps, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n,
        D_V=D_LATENT, D_PE=D_ROPE, KV_FP8=is_fp8, KV_SCALE_PTR=scale_ptr,
        UPCAST=dot_upcast(q.dtype), ISOLATE_QK=isolate,
        num_warps=warps, num_stages=stages,
    )
    return out
