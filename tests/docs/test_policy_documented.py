"""Every rule id the graph policy can emit is explained in docs/policy.md.

The ids come from ``attnreg.graph_policy.RULES``, the single source of truth
(``tests/policy/test_rule_ids.py`` checks that the code emits exactly those
ids).  A new rule therefore fails this test until docs/policy.md mentions it;
the rule tables there are generated from RULES by ``scripts/build_docs.py``.
"""

from __future__ import annotations

import pytest

from attnreg.graph_policy import RULES

from .conftest import DOCS

POLICY_PAGE = DOCS / "policy.md"
RULE_IDS = list(RULES)


def test_rule_ids_are_found():
    # Guards the parametrised test against silently checking nothing: these
    # ids are named in DESIGN.md / the seeds.
    assert {"gate.mha_companion_prefix", "backend.capture_unsupported",
            "backend.high_cost_fallback"} <= set(RULE_IDS), RULE_IDS


@pytest.mark.parametrize("rule", RULE_IDS)
def test_rule_id_is_explained_in_policy_page(rule):
    text = POLICY_PAGE.read_text()
    assert f"`{rule}`" in text, (f"docs/policy.md does not mention rule id `{rule}`: run "
                                 "`python scripts/build_docs.py` to regenerate its rule tables")
