"""The runtime (FlashMLABackend) on the CPU, against the stand-in library.

What is checked here is the plumbing the device cannot tell us about cheaply:
refusals before any library call, the schedule recomputed for every replay,
padded rows, the fp8 query rounding, the buffers' sizes.  The numbers the
kernel produces on an H200 are checked by the GPU tests and the conformance
suite.
"""

from __future__ import annotations

import sys

import pytest
import torch
from attnreg.registry import (
    BackendUnavailableError,
    DeclarationContext,
    GraphMode,
    Platform,
    UnsupportedError,
)
from attnreg.runtime import GraphRunner, MLAConfig, decode_batch, extend_batch

import fake_flash_mla
from attnreg_flashmla import kernel
from attnreg_flashmla.declaration import capabilities, scheduler_bytes
from attnreg_flashmla.runtime import FlashMLABackend

SM90 = capabilities(DeclarationContext(Platform.parse("cuda:sm90")))
SCALE = 192 ** -0.5  # MLAConfig's default softmax scale (DeepSeek: 1 / sqrt(128 + 64))


@pytest.fixture(autouse=True)
def fake_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla)
    fake_flash_mla.CALLS.clear()
    return fake_flash_mla


def _backend(**config) -> FlashMLABackend:
    cfg = MLAConfig(**{"num_heads": 16, "page_size": 64, "device": "cpu", **config})
    return FlashMLABackend(cfg, capabilities=SM90)


def _pool(backend, num_pages=40, seed=0, scale=1.0):
    pool = backend.config.make_pool(num_pages, scale=scale)
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(pool.buffer.shape, generator=gen)
    pool.write(torch.arange(pool.buffer.shape[0] * pool.page_size, dtype=torch.int32),
               rows.view(-1, pool.row_dim)[:, :512], rows.view(-1, pool.row_dim)[:, 512:])
    return pool


