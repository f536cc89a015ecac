"""The conventions every `attnreg` command follows (docs/cli.md, top).

Tables fit 100 columns (``--wide`` keeps long cells whole), ``--json`` puts
one JSON document on stdout, ``-o FILE`` writes it, a closed pipe ends
quietly, and argparse (not a scan of argv) picks the subcommand while
``attnreg compat`` imports no other command's module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.cli import main
from attnreg.commands._common import MAX_WIDTH, table, wrap

#: Commands whose human output is checked for width (cheap ones: no kernels run).
TABLE_COMMANDS = [
    ["backends"],
    ["backends", "--platform", "cuda:sm90"],
    ["backends", "--platform", "cuda:sm100", "--check"],
    ["compat", "--platform", "cuda:sm100", "--model", "kimi-k2.6"],
    ["compat", "--platform", "cuda:sm100", "--model", "kimi-k2.6", "--prefill-graph",
     "tc_piecewise"],
    ["compat", "--platform", "h200", "--model", "deepseek-v4-like", "--speculative-decoding",
     "3"],
    ["doctor"],
]


def _printed(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0, argv
    return capsys.readouterr().out


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > MAX_WIDTH]


def test_every_table_make_demo_prints_fits_100_columns(capsys):
    """`make demo` runs `attnreg demo`: this machine, simulated H200 and B200."""
    out = _printed(capsys, ["demo"])
    assert out.count("attention backends on") == 3 and out.count("graph plan for") == 3
    assert _too_wide(out) == []


@pytest.mark.parametrize("argv", TABLE_COMMANDS, ids=" ".join)
def test_command_tables_fit_100_columns(capsys, argv):
    assert _too_wide(_printed(capsys, argv)) == []


def test_wide_keeps_long_cells_whole(capsys):
    narrow = _printed(capsys, ["backends", "--platform", "cuda:sm90"])
    wide = _printed(capsys, ["backends", "--platform", "cuda:sm90", "--wide"])
    reason = "trtllm-gen MLA kernels are Blackwell-only (sm100/sm103); this is cuda:sm90"
    assert reason not in narrow and reason in wide
    assert _too_wide(wide)  # the summary of each backend on one line
    # narrow: the unavailable reason wraps under its column, one capture mode per line
    row = next(line for line in narrow.splitlines() if line.startswith("flashinfer_mla "))
    assert row.rstrip().endswith("decode:mla")
    # a long method list breaks at a space or after a "/", never inside a method name
    assert "mha_chunked_kv" in narrow and "mha_\n" not in narrow


def test_long_decisions_wrap_under_their_text(capsys):
    out = _printed(capsys, ["compat", "--platform", "cuda:sm100", "--model", "kimi-k2.6"])
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  5. "))
    assert lines[first + 1].startswith("     ") and not lines[first + 1].startswith("      ")
    wide = _printed(capsys, ["compat", "--platform", "cuda:sm100", "--model", "kimi-k2.6",
                             "--wide"])
    assert any(line.startswith("  5. ") and "running eagerly" in line
               for line in wide.splitlines())


@pytest.mark.parametrize("argv", [["backends", "--platform", "cpu"], ["doctor"],
                                  ["compat", "--platform", "cuda:sm90"],
                                  ["demo", "--platform", "h200"]], ids=" ".join)
def test_json_is_one_document_on_stdout_and_output_writes_it(capsys, tmp_path, argv):
    target = tmp_path / "sub" / "out.json"
    assert main([*argv, "--json", "-o", str(target)]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert json.loads(target.read_text()) == printed
    assert f"JSON written to {target}" in captured.err
    # -o alone keeps the table on stdout
    assert main([*argv, "--output", str(target)]) == 0
    assert not capsys.readouterr().out.lstrip().startswith("{")


def test_demo_json_holds_each_platforms_backends_and_plan(capsys):
    data = json.loads(_printed(capsys, ["demo", "--json"]))
    assert [r["platform"] for r in data["reports"]] == ["detect", "h200", "b200"]
    h200 = data["reports"][1]
    assert h200["backends"]["platform"] == "cuda:sm90" and h200["backends"]["simulated"]
    assert h200["plan"]["phases"]["prefill"]["backend"] == "flashinfer_mla"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["ATTNREG_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


@pytest.mark.parametrize("argv", [["doctor", "--json"], ["demo"],
                                  ["backends", "--platform", "cuda:sm100"]], ids=" ".join)
def test_a_closed_pipe_ends_quietly_with_exit_0(argv):
    """`attnreg doctor --json | head`: the reader is gone before the first write."""
    proc = subprocess.Popen([sys.executable, "-m", "attnreg", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `head` exiting; the child has not started writing yet
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def _modules_after(argv: list[str]) -> list[str]:
    code = ("import sys, runpy\n"
            f"sys.argv = ['attnreg', *{argv!r}]\n"
            "try:\n    runpy.run_module('attnreg', run_name='__main__', alter_sys=True)\n"
            "except SystemExit:\n    pass\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('attnreg.commands')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=120, check=True)
    return [line for line in proc.stdout.splitlines() if line.startswith("attnreg.commands")]


def test_compat_imports_no_other_command_module():
    """Start-up (P5): the choosing parser knows the names only, not the options."""
    loaded = _modules_after(["compat", "--platform", "cuda:sm90", "--json"])
    assert sorted(loaded) == ["attnreg.commands", "attnreg.commands._common",
                              "attnreg.commands.compat"]


def test_the_subcommand_is_the_one_argparse_finds(capsys):
    # an option value that is another command's name does not choose that command
    assert main(["backends", "--disable", "demo", "--platform", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["platform"] == "cpu"
    with pytest.raises(SystemExit) as exc:
        main(["compat", "--help"])
    assert exc.value.code == 0 and "--prefill-graph" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert main([]) == 2  # no command: the overview, exit 2


def test_demo_does_not_import_the_cli_root():
    proc = subprocess.run([sys.executable, "-c", "import sys, attnreg.commands.demo; "
                           "print('attnreg.cli' in sys.modules)"], capture_output=True,
                          text=True, env=_env(), timeout=120, check=True)
    assert proc.stdout.strip() == "False"


def test_wrap_breaks_at_spaces_then_punctuation():
    assert wrap("aaa bbb ccc", 7) == ["aaa bbb", "ccc"]
    assert wrap("attnreg.backends.reference:ReferenceBackend", 20, "  ") == [
        "attnreg.backends.", "  reference:", "  ReferenceBackend"]
    assert wrap("  1. one two three", 12, "     ") == ["  1. one two", "     three"]
    assert wrap("x" * 30, None) == ["x" * 30]


def test_table_wraps_only_the_named_columns_to_fit():
    rows = [["a", "word " * 20], ["b", "short"]]
    text = table(["key", "long"], rows, wrap_columns=("long",), width=40)
    assert max(len(line) for line in text.splitlines()) <= 40
    assert text.splitlines()[2].startswith("a    word word")
    assert len(table(["key", "long"], rows, width=40).splitlines()[2]) > 40  # not named: whole


def test_calibrate_output_option_and_the_old_out_spelling(tmp_path: Path, capsys):
    """`-o` is the convention; `--out` (earlier docs) still works as argparse's abbreviation."""
    pytest.importorskip("torch")
    tiny = ["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0", "--extends", "4",
            "--layer-tokens", "4", "-q"]
    assert main([*tiny, "-o", str(tmp_path / "a.json")]) == 0
    assert main([*tiny, "--out", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "a.json").exists() and (tmp_path / "b.json").exists()
    assert capsys.readouterr().err == ""  # -q: no progress lines
