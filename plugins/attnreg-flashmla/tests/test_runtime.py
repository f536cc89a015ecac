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
    ForwardMode,
    GraphMode,
    Platform,
    UnsupportedError,
)
from attnreg.runtime import (
    GraphRunner,
    MLAConfig,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    verify_batch,
)

import fake_flash_mla
from attnreg_flashmla import kernel
from attnreg_flashmla.declaration import MAX_VERIFY_TOKENS, capabilities, scheduler_bytes
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


def _pool(backend, num_pages=40, seed=0, scale=1.0, num_layers=1):
    """A pool whose every layer holds its own random rows (``scale``: one per layer or all)."""
    pool = backend.config.make_pool(num_pages, scale=scale, num_layers=num_layers)
    slots = torch.arange(pool.num_slots, dtype=torch.int32)
    for layer in range(num_layers):
        gen = torch.Generator().manual_seed(seed + 100 * layer)
        rows = torch.randn(pool.num_slots, pool.row_dim, generator=gen)
        pool.write(slots, rows[:, :512], rows[:, 512:], layer_id=layer)
    return pool


def _oracle_with_lse(q, pool, batch, q_rounded=None, layer_id=0):
    """float64 attention over one layer as it stores the rows (dequantised): ``(out, lse)``.

    New tokens of a sequence are causal among themselves over the whole prefix (decode:
    one token seeing everything); the LSE is attnreg's, natural log.
    """
    qf = (q_rounded if q_rounded is not None else q).double()
    table = batch.page_table.long()
    outs, lses = [], []
    row = 0
    for b, (length, new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
        pos = torch.arange(length)
        rows = pool.read_slots((table[b, pos // pool.page_size] * pool.page_size
                                + pos % pool.page_size), layer_id=layer_id).double()
        scores = torch.einsum("shd,ld->shl", qf[row:row + new], rows) * SCALE
        limit = torch.arange(new)[:, None] + (length - new)
        scores = scores.masked_fill((pos[None, :] > limit)[:, None, :], float("-inf"))
        outs.append(torch.einsum("shl,ld->shd", torch.softmax(scores, -1), rows[:, :512]))
        lses.append(torch.logsumexp(scores, -1))
        row += new
    return torch.cat(outs).float(), torch.cat(lses).float()


def _oracle(q, pool, batch, q_rounded=None, layer_id=0):
    return _oracle_with_lse(q, pool, batch, q_rounded, layer_id)[0]


def _rounded(q):
    """q as the fp8 kernel computes with it (the declared rounding, over every row)."""
    q8, descale = kernel.quantize_q(q, torch.ones(q.shape[0], dtype=torch.bool))
    return q8.float() * descale


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


# -- an engine's own fp8 query ------------------------------------------------------------

def _engine_fp8(q, gain=4.0):
    """q as an engine that rounds it itself hands it: fp8 and its float32 [1] scale."""
    return kernel.quantize_q(q * gain, torch.ones(q.shape[0], dtype=torch.bool))


def test_an_engines_fp8_query_reaches_the_kernel_as_given_with_its_scale(monkeypatch):
    be = _backend(kv_dtype="fp8_e4m3", q_dtype="fp8_e4m3")
    pool = _pool(be, scale=0.5)
    batch = decode_batch(pool, [1, 90, 64, 130], shuffle=6)
    q8, q_scale = _engine_fp8(_queries(4, seed=8))

    def no_rounding(*args, **kwargs):
        raise AssertionError("an fp8 query must not be rounded again")

    monkeypatch.setattr(kernel, "quantize_q", no_rounding)
    out = be.forward_decode(q8, None, None, pool, batch, q_scale=q_scale)
    assert out.dtype == torch.bfloat16
    want = _oracle(q8.float() * q_scale, pool, batch)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("q_kind,scale_kind,needle", [
    ("fp8", None, "an fp8 query needs its float32 dequantisation scale"),
    ("fp8", "two", "expected one float32 element"),
    ("bf16", "one", "only an fp8 query carries a scale"),
])
def test_a_query_scale_is_checked_before_a_launch(q_kind, scale_kind, needle):
    be = _backend(kv_dtype="fp8_e4m3", q_dtype="fp8_e4m3")
    pool = _pool(be)
    batch = decode_batch(pool, [5, 70])
    q = _queries(2)
    q8, q_scale = _engine_fp8(q)
    scale = {None: None, "one": q_scale, "two": torch.ones(2)}[scale_kind]
    calls = len(fake_flash_mla.CALLS)
    with pytest.raises(UnsupportedError, match=needle):
        be.forward_decode(q8 if q_kind == "fp8" else q, None, None, pool, batch,
                          q_scale=scale)
    assert [n for n, _ in fake_flash_mla.CALLS[calls:]] == ["get_mla_decoding_metadata"]


def test_an_fp8_query_over_a_bf16_pool_is_refused_by_the_declaration():
    be = _backend()
    pool = _pool(be)
    q8, q_scale = _engine_fp8(_queries(2))
    with pytest.raises(UnsupportedError, match="q dtype fp8_e4m3 not in"):
        be.forward_decode(q8, None, None, pool, decode_batch(pool, [5, 70]), q_scale=q_scale)


def test_a_session_replays_each_steps_fp8_query_with_its_own_scale():
    from attnreg.runtime import GraphSession, StepInputs

    be = _backend(kv_dtype="fp8_e4m3", q_dtype="fp8_e4m3")
    pool = _pool(be, num_pages=60, scale=0.5)
    session = GraphSession(be, pool, phase="decode", mode="full", buckets=[4],
                           max_seq_len=2048, device_graphs=False, writes_kv=False)
    session.capture()
    statics = session.statics
    assert statics is not None and statics.qs[0].dtype == torch.float8_e4m3fn
    assert statics.outs[0].dtype == torch.bfloat16 and len(statics.q_scales) == 1
    for gain, lens in ((4.0, [300, 2, 65]), (1 / 64, [700, 64, 500, 3])):
        batch = decode_batch(pool, lens, shuffle=len(lens))
        q8, q_scale = _engine_fp8(_queries(len(lens), seed=len(lens)), gain)
        (out,) = session.replay(batch, StepInputs.one(q8, q_scale=q_scale))
        # a scale frozen at capture (or the first step's) would be off by 256x here
        want = _oracle(q8.float() * q_scale, pool, batch)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))
    # a step without its scale would replay with the last one; a 16-bit q would be cast
    # to fp8 unscaled: both refused before anything is copied
    from attnreg.runtime import SessionError

    batch = decode_batch(pool, [40, 9])
    q8, q_scale = _engine_fp8(_queries(2))
    before = statics.q_scales[0].clone()
    for bad in (StepInputs.one(q8), StepInputs.one(q8.to(torch.bfloat16), q_scale=q_scale),
                StepInputs.one(q8.to(torch.bfloat16))):
        with pytest.raises(SessionError, match="layer 0: .*q_dtype fp8_e4m3"):
            session.replay(batch, bad)
    assert torch.equal(statics.q_scales[0], before)


