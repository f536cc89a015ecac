"""A tiny third-party plugin, installed only for the registry tests.

It reuses the reference runtime with a narrower declaration (page size 16 only),
so it is a real, honest backend.
"""

import attnreg
from attnreg import (
    Capabilities,
    CaptureSupport,
    DType,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Requirement,
    Vendor,
)


def capabilities(ctx):
    half = frozenset({DType.BF16, DType.FP16})
    return Capabilities(
        backend="demo_mla", platform=ctx.platform, vendors=frozenset({Vendor.CPU, Vendor.CUDA}),
        kernels=(KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                                   ((576, 512),), half, half, page_sizes=(16,), max_heads=16,
                                   kernel="torch"),),
        graph_modes=(
            GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.unsupported("host loop")),
            GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                             CaptureSupport.unsupported("host loop")),
            GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, CaptureSupport.native()),
        ),
    )


@attnreg.hookimpl
def attnreg_register_backends(register):
    register(attnreg.BackendSpec(name="demo_mla", summary="demo plugin backend (page size 16)",
                                 capabilities=capabilities,
                                 runtime="attnreg.backends.reference:ReferenceBackend",
                                 requires=(Requirement("torch", "torch"),)))
