"""GraphSession with real CUDA graphs: decode and verify buckets captured largest first into
one private memory pool with host syncs forbidden, replays equal to eager for padded
batches, the eager fallback counted by rule, and BREAKABLE prefill re-running the caller's
eager break between the recorded segments.  Run on a GPU: ``pytest -m gpu
tests/runtime/test_session_gpu.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy.capture import eager_break  # noqa: E402
from attnreg.registry import ForwardMode, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    GraphRunner,
    GraphSession,
    MLAConfig,
    StepInputs,
    decode_batch,
    extend_batch,
    verify_batch,
)

pytestmark = pytest.mark.gpu

H, LAYERS, DRAFTS, CONTEXT = 16, 2, 4, 2048


def _setup(name: str = "triton"):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = MLAConfig(num_heads=H, page_size=64, device="cuda", max_context_len=CONTEXT)
    reg = get_registry()
    avail = reg.availability(name)
    if not avail.available:
        pytest.skip(f"{name}: {avail.reason}")
    pool = cfg.make_pool(16 * (CONTEXT // 64) + 2, num_layers=LAYERS)
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in pool.layers:
        layer.buffer.normal_(generator=g)
    return cfg, reg.create(name, cfg), reg.create("reference", cfg), pool


def _inputs(rows: int, seed: int) -> StepInputs:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return StepInputs([torch.randn(rows, H, 576, generator=g, device="cuda").bfloat16()
                       for _ in range(LAYERS)])


@pytest.mark.parametrize("name", ["triton", "flashinfer_mla"])
def test_decode_and_verify_buckets_replay_real_graphs_equal_to_eager(name: str) -> None:
    cfg, backend, reference, pool = _setup(name)
    session = GraphSession(backend, pool, phase="decode", mode="full", buckets=[8, 2, 4],
                           layers=LAYERS, writes_kv=False, forbid_sync=True,
                           forward_modes={"decode": 1, "target_verify": DRAFTS})
    graphs = session.capture()
    assert list(graphs) == session.keys and session.keys[0] == (ForwardMode.TARGET_VERIFY, 8)
    assert all(g.device_graphs and g.graphs for g in graphs.values())
    pages = pool.allocate([CONTEXT] * 10, shuffle=1)
    cases = [decode_batch(pool, [1900, 5, 700], pages=pages[:3]),
             verify_batch(pool, [64, 1000, 3, 2000, 17], DRAFTS, pages=pages[:5]),
             decode_batch(pool, [30], pages=pages[:1])]
    for i, batch in enumerate(cases):
        inputs = _inputs(batch.num_tokens, seed=i)
        res = session.run(batch, inputs)
        torch.cuda.synchronize()
        assert res.replayed, res.reason
        for layer in range(LAYERS):
            want = reference.forward(inputs.q[layer], None, None, pool, batch, layer_id=layer)
            assert torch.allclose(res.outputs[layer].float(), want.float(), atol=2e-2)
    assert session.counts.replayed == {"gate.ok": 3}
    big = decode_batch(pool, [40] * 10, pages=pages[:10])
    res = session.run(big, _inputs(10, seed=9))
    assert not res.replayed and session.counts.eager == {"gate.batch_slots": 1}


@pytest.mark.parametrize("name", ["triton", "flashinfer_mla"])
def test_batches_packed_into_the_graph_index_buffer_replay_back_to_back_equal_to_reference(
        name: str) -> None:
    """Each batch packed into the buffer after the previous replay was launched (not waited
    for): the device runs the previous graph before the pack's copies overwrite what it reads."""
    cfg, backend, reference, pool = _setup(name)
    session = GraphSession(backend, pool, phase="decode", mode="full", buckets=[2, 4, 8],
                           layers=LAYERS, writes_kv=False, forbid_sync=True,
                           forward_modes={"decode": 1, "target_verify": DRAFTS})
    session.capture()
    pages = pool.allocate([CONTEXT] * 8, shuffle=2)
    buf = session.index_buffer
    steps = []
    for i, lens in enumerate(([1900, 5, 700], [64, 1000, 13, 2000, 17, 8, 9], [30], [2040] * 8)):
        if i % 2:
            batch = verify_batch(pool, [n - DRAFTS for n in lens], DRAFTS,
                                 pages=pages[:len(lens)], layout=buf)
        else:
            batch = decode_batch(pool, lens, pages=pages[:len(lens)], layout=buf)
        inputs = _inputs(batch.num_tokens, seed=10 + i)
        res = session.run(batch, inputs)
        assert res.replayed, res.reason
        steps.append((batch, inputs, [o.clone() for o in res.outputs]))
    torch.cuda.synchronize()
    assert backend.graph_state.fills["in_place"] == 4
    for batch, inputs, outs in steps:
        rebuilt = (decode_batch(pool, list(batch.seq_lens_cpu), pages=pages[:batch.batch_size])
                   if batch.forward_mode is ForwardMode.DECODE else
                   verify_batch(pool, list(batch.prefix_lens_cpu), DRAFTS,
                                pages=pages[:batch.batch_size]))
        for layer in range(LAYERS):
            want = reference.forward(inputs.q[layer], None, None, pool, rebuilt,
                                     layer_id=layer)
            assert torch.allclose(outs[layer].float(), want.float(), atol=2e-2)


def test_two_sessions_share_one_runner_and_its_memory_pool() -> None:
    cfg, backend, _, pool = _setup()
    runner = GraphRunner("cuda")
    decode = GraphSession(backend, pool, phase="decode", mode="full", buckets=[4],
                          layers=LAYERS, writes_kv=False, runner=runner)
    decode.capture()
    prefill = GraphSession(get_registry().create("triton", cfg), pool, phase="prefill",
                           mode="breakable", buckets=[128], max_requests=4, layers=LAYERS,
                           writes_kv=False, runner=runner)
    prefill.capture()
    assert decode.runner.mempool is prefill.runner.mempool
    assert len(runner.keys()) == 2


def test_breakable_prefill_reruns_the_callers_eager_break_at_every_replay() -> None:
    cfg, backend, reference, pool = _setup()
    scale = [1.0]
    mid = torch.zeros(128, H, 512, dtype=torch.bfloat16, device="cuda")
    final = torch.zeros_like(mid)

    def after(step):  # type: ignore[no-untyped-def]
        eager_break.run("test.scale", lambda: torch.mul(step.outputs[0], scale[0], out=mid))
        final.copy_(mid)

    session = GraphSession(backend, pool, phase="prefill", mode="breakable", buckets=[128],
                           max_requests=4, layers=LAYERS, writes_kv=False,
                           after_attention=after)
    graph = session.capture()[(ForwardMode.EXTEND, 128)]
    assert graph.breaks[-1] == "test.scale" and len(graph.graphs) >= 2
    pages = pool.allocate([CONTEXT] * 3, shuffle=2)
    for i, factor in enumerate((2.0, 0.5)):
        batch = extend_batch(pool, [300, 0, 1200], [40, 17, 9], pages=pages)
        inputs = _inputs(batch.num_tokens, seed=20 + i)
        scale[0] = factor
        res = session.run(batch, inputs)
        torch.cuda.synchronize()
        assert res.replayed, res.reason
        want = reference.forward(inputs.q[0], None, None, pool, batch)
        assert torch.allclose(res.output.float(), want.float(), atol=2e-2)
        assert torch.allclose(final[:batch.num_tokens].float() / factor, want.float(),
                              atol=4e-2)
