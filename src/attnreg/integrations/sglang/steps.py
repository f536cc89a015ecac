"""The resolution steps that replace sglang's graph-compatibility steps.

sglang 0.5.23's pipeline (``arg_groups/pipeline.py``) decides graph
compatibility twice:

1. ``apply_cuda_graph_compatibility``, inside ``handle_cuda_graph_config``,
   before the attention backends are resolved (they are None there);
2. ``disable_prefill_cuda_graph_for_deepseek_trtllm_mla``, right after
   ``handle_attention_backend_compatibility``: an architecture-named rule.

:func:`early_step` replaces (1): it keeps only the sglang rules attnreg has
no fact for (:mod:`.engine_rules`) and defers the rest.  :func:`policy_step`
replaces (2): with the backends known, attnreg's plan decides both phases
and each phase's mode is written back with ``declare_resolution``.  When a
fact has no attnreg equivalent, :func:`policy_step` runs sglang's own two
steps instead, unchanged.  sglang's CP path calls (1) again after the
backends are known; :func:`early_step` then runs the policy step again.

Every decision is logged on the ``attnreg.integrations.sglang`` logger with
its rule id, and the outcome is kept on the server args
(:func:`outcome_of`).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

from sglang.srt.arg_groups import cuda_graph_hook
from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
from sglang.srt.model_executor.cuda_graph_config import with_phase

from attnreg.graph_policy import Decision, GraphPlan
from attnreg.integrations._policy_log import policy_log_silenced
from attnreg.registry.capabilities import GraphMode, Phase

from .adapter import DeclarationGap, check_host_locks, plan_for
from .decisions import BridgeDecision
from .engine_rules import first_engine_rule
from .facts import SglangFacts, host_modes, read_facts
from .names import graph_mode_from_sglang, graph_mode_to_sglang

__all__ = ["DECLARATION_SOURCE", "SglangOutcome", "early_step", "outcome_of", "policy_step"]

logger = logging.getLogger("attnreg.integrations.sglang")

#: The ``source`` of every ``declare_resolution`` the bridge makes.
DECLARATION_SOURCE = "attnreg_graph_policy"

_PHASES = (Phase.PREFILL, Phase.DECODE)
#: The phases sglang 0.5.23's two replaced steps can change: both declare only
#: ``with_phase(..., Phase.PREFILL, ...)`` (``arg_groups/cuda_graph_hook.py``).
_SGLANG_STEPS_DECIDE = frozenset({Phase.PREFILL})
_OUTCOME_ATTR = "_attnreg_outcome"
_EARLY_ATTR = "_attnreg_early_decisions"


@dataclass(frozen=True)
class SglangOutcome:
    """What the bridge decided for one server.

    ``plan`` is None when a gap left the server to sglang's own rules;
    ``decided`` names the phases attnreg decided (a phase with a gap of its
    own is sglang's; the plan's entry for it is a placeholder and never
    used).  ``decisions`` are attnreg's for the decided phases (rule ids of
    ``attnreg.graph_policy.RULES``) and ``bridge`` the bridge's own
    (``sglang.*`` ids), each in order.
    """

    facts: SglangFacts
    plan: GraphPlan | None
    decisions: tuple[Decision, ...]
    bridge: tuple[BridgeDecision, ...]
    before: dict[Phase, GraphMode]
    after: dict[Phase, GraphMode]
    decided: frozenset[Phase] = frozenset()

    @property
    def rule_ids(self) -> tuple[str, ...]:
        """Every rule id, the bridge's first, then attnreg's."""
        return tuple(d.rule for d in self.bridge) + tuple(d.rule for d in self.decisions)

    def to_dict(self) -> dict[str, object]:
        return {
            "platform": str(self.facts.platform),
            "architecture": self.facts.architecture,
            "backends": {p.value: {"sglang": m.sglang, "attnreg": m.attnreg,
                                   **({"dsa_backend": m.dsa_backend}
                                      if m.dsa_backend is not None else {})}
                         for p, m in self.facts.backends.items()},
            "engine": self.facts.engine.to_dict(),
            "gaps": list(self.facts.all_gaps),
            "decided": sorted(p.value for p in self.decided),
            "before": {p.value: m.value for p, m in self.before.items()},
            "after": {p.value: m.value for p, m in self.after.items()},
            "bridge": [d.to_dict() for d in self.bridge],
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


def outcome_of(server_args: Any) -> SglangOutcome | None:
    """The bridge's outcome for ``server_args`` (None before its policy step ran)."""
    return getattr(server_args, _OUTCOME_ATTR, None)


