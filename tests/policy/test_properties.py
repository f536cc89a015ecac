"""Property tests over generated platforms, declarations, facts, engines, locks, features.

The expectations are recomputed here from the declarations themselves (an
independent reading of the rules), so a rule the resolver forgets, applies to
a locked mode, or applies on the wrong platform is caught.  Size: the
``policy-default`` hypothesis profile in ``make test``; 10,000 cases per test
under ``HYPOTHESIS_PROFILE=slow`` (tests/policy/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from attnreg.graph_policy import (
    FEATURE_RULES,
    EngineFacts,
    GraphConfig,
    GraphPlan,
    ModelFacts,
    ServerFeatures,
    Severity,
    resolve,
)
from attnreg.graph_policy.features import FEATURE_HELP
from attnreg.graph_policy.selection import model_rejections, pinned_method_rejections
from attnreg.registry import (
    Capabilities,
    CaptureMemory,
    CaptureSupport,
    Cost,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    KernelConstraints,
    Phase,
    Platform,
    SplitKV,
    Vendor,
)

pytestmark = pytest.mark.slow

PLATFORMS = [Platform.parse(p) for p in ("cuda:sm80", "cuda:sm90", "cuda:sm100", "cuda:sm103",
                                          "rocm:gfx942", "cpu", "npu", "xpu")]
POOL_DTYPES = [DType.BF16, DType.FP16, DType.FP8_E4M3]
MODE_KEYS = ((Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE),
             (Phase.PREFILL, GraphMode.TC_PIECEWISE))
CAPTURE_MODES = (GraphMode.FULL, GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE)
#: The generated fallback target (passed to resolve as an extra declaration) and a
#: name nobody declares.
TARGET, MISSING = "gen_target", "gen_missing"
SPEC_MODES = (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


@st.composite
def capture_supports(draw: st.DrawFn, name: str) -> CaptureSupport:
    kind = draw(st.sampled_from(["native", "native", "fallback", "unsupported"]))
    if kind == "native":
        return CaptureSupport.native()
    if kind == "unsupported":
        return CaptureSupport.unsupported("generated: cannot capture")
    per = draw(st.dictionaries(st.sampled_from(POOL_DTYPES), st.sampled_from(list(Cost)),
                               max_size=2))
    to = draw(st.sampled_from([TARGET, TARGET, TARGET, MISSING, name]))
    return CaptureSupport.fallback(to, draw(st.sampled_from(list(Cost))), "generated fallback",
                                   per)


def spec_entries(draw: st.DrawFn) -> tuple[ForwardModeSupport, ...]:
    out = [ForwardModeSupport(ForwardMode.DECODE, 1, True)]
    for mode in SPEC_MODES:
        if draw(st.booleans()):
            out.append(ForwardModeSupport(mode, draw(st.sampled_from([1, 2, 4, 8])),
                                          mode is ForwardMode.TARGET_VERIFY))
    return tuple(out)


@st.composite
def declarations(draw: st.DrawFn, platform: Platform, name: str) -> Capabilities:
    half = frozenset({DType.BF16, DType.FP16})
    # Mostly accepting declarations, so that most scenarios reach the mode rules.
    kv = draw(st.sampled_from([frozenset(POOL_DTYPES)] * 6 + [
        frozenset({DType.BF16, DType.FP16}), frozenset({DType.FP8_E4M3})]))
    max_heads = draw(st.sampled_from([256] * 8 + [16, 64]))
    pages = draw(st.sampled_from([(1, 16, 64)] * 8 + [(32, 64), (1,)]))
    limit = draw(st.sampled_from([None] * 12 + [4096, 1 << 20]))
    kernels = [KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                                 ((576, 512),), half, kv, page_sizes=pages,
                                 max_heads=max_heads, max_seq_len=limit)]
    if draw(st.booleans()):
        kernels.append(KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}),
                                         ((192, 128), (128, 128)), half, half, max_heads=128))
    modes = []
    for phase, mode in MODE_KEYS:
        if not draw(st.booleans()) and draw(st.booleans()):
            continue  # undeclared: graph_support() answers UNSUPPORTED
        cap = draw(capture_supports(name))
        pinned = None if cap.is_unsupported else draw(
            st.sampled_from([None, ForwardMethod.MLA, ForwardMethod.MHA]))
        mem = CaptureMemory(draw(st.integers(0, 1 << 32)), draw(st.integers(0, 1 << 24)))
        served = spec_entries(draw) if phase is Phase.DECODE else ()
        modes.append(GraphModeSupport(phase, mode, cap, pinned, draw(st.sampled_from(SplitKV)),
                                      mem, served))
    eager = ()
    if draw(st.booleans()):
        eager = spec_entries(draw) + (ForwardModeSupport(ForwardMode.EXTEND, None, False),)
    reason = draw(st.sampled_from([""] * 19 + ["generated: not on this platform"]))
    return Capabilities(backend=name, platform=platform, vendors=frozenset(Vendor),
                        kernels=tuple(kernels), graph_modes=tuple(modes),
                        platform_reason=reason, priority=draw(st.integers(0, 50)),
                        eager_forward_modes=eager)


@st.composite
def targets(draw: st.DrawFn, platform: Platform) -> Capabilities:
    """The fallback target: NATIVE, itself a FALLBACK (a chain), UNSUPPORTED or unavailable."""
    half = frozenset({DType.BF16, DType.FP16})
    kernels = (KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                                 ((576, 512),), half, half, page_sizes=(1,)),)
    modes = []
    for phase, mode in MODE_KEYS:
        kind = draw(st.sampled_from(["native", "native", "unsupported", "chain"]))
        cap = (CaptureSupport.native() if kind == "native" else
               CaptureSupport.unsupported("generated") if kind == "unsupported" else
               CaptureSupport.fallback("gen_prefill", Cost.LOW, "generated chain"))
        modes.append(GraphModeSupport(phase, mode, cap))
    reason = draw(st.sampled_from([""] * 5 + ["generated: target not here"]))
    return Capabilities(backend=TARGET, platform=platform, vendors=frozenset(Vendor),
                        kernels=kernels, graph_modes=tuple(modes), platform_reason=reason)


facts_strategy = st.builds(
    ModelFacts,
    attention=st.sampled_from(["mla"] * 9 + ["mha"]),
    kv_dtype=st.sampled_from(POOL_DTYPES),
    num_heads=st.sampled_from([16, 32, 64, 128, 128, 128, 128, 128, 128, 256]),
    act_dtype=st.sampled_from([DType.BF16, DType.FP16]),
    dsa_sparse=st.booleans(), multimodal=st.booleans(), piecewise_validated=st.booleans(),
    prefill_capture_pool_bytes=st.integers(0, 1 << 36),
    decode_capture_pool_bytes=st.integers(0, 1 << 34),
)
#: Each feature on with probability 1/6, so that plans without any are common.
features_strategy = st.builds(ServerFeatures, **{name: st.sampled_from([False] * 5 + [True])
                                                 for name in FEATURE_HELP})
engine_strategy = st.builds(
    EngineFacts,
    page_size=st.sampled_from([None] * 4 + [1, 16, 64]),
    max_context_len=st.sampled_from([4096, 8192, 8192, 131072]),
    max_running_requests=st.sampled_from([None, None, 1, 48, 1000]),
    kv_pool_bytes=st.sampled_from([0, 1 << 30]),
    device_memory_bytes=st.sampled_from([None, None, 80 * 10 ** 9, 1 << 20]),
    num_draft_tokens=st.sampled_from([0, 0, 2, 4]),
    prefill_graph_modes=st.one_of(st.none(), st.none(), st.frozensets(
        st.sampled_from([GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE]))),
    decode_graph_modes=st.one_of(st.none(), st.none(), st.just(frozenset())),
)


@st.composite
def configs(draw: st.DrawFn) -> GraphConfig:
    prefill = draw(st.sampled_from([None, None, GraphMode.DISABLED, GraphMode.BREAKABLE,
                                    GraphMode.TC_PIECEWISE]))
    decode = draw(st.sampled_from([None, None, GraphMode.DISABLED, GraphMode.FULL]))
    locked = set()
    if prefill is not None and draw(st.booleans()):
        locked.add("prefill_mode")
    if decode is not None and draw(st.booleans()):
        locked.add("decode_mode")
    budget = draw(st.one_of(st.none(), st.none(), st.integers(0, 1 << 37)))
    return GraphConfig(prefill_mode=prefill, decode_mode=decode, locked=frozenset(locked),
                       capture_memory_budget_bytes=budget,
                       capture_budget_fraction=draw(st.sampled_from([0.1, 0.1, 0.0, 1.0])))


@dataclass(frozen=True)
class Scenario:
    platform: Platform
    prefill: Capabilities
    decode: Capabilities
    target: Capabilities
    facts: ModelFacts
    config: GraphConfig
    features: ServerFeatures
    engine: EngineFacts

    def caps(self, phase: Phase) -> Capabilities:
        return self.prefill if phase is Phase.PREFILL else self.decode

    def resolve(self) -> GraphPlan:
        return resolve(self.platform, self.facts, {"prefill": self.prefill,
                                                   "decode": self.decode},
                       self.config, self.features, self.engine,
                       extra_declarations=[self.target])


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    platform = draw(st.sampled_from(PLATFORMS))
    prefill = draw(declarations(platform, "gen_prefill"))
    decode = prefill if draw(st.booleans()) else draw(declarations(platform, "gen_decode"))
    return Scenario(platform, prefill, decode, draw(targets(platform)), draw(facts_strategy),
                    draw(configs()), draw(features_strategy), draw(engine_strategy))


# -- independent expectations -------------------------------------------------

def fallback_broken(s: Scenario, caps: Capabilities, phase: Phase, mode: GraphMode) -> bool:
    cap = caps.graph_support(phase, mode).capture
    if not cap.is_fallback:
        return False
    if cap.fallback_to != TARGET:  # itself, or a name nobody declares
        return True
    if s.target.platform_reason or not s.target.kernels:
        return True
    return not s.target.graph_support(phase, mode).capture.is_native


def hard_reasons(s: Scenario, phase: Phase, mode: GraphMode) -> list[str]:
    if mode is GraphMode.DISABLED:
        return []
    caps = s.caps(phase)
    out = []
    if mode in CAPTURE_MODES and s.platform.vendor is Vendor.CPU:  # the platform table
        out.append("platform.no_device_graphs")
    host = s.engine.graph_modes(phase)
    if host is not None and mode not in host:
        out.append("engine.mode_unsupported")
    support = caps.graph_support(phase, mode)
    if support.capture.is_unsupported:
        out.append("backend.capture_unsupported")
    else:
        if fallback_broken(s, caps, phase, mode):
            out.append("backend.fallback_target_invalid")
        if support.pinned_method is not None and pinned_method_rejections(
                caps, phase, support.pinned_method, s.facts, s.engine):
            out.append("backend.pinned_kernel_rejects_model")
    out += [r.rule_id for r in FEATURE_RULES if r.severity is Severity.HARD
            and r.phase is phase and mode in r.modes and getattr(s.features, r.feature)]
    return out


def soft_reasons(s: Scenario, phase: Phase, mode: GraphMode) -> list[str]:
    if mode is GraphMode.DISABLED:
        return []
    out = [r.rule_id for r in FEATURE_RULES if r.severity is Severity.SOFT
           and r.phase is phase and mode in r.modes and getattr(s.features, r.feature)]
    cap = s.caps(phase).graph_support(phase, mode).capture
    if cap.is_fallback and cap.cost_for(s.facts.kv_dtype) is Cost.HIGH:
        out.append("backend.high_cost_fallback")
    if phase is Phase.PREFILL and mode is GraphMode.TC_PIECEWISE and s.facts.multimodal \
            and not s.facts.piecewise_validated:
        out.append("model.multimodal_piecewise_unvalidated")
    return out


def selection_fails(s: Scenario, phase: Phase) -> bool:
    caps = s.caps(phase)
    return bool(caps.platform_reason or not caps.serves(phase)
                or model_rejections(caps, phase, s.facts, s.engine))


def draft_tokens(s: Scenario) -> int | None:
    if s.engine.num_draft_tokens:
        return s.engine.num_draft_tokens
    return 0 if s.features.speculative_decoding else None


@given(scenarios())
def test_policy_properties(s: Scenario) -> None:
    cfg, platform = s.config, s.platform
    selection_error = any(selection_fails(s, p) for p in Phase)
    locked_hard = {p: hard_reasons(s, p, cfg.requested_mode(platform, p))
                   for p in Phase if cfg.is_locked(p) and not selection_fails(s, p)}
    expect_error = selection_error or any(locked_hard.values())

    try:
        plan = s.resolve()
    except GraphPolicyError as exc:
        event("policy error: " + ("selection" if selection_error else "locked hard rule"))
        assert expect_error, f"unexpected policy error: {exc.reasons}"
        # Every hard reason of every locked phase is listed.
        for phase, rules in locked_hard.items():
            for rule in rules:
                assert any(r.startswith(f"{phase} ") and rule in r for r in exc.reasons), \
                    (phase, rule, exc.reasons)
        return
    assert not expect_error, "a locked mode that breaks a hard rule must fail startup"

    event("plan")
    for d in plan.decisions:
        if d.changed or d.rule.startswith(("budget", "backend.high", "backend.fallback_t")):
            event(f"decision {d.rule} ({d.severity.value})")
    # Same input, same plan.
    assert s.resolve() == plan

    for phase in Phase:
        pp = plan.phase(phase)
        requested = cfg.requested_mode(platform, phase)
        # Hard rules are never violated: no capture on cpu, no mode the host lacks,
        # no fallback into a target that cannot serve it.
        assert hard_reasons(s, phase, pp.mode) == []
        if cfg.is_locked(phase):
            assert pp.mode is requested  # a lock is honoured
        else:
            assert pp.mode in (requested, GraphMode.TC_PIECEWISE, GraphMode.DISABLED)
            # Soft rules hold where nothing is locked.
            assert soft_reasons(s, phase, pp.mode) == []
        if pp.mode is GraphMode.TC_PIECEWISE and requested is not GraphMode.TC_PIECEWISE:
            assert s.caps(phase).graph_support(phase, GraphMode.TC_PIECEWISE).capture.is_native
            assert s.facts.piecewise_validated
        # Every change from the default has a decision entry ending on the result.
        if pp.mode is not pp.default_mode:
            changes = [d for d in plan.decisions_for(phase)
                       if d.before is not None and d.after is not None and d.changed]
            assert changes and changes[-1].after is pp.mode, (phase, plan.decisions)
        if pp.mode is GraphMode.DISABLED:
            assert pp.capture_memory_bytes == 0 and pp.pinned_method is None
            assert pp.captured == ()
        else:
            # The plan records what is captured: sequences up to the engine's context.
            assert pp.captured and all(c.max_seq_len == s.engine.max_context_len
                                       for c in pp.captured)
            limit = s.engine.max_running_requests
            for c in pp.captured:
                if limit is not None and c.forward_mode is ForwardMode.EXTEND:
                    assert c.max_requests <= limit
        # Fallbacks in effect are exactly what the declaration says for this mode.
        cap = s.caps(phase).graph_support(phase, pp.mode).capture
        assert bool(pp.fallbacks) == (pp.mode is not GraphMode.DISABLED and cap.is_fallback)

    budget = plan.capture_budget
    assert budget is not None
    if cfg.capture_memory_budget_bytes is not None:
        assert budget.bytes == cfg.capture_memory_budget_bytes and budget.source == "user"
    if budget.bytes is not None and plan.capture_memory_bytes > budget.bytes:
        # Over budget only with every remaining capture locked by the user.
        assert all(cfg.is_locked(p) for p in Phase if plan.phase(p).mode is not GraphMode.DISABLED)

    n = draft_tokens(s)
    if n is None:
        assert plan.speculative == ()
    else:
        assert [m.forward_mode for m in plan.speculative] == list(SPEC_MODES)
        full = s.decode.graph_support(Phase.DECODE, GraphMode.FULL)
        for spec in plan.speculative:
            entry = full.serving(spec.forward_mode)
            graph = (plan.decode.mode is GraphMode.FULL and n > 0 and entry is not None
                     and entry.serves_query_len(n))
            assert (spec.how == "graph") == graph, (spec, entry)
            assert (plan.decode.shapes_for(spec.forward_mode) is not None) == graph
            event(f"spec {spec.forward_mode}: {spec.how}")
    plan.to_dict()  # JSON-ready for every generated plan
