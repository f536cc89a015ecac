"""The plugin as sglang loads it, and the facts the bridge reads from real ServerArgs."""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from attnreg.graph_policy import GraphConfig
from attnreg.integrations.sglang import plugin, steps
from attnreg.integrations.sglang.adapter import (
    SglangGraphPolicyError,
    check_host_locks,
    plan_for,
)
from attnreg.integrations.sglang.facts import host_modes
from attnreg.registry.capabilities import DType, GraphMode, Phase
from attnreg.registry.platform import Platform

from . import _sglang_env


def test_entry_point_is_in_sglangs_plugin_group() -> None:
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "attnreg"]
    assert [ep.value for ep in eps] == ["attnreg.integrations.sglang.plugin:register"]
    assert eps[0].load() is plugin.register


def test_load_plugins_installs_both_replacements(plugin_on: None) -> None:
    from sglang.srt.arg_groups import cuda_graph_hook

    for target, step in plugin.HOOK_TARGETS.items():
        installed = getattr(cuda_graph_hook, target.rsplit(".", 1)[1])
        original = inspect.unwrap(installed)
        assert installed is not original, f"{target} was not replaced"
        assert original.__module__ == "sglang.srt.arg_groups.cuda_graph_hook"
        # sglang's run_hook keys on __name__: the step keeps its place and name.
        assert installed.__name__ == original.__name__
        assert getattr(steps, step).__name__ == step


def test_host_modes_of_sglang_0_5_23() -> None:
    modes = host_modes()
    assert GraphMode.TC_PIECEWISE not in modes[Phase.PREFILL]
    assert modes[Phase.PREFILL] == {GraphMode.FULL, GraphMode.BREAKABLE, GraphMode.DISABLED}
    assert check_host_locks({Phase.PREFILL: GraphMode.BREAKABLE}, modes) is None
    with pytest.raises(SglangGraphPolicyError, match="sglang.host_modes"):
        check_host_locks({Phase.PREFILL: GraphMode.TC_PIECEWISE}, modes)


def _outcome(models: dict[str, Path], name: str) -> steps.SglangOutcome:
    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME[name], models)
    outcome = steps.outcome_of(result["server_args"])
    assert outcome is not None
    return outcome


def test_facts_of_deepseek_v3_fp8_on_blackwell(plugin_on: None, models: dict[str, Path]) -> None:
    facts = _outcome(models, "dsv3_trtllm_fp8_b200").facts
    assert facts.platform == Platform.parse("cuda:sm100")
    assert facts.architecture == "DeepseekV3ForCausalLM"
    assert facts.model is not None
    assert (facts.model.kv_dtype, facts.model.act_dtype) == (DType.FP8_E4M3, DType.BF16)
    assert facts.model.num_heads == 128 and not facts.model.multimodal
    assert {p: m.attnreg for p, m in facts.backends.items()} == {
        Phase.PREFILL: "trtllm_mla", Phase.DECODE: "trtllm_mla"}
    assert facts.backends_by_user == frozenset()  # sglang's default choice
    assert facts.locked == frozenset()
    assert facts.engine.max_context_len == 163840
    assert facts.engine.page_size == 64  # sglang's trtllm_mla page constraint, resolved
    assert facts.engine.prefill_graph_modes == {GraphMode.BREAKABLE, GraphMode.DISABLED}
    assert facts.engine.decode_graph_modes == {GraphMode.FULL, GraphMode.DISABLED}
    assert facts.config is not None
    assert facts.config.decode_batch_sizes[0] == 1 and len(facts.config.decode_batch_sizes) > 8
    assert facts.config.prefill_num_tokens[-1] == 4096


def test_facts_of_a_multimodal_model(plugin_on: None, models: dict[str, Path]) -> None:
    facts = _outcome(models, "kimi_trtllm_fp8_b200").facts
    assert facts.model is not None
    assert facts.model.multimodal and facts.model.piecewise_validated
    assert facts.model.num_heads == 64


def test_features_and_locks_are_read(plugin_on: None, models: dict[str, Path]) -> None:
    facts = _outcome(models, "dsv3_triton_h200_pp2").facts
    assert facts.features.pipeline_parallel
    assert facts.backends_by_user == {Phase.PREFILL, Phase.DECODE}
    locked = _outcome(models, "dsv3_trtllm_fp8_locked_breakable").facts
    assert locked.locked == {Phase.PREFILL}
    assert locked.config is not None and locked.config.locked == {"prefill_mode"}


def test_gap_names_what_attnreg_cannot_represent(plugin_on: None,
                                                 models: dict[str, Path]) -> None:
    outcome = _outcome(models, "dsv3_fa3_h200")
    assert outcome.plan is None
    assert any("fa3" in gap for gap in outcome.facts.all_gaps)
    assert set(outcome.facts.phase_gaps) == {Phase.PREFILL, Phase.DECODE}
    assert [d.rule for d in outcome.bridge if d.rule == "sglang.gap"] == ["sglang.gap"]


