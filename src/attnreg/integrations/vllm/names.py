"""vLLM's attention-backend and KV-cache-dtype names, and attnreg's.

Pure data, no vLLM import.  A vLLM backend maps only where its kernels are
the ones the attnreg declaration describes for an MLA model; the mapping
then asserts that vLLM's implementation behaves as attnreg's declaration
says (attnreg's conformance suite proves attnreg's own implementation, not
vLLM's), as the sglang bridge's names do (docs/decisions.md, "sglang
backend names").  A backend not mapped is left to vLLM's own stated support.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnreg.registry.capabilities import DType

__all__ = [
    "BRIDGE_PREFIX",
    "MAPPED_BACKENDS",
    "UNMAPPED_BACKENDS",
    "BackendMapping",
    "kv_dtype_from_vllm",
    "map_backend",
]

#: vLLM backend names ``attnreg_<name>`` stand for attnreg's own implementations.
BRIDGE_PREFIX = "ATTNREG_"

#: vLLM ``AttentionBackendEnum`` name -> attnreg backend whose declaration describes its
#: decode kernels.
MAPPED_BACKENDS: dict[str, str] = {
    # vLLM's Triton MLA decode (decode_attention_fwd, split-KV with a fixed split count).
    "TRITON_MLA": "triton",
    # vLLM's FLASHINFER_MLA is flashinfer's trtllm-gen MLA decode
    # (trtllm_batch_decode_with_kv_cache_mla), compute capability 10.x only:
    # the kernels of attnreg's trtllm_mla, not of attnreg's flashinfer_mla (fa2/fa3 paged MLA).
    "FLASHINFER_MLA": "trtllm_mla",
    # FlashMLA dense decode (sgl-flash-mla / vLLM's flashmla ops): the attnreg-flashmla plugin.
    "FLASHMLA": "flashmla",
}

#: vLLM MLA backends attnreg has no declaration for, with why.
UNMAPPED_BACKENDS: dict[str, str] = {
    "CUTLASS_MLA": "CUTLASS MLA: no attnreg declaration",
    "FLASHMLA_SPARSE": "sparse (DSA) MLA is outside attnreg's declarations",
    "FLASHINFER_MLA_SPARSE": "sparse (DSA) MLA is outside attnreg's declarations",
    "FLASH_ATTN_MLA": "FlashAttention 3 MLA (sm90): attnreg declares no FA3 backend",
    "ROCM_AITER_MLA": "AMD aiter: no attnreg declaration for ROCm kernels",
    "ROCM_AITER_TRITON_MLA": "AMD aiter: no attnreg declaration for ROCm kernels",
    "CPU_MLA": "vLLM's CPU MLA: no attnreg declaration (and no device graphs)",
}


@dataclass(frozen=True)
class BackendMapping:
    """What one vLLM attention-backend name is to attnreg.

    ``attnreg`` is None when attnreg has no declaration for it; ``reason``
    then says why (it goes into the bridge's log line).
    """

    vllm: str
    attnreg: str | None
    reason: str
    exact: bool = False

    @property
    def mapped(self) -> bool:
        return self.attnreg is not None


def map_backend(name: str) -> BackendMapping:
    """The attnreg backend declared for vLLM's attention backend ``name``.

    Examples
    --------
    >>> map_backend("TRITON_MLA").attnreg
    'triton'
    >>> map_backend("ATTNREG_REFERENCE").exact
    True
    >>> map_backend("CUTLASS_MLA").mapped
    False
    """
    if name.startswith(BRIDGE_PREFIX):
        return BackendMapping(name, name[len(BRIDGE_PREFIX):].lower(),
                              "attnreg's own implementation behind vLLM's interface",
                              exact=True)
    if name in MAPPED_BACKENDS:
        target = MAPPED_BACKENDS[name]
        return BackendMapping(name, target,
                              f"vLLM's {name} runs the kernels attnreg's {target} declares")
    why = UNMAPPED_BACKENDS.get(name, "attnreg has no declaration for this vLLM backend")
    return BackendMapping(name, None, why)


#: vLLM ``cache_dtype`` values attnreg declares (``auto`` = the model dtype).
_KV_DTYPES = {
    "bfloat16": DType.BF16,
    "float16": DType.FP16,
    "half": DType.FP16,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
}


def kv_dtype_from_vllm(cache_dtype: str, model_dtype: DType) -> DType | None:
    """attnreg's KV dtype for vLLM's ``cache_config.cache_dtype``; None when attnreg has
    none (``fp8_e5m2``, ``fp8_ds_mla``, ``nvfp4``, ...).

    >>> kv_dtype_from_vllm("fp8", DType.BF16).value
    'fp8_e4m3'
    """
    if cache_dtype in ("auto", None):
        return model_dtype
    return _KV_DTYPES.get(str(cache_dtype))
