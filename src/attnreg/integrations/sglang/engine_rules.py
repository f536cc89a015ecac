"""sglang's breakable-prefill rules that attnreg has no fact for, kept as engine rules.

sglang 0.5.23's ``disable_breakable_cudagraph_if_incompatible`` disables a
default breakable prefill graph for seven reasons.  Three are facts attnreg
models as server features (context parallelism without the breakable CP
path, decode context parallelism, two-batch overlap); ``pp_size > 1`` in
``apply_cuda_graph_compatibility`` is the feature ``pipeline_parallel``.
attnreg decides those, with its rule ids.  The four below are about the
model or the MoE transport, which attnreg's facts do not describe; the
bridge keeps them exactly as sglang states them, reading sglang's own
predicates, and runs them where sglang does (before the attention backends
are known), so every sglang step in between sees the same config as without
the plugin.  Like sglang's, they never override a user's explicit prefill
backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang.srt.arg_groups.overrides import model_config_of, resolved_view

__all__ = ["ENGINE_RULES", "EngineRule", "first_engine_rule"]


@dataclass(frozen=True)
class EngineRule:
    """One sglang rule the bridge keeps: its name, what attnreg lacks, its predicate."""

    name: str
    message: str
    missing_fact: str
    applies: Callable[[Any], bool]


def _kda_hybrid(server_args: Any) -> bool:
    from sglang.srt.configs.model_config import uses_kda_attention

    hf = model_config_of(server_args).hf_config
    # sglang's own exemption (GLM-5.3 Flash is validated under breakable).
    return bool(uses_kda_attention(hf)) and \
        "Glm5NextForConditionalGeneration" not in (hf.architectures or [])


def _deepseek_v4_memory(server_args: Any) -> bool:
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.layers.cp.bcg import supports_prefill_cp_bcg

    hf = model_config_of(server_args).hf_config
    return bool(is_deepseek_v4(hf)) and not supports_prefill_cp_bcg(server_args)


def _unvalidated_a2a(server_args: Any) -> bool:
    backend = resolved_view(server_args).moe_a2a_backend
    return backend not in ("none", "deepep", "megamoe", "flashinfer")


def _multimodal_unvalidated(server_args: Any) -> bool:
    mc = model_config_of(server_args)
    return bool(mc.is_multimodal) and not bool(mc.is_multimodal_breakable_cuda_graph_supported)


#: In sglang's order; the first that applies disables the default breakable prefill.
ENGINE_RULES: tuple[EngineRule, ...] = (
    EngineRule("kda_linear_attention", "breakable prefill is not validated for KDA hybrid "
               "linear attention", "linear-attention layers and their breakable validation",
               _kda_hybrid),
    EngineRule("deepseek_v4_capture_memory", "the DeepSeek-V4 c4 indexer scratch pinned in "
               "the capture pool runs out of memory",
               "the model's prefill capture-pool size (ModelFacts.prefill_capture_pool_bytes), "
               "which sglang does not expose", _deepseek_v4_memory),
    EngineRule("unvalidated_a2a", "the MoE all-to-all backend is not validated under breakable "
               "prefill", "which MoE all-to-all transports were validated under breakable",
               _unvalidated_a2a),
    EngineRule("multimodal_breakable_unvalidated", "multimodal prefill replay faults under "
               "breakable capture unless the architecture is validated",
               "whether breakable prefill was validated for this multimodal model",
               _multimodal_unvalidated),
)


def first_engine_rule(server_args: Any) -> EngineRule | None:
    """The first kept sglang rule that disables breakable prefill here, or None."""
    for rule in ENGINE_RULES:
        if rule.applies(server_args):
            return rule
    return None