# -- the library's own output -------------------------------------------------------------

def _recording_decode(monkeypatch, padding_garbage=False):
    """kernel.decode, remembering each output the library allocated; ``padding_garbage``:
    rows of length-0 sequences left NaN, as the real fp8 kernel leaves them unwritten."""
    made = []
    real = kernel.decode

    def decode(lib, q, cache, page_table, seq_lens, *args, **kwargs):
        out, lse = real(lib, q, cache, page_table, seq_lens, *args, **kwargs)
        if padding_garbage:
            rows = (seq_lens == 0).repeat_interleave(q.shape[0] // seq_lens.shape[0])
            out[rows] = float("nan")
        made.append(out)
        return out, lse

    monkeypatch.setattr(kernel, "decode", decode)
    return made


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_a_forward_without_out_returns_the_librarys_output_not_a_copy(monkeypatch, kv_dtype):
    made = _recording_decode(monkeypatch)
    be = _backend(kv_dtype=kv_dtype)
    assert be.returns_kernel_output
    pool = _pool(be)
    batch = decode_batch(pool, [1, 90, 64, 130], shuffle=6)
    q = _queries(4)
    got = be.forward_decode(q, None, None, pool, batch)
    assert got is made[-1], "the library's output itself (no second tensor, no copy)"
    given = torch.full_like(got, float("nan"))
    assert be.forward_decode(q, None, None, pool, batch, out=given) is given
    assert torch.equal(given, got)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_a_kernel_outputs_session_zeroes_padding_in_the_librarys_output(monkeypatch, kv_dtype):
    from attnreg.runtime import GraphSession, StepInputs

    # the bf16 kernel writes zero rows for empty sequences (measured); the fp8 one does not
    made = _recording_decode(monkeypatch, padding_garbage=kv_dtype == "fp8_e4m3")
    be = _backend(kv_dtype=kv_dtype)
    pool = _pool(be, num_pages=60, scale=0.5 if kv_dtype == "fp8_e4m3" else 1.0)
    session = GraphSession(be, pool, phase="decode", mode="full", buckets=[4],
                           max_seq_len=2048, device_graphs=False, writes_kv=False,
                           kernel_outputs=True)
    session.capture()
    assert session.kernel_outputs
    batch = decode_batch(pool, [300, 2, 65])
    q = _queries(3, seed=3)
    (out,) = session.replay(batch, StepInputs.one(q))
    (full,) = session.outputs((ForwardMode.DECODE, 4))
    assert full is made[-1] and out.data_ptr() == full.data_ptr()
    assert not full.isnan().any() and bool((full[3] == 0).all()), \
        "the padding row is zeroed in the library's output"
    want = _oracle(q if kv_dtype == "bf16" else _rounded(q), pool, batch)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


# -- layers -----------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype,scales", [("bf16", 1.0), ("fp8_e4m3", (0.5, 0.25, 1.0))])
def test_each_layer_of_one_pool_is_read_with_its_own_rows_and_scale(kv_dtype, scales):
    be = _backend(kv_dtype=kv_dtype)
    pool = _pool(be, num_pages=40, scale=scales, num_layers=3)
    batch = decode_batch(pool, [1, 90, 64, 130], shuffle=6)
    be.init_forward_metadata(batch)  # one plan for every layer of the step
    calls = len(fake_flash_mla.CALLS)
    outs = []
    for layer in range(3):
        q = _queries(4, seed=20 + layer)
        out = be.forward_decode(q, None, None, pool, batch, layer_id=layer)
        want = _oracle(q, pool, batch, _rounded(q) if kv_dtype == "fp8_e4m3" else None,
                       layer_id=layer)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        outs.append(out)
    # planned once: three kernel calls, no further scheduler run
    assert [n for n, _ in fake_flash_mla.CALLS[calls:]] == ["flash_mla_with_kvcache"] * 3
    assert not torch.equal(outs[0], outs[1])


def test_one_graph_over_three_layers_replays_each_layer_correctly():
    be = _backend(kv_dtype="fp8_e4m3")
    pool = _pool(be, num_pages=60, scale=(0.5, 0.125, 2.0), num_layers=3)
    bs = 4
    be.init_cuda_graph_state(bs, bs, max_seq_len=2048)
    qs = [torch.zeros(bs, 16, 576, dtype=torch.bfloat16) for _ in range(3)]
    outs = [torch.zeros(bs, 16, 512, dtype=torch.bfloat16) for _ in range(3)]
    be.init_forward_metadata_capture(bs, bs)

    def step():
        for layer in range(3):
            be.forward_decode(qs[layer], None, None, pool, None, out=outs[layer],
                              layer_id=layer)

    graph = GraphRunner("cpu").capture(step, GraphMode.FULL)
    for lens in ([300, 2, 65, 129], [700, 64, 500]):
        batch = decode_batch(pool, lens, shuffle=len(lens))
        be.init_forward_metadata_replay(bs, bs, batch)
        real = [_queries(len(lens), seed=layer + lens[0]) for layer in range(3)]
        for layer in range(3):
            qs[layer][:len(lens)].copy_(real[layer])
        graph.replay()
        for layer in range(3):
            want = _oracle(real[layer], pool, batch, _rounded(real[layer]), layer_id=layer)
            torch.testing.assert_close(outs[layer][:len(lens)].float(), want,
                                       atol=2e-2, rtol=2e-2)
            assert torch.count_nonzero(outs[layer][len(lens):]) == 0
        pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))


