"""The capability model: parsing, queries, validation reasons."""

from __future__ import annotations

import dataclasses

import pytest

from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    Cost,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Platform,
    SplitKV,
    Vendor,
    validate_capabilities,
)
from attnreg.registry.spec import DeclarationContext

HALF = frozenset({DType.BF16, DType.FP16})


def _caps(**overrides):
    base = dict(
        backend="toy", platform=Platform.parse("cuda:sm90"), vendors=frozenset({Vendor.CUDA}),
        kernels=(
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                              ((576, 512),), HALF, HALF, page_sizes=(1, 16), max_heads=64,
                              split_kv=SplitKV.DYNAMIC),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), ((192, 128),),
                              HALF, HALF),
        ),
        graph_modes=(
            GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                             pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC),
            GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                             pinned_method=ForwardMethod.MLA),
            GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                             CaptureSupport.fallback("other", Cost.LOW, "why",
                                                     {DType.FP8_E4M3: Cost.HIGH})),
        ),
    )
    base.update(overrides)
    return Capabilities(**base)


@pytest.mark.parametrize("text,vendor,arch,sm", [
    ("cuda:sm90", Vendor.CUDA, "sm90", 90),
    ("CUDA:SM_100A", Vendor.CUDA, "sm100", 100),
    ("rocm:gfx942", Vendor.ROCM, "gfx942", None),
    ("cpu", Vendor.CPU, "", None),
])
def test_platform_parse(text, vendor, arch, sm):
    p = Platform.parse(text)
    assert (p.vendor, p.arch, p.sm) == (vendor, arch, sm)
    assert Platform.parse(str(p)) == p


@pytest.mark.parametrize("bad", ["gpu:sm90", "cuda:gfx90a", "cuda:potato"])
def test_platform_parse_rejects_with_a_hint(bad):
    with pytest.raises(ValueError, match="expected"):
        Platform.parse(bad)


def test_platform_table_says_which_platforms_have_device_graphs():
    # cpu has none; npu and xpu graphs exist, and each backend's declaration decides there.
    assert Platform.parse("cuda:sm90").has_device_graphs
    assert Platform.parse("rocm:gfx942").has_device_graphs
    assert Platform.parse("npu").has_device_graphs and Platform.parse("xpu").has_device_graphs
    assert not Platform.parse("cpu").has_device_graphs


def test_platform_detect_without_gpu_is_cpu():
    assert Platform.detect().vendor is Vendor.CPU


def test_enum_parse_is_case_insensitive_and_lists_values():
    assert GraphMode.parse("TC-PIECEWISE") is GraphMode.TC_PIECEWISE
    with pytest.raises(ValueError, match="breakable"):
        GraphMode.parse("halfway")


def test_fallback_cost_depends_on_kv_dtype():
    fb = CaptureSupport.fallback("x", Cost.LOW, "r", {DType.FP8_E4M3: Cost.HIGH})
    assert fb.cost_for("bf16") is Cost.LOW
    assert fb.cost_for(DType.FP8_E4M3) is Cost.HIGH
    assert CaptureSupport.native().cost_for("fp8_e4m3") is Cost.NONE


def test_declarations_are_immutable():
    caps = _caps()
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.backend = "other"  # type: ignore[misc]


def test_valid_declaration_has_no_reasons():
    assert validate_capabilities(_caps()) == []


def test_graph_support_defaults_disabled_to_native_and_missing_to_unsupported():
    caps = _caps(graph_modes=_caps().graph_modes[:1])
    assert caps.graph_support("prefill", "disabled").capture.is_native
    assert caps.graph_support("prefill", "breakable").capture.is_unsupported


def _with_decode_modes(caps, *served):
    full = dataclasses.replace(caps.graph_modes[0], forward_modes=served)
    return dataclasses.replace(caps, graph_modes=(full,) + caps.graph_modes[1:])


