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
  fp32 online softmax in the exp2 domain, fp8 cache converted on chip (see kv_tile).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# the sizing the declaration estimates with (re-exported: kernel callers import it here)
from ..declarations.triton_sizing import (  # noqa: F401
    EXTEND_MIN_CHUNK_TOKENS,
    default_extend_splits,
    extend_tile,
)
from ._common import (
    KV_FP8_DTYPE,
    LN2,
    LOG2E,
    _dot,
    check_index,
    check_kv_scale,
    check_lse,
    check_tensor,
    dot_upcast,
    interpreting,
    kv_tile,
    lse_launch_args,
    next_pow2,
    round_q_rows_fp8,
    tile_rows,
)
from .decode import D_LATENT, D_ROPE, _split_chunk, check_absorbed_inputs


@triton.jit
def _finite_max(m, SAFE_MAX: tl.constexpr):
    # A KV split that starts past a row's position leaves that row with no visible
    # column so far: its max is -inf, and exp2(-inf - -inf) would be NaN.  Subtracting 0
    # instead gives alpha = p = 0.  Without splits column 0 comes first and is visible to
    # every row, so the max is always finite and this costs nothing.
    if SAFE_MAX:
        return tl.where(m == float("-inf"), 0.0, m)
    return m


@triton.jit
def _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row, n0, q_pos, kv_end, scale,
                     stride_kvp, stride_kvr,
                     PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                     D_V: tl.constexpr, D_PE: tl.constexpr, MASK: tl.constexpr,
                     KV_FP8: tl.constexpr, UPCAST: tl.constexpr, SAFE_MAX: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_V)
    offs_pe = D_V + tl.arange(0, D_PE)
    mask_n = offs_n < kv_end
    kv_base, row = tile_rows(KV, pt_row, n0, mask_n, stride_kvp, stride_kvr, PAGE_SIZE, BLOCK_N,
                             MASK, ONE_PAGE)
    k_lat, k_pe, v = kv_tile(kv_base, row, offs_d, offs_pe, mask_n, q_nope.dtype, MASK, KV_FP8,
                             False)
    # Same device as the decode kernel's ISOLATE_QK (see decode.py): the score dots sit in
    # the regions of always-true runtime ifs so that Triton does not lay them out as
    # "chained" dots, which at 64 rows and 8 warps would make both warpgroups compute the
    # whole score tile.  p16 is loop-carried for the same reason as there.  (Chained
    # dots with 32-head mma.sync blocks lost in issue 20's sweep 1: 0.351 vs 0.214 ms at
    # prefix 0 + extend 512.)
    qk_pe = tl.zeros([q_nope.shape[0], BLOCK_N], dtype=tl.float32)
    if kv_end > n0:
        qk_pe = _dot(q_pe, k_pe, qk_pe, UPCAST)
    alpha = tl.full([q_nope.shape[0]], 1.0, dtype=tl.float32)
    m_new = m_i
    l_new = l_i
    if n0 < kv_end:
        qk = _dot(q_nope, k_lat, qk_pe, UPCAST) * scale
        if MASK:
            ok = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(ok, qk, float("-inf"))
        # A row whose every column here is masked keeps its (finite, see caller) max.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = _finite_max(m_new, SAFE_MAX)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
        l_new = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(v.dtype)
    acc = acc * alpha[:, None]
    acc = _dot(p16, v, acc, UPCAST)
    return acc, m_new, l_new, p16


