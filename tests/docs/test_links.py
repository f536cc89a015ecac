"""Relative links of the user docs point at files and headings that exist."""

from __future__ import annotations

import re

import pytest

from .conftest import DOCS, REPO
from .test_doc_snippets import PAGES

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|````).*?^\1\s*$", re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def test_slug_matches_github():
    assert slug('"My backend\'s claim was refuted"') == "my-backends-claim-was-refuted"
    assert slug("`attnreg compat`") == "attnreg-compat"
    assert slug("7. Prove the declaration") == "7-prove-the-declaration"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    path = DOCS / page
    broken = []
    for target in _LINK.findall(_FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            shown = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
            broken.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert broken == [], f"{page}: " + "; ".join(broken)
