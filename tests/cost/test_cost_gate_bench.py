"""benchmarks/cost_gate.py runs standalone and writes its JSON (CPU dry run: no timing
is asserted, only that every class was run, decided and summarised)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.cli import main

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "cost_gate.py"


def test_dry_run_writes_every_class_and_the_summary(tmp_path: Path) -> None:
    profile = tmp_path / "dry.json"
    assert main(["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0,8",
                 "--extends", "4", "--layer-tokens", "4,8", "--json",
                 "--out", str(profile)]) == 0
    out = tmp_path / "cg.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile),
                           "--out", str(out), "--dry-run"], capture_output=True, text=True,
                          check=False,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "attnreg.bench.cost_gate" and doc["dry_run"] is True
    classes = doc["classes"]
    assert len(classes) == len(doc["setup"]["mix"]) and all("error" not in c for c in classes)
    for c in classes:
        assert c["gate_choice"] in ("graph", "eager") and c["agree"] is True
        assert c["ratio_to_best"] >= 1.0
        assert c["gate_reason"].startswith(("gate.ok", "gate.cost_model"))
    summary = doc["summary"]
    assert summary["classes"] == len(classes)
    assert set(summary["total_ms"]) == {"cost_aware", "always_graph", "always_eager",
                                        "per_class_best"}
    assert summary["targets"]["max_class_ratio_to_best"] == 1.05
    assert "DRY RUN" in proc.stdout


def test_it_refuses_to_run_without_cuda_unless_dry(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    profile = tmp_path / "dry.json"
    assert main(["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0",
                 "--extends", "4", "--layer-tokens", "4", "--json", "--out", str(profile)]) == 0
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile),
                           "--out", str(tmp_path / "x.json")], capture_output=True, text=True,
                          check=False,
                          timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_a_custom_mix_is_run(tmp_path: Path) -> None:
    profile = tmp_path / "dry.json"
    assert main(["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0",
                 "--extends", "4", "--layer-tokens", "4", "--json", "--out", str(profile)]) == 0
    out = tmp_path / "cg.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile), "--out",
                           str(out), "--dry-run", "--mix", "1:4:8"], capture_output=True,
                          text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c["prefix"] for c in json.loads(out.read_text())["classes"]] == [4]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile), "--out",
                          str(out), "--mix", "1:2"], capture_output=True, text=True,
                         check=False, timeout=120)
    assert bad.returncode == 2 and "expected B:P:E" in bad.stderr


def test_a_backend_that_captures_prefill_goes_through_the_graph_session(tmp_path: Path) -> None:
    """triton declares a BREAKABLE prefill graph: on a cpu the graph path is the session's
    capture-mode path (capture runs once, replay re-runs), and it agrees with eager."""
    profile = tmp_path / "dry.json"
    assert main(["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0",
                 "--extends", "4", "--layer-tokens", "4", "--json", "--out", str(profile)]) == 0
    out = tmp_path / "cg.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--profile", str(profile), "--out",
                           str(out), "--dry-run", "--backend", "triton", "--mix", "1:8:4"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["classes"]
    assert "error" not in row, row
    assert row["graph"].startswith("GraphSession without device graphs") and row["agree"] is True
