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
from attnreg.runtime import AttentionBackend, ForwardMetadata, MLAConfig, MLAKVPool

__all__ = ["ReferenceBackend", "causal_attention", "gather_sequence"]


def gather_sequence(pool: MLAKVPool, page_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Dequantised float32 rows ``[seq_len, 576]`` of one sequence, via its page table row."""
    pos = torch.arange(seq_len, device=pool.device)
    slots = page_row.long()[pos // pool.page_size] * pool.page_size + pos % pool.page_size
    return pool.read_slots(slots)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
                     ) -> torch.Tensor:
    """float32 attention with a bottom-right aligned causal mask.

    ``q [E, H, Dqk]``, ``k [L, H or 1, Dqk]``, ``v [L, H or 1, Dv]`` with ``L >= E``:
    query ``i`` sees keys ``0 .. L - E + i``.  Returns ``[E, H, Dv]`` float32.
    """
    e, length = q.shape[0], k.shape[0]
    scores = torch.einsum("ehd,lhd->hel", q.float(), k.float().expand(-1, q.shape[1], -1))
    scores = scores * sm_scale
    key_pos = torch.arange(length, device=q.device)
    query_pos = torch.arange(e, device=q.device) + (length - e)
    scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None],
                                float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hel,lhd->ehd", probs, v.float().expand(-1, q.shape[1], -1))


class ReferenceBackend(AttentionBackend[None, None]):
    """float32 torch MLA (decode, extend) and ragged MHA on any device.

    Takes no options.  Accepts bf16 / fp16 / fp32 queries and bf16 / fp16 /
    fp32 / fp8 pools (fp8 dequantised with the pool's scale); outputs in the
    query dtype.  Refuses FULL / BREAKABLE capture (declared UNSUPPORTED).
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

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool, md: ForwardMetadata[None],
                             out: torch.Tensor) -> None:
        seq_lens, _ = self._host_lens(md)
        latent = self.config.kv_lora_rank
        for b, length in enumerate(seq_lens):
            if length == 0:
                out[b].zero_()
                continue
            kv = gather_sequence(pool, md.page_table[b], length)[:, None, :]
            o = causal_attention(q[b:b + 1], kv, kv[:, :, :latent], self.config.softmax_scale)
            out[b] = o[0].to(out.dtype)

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata[None], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        seq_lens, prefix_lens = self._host_lens(md)
        latent = self.config.kv_lora_rank
        q_start = kv_start = 0
        for b, (length, prefix) in enumerate(zip(seq_lens, prefix_lens)):
            extend = length - prefix
            rows = slice(q_start, q_start + extend)
            if extend > 0:
                if method is ForwardMethod.MLA:
                    assert pool is not None
                    kv = gather_sequence(pool, md.page_table[b], length)[:, None, :]
                    o = causal_attention(q[rows], kv, kv[:, :, :latent],
                                         self.config.softmax_scale)
                else:
                    assert k is not None and v is not None
                    keys = slice(kv_start, kv_start + length)
                    o = causal_attention(q[rows], k[keys], v[keys], self.config.softmax_scale)
                out[rows] = o.to(out.dtype)
            q_start += extend
            kv_start += length
