"""The bridge's pure tables (no vLLM needed: these run in `make test` too)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest

from attnreg.graph_policy import EngineFacts, GraphConfig, ModelFacts, ServerFeatures, resolve
from attnreg.integrations.vllm import names, plugin, vocabulary
from attnreg.registry import get_registry
from attnreg.registry.capabilities import (
    DType,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    Phase,
)


def test_mapped_backends_are_declared() -> None:
    declared = set(get_registry().names())
    for vllm_name, target in names.MAPPED_BACKENDS.items():
        assert target in declared, vllm_name
    assert not set(names.MAPPED_BACKENDS) & set(names.UNMAPPED_BACKENDS)


def test_unknown_backend_is_left_to_vllm() -> None:
    m = names.map_backend("SOMETHING_NEW")
    assert not m.mapped and "no declaration" in m.reason


@pytest.mark.parametrize(("cache_dtype", "want"), [
    ("auto", DType.BF16), ("bfloat16", DType.BF16), ("fp8", DType.FP8_E4M3),
    ("fp8_e4m3", DType.FP8_E4M3), ("fp8_e5m2", None), ("fp8_ds_mla", None)])
def test_kv_dtypes(cache_dtype: str, want: DType | None) -> None:
    assert names.kv_dtype_from_vllm(cache_dtype, DType.BF16) is want


def test_modes_round_trip() -> None:
    for (prefill, decode_full), name in vocabulary.MODES.items():
        assert vocabulary.requested_modes(name) == (
            prefill, GraphMode.FULL if decode_full else GraphMode.DISABLED)
    assert vocabulary.requested_modes("FULL") is None
    assert len(set(vocabulary.MODES.values())) == len(vocabulary.MODES)


@pytest.mark.parametrize(("backend", "draft", "want"), [
    ("triton", 0, "UNIFORM_BATCH"), ("triton", 8, "UNIFORM_BATCH"),
    ("triton", 9, "UNIFORM_SINGLE_TOKEN_DECODE"), ("trtllm_mla", 0, "UNIFORM_BATCH"),
    ("trtllm_mla", 2, "UNIFORM_BATCH"), ("trtllm_mla", 3, "UNIFORM_SINGLE_TOKEN_DECODE"),
    ("reference", 0, "NEVER")])
def test_support_from_declarations(backend: str, draft: int, want: str) -> None:
    decl = get_registry().declaration(backend, "cuda:sm100")
    assert vocabulary.cg_support(decl, draft) == want


def test_full_graphs_of_any_query_length_are_always() -> None:
    # No built-in declares it: a declaration whose decode full graphs serve ragged
    # extend batches (mixed prefill and decode) is vLLM's ALWAYS.
    decl = get_registry().declaration("triton", "cuda:sm90")
    mixed = ForwardModeSupport(ForwardMode.EXTEND, None, False)
    modes = tuple(dataclasses.replace(g, forward_modes=(*g.forward_modes, mixed))
                  if (g.phase, g.mode) == (Phase.DECODE, GraphMode.FULL) else g
                  for g in decl.graph_modes)
    assert vocabulary.cg_support(dataclasses.replace(decl, graph_modes=modes), 3) == "ALWAYS"


def test_decode_disabled_by_the_plan_is_not_captured() -> None:
    plan = resolve("cuda:sm90", ModelFacts(), ("triton", "triton"),
                   GraphConfig.from_user(prefill="tc_piecewise", decode="disabled"),
                   ServerFeatures(), EngineFacts(), assume_installed=True)
    assert vocabulary.vllm_mode(plan, 0) == ("PIECEWISE", ())


def test_tested_release() -> None:
    assert plugin.is_tested_release("0.33.0") and plugin.is_tested_release("0.33.2.dev1")
    assert not plugin.is_tested_release("0.34.0") and not plugin.is_tested_release("1.33.0")


def test_off_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in [("", False), ("0", False), ("1", True), ("yes", True), ("On", True)]:
        monkeypatch.setenv("ATTNREG_VLLM", value)
        assert plugin.enabled() is on


def test_light_modules_import_without_vllm_or_torch() -> None:
    code = ("import sys; import attnreg.integrations.vllm.plugin, "
            "attnreg.integrations.vllm.names, attnreg.integrations.vllm.vocabulary, "
            "attnreg.integrations.vllm.registration; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ})
    assert out.stdout.strip() == "[]"
    importlib.import_module("attnreg.integrations.vllm.plugin")


def test_vllm_names_of_attnreg_backends_map_back_exactly() -> None:
    from attnreg.integrations.vllm.registration import backend_class_name, class_path, vllm_name

    for name in get_registry().names():
        mapping = names.map_backend(vllm_name(name))
        assert mapping.exact and mapping.attnreg == name
    assert class_path("flashinfer_mla") == (
        "attnreg.integrations.vllm.backend." + backend_class_name("flashinfer_mla"))
