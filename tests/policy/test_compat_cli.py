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


# -- issue 16 / 18: the platform table, engine facts, one-line input errors -------------
def test_cpu_plans_both_phases_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "cpu", "--model", "deepseek-v3")
    phases = data["phases"]
    assert isinstance(phases, dict)
    assert (phases["prefill"]["mode"], phases["decode"]["mode"]) == ("disabled", "disabled")
    assert phases["prefill"]["captured"] == [] and phases["decode"]["captured"] == []


def test_a_locked_tc_piecewise_on_cpu_exits_2_naming_the_rule(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compat", "--platform", "cpu", "--model", "deepseek-v3",
                 "--prefill-graph", "tc_piecewise"])
    err = capsys.readouterr().err
    assert code == 2 and "prefill tc_piecewise (set by the user): platform.no_device_graphs" in err


@pytest.mark.parametrize("args, option, value", [
    (["--num-heads", "0"], "--num-heads", "0"),
    (["--num-heads", "-3"], "--num-heads", "-3"),
    (["--page-size", "x"], "--page-size", "x"),
    (["--max-context", "0"], "--max-context", "0"),
    (["--decode-batch-sizes", "4,2"], "--decode-batch-sizes", "4,2"),
    (["--speculative-decoding", "0"], "--speculative-decoding", "0"),
    (["--capture-budget-fraction", "2"], "--capture-budget-fraction", "2"),
    (["--engine-prefill-modes", "full"], "--engine-prefill-modes", "full"),
    (["--device-memory", "0"], "--device-memory", "0"),
    (["--platform", "cuda"], "--platform", "cuda"),
    (["--kv-dtype", "int4"], "--kv-dtype", "int4"),
])
def test_bad_input_is_one_line_naming_option_value_and_what_is_allowed(
        capsys: pytest.CaptureFixture[str], args: list[str], option: str, value: str) -> None:
    try:
        code = main(["compat", *args])
    except SystemExit as exc:  # argparse's way out
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnreg compat: error: argument " + option)
    assert repr(value) in lines[0] or value in lines[0]
    assert "Traceback" not in err


def test_traceback_is_shown_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["compat", "--platform", "cpu", "--prefill-graph", "tc_piecewise"]
    assert main(args) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main([*args, "--traceback"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_engine_facts_and_capture_sizes_reach_the_plan(
        capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--platform", "b200", "--model", "deepseek-v3", "--page-size", "1",
                    "--max-context", "32768", "--max-running-requests", "48",
                    "--decode-batch-sizes", "1,8,64", "--prefill-tokens", "256,1024",
                    "--speculative-decoding", "4", "--kv-pool-size", "100GB")
    engine = data["engine"]
    assert isinstance(engine, dict)
    assert (engine["page_size"], engine["max_context_len"], engine["num_draft_tokens"],
            engine["kv_pool_bytes"]) == (1, 32768, 4, 100 * 10 ** 9)
    decode = data["phases"]["decode"]  # type: ignore[index]
    assert decode["backend"] == "flashinfer_mla"  # trtllm_mla declares pages of 32/64 only
    captured = decode["captured"]  # decode, then the verify / draft graphs flashinfer declares
    assert [c["forward_mode"] for c in captured] == ["decode", "target_verify", "draft_extend"]
    assert captured[0]["batch_sizes"] == [1, 8, 64] and captured[0]["max_seq_len"] == 32768
    assert captured[1]["num_tokens"] == [4, 32, 256] and captured[1]["query_len"] == 4
    assert data["phases"]["prefill"]["captured"][0]["num_tokens"] == [256, 1024]  # type: ignore[index]
    assert [s["how"] for s in data["speculative"]] == ["graph", "graph"]  # type: ignore[union-attr]
    assert data["capture_budget"]["source"] == "platform"  # type: ignore[index]
    assert data["capture_budget"]["device_memory_bytes"] == 180 * 10 ** 9  # type: ignore[index]


def test_host_engine_modes_are_an_input(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compat", "--platform", "cuda:sm90", "--engine-prefill-modes",
                 "breakable,disabled", "--prefill-graph", "tc_piecewise", "--backend", "triton"])
    assert code == 2 and "engine.mode_unsupported" in capsys.readouterr().err