# num_splits / min_chunk are not specialised: one binary serves every split count.
@triton.jit(do_not_specialize=["num_splits", "min_chunk"])
def _mla_extend_kernel(
    Q, KV, PT, PREFIX, SEQ, QO, OUT, PO, PLSE, KVS,
    qk_scale, kv_scale,
    stride_qt, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ot, stride_oh,
    stride_pot, stride_pos, stride_poh,
    stride_lt, stride_ls,
    H, num_splits, min_chunk,
    PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SCALE_PTR: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
    LSE=None, stride_lse_t=0, STORE_LSE: tl.constexpr = False,
    ROUND_Q: tl.constexpr = False, EMULATE_FP8: tl.constexpr = False,
):
    qb = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2) // num_splits
    sid = tl.program_id(2) % num_splits
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
    if ROUND_Q:
        # q rounded to fp8 per (query, head) row exactly as the decode kernel's fp8 score
        # dots round it (a verify step computes what the decode step would), kept in q's
        # dtype (exact) and the row's scale folded into the score scale
        q8_nope, q8_pe, q_scale = round_q_rows_fp8(q_row[:, None], offs_d, offs_pe, mask_r,
                                                   EMULATE_FP8)
        q_nope = q8_nope.to(Q.dtype.element_ty)
        q_pe = q8_pe.to(Q.dtype.element_ty)
        scale = (scale * q_scale)[:, None]
    else:
        q_nope = tl.load(q_row[:, None] + offs_d[None, :], mask=mask_r[:, None], other=0.0)
        q_pe = tl.load(q_row[:, None] + offs_pe[None, :], mask=mask_r[:, None], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_V], dtype=tl.float32)

    q_first = prefix + qb * BLOCK_Q
    q_last = prefix + tl.minimum(qb * BLOCK_Q + BLOCK_Q, ext) - 1
    kv_end = tl.minimum(q_last + 1, seq_len)
    # This program's KV range: split `sid` of the block's kv_end, in BLOCK_N-aligned
    # chunks decided on the device (the merge kernel needs no count: an empty split
    # writes an LSE of -inf).  Without splits: the whole [0, kv_end).
    chunk = _split_chunk(kv_end, num_splits, min_chunk, BLOCK_N)
    lo = sid * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    # Tiles entirely <= the block's first query position (and inside kv_end): no mask.
    full_end = tl.minimum((q_first + 1) // BLOCK_N, kv_end // BLOCK_N) * BLOCK_N
    full_end = tl.maximum(full_end, 0)
    pt_row = PT + b.to(tl.int64) * stride_ptb
    p16 = tl.zeros([ROWS, BLOCK_N], dtype=Q.dtype.element_ty)
    for n0 in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, m_i, l_i, p16 = _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row,
                                              n0, q_pos, kv_end, scale, stride_kvp,
                                              stride_kvr, PAGE_SIZE, ONE_PAGE, BLOCK_N, D_V,
                                              D_PE, False, KV_FP8, UPCAST, SPLIT)
    # Without splits column 0 is visible to every row, so after the first tile every row
    # max is finite; a later split may see rows with nothing visible yet (SAFE_MAX).
    for n0 in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        acc, m_i, l_i, p16 = _mla_extend_tile(acc, m_i, l_i, p16, q_nope, q_pe, KV, pt_row,
                                              n0, q_pos, kv_end, scale, stride_kvp,
                                              stride_kvr, PAGE_SIZE, ONE_PAGE, BLOCK_N, D_V,
                                              D_PE, True, KV_FP8, UPCAST, SPLIT)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc * (kvs / l_safe)[:, None]
    t = (q_start + qi).to(tl.int64)
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        po = PO + t * stride_pot + sid * stride_pos + h * stride_poh
        tl.store(po[:, None] + offs_d[None, :], o, mask=mask_r[:, None])
        tl.store(PLSE + t * stride_lt + sid * stride_ls + h, lse, mask=mask_r)
    else:
        o_row = OUT + t * stride_ot + h * stride_oh
        tl.store(o_row[:, None] + offs_d[None, :], o.to(OUT.dtype.element_ty),
                 mask=mask_r[:, None])
        if STORE_LSE:  # natural log (m_i, l_i are in the log2 domain)
            row_lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
            tl.store(LSE + t * stride_lse_t + h, row_lse, mask=mask_r)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_extend_merge_kernel(
    PO, PLSE, QO, OUT,
    stride_pot, stride_pos, stride_poh,
    stride_lt, stride_ls,
    stride_ot, stride_oh,
    B, H, num_splits,
    SPLITS_POW2: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    LSE=None, stride_lse_t=0, STORE_LSE: tl.constexpr = False,
):
    # One program per (query row, head, BLOCK_D output columns).  A split whose LSE is
    # -inf saw no visible column (or none at all): its weight is 0 and its partial output
    # is not read.
    t = tl.program_id(0)
    h = tl.program_id(1)
    dblk = tl.program_id(2)
    if t >= tl.load(QO + B):  # rows past qo_indptr[B] stay untouched
        return
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_c = tl.arange(0, CHUNK_S)
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    lse_base = PLSE + t.to(tl.int64) * stride_lt + h
    lse = tl.load(lse_base + offs_s * stride_ls, mask=offs_s < num_splits,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp2(lse - m), 0)
    inv = tl.where(w_sum > 0.0, 1.0 / tl.where(w_sum > 0.0, w_sum, 1.0), 0.0)
    po_base = PO + t.to(tl.int64) * stride_pot + h * stride_poh
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sc = s0 + offs_c
        w = tl.exp2(tl.load(lse_base + sc * stride_ls, mask=sc < num_splits,
                            other=float("-inf")) - m)
        o = tl.load(po_base + sc[:, None] * stride_pos + offs_d[None, :],
                    mask=(w > 0.0)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             (acc * inv).to(OUT.dtype.element_ty))
    if STORE_LSE:
        if dblk == 0:
            row_lse = tl.where(w_sum > 0.0, (m + tl.log2(tl.maximum(w_sum, 1e-30))) * LN2,
                               float("-inf"))
            tl.store(LSE + t.to(tl.int64) * stride_lse_t + h, row_lse)


