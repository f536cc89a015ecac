"""attnreg's conformance suite, run on the CPU against the stand-in library.

The suite's own harness checks every claim of the sm90 declaration that can
run without a device graph: eager correctness against the float64 oracle (the
fp8 path with the oracle rounding q as the declaration says), refusals before
any launch, the capture-mode code path replaying other lengths, padded rows.
On the H200 `attnreg conformance --backend flashmla --device cuda` runs all of
them with the real library and real graphs.
"""

from __future__ import annotations

import sys

import pytest
from attnreg.registry import DeclarationContext, DType, Platform
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


@pytest.fixture
def harness(registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla)
    return Harness(registry, "cpu", SM90)


def test_the_cpu_run_covers_both_pools_refusals_and_the_capture_path():
    kinds = {(c.kind, c.check) for c in CLAIMS}
    assert (ClaimKind.EAGER, Check.MATCHES_REFERENCE) in kinds
    assert (ClaimKind.CAPTURE, Check.CAPTURE_PATH) in kinds
    assert (ClaimKind.CAPTURE, Check.PADDED_ROWS) in kinds
    assert {c.check for c in CLAIMS if c.kind is ClaimKind.REFUSAL} >= {
        Check.PAGE_SIZE, Check.NUM_HEADS, Check.KV_DTYPE, Check.INDEX_DTYPE}
    eager_pools = {c.combo.kv_dtype for c in CLAIMS if c.kind is ClaimKind.EAGER}
    assert eager_pools == {DType.BF16, DType.FP8_E4M3}


def test_the_oracle_rounds_q_for_the_fp8_kernel_only():
    eager = {c.combo.kv_dtype: c.combo for c in CLAIMS if c.kind is ClaimKind.EAGER}
    assert kernel_q_compute_dtype(CAPS, eager[DType.FP8_E4M3]) is DType.FP8_E4M3
    assert kernel_q_compute_dtype(CAPS, eager[DType.BF16]) is None


@pytest.mark.parametrize("claim", CLAIMS, ids=[c.id for c in CLAIMS])
def test_claim_holds_against_the_stand_in(harness, claim):
    harness.run(claim)
