"""attnreg's conformance suite, run on the CPU against the stand-in library.

The suite's own harness checks every claim of the sm90 declaration that can
run without a device graph: eager correctness against the float64 oracle (the
fp8 path with the oracle rounding q as the declaration says), target-verify
batches, the LSE, several layers of one pool, refusals before any launch, the
capture-mode code path replaying other lengths (decode and verify), padded rows.
On the H200 `attnreg conformance --backend flashmla --device cuda` runs all of
them with the real library and real graphs.
"""

from __future__ import annotations

import sys

import pytest
from attnreg.registry import DeclarationContext, DType, ForwardMode, GraphMode, Phase, Platform
from attnreg.testing.claims import Check, ClaimKind, expand_claims, kernel_q_compute_dtype
from attnreg.testing.harness import Harness

import fake_flash_mla
from attnreg_flashmla.declaration import capabilities

SM90 = Platform.parse("cuda:sm90")
CAPS = capabilities(DeclarationContext(SM90))
#: On cpu the suite measures capture memory from the backend's own graph buffers;
#: FlashMLA's is mostly what the library allocates inside the graph, which only the
#: device allocator sees, so that claim is checked on the GPU only.
CLAIMS = [c for c in expand_claims(CAPS, "cpu")
          if not c.skip_reason and c.check is not Check.CAPTURE_MEMORY]
#: The sparse (DSA) checks (attnreg.testing.sparse_checks): the stand-in runs the
#: legacy sparse kernels' math, fp8_ds_mla rows unpacked by its own code.
SPARSE_CHECKS = {Check.SPARSE, Check.SPARSE_INDEX, Check.SPARSE_REFUSES_CAPTURE,
                 Check.SPARSE_REPLAY}


def _undeclared_configuration(claim) -> bool:
    """A claim that should hold but names a configuration the declaration itself refuses."""
    combo = claim.combo
    if claim.kind is ClaimKind.REFUSAL or combo is None:
        return False
    if claim.check in SPARSE_CHECKS:
        return bool(CAPS.check_sparse_request(
            combo.phase, q_dtype=combo.q_dtype, kv_dtype=combo.kv_dtype,
            page_size=combo.page_size, num_heads=combo.num_heads))
    return bool(CAPS.check_request(combo.method, combo.phase, head_dims=combo.head_dims,
                                   q_dtype=combo.q_dtype, kv_dtype=combo.kv_dtype,
                                   page_size=combo.page_size, num_heads=combo.num_heads))


@pytest.fixture
def harness(registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla)
    return Harness(registry, "cpu", SM90)


def _plain_eager(claim) -> bool:
    return (claim.kind is ClaimKind.EAGER and claim.check is Check.MATCHES_REFERENCE
            and claim.forward_mode is None)


def test_the_cpu_run_covers_both_pools_refusals_and_the_capture_path():
    kinds = {(c.kind, c.check) for c in CLAIMS}
    assert (ClaimKind.EAGER, Check.MATCHES_REFERENCE) in kinds
    assert (ClaimKind.EAGER, Check.LSE) in kinds
    assert (ClaimKind.EAGER, Check.MULTI_LAYER) in kinds
    assert (ClaimKind.CAPTURE, Check.CAPTURE_PATH) in kinds
    assert (ClaimKind.CAPTURE, Check.PADDED_ROWS) in kinds
    assert (ClaimKind.CAPTURE, Check.MULTI_LAYER) in kinds
    assert {c.check for c in CLAIMS if c.kind is ClaimKind.REFUSAL} >= {
        Check.PAGE_SIZE, Check.NUM_HEADS, Check.KV_DTYPE, Check.INDEX_DTYPE}
    eager_pools = {c.combo.kv_dtype for c in CLAIMS if _plain_eager(c)}
    assert eager_pools == {DType.BF16, DType.FP8_E4M3}


def test_the_cpu_run_covers_target_verify_eagerly_and_in_the_decode_graphs_only():
    verify = {(c.kind, c.check, c.query_len) for c in CLAIMS
              if c.forward_mode is ForwardMode.TARGET_VERIFY}
    assert {(ClaimKind.EAGER, Check.MATCHES_REFERENCE, 8),
            (ClaimKind.CAPTURE, Check.CAPTURE_PATH, 8),
            (ClaimKind.CAPTURE, Check.PADDED_ROWS, 8)} <= verify
    assert not [c for c in CLAIMS if c.forward_mode is ForwardMode.DRAFT_EXTEND]


def test_the_cpu_run_covers_every_sparse_kernel_eagerly_refusing_and_captured():
    sparse = {(c.kind, c.check, c.combo.phase, c.combo.kv_dtype, c.graph_mode)
              for c in CLAIMS if c.check in SPARSE_CHECKS}
    for kv in (DType.FP8_E4M3, DType.BF16):   # fp8_ds_mla rows, bf16 rows
        for phase in (Phase.DECODE, Phase.PREFILL):
            assert (ClaimKind.EAGER, Check.SPARSE, phase, kv, GraphMode.DISABLED) in sparse
        assert (ClaimKind.CAPTURE, Check.SPARSE_REPLAY, Phase.DECODE, kv,
                GraphMode.FULL) in sparse
        assert (ClaimKind.CAPTURE, Check.SPARSE_REPLAY, Phase.PREFILL, kv,
                GraphMode.BREAKABLE) in sparse
    refusals = [c.id for c in CLAIMS if c.check is Check.SPARSE_INDEX]
    assert len(refusals) == len(set(refusals)) == 4, refusals


def test_the_oracle_rounds_q_for_the_fp8_kernel_only():
    eager = {(c.combo.q_dtype, c.combo.kv_dtype): c.combo for c in CLAIMS if _plain_eager(c)}
    bf16, fp8 = DType.BF16, DType.FP8_E4M3
    assert kernel_q_compute_dtype(CAPS, eager[bf16, fp8]) is fp8
    assert kernel_q_compute_dtype(CAPS, eager[bf16, bf16]) is None
    # the engine's own fp8 q (with its scale) is the kernel's input: nothing to round
    assert kernel_q_compute_dtype(CAPS, eager[fp8, fp8]) is None


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.id for c in CLAIMS])
def test_claim_holds_against_the_stand_in(harness, claim):
    # every claim that should hold names a configuration the declaration accepts (the
    # multi-layer claim's fp8 configurations once took the base's head count, which the
    # fp8 kernels refuse)
    assert not _undeclared_configuration(claim), claim.id
    harness.run(claim)
