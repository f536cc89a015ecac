"""Declaration of ``flash_attn_cute`` (flash-attn-4, the CuTe DSL FlashAttention).

Facts (shared/gpu/README.md, SEEDS.md, the flash-attn-4 4.0.0b36 sources): on
sm90 varlen MHA (192/128, 128/128) is correct and capturable; the absorbed
``qv`` path (head_dim 64 + qv 512) is Blackwell-only (on sm90 FA4 asserts
"not supported on SM90"); its default 2-CTA kernel has no split-KV variant, so
the backend always runs it with ``num_splits=1`` (declared SINGLE).  Paged KV
for ``qv``: pages of 128 tokens (the kernel's key tile) load by TMA, other
page sizes by cp.async ("paged KV at any page size" in the kernel sources);
declared 1, 16, 32, 64, 128, not yet run on a Blackwell device here.
"""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureMemory,
    CaptureShape,
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

SUPPORTED_SM = (90, 100, 103)
#: The absorbed ``qv`` kernel exists for Blackwell (sm100+) only.
QV_MIN_SM = 100
QV_PAGE_SIZES = (1, 16, 32, 64, 128)
#: Bytes per output element: FA4 runs 16-bit queries and writes the output in their dtype.
_OUT_ITEMSIZE = 2
#: Value widths of the captured forms: absorbed MLA (latent) and the MHA companion.
_MLA_V, _MHA_V = 512, 128


def _output_bytes(shape: CaptureShape, v_dim: int) -> int:
    # flash_attn_varlen_func takes no out=: every call allocates its output, which inside
    # a graph comes from (and stays in) the graph's memory pool
    return shape.max_num_tokens * shape.num_heads * v_dim * _OUT_ITEMSIZE


def mla_capture_bytes(shape: CaptureShape) -> int:
    """BREAKABLE prefill with MLA pinned (sm100+): the absorbed output FA4 allocates."""
    return _output_bytes(shape, _MLA_V)


def mha_capture_bytes(shape: CaptureShape) -> int:
    """BREAKABLE prefill capturing the MHA companion (sm90): the output FA4 allocates."""
    return _output_bytes(shape, _MHA_V)


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    if plat.vendor is not Vendor.CUDA:
        reason = f"flash-attn-4 is CUDA-only (sm90/sm100); this is {plat}"
    elif plat.sm is not None and plat.sm not in SUPPORTED_SM:
        reason = f"flash-attn-4 kernels exist for sm90, sm100, sm103; this is {plat}"
    kernels: list[KernelConstraints] = []
    unavailable: tuple[tuple[str, str], ...] = ()
    has_qv = plat.is_cuda_at_least(QV_MIN_SM)
    if not reason:
        kernels.append(KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS,
                                         HALF, HALF, max_heads=128,
                                         kernel="flash_attn_varlen_func"))
        if has_qv:
            # FA4 asserts that q, qv and the cache share one dtype.
            kernels.extend(
                KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS,
                                  frozenset({dt}), frozenset({dt}), page_sizes=QV_PAGE_SIZES,
                                  max_heads=128, kernel="flash_attn_varlen_func(qv=...)",
                                  split_kv=SplitKV.SINGLE)
                for dt in (DType.BF16, DType.FP16))
        else:
            unavailable = (("flash_attn_varlen_func(qv=...)",
                            f"the absorbed qv path is Blackwell-only (sm100+); this is {plat}"),)
    if has_qv:
        breakable = GraphModeSupport(
            Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
            pinned_method=ForwardMethod.MLA, split_kv=SplitKV.SINGLE,
            capture_memory=CaptureMemory(
                bytes_fn=mla_capture_bytes,
                formula="max_num_tokens x heads x 512 x 2 bytes (the output FA4 allocates "
                        "inside the graph)"))
    else:
        # Without the absorbed path nothing can be pinned: the MHA companion is
        # what gets captured, so prefix batches must run eagerly.
        breakable = GraphModeSupport(
            Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(), pinned_method=None,
            capture_memory=CaptureMemory(
                bytes_fn=mha_capture_bytes,
                formula="max_num_tokens x heads x 128 x 2 bytes (the output FA4 allocates "
                        "inside the graph)"))
    modes = (
        breakable,
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend="flash_attn_cute", platform=plat, vendors=frozenset({Vendor.CUDA}),
        kernels=tuple(kernels), graph_modes=modes,
        platform_reason=reason, unavailable_kernels=unavailable, priority=25,
        notes=("prefill only: pair it with a decode backend",),
    )
