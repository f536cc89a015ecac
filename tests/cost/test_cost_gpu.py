"""On a CUDA device: calibrate and the cost-gate benchmark on tiny grids (seconds).

Run these before a real calibration: they exercise what the CPU tests cannot
(CUDA graph capture of the projections and of the absorbed stack, stalled-stream
timing).  Nothing here asserts a time; the checks are that the pipeline runs,
writes valid JSON and that graph and eager paths compute the same function.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.cli import main
from attnreg.graph_policy.cost_profile import TERMS, load_profile

REPO = Path(__file__).resolve().parents[2]
TINY = ["--heads", "16", "--batch-sizes", "1,2", "--prefixes", "0,256", "--extends", "64,128",
        "--layer-tokens", "64,256", "--time-budget-s", "120"]


@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "triton.json"
    assert main(["calibrate", "--backend", "triton", *TINY, "--json", "--out", str(out)]) == 0
    return out


@pytest.mark.gpu
def test_calibrate_on_the_device_writes_a_checked_profile(gpu_profile: Path) -> None:
    profile = load_profile(gpu_profile)
    data = json.loads(gpu_profile.read_text())
    assert not profile.dry_run and profile.platform.vendor.value == "cuda"
    assert data["checks"]["passed"] is True
    measured = {m["term"] for m in data["measurements"] if "us" in m}
    assert set(TERMS) <= measured
    assert all(m["us"] > 0 for m in data["measurements"] if "us" in m)
    graphs = {m.get("graph") for m in data["measurements"] if m["term"] == "layer_gpu"}
    assert graphs == {"cuda graph"}


@pytest.mark.gpu
def test_cost_gate_benchmark_runs_on_the_device(gpu_profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "cg.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_gate.py"),
                           "--profile", str(gpu_profile), "--out", str(out), "--heads", "16",
                           "--layers", "2", "--mix", "1:0:64,1:256:128,2:128:96"],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [c.get("error") for c in doc["classes"]] == [None] * 3, doc["classes"]
    assert all(c["agree"] for c in doc["classes"])
    assert all(c["graph"].startswith("cuda graph") for c in doc["classes"])
    assert doc["profile"]["gate_uses_cost_model"] is True
