"""vLLM 0.33's cudagraph resolution with the bridge off and on, on CPU with simulated GPUs.

For each configuration (backend x KV dtype x speculative decoding x explicit
mode) the tables below give vLLM's own answer and attnreg's; with the bridge
on, vLLM's real ``resolve_cudagraph_mode_and_sizes`` returns attnreg's plan,
and every difference from vLLM's own answer carries the attnreg rule that
causes it (or the declaration's support, where only the support differs).
"""

from __future__ import annotations

import logging
import pickle

import pytest

from .conftest import HAS_VLLM, SKIP_REASON

if not HAS_VLLM:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from vllm.config import CompilationConfig
from vllm.config.compilation import CUDAGraphMode

from attnreg.integrations.vllm import hooks
from attnreg.integrations.vllm.adapter import VllmGraphPolicyError

from . import _vllm_env as env
from ._vllm_env import Engine

# Engine -> (vLLM's own mode, attnreg's mode, attnreg's support, the rule ids behind a
# mode change).  vLLM's own supports: TRITON_MLA / FLASHMLA UNIFORM_BATCH, FLASHINFER_MLA
# ALWAYS, CUTLASS_MLA UNIFORM_SINGLE_TOKEN_DECODE.
CASES: dict[Engine, tuple[str, str, str, tuple[str, ...]]] = {
    Engine("TRITON_MLA", 90): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ()),
    Engine("TRITON_MLA", 90, "fp8"): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ()),
    # Verify batches of 4 tokens: within the 8 draft tokens triton's full graphs declare.
    Engine("TRITON_MLA", 90, draft=3): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ("spec.graph",)),
    # 10 speculative tokens (verify batches of 11): more than triton's full graphs
    # declare, so verify runs eagerly.
    Engine("TRITON_MLA", 90, draft=10): (
        "FULL_AND_PIECEWISE", "PIECEWISE", "UNIFORM_SINGLE_TOKEN_DECODE", ("spec.eager",)),
    Engine("TRITON_MLA", 90, explicit="FULL_DECODE_ONLY"): (
        "FULL_DECODE_ONLY", "FULL_DECODE_ONLY", "UNIFORM_BATCH", ()),
    # FLASHINFER_MLA is trtllm-gen decode: attnreg's trtllm_mla declares decode and
    # uniform target-verify graphs (up to 2 tokens per sequence), where vLLM states ALWAYS.
    Engine("FLASHINFER_MLA", 100): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ()),
    # The seed-002 cost rule: piecewise prefill falls back at HIGH cost for an FP8 pool.
    Engine("FLASHINFER_MLA", 100, "fp8"): (
        "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "UNIFORM_BATCH",
        ("backend.high_cost_fallback",)),
    # ... an explicit mode is a lock: the soft rule yields.
    Engine("FLASHINFER_MLA", 100, "fp8", explicit="FULL_AND_PIECEWISE"): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ()),
    # trtllm_mla's full graphs serve verify batches of up to 2 tokens per sequence
    # (1 speculative token: the accepted token and one draft)...
    Engine("FLASHINFER_MLA", 100, draft=1): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ("spec.graph",)),
    # ... and no more, so longer verify batches run eagerly: 2 speculative tokens are
    # verify batches of 3 tokens (the accepted one and the drafts).
    Engine("FLASHINFER_MLA", 100, draft=2): (
        "FULL_AND_PIECEWISE", "PIECEWISE", "UNIFORM_SINGLE_TOKEN_DECODE", ("spec.eager",)),
    Engine("FLASHINFER_MLA", 100, draft=3): (
        "FULL_AND_PIECEWISE", "PIECEWISE", "UNIFORM_SINGLE_TOKEN_DECODE", ("spec.eager",)),
    Engine("FLASHMLA", 90, draft=2): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ("spec.graph",)),
    Engine("FLASHMLA", 90, "fp8"): (
        "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", "UNIFORM_BATCH", ()),
    # attnreg's reference declares no decode graphs (a hard rule; unlocked: a downgrade),
    # and behind vLLM's interface the adapter runs every attnreg backend eagerly.
    Engine("ATTNREG_REFERENCE", 90): (
        "PIECEWISE", "PIECEWISE", "NEVER",
        ("engine.mode_unsupported", "backend.capture_unsupported")),
    # attnreg's triton declares full decode graphs, but behind vLLM's interface the
    # adapter runs it eagerly (its builder states NEVER): no full decode graph.
    Engine("ATTNREG_TRITON", 90): (
        "PIECEWISE", "PIECEWISE", "NEVER", ("engine.mode_unsupported",)),
}

#: Configurations the bridge leaves to vLLM, with why.
GAPS: dict[Engine, tuple[str, str]] = {
    Engine("CUTLASS_MLA", 100): ("FULL_AND_PIECEWISE", "no attnreg declaration"),
    Engine("TRITON_MLA", 90, explicit="FULL"): (
        "FULL_AND_PIECEWISE", "full graphs of mixed batches have no attnreg equivalent"),
    Engine("TRITON_MLA", 90, "fp8_e5m2"): ("FULL_AND_PIECEWISE", "'fp8_e5m2' has no attnreg"),
}

