"""Declaration of ``flashinfer_mla`` (flashinfer-python >= 0.6.13)."""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureMemory,
    CaptureSupport,
    DeclarationContext,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    SplitKV,
    Vendor,
)

from ._common import FLASHINFER, HALF, MHA_DIMS, MLA_DIMS, TORCH

MIN_SM = 80
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Workspace: flashinfer's float workspace buffer (128 MiB, allocated once)
#: plus per-slot int32 index buffers of the use_cuda_graph wrappers.
_WORKSPACE_BYTES = 128 * 1024 * 1024
_PER_SLOT_BYTES = 4 * 4096


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    if plat.vendor is not Vendor.CUDA:
        reason = f"flashinfer kernels are CUDA-only; this is {plat}"
    elif plat.sm is not None and plat.sm < MIN_SM:
        reason = f"needs sm{MIN_SM}+; this is {plat}"
    kernels: tuple[KernelConstraints, ...] = ()
    notes = []
    if not reason:
        backend_name = "fa3" if plat.sm == 90 else "fa2"
        notes.append(f"BatchMLAPagedAttentionWrapper backend auto -> {backend_name} here")
        kernels = (
            # The paged MLA kernels read a bf16/fp16 latent cache; an FP8 pool
            # would need a whole-pool conversion, which this backend refuses.
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                              MLA_DIMS, HALF, HALF, page_sizes=PAGE_SIZES, max_heads=128,
                              kernel=f"BatchMLAPagedAttentionWrapper({backend_name})",
                              split_kv=SplitKV.HOST_PLANNED),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF,
                              HALF, max_heads=128,
                              kernel="BatchPrefillWithRaggedKVCacheWrapper"),
        )
    mem = CaptureMemory(fixed_bytes=_WORKSPACE_BYTES, per_batch_slot_bytes=_PER_SLOT_BYTES)
    modes = (
        # plan() runs on the host before capture and before every replay, into
        # the buffers of a use_cuda_graph wrapper; the kernel's split schedule is
        # re-planned for each replay's lengths.
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED,
                         capture_memory=mem),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED,
                         capture_memory=mem),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend="flashinfer_mla", platform=plat, vendors=frozenset({Vendor.CUDA}),
        kernels=kernels, graph_modes=modes, requires=(TORCH, FLASHINFER),
        platform_reason=reason, priority=30, notes=tuple(notes),
    )
