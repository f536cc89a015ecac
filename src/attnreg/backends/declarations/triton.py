"""Declaration of the ``triton`` backend (attnreg's own Triton MLA kernels)."""

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

from ._common import HALF, HALF_AND_FP8, MHA_DIMS, MLA_DIMS, TORCH, TRITON

MIN_SM = 80
PAGE_SIZES = (1, 16, 32, 64)
#: Split-KV workspace per request slot: fp32 partial outputs and LSEs for
#: 128 heads x up to 32 splits x (512 + 1) floats.
_WORKSPACE_PER_SLOT = 128 * 32 * (512 + 1) * 4


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    if plat.vendor is Vendor.CUDA:
        if plat.sm is not None and plat.sm < MIN_SM:
            reason = f"needs sm{MIN_SM}+ (bf16 tensor cores); this is {plat}"
    elif plat.vendor is Vendor.CPU:
        if not ctx.triton_interpreter:
            reason = ("Triton kernels need a GPU; on cpu they run only under the Triton "
                      "interpreter (set TRITON_INTERPRET=1; slow, for tests)")
    else:
        reason = f"not validated on {plat.vendor} (declared for cuda sm{MIN_SM}+ only)"
    kernels: tuple[KernelConstraints, ...] = ()
    if not reason:
        kernels = (
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), MLA_DIMS, HALF,
                              HALF_AND_FP8, page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="triton mla_decode (split-KV)", split_kv=SplitKV.DYNAMIC),
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS, HALF,
                              HALF_AND_FP8, page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="triton mla_extend"),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF,
                              HALF, max_heads=128, kernel="triton mha_prefill"),
        )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC,
                         capture_memory=CaptureMemory(per_batch_slot_bytes=_WORKSPACE_PER_SLOT)),
        # Breakable prefill captures attention: the absorbed extend kernel has a
        # static grid bounded by the captured token count, so MLA is pinned and
        # prefix batches can replay.
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend="triton", platform=plat, vendors=frozenset({Vendor.CUDA, Vendor.CPU}),
        kernels=kernels, graph_modes=modes, requires=(TORCH, TRITON), platform_reason=reason,
        priority=20,
    )
