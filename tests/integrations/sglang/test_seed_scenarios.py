"""The seed scenarios through sglang 0.5.23's full ``resolve_once()``: its own rules
(a fresh process, plugin installed but off) against attnreg's (plugin loaded by
sglang's ``load_plugins()`` with ``ATTNREG_SGLANG=1``).

Every difference between the two columns is one the doc lists with its reason
(docs/integrations/sglang.md, "Outcomes against sglang's own rules").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from attnreg.integrations.sglang.steps import DECLARATION_SOURCE, outcome_of

from . import _sglang_env

ARCH_RULE_SOURCE = "_disable_prefill_cuda_graph_for_deepseek_trtllm_mla"


@dataclass(frozen=True)
class Expected:
    """sglang 0.5.23's own (prefill, decode), attnreg's, and the rule ids that must
    appear in the bridge's outcome (attnreg's or the bridge's)."""

    sglang: tuple[str, str]
    attnreg: tuple[str, str]
    rules: tuple[str, ...]


EXPECTED: dict[str, Expected] = {
    # sglang: the arch-named rule disables prefill for any pool.  attnreg: trtllm_mla's
    # declared fallback is cheap for a bf16 pool, so breakable stays (seed 002's intent).
    "dsv3_trtllm_bf16_b200": Expected(("disabled", "full"), ("breakable", "full"),
                                      ("backend.fallback_in_effect", "backend.pinning")),
    "dsv3_trtllm_fp8_b200": Expected(("disabled", "full"), ("disabled", "full"),
                                     ("backend.high_cost_fallback",)),
    # seed 002 on a multimodal model: sglang keeps breakable with an FP8 pool and pays
    # the pool conversion on every replay; attnreg runs prefill eagerly.
    # Both: the tc_piecewise upgrade is not applied (this sglang has no tc_piecewise).
    "kimi_trtllm_fp8_b200": Expected(("breakable", "full"), ("disabled", "full"),
                                     ("model.piecewise_upgrade", "backend.high_cost_fallback")),
    "kimi_trtllm_bf16_b200": Expected(("breakable", "full"), ("breakable", "full"),
                                      ("model.piecewise_upgrade", "backend.fallback_in_effect")),
    # The user's lock beats the soft rule, which is recorded as yielding.
    "dsv3_trtllm_fp8_locked_breakable": Expected(("breakable", "full"), ("breakable", "full"),
                                                 ("user.locked", "backend.high_cost_fallback")),
    # fa3 has no attnreg declaration: sglang's rules decide, unchanged.
    "dsv3_fa3_h200": Expected(("breakable", "full"), ("breakable", "full"), ("sglang.gap",)),
    # fa4 maps to flash_attn_cute, whose declaration has no sm90 decode kernel: attnreg
    # cannot judge what sglang runs for decode, so sglang decides decode alone; prefill
    # stays attnreg's.
    "dsv3_fa4_h200": Expected(("breakable", "full"), ("breakable", "full"),
                              ("sglang.gap", "sglang.declared")),
    # A per-phase gap: cutlass_mla has no attnreg declaration, so decode is sglang's;
    # prefill stays attnreg's trtllm_mla, whose bf16 fallback keeps breakable (sglang's
    # arch rule disables it).
    "dsv3_trtllm_prefill_cutlass_decode_b200": Expected(
        ("disabled", "full"), ("breakable", "full"),
        ("sglang.gap", "backend.fallback_in_effect")),
    "dsv3_triton_h200": Expected(("breakable", "full"), ("breakable", "full"),
                                 ("backend.pinning",)),
    "dsv3_flashinfer_h200": Expected(("breakable", "full"), ("breakable", "full"),
                                     ("backend.pinning",)),
    # attnreg's triton declares verify and draft-extend batches of up to 8 tokens in its
    # FULL decode graphs: the plan captures them at 4 tokens per sequence (spec.graph).
    "dsv3_triton_h200_mtp4": Expected(("breakable", "full"), ("breakable", "full"),
                                      ("spec.graph",)),
    "dsv3_triton_h200_pp2": Expected(("disabled", "full"), ("disabled", "full"),
                                     ("feature.pipeline_parallel",)),
    "dsv3_triton_h200_a2a_mooncake": Expected(("disabled", "full"), ("disabled", "full"),
                                              ("sglang.engine_rule:unvalidated_a2a",)),
}


def test_every_scenario_has_an_expectation() -> None:
    names = {s.name for s in _sglang_env.SCENARIOS} - {"dsv3_locked_tc_piecewise",
                                                       "dsv3_reference_mi300x"}
    assert names == set(EXPECTED)


