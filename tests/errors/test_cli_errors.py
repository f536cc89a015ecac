"""One error path (issue 28): every wrong invocation the issue lists ends in its documented
exit code and one line on stderr, never a traceback.

In-process ``main(argv)`` wherever the command runs no pytest of its own; subprocesses
only for what needs a real process: stdout on /dev/full, a closed pipe, and the
conformance runs (they start pytest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnreg import cli
from attnreg.cli import EXIT_BAD_INPUT, EXIT_CODES, EXIT_INTERNAL, main
from attnreg.graph_policy.cost_profile import PROFILE_SCHEMA, TERMS

REPO = Path(__file__).resolve().parents[2]
NOWHERE = "/proc/attnreg-nowhere/out.json"  # a directory nobody can make


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), ATTNREG_DISABLE_PLUGIN_AUTOLOAD="1",
               TRITON_INTERPRET="1")
    env.pop("ATTNREG_PLATFORM", None)
    env.update(extra)
    return env


def run_main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *, expected: int = EXIT_BAD_INPUT,
                          naming: str = "") -> None:
    assert code == expected, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert ": error: " in lines[0] if expected == EXIT_BAD_INPUT else True
    assert naming in lines[0], (naming, err)


def valid_profile() -> dict[str, Any]:
    return {"schema": PROFILE_SCHEMA, "schema_version": 1, "backend": "triton",
            "platform": "cuda:sm90", "kv_dtype": "bf16",
            "terms": {t: {"coefficients_us": {"one": 1.0}} for t in TERMS}}


def valid_report() -> dict[str, Any]:
    return {"schema_version": 1,
            "header": {"backends": ["reference"], "device": "cpu", "platform": "cpu",
                       "libraries": {"attnreg": "0.1.0"}},
            "claims": [{"id": "reference/eager/x", "backend": "reference", "status": "verified",
                        "message": "", "duration_s": 0.1}]}


# -- files the user named: -o and inputs -------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["backends", "--platform", "cpu", "-o", "{dir}"],
    ["backends", "--platform", "cpu", "-o", NOWHERE],
    ["compat", "--platform", "cuda:sm90", "-o", "{dir}"],
    ["doctor", "-o", NOWHERE],
    ["calibrate", "--dry-run", "-o", NOWHERE],
    ["calibrate", "--dry-run", "-o", "{dir}"],
    ["conformance", "--merge", "{report}", "-o", "{dir}"],
])
def test_an_output_that_cannot_be_written_is_one_line(capsys, tmp_path, argv) -> None:
    report = tmp_path / "r.json"
    report.write_text(json.dumps(valid_report()))
    argv = [a.format(dir=tmp_path, report=report) for a in argv]
    code, _, err = run_main(capsys, argv)
    named = argv[argv.index("-o") + 1]
    assert_one_line_error(code, err, naming=named.rsplit("/", 1)[0])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_o_is_one_line(capsys) -> None:
    code, _, err = run_main(capsys, ["compat", "--platform", "cuda:sm90", "-o", "/dev/full"])
    assert_one_line_error(code, err, naming="/dev/full: cannot write the JSON there: No space")


def test_o_replaces_the_file_only_once_it_is_whole(capsys, tmp_path, monkeypatch) -> None:
    out = tmp_path / "plan.json"
    out.write_text("what the user had\n")

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    code, _, err = run_main(capsys, ["backends", "--platform", "cpu", "-o", str(out)])
    assert_one_line_error(code, err, naming=str(out))
    assert out.read_text() == "what the user had\n"  # nothing the user had is lost
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left
    monkeypatch.undo()
    assert main(["backends", "--platform", "cpu", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["platform"] == "cpu"


@pytest.mark.parametrize("content, problem", [
    (b'{"schema": "\xff"}', "is not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
    (b"a coefficient of 10**400", "not a finite number"),
    (b"1" * 20_000, "is not valid JSON here"),
    (b"[]", "expected an object, got a list"),
])
def test_a_malformed_cost_profile_is_one_line(capsys, tmp_path, content, problem) -> None:
    path = tmp_path / "profile.json"
    if content == b"a coefficient of 10**400":
        data = valid_profile()
        text = json.dumps(data).replace('"layer_gpu": {"coefficients_us": {"one": 1.0}}',
                                        '"layer_gpu": {"coefficients_us": {"one": 1'
                                        + "0" * 400 + "}}")
        content = text.encode()
    path.write_bytes(content)
    code, _, err = run_main(capsys, ["compat", "--platform", "cuda:sm90",
                                     "--cost-profile", str(path)])
    assert_one_line_error(code, err, naming=f"cost profile {path}")
    assert problem in err


@pytest.mark.parametrize("change, problem", [
    (lambda r: [], "expected an object, got a list"),
    (lambda r: dict(r, header=[]), "at `header`: expected an object"),
    (lambda r: dict(r, header=dict(r["header"], platform=3)), "at `header.platform`"),
    (lambda r: dict(r, header=dict(r["header"], libraries=["torch"])), "at `header.libraries`"),
    (lambda r: dict(r, header=dict(r["header"], backends="reference")), "header.backends"),
    (lambda r: dict(r, header=dict(r["header"], unavailable={"x": 1})), "unavailable.x"),
    (lambda r: dict(r, claims={}), "at `claims`: expected a list"),
    (lambda r: dict(r, claims=[{"id": "x"}]), "at `claims[0].backend`: missing"),
    (lambda r: dict(r, claims=[dict(r["claims"][0], status="passed")]), "claims[0].status"),
    (lambda r: dict(r, claims=[dict(r["claims"][0], duration_s=10 ** 400)]),
     "not a finite number"),
    (lambda r: dict(r, schema_version=2), "schema_version 2 is not 1"),
])
def test_a_malformed_merge_report_is_one_line(capsys, tmp_path, change, problem) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(change(valid_report())))
    code, _, err = run_main(capsys, ["conformance", "--merge", str(path)])
    assert_one_line_error(code, err, naming=f"conformance report {path}")
    assert problem in err


@pytest.mark.parametrize("content", [b"[" * 100_000, b"{\"schema_version\": 1,", b"\xfe\xff"])
def test_a_merge_report_that_is_no_json_is_one_line(capsys, tmp_path, content) -> None:
    path = tmp_path / "report.json"
    path.write_bytes(content)
    code, _, err = run_main(capsys, ["conformance", "--merge", str(path)])
    assert_one_line_error(code, err, naming=str(path))


def test_a_merge_of_a_directory_or_a_missing_file_is_one_line(capsys, tmp_path) -> None:
    code, _, err = run_main(capsys, ["conformance", "--merge", str(tmp_path)])
    assert_one_line_error(code, err, naming=f"{tmp_path}: is a directory")
    code, _, err = run_main(capsys, ["conformance", "--merge", str(tmp_path / "none.json")])
    assert_one_line_error(code, err, naming="none.json: no such file")


# -- environment variables, parsed like the flags they mirror ------------------------------

@pytest.mark.parametrize("command", [["backends"], ["compat"], ["doctor"]])
def test_a_bad_attnreg_platform_is_one_line_like_the_flag(capsys, monkeypatch,
                                                          command) -> None:
    monkeypatch.setenv("ATTNREG_PLATFORM", "bogus")
    code, _, err = run_main(capsys, command)
    assert_one_line_error(code, err, naming="ATTNREG_PLATFORM='bogus'")
    monkeypatch.delenv("ATTNREG_PLATFORM")
    _, _, flag_err = run_main(capsys, [*command, "--platform", "bogus"]) \
        if command != ["doctor"] else (0, "", err)
    # the same reason as the flag's
    assert "unknown platform vendor 'bogus'" in err and "unknown platform vendor" in flag_err


@pytest.mark.parametrize("name, value", [
    ("ATTNREG_SLOW_PLUGIN_SECONDS", "abc"),
    ("ATTNREG_SLOW_PLUGIN_SECONDS", "-1"),
    ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "maybe"),
    ("ATTNREG_TRACE_HOOKS", "sometimes"),
    ("ATTNREG_PLATFORM", "cuda:sm999"),
])
def test_a_bad_environment_value_is_one_line_naming_the_variable(capsys, monkeypatch, name,
                                                                 value) -> None:
    monkeypatch.setenv(name, value)
    code, _, err = run_main(capsys, ["backends"])
    assert_one_line_error(code, err, naming=f"environment variable {name}=")
    assert f"unset {name}" in err  # what to do


def test_a_platform_from_the_environment_is_not_called_detected(capsys, monkeypatch) -> None:
    monkeypatch.setenv("ATTNREG_PLATFORM", "cuda:sm90")
    code, out, _ = run_main(capsys, ["backends"])
    assert code == 0 and out.splitlines()[0].startswith("attention backends on cuda:sm90 "
                                                        "(simulated")
    code, out, _ = run_main(capsys, ["doctor"])
    assert code == 0 and out.splitlines()[0] == "platform (from ATTNREG_PLATFORM): cuda:sm90"


# -- options --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, naming", [
    (["compat", "--platform", "cuda:sm999"], "attnreg knows no cuda architecture 'sm999'"),
    (["compat", "--platform", "cuda:sm" + "9" * 20_000], "cannot parse architecture"),
    (["backends", "--platform", "cuda:sm999"], "give one of cuda:sm80"),
    (["calibrate", "--dry-run", "--heads", "0"], "argument --heads: '0' is not allowed"),
    (["calibrate", "--dry-run", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["calibrate", "--dry-run", "--page-size", "0"], "argument --page-size"),
    (["calibrate", "--dry-run", "--time-budget-s", "nan"], "argument --time-budget-s"),
    (["compat", "--num-heads", "0"], "argument --num-heads"),
    (["backends", "--plugin", "no_such_module"], "--plugin no_such_module: no module named"),
    (["conformance", "--merge", "x.json", "--backend", "reference"], "--merge runs no claims"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    (["backends", "--nosuchoption"], "unrecognized arguments: --nosuchoption"),
])
def test_bad_options_are_one_line(capsys, argv, naming) -> None:
    code, _, err = run_main(capsys, argv)
    assert_one_line_error(code, err, naming=naming)


def test_the_20000_digit_arch_is_named_briefly(capsys) -> None:
    code, _, err = run_main(capsys, ["compat", "--platform", "cuda:sm" + "9" * 20_000])
    assert code == 2 and len(err) < 300


# -- what nobody planned for ----------------------------------------------------------------

def _raise_in_backends(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    from attnreg.commands import backends

    def boom(args: Any) -> int:
        raise exc

    monkeypatch.setattr(backends, "run", boom)


def test_an_unexpected_error_is_an_internal_error_with_its_own_code(capsys,
                                                                    monkeypatch) -> None:
    _raise_in_backends(monkeypatch, RuntimeError("boom"))
    code, _, err = run_main(capsys, ["backends"])
    assert_one_line_error(code, err, expected=EXIT_INTERNAL)
    assert err == ("attnreg backends: internal error: RuntimeError: boom (run with --traceback "
                   "and report it)\n")
    assert EXIT_INTERNAL == 3 and "internal error" in EXIT_CODES[EXIT_INTERNAL]


def test_an_os_error_on_a_file_nobody_named_is_internal(capsys, monkeypatch) -> None:
    _raise_in_backends(monkeypatch, FileNotFoundError(2, "No such file", "/some/internal"))
    code, _, err = run_main(capsys, ["backends"])
    assert code == EXIT_INTERNAL and "internal error: FileNotFoundError" in err


def test_traceback_shows_the_stack(capsys, monkeypatch) -> None:
    _raise_in_backends(monkeypatch, RuntimeError("boom"))
    code, _, err = run_main(capsys, ["backends", "--traceback"])
    assert code == EXIT_INTERNAL
    assert err.startswith("Traceback (most recent call last):") and "RuntimeError: boom" in err
    assert err.strip().splitlines()[-1] == ("attnreg backends: internal error: RuntimeError: "
                                            "boom (report it)")
    code, _, err = run_main(capsys, ["compat", "--platform", "cuda:sm999", "--traceback"])
    assert code == EXIT_BAD_INPUT and "Traceback" in err  # asked for: bad input too


def test_every_command_takes_traceback() -> None:
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # type: ignore
        assert "--traceback" in sub._option_string_actions, name


def test_ctrl_c_is_quiet(capsys, monkeypatch) -> None:
    _raise_in_backends(monkeypatch, KeyboardInterrupt())
    code, _, err = run_main(capsys, ["backends"])
    assert code == 130 and err == "attnreg backends: interrupted\n"


# -- stdout: full disk, closed pipe (real processes) ----------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_disk_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "attnreg", "backends"], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=_env(), timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr,
                          naming="cannot write to stdout: No space left on device")


def test_a_closed_pipe_stays_quiet() -> None:
    # the reader is gone before attnreg writes a byte (`attnreg backends | head -0`): its
    # first write meets EPIPE, every time, however little it prints
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "attnreg", "backends", "--wide"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, env=_env(),
                              timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == ""


# -- conformance (starts pytest: real processes) --------------------------------------------

def _conformance(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnreg", "conformance", *argv],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=_env(), timeout=300)


def test_conformance_plugin_that_does_not_exist_is_one_line(tmp_path) -> None:
    proc = _conformance(tmp_path, "--plugin", "no_such_module", "--list")
    assert_one_line_error(proc.returncode, proc.stderr,
                          naming="--plugin no_such_module: no module named 'no_such_module'")
    assert proc.stdout == ""  # no pytest collection dump


def test_conformance_k_selecting_nothing_exits_2(tmp_path) -> None:
    proc = _conformance(tmp_path, "--backend", "reference", "--device", "cpu", "-k",
                        "zzznomatch", "-q")
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert "-k 'zzznomatch': nothing selected" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_conformance_output_directory_is_refused_before_running(tmp_path) -> None:
    proc = _conformance(tmp_path, "--backend", "reference", "--device", "cpu", "-o",
                        str(tmp_path))
    assert_one_line_error(proc.returncode, proc.stderr, naming="is a directory")
    assert proc.stdout == ""  # nothing ran


def test_conformance_list_says_nothing_ran(tmp_path) -> None:
    proc = _conformance(tmp_path, "--backend", "reference", "--device", "cpu", "--list",
                        "-k", "refusal/decode")
    assert proc.returncode == 0, proc.stderr
    assert "NOTHING VERIFIED" not in proc.stdout
    assert "listed only, nothing ran" in proc.stdout
