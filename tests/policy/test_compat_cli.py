"""`attnreg compat`: JSON keys, human output, exit codes."""

from __future__ import annotations

import json

import pytest

from attnreg.cli import main
from attnreg.commands.compat import parse_size


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    code = main(["compat", "--json", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(out)
    assert isinstance(data, dict)
    return data


def test_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "cuda:sm100", "--model", "kimi-k2.6")
    assert data["platform"] == "cuda:sm100" and data["simulated"] is True
    phases = data["phases"]
    assert isinstance(phases, dict)
    assert phases["prefill"]["mode"] == "disabled"
    assert phases["decode"]["mode"] == "full"
    assert phases["decode"]["pinned_method"] == "mla"
    for phase in ("prefill", "decode"):
        assert {"mode", "backend", "pinned_method", "fallbacks", "split_kv",
                "capture_memory_bytes", "locked"} <= set(phases[phase])
    decisions = data["decisions"]
    assert isinstance(decisions, list) and decisions
    for d in decisions:
        assert set(d) == {"rule", "severity", "source", "phase", "before", "after", "message"}
    assert any(d["rule"] == "backend.high_cost_fallback" and d["severity"] == "soft"
               for d in decisions)


def test_lock_flag_is_honoured_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "cuda:sm100", "--model", "kimi-k2.6",
                    "--prefill-graph", "tc_piecewise")
    prefill = data["phases"]["prefill"]  # type: ignore[index]
    assert prefill["mode"] == "tc_piecewise" and prefill["locked"] is True
    assert prefill["fallbacks"] == [{"to": "flashinfer_mla", "cost": "high",
                                     "reason": prefill["fallbacks"][0]["reason"]}]


def test_fact_flags_override_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "cuda:sm100", "--model", "kimi-k2.6",
                    "--kv-dtype", "bf16")
    assert data["model"]["kv_dtype"] == "bf16"  # type: ignore[index]
    assert data["phases"]["prefill"]["mode"] == "breakable"  # type: ignore[index]


def test_feature_and_budget_flags(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "cuda:sm90", "--model", "deepseek-v3",
                    "--two-batch-overlap", "--enable-lora")
    assert data["features"] == ["lora", "two_batch_overlap"]
    assert data["phases"]["prefill"]["mode"] == "disabled"  # type: ignore[index]
    data = run_json(capsys, "--platform", "cuda:sm90", "--model", "deepseek-v4-like",
                    "--capture-memory-budget", "16GiB")
    assert data["phases"]["prefill"]["mode"] == "disabled"  # type: ignore[index]
    assert data["phases"]["decode"]["mode"] == "full"  # type: ignore[index]
    assert any(d["rule"] == "budget.capture_memory" for d in data["decisions"])  # type: ignore[union-attr]


def test_human_output_has_table_and_numbered_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "phase" in out and "prefill  breakable" in out and "decode   full" in out
    assert "decisions:" in out and "  1. [info/" in out


def test_policy_error_exits_2_with_every_reason_on_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
                 "--backend", "reference", "--decode-graph", "full",
                 "--prefill-graph", "breakable"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("backend.capture_unsupported") == 2
    assert "decode full" in captured.err and "prefill breakable" in captured.err


def test_policy_error_in_json_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compat", "--json", "--platform", "cpu", "--backend", "reference",
                 "--decode-graph", "full"])
    captured = capsys.readouterr()
    assert code == 2
    data = json.loads(captured.out)
    assert data["error"] == "graph_policy" and len(data["reasons"]) == 2
    assert "platform.no_device_graphs" in captured.err


def test_unknown_backend_exits_2_with_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compat", "--platform", "cuda:sm100", "--prefill-backend", "trtlm_mla"])
    captured = capsys.readouterr()
    assert code == 2 and "Did you mean: trtllm_mla" in captured.err


@pytest.mark.parametrize("text,expected", [("8GiB", 8 << 30), ("512MiB", 512 << 20),
                                           ("2GB", 2_000_000_000), ("1e6", 1_000_000),
                                           ("4096", 4096)])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_bad_size_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["compat", "--capture-memory-budget", "lots"])
    assert info.value.code == 2
    assert "cannot read size" in capsys.readouterr().err
