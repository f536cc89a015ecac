"""Speculative decoding: verify / draft-extend batches declared, planned and replayed.

Built-in backends declare only the forward modes they run today (decode and
extend), so these tests use generated declarations that declare more.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnreg.graph_policy import (
    MODEL_PRESETS,
    EngineFacts,
    GraphConfig,
    ReplayBatch,
    ReplayGate,
    ServerFeatures,
    resolve,
)
from attnreg.registry import (
    BackendSpec,
    Capabilities,
    CaptureMemory,
    CaptureShape,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    Phase,
    hookimpl,
    load_registry,
)

from ._helpers import declaration, sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]
FULL = (Phase.DECODE, GraphMode.FULL)
VERIFY, DRAFT = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND
EAGER_ALL = (ForwardModeSupport(ForwardMode.DECODE),
             ForwardModeSupport(ForwardMode.EXTEND, None, uniform=False),
             ForwardModeSupport(VERIFY, 8), ForwardModeSupport(DRAFT, 8, uniform=False))
CONFIG = GraphConfig(decode_batch_sizes=(1, 2, 4, 8))


def verifying(name: str = "gen_verify", max_query: int = 4, priority: int = 0,
              platform: str = "cuda:sm90") -> Capabilities:
    """Full decode graphs that also serve verify (uniform) and draft-extend batches."""
    return declaration(name, platform, priority=priority, eager_forward_modes=EAGER_ALL,
                       forward_modes={FULL: (ForwardModeSupport(ForwardMode.DECODE),
                                             ForwardModeSupport(VERIFY, max_query),
                                             ForwardModeSupport(DRAFT, max_query, False))})


def spec(n: int) -> EngineFacts:
    return EngineFacts(num_draft_tokens=n)


def test_declared_verify_graphs_are_planned_with_their_shapes() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, verifying(), CONFIG, engine=spec(3))
    assert [(s.forward_mode, s.how) for s in plan.speculative] == [(VERIFY, "graph"),
                                                                  (DRAFT, "graph")]
    verify = plan.decode.shapes_for(VERIFY)
    assert verify is not None and verify.query_len == 3
    assert verify.batch_sizes == (1, 2, 4, 8) and verify.num_tokens == (3, 6, 12, 24)
    notes = [d for d in plan.decisions if d.rule == "spec.graph"]
    assert len(notes) == 2 and "replay gen_verify's full decode graphs" in notes[0].message
    data = plan.to_dict()
    assert data["speculative"][0]["how"] == "graph"
    assert {c["forward_mode"] for c in data["phases"]["decode"]["captured"]} == \
        {"decode", "target_verify", "draft_extend"}


def test_the_gate_replays_a_verify_batch_where_declared() -> None:
    gate = ReplayGate(sim("cuda:sm90", TEXT_MLA, verifying(), CONFIG, engine=spec(3)))
    batch = ReplayBatch(VERIFY, 3, num_tokens=9, prefix_lens=[10, 200, 30])
    assert gate.can_replay(batch) == (True, gate.can_replay(batch)[1])
    assert gate.can_replay(batch)[1].rule == "gate.ok"
    assert gate.bucket_for(batch) == 4
    wrong = ReplayBatch(VERIFY, 3, num_tokens=6)  # 2 tokens per sequence: not what was captured
    assert gate.can_replay(wrong)[1].rule == "gate.spec_query_len"
    assert gate.can_replay(ReplayBatch(VERIFY, 9, num_tokens=27))[1].rule == "gate.batch_slots"
    unknown = gate.can_replay(ReplayBatch(VERIFY, 2))[1]  # its tokens are not known
    assert (unknown.rule, unknown.fact) == ("gate.fact_missing", "num_tokens")
    # Draft extend: 1..3 tokens per sequence replay; more do not; lengths are required.
    assert gate.can_replay(ReplayBatch(DRAFT, 2, extend_lens=[1, 3], seq_lens=[40, 90]))[0]
    assert gate.can_replay(ReplayBatch(DRAFT, 2, extend_lens=[4, 1]))[1].rule == \
        "gate.spec_query_len"
    unknown = gate.can_replay(ReplayBatch(DRAFT, 2, num_tokens=4))[1]
    assert (unknown.rule, unknown.fact) == ("gate.fact_missing", "extend_lens")


def test_verify_graphs_are_sized_in_the_capture_memory_estimate() -> None:
    seen: list[CaptureShape] = []
    caps = verifying()
    memory = CaptureMemory(bytes_fn=lambda s: seen.append(s) or s.max_num_tokens)
    caps = replace(caps, graph_modes=tuple(replace(g, capture_memory=memory)
                                           if g.phase is Phase.DECODE else g
                                           for g in caps.graph_modes))
    plan = sim("cuda:sm90", TEXT_MLA, caps, CONFIG, engine=spec(3))
    assert plan.decode.capture_memory_bytes == 8 * 3  # the largest bucket x draft tokens
    assert seen[-1].max_batch_size == 8


@pytest.mark.parametrize("engine, features, config, why", [
    (spec(8), None, CONFIG, "serve target_verify (<= 4 tokens per sequence, uniform), not 8"),
    (spec(3), None, GraphConfig.from_user(decode="disabled"), "decode graphs are disabled"),
    (None, ServerFeatures(speculative_decoding=True), CONFIG,
     "the number of draft tokens is unknown"),
])
def test_otherwise_they_run_eagerly_and_the_plan_says_why(engine, features, config,  # type: ignore[no-untyped-def]
                                                          why: str) -> None:
    plan = sim("cuda:sm90", TEXT_MLA, verifying(), config, features, engine)
    verify = plan.speculative_for(VERIFY)
    assert verify is not None and verify.how == "eager" and why in verify.message
    assert plan.decode.shapes_for(VERIFY) is None
    (note, _) = [d for d in plan.decisions if d.rule == "spec.eager"]
    assert why in note.message
    ok, reason = ReplayGate(plan).can_replay(ReplayBatch(VERIFY, 1, num_tokens=8))
    assert not ok and reason.rule == "gate.spec_forward_mode" and why in reason.message


def test_built_in_backends_replay_verify_batches_up_to_their_declared_draft_tokens() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, engine=spec(4))
    verify = plan.speculative_for(VERIFY)
    assert verify is not None and verify.how == "graph"
    assert "flashinfer_mla declares target_verify (<= 16 tokens per sequence" in \
        verify.message
    assert plan.decode.mode is GraphMode.FULL  # plain decode graphs are unaffected
    # more drafts than any built-in declares (flashinfer_mla's 16): nothing serves them
    verify = sim("cuda:sm90", TEXT_MLA, engine=spec(17)).speculative_for(VERIFY)
    assert verify is not None and verify.how == "unserved"
    assert "does not declare target_verify batches of 17 tokens" in verify.message


def test_speculative_decoding_off_plans_nothing_for_it() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, verifying(), CONFIG)
    assert plan.speculative == () and plan.decode.shapes_for(VERIFY) is None
    reason = ReplayGate(plan).can_replay(ReplayBatch(VERIFY, 1, num_tokens=3))[1]
    assert reason.rule == "gate.spec_forward_mode" and "speculative decoding is off" in \
        reason.message


def test_selection_prefers_a_decode_backend_whose_graphs_serve_verify() -> None:
    plain = declaration("gen_plain", "rocm:gfx942", priority=50)
    verify = verifying("gen_verify", priority=10, platform="rocm:gfx942")

    class Plugin:
        @hookimpl
        def attnreg_register_backends(self, register):  # type: ignore[no-untyped-def]
            for caps in (plain, verify):
                register(BackendSpec(name=caps.backend, summary="generated",
                                     capabilities=lambda ctx, c=caps: replace(
                                         c, platform=ctx.platform),
                                     runtime="attnreg.backends.reference:ReferenceBackend"))

    reg = load_registry(autoload=False, extra_plugins=[("gen_plugin", Plugin())])
    without = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True)
    assert without.decode.backend == "gen_plain"
    plan = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True,
                   engine=spec(4))
    assert plan.decode.backend == "gen_verify" and plan.prefill.backend == "gen_plain"
    assert "gen_plain (priority 50: target_verify graphs would not run" in \
        plan.decode.backend_choice
    assert plan.speculative_for(VERIFY).how == "graph"  # type: ignore[union-attr]
