"""A DeepSeek-V3.2 (DSA) server through sglang 0.5.23's real argument resolution, with
attnreg's plugin on: the model's facts say sparse with top-k 2048, and the server's
``dsa`` backend is a gap that says why (no attnreg declaration describes the sparse
kernels sglang runs), so sglang's own rules decide (docs/integrations/sglang.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from attnreg.integrations.sglang.steps import outcome_of  # noqa: E402

from . import _sglang_env  # noqa: E402

#: DeepSeek-V3.2's config.json fields that make it DSA (the indexer), over DeepSeek-V3's.
_DEEPSEEK_V32 = {**_sglang_env.MODELS["deepseek-v3"],
                 "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                 "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("models") / "deepseek-v3.2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_DEEPSEEK_V32, indent=1))
    return {"deepseek-v3.2": path}


def test_a_dsa_server_is_a_gap_with_the_reason(plugin_on: None, v32: dict[str, Path]) -> None:
    scenario = _sglang_env.Scenario("dsv32_h200", "deepseek-v3.2", 90)
    result = _sglang_env.run_scenario(scenario, v32)
    assert "error" not in result, result
    assert "dsa" in result["backends"] or "nsa" in result["backends"], result["backends"]
    outcome = outcome_of(result["server_args"])
    assert outcome is not None and outcome.plan is None and not outcome.decided
    model = outcome.facts.model
    assert model is not None and model.sparse_top_k == 2048 and model.dsa_sparse
    gaps = [d for d in outcome.bridge if d.rule == "sglang.gap"]
    assert any("no attnreg backend declares those sparse kernels" in d.message for d in gaps), \
        [d.message for d in gaps]
