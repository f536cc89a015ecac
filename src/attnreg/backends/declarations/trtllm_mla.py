"""Declaration of ``trtllm_mla``: TensorRT-LLM-gen MLA kernels shipped in flashinfer.

Facts (SEEDS.md): the kernels are Blackwell-only (sm100/sm103); the ragged
prefill kernel accepts only MHA head dims (q/k 192, 128 or 256; v 128), so
absorbed (576, 576, 512) tensors must never reach it; under any capture mode
extend batches fall back to flashinfer's paged MLA, which converts an FP8 KV
pool in full (the 2.8x TTFT regression of PR #32785).
"""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    Cost,
    DeclarationContext,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Vendor,
)

from ._common import FLASHINFER, HALF, HALF_AND_FP8, MLA_DIMS, TORCH

BLACKWELL = (100, 103)
RAGGED_DIMS = ((192, 128), (128, 128), (256, 128))
PAGE_SIZES = (32, 64)

_FALLBACK_REASON = ("under capture the forward mode is pinned to absorbed MLA, and the "
                    "trtllm ragged kernel only takes MHA head dims: extend runs flashinfer's "
                    "paged MLA instead, which must convert an FP8 pool to bf16 in full")


def _fallback() -> CaptureSupport:
    return CaptureSupport.fallback("flashinfer_mla", Cost.LOW, _FALLBACK_REASON,
                                   costs_by_kv_dtype={DType.FP8_E4M3: Cost.HIGH})


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    unavailable: tuple[tuple[str, str], ...] = ()
    if plat.vendor is not Vendor.CUDA:
        reason = f"trtllm-gen kernels are CUDA Blackwell-only (sm100/sm103); this is {plat}"
    elif plat.sm is not None and plat.sm not in BLACKWELL:
        reason = f"trtllm-gen MLA kernels are Blackwell-only (sm100/sm103); this is {plat}"
        unavailable = (
            ("trtllm_batch_decode_with_kv_cache_mla", reason),
            ("trtllm_ragged_attention_deepseek", reason),
        )
    kernels: tuple[KernelConstraints, ...] = ()
    if not reason:
        kernels = (
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), MLA_DIMS, HALF,
                              HALF_AND_FP8, page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="trtllm_batch_decode_with_kv_cache_mla"),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), RAGGED_DIMS, HALF,
                              HALF, max_heads=128, kernel="trtllm_ragged_attention_deepseek"),
            # Eager absorbed extend (prefix batches) is delegated to flashinfer's
            # paged MLA, as in the engines this is modelled on.
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS, HALF,
                              HALF_AND_FP8, page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="flashinfer_mla (delegated; FP8 pool converted)"),
        )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, _fallback(),
                         pinned_method=ForwardMethod.MLA),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, _fallback(),
                         pinned_method=ForwardMethod.MLA),
    )
    return Capabilities(
        backend="trtllm_mla", platform=plat, vendors=frozenset({Vendor.CUDA}), kernels=kernels,
        graph_modes=modes, requires=(TORCH, FLASHINFER), platform_reason=reason,
        unavailable_kernels=unavailable, priority=40,
    )
