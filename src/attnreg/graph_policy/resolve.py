"""resolve(): platform + model, engine facts + backends + config + features -> GraphPlan.

Order of work:

0. the platform must be specific enough: a vendor whose backends gate
   kernels on the architecture (cuda, rocm) needs one (``platform.arch_required``);
1. per phase, the backend: the user's, or the best one for the need
   (:mod:`~attnreg.graph_policy.selection`);
2. per phase, the mode, by precedence:

   a. hard rules always hold (a platform without device graphs, a mode the
      host engine lacks, a mode the backend declares UNSUPPORTED, whose
      fallback target cannot serve it, or whose pinned kernels reject the
      model, a feature that cannot be captured).  A LOCKED mode that breaks
      one fails startup with :class:`GraphPolicyError` listing every
      reason; an unlocked one falls to DISABLED with one decision per reason;
   b. the user's locks beat soft rules (a soft rule that would have changed
      a locked mode is recorded as an INFO decision and logged as a warning);
   c. soft rules adjust defaults: the validated breakable -> tc_piecewise
      upgrade (only where the backend captures tc_piecewise natively), no
      default into a HIGH-cost capture fallback, unvalidated combinations;
   d. defaults: decode FULL; prefill BREAKABLE on CUDA, TC_PIECEWISE elsewhere;

3. the capture memory budget (soft, across phases, prefill dropped first):
   the user's, else a fraction of the device memory;
4. speculative batches: replayed from the decode graphs where the decode
   backend declares them, else eager, with the reason;
5. the captured shapes per phase and forward mode.

A default that a rule rejects falls to DISABLED (eager): the policy never
invents a capture mode the defaults did not ask for, except the upgrade.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ..registry.capabilities import (
    SPECULATIVE_MODES,
    Capabilities,
    CaptureShape,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    SplitKV,
)
from ..registry.errors import GraphPolicyError
from ..registry.manager import BackendRegistry, get_registry
from ..registry.platform import KNOWN_DEVICES, DeviceInfo, Platform, known_device
from .bucket_backends import choose_bucket_backends
from .config import GraphConfig, default_mode
from .decisions import Decision, Severity, Source, Violation
from .decode_profile import DecodeProfile, load_decode_profile
from .engine import EngineFacts
from .features import ServerFeatures
from .model import ModelFacts
from .plan import (
    CaptureBudget,
    CapturedShapes,
    FallbackInEffect,
    GraphPlan,
    PhasePlan,
    SpecModePlan,
)
from .presets import preset
from .rule_ids import tagged
from .rules import RuleContext, hard_violations, piecewise_upgrade_blockers, soft_violations
from .selection import (
    BackendsArg,
    SelectedBackend,
    SelectionTiers,
    normalize_backends,
    select_backend,
)
from .targets import TargetLookup

__all__ = ["capture_shape", "resolve"]

logger = logging.getLogger("attnreg.graph_policy")

_PHASES = (Phase.PREFILL, Phase.DECODE)
#: A KV pool size far above any real one: a capture estimate that changes between
#: pool size 0 and this one grows with the pool (a fallback converting it in-graph).
_PROBE_POOL_BYTES = 1 << 50


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


# -- speculative decoding --------------------------------------------------------

def _spec_draft_tokens(features: ServerFeatures, engine: EngineFacts) -> int | None:
    """Draft tokens per verify batch; 0 when speculative decoding is on with an unknown
    count; None when it is off."""
    if engine.num_draft_tokens > 0:
        return engine.num_draft_tokens
    return 0 if features.speculative_decoding else None


def _spec_graph_problem(caps: Capabilities, mode: ForwardMode, n: int) -> str:
    """Why ``caps``'s full decode graphs cannot serve ``mode`` batches of ``n`` tokens per
    sequence ('' = they can)."""
    support = caps.graph_support(Phase.DECODE, GraphMode.FULL)
    if support.capture.is_unsupported:
        return f"{caps.backend} captures no full decode graphs"
    entry = support.serving(mode)
    if entry is None:
        served = ", ".join(f.describe() for f in support.forward_modes) or "nothing"
        return (f"{caps.backend}'s full decode graphs do not serve {mode} batches (they "
                f"serve {served})")
    if n < 1:
        return "the number of draft tokens is unknown"
    if not entry.serves_query_len(n):
        return (f"{caps.backend}'s full decode graphs serve {entry.describe()}, not {n} "
                "tokens per sequence")
    return ""


def _spec_plans(caps: Capabilities, decode_mode: GraphMode, n: int,
                trace: _Trace) -> tuple[SpecModePlan, ...]:
    """How target-verify and draft-extend batches run, with one decision each."""
    out = []
    for mode in SPECULATIVE_MODES:
        eager = caps.eager_serving(mode)
        eager_ok = eager is not None and (n < 1 or eager.serves_query_len(n))
        tokens = f"{n} tokens per sequence" if n > 0 else "an unknown number of draft tokens"
        if n < 1:
            why_not = ("speculative decoding is on but the number of draft tokens is unknown "
                       "(pass EngineFacts.num_draft_tokens / --speculative-decoding N), so no "
                       "graph can be captured for it")
        elif decode_mode is GraphMode.DISABLED:
            why_not = "decode graphs are disabled in this plan"
        else:
            why_not = _spec_graph_problem(caps, mode, n)
        if not why_not:
            entry = caps.graph_support(Phase.DECODE, GraphMode.FULL).serving(mode)
            assert entry is not None
            how = "graph"
            msg = (f"{mode} batches ({tokens}) replay {caps.backend}'s full decode graphs, "
                   f"captured for {n} query tokens per sequence ({caps.backend} declares "
                   f"{entry.describe()} under full)")
        elif eager_ok:
            how = "eager"
            msg = f"{mode} batches ({tokens}) run eagerly on {caps.backend}: {why_not}"
        else:
            how = "unserved"
            have = ", ".join(f.describe() for f in caps.eager_forward_modes)
            limit = f" ({eager.describe()})" if eager is not None else ""
            msg = (f"{caps.backend} does not declare {mode} batches of {tokens}, eagerly or "
                   f"in graphs{limit}: it serves {have}; the engine must run them another way "
                   "(e.g. as extend batches of the prefill backend) or choose a decode backend "
                   f"that declares {mode}")
        trace.add(Decision("spec.graph" if how == "graph" else "spec.eager", Severity.INFO,
                           Source.BACKEND, Phase.DECODE, decode_mode, decode_mode, msg))
        out.append(SpecModePlan(mode, how, caps.backend, n, msg))
    return tuple(out)


# -- captured shapes and capture memory ------------------------------------------

def _decode_batch_sizes(config: GraphConfig, engine: EngineFacts) -> tuple[int, ...]:
    """Decode buckets up to the first that holds the engine's max running requests."""
    sizes = config.decode_batch_sizes
    limit = engine.max_running_requests
    if limit is None:
        return sizes
    kept = tuple(b for b in sizes if b < limit)
    above = [b for b in sizes if b >= limit]
    return kept + (above[0],) if above else kept


