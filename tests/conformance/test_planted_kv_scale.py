"""(s) ``planted_kv_scale_frozen`` keeps each layer's fp8 scale of its first graph forward:
the ``kv_scale_change`` claims (a graph captured at one scale, replayed after
``set_scale``) refute it, on cpu through the capture-mode path; triton's hold."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

B = "planted_kv_scale_frozen"
FP8 = "mla/bf16-fp8_e4m3/p16/h2/576x512"


def test_a_scale_frozen_at_capture_is_refuted_by_the_scale_change_claims(tmp_path):
    code, out, data = conformance(
        tmp_path, "--device", "cpu", "--exhaustive", "--plugin", "planted.kv_scale",
        "--backend", B, "--backend", "triton",
        "-k", "kv_scale_change and p16/h2/ and not target_verify and not draft_extend")
    assert code == 1 and data is not None, out
    refuted = by_status(data, "refuted")
    assert set(refuted) == {f"{B}/capture/decode/full/kv_scale_change/{FP8}",
                            f"{B}/capture/prefill/breakable/kv_scale_change/{FP8}"}, out
    for msg in refuted.values():
        assert "replay 1: " in msg and "output differs from the float64 oracle" in msg, msg
    assert set(by_status(data, "verified")) == {
        f"triton/capture/decode/full/kv_scale_change/{FP8}",
        f"triton/capture/prefill/breakable/kv_scale_change/{FP8}"}, out
