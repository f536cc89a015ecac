"""A vLLM step's decode and prefill parts as attnreg batches (torch only: runs without vLLM).

``common`` stands for vLLM's ``CommonAttentionMetadata`` with the fields
:func:`~attnreg.integrations.vllm.batches.to_attnreg_batches` reads; the
real class runs in test_backend_adapter.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnreg.integrations.vllm.batches import to_attnreg_batches
from attnreg.registry import ForwardMode


def _common(context: list[int], query: list[int], *, optimistic: int = 0) -> SimpleNamespace:
    seq = [c + q for c, q in zip(context, query)]
    qsl = torch.tensor([0] + [sum(query[:i + 1]) for i in range(len(query))],
                       dtype=torch.int32)
    table = torch.arange(1, 1 + 3 * len(seq), dtype=torch.int32).view(len(seq), 3)
    slots = torch.arange(100, 100 + sum(query), dtype=torch.int64)
    upper = torch.tensor(seq, dtype=torch.int32)
    upper[:2] += optimistic  # vLLM's async speculative decoding: every draft accepted
    return SimpleNamespace(num_reqs=len(seq), query_start_loc_cpu=qsl,
                           seq_lens=torch.tensor(seq, dtype=torch.int32),
                           seq_lens_cpu_upper_bound=upper, block_table_tensor=table,
                           slot_mapping=slots)


def test_decodes_first_then_the_prefill() -> None:
    common = _common([13, 30, 4], [1, 1, 6])
    parts = to_attnreg_batches(common, num_decodes=2, num_decode_tokens=2, num_prefills=1)
    decode, prefill = parts.decode, parts.prefill
    assert decode is not None and prefill is not None
    assert decode.forward_mode is ForwardMode.DECODE
    assert decode.seq_lens_cpu == (14, 31) and decode.prefix_lens_cpu == (13, 30)
    assert prefill.forward_mode is ForwardMode.EXTEND
    assert prefill.prefix_lens_cpu == (4,) and prefill.extend_lens_cpu == (6,)
    assert torch.equal(decode.page_table, common.block_table_tensor[:2])
    assert torch.equal(prefill.page_table, common.block_table_tensor[2:])
    assert decode.out_cache_loc.dtype == torch.int32
    assert decode.out_cache_loc.tolist() == [100, 101]
    assert prefill.out_cache_loc.tolist() == list(range(102, 108))


def test_uniform_multi_token_decodes_are_target_verify() -> None:
    parts = to_attnreg_batches(_common([5, 18], [3, 3]), num_decodes=2, num_decode_tokens=6,
                               num_prefills=0)
    assert parts.prefill is None and parts.decode is not None
    assert parts.decode.forward_mode is ForwardMode.TARGET_VERIFY
    assert parts.decode.prefix_lens_cpu == (5, 18)


def test_async_speculative_decoding_reads_decode_lengths_from_the_device() -> None:
    common = _common([5, 18, 2], [3, 3, 4], optimistic=2)
    exact = to_attnreg_batches(common, num_decodes=2, num_decode_tokens=6, num_prefills=1,
                               exact_decode_lens=False)
    assert exact.decode is not None and exact.decode.seq_lens_cpu == (8, 21)
    # the upper bound is vLLM's assumption that every draft was accepted
    optimistic = to_attnreg_batches(common, num_decodes=2, num_decode_tokens=6,
                                    num_prefills=1)
    assert optimistic.decode is not None and optimistic.decode.seq_lens_cpu == (10, 23)


def test_a_ragged_decode_part_is_refused() -> None:
    with pytest.raises(ValueError, match="same number of tokens"):
        to_attnreg_batches(_common([5, 18], [1, 2]), num_decodes=2, num_decode_tokens=3,
                           num_prefills=0)
