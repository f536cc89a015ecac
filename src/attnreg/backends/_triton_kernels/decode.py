"""MLA decode (one query token per sequence) over a paged latent KV cache, split-KV.

Layout
------
``kv_cache[page, row, :]`` holds one token: 512 latent values (``c_kv``, used as both K
and V) followed by 64 rope values (``k_pe``).  Token ``t`` of sequence ``b`` lives at
``page_table[b, t // page_size]``, row ``t % page_size``.

Design (why it is shaped like this)
-----------------------------------
* One program owns a block of ``BLOCK_H`` query heads of one sequence and one KV split.
  It streams the KV tiles of its split once and uses every tile for all ``BLOCK_H``
  heads: with 128 heads and ``BLOCK_H = 64`` each tile is read by two programs that are
  adjacent in the grid (head block is the fastest grid axis) and so run at the same
  time, and the second read is an L2 hit.  The commonly used Triton MLA kernel walks the
  cache once per 16 heads, i.e. 8 times at 128 heads.
* Scores are ``q[:, :512] @ c_kv^T + q[:, 512:] @ k_pe^T``: two dots over power-of-two
  widths (576 is not one); the 512-wide latent tile that was loaded for the first dot is
  the V operand of ``P @ V``: it is loaded once.
* Split-KV that survives CUDA-graph capture: the grid is ``(head blocks, S, B)`` with a
  static ``S`` (``max_splits``).  Each program derives its sequence's chunk length from
  ``seq_lens`` on the device (``chunk = max(MIN_CHUNK, roundup(cdiv(L, S), BLOCK_N))``),
  so a short sequence uses fewer splits and programs past its last split exit at once.
  A second kernel recomputes the same split count and merges the normalised partial
  outputs with their log-sum-exp.  Nothing is read back to the host and, given a
  workspace, nothing is allocated: replays with other ``seq_lens`` stay correct.
* fp32 accumulation, exp2-based online softmax (``sm_scale * log2(e)`` folded into one
  multiply), ``kv_scale`` folded into the score scale and the output.  Over an fp8 e4m3
  cache the score dots are fp8 x fp8 on q rounded per head row (declared:
  ``q_compute_dtype`` fp8, ``q_compute_scale`` "row") up to 16 heads tokens-major
  (``SCORES_T``: S^T = K @ q^T, the tile as stored is the A operand of a 64-row wgmma;
  V converted in registers) and from 33 (``FP8_SCORES``) in 64-head tiles, P @ V 16-bit
  (``kv_tile_fp8``); 17-32 heads convert the tile to 16-bit dot operands (``kv_tile``).

Measured (one H200, bf16, page_size 1, CUDA-graph replay, cold L2; see
benchmarks/triton_decode_tuning.py): 537 us at B=128, L=4096, H=128 (~270 TFLOP/s of
useful MMA work, 1.1 TB/s of HBM: not bandwidth-bound; timings at BLOCK_N 16/32/64 fit
a fixed ~1.7 us per tile iteration, presumably the serial chain of synchronous score
wgmma, cross-warpgroup softmax reductions and the P exchange through shared memory - no
profiler was used), 185 us at B=128, L=4096, H=16 (~3.3 TB/s).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# the sizing the declaration estimates with (re-exported: kernel callers import it here)
from ..declarations.triton_sizing import (  # noqa: F401
    MIN_CHUNK_TOKENS,
    DecodeConfig,
    decode_config,
    default_max_splits,
    splits_for_config,
)
from ._common import (
    KV_FP8_DTYPE,
    LN2,
    LOG2E,
    Q_DTYPES,
    _dot,
    check_index,
    check_kv_scale,
    check_lse,
    check_tensor,
    dot_upcast,
    fp8_to_fp16_in_registers,
    interpreting,
    kv_dtypes_for,
    kv_tile,
    kv_tile_fp8,
    next_pow2,
    round_q_rows_fp8,
    tile_rows,
)
from ._launch import BoundLaunch, direct_context

D_LATENT = 512
D_ROPE = 64
D_QK = D_LATENT + D_ROPE

#: The compiled kernel of the latest JIT launch of each kernel (diagnostics: registers,
#: spills).
_LAST_LAUNCH: dict = {}
#: this module: BoundLaunch looks the kernels up here at each JIT launch
_KERNELS = sys.modules[__name__]


class MLADecodeWorkspace(NamedTuple):
    """Scratch buffers of split-KV decode (allocate once, reuse across graph replays).

    partial_out : float32 [batch, max_splits, num_heads, 512]
        Normalised output of each split.
    partial_lse : float32 [batch, max_splits, num_heads]
        Log2-domain log-sum-exp of each split's scaled scores.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor


