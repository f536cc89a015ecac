"""The declarations of flashinfer_mla, trtllm_mla and flash_attn_cute: valid on every
platform, and saying what the libraries' sources say (see each declaration's docstring)."""

from __future__ import annotations

import json

import pytest

from attnreg.cli import main
from attnreg.registry import (
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    SplitKV,
    load_registry,
    validate_capabilities,
)
from attnreg.testing.claims import (
    CUDA_PLATFORMS,
    ClaimKind,
    expand_claims,
    other_platform_claims,
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


def test_trtllm_declares_uniform_verify_of_two_drafts_and_no_draft_extend(reg) -> None:
    """flashinfer 0.6.13 checks the decode kernel's q_len_per_request 1 and 2 against a
    causal reference, and passes no cum_seq_lens_q (the declaration's docstring)."""
    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    for entry in (caps.graph_support("decode", "full").serving(ForwardMode.TARGET_VERIFY),
                  caps.eager_serving(ForwardMode.TARGET_VERIFY)):
        assert entry is not None and entry.max_query_len == 2 and entry.uniform
        assert entry.serves_query_len(2) and not entry.serves_query_len(3)
    assert caps.eager_serving(ForwardMode.DRAFT_EXTEND) is None
    assert caps.graph_support("decode", "full").serving(ForwardMode.DRAFT_EXTEND) is None
    assert caps.eager_serving(ForwardMode.EXTEND) is not None  # ragged prefill stays


def test_trtllm_verify_claims_exist_and_are_blackwell_only(reg) -> None:
    """The conformance suite turns the verify declaration into claims on sm100; on an
    H200 (sm90) they are listed, skipped, as declared for Blackwell only."""
    claims = expand_claims(reg.declaration("trtllm_mla", "cuda:sm100"), "cuda")
    verify = [c for c in claims if c.forward_mode is ForwardMode.TARGET_VERIFY]
    assert {c.kind for c in verify} == {ClaimKind.EAGER, ClaimKind.CAPTURE}
    assert all(c.query_len == 2 for c in verify)
    assert not [c for c in claims if c.forward_mode is ForwardMode.DRAFT_EXTEND]
    sm90 = reg.declaration("trtllm_mla", "cuda:sm90")
    assert not sm90.kernels  # nothing of trtllm_mla runs on sm90
    others = [reg.declaration("trtllm_mla", p) for p in CUDA_PLATFORMS]
    skipped = {c.id: c for c in other_platform_claims([], others, "cuda:sm90", "cuda")}
    assert {c.id for c in verify} <= set(skipped)
    assert {skipped[c.id].skip_reason for c in verify} == {
        "declared for cuda:sm100, cuda:sm103 only; this is cuda:sm90"}


def test_deepseek_on_blackwell_with_two_drafts_captures_verify_batches(capsys) -> None:
    """`attnreg compat` for the flagship setup: verify batches replay trtllm_mla's full
    decode graphs; more drafts than declared run another way, saying why."""
    def spec(drafts: str) -> dict[str, str]:
        code = main(["compat", "--json", "--platform", "b200", "--model", "deepseek-v3",
                     "--backend", "trtllm_mla", "--speculative-decoding", drafts])
        out = capsys.readouterr().out
        assert code == 0, out
        return {s["forward_mode"]: s["how"] for s in json.loads(out)["speculative"]}

    assert spec("2") == {"target_verify": "graph", "draft_extend": "unserved"}
    assert spec("4")["target_verify"] == "unserved"