def _captured_shapes(ctx: RuleContext, mode: GraphMode, config: GraphConfig,
                     spec: Sequence[SpecModePlan]) -> tuple[CapturedShapes, ...]:
    if mode is GraphMode.DISABLED:
        return ()
    eng = ctx.engine
    support = ctx.support(mode)
    if ctx.phase is Phase.PREFILL:
        max_requests = config.prefill_max_requests
        if eng.max_running_requests is not None:
            max_requests = min(max_requests, eng.max_running_requests)
        return (CapturedShapes(ForwardMode.EXTEND, (), config.prefill_num_tokens, max_requests,
                               None, eng.max_context_len),)
    sizes = _decode_batch_sizes(config, eng)
    query = {ForwardMode.DECODE: 1}
    query.update({s.forward_mode: s.query_len for s in spec if s.how == "graph"})
    out = []
    for entry in support.forward_modes:
        q = query.get(entry.mode)
        if q is None:
            continue
        out.append(CapturedShapes(entry.mode, sizes, tuple(b * q for b in sizes), sizes[-1], q,
                                  eng.max_context_len))
    return tuple(out)


def capture_shape(ctx: RuleContext, shapes: Sequence[CapturedShapes],
                  kv_pool_bytes: int | None = None) -> CaptureShape:
    """The bounds capture memory is estimated for: the largest captured batch and query
    rows of the phase's graphs, the engine's context, page size and pool, the model's
    heads, KV dtype and query (activation) dtype."""
    eng = ctx.engine
    return CaptureShape(
        max_batch_size=max((s.max_requests for s in shapes), default=1),
        max_num_tokens=max((s.num_tokens[-1] for s in shapes if s.num_tokens), default=1),
        max_seq_len=eng.max_context_len, num_heads=ctx.model.num_heads,
        page_size=eng.page_size or 1, kv_dtype=ctx.model.kv_dtype,
        kv_pool_bytes=eng.kv_pool_bytes if kv_pool_bytes is None else kv_pool_bytes,
        q_dtype=ctx.model.act_dtype)


