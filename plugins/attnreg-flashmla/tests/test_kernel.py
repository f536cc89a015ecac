"""The calls into the library (attnreg_flashmla.kernel), against the CPU stand-in."""

from __future__ import annotations

import sys

import pytest
import torch
from attnreg.registry import BackendUnavailableError

import fake_flash_mla
from attnreg_flashmla import kernel


@pytest.fixture
def lib(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla)
    fake_flash_mla.CALLS.clear()
    return kernel.load_library()


def _paged(seq_lens, heads=16, tokens_per_seq=1, seed=0, num_pages=None):
    """A page-64 bf16 cache with shuffled pages, queries, and per-sequence float rows."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [max(1, -(-n // 64)) for n in seq_lens]
    num_pages = num_pages or 1 + sum(pages_per)
    cache = torch.randn(num_pages, 64, 576, generator=gen).bfloat16()
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    q = torch.randn(len(seq_lens) * tokens_per_seq, heads, 576, generator=gen).bfloat16()
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def _expected(q, cache, table, seq_lens, scale, tokens_per_seq=1, kv_scale=1.0):
    outs = []
    for b, length in enumerate(seq_lens.tolist()):
        rows = q[b * tokens_per_seq:(b + 1) * tokens_per_seq].double()
        if length == 0:
            outs.append(torch.zeros(tokens_per_seq, q.shape[1], 512, dtype=torch.float64))
            continue
        keys = cache[table[b].long()].reshape(-1, 576)[:length].double() * kv_scale
        scores = torch.einsum("shd,ld->shl", rows, keys) * scale
        limit = torch.arange(tokens_per_seq)[:, None] + (length - tokens_per_seq)
        scores = scores.masked_fill((torch.arange(length)[None, :] > limit)[:, None, :],
                                    float("-inf"))
        outs.append(torch.einsum("shl,ld->shd", torch.softmax(scores, -1), keys[:, :512]))
    return torch.cat(outs).float()


def _expected_lse(q, cache, table, seq_lens, scale, tokens_per_seq=1):
    """attnreg's LSE [rows, H]: natural log, -inf for a row that sees no key."""
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        rows = q[b * tokens_per_seq:(b + 1) * tokens_per_seq].double()
        keys = cache[table[b].long()].reshape(-1, 576)[:length].double()
        scores = torch.einsum("shd,ld->shl", rows, keys) * scale
        limit = torch.arange(tokens_per_seq)[:, None] + (length - tokens_per_seq)
        scores = scores.masked_fill((torch.arange(length)[None, :] > limit)[:, None, :],
                                    float("-inf"))
        out.append(torch.logsumexp(scores, -1))
    return torch.cat(out).float()


SCALE = 192 ** -0.5


def test_load_library_without_flash_mla_is_unavailable_with_the_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    with pytest.raises(BackendUnavailableError, match="install sgl-flash-mla"):
        kernel.load_library()


def test_load_library_without_the_legacy_kernels_is_unavailable(lib, monkeypatch):
    monkeypatch.setattr(fake_flash_mla, "has_legacy", lambda: False)
    with pytest.raises(BackendUnavailableError, match="no legacy kernels"):
        kernel.load_library()


@pytest.mark.parametrize("tokens_per_seq", [1, 3])
def test_decode_matches_float64_attention_over_shuffled_pages(lib, tokens_per_seq):
    q, cache, table, lens = _paged([3, 64, 65, 200], tokens_per_seq=tokens_per_seq)
    sched = kernel.schedule(lib, lens, 16, tokens_per_seq=tokens_per_seq)
    out, lse = kernel.decode(lib, q, cache, table, lens, sched, softmax_scale=SCALE,
                             tokens_per_seq=tokens_per_seq)
    # the LSE in the library's layout: [B, H, s_q]
    assert out.shape == (q.shape[0], 16, 512) and lse.shape == (4, 16, tokens_per_seq)
    want = _expected(q, cache, table, lens, SCALE, tokens_per_seq)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    into = torch.empty(q.shape[0], 16)
    kernel.store_lse(lse, into)
    torch.testing.assert_close(into, _expected_lse(q, cache, table, lens, SCALE, tokens_per_seq))
    call = [c for c in fake_flash_mla.CALLS if c[0] == "flash_mla_with_kvcache"][-1][1]
    assert call["q_shape"] == (4, tokens_per_seq, 16, 576)
    assert call["causal"] is (tokens_per_seq > 1)


