"""(m) The planted ``planted_fp8_q_unscaled`` (q cast to fp8 without a scale over an FP8
pool, declared q_compute_dtype fp8) is refuted on cpu by the ``fp8_large_q`` claims, and
only by them: every other claim of its FP8 pool holds (N(0, 1) queries never leave the
fp8 range)."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

B = "planted_fp8_q_unscaled"
FP8 = "bf16-fp8_e4m3/p16/h2/576x512"
# the large-query claims run at checks.LARGE_Q_SM_SCALE (1/(sqrt(192) * 1024))
LQ = f"{FP8}/sm_scale7.048e-05"
EXPECTED = {
    f"eager/decode/mla/fp8_large_q/{LQ}",
    f"eager/decode/mla/target_verify/fp8_large_q/{LQ}",
    f"eager/decode/mla/draft_extend/fp8_large_q/{LQ}",
    f"eager/prefill/mla/fp8_large_q/{LQ}",
    f"capture/decode/full/fp8_large_q/mla/{LQ}",
    f"capture/decode/full/target_verify/fp8_large_q/mla/{LQ}",
    f"capture/decode/full/draft_extend/fp8_large_q/mla/{LQ}",
    f"capture/prefill/breakable/fp8_large_q/mla/{LQ}",
    f"capture/prefill/tc_piecewise/fp8_large_q/mla/{LQ}",
}


def test_the_unscaled_fp8_cast_is_refuted_by_fp8_large_q_only(tmp_path):
    # every claim over its FP8 pool, eager and through the capture-mode paths
    code, out, data = conformance(tmp_path, "--device", "cpu", "--plugin",
                                  "planted.fp8_q_unscaled", "--backend", B, "-k", "fp8_e4m3")
    assert code == 1 and data is not None, out
    refuted = {cid.removeprefix(B + "/"): msg for cid, msg in by_status(data, "refuted").items()}
    assert set(refuted) == EXPECTED, out
    for cid, msg in refuted.items():
        assert "output differs from the float64 oracle" in msg or "NaN" in msg, msg
        assert "without a scale" in msg, msg
    assert "(bs=4, seq_lens=[1, 6, 17, 34])" in refuted[f"eager/decode/mla/fp8_large_q/{LQ}"]
    verified = by_status(data, "verified")
    # the same pool with ordinary queries: the multi-layer and eager fp8 claims hold
    assert f"{B}/eager/decode/mla/{FP8}" in verified
    assert len(verified) >= 20, sorted(verified)


def test_the_large_query_claims_keep_the_default_logits_of_their_largest_gain():
    import math

    from attnreg.runtime import MLAConfig
    from attnreg.testing.checks import LARGE_Q_SM_SCALE
    from attnreg.testing.workload import LARGE_Q_GAINS

    default = MLAConfig(num_heads=16, device="cpu").softmax_scale
    assert default == pytest.approx(1 / math.sqrt(192))
    assert LARGE_Q_SM_SCALE * max(LARGE_Q_GAINS) == pytest.approx(default)
