"""Generated documentation is current: regenerate it and compare.

Each test names the command that fixes it.  The generators live in
``scripts/``; see their docstrings for the marker syntax.
"""

from __future__ import annotations

import re

import pytest

from attnreg.cli import COMMANDS

from .conftest import DOCS, REPO

FIX = "run `python scripts/build_docs.py` and commit the result"


def _stale_labels(build_docs, kind: str) -> list[str]:
    return [block.label for block, _ in build_docs.stale_blocks((kind,))]


def test_capability_reference_is_current(capability_reference):
    committed = (DOCS / "capabilities.md").read_text()
    assert committed == capability_reference.render(), (
        "docs/capabilities.md is stale: run `python scripts/gen_capability_reference.py`")


def test_capability_reference_covers_every_builtin_backend_and_platform(capability_reference):
    text = (DOCS / "capabilities.md").read_text()
    names = [spec.name for spec in capability_reference.builtin_specs()]
    assert len(names) == 5
    for name in names:
        assert f"\n## {name}\n" in text
        # Every platform is rendered for every backend, alone or merged with others.
        sections = re.findall(rf"^### {name} on (.+)$", text, flags=re.MULTILINE)
        covered = {p.strip("` ") for line in sections for p in line.split(",")}
        assert covered == set(capability_reference.PLATFORMS), (name, covered)


def test_capability_reference_does_not_depend_on_the_environment(capability_reference,
                                                                  monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain = capability_reference.render()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATTNREG_DISABLE", "trtllm_mla")
    assert capability_reference.render() == plain


def test_tutorial_code_is_the_example_package(build_docs):
    """Every embedded file (the tutorial's code, the hook example) equals the file."""
    blocks = list(build_docs.iter_blocks(("embed",)))
    embedded = {b.arg for b in blocks if b.page.name == "tutorial.md"}
    example_files = {
        str(p.relative_to(REPO)) for p in (REPO / "examples" / "attnreg-example-backend").rglob("*")
        if p.suffix in (".py", ".toml") and p.name != "__init__.py"
        and "egg-info" not in str(p) and "build" not in p.parts
    }
    assert example_files <= embedded, f"not in docs/tutorial.md: {example_files - embedded}"
    assert _stale_labels(build_docs, "embed") == [], FIX


def test_cli_usage_sections_are_current(build_docs):
    assert _stale_labels(build_docs, "cli") == [], FIX


def test_every_subcommand_has_a_cli_section():
    text = (DOCS / "cli.md").read_text()
    missing = [name for name in COMMANDS
               if f"<!-- cli: {name} -->" not in text or f"## `attnreg {name}`" not in text]
    assert missing == [], f"docs/cli.md has no section for: {missing}"


def test_command_outputs_shown_in_the_docs_are_current(build_docs):
    """Every ``output`` block is what the command prints today (real runs)."""
    assert _stale_labels(build_docs, "output") == [], FIX


def test_a_changed_output_is_detected(build_docs, tmp_path):
    """The staleness check itself can fail: a doctored block is reported."""
    page = tmp_path / "page.md"
    page.write_text("<!-- output: attnreg backends --platform cpu -->\n```text\nold\n```\n"
                    "<!-- /output -->\n<!-- embed: README.md -->\nnot the readme\n"
                    "<!-- /embed -->\n")
    stale = build_docs.stale_blocks(pages=[page])
    assert [b.kind for b, _ in stale] == ["output", "embed"]
    build_docs.rewrite(pages=[page], log=lambda _: None)
    assert build_docs.stale_blocks(pages=[page]) == []
    assert "reference" in page.read_text()


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_block_markers_are_balanced(build_docs, page):
    text = (DOCS / page).read_text()
    opened = re.findall(r"<!-- (embed|cli|table|output(?:\[[a-z]+\])?): ", text)
    assert len(build_docs.find_blocks(DOCS / page)) == len(opened), (
        f"{page}: a marker is not closed by its <!-- /kind --> line")


def test_every_conformance_check_is_explained_in_troubleshooting():
    """The refutation table names every check the suite can report (from the code)."""
    from attnreg.testing.claims import Check

    text = (DOCS / "troubleshooting.md").read_text()
    table = text[text.index("| check | usually means |"):]
    missing = [c.value for c in Check if f"`{c.value}`" not in table]
    assert missing == [], f"docs/troubleshooting.md: explain the checks {missing}"