class MLAExtendWorkspace(NamedTuple):
    """Scratch buffers of split-KV extend (allocate once, reuse across graph replays).

    partial_out : float32 [num_tokens, num_splits, num_heads, 512]
    partial_lse : float32 [num_tokens, num_splits, num_heads]
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


class ExtendConfig(NamedTuple):
    """Launch configuration of the extend kernel (see :func:`extend_config`)."""

    block_h: int  # heads per program
    block_q: int  # queries per program (rows = block_h * block_q)
    block_n: int
    num_warps: int
    num_stages: int


def extend_config(num_heads: int) -> ExtendConfig:
    """Launch configuration for ``num_heads``: 64 query-head rows per program (as many
    heads as fit, queries for the rest: :func:`extend_tile`, which the split heuristic
    uses too), 8 warps (the 64 x 512 fp32 accumulator), 64-token KV tiles, three stages
    (230 KB of shared memory with a 16-bit cache, 185 KB with fp8).

    Issue 20 (H200, H=128, bf16, kernel time, L2 flushed, ms; prefix + extend): sweep 1
    measured 64-token tiles with three stages 1.3x (0 + 512: 0.214 vs 0.281) to 2.0x
    (32768 + 4096: 134.8 vs 269.7) faster than the earlier 32-token tiles with two
    stages, 1.7-2.0x at the five larger P9 shapes (4096 + 4096: 21.4 vs 37.6, 327 vs
    187 TFLOP/s); sweep 2 reproduced it (0.214, 7.39, 1.97, 21.6, 16.3, 134.9 vs 0.281,
    12.75, 3.52, 38.4, 32.4, 269.3).  32-token tiles with three or four stages (0.241,
    32.7 ms at 4096 + 4096), 32-head mma.sync blocks (0.351, 42.8) and 2 queries x 32
    heads (0.245, 29.2) all lost to it at every P9 shape.  Wider score tiles halve the
    shared-memory reads of the query per score (the QK wgmma reads its A operand from
    shared memory every k-step), as in the decode kernel.
    """
    block_h, block_q = extend_tile(num_heads)
    return ExtendConfig(block_h, block_q, 64, 8, 3)


def _extend_config(num_heads: int) -> ExtendConfig:
    # (tests swap this for other tile shapes)
    return extend_config(num_heads)


def mla_extend_workspace(num_tokens: int, num_heads: int, num_splits: int,
                         device) -> MLAExtendWorkspace:
    """Allocate the fp32 partial-output and LSE buffers for a split :func:`mla_extend`."""
    s = max(1, int(num_splits))
    po = torch.empty((num_tokens, s, num_heads, D_LATENT), dtype=torch.float32, device=device)
    pl = torch.empty((num_tokens, s, num_heads), dtype=torch.float32, device=device)
    return MLAExtendWorkspace(po, pl)


def _check_extend_workspace(workspace, T: int, H: int, splits: int, dev) -> None:
    if not isinstance(workspace, MLAExtendWorkspace):
        raise ValueError("workspace: expected the object returned by mla_extend_workspace, "
                         f"got {type(workspace).__name__}")
    po, pl = workspace
    if (po.dtype != torch.float32 or pl.dtype != torch.float32 or po.device != dev
            or pl.device != dev or po.shape[0] < T or po.shape[1] < splits
            or po.shape[2] < H or po.shape[3] != D_LATENT or po.stride(3) != 1
            or pl.shape[0] < T or pl.shape[1] < splits or pl.shape[2] < H):
        raise ValueError(
            f"workspace: expected float32 buffers on {dev} for >= {T} query rows, >= "
            f"{splits} splits, >= {H} heads, i.e. partial_out [>={T}, >={splits}, >={H}, "
            f"{D_LATENT}] and partial_lse [>={T}, >={splits}, >={H}]; got "
            f"{tuple(po.shape)} {po.dtype} {po.device} and {tuple(pl.shape)} {pl.dtype}")


def mla_extend(q, kv_cache, page_table, seq_lens, prefix_lens, qo_indptr, out, *, sm_scale,
               kv_scale=1.0, max_extend_len=None, num_splits=1, workspace=None,
               min_chunk=None, lse=None, round_q_fp8=False):
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
    num_splits : int
        Static number of KV splits the grid is built for (see
        :func:`default_extend_splits`).  Each query block splits its visible KV into
        ``cdiv(kv, max(min_chunk, roundup(cdiv(kv, num_splits), BLOCK_N)))`` chunks,
        decided on the device, and a second kernel merges them: a graph captured with
        short lengths keeps its parallelism and stays correct when replayed with long ones.
    workspace : MLAExtendWorkspace, optional
        From :func:`mla_extend_workspace` (``>= T_total`` rows, ``>= num_splits``).
        Required for graph capture when splitting: without it the buffers are allocated
        here.
    min_chunk : int, optional
        Shortest chunk in tokens (default :data:`EXTEND_MIN_CHUNK_TOKENS`; a multiple of
        the kernel's KV tile is used as is, so ``1`` means "exactly ``num_splits`` chunks").
    lse : Tensor [T_total, H] float32, optional
        Also write each (query row, head)'s log-sum-exp (natural log, see
        :func:`~attnreg.backends._triton_kernels.mla_decode`); rows past
        ``qo_indptr[B]`` are left untouched.
    round_q_fp8 : bool
        Compute with q rounded to fp8 e4m3, one power-of-two scale per (query, head) row,
        as :func:`mla_decode` does with an fp8 cache at 33+ heads (its fp8 score dots):
        the backend asks for it on a verify / draft-extend step, so that such a step
        computes what the decode step would.

    Raises
    ------
    ValueError
        On wrong shapes, dtypes, devices, int64 index tensors or a too small workspace,
        before any launch.
    """
    check_absorbed_inputs(q, kv_cache)
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
    check_lse(lse, T, H, dev)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits: expected a Python int >= 1, got {num_splits!r}")
    if min_chunk is not None and (not isinstance(min_chunk, int) or min_chunk < 1):
        raise ValueError(f"min_chunk: expected None or a Python int >= 1, got {min_chunk!r}")
    split = num_splits > 1
    if split and workspace is not None:
        _check_extend_workspace(workspace, T, H, num_splits, dev)
    if max_extend_len is None:
        # Host read: fine outside capture; a graph caller must pass the bound.
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if B > 0 else 0
    if not isinstance(max_extend_len, int) or max_extend_len < 0:
        raise ValueError(f"max_extend_len: expected a Python int >= 0 or None, got "
                         f"{max_extend_len!r}")
    if B == 0 or H == 0 or max_extend_len == 0:
        return out

    return _mla_extend_impl(q, kv_cache, page_table, seq_lens, prefix_lens, qo_indptr, out,
                            sm_scale=sm_scale, kv_scale=kv_scale,
                            max_extend_len=max_extend_len, num_splits=num_splits,
                            workspace=workspace, min_chunk=min_chunk, cfg=_extend_config(H),
                            lse=lse, round_q_fp8=bool(round_q_fp8))


