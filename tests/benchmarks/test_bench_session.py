"""The `session` benchmark section: a smoke run on CPU (tiny shapes, Triton interpreter, no
device graphs) so it cannot rot, and its checks / rendering on stated data.  No figure is
measured here: the lead runs it on the H200 (`python -m benchmarks --only session`)."""

from __future__ import annotations

import json

import pytest

from benchmarks import session_step
from benchmarks._report import Page, Plotter


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="CPU stand-in for the device run")
def test_the_session_section_runs_end_to_end_on_tiny_shapes(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from benchmarks.__main__ import main

    # the smallest step that still has a decode and a verify bucket and several layers
    monkeypatch.setattr(session_step, "DRY_BATCHES", (1,))
    monkeypatch.setattr(session_step, "DRY_HOST_SAMPLES", 1)
    rc = main(["--dry-run", "--only", "session", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, doc
    sec = doc["sections"]["session"]
    assert sec["status"] == "ok", sec
    data = sec["data"]
    rows = {(r["variant"], r["kind"], r["B"]): r for r in data["rows"]}
    for kind in ("decode", "verify"):
        row = rows[("triton", kind, 1)]
        assert len(row["runs"]) == session_step.RUNS >= 3
        assert row["eager_us"]["min"] <= row["eager_us"]["median"] <= row["eager_us"]["max"]
        assert row["counts"]["replayed"]["gate.ok"] >= 1, "the timed graph steps replayed"
        assert row["graph_vs_eager_max_abs"] < 5e-2, "the replay computes what eager does"
    host = data["host"][0]
    assert host["variant"] == "triton" and host["B"] == 1
    assert set(host["runs"]) == {"step_us", "gate_us", "replay_metadata_us",
                                 "replay_launch_us", "replay_metadata_plain_us",
                                 "batch_build_us", "batch_build_plain_us",
                                 "step_in_place_us", "replay_metadata_in_place_us",
                                 "batch_build_in_place_us"}
    # the step's batch was built in the session's index layout: its replays took one copy;
    # packed into the session's index buffer, none
    assert host["fills"]["packed"] > 0 and host["fills"]["in_place"] > 0
    assert all(len(v) == session_step.RUNS for v in host["runs"].values())
    ids = [c["id"] for c in data["checks"]]
    assert ids == ["session triton decode", "session triton verify", "session triton host"]


def _stated() -> dict:
    def row(kind: str, runs: list[float]) -> dict:
        spread = {"median": 100.0, "min": 90.0, "max": 120.0}
        return {"variant": "triton", "kind": kind, "B": 1, "runs": runs,
                "speedup": sorted(runs)[1], "eager_us": spread, "graph_us": spread,
                "graph_vs_eager_max_abs": 1e-3}
    return {"variants": ["triton", "flash_attn_cute"], "layers": 8, "heads": 128, "kv_lora": 512,
            "rope": 64, "page_size": 64, "seq_len": 2048, "drafts": 4, "runs": 3,
            "host_batch": 64, "timing": "t",
            "rows": [row("decode", [3.5, 2.5, 3.1]), row("verify", [1.5, 2.2, 1.9]),
                     {"variant": "flash_attn_cute", "not_declared": "no absorbed decode"}],
            "host": [{"variant": "triton", "B": 64, "step_us": 28.0, "gate_us": 3.0,
                      "replay_metadata_us": 20.0, "replay_launch_us": 5.0,
                      "step_in_place_us": 25.0, "replay_metadata_in_place_us": 14.0,
                      "runs": {"step_us": [27.0, 28.0, 40.0],
                               "step_in_place_us": [31.0, 25.0, 24.0]}}]}


def test_checks_state_the_median_of_the_runs_against_the_issue_targets():
    checks = {c.id: c for c in session_step.checks(_stated())}
    assert set(checks) == {"session triton decode", "session triton verify",
                           "session triton host"}, "an undeclared backend owes no figure"
    decode, verify, host = (checks[f"session triton {k}"] for k in ("decode", "verify", "host"))
    assert decode.measured == 3.1 and decode.status == "target met"
    assert verify.measured == 1.9 and verify.status == "missed"
    # the step of a batch packed into the session's index buffer, as docs/runtime.md says
    assert host.measured == 25.0 and host.status == "target met"
    assert "packed into the session's index buffer" in host.what
    assert list(decode.runs) == [3.5, 2.5, 3.1]
    older = _stated()
    del older["host"][0]["runs"]["step_in_place_us"]  # a result from before that form
    host = {c.id: c for c in session_step.checks(older)}["session triton host"]
    assert host.measured == 28.0 and "built in the index layout" in host.what


def test_render_shows_each_run_and_the_host_parts(tmp_path):
    page = Page(Plotter(tmp_path, enabled=False), "img")
    text = "\n".join(session_step.render(_stated(), page))
    assert "**3.10x** (3.50, 2.50, 3.10)" in text
    assert "| triton | 64 | **25.0** / 28.0 | 3.0 | 14.0 / 20.0 / - | 5.0 |" in text
    assert "not declared: no absorbed decode" in text
