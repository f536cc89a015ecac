"""`attnreg compat` shows where the cost model switches to eager MHA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnreg.cli import main
from attnreg.graph_policy import cost_profile as cp
from attnreg.graph_policy.cost_profile import save_profile

from ._helpers import profile_dict

PLAN = ["--platform", "cuda:sm90", "--model", "deepseek-v3", "--backend", "triton"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["compat", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    return save_profile(profile_dict(), tmp_path / "h200-triton.json")


@pytest.fixture
def no_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(cp, "shipped_profile_dir", lambda: shipped)
    return shipped


def test_json_has_the_crossover_per_prefix(capsys: pytest.CaptureFixture[str],
                                           profile_path: Path) -> None:
    code, out, _ = run(capsys, *PLAN, "--cost-profile", str(profile_path), "--json")
    assert code == 0
    cross: dict[str, Any] = json.loads(out)["phases"]["prefill"]["crossover"]
    assert cross["applies"] is True
    assert cross["profile"]["source"] == str(profile_path)
    assert cross["profile"]["shipped"] is False
    assert cross["heads"] == 128 and cross["batch_size"] == 1
    assert [p["prefix"] for p in cross["points"]] == [0, 4096, 32768]
    first = cross["points"][0]
    # The synthetic profile crosses over at extend 1249 for prefix 0 (see test_cost_profile).
    assert first["max_graph_extend"] == 1249 and first["max_extend"] == 8192
    assert first["text"] == "absorbed graph for extend <= 1249 tokens at prefix 0, eager MHA above"
    # A longer prefix makes every extend costlier for the absorbed form: an earlier switch.
    extends = [p["max_graph_extend"] for p in cross["points"]]
    assert extends == sorted(extends, reverse=True) and extends[-1] < extends[0]


def test_human_output_says_where_the_graph_stops(capsys: pytest.CaptureFixture[str],
                                                 profile_path: Path) -> None:
    code, out, _ = run(capsys, *PLAN, "--cost-profile", str(profile_path))
    assert code == 0
    assert "cost model (prefill replay, per layer):" in out
    assert "absorbed graph for extend <= 1249 tokens at prefix 0, eager MHA above" in out
    assert "at prefix 4096" in out and "at prefix 32768" in out


def test_no_profile_means_a_null_crossover(capsys: pytest.CaptureFixture[str],
                                           no_shipped: Path) -> None:
    code, out, _ = run(capsys, *PLAN, "--json")
    assert code == 0
    assert json.loads(out)["phases"]["prefill"]["crossover"] is None
    code, out, _ = run(capsys, *PLAN)
    # No crossover section (the backend.pinning decision still names the cost model).
    assert "cost model (prefill replay" not in out and "eager MHA above" not in out


def test_a_shipped_profile_is_found_automatically(capsys: pytest.CaptureFixture[str],
                                                  no_shipped: Path) -> None:
    save_profile(profile_dict(), no_shipped / "h200-triton.json")
    code, out, _ = run(capsys, *PLAN, "--json")
    cross = json.loads(out)["phases"]["prefill"]["crossover"]
    assert code == 0 and cross["applies"] and cross["profile"]["shipped"] is True
    assert cross["points"][0]["max_graph_extend"] == 1249
    # Another backend on the same platform has no shipped profile: no crossover.
    code, out, _ = run(capsys, "--platform", "cuda:sm90", "--model", "deepseek-v3",
                       "--backend", "flashinfer_mla", "--json")
    assert json.loads(out)["phases"]["prefill"]["crossover"] is None


def test_a_profile_for_another_backend_is_reported_and_not_applied(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    other = save_profile(profile_dict(backend="flashinfer_mla"), tmp_path / "fi.json")
    code, out, _ = run(capsys, *PLAN, "--cost-profile", str(other), "--json")
    cross = json.loads(out)["phases"]["prefill"]["crossover"]
    assert code == 0 and cross["applies"] is False and cross["points"] == []
    assert "ignored" in cross["note"] and cross["profile"] is None


def test_a_plan_the_cost_model_does_not_decide_still_shows_the_profile(
        capsys: pytest.CaptureFixture[str], profile_path: Path) -> None:
    code, out, _ = run(capsys, *PLAN, "--prefill-graph", "tc_piecewise",
                       "--cost-profile", str(profile_path))
    assert code == 0
    assert "(not applied to this plan)" in out
    assert "decides only breakable graphs" in out


def test_a_malformed_profile_exits_2_naming_the_file(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "attnreg.cost_profile", "schema_version": 1}')
    code, _, err = run(capsys, *PLAN, "--cost-profile", str(bad))
    assert code == 2
    assert f"cost profile {bad}:" in err and "at `backend`: missing" in err
