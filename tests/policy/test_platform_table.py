"""The platform table, arch-less platforms, and capture memory as a default limit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnreg.graph_policy import (
    DEFAULT_CAPTURE_BUDGET_FRACTION,
    MODEL_PRESETS,
    EngineFacts,
    GraphConfig,
    Severity,
    Source,
)
from attnreg.registry import (
    KNOWN_DEVICES,
    PLATFORM_TRAITS,
    CaptureMemory,
    CaptureShape,
    CaptureSupport,
    Cost,
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    Phase,
    Platform,
    Vendor,
)

from ._helpers import declaration, sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]
BIG_POOL = MODEL_PRESETS["deepseek-v4-like"]  # a 64 GiB prefill capture pool (illustrative)
GB = 10 ** 9


def changed(plan, phase: Phase) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.rule for d in plan.decisions_for(phase) if d.changed]


def test_the_table_is_data_for_every_vendor() -> None:
    assert set(PLATFORM_TRAITS) == set(Vendor)
    assert [v for v, t in PLATFORM_TRAITS.items() if not t.device_graphs] == [Vendor.CPU]
    assert {v for v, t in PLATFORM_TRAITS.items() if t.arch_required} == {Vendor.CUDA,
                                                                          Vendor.ROCM}


def test_cpu_plans_both_phases_disabled_with_a_hard_platform_decision() -> None:
    plan = sim("cpu", "deepseek-v3")
    assert (plan.prefill.mode, plan.decode.mode) == (GraphMode.DISABLED, GraphMode.DISABLED)
    for phase in Phase:
        (first, *_) = [d for d in plan.decisions_for(phase) if d.changed]
        assert first.rule == "platform.no_device_graphs" and first.severity is Severity.HARD


@pytest.mark.parametrize("mode", ["tc_piecewise", "breakable"])
def test_a_locked_prefill_capture_on_cpu_fails_naming_the_rule(mode: str) -> None:
    # tc_piecewise records each torch.compile piece as a device graph: cpu has none.
    caps = declaration("gen", "cpu")  # declares every mode NATIVE: the platform still rules
    with pytest.raises(GraphPolicyError) as info:
        sim("cpu", TEXT_MLA, caps, GraphConfig.from_user(prefill=mode))
    (reason,) = info.value.reasons
    assert reason.startswith(f"prefill {mode} (set by the user): platform.no_device_graphs")


@pytest.mark.parametrize("vendor", ["npu", "xpu"])
def test_on_npu_and_xpu_the_declaration_decides(vendor: str) -> None:
    caps = declaration("gen", vendor)  # decode FULL, prefill BREAKABLE / TC_PIECEWISE native
    plan = sim(vendor, TEXT_MLA, caps, GraphConfig.from_user(prefill="breakable", decode="full"))
    assert (plan.prefill.mode, plan.decode.mode) == (GraphMode.BREAKABLE, GraphMode.FULL)
    unsupported = declaration("gen", vendor, modes={
        (Phase.DECODE, GraphMode.FULL): CaptureSupport.unsupported("not proven here")})
    assert sim(vendor, TEXT_MLA, unsupported).decode.mode is GraphMode.DISABLED


@pytest.mark.parametrize("text", ["cuda", "rocm"])
def test_a_plan_needs_an_arch_and_the_error_lists_them(text: str) -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim(text, TEXT_MLA)
    (reason,) = info.value.reasons
    assert reason.startswith("platform.arch_required: ")
    first_arch = PLATFORM_TRAITS[Vendor(text)].archs[0]
    assert f"{text}:{first_arch}" in info.value.hint
    if text == "cuda":
        assert "h200" in info.value.hint and "gb300" in info.value.hint


def test_a_gpu_name_is_a_platform_with_its_memory() -> None:
    assert Platform.parse("h200") == Platform.parse("cuda:sm90")
    assert Platform.parse("GB300") == Platform.parse("cuda:sm103")
    plan = sim("h200", TEXT_MLA)
    assert plan.platform == Platform.parse("cuda:sm90")
    budget = plan.capture_budget
    assert budget is not None and budget.source == "platform"
    assert budget.device_memory_bytes == KNOWN_DEVICES["h200"].memory_bytes
    assert budget.bytes == int(KNOWN_DEVICES["h200"].memory_bytes * DEFAULT_CAPTURE_BUDGET_FRACTION)


def test_an_arch_alone_takes_its_smallest_known_device() -> None:
    budget = sim("cuda:sm90", TEXT_MLA).capture_budget
    assert budget is not None and budget.device_memory_bytes == 80 * GB  # H100, not H200
    assert "smallest known cuda:sm90 device" in budget.note


def test_the_default_budget_drops_a_huge_prefill_capture_first() -> None:
    plan = sim("h200", BIG_POOL)
    assert plan.prefill.mode is GraphMode.DISABLED and plan.decode.mode is GraphMode.FULL
    (drop,) = [d for d in plan.decisions if d.rule == "budget.capture_memory"]
    assert drop.phase is Phase.PREFILL and drop.severity is Severity.SOFT
    assert drop.source is Source.PLATFORM and "default budget" in drop.message
    budget = plan.capture_budget
    assert budget is not None and budget.bytes is not None
    assert plan.capture_memory_bytes <= budget.bytes


def test_an_explicit_budget_or_a_lock_wins_over_the_default() -> None:
    roomy = sim("h200", BIG_POOL, config=GraphConfig(capture_memory_budget_bytes=1 << 40))
    assert roomy.prefill.mode is GraphMode.BREAKABLE
    locked = sim("h200", BIG_POOL, config=GraphConfig.from_user(prefill="breakable"))
    assert locked.prefill.mode is GraphMode.BREAKABLE
    notes = [d for d in locked.decisions if d.rule == "budget.capture_memory"]
    # The unlocked decode goes first; the locked prefill stays, with a note.
    assert [(d.phase, d.severity) for d in notes] == [(Phase.DECODE, Severity.SOFT),
                                                      (Phase.PREFILL, Severity.INFO)]
    assert "yields to the user's lock" in notes[1].message


def test_device_memory_from_the_engine_replaces_the_platform_default() -> None:
    plan = sim("h200", BIG_POOL, engine=EngineFacts(device_memory_bytes=1000 * GB))
    assert plan.prefill.mode is GraphMode.BREAKABLE
    assert plan.capture_budget is not None and plan.capture_budget.source == "engine"


def test_unknown_memory_or_a_zero_fraction_means_no_default_budget() -> None:
    npu = sim("npu", BIG_POOL, declaration("gen", "npu"))
    assert npu.capture_budget is not None and npu.capture_budget.bytes is None
    assert "device memory of npu is unknown" in npu.capture_budget.note
    assert npu.prefill.mode is GraphMode.TC_PIECEWISE
    off = sim("h200", BIG_POOL, config=GraphConfig(capture_budget_fraction=0.0))
    assert off.prefill.mode is GraphMode.BREAKABLE
    assert off.capture_budget is not None and off.capture_budget.bytes is None


def _pool_converting_fallback() -> object:
    """A prefill BREAKABLE fallback that converts the whole KV pool inside the graph."""
    caps = declaration("gen_pool", "cuda:sm90")
    memory = CaptureMemory(fixed_bytes=1 << 20, bytes_fn=lambda s: 2 * s.kv_pool_bytes,
                           formula="2 x the KV pool")
    fallback = CaptureSupport.fallback("triton", Cost.LOW, "converts the pool")
    modes = tuple(GraphModeSupport(g.phase, g.mode, fallback, g.pinned_method, g.split_kv,
                                   memory) if g.mode is GraphMode.BREAKABLE else g
                  for g in caps.graph_modes)
    return replace(caps, graph_modes=modes)


def test_declared_fallback_memory_counts_the_pool_the_engine_passes() -> None:
    caps = _pool_converting_fallback()
    unknown = sim("h200", TEXT_MLA, caps)
    assert unknown.prefill.mode is GraphMode.BREAKABLE
    (note,) = [d for d in unknown.decisions if d.rule == "budget.pool_size_unknown"]
    assert note.phase is Phase.PREFILL and "did not pass the pool size" in note.message
    pool = 100 * GB
    known = sim("h200", TEXT_MLA, caps, engine=EngineFacts(kv_pool_bytes=pool))
    # 2 x 100 GB does not fit the default budget (a tenth of 141 GB): prefill is dropped.
    assert known.prefill.mode is GraphMode.DISABLED
    assert "budget.capture_memory" in changed(known, Phase.PREFILL)
    roomy = sim("h200", TEXT_MLA, caps, GraphConfig(capture_memory_budget_bytes=1 << 40),
                engine=EngineFacts(kv_pool_bytes=pool))
    assert roomy.prefill.capture_memory_bytes == (1 << 20) + 2 * pool
    assert not [d for d in roomy.decisions if d.rule == "budget.pool_size_unknown"]


def test_capture_memory_is_estimated_for_the_engine_shape() -> None:
    seen: list[CaptureShape] = []

    def record(shape: CaptureShape) -> int:
        seen.append(shape)
        return 0

    caps = declaration("gen_shape", "cuda:sm90")
    modes = tuple(replace(g, capture_memory=CaptureMemory(bytes_fn=record))
                  for g in caps.graph_modes)
    engine = EngineFacts(page_size=64, max_context_len=32768, kv_pool_bytes=7,
                         max_running_requests=48)
    sim("cuda:sm90", TEXT_MLA, replace(caps, graph_modes=modes), engine=engine)
    decode = [s for s in seen if s.max_num_tokens == s.max_batch_size]
    assert decode and decode[-1].max_batch_size == 48  # the bucket that holds 48 requests
    for shape in seen:
        assert (shape.page_size, shape.max_seq_len, shape.kv_pool_bytes) == (64, 32768, 7)
        assert shape.num_heads == TEXT_MLA.num_heads and shape.kv_dtype is TEXT_MLA.kv_dtype


@pytest.mark.gpu
def test_the_device_memory_is_detected_on_a_gpu() -> None:
    import torch

    from attnreg.registry.platform import detect_device_memory

    assert detect_device_memory() == torch.cuda.get_device_properties(0).total_memory
