"""resolve(): platform + model facts + backends + config + features -> GraphPlan.

Precedence, per phase:

1. hard rules always hold (a mode the backend declares UNSUPPORTED or whose
   pinned kernels reject the model, a platform without device graphs, a
   feature that cannot be captured).  A LOCKED mode that breaks one fails
   startup with :class:`GraphPolicyError` listing every reason; an unlocked
   one falls to DISABLED with one decision per reason.
2. the user's locks beat soft rules (a soft rule that would have changed a
   locked mode is recorded as an INFO decision and logged as a warning).
3. soft rules adjust defaults: the validated breakable -> tc_piecewise
   upgrade (only where the backend captures tc_piecewise natively), no
   default into a HIGH-cost capture fallback, unvalidated combinations,
   and the capture memory budget.
4. defaults: decode FULL; prefill BREAKABLE on CUDA, TC_PIECEWISE elsewhere.

A default that a rule rejects falls to DISABLED (eager): the policy never
invents a capture mode the defaults did not ask for, except the upgrade.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..registry.capabilities import (
    Capabilities,
    CaptureShape,
    ForwardMethod,
    GraphMode,
    Phase,
    SplitKV,
)
from ..registry.errors import GraphPolicyError
from ..registry.manager import BackendRegistry, get_registry
from ..registry.platform import Platform
from .config import DEFAULT_MAX_SEQ_LEN, GraphConfig, default_mode
from .decisions import Decision, Severity, Source, Violation
from .features import ServerFeatures
from .model import ModelFacts
from .plan import FallbackInEffect, GraphPlan, PhasePlan
from .presets import preset
from .rules import RuleContext, hard_violations, piecewise_upgrade_blockers, soft_violations
from .selection import BackendsArg, SelectedBackend, normalize_backends, select_backend

__all__ = ["resolve"]

logger = logging.getLogger("attnreg.graph_policy")

_PHASES = (Phase.PREFILL, Phase.DECODE)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _Trace:
    """The ordered decision list; logs every entry at a level that fits it."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def add(self, decision: Decision, *, warn: bool = False) -> None:
        self.decisions.append(decision)
        if decision.changed and decision.after is GraphMode.DISABLED:
            level = logging.WARNING  # a downgrade: always visible, with its reason
        elif warn:
            level = logging.WARNING
        elif decision.changed:
            level = logging.INFO
        else:
            level = logging.DEBUG
        logger.log(level, "graph policy: %s", decision.describe())

    def violation(self, v: Violation, phase: Phase, before: GraphMode, after: GraphMode,
                  suffix: str = "") -> None:
        self.add(Decision(v.rule, v.severity, v.source, phase, before, after, v.message + suffix))


def _resolve_locked(ctx: RuleContext, mode: GraphMode, trace: _Trace,
                    errors: list[str]) -> GraphMode:
    hard = hard_violations(ctx, mode)
    for v in hard:
        errors.append(f"{ctx.phase} {mode} (set by the user): {v.rule}: {v.message}")
    if not hard:
        for v in soft_violations(ctx, mode):
            trace.add(Decision(v.rule, Severity.INFO, v.source, ctx.phase, mode, mode,
                               f"soft rule yields to the user's lock: {v.message}"), warn=True)
    return mode


def _resolve_unlocked(ctx: RuleContext, mode: GraphMode, trace: _Trace) -> GraphMode:
    if ctx.phase is Phase.PREFILL and mode is GraphMode.BREAKABLE \
            and ctx.model.piecewise_validated:
        blockers = piecewise_upgrade_blockers(ctx)
        if blockers:
            trace.add(Decision("model.piecewise_upgrade", Severity.INFO, Source.MODEL, ctx.phase,
                               mode, mode, "breakable -> tc_piecewise upgrade not applied: "
                               + "; ".join(blockers)))
        else:
            trace.add(Decision("model.piecewise_upgrade", Severity.SOFT, Source.MODEL,
                               ctx.phase, mode, GraphMode.TC_PIECEWISE,
                               "piecewise prefill is validated for this model and "
                               f"{ctx.caps.backend} captures tc_piecewise natively"))
            mode = GraphMode.TC_PIECEWISE
    hard = hard_violations(ctx, mode)
    if hard:
        for v in hard:
            trace.violation(v, ctx.phase, mode, GraphMode.DISABLED, "; running eagerly")
        return GraphMode.DISABLED
    soft = soft_violations(ctx, mode)
    for v in soft:
        trace.violation(v, ctx.phase, mode, GraphMode.DISABLED,
                        "; not a default: running eagerly (set the mode explicitly to "
                        "capture anyway)")
    return GraphMode.DISABLED if soft else mode


def _capture_bytes(ctx: RuleContext, mode: GraphMode, config: GraphConfig) -> int:
    if mode is GraphMode.DISABLED:
        return 0
    pool = (ctx.model.prefill_capture_pool_bytes if ctx.phase is Phase.PREFILL
            else ctx.model.decode_capture_pool_bytes)
    return ctx.support(mode).capture_memory.estimate(capture_shape(ctx, config)) + pool