def _log_bridge(decision: BridgeDecision) -> None:
    level = logging.WARNING if decision.changed else logging.INFO
    logger.log(level, "attnreg: %s", decision.describe())


def _log_policy(decision: Decision) -> None:
    if decision.changed and decision.after is GraphMode.DISABLED:
        level = logging.WARNING
    else:
        level = logging.INFO
    logger.log(level, "attnreg: %s", decision.describe())




def _current_modes(server_args: Any) -> dict[Phase, GraphMode]:
    cg = resolving_view(server_args).cuda_graph_config
    return {p: graph_mode_from_sglang(getattr(cg, p.value).backend) for p in _PHASES}


def _declare(server_args: Any, phase: Phase, mode: GraphMode) -> None:
    cfg = resolving_view(server_args)
    declare_resolution(server_args, DECLARATION_SOURCE,
                       cuda_graph_config=with_phase(cfg.cuda_graph_config, phase.value,
                                                    backend=graph_mode_to_sglang(mode)))


def _sglang_original(name: str) -> Any:
    """sglang's own step under any hook wrappers (``HookRegistry`` keeps ``__wrapped__``)."""
    return inspect.unwrap(getattr(cuda_graph_hook, name))


def early_step(server_args: Any) -> None:
    """Replaces ``apply_cuda_graph_compatibility``.

    Before the attention backends are known: refuse a lock on a mode this
    sglang lacks, keep the sglang rules attnreg has no fact for, and defer
    the rest to :func:`policy_step`.  Called again after the policy step
    (sglang's CP path does), it runs the policy step again.
    """
    if outcome_of(server_args) is not None:
        policy_step(server_args)
        return
    locked_keys: set[tuple[str, str]] = getattr(server_args, "_cuda_graph_config_locked", set())
    modes = _current_modes(server_args)
    locked = {p: modes[p] for p in _PHASES if (p.value, "backend") in locked_keys}
    check_host_locks(locked, host_modes())
    decisions: list[BridgeDecision] = []
    prefill = modes[Phase.PREFILL]
    if Phase.PREFILL not in locked and prefill is GraphMode.BREAKABLE:
        rule = first_engine_rule(server_args)
        if rule is not None:
            _declare(server_args, Phase.PREFILL, GraphMode.DISABLED)
            decisions.append(BridgeDecision(
                f"sglang.engine_rule:{rule.name}", Phase.PREFILL, prefill, GraphMode.DISABLED,
                f"{rule.message} (sglang's rule, kept: attnreg has no fact for "
                f"{rule.missing_fact}); set the prefill graph backend explicitly to override"))
    decisions.append(BridgeDecision(
        "sglang.deferred", None, None, None,
        "sglang's graph-compatibility step runs before the attention backends are known; "
        "attnreg decides at the attention-backend step"))
    for d in decisions:
        _log_bridge(d)
    setattr(server_args, _EARLY_ATTR, tuple(decisions))


def _run_sglang_rules(server_args: Any, gaps: tuple[str, ...] | list[str],
                      bridge: list[BridgeDecision], phases: frozenset[Phase]) -> None:
    """sglang's own two steps, unchanged; they decide ``phases`` (every phase attnreg
    cannot decide).  A decided phase's mode is written again after them."""
    which = "this server" if phases == frozenset(_PHASES) else \
        " and ".join(f"the {p} phase" for p in _PHASES if p in phases)
    runs = bool(phases & _SGLANG_STEPS_DECIDE)
    how = ("sglang's own graph-compatibility rules decide it, unchanged" if runs else
           "sglang's two graph-compatibility steps change only prefill, so it keeps the "
           "mode sglang resolved for it, unchanged")
    bridge.append(BridgeDecision(
        "sglang.gap", None if len(phases) != 1 else next(iter(phases)), None, None,
        f"attnreg cannot decide {which} (" + "; ".join(gaps) + f"): {how}"))
    _log_bridge(bridge[-1])
    if runs:
        _sglang_original("apply_cuda_graph_compatibility")(server_args)
        _sglang_original("disable_prefill_cuda_graph_for_deepseek_trtllm_mla")(server_args)