def _capture_bytes(ctx: RuleContext, mode: GraphMode,
                   shapes: Sequence[CapturedShapes]) -> int:
    if mode is GraphMode.DISABLED:
        return 0
    pool = (ctx.model.prefill_capture_pool_bytes if ctx.phase is Phase.PREFILL
            else ctx.model.decode_capture_pool_bytes)
    return ctx.support(mode).capture_memory.estimate(capture_shape(ctx, shapes)) + pool


def _grows_with_pool(ctx: RuleContext, mode: GraphMode, shapes: Sequence[CapturedShapes]) -> bool:
    memory = ctx.support(mode).capture_memory
    return memory.estimate(capture_shape(ctx, shapes, 0)) != \
        memory.estimate(capture_shape(ctx, shapes, _PROBE_POOL_BYTES))


def _budget(config: GraphConfig, engine: EngineFacts, platform: Platform,
            device: DeviceInfo | None) -> CaptureBudget:
    fraction = config.capture_budget_fraction
    if config.capture_memory_budget_bytes is not None:
        return CaptureBudget(config.capture_memory_budget_bytes, Source.USER.value,
                             engine.device_memory_bytes, fraction, "the budget set by the user")
    memory: int | None = None
    source, what = "none", ""
    if engine.device_memory_bytes is not None:
        memory, source = engine.device_memory_bytes, Source.ENGINE.value
        what = f"{_fmt_bytes(memory)}, the device memory the engine passed"
    elif device is not None:
        memory, source = device.memory_bytes, Source.PLATFORM.value
        what = f"{device.memory_bytes / 1e9:g} GB, the memory of one {device.label}"
    else:
        fallback = platform.default_device()
        if fallback is not None:
            memory, source = fallback.memory_bytes, Source.PLATFORM.value
            what = (f"{fallback.memory_bytes / 1e9:g} GB, the smallest known {platform} device "
                    f"({fallback.label})")
    if memory is None:
        return CaptureBudget(None, "none", None, fraction,
                             f"no default capture budget: the device memory of {platform} is "
                             "unknown (pass EngineFacts.device_memory_bytes / --device-memory)")
    if fraction == 0:
        return CaptureBudget(None, "none", memory, fraction,
                             "no default capture budget (capture_budget_fraction is 0)")
    return CaptureBudget(int(memory * fraction), source, memory, fraction,
                         f"default: {fraction:g} of {what}")


