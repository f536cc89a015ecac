"""Every rule id the graph policy can emit is explained in docs/policy.md.

The ids come from the code, not from a list kept here: the registries the
policy package exports (``GATE_RULES``, ``FEATURE_RULES``, and ``RULES`` /
``RULE_IDS`` when present), plus every literal id passed to ``Decision``,
``Violation`` or ``ReplayReason`` anywhere in ``attnreg.graph_policy``.  A new
rule therefore fails this test until it is documented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from attnreg import graph_policy

from .conftest import DOCS

POLICY_PAGE = DOCS / "policy.md"
_RULE_CLASSES = {"Decision", "Violation", "ReplayReason"}
_RULE_ID = re.compile(r"^[a-z_]+(\.[a-z_0-9]+)+$")
#: Errors that carry a rule id write it first: "backend.model_unsupported: ...".
_PREFIXED_ID = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+): ")


def _string_constants(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _literal_rule_ids() -> set[str]:
    """Ids given to Decision/Violation/ReplayReason, and ids that prefix an error message."""
    ids: set[str] = set()
    for path in Path(graph_policy.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.JoinedStr) and node.values:
                first = node.values[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    m = _PREFIXED_ID.match(first.value)
                    if m:
                        ids.add(m.group(1))
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else ""
            if name not in _RULE_CLASSES:
                continue
            # The id argument may be a conditional expression of two literal ids.
            candidates = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "rule"]
            for arg in candidates:
                ids.update(v for v in _string_constants(arg) if _RULE_ID.match(v))
    return ids


def policy_rule_ids() -> set[str]:
    ids = set(graph_policy.GATE_RULES)
    ids |= {rule.rule_id for rule in graph_policy.FEATURE_RULES}
    for registry_name in ("RULES", "RULE_IDS"):
        registry = getattr(graph_policy, registry_name, None)
        if registry is not None:
            ids |= {getattr(r, "rule_id", getattr(r, "id", r)) for r in registry}
    return ids | _literal_rule_ids()


RULE_IDS = sorted(policy_rule_ids())


def test_rule_ids_are_found():
    # Guards the parametrised test against silently checking nothing: these
    # ids are named in DESIGN.md / the seeds and exist in the code.
    assert {"gate.mha_companion_prefix", "backend.capture_unsupported",
            "backend.high_cost_fallback"} <= set(RULE_IDS), RULE_IDS


@pytest.mark.parametrize("rule", RULE_IDS)
def test_rule_id_is_explained_in_policy_page(rule):
    assert POLICY_PAGE.exists(), "docs/policy.md does not exist yet"
    text = POLICY_PAGE.read_text()
    assert f"`{rule}`" in text, f"docs/policy.md does not mention rule id `{rule}`"
