"""Server features that constrain graph capture, as declared data.

Each :class:`FeatureRule` names a feature, the (phase, modes) it cannot be
captured under, whether that is HARD or SOFT, and its source.  The rules
follow sglang's ``disable_tc_piecewise_cudagraph_if_incompatible`` and
``disable_breakable_cudagraph_if_incompatible`` lists (server-args
resolution of the cuda-graph config).  Classification: HARD when the source
states how capture fails (a dynamo guard break, a replay size mismatch, a
capture that cannot be built); SOFT when the source lists the combination as
incompatible without a mechanism, or as a performance default ("not
validated": defaults avoid it, a user lock is honoured with a warning).
See docs/policy.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..registry.capabilities import GraphMode, Phase
from .severity import Severity

__all__ = ["FEATURE_HELP", "FEATURE_RULES", "FeatureRule", "ServerFeatures"]

_TC = frozenset({GraphMode.TC_PIECEWISE})
_BCG = frozenset({GraphMode.BREAKABLE})
_SGLANG_TC = "sglang tc_piecewise incompatibility list"
_SGLANG_BCG = "sglang breakable incompatibility list"


@dataclass(frozen=True)
class ServerFeatures:
    """Engine features that are on for this server (all off by default)."""

    lora: bool = False
    dp_attention: bool = False
    pipeline_parallel: bool = False
    speculative_decoding: bool = False
    torch_compile: bool = False
    context_parallel: bool = False
    decode_context_parallel: bool = False
    two_batch_overlap: bool = False
    moe_a2a: bool = False
    hierarchical_cache: bool = False
    deterministic_inference: bool = False
    pd_disaggregation: bool = False
    symmetric_memory: bool = False
    expert_recorder: bool = False
    memory_saver: bool = False

    def enabled(self) -> tuple[str, ...]:
        """Names of the features that are on, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))

    def to_dict(self) -> dict[str, bool]:
        return {f.name: bool(getattr(self, f.name)) for f in fields(self)}


#: One line per feature for CLI help and docs.
FEATURE_HELP: dict[str, str] = {
    "lora": "LoRA adapters are enabled",
    "dp_attention": "data-parallel attention",
    "pipeline_parallel": "pipeline parallelism (pp_size > 1)",
    "speculative_decoding": "speculative decoding (target verify / draft extend batches)",
    "torch_compile": "full torch.compile of the model",
    "context_parallel": "attention context parallelism (cp_size > 1) without breakable support",
    "decode_context_parallel": "decode context parallelism (dcp_size > 1)",
    "two_batch_overlap": "two-batch overlap",
    "moe_a2a": "an MoE all-to-all backend",
    "hierarchical_cache": "CPU offload or hierarchical KV cache",
    "deterministic_inference": "deterministic inference mode",
    "pd_disaggregation": "prefill/decode disaggregation",
    "symmetric_memory": "symmetric memory collectives",
    "expert_recorder": "expert distribution recorder / EPLB",
    "memory_saver": "the memory saver (releasable weights/KV)",
}


@dataclass(frozen=True)
class FeatureRule:
    """``feature`` cannot be captured under ``modes`` of ``phase``."""

    feature: str
    phase: Phase
    modes: frozenset[GraphMode]
    severity: Severity
    reason: str
    source: str

    @property
    def rule_id(self) -> str:
        return f"feature.{self.feature}"


def _tc(feature: str, severity: Severity, reason: str) -> FeatureRule:
    return FeatureRule(feature, Phase.PREFILL, _TC, severity, reason, _SGLANG_TC)


def _bcg(feature: str, severity: Severity, reason: str) -> FeatureRule:
    return FeatureRule(feature, Phase.PREFILL, _BCG, severity, reason, _SGLANG_BCG)


_HARD, _SOFT = Severity.HARD, Severity.SOFT

#: The declared feature rules.  speculative_decoding restricts no mode: its
#: verify/draft batches are never replayed by these graphs (see ReplayGate).
FEATURE_RULES: tuple[FeatureRule, ...] = (
    _tc("lora", _HARD, "dynamo cannot trace LoRA under tc_piecewise: per-batch LoRA batch "
        "info rebinds break its guards (breakable and full capture support LoRA)"),
    _tc("torch_compile", _HARD, "the model is already compiled whole; tc_piecewise compiles "
        "and splits it itself"),
    _bcg("context_parallel", _HARD, "the context-parallel all_gather replays with a size "
         "mismatch under breakable capture"),
    _tc("decode_context_parallel", _HARD, "capture builds a dummy extend forward without "
        "decode-context-parallel metadata"),
    _bcg("decode_context_parallel", _HARD, "capture builds a dummy extend forward without "
         "decode-context-parallel metadata"),
    _bcg("two_batch_overlap", _HARD, "two-batch-overlap capture is unsupported"),
    _bcg("memory_saver", _HARD, "the breakable graph runner rejects the memory saver"),
    _tc("context_parallel", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("dp_attention", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("pipeline_parallel", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _bcg("pipeline_parallel", _SOFT, "opt-in only: capturing every prefill bucket implicitly "
         "includes large buckets that can be slower than eager"),
    _tc("moe_a2a", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("hierarchical_cache", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("deterministic_inference", _SOFT, "listed incompatible with tc_piecewise "
        "(no mechanism given)"),
    _tc("pd_disaggregation", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("symmetric_memory", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
    _tc("expert_recorder", _SOFT, "listed incompatible with tc_piecewise (no mechanism given)"),
)