def _apply_budget(ctxs: dict[Phase, RuleContext], modes: dict[Phase, GraphMode],
                  shapes: dict[Phase, tuple[CapturedShapes, ...]], config: GraphConfig,
                  budget: CaptureBudget, trace: _Trace) -> None:
    """Soft: drop unlocked captures (prefill first) until the estimate fits the budget.

    Prefill goes first because decode graphs carry the per-token latency.
    """
    if budget.bytes is None:
        return
    limit = budget.bytes
    source = Source(budget.source)
    label = (f"the budget of {_fmt_bytes(limit)}" if source is Source.USER else
             f"the default budget of {_fmt_bytes(limit)} ({budget.note}; set a budget or the "
             "device memory to change it)")
    est = {p: _capture_bytes(ctxs[p], modes[p], shapes[p]) for p in _PHASES}
    total = sum(est.values())
    if total <= limit:
        return
    for phase in _PHASES:
        if total <= limit:
            break
        if modes[phase] is GraphMode.DISABLED or est[phase] == 0:
            continue
        if config.is_locked(phase):
            continue
        trace.add(Decision("budget.capture_memory", Severity.SOFT, source, phase,
                           modes[phase], GraphMode.DISABLED,
                           f"captured phases need about {_fmt_bytes(total)} (backend capture "
                           f"buffers + model capture pool), over {label}; not capturing "
                           f"{phase} frees {_fmt_bytes(est[phase])}"))
        modes[phase] = GraphMode.DISABLED
        total -= est[phase]
    if total > limit:
        for phase in _PHASES:
            if modes[phase] is not GraphMode.DISABLED and config.is_locked(phase):
                trace.add(Decision("budget.capture_memory", Severity.INFO, source, phase,
                                   modes[phase], modes[phase],
                                   f"soft rule yields to the user's lock: captured phases "
                                   f"need about {_fmt_bytes(total)}, over {label}"), warn=True)


def _describe_shapes(shapes: Sequence[CapturedShapes], engine: EngineFacts) -> str:
    parts = []
    for s in shapes:
        buckets = s.buckets()
        unit = "tokens" if s.keyed_by_tokens else "requests"
        span = f"{buckets[0]}..{buckets[-1]}" if len(buckets) > 1 else f"{buckets[0]}"
        query = "" if s.query_len in (None, 1) else f", {s.query_len} tokens per sequence"
        cap = f" (up to {s.max_requests} requests)" if s.keyed_by_tokens else ""
        parts.append(f"{s.forward_mode} at {span} {unit} ({len(buckets)} buckets{query}){cap}")
    page = f", page size {engine.page_size}" if engine.page_size is not None else ""
    trim = ("" if engine.max_running_requests is None else
            f"; the engine runs at most {engine.max_running_requests} requests")
    return ("graphs captured for " + "; ".join(parts)
            + f"; sequences up to {engine.max_context_len} tokens{page}{trim}")


def _phase_plan(ctx: RuleContext, mode: GraphMode, config: GraphConfig,
                selected: SelectedBackend, shapes: tuple[CapturedShapes, ...],
                trace: _Trace) -> PhasePlan:
    captured = mode is not GraphMode.DISABLED
    support = ctx.support(mode)
    fallbacks: tuple[FallbackInEffect, ...] = ()
    if captured:
        trace.add(Decision("engine.captured_shapes", Severity.INFO, Source.ENGINE, ctx.phase,
                           mode, mode, _describe_shapes(shapes, ctx.engine)))
    if captured and support.capture.is_fallback:
        cost = support.capture.cost_for(ctx.model.kv_dtype)
        fallbacks = (FallbackInEffect(support.capture.fallback_to or "?", cost,
                                      support.capture.reason),)
        trace.add(Decision("backend.fallback_in_effect", Severity.INFO, Source.BACKEND,
                           ctx.phase, mode, mode,
                           f"{ctx.caps.backend} runs {support.capture.fallback_to} under "
                           f"{mode} (cost {cost} for a {ctx.model.kv_dtype} KV pool): "
                           f"{support.capture.reason}"))
    if captured and ctx.engine.kv_pool_bytes == 0 and _grows_with_pool(ctx, mode, shapes):
        trace.add(Decision("budget.pool_size_unknown", Severity.INFO, Source.ENGINE, ctx.phase,
                           mode, mode,
                           f"{ctx.caps.backend}'s capture memory under {mode} grows with the KV "
                           "pool (it converts or copies the pool inside the graph), and the "
                           "engine did not pass the pool size (EngineFacts.kv_pool_bytes, "
                           "--kv-pool-size): the estimate leaves that part out"))
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
        capture_memory_bytes=_capture_bytes(ctx, mode, shapes),
        captured=shapes,
    )