def mla_decode_workspace(batch_size: int, num_heads: int, max_splits: int,
                         device) -> MLADecodeWorkspace:
    """Allocate the fp32 partial-output and LSE buffers for :func:`mla_decode`.

    Returns
    -------
    MLADecodeWorkspace
        ``partial_out`` float32 [batch_size, max_splits, num_heads, 512] and
        ``partial_lse`` float32 [batch_size, max_splits, num_heads].
    """
    s = max(1, int(max_splits))
    po = torch.empty((batch_size, s, num_heads, D_LATENT), dtype=torch.float32, device=device)
    pl = torch.empty((batch_size, s, num_heads), dtype=torch.float32, device=device)
    return MLADecodeWorkspace(po, pl)


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------

@triton.jit
def _split_chunk(seq_len, num_splits, min_chunk, BLOCK_N: tl.constexpr):
    # Identical in the decode and merge kernels: both must agree on the split count.
    # num_splits / min_chunk are runtime ints so that every split count shares one
    # compiled kernel (the backend picks a different count per captured batch size).
    # min_chunk is a multiple of BLOCK_N (the launchers round it up), so every tile
    # starts at a multiple of BLOCK_N: tile_rows relies on it for pages that hold a whole
    # tile.  (Rounding here instead, after the floor, lets the compiler prove the
    # alignment, and that made it build a worse loop at page size 1: 1199 instructions
    # per tile instead of 1022, 144 bytes spilled with three stages; offline sm90 compile.)
    chunk = tl.cdiv(seq_len, num_splits)
    chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, min_chunk)


