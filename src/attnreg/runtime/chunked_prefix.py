"""Chunked-prefix MHA (``ForwardMethod.MHA_CHUNKED_KV``, sglang's chunked-prefix MHA).

What MHA over prefix + new tokens computes, without materialising the whole
prefix's K / V: the backend attends the new tokens causally (its
``_forward_extend_impl`` with MHA_CHUNKED_KV), then :func:`merge_prefix_chunks`
reads every prefix chunk (:meth:`ForwardBatch.prefix_chunks`) from the pool,
decompresses it with the engine's ``kv_b_proj``, attends it without a mask
(the backend's ``_forward_prefix_chunk_impl``) and merges the result by its
log-sum-exp (:func:`~attnreg.runtime.merge_attention_states`).  Eager only:
the chunks are planned on the host per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .batch import PrefixChunk
from .lse import PrefixDecompress, merge_attention_states
from .metadata import ForwardMetadata
from .pool import MLAKVLayer
from .refusals import RequestChecker, refusal_error

__all__ = ["ChunkAttention", "merge_prefix_chunks", "prefix_chunks"]

#: ``attend(q, k, v, md, chunk, out, lse)``: the new tokens over one prefix chunk,
#: without a mask, into ``out`` and ``lse`` (``_forward_prefix_chunk_impl``).
ChunkAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ForwardMetadata[Any],
                           PrefixChunk, torch.Tensor, torch.Tensor], None]


def prefix_chunks(md: ForwardMetadata[Any], chunk_tokens: int | None,
                  page_size: int) -> list[PrefixChunk]:
    """The batch's prefix chunks of ``chunk_tokens`` tokens (None: the longest prefix in
    one chunk), computed once per batch and size: every layer of the step reuses them."""
    longest = max(md.prefix_lens_cpu or (0,))
    size = int(chunk_tokens) if chunk_tokens else max(1, longest)
    found = md.prefix_chunk_cache.get(size)
    if found is None:
        assert md.batch is not None, "eager metadata always has its batch"
        found = md.batch.prefix_chunks(size, page_size)
        md.prefix_chunk_cache[size] = found
    return found


def merge_prefix_chunks(q: torch.Tensor, kv: MLAKVLayer | None, md: ForwardMetadata[Any],
                        out: torch.Tensor, lse: torch.Tensor, *,
                        decompress: PrefixDecompress | None, chunk_tokens: int | None,
                        page_size: int, attend: ChunkAttention,
                        checker: RequestChecker) -> None:
    """Fold every prefix chunk of the batch into ``out`` / ``lse``, which hold the new
    tokens' causal attention over themselves; both are updated in place.  Nothing to do
    for a batch without a prefix.

    ``checker`` (which has accepted the request: a prefix comes with ``kv`` and
    ``decompress``) refuses a ``decompress`` returning rows of the wrong shape or dtype.
    """
    if not any(md.prefix_lens_cpu or ()):
        return
    assert kv is not None and decompress is not None
    acc = out.float()
    for chunk in prefix_chunks(md, chunk_tokens, page_size):
        n = chunk.num_tokens
        if n == 0:
            continue
        rows = kv.read_slots(chunk.slots, q.dtype)
        k_c, v_c = decompress(rows[:, :kv.kv_lora_rank], rows[:, kv.kv_lora_rank:])
        refused = checker.decompressed(q, k_c, v_c, n)
        if refused:
            raise refusal_error(checker.name, refused)
        o_c = torch.empty_like(out)
        lse_c = torch.empty_like(lse)
        attend(q, k_c, v_c, md, chunk, o_c, lse_c)
        if 0 in chunk.kv_lens_cpu:
            # sequences without a token in this chunk: nothing to merge, whatever a
            # kernel leaves for a zero-length key set
            empty = torch.tensor([m == 0 for m in chunk.kv_lens_cpu], device=q.device)
            token_rows = torch.repeat_interleave(
                empty, torch.tensor(md.extend_lens_cpu, device=q.device),
                output_size=md.num_tokens)
            o_c.masked_fill_(token_rows[:, None, None], 0)
            lse_c.masked_fill_(token_rows[:, None], float("-inf"))
        merge_attention_states(acc, lse, o_c, lse_c, out=acc, lse_out=lse)
    out.copy_(acc)
