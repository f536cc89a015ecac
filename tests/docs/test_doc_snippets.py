"""The ``>>>`` examples of the user docs run and print what the docs say (doctest).

Shell commands and their outputs are checked by test_generated_docs.py
(``output`` blocks); Python examples are written as ``pycon`` blocks with
``>>>`` prompts, so doctest can run them and compare the printed results.
"""

from __future__ import annotations

import doctest
import re

import pytest

from .conftest import DOCS

#: The pages of this docs set (others own runtime.md, policy.md, conformance.md).
PAGES = ("index.md", "quickstart.md", "concepts.md", "hooks.md", "cli.md",
         "troubleshooting.md", "tutorial.md")
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_PYCON = re.compile(r"^```pycon\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def pycon_only(text: str) -> str:
    """The page with every line outside ```pycon blocks blanked (line numbers kept)."""
    keep = [False] * (text.count("\n") + 1)
    for m in _PYCON.finditer(text):
        first = text.count("\n", 0, m.start(1))
        for i in range(first, first + m.group(1).count("\n")):
            keep[i] = True
    return "\n".join(line if keep[i] else "" for i, line in enumerate(text.split("\n")))


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run_and_print_what_the_page_shows(page):
    path = DOCS / page
    test = doctest.DocTestParser().get_doctest(pycon_only(path.read_text()), {}, page,
                                               str(path), 0)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    failures: list[str] = []
    runner.run(test, out=failures.append)
    assert runner.failures == 0, "".join(failures)


def test_examples_exist():
    """At least the concepts and hooks pages carry runnable examples."""
    counts = {page: len(doctest.DocTestParser().get_examples(pycon_only((DOCS / page).read_text())))
              for page in ("concepts.md", "hooks.md")}
    assert all(n >= 3 for n in counts.values()), counts
