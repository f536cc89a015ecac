"""Progress lines of long runs: "i of N", elapsed time, time left; on stderr, on a terminal.

``attnreg.profiling.progress.Progress`` is what ``python -m benchmarks`` (one line
per section) and ``attnreg calibrate`` (one line per measurement) print.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from attnreg.profiling.progress import Progress, format_seconds

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import __main__ as bench_main
from benchmarks._harness import RunContext, Section, run_sections


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_steps_count_and_estimate_from_the_steps_so_far():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(4, stream=out, clock=clock)
    progress.step("first")
    clock.now += 10
    progress.step("second")
    clock.now += 10
    progress.step("third")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[   0.0s] 1 of 4: first"  # nothing ended yet: no estimate
    assert lines[1] == "[  10.0s] 2 of 4: second (about 30 s left)"  # 10 s a step, 3 to go
    assert lines[2] == "[  20.0s] 3 of 4: third (about 20 s left)"


def test_the_estimate_never_exceeds_the_time_budget():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(10, stream=out, clock=clock, budget_s=30)
    progress.step("a")
    clock.now += 20
    progress.step("b")
    assert out.getvalue().splitlines()[1].endswith("(about 10 s left)")


def test_lines_only_on_a_terminal_unless_forced_and_never_when_quiet():
    assert not Progress.for_terminal(3, stream=io.StringIO()).enabled
    assert Progress.for_terminal(3, stream=Terminal()).enabled
    assert Progress.for_terminal(3, stream=io.StringIO(), force=True).enabled
    assert not Progress.for_terminal(3, stream=Terminal(), quiet=True).enabled
    quiet_out = io.StringIO()
    Progress(2, enabled=False, stream=quiet_out).step("x")
    assert quiet_out.getvalue() == ""


def test_format_seconds():
    assert [format_seconds(s) for s in (4.2, 60, 185)] == ["4 s", "1 min", "3 min 5 s"]


@dataclass(frozen=True)
class FakeSection(Section):
    fn: Any = None

    def load(self):  # type: ignore[override]
        return self.fn


def _ok(ctx: RunContext, data: dict) -> None:
    data["ok"] = True


def test_benchmark_sections_print_i_of_n_on_stderr(tmp_path, capsys):
    out = io.StringIO()
    ctx = RunContext(out_dir=tmp_path, dry_run=True, command="test",
                     progress=Progress(0, stream=out))
    run_sections(ctx, [FakeSection("A", "first", "x:y", fn=_ok),
                       FakeSection("B", "second", "x:y", fn=_ok)], set())
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1].split(" (")[0] for line in lines] == [
        "1 of 2: A: first", "2 of 2: B: second"]
    # the section header went to the progress stream, not (again) to stdout
    assert "A: first" not in capsys.readouterr().out


def test_benchmarks_without_a_terminal_keep_their_log_and_print_no_progress(tmp_path, capsys):
    ctx = RunContext(out_dir=tmp_path, dry_run=True, command="test")
    run_sections(ctx, [FakeSection("A", "first", "x:y", fn=_ok)], set())
    captured = capsys.readouterr()
    assert "A: first" in captured.out and "1 of 1" not in captured.out + captured.err


def test_benchmarks_take_quiet_and_progress():
    args = bench_main.build_parser().parse_args(["-q", "--progress"])
    assert args.quiet and args.progress


def test_calibrate_prints_one_progress_line_per_measurement(tmp_path, capsys):
    pytest.importorskip("torch")
    from attnreg.cli import main

    argv = ["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0", "--extends", "4",
            "--layer-tokens", "4", "-o", str(tmp_path / "p.json"), "--json", "--progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["dry_run"] is True  # stdout: the profile alone
    steps = [line for line in captured.err.splitlines() if " of 2: " in line]
    assert [s.split("] ", 1)[1].split(" (")[0] for s in steps] == [
        "1 of 2: layer projections at 4 tokens", "2 of 2: attention at B=1 prefix=0 extend=4"]
