"""The runtime of ``compat_0_1_mla``: imported only when the backend is instantiated.

It reuses the reference backend's extend and replaces its decode with a
batched one: every sequence's rows are gathered through the page table in one
indexing operation, padded to the longest sequence and masked, instead of a
Python loop over sequences.  attnreg's base class has already checked each
request against the declaration (page size, dtypes, head count, forward
method, capture mode) by the time :meth:`ExampleMLABackend._forward_decode_impl`
runs.
"""

from __future__ import annotations

import torch
from attnreg.backends.base import ForwardMetadata
from attnreg.backends.kv_pool import MLAKVPool
from attnreg.backends.reference import ReferenceBackend

__all__ = ["ExampleMLABackend"]


class ExampleMLABackend(ReferenceBackend):
    """Absorbed MLA on any torch device: batched decode, per-sequence extend.

    Constructed by attnreg as ``ExampleMLABackend(config, capabilities=caps)``.
    Computes in float32 and writes the output in the query's dtype.
    """

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool, md: ForwardMetadata,
                             out: torch.Tensor) -> None:
        batch, latent = q.shape[0], self.config.kv_lora_rank
        max_len = md.max_seq_len
        if max_len == 0:
            out.zero_()
            return
        # Flat pool slot of every (sequence, position < max_len): page * size + row.
        pos = torch.arange(max_len, device=q.device)
        pages = md.page_table.long()[:, pos // pool.page_size]
        slots = pages * pool.page_size + pos % pool.page_size
        kv = pool.read_slots(slots.reshape(-1)).view(batch, max_len, pool.row_dim)
        scores = torch.einsum("bhd,bld->bhl", q.float(), kv) * self.config.softmax_scale
        valid = pos[None, :] < md.seq_lens.long()[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhl,bld->bhd", probs, kv[..., :latent])
        # A length-0 sequence (padding) has no key: its softmax row is NaN; write zeros.
        has_keys = valid.any(dim=1)[:, None, None]
        out.copy_(torch.where(has_keys, o, torch.zeros_like(o)).to(out.dtype))
