"""Speculative-decoding batches at runtime: target verify and draft extend.

They are decode-phase batches (``PHASE_FORWARD_MODES``) run by ``forward_extend``
with absorbed MLA: each sequence's new tokens causal among themselves over the
whole prefix.  Served eagerly and in FULL decode graphs where declared
(``eager_forward_modes``, ``GraphModeSupport.forward_modes``), refused elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnreg.registry import (
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    Phase,
    UnsupportedError,
    get_registry,
)
from attnreg.registry.capabilities import PHASE_FORWARD_MODES
from attnreg.runtime import (
    ForwardBatch,
    GraphRunner,
    MLAConfig,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    phase_of,
    verify_batch,
)

H = 2


def fill(pool, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=g).to(layer.buffer.dtype))


def test_speculative_modes_are_decode_phase_from_the_registry() -> None:
    for phase, modes in PHASE_FORWARD_MODES.items():
        for mode in modes:
            assert phase_of(mode) is phase
    assert phase_of("target_verify") is Phase.DECODE
    assert phase_of(ForwardMode.EXTEND) is Phase.PREFILL


def test_verify_and_draft_extend_builders() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    pool = cfg.make_pool(16)
    v = verify_batch(pool, [10, 30], 4)
    assert v.forward_mode is ForwardMode.TARGET_VERIFY and v.query_len == 4
    assert v.extend_lens_cpu == (4, 4) and v.seq_lens_cpu == (14, 34)
    assert v.qo_indptr.tolist() == [0, 4, 8]
    d = draft_extend_batch(pool, [5, 6], [3, 1])
    assert d.forward_mode is ForwardMode.DRAFT_EXTEND and d.query_len is None
    assert d.out_cache_loc.shape == (4,)
    with pytest.raises(ValueError, match="same number"):
        ForwardBatch.build("target_verify", [1, 2], [2, 3], v.page_table, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=">= 1 new token"):
        draft_extend_batch(pool, [1, 2], [2, 0])
    with pytest.raises(ValueError, match="num_draft must be >= 1"):
        verify_batch(pool, [1], 0)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["target_verify", "draft_extend"])
def test_eager_speculative_batches_match_the_reference(backend_name: str, mode: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    reg = get_registry()
    backend, oracle = reg.create(backend_name, cfg), reg.create("reference", cfg)
    pool = cfg.make_pool(20)
    fill(pool)
    batch = verify_batch(pool, [0, 17, 60], 3) if mode == "target_verify" else \
        draft_extend_batch(pool, [0, 17, 60], [3, 1, 2])
    q = torch.randn(batch.num_tokens, H, 576).bfloat16()
    got = backend.forward_extend(q, None, None, pool, batch)
    # the reference computes it as an extend with a prefix, per sequence
    want = oracle.forward_extend(q, None, None, pool, batch)
    assert torch.allclose(got.float(), want.float(), atol=2e-2)
    # causal among the drafts: the first draft of a sequence does not see the second
    first = oracle.forward_extend(q[:1], None, None, pool,
                                  verify_batch(pool, [0], 1, pages=[[int(batch.page_table[0, 0])]]))
    assert torch.allclose(got[0].float(), first[0].float(), atol=2e-2)


def test_speculative_batches_are_refused_where_not_declared() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    reg = get_registry()
    caps = reg.declaration("reference", "cpu")
    plain = dataclasses.replace(caps, eager_forward_modes=())  # decode + extend only
    backend = type(reg.create("reference", cfg))(cfg, capabilities=plain)
    pool = cfg.make_pool(8)
    batch = verify_batch(pool, [5], 2)
    q = torch.zeros(2, H, 576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="does not declare target_verify batches eagerly"):
        backend.forward_extend(q, None, None, pool, batch)
    short = dataclasses.replace(caps, eager_forward_modes=(
        ForwardModeSupport(ForwardMode.TARGET_VERIFY, 1),))
    backend = type(reg.create("reference", cfg))(cfg, capabilities=short)
    with pytest.raises(UnsupportedError, match="this batch has 2 tokens per sequence"):
        backend.forward_extend(q, None, None, pool, batch)


def test_speculative_batches_run_absorbed_mla_through_forward_extend_only() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = get_registry().create("reference", cfg)
    pool = cfg.make_pool(8)
    batch = verify_batch(pool, [5], 2)
    with pytest.raises(UnsupportedError, match="forward_decode on a target_verify batch"):
        backend.forward_decode(torch.zeros(1, H, 576, dtype=torch.bfloat16), None, None, pool,
                               batch)
    q192 = torch.zeros(2, H, 192, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="speculative batches attend the paged pool"):
        backend.forward_extend(q192, None, None, pool, batch, method="mha", k=q192,
                               v=torch.zeros(7, H, 128, dtype=torch.bfloat16))


def _graphs(backend, pool, max_bs: int, q_len: int, layers: int):  # type: ignore[no-untyped-def]
    """Decode and verify graphs of one bucket in one graph state, both over ``layers``."""
    backend.init_cuda_graph_state(max_bs, max_bs * q_len, max_seq_len=256,
                                  graph_modes={"decode": "full"})
    runner = GraphRunner("cpu")
    static = {
        "verify_q": torch.zeros(max_bs * q_len, H, 576, dtype=torch.bfloat16),
        "decode_q": torch.zeros(max_bs, H, 576, dtype=torch.bfloat16),
        "verify_out": [torch.zeros(max_bs * q_len, H, 512, dtype=torch.bfloat16)
                       for _ in range(layers)],
        "verify_lse": [torch.zeros(max_bs * q_len, H) for _ in range(layers)],
        "decode_out": [torch.zeros(max_bs, H, 512, dtype=torch.bfloat16)
                       for _ in range(layers)],
    }

    def verify() -> None:
        for i in range(layers):
            backend.forward_extend(static["verify_q"], None, None, pool, None, layer_id=i,
                                   out=static["verify_out"][i], lse=static["verify_lse"][i])

    def decode() -> None:
        for i in range(layers):
            backend.forward_decode(static["decode_q"], None, None, pool, None, layer_id=i,
                                   out=static["decode_out"][i])

    backend.init_forward_metadata_capture(max_bs, max_bs * q_len, forward_mode="target_verify")
    runner.capture(verify, GraphMode.FULL, key=("verify", max_bs))
    backend.init_forward_metadata_capture(max_bs, max_bs, forward_mode="decode")
    runner.capture(decode, GraphMode.FULL, key=("decode", max_bs))
    return runner, static


def test_triton_replays_verify_and_decode_graphs_of_one_bucket_over_layers() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, max_context_len=256)
    reg = get_registry()
    backend, oracle = reg.create("triton", cfg), reg.create("reference", cfg)
    pool = cfg.make_pool(40, num_layers=2)
    fill(pool, 3)
    runner, static = _graphs(backend, pool, 4, 3, 2)
    for prefixes in ([100, 7], [3, 200, 50, 9]):   # fewer sequences (padding), then full
        batch = verify_batch(pool, prefixes, 3)
        n = batch.num_tokens
        static["verify_q"][:n] = torch.randn(n, H, 576)
        backend.init_forward_metadata_replay(4, 12, batch)
        runner[("verify", 4)].replay()
        for i in range(2):
            want, want_lse = oracle.forward_extend(static["verify_q"][:n], None, None, pool,
                                                   batch, layer_id=i, return_lse=True)
            assert torch.allclose(static["verify_out"][i][:n].float(), want.float(), atol=2e-2)
            assert torch.allclose(static["verify_lse"][i][:n], want_lse, atol=1e-3)
            assert bool((static["verify_out"][i][n:] == 0).all()), "padding rows are zero"
            assert bool((static["verify_lse"][i][n:] == float("-inf")).all())
    step = decode_batch(pool, [30, 120, 4])
    static["decode_q"][:3] = torch.randn(3, H, 576)
    backend.init_forward_metadata_replay(4, 4, step)
    runner[("decode", 4)].replay()
    for i in range(2):
        want = oracle.forward_decode(static["decode_q"][:3], None, None, pool, step, layer_id=i)
        assert torch.allclose(static["decode_out"][i][:3].float(), want.float(), atol=2e-2)


def test_a_verify_graph_replays_only_its_captured_draft_tokens() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, max_context_len=256)
    backend = get_registry().create("triton", cfg)
    pool = cfg.make_pool(20)
    _graphs(backend, pool, 2, 3, 1)
    with pytest.raises(UnsupportedError, match="captured for 3 draft tokens per sequence"):
        backend.init_forward_metadata_replay(2, 6, verify_batch(pool, [4], 2))
    with pytest.raises(UnsupportedError, match="batch is decode, the graph was captured for "
                                               "target_verify"):
        backend.init_forward_metadata_replay(2, 6, decode_batch(pool, [4, 5]),
                                             forward_mode="target_verify")
    with pytest.raises(UnsupportedError, match="multiple of bs=2"):
        backend.init_forward_metadata_capture(2, 5, forward_mode="target_verify")


def test_capture_refuses_more_draft_tokens_than_the_graphs_declare() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, max_context_len=256)
    backend = get_registry().create("triton", cfg)
    backend.init_cuda_graph_state(2, 2 * 9, max_seq_len=256, graph_modes={"decode": "full"})
    with pytest.raises(UnsupportedError, match="this batch has 9 tokens per sequence"):
        backend.init_forward_metadata_capture(2, 18, forward_mode="target_verify")


@pytest.mark.parametrize("heads,kv,rounds", [(64, "fp8_e4m3", True), (16, "fp8_e4m3", True),
                                             (32, "fp8_e4m3", False), (64, "bf16", False)])
def test_triton_verify_and_draft_extend_round_q_where_its_decode_does(monkeypatch, heads, kv,
                                                                     rounds) -> None:
    """Over an fp8 cache up to FP8_SCORES_T_MAX_HEADS and from FP8_SCORES_MIN_HEADS heads
    up, triton's decode kernel takes fp8 score dots on q rounded per head row (declared for the decode phase); its verify
    and draft-extend steps (the extend kernel) are asked to round q the same way, and a
    prefill step is not."""
    import attnreg.backends.triton_mla as triton_mla

    asked: list[tuple[str, bool]] = []

    def record(q, *args, round_q_fp8=False, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((str(batch.forward_mode), round_q_fp8))
        return args[5]  # out, untouched: the wiring is what is checked

    monkeypatch.setattr(triton_mla, "mla_extend", record)
    cfg = MLAConfig(num_heads=heads, page_size=16, max_context_len=256, kv_dtype=kv)
    backend = get_registry().create("triton", cfg)
    pool = cfg.make_pool(8)
    for batch in (verify_batch(pool, [5, 9], 2), draft_extend_batch(pool, [5, 6], [2, 1])):
        backend.forward_extend(torch.randn(batch.num_tokens, heads, 576).bfloat16(), None, None,
                               pool, batch, layer_id=0)
    batch = extend_batch(pool, [0, 3], [4, 2])
    backend.forward_extend(torch.randn(batch.num_tokens, heads, 576).bfloat16(), None, None,
                           pool, batch, layer_id=0)
    assert asked == [("target_verify", rounds), ("draft_extend", rounds), ("extend", False)]
