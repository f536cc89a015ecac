"""The scenarios of seeds 000 and 002, decided from declarations alone."""

from __future__ import annotations

import logging

import pytest

from attnreg.graph_policy import (
    MODEL_PRESETS,
    GraphConfig,
    ModelFacts,
    ReplayBatch,
    ReplayGate,
    Severity,
)
from attnreg.registry import (
    CaptureSupport,
    Cost,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    GraphPolicyError,
    Phase,
)

from ._helpers import declaration, sim

#: A DSA model whose top-k is not given: planned as dense absorbed MLA without an MHA
#: companion (the sparse match, with top-k, is tests/policy/test_sparse_policy.py's).
DSA_NO_TOPK = ModelFacts(dsa_sparse=True, label="dsa-without-top-k")

VALIDATED_MM = MODEL_PRESETS["kimi-k2.6"]  # multimodal, piecewise validated, FP8 pool
VALIDATED_MM_BF16 = VALIDATED_MM.with_overrides(kv_dtype=DType.BF16)
TEXT_MLA = MODEL_PRESETS["deepseek-v3"]


def changed_rules(plan, phase: Phase) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.rule for d in plan.decisions_for(phase) if d.changed]


# -- seed 002: the trtllm_mla exception, derived from its declaration ----------

def test_trtllm_mla_validated_multimodal_bf16_stays_on_breakable() -> None:
    plan = sim("cuda:sm100", VALIDATED_MM_BF16, "trtllm_mla")
    assert plan.prefill.mode is GraphMode.BREAKABLE
    upgrade = [d for d in plan.decisions_for(Phase.PREFILL) if d.rule == "model.piecewise_upgrade"]
    assert len(upgrade) == 1 and upgrade[0].severity is Severity.INFO
    assert "natively" in upgrade[0].message and not upgrade[0].changed
    # The cheap fallback is in effect and reported, with its cost.
    assert [(f.to, f.cost) for f in plan.prefill.fallbacks] == [("flashinfer_mla", Cost.LOW)]
    assert plan.prefill.pinned_method is ForwardMethod.MLA


def test_trtllm_mla_is_the_default_choice_on_blackwell() -> None:
    plan = sim("cuda:sm100", VALIDATED_MM)
    assert plan.prefill.backend == "trtllm_mla" and plan.decode.backend == "trtllm_mla"


def test_trtllm_mla_fp8_pool_lands_on_disabled_with_the_high_cost_reason() -> None:
    plan = sim("cuda:sm100", VALIDATED_MM)  # default backends: trtllm_mla
    assert plan.prefill.mode is GraphMode.DISABLED
    (downgrade,) = [d for d in plan.decisions_for(Phase.PREFILL) if d.changed]
    assert downgrade.rule == "backend.high_cost_fallback"
    assert downgrade.severity is Severity.SOFT
    assert (downgrade.before, downgrade.after) == (GraphMode.BREAKABLE, GraphMode.DISABLED)
    assert "HIGH" in downgrade.message and "fp8_e4m3" in downgrade.message
    assert plan.decode.mode is GraphMode.FULL  # decode is untouched (seed 002)


@pytest.mark.parametrize("facts", [VALIDATED_MM, VALIDATED_MM_BF16], ids=["fp8", "bf16"])
def test_explicit_tc_piecewise_lock_is_honoured_over_the_soft_rules(facts) -> None:  # type: ignore[no-untyped-def]
    plan = sim("cuda:sm100", facts, "trtllm_mla", GraphConfig.from_user(prefill="tc_piecewise"))
    assert plan.prefill.mode is GraphMode.TC_PIECEWISE and plan.prefill.locked
    locked = [d for d in plan.decisions_for(Phase.PREFILL) if d.rule == "user.locked"]
    assert locked and locked[0].after is GraphMode.TC_PIECEWISE
    high = [d for d in plan.decisions_for(Phase.PREFILL) if d.rule == "backend.high_cost_fallback"]
    if facts.kv_dtype is DType.FP8_E4M3:
        assert len(high) == 1 and high[0].severity is Severity.INFO
        assert "yields to the user's lock" in high[0].message
        assert plan.prefill.fallbacks[0].cost is Cost.HIGH
    else:
        assert high == [] and plan.prefill.fallbacks[0].cost is Cost.LOW


