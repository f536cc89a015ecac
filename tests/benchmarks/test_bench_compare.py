"""python -m benchmarks.compare: a section's times in new runs against the old runs' range."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import compare


def _run(tmp_path: Path, name: str, triton_us: float, fa3_us: float) -> Path:
    rows = [{"B": 1, "L": 32768, "H": 128, "results": {
        "triton": {"us": triton_us, "timing": {"median_us": triton_us, "samples_us": [1.0]}},
        "flashinfer_mla/fa3": {"us": fa3_us}}}]
    doc: dict[str, Any] = {"sections": {"P1": {"status": "ok", "data": {"rows": rows}},
                                        "P3": {"status": "error", "data": {}}}}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_a_new_median_outside_the_old_range_is_flagged(tmp_path: Path) -> None:
    old = [_run(tmp_path, "a.json", 60.0, 49.0), _run(tmp_path, "b.json", 62.0, 49.2)]
    new = [_run(tmp_path, "c.json", 61.0, 60.0)]
    lines = compare.compare(old, new, "P1", tolerance=0.05)
    triton = next(ln for ln in lines if "/triton/us" in ln)
    fa3 = next(ln for ln in lines if "flashinfer_mla/fa3/us" in ln)
    assert "rows[B=1,L=32768,H=128]" in triton
    assert "61.0 (60.0 - 62.0, 2)" in triton and triton.endswith("| 1.000 |")
    assert fa3.endswith(">> |")  # 60 us against 49.0 - 49.2: slower than noise
    assert sum("us` |" in ln for ln in lines) == 2  # spreads and samples are not times
    assert "flagged (outside the old range by more than 5%): 1" in lines[-2]


def test_a_section_without_ok_runs_says_so(tmp_path: Path) -> None:
    old = [_run(tmp_path, "a.json", 60.0, 49.0)]
    assert "No time in both" in compare.compare(old, old, "P3", 0.05)[2]
    assert compare.main(["--old", str(tmp_path / "missing.json"), "--new", str(old[0])]) == 2
