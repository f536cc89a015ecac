"""Synthetic cost profiles and simulated plans for the cost-model tests (no device)."""

from __future__ import annotations

import copy
from typing import Any

from attnreg.graph_policy import GraphConfig, GraphPlan, ModelFacts, ReplayBatch, resolve
from attnreg.graph_policy.cost_profile import PROFILE_SCHEMA, TERMS, CostProfile
from attnreg.registry import ForwardMode

#: Library versions the simulated plans are evaluated with (the machine's do not matter).
VERSIONS: dict[str, str | None] = {"flashinfer-python": "0.6.13", "flash-attn-4": "4.0.0b36",
                                   "torch": "2.13.0", "triton": "3.9.0"}
HEADS = 128
TEXT_MLA = ModelFacts(attention="mla", kv_dtype="bf16", num_heads=HEADS, label="text-mla")

#: Graph cost per head-pair (us): the absorbed form's FLOPs are ~3x the MHA form's.
ABSORBED_PER_HEAD_PAIR = 1e-6
MHA_PER_HEAD_PAIR = 3e-7
#: Host time of one eager layer (us): what the graph saves on short batches.
EAGER_HOST_US = 100.0


def profile_dict(backend: str = "triton", platform: str = "cuda:sm90", kv_dtype: str = "bf16",
                 **coefficients: dict[str, float]) -> dict[str, Any]:
    """A valid profile: absorbed / MHA attention proportional to head-pairs, a constant
    eager host cost, every other term zero; ``coefficients`` replaces whole terms."""
    terms: dict[str, dict[str, float]] = {t: {"one": 0.0} for t in TERMS}
    terms["absorbed_attention"] = {"head_pairs": ABSORBED_PER_HEAD_PAIR}
    terms["mha_attention"] = {"head_pairs": MHA_PER_HEAD_PAIR}
    terms["eager_host"] = {"one": EAGER_HOST_US}
    terms.update(coefficients)
    return {"schema": PROFILE_SCHEMA, "schema_version": 1, "backend": backend,
            "platform": platform, "kv_dtype": kv_dtype, "device": "synthetic",
            "created": "2025-01-01T00:00:00+00:00",
            "calibration": {"heads": HEADS},
            "terms": {t: {"coefficients_us": dict(c)} for t, c in terms.items()}}


def profile(**kwargs: Any) -> CostProfile:
    return CostProfile.from_dict(profile_dict(**kwargs), source="<synthetic>")


def mutated(change: Any) -> dict[str, Any]:
    """A deep copy of the default profile dict after ``change(data)``."""
    data = copy.deepcopy(profile_dict())
    change(data)
    return data


def sim(backend: Any = "triton", model: ModelFacts = TEXT_MLA, platform: str = "cuda:sm90",
        config: GraphConfig | None = None) -> GraphPlan:
    """A plan resolved on a simulated platform, as `attnreg compat --platform` does."""
    return resolve(platform, model, backend, config, assume_installed=True, versions=VERSIONS)


def prefill(prefix: int, extend: int, batch_size: int = 1, **kwargs: Any) -> ReplayBatch:
    """``batch_size`` requests of ``extend`` new tokens after ``prefix`` cached ones."""
    return ReplayBatch(ForwardMode.EXTEND, batch_size, num_tokens=extend * batch_size,
                       prefix_lens=(prefix,) * batch_size, extend_lens=(extend,) * batch_size,
                       **kwargs)
