"""The batched float64 oracle equals a plain per-sequence computation.

:func:`attnreg.testing.workload.make_workload` builds every sequence of a batch
at once and computes the expected output with one padded, masked float64
attention per group of sequences (:func:`ragged_attention`).  Here each
sequence is recomputed on its own, from what the pool holds (the prefix rows
read back through the sequence's pages, dequantised) and the workload's own
new rows, queries and k / v: a grouping, padding, masking or layout bug in the
batched oracle, or a prefix written to the wrong slot, shows as a difference.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnreg.registry import DType, ForwardMethod, ForwardMode, Phase
from attnreg.testing.batches import BatchSpec
from attnreg.testing.claims import Combo
from attnreg.testing.workload import make_config, make_pool, make_workload, ragged_attention


def _attend(q, keys, values, scale, causal=True):
    """One sequence, the textbook way: ``q [E, H, D]``, ``keys [L, H, D]``, float64."""
    e, length = q.shape[0], keys.shape[0]
    heads = q.shape[1]
    if length == 0:
        return torch.zeros(e, heads, values.shape[-1]), torch.full((e, heads), float("-inf"))
    out = torch.zeros(e, heads, values.shape[-1], dtype=torch.float64)
    lse = torch.zeros(e, heads, dtype=torch.float64)
    for i in range(e):
        seen = length - e + i + 1 if causal else length
        for h in range(heads):
            if seen <= 0:
                out[i, h] = 0
                lse[i, h] = float("-inf")
                continue
            s = (keys[:seen, h].double() @ q[i, h].double()) * scale
            m = s.max()
            p = torch.exp(s - m)
            lse[i, h] = m + torch.log(p.sum())
            out[i, h] = (p / p.sum()) @ values[:seen, h].double()
    return out.float(), lse.float()


def _reference(work, pool, config):
    """Expected output and LSE of ``work``, one sequence at a time."""
    spec, layer = work.spec, pool.layer(work.layer_id)
    scale = config.softmax_scale
    outs, lses = [], []
    q_start = kv_start = new_start = 0
    for b, (prefix, extend) in enumerate(spec.seqs):
        pages = work.pages[b]
        slots = torch.tensor(pool.slots(pages, range(prefix)), dtype=torch.int32)
        cached = layer.read_slots(slots) if prefix else torch.zeros(0, pool.row_dim)
        rows = torch.cat([cached, work.new_rows[new_start:new_start + extend]])
        q = work.q[q_start:q_start + extend].float()
        if work.method is ForwardMethod.MLA:
            keys = rows[:, None].expand(-1, q.shape[1], -1)
            values = keys[..., :pool.kv_lora_rank]
        elif work.method is ForwardMethod.MHA:
            keys = work.k[kv_start:kv_start + prefix + extend]
            values = work.v[kv_start:kv_start + prefix + extend]
        else:
            lat = cached.to(work.q.dtype)
            k_p, v_p = work.decompress(lat[:, :pool.kv_lora_rank], lat[:, pool.kv_lora_rank:])
            keys = torch.cat([k_p, work.k[q_start:q_start + extend]])
            values = torch.cat([v_p, work.v[q_start:q_start + extend]])
        o, lse = _attend(q, keys, values, scale)
        outs.append(o)
        lses.append(lse)
        q_start += extend
        new_start += extend
        kv_start += prefix + extend
    return torch.cat(outs), torch.cat(lses)


def _random_spec(rng: random.Random, mode: ForwardMode) -> BatchSpec:
    n = rng.randint(1, 7)
    if mode is ForwardMode.DECODE:
        seqs = tuple((rng.choice([0, 1, rng.randint(2, 70)]), 1) for _ in range(n))
        return BatchSpec("rand_decode", Phase.DECODE, seqs, "random")
    if mode is ForwardMode.TARGET_VERIFY:
        q = rng.randint(2, 4)
        return BatchSpec("rand_verify", Phase.DECODE,
                         tuple((rng.randint(1, 40), q) for _ in range(n)), "random", mode)
    if mode is ForwardMode.DRAFT_EXTEND:
        q = rng.randint(2, 4)
        return BatchSpec("rand_draft", Phase.DECODE,
                         tuple((rng.randint(1, 40), q - i % q) for i in range(n)), "random",
                         mode)
    seqs = tuple((rng.choice([0, rng.randint(1, 50)]), rng.randint(1, 9)) for _ in range(n))
    return BatchSpec("rand_extend", Phase.PREFILL, seqs, "random")


CASES = [
    # (forward mode, method, kv dtype, page size)
    (ForwardMode.DECODE, ForwardMethod.MLA, DType.BF16, 1),
    (ForwardMode.DECODE, ForwardMethod.MLA, DType.FP8_E4M3, 16),
    (ForwardMode.DECODE, ForwardMethod.MLA, DType.FP32, 64),
    (ForwardMode.TARGET_VERIFY, ForwardMethod.MLA, DType.BF16, 16),
    (ForwardMode.DRAFT_EXTEND, ForwardMethod.MLA, DType.FP8_E4M3, 1),
    (ForwardMode.EXTEND, ForwardMethod.MLA, DType.BF16, 64),
    (ForwardMode.EXTEND, ForwardMethod.MLA, DType.FP8_E4M3, 1),
    (ForwardMode.EXTEND, ForwardMethod.MHA, DType.BF16, 16),
    (ForwardMode.EXTEND, ForwardMethod.MHA_CHUNKED_KV, DType.BF16, 16),
]


@pytest.mark.parametrize("mode,method,kv,page", CASES,
                         ids=[f"{m}-{me}-{kv}-p{p}" for m, me, kv, p in CASES])
def test_batched_oracle_equals_the_per_sequence_one(mode, method, kv, page):
    rng = random.Random(f"{mode}{method}{kv}{page}")
    q_dtype = DType.FP32 if kv is DType.FP32 else DType.BF16
    dims = (576, 512) if method is ForwardMethod.MLA else (192, 128)
    for trial in range(2):
        spec = _random_spec(rng, mode)
        combo = Combo(method, spec.phase, q_dtype, kv, page, 3, dims)
        config = make_config(combo, "cpu")
        pool = make_pool(config, [spec])
        work = make_workload(config, pool, spec, method, seed=trial, chunk_tokens=8)
        expected, expected_lse = _reference(work, pool, config)
        torch.testing.assert_close(work.expected, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(work.expected_lse, expected_lse, atol=1e-6, rtol=1e-6)


def test_ragged_attention_groups_pads_and_masks_like_one_sequence_at_a_time():
    """Tiny group budgets (one group per sequence, then several per group), lengths 0,
    causal and not, one key head shared by all query heads or one per head."""
    gen = torch.Generator().manual_seed(0)
    q_lens = [1, 3, 0, 2, 5, 1]
    kv_lens = [1, 7, 4, 2, 9, 0]
    heads, d, dv = 3, 8, 5
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    for shared in (True, False):
        keys = torch.randn(sum(kv_lens), *(() if shared else (heads,)), d, generator=gen)
        values = torch.randn(sum(kv_lens), *(() if shared else (heads,)), dv, generator=gen)
        for causal in (True, False):
            lens = [(e, length) for e, length in zip(q_lens, kv_lens)]
            if causal:  # a causal sequence has at least as many keys as queries
                lens = [(e, max(length, e)) for e, length in lens]
                kv = [length for _, length in lens]
                keys_c = torch.randn(sum(kv), *keys.shape[1:], generator=gen)
                values_c = torch.randn(sum(kv), *values.shape[1:], generator=gen)
            else:
                kv, keys_c, values_c = kv_lens, keys, values
            want_o, want_l = [], []
            qs = ks = 0
            for e, length in zip(q_lens, kv):
                k = keys_c[ks:ks + length]
                v = values_c[ks:ks + length]
                if shared:
                    k, v = k[:, None].expand(-1, heads, -1), v[:, None].expand(-1, heads, -1)
                o, lse = _attend(q[qs:qs + e], k, v, 0.3, causal=causal)
                want_o.append(o)
                want_l.append(lse)
                qs += e
                ks += length
            for budget in (1, 200, 1 << 24):
                out, lse = ragged_attention(q, keys_c, values_c, q_lens, kv, 0.3,
                                            causal=causal, max_elements=budget)
                torch.testing.assert_close(out, torch.cat(want_o), atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(lse, torch.cat(want_l), atol=1e-6, rtol=1e-6)