@triton.jit
def _softmax_step(qk, mask_n, m_i, l_i):
    """The online-softmax update of one heads-major score tile ``qk [heads, tokens]`` (log2
    domain): masked tokens dropped, ``(m_new, alpha, p, l_new)``.  Every tile holds >= 1
    valid token (chunks start below seq_len), so ``m_new`` is finite."""
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _tokens_major_step(kv_base, row, offs_d, offs_pe, mask_n, q_lat, q_pe, score_scale,
                       m_i, l_i, acc, PDT: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """One KV tile of the tokens-major fp8 decode (``SCORES_T``): ``S^T = K @ q^T`` with
    the fp8 tile as stored as the A operand (q^T, rounded to fp8 per head row, the B
    operand), the online softmax along the tokens, and ``P @ V`` in 16 bits with V
    converted in registers.  Returns the updated ``(m_i, l_i, acc)``."""
    kv_row = kv_base + row[:, None]
    kv = tl.load(kv_row + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    kpe = tl.load(kv_row + offs_pe[None, :], mask=mask_n[:, None], other=0.0)
    st = _dot(kpe, q_pe, tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32), UPCAST)
    st = _dot(kv, q_lat, st, UPCAST) * score_scale
    st = tl.where(mask_n[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pt, 0)
    acc = acc * alpha[:, None]
    acc = _dot(tl.trans(pt.to(PDT)), fp8_to_fp16_in_registers(kv, UPCAST), acc, UPCAST)
    return m_new, l_i, acc


# num_splits / min_chunk are not specialised (Triton would otherwise compile a variant for
# values divisible by 16 and another for 1): one binary serves every split count.
@triton.jit(do_not_specialize=["num_splits", "min_chunk"])
def _mla_decode_kernel(
    Q, KV, PT, SEQ, OUT, PO, PLSE, KVS, LSE,
    qk_scale, kv_scale,
    stride_qb, stride_qh,
    stride_kvp, stride_kvr,
    stride_ptb,
    stride_ob, stride_oh,
    stride_pob, stride_pos, stride_poh,
    stride_lb, stride_ls, stride_lse_b,
    H, num_splits, min_chunk,
    PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_V: tl.constexpr, D_PE: tl.constexpr,
    SPLIT: tl.constexpr, KV_FP8: tl.constexpr, KV_SCALE_PTR: tl.constexpr,
    UPCAST: tl.constexpr, ISOLATE_QK: tl.constexpr, FP8_TWO_LOADS: tl.constexpr,
    FP8_SCORES: tl.constexpr, STORE_LSE: tl.constexpr, SCORES_T: tl.constexpr,
):
    hb = tl.program_id(0)
    sid = tl.program_id(1)
    b = tl.program_id(2)

    seq_len = tl.load(SEQ + b)
    chunk = _split_chunk(seq_len, num_splits, min_chunk, BLOCK_N)
    start = sid * chunk
    # Programs past this sequence's last split do nothing; the merge never reads them.
    # Split 0 always runs so an empty sequence still writes (zeros) in the 1-split mode.
    if (sid > 0) & (start >= seq_len):
        return
    end = tl.minimum(start + chunk, seq_len)

    if KV_SCALE_PTR:
        kvs = tl.load(KVS).to(tl.float32)
    else:
        kvs = kv_scale
    scale = qk_scale * kvs  # sm_scale * log2(e) * kv_scale: scores go straight to exp2

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_pe = D_V + tl.arange(0, D_PE)

    q_row = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    # Dot operand dtype: q's, or fp16 for an fp8 cache read twice (see kv_tile); P's
    # dtype (PDT) is the same, except fp16 beside fp8 score dots (V converted to fp16).
    if FP8_TWO_LOADS:
        DT: tl.constexpr = tl.float16
    else:
        DT: tl.constexpr = Q.dtype.element_ty
    if FP8_SCORES:
        PDT: tl.constexpr = tl.float16
    else:
        PDT: tl.constexpr = DT
    if FP8_SCORES:
        # fp8 x fp8 score dots (a 64-head tile is bound by its serial chain, and an fp8 K
        # operand needs no conversion into a 16-bit shared tile): q rounded to fp8 with
        # one power-of-two scale per head row, undone on the scores with the softmax
        # scale.  Declared (q_compute_dtype fp8, q_compute_scale "row").
        q_lat, q_pe, q_scale = round_q_rows_fp8(q_row, offs_d, offs_pe, mask_h, UPCAST)
        if SCORES_T:
            q_lat = tl.trans(q_lat)
            q_pe = tl.trans(q_pe)
            score_scale = (scale * q_scale)[None, :]
        else:
            score_scale = (scale * q_scale)[:, None]
    else:
        q_lat = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(DT)
        q_pe = tl.load(q_row + offs_pe[None, :], mask=mask_h[:, None], other=0.0).to(DT)
        score_scale = scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)

    pt_row = PT + b.to(tl.int64) * stride_ptb
    p16 = tl.zeros([BLOCK_H, BLOCK_N], dtype=PDT)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kv_base, row = tile_rows(KV, pt_row, n0, mask_n, stride_kvp, stride_kvr, PAGE_SIZE,
                                 BLOCK_N, True, ONE_PAGE)
        # One load of the latent tile: K for the scores, V for the output.
        if SCORES_T:
            m_i, l_i, acc = _tokens_major_step(kv_base, row, offs_d, offs_pe, mask_n, q_lat,
                                               q_pe, score_scale, m_i, l_i, acc, PDT,
                                               UPCAST, BLOCK_N, BLOCK_H)
        else:
            if FP8_SCORES:
                k_lat, k_pe, v = kv_tile_fp8(kv_base, row, offs_d, offs_pe, mask_n)
            else:
                k_lat, k_pe, v = kv_tile(kv_base, row, offs_d, offs_pe, mask_n, DT, True,
                                         KV_FP8, FP8_TWO_LOADS)
            if ISOLATE_QK:
                # Triton lays out a dot whose result feeds another dot ("chained": S feeds
                # P @ V) with every warp along M.  At M = 64 heads and 8 warps both
                # warpgroups would then compute the same S.  A dot inside the region of an
                # always-true runtime `if` is not seen as chained (the compiler's forward
                # slice of its result stops at the region's yield), so it gets the [4, 2]
                # layout: the two warpgroups split the tokens, half the QK tensor-core work.
                # The rope dot gets its own region (it feeds the latent dot, which would make
                # it chained); the conditions differ so that the two ifs are not merged.  The
                # softmax sits in the second region so that only the bf16 P crosses to the
                # P @ V operand layout.  (A one-trip loop would hide the dots as well but
                # stops the software pipelining of the KV loads.)  Putting both score dots in
                # one region with a separate add was tried: the compiler then moves fp32
                # layout conversions into the region and needs 270 KB of shared memory.
                qk_pe = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
                if end > n0:
                    qk_pe = _dot(q_pe, k_pe, qk_pe, UPCAST)
                # p16 is loop-carried: the else-value is last tile's P, already in the P @ V
                # operand layout (a constant else-value would take its own shared memory).
                alpha = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
                m_new = m_i
                l_new = l_i
                if n0 < end:
                    qk = _dot(q_lat, k_lat, qk_pe, UPCAST) * score_scale
                    m_new, alpha, p, l_new = _softmax_step(qk, mask_n, m_i, l_i)
                    p16 = p.to(PDT)
                acc = acc * alpha[:, None]
                acc = _dot(p16, v, acc, UPCAST)
                m_i = m_new
                l_i = l_new
            else:
                qk = _dot(q_pe, k_pe, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), UPCAST)
                qk = _dot(q_lat, k_lat, qk, UPCAST) * score_scale
                m_new, alpha, p, l_i = _softmax_step(qk, mask_n, m_i, l_i)
                acc = acc * alpha[:, None]
                acc = _dot(p.to(PDT), v, acc, UPCAST)
                m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    if KV_SCALE_PTR:
        # read again rather than kept from the top: a value live through the loop takes a
        # register the 16-head fp8 kernel (at its 255) does not have, 8 more bytes of stack
        # in an offline sm90 compile and 207 vs 190 us at (128, 4096, 16), page 1 (H100)
        kvs = tl.load(KVS).to(tl.float32)
    o = acc * (kvs / l_safe)[:, None]
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        po = (PO + b.to(tl.int64) * stride_pob + sid * stride_pos
              + offs_h[:, None] * stride_poh + offs_d[None, :])
        tl.store(po, o, mask=mask_h[:, None])
        tl.store(PLSE + b.to(tl.int64) * stride_lb + sid * stride_ls + offs_h, lse, mask=mask_h)
    else:
        out = OUT + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, o.to(OUT.dtype.element_ty), mask=mask_h[:, None])
        if STORE_LSE:  # natural log of the scaled scores' sum (m_i, l_i: log2 domain)
            row_lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
            tl.store(LSE + b.to(tl.int64) * stride_lse_b + offs_h, row_lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "min_chunk"])
