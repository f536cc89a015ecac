"""The claims report: text table, JSON round trip."""

from __future__ import annotations

import json

import pytest

from attnreg.testing.report import SCHEMA_VERSION, ClaimResult, Report, Status


def _result(cid: str, status: Status, message: str = "", backend: str = "b") -> ClaimResult:
    return ClaimResult({"id": cid, "backend": backend, "kind": "eager", "check": "x"},
                       status, message)


def test_text_lists_refutations_with_their_message_and_groups_skips():
    report = Report({"backends": ["b"], "device": "cpu", "platform": "cpu",
                     "libraries": {"torch": "2.13"}})
    report.add(_result("b/eager/1", Status.VERIFIED))
    report.add(_result("b/capture/2", Status.REFUTED, "replay 2: output differs"))
    for i in range(5):
        report.add(_result(f"b/capture/s{i}", Status.SKIPPED, "no CUDA graphs on cpu"))
    text = report.to_text()
    assert "b: 1 verified, 1 refuted, 5 skipped" in text
    assert "REFUTED   b/capture/2" in text and "replay 2: output differs" in text
    assert "SKIPPED   5 claims: no CUDA graphs on cpu" in text
    assert "b/eager/1" not in text and "b/eager/1" in report.to_text(verbose=True)
    assert text.splitlines()[-1].startswith("REFUTED: 1 verified, 1 refuted, 5 skipped")
    assert not report.ok


def test_a_worse_outcome_of_the_same_claim_wins():
    report = Report()
    report.add(_result("c", Status.VERIFIED))
    report.add(_result("c", Status.REFUTED, "teardown failed"))
    report.add(_result("c", Status.VERIFIED))
    assert [r.status for r in report.results] == [Status.REFUTED]


def test_json_round_trip(tmp_path):
    report = Report({"backends": ["b"], "device": "cuda", "platform": "cuda:sm90"})
    report.add(_result("b/x", Status.REFUTED, "why"))
    report.add(_result("b/y", Status.SKIPPED, "because"))
    path = report.write_json(tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["summary"] == {"verified": 0, "refuted": 1, "skipped": 1,
                               "by_backend": {"b": {"verified": 0, "refuted": 1, "skipped": 1}}}
    assert data["claims"][0]["status"] == "refuted" and data["claims"][0]["message"] == "why"
    again = Report.read_json(path)
    assert [(r.id, r.status, r.message) for r in again.results] == \
        [(r.id, r.status, r.message) for r in report.results]


def _run_report(backend: str, *results: ClaimResult, **header: object) -> Report:
    base = {"backends": [backend], "device": "cuda", "platform": "cuda:sm90",
            "device_name": "NVIDIA H200", "libraries": {"torch": "2.11.0"}, "unavailable": {}}
    base.update(header)
    report = Report(base)
    for r in results:
        report.add(r)
    return report


def test_merge_joins_per_backend_runs_of_one_machine():
    a = _run_report("a", _result("a/1", Status.VERIFIED, backend="a"))
    b = _run_report("b", _result("b/1", Status.SKIPPED, "not here", backend="b"),
                    unavailable={"b": "needs sm100"})
    merged = Report.merge([a, b])
    assert merged.header["backends"] == ["a", "b"]
    assert merged.header["unavailable"] == {"b": "needs sm100"}
    assert merged.counts() == {"verified": 1, "refuted": 0, "skipped": 1}
    assert merged.ok
    # the inputs are not changed by the merge
    assert a.header["backends"] == ["a"] and a.header["unavailable"] == {}


def test_merge_keeps_the_worse_outcome_of_a_claim_run_twice():
    first = _run_report("a", _result("a/1", Status.VERIFIED, backend="a"))
    second = _run_report("a", _result("a/1", Status.REFUTED, "replay differs", backend="a"))
    merged = Report.merge([first, second])
    assert [r.status for r in merged.results] == [Status.REFUTED] and not merged.ok


def test_merge_refuses_reports_of_different_machines_or_versions():
    a = _run_report("a")
    with pytest.raises(ValueError, match="platform 'cuda:sm100'"):
        Report.merge([a, _run_report("b", platform="cuda:sm100")])
    with pytest.raises(ValueError, match="torch 2.13.0, an earlier one 2.11.0"):
        Report.merge([a, _run_report("b", libraries={"torch": "2.13.0"})])
    with pytest.raises(ValueError, match="nothing to merge"):
        Report.merge([])


def test_merge_takes_a_library_installed_for_one_run_only():
    # flash-attn-4 installed only for its backend's run: one machine, one library set
    a = _run_report("a", libraries={"torch": "2.11.0", "flash-attn-4": None})
    b = _run_report("b", libraries={"torch": "2.11.0", "flash-attn-4": "4.0.0b36"})
    merged = Report.merge([a, b])
    assert merged.header["libraries"] == {"torch": "2.11.0", "flash-attn-4": "4.0.0b36"}
    assert a.header["libraries"]["flash-attn-4"] is None
    with pytest.raises(ValueError, match="flash-attn-4 4.0.0b37"):
        Report.merge([b, _run_report("c", libraries={"torch": "2.11.0",
                                                     "flash-attn-4": "4.0.0b37"})])