# -- log-sum-exp ------------------------------------------------------------------------

def test_decode_returns_the_natural_log_sum_exp_per_token_and_head():
    be = _backend()
    pool = _pool(be)
    batch = decode_batch(pool, [1, 37, 64, 65, 300], shuffle=3)
    q = _queries(5)
    out, lse = be.forward_decode(q, None, None, pool, batch, return_lse=True)
    want_out, want_lse = _oracle_with_lse(q, pool, batch)
    assert lse.shape == (5, 16) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)


def test_lse_of_padding_in_a_replayed_graph_is_minus_infinity():
    be = _backend()
    pool = _pool(be, num_pages=60)
    be.init_cuda_graph_state(6, 6, max_seq_len=2048)
    q = torch.zeros(6, 16, 576, dtype=torch.bfloat16)
    out = torch.zeros(6, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(6, 16)
    be.init_forward_metadata_capture(6, 6)
    graph = GraphRunner("cpu").capture(
        lambda: be.forward_decode(q, None, None, pool, None, out=out, lse=lse), GraphMode.FULL)
    batch = decode_batch(pool, [40, 300], shuffle=7)
    real = _queries(2, seed=3)
    be.init_forward_metadata_replay(6, 6, batch)
    q[:2].copy_(real)
    graph.replay()
    torch.testing.assert_close(lse[:2], _oracle_with_lse(real, pool, batch)[1],
                               atol=1e-4, rtol=1e-5)
    assert (lse[2:] == float("-inf")).all()


def test_an_fp8_pool_refuses_the_lse_it_does_not_declare_before_a_launch():
    be = _backend(kv_dtype="fp8_e4m3")
    pool = _pool(be, scale=0.5)
    batch = decode_batch(pool, [3, 20])
    with pytest.raises(UnsupportedError, match="log-sum-exp"):
        be.forward_decode(_queries(2), None, None, pool, batch, return_lse=True)
    assert "flash_mla_with_kvcache" not in _library_calls()


# -- target verify ----------------------------------------------------------------------

@pytest.mark.parametrize("draft", [1, 2, 3, 4, 8])
def test_eager_verify_is_causal_among_the_drafts_over_the_whole_prefix(draft):
    be = _backend()
    pool = _pool(be)
    batch = verify_batch(pool, [0, 37, 64, 300], draft, shuffle=2)
    q = _queries(4 * draft, seed=draft)
    out, lse = be.forward_extend(q, None, None, pool, batch, return_lse=True)
    want_out, want_lse = _oracle_with_lse(q, pool, batch)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    sched = [c for n, c in fake_flash_mla.CALLS if n == "get_mla_decoding_metadata"][-1]
    assert sched["n"] == draft * 16  # the scheduler plans s_q * H query rows
    call = [c for n, c in fake_flash_mla.CALLS if n == "flash_mla_with_kvcache"][-1]
    assert call["q_shape"] == (4, draft, 16, 576) and call["causal"] is (draft > 1)


def test_eager_verify_over_an_fp8_pool_rounds_q_once_per_batch():
    be = _backend(kv_dtype="fp8_e4m3")
    pool = _pool(be, scale=0.5)
    batch = verify_batch(pool, [5, 90, 64], 4, shuffle=4)
    q = _queries(12, seed=5)
    out = be.forward_extend(q, None, None, pool, batch)
    torch.testing.assert_close(out.float(), _oracle(q, pool, batch, _rounded(q)),
                               atol=2e-2, rtol=2e-2)


def test_verify_writes_the_drafts_before_attending():
    be = _backend()
    pool = _pool(be)
    batch = verify_batch(pool, [10, 70], 3, shuffle=1)
    q = _queries(6)
    latent, rope = torch.randn(6, 512).bfloat16(), torch.randn(6, 64).bfloat16()
    out = be.forward_extend(q, latent, rope, pool, batch)
    torch.testing.assert_close(pool.read_slots(batch.out_cache_loc.long())[:, :512],
                               latent.float())
    torch.testing.assert_close(out.float(), _oracle(q, pool, batch), atol=2e-2, rtol=2e-2)


def test_more_drafts_than_declared_are_refused_before_a_launch():
    be = _backend()
    pool = _pool(be, num_pages=60)
    batch = verify_batch(pool, [20, 30], MAX_VERIFY_TOKENS + 1)
    with pytest.raises(UnsupportedError, match="target_verify"):
        be.forward_extend(_queries(2 * (MAX_VERIFY_TOKENS + 1)), None, None, pool, batch)
    assert "flash_mla_with_kvcache" not in _library_calls()


def test_draft_extend_batches_are_refused_with_the_reason():
    be = _backend()
    pool = _pool(be)
    batch = draft_extend_batch(pool, [10, 20], [3, 1])
    with pytest.raises(UnsupportedError, match="ragged accepted lengths"):
        be.forward_extend(_queries(4), None, None, pool, batch)
    assert "flash_mla_with_kvcache" not in _library_calls()
    be.init_cuda_graph_state(2, 8, max_seq_len=512)
    with pytest.raises(UnsupportedError, match="draft_extend"):
        be.init_forward_metadata_capture(2, 8, forward_mode=ForwardMode.DRAFT_EXTEND)


def _captured_verify(be, pool, bs, draft, heads=16):
    """A target-verify step captured at ``bs`` sequences of ``draft`` tokens."""
    be.init_cuda_graph_state(bs, bs * draft, max_seq_len=2048)
    q = torch.zeros(bs * draft, heads, 576, dtype=torch.bfloat16)
    out = torch.zeros(bs * draft, heads, 512, dtype=torch.bfloat16)
    be.init_forward_metadata_capture(bs, bs * draft, forward_mode=ForwardMode.TARGET_VERIFY)
    graph = GraphRunner("cpu").capture(
        lambda: be.forward_extend(q, None, None, pool, None, out=out), GraphMode.FULL)
    return q, out, graph


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_a_verify_graph_replays_new_lengths_and_zeroes_padded_sequences(kv_dtype):
    be = _backend(kv_dtype=kv_dtype)
    pool = _pool(be, num_pages=80, scale=0.5 if kv_dtype == "fp8_e4m3" else 1.0)
    draft, bs = 4, 4
    q, out, graph = _captured_verify(be, pool, bs, draft)
    for prefixes in ([300, 2, 65, 129], [700, 0], [5, 500, 64]):
        batch = verify_batch(pool, prefixes, draft, shuffle=len(prefixes))
        rows = len(prefixes) * draft
        real = _queries(rows, seed=prefixes[0])
        be.init_forward_metadata_replay(bs, bs * draft, batch)
        q[:rows].copy_(real)
        q[rows:].fill_(1e4)  # stale rows of padded sequences
        out.fill_(7.0)
        graph.replay()
        want = _oracle(real, pool, batch, _rounded(real) if kv_dtype == "fp8_e4m3" else None)
        torch.testing.assert_close(out[:rows].float(), want, atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(out[rows:]) == 0
        pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))