def _mla_merge_kernel(
    PO, PLSE, SEQ, OUT, LSE,
    stride_pob, stride_pos, stride_poh,
    stride_lb, stride_ls,
    stride_ob, stride_oh, stride_lse_b,
    H, num_splits, min_chunk,
    BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, CHUNK_S: tl.constexpr,
    BLOCK_HM: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
):
    # One program per (BLOCK_HM heads, sequence, BLOCK_D output columns); the host picks
    # the shape so that there are neither too few programs (one per head and 128 columns
    # when B * H is small and the splits many) nor tens of thousands of tiny ones (a
    # 16k-program variant cost ~40 us at B=64, H=64 on an H200).  All split LSEs of a
    # head are read at once (one vector), so the weights are known up front, and the
    # partial outputs are read CHUNK_S splits per step: independent loads rather than a
    # chain of dependent loads per split (an earlier one-split-per-step merge measured
    # ~0.5 us per split, ~35 us at 66 splits).
    hb = tl.program_id(0)
    b = tl.program_id(1)
    dblk = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    chunk = _split_chunk(seq_len, num_splits, min_chunk, BLOCK_N)
    n_splits = tl.cdiv(seq_len, chunk)

    offs_s = tl.arange(0, SPLITS_POW2)
    offs_c = tl.arange(0, CHUNK_S)
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    for hh in tl.static_range(BLOCK_HM):
        h = hb * BLOCK_HM + hh
        # (vector masks built as offs * 0 + h: the interpreter rejects scalar & vector)
        lse_base = PLSE + b.to(tl.int64) * stride_lb + h
        lse = tl.load(lse_base + offs_s * stride_ls, mask=(offs_s < n_splits) & (offs_s * 0 + h < H),
                      other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.sum(tl.exp2(lse - m), 0)
        inv = tl.where(w_sum > 0.0, 1.0 / tl.where(w_sum > 0.0, w_sum, 1.0), 0.0)
        po_base = PO + b.to(tl.int64) * stride_pob + h * stride_poh
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, n_splits, CHUNK_S):
            sc = s0 + offs_c
            ok = (sc < n_splits) & (sc * 0 + h < H)
            w = tl.exp2(tl.load(lse_base + sc * stride_ls, mask=ok, other=float("-inf")) - m)
            o = tl.load(po_base + sc[:, None] * stride_pos + offs_d[None, :],
                        mask=ok[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, 0)
        out = acc * inv
        tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
                 out.to(OUT.dtype.element_ty), mask=offs_d * 0 + h < H)
        if STORE_LSE:
            if dblk == 0:
                if h < H:
                    row_lse = tl.where(w_sum > 0.0, (m + tl.log2(tl.maximum(w_sum, 1e-30))) * LN2,
                                       float("-inf"))
                    tl.store(LSE + b.to(tl.int64) * stride_lse_b + h, row_lse)