def test_a_host_with_tc_piecewise_gets_the_upgrade(plugin_on: None,
                                                   models: dict[str, Path]) -> None:
    """The same attnreg on a host that lists tc_piecewise (sglang <= 0.5.21): the
    validated multimodal upgrade applies where the backend captures it natively."""
    from dataclasses import replace

    facts = _outcome(models, "kimi_trtllm_bf16_b200").facts
    with_tc = replace(facts.engine, prefill_graph_modes=facts.engine.prefill_graph_modes
                      | {GraphMode.TC_PIECEWISE})
    triton = replace(facts.backends[Phase.PREFILL], attnreg="triton")
    facts = replace(facts, platform=Platform.parse("cuda:sm90"),
                    backends={Phase.PREFILL: triton, Phase.DECODE: triton})
    plan = plan_for(replace(facts, engine=with_tc))
    assert plan.prefill.mode is GraphMode.TC_PIECEWISE
    assert "model.piecewise_upgrade" in [d.rule for d in plan.decisions if d.changed]
    # ... and with 0.5.23's host modes the upgrade is refused, with the reason.
    plan = plan_for(facts)
    assert plan.prefill.mode is GraphMode.BREAKABLE
    refused = [d for d in plan.decisions if d.rule == "model.piecewise_upgrade"]
    assert "engine.mode_unsupported" in refused[0].message


def test_a_locked_mode_that_breaks_a_hard_rule_fails_startup(plugin_on: None,
                                                             models: dict[str, Path]) -> None:
    from dataclasses import replace

    facts = _outcome(models, "dsv3_trtllm_fp8_locked_breakable").facts
    assert facts.config is not None
    locked_pp = replace(facts, config=GraphConfig.from_user(prefill="breakable"),
                        features=replace(facts.features, two_batch_overlap=True))
    with pytest.raises(SglangGraphPolicyError, match="feature.two_batch_overlap") as info:
        plan_for(locked_pp)
    assert isinstance(info.value, ValueError)


def test_doc_names_every_kept_engine_rule() -> None:
    from attnreg.integrations.sglang.engine_rules import ENGINE_RULES

    doc = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "sglang.md"
    text = doc.read_text()
    assert [r.name for r in ENGINE_RULES if f"sglang.engine_rule:{r.name}" not in text] == []


def test_resolved_server_args_still_pickle(plugin_on: None, models: dict[str, Path]) -> None:
    """sglang sends ServerArgs to its scheduler processes: the outcome kept on them
    must pickle (a MappingProxyType or a lambda there would break the server)."""
    import pickle

    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["kimi_trtllm_fp8_b200"],
                                      models)
    copy = pickle.loads(pickle.dumps(result["server_args"]))
    outcome = steps.outcome_of(copy)
    assert outcome is not None and outcome.after[Phase.PREFILL] is GraphMode.DISABLED


def test_a_release_without_the_hook_points_keeps_sglangs_rules(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("ATTNREG_SGLANG", "1")
    monkeypatch.setitem(plugin.HOOK_TARGETS, "sglang.srt.arg_groups.cuda_graph_hook.gone",
                        "policy_step")
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    caplog.set_level("WARNING", logger="attnreg.integrations.sglang")
    plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    assert "bridge NOT installed" in caplog.text and "cuda_graph_hook.gone" in caplog.text


@pytest.mark.parametrize("version", ["0.5.24", "0.5.22", "0.6.0", "0.5.23rc1"])
def test_another_sglang_version_stands_aside_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        version: str) -> None:
    import importlib.metadata

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv("ATTNREG_SGLANG", "1")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    caplog.set_level("WARNING", logger="attnreg.integrations.sglang")
    plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    assert f"sglang {version} is outside the range the bridge is tested with " \
           "(>=0.5.23,<0.5.24)" in caplog.text


def test_the_tested_range_is_the_extras_bound() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["sglang"]
    low, high = plugin.TESTED_SGLANG
    assert extra == [f"sglang>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"]
    assert plugin.sglang_version_problem("0.5.23") is None
    assert plugin.sglang_version_problem("0.5.23.post1") is None


def test_a_release_without_the_runtime_hook_points_keeps_sglangs_rules(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from attnreg.integrations.sglang import runtime_gate

    monkeypatch.setenv("ATTNREG_SGLANG", "1")
    monkeypatch.setitem(runtime_gate.HOOKS, "sglang.srt.managers.gone.f",
                        ("AROUND", lambda original, *a, **k: original(*a, **k)))
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    caplog.set_level("WARNING", logger="attnreg.integrations.sglang")
    plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    assert "bridge NOT installed" in caplog.text and "sglang.srt.managers.gone.f" in caplog.text


def test_a_declaration_gap_names_the_phases_its_reasons_are_about() -> None:
    from attnreg.integrations.sglang.adapter import DeclarationGap

    assert DeclarationGap(["decode: backend.unavailable: x"]).phases == {Phase.DECODE}
    assert DeclarationGap(["prefill breakable (set by the user): backend.x: y",
                           "decode: backend.unavailable: x"]).phases == {Phase.PREFILL,
                                                                         Phase.DECODE}
    # a reason about no phase (the platform) concerns the whole server
    assert DeclarationGap(["platform.arch_required: x"]).phases == {Phase.PREFILL,
                                                                   Phase.DECODE}