def test_a_verify_replay_without_replanning_would_be_wrong(monkeypatch):
    be = _backend()
    pool = _pool(be, num_pages=80)
    q, out, graph = _captured_verify(be, pool, 4, 3)
    monkeypatch.setattr(FlashMLABackend, "_init_replay_impl", lambda self, md, batch: None)
    batch = verify_batch(pool, [700, 64, 500, 3], 3, shuffle=5)
    real = _queries(12, seed=9)
    be.init_forward_metadata_replay(4, 12, batch)
    q.copy_(real)
    graph.replay()
    assert not torch.allclose(out.float(), _oracle(real, pool, batch), atol=2e-2, rtol=2e-2)


def test_decode_and_verify_graphs_share_the_scheduler_buffers_with_their_own_shapes():
    be = _backend(num_heads=128)
    pool = _pool(be, num_pages=80)
    bs, draft = 4, 8
    be.init_cuda_graph_state(bs, bs * draft, max_seq_len=2048)
    qd = torch.zeros(bs, 128, 576, dtype=torch.bfloat16)
    od = torch.zeros(bs, 128, 512, dtype=torch.bfloat16)
    qv = torch.zeros(bs * draft, 128, 576, dtype=torch.bfloat16)
    ov = torch.zeros(bs * draft, 128, 512, dtype=torch.bfloat16)
    runner = GraphRunner("cpu")
    be.init_forward_metadata_capture(bs, bs)
    decode = runner.capture(lambda: be.forward_decode(qd, None, None, pool, None, out=od))
    be.init_forward_metadata_capture(bs, bs * draft, forward_mode=ForwardMode.TARGET_VERIFY)
    verify = runner.capture(lambda: be.forward_extend(qv, None, None, pool, None, out=ov))
    plans = {md.forward_mode: md.plan for md in be.captured_metadata()}
    # 128 heads on 132 SMs: 66 partitions for decode, 132 // ceil(8 * 128 / 64) = 8 for verify
    assert tuple(plans[ForwardMode.DECODE].schedule.tile_scheduler_metadata.shape) == (66, 8)
    assert tuple(plans[ForwardMode.TARGET_VERIFY].schedule.tile_scheduler_metadata.shape) \
        == (8, 8)
    assert be.graph_buffer_bytes() == 66 * 8 * 4 + (bs + 1) * 4  # one set of buffers
    for step in range(2):  # alternate: each replay re-plans its own shape
        dbatch = decode_batch(pool, [300 + step, 65, 2], shuffle=step)
        real_d = _queries(3, heads=128, seed=step)
        be.init_forward_metadata_replay(bs, bs, dbatch)
        qd[:3].copy_(real_d)
        decode.replay()
        torch.testing.assert_close(od[:3].float(), _oracle(real_d, pool, dbatch),
                                   atol=2e-2, rtol=2e-2)
        pool.free(sorted({p for row in dbatch.page_table.tolist() for p in row if p}))
        vbatch = verify_batch(pool, [100, 7 + step, 640, 64], draft, shuffle=step + 1)
        real_v = _queries(bs * draft, heads=128, seed=10 + step)
        be.init_forward_metadata_replay(bs, bs * draft, vbatch)
        qv.copy_(real_v)
        verify.replay()
        torch.testing.assert_close(ov.float(), _oracle(real_v, pool, vbatch),
                                   atol=2e-2, rtol=2e-2)
        pool.free(sorted({p for row in vbatch.page_table.tolist() for p in row if p}))
