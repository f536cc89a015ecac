"""vLLM's per-step batch as attnreg :class:`~attnreg.runtime.ForwardBatch` es.

vLLM 0.33's MLA metadata builders reorder a step so that its decode requests
come first (``reorder_batch_threshold``: requests with at most that many new
tokens) and split it with ``split_decodes_and_prefills``: requests
``0 .. num_decodes - 1`` own tokens ``0 .. num_decode_tokens - 1`` and run
``forward_mqa`` (absorbed MLA over the paged cache), the rest run
``forward_mha`` (prefill).  Each part becomes one attnreg batch:

| vLLM (``CommonAttentionMetadata``) | attnreg (``ForwardBatch``) |
|---|---|
| ``query_start_loc_cpu`` differences | ``extend_lens_cpu`` (new tokens per request) |
| ``seq_lens`` (computed + new tokens) | ``seq_lens`` (prefix + new) |
| ``seq_lens - query_len`` | ``prefix_lens`` |
| ``block_table_tensor`` rows (int32 block ids) | ``page_table`` (the same tensor, sliced) |
| ``slot_mapping`` (int64 ``block * block_size + offset``) | ``out_cache_loc`` (int32, same values) |
| decode part, 1 token per request | ``DECODE`` |
| decode part, ``1 + k`` tokens per request (speculative decoding) | ``TARGET_VERIFY`` |
| prefill part | ``EXTEND`` |

attnreg plans on host lengths.  vLLM's host ``seq_lens_cpu_upper_bound`` is
exact for prefill rows, and for decode rows unless speculative decoding runs
with async scheduling (it then assumes every draft was accepted); there the
decode lengths are read from the device once per step (``exact_decode_lens``
False).  Torch only: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnreg.registry import ForwardMode
from attnreg.runtime import ForwardBatch

__all__ = ["StepBatches", "to_attnreg_batches"]


@dataclass(frozen=True)
class StepBatches:
    """The decode part and the prefill part of one vLLM step (None: the part is empty)."""

    decode: ForwardBatch | None
    prefill: ForwardBatch | None


def _host_lens(common: Any, exact_decode_lens: bool, num_decodes: int) -> list[int]:
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    num_reqs = int(common.num_reqs)
    if upper is None:
        return [int(n) for n in common.seq_lens[:num_reqs].cpu().tolist()]
    lens = [int(n) for n in upper[:num_reqs].tolist()]
    if num_decodes and not exact_decode_lens:
        lens[:num_decodes] = [int(n) for n in common.seq_lens[:num_decodes].cpu().tolist()]
    return lens


def _batch(mode: ForwardMode, seq_lens: list[int], query_lens: list[int],
           page_table: torch.Tensor, slots: torch.Tensor) -> ForwardBatch:
    prefix = [s - q for s, q in zip(seq_lens, query_lens)]
    if any(p < 0 for p in prefix):
        raise ValueError(f"vLLM batch with more new tokens than tokens: seq_lens {seq_lens}, "
                         f"query lens {query_lens}")
    return ForwardBatch.build(mode, prefix, query_lens, page_table.to(torch.int32),
                              slots.to(torch.int32))


def to_attnreg_batches(common: Any, *, num_decodes: int, num_decode_tokens: int,
                       num_prefills: int, exact_decode_lens: bool = True) -> StepBatches:
    """attnreg's batches for one vLLM step (``common``: vLLM's ``CommonAttentionMetadata``;
    the split as the MLA builder's ``split_decodes_and_prefills`` returned it).

    Raises
    ------
    ValueError
        When the decode part is not uniform (attnreg's verify batches have the same
        number of draft tokens per sequence; vLLM's UNIFORM query-length support
        guarantees it).
    """
    qsl = [int(x) for x in common.query_start_loc_cpu[:int(common.num_reqs) + 1].tolist()]
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    seq_lens = _host_lens(common, exact_decode_lens, num_decodes)
    table, slots = common.block_table_tensor, common.slot_mapping
    decode = prefill = None
    if num_decodes:
        lens = query_lens[:num_decodes]
        if len(set(lens)) != 1 or sum(lens) != num_decode_tokens:
            raise ValueError(f"vLLM's decode requests have query lengths {lens}: attnreg's "
                             "decode-phase batches have the same number of tokens per request")
        mode = ForwardMode.DECODE if lens[0] == 1 else ForwardMode.TARGET_VERIFY
        decode = _batch(mode, seq_lens[:num_decodes], lens, table[:num_decodes],
                        slots[:num_decode_tokens])
    if num_prefills:
        reqs = slice(num_decodes, num_decodes + num_prefills)
        lens = query_lens[reqs]
        start = num_decode_tokens
        prefill = _batch(ForwardMode.EXTEND, seq_lens[reqs], lens, table[reqs],
                         slots[start:start + sum(lens)])
    return StepBatches(decode, prefill)
