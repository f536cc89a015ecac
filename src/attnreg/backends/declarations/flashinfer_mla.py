"""Declaration of ``flashinfer_mla`` (flashinfer-python >= 0.6.13).

Facts (read from the flashinfer 0.6.13 wheel, and seen on an H200, see
shared/gpu/README.md):

* ``BatchMLAPagedAttentionWrapper`` (backend ``auto`` -> ``fa3`` on sm90a,
  ``fa2`` elsewhere) runs absorbed MLA over a paged latent cache.  Its JIT
  kernels are instantiated with one q dtype and one kv dtype and compute the
  attention with the *kv* dtype's tensor-core instructions, so a 16-bit q must
  match a 16-bit cache (bf16/bf16 or fp16/fp16), never mix.
* FP8 (e4m3) KV: 0.6.13 has no FP8 MLA path (its ``run`` takes no
  ``ckv_scale``); flashinfer PR #3694 added it for ``fa3`` only (sm90), with
  bf16 queries and per-tensor ``ckv_scale`` / ``kpe_scale``.  It is declared
  from :data:`FP8_MLA_MIN_VERSION` on sm90; the runtime also checks the
  installed ``run`` signature and refuses FP8 when the keyword is absent.
* ``BatchPrefillWithRaggedKVCacheWrapper`` runs the non-absorbed MHA prefill
  (192/128, 128/128), eagerly: it is never captured here (MLA is pinned under
  breakable capture, and piecewise graphs run attention between pieces).
"""

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

from ._common import FLASHINFER, HALF, MHA_DIMS, MLA_DIMS

MIN_SM = 80
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: First flashinfer release line after 0.6.13 (which lacks it) that carries the
#: SM90 FP8-KV MLA path (PR #3694: ``run(..., ckv_scale=, kpe_scale=)``).
FP8_MLA_MIN_VERSION = "0.7.0"
FP8_MLA_SM = 90
_MIB = 1024 * 1024
#: Allocated once per backend instance: the 128 MiB float workspace shared by
#: every wrapper, plus the 8 MiB device int workspace flashinfer allocates for
#: each of the two eager wrappers (paged MLA, ragged MHA).
_FIXED_BYTES = 128 * _MIB + 2 * 8 * _MIB
#: Each captured batch size gets its own ``use_cuda_graph`` wrapper, which
#: allocates an 8 MiB int workspace; when every batch size up to the maximum is
#: captured that is 8 MiB per request slot (an upper bound), plus int32 page
#: indices (8192 pages per slot).
_PER_SLOT_BYTES = 8 * _MIB + 4 * 8192


def _mla_kernels(backend_name: str, fp8_reason: str) -> list[KernelConstraints]:
    both = frozenset({Phase.DECODE, Phase.PREFILL})
    kernel = f"BatchMLAPagedAttentionWrapper({backend_name})"
    out = [
        KernelConstraints(ForwardMethod.MLA, both, MLA_DIMS, frozenset({dt}), frozenset({dt}),
                          page_sizes=PAGE_SIZES, max_heads=128, kernel=kernel,
                          split_kv=SplitKV.HOST_PLANNED)
        for dt in (DType.BF16, DType.FP16)
    ]
    if not fp8_reason:
        out.append(KernelConstraints(ForwardMethod.MLA, both, MLA_DIMS, frozenset({DType.BF16}),
                                     frozenset({DType.FP8_E4M3}), page_sizes=PAGE_SIZES,
                                     max_heads=128, kernel=f"{kernel}, fp8 kv",
                                     split_kv=SplitKV.HOST_PLANNED))
    return out


def _fp8_reason(ctx: DeclarationContext) -> str:
    """Why FP8 KV is not available on this platform/version ('' when it is)."""
    plat = ctx.platform
    if plat.sm != FP8_MLA_SM:
        return (f"flashinfer's FP8-KV MLA exists only in the fa3 kernel (sm90); "
                f"this is {plat}")
    if not ctx.version_at_least(FLASHINFER.distribution, FP8_MLA_MIN_VERSION):
        have = ctx.version(FLASHINFER.distribution) or "not installed"
        return (f"needs flashinfer-python >= {FP8_MLA_MIN_VERSION} (installed: {have}); "
                "0.6.13 has no FP8 MLA path")
    return ""


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    if plat.vendor is not Vendor.CUDA:
        reason = f"flashinfer kernels are CUDA-only; this is {plat}"
    elif plat.sm is not None and plat.sm < MIN_SM:
        reason = f"needs sm{MIN_SM}+; this is {plat}"
    kernels: tuple[KernelConstraints, ...] = ()
    unavailable: tuple[tuple[str, str], ...] = ()
    notes = []
    if not reason:
        backend_name = "fa3" if plat.sm == 90 else "fa2"
        notes.append(f"BatchMLAPagedAttentionWrapper backend auto -> {backend_name} here")
        notes.append("q and a 16-bit KV pool must share one dtype (bf16/bf16 or fp16/fp16)")
        fp8_reason = _fp8_reason(ctx)
        if fp8_reason:
            unavailable = (("BatchMLAPagedAttentionWrapper, fp8 kv", fp8_reason),)
        kernels = (
            *_mla_kernels(backend_name, fp8_reason),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF,
                              HALF, max_heads=128,
                              kernel="BatchPrefillWithRaggedKVCacheWrapper"),
        )
    mem = CaptureMemory(fixed_bytes=_FIXED_BYTES, per_batch_slot_bytes=_PER_SLOT_BYTES)
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
        kernels=kernels, graph_modes=modes,
        unavailable_kernels=unavailable, platform_reason=reason, priority=30,
        notes=tuple(notes),
    )
