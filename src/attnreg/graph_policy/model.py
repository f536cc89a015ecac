"""Model facts: what the graph policy may know about a model.

Rules read these facts, never an architecture name: a new model needs facts,
not a code change.  Named presets live in :mod:`attnreg.graph_policy.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

from attnreg.registry.strenum import StrEnum

from ..registry.capabilities import DType

__all__ = ["AttentionKind", "ModelFacts"]


class AttentionKind(StrEnum):
    """The attention form of a model."""

    MLA = "mla"
    MHA = "mha"



@dataclass(frozen=True)
class ModelFacts:
    """Facts about a served model that graph decisions depend on.

    Parameters
    ----------
    attention
        MLA (latent KV cache; prefill may run the non-absorbed MHA companion)
        or plain MHA.
    kv_dtype
        dtype of the KV pool (``fp8_e4m3`` for an FP8 pool).
    num_heads
        attention heads on one rank (after the tensor-parallel split); kernels
        declare the head counts they accept.
    act_dtype
        activation dtype (q, and the K/V an MHA prefill materialises).
    dsa_sparse
        sparse attention with a token indexer over the latent cache (DSA):
        prefill always runs the absorbed MLA form, so the model has no MHA
        companion path.
    sparse_top_k
        the fact "attention is sparse with top-k K": each query token attends
        the K latent-cache tokens its indexer picks.  Set, every phase runs a
        backend's declared sparse MLA kernels (``Capabilities.sparse_kernels``
        accepting top-k K) under their declared capture support; implies
        ``dsa_sparse``.  None: dense attention (a ``dsa_sparse`` model without
        it is planned as absorbed dense MLA, as before this fact existed).
    multimodal
        the model takes image/audio inputs in prefill.
    piecewise_validated
        torch.compile piecewise prefill (TC_PIECEWISE) was validated for this
        model; enables the breakable -> tc_piecewise default upgrade.
    prefill_capture_pool_bytes, decode_capture_pool_bytes
        the graph-pool memory the model's captured graphs of that phase keep
        alive (activations at the largest bucket, plus any model scratch pinned
        in the pool); compared with the capture memory budget.
    mha_head_dims
        (head_dim_qk, head_dim_v) of an MHA model; unused for MLA, whose
        forward methods have fixed dims.
    label
        a display name.  No rule reads it.
    """

    attention: AttentionKind = AttentionKind.MLA
    kv_dtype: DType = DType.BF16
    num_heads: int = 128
    act_dtype: DType = DType.BF16
    dsa_sparse: bool = False
    multimodal: bool = False
    piecewise_validated: bool = False
    prefill_capture_pool_bytes: int = 0
    decode_capture_pool_bytes: int = 0
    mha_head_dims: tuple[int, int] = (128, 128)
    label: str = "custom"
    sparse_top_k: int | None = None

    def __post_init__(self) -> None:
        # Accept strings from CLIs and JSON; store the enums.
        object.__setattr__(self, "attention", AttentionKind(str(self.attention).lower()))
        object.__setattr__(self, "kv_dtype", cast(DType, DType.parse(self.kv_dtype)))
        object.__setattr__(self, "act_dtype", cast(DType, DType.parse(self.act_dtype)))
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.prefill_capture_pool_bytes < 0 or self.decode_capture_pool_bytes < 0:
            raise ValueError("capture pool estimates must be >= 0 bytes")
        if self.sparse_top_k is not None:
            if int(self.sparse_top_k) < 1:
                raise ValueError(f"sparse_top_k must be >= 1, got {self.sparse_top_k}")
            object.__setattr__(self, "sparse_top_k", int(self.sparse_top_k))
            object.__setattr__(self, "dsa_sparse", True)

    @property
    def sparse(self) -> bool:
        """True when attention is sparse with a known top-k (``sparse_top_k``)."""
        return self.sparse_top_k is not None

    @property
    def has_mha_companion(self) -> bool:
        """True when prefill may run the non-absorbed MHA companion of an MLA model.

        DSA-sparse models always run absorbed MLA in prefill; MHA models have
        no companion (MHA is their only form).
        """
        return self.attention is AttentionKind.MLA and not self.dsa_sparse

    def with_overrides(self, **changes: Any) -> ModelFacts:
        """A copy with ``changes`` applied (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "attention": self.attention.value,
            "kv_dtype": self.kv_dtype.value,
            "act_dtype": self.act_dtype.value,
            "num_heads": self.num_heads,
            "dsa_sparse": self.dsa_sparse,
            "sparse_top_k": self.sparse_top_k,
            "multimodal": self.multimodal,
            "piecewise_validated": self.piecewise_validated,
            "prefill_capture_pool_bytes": self.prefill_capture_pool_bytes,
            "decode_capture_pool_bytes": self.decode_capture_pool_bytes,
            "has_mha_companion": self.has_mha_companion,
        }
