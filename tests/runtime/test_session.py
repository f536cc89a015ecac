"""GraphSession on a cpu: bucket choice, padding and real rows, eager fallback counted by rule
id, speculative buckets, several layers, BREAKABLE with the caller's eager break, TC_PIECEWISE,
the gate of a plan, and outputs equal to eager for the triton (interpreter, tiny shapes) and
reference backends.  Without device graphs a replay re-runs the captured function, so outputs
are real; a fake recorder shows the replay plan a CUDA graph would have."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy import EngineFacts, GraphConfig, ReplayGate, ServerFeatures, resolve  # noqa: E402
from attnreg.graph_policy.capture import eager_break  # noqa: E402
from attnreg.graph_policy.sync import Agreed  # noqa: E402
from attnreg.registry import ForwardMode, get_registry  # noqa: E402
from attnreg.runtime import (  # noqa: E402
    SYNC_EAGER,
    GraphSession,
    MLAConfig,
    SessionError,
    StepInputs,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    replay_batch,
    verify_batch,
)

from ._session_inputs import random_inputs, random_pool  # noqa: E402

H = 2






def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), atol=2e-2))


@pytest.fixture(scope="module")
def cfg() -> MLAConfig:
    return MLAConfig(num_heads=H, page_size=16, max_context_len=256)


@pytest.fixture(scope="module")
def oracle(cfg: MLAConfig) -> Any:
    return get_registry().create("reference", cfg)


@pytest.fixture(scope="module")
def decode_session(cfg: MLAConfig) -> tuple[GraphSession, Any]:
    """Triton decode + 3-draft verify graphs at buckets 2 and 4 over 2 layers."""
    pool = random_pool(cfg, 120, layers=2, seed=3)
    ses = GraphSession(get_registry().create("triton", cfg), pool, phase="decode", mode="full",
                       buckets=[4, 2], layers=2, writes_kv=False,
                       forward_modes={"decode": 1, "target_verify": 3})
    ses.capture()
    return ses, pool


def test_capture_takes_every_bucket_of_every_forward_mode_largest_first(decode_session):
    ses, _ = decode_session
    assert ses.keys == [(ForwardMode.TARGET_VERIFY, 4), (ForwardMode.TARGET_VERIFY, 2),
                        (ForwardMode.DECODE, 4), (ForwardMode.DECODE, 2)]
    assert ses.shape((ForwardMode.TARGET_VERIFY, 4)) == (4, 12)
    assert sorted(ses.runner.keys()) == sorted(("decode", str(m), b) for m, b in ses.keys)


def test_a_batch_pads_to_the_smallest_bucket_and_only_its_rows_come_back(decode_session, oracle):
    ses, pool = decode_session
    batch = decode_batch(pool, [30, 100, 7])
    inputs = random_inputs(3, H, layers=2, seed=1)
    for out in ses.statics.outs:
        out.fill_(float("nan"))
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 4 and res.reason.rule == "gate.ok"
    assert [tuple(o.shape) for o in res.outputs] == [(3, H, 512)] * 2
    for i in range(2):
        want = oracle.forward_decode(inputs.q[i], None, None, pool, batch, layer_id=i)
        assert _close(res.outputs[i], want), f"layer {i} differs from eager"
        assert bool((ses.statics.outs[i][3:4] == 0).all()), "the padding row is zero"
    one = ses.run(decode_batch(pool, [12]), random_inputs(1, H, layers=2, seed=2))
    assert one.bucket == 2 and one.output.shape[0] == 1


def test_a_batch_no_bucket_holds_runs_eagerly_and_is_counted_by_rule(decode_session, oracle):
    ses, pool = decode_session
    before = ses.counts.eager["gate.batch_slots"]
    batch = decode_batch(pool, [5] * 5)
    inputs = random_inputs(5, H, layers=2, seed=4)
    res = ses.run(batch, inputs)
    assert not res.replayed and res.bucket is None and res.reason.rule == "gate.batch_slots"
    assert ses.counts.eager["gate.batch_slots"] == before + 1
    want = oracle.forward_decode(inputs.q[1], None, None, pool, batch, layer_id=1)
    assert _close(res.outputs[1], want)
    long = ses.run(decode_batch(pool, [300]), random_inputs(1, H, layers=2))
    assert long.reason.rule == "gate.seq_len_above_max" and not long.replayed
    assert ses.counts.to_dict()["eager"]["gate.seq_len_above_max"] >= 1


def test_verify_batches_replay_their_draft_bucket_and_other_draft_counts_run_eagerly(
        decode_session, oracle):
    ses, pool = decode_session
    batch = verify_batch(pool, [10, 40, 3], 3)
    inputs = random_inputs(9, H, layers=2, seed=5)
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 4 and res.output.shape[0] == 9
    want = oracle.forward_extend(inputs.q[0], None, None, pool, batch)
    assert _close(res.output, want)
    two = ses.run(verify_batch(pool, [10], 2), random_inputs(2, H, layers=2))
    assert two.reason.rule == "gate.spec_query_len" and not two.replayed
    draft = ses.run(draft_extend_batch(pool, [4], [2]), random_inputs(2, H, layers=2))
    assert draft.reason.rule == "gate.spec_forward_mode", "no draft-extend graphs captured"


def test_a_draft_extend_session_serves_one_up_to_the_draft_tokens(cfg, oracle):
    pool = random_pool(cfg, 120, seed=3)
    ses = GraphSession(get_registry().create("triton", cfg), pool, phase="decode", mode="full",
                       buckets=[2], writes_kv=False, forward_modes={"draft_extend": 3})
    ses.capture()
    batch = draft_extend_batch(pool, [20, 5], [3, 1])
    inputs = random_inputs(4, H, seed=6)
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 2
    assert _close(res.output, oracle.forward_extend(inputs.q[0], None, None, pool, batch))


def test_new_tokens_are_written_into_every_layer_from_the_static_inputs(cfg):
    pool = random_pool(cfg, 120, layers=2, seed=3)
    ses = GraphSession(get_registry().create("triton", cfg), pool, phase="decode", mode="full",
                       buckets=[2], layers=2)
    ses.capture()
    batch = decode_batch(pool, [9])
    g = torch.Generator().manual_seed(8)
    lat = [torch.randn(1, 512, generator=g).bfloat16() for _ in range(2)]
    rope = [torch.randn(1, 64, generator=g).bfloat16() for _ in range(2)]
    ses.run(batch, StepInputs([torch.zeros(1, H, 576).bfloat16()] * 2, lat, rope))
    slot = int(batch.out_cache_loc[0])
    for i in range(2):
        row = pool.layers[i].buffer.view(-1, 576)[slot]
        assert torch.equal(row[:512], lat[i][0]) and torch.equal(row[512:], rope[i][0])


def test_breakable_prefill_runs_the_callers_eager_break_between_segments(cfg, oracle):
    pool = random_pool(cfg, 120, seed=3)
    scaled: list[torch.Tensor] = []
    mids: list[torch.Tensor] = []
    factor = [2.0]

    def after(step):  # type: ignore[no-untyped-def]
        if not mids:
            mids.append(torch.zeros_like(ses.statics.outs[0]))
            scaled.append(torch.zeros_like(ses.statics.outs[0]))
        eager_break.run("caller.scale", lambda: torch.mul(step.outputs[0], factor[0],
                                                          out=mids[0][:step.outputs[0].shape[0]]))
        scaled[0].copy_(mids[0])

    ses = GraphSession(get_registry().create("triton", cfg), pool, phase="prefill",
                       mode="breakable", buckets=[8], max_requests=2, writes_kv=False,
                       after_attention=after)
    ses.capture()
    batch = extend_batch(pool, [0, 20], [3, 4])
    inputs = random_inputs(7, H, seed=9)
    factor[0] = 4.0   # a host value the break reads at replay, not the one captured
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 8
    want = oracle.forward_extend(inputs.q[0], None, None, pool, batch)
    assert _close(res.output, want)
    assert _close(scaled[0][:7] / 4.0, want), "the break re-ran with the new host value"


class FakeRecorder:
    """Segments whose replay logs their number (the replay plan of a CUDA graph)."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.opened = log, 0

    def begin(self) -> int:
        self.opened += 1
        return self.opened

    def end(self, handle: int, exc: BaseException | None = None) -> Any:
        log = self.log

        class Graph:
            def replay(self) -> None:
                log.append(f"graph{handle}")
        return Graph()

    @staticmethod
    def eager() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_breakable_replay_plan_is_segment_break_segment(cfg):
    pool = random_pool(cfg, 120, seed=3)
    log: list[str] = []

    def after(step):  # type: ignore[no-untyped-def]
        eager_break.run("caller", log.append, "break")

    ses = GraphSession(get_registry().create("triton", cfg), pool, phase="prefill",
                       mode="breakable", buckets=[4], max_requests=1, writes_kv=False,
                       after_attention=after, recorder=FakeRecorder(log))
    graphs = ses.capture()
    graph = graphs[(ForwardMode.EXTEND, 4)]
    assert graph.plan == [("graph", "graph"), ("eager", "caller"), ("graph", "graph")]
    log.clear()
    res = ses.run(extend_batch(pool, [0], [3]), random_inputs(3, H))
    assert res.replayed and log == ["graph1", "break", "graph2"]


