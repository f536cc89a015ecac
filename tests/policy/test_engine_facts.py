"""Engine facts as policy inputs, and selection by need."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from attnreg.graph_policy import (
    MODEL_PRESETS,
    EngineFacts,
    GraphConfig,
    ReplayBatch,
    ReplayGate,
    resolve,
)
from attnreg.registry import (
    BackendRegistry,
    BackendSpec,
    Capabilities,
    DType,
    ForwardMode,
    GraphMode,
    GraphPolicyError,
    Phase,
    hookimpl,
    load_registry,
)

from ._helpers import declaration, sim

TEXT_MLA = MODEL_PRESETS["deepseek-v3"]
FP8 = TEXT_MLA.with_overrides(kv_dtype=DType.FP8_E4M3)


def registry_with(*decls: Capabilities) -> BackendRegistry:
    """Only ``decls`` (same on every platform): selection among generated backends."""

    class Plugin:
        @hookimpl
        def attnreg_register_backends(self, register):  # type: ignore[no-untyped-def]
            for caps in decls:
                register(BackendSpec(
                    name=caps.backend, summary="generated for a test",
                    capabilities=lambda ctx, c=caps: replace(c, platform=ctx.platform),
                    runtime="attnreg.backends.reference:ReferenceBackend"))

    reg = load_registry(autoload=False, disable=["attnreg.builtin"],
                        extra_plugins=[("gen_plugin", Plugin())])
    assert not reg.errors and set(reg.names()) == {c.backend for c in decls}, reg.errors
    return reg


def test_resolve_keeps_its_positional_call_and_takes_engine_facts_sixth() -> None:
    plan = resolve("cuda:sm90", TEXT_MLA, "triton", GraphConfig(), None,
                   EngineFacts(page_size=16), assume_installed=True)
    assert plan.engine.page_size == 16 and plan.to_dict()["engine"]["page_size"] == 16


# -- page size ------------------------------------------------------------------------
def test_a_page_size_the_default_backend_does_not_declare_passes_it_over() -> None:
    # trtllm_mla declares pages of 32 and 64 only: an engine on page size 1 gets flashinfer.
    one = sim("cuda:sm100", TEXT_MLA, engine=EngineFacts(page_size=1))
    assert (one.prefill.backend, one.decode.backend) == ("flashinfer_mla", "flashinfer_mla")
    assert "passed over: trtllm_mla (priority 40: its kernels reject the model: " \
        in one.decode.backend_choice and "page size 1 not in [32, 64]" in one.decode.backend_choice
    assert sim("cuda:sm100", TEXT_MLA, engine=EngineFacts(page_size=64)).decode.backend == \
        "trtllm_mla"


def test_a_named_backend_that_rejects_the_page_size_is_an_error() -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm100", TEXT_MLA, {"decode": "trtllm_mla"}, engine=EngineFacts(page_size=1))
    (reason,) = info.value.reasons
    assert reason.startswith("decode: backend.model_unsupported") and "page size 1" in reason


# -- max context ----------------------------------------------------------------------
def test_a_kernel_declaring_a_shorter_context_is_passed_over() -> None:
    reg = registry_with(declaration("gen_short", "rocm:gfx942", priority=50, max_seq_len=4096),
                        declaration("gen_long", "rocm:gfx942", priority=10))
    short = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True,
                    engine=EngineFacts(max_context_len=4096))
    assert short.decode.backend == "gen_short"
    long = resolve("rocm:gfx942", TEXT_MLA, registry=reg, assume_installed=True,
                   engine=EngineFacts(max_context_len=131072))
    assert long.decode.backend == "gen_long"
    assert "max context 131072 above the kernel's 4096 tokens" in long.decode.backend_choice


# -- captured shapes ------------------------------------------------------------------
def test_the_plan_records_its_captured_shapes_per_phase() -> None:
    engine = EngineFacts(max_context_len=32768, max_running_requests=48, page_size=16)
    plan = sim("cuda:sm90", TEXT_MLA, "triton", engine=engine)
    (decode,) = plan.decode.captured
    assert decode.forward_mode is ForwardMode.DECODE and decode.query_len == 1
    assert decode.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 48)  # up to the bucket holding 48
    assert decode.num_tokens == decode.batch_sizes and decode.max_seq_len == 32768
    (prefill,) = plan.prefill.captured
    assert prefill.num_tokens == plan.config.prefill_num_tokens
    assert prefill.max_requests == 48 and prefill.query_len is None
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["phases"]["decode"]["captured"] == [{
        "forward_mode": "decode", "batch_sizes": list(decode.batch_sizes),
        "num_tokens": list(decode.num_tokens), "max_requests": 48, "query_len": 1,
        "max_seq_len": 32768}]
    assert data["engine"]["max_context_len"] == 32768
    shapes = [d for d in plan.decisions if d.rule == "engine.captured_shapes"]
    assert [d.phase for d in shapes] == [Phase.PREFILL, Phase.DECODE]
    assert "at most 48 requests" in shapes[1].message


def test_the_gate_uses_the_captured_shapes() -> None:
    plan = sim("cuda:sm90", TEXT_MLA, "triton",
               engine=EngineFacts(max_context_len=512, max_running_requests=3))
    gate = ReplayGate(plan)
    # 515 tokens against graphs captured for 512: refused, with the rule id (issue 18).
    ok, reason = gate.can_replay(ReplayBatch("decode", 2, seq_lens=[515, 10]))
    assert not ok and reason.rule == "gate.seq_len_above_max" and "515" in reason.message
    assert gate.can_replay(ReplayBatch("decode", 2, seq_lens=[512, 10]))[0]
    assert gate.can_replay(ReplayBatch("decode", 2, prefix_lens=[511, 9]))[0]
    assert not gate.can_replay(ReplayBatch("decode", 2, prefix_lens=[512, 9]))[0]
    # max running requests 3: the decode graphs go up to the bucket of 4.
    assert gate.bucket_for(ReplayBatch("decode", 3)) == 4
    assert gate.can_replay(ReplayBatch("decode", 5))[1].rule == "gate.batch_slots"


def test_bucket_for_is_the_padding_rule() -> None:
    cfg = GraphConfig(decode_batch_sizes=(1, 2, 4, 8), prefill_num_tokens=(64, 128, 256))
    gate = ReplayGate(sim("cuda:sm90", TEXT_MLA, "triton", cfg))
    assert [gate.bucket_for(ReplayBatch("decode", n)) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    assert gate.bucket_for(ReplayBatch("extend", 2, extend_lens=[30, 40])) == 128
    assert gate.bucket_for(ReplayBatch("extend", 1, num_tokens=300)) is None
    assert gate.bucket_for(ReplayBatch("extend", 2)) is None  # its tokens are not known
    eager = ReplayGate(sim("cuda:sm90", TEXT_MLA, "triton",
                           GraphConfig.from_user(decode="disabled")))
    assert eager.bucket_for(ReplayBatch("decode", 1)) is None
    assert eager.bucket_for(ReplayBatch("target_verify", 1, num_tokens=2)) is None


# -- host engine graph modes ----------------------------------------------------------
NO_PIECEWISE = EngineFacts(prefill_graph_modes=frozenset({GraphMode.BREAKABLE}))


def test_a_mode_the_host_lacks_is_never_the_upgrade() -> None:
    # triton captures tc_piecewise natively: a validated multimodal model would be upgraded.
    mm = MODEL_PRESETS["kimi-k2.6"].with_overrides(kv_dtype=DType.BF16)
    assert sim("cuda:sm90", mm, "triton").prefill.mode is GraphMode.TC_PIECEWISE
    plan = sim("cuda:sm90", mm, "triton", engine=NO_PIECEWISE)
    assert plan.prefill.mode is GraphMode.BREAKABLE
    (upgrade,) = [d for d in plan.decisions if d.rule == "model.piecewise_upgrade"]
    assert not upgrade.changed and "engine.mode_unsupported" in upgrade.message


def test_a_lock_on_a_mode_the_host_lacks_is_a_hard_error() -> None:
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", TEXT_MLA, "triton", GraphConfig.from_user(prefill="tc_piecewise"),
            engine=NO_PIECEWISE)
    (reason,) = info.value.reasons
    assert "engine.mode_unsupported" in reason and "runs breakable, disabled" in reason


def test_a_default_the_host_lacks_runs_eagerly_with_the_reason() -> None:
    # On npu the default prefill mode is tc_piecewise.
    plan = sim("npu", TEXT_MLA, declaration("gen", "npu"), engine=NO_PIECEWISE)
    assert plan.prefill.mode is GraphMode.DISABLED
    assert [d.rule for d in plan.decisions_for(Phase.PREFILL) if d.changed] == \
        ["engine.mode_unsupported"]


def test_engine_facts_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        EngineFacts(page_size=0)
    with pytest.raises(ValueError, match="do not exist for decode"):
        EngineFacts(decode_graph_modes=frozenset({GraphMode.BREAKABLE}))


# -- selection by need ----------------------------------------------------------------
def test_a_higher_priority_backend_whose_pinned_kernels_reject_the_model_is_passed_over() -> None:
    # flashinfer_mla serves FP8 prefill through its MHA kernel, but pins MLA under
    # breakable and its absorbed kernel (0.6.13) cannot read FP8: the next backend whose
    # declaration lets breakable run (flash_attn_cute, which pins nothing there) serves it.
    plan = sim("cuda:sm90", FP8)
    assert plan.prefill.backend == "flash_attn_cute" and plan.prefill.mode is GraphMode.BREAKABLE
    choice = plan.prefill.backend_choice
    assert "that let prefill breakable run" in choice
    assert "flashinfer_mla (priority 30: prefill breakable would not run: " \
           "backend.pinned_kernel_rejects_model" in choice


def test_without_a_capture_to_keep_priority_alone_decides() -> None:
    plan = sim("cuda:sm90", FP8, config=GraphConfig.from_user(prefill="disabled"))
    assert plan.prefill.backend == "flashinfer_mla"


def test_soft_advice_does_not_demote_a_backend() -> None:
    # Seed 002: trtllm_mla's breakable prefill falls back at HIGH cost for an FP8 pool;
    # that is advice, so it stays the prefill backend and runs eagerly.
    plan = sim("cuda:sm100", "kimi-k2.6")
    assert plan.prefill.backend == "trtllm_mla" and plan.prefill.mode is GraphMode.DISABLED
