"""ReplayGate: every eligibility rule of seed 000's can_replay_locally."""

from __future__ import annotations

import pytest

from attnreg.graph_policy import (
    GATE_RULES,
    MODEL_PRESETS,
    GraphConfig,
    HiddenCapture,
    ReplayBatch,
    ReplayGate,
    ServerFeatures,
)
from attnreg.registry import ForwardMode, GraphMode

from ._helpers import sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]
CONFIG = GraphConfig(decode_batch_sizes=(1, 2, 4, 8), prefill_num_tokens=(64, 128, 256),
                     prefill_max_requests=4)


def gate(features: ServerFeatures | None = None, config: GraphConfig = CONFIG,
         **kwargs: object) -> ReplayGate:
    plan = sim("cuda:sm90", TEXT_MLA, "flashinfer_mla", config, features)
    return ReplayGate(plan, **kwargs)  # type: ignore[arg-type]


def extend(**kwargs: object) -> ReplayBatch:
    """An extend batch with every fact the rules read (short sequences, no prefix)."""
    base: dict[str, object] = {"forward_mode": ForwardMode.EXTEND, "batch_size": 2,
                               "num_tokens": 100}
    base.update(kwargs)
    base.setdefault("seq_lens", [200] * int(base["batch_size"]))  # type: ignore[call-overload]
    return ReplayBatch(**base)  # type: ignore[arg-type]


def decode(batch_size: int, **kwargs: object) -> ReplayBatch:
    """A decode batch of short sequences."""
    return ReplayBatch(ForwardMode.DECODE, batch_size, seq_lens=[50] * batch_size,
                       **kwargs)  # type: ignore[arg-type]


def rule_of(g: ReplayGate, batch: ReplayBatch) -> str:
    ok, reason = g.can_replay(batch)
    assert ok == (reason.rule == "gate.ok")
    assert reason.rule in GATE_RULES
    return reason.rule


def test_plain_batches_replay() -> None:
    g = gate()
    assert rule_of(g, extend()) == "gate.ok"
    assert rule_of(g, decode(8)) == "gate.ok"


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
def test_speculative_forward_modes_run_eagerly(mode: ForwardMode) -> None:
    assert rule_of(gate(), ReplayBatch(mode, 1, 4)) == "gate.spec_forward_mode"


def test_disabled_phase_never_replays() -> None:
    g = gate(config=GraphConfig.from_user(prefill="disabled"))
    assert rule_of(g, extend()) == "gate.phase_disabled"
    assert rule_of(g, decode(1)) == "gate.ok"


def test_batch_slots_above_the_captured_maximum_run_eagerly() -> None:
    g = gate()
    assert rule_of(g, decode(9)) == "gate.batch_slots"
    assert rule_of(g, extend(batch_size=5)) == "gate.batch_slots"
    assert rule_of(g, extend(batch_size=4)) == "gate.ok"


def test_lora_batches_replay_only_when_lora_was_captured_and_not_under_dp_attention() -> None:
    lora = extend(lora=True)
    assert rule_of(gate(), lora) == "gate.lora"
    assert rule_of(gate(ServerFeatures(lora=True)), lora) == "gate.ok"
    both = ServerFeatures(lora=True, dp_attention=True)
    assert rule_of(gate(both), lora) == "gate.lora"
    assert rule_of(gate(both), decode(2, lora=True)) == "gate.ok"


def test_embeddings_outside_the_graph_run_eagerly() -> None:
    g = gate()
    assert rule_of(g, extend(has_input_embeds=True)) == "gate.input_embeds"
    assert rule_of(g, extend(has_replace_embeds=True)) == "gate.replace_embeds"


def test_hidden_state_capture_must_not_exceed_what_was_captured() -> None:
    assert rule_of(gate(), extend(capture_hidden=HiddenCapture.LAST)) == "gate.hidden_capture"
    g = gate(captured_hidden=HiddenCapture.FULL)
    assert rule_of(g, extend(capture_hidden=HiddenCapture.LAST)) == "gate.ok"


def test_prefill_logprobs_need_an_eager_tail() -> None:
    assert rule_of(gate(), extend(return_logprob=True)) == "gate.logprob_without_eager_tail"
    assert rule_of(gate(eager_logprob_tail=True), extend(return_logprob=True)) == "gate.ok"
    assert rule_of(gate(), decode(2, return_logprob=True)) == "gate.ok"


def test_token_buckets_and_padding_waste() -> None:
    g = gate()
    assert rule_of(g, extend(num_tokens=257)) == "gate.num_tokens_above_max"
    assert rule_of(g, extend(num_tokens=256)) == "gate.ok"
    assert rule_of(g, extend(num_tokens=31)) == "gate.padding_waste"  # 64 > 2 x 31
    assert rule_of(g, extend(num_tokens=32)) == "gate.ok"             # 64 == 2 x 32
    # Unknown tokens are not "fits": the gate answers eagerly, naming the fact.
    ok, reason = g.can_replay(extend(num_tokens=None))
    assert not ok and reason.rule == "gate.fact_missing" and reason.fact == "num_tokens"
    assert reason.needed_by == "gate.num_tokens_above_max"
    strict = gate(config=GraphConfig(prefill_num_tokens=(64, 128), padding_waste_factor=1.0))
    assert rule_of(strict, extend(num_tokens=63)) == "gate.padding_waste"


