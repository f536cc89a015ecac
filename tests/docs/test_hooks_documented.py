"""Every hookspec is documented in docs/hooks.md and called by a test (datasette's rule).

The hook list comes from ``attnreg.registry.hookspecs`` itself, so adding a
hook without a doc section and a test fails here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

from attnreg.registry import hookspecs

from .conftest import DOCS, REPO

HOOKS_PAGE = DOCS / "hooks.md"
SPEC_MARKER = f"{hookspecs.PROJECT_NAME}_spec"  # pluggy's attribute on a hookspec


def _hookspecs() -> dict[str, Callable[..., Any]]:
    return {name: obj for name, obj in vars(hookspecs).items()
            if callable(obj) and hasattr(obj, SPEC_MARKER)}


def _annotation(value: Any) -> str:
    # hookspecs uses `from __future__ import annotations`: annotations are strings.
    return value if isinstance(value, str) else inspect.formatannotation(value)


def signature_text(name: str, fn: Callable[..., Any]) -> str:
    """``name(arg: Type, ...) -> Return``, exactly as written in hookspecs.py."""
    sig = inspect.signature(fn)
    params = ", ".join(
        p.name if p.annotation is inspect.Parameter.empty
        else f"{p.name}: {_annotation(p.annotation)}" for p in sig.parameters.values())
    ret = "" if sig.return_annotation is inspect.Signature.empty \
        else f" -> {_annotation(sig.return_annotation)}"
    return f"{name}({params}){ret}"


def _section(text: str, heading: str) -> str:
    """The text after ``heading`` up to the next heading of the same or a higher level."""
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    rest = text[start + len(heading):]
    m = re.search(rf"^#{{1,{level}}} ", rest, flags=re.MULTILINE)
    return rest[: m.start()] if m else rest


HOOKS = _hookspecs()


def test_hookspecs_are_found():
    # Guards the tests below against silently checking nothing.
    assert "attnreg_register_backends" in HOOKS


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_has_a_heading_with_its_exact_signature(name):
    heading = f"### `{signature_text(name, HOOKS[name])}`"
    assert heading in HOOKS_PAGE.read_text().splitlines(), (
        f"docs/hooks.md needs the heading:\n{heading}")


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_section_documents_every_argument_and_the_return(name):
    text = HOOKS_PAGE.read_text()
    section = _section(text, f"### `{signature_text(name, HOOKS[name])}`")
    for param in inspect.signature(HOOKS[name]).parameters:
        assert re.search(rf"^- `{param}`: ", section, flags=re.MULTILINE), (
            f"docs/hooks.md, {name}: document argument `{param}` as a '- `{param}`: ...' item")
    assert "Returns:" in section, f"docs/hooks.md, {name}: say what the hook returns"
    assert "firstresult" in section, f"docs/hooks.md, {name}: say whether it is firstresult"
    assert "```python" in section or "<!-- embed:" in section, (
        f"docs/hooks.md, {name}: give an example")


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_called_by_a_test(name):
    """Some test module outside tests/docs names the hook (calls it or checks it ran)."""
    users = [p for p in (REPO / "tests").rglob("test_*.py")
             if "docs" not in p.relative_to(REPO / "tests").parts and name in p.read_text()]
    assert users, f"no test under tests/ mentions {name}: add one that exercises the hook"


def test_signature_text_matches_the_source():
    """The expected heading is the signature as written, not a re-rendering of it."""
    src = inspect.getsource(hookspecs)
    for name, fn in HOOKS.items():
        text = signature_text(name, fn)
        assert f"def {text}:" in src, text
