"""What ``compat_0_1_mla`` declares: a pure function of the platform, no torch import.

attnreg calls :func:`capabilities` at startup (``attnreg backends``,
``attnreg compat``) and the conformance suite turns every line of it into a
test, so each value here must be true of :mod:`attnreg_compat_0_1.runtime`.
"""

from __future__ import annotations

from attnreg import (
    Capabilities,
    CaptureSupport,
    DeclarationContext,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Requirement,
    Vendor,
)

BACKEND_NAME = "compat_0_1_mla"

#: Only these page sizes: a deliberate policy of this backend (say, the only
#: layouts its engine allocates).  Anything else is refused before a launch.
PAGE_SIZES = (16, 64)
MAX_HEADS = 64
HALF = frozenset({DType.BF16, DType.FP16})

#: An optional dependency: missing, the backend is listed as unavailable with
#: an install hint instead of failing.  (distribution "torch", import "torch",
#: the attnreg extra that brings it.)
TORCH = Requirement("torch", "torch", "torch", "2.4")

# Reasons are shown to users by `attnreg compat`; say why, truthfully.
_DECODE_NOT_CAPTURED = ("decode capture has not been verified on a GPU for this example; "
                        "declare FULL only after `attnreg conformance --device cuda` passes")
_EXTEND_NOT_CAPTURABLE = ("extend loops over sequences with host-side lengths (the reference "
                          "extend), which a CUDA graph cannot record")


def capabilities(ctx: DeclarationContext) -> Capabilities:
    """The declaration of ``compat_0_1_mla`` on ``ctx.platform``.

    Parameters
    ----------
    ctx
        The platform and the installed library versions.  Read only these:
        a capability function must not import torch or a kernel library.
    """
    platform = ctx.platform
    reason = ""
    if platform.vendor not in (Vendor.CPU, Vendor.CUDA):
        reason = f"compat_0_1_mla runs on cpu and cuda (plain torch); this is {platform}"
    kernels: tuple[KernelConstraints, ...] = ()
    if not reason:
        kernels = (
            # Absorbed MLA only: no MHA companion, so forward_extend(method=MHA)
            # is refused by attnreg before this backend's code runs.
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),),
                              q_dtypes=HALF, kv_dtypes=HALF, page_sizes=PAGE_SIZES,
                              max_heads=MAX_HEADS, kernel="torch batched gather decode"),
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), ((576, 512),),
                              q_dtypes=HALF, kv_dtypes=HALF, page_sizes=PAGE_SIZES,
                              max_heads=MAX_HEADS, kernel="reference extend (float32 torch)"),
        )
    graph_modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL,
                         CaptureSupport.unsupported(_DECODE_NOT_CAPTURED)),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                         CaptureSupport.unsupported(_EXTEND_NOT_CAPTURABLE)),
        # Under torch.compile piecewise graphs attention is a splitting op that
        # runs eagerly between the captured pieces, so host reads are fine.
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    return Capabilities(
        backend=BACKEND_NAME, platform=platform,
        vendors=frozenset({Vendor.CPU, Vendor.CUDA}), kernels=kernels,
        graph_modes=graph_modes, requires=(TORCH,), platform_reason=reason,
        # Below the built-in reference (0): installing the plugin must not change
        # which backend an engine gets when it asks for none.
        priority=-1,
        notes=(f"tutorial backend: page sizes {PAGE_SIZES} only, at most {MAX_HEADS} heads",),
    )