def test_prefix_rule_applies_only_to_breakable_prefill() -> None:
    # flash_attn_cute on sm90 pins nothing: under tc_piecewise attention runs
    # eagerly between pieces, so a prefix batch still replays.
    plan = sim("cuda:sm90", TEXT_MLA, {"prefill": "flash_attn_cute", "decode": "triton"},
               GraphConfig.from_user(prefill="tc_piecewise"))
    assert plan.prefill.mode is GraphMode.TC_PIECEWISE
    ok, _ = ReplayGate(plan).can_replay(extend(prefix_lens=(5, 0)))
    assert ok


def test_gate_is_deterministic_and_first_rule_wins() -> None:
    g = gate()
    batch = extend(batch_size=9, lora=True, has_input_embeds=True, return_logprob=True)
    answers = {g.can_replay(batch) for _ in range(20)}
    assert len(answers) == 1
    (ok, reason), = answers
    assert not ok and reason.rule == "gate.batch_slots"
    assert str(reason).startswith("gate.batch_slots: ")


def test_gate_rules_list_is_in_evaluation_order() -> None:
    assert GATE_RULES[0] == "gate.spec_forward_mode" and GATE_RULES[-1] == "gate.ok"
    assert len(set(GATE_RULES)) == len(GATE_RULES)


@pytest.mark.parametrize("batch, fact, needed_by", [
    # the case: without seq_lens the context bound is unknown, so no gate.ok
    (ReplayBatch("decode", 1), "seq_lens", "gate.seq_len_above_max"),
    (extend(seq_lens=None), "seq_lens", "gate.seq_len_above_max"),
    (extend(lora=None), "lora", "gate.lora"),
    (extend(has_input_embeds=None), "has_input_embeds", "gate.input_embeds"),
    (extend(has_replace_embeds=None), "has_replace_embeds", "gate.replace_embeds"),
    (extend(capture_hidden=None), "capture_hidden", "gate.hidden_capture"),
    (extend(return_logprob=None), "return_logprob", "gate.logprob_without_eager_tail"),
    (extend(num_tokens=None), "num_tokens", "gate.num_tokens_above_max"),
])
def test_a_missing_fact_is_answered_eagerly_with_its_own_rule(
        batch: ReplayBatch, fact: str, needed_by: str) -> None:
    ok, reason = gate().can_replay(batch)
    assert not ok and reason.rule == "gate.fact_missing"
    assert (reason.fact, reason.needed_by) == (fact, needed_by)
    assert fact in reason.message and needed_by in reason.message
    assert gate().facts(batch).eligible is False


def test_a_fact_no_rule_needs_may_be_missing() -> None:
    # graphs captured with FULL hidden states serve any request; LoRA captured in decode
    assert rule_of(gate(captured_hidden=HiddenCapture.FULL), extend(capture_hidden=None)) \
        == "gate.ok"
    assert rule_of(gate(ServerFeatures(lora=True)), decode(2, lora=None)) == "gate.ok"
    assert rule_of(gate(eager_logprob_tail=True), extend(return_logprob=None)) == "gate.ok"
    assert rule_of(gate(), decode(2, return_logprob=None)) == "gate.ok"  # decode: no tail
    # flashinfer_mla pins MLA under breakable: a prefix never decides, so it may be unknown
    assert rule_of(gate(), extend(prefix_lens=None)) == "gate.ok"


def test_an_idle_batch_knows_every_per_request_fact() -> None:
    idle = ReplayBatch("decode", 0, lora=None, capture_hidden=None, return_logprob=None,
                       has_input_embeds=None, has_replace_embeds=None)
    assert (idle.prefix_lens, idle.seq_lens, idle.lora, idle.capture_hidden) == \
        ((), (), False, HiddenCapture.NULL)
    assert rule_of(gate(), idle) == "gate.ok"


def test_the_phase_word_prefill_means_extend_and_other_words_are_named() -> None:
    assert ReplayBatch("prefill", 1, num_tokens=5).forward_mode is ForwardMode.EXTEND
    assert ReplayBatch("PREFILL", 1).forward_mode is ForwardMode.EXTEND
    with pytest.raises(ValueError, match="unknown forward mode 'prefil'; expected one of "
                       "decode, extend, target_verify, draft_extend .or the phase word "
                       "prefill, meaning extend."):
        ReplayBatch("prefil", 1)


def test_a_verify_batch_has_the_same_new_tokens_in_every_request() -> None:
    with pytest.raises(ValueError, match="same new tokens"):
        ReplayBatch("target_verify", 2, extend_lens=[2, 4])
    with pytest.raises(ValueError, match="not a multiple of batch_size 2"):
        ReplayBatch("target_verify", 2, num_tokens=5)