def test_lock_yielding_to_a_high_cost_fallback_is_logged_as_a_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="attnreg.graph_policy"):
        sim("cuda:sm100", VALIDATED_MM, "trtllm_mla", GraphConfig.from_user(prefill="tc_piecewise"))
    assert any("backend.high_cost_fallback" in r.getMessage() and "yields" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("platform,backend", [("cuda:sm100", "flashinfer_mla"),
                                              ("cuda:sm90", "flashinfer_mla"),
                                              ("cuda:sm90", "triton")])
def test_validated_model_with_a_natively_capturing_backend_upgrades(platform: str,
                                                                   backend: str) -> None:
    plan = sim(platform, VALIDATED_MM_BF16, backend)
    assert plan.prefill.mode is GraphMode.TC_PIECEWISE
    (upgrade,) = [d for d in plan.decisions_for(Phase.PREFILL) if d.changed]
    assert upgrade.rule == "model.piecewise_upgrade" and upgrade.severity is Severity.SOFT
    assert plan.prefill.fallbacks == ()


def test_unvalidated_model_does_not_upgrade() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, "flashinfer_mla")
    assert plan.prefill.mode is GraphMode.BREAKABLE
    assert not any(d.rule == "model.piecewise_upgrade" for d in plan.decisions)


def test_upgrade_is_not_applied_where_a_feature_forbids_tc_piecewise() -> None:
    from attnreg.graph_policy import ServerFeatures

    plan = sim("cuda:sm90", VALIDATED_MM_BF16, "flashinfer_mla",
               features=ServerFeatures(lora=True))
    assert plan.prefill.mode is GraphMode.BREAKABLE  # breakable supports LoRA
    (skipped,) = [d for d in plan.decisions if d.rule == "model.piecewise_upgrade"]
    assert "feature.lora" in skipped.message


# -- seed 000: BCG for MLA, decided by the declared pinning ----------------------

def test_mla_under_breakable_is_enabled_where_the_backend_pins_mla() -> None:
    plan = sim("cuda:sm90", TEXT_MLA)
    assert plan.prefill.backend == "flashinfer_mla"
    assert plan.prefill.mode is GraphMode.BREAKABLE  # no blanket "MLA disables BCG" rule
    assert plan.prefill.pinned_method is ForwardMethod.MLA
    gate = ReplayGate(plan)
    ok, reason = gate.can_replay(ReplayBatch(ForwardMode.EXTEND, 2, 100, prefix_lens=(0, 37),
                                          extend_lens=(60, 40)))
    assert ok, reason


def prefix_batch() -> ReplayBatch:
    return ReplayBatch(ForwardMode.EXTEND, batch_size=3, num_tokens=200,
                       prefix_lens=(0, 512, 64), extend_lens=(100, 50, 50))


@pytest.mark.parametrize("platform,backend", [("cuda:sm100", "flash_attn_cute"),
                                              ("cuda:sm90", "triton"),
                                              ("cuda:sm90", "flashinfer_mla")])
def test_prefix_batch_replays_where_mla_is_pinned(platform: str, backend: str) -> None:
    plan = sim(platform, TEXT_MLA, {"prefill": backend})
    assert plan.prefill.mode is GraphMode.BREAKABLE
    ok, reason = ReplayGate(plan).can_replay(prefix_batch())
    assert ok and reason.rule == "gate.ok"


def test_prefix_batch_runs_eagerly_where_mla_is_not_pinned() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, {"prefill": "flash_attn_cute"})
    assert plan.prefill.mode is GraphMode.BREAKABLE and plan.prefill.pinned_method is None
    gate = ReplayGate(plan)
    ok, reason = gate.can_replay(prefix_batch())
    assert not ok and reason.rule == "gate.mha_companion_prefix"
    # Without a prefix the companion path is capturable: the batch replays.
    ok, reason = gate.can_replay(ReplayBatch(ForwardMode.EXTEND, 2, 200, prefix_lens=(0, 0),
                                         extend_lens=(100, 100)))
    assert ok, reason
    pinning = [d for d in plan.decisions if d.rule == "backend.pinning"]
    assert pinning and "eagerly" in pinning[0].message


def test_a_backend_that_does_not_pin_gets_prefix_batches_eagerly() -> None:
    caps = declaration("unpinned", "rocm:gfx942")
    plan = sim("rocm:gfx942", TEXT_MLA, caps, GraphConfig(prefill_mode=GraphMode.BREAKABLE))
    assert plan.prefill.mode is GraphMode.BREAKABLE
    ok, reason = ReplayGate(plan).can_replay(prefix_batch())
    assert not ok and reason.rule == "gate.mha_companion_prefix"
    pinned = declaration("pinned", "rocm:gfx942",
                         pinned={(Phase.PREFILL, GraphMode.BREAKABLE): ForwardMethod.MLA})
    plan = sim("rocm:gfx942", TEXT_MLA, pinned, GraphConfig(prefill_mode=GraphMode.BREAKABLE))
    assert ReplayGate(plan).can_replay(prefix_batch())[0]