def _oracle(q, pool, batch, q_rounded=None):
    """float64 attention over the pool as it stores the rows (dequantised)."""
    qf = (q_rounded if q_rounded is not None else q).double()
    table = batch.page_table.long()
    outs = []
    for b, length in enumerate(batch.seq_lens_cpu):
        pos = torch.arange(length)
        rows = pool.read_slots((table[b, pos // pool.page_size] * pool.page_size
                                + pos % pool.page_size)).double()
        scores = torch.einsum("hd,ld->hl", qf[b], rows) * SCALE
        outs.append(torch.einsum("hl,ld->hd", torch.softmax(scores, -1), rows[:, :512]))
    return torch.stack(outs).float()


def _queries(n, heads=16, seed=1):
    return torch.randn(n, heads, 576, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _library_calls():
    return [name for name, _ in fake_flash_mla.CALLS]


# -- refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize("config,needle", [
    ({"page_size": 16}, "page size 16 not in [64]"),
    ({"page_size": 1}, "page size 1 not in [64]"),
    ({"num_heads": 24}, "24 heads not in [1, 2, 4, 8, 16, 32, 64, 128]"),
    ({"num_heads": 256}, "256 heads not in"),
    ({"q_dtype": "fp16", "kv_dtype": "fp16"}, "q dtype fp16 not in ['bf16']"),
])
def test_undeclared_configurations_are_refused_before_the_library_is_touched(config, needle):
    with pytest.raises(UnsupportedError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _backend(**config)
    assert _library_calls() == []


def test_a_pool_of_another_page_size_is_refused_before_a_launch():
    be = _backend()
    other = MLAConfig(num_heads=16, page_size=16).make_pool(8)
    batch = decode_batch(other, [3, 20])
    with pytest.raises(UnsupportedError, match="page size 16 not in"):
        be.forward_decode(_queries(2), None, None, other, batch)
    assert "flash_mla_with_kvcache" not in _library_calls()


def test_extend_batches_are_refused_with_the_reason():
    be = _backend()
    pool = _pool(be)
    batch = extend_batch(pool, [0], [5])
    with pytest.raises(UnsupportedError, match="decode"):
        be.forward_extend(_queries(5), None, None, pool, batch)
    assert "flash_mla_with_kvcache" not in _library_calls()


def test_without_the_library_construction_is_unavailable_with_the_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    with pytest.raises(BackendUnavailableError, match="install sgl-flash-mla"):
        _backend()


# -- eager ------------------------------------------------------------------------------

def test_eager_decode_matches_the_oracle_over_shuffled_pages():
    be = _backend()
    pool = _pool(be)
    batch = decode_batch(pool, [1, 37, 64, 65, 300], shuffle=3)
    q = _queries(5)
    out = be.forward_decode(q, None, None, pool, batch)
    torch.testing.assert_close(out.float(), _oracle(q, pool, batch), atol=2e-2, rtol=2e-2)
    assert ("get_mla_decoding_metadata", {"n": 16, "fp8": False, "legacy": True, "batch": 5}) \
        in fake_flash_mla.CALLS


def test_new_tokens_are_written_before_attention():
    be = _backend()
    pool = _pool(be)
    batch = decode_batch(pool, [10, 70], shuffle=1)
    q = _queries(2)
    latent, rope = torch.randn(2, 512).bfloat16(), torch.randn(2, 64).bfloat16()
    out = be.forward_decode(q, latent, rope, pool, batch)
    got = pool.read_slots(batch.out_cache_loc.long())
    torch.testing.assert_close(got[:, :512], latent.float())
    torch.testing.assert_close(out.float(), _oracle(q, pool, batch), atol=2e-2, rtol=2e-2)


# -- graphs -----------------------------------------------------------------------------

def _captured(be, pool, bs, heads=16):
    """A decode step captured at ``bs`` through attnreg's GraphRunner (cpu: re-run at replay)."""
    be.init_cuda_graph_state(bs, bs, max_seq_len=2048)
    q = torch.zeros(bs, heads, 576, dtype=torch.bfloat16)
    out = torch.zeros(bs, heads, 512, dtype=torch.bfloat16)
    be.init_forward_metadata_capture(bs, bs)
    runner = GraphRunner("cpu")
    graph = runner.capture(lambda: be.forward_decode(q, None, None, pool, None, out=out),
                           GraphMode.FULL)
    return q, out, graph


def test_replays_follow_new_lengths_because_the_schedule_is_replanned_each_time():
    be = _backend()
    pool = _pool(be, num_pages=60)
    q, out, graph = _captured(be, pool, 4)
    for lens in ([300, 2, 65, 129], [1, 1, 1, 1], [700, 64, 500, 3]):
        batch = decode_batch(pool, lens, shuffle=len(lens) + lens[0])
        queries = _queries(4, seed=lens[0])
        be.init_forward_metadata_replay(4, 4, batch)
        q.copy_(queries)
        graph.replay()
        torch.testing.assert_close(out.float(), _oracle(queries, pool, batch),
                                   atol=2e-2, rtol=2e-2)
        pool.free([p for row in batch.page_table.tolist() for p in set(row) if p])


def test_a_replay_without_replanning_would_be_wrong(monkeypatch):
    """The stand-in depends on the schedule as the device does: freezing it is caught."""
    be = _backend()
    pool = _pool(be, num_pages=60)
    q, out, graph = _captured(be, pool, 4)
    monkeypatch.setattr(FlashMLABackend, "_init_replay_impl", lambda self, md, batch: None)
    batch = decode_batch(pool, [700, 64, 500, 3], shuffle=5)
    queries = _queries(4, seed=9)
    be.init_forward_metadata_replay(4, 4, batch)
    q.copy_(queries)
    graph.replay()
    assert not torch.allclose(out.float(), _oracle(queries, pool, batch), atol=2e-2, rtol=2e-2)


def test_padded_rows_of_a_smaller_batch_are_zero():
    be = _backend()
    pool = _pool(be, num_pages=60)
    q, out, graph = _captured(be, pool, 8)
    batch = decode_batch(pool, [200, 5, 77], shuffle=2)
    queries = _queries(3, seed=4)
    be.init_forward_metadata_replay(8, 8, batch)
    q[:3].copy_(queries)
    q[3:].fill_(3.0)  # stale rows left by an earlier, larger batch
    graph.replay()
    torch.testing.assert_close(out[:3].float(), _oracle(queries, pool, batch),
                               atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[3:]) == 0


def test_graph_buffers_are_the_declared_scheduler_buffers():
    be = _backend(num_heads=128)
    be.init_cuda_graph_state(32, 32, max_seq_len=4096)
    # 128 heads on 132 SMs: 66 partitions; 33 split counts for 32 slots
    assert be.graph_buffer_bytes() == 66 * 8 * 4 + 33 * 4
    declared = scheduler_bytes(32, 128)  # the same buffers, in allocator granules
    assert 0 <= sum(declared.values()) - be.graph_buffer_bytes() < 2 * 512
    meta = be.graph_state.buffers.schedule.tile_scheduler_metadata
    assert tuple(meta.shape) == (66, 8) and meta.dtype == torch.int32


# -- fp8 --------------------------------------------------------------------------------

def test_fp8_pool_decode_rounds_q_once_per_tensor_and_reads_the_pool_scale():
    be = _backend(kv_dtype="fp8_e4m3")
    pool = _pool(be, scale=0.5)
    batch = decode_batch(pool, [1, 90, 64, 130], shuffle=6)
    q = _queries(4, seed=8)
    out = be.forward_decode(q, None, None, pool, batch)
    q8, descale = kernel.quantize_q(q, torch.ones(4, dtype=torch.bool))
    want = _oracle(q, pool, batch, q_rounded=q8.float() * descale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert ("get_mla_decoding_metadata", {"n": 16, "fp8": True, "legacy": True, "batch": 4}) \
        in fake_flash_mla.CALLS


def test_fp8_padded_rows_neither_set_the_q_scale_nor_leave_output():
    be = _backend(kv_dtype="fp8_e4m3")
    pool = _pool(be, num_pages=60, scale=0.5)
    q, out, graph = _captured(be, pool, 6)
    batch = decode_batch(pool, [40, 300], shuffle=7)
    queries = _queries(2, seed=3)
    be.init_forward_metadata_replay(6, 6, batch)
    q[:2].copy_(queries)
    q[2:].fill_(1e4)  # stale padded rows: would dominate a scale taken over every row
    graph.replay()
    q8, descale = kernel.quantize_q(queries, torch.ones(2, dtype=torch.bool))
    want = _oracle(queries, pool, batch, q_rounded=q8.float() * descale)
    torch.testing.assert_close(out[:2].float(), want, atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[2:]) == 0