def _merge_config(batch: int, heads: int) -> tuple[int, int, int]:
    """(BLOCK_HM, BLOCK_D, CHUNK_S) of the merge kernel for B * H (head, sequence) rows.

    B * H < 256 (batch 1 with long contexts, where the splits are many): one head and 64
    columns per program, up to 128 splits per step (the launch caps CHUNK_S at the split
    count).  Sweep 1, B=1, L=32768: 32.1 us vs 38.8 for (1, 128, 16) at H=16 / 128 splits
    (merge alone 8.2 vs 19.8 us), 58.4 vs 61.6 at H=128 / 66 splits.
    """
    bh = batch * heads
    if bh >= 512:
        return 4, D_LATENT, 8
    if bh >= 256:
        return 1, D_LATENT, 8
    return 1, 64, 128


# ----------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------

def check_absorbed_inputs(q, kv_cache) -> int:
    """Check absorbed-MLA ``q`` [rows, H, 576] and the latent cache; return its page size.

    Shared by the decode and extend wrappers: both read the same paged latent cache.
    """
    check_tensor("q", q, ndim=3, dtypes=Q_DTYPES)
    if q.shape[2] != D_QK:
        raise ValueError(f"q: expected last dim {D_QK} (512 latent + 64 rope), got shape "
                         f"{tuple(q.shape)}")
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=kv_dtypes_for(q.dtype), device=q.device)
    if kv_cache.shape[2] != D_QK:
        raise ValueError(f"kv_cache: expected [num_pages, page_size, {D_QK}], got shape "
                         f"{tuple(kv_cache.shape)}")
    ps = kv_cache.shape[1]
    if ps < 1 or (ps & (ps - 1)) != 0:
        raise ValueError(f"kv_cache: page_size (dim 1) must be a power of two, got {ps}")
    return int(ps)


