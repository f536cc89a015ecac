"""benchmarks/speculative.py on a cpu: its dry run checks each backend's verify and decode
steps (graph and eager) against a float64 oracle, and renders (the timings mean nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

pytest.importorskip("torch")

from benchmarks import speculative  # noqa: E402
from benchmarks._report import Page, Plotter  # noqa: E402


def test_dry_run_checks_in_float64_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    code = speculative.main(["--dry-run", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    rows = {r["backend"]: r for r in result["data"]["rows"]}
    assert "triton" in rows, result["data"]
    errs = rows["triton"]["errors"]
    assert set(errs) == {"verify_graph", "verify_eager", "decode_graph", "decode_eager"}
    assert max(errs.values()) <= speculative.MAX_ABS_ERR
    accuracy = next(c for c in result["checks"] if c["id"] == "spec triton float64")
    assert accuracy["status"] == "target met"
    assert "flashinfer_mla" in result["data"]["skipped_backends"]   # CUDA only
    lines = speculative.render(result["data"], Page(plot=Plotter(Path("img"), enabled=False), img_rel="img"))
    assert any("| triton |" in line for line in "\n".join(lines).splitlines())


def test_a_wrong_verify_output_fails_the_float64_check() -> None:
    data = {"rows": [{"backend": "triton", "errors": {"verify_graph": 0.5},
                      "verify_graph": {"median_us": 10.0}, "verify_eager": {"median_us": 20.0}}]}
    checks = {c.id: c for c in speculative.checks(data)}
    assert checks["spec triton float64"].status == "missed"
    assert checks["spec triton graph"].measured == pytest.approx(2.0)