def _with_bucket_backends(profile_arg: DecodeProfile | str | os.PathLike[str],
                          plans: dict[Phase, PhasePlan], ctx: RuleContext, mode: GraphMode,
                          shapes: tuple[CapturedShapes, ...], by_user: bool,
                          budget: CaptureBudget, trace: _Trace, registry: BackendRegistry,
                          assume_installed: bool, versions: Mapping[str, str | None] | None
                          ) -> PhasePlan:
    """The decode phase plan with its per-bucket backends from the decode profile
    (:mod:`~attnreg.graph_policy.bucket_backends`), and the decision saying why."""
    profile = (profile_arg if isinstance(profile_arg, DecodeProfile)
               else load_decode_profile(profile_arg))

    def capture_bytes(caps: Capabilities, sub: Sequence[CapturedShapes]) -> int:
        # the backend's own capture buffers; the model's graph pool is shared by all
        theirs = replace(ctx, caps=caps)
        return theirs.support(GraphMode.FULL).capture_memory.estimate(
            capture_shape(theirs, sub))

    choice = choose_bucket_backends(profile, ctx, mode, shapes, by_user=by_user,
                                    registry=registry, assume_installed=assume_installed,
                                    versions=versions, capture_bytes=capture_bytes)
    pp = plans[Phase.DECODE]
    message = choice.message
    total = sum(p.capture_memory_bytes for p in plans.values()) + choice.extra_capture_bytes
    if choice.buckets and budget.bytes is not None and total > budget.bytes:
        message = (f"per-bucket decode backends not used: their graph state needs "
                   f"{_fmt_bytes(choice.extra_capture_bytes)} more, and the captured phases "
                   f"would need about {_fmt_bytes(total)}, over the capture budget of "
                   f"{_fmt_bytes(budget.bytes)} ({budget.note}); would have been: {message}")
        choice = replace(choice, buckets=(), extra_capture_bytes=0)
    trace.add(Decision("decode.bucket_backends" if choice.buckets else
                       "decode.bucket_backends_off", Severity.INFO, Source.BACKEND,
                       Phase.DECODE, mode, mode, message))
    if not choice.buckets:
        return pp
    return replace(pp, bucket_backends=choice.buckets,
                   capture_memory_bytes=pp.capture_memory_bytes + choice.extra_capture_bytes)


def _arch_error(plat: Platform) -> GraphPolicyError:
    names = sorted(d.name for d in KNOWN_DEVICES.values() if d.vendor is plat.vendor)
    devices = f", or a GPU name ({', '.join(names)})" if names else ""
    return GraphPolicyError(
        [tagged("platform.arch_required",
                f"{plat} names no architecture, and which {plat} kernels exist depends on it "
                f"(e.g. Blackwell-only kernels): a plan for '{plat}' would hold for no "
                "particular GPU")],
        hint=f"To fix: give the architecture: one of {', '.join(plat.known_archs())}{devices}.")