@pytest.fixture(scope="module")
def sglang_own(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every scenario under sglang's own rules: a fresh process, the plugin installed
    but switched off."""
    env = {k: v for k, v in os.environ.items() if k != "ATTNREG_SGLANG"}
    script = Path(_sglang_env.__file__)
    out = subprocess.run([sys.executable, str(script), str(tmp_path_factory.mktemp("own"))],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sglang_own_rules(sglang_own: dict[str, dict], name: str) -> None:
    own = sglang_own[name]
    assert (own["prefill"], own["decode"]) == EXPECTED[name].sglang
    assert DECLARATION_SOURCE not in own["sources"], "the plugin must do nothing when off"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attnreg_decides(plugin_on: None, models: dict[str, Path], name: str) -> None:
    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME[name], models)
    assert "error" not in result, result
    expected = EXPECTED[name]
    assert (result["prefill"], result["decode"]) == expected.attnreg
    outcome = outcome_of(result["server_args"])
    assert outcome is not None
    for rule in expected.rules:
        assert rule in outcome.rule_ids, (rule, outcome.rule_ids)
    decided = {p.value for p in outcome.decided}
    # The arch-named rule never runs once attnreg owns prefill.
    if "prefill" in decided:
        assert ARCH_RULE_SOURCE not in result["sources"]
    if outcome.plan is None:  # a gap: sglang's rules, nothing declared by attnreg
        assert not decided and DECLARATION_SOURCE not in result["sources"]
    else:
        assert result["sources"].count(DECLARATION_SOURCE) >= len(decided)  # one per phase
        for phase in decided:
            assert outcome.plan.phase(phase).mode.value == result[phase]
    # A phase with a gap of its own is sglang's, and says so.
    for phase in {"prefill", "decode"} - decided:
        assert any(d.rule == "sglang.gap" for d in outcome.bridge), phase


def test_a_changed_mode_names_its_rule(plugin_on: None, models: dict[str, Path]) -> None:
    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["kimi_trtllm_fp8_b200"],
                                      models)
    outcome = outcome_of(result["server_args"])
    assert outcome is not None and outcome.plan is not None
    downgrade = [d for d in outcome.decisions if d.changed and d.phase.value == "prefill"]
    assert [d.rule for d in downgrade] == ["backend.high_cost_fallback"]
    assert "HIGH cost for a fp8_e4m3 KV pool" in downgrade[0].message
    declared = [d for d in outcome.bridge if d.rule == "sglang.declared"
                and d.phase is not None and d.phase.value == "prefill"]
    assert "changed by backend.high_cost_fallback" in declared[0].message


def test_a_lock_on_a_mode_sglang_lacks_fails_with_the_reason(
        sglang_own: dict[str, dict], plugin_on: None, models: dict[str, Path]) -> None:
    scenario = _sglang_env.SCENARIO_BY_NAME["dsv3_locked_tc_piecewise"]
    own = sglang_own[scenario.name]
    assert own["error"] == "ValueError" and "tc_piecewise" in own["message"]
    result = _sglang_env.run_scenario(scenario, models)
    assert result["error"] == "SglangGraphPolicyError"
    assert "sglang.host_modes: prefill tc_piecewise was set explicitly" in result["message"]
    assert "accepts only breakable, disabled, full" in result["message"]


def test_the_upgrade_is_refused_for_the_host_lacking_tc_piecewise(
        plugin_on: None, models: dict[str, Path]) -> None:
    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["kimi_trtllm_bf16_b200"],
                                      models)
    outcome = outcome_of(result["server_args"])
    assert outcome is not None and outcome.plan is not None
    upgrade = [d for d in outcome.decisions if d.rule == "model.piecewise_upgrade"]
    assert len(upgrade) == 1 and not upgrade[0].changed
    assert "engine.mode_unsupported" in upgrade[0].message


def test_logs_carry_rule_ids(plugin_on: None, models: dict[str, Path],
                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="attnreg.integrations.sglang")
    _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["dsv3_trtllm_fp8_b200"], models)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnreg.integrations.sglang"]
    assert any("backend.high_cost_fallback" in line for line in lines)
    assert any("sglang.declared" in line for line in lines)
    assert any("sglang.deferred" in line for line in lines)
    # resolve()'s own logger is silenced inside sglang: one voice, no duplicates.
    assert not [r for r in caplog.records if r.name == "attnreg.graph_policy"]


def test_a_rocm_server_is_decided_by_attnreg(plugin_on: None, models: dict[str, Path],
                                              tmp_path: Path) -> None:
    """sglang reports HIP without an arch; the bridge reads gfx942 from the KFD topology
    and attnreg's plan decides (the reference declares no graph capture)."""
    scenario = _sglang_env.SCENARIO_BY_NAME["dsv3_reference_mi300x"]
    result = _sglang_env.run_scenario(scenario, models, kfd_root=tmp_path)
    assert "error" not in result, result
    outcome = outcome_of(result["server_args"])
    assert outcome is not None and outcome.plan is not None
    assert str(outcome.facts.platform) == "rocm:gfx942"
    assert {p.value for p in outcome.decided} == {"prefill", "decode"}
    assert (result["prefill"], result["decode"]) == ("disabled", "disabled")
    assert "backend.capture_unsupported" in outcome.rule_ids
    assert "platform.arch_required" not in outcome.rule_ids


def test_a_rocm_server_whose_arch_cannot_be_read_is_left_to_sglang(
        plugin_on: None, models: dict[str, Path], tmp_path: Path) -> None:
    from dataclasses import replace

    scenario = replace(_sglang_env.SCENARIO_BY_NAME["dsv3_reference_mi300x"], rocm=0)
    result = _sglang_env.run_scenario(scenario, models, kfd_root=tmp_path)
    outcome = outcome_of(result["server_args"])
    assert outcome is not None and outcome.plan is None
    assert any("architecture could not be read" in g for g in outcome.facts.gaps)
