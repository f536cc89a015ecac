"""The library calls on an sm90 GPU with the real ``flash_mla`` (marker ``gpu``).

These pin the device facts the declaration and the runtime rest on, one test
per fact, so a new sgl-flash-mla release that changes one fails here first.
"""

from __future__ import annotations

import pytest
import torch
from attnreg.registry import DType
from attnreg.testing.workload import TOLERANCES

from attnreg_flashmla import kernel
from attnreg_flashmla.declaration import (
    FP8_HEAD_COUNTS,
    HEAD_COUNTS,
    MAX_VERIFY_TOKENS,
    decode_call_bytes,
    num_sm_parts,
)

pytestmark = pytest.mark.gpu

SCALE = 192 ** -0.5
DEV = "cuda"


@pytest.fixture(scope="module")
def lib():
    return kernel.load_library()


def _paged(seq_lens, heads, tokens_per_seq=1, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages_per = [max(1, -(-n // 64)) for n in seq_lens]
    num_pages = 1 + sum(pages_per)
    cache = torch.randn(num_pages, 64, 576, generator=gen, device=DEV).bfloat16()
    order = torch.randperm(num_pages - 1, generator=gen, device=DEV) + 1
    table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32, device=DEV)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    q = torch.randn(len(seq_lens) * tokens_per_seq, heads, 576, generator=gen,
                    device=DEV).bfloat16()
    return q, cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def _expected(q, cache, table, seq_lens, tokens_per_seq=1, kv_scale=1.0):
    outs = []
    for b, length in enumerate(seq_lens.tolist()):
        rows = q[b * tokens_per_seq:(b + 1) * tokens_per_seq].double()
        if length == 0:
            outs.append(torch.zeros(tokens_per_seq, q.shape[1], 512, dtype=torch.float64,
                                    device=DEV))
            continue
        keys = cache[table[b].long()].reshape(-1, 576)[:length].double() * kv_scale
        scores = torch.einsum("shd,ld->shl", rows, keys) * SCALE
        limit = torch.arange(tokens_per_seq, device=DEV)[:, None] + (length - tokens_per_seq)
        scores = scores.masked_fill(
            (torch.arange(length, device=DEV)[None, :] > limit)[:, None, :], float("-inf"))
        outs.append(torch.einsum("shl,ld->shd", torch.softmax(scores, -1), keys[:, :512]))
    return torch.cat(outs).float()


def _expected_lse(q, cache, table, seq_lens, tokens_per_seq=1, kv_scale=1.0):
    """attnreg's LSE [rows, H]: natural log over the visible keys, -inf with none."""
    lses = []
    for b, length in enumerate(seq_lens.tolist()):
        rows = q[b * tokens_per_seq:(b + 1) * tokens_per_seq].double()
        keys = cache[table[b].long()].reshape(-1, 576)[:length].double() * kv_scale
        scores = torch.einsum("shd,ld->shl", rows, keys) * SCALE
        limit = torch.arange(tokens_per_seq, device=DEV)[:, None] + (length - tokens_per_seq)
        scores = scores.masked_fill(
            (torch.arange(length, device=DEV)[None, :] > limit)[:, None, :], float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
    return torch.cat(lses).float()


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _rel(out, want):
    return float((out.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_bf16_decode_at_every_declared_head_count(lib, heads):
    q, cache, table, lens = _paged([700, 1, 64, 65], heads)
    sched = kernel.schedule(lib, lens, heads)
    assert tuple(sched.tile_scheduler_metadata.shape) == (num_sm_parts(
        heads, num_sms=torch.cuda.get_device_properties(0).multi_processor_count), 8)
    out, lse = kernel.decode(lib, q, cache, table, lens, sched, softmax_scale=SCALE)
    assert _rel(out, _expected(q, cache, table, lens)) < 1e-2


def test_zero_length_sequences_give_zero_rows(lib):
    q, cache, table, lens = _paged([300, 0, 5, 0], 16)
    out, _ = kernel.decode(lib, q, cache, table, lens, kernel.schedule(lib, lens, 16),
                           softmax_scale=SCALE)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[3]) == 0


def test_schedule_refreshed_before_replay_is_correct_at_other_lengths(lib):
    from attnreg.runtime import GraphRunner

    heads = 16
    q, cache, table, lens = _paged([4096, 100, 2000, 64], heads)
    buffers = kernel.schedule(lib, lens, heads)
    static_lens = lens.clone()
    holder = {}

    def step():
        holder["out"], _ = kernel.decode(lib, q, cache, table, static_lens, buffers,
                                         softmax_scale=SCALE)

    graph = GraphRunner(DEV).capture(step)
    for new in ([1, 4096, 33, 1000], [4000, 4000, 4000, 4000], [7, 7, 7, 7]):
        static_lens.copy_(torch.tensor(new, dtype=torch.int32, device=DEV))
        buffers.refresh(kernel.schedule(lib, static_lens, heads))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(holder["out"], _expected(q, cache, table, static_lens)) < 1e-2, new


def test_one_call_allocates_what_the_declaration_counts(lib):
    heads, bs = 128, 32
    q, cache, table, lens = _paged([512] * bs, heads)
    sched = kernel.schedule(lib, lens, heads)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = kernel.decode(lib, q, cache, table, lens, sched, softmax_scale=SCALE)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    declared = sum(decode_call_bytes(bs, heads, num_sms=sms).values())
    assert 0.8 * declared <= peak <= 1.25 * declared, (peak, declared)


def test_quantize_q_on_the_device_matches_the_cpu_rounding_bit_for_bit():
    q = (torch.randn(64, 128, 576, device=DEV) * 2.5).bfloat16()
    live = torch.ones(64, dtype=torch.bool, device=DEV)
    live[60:] = False
    q8, descale = kernel.quantize_q(q, live)
    q8_cpu, descale_cpu = kernel.quantize_q(q.cpu(), live.cpu())
    assert float(descale) == float(descale_cpu)
    assert torch.equal(q8.cpu().view(torch.uint8), q8_cpu.view(torch.uint8))


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_fp8_decode_error_is_the_kernels_own_once_q_is_rounded(lib, heads):
    kv_scale = 0.05
    q, cache, table, lens = _paged([777, 64, 1, 300], heads, seed=heads)
    cache8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
    q8, q_descale = kernel.quantize_q(q, lens > 0)
    sched = kernel.schedule(lib, lens, heads, fp8=True)
    out, _ = kernel.decode(lib, q8, cache8, table, lens, sched, softmax_scale=SCALE,
                           q_descale=q_descale,
                           kv_descale=torch.tensor([kv_scale], device=DEV))
    assert out.dtype == torch.bfloat16
    want = _expected(q8.float() * q_descale, cache8.float(), table, lens, kv_scale=kv_scale)
    # the conformance suite's tolerance for a kernel computing in fp8
    tol = TOLERANCES[DType.FP8_E4M3]
    err = (out.float() - want).abs() - tol.rtol * want.abs()
    assert float(err.max()) <= tol.atol, float(err.max())


def test_fp8_zero_length_sequences_give_zero_rows(lib):
    q, cache, table, lens = _paged([300, 0, 5], 16)
    cache8 = cache.to(torch.float8_e4m3fn)
    q8, q_descale = kernel.quantize_q(q, lens > 0)
    out, _ = kernel.decode(lib, q8, cache8, table, lens,
                           kernel.schedule(lib, lens, 16, fp8=True), softmax_scale=SCALE,
                           q_descale=q_descale, kv_descale=torch.ones(1, device=DEV))
    assert torch.isfinite(out.float()).all()
    assert torch.count_nonzero(out[1]) == 0


# -- log-sum-exp ------------------------------------------------------------------------

@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_bf16_lse_is_the_natural_log_sum_exp(lib, heads):
    q, cache, table, lens = _paged([700, 1, 64, 65, 4097], heads, seed=heads)
    out, lse = kernel.decode(lib, q, cache, table, lens, kernel.schedule(lib, lens, heads),
                             softmax_scale=SCALE)
    assert lse.shape == (5, heads, 1) and lse.dtype == torch.float32
    into = torch.empty(5, heads, device=DEV)
    kernel.store_lse(lse, into)
    torch.testing.assert_close(into, _expected_lse(q, cache, table, lens), atol=1e-4, rtol=1e-5)


def test_zero_length_sequences_get_an_lse_of_minus_infinity_in_attnregs_convention(lib):
    q, cache, table, lens = _paged([300, 0, 5, 0], 16)
    _, lse = kernel.decode(lib, q, cache, table, lens, kernel.schedule(lib, lens, 16),
                           softmax_scale=SCALE)
    assert (lse[1] == float("inf")).all()  # the library's convention
    into = torch.empty(4, 16, device=DEV)
    kernel.store_lse(lse, into)
    assert (into[[1, 3]] == float("-inf")).all() and torch.isfinite(into[[0, 2]]).all()


def test_fp8_kernel_lse_against_the_oracle(lib):
    """Not declared (lse=False on the fp8 kernel): this is the measurement that would allow it.

    Passing on the H200 means the fp8 kernel's LSE, with q rounded as declared and the
    pool's scale applied, is attnreg's LSE to the suite's tolerance.
    """
    kv_scale = 0.05
    q, cache, table, lens = _paged([777, 64, 1, 300], 16, seed=3)
    cache8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
    q8, q_descale = kernel.quantize_q(q, lens > 0)
    _, lse = kernel.decode(lib, q8, cache8, table, lens, kernel.schedule(lib, lens, 16, fp8=True),
                           softmax_scale=SCALE, q_descale=q_descale,
                           kv_descale=torch.tensor([kv_scale], device=DEV))
    into = torch.empty(4, 16, device=DEV)
    kernel.store_lse(lse, into)
    want = _expected_lse(q8.float() * q_descale, cache8.float(), table, lens, kv_scale=kv_scale)
    torch.testing.assert_close(into, want, atol=2e-3, rtol=2e-4)  # the suite's LSE tolerance


# -- several query tokens per sequence (target verify) ----------------------------------

@pytest.mark.parametrize("tokens", range(1, MAX_VERIFY_TOKENS + 1))
@pytest.mark.parametrize("heads", [16, 128])
def test_verify_is_causal_among_the_new_tokens_at_every_declared_count(lib, heads, tokens):
    # prefixes 0, 63, 700, 4000: a sequence of exactly `tokens` keys, page edges, splits
    lens = [t + tokens for t in (0, 63, 700, 4000)]
    q, cache, table, seq_lens = _paged(lens, heads, tokens_per_seq=tokens, seed=tokens)
    sched = kernel.schedule(lib, seq_lens, heads, tokens_per_seq=tokens)
    # the scheduler plans s_q * H query rows: fewer partitions than one token per sequence
    assert tuple(sched.tile_scheduler_metadata.shape) == (
        num_sm_parts(heads, tokens, num_sms=_sms()), 8)
    out, lse = kernel.decode(lib, q, cache, table, seq_lens, sched, softmax_scale=SCALE,
                             tokens_per_seq=tokens)
    assert _rel(out, _expected(q, cache, table, seq_lens, tokens)) < 1e-2
    assert lse.shape == (4, heads, tokens)
    into = torch.empty(4 * tokens, heads, device=DEV)
    kernel.store_lse(lse, into)
    torch.testing.assert_close(into, _expected_lse(q, cache, table, seq_lens, tokens),
                               atol=1e-4, rtol=1e-5)


def test_a_zero_length_sequence_in_a_verify_batch_leaves_the_others_correct(lib):
    """A padded sequence of a replayed verify graph has length 0 with s_q query tokens."""
    tokens = 4
    q, cache, table, lens = _paged([300, 0, 40, 0], 16, tokens_per_seq=tokens)
    out, _ = kernel.decode(lib, q, cache, table, lens,
                           kernel.schedule(lib, lens, 16, tokens_per_seq=tokens),
                           softmax_scale=SCALE, tokens_per_seq=tokens)
    torch.cuda.synchronize()
    for b in (0, 2):
        rows = slice(b * tokens, (b + 1) * tokens)
        sub = torch.tensor([int(lens[b])], dtype=torch.int32, device=DEV)
        want = _expected(q[rows], cache, table[b:b + 1], sub, tokens)
        assert _rel(out[rows], want) < 1e-2


@pytest.mark.parametrize("heads", FP8_HEAD_COUNTS)
def test_fp8_verify_error_is_the_kernels_own_once_q_is_rounded(lib, heads):
    kv_scale, tokens = 0.05, 4
    q, cache, table, lens = _paged([777, 64 + tokens, tokens, 300], heads,
                                   tokens_per_seq=tokens, seed=heads)
    cache8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
    q8, q_descale = kernel.quantize_q(q.view(4, -1, 576), lens > 0)
    q8 = q8.view(q.shape)
    sched = kernel.schedule(lib, lens, heads, tokens_per_seq=tokens, fp8=True)
    out, _ = kernel.decode(lib, q8, cache8, table, lens, sched, softmax_scale=SCALE,
                           tokens_per_seq=tokens, q_descale=q_descale,
                           kv_descale=torch.tensor([kv_scale], device=DEV))
    want = _expected(q8.float() * q_descale, cache8.float(), table, lens, tokens,
                     kv_scale=kv_scale)
    # the conformance suite's tolerance for a kernel computing in fp8
    tol = TOLERANCES[DType.FP8_E4M3]
    err = (out.float() - want).abs() - tol.rtol * want.abs()
    assert float(err.max()) <= tol.atol, float(err.max())


def test_a_verify_schedule_refreshed_before_replay_is_correct_at_other_lengths(lib):
    from attnreg.runtime import GraphRunner

    heads, tokens = 16, 4
    q, cache, table, lens = _paged([4096, 100, 2000, 64], heads, tokens_per_seq=tokens)
    buffers = kernel.schedule(lib, lens, heads, tokens_per_seq=tokens)
    static_lens = lens.clone()
    holder = {}

    def step():
        holder["out"], _ = kernel.decode(lib, q, cache, table, static_lens, buffers,
                                         softmax_scale=SCALE, tokens_per_seq=tokens)

    graph = GraphRunner(DEV).capture(step)
    for new in ([5, 4096, 33, 1000], [4000, 4000, 4000, 4000], [7, 7, 7, 7]):
        static_lens.copy_(torch.tensor(new, dtype=torch.int32, device=DEV))
        buffers.refresh(kernel.schedule(lib, static_lens, heads, tokens_per_seq=tokens))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(holder["out"], _expected(q, cache, table, static_lens, tokens)) < 1e-2, new


def test_one_verify_call_allocates_what_the_declaration_counts(lib):
    heads, bs, tokens = 128, 32, 4
    q, cache, table, lens = _paged([512] * bs, heads, tokens_per_seq=tokens)
    sched = kernel.schedule(lib, lens, heads, tokens_per_seq=tokens)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = kernel.decode(lib, q, cache, table, lens, sched, softmax_scale=SCALE,
                             tokens_per_seq=tokens)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    declared = sum(decode_call_bytes(bs, heads, tokens, num_sms=_sms()).values())
    assert 0.8 * declared <= peak <= 1.25 * declared, (peak, declared)