def _selection_tiers(phase: Phase, platform: Platform, model: ModelFacts,
                features: ServerFeatures, engine: EngineFacts, targets: TargetLookup,
                requested: GraphMode, spec_tokens: int | None) -> SelectionTiers:
    """Selection tiers for ``phase``: backends whose declaration lets the requested mode run
    for this model first (hard, backend-declared rules only: platform, engine and feature
    rules are the same for every backend, and soft rules are cost advice that the declared
    priority already weighs), then, for decode with speculative decoding, those whose full
    graphs serve target-verify batches."""
    def prefer(caps: Capabilities) -> list[tuple[str, Sequence[str]]]:
        ctx = RuleContext(platform, model, features, phase, caps, engine, targets)
        blocking = [f"{v.rule}: {v.message}" for v in hard_violations(ctx, requested)
                    if v.source is Source.BACKEND]
        tiers: list[tuple[str, Sequence[str]]] = [(f"{phase} {requested}", blocking)]
        if phase is Phase.DECODE and spec_tokens and requested is GraphMode.FULL:
            problem = _spec_graph_problem(caps, ForwardMode.TARGET_VERIFY, spec_tokens)
            tiers.append((f"{ForwardMode.TARGET_VERIFY} graphs", [problem] if problem else []))
        return tiers
    return prefer


