"""Progress lines of `attnreg conformance` (issue 21 item 7): claim i of N on stderr with
the elapsed time and an estimate, a notice before a flashinfer JIT compile, nothing on
stdout, off when stderr is not a terminal or with --quiet."""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.commands import conformance as conformance_cmd
from attnreg.registry import get_registry
from attnreg.testing.claims import ClaimKind, expand_claims
from attnreg.testing.progress import ClaimProgress, jit_variant

from ._run import env

pytest.importorskip("torch")

#: Five refusal claims of the reference backend (its dense decode ones): a fast run.
RUN = ["--backend", "reference", "--device", "cpu", "-k", "refusal/decode and not sparse"]
STEP = re.compile(r"^\[ *\d+\.\ds\] (\d) of 5: claim (reference/refusal/decode/\S+)"
                  r"( \(about \d+ s left\))?$", re.M)


def _conformance(tmp_path, *args, stderr=subprocess.PIPE, run=RUN):
    return subprocess.run([sys.executable, "-m", "attnreg", "conformance", *run, *args],
                          cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=stderr,
                          text=True, timeout=300, check=False)


def test_progress_names_each_claim_i_of_n_with_an_estimate_on_stderr_only(tmp_path):
    # the 5 refusals run; the 2 piecewise claims are skipped up front (no graphs on cpu)
    run = [*RUN[:-1], "(refusal/decode and not sparse) or tc_piecewise/piecewise"]
    proc = _conformance(tmp_path, "--progress", "--json", run=run)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # stdout is the report alone
    assert report["summary"]["skipped"] == 2
    steps = STEP.findall(proc.stderr)
    assert [int(i) for i, _, _ in steps] == [1, 2, 3, 4, 5], proc.stderr
    assert not steps[0][2] and all(left for _, _, left in steps[1:])  # an estimate from 2 on
    assert "attnreg conformance: 5 claims to run (2 more listed as skipped)" in proc.stderr
    # pytest's marks (. s) would only interleave with the lines: left out
    assert not re.search(r"^[.sFE]+ *$", proc.stderr, re.M), proc.stderr


class _Stderr:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty,flags,on", [
    (True, [], True), (False, [], False), (False, ["--progress"], True),
    (True, ["-q"], False), (True, ["--quiet", "--progress"], False), (True, ["--list"], False),
])
def test_progress_is_on_for_a_terminal_or_progress_and_off_with_quiet(monkeypatch, tty, flags,
                                                                       on):
    parser = argparse.ArgumentParser()
    conformance_cmd.add_arguments(parser)
    monkeypatch.setattr(sys, "stderr", _Stderr(tty))
    plugins = conformance_cmd._progress_plugins(parser.parse_args(flags))
    assert bool(plugins) is on
    argv = conformance_cmd.pytest_args(parser.parse_args(flags), Path("pytest.ini"),
                                       progress=bool(plugins))
    assert ("console_output_style=classic" in argv) is on


def test_progress_is_on_when_stderr_is_a_terminal(tmp_path):
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "attnreg", "conformance", *RUN],
                            cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=follower,
                            text=True)
    os.close(follower)
    seen = b""
    try:
        while True:  # read as it comes: a full terminal buffer would block the run
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the run closed its side
                break
            if not chunk:
                break
            seen += chunk
        stdout, _ = proc.communicate(timeout=300)
    finally:
        os.close(leader)
    assert proc.returncode == 0, stdout
    text = seen.decode().replace("\r\n", "\n")
    assert len(STEP.findall(text)) == 5, text
    assert not STEP.search(stdout) and "OK: 5 verified" in stdout


class _Lines:
    total = 0

    def __init__(self) -> None:
        self.notes: list[str] = []

    def step(self, what: str, *, left_s: float | None = None) -> str:
        return what

    def note(self, line: str) -> None:
        self.notes.append(line)


def test_a_notice_before_the_first_use_of_each_flashinfer_variant_only():
    reg = get_registry()
    progress = ClaimProgress(_Lines(), registry=reg)
    claims = expand_claims(reg.declaration("flashinfer_mla", "cuda:sm90"), "cuda")
    notices = {c.id: progress.slow_step_notice(c) for c in claims}
    said = {cid: n for cid, n in notices.items() if n}
    variants = {jit_variant(c.combo) for c in claims
                if c.kind in (ClaimKind.EAGER, ClaimKind.CAPTURE) and not c.skip_reason}
    assert len(said) == len(variants) >= 3  # one per variant, never twice
    first = next(n for n in said.values() if "paged MLA bf16/bf16 576x512" in n)
    assert "may JIT-compile" in first and "about 20 s" in first and "cached" in first
    assert any("ragged prefill bf16/bf16 192x128" in n and "100-135 s" in n
               for n in said.values())
    # refusals stop before any kernel; backends without flashinfer compile nothing
    assert not any("/refusal/" in cid for cid in said)
    triton = expand_claims(reg.declaration("triton", "cuda:sm90"), "cuda")
    assert not any(progress.slow_step_notice(c) for c in triton)
