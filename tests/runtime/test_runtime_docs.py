"""docs/runtime.md's ``pycon`` example (a decode engine on the GraphRunner) runs on a cpu
and prints what the page shows (doctest; the Triton kernels run in the interpreter)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
_PYCON = re.compile(r"^```pycon\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def test_the_graph_runner_example_runs_and_prints_what_the_page_shows() -> None:
    text = PAGE.read_text()
    blocks = _PYCON.findall(text)
    assert blocks, "docs/runtime.md lost its runnable GraphRunner example"
    assert any("GraphRunner" in b and ".replay()" in b for b in blocks)
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures: list[str] = []
    for i, block in enumerate(blocks):
        test = parser.get_doctest(block, {}, f"runtime.md[{i}]", str(PAGE), 0)
        runner.run(test, out=failures.append)
    assert runner.failures == 0, "".join(failures)