def test_tc_piecewise_plans_the_real_batch_eagerly_at_every_replay(cfg, oracle):
    pool = random_pool(cfg, 120, seed=3)
    ref = get_registry().create("reference", cfg)
    copied: list[torch.Tensor] = []

    def after(step):  # type: ignore[no-untyped-def]
        copied.append(step.outputs[0].clone())

    capture_batch = extend_batch(pool, [0], [6])
    ses = GraphSession(ref, pool, phase="prefill", mode="tc_piecewise", buckets=[8],
                       max_requests=2, writes_kv=False, after_attention=after)
    with pytest.raises(SessionError, match="give a capture batch"):
        ses.capture()
    ses.capture(batches={8: capture_batch})
    batch = extend_batch(pool, [5, 30], [2, 3])
    inputs = random_inputs(5, H, seed=11)
    copied.clear()
    res = ses.run(batch, inputs)
    assert res.replayed and res.bucket == 8
    want = oracle.forward_extend(inputs.q[0], None, None, pool, batch)
    assert _close(res.output, want)
    assert copied and _close(copied[-1][:5], want) and bool((copied[-1][5:] == 0).all())


def test_tc_piecewise_replay_plan_runs_attention_eagerly_before_the_captured_piece(cfg):
    pool = random_pool(cfg, 120, seed=3)
    log: list[str] = []
    ses = GraphSession(get_registry().create("reference", cfg), pool, phase="prefill",
                       mode="tc_piecewise", buckets=[4], max_requests=1, writes_kv=False,
                       after_attention=lambda step: None, recorder=FakeRecorder(log))
    graph = ses.capture(batches={4: extend_batch(pool, [0], [4])})[(ForwardMode.EXTEND, 4)]
    assert graph.plan == [("eager", "attention"), ("graph", "graph")]


