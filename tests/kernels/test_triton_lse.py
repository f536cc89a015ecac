"""The Triton kernels' log-sum-exp outputs (CPU: the Triton interpreter).

Every kernel path that writes an output can also write the natural-log LSE of
its (query row, head): one pass and split-KV with its merge, for decode,
absorbed extend (which also runs verify batches) and ragged MHA, causal or not.
Compared with ``attention_with_lse`` of the reference backend (float32).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnreg.backends._triton_kernels import (  # noqa: E402
    mha_prefill,
    mla_decode,
    mla_extend,
)
from attnreg.backends.reference import attention_with_lse  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 1 / math.sqrt(192)


def paged(lens, page_size, seed=0):
    """A shuffled bf16 paged cache holding ``lens[b]`` tokens, its page table, and the
    float32 rows of each sequence."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // page_size)) for n in lens]
    pages = sum(need) + 1
    perm = torch.randperm(pages, generator=g)
    cache = torch.zeros(pages, page_size, 576, dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    rows, k = [], 0
    for b, n in enumerate(lens):
        vals = torch.randn(n, 576, generator=g).bfloat16()
        for j in range(need[b]):
            p = int(perm[k])
            k += 1
            table[b, j] = p
            chunk = vals[j * page_size:(j + 1) * page_size]
            cache[p, :chunk.shape[0]] = chunk
        rows.append(vals.float())
    return cache.to(DEV), table.to(DEV), rows


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def expected_mla(q, rows, prefix, extend):
    """float32 (out, lse) of absorbed MLA, sequence by sequence (bottom-right causal)."""
    outs, lses, start = [], [], 0
    for kv, p, e in zip(rows, prefix, extend):
        keys = kv[:p + e, None, :]
        o, lse = attention_with_lse(q[start:start + e].float().cpu(), keys, keys[..., :512],
                                    SCALE)
        outs.append(o)
        lses.append(lse)
        start += e
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_lse_one_pass_and_split(splits):
    lens = [0, 17, 70]
    cache, table, rows = paged(lens, 16)
    q = torch.randn(3, 2, 576, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    out = torch.full((3, 2, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((3, 2), float("nan"), device=DEV)
    mla_decode(q, cache, table, i32(lens), out, sm_scale=SCALE, max_splits=splits,
               force_num_splits=splits, lse=lse)
    # decode: the one new token of each non-empty sequence sees the whole sequence
    want_out, want_lse = expected_mla(q[1:], rows[1:], [n - 1 for n in lens[1:]], [1, 1])
    # sequence 0 is empty: zero output, -inf LSE
    assert torch.equal(out[0].float().cpu(), torch.zeros(2, 512))
    assert lse[0].cpu().tolist() == [float("-inf")] * 2
    assert torch.allclose(lse[1:].cpu(), want_lse, atol=1e-4, rtol=1e-5)
    assert torch.allclose(out[1:].float().cpu(), want_out, atol=2e-2)


@pytest.mark.parametrize("splits", [1, 4])
def test_extend_lse_with_prefix_one_pass_and_split(splits):
    prefix, extend = [5, 40, 0], [3, 2, 4]     # verify-shaped rows and a fresh prompt
    lens = [p + e for p, e in zip(prefix, extend)]
    cache, table, rows = paged(lens, 16, seed=2)
    t = sum(extend)
    q = torch.randn(t, 2, 576, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
    out = torch.empty(t, 2, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((t, 2), float("nan"), device=DEV)
    mla_extend(q, cache, table, i32(lens), i32(prefix), i32([0, 3, 5, 9]), out,
               sm_scale=SCALE, max_extend_len=4, num_splits=splits,
               min_chunk=1 if splits > 1 else None, lse=lse)
    want_out, want_lse = expected_mla(q, rows, prefix, extend)
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=1e-5)
    assert torch.allclose(out.float().cpu(), want_out, atol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_mha_prefill_lse_causal_and_unmasked(causal):
    g = torch.Generator().manual_seed(4)
    q_lens, kv_lens = [3, 4, 2], [3, 9, 0]      # the last sequence sees no key
    q = torch.randn(sum(q_lens), 2, 192, generator=g).bfloat16().to(DEV)
    k = torch.randn(sum(kv_lens), 2, 192, generator=g).bfloat16().to(DEV)
    v = torch.randn(sum(kv_lens), 2, 128, generator=g).bfloat16().to(DEV)
    out = torch.empty(sum(q_lens), 2, 128, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((sum(q_lens), 2), float("nan"), device=DEV)
    mha_prefill(q, k, v, i32([0, 3, 7, 9]), i32([0, 3, 12, 12]), out, sm_scale=SCALE,
                causal=causal, lse=lse)
    qs = ks = 0
    for n, m in zip(q_lens, kv_lens):
        o, want = attention_with_lse(q[qs:qs + n].cpu(), k[ks:ks + m].cpu(),
                                     v[ks:ks + m].cpu(), SCALE, causal=causal)
        got = lse[qs:qs + n].cpu()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-5)
        assert torch.allclose(out[qs:qs + n].float().cpu(), o, atol=2e-2)
        qs += n
        ks += m


def test_lse_buffers_are_checked_before_launch():
    cache, table, _ = paged([4], 16)
    q = torch.zeros(1, 2, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(1, 2, 512, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="lse: expected shape"):
        mla_decode(q, cache, table, i32([4]), out, sm_scale=SCALE, max_splits=1,
                   lse=torch.empty(2, 2, device=DEV))
    with pytest.raises(ValueError, match="lse: expected dtype"):
        mla_extend(q, cache, table, i32([4]), i32([3]), i32([0, 1]), out, sm_scale=SCALE,
                   max_extend_len=1, lse=torch.empty(1, 2, dtype=torch.bfloat16, device=DEV))
