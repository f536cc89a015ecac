"""Declaration of the ``reference`` backend: float32 torch, the cpu fallback.

(Not the conformance oracle: that is the float64 computation of
``attnreg.testing.workload``, which checks this backend like any other.)
"""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    DeclarationContext,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Vendor,
)

from ._common import HALF_AND_FP8, MHA_DIMS, MLA_DIMS

_NOT_CAPTURABLE = ("the reference loops over sequences with host-side lengths "
                   "(.tolist()), which a CUDA graph cannot record")


def capabilities(ctx: DeclarationContext) -> Capabilities:
    q_dtypes = frozenset({DType.BF16, DType.FP16, DType.FP32})
    kv_dtypes = HALF_AND_FP8 | {DType.FP32}
    kernels = (
        KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}), MLA_DIMS,
                          q_dtypes, kv_dtypes, page_sizes=(1, 16, 32, 64), max_heads=128,
                          kernel="torch.float32"),
        KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS,
                          q_dtypes, q_dtypes, max_heads=128, kernel="torch.float32"),
    )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.unsupported(_NOT_CAPTURABLE)),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                         CaptureSupport.unsupported(_NOT_CAPTURABLE)),
        # Under torch.compile piecewise graphs attention runs eagerly between
        # captured pieces, so the host loop is fine there.
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend="reference", platform=ctx.platform,
        vendors=frozenset(Vendor), kernels=kernels, graph_modes=modes,
        priority=0,
        notes=("float32 math, slow: a plain implementation to compare against, and the cpu "
               "fallback",),
    )
