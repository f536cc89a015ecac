"""Declaration of the ``reference`` backend: float32 torch, the cpu fallback.

(Not the conformance oracle: that is the float64 computation of
``attnreg.testing.workload``, which checks this backend like any other.)

It serves every forward mode eagerly (decode, extend, target verify and draft
extend of up to :data:`MAX_DRAFT_TOKENS` tokens per sequence, chunked-prefix
MHA) and returns the log-sum-exp everywhere.  Graph modes are declared only
where they were proven: FULL / BREAKABLE capture is impossible (host loops),
and TC_PIECEWISE (attention eagerly between captured pieces) was proven on
cuda by the conformance suite on an H200 and runs its eager path on cpu; on
rocm, npu and xpu nobody ran it, so it is declared unsupported there with that
reason rather than trusted by the graph policy.
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
    SparseKernel,
    SparseKVFormat,
    Vendor,
)

from ._common import HALF_AND_FP8, MHA_DIMS, MLA_DIMS, SPECULATIVE_EAGER_MODES

_NOT_CAPTURABLE = ("the reference loops over sequences with host-side lengths "
                   "(.tolist()), which a CUDA graph cannot record")

#: Vendors where tc_piecewise prefill with the reference between pieces was run:
#: cuda (conformance on an H200: captured pieces around the eager attention) and
#: cpu (the eager attention path; cpu records no device graphs at all).
PIECEWISE_PROVEN = frozenset({Vendor.CUDA, Vendor.CPU})


def _piecewise(vendor: Vendor) -> CaptureSupport:
    if vendor in PIECEWISE_PROVEN:
        return CaptureSupport.native("attention runs eagerly between pieces")
    return CaptureSupport.unsupported(
        f"not proven on {vendor}: torch.compile piecewise graphs around the reference's "
        f"eager attention were run on cuda only (run `attnreg conformance --backend "
        f"reference` on a {vendor} device, then declare it)")


#: Why the reference's sparse path declares no capture mode: it gathers and attends
#: without a host value, but nobody has captured it (no sparse capture claim ran yet).
_SPARSE_NOT_CAPTURED = ("the reference's sparse path is declared eagerly only: no capture of "
                        "it was run through the graph session (docs/sparse.md)")


def capabilities(ctx: DeclarationContext) -> Capabilities:
    q_dtypes = frozenset({DType.BF16, DType.FP16, DType.FP32})
    kv_dtypes = HALF_AND_FP8 | {DType.FP32}
    kernels = (
        KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}), MLA_DIMS,
                          q_dtypes, kv_dtypes, page_sizes=(1, 16, 32, 64), max_heads=128,
                          kernel="torch.float32", lse=True),
        KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS,
                          q_dtypes, q_dtypes, max_heads=128, kernel="torch.float32", lse=True),
        KernelConstraints(ForwardMethod.MHA_CHUNKED_KV, frozenset({Phase.PREFILL}), MHA_DIMS,
                          q_dtypes, q_dtypes, max_heads=128,
                          kernel="torch.float32 (chunked prefix)", lse=True),
    )
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.unsupported(_NOT_CAPTURABLE)),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                         CaptureSupport.unsupported(_NOT_CAPTURABLE)),
        # Under torch.compile piecewise graphs attention runs eagerly between
        # captured pieces, so the host loop is fine there.
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, _piecewise(ctx.platform.vendor)),
    )
    # Sparse (DSA) MLA over the pool's own bf16 rows, any top-k width up to 2048
    # (DeepSeek-V3.2's index_topk): sparse_attention_with_lse in backends/reference.py.
    sparse = (SparseKernel(frozenset({Phase.DECODE, Phase.PREFILL}), q_dtypes,
                           SparseKVFormat.BF16, page_sizes=(1, 16, 32, 64), max_heads=128,
                           max_top_k=2048, kernel="torch.float32 (sparse)", lse=True),)
    sparse_modes = tuple(
        GraphModeSupport(phase, mode, CaptureSupport.unsupported(_SPARSE_NOT_CAPTURED))
        for phase, mode in ((Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE),
                            (Phase.PREFILL, GraphMode.TC_PIECEWISE)))
    return Capabilities(
        backend="reference", platform=ctx.platform,
        vendors=frozenset(Vendor), kernels=kernels, graph_modes=modes,
        priority=0, eager_forward_modes=SPECULATIVE_EAGER_MODES,
        sparse_kernels=sparse, sparse_graph_modes=sparse_modes,
        notes=("float32 math, slow: a plain implementation to compare against, and the cpu "
               "fallback",),
    )