def test_speculative_forward_modes_declared_well_are_valid():
    caps = _with_decode_modes(_caps(), ForwardModeSupport(ForwardMode.DECODE),
                              ForwardModeSupport(ForwardMode.TARGET_VERIFY, 4),
                              ForwardModeSupport(ForwardMode.DRAFT_EXTEND, 4, uniform=False))
    assert validate_capabilities(caps) == []


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: dataclasses.replace(c, graph_modes=c.graph_modes[:2]),
     "prefill/tc_piecewise is not declared"),
    (lambda c: dataclasses.replace(c, graph_modes=c.graph_modes + (
        GraphModeSupport(Phase.DECODE, GraphMode.BREAKABLE, CaptureSupport.native()),)),
     "decode has no graph mode breakable"),
    (lambda c: dataclasses.replace(c, graph_modes=c.graph_modes + c.graph_modes[:1]),
     "declared twice"),
    (lambda c: dataclasses.replace(c, kernels=(dataclasses.replace(
        c.kernels[0], head_dims=((192, 128),)),) + c.kernels[1:]), "absorbed MLA is (576, 512)"),
    (lambda c: dataclasses.replace(c, kernels=(dataclasses.replace(
        c.kernels[0], page_sizes=(3,)),) + c.kernels[1:]), "not a positive power of two"),
    (lambda c: dataclasses.replace(c, graph_modes=(
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.unsupported("")),)
        + c.graph_modes[1:]), "UNSUPPORTED needs a reason"),
    (lambda c: dataclasses.replace(c, graph_modes=c.graph_modes[:2] + (
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.fallback("toy", Cost.LOW, "r")),)),
     "FALLBACK must name another backend"),
    (lambda c: dataclasses.replace(c, kernels=(), platform_reason=""),
     "declares no kernel"),
    (lambda c: dataclasses.replace(c, kernels=(dataclasses.replace(
        c.kernels[0], min_heads=200),) + c.kernels[1:]), "min_heads must be within"),
    (lambda c: dataclasses.replace(c, kernels=(dataclasses.replace(
        c.kernels[0], split_kv=SplitKV.NONE),) + c.kernels[1:]), "claims dynamic split-KV"),
    (lambda c: _with_decode_modes(c, ForwardModeSupport(ForwardMode.EXTEND, None, False)),
     "serves forward mode extend, which is not one of"),
    (lambda c: _with_decode_modes(c, ForwardModeSupport(ForwardMode.DECODE, 4)),
     "DECODE serves exactly one query token"),
    (lambda c: _with_decode_modes(c, ForwardModeSupport(ForwardMode.TARGET_VERIFY, 0)),
     "max_query_len must be >= 1"),
    (lambda c: _with_decode_modes(c, ForwardModeSupport(ForwardMode.TARGET_VERIFY, None)),
     "needs a bound on the draft tokens"),
    (lambda c: _with_decode_modes(c, ForwardModeSupport(ForwardMode.DECODE),
                                  ForwardModeSupport(ForwardMode.DECODE)), "listed twice"),
    (lambda c: dataclasses.replace(c, eager_forward_modes=(
        ForwardModeSupport(ForwardMode.EXTEND, None, False),
        ForwardModeSupport(ForwardMode.DRAFT_EXTEND, -2))), "eager forward modes: draft_extend"),
])
def test_invalid_declarations_are_explained(mutate, expected):
    reasons = validate_capabilities(mutate(_caps()))
    assert any(expected in r for r in reasons), reasons


def test_check_request_names_what_is_outside_the_declaration():
    caps = _caps()
    assert caps.check_request("mla", "decode", head_dims=(576, 512), q_dtype="bf16",
                              kv_dtype="bf16", page_size=16, num_heads=64) == []
    reasons = caps.check_request("mla", "decode", page_size=64, kv_dtype="fp8_e4m3",
                                 num_heads=128)
    text = " ".join(reasons)
    assert "page size 64" in text and "fp8_e4m3" in text and "128 heads" in text
    assert "no mha kernel for decode" in caps.check_request("mha", "decode")[0]


def test_a_head_range_split_at_min_heads_serves_each_side_and_names_its_range():
    low = dataclasses.replace(_caps().kernels[0], max_heads=32)
    high = dataclasses.replace(low, min_heads=33, max_heads=128)
    assert [h for h in (1, 32, 33, 128, 129) if low.accepts_heads(h)] == [1, 32]
    assert [h for h in (1, 32, 33, 128, 129) if high.accepts_heads(h)] == [33, 128]
    assert high.head_range == "33..128" and high.to_dict()["min_heads"] == 33
    caps = _caps(kernels=(high,))
    assert caps.check_request("mla", "decode", num_heads=64) == []
    assert "16 heads not in 33..128" in " ".join(
        caps.check_request("mla", "decode", num_heads=16))


def test_declaration_context_compares_versions(monkeypatch):
    ctx = DeclarationContext(Platform.parse("cuda:sm90"), {"flashinfer-python": "0.6.13"})
    assert ctx.version_at_least("flashinfer-python", "0.6.2")
    assert not ctx.version_at_least("flashinfer-python", "0.7")
    assert not ctx.version_at_least("not-installed-dist", "1.0")
