"""What runs without sglang: the name mappings, the switch, and the import boundary.

These run in `make test` too (no sglang there).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from attnreg.integrations.sglang import ENV_SWITCH, plugin
from attnreg.integrations.sglang.decisions import BridgeDecision
from attnreg.integrations.sglang.names import (
    MAPPED_BACKENDS,
    graph_mode_from_sglang,
    graph_mode_to_sglang,
    kv_dtype_from_sglang,
    map_backend,
)
from attnreg.registry import get_registry
from attnreg.registry.capabilities import DType, GraphMode

SRC = Path(__file__).resolve().parents[3] / "src" / "attnreg"


def test_every_mapped_backend_is_registered_in_attnreg() -> None:
    names = set(get_registry().names())
    assert set(MAPPED_BACKENDS.values()) <= names


@pytest.mark.parametrize(("sglang", "attnreg", "exact"), [
    ("trtllm_mla", "trtllm_mla", False), ("flashinfer", "flashinfer_mla", False),
    ("triton", "triton", False), ("fa4", "flash_attn_cute", False),
    ("attnreg_triton", "triton", True), ("fa3", None, False), ("flashmla", None, False),
    ("something_new", None, False), (None, None, False)])
def test_map_backend(sglang: str | None, attnreg: str | None, exact: bool) -> None:
    mapping = map_backend(sglang)
    assert (mapping.attnreg, mapping.exact) == (attnreg, exact)
    assert mapping.reason  # mapped or not, the decision says why


def test_graph_modes_round_trip() -> None:
    for text in ("disabled", "full", "breakable", "tc_piecewise"):
        assert graph_mode_to_sglang(graph_mode_from_sglang(text)) == text
    with pytest.raises(ValueError, match="unknown sglang cuda-graph backend"):
        graph_mode_from_sglang("piecewise")


def test_kv_dtypes() -> None:
    assert kv_dtype_from_sglang("auto", DType.BF16) is DType.BF16
    assert kv_dtype_from_sglang("fp8_e4m3", DType.BF16) is DType.FP8_E4M3
    assert kv_dtype_from_sglang("fp8_e5m2", DType.BF16) is None
    assert kv_dtype_from_sglang("fp4_e2m1", DType.BF16) is None


def test_bridge_decisions_refuse_unknown_ids() -> None:
    assert BridgeDecision("sglang.engine_rule:x", None, None, None, "m").rule
    with pytest.raises(ValueError, match="unknown bridge rule id"):
        BridgeDecision("sglang.made_up", None, None, None, "m")
    d = BridgeDecision("sglang.declared", None, GraphMode.BREAKABLE, GraphMode.DISABLED, "m")
    assert d.changed and "breakable -> disabled" in d.describe()


def test_register_does_nothing_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("", "0", "false"):
        monkeypatch.setenv(ENV_SWITCH, value)
        assert not plugin.enabled()
        plugin.register()  # imports no sglang, registers nothing
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert plugin.enabled()


def test_plugin_module_imports_no_sglang_or_torch() -> None:
    tree = ast.parse((SRC / "integrations" / "sglang" / "plugin.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("sglang", "torch"))]


def test_nothing_in_core_imports_the_integrations() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        if "integrations" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and "integrations" in (node.module or ""):
                offenders.append(str(path.relative_to(SRC)))
            if isinstance(node, ast.Import) and any("integrations" in a.name
                                                    for a in node.names):
                offenders.append(str(path.relative_to(SRC)))
    assert offenders == []
    assert "sglang" not in sys.modules or "attnreg.integrations.sglang.steps" in sys.modules


DOC = SRC.parents[1] / "docs" / "integrations" / "sglang.md"


def test_doc_lists_every_bridge_rule_and_backend_name() -> None:
    from attnreg.integrations.sglang.decisions import BRIDGE_RULES
    from attnreg.integrations.sglang.names import UNMAPPED_BACKENDS

    text = DOC.read_text()
    missing = [f"`{rule}`" for rule in BRIDGE_RULES if f"`{rule}`" not in text]
    missing += [f"`{name}`" for name in (*MAPPED_BACKENDS, *MAPPED_BACKENDS.values(),
                                         *UNMAPPED_BACKENDS) if f"`{name}`" not in text]
    assert missing == [], f"docs/integrations/sglang.md does not name {missing}"
    assert f"`{ENV_SWITCH}`" in text


@pytest.mark.parametrize("name", ["dsa", "nsa"])
def test_sglang_dsa_backends_are_a_gap_that_says_why(name: str) -> None:
    # sglang's dsa runs its --dsa-*-backend kernels; attnreg declares sparse MLA, but no
    # backend of sglang's (docs/integrations/sglang.md, docs/sparse.md)
    mapping = map_backend(name)
    assert not mapping.mapped
    assert "--dsa-decode-backend" in mapping.reason and "no attnreg backend declares" \
        in mapping.reason


def test_the_sglang_facts_carry_the_dsa_top_k() -> None:
    from types import SimpleNamespace

    pytest.importorskip("sglang", reason="the facts module reads sglang's config types")
    from attnreg.integrations.sglang.facts import _index_topk

    assert _index_topk(SimpleNamespace(index_topk=2048)) == 2048
    assert _index_topk(SimpleNamespace(text_config=SimpleNamespace(index_topk=512))) == 512
    assert _index_topk(SimpleNamespace()) is None