def _mla_extend_impl(q, kv_cache, page_table, seq_lens, prefix_lens, qo_indptr, out, *,
                     sm_scale, kv_scale, max_extend_len: int, num_splits: int, workspace,
                     min_chunk, cfg: ExtendConfig, lse=None, round_q_fp8=False):
    """Launch the extend (and merge) kernels on validated inputs with config ``cfg``."""
    T, H, _ = q.shape
    B = qo_indptr.shape[0] - 1
    dev = q.device
    ps = kv_cache.shape[1]
    split = num_splits > 1
    block_h, block_q, block_n = cfg.block_h, cfg.block_q, cfg.block_n
    is_fp8 = KV_FP8_DTYPE is not None and kv_cache.dtype == KV_FP8_DTYPE
    scale_ptr = isinstance(kv_scale, torch.Tensor)
    if split:
        po, pl = workspace if workspace is not None else \
            mla_extend_workspace(T, H, num_splits, dev)
        po_strides = (po.stride(0), po.stride(1), po.stride(2))
        pl_strides = (pl.stride(0), pl.stride(1))
    else:
        po = pl = out  # never read or written without splits
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    # (without splits any floor gives one chunk covering the block's whole KV)
    # a multiple of block_n: chunks, so tiles, start at multiples of it (see _split_chunk)
    chunk_floor = triton.cdiv(EXTEND_MIN_CHUNK_TOKENS if min_chunk is None else min_chunk,
                              block_n) * block_n
    grid = (triton.cdiv(max_extend_len, block_q), triton.cdiv(H, block_h), B * num_splits)
    _mla_extend_kernel[grid](
        q, kv_cache, page_table, prefix_lens, seq_lens, qo_indptr, out, po, pl,
        kv_scale if scale_ptr else q,
        float(sm_scale) * LOG2E, 1.0 if scale_ptr else float(kv_scale),
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        *po_strides, *pl_strides,
        H, num_splits, chunk_floor,
        PAGE_SIZE=ps, ONE_PAGE=ps >= block_n, BLOCK_Q=block_q, BLOCK_H=block_h,
        BLOCK_N=block_n, D_V=D_LATENT, D_PE=D_ROPE, KV_FP8=is_fp8, KV_SCALE_PTR=scale_ptr,
        UPCAST=dot_upcast(q.dtype), SPLIT=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **lse_launch_args(lse, "stride_lse_t", not split),
        **({"ROUND_Q": True, "EMULATE_FP8": interpreting()} if round_q_fp8 else {}),
    )
    if split:
        block_d = 128
        _mla_extend_merge_kernel[(T, H, D_LATENT // block_d)](
            po, pl, qo_indptr, out,
            *po_strides, *pl_strides,
            out.stride(0), out.stride(1),
            B, H, num_splits,
            SPLITS_POW2=max(2, next_pow2(num_splits)), CHUNK_S=min(16, next_pow2(num_splits)),
            BLOCK_D=block_d, num_warps=4, num_stages=2,
            **lse_launch_args(lse, "stride_lse_t", True),
        )
    return out
