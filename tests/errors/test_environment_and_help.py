"""Environment variables in one table, help on every option, the time-left estimate
(issue 28 items 3 and 5)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.cli import build_parser, main
from attnreg.profiling.progress import Progress
from attnreg.registry.environment import (
    ENV_VARS,
    EnvironmentValueError,
    env_value,
    environment_report,
)
from attnreg.testing.progress import ClaimTimes

REPO = Path(__file__).resolve().parents[2]
#: A read of a variable: os.environ / getenv, or the table's readers.
_READ = re.compile(r"""(?:environ\.get|getenv|environ\[|env_value|_env_list|_truthy)\(?\s*"""
                   r"""["']([A-Z_][A-Z0-9_]*)["']""")
_NAMED = re.compile(r"""^\s*_?[A-Z_]*ENV[A-Z_]* = ["']([A-Z_][A-Z0-9_]*)["']""", re.M)


def _read_by_src() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "src" / "attnreg").rglob("*.py"):
        text = path.read_text()
        names |= set(_READ.findall(text)) | set(_NAMED.findall(text))
    return names


def test_every_variable_the_source_reads_is_in_the_table() -> None:
    listed = {v.name for v in ENV_VARS}
    read = _read_by_src()
    assert {"ATTNREG_PLATFORM", "ATTNREG_SLOW_PLUGIN_SECONDS"} <= read  # the scan works
    assert read <= listed, f"read but not in ENV_VARS (doctor lists that table): {read - listed}"


def test_doctor_lists_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["environment"]) == [v.name for v in ENV_VARS]
    assert "ATTNREG_PLATFORM" in data["environment"]
    assert main(["doctor", "--wide"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^{v.name}\s", out, re.M) for v in ENV_VARS), out


def test_doctor_marks_a_variable_it_does_not_need_to_run_as_invalid(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNREG_SGLANG", "perhaps")
    assert main(["doctor", "--json"]) == 0
    problems = json.loads(capsys.readouterr().out)["environment_problems"]
    assert list(problems) == ["ATTNREG_SGLANG"] and "expected one of 1" in problems[
        "ATTNREG_SGLANG"]


@pytest.mark.parametrize("name, raw, parsed", [
    ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "YES", True),
    ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "0", False),
    ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "", False),
    ("ATTNREG_SLOW_PLUGIN_SECONDS", " 2.5 ", 2.5),
    ("ATTNREG_SLOW_PLUGIN_SECONDS", "", 0.5),
    ("ATTNREG_DISABLE", "a, b,,", ["a", "b"]),
    ("ATTNREG_PLATFORM", "", None),
])
def test_values_parse_like_their_flags(name: str, raw: str, parsed: object) -> None:
    value = env_value(name, {name: raw})
    assert (str(value) if name == "ATTNREG_PLATFORM" and value else value) == parsed


def test_a_bad_value_names_the_variable_and_the_flag_it_mirrors() -> None:
    with pytest.raises(EnvironmentValueError) as exc:
        env_value("ATTNREG_PLATFORM", {"ATTNREG_PLATFORM": "gpu"})
    assert exc.value.name == "ATTNREG_PLATFORM" and "(as --platform takes it)" in str(exc.value)
    assert isinstance(exc.value, ValueError)  # as Platform.parse's error was
    rows = environment_report({"ATTNREG_SLOW_PLUGIN_SECONDS": "abc", "TRITON_INTERPRET": "x"})
    bad = {r["name"]: r["problem"] for r in rows if not r["valid"]}
    assert list(bad) == ["ATTNREG_SLOW_PLUGIN_SECONDS"]  # others' variables are theirs


# -- help text ----------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_every_option_of_every_command_has_help() -> None:
    missing = [(name, action.option_strings[0])
               for name, sub in _subparsers(build_parser()).items()
               for action in sub._actions
               if action.option_strings and not action.help]
    assert not missing


def test_benchmarks_help_names_no_issue_number() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    assert "usage:" in proc.stdout and not re.search(r"\(issue \d+\)", proc.stdout)


def test_cli_docs_have_no_blank_help_cells() -> None:
    text = (REPO / "docs" / "cli.md").read_text()
    # option tables: | `--option` | help | default |; the help cell must say something
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in text.splitlines() if line.startswith("| `-")]
    assert rows and all(len(r) >= 2 for r in rows)
    blank = [r[0] for r in rows if not r[1]]
    assert not blank


# -- time left: from measured per-claim times -----------------------------------------------

def test_time_left_counts_unmeasured_classes_at_the_slowest_measured_mean() -> None:
    times = ClaimTimes()
    assert times.estimate(["eager"]) is None
    for _ in range(3):
        times.add("eager", 0.5)
    # 34 fast claims measured, 59 slow capture claims to come: the mean of the fast ones
    # would say 59 * 0.5 s; the slow class, once measured, says what it takes
    assert times.estimate(["eager"] * 10) == pytest.approx(5.0)
    times.add("capture", 2.0)
    assert times.estimate(["eager", "capture", "capture"]) == pytest.approx(4.5)
    assert times.estimate(["unseen"]) == pytest.approx(2.0)


def test_the_step_line_shows_the_callers_estimate_capped_by_the_budget() -> None:
    now = [0.0]
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    progress = Progress(3, stream=Out(), clock=lambda: now[0],  # type: ignore[arg-type]
                        budget_s=30)
    progress.step("a")
    now[0] = 1.0
    assert progress.step("b", left_s=120.0).endswith("(about 29 s left)")  # the budget caps
    now[0] = 2.0
    assert progress.step("c").endswith("(about 1 s left)")  # the mean, without an estimate
    assert "".join(lines).count("\n") == 3
