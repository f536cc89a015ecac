"""DeepSeek-V3.2 (DSA) servers through sglang 0.5.23's real argument resolution, with
attnreg's plugin on (docs/integrations/sglang.md, "DSA models").

sglang resolves ``--attention-backend dsa`` and, per phase, the kernel behind it
(``--dsa-prefill-backend`` / ``--dsa-decode-backend``, defaulted from the pool's
dtype and the GPU).  The bridge maps a phase to attnreg's ``flashmla`` where
FlashMLA's kernel sglang runs reads the pool's rows in the format a sparse kernel
of that declaration reads in that phase; attnreg's policy then decides the phase's
graph mode from the declared sparse capture support.  Every other combination is
a gap whose reason names the sub-backend.

The ``flashmla`` declaration here is the attnreg-flashmla plugin's own plus
FlashMLA's two sm90 sparse kernels as issue 32 describes them (test data,
:func:`_with_sparse_kernels`), registered through a test plugin manager;
:func:`test_the_plugins_own_sparse_declaration_maps_the_default_fp8_server`
runs the same server on the plugin's own declaration once it declares them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from attnreg.integrations.sglang import facts as bridge_facts  # noqa: E402
from attnreg.integrations.sglang.adapter import PLACEHOLDER  # noqa: E402
from attnreg.integrations.sglang.steps import (  # noqa: E402
    DECLARATION_SOURCE,
    SglangOutcome,
    outcome_of,
)
from attnreg.registry import (  # noqa: E402
    BackendRegistry,
    BackendSpec,
    Capabilities,
    CaptureSupport,
    DeclarationContext,
    DType,
    GraphMode,
    GraphModeSupport,
    Phase,
    SparseKernel,
    SparseKVFormat,
    hookimpl,
    load_registry,
)

from . import _sglang_env  # noqa: E402

# The FlashMLA plugin lives in this repository; `make test-sglang` does not install it
# into the sglang venv, so import it from its source tree when it is not installed.
_PLUGIN_SRC = Path(__file__).resolve().parents[3] / "plugins" / "attnreg-flashmla" / "src"
if importlib.util.find_spec("attnreg_flashmla") is None and _PLUGIN_SRC.is_dir():
    sys.path.insert(0, str(_PLUGIN_SRC))

from attnreg_flashmla import declaration as flashmla_declaration  # noqa: E402
from attnreg_flashmla import plugin as flashmla_plugin  # noqa: E402

#: DeepSeek-V3.2's config.json fields that make it DSA (the indexer), over DeepSeek-V3's.
_DEEPSEEK_V32 = {**_sglang_env.MODELS["deepseek-v3"],
                 "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                 "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}

_NOT_CAPTURED = "test declaration: FlashMLA's sparse prefill under a prefill graph not run"


def _with_sparse_kernels(ctx: DeclarationContext) -> Capabilities:
    """The plugin's declaration plus FlashMLA's sm90 sparse kernels (issue 32): decode over
    DeepSeek-V3.2's FP8 rows (flash_mla_with_kvcache with indices), prefill over bf16
    rows (flash_mla_sparse_fwd); page size 64, 64 or 128 heads, top-k 2048.  Test data
    for the bridge: decode FULL captured, prefill graphs not."""
    caps = flashmla_declaration.capabilities(ctx)
    if caps.platform_reason:
        return caps
    bf16 = frozenset({DType.BF16})
    kernels = (
        SparseKernel(frozenset({Phase.DECODE}), bf16, SparseKVFormat.FP8_DS_MLA,
                     page_sizes=(64,), head_counts=(64, 128), top_k_sizes=(2048,),
                     kernel="flash_mla_with_kvcache(indices=..., is_fp8_kvcache=True) "
                            "(test declaration)"),
        SparseKernel(frozenset({Phase.PREFILL}), bf16, SparseKVFormat.BF16,
                     page_sizes=(64,), head_counts=(64, 128), top_k_sizes=(2048,),
                     kernel="flash_mla_sparse_fwd (test declaration)"),
    )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL,
                         CaptureSupport.native("test declaration: captured")),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                         CaptureSupport.unsupported(_NOT_CAPTURED)),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.unsupported(_NOT_CAPTURED)),
    )
    return replace(caps, sparse_kernels=kernels, sparse_graph_modes=modes)


class _SparseFlashMLA:
    """A test plugin: ``flashmla`` with :func:`_with_sparse_kernels`."""

    @hookimpl
    def attnreg_register_backends(self, register: Callable[[BackendSpec], None]) -> None:
        register(BackendSpec(name=flashmla_declaration.BACKEND_NAME, summary="test: sparse",
                             capabilities=_with_sparse_kernels,
                             runtime="attnreg_flashmla.runtime:FlashMLABackend"))


def _registry(*plugins: tuple[str, Any]) -> BackendRegistry:
    reg = load_registry(autoload=False, extra_plugins=list(plugins))
    assert not reg.errors, reg.errors
    return reg


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    models = _sglang_env.write_models(root)
    path = root / "deepseek-v3.2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_DEEPSEEK_V32, indent=1))
    return {**models, "deepseek-v3.2": path}


@pytest.fixture(scope="module")
def sparse_flashmla() -> BackendRegistry:
    return _registry(("test_sparse_flashmla", _SparseFlashMLA()))


@pytest.fixture(scope="module")
def builtins_only() -> BackendRegistry:
    return _registry()


@pytest.fixture(scope="module")
def plugin_registered() -> BackendRegistry:
    return _registry(("attnreg-flashmla", flashmla_plugin))


@pytest.fixture
def run(plugin_on: None, v32: dict[str, Path]) -> Iterator[Callable[..., dict[str, Any]]]:
    def run(registry: BackendRegistry, sm: int, model: str = "deepseek-v3.2",
            **args: Any) -> dict[str, Any]:
        scenario = _sglang_env.Scenario("dsa", model, sm, args)
        with mock.patch.object(bridge_facts, "bridge_registry", lambda: registry):
            result = _sglang_env.run_scenario(scenario, v32)
        assert "error" not in result, result
        return result
    yield run


def _outcome(result: dict[str, Any]) -> SglangOutcome:
    outcome = outcome_of(result["server_args"])
    assert outcome is not None
    return outcome


def _bridge(outcome: SglangOutcome, rule: str, phase: Phase | None) -> list[str]:
    return [d.message for d in outcome.bridge if d.rule == rule and d.phase is phase]


def _gap_messages(outcome: SglangOutcome) -> str:
    return " | ".join(d.message for d in outcome.bridge if d.rule == "sglang.gap")


def _assert_decided_sparse(result: dict[str, Any], phase: Phase, mode: str) -> SglangOutcome:
    """``phase`` decided by attnreg on flashmla's sparse kernels, ``mode`` written back."""
    outcome = _outcome(result)
    assert phase in outcome.decided, _gap_messages(outcome)
    assert outcome.facts.model is not None and outcome.facts.model.sparse_top_k == 2048
    assert outcome.plan is not None and outcome.plan.phase(phase).backend == "flashmla"
    sparse = [d for d in outcome.decisions if d.rule == "model.sparse_attention"]
    assert [d.phase for d in sparse] == [phase]
    assert "flashmla's sparse MLA kernels" in sparse[0].message
    assert outcome.after[phase].value == mode == result[phase.value]
    assert DECLARATION_SOURCE in result["sources"]
    declared = _bridge(outcome, "sglang.declared", phase)
    assert declared and "on flashmla" in declared[0], outcome.bridge
    return outcome


