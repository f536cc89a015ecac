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
  breakable capture, and piecewise graphs run attention between pieces).  It
  also serves chunked-prefix MHA (``MHA_CHUNKED_KV``): causal over the new
  tokens, unmasked (``causal=False``) over each prefix chunk.
* Speculative decoding: the MLA wrapper takes ``qo_indptr``, so several causal
  query tokens per request (target verify, draft extend) run the same paged
  kernel with ``causal=True`` (bottom-right aligned: the ``kv_idx + qo_len >
  kv_len + q_idx`` mask of ``mla.cuh``), eagerly and in the FULL decode graphs.
  The kernel has no draft-token limit of its own (``plan()`` takes any
  ``qo_indptr``); flashinfer's own tests run it with 1..17 query tokens per
  request, causal and not, fa2 and fa3 (``tests/attention/test_deepseek_mla.py``
  lines 284 and 500 at v0.6.13, ``test_batch_mla_varlen_page_attention`` and
  ``test_batch_mla_page_attention``), so :data:`MAX_DRAFT_TOKENS` is 16, the
  largest power of two inside what they run (the other built-ins keep 8).
* LSE: the MLA wrapper's ``run(lse=, return_lse=True, return_lse_base_on_e=)``
  (fa2 and fa3), the ragged wrapper's ``run(return_lse=True)`` (base 2,
  converted); declared for the 16-bit kernels (the fp8 path's LSE was never run).
"""

from __future__ import annotations

from typing import NamedTuple

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

from ._common import (
    FLASHINFER,
    HALF,
    MHA_DIMS,
    MLA_DIMS,
    speculative_modes,
)

MIN_SM = 80
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Draft tokens per sequence of verify / draft-extend batches (module doc: inside the
#: 1..17 query tokens per request flashinfer's own MLA tests run).
MAX_DRAFT_TOKENS = 16
SPECULATIVE_DECODE_MODES, SPECULATIVE_EAGER_MODES = speculative_modes(MAX_DRAFT_TOKENS)
#: First flashinfer release line after 0.6.13 (which lacks it) that carries the
#: SM90 FP8-KV MLA path (PR #3694: ``run(..., ckv_scale=, kpe_scale=)``).
FP8_MLA_MIN_VERSION = "0.7.0"
FP8_MLA_SM = 90
_MIB = 1024 * 1024
#: The float workspace every wrapper of one backend instance shares (flashinfer's
#: recommended size).  Allocated when the backend is created, used eagerly too: not
#: capture memory.
FLOAT_WORKSPACE_BYTES = 128 * _MIB
#: The device int workspace each ``BatchMLAPagedAttentionWrapper`` allocates when it is
#: created (flashinfer 0.6.13 ``mla/_core.py``).  Each captured shape gets its own
#: ``use_cuda_graph`` wrapper, so this is paid per captured graph.
WRAPPER_INT_WORKSPACE_BYTES = 8 * _MIB


class GraphIndexSizes(NamedTuple):
    """int32 elements of the index buffers every graph wrapper slices.

    A captured plan has at most ``bs + 1`` requests (the real and zero-length
    padding sequences, then, outside decode, one filler request owning the padding
    rows; a decode plan's padding sequences own one row each and there is no
    filler), so the CSR arrays have room for ``bs + 2`` entries and the page
    indices for every sequence's pages plus the filler's padding pages (one per
    padding row at page size 1).
    """

    qo_indptr: int
    kv_indptr: int
    kv_lens: int
    kv_indices: int


def graph_index_sizes(shape: CaptureShape) -> GraphIndexSizes:
    """What ``init_cuda_graph_state`` allocates for graph wrappers at ``shape``."""
    bs = shape.max_batch_size
    return GraphIndexSizes(qo_indptr=bs + 2, kv_indptr=bs + 2, kv_lens=bs + 1,
                           kv_indices=bs * shape.max_pages + shape.max_num_tokens)


def capture_bytes(shape: CaptureShape) -> int:
    """Capture memory of the paged-MLA graphs: index buffers, one int workspace per graph."""
    return 4 * sum(graph_index_sizes(shape)) + shape.graphs * WRAPPER_INT_WORKSPACE_BYTES


#: FULL decode and BREAKABLE prefill (also trtllm_mla's capture fallback).
CAPTURE_MEMORY = CaptureMemory(
    bytes_fn=capture_bytes,
    formula="graphs x 8 MiB (each use_cuda_graph wrapper's int workspace) + int32 index "
            "buffers: 3 x max_batch_size + 5 + max_batch_size x max_pages + max_num_tokens")


def _mla_kernels(backend_name: str, fp8_reason: str) -> list[KernelConstraints]:
    both = frozenset({Phase.DECODE, Phase.PREFILL})
    kernel = f"BatchMLAPagedAttentionWrapper({backend_name})"
    out = [
        KernelConstraints(ForwardMethod.MLA, both, MLA_DIMS, frozenset({dt}), frozenset({dt}),
                          page_sizes=PAGE_SIZES, max_heads=128, kernel=kernel,
                          split_kv=SplitKV.HOST_PLANNED, lse=True)
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
                              kernel="BatchPrefillWithRaggedKVCacheWrapper", lse=True),
            KernelConstraints(ForwardMethod.MHA_CHUNKED_KV, frozenset({Phase.PREFILL}),
                              MHA_DIMS, HALF, HALF, max_heads=128,
                              kernel="BatchPrefillWithRaggedKVCacheWrapper (causal new "
                                     "tokens, causal=False prefix chunks)", lse=True),
        )
    mem = CAPTURE_MEMORY
    modes = (
        # plan() runs on the host before capture and before every replay, into
        # the buffers of a use_cuda_graph wrapper; the kernel's split schedule is
        # re-planned for each replay's lengths.
        # Decode graphs serve speculative batches too: one use_cuda_graph wrapper per
        # captured (forward mode, shape), planned causal for several tokens per request.
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED,
                         capture_memory=mem, forward_modes=SPECULATIVE_DECODE_MODES),
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
        notes=tuple(notes), eager_forward_modes=SPECULATIVE_EAGER_MODES,
    )