def _validate(q, kv_cache, page_table, seq_lens, out, max_splits, workspace, force_num_splits,
              kv_scale):
    check_absorbed_inputs(q, kv_cache)
    dev = q.device
    B, H, _ = q.shape
    check_index("page_table", page_table, ndim=2, device=dev)
    if page_table.shape[0] < B:
        raise ValueError(f"page_table: expected >= {B} rows (batch of q), got shape "
                         f"{tuple(page_table.shape)}")
    check_index("seq_lens", seq_lens, ndim=1, device=dev, shape0=B)
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
    if tuple(out.shape) != (B, H, D_LATENT):
        raise ValueError(f"out: expected shape {(B, H, D_LATENT)}, got {tuple(out.shape)}")
    check_kv_scale(kv_scale, kv_cache)
    if not isinstance(max_splits, int) or max_splits < 1:
        raise ValueError(f"max_splits: expected a Python int >= 1, got {max_splits!r}")
    if force_num_splits is not None and (not isinstance(force_num_splits, int)
                                         or not 1 <= force_num_splits <= max_splits):
        raise ValueError(f"force_num_splits: expected None or an int in [1, max_splits="
                         f"{max_splits}], got {force_num_splits!r}")
    if workspace is not None:
        if not isinstance(workspace, MLADecodeWorkspace):
            raise ValueError("workspace: expected the object returned by mla_decode_workspace, "
                             f"got {type(workspace).__name__}")
        po, pl = workspace
        need = force_num_splits or max_splits
        if (po.dtype != torch.float32 or pl.dtype != torch.float32 or po.device != dev
                or pl.device != dev or po.shape[0] < B or po.shape[1] < need
                or po.shape[2] < H or po.shape[3] != D_LATENT or pl.shape[0] < B
                or pl.shape[1] < need or pl.shape[2] < H or po.stride(3) != 1):
            raise ValueError(
                f"workspace: expected float32 buffers on {dev} for >= {B} sequences, "
                f">= {need} splits, >= {H} heads, i.e. partial_out [>={B}, >={need}, >={H}, "
                f"{D_LATENT}] and partial_lse [>={B}, >={need}, >={H}]; got "
                f"{tuple(po.shape)} {po.dtype} {po.device} and {tuple(pl.shape)} {pl.dtype}")


