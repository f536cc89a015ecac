"""sglang's names for attention backends and graph modes, and attnreg's.

Pure data, no sglang import: the plugin entry point and docs read it.

A backend maps only where sglang's backend runs the kernels the attnreg
declaration describes for an MLA model; the mapping then asserts that
sglang's implementation behaves as attnreg's declaration says (attnreg's
conformance suite proves attnreg's own implementation, not sglang's).  The
``attnreg_<name>`` backends of the bridge are attnreg's implementations, so
their mapping is exact.  See docs/decisions.md ("sglang backend names").
"""

from __future__ import annotations

from dataclasses import dataclass

from attnreg.registry.capabilities import DType, GraphMode

__all__ = [
    "BRIDGE_PREFIX",
    "MAPPED_BACKENDS",
    "UNMAPPED_BACKENDS",
    "BackendMapping",
    "graph_mode_from_sglang",
    "graph_mode_to_sglang",
    "kv_dtype_from_sglang",
    "map_backend",
]

#: sglang attention-backend names registered by the backend bridge.
BRIDGE_PREFIX = "attnreg_"

#: sglang backend (MLA model) -> attnreg backend whose declaration describes its kernels.
MAPPED_BACKENDS: dict[str, str] = {
    # TRT-LLM-gen MLA decode + ragged prefill; under capture extend falls back
    # to flashinfer's paged MLA (seed 002), exactly what attnreg declares.
    "trtllm_mla": "trtllm_mla",
    # sglang's "flashinfer" builds FlashInferMLAAttnBackend for MLA models.
    "flashinfer": "flashinfer_mla",
    # sglang's Triton MLA decode/extend kernels (the models of attnreg's).
    "triton": "triton",
    # sglang's fa4 is flash_attn.cute (FlashAttention 4), attnreg's flash_attn_cute.
    "fa4": "flash_attn_cute",
}

_DSA_GAP = ("sparse (DSA) attention: sglang runs the kernels of its --dsa-prefill-backend / "
            "--dsa-decode-backend (flashmla_sparse, flashmla_kv, fa3, tilelang, triton, "
            "trtllm, ...), and no attnreg backend declares those sparse kernels yet "
            "(attnreg's only sparse declaration is its torch reference, which sglang does not "
            "run); docs/sparse.md")

#: sglang MLA-capable backends attnreg has no declaration for, with why.
UNMAPPED_BACKENDS: dict[str, str] = {
    "fa3": "FlashAttention 3 (flash_attn_interface, sm90): attnreg declares no FA3 backend",
    "flashmla": "FlashMLA: no attnreg declaration in this release",
    "cutlass_mla": "CUTLASS MLA: no attnreg declaration",
    "cutedsl_mla": "CuTe-DSL MLA decode: no attnreg declaration",
    "aiter": "AMD aiter: no attnreg declaration for ROCm kernels",
    # sglang 0.5.23's dsa (nsa: its deprecated alias) runs the kernels its
    # --dsa-prefill-backend / --dsa-decode-backend pick (flashmla_sparse, flashmla_kv,
    # fa3, tilelang, triton, trtllm, ...).  attnreg declares sparse MLA
    # (Capabilities.sparse_kernels) but none of those kernels yet.
    "nsa": _DSA_GAP,
    "dsa": _DSA_GAP,
    "qsa": "sparse attention backends are outside attnreg's declarations",
    "dsv4": "DeepSeek-V4 attention is outside attnreg's declarations",
    "torch_native": "torch native attention: sglang disables graphs for it itself",
    "flex_attention": "flex attention: sglang disables graphs for it itself",
}


@dataclass(frozen=True)
class BackendMapping:
    """What one sglang attention-backend name is to attnreg.

    ``attnreg`` is None when attnreg has no declaration for it; ``reason``
    then says why (it goes into the bridge's decision).
    """

    sglang: str | None
    attnreg: str | None
    reason: str = ""
    exact: bool = False

    @property
    def mapped(self) -> bool:
        return self.attnreg is not None


def map_backend(name: str | None) -> BackendMapping:
    """The attnreg backend declared for sglang's attention backend ``name``.

    Examples
    --------
    >>> map_backend("flashinfer").attnreg
    'flashinfer_mla'
    >>> map_backend("attnreg_triton").exact
    True
    >>> map_backend("fa3").mapped
    False
    """
    if name is None:
        return BackendMapping(None, None, "sglang resolved no attention backend")
    if name.startswith(BRIDGE_PREFIX):
        return BackendMapping(name, name[len(BRIDGE_PREFIX):],
                              "attnreg's own implementation behind sglang's interface",
                              exact=True)
    if name in MAPPED_BACKENDS:
        target = MAPPED_BACKENDS[name]
        return BackendMapping(name, target, f"sglang's {name} runs the kernels attnreg's "
                                            f"{target} declares")
    why = UNMAPPED_BACKENDS.get(name, "attnreg has no declaration for this sglang backend")
    return BackendMapping(name, None, why)


#: sglang ``cuda_graph_config[phase].backend`` strings <-> attnreg graph modes.
_MODES = {
    "disabled": GraphMode.DISABLED,
    "full": GraphMode.FULL,
    "breakable": GraphMode.BREAKABLE,
    "tc_piecewise": GraphMode.TC_PIECEWISE,
}


def graph_mode_from_sglang(backend: str) -> GraphMode:
    """attnreg's mode for a sglang graph backend string (``"breakable"``)."""
    try:
        return _MODES[str(backend)]
    except KeyError:
        raise ValueError(f"unknown sglang cuda-graph backend {backend!r}; known: "
                         f"{', '.join(_MODES)}") from None


def graph_mode_to_sglang(mode: GraphMode) -> str:
    """sglang's graph backend string for an attnreg mode (the enum values agree)."""
    return GraphMode.parse(mode).value  # type: ignore[union-attr]


#: sglang ``--kv-cache-dtype`` values attnreg declares (``auto`` = the model dtype).
_KV_DTYPES = {
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "fp8_e4m3": DType.FP8_E4M3,
}


def kv_dtype_from_sglang(kv_cache_dtype: str, model_dtype: DType) -> DType | None:
    """attnreg's KV dtype for sglang's ``kv_cache_dtype``; None when attnreg has none
    (fp8_e5m2, fp4 / nvfp4 / mxfp8 pools)."""
    if kv_cache_dtype in ("auto", None):
        return model_dtype
    return _KV_DTYPES.get(str(kv_cache_dtype))
