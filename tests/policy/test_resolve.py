"""resolve(): defaults, backend selection, features, budget, plan output."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest

from attnreg.graph_policy import (
    FEATURE_RULES,
    MODEL_PRESETS,
    GraphConfig,
    ModelFacts,
    ServerFeatures,
    Severity,
    default_mode,
    resolve,
)
from attnreg.graph_policy.config import DEFAULT_MAX_SEQ_LEN
from attnreg.registry import (
    BackendRegistry,
    BackendSpec,
    Capabilities,
    CaptureMemory,
    CaptureShape,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    Phase,
    Platform,
    UnknownBackendError,
    get_registry,
    hookimpl,
    load_registry,
)

from ._helpers import VERSIONS, declaration, sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]


@pytest.mark.parametrize("platform,prefill", [
    ("cuda:sm90", GraphMode.BREAKABLE), ("cuda:sm100", GraphMode.BREAKABLE),
    ("rocm:gfx942", GraphMode.TC_PIECEWISE), ("npu", GraphMode.TC_PIECEWISE),
    ("xpu", GraphMode.TC_PIECEWISE), ("cpu", GraphMode.TC_PIECEWISE)])
def test_defaults_decode_full_prefill_breakable_only_on_cuda(platform: str,
                                                            prefill: GraphMode) -> None:
    plat = Platform.parse(platform)
    assert default_mode(plat, Phase.DECODE) is GraphMode.FULL
    assert default_mode(plat, Phase.PREFILL) is prefill


def test_a_native_backend_keeps_the_defaults_with_no_change_decisions() -> None:
    plan = sim("rocm:gfx942", TEXT_MLA, declaration("gen", "rocm:gfx942"))
    assert (plan.prefill.mode, plan.decode.mode) == (GraphMode.TC_PIECEWISE, GraphMode.FULL)
    assert not any(d.changed for d in plan.decisions)
    assert plan.prefill.default_mode is GraphMode.TC_PIECEWISE


def test_config_rejects_modes_a_phase_does_not_have() -> None:
    with pytest.raises(ValueError, match="decode cannot use graph mode breakable"):
        GraphConfig.from_user(decode="breakable")
    with pytest.raises(ValueError, match="prefill cannot use graph mode full"):
        GraphConfig(prefill_mode=GraphMode.FULL)
    with pytest.raises(ValueError, match="locked but has no value"):
        GraphConfig(locked=frozenset({"decode_mode"}))


def test_default_selection_skips_backends_whose_kernels_reject_the_pool() -> None:
    fp8 = TEXT_MLA.with_overrides(kv_dtype=DType.FP8_E4M3)
    plan = sim("cuda:sm90", fp8)
    assert plan.decode.backend == "triton"  # flashinfer_mla (higher priority) takes no FP8
    chosen = [d for d in plan.decisions if d.rule == "backend.selected" and d.phase is Phase.DECODE]
    assert "passed over: flashinfer_mla (priority 30: its kernels reject the model" in \
        chosen[0].message and "fp8_e4m3" in chosen[0].message


def _registry_with(*decls: Capabilities) -> BackendRegistry:
    """A registry holding the built-ins plus ``decls`` (same on every platform)."""

    class Plugin:
        @hookimpl
        def attnreg_register_backends(self, register):  # type: ignore[no-untyped-def]
            for caps in decls:
                register(BackendSpec(
                    name=caps.backend, summary="generated for a test",
                    capabilities=lambda ctx, c=caps: replace(c, platform=ctx.platform),
                    runtime="attnreg.backends.reference:ReferenceBackend"))

    reg = load_registry(autoload=False, extra_plugins=[("gen_plugin", Plugin())])
    assert not reg.errors, reg.errors
    return reg


def test_default_selection_takes_the_highest_priority_that_accepts_the_model() -> None:
    bf16_only = declaration("gen_high", "rocm:gfx942", kv_dtypes=frozenset({DType.BF16}),
                            priority=50)
    any_pool = declaration("gen_low", "rocm:gfx942", priority=10)
    reg = _registry_with(bf16_only, any_pool)
    plan = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True)
    assert (plan.prefill.backend, plan.decode.backend) == ("gen_high", "gen_high")
    fp8 = TEXT_MLA.with_overrides(kv_dtype=DType.FP8_E4M3)
    plan = resolve("rocm:gfx942", fp8, registry=reg, assume_installed=True)
    assert plan.decode.backend == "gen_low"
    assert "passed over: gen_high (priority 50: its kernels reject the model" in \
        plan.decode.backend_choice


def test_equal_priorities_break_ties_by_name() -> None:
    reg = _registry_with(declaration("gen_b", "rocm:gfx942", priority=5),
                         declaration("gen_a", "rocm:gfx942", priority=5))
    plan = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True)
    assert plan.decode.backend == "gen_a"


def test_unknown_backend_name_raises_did_you_mean() -> None:
    with pytest.raises(UnknownBackendError, match="Did you mean: trtllm_mla"):
        sim("cuda:sm100", TEXT_MLA, "trtlm_mla")


def test_backend_unavailable_on_the_platform_is_a_policy_error() -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", TEXT_MLA, "trtllm_mla")
    assert all("backend.unavailable" in r for r in info.value.reasons)
    assert len(info.value.reasons) == 2  # both phases


@pytest.mark.parametrize("platform, model, backends, config", [
    ("cuda:sm90", TEXT_MLA, "trtllm_mla", None),                  # unavailable, both phases
    ("cuda:sm100", TEXT_MLA, "flash_attn_cute", None),            # no decode kernel
    ("cuda:sm90", MODEL_PRESETS["llama-3-8b"], None, None),       # none fits
    ("cuda", TEXT_MLA, None, None),                               # no architecture
    ("cpu", TEXT_MLA, None, GraphConfig.from_user(decode="full")),  # a locked mode
])
def test_every_reason_has_the_documented_form(platform: str, model: ModelFacts,
                                              backends: object, config: object) -> None:
    # GraphPolicyError's docstring: "PHASE[ MODE (set by the user)]: RULE_ID: message",
    # or "RULE_ID: message" for a reason about no phase (issue 28: its old docstring said
    # every reason starts with the rule id).
    from attnreg.graph_policy import RULES

    form = re.compile(r"^(?:(?:prefill|decode)(?: [a-z_]+ \(set by the user\))?: )?"
                      r"([a-z_]+\.[a-z_0-9]+): \S")
    with pytest.raises(GraphPolicyError) as info:
        sim(platform, model, backends, config)  # type: ignore[arg-type]
    assert info.value.reasons
    for reason in info.value.reasons:
        found = form.match(reason)
        assert found and found.group(1) in RULES, reason


def test_prefill_only_backend_cannot_serve_decode() -> None:
    with pytest.raises(GraphPolicyError, match="backend.phase_unserved"):
        sim("cuda:sm100", TEXT_MLA, "flash_attn_cute")


def test_mha_model_finds_no_mla_backend_for_decode() -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", MODEL_PRESETS["llama-3-8b"])
    assert any(r.startswith("decode: backend.none_fits") and "mha model" in r
               for r in info.value.reasons)


@pytest.mark.parametrize("rule", [r for r in FEATURE_RULES if r.severity is Severity.HARD],
                         ids=lambda r: f"{r.feature}-{'-'.join(sorted(m.value for m in r.modes))}")
def test_hard_feature_rules_disable_defaults_and_refuse_locks(rule) -> None:  # type: ignore[no-untyped-def]
    feats = ServerFeatures(**{rule.feature: True})
    caps = declaration("gen", "cuda:sm90")
    (mode,) = rule.modes
    unlocked = sim("cuda:sm90", TEXT_MLA, caps, GraphConfig(prefill_mode=mode), feats)
    assert unlocked.phase(rule.phase).mode is GraphMode.DISABLED
    assert rule.rule_id in [d.rule for d in unlocked.decisions if d.changed]
    cfg = GraphConfig.from_user(**{rule.phase.value: mode})
    with pytest.raises(GraphPolicyError, match=rule.rule_id):
        sim("cuda:sm90", TEXT_MLA, caps, cfg, feats)


@pytest.mark.parametrize("rule", [r for r in FEATURE_RULES if r.severity is Severity.SOFT],
                         ids=lambda r: f"{r.feature}-{'-'.join(sorted(m.value for m in r.modes))}")
def test_soft_feature_rules_adjust_defaults_and_yield_to_locks(rule) -> None:  # type: ignore[no-untyped-def]
    feats = ServerFeatures(**{rule.feature: True})
    caps = declaration("gen", "cuda:sm90")
    (mode,) = rule.modes
    unlocked = sim("cuda:sm90", TEXT_MLA, caps, GraphConfig(prefill_mode=mode), feats)
    assert unlocked.phase(rule.phase).mode is GraphMode.DISABLED
    locked = sim("cuda:sm90", TEXT_MLA, caps, GraphConfig.from_user(**{rule.phase.value: mode}),
                 feats)
    assert locked.phase(rule.phase).mode is mode
    assert any(d.rule == rule.rule_id and d.severity is Severity.INFO for d in locked.decisions)


def test_speculative_decoding_restricts_no_mode() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, features=ServerFeatures(speculative_decoding=True))
    assert (plan.prefill.mode, plan.decode.mode) == (GraphMode.BREAKABLE, GraphMode.FULL)
    # ... and says how its batches run (tests/policy/test_speculative.py has the rest).
    assert [s.forward_mode.value for s in plan.speculative] == ["target_verify",
                                                                "draft_extend"]


def test_multimodal_model_without_piecewise_validation_avoids_tc_piecewise_by_default() -> None:
    mm = TEXT_MLA.with_overrides(multimodal=True)
    plan = sim("rocm:gfx942", mm, declaration("gen", "rocm:gfx942"))
    assert plan.prefill.mode is GraphMode.DISABLED
    assert "model.multimodal_piecewise_unvalidated" in [d.rule for d in plan.decisions
                                                        if d.changed]


def _with_capture_memory(fixed: int) -> object:
    caps = declaration("gen_mem", "cuda:sm90")
    modes = tuple(GraphModeSupport(g.phase, g.mode, g.capture, g.pinned_method, g.split_kv,
                                   CaptureMemory(fixed_bytes=fixed)) for g in caps.graph_modes)
    return replace(caps, graph_modes=modes)


def test_capture_budget_drops_prefill_first_and_keeps_decode() -> None:
    big = MODEL_PRESETS["deepseek-v4-like"]
    caps = _with_capture_memory(1 << 20)
    budget = 1 << 30
    plan = sim("cuda:sm90", big, caps, GraphConfig(capture_memory_budget_bytes=budget))
    assert plan.prefill.mode is GraphMode.DISABLED and plan.decode.mode is GraphMode.FULL
    (drop,) = [d for d in plan.decisions if d.rule == "budget.capture_memory"]
    assert drop.phase is Phase.PREFILL and drop.severity is Severity.SOFT
    assert plan.capture_memory_bytes <= budget
    assert plan.decode.capture_memory_bytes == 1 << 20


def test_capture_budget_yields_to_a_locked_prefill() -> None:
    big = MODEL_PRESETS["deepseek-v4-like"]
    cfg = GraphConfig.from_user(prefill="breakable", capture_memory_budget_bytes=1 << 30)
    plan = sim("cuda:sm90", big, _with_capture_memory(1 << 20), cfg)
    assert plan.prefill.mode is GraphMode.BREAKABLE
    # decode is dropped (unlocked) and the locked prefill stays, with a note.
    assert plan.decode.mode is GraphMode.DISABLED
    notes = [d for d in plan.decisions if d.rule == "budget.capture_memory"]
    assert [(d.phase, d.severity) for d in notes] == [(Phase.DECODE, Severity.SOFT),
                                                      (Phase.PREFILL, Severity.INFO)]


def test_capture_memory_estimate_counts_backend_buffers_and_model_pool() -> None:
    facts = ModelFacts(prefill_capture_pool_bytes=1000, decode_capture_pool_bytes=10)
    plan = sim("cuda:sm90", facts, {"prefill": "flashinfer_mla", "decode": "triton"})
    cfg = plan.config
    reg = get_registry()
    prefill_mem = reg.declaration("flashinfer_mla", "cuda:sm90", VERSIONS).graph_support(
        Phase.PREFILL, GraphMode.BREAKABLE).capture_memory
    decode_mem = reg.declaration("triton", "cuda:sm90", VERSIONS).graph_support(
        Phase.DECODE, GraphMode.FULL).capture_memory
    # Prefill counts its captured request slots, decode its largest batch.
    prefill_shape = CaptureShape(max_batch_size=cfg.prefill_max_requests,
                                 max_num_tokens=cfg.prefill_num_tokens[-1],
                                 max_seq_len=DEFAULT_MAX_SEQ_LEN, num_heads=facts.num_heads,
                                 kv_dtype=facts.kv_dtype)
    decode_shape = CaptureShape(max_batch_size=cfg.decode_batch_sizes[-1],
                                max_num_tokens=cfg.decode_batch_sizes[-1],
                                max_seq_len=DEFAULT_MAX_SEQ_LEN, num_heads=facts.num_heads,
                                kv_dtype=facts.kv_dtype)
    assert prefill_mem.estimate(prefill_shape) > 0
    assert plan.prefill.capture_memory_bytes == prefill_mem.estimate(prefill_shape) + 1000
    assert plan.decode.capture_memory_bytes == decode_mem.estimate(decode_shape) + 10
    eager = sim("cuda:sm90", facts, {"prefill": "flashinfer_mla", "decode": "triton"},
                GraphConfig.from_user(prefill="disabled", decode="disabled"))
    assert eager.capture_memory_bytes == 0


def test_same_input_same_plan_and_json_round_trip() -> None:
    a = sim("cuda:sm100", "kimi-k2.6")
    b = sim("cuda:sm100", "kimi-k2.6")
    assert a == b
    data = json.loads(json.dumps(a.to_dict()))
    assert data["phases"]["prefill"]["mode"] == "disabled"
    assert data["phases"]["decode"]["pinned_method"] == "mla"
    assert {"rule", "severity", "source", "phase", "before", "after", "message"} <= \
        set(data["decisions"][0])


def test_split_kv_single_is_reported_for_flash_attn_cute_on_blackwell() -> None:
    plan = sim("cuda:sm100", TEXT_MLA, {"prefill": "flash_attn_cute", "decode": "trtllm_mla"})
    assert plan.prefill.split_kv is not None and plan.prefill.split_kv.value == "single"
    assert any(d.rule == "backend.split_kv_single" for d in plan.decisions)


def test_every_downgrade_is_logged_with_its_rule(caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="attnreg.graph_policy"):
        plan = sim("cuda:sm100", "kimi-k2.6")
    downgrades = [d for d in plan.decisions if d.changed and d.after is GraphMode.DISABLED]
    assert downgrades
    messages = [r.getMessage() for r in caplog.records]
    for d in downgrades:
        assert any(d.rule in m and d.message in m for m in messages)


def test_resolve_accepts_a_preset_name_and_plain_strings() -> None:
    plan = resolve("cuda:sm90", "deepseek-v2-lite", {"prefill": "triton", "decode": "triton"},
                   assume_installed=True)
    assert plan.model.num_heads == 16 and plan.prefill.backend == "triton"


# -- backend.pinning agrees with the replay gate -------------------------------------
@pytest.mark.parametrize("pinned, replays", [(ForwardMethod.MLA, True),
                                             (ForwardMethod.MHA, False), (None, False)])
def test_pinning_decision_says_what_the_gate_does_with_prefix_batches(pinned, replays):
    from attnreg.graph_policy import ReplayBatch, ReplayGate

    caps = declaration(pinned={(Phase.PREFILL, GraphMode.BREAKABLE): pinned})
    plan = resolve("cuda:sm90", TEXT_MLA, caps)
    [note] = [d for d in plan.decisions if d.rule == "backend.pinning"]
    ok, reason = ReplayGate(plan).can_replay(
        ReplayBatch("extend", batch_size=1, num_tokens=128, prefix_lens=[64]))
    assert ok is replays, reason
    if replays:
        assert "may replay" in note.message and "gate.cost_model" in note.message
    else:
        assert "run eagerly" in note.message and reason.rule in note.message


# -- GraphPolicyError says what to do -------------------------------------------------
def test_policy_error_hint_for_an_unusable_backend():
    with pytest.raises(GraphPolicyError) as info:
        sim("cpu", TEXT_MLA, backends="trtllm_mla")
    hint = info.value.hint
    assert "choose a prefill backend" in hint and "choose a decode backend" in hint
    assert "unlock" not in hint and "attnreg backends --platform cpu" in hint
    assert hint in str(info.value)


def test_policy_error_hint_for_a_locked_mode():
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", TEXT_MLA, backends="reference",
            config=GraphConfig.from_user(decode="full"))
    hint = info.value.hint
    assert "unlock decode" in hint and "captures full on cuda:sm90" in hint
    assert "prefill" not in hint