def test_the_gate_of_a_plan_decides_and_its_buckets_must_be_captured(cfg):
    plan = resolve("h200", "deepseek-v3", backends="triton", assume_installed=True,
                   config=GraphConfig(decode_batch_sizes=(1, 2)),
                   engine=EngineFacts(max_context_len=256, num_draft_tokens=3),
                   features=ServerFeatures(speculative_decoding=True))
    gate = ReplayGate(plan)
    pool = random_pool(cfg, 120, seed=3)
    backend = get_registry().create("triton", cfg)
    with pytest.raises(SessionError, match=r"\[2\] would be answered with no graph"):
        GraphSession(backend, pool, phase="decode", mode="full", buckets=[1], gate=gate)
    ses = GraphSession.from_plan(backend, pool, gate, "decode", writes_kv=False,
                                 recorder=FakeRecorder([]))
    assert ses.buckets == (1, 2) and ses.forward_modes == {
        ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: 3, ForwardMode.DRAFT_EXTEND: 3}
    ses.capture()
    batch = decode_batch(pool, [7])
    assert ses.decide(batch) == (True, 1, gate.can_replay(replay_batch(batch))[1])
    lora = ses.run(batch, random_inputs(1, H), facts=replay_batch(batch, lora=True))
    assert not lora.replayed and lora.reason.rule == "gate.lora"
    assert ses.counts.eager == {"gate.lora": 1}


def test_replay_batch_carries_every_host_length():
    cfg = MLAConfig(num_heads=H, page_size=16)
    pool = cfg.make_pool(8)
    rb = replay_batch(extend_batch(pool, [3, 0], [2, 5]), return_logprob=True)
    assert (rb.batch_size, rb.num_tokens, rb.prefix_lens, rb.extend_lens, rb.seq_lens) == (
        2, 7, (3, 0), (2, 5), (5, 5))
    assert rb.forward_mode is ForwardMode.EXTEND and rb.return_logprob


def test_inputs_for_the_wrong_number_of_layers_are_refused(decode_session):
    ses, pool = decode_session
    with pytest.raises(SessionError, match="inputs for 1 layers, the session attends 2"):
        ses.run(decode_batch(pool, [4]), random_inputs(1, H, layers=1))


def _agreed(replay: bool, bucket: int | None) -> Agreed:
    return Agreed(replay=replay, bucket=bucket, forward_mode=ForwardMode.DECODE,
                  num_tokens=(1, 4), max_seq_len=40, ineligible_ranks=() if replay else (1,))


def test_the_groups_agreement_decides_the_bucket_and_an_other_ranks_eager(decode_session,
                                                                          oracle):
    ses, pool = decode_session
    batch = decode_batch(pool, [33])
    inputs = random_inputs(1, H, layers=2, seed=12)
    res = ses.run(batch, inputs, agreed=_agreed(True, 4))
    assert res.replayed and res.bucket == 4, "padded to the bucket the group agreed on"
    assert _close(res.outputs[1], oracle.forward_decode(inputs.q[1], None, None, pool, batch,
                                                        layer_id=1))
    before = ses.counts.eager[SYNC_EAGER]
    res = ses.run(batch, inputs, agreed=_agreed(False, None))
    assert not res.replayed and res.rule == SYNC_EAGER and res.reason.rule == "gate.ok"
    assert ses.counts.eager[SYNC_EAGER] == before + 1
    with pytest.raises(SessionError, match="bucket 8, which this session did not capture"):
        ses.run(batch, inputs, agreed=_agreed(True, 8))
    with pytest.raises(SessionError, match="this rank's gate refuses it"):
        ses.run(decode_batch(pool, [3] * 5), random_inputs(5, H, layers=2), agreed=_agreed(True, 4))