def test_the_default_fp8_h200_server_decodes_as_attnreg_decides(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    # sm90 + an fp8 pool: sglang picks flashmla_kv for both phases (656-byte rows)
    result = run(sparse_flashmla, 90, kv_cache_dtype="fp8_e4m3")
    assert result["backends"] == ["dsa", "dsa"] and result["page_size"] == 64
    outcome = _assert_decided_sparse(result, Phase.DECODE, "full")
    assert outcome.decided == frozenset({Phase.DECODE})
    backend = _bridge(outcome, "sglang.backend", Phase.DECODE)[0]
    assert "--dsa-decode-backend flashmla_kv (chosen by sglang's defaults)" in backend
    assert "-> attnreg's flashmla" in backend and "flash_mla_with_kvcache" in backend
    # prefill runs the same FP8 decode kernel per extend token, which the declaration
    # does not declare for prefill: sglang decides prefill, and says why
    gap = _bridge(outcome, "sglang.gap", Phase.PREFILL)
    assert gap and "--dsa-prefill-backend flashmla_kv" in gap[0]
    assert "no sparse prefill kernel over fp8_ds_mla rows" in gap[0]
    assert result["prefill"] == "breakable"  # sglang's own rules, unchanged
    # no declared backend has a sparse prefill kernel over fp8_ds_mla rows: the plan's
    # prefill entry is the bridge's eager placeholder for sglang's own, never used
    assert outcome.plan is not None and outcome.plan.prefill.backend == PLACEHOLDER
    assert outcome.plan.prefill.mode is GraphMode.DISABLED
    assert outcome.to_dict()["backends"]["decode"] == {
        "sglang": "dsa", "attnreg": "flashmla", "dsa_backend": "flashmla_kv"}


def test_user_chosen_flashmla_backends_over_an_fp8_pool(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    result = run(sparse_flashmla, 90, kv_cache_dtype="fp8_e4m3",
                 dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_kv")
    outcome = _assert_decided_sparse(result, Phase.DECODE, "full")
    assert "--dsa-decode-backend flashmla_kv (chosen by the user)" in \
        _bridge(outcome, "sglang.backend", Phase.DECODE)[0]
    # flashmla_sparse over an fp8 pool reads a dequantized bf16 copy, not the pool
    gap = _bridge(outcome, "sglang.gap", Phase.PREFILL)
    assert gap and "--dsa-prefill-backend flashmla_sparse" in gap[0]
    assert "dequantize_k_cache_paged_dsa" in gap[0]


def test_the_nsa_alias_maps_like_dsa(run: Callable[..., dict[str, Any]],
                                      sparse_flashmla: BackendRegistry) -> None:
    result = run(sparse_flashmla, 90, kv_cache_dtype="fp8_e4m3", attention_backend="nsa")
    assert result["backends"] == ["nsa", "nsa"]
    _assert_decided_sparse(result, Phase.DECODE, "full")


def test_the_default_bf16_h200_server_prefills_as_attnreg_decides(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    # sm90 + sglang's default bf16 pool: flashmla_sparse prefill, fa3 decode
    result = run(sparse_flashmla, 90)
    outcome = _assert_decided_sparse(result, Phase.PREFILL, "disabled")
    # the declared sparse capture support decides, with its rule and reason
    changed = [d for d in outcome.decisions if d.changed and d.phase is Phase.PREFILL]
    assert [d.rule for d in changed] == ["backend.capture_unsupported"]
    assert _NOT_CAPTURED in changed[0].message
    assert "(changed by backend.capture_unsupported)" in \
        _bridge(outcome, "sglang.declared", Phase.PREFILL)[0]
    backend = _bridge(outcome, "sglang.backend", Phase.PREFILL)[0]
    assert "flash_mla_sparse_fwd" in backend and "dense MHA" in backend
    gap = _bridge(outcome, "sglang.gap", Phase.DECODE)
    assert gap and "--dsa-decode-backend fa3" in gap[0] and "FA3" in gap[0]
    assert result["decode"] == "full"  # sglang's own


def test_flashmla_sparse_decode_over_bf16_stays_a_gap_naming_it(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    result = run(sparse_flashmla, 90, dsa_decode_backend="flashmla_sparse")
    outcome = _outcome(result)
    assert outcome.decided == frozenset({Phase.PREFILL})
    gap = _bridge(outcome, "sglang.gap", Phase.DECODE)
    assert gap and "--dsa-decode-backend flashmla_sparse" in gap[0]
    assert "no sparse decode kernel over bf16 rows" in gap[0]


def test_the_default_b200_server_is_a_gap_naming_trtllm(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    result = run(sparse_flashmla, 100)  # sm100: an fp8 pool, trtllm for both phases
    outcome = _outcome(result)
    assert outcome.plan is None and not outcome.decided
    gaps = _gap_messages(outcome)
    assert "--dsa-prefill-backend trtllm" in gaps and "--dsa-decode-backend trtllm" in gaps
    assert "TRT-LLM-gen sparse MLA" in gaps


def test_without_the_plugin_a_dsa_server_is_a_gap_that_says_install_it(
        run: Callable[..., dict[str, Any]], builtins_only: BackendRegistry) -> None:
    result = run(builtins_only, 90, kv_cache_dtype="fp8_e4m3")
    outcome = _outcome(result)
    assert outcome.plan is None and not outcome.decided
    model = outcome.facts.model
    assert model is not None and model.sparse_top_k == 2048 and model.dsa_sparse
    gaps = _gap_messages(outcome)
    assert "--dsa-decode-backend flashmla_kv" in gaps
    assert "pip install attnreg-flashmla" in gaps


def test_sglang_flashmla_decodes_as_the_plugin_decides_when_it_is_registered(
        run: Callable[..., dict[str, Any]], plugin_registered: BackendRegistry,
        builtins_only: BackendRegistry) -> None:
    result = run(plugin_registered, 90, model="deepseek-v3", attention_backend="flashmla")
    outcome = _outcome(result)
    assert outcome.decided == frozenset({Phase.DECODE})
    assert outcome.plan is not None and outcome.plan.decode.backend == "flashmla"
    assert outcome.after[Phase.DECODE].value == result["decode"] == "full"
    gap = _bridge(outcome, "sglang.gap", Phase.PREFILL)
    assert gap and "FlashInferMLAAttnBackend" in gap[0]
    unregistered = _outcome(run(builtins_only, 90, model="deepseek-v3",
                                attention_backend="flashmla"))
    assert not unregistered.decided
    assert "install attnreg-flashmla" in _gap_messages(unregistered)


def test_sglang_flashmla_on_a_dsa_model_is_a_gap_dense_kernels_for_a_sparse_model(
        run: Callable[..., dict[str, Any]], sparse_flashmla: BackendRegistry) -> None:
    result = run(sparse_flashmla, 90, attention_backend="flashmla")
    outcome = _outcome(result)
    assert result["backends"] == ["flashmla", "flashmla"] and not outcome.decided
    gap = _bridge(outcome, "sglang.gap", None)
    assert gap and "runs dense MLA kernels" in gap[0] and "top-k 2048" in gap[0]


def test_the_plugins_own_sparse_declaration_maps_both_phases_of_the_default_fp8_server(
        run: Callable[..., dict[str, Any]], plugin_registered: BackendRegistry) -> None:
    caps = plugin_registered.declaration("flashmla", "cuda:sm90")
    if not any(k.kv_format is SparseKVFormat.FP8_DS_MLA
               for k in caps.sparse_kernels_for(Phase.DECODE)):
        pytest.skip("attnreg-flashmla declares no sparse decode kernel over fp8_ds_mla rows "
                    "yet (issue 32, item 2); the test declaration stands in above")
    result = run(plugin_registered, 90, kv_cache_dtype="fp8_e4m3")
    outcome = _outcome(result)
    # sglang's defaults for an fp8 pool on sm90 run flashmla_kv in both phases; the plugin
    # declares its fp8 sparse kernel for decode and extend batches: the whole server is
    # attnreg's
    assert {Phase.DECODE, Phase.PREFILL} <= set(outcome.decided), _gap_messages(outcome)
    for phase in (Phase.DECODE, Phase.PREFILL):
        assert "flashmla_kv" in _bridge(outcome, "sglang.backend", phase)[0]
        assert "-> attnreg's flashmla" in _bridge(outcome, "sglang.backend", phase)[0]