def test_a_schedule_refreshed_in_place_follows_new_lengths_and_a_frozen_one_does_not(lib):
    q, cache, table, lens = _paged([300, 10, 129, 64], num_pages=40)
    buffers = kernel.schedule(lib, lens, 16)
    other = torch.tensor([5, 250, 64, 190], dtype=torch.int32)
    want = _expected(q, cache, table, other, SCALE)
    frozen, _ = kernel.decode(lib, q, cache, table, other, buffers, softmax_scale=SCALE)
    assert not torch.allclose(frozen.float(), want, atol=2e-2, rtol=2e-2)
    buffers.refresh(kernel.schedule(lib, other, 16))
    fresh, _ = kernel.decode(lib, q, cache, table, other, buffers, softmax_scale=SCALE)
    torch.testing.assert_close(fresh.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens_per_seq", [1, 8])
def test_a_captured_shape_reads_views_shaped_like_its_own_schedule(lib, tokens_per_seq):
    big = kernel.schedule(lib, torch.full((8,), 64, dtype=torch.int32), 128)
    q, cache, table, lens = _paged([70, 11], heads=128, tokens_per_seq=tokens_per_seq)
    fresh = kernel.schedule(lib, lens, 128, tokens_per_seq=tokens_per_seq)
    view = big.view_like(fresh)
    # 128 heads: 66 partitions for one token per sequence, 132 // 16 = 8 for 8 tokens
    assert tuple(view.tile_scheduler_metadata.shape) == ((66, 8) if tokens_per_seq == 1
                                                         else (8, 8))
    assert view.num_splits.shape == (3,)
    assert view.num_splits.data_ptr() == big.num_splits.data_ptr()
    assert view.tile_scheduler_metadata.data_ptr() == big.tile_scheduler_metadata.data_ptr()
    view.refresh(fresh)
    out, _ = kernel.decode(lib, q, cache, table, lens, view, softmax_scale=SCALE,
                           tokens_per_seq=tokens_per_seq)
    torch.testing.assert_close(out.float(),
                               _expected(q, cache, table, lens, SCALE, tokens_per_seq),
                               atol=2e-2, rtol=2e-2)


def test_a_schedule_that_does_not_fit_the_buffers_is_refused(lib):
    small = kernel.schedule(lib, torch.full((2,), 64, dtype=torch.int32), 128)  # 66 parts
    with pytest.raises(ValueError, match="does not fit"):
        small.view_like(kernel.schedule(lib, torch.full((2,), 64, dtype=torch.int32), 16))
    with pytest.raises(ValueError, match="does not fit"):
        small.view_like(kernel.schedule(lib, torch.full((4,), 64, dtype=torch.int32), 128))


def test_empty_sequences_give_zero_rows_and_an_lse_of_minus_infinity(lib):
    q, cache, table, lens = _paged([100, 0, 7])
    out, lse = kernel.decode(lib, q, cache, table, lens, kernel.schedule(lib, lens, 16),
                             softmax_scale=SCALE)
    assert torch.count_nonzero(out[1]) == 0
    assert (lse[1] == float("inf")).all()  # the library's convention (measured on the H200)
    into = torch.zeros(3, 16)
    kernel.store_lse(lse, into)
    assert (into[1] == float("-inf")).all()  # attnreg's
    assert torch.isfinite(into[[0, 2]]).all()


def test_store_lse_keeps_nan_and_minus_infinity():
    lse = torch.tensor([[[float("nan")], [float("-inf")], [float("inf")], [1.5]]])
    into = torch.empty(1, 4)
    kernel.store_lse(lse, into)
    assert torch.isnan(into[0, 0]) and into[0, 1] == float("-inf")
    assert into[0, 2] == float("-inf") and into[0, 3] == 1.5


def test_quantize_q_rounds_once_with_a_power_of_two_scale():
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(6, 16, 576, generator=gen) * 3).bfloat16()
    q[4] = float("inf")  # a stale padded row: left out of the scale
    live = torch.tensor([True, True, True, True, False, True])
    q8, descale = kernel.quantize_q(q, live)
    assert q8.dtype == torch.float8_e4m3fn and descale.shape == (1,)
    amax = q[live].abs().float().amax()
    d = float(descale)
    assert d == 2.0 ** round(torch.log2(descale).item())       # a power of two
    assert amax / d <= kernel.FP8_MAX < 2 * amax / d           # the smallest one that fits
    # one rounding: what float32 division then one cast to fp8 gives, bit for bit
    direct = (q[live].float() / d).to(torch.float8_e4m3fn)
    assert torch.equal(q8[live].view(torch.uint8), direct.view(torch.uint8))


def test_quantize_q_keeps_an_exact_power_of_two_ratio():
    q = torch.full((1, 1, 576), 448.0 * 4).bfloat16()
    _, descale = kernel.quantize_q(q, torch.tensor([True]))
    assert float(descale) == 4.0


def test_fp8_decode_reads_one_pool_scale_and_fp8_queries(lib):
    q, cache, table, lens = _paged([90, 5, 64])
    kv_scale = 0.5
    cache8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
    live = lens > 0
    q8, q_descale = kernel.quantize_q(q, live)
    sched = kernel.schedule(lib, lens, 16, fp8=True)
    out, _ = kernel.decode(lib, q8, cache8, table, lens, sched, softmax_scale=SCALE,
                           q_descale=q_descale,
                           kv_descale=torch.tensor([kv_scale], dtype=torch.float32))
    assert out.dtype == torch.bfloat16
    q_rounded = q8.float() * q_descale
    want = _expected(q_rounded, cache8.float(), table, lens, SCALE, kv_scale=kv_scale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert ("get_mla_decoding_metadata", {"n": 16, "fp8": True, "legacy": True, "batch": 3}) \
        in fake_flash_mla.CALLS


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 40.0, 3e3])
def test_quantize_q_is_the_rounding_the_conformance_oracle_applies(magnitude):
    """The declaration says q_compute_dtype fp8: the suite's oracle must see the same q."""
    from attnreg.registry import DType
    from attnreg.testing.workload import round_q

    q = (torch.randn(9, 32, 576, generator=torch.Generator().manual_seed(5)) * magnitude
         ).bfloat16()
    q8, descale = kernel.quantize_q(q, torch.ones(9, dtype=torch.bool))
    assert torch.equal(q8.float() * descale, round_q(q, DType.FP8_E4M3))
