"""Ragged (varlen) multi-head attention prefill for the non-absorbed MLA path.

``q [T_q, H, Dqk]``, ``k [T_k, H, Dqk]``, ``v [T_k, H, Dv]``, sequences delimited by
``qo_indptr`` / ``kv_indptr``.  For DeepSeek MLA ``Dqk = 192`` (128 nope + 64 rope) and
``Dv = 128``; any ``Dqk`` / ``Dv`` works because the dims are compile-time constants taken
from the tensors: a non-power-of-two ``Dqk`` is split into a power-of-two main part and a
(masked, padded) remainder, each its own dot (``tl.arange`` needs powers of two), so
192 = 128 + 64 costs no padding at all.

Causal masking is bottom-right aligned: with ``q_len`` queries and ``kv_len`` keys, query
``i`` sees keys ``j <= kv_len - q_len + i`` (the prefix plus itself).  A query that sees
no key (``q_len > kv_len``) gets a zero output.

The grid ``(cdiv(max_q_len, BLOCK_M), H, B)`` is static given a Python-int bound, and all
lengths are read on the device, so the launch is capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LN2,
    LOG2E,
    _dot,
    check_index,
    check_lse,
    check_tensor,
    dot_upcast,
    interpreting,
    lse_launch_args,
    next_pow2,
    split_pow2,
)


@triton.jit
def _mha_tile(acc, m_i, l_i, q_a, q_b, k_base, stride_kt, v_base, stride_vt, n0, kv_len,
              diag_m, scale,
              D_A: tl.constexpr, D_B: tl.constexpr, D_B_REAL: tl.constexpr,
              BLOCK_DV: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, D_A)
    offs_v = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < kv_len
    k_off = offs_n.to(tl.int64)[:, None]
    if MASK:
        k_a = tl.load(k_base + k_off * stride_kt + offs_a[None, :], mask=mask_n[:, None],
                      other=0.0)
    else:
        k_a = tl.load(k_base + k_off * stride_kt + offs_a[None, :])
    qk = _dot(q_a, tl.trans(k_a), tl.zeros([q_a.shape[0], BLOCK_N], dtype=tl.float32), UPCAST)
    if D_B > 0:
        offs_b = D_A + tl.arange(0, D_B)
        mb = mask_n[:, None] & (offs_b[None, :] < D_A + D_B_REAL)
        k_b = tl.load(k_base + k_off * stride_kt + offs_b[None, :], mask=mb, other=0.0)
        qk = _dot(q_b, tl.trans(k_b), qk, UPCAST)
    qk = qk * scale
    if MASK:
        ok = mask_n[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= diag_m[:, None])
        qk = tl.where(ok, qk, float("-inf"))
        # Rows with nothing visible yet keep m = -inf: use 0 as the reference instead.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK or (BLOCK_DV != D_V):
        mv = mask_n[:, None] & (offs_v[None, :] < D_V)
        v = tl.load(v_base + k_off * stride_vt + offs_v[None, :], mask=mv, other=0.0)
    else:
        v = tl.load(v_base + k_off * stride_vt + offs_v[None, :])
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _mha_prefill_kernel(
    Q, K, V, QO, KVI, OUT,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    D_A: tl.constexpr, D_B: tl.constexpr, D_B_REAL: tl.constexpr,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    LSE=None, stride_lse_t=0, STORE_LSE: tl.constexpr = False,
):
    mblk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(QO + b)
    q_len = tl.load(QO + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    kv_start = tl.load(KVI + b)
    kv_len = tl.load(KVI + b + 1) - kv_start

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_a = tl.arange(0, D_A)
    q_row = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q_a = tl.load(q_row + offs_a[None, :], mask=mask_m[:, None], other=0.0)
    if D_B > 0:
        offs_b = D_A + tl.arange(0, D_B)
        q_b = tl.load(q_row + offs_b[None, :],
                      mask=mask_m[:, None] & (offs_b[None, :] < D_A + D_B_REAL), other=0.0)
    else:
        q_b = q_a  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    k_base = K + kv_start.to(tl.int64) * stride_kt + h * stride_kh
    v_base = V + kv_start.to(tl.int64) * stride_vt + h * stride_vh
    # Bottom-right causal: query offs_m sees keys <= diag_m.
    diag_m = kv_len - q_len + offs_m
    if CAUSAL:
        first_diag = kv_len - q_len + mblk * BLOCK_M
        hi = tl.minimum(kv_len, first_diag + BLOCK_M)
        hi = tl.maximum(hi, 0)
        # Tiles whose every key is visible to the block's first query and < kv_len.
        full_end = tl.minimum((first_diag + 1) // BLOCK_N, kv_len // BLOCK_N) * BLOCK_N
        full_end = tl.maximum(full_end, 0)
    else:
        hi = kv_len
        full_end = (kv_len // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _mha_tile(acc, m_i, l_i, q_a, q_b, k_base, stride_kt, v_base,
                                  stride_vt, n0, kv_len, diag_m,
                                  qk_scale, D_A, D_B, D_B_REAL, BLOCK_DV, D_V, BLOCK_N,
                                  False, CAUSAL, UPCAST)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _mha_tile(acc, m_i, l_i, q_a, q_b, k_base, stride_kt, v_base,
                                  stride_vt, n0, kv_len, diag_m,
                                  qk_scale, D_A, D_B, D_B_REAL, BLOCK_DV, D_V, BLOCK_N,
                                  True, CAUSAL, UPCAST)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    offs_v = tl.arange(0, BLOCK_DV)
    o_ptr = (OUT + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
             + offs_v[None, :])
    tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (offs_v[None, :] < D_V))
    if STORE_LSE:  # natural log (m_i, l_i are in the log2 domain); no visible key: -inf
        row_lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        tl.store(LSE + (q_start + offs_m).to(tl.int64) * stride_lse_t + h, row_lse,
                 mask=mask_m)


def _mha_config(d_qk: int, d_v: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if interpreting():
        return 32, 32, 4, 1
    if d_qk + d_v > 320:
        return 64, 64, 4, 2
    return 128, 64, 8, 2


def mha_prefill(q, k, v, qo_indptr, kv_indptr, out, *, sm_scale, causal=True, max_q_len=None,
                lse=None):
    """Ragged multi-head attention prefill (non-absorbed MLA: Dqk=192, Dv=128).

    Parameters
    ----------
    q : Tensor [T_q, H, Dqk], bf16 or fp16
    k : Tensor [T_k, H, Dqk], dtype of q
    v : Tensor [T_k, H, Dv], dtype of q
    qo_indptr : int32 Tensor [B + 1]
        Sequence b's queries are rows ``qo_indptr[b] : qo_indptr[b+1]``.
    kv_indptr : int32 Tensor [B + 1]
        Sequence b's keys/values (prefix + new tokens) are rows
        ``kv_indptr[b] : kv_indptr[b+1]``.
    out : Tensor [T_q, H, Dv], dtype of q
        Written in place and returned.
    sm_scale : float
    causal : bool
        Bottom-right aligned causal mask (query i sees key j <= kv_len - q_len + i).
    max_q_len : int, optional
        Python-int bound on the per-sequence query count (fixes the grid; needed under
        graph capture).  None reads it from ``qo_indptr`` on the host.
    lse : Tensor [T_q, H] float32, optional
        Also write each (query row, head)'s log-sum-exp: natural log of the summed
        ``exp(sm_scale * q . k)`` over its visible keys, ``-inf`` when it sees none.

    Raises
    ------
    ValueError
        On wrong shapes / dtypes / devices or int64 indptrs, before any launch.
    """
    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16, torch.float16))
    dev = q.device
    Tq, H, Dqk = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=dev)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=dev)
    if k.shape[1] != H or k.shape[2] != Dqk:
        raise ValueError(f"k: expected shape [T_k, {H}, {Dqk}] (heads and head dim of q), got "
                         f"{tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != H:
        raise ValueError(f"v: expected shape [{k.shape[0]}, {H}, Dv] (tokens of k, heads of "
                         f"q), got {tuple(v.shape)}")
    Dv = v.shape[2]
    if not (16 <= Dqk <= 512) or not (16 <= Dv <= 512):
        raise ValueError(f"head dims: expected 16 <= Dqk, Dv <= 512, got Dqk={Dqk}, Dv={Dv}")
    check_index("qo_indptr", qo_indptr, ndim=1, device=dev)
    B = qo_indptr.shape[0] - 1
    check_index("kv_indptr", kv_indptr, ndim=1, device=dev, shape0=B + 1)
    check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=dev)
    if tuple(out.shape) != (Tq, H, Dv):
        raise ValueError(f"out: expected shape {(Tq, H, Dv)}, got {tuple(out.shape)}")
    check_lse(lse, Tq, H, dev)
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if B > 0 else 0
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len: expected a Python int >= 0 or None, got {max_q_len!r}")
    if B <= 0 or H == 0 or max_q_len == 0:
        return out

    d_a, d_b = split_pow2(Dqk)
    if d_a < 16:
        raise ValueError(f"q: head dim {Dqk} too small for the tensor-core tiles (>= 16)")
    if d_b and d_b < 16:
        d_b = 16  # dots need K >= 16: pad the remainder (masked) to 16
    block_m, block_n, warps, stages = _mha_config(Dqk, Dv)
    grid = (triton.cdiv(max_q_len, block_m), H, B)
    _mha_prefill_kernel[grid](
        q, k, v, qo_indptr, kv_indptr, out,
        float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        D_A=d_a, D_B=d_b, D_B_REAL=Dqk - d_a, D_V=Dv, BLOCK_DV=max(16, next_pow2(Dv)),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        UPCAST=dot_upcast(q.dtype),
        num_warps=warps, num_stages=stages,
        **lse_launch_args(lse, "stride_lse_t"),
    )
    return out
