"""ReplayGate with a cost profile: per-batch absorbed graph or eager MHA (issue 10)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from attnreg.graph_policy import (
    GATE_RULES,
    MODEL_PRESETS,
    GraphConfig,
    ModelFacts,
    ReplayBatch,
    ReplayGate,
)
from attnreg.graph_policy import cost_profile as cp
from attnreg.graph_policy.cost_profile import CostProfileError, save_profile
from attnreg.registry import ForwardMode, GraphMode

from ._helpers import TEXT_MLA, mutated, prefill, profile, profile_dict, sim

_US = re.compile(r"(\d+\.\d) us/layer")


def gate(**kwargs: object) -> ReplayGate:
    return ReplayGate(sim(), cost_profile=profile(**kwargs))  # type: ignore[arg-type]


def test_the_plan_under_test_runs_absorbed_mla_in_a_breakable_graph() -> None:
    plan = sim()
    assert plan.prefill.mode is GraphMode.BREAKABLE
    assert plan.prefill.pinned_method is not None and plan.prefill.pinned_method.value == "mla"
    assert gate().uses_cost_model


def test_short_extends_replay_long_extends_run_eager_mha() -> None:
    g = gate()
    ok, reason = g.can_replay(prefill(prefix=0, extend=512))
    assert ok and reason.rule == "gate.ok"
    assert reason.cost is not None and reason.cost.graph_wins
    assert "absorbed graph" in reason.message and "eager MHA" in reason.message
    ok, reason = g.can_replay(prefill(prefix=4096, extend=4096))
    assert not ok and reason.rule == "gate.cost_model"
    assert reason.cost is not None and not reason.cost.graph_wins
    assert str(reason).startswith("gate.cost_model: eager MHA is predicted no slower")


def test_the_reason_carries_both_predictions() -> None:
    g = gate()
    for batch in (prefill(0, 512), prefill(4096, 4096)):
        _, reason = g.can_replay(batch)
        assert reason.cost is not None
        shown = [float(v) for v in _US.findall(reason.message)]
        assert len(shown) == 2, reason.message
        assert sorted(shown) == sorted([round(reason.cost.graph_us, 1),
                                        round(reason.cost.eager_us, 1)])
        assert "profile triton on cuda:sm90" in reason.message


def test_the_switch_is_at_the_profile_crossover() -> None:
    # The synthetic profile crosses over at extend 1249 for prefix 0 (test_cost_profile).
    g = gate()
    assert g.can_replay(prefill(0, 1249))[0]
    assert not g.can_replay(prefill(0, 1250))[0]


def test_a_tie_runs_eagerly() -> None:
    g = gate(absorbed_attention={"one": 0.0}, mha_attention={"one": 0.0},
             eager_host={"one": 0.0}, layer_gpu={"one": 5.0})
    ok, reason = g.can_replay(prefill(0, 64))
    assert reason.cost is not None and reason.cost.graph_us == reason.cost.eager_us
    assert not ok and reason.rule == "gate.cost_model"
    assert "ties run eagerly" in reason.message


def test_padding_counts_against_the_graph() -> None:
    # Projections cost 1 us per token and an eager layer 1500 us of host time: 1100
    # tokens pad to 2048 in the graph (2048 us > 1500 us eager); 1024 tokens do not pad.
    g = gate(layer_gpu={"q_tokens": 1.0}, absorbed_attention={"one": 0.0},
             mha_attention={"one": 0.0}, eager_host={"one": 1500.0})
    ok, reason = g.can_replay(prefill(0, 1100))
    assert not ok and "padded to 2048" in reason.message
    ok, _ = g.can_replay(prefill(0, 1024))  # exactly a bucket: no padding
    assert ok


def test_without_a_profile_todays_rule_stands() -> None:
    g = ReplayGate(sim())
    assert not g.uses_cost_model and g.cost_profile is None
    assert "no cost profile" in g.cost_model_note
    ok, reason = g.can_replay(prefill(4096, 4096))
    assert ok and reason.rule == "gate.ok" and reason.cost is None


@pytest.mark.parametrize("kwargs, why", [
    ({"backend": "flashinfer_mla"}, "runs prefill with triton on cuda:sm90"),
    ({"platform": "cuda:sm100"}, "runs prefill with triton on cuda:sm90"),
    ({"kv_dtype": "fp8_e4m3"}, "with a bf16 KV pool"),
])
def test_a_profile_for_another_backend_platform_or_kv_dtype_is_ignored(
        kwargs: dict[str, str], why: str) -> None:
    g = ReplayGate(sim(), cost_profile=profile(**kwargs))
    assert not g.uses_cost_model and g.cost_profile is None
    assert "ignored" in g.cost_model_note and why in g.cost_model_note
    ok, reason = g.can_replay(prefill(4096, 4096))
    assert ok and reason.cost is None  # today's rule


def test_the_cost_model_decides_only_breakable_graphs_that_run_absorbed_mla() -> None:
    piecewise = sim(config=GraphConfig.from_user(prefill="tc_piecewise"))
    assert piecewise.prefill.mode is GraphMode.TC_PIECEWISE
    g = ReplayGate(piecewise, cost_profile=profile())
    assert not g.uses_cost_model and "decides only breakable graphs" in g.cost_model_note
    ok, reason = g.can_replay(prefill(4096, 4096))
    assert ok and reason.rule == "gate.ok" and reason.cost is None


def test_a_model_without_an_mha_companion_always_replays() -> None:
    # DSA without a top-k: planned dense, prefill always absorbed (no MHA companion)
    sparse = sim(model=ModelFacts(dsa_sparse=True))
    g = ReplayGate(sparse, cost_profile=profile())
    assert not g.uses_cost_model
    assert g.can_replay(prefill(4096, 4096))[1].rule == "gate.ok"


def test_a_backend_that_pins_nothing_keeps_the_mha_companion_rule() -> None:
    plan = sim({"prefill": "flash_attn_cute", "decode": "triton"})
    assert plan.prefill.mode is GraphMode.BREAKABLE and plan.prefill.pinned_method is None
    g = ReplayGate(plan, cost_profile=profile(backend="flash_attn_cute"))
    assert not g.uses_cost_model
    assert g.can_replay(prefill(4096, 64))[1].rule == "gate.mha_companion_prefix"


def test_earlier_rules_still_win() -> None:
    g = gate()
    assert g.can_replay(prefill(0, 64, lora=True))[1].rule == "gate.lora"
    assert g.can_replay(prefill(0, 9000))[1].rule == "gate.num_tokens_above_max"
    decode = ReplayBatch(ForwardMode.DECODE, 4, seq_lens=(10,) * 4)
    assert g.can_replay(decode)[1].rule == "gate.ok"  # decode is not the cost model's


def test_unknown_lengths_are_answered_eagerly_not_guessed() -> None:
    # Issue 16: the same batch must get the same answer at schedule and forward time,
    # so with a cost model the per-request lengths are needed, never estimated: a batch
    # without them runs eagerly (gate.fact_missing), naming the length.
    g = gate()
    for batch, fact in [
            (ReplayBatch(ForwardMode.EXTEND, 1, prefix_lens=(4096,)), "num_tokens"),
            (ReplayBatch(ForwardMode.EXTEND, 2, num_tokens=1024, prefix_lens=(0, 0),
                         seq_lens=(512, 512)), "extend_lens"),
            (ReplayBatch(ForwardMode.EXTEND, 2, extend_lens=(512, 512), seq_lens=(512, 512)),
             "prefix_lens")]:
        ok, reason = g.can_replay(batch)
        assert not ok and (reason.rule, reason.fact) == ("gate.fact_missing", fact), reason
    # Without a cost model neither is needed: no rule reads them.
    plain = ReplayGate(sim())
    assert plain.can_replay(ReplayBatch(ForwardMode.EXTEND, 2, num_tokens=1024,
                                        seq_lens=(512, 512)))[0]


def test_extend_lens_stand_in_for_num_tokens() -> None:
    g = gate()
    batch = ReplayBatch(ForwardMode.EXTEND, 1, prefix_lens=(0,), extend_lens=(9000,))
    assert batch.tokens == 9000
    assert g.can_replay(batch)[1].rule == "gate.num_tokens_above_max"


@pytest.mark.parametrize("kwargs, problem", [
    ({"batch_size": 2, "extend_lens": (4,)}, "1 extend_lens for batch_size 2"),
    ({"batch_size": 1, "extend_lens": (4,), "prefix_lens": (0, 0)},
     "2 prefix_lens for batch_size 1"),
    ({"batch_size": 1, "extend_lens": (4,), "num_tokens": 5}, "num_tokens 5 != sum"),
])
def test_inconsistent_lengths_are_refused(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        ReplayBatch(ForwardMode.EXTEND, **kwargs)  # type: ignore[arg-type]


def test_the_decision_is_deterministic_across_ranks(tmp_path: Path) -> None:
    path = save_profile(profile_dict(), tmp_path / "p.json")
    # Two "ranks" load the same file independently.
    ranks = [ReplayGate(sim(), cost_profile=str(path)) for _ in range(2)]
    for batch in (prefill(0, 1249), prefill(0, 1250), prefill(4096, 300, batch_size=3)):
        answers = {g.can_replay(batch) for g in ranks for _ in range(5)}
        assert len(answers) == 1, answers


def test_auto_uses_the_shipped_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp, "shipped_profile_dir", lambda: tmp_path)
    assert not ReplayGate(sim(), cost_profile="auto").uses_cost_model  # nothing shipped
    save_profile(profile_dict(), tmp_path / "h200-triton.json")
    g = ReplayGate(sim(), cost_profile="auto")
    assert g.uses_cost_model and g.cost_profile is not None
    assert g.cost_profile.source.endswith("h200-triton.json")
    assert not g.can_replay(prefill(4096, 4096))[0]


def test_a_malformed_profile_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema": "attnreg.cost_profile"')
    with pytest.raises(CostProfileError, match=f"cost profile {re.escape(str(path))}: is not "
                                               "valid JSON"):
        ReplayGate(sim(), cost_profile=str(path))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(mutated(lambda d: d["terms"].pop("graph_host"))))
    with pytest.raises(CostProfileError, match=r"bad.json: at `terms.graph_host`: missing"):
        ReplayGate(sim(), cost_profile=bad)


def test_the_note_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="attnreg.graph_policy"):
        gate()
    assert any("cost model from <synthetic>" in r.getMessage() for r in caplog.records)


def test_cost_model_rule_is_registered_before_ok() -> None:
    assert GATE_RULES[-2:] == ("gate.cost_model", "gate.ok")


def test_text_model_preset_matches_the_helper() -> None:
    # The helper's model is the deepseek-v3 preset's facts (128 heads, bf16, MLA).
    preset = MODEL_PRESETS["deepseek-v3"]
    assert (preset.num_heads, preset.kv_dtype, preset.attention) == \
        (TEXT_MLA.num_heads, TEXT_MLA.kv_dtype, TEXT_MLA.attention)


def test_the_note_says_when_heads_are_extrapolated() -> None:
    assert "scaled linearly" not in gate().cost_model_note  # 128 heads, calibrated at 128
    facts = TEXT_MLA.with_overrides(num_heads=64)
    g = ReplayGate(sim(model=facts), cost_profile=profile())
    assert g.uses_cost_model
    assert "calibrated at 128 heads; its per-head terms are scaled linearly to 64" in \
        g.cost_model_note
