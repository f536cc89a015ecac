"""(n) An engine's fp8 query mishandled: ``planted_fp8_q_scale_ignored`` (drops
``q_scale``) is refuted by every fp8-query claim, ``planted_fp8_q_scale_kept`` (reuses
each layer's first scale) by every claim that runs a second batch, and the control that
dequantises with each call's own scale holds them all.  One exhaustive cpu run: the
eager claims and the capture-mode paths (the session's static ``q_scale``)."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

IGNORED, KEPT, PER_STEP, CORRECT = (f"planted_fp8_q_scale_{d}"
                                    for d in ("ignored", "kept", "per_step", "correct"))
# the fp8-query entry extends triton's fp8-pool entries that take q as given: decode's at
# 17-32 heads (1-16 and 33+ round q, declared), prefill's at every head count
FP8Q = "fp8_e4m3-fp8_e4m3/p16/h17/576x512"
FP8Q_PREFILL = "fp8_e4m3-fp8_e4m3/p16/h2/576x512"


def test_an_fp8_querys_scale_must_reach_every_call(tmp_path):
    args = ["--device", "cpu", "--exhaustive", "--plugin", "planted.fp8_q_scale",
            "-k", "fp8_e4m3-fp8_e4m3 and p16 and (h17 or h2) and (eager or fp8_large_q) and not multi_layer"]
    for backend in (IGNORED, KEPT, CORRECT):
        args += ["--backend", backend]
    code, out, data = conformance(tmp_path, *args)
    assert code == 1 and data is not None, out
    refuted, verified = by_status(data, "refuted"), by_status(data, "verified")

    def ids(statuses: dict[str, str], backend: str) -> set[str]:
        return {cid.removeprefix(backend + "/") for cid in statuses if
                cid.startswith(backend + "/")}

    # the control holds every claim the run made, eager and through each capture path
    assert not ids(refuted, CORRECT), out
    held = ids(verified, CORRECT)
    assert {f"eager/decode/mla/{FP8Q}", f"eager/prefill/mla/{FP8Q_PREFILL}",
            f"capture/decode/full/fp8_large_q/mla/{FP8Q}/sm_scale7.048e-05",
            f"capture/prefill/tc_piecewise/fp8_large_q/mla/{FP8Q_PREFILL}/sm_scale7.048e-05"} <= held
    # a dropped scale: nothing holds
    assert ids(refuted, IGNORED) == held, out
    # a kept scale: every claim whose batches carry another scale than the first
    kept = ids(refuted, KEPT)
    # (not eager decode at 17 heads: a cpu run claims 16+ heads on one small batch, whose
    # first scale is the right one)
    assert {f"eager/prefill/mla/{FP8Q_PREFILL}",
            f"capture/decode/full/fp8_large_q/mla/{FP8Q}/sm_scale7.048e-05",
            f"capture/decode/full/target_verify/fp8_large_q/mla/{FP8Q}/sm_scale7.048e-05",
            f"capture/prefill/breakable/fp8_large_q/mla/{FP8Q_PREFILL}/sm_scale7.048e-05"} <= kept, out
    for cid in kept:
        assert "output differs from the float64 oracle" in refuted[f"{KEPT}/{cid}"]


def test_each_layer_of_a_step_gets_its_own_query_scale(tmp_path):
    """The step's first layer's scale used for every layer: the multi-layer claims of the
    fp8-query pair (each layer's query carries its own scale) refute it.  (Every
    single-layer claim verifies it: capture claims in the H200 run of `scripts/h200.sh
    fp8q`, eager ones in a cpu run.)"""
    code, out, data = conformance(
        tmp_path, "--device", "cpu", "--exhaustive", "--plugin", "planted.fp8_q_scale",
        "--backend", PER_STEP, "--backend", CORRECT,
        "-k", "multi_layer and fp8_e4m3-fp8_e4m3 and p16 and h17 and decode")
    assert code == 1 and data is not None, out
    refuted, verified = by_status(data, "refuted"), by_status(data, "verified")
    claims = {c["id"].removeprefix(PER_STEP + "/") for c in data["claims"]
              if c["id"].startswith(PER_STEP + "/")}
    assert {f"eager/decode/mla/multi_layer/{FP8Q}",
            f"capture/decode/full/multi_layer/mla/{FP8Q}"} <= claims, out
    assert {f"{PER_STEP}/{cid}" for cid in claims} == set(refuted), out
    assert {f"{CORRECT}/{cid}" for cid in claims} == set(verified), out
    for cid, message in refuted.items():
        assert "(layer 1)" in message or "layer 1:" in message, (cid, message)


def test_an_fp8_query_of_an_idle_batch_replays(tmp_path):
    """padded_rows replays an idle batch (no request, an idle data-parallel rank): its q
    has no row, and rounding it must not raise (amax of no element refuted this claim of
    every fp8-q backend on an H100, 2026-12-07: flashmla's too)."""
    claim = f"{CORRECT}/capture/decode/full/padded_rows/mla/{FP8Q}"
    code, out, data = conformance(
        tmp_path, "--device", "cpu", "--exhaustive", "--plugin", "planted.fp8_q_scale",
        "--backend", CORRECT, "-k", "decode/full/padded_rows and fp8_e4m3-fp8_e4m3 and h17")
    assert code == 0 and data is not None, out
    assert set(by_status(data, "verified")) == {claim}, out