def capture_shape(ctx: RuleContext, config: GraphConfig) -> CaptureShape:
    """The shape the policy estimates capture memory for: the config's largest
    bucket of the phase, the model's heads and KV dtype."""
    return CaptureShape(max_batch_size=config.max_slots(ctx.phase),
                        max_num_tokens=config.max_tokens(ctx.phase),
                        max_seq_len=DEFAULT_MAX_SEQ_LEN, num_heads=ctx.model.num_heads,
                        kv_dtype=ctx.model.kv_dtype)


def _apply_budget(ctxs: dict[Phase, RuleContext], modes: dict[Phase, GraphMode],
                  config: GraphConfig, trace: _Trace) -> None:
    """Soft: drop unlocked captures (prefill first) until the estimate fits the budget.

    Prefill goes first because decode graphs carry the per-token latency.
    """
    budget = config.capture_memory_budget_bytes
    if budget is None:
        return
    est = {p: _capture_bytes(ctxs[p], modes[p], config) for p in _PHASES}
    total = sum(est.values())
    if total <= budget:
        return
    for phase in _PHASES:
        if total <= budget:
            break
        if modes[phase] is GraphMode.DISABLED or est[phase] == 0:
            continue
        if config.is_locked(phase):
            continue
        trace.add(Decision("budget.capture_memory", Severity.SOFT, Source.USER, phase,
                           modes[phase], GraphMode.DISABLED,
                           f"captured phases need about {_fmt_bytes(total)} (backend capture "
                           f"buffers + model capture pool), over the budget of "
                           f"{_fmt_bytes(budget)}; not capturing {phase} frees "
                           f"{_fmt_bytes(est[phase])}"))
        modes[phase] = GraphMode.DISABLED
        total -= est[phase]
    if total > budget:
        for phase in _PHASES:
            if modes[phase] is not GraphMode.DISABLED and config.is_locked(phase):
                trace.add(Decision("budget.capture_memory", Severity.INFO, Source.USER, phase,
                                   modes[phase], modes[phase],
                                   f"soft rule yields to the user's lock: captured phases "
                                   f"need about {_fmt_bytes(total)}, over the budget of "
                                   f"{_fmt_bytes(budget)}"), warn=True)


def _phase_plan(ctx: RuleContext, mode: GraphMode, config: GraphConfig,
                selected: SelectedBackend, trace: _Trace) -> PhasePlan:
    captured = mode is not GraphMode.DISABLED
    support = ctx.support(mode)
    fallbacks: tuple[FallbackInEffect, ...] = ()
    if captured and support.capture.is_fallback:
        cost = support.capture.cost_for(ctx.model.kv_dtype)
        fallbacks = (FallbackInEffect(support.capture.fallback_to or "?", cost,
                                      support.capture.reason),)
        trace.add(Decision("backend.fallback_in_effect", Severity.INFO, Source.BACKEND,
                           ctx.phase, mode, mode,
                           f"{ctx.caps.backend} runs {support.capture.fallback_to} under "
                           f"{mode} (cost {cost} for a {ctx.model.kv_dtype} KV pool): "
                           f"{support.capture.reason}"))
    if captured and mode is GraphMode.BREAKABLE and ctx.model.has_mha_companion:
        # Mirrors gate.mha_companion_prefix: only an MLA pin keeps prefix batches on the graph.
        if support.pinned_method is ForwardMethod.MLA:
            msg = (f"{ctx.caps.backend} pins {support.pinned_method} under {mode} on "
                   f"{ctx.platform}: the MHA companion is never captured, so prefix batches "
                   "may replay (subject to the cost model when a profile is loaded: "
                   "gate.cost_model)")
        else:
            pins = (f"pins {support.pinned_method}" if support.pinned_method is not None
                    else "pins no forward method")
            msg = (f"{ctx.caps.backend} {pins} under {mode} on {ctx.platform}: the MHA "
                   "companion may be captured, so prefix batches run eagerly "
                   "(gate.mha_companion_prefix)")
        trace.add(Decision("backend.pinning", Severity.INFO, Source.BACKEND, ctx.phase, mode,
                           mode, msg))
    if captured and support.split_kv is SplitKV.SINGLE:
        trace.add(Decision("backend.split_kv_single", Severity.INFO, Source.BACKEND, ctx.phase,
                           mode, mode,
                           f"{ctx.caps.backend} forces one KV split under {mode}: always "
                           "correct, slower on long KV"))
    return PhasePlan(
        phase=ctx.phase,
        mode=mode,
        default_mode=default_mode(ctx.platform, ctx.phase),
        locked=config.is_locked(ctx.phase),
        backend=ctx.caps.backend,
        backend_choice=selected.how,
        pinned_method=support.pinned_method if captured else None,
        fallbacks=fallbacks,
        split_kv=support.split_kv if captured else None,
        capture_memory_bytes=_capture_bytes(ctx, mode, config),
    )


