"""The rules: pure functions from declared facts to violations.

Every rule reads declarations (the platform table, backend capabilities,
model, engine and feature facts), never a backend or architecture name.
Hard rules always hold; soft rules adjust defaults and yield to user locks.
Rule ids are stable strings, each listed in
:data:`~attnreg.graph_policy.RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..registry.capabilities import (
    CAPTURE_GRAPH_MODES,
    Capabilities,
    Cost,
    GraphMode,
    GraphModeSupport,
    Phase,
)
from ..registry.platform import Platform
from .acceptance import pinned_method_rejections
from .decisions import Severity, Source, Violation
from .engine import EngineFacts
from .features import FEATURE_RULES, ServerFeatures
from .model import ModelFacts
from .targets import TargetLookup

__all__ = [
    "RuleContext",
    "hard_violations",
    "piecewise_upgrade_blockers",
    "soft_violations",
]

#: Every capture mode needs the platform's device graphs: full and breakable
#: record attention, and tc_piecewise records each torch.compile piece.
_NEEDS_DEVICE_GRAPHS = frozenset(CAPTURE_GRAPH_MODES)


@dataclass(frozen=True)
class RuleContext:
    """What the rules of one phase may read."""

    platform: Platform
    model: ModelFacts
    features: ServerFeatures
    phase: Phase
    caps: Capabilities
    engine: EngineFacts = field(default_factory=EngineFacts)
    #: fallback targets; None = not checked (a declaration evaluated on its own)
    targets: TargetLookup | None = field(default=None, compare=False)

    def support(self, mode: GraphMode) -> GraphModeSupport:
        return self.caps.graph_support(self.phase, mode)


def _feature_violations(ctx: RuleContext, mode: GraphMode,
                        severity: Severity) -> list[Violation]:
    out = []
    for rule in FEATURE_RULES:
        if rule.severity is not severity or rule.phase is not ctx.phase or mode not in rule.modes:
            continue
        if getattr(ctx.features, rule.feature):
            out.append(Violation(rule.rule_id, severity, Source.FEATURE,
                                 f"{rule.feature} cannot be captured under {mode}: "
                                 f"{rule.reason} (source: {rule.source})"))
    return out


def hard_violations(ctx: RuleContext, mode: GraphMode) -> list[Violation]:
    """Every hard rule that forbids ``mode`` for the context's phase."""
    if mode is GraphMode.DISABLED:
        return []
    out: list[Violation] = []
    if mode in _NEEDS_DEVICE_GRAPHS and not ctx.platform.has_device_graphs:
        out.append(Violation("platform.no_device_graphs", Severity.HARD, Source.PLATFORM,
                             f"{ctx.platform} has no device graphs, which {mode} needs (every "
                             "capture mode records device graphs; tc_piecewise one per "
                             "torch.compile piece)"))
    if not ctx.engine.supports_mode(ctx.phase, mode):
        host = sorted(m.value for m in ctx.engine.graph_modes(ctx.phase) or ())
        out.append(Violation("engine.mode_unsupported", Severity.HARD, Source.ENGINE,
                             f"the host engine has no {ctx.phase} {mode} graphs (it runs "
                             f"{', '.join(host)})"))
    support = ctx.support(mode)
    if support.capture.is_unsupported:
        out.append(Violation("backend.capture_unsupported", Severity.HARD, Source.BACKEND,
                             f"{ctx.caps.backend} declares {ctx.phase} under {mode} "
                             f"UNSUPPORTED: {support.capture.reason}"))
    else:
        problem = ctx.targets.problem(ctx.caps, ctx.phase, mode) if ctx.targets else ""
        if problem:
            out.append(Violation("backend.fallback_target_invalid", Severity.HARD,
                                 Source.BACKEND, problem))
        if support.pinned_method is not None:
            rejected = pinned_method_rejections(ctx.caps, ctx.phase, support.pinned_method,
                                                ctx.model, ctx.engine)
            if rejected:
                out.append(Violation("backend.pinned_kernel_rejects_model", Severity.HARD,
                                     Source.BACKEND,
                                     f"{ctx.caps.backend} pins {support.pinned_method} under "
                                     f"{mode}, but its {support.pinned_method} kernels reject "
                                     "the model: " + "; ".join(rejected)))
    out.extend(_feature_violations(ctx, mode, Severity.HARD))
    return out


def soft_violations(ctx: RuleContext, mode: GraphMode) -> list[Violation]:
    """Every soft rule that advises against ``mode`` (the budget rule is separate)."""
    if mode is GraphMode.DISABLED:
        return []
    out: list[Violation] = []
    if (ctx.phase is Phase.PREFILL and mode is GraphMode.TC_PIECEWISE
            and ctx.model.multimodal and not ctx.model.piecewise_validated):
        out.append(Violation("model.multimodal_piecewise_unvalidated", Severity.SOFT,
                             Source.MODEL,
                             "tc_piecewise prefill is not validated for this multimodal "
                             "model"))
    out.extend(_feature_violations(ctx, mode, Severity.SOFT))
    capture = ctx.support(mode).capture
    if capture.is_fallback and capture.cost_for(ctx.model.kv_dtype) is Cost.HIGH:
        out.append(Violation("backend.high_cost_fallback", Severity.SOFT, Source.BACKEND,
                             f"under {mode} {ctx.caps.backend} falls back to "
                             f"{capture.fallback_to} at HIGH cost for a {ctx.model.kv_dtype} "
                             f"KV pool: {capture.reason}"))
    return out


def piecewise_upgrade_blockers(ctx: RuleContext) -> list[str]:
    """Why the breakable -> tc_piecewise upgrade does not apply (empty = it does).

    The upgrade needs a model whose piecewise prefill is validated, a backend
    that captures TC_PIECEWISE NATIVELY (a fallback, even a cheap one, is not
    an upgrade: seed 002), and no hard or soft rule against TC_PIECEWISE
    (among them: a host engine without tc_piecewise graphs).
    """
    if ctx.phase is not Phase.PREFILL:
        return ["only prefill has a tc_piecewise mode"]
    if not ctx.model.piecewise_validated:
        return ["piecewise prefill is not validated for this model"]
    blockers = []
    capture = ctx.support(GraphMode.TC_PIECEWISE).capture
    if not capture.is_native:
        blockers.append(f"{ctx.caps.backend} does not capture tc_piecewise natively "
                        f"({capture.describe()})")
    # Rule ids only: each rule's full message appears where it applies.
    against = [v.rule for v in (*hard_violations(ctx, GraphMode.TC_PIECEWISE),
                                *soft_violations(ctx, GraphMode.TC_PIECEWISE))]
    if against:
        blockers.append("tc_piecewise is ruled out by " + ", ".join(against))
    return blockers