def resolve(platform: Platform | str, model: ModelFacts | str,
            backends: BackendsArg = None, config: GraphConfig | None = None,
            features: ServerFeatures | None = None, engine: EngineFacts | None = None, *,
            registry: BackendRegistry | None = None,
            assume_installed: bool = False,
            versions: Mapping[str, str | None] | None = None,
            extra_declarations: Iterable[Capabilities] = (),
            decode_profile: DecodeProfile | str | os.PathLike[str] | None = None) -> GraphPlan:
    """Decide each phase's graph mode from declarations, with a reason for every step.

    Parameters
    ----------
    platform
        where the server runs: a ``Platform``, ``"cuda:sm100"``, or a known GPU
        name such as ``"h200"`` (which also gives the device memory).  cuda and
        rocm need an architecture.
    model
        :class:`ModelFacts`, or the name of a preset (``attnreg.graph_policy.presets``).
    backends
        per phase, a backend name or a :class:`Capabilities` declaration; None
        for the default (the best declared backend for the need, see
        :mod:`attnreg.graph_policy.selection`).  One value applies to both phases.
    config
        graph modes, locks, capture sizes and budget; default :class:`GraphConfig()`.
    features
        engine features that constrain capture; default all off.
    engine
        :class:`EngineFacts`: page size, max context, max running requests, KV
        pool and device memory, speculative draft tokens, the host engine's
        graph modes; default :class:`EngineFacts()`.
    registry
        where names are looked up (default: :func:`get_registry`).
    assume_installed
        evaluate availability as if optional libraries were installed (for a
        simulated platform).
    versions
        installed library versions to evaluate declarations with
        (distribution -> version, None = not installed); default: this
        environment's.  Makes a simulated plan independent of the machine.
    extra_declarations
        declarations consulted by name before the registry when checking
        fallback targets (for declarations built outside the registry).
    decode_profile
        measured decode times per backend and capture bucket
        (:class:`~attnreg.graph_policy.decode_profile.DecodeProfile` or a path
        to one, from ``attnreg calibrate --decode``): each decode bucket may
        then be captured with its own backend among those declaring the same
        pool layout (:mod:`~attnreg.graph_policy.bucket_backends`;
        ``PhasePlan.bucket_backends``).  None: one decode backend.

    Returns
    -------
    GraphPlan

    Raises
    ------
    GraphPolicyError
        a locked mode breaks a hard rule, a named backend cannot serve the
        model (including one whose plugin failed to load), no backend can
        serve a phase, or the platform lacks a required architecture; every
        reason is listed.  Plugin errors never escape: they become reasons.
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
    device = known_device(platform) if isinstance(platform, str) else None
    facts = preset(model) if isinstance(model, str) else model
    cfg = config if config is not None else GraphConfig()
    feats = features if features is not None else ServerFeatures()
    eng = engine if engine is not None else EngineFacts()
    if plat.arch_missing:
        raise _arch_error(plat)
    choice = normalize_backends(backends)
    needs_registry = any(not isinstance(choice.for_phase(p), Capabilities) for p in _PHASES)
    reg = registry if registry is not None else (get_registry() if needs_registry else None)
    known = [c for c in (choice.prefill, choice.decode) if isinstance(c, Capabilities)]
    targets = TargetLookup.build(plat, reg, assume_installed, versions,
                                 [*known, *extra_declarations],
                                 registry_loader=get_registry if registry is None else None)
    spec_tokens = _spec_draft_tokens(feats, eng)

    trace = _Trace()
    errors: list[str] = []
    hints: list[str] = []
    selected: dict[Phase, SelectedBackend] = {}
    for phase in _PHASES:
        prefer = _selection_tiers(phase, plat, facts, feats, eng, targets,
                             cfg.requested_mode(plat, phase), spec_tokens)
        sel, errs = select_backend(phase, choice.for_phase(phase), plat, facts, reg,
                                   assume_installed, versions, engine=eng, prefer=prefer)
        errors.extend(f"{phase}: {e}" for e in errs)
        if errs:
            hints.append(f"choose a {phase} backend that runs this model on {plat}")
        if sel is not None:
            selected[phase] = sel
            trace.add(Decision("user.backend" if sel.by_user else "backend.selected",
                               Severity.INFO, Source.USER if sel.by_user else Source.BACKEND,
                               phase, None, None, sel.how))
            if facts.sparse:
                kernels = ", ".join(k.kernel or "sparse mla" for k in sel.caps.kernels
                                    if phase in k.phases)
                trace.add(Decision(
                    "model.sparse_attention", Severity.INFO, Source.MODEL, phase, None, None,
                    f"attention is sparse with top-k {facts.sparse_top_k}: {phase} runs "
                    f"{sel.caps.backend}'s sparse MLA kernels ({kernels}) and its graph mode "
                    "follows their declared capture support (sparse_graph_modes)"))

    ctxs: dict[Phase, RuleContext] = {}
    modes: dict[Phase, GraphMode] = {}
    for phase, sel in selected.items():
        ctx = RuleContext(plat, facts, feats, phase, sel.caps, eng, targets)
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

    budget = _budget(cfg, eng, plat, device)
    decode_caps = ctxs[Phase.DECODE].caps

    def shapes_now() -> dict[Phase, tuple[CapturedShapes, ...]]:
        spec = () if spec_tokens is None else tuple(
            SpecModePlan(m, "graph", decode_caps.backend, spec_tokens, "")
            for m in SPECULATIVE_MODES
            if modes[Phase.DECODE] is not GraphMode.DISABLED and spec_tokens > 0
            and not _spec_graph_problem(decode_caps, m, spec_tokens))
        return {p: _captured_shapes(ctxs[p], modes[p], cfg, spec) for p in _PHASES}

    _apply_budget(ctxs, modes, shapes_now(), cfg, budget, trace)
    speculative = () if spec_tokens is None else \
        _spec_plans(decode_caps, modes[Phase.DECODE], spec_tokens, trace)
    shapes = {p: _captured_shapes(ctxs[p], modes[p], cfg, speculative) for p in _PHASES}
    plans = {p: _phase_plan(ctxs[p], modes[p], cfg, selected[p], shapes[p], trace)
             for p in _PHASES}
    if decode_profile is not None:
        plans[Phase.DECODE] = _with_bucket_backends(
            decode_profile, plans, ctxs[Phase.DECODE], modes[Phase.DECODE],
            shapes[Phase.DECODE], selected[Phase.DECODE].by_user, budget, trace,
            reg if reg is not None else get_registry(), assume_installed, versions)
    return GraphPlan(platform=plat, model=facts, features=feats, config=cfg,
                     prefill=plans[Phase.PREFILL], decode=plans[Phase.DECODE],
                     decisions=tuple(trace.decisions), engine=eng, speculative=speculative,
                     capture_budget=budget)
