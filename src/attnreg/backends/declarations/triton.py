"""Declaration of the ``triton`` backend (attnreg's own Triton MLA kernels)."""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureMemory,
    CaptureSupport,
    DeclarationContext,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    SplitKV,
    Vendor,
)

from ._common import HALF, MHA_DIMS, MLA_DIMS

MIN_SM = 80
PAGE_SIZES = (1, 16, 32, 64)
#: Split-KV workspace per request slot: fp32 partial outputs and LSEs for
#: 128 heads x up to 32 splits x (512 + 1) floats.
_WORKSPACE_PER_SLOT = 128 * 32 * (512 + 1) * 4
#: Split extend workspace: splits are added only while one wave of 64-row programs is
#: not full, so (tokens x splits x heads) stays near 64 rows x the SM count (160 here,
#: above today's GPUs), each row a 512-float partial plus its LSE.
_EXTEND_WORKSPACE = 64 * 160 * (512 + 1) * 4


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
        # The kernels convert an fp8 cache to the query dtype in registers, but a
        # 16-bit cache must already be in the query dtype (bf16/bf16 or fp16/fp16;
        # they refuse bf16 queries over an fp16 cache): one entry per query dtype.
        kernels = tuple(
            KernelConstraints(ForwardMethod.MLA, frozenset({phase}), MLA_DIMS, frozenset({dt}),
                              frozenset({dt, DType.FP8_E4M3}), page_sizes=PAGE_SIZES,
                              max_heads=128, kernel=name, split_kv=split)
            for phase, name, split in (
                (Phase.DECODE, "triton mla_decode (split-KV)", SplitKV.DYNAMIC),
                (Phase.PREFILL, "triton mla_extend (split-KV)", SplitKV.DYNAMIC))
            for dt in (DType.BF16, DType.FP16)
        ) + (
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF,
                              HALF, max_heads=128, kernel="triton mha_prefill"),
        )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC,
                         capture_memory=CaptureMemory(per_batch_slot_bytes=_WORKSPACE_PER_SLOT)),
        # Breakable prefill captures attention: the absorbed extend kernel has a
        # static grid bounded by the captured token count, so MLA is pinned and
        # prefix batches can replay.  Its split count is fixed per captured shape and
        # its chunks are decided on the device, as in decode.
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC,
                         capture_memory=CaptureMemory(fixed_bytes=_EXTEND_WORKSPACE)),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend="triton", platform=plat, vendors=frozenset({Vendor.CUDA, Vendor.CPU}),
        kernels=kernels, graph_modes=modes, platform_reason=reason,
        priority=20,
    )
