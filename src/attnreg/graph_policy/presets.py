"""Named model presets: data only.

This is the only graph_policy module that names architectures; rules read
:class:`ModelFacts` fields and never a preset name.  Head counts are the
models' published ``num_attention_heads`` at tensor-parallel size 1.  KV dtypes
are the common serving choice and can be overridden (``--kv-dtype``).
"""

from __future__ import annotations

from ..registry.capabilities import DType
from .model import AttentionKind, ModelFacts

__all__ = ["MODEL_PRESETS", "preset"]

_GIB = 1024 ** 3

#: NOT a measurement.  Stands for "a capture pool larger than a sane budget",
#: the reason sglang keeps breakable prefill off for DeepSeek-V4 (its sparse
#: indexer scratch is pinned in the capture pool).  Override with real numbers.
_ILLUSTRATIVE_LARGE_PREFILL_POOL = 64 * _GIB

MODEL_PRESETS: dict[str, ModelFacts] = {
    "deepseek-v3": ModelFacts(AttentionKind.MLA, DType.BF16, 128, label="deepseek-v3"),
    "deepseek-v2-lite": ModelFacts(AttentionKind.MLA, DType.BF16, 16, label="deepseek-v2-lite"),
    # index_topk 2048 in DeepSeek-V3.2's config.json: each token attends 2048 indexed tokens.
    "deepseek-v3.2": ModelFacts(AttentionKind.MLA, DType.BF16, 128, dsa_sparse=True,
                                sparse_top_k=2048, label="deepseek-v3.2"),
    "kimi-k2": ModelFacts(AttentionKind.MLA, DType.BF16, 64, label="kimi-k2"),
    # The seed-002 model: multimodal, piecewise prefill validated, served with
    # an FP8 KV pool (NVFP4 checkpoint).
    "kimi-k2.6": ModelFacts(AttentionKind.MLA, DType.FP8_E4M3, 64, multimodal=True,
                            piecewise_validated=True, label="kimi-k2.6"),
    "deepseek-v4-like": ModelFacts(AttentionKind.MLA, DType.BF16, 128, dsa_sparse=True,
                                   prefill_capture_pool_bytes=_ILLUSTRATIVE_LARGE_PREFILL_POOL,
                                   label="deepseek-v4-like"),
    "llama-3-8b": ModelFacts(AttentionKind.MHA, DType.BF16, 32, mha_head_dims=(128, 128),
                             label="llama-3-8b"),
}


def preset(name: str) -> ModelFacts:
    """The facts of a named preset; raises KeyError listing the known names."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}; or give "
                       "the facts directly (--attention, --kv-dtype, --num-heads, ...)") from None
