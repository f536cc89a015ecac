"""Sparse (DSA) MLA as a declared capability: the data, its validation and its rendering."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    DType,
    GraphMode,
    GraphModeSupport,
    Phase,
    Platform,
    SparseKernel,
    SparseKVFormat,
    SupportKind,
    Vendor,
    validate_capabilities,
)

SPARSE_DECODE = SparseKernel(frozenset({Phase.DECODE}), frozenset({DType.BF16}),
                             SparseKVFormat.FP8_DS_MLA, page_sizes=(64,), head_counts=(64, 128),
                             top_k_multiple=64, max_top_k=2048, kernel="sparse decode")


def sparse_only(*modes: GraphModeSupport, kernel: SparseKernel = SPARSE_DECODE) -> Capabilities:
    return Capabilities("dsa", Platform.parse("cuda:sm90"), frozenset({Vendor.CUDA}), (), (),
                        sparse_kernels=(kernel,), sparse_graph_modes=modes)


FULL_NATIVE = GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native())


def test_the_fp8_row_is_the_656_byte_v32_layout() -> None:
    # 512 e4m3 latent + 4 float32 scales (one per 128 values) + 64 bf16 rope
    assert SparseKVFormat.FP8_DS_MLA.row_bytes == 512 + 16 + 128 == 656
    assert SparseKVFormat.FP8_DS_MLA.dtype is DType.FP8_E4M3
    assert SparseKVFormat.BF16.row_bytes == 1152 and SparseKVFormat.BF16.dtype is DType.BF16


def test_top_k_sizes_follow_the_declaration() -> None:
    assert SPARSE_DECODE.accepts_top_k(2048) and SPARSE_DECODE.accepts_top_k(64)
    assert not SPARSE_DECODE.accepts_top_k(100) and not SPARSE_DECODE.accepts_top_k(4096)
    listed = dataclasses.replace(SPARSE_DECODE, top_k_sizes=(512, 2048))
    assert listed.accepts_top_k(512) and not listed.accepts_top_k(1024)


def test_a_sparse_only_declaration_is_valid_and_serves_no_dense_request() -> None:
    caps = sparse_only(FULL_NATIVE)
    assert validate_capabilities(caps) == []
    assert not caps.serves(Phase.DECODE) and caps.serves_sparse(Phase.DECODE)
    assert caps.check_sparse_request(Phase.DECODE, top_k=2048, q_dtype="bf16",
                                     kv_dtype="fp8_e4m3", page_size=64, num_heads=128) == []
    reasons = caps.check_sparse_request(Phase.DECODE, top_k=100, kv_dtype="bf16",
                                        page_size=16, num_heads=16)
    assert len(reasons) == 4 and "top-k 100 not in multiples of 64" in reasons[0]
    assert caps.check_sparse_request(Phase.PREFILL) == [
        "dsa declares no sparse MLA kernel for prefill on cuda:sm90"]


def test_every_capture_mode_of_a_sparse_phase_must_be_declared() -> None:
    reasons = validate_capabilities(sparse_only())
    assert reasons == ["sparse decode/full is not declared (say NATIVE, FALLBACK or UNSUPPORTED "
                       "with a reason in sparse_graph_modes)"]


@pytest.mark.parametrize("change, expected", [
    ({"page_sizes": ()}, "list page sizes"),
    ({"page_sizes": (48,)}, "page size 48 is not a positive power of two"),
    ({"top_k_multiple": 0}, "top-k bounds"),
    ({"top_k_sizes": (0,)}, "top-k sizes must be >= 1"),
    ({"head_counts": (256,)}, "head counts must be within 1..max_heads"),
])
def test_malformed_sparse_kernels_are_reported(change: dict[str, object], expected: str) -> None:
    kernel = dataclasses.replace(SPARSE_DECODE, **change)  # type: ignore[arg-type]
    reasons = validate_capabilities(sparse_only(FULL_NATIVE, kernel=kernel))
    assert any(expected in r for r in reasons), reasons


def test_sparse_graph_modes_are_checked_like_dense_ones() -> None:
    prefill = GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native())
    bad_mode = GraphModeSupport(Phase.DECODE, GraphMode.BREAKABLE, CaptureSupport.native())
    reasons = validate_capabilities(sparse_only(FULL_NATIVE, prefill, bad_mode, FULL_NATIVE))
    assert any("decode has no graph mode breakable" in r for r in reasons)
    assert any("declared twice" in r for r in reasons)
    assert any("no sparse kernel serves prefill" in r for r in reasons)
    unsupported = GraphModeSupport(Phase.DECODE, GraphMode.FULL,
                                   CaptureSupport(SupportKind.UNSUPPORTED))
    assert any("UNSUPPORTED needs a reason" in r
               for r in validate_capabilities(sparse_only(unsupported)))


def test_the_sparse_view_is_what_a_sparse_model_is_planned_with() -> None:
    caps = sparse_only(FULL_NATIVE)
    view = caps.sparse_view()
    (kernel,) = view.kernels
    assert kernel.head_dims == ((576, 512),) and kernel.kv_dtypes == {DType.FP8_E4M3}
    assert view.graph_support(Phase.DECODE, GraphMode.FULL).capture.is_native
    assert caps.graph_support(Phase.DECODE, GraphMode.FULL).capture.is_unsupported


def test_sparse_facts_render_in_json() -> None:
    data = json.loads(json.dumps(sparse_only(FULL_NATIVE).to_dict()))
    (kernel,) = data["sparse_kernels"]
    assert kernel["kv_format"] == "fp8_ds_mla" and kernel["kv_row_bytes"] == 656
    assert kernel["index_dtype"] == "int32" and kernel["invalid_index"] == -1
    assert kernel["top_k_multiple"] == 64 and kernel["head_counts"] == [64, 128]
    assert data["sparse_graph_modes"][0]["capture"]["kind"] == "native"


def test_the_reference_declares_its_sparse_path_eager_only() -> None:
    from attnreg.registry import get_registry

    caps = get_registry().declaration("reference", "cpu")
    assert caps.serves_sparse(Phase.DECODE) and caps.serves_sparse(Phase.PREFILL)
    assert all(g.capture.is_unsupported for g in caps.sparse_graph_modes)
    assert {k.kv_format for k in caps.sparse_kernels} == {SparseKVFormat.BF16}