class _DecodePlan:
    """A validated decode request: its launch configuration and bound kernels.

    Everything but the tensors' addresses and the two scales is fixed by the request's
    shapes, strides and dtypes, so it is worked out once per request (see
    :func:`mla_decode`) and each call only launches.
    """

    __slots__ = ("decode", "empty", "merge", "scale_ptr", "split", "ws_shape")

    def __init__(self, q, kv_cache, page_table, out, workspace, kv_scale, *, num_splits: int,
                 min_chunk: int, cfg: DecodeConfig, merge_cfg=None, lse=None) -> None:
        B, H, _ = q.shape
        self.empty = B == 0 or H == 0
        self.split = num_splits > 1
        self.scale_ptr = isinstance(kv_scale, torch.Tensor)
        self.ws_shape = (B, H, num_splits)
        self.decode = self.merge = None
        if self.empty:
            return
        ps = kv_cache.shape[1]
        min_chunk = triton.cdiv(max(1, min_chunk), cfg.block_n) * cfg.block_n  # _split_chunk
        is_fp8 = KV_FP8_DTYPE is not None and kv_cache.dtype == KV_FP8_DTYPE
        fp8_scores = is_fp8 and cfg.fp8_scores
        if self.split and workspace is not None:
            po_strides = tuple(workspace.partial_out.stride()[:3])
            pl_strides = tuple(workspace.partial_lse.stride()[:2])
        elif self.split:  # what a call allocates: contiguous [B, S, H, 512] and [B, S, H]
            po_strides = (num_splits * H * D_LATENT, H * D_LATENT, D_LATENT)
            pl_strides = (num_splits * H, H)
        else:
            po_strides, pl_strides = (0, 0, 0), (0, 0)
        kv_dt = kv_scale.dtype if self.scale_ptr else q.dtype  # q stands in when a float
        # without ``lse`` the kernels get ``out`` as a pointer they never use
        store_lse = lse is not None
        lse_stride = lse.stride(0) if store_lse else 0
        lse_dt = torch.float32 if store_lse else out.dtype
        self.decode = BoundLaunch(
            _KERNELS, "_mla_decode_kernel", (triton.cdiv(H, cfg.block_h), num_splits, B),
            ints=(q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
                  page_table.stride(0), out.stride(0), out.stride(1), *po_strides,
                  *pl_strides, lse_stride, H, num_splits, min_chunk),
            constexprs=(ps, cfg.page_tiles and ps >= cfg.block_n, cfg.block_h, cfg.block_n,
                        D_LATENT, D_ROPE, self.split, is_fp8, self.scale_ptr,
                        dot_upcast(q.dtype) or (fp8_scores and interpreting()),
                        cfg.isolate_qk, is_fp8 and cfg.fp8_two_loads and not fp8_scores,
                        fp8_scores, store_lse and not self.split,
                        fp8_scores and cfg.fp8_scores_t),
            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            dtypes=(q.dtype, kv_cache.dtype, page_table.dtype, torch.int32, out.dtype,
                    torch.float32 if self.split else out.dtype,
                    torch.float32 if self.split else out.dtype, kv_dt, lse_dt))
        if self.split:
            block_hm, block_d, chunk_s = merge_cfg or _merge_config(B, H)
            splits_pow2 = max(2, next_pow2(num_splits))
            self.merge = BoundLaunch(
                _KERNELS, "_mla_merge_kernel", (triton.cdiv(H, block_hm), B, D_LATENT // block_d),
                ints=(*po_strides, *pl_strides, out.stride(0), out.stride(1), lse_stride, H,
                      num_splits, min_chunk),
                # a step wider than the splits only masks
                constexprs=(cfg.block_n, splits_pow2, min(chunk_s, splits_pow2), block_hm,
                            block_d, store_lse),
                options=dict(num_warps=4, num_stages=2),
                dtypes=(torch.float32, torch.float32, torch.int32, out.dtype, lse_dt))

    def run(self, q, kv_cache, page_table, seq_lens, out, workspace, sm_scale, kv_scale,
            parts=("decode", "merge"), lse=None):
        """Launch the decode kernel and, when splitting, the merge kernel.

        ``lse`` must be given exactly when the plan was built with one.
        """
        if self.empty:
            return out
        if not self.split:
            po = pl = out  # not read without splits
        elif workspace is not None:
            po, pl = workspace
        else:
            po, pl = mla_decode_workspace(*self.ws_shape, q.device)
        if self.scale_ptr:
            kvs, kvs_val = kv_scale, 1.0
        else:
            kvs, kvs_val = q, float(kv_scale)  # q: a pointer the kernel never reads
        ctx = direct_context()
        lse_t = out if lse is None else lse
        tensors = (q, kv_cache, page_table, seq_lens, out, po, pl, kvs, lse_t)
        ptrs = None if ctx is None else [t.data_ptr() for t in tensors]
        if "decode" in parts:
            compiled = self.decode(tensors, (float(sm_scale) * LOG2E, kvs_val), ctx, ptrs)
            if compiled is not None:  # a JIT launch (diagnostics: registers, spills)
                _LAST_LAUNCH["decode"] = compiled
        if self.merge is not None and "merge" in parts:
            compiled = self.merge((po, pl, seq_lens, out, lse_t), (), ctx,
                                  None if ptrs is None
                                  else (ptrs[5], ptrs[6], ptrs[3], ptrs[4], ptrs[8]))
            if compiled is not None:
                _LAST_LAUNCH["merge"] = compiled
        return out


def _mla_decode_impl(q, kv_cache, page_table, seq_lens, out, *, sm_scale, kv_scale,
                     num_splits, min_chunk, workspace, cfg: DecodeConfig, merge_cfg=None,
                     parts=("decode", "merge"), lse=None):
    """Launch with an explicit config on validated inputs (tests, tuning).

    ``merge_cfg``: (BLOCK_HM, BLOCK_D, CHUNK_S) of the merge (default
    :func:`_merge_config`).  ``parts`` launches only some of the two kernels (timing
    probes; with splits, ``("merge",)`` merges whatever the workspace holds).
    """
    plan = _DecodePlan(q, kv_cache, page_table, out, workspace, kv_scale,
                       num_splits=num_splits, min_chunk=min_chunk, cfg=cfg,
                       merge_cfg=merge_cfg, lse=lse)
    return plan.run(q, kv_cache, page_table, seq_lens, out, workspace, sm_scale, kv_scale,
                    parts, lse)


#: request key (see _request_key) -> its plan; cleared when full (an engine whose page
#: table widens every step makes a new key per step)
_PLANS: dict[tuple, _DecodePlan] = {}
_MAX_PLANS = 512


def _meta(t) -> tuple:
    return t.dtype, t.shape, t.stride(), t.device


def _request_key(q, kv_cache, page_table, seq_lens, out, kv_scale, max_splits, workspace,
                 force_num_splits, lse) -> tuple | None:
    """Everything validation and the launch plan read: types, dtypes, shapes, strides,
    devices, and the split arguments (values and types).  None when an argument is not
    a tensor (validation then names it)."""
    try:
        scale = _meta(kv_scale) if isinstance(kv_scale, torch.Tensor) else type(kv_scale)
        ws = None if workspace is None else \
            (type(workspace), _meta(workspace[0]), _meta(workspace[1]))
        return (_meta(q), _meta(kv_cache), _meta(page_table), _meta(seq_lens), _meta(out),
                scale, ws, max_splits, type(max_splits), force_num_splits,
                type(force_num_splits), None if lse is None else _meta(lse))
    except (AttributeError, TypeError, IndexError):
        return None


def mla_decode(q, kv_cache, page_table, seq_lens, out, *, sm_scale, kv_scale=1.0,
               max_splits, workspace=None, force_num_splits=None, lse=None):
    """Absorbed MLA decode over a paged latent cache; CUDA-graph capturable.

    Host path: the inputs are checked once per distinct request (dtypes, shapes,
    strides, devices and split arguments), and the launch configuration worked out then
    is kept; later calls with such inputs only launch, and after the first launch of a
    binary they call the compiled kernel directly (see ``_launch.py``; the JIT launch
    where that is unavailable).

    Parameters
    ----------
    q : Tensor [B, H, 576], bf16 or fp16
        Absorbed query: ``q_nope @ W_UK`` (512) then the rope part (64).
    kv_cache : Tensor [num_pages, page_size, 576]
        Same dtype as ``q``, or ``torch.float8_e4m3fn`` (value = stored * kv_scale).
        ``page_size`` is a power of two (1, 16, 32, 64 ... ).
    page_table : int32 Tensor [>= B, max_pages_per_seq]
        Page of token ``t`` of sequence ``b`` is ``page_table[b, t // page_size]``.
    seq_lens : int32 Tensor [B]
        KV length of each sequence, read on the device only.  0 gives a zero output.
    out : Tensor [B, H, 512], dtype of q
        Written in place and returned.
    sm_scale : float
        Softmax scale applied to the 576-wide dot.
    kv_scale : float or 1-element floating Tensor
        Dequantisation scale of an fp8 cache (a tensor is read on the device, so the value
        may change between graph replays).
    max_splits : int
        Static number of KV splits the launch grid is built for (see
        :func:`default_max_splits`, given the cache's dtype and page size).  Each sequence uses
        ``cdiv(L, max(256, roundup(cdiv(L, max_splits), BLOCK_N)))`` of them, decided on
        the device.
    workspace : MLADecodeWorkspace, optional
        From :func:`mla_decode_workspace` (``>= max_splits`` splits).  Required for graph
        capture when splitting: without it the partial buffers are allocated here.
    force_num_splits : int, optional
        Use exactly this static split count (chunks of ``roundup(cdiv(L, n), BLOCK_N)``,
        no minimum chunk).  ``1`` runs the one-pass kernel that writes ``out`` directly.
    lse : Tensor [B, H] float32, optional
        Also write each (sequence, head)'s log-sum-exp: natural log of the summed
        ``exp(sm_scale * kv_scale * q . k)``; ``-inf`` for a zero-length sequence.

    Returns
    -------
    Tensor
        ``out``.

    Raises
    ------
    ValueError
        On a wrong shape, dtype, device, int64 index tensor or too small workspace;
        raised before anything is launched.
    """
    key = _request_key(q, kv_cache, page_table, seq_lens, out, kv_scale, max_splits, workspace,
                       force_num_splits, lse)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        _validate(q, kv_cache, page_table, seq_lens, out, max_splits, workspace,
                  force_num_splits, kv_scale)
        check_lse(lse, q.shape[0], q.shape[1], q.device)
        cfg = decode_config(q.shape[1], kv_cache.dtype, kv_cache.shape[1])
        if force_num_splits is not None:
            num_splits, min_chunk = force_num_splits, cfg.block_n
        else:
            num_splits, min_chunk = max_splits, max(cfg.block_n, cfg.min_chunk)
        plan = _DecodePlan(q, kv_cache, page_table, out, workspace, kv_scale,
                           num_splits=num_splits, min_chunk=min_chunk, cfg=cfg, lse=lse)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan.run(q, kv_cache, page_table, seq_lens, out, workspace, sm_scale, kv_scale,
                    lse=lse)
