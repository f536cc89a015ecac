"""(o) A backend returning its kernel's own output: one tensor shared by every layer is
refuted by exactly the multi-layer claims, eager (layer 0's output changes when layer 1
runs) and captured (the session keeps each layer's output: layer 0's rows are layer 1's);
the control with a new tensor per call holds them, and both hold the single-layer claims.
A cpu run of the decode claims at the smallest shape."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

SHARED, CORRECT = "planted_kernel_output_shared", "planted_kernel_output_correct"


def test_every_layer_must_get_an_output_of_its_own(tmp_path):
    code, out, data = conformance(
        tmp_path, "--device", "cpu", "--plugin", "planted.kernel_output",
        "--backend", SHARED, "--backend", CORRECT,
        "-k", "p16 and h2 and decode and not target_verify and not draft_extend and "
              "((multi_layer and bf16-fp8_e4m3) or (full and bf16-bf16 and (padded_rows or "
              "capture_path) and not sm_scale))")
    assert code == 1 and data is not None, out
    refuted, verified = by_status(data, "refuted"), by_status(data, "verified")
    claims = {c["id"].removeprefix(SHARED + "/") for c in data["claims"]
              if c["id"].startswith(SHARED + "/")}
    multi = {cid for cid in claims if "multi_layer" in cid}
    assert multi and claims - multi, out
    assert {f"{SHARED}/{cid}" for cid in multi} == set(refuted), out
    assert {f"{CORRECT}/{cid}" for cid in claims} | {
        f"{SHARED}/{cid}" for cid in claims - multi} == set(verified), out
    assert any("eager" in cid for cid in multi) and any("full" in cid for cid in multi), out
    for message in refuted.values():
        assert "layer 0" in message, message