def test_dsa_sparse_model_has_no_companion_so_prefix_batches_replay() -> None:
    # A backend that pins nothing under breakable: for a DSA model the MHA companion
    # does not exist, so a prefix batch still replays.
    caps = declaration("unpinned", "rocm:gfx942")
    plan = sim("rocm:gfx942", DSA_NO_TOPK, caps,
               GraphConfig(prefill_mode=GraphMode.BREAKABLE))
    assert plan.prefill.mode is GraphMode.BREAKABLE and plan.prefill.pinned_method is None
    assert ReplayGate(plan).can_replay(prefix_batch())[0]


def test_dsa_sparse_prefill_needs_an_absorbed_kernel() -> None:
    # flash_attn_cute on sm90 has no absorbed (qv) kernel: it cannot serve a DSA
    # model's prefill at all, so naming it is an error and the default passes it over.
    dsa = DSA_NO_TOPK
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", dsa, {"prefill": "flash_attn_cute"})
    (reason,) = info.value.reasons
    assert reason.startswith("prefill: backend.model_unsupported") and "DSA" in reason
    # With an FP8 pool, flashinfer_mla's absorbed kernel (flashinfer 0.6.13) cannot read
    # it: triton, which can, serves prefill and captures it.
    plan = sim("cuda:sm90", dsa.with_overrides(kv_dtype=DType.FP8_E4M3))
    assert plan.prefill.backend == "triton" and plan.prefill.mode is GraphMode.BREAKABLE
    assert "passed over: flashinfer_mla" in plan.prefill.backend_choice


def test_locked_unsupported_modes_fail_with_every_reason() -> None:
    cfg = GraphConfig.from_user(prefill="breakable", decode="full")
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", TEXT_MLA, "reference", cfg)
    reasons = info.value.reasons
    assert len(reasons) == 2
    assert any(r.startswith("prefill breakable") and "backend.capture_unsupported" in r
               for r in reasons)
    assert any(r.startswith("decode full") and "backend.capture_unsupported" in r
               for r in reasons)


def test_locked_full_decode_on_cpu_lists_platform_and_backend_reasons() -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim("cpu", TEXT_MLA, "reference", GraphConfig.from_user(decode="full"))
    text = "\n".join(info.value.reasons)
    assert "platform.no_device_graphs" in text and "backend.capture_unsupported" in text


def test_unlocked_unsupported_default_falls_to_disabled_with_each_reason(caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING, logger="attnreg.graph_policy"):
        plan = sim("cpu", TEXT_MLA, "reference")
    assert plan.decode.mode is GraphMode.DISABLED
    assert changed_rules(plan, Phase.DECODE) == ["platform.no_device_graphs",
                                                 "backend.capture_unsupported"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "platform.no_device_graphs" in logged and "backend.capture_unsupported" in logged
    # cpu's default tc_piecewise needs device graphs too (the reference declares it native).
    assert plan.prefill.mode is GraphMode.DISABLED
    assert changed_rules(plan, Phase.PREFILL) == ["platform.no_device_graphs"]


def test_pinned_kernel_that_rejects_the_pool_dtype_is_a_hard_rule() -> None:
    # flash_attn_cute's absorbed kernel takes bf16/fp16 pools only, and it pins
    # MLA under breakable on sm100: an FP8 pool cannot be captured there.
    fp8 = TEXT_MLA.with_overrides(kv_dtype=DType.FP8_E4M3)
    plan = sim("cuda:sm100", fp8, {"prefill": "flash_attn_cute", "decode": "trtllm_mla"})
    assert plan.prefill.mode is GraphMode.DISABLED
    assert "backend.pinned_kernel_rejects_model" in changed_rules(plan, Phase.PREFILL)


def test_capture_fallback_declared_high_only_for_fp8_in_a_generated_backend() -> None:
    # A fallback target that exists and captures both modes natively (checked by the policy).
    fallback = CaptureSupport.fallback("triton", Cost.LOW, "converts the pool",
                                       costs_by_kv_dtype={DType.FP8_E4M3: Cost.HIGH})
    caps = declaration("gen_fb", "cuda:sm90",
                       modes={(Phase.PREFILL, GraphMode.BREAKABLE): fallback,
                              (Phase.PREFILL, GraphMode.TC_PIECEWISE): fallback})
    fp8 = VALIDATED_MM
    assert sim("cuda:sm90", fp8, caps).prefill.mode is GraphMode.DISABLED
    assert sim("cuda:sm90", VALIDATED_MM_BF16, caps).prefill.mode is GraphMode.BREAKABLE
