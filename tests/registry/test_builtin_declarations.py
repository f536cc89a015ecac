"""The five built-in declarations hold the hardware facts of SEEDS.md and gpu/README.md."""

from __future__ import annotations

import pytest

from attnreg.registry import (
    Cost,
    ForwardMethod,
    GraphMode,
    Phase,
    SplitKV,
    load_registry,
    validate_capabilities,
)

PLATFORMS = ["cpu", "cuda:sm80", "cuda:sm90", "cuda:sm100", "cuda:sm103", "rocm:gfx942", "npu"]
BUILTINS = ["reference", "triton", "flashinfer_mla", "trtllm_mla", "flash_attn_cute"]


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def test_all_builtins_register_without_errors(reg):
    assert reg.names() == sorted(BUILTINS)
    assert reg.errors == []
    assert all(reg.get(n).plugin == "attnreg.builtin" for n in BUILTINS)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_declarations_validate_everywhere(reg, name, platform):
    assert validate_capabilities(reg.declaration(name, platform), name) == []


def test_trtllm_is_blackwell_only_and_says_so(reg):
    a = reg.availability("trtllm_mla", "cuda:sm90", assume_installed=True)
    assert not a.available and "Blackwell" in a.reason
    assert reg.availability("trtllm_mla", "cuda:sm100", assume_installed=True).available


def test_trtllm_ragged_kernel_takes_only_mha_head_dims(reg):
    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    ragged = caps.kernels_for(ForwardMethod.MHA, Phase.PREFILL)
    assert ragged and all((576, 512) not in k.head_dims for k in ragged)
    assert caps.check_request("mha", "prefill", head_dims=(576, 512))


@pytest.mark.parametrize("mode", [GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE])
def test_trtllm_extend_under_capture_falls_back_high_for_fp8(reg, mode):
    support = reg.declaration("trtllm_mla", "cuda:sm100").graph_support(Phase.PREFILL, mode)
    assert support.capture.is_fallback and support.capture.fallback_to == "flashinfer_mla"
    assert support.capture.cost_for("fp8_e4m3") is Cost.HIGH
    assert support.capture.cost_for("bf16") is Cost.LOW
    assert support.pinned_method is ForwardMethod.MLA


def test_flash_attn_cute_absorbed_path_is_blackwell_only(reg):
    sm90 = reg.declaration("flash_attn_cute", "cuda:sm90")
    assert sm90.methods(Phase.PREFILL) == (ForwardMethod.MHA,)
    assert sm90.graph_support("prefill", "breakable").pinned_method is None
    assert any("Blackwell" in r for _, r in sm90.unavailable_kernels)
    sm100 = reg.declaration("flash_attn_cute", "cuda:sm100")
    assert ForwardMethod.MLA in sm100.methods(Phase.PREFILL)
    breakable = sm100.graph_support("prefill", "breakable")
    assert breakable.pinned_method is ForwardMethod.MLA
    assert breakable.split_kv is SplitKV.SINGLE


def test_reference_refuses_device_capture_but_not_piecewise(reg):
    caps = reg.declaration("reference", "cuda:sm90")
    assert caps.graph_support("decode", "full").capture.is_unsupported
    assert caps.graph_support("prefill", "breakable").capture.is_unsupported
    assert caps.graph_support("prefill", "tc_piecewise").capture.is_native


def test_triton_on_cpu_needs_the_interpreter(reg, monkeypatch):
    from attnreg.backends.declarations import triton
    from attnreg.registry import Platform
    from attnreg.registry.spec import DeclarationContext

    off = triton.capabilities(DeclarationContext(Platform.parse("cpu"), triton_interpreter=False))
    assert "TRITON_INTERPRET=1" in off.platform_reason and not off.kernels
    on = triton.capabilities(DeclarationContext(Platform.parse("cpu"), triton_interpreter=True))
    assert on.kernels and not on.platform_reason


def test_missing_library_is_an_install_hint_not_a_crash(reg):
    a = reg.availability("flashinfer_mla", "cuda:sm90",
                         versions={"flashinfer-python": None})
    if a.available:  # flashinfer happens to be importable here
        pytest.skip("flashinfer is installed in this environment")
    assert "install attnreg[flashinfer]" in a.reason
