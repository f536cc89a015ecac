"""Property tests over generated platforms, declarations, facts, locks, features.

The expectations are recomputed here from the declarations themselves, so a
rule the resolver forgets (or applies to a locked mode) is caught.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attnreg.graph_policy import (
    FEATURE_RULES,
    GraphConfig,
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
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    KernelConstraints,
    Phase,
    Platform,
    SplitKV,
    Vendor,
)

PLATFORMS = [Platform.parse(p) for p in ("cuda:sm80", "cuda:sm90", "cuda:sm100", "cuda:sm103",
                                          "rocm:gfx942", "cpu", "npu", "xpu")]
POOL_DTYPES = [DType.BF16, DType.FP16, DType.FP8_E4M3]
MODE_KEYS = ((Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE),
             (Phase.PREFILL, GraphMode.TC_PIECEWISE))


@st.composite
def capture_supports(draw: st.DrawFn) -> CaptureSupport:
    kind = draw(st.sampled_from(["native", "fallback", "unsupported"]))
    if kind == "native":
        return CaptureSupport.native()
    if kind == "unsupported":
        return CaptureSupport.unsupported("generated: cannot capture")
    per = draw(st.dictionaries(st.sampled_from(POOL_DTYPES), st.sampled_from(list(Cost)),
                               max_size=2))
    return CaptureSupport.fallback("some_other", draw(st.sampled_from(list(Cost))),
                                   "generated fallback", per)


@st.composite
def declarations(draw: st.DrawFn, platform: Platform, name: str) -> Capabilities:
    half = frozenset({DType.BF16, DType.FP16})
    # Mostly accepting declarations, so that most scenarios reach the mode rules.
    kv = draw(st.one_of(st.just(frozenset(POOL_DTYPES)),
                        st.frozensets(st.sampled_from(POOL_DTYPES), min_size=1)))
    max_heads = draw(st.sampled_from([128] * 6 + [16, 64]))
    kernels = [KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                                 ((576, 512),), half, kv, page_sizes=(1, 64),
                                 max_heads=max_heads)]
    if draw(st.booleans()):
        kernels.append(KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}),
                                         ((192, 128), (128, 128)), half, half, max_heads=128))
    modes = []
    for phase, mode in MODE_KEYS:
        if not draw(st.booleans()) and draw(st.booleans()):
            continue  # undeclared: graph_support() answers UNSUPPORTED
        cap = draw(capture_supports())
        pinned = None if cap.is_unsupported else draw(
            st.sampled_from([None, ForwardMethod.MLA, ForwardMethod.MHA]))
        mem = CaptureMemory(draw(st.integers(0, 1 << 32)), draw(st.integers(0, 1 << 24)))
        modes.append(GraphModeSupport(phase, mode, cap, pinned, draw(st.sampled_from(SplitKV)),
                                      mem))
    reason = draw(st.sampled_from([""] * 9 + ["generated: not on this platform"]))
    return Capabilities(backend=name, platform=platform, vendors=frozenset(Vendor),
                        kernels=tuple(kernels), graph_modes=tuple(modes),
                        platform_reason=reason, priority=draw(st.integers(0, 50)))


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
    budget = draw(st.one_of(st.none(), st.integers(0, 1 << 37)))
    return GraphConfig(prefill_mode=prefill, decode_mode=decode, locked=frozenset(locked),
                       capture_memory_budget_bytes=budget)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[object, ...]:
    platform = draw(st.sampled_from(PLATFORMS))
    prefill = draw(declarations(platform, "gen_prefill"))
    decode = prefill if draw(st.booleans()) else draw(declarations(platform, "gen_decode"))
    return platform, prefill, decode, draw(facts_strategy), draw(configs()), \
        draw(features_strategy)


# -- independent expectations -------------------------------------------------

def hard_reasons(platform: Platform, caps: Capabilities, phase: Phase, mode: GraphMode,
                 facts: ModelFacts, feats: ServerFeatures) -> list[str]:
    if mode is GraphMode.DISABLED:
        return []
    out = []
    if mode in (GraphMode.FULL, GraphMode.BREAKABLE) and not platform.has_device_graphs:
        out.append("platform.no_device_graphs")
    support = caps.graph_support(phase, mode)
    if support.capture.is_unsupported:
        out.append("backend.capture_unsupported")
    elif support.pinned_method is not None and \
            pinned_method_rejections(caps, phase, support.pinned_method, facts):
        out.append("backend.pinned_kernel_rejects_model")
    out += [r.rule_id for r in FEATURE_RULES if r.severity is Severity.HARD
            and r.phase is phase and mode in r.modes and getattr(feats, r.feature)]
    return out


def soft_reasons(caps: Capabilities, phase: Phase, mode: GraphMode, facts: ModelFacts,
                 feats: ServerFeatures) -> list[str]:
    if mode is GraphMode.DISABLED:
        return []
    out = [r.rule_id for r in FEATURE_RULES if r.severity is Severity.SOFT
           and r.phase is phase and mode in r.modes and getattr(feats, r.feature)]
    cap = caps.graph_support(phase, mode).capture
    if cap.is_fallback and cap.cost_for(facts.kv_dtype) is Cost.HIGH:
        out.append("backend.high_cost_fallback")
    if phase is Phase.PREFILL and mode is GraphMode.TC_PIECEWISE and facts.multimodal \
            and not facts.piecewise_validated:
        out.append("model.multimodal_piecewise_unvalidated")
    return out


def selection_fails(caps: Capabilities, phase: Phase, facts: ModelFacts) -> bool:
    return bool(caps.platform_reason or not caps.serves(phase)
                or model_rejections(caps, phase, facts))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_policy_properties(scenario: tuple[object, ...]) -> None:
    platform, prefill_caps, decode_caps, facts, cfg, feats = scenario
    assert isinstance(platform, Platform) and isinstance(cfg, GraphConfig)
    assert isinstance(facts, ModelFacts) and isinstance(feats, ServerFeatures)
    assert isinstance(prefill_caps, Capabilities) and isinstance(decode_caps, Capabilities)
    caps = {Phase.PREFILL: prefill_caps, Phase.DECODE: decode_caps}
    backends = {"prefill": prefill_caps, "decode": decode_caps}

    selection_error = any(selection_fails(caps[p], p, facts) for p in Phase)
    locked_hard = {p: hard_reasons(platform, caps[p], p, cfg.requested_mode(platform, p), facts,
                                   feats)
                   for p in Phase if cfg.is_locked(p) and not selection_fails(caps[p], p, facts)}
    expect_error = selection_error or any(locked_hard.values())

    try:
        plan = resolve(platform, facts, backends, cfg, feats)
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
        if d.changed or d.rule.startswith(("budget", "backend.high")):
            event(f"decision {d.rule} ({d.severity.value})")
    # Same input, same plan.
    assert resolve(platform, facts, backends, cfg, feats) == plan

    for phase in Phase:
        pp = plan.phase(phase)
        requested = cfg.requested_mode(platform, phase)
        # Hard rules are never violated.
        assert hard_reasons(platform, caps[phase], phase, pp.mode, facts, feats) == []
        if cfg.is_locked(phase):
            assert pp.mode is requested  # a lock is honoured
        else:
            assert pp.mode in (requested, GraphMode.TC_PIECEWISE, GraphMode.DISABLED)
            # Soft rules hold where nothing is locked.
            assert soft_reasons(caps[phase], phase, pp.mode, facts, feats) == []
        if pp.mode is GraphMode.TC_PIECEWISE and requested is not GraphMode.TC_PIECEWISE:
            assert caps[phase].graph_support(phase, GraphMode.TC_PIECEWISE).capture.is_native
            assert facts.piecewise_validated
        # Every change from the default has a decision entry ending on the result.
        if pp.mode is not pp.default_mode:
            changes = [d for d in plan.decisions_for(phase)
                       if d.before is not None and d.after is not None and d.changed]
            assert changes and changes[-1].after is pp.mode, (phase, plan.decisions)
        if pp.mode is GraphMode.DISABLED:
            assert pp.capture_memory_bytes == 0 and pp.pinned_method is None
        # Fallbacks in effect are exactly what the declaration says for this mode.
        cap = caps[phase].graph_support(phase, pp.mode).capture
        assert bool(pp.fallbacks) == (pp.mode is not GraphMode.DISABLED and cap.is_fallback)
    budget = cfg.capture_memory_budget_bytes
    if budget is not None and plan.capture_memory_bytes > budget:
        # Over budget only with every remaining capture locked by the user.
        assert all(cfg.is_locked(p) for p in Phase if plan.phase(p).mode is not GraphMode.DISABLED)
    plan.to_dict()  # JSON-ready for every generated plan
