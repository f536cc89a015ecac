"""Docs and committed results name no machine paths: a reader gets a command they can
run, not a file that existed on the machine that measured it.  An output directory
(``--out /tmp/x``: anyone can write there) and a standard tool are the exceptions."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import DOCS, REPO

#: an absolute path under a directory that differs from machine to machine
ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:work|home|root|tmp|Users|opt|mnt|var|usr|srv|data)"
                      r"/[^\s\"'`)\];,]*")
#: a Windows path from a drive root (``C:\\Users\\me``, ``D:/runs``; JSON doubles the
#: backslashes): every such path is the measuring machine's
WINDOWS = re.compile(r"(?<![\w.~-])[A-Za-z]:(?:\\{1,2}|/)[^\s\"'`)\];,]+")
#: what may stand before or as such a path
ALLOWED_BEFORE = ("--out ", "--out=")
ALLOWED = {"/usr/bin/time"}


def _published() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "benchmarks").glob("*.md"))]
    for where in (DOCS, REPO / "benchmarks" / "results"):
        files += [*sorted(where.rglob("*.md")), *sorted(where.rglob("*.json"))]
    return [f for f in files if f.is_file()]


def machine_paths(text: str) -> list[str]:
    """The absolute machine paths in ``text`` that are neither an output directory nor a
    standard tool."""
    found = []
    for m in [*ABSOLUTE.finditer(text), *WINDOWS.finditer(text)]:
        before = text[max(0, m.start() - 6):m.start()]
        path = m.group().rstrip(".:")
        if path in ALLOWED or before.endswith(ALLOWED_BEFORE):
            continue
        found.append(path)
    return found


def test_the_check_finds_a_machine_path_and_keeps_an_output_directory():
    assert machine_paths("--profile /tmp/h200-cost/p.json") == ["/tmp/h200-cost/p.json"]
    assert machine_paths('"source": "/work/main/src/attnreg"') == ["/work/main/src/attnreg"]
    assert machine_paths("run `--out /tmp/p5` and /usr/bin/time; src/x/tmp/y") == []


def test_the_check_finds_a_windows_path_and_leaves_urls_and_ratios():
    assert machine_paths(r"profile at C:\Users\me\p.json") == [r"C:\Users\me\p.json"]
    assert machine_paths('"out": "D:\\\\runs\\\\h200"') == ["D:\\\\runs\\\\h200"]
    assert machine_paths("see E:/bench/out.json") == ["E:/bench/out.json"]
    assert machine_paths("https://docs.nvidia.com/x, sm90:/a, ratio 1:2, --out D:/runs/p") == []


def test_published_docs_and_results_name_no_machine_path():
    bad = {str(f.relative_to(REPO)): hits for f in _published()
           if (hits := machine_paths(f.read_text(encoding="utf-8", errors="replace")))}
    assert not bad, ("give the command anyone can run (a path in the repository, or one "
                     f"the reader makes), not this machine's: {bad}")
