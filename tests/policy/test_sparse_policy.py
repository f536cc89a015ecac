"""A sparse-attention model fact meets backend declarations: only declared sparse kernels
serve it, a dense model never gets a sparse-only backend, and every choice has a rule id."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from attnreg.cli import main
from attnreg.graph_policy import MODEL_PRESETS, EngineFacts, GraphConfig, ModelFacts
from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    DType,
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    Phase,
    SparseKernel,
    SparseKVFormat,
)

from ._helpers import declaration, sim
from .test_engine_facts import registry_with

V32 = MODEL_PRESETS["deepseek-v3.2"]
DENSE = MODEL_PRESETS["deepseek-v3"]


def with_sparse(caps: Capabilities, *, fmt: SparseKVFormat = SparseKVFormat.BF16,
                decode: CaptureSupport | None = None, top_k_multiple: int = 64,
                dense: bool = True) -> Capabilities:
    kernel = SparseKernel(frozenset({Phase.DECODE, Phase.PREFILL}), frozenset({DType.BF16}),
                          fmt, page_sizes=(64,), max_heads=128, top_k_multiple=top_k_multiple,
                          kernel="sparse kernel")
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, decode or CaptureSupport.native()),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native()),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.unsupported("sparse piecewise not run")),
    )
    return replace(caps, kernels=caps.kernels if dense else (),
                   graph_modes=caps.graph_modes if dense else (),
                   sparse_kernels=(kernel,), sparse_graph_modes=modes)


def test_the_preset_says_sparse_with_top_k_and_no_rule_names_it() -> None:
    assert V32.sparse and V32.sparse_top_k == 2048 and V32.dsa_sparse
    assert not V32.has_mha_companion
    assert ModelFacts(sparse_top_k=64).dsa_sparse  # the top-k implies DSA
    with pytest.raises(ValueError, match="sparse_top_k"):
        ModelFacts(sparse_top_k=0)


def test_a_sparse_model_picks_only_a_backend_that_declares_sparse() -> None:
    dense_fast = declaration("dense_fast", priority=50)
    sparse_slow = with_sparse(declaration("sparse_slow", priority=10))
    reg = registry_with(dense_fast, sparse_slow)
    plan = sim("cuda:sm90", V32, registry=reg)
    assert plan.prefill.backend == plan.decode.backend == "sparse_slow"
    assert "passed over: dense_fast" in plan.decode.backend_choice
    assert "declares no sparse MLA kernel" in plan.decode.backend_choice
    rules = [d.rule for d in plan.decisions]
    assert rules.count("model.sparse_attention") == 2
    # a dense model on the same registry: the dense backend (higher priority) ...
    assert sim("cuda:sm90", DENSE, registry=reg).decode.backend == "dense_fast"


def test_a_dense_model_never_gets_a_sparse_only_backend() -> None:
    only = with_sparse(declaration("sparse_only"), dense=False)
    reg = registry_with(only, declaration("dense"))
    assert sim("cuda:sm90", DENSE, registry=reg).decode.backend == "dense"
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", DENSE, {"decode": "sparse_only"}, registry=reg)
    assert any("backend.phase_unserved" in r for r in info.value.reasons)
    # ... and a sparse model runs on it
    assert sim("cuda:sm90", V32, registry=reg).decode.backend == "sparse_only"


def test_a_sparse_only_declaration_given_directly_runs_a_sparse_model() -> None:
    only = with_sparse(declaration("sparse_only"), dense=False)
    plan = sim("cuda:sm90", V32, only)
    assert plan.decode.backend == plan.prefill.backend == "sparse_only"
    assert plan.decode.mode is GraphMode.FULL   # its sparse_graph_modes, not its (no) dense ones
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", DENSE, only)
    assert not any("backend.unavailable" in r for r in info.value.reasons), info.value.reasons


def test_capture_follows_the_sparse_declaration_not_the_dense_one() -> None:
    caps = with_sparse(declaration("mixed"),
                       decode=CaptureSupport.unsupported("sparse decode not capturable"))
    plan = sim("cuda:sm90", V32, caps)
    assert plan.decode.mode is GraphMode.DISABLED     # dense FULL is native, sparse is not
    assert plan.prefill.mode is GraphMode.BREAKABLE
    drop = next(d for d in plan.decisions if d.rule == "backend.capture_unsupported")
    assert "sparse decode not capturable" in drop.message
    assert sim("cuda:sm90", DENSE, caps).decode.mode is GraphMode.FULL


def test_top_k_format_and_page_size_must_be_declared() -> None:
    caps = with_sparse(declaration("k512"), top_k_multiple=512)
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", replace(V32, sparse_top_k=100), caps)
    (first, *_) = info.value.reasons
    assert first.startswith("prefill: backend.sparse_unsupported") and "top-k 100" in first
    fp8 = with_sparse(declaration("fp8rows"), fmt=SparseKVFormat.FP8_DS_MLA)
    with pytest.raises(GraphPolicyError, match="kv dtype bf16 is not its fp8_ds_mla rows"):
        sim("cuda:sm90", V32, fp8)
    plan = sim("cuda:sm90", V32.with_overrides(kv_dtype=DType.FP8_E4M3), fp8)
    assert plan.decode.backend == "fp8rows"
    with pytest.raises(GraphPolicyError, match="page size 16 not in"):
        sim("cuda:sm90", V32, caps, engine=EngineFacts(page_size=16))


def test_no_backend_fits_says_the_model_is_sparse() -> None:
    reg = registry_with(declaration("dense"))
    with pytest.raises(GraphPolicyError) as info:
        sim("cuda:sm90", V32, registry=reg, config=GraphConfig())
    assert any("backend.none_fits" in r and "sparse attention (top-k 2048)" in r
               for r in info.value.reasons)


def test_compat_explains_the_deepseek_v32_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compat", "--platform", "cpu", "--model", "deepseek-v3.2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["sparse_top_k"] == 2048
    # triton (priority 20, on cpu under the interpreter tests/conftest.py sets) declares
    # sparse decode over bf16 rows; prefill stays the reference's
    assert data["phases"]["decode"]["backend"] == "triton"
    assert data["phases"]["prefill"]["backend"] == "reference"
    sparse = [d for d in data["decisions"] if d["rule"] == "model.sparse_attention"]
    assert len(sparse) == 2 and "top-k 2048" in sparse[0]["message"]
    # a dense override of the same preset plans dense attention again
    assert main(["compat", "--platform", "cpu", "--model", "deepseek-v3.2", "--no-dsa-sparse",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not any(d["rule"] == "model.sparse_attention" for d in data["decisions"])
    with pytest.raises(SystemExit) as exit_info:
        main(["compat", "--platform", "cpu", "--model", "deepseek-v3", "--sparse-top-k", "0"])
    assert exit_info.value.code == 2
    assert "--sparse-top-k: '0' is not allowed" in capsys.readouterr().err
