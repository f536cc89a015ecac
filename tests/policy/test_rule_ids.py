"""RULES is the single source of truth for policy rule ids.

Statically: every id the policy code emits or mentions is in RULES, and every
RULES entry is emitted somewhere.  At run time: the record types refuse an
unknown id, and the severity and source of every decision a sweep of plans
produces are the ones RULES lists for its id.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from attnreg import graph_policy
from attnreg.graph_policy import (
    FEATURE_RULES,
    GATE_RULES,
    RULES,
    Decision,
    GraphConfig,
    ReplayBatch,
    ReplayGate,
    ReplayReason,
    ServerFeatures,
    Severity,
    Source,
)
from attnreg.graph_policy.decisions import Violation
from attnreg.registry import GraphMode, GraphPolicyError, Phase

from ._helpers import sim

PACKAGE = Path(graph_policy.__file__).parent
#: Calls whose first argument (or ``rule=``/``rule_id=``) is a rule id being emitted.
_EMITTERS = {"Decision", "Violation", "ReplayReason", "tagged"}
_ID = re.compile(r"^[a-z_]+\.[a-z_0-9]+$")
#: A rule id mentioned anywhere in a string (messages point at other rules).
_MENTION = re.compile(r"(?<![\w.])((?:default|user|platform|backend|model|budget|feature|gate)"
                      r"\.[a-z_][a-z_0-9]*)(?![\w(])")


def _sources() -> list[Path]:
    files = sorted(p for p in PACKAGE.glob("*.py") if p.name != "rule_ids.py")
    assert len(files) >= 10, files  # the package is really being scanned
    return files


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else \
        func.attr if isinstance(func, ast.Attribute) else ""


def emitted_ids() -> dict[str, list[str]]:
    """Literal ids passed to an emitter, with where (``file:line``)."""
    out: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call) or _call_name(node) not in _EMITTERS:
                continue
            args = list(node.args[:1]) + [k.value for k in node.keywords
                                          if k.arg in ("rule", "rule_id")]
            for arg in args:
                # An id may be a conditional expression of two literal ids.
                for const in ast.walk(arg):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str) \
                            and _ID.match(const.value):
                        out.setdefault(const.value, []).append(f"{path.name}:{node.lineno}")
    return out


def mentioned_ids() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for rule in _MENTION.findall(node.value):
                    out.setdefault(rule, []).append(f"{path.name}:{node.lineno}")
    return out


def test_the_scan_finds_the_emitters():
    # Guards the tests below against checking nothing.
    found = emitted_ids()
    assert {"gate.mha_companion_prefix", "backend.capture_unsupported",
            "backend.none_fits", "user.backend", "backend.selected"} <= set(found), found


def test_every_emitted_or_mentioned_id_is_in_rules():
    unknown = {rule: where for rule, where in {**mentioned_ids(), **emitted_ids()}.items()
               if rule not in RULES}
    assert unknown == {}, f"ids used in graph_policy but missing from RULES: {unknown}"


def test_every_rules_entry_is_emitted():
    used = set(emitted_ids()) | {r.rule_id for r in FEATURE_RULES}
    # "sync" entries are count keys of the graph session (runtime), not emitted in
    # graph_policy: test_rule_id_literals.py checks they are used there
    unused = [rule for rule, info in RULES.items() if rule not in used and info.kind != "sync"]
    assert unused == [], f"RULES entries no code emits (remove them or emit them): {unused}"


def test_feature_entries_match_feature_rules():
    for rule in FEATURE_RULES:
        info = RULES[rule.rule_id]
        assert info.kind == "feature" and rule.severity in info.severities


def test_gate_rules_are_the_gate_entries_in_evaluation_order():
    assert GATE_RULES == tuple(r.id for r in RULES.values() if r.kind == "gate")
    assert GATE_RULES[0] == "gate.spec_forward_mode" and GATE_RULES[-1] == "gate.ok"


@pytest.mark.parametrize("make", [
    lambda rule: Decision(rule, Severity.INFO, Source.USER, Phase.DECODE, None, None, "m"),
    lambda rule: Violation(rule, Severity.HARD, Source.BACKEND, "m"),
    lambda rule: ReplayReason(rule, "m"),
], ids=["Decision", "Violation", "ReplayReason"])
def test_an_unknown_rule_id_is_refused(make):
    with pytest.raises(ValueError, match=r"'gate\.made_up'.*RULES"):
        make("gate.made_up")
    make("gate.ok")  # a known id is accepted


def _plans():
    """Plans over presets, platforms, locks, features and budgets (many rules fire)."""
    models = ("deepseek-v3", "deepseek-v3.2", "kimi-k2.6", "deepseek-v4-like", "llama-3-8b")
    platforms = ("cuda:sm90", "cuda:sm100", "cpu", "rocm:gfx942")
    configs = (GraphConfig(), GraphConfig.from_user(prefill="tc_piecewise"),
               GraphConfig.from_user(prefill="breakable", capture_memory_budget_bytes=1),
               GraphConfig(capture_memory_budget_bytes=1))
    features = (ServerFeatures(), ServerFeatures(lora=True, dp_attention=True),
                ServerFeatures(context_parallel=True, pipeline_parallel=True))
    for model, platform, config, feats in itertools.product(models, platforms, configs,
                                                           features):
        try:
            yield sim(platform, model, config=config, features=feats)
        except GraphPolicyError:
            continue


def test_decisions_carry_the_severity_and_source_rules_lists():
    seen: set[str] = set()
    for plan in _plans():
        for d in plan.decisions:
            info = RULES[d.rule]
            seen.add(d.rule)
            assert info.kind in ("plan", "feature"), d
            assert d.source in info.sources, (d, info.sources)
            # A soft rule that yields to a lock is recorded at INFO.
            assert d.severity in info.severities or (
                d.severity is Severity.INFO and Severity.SOFT in info.severities), (d, info)
    assert len(seen) >= 12, seen  # the sweep reaches most plan rules


def test_gate_reasons_are_gate_entries():
    plan = sim("cuda:sm90", "deepseek-v3")
    gate = ReplayGate(plan)
    batches = [ReplayBatch("extend", 1, 100), ReplayBatch("decode", 1),
               ReplayBatch("target_verify", 1), ReplayBatch("extend", 1, 10 ** 6),
               ReplayBatch("extend", 1, 100, prefix_lens=[5], lora=True)]
    for batch in batches:
        _, reason = gate.can_replay(batch)
        assert RULES[reason.rule].kind == "gate", reason


def test_policy_errors_are_tagged_with_error_or_hard_rules():
    with pytest.raises(GraphPolicyError) as info:
        sim("cpu", "deepseek-v3", backends="trtllm_mla",
            config=GraphConfig.from_user(decode=GraphMode.FULL))
    for reason in info.value.reasons:
        rule = next(m for m in _MENTION.findall(reason))
        assert Severity.HARD in RULES[rule].severities, reason