def resolve(platform: Platform | str, model: ModelFacts | str,
            backends: BackendsArg = None, config: GraphConfig | None = None,
            features: ServerFeatures | None = None, *,
            registry: BackendRegistry | None = None,
            assume_installed: bool = False,
            versions: Mapping[str, str | None] | None = None) -> GraphPlan:
    """Decide each phase's graph mode from declarations, with a reason for every step.

    Parameters
    ----------
    platform
        where the server runs (``Platform`` or ``"cuda:sm100"``).
    model
        :class:`ModelFacts`, or the name of a preset (``attnreg.graph_policy.presets``).
    backends
        per phase, a backend name or a :class:`Capabilities` declaration; None
        for the default (highest declared priority among available backends
        whose kernels accept the model).  One value applies to both phases.
    config
        graph modes, locks and capture sizes; default :class:`GraphConfig()`.
    features
        engine features that constrain capture; default all off.
    registry
        where names are looked up (default: :func:`get_registry`).
    assume_installed
        evaluate availability as if optional libraries were installed (for a
        simulated platform).
    versions
        installed library versions to evaluate declarations with
        (distribution -> version, None = not installed); default: this
        environment's.  Makes a simulated plan independent of the machine.

    Returns
    -------
    GraphPlan

    Raises
    ------
    GraphPolicyError
        a locked mode breaks a hard rule, or no backend can serve a phase;
        every reason is listed.
    UnknownBackendError
        a backend name no plugin registered (with did-you-mean suggestions).

    Examples
    --------
    >>> from attnreg.graph_policy import ModelFacts
    >>> facts = ModelFacts(attention="mla", kv_dtype="fp8_e4m3", num_heads=64,
    ...                    multimodal=True, piecewise_validated=True)
    >>> plan = resolve("cuda:sm100", facts, assume_installed=True)
    >>> plan.prefill.mode.value, [d.rule for d in plan.decisions if d.changed]
    ('disabled', ['backend.high_cost_fallback'])
    """
    plat = Platform.parse(platform)
    facts = preset(model) if isinstance(model, str) else model
    cfg = config if config is not None else GraphConfig()
    feats = features if features is not None else ServerFeatures()
    choice = normalize_backends(backends)
    needs_registry = any(not isinstance(choice.for_phase(p), Capabilities) for p in _PHASES)
    reg = registry if registry is not None else (get_registry() if needs_registry else None)

    trace = _Trace()
    errors: list[str] = []
    hints: list[str] = []
    selected: dict[Phase, SelectedBackend] = {}
    for phase in _PHASES:
        sel, errs = select_backend(phase, choice.for_phase(phase), plat, facts, reg,
                                   assume_installed, versions)
        errors.extend(f"{phase}: {e}" for e in errs)
        if errs:
            hints.append(f"choose a {phase} backend that runs this model on {plat}")
        if sel is not None:
            selected[phase] = sel
            trace.add(Decision("user.backend" if sel.by_user else "backend.selected",
                               Severity.INFO, Source.USER if sel.by_user else Source.BACKEND,
                               phase, None, None, sel.how))

    ctxs: dict[Phase, RuleContext] = {}
    modes: dict[Phase, GraphMode] = {}
    for phase, sel in selected.items():
        ctx = RuleContext(plat, facts, feats, phase, sel.caps)
        ctxs[phase] = ctx
        requested = cfg.requested_mode(plat, phase)
        platform_default = default_mode(plat, phase)
        if cfg.is_locked(phase):
            trace.add(Decision("user.locked", Severity.INFO, Source.USER, phase,
                               platform_default, requested,
                               f"{phase} set to {requested} by the user: soft rules yield to "
                               "it, hard rules must allow it"))
            n_errors = len(errors)
            modes[phase] = _resolve_locked(ctx, requested, trace, errors)
            if len(errors) > n_errors:
                hints.append(f"unlock {phase} (drop the explicit {phase} mode) or choose a "
                             f"{phase} backend that captures {requested} on {plat}")
        else:
            source = Source.PLATFORM if requested is platform_default else Source.USER
            trace.add(Decision("default.mode", Severity.INFO, source, phase, platform_default,
                               requested,
                               f"default {phase} mode on {plat}: {requested}"
                               + ("" if source is Source.PLATFORM else " (engine config)")))
            modes[phase] = _resolve_unlocked(ctx, requested, trace)
    if errors:
        raise GraphPolicyError(errors, hint=f"To fix: {'; '.join(hints)} (`attnreg backends "
                               f"--platform {plat}` lists what each backend declares).")

    _apply_budget(ctxs, modes, cfg, trace)
    plans = {p: _phase_plan(ctxs[p], modes[p], cfg, selected[p], trace) for p in _PHASES}
    return GraphPlan(platform=plat, model=facts, features=feats, config=cfg,
                     prefill=plans[Phase.PREFILL], decode=plans[Phase.DECODE],
                     decisions=tuple(trace.decisions))
