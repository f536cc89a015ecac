"""The ``reference`` backend: float32 torch MLA and MHA, the cpu fallback.

It loops over sequences with host-side lengths, which is why its declaration
says FULL and BREAKABLE capture are UNSUPPORTED: the base class refuses
capture before this code could run.  Slow but simple: every sequence is
gathered from the pool through its page table, dequantised, and attended with
an explicit causal mask.  It is not the conformance oracle (that is the
float64 computation in :mod:`attnreg.testing.workload`, which never reads the
pool through a page table); the suite checks this backend like any other.
"""

from __future__ import annotations

from typing import Any

import torch

from attnreg.registry import ForwardMethod, UnsupportedError
from attnreg.runtime import (
    AttentionBackend,
    ForwardMetadata,
    MLAConfig,
    MLAKVLayer,
    MLAKVPool,
    PrefixChunk,
)

__all__ = ["ReferenceBackend", "attention_with_lse", "causal_attention", "gather_sequence",
           "sparse_attention_with_lse"]


def gather_sequence(pool: MLAKVPool | MLAKVLayer, page_row: torch.Tensor,
                    seq_len: int) -> torch.Tensor:
    """Dequantised float32 rows ``[seq_len, 576]`` of one sequence, via its page table row."""
    pos = torch.arange(seq_len, device=pool.device)
    slots = page_row.long()[pos // pool.page_size] * pool.page_size + pos % pool.page_size
    return pool.read_slots(slots)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                       *, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention and its log-sum-exp, bottom-right causal or unmasked.

    ``q [E, H, Dqk]``, ``k [L, H or 1, Dqk]``, ``v [L, H or 1, Dv]``; causal:
    query ``i`` sees keys ``0 .. L - E + i``.  Returns ``out [E, H, Dv]`` and
    ``lse [E, H]`` (natural log of the summed ``exp(sm_scale * q . k)``), both
    float32; a query that sees no key gets 0 and ``-inf``.
    """
    e, length = q.shape[0], k.shape[0]
    heads = q.shape[1]
    if length == 0:
        return (torch.zeros(e, heads, v.shape[-1], device=q.device),
                torch.full((e, heads), float("-inf"), device=q.device))
    scores = torch.einsum("ehd,lhd->hel", q.float(), k.float().expand(-1, heads, -1))
    scores = scores * sm_scale
    if causal:
        key_pos = torch.arange(length, device=q.device)
        query_pos = torch.arange(e, device=q.device) + (length - e)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None],
                                    float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                       # [H, E]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("hel,lhd->ehd", probs, v.float().expand(-1, heads, -1))
    return out, lse.transpose(0, 1).contiguous()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
                     ) -> torch.Tensor:
    """float32 attention with a bottom-right aligned causal mask.

    ``q [E, H, Dqk]``, ``k [L, H or 1, Dqk]``, ``v [L, H or 1, Dv]``: query ``i``
    sees keys ``0 .. L - E + i`` (a query that sees none gets zeros).  Returns
    ``[E, H, Dv]`` float32.
    """
    return attention_with_lse(q, k, v, sm_scale)[0]


def sparse_attention_with_lse(q: torch.Tensor, pool: MLAKVPool | MLAKVLayer,
                              indices: torch.Tensor, sm_scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 sparse MLA: row ``i`` of ``q [R, H, 576]`` attends the pool slots
    ``indices[i]`` (``[R, K]``; -1 = no key, a repeated slot counts twice), no causal mask.

    Returns ``out [R, H, 512]`` and ``lse [R, H]``; a row with no key gets 0 and ``-inf``.
    Every row is gathered in one indexing op, so nothing reads a host value.
    """
    rows, top_k = indices.shape
    latent = pool.kv_lora_rank
    valid = indices != -1
    slots = torch.where(valid, indices, torch.zeros_like(indices)).reshape(-1)
    kv = pool.read_slots(slots).view(rows, top_k, -1)            # [R, K, 576]
    scores = torch.einsum("rhd,rkd->rhk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                         # [R, H]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("rhk,rkd->rhd", probs, kv[..., :latent])
    return out, lse


class ReferenceBackend(AttentionBackend[None, None]):
    """float32 torch MLA (decode, extend, target verify, draft extend), ragged MHA and
    chunked-prefix MHA on any device, each with its log-sum-exp.

    Takes no options.  Accepts bf16 / fp16 / fp32 queries and bf16 / fp16 /
    fp32 / fp8 pools (fp8 dequantised with the layer's scale); outputs in the
    query dtype.  Refuses FULL / BREAKABLE capture (declared UNSUPPORTED).
    Sparse (DSA) MLA, decode and extend, over a bf16 pool with ``topk_indices``
    (:func:`sparse_attention_with_lse`), eagerly.
    """

    def __init__(self, config: MLAConfig, *, capabilities: Any, **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)

    @staticmethod
    def _host_lens(md: ForwardMetadata[None]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if md.seq_lens_cpu is None or md.prefix_lens_cpu is None:
            # Graph metadata has no host lengths; capture is refused before this point,
            # so reaching here means a subclass bypassed the base class checks.
            raise UnsupportedError("reference", "forward on graph metadata",
                                   "the reference needs host-side lengths",
                                   "run the reference eagerly")
        return md.seq_lens_cpu, md.prefix_lens_cpu

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer, md: ForwardMetadata[None],
                             out: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        seq_lens, _ = self._host_lens(md)
        latent = self.config.kv_lora_rank
        for b, length in enumerate(seq_lens):
            kv = gather_sequence(pool, md.page_table[b], length)[:, None, :]
            o, row_lse = attention_with_lse(q[b:b + 1], kv, kv[:, :, :latent],
                                            self.config.softmax_scale)
            out[b] = o[0].to(out.dtype)
            if lse is not None:
                lse[b] = row_lse[0]

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[None], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None) -> None:
        seq_lens, prefix_lens = self._host_lens(md)
        latent = self.config.kv_lora_rank
        scale = self.config.softmax_scale
        q_start = kv_start = 0
        for b, (length, prefix) in enumerate(zip(seq_lens, prefix_lens)):
            extend = length - prefix
            rows = slice(q_start, q_start + extend)
            if extend > 0:
                if method is ForwardMethod.MLA:  # extend, target verify, draft extend
                    assert pool is not None
                    kv = gather_sequence(pool, md.page_table[b], length)[:, None, :]
                    o, row_lse = attention_with_lse(q[rows], kv, kv[:, :, :latent], scale)
                elif method is ForwardMethod.MHA_CHUNKED_KV:  # the new tokens only
                    assert k is not None and v is not None
                    o, row_lse = attention_with_lse(q[rows], k[rows], v[rows], scale)
                else:
                    assert k is not None and v is not None
                    keys = slice(kv_start, kv_start + length)
                    o, row_lse = attention_with_lse(q[rows], k[keys], v[keys], scale)
                out[rows] = o.to(out.dtype)
                if lse is not None:
                    lse[rows] = row_lse
            q_start += extend
            kv_start += length

    def _forward_sparse_impl(self, q: torch.Tensor, pool: MLAKVLayer, md: ForwardMetadata[None],
                             out: torch.Tensor, indices: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        o, row_lse = sparse_attention_with_lse(q, pool, indices, self.config.softmax_scale)
        out.copy_(o.to(out.dtype))
        if lse is not None:
            lse.copy_(row_lse)

    def _forward_prefix_chunk_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   md: ForwardMetadata[None], chunk: PrefixChunk,
                                   out: torch.Tensor, lse: torch.Tensor) -> None:
        self._host_lens(md)  # refuses graph metadata
        assert md.extend_lens_cpu is not None
        q_start = kv_start = 0
        for extend, n in zip(md.extend_lens_cpu, chunk.kv_lens_cpu):
            rows, keys = slice(q_start, q_start + extend), slice(kv_start, kv_start + n)
            if extend > 0:
                o, row_lse = attention_with_lse(q[rows], k[keys], v[keys],
                                                self.config.softmax_scale, causal=False)
                out[rows] = o.to(out.dtype)
                lse[rows] = row_lse
            q_start += extend
            kv_start += n
