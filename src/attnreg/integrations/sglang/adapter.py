"""The one call from the sglang bridge into :func:`attnreg.graph_policy.resolve`.

:func:`plan_for` is the only function of the bridge that knows resolve()'s
signature.  resolve() of this release takes no engine facts and no host
modes, so the adapter wraps what it needs around the call:

* host modes: a mode sglang does not accept is never a default (the
  breakable -> tc_piecewise upgrade is turned off by presenting the model as
  not piecewise-validated, with a ``sglang.host_modes`` decision), and a lock
  on it fails startup (:class:`SglangGraphPolicyError`, rule
  ``sglang.host_modes``);
* engine facts (page size, context length, speculative decoding): read and
  carried in :class:`~.facts.EngineFacts`; resolve() reads the capture
  buckets through :class:`~attnreg.graph_policy.GraphConfig`.

When resolve() takes engine facts and host modes itself, only this function
changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attnreg.graph_policy import RULES, GraphPlan, resolve
from attnreg.registry.capabilities import GraphMode, Phase
from attnreg.registry.errors import GraphPolicyError

from .decisions import BridgeDecision
from .facts import SglangFacts

__all__ = ["AdapterResult", "DeclarationGap", "SglangGraphPolicyError", "check_host_locks",
           "plan_for"]

#: resolve()'s errors that mean "no attnreg declaration serves this" (no plan at all),
#: as opposed to a lock that breaks a hard rule.
_SELECTION_RULES = tuple(rule.id for rule in RULES.values() if rule.kind == "error")


class SglangGraphPolicyError(GraphPolicyError, ValueError):
    """attnreg refuses sglang's graph configuration; a ValueError like sglang's own
    argument errors, so sglang's startup reports it the same way."""


class DeclarationGap(Exception):
    """attnreg's declaration of the mapped backend cannot serve a phase of this server
    (unavailable on the platform, no kernel for the phase or the model): attnreg
    has nothing to decide with, so sglang's own rules decide.  ``reasons`` lists why."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("; ".join(reasons))


@dataclass(frozen=True)
class AdapterResult:
    """attnreg's plan and the bridge decisions taken around the call."""

    plan: GraphPlan
    notes: tuple[BridgeDecision, ...]


def check_host_locks(locked: dict[Phase, GraphMode],
                     host_modes: dict[Phase, frozenset[GraphMode]]) -> None:
    """Raise :class:`SglangGraphPolicyError` when a locked mode is one the host lacks."""
    reasons = [f"sglang.host_modes: {phase} {mode} was set explicitly, but this sglang accepts "
               f"only {', '.join(sorted(m.value for m in host_modes[phase]))} for {phase}"
               for phase, mode in locked.items() if mode not in host_modes[phase]]
    if reasons:
        raise SglangGraphPolicyError(
            reasons, hint="To fix: choose a mode this sglang release supports "
                          "(--cuda-graph-backend-prefill / --cuda-graph-config).")


def plan_for(facts: SglangFacts) -> AdapterResult:
    """attnreg's plan for a server whose facts have no gap.

    Raises :class:`SglangGraphPolicyError` when a locked mode breaks a hard
    rule or is one the host lacks (every reason listed), and
    :class:`DeclarationGap` when the mapped declaration cannot serve a phase
    at all (sglang's backend may well run it; attnreg cannot judge it).
    """
    if facts.model is None or facts.config is None:
        raise ValueError("plan_for needs facts without gaps: " + "; ".join(facts.gaps))
    check_host_locks({p: facts.sglang_modes[p] for p in facts.locked}, facts.host_modes)
    model = facts.model
    notes: list[BridgeDecision] = []
    if GraphMode.TC_PIECEWISE not in facts.host_modes[Phase.PREFILL] and model.piecewise_validated:
        model = replace(model, piecewise_validated=False)
        notes.append(BridgeDecision(
            "sglang.host_modes", Phase.PREFILL, None, None,
            "piecewise prefill is validated for this model, but this sglang has no "
            "tc_piecewise prefill: the breakable -> tc_piecewise upgrade is not considered"))
    backends = (facts.backends[Phase.PREFILL].attnreg, facts.backends[Phase.DECODE].attnreg)
    try:
        # assume_installed: the kernels run inside sglang, whose install carries the
        # libraries; attnreg's own optional extras need not be present.
        plan = resolve(facts.platform, model, backends, facts.config, facts.features,
                       assume_installed=True)
    except GraphPolicyError as exc:
        if any(f"{rule}:" in reason for reason in exc.reasons for rule in _SELECTION_RULES):
            raise DeclarationGap(exc.reasons) from exc
        raise SglangGraphPolicyError(exc.reasons, exc.hint) from exc
    for phase in (Phase.PREFILL, Phase.DECODE):
        mode = plan.phase(phase).mode
        if mode not in facts.host_modes[phase]:  # a policy default the host lacks: a bug here
            raise SglangGraphPolicyError(
                [f"sglang.host_modes: attnreg planned {phase} {mode}, which this sglang does "
                 "not accept"], hint="Report this as an attnreg bug.")
    return AdapterResult(plan, tuple(notes))
