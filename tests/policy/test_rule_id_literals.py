"""Every rule id written anywhere in attnreg's source is registered in RULES.

``test_rule_ids.py`` scans ``graph_policy`` for the emitters; ids are also used
outside it (the graph session counts a data-parallel override under
``runtime.SYNC_EAGER``).  Here every string literal of ``src/attnreg`` that has
the form of an id in one of the registered namespaces must be a RULES entry,
and every entry that no graph_policy emitter writes is used somewhere else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from attnreg import graph_policy
from attnreg.graph_policy import RULES

SRC = Path(graph_policy.__file__).parent.parent
#: The namespaces of the registered ids (``gate``, ``backend``, ``sync`` ...).
NAMESPACES = sorted({rule.split(".", 1)[0] for rule in RULES})
_LITERAL = re.compile(rf"^(?:{'|'.join(NAMESPACES)})\.[a-z_][a-z_0-9]*$")


def rule_id_literals() -> dict[str, list[str]]:
    """String constants of ``src/attnreg`` shaped like a registered-namespace rule id."""
    out: dict[str, list[str]] = {}
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, files  # the whole package is scanned
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and _LITERAL.match(node.value):
                where = f"{path.relative_to(SRC)}:{node.lineno}"
                out.setdefault(node.value, []).append(where)
    return out


def test_the_scan_reaches_outside_graph_policy() -> None:
    found = rule_id_literals()
    assert "runtime/session_types.py:28" in found.get("sync.other_rank_eager", []), found
    assert {"gate.ok", "backend.selected"} <= set(found)


def test_every_rule_id_literal_in_the_source_is_registered() -> None:
    unknown = {rule: where for rule, where in rule_id_literals().items() if rule not in RULES}
    assert unknown == {}, (f"rule ids used in src/attnreg but missing from RULES "
                           f"(graph_policy/rule_ids.py): {unknown}")


def test_the_sync_rule_is_the_session_count_key() -> None:
    from attnreg.runtime import SYNC_EAGER

    info = RULES[SYNC_EAGER]
    assert info.kind == "sync" and info.description
    assert [r.id for r in RULES.values() if r.kind == "sync"] == [SYNC_EAGER]
