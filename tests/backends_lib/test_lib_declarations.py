"""The declarations of flashinfer_mla, trtllm_mla and flash_attn_cute: valid on every
platform, and saying what the libraries' sources say (see each declaration's docstring)."""

from __future__ import annotations

import pytest

from attnreg.registry import (
    DType,
    ForwardMethod,
    GraphMode,
    Phase,
    SplitKV,
    load_registry,
    validate_capabilities,
)

NAMES = ["flashinfer_mla", "trtllm_mla", "flash_attn_cute"]
OLD, NEW = {"flashinfer-python": "0.6.13"}, {"flashinfer-python": "0.7.0"}


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


@pytest.mark.parametrize("platform", ["cpu", "cuda:sm90", "cuda:sm100", "cuda:sm103"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("versions", [OLD, NEW], ids=["fi0.6.13", "fi0.7.0"])
def test_declarations_validate(reg, name: str, platform: str, versions) -> None:
    assert validate_capabilities(reg.declaration(name, platform, versions), name) == []


def test_flashinfer_fp8_kv_needs_0_7_and_sm90(reg) -> None:
    for versions, platform, fp8 in [(OLD, "cuda:sm90", False), (NEW, "cuda:sm90", True),
                                    (NEW, "cuda:sm100", False)]:
        caps = reg.declaration("flashinfer_mla", platform, versions)
        reasons = caps.check_request("mla", "decode", q_dtype="bf16", kv_dtype="fp8_e4m3")
        assert (reasons == []) is fp8, (versions, platform, reasons)
        if not fp8:
            assert any("fp8" in n for n, _ in caps.unavailable_kernels)
    new = reg.declaration("flashinfer_mla", "cuda:sm90", NEW)
    assert new.check_request("mla", "decode", q_dtype="fp16", kv_dtype="fp8_e4m3")


def test_flashinfer_q_and_16bit_pool_share_a_dtype(reg) -> None:
    caps = reg.declaration("flashinfer_mla", "cuda:sm90")
    assert caps.check_request("mla", "decode", q_dtype="bf16", kv_dtype="bf16") == []
    assert caps.check_request("mla", "decode", q_dtype="fp16", kv_dtype="fp16") == []
    assert caps.check_request("mla", "decode", q_dtype="bf16", kv_dtype="fp16")
    assert caps.check_request("mla", "prefill", page_size=64, kv_dtype="bf16") == []
    assert caps.check_request("mla", "prefill", page_size=128)


def test_flashinfer_pins_mla_and_plans_splits_on_the_host(reg) -> None:
    caps = reg.declaration("flashinfer_mla", "cuda:sm90")
    for phase, mode in [(Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE)]:
        entry = caps.graph_support(phase, mode)
        assert entry.capture.is_native and entry.pinned_method is ForwardMethod.MLA
        assert entry.split_kv is SplitKV.HOST_PLANNED


def test_trtllm_ragged_dims_are_the_ones_the_kernel_asserts(reg) -> None:
    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    for dims in [(192, 128), (128, 128), (256, 256)]:
        assert caps.check_request("mha", "prefill", head_dims=dims, q_dtype="bf16",
                                  kv_dtype="bf16") == [], dims
    for dims in [(256, 128), (576, 512)]:
        assert caps.check_request("mha", "prefill", head_dims=dims), dims


def test_trtllm_decode_heads_pages_and_dtypes(reg) -> None:
    caps = reg.declaration("trtllm_mla", "cuda:sm100")

    def ok(**kw: object) -> bool:
        return caps.check_request("mla", "decode", **kw) == []

    assert all(ok(num_heads=h, page_size=p) for h in (16, 32, 64, 128) for p in (32, 64))
    assert not ok(num_heads=96) and not ok(num_heads=8) and not ok(page_size=16)
    assert ok(q_dtype="bf16", kv_dtype="fp8_e4m3") and ok(q_dtype="bf16", kv_dtype="bf16")
    assert not ok(q_dtype="fp16")  # the kernel writes a bf16 output


def test_trtllm_capture_fallback_and_native_decode(reg) -> None:
    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    assert caps.graph_support("decode", "full").capture.is_native
    for mode in ("breakable", "tc_piecewise"):
        entry = caps.graph_support("prefill", mode)
        assert entry.capture.fallback_to == "flashinfer_mla"
        assert entry.capture.cost_for(DType.FP8_E4M3).value == "high"
        assert entry.pinned_method is ForwardMethod.MLA


def test_flash_attn_cute_qv_pages_dtypes_and_single_split(reg) -> None:
    sm100 = reg.declaration("flash_attn_cute", "cuda:sm100")
    for page in (1, 16, 32, 64, 128):
        assert sm100.check_request("mla", "prefill", page_size=page, q_dtype="bf16",
                                   kv_dtype="bf16") == [], page
    assert sm100.check_request("mla", "prefill", q_dtype="bf16", kv_dtype="fp16")
    assert all(k.split_kv is SplitKV.SINGLE for k in sm100.kernels_for("mla", "prefill"))
    sm90 = reg.declaration("flash_attn_cute", "cuda:sm90")
    reasons = sm90.check_request("mla", "prefill")
    assert reasons and "Blackwell" in reasons[0]
    assert sm90.check_request("mha", "prefill", head_dims=(192, 128)) == []