_IDS = [e.label for e in CASES]
_GAP_IDS = [e.label for e in GAPS]


@pytest.fixture(scope="module", autouse=True)
def _reference_backend() -> None:
    env.register_reference()


def _resolve(e: Engine) -> tuple[str, object]:
    vllm_config, builder, spec = env.engine(e)
    with env.simulated_gpu(e.sm):
        mode = env.runner_step(vllm_config, builder, spec)
    return mode, vllm_config


@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA"])
def test_stand_ins_state_what_vllm_states(backend: str) -> None:
    assert env.stated_in_source(backend)


@pytest.mark.parametrize("e", list(CASES) + list(GAPS), ids=_IDS + _GAP_IDS)
def test_bridge_off_leaves_vllm_unchanged(e: Engine) -> None:
    assert not hooks.installed()
    own = CASES[e][0] if e in CASES else GAPS[e][0]
    assert _resolve(e)[0] == own


@pytest.mark.parametrize("e", list(CASES), ids=_IDS)
def test_bridge_on_resolves_attnregs_plan(e: Engine, bridge_on: None,
                                          caplog: pytest.LogCaptureFixture) -> None:
    own, planned, support, reasons = CASES[e]
    with caplog.at_level(logging.INFO, logger="vllm.attnreg"):
        mode, vllm_config = _resolve(e)
    outcome = hooks.outcome_of(vllm_config, e.backend)
    assert outcome is not None and outcome.plan is not None
    assert mode == outcome.mode == planned
    assert outcome.support == support
    assert outcome.reasons == reasons
    if mode != own:
        # every change has its rule, and the rule is in vLLM's log line
        assert reasons
        assert any(all(r in rec.getMessage() for r in reasons) and mode in rec.getMessage()
                   for rec in caplog.records if rec.levelno >= logging.WARNING)
    # vLLM's resolution runs unchanged after the bridge and confirms the plan
    assert vllm_config.compilation_config.cudagraph_mode.name == planned


@pytest.mark.parametrize("e", list(GAPS), ids=_GAP_IDS)
def test_gaps_are_left_to_vllm(e: Engine, bridge_on: None) -> None:
    own, why = GAPS[e]
    mode, vllm_config = _resolve(e)
    outcome = hooks.outcome_of(vllm_config, e.backend)
    assert mode == own
    assert outcome is not None and outcome.plan is None
    assert any(why in gap for gap in outcome.gaps), outcome.gaps


def test_a_lock_breaking_a_hard_rule_fails_startup(bridge_on: None) -> None:
    e = Engine("ATTNREG_REFERENCE", 90, explicit="FULL_DECODE_ONLY")
    with pytest.raises(VllmGraphPolicyError) as info:
        _resolve(e)
    assert isinstance(info.value, ValueError)
    assert any("backend.capture_unsupported" in r for r in info.value.reasons)


def test_a_full_decode_lock_on_the_adapter_fails_startup(bridge_on: None) -> None:
    # triton declares full decode graphs; the adapter behind vLLM's interface has none
    with pytest.raises(VllmGraphPolicyError) as info:
        _resolve(Engine("ATTNREG_TRITON", 90, explicit="FULL_DECODE_ONLY"))
    assert any("engine.mode_unsupported" in r for r in info.value.reasons)
    assert not any("backend.capture_unsupported" in r for r in info.value.reasons)


def test_asking_twice_gives_the_same_answer(bridge_on: None) -> None:
    # vLLM asks each builder per KV-cache group and again for the drafter.
    e = Engine("FLASHINFER_MLA", 100, "fp8")
    vllm_config, builder, spec = env.engine(e)
    with env.simulated_gpu(e.sm):
        first = builder.get_cudagraph_support(vllm_config, spec)
        second = builder.get_cudagraph_support(vllm_config, spec)
    assert first == second
    assert vllm_config.compilation_config.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY


def test_the_lock_record_travels_with_the_config() -> None:
    explicit = CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE)
    default = CompilationConfig()
    hooks.record_lock(explicit)
    hooks.record_lock(default)
    assert hooks._locked(pickle.loads(pickle.dumps(explicit)))
    assert not hooks._locked(pickle.loads(pickle.dumps(default)))
    # vLLM wraps a filled-in config in a new VllmConfig (dataclasses.replace): the
    # default it filled in stays vLLM's, not the user's.
    default.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    hooks.record_lock(default)
    assert not hooks._locked(default)


def test_install_wraps_and_uninstall_restores() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    original = VllmConfig.__post_init__
    hooks.install()
    try:
        assert hooks.installed()
        assert VllmConfig.__post_init__.__wrapped__ is original
        hooks.install()  # vLLM loads plugins once per process, but may load them again
        assert VllmConfig.__post_init__.__wrapped__ is original
    finally:
        hooks.uninstall()
    assert not hooks.installed() and VllmConfig.__post_init__ is original
    assert AttentionMetadataBuilder.get_cudagraph_support.__func__ is \
        hooks._ORIGINAL_SUPPORT.__func__