def _plan_phases(facts: SglangFacts) -> tuple[GraphPlan | None, frozenset[Phase], list[str]]:
    """attnreg's plan for as many phases as it can decide, those phases, and every gap.

    A declaration that cannot serve one phase leaves that phase to sglang and
    the other to attnreg, as a backend without a declaration does.
    """
    gaps = list(facts.all_gaps)
    phases = facts.decidable_phases
    while phases:
        try:
            with policy_log_silenced():
                return plan_for(facts, phases), phases, gaps
        except DeclarationGap as gap:
            gaps.extend(f"attnreg's declaration cannot serve it: {r}" for r in gap.reasons)
            if not gap.phases & phases or gap.phases >= phases:
                break
            phases = phases - gap.phases
    return None, frozenset(), gaps


def policy_step(server_args: Any) -> None:
    """Replaces ``disable_prefill_cuda_graph_for_deepseek_trtllm_mla``.

    With the attention backends resolved: attnreg's plan decides each phase
    it can, written back with ``declare_resolution``; every decision is
    logged with its rule id.  A phase attnreg cannot decide (a backend
    without a declaration, a declaration that cannot serve it) is left to
    sglang's rules alone; a server-wide gap (the model, the KV dtype) leaves
    both.  Raises :class:`~.adapter.SglangGraphPolicyError` when a locked
    mode breaks a hard rule.
    """
    bridge = list(getattr(server_args, _EARLY_ATTR, ()))
    before = _current_modes(server_args)
    facts = read_facts(server_args)
    for phase, mapping in facts.backends.items():
        who = "the user" if phase in facts.backends_by_user else "sglang's defaults"
        target = f"attnreg's {mapping.attnreg}" if mapping.mapped else "no attnreg declaration"
        sub = ""
        if mapping.dsa_backend is not None:
            sub_who = "the user" if phase in facts.dsa_backends_by_user else "sglang's defaults"
            sub = f" with --dsa-{phase.value}-backend {mapping.dsa_backend} (chosen by {sub_who})"
        bridge.append(BridgeDecision("sglang.backend", phase, None, None,
                                     f"sglang's {mapping.sglang} (chosen by {who}){sub} -> "
                                     f"{target}: {mapping.reason}"))
        _log_bridge(bridge[-1])
    plan, decided, gaps = _plan_phases(facts) if facts.decidable else \
        (None, frozenset(), list(facts.all_gaps))
    undecided = frozenset(_PHASES) - decided
    if undecided:
        _run_sglang_rules(server_args, gaps, bridge, undecided)
    if plan is None:
        setattr(server_args, _OUTCOME_ATTR, SglangOutcome(
            facts, None, (), tuple(bridge), before, _current_modes(server_args)))
        return
    decisions = tuple(d for d in plan.decisions if d.phase is None or d.phase in decided)
    for decision in decisions:
        _log_policy(decision)
    after = _current_modes(server_args)
    for phase in _PHASES:
        if phase not in decided:
            continue
        mode = plan.phase(phase).mode
        _declare(server_args, phase, mode)
        after[phase] = mode
        why = [d.rule for d in plan.decisions_for(phase) if d.changed]
        declared = BridgeDecision(
            "sglang.declared", phase, before[phase], mode,
            f"attnreg's {phase} mode on {plan.phase(phase).backend} written to sglang's "
            f"cuda_graph_config" + (f" (changed by {', '.join(why)})" if why else ""))
        bridge.append(declared)
        _log_bridge(declared)
    setattr(server_args, _OUTCOME_ATTR, SglangOutcome(
        facts, plan, decisions, tuple(bridge), before, after, decided))
