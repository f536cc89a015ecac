"""Declaration of ``trtllm_mla``: TensorRT-LLM-gen MLA kernels shipped in flashinfer.

Facts (SEEDS.md, and the flashinfer 0.6.13 sources):

* the kernels are Blackwell-only (sm100/sm103) and load cubins at run time;
* ``trtllm_batch_decode_with_kv_cache_mla`` takes a concatenated 576-wide
  query and cache, writes a **bf16** output (so the query is bf16, or fp8 for
  an fp8 cache), pages of 32 or 64 tokens, and a
  page table whose width is a multiple of ``128 / page_size``.  flashinfer's
  own tests run it with 128 query heads; engines run it with 16..128 heads per
  rank (tensor parallelism of DeepSeek / Kimi), and later flashinfer releases
  reject 64 < heads < 128 (the Q tile is 64 heads): declared 16, 32, 64, 128;
* with an FP8 cache the decode kernel multiplies fp8 q by fp8 KV: the backend
  rounds q to fp8 e4m3 on the device with attnreg's per-tensor power-of-two scale
  (``q_compute_dtype`` fp8; a plain cast would make every ``|q| > 448`` 448 or NaN,
  and absorbed queries reach that) and passes the descale inside ``bmm1_scale`` as
  a float32 ``(1,)`` tensor, which 0.6.13's ``trtllm_batch_decode_with_kv_cache_mla``
  accepts on the trtllm-gen backend (``mla/_core.py``: a float32 check, then
  ``bmm1_scale * log2e`` for a tensor).  Not run on Blackwell yet;
* ``trtllm_ragged_attention_deepseek`` accepts only the head dims
  (q/k, v) = (192, 128), (128, 128) or (256, 256) -- it asserts otherwise --
  so absorbed (576, 576, 512) tensors must never reach it.  Batches with a
  cached prefix are run by flashinfer's ragged wrapper instead (bottom-right
  causal over prefix + new tokens), as the engines this is modelled on do;
* under any capture mode extend batches fall back to flashinfer's paged MLA,
  which on Blackwell (fa2) has no FP8 path and so converts an FP8 KV pool to
  bf16 in full (the 2.8x TTFT regression of sglang PR #32785);
* target-verify batches (speculative decoding) run the same decode kernel with
  a 4-d query ``[B, q_len_per_request, H, 576]`` (its docstring: "q_len_per_request
  is the MTP query length").  0.6.13's ``mla/_core.py`` passes ``max_q_len =
  query.size(1)`` (line 1418) and ``None,  # cum_seq_lens_q`` (line 1469) to
  ``trtllm_paged_attention_decode``: every request has the same query length,
  declared uniform.  The mask is per query token, from ``seq_lens`` (which
  include the new tokens): token ``i`` of ``q_len`` sees keys ``0 .. seq_len -
  q_len + i``, bottom-right causal.  The MLA generation kernels carry a dense
  mask (``csrc/trtllm_fmha_kernel_launcher.cu`` line 215; ``include/flashinfer/
  trtllm/fmha/fmhaKernels.cuh`` lines 875-877: "the runtime sequence
  lengths/indices provide the effective masking"), and flashinfer's own test
  checks the kernel against its paged MLA planned causal (``tests/attention/
  test_trtllm_gen_mla.py`` at v0.6.13, line 533: ``plan(q_indptr = arange *
  q_len_per_request, ..., True, ...)``); sglang 0.5.23 relies on the same bound
  (``layers/attention/trtllm_mla_backend.py`` lines 840-842, ``seq_lens +
  self.num_draft_tokens``; line 1551, ``q.view(bs, -1, tp_q_head_num, head_dim)``).
  Nothing bounds ``q_len`` in the wrapper or the launcher (one CTA per query
  token: ``fmhaKernels.cuh`` line 430), but 0.6.13's tests check values only at
  ``q_len_per_request`` 1 and 2 (lines 882-884, "todo(Yingyi): verify larger
  q_len_per_request"; ``test_trtllm_batch_decode_mla_preallocated_out``, line
  979, runs 4 but compares the kernel only with itself), so
  :data:`MAX_VERIFY_TOKENS` is 2 (docs/decisions.md, 2026-12-02).  Draft-extend
  batches (1..n accepted tokens per request) are not declared: without
  ``cum_seq_lens_q`` ragged query lengths cannot reach the kernel (sglang pads
  them to the longest and shifts ``seq_lens``); attnreg's DRAFT_EXTEND is ragged.
"""

from __future__ import annotations

from attnreg.registry import (
    Capabilities,
    CaptureMemory,
    CaptureShape,
    CaptureSupport,
    Cost,
    DeclarationContext,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Vendor,
)

from ._common import MLA_DIMS
from .flashinfer_mla import capture_bytes as flashinfer_capture_bytes

BLACKWELL = (100, 103)
RAGGED_DIMS = ((192, 128), (128, 128), (256, 256))
PAGE_SIZES = (32, 64)
DECODE_HEAD_COUNTS = (16, 32, 64, 128)
#: The zero-initialised trtllm-gen workspace (its multi-CTA counters live there).
#: Allocated when the backend is created and used eagerly too: not capture memory.
WORKSPACE_BYTES = 128 * 1024 * 1024
#: The decode kernel wants ``block_tables.shape[1] % (TABLE_ALIGN / page_size) == 0``.
TABLE_ALIGN = 128
#: Bytes per element of the 16-bit copy an FP8 pool is converted to under capture.
_CONVERTED_ITEMSIZE = 2
#: Query tokens per request of target-verify batches (``q_len_per_request``): the
#: largest flashinfer 0.6.13's own tests check against a reference (module doc).
MAX_VERIFY_TOKENS = 2
#: What the FULL decode graphs (and the eager path) serve in the decode phase: one-token
#: decode and uniform target-verify batches of up to MAX_VERIFY_TOKENS tokens.
DECODE_FORWARD_MODES = (
    ForwardModeSupport(ForwardMode.DECODE, 1, True),
    ForwardModeSupport(ForwardMode.TARGET_VERIFY, MAX_VERIFY_TOKENS, True),
)
#: ...and eagerly also ragged extend (the prefill phase).
EAGER_FORWARD_MODES = DECODE_FORWARD_MODES + (ForwardModeSupport(ForwardMode.EXTEND, None,
                                                                 False),)


def decode_table_width(max_pages: int, page_size: int) -> int:
    """Columns of the decode kernel's block table: ``max_pages`` rounded up to its alignment."""
    multiple = max(1, TABLE_ALIGN // page_size)
    return -(-max_pages // multiple) * multiple


def decode_capture_bytes(shape: CaptureShape) -> int:
    """FULL decode: the aligned int32 block tables and clamped lengths of the graph."""
    bs = shape.max_batch_size
    return 4 * (bs * decode_table_width(shape.max_pages, shape.page_size) + bs)


def fallback_capture_bytes(shape: CaptureShape) -> int:
    """BREAKABLE prefill (flashinfer's paged MLA): its graph memory, plus for an FP8 pool
    the 16-bit copy of the whole pool the graph converts it into at every replay."""
    converted = _CONVERTED_ITEMSIZE * shape.kv_pool_bytes \
        if shape.kv_dtype is DType.FP8_E4M3 else 0
    return flashinfer_capture_bytes(shape) + converted

_FALLBACK_REASON = ("under capture the forward mode is pinned to absorbed MLA, and the "
                    "trtllm ragged kernel only takes MHA head dims: extend runs flashinfer's "
                    "paged MLA instead, which reads a bf16 pool as is but must convert an "
                    "FP8 pool to bf16 in full "
                    "(inside the graph, every replay, into a pool-sized temporary)")

_BF16 = frozenset({DType.BF16})
_NOTE = ("decode and ragged prefill kernels need sm100/sm103; absorbed extend (eager and "
         "under capture) runs flashinfer's paged MLA")


def _fallback() -> CaptureSupport:
    return CaptureSupport.fallback("flashinfer_mla", Cost.LOW, _FALLBACK_REASON,
                                   costs_by_kv_dtype={DType.FP8_E4M3: Cost.HIGH})


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    unavailable: tuple[tuple[str, str], ...] = ()
    if plat.vendor is not Vendor.CUDA:
        reason = f"trtllm-gen kernels are CUDA Blackwell-only (sm100/sm103); this is {plat}"
    elif plat.sm is not None and plat.sm not in BLACKWELL:
        reason = f"trtllm-gen MLA kernels are Blackwell-only (sm100/sm103); this is {plat}"
        unavailable = (
            ("trtllm_batch_decode_with_kv_cache_mla", reason),
            ("trtllm_ragged_attention_deepseek", reason),
        )
    kernels: tuple[KernelConstraints, ...] = ()
    if not reason:
        kernels = (
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), MLA_DIMS, _BF16,
                              _BF16, page_sizes=PAGE_SIZES,
                              max_heads=128, head_counts=DECODE_HEAD_COUNTS,
                              kernel="trtllm_batch_decode_with_kv_cache_mla"),
            # an FP8 pool: fp8 x fp8, q rounded on the device (module doc)
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), MLA_DIMS, _BF16,
                              frozenset({DType.FP8_E4M3}), page_sizes=PAGE_SIZES,
                              max_heads=128, head_counts=DECODE_HEAD_COUNTS,
                              kernel="trtllm_batch_decode_with_kv_cache_mla (fp8 q, scaled "
                                     "per tensor)", q_compute_dtype=DType.FP8_E4M3),
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), RAGGED_DIMS, _BF16,
                              _BF16, max_heads=128,
                              kernel="trtllm_ragged_attention_deepseek "
                                     "(prefix batches: flashinfer ragged)"),
            # Absorbed extend (eager and under capture) is delegated to
            # flashinfer's paged MLA, whose q must match a 16-bit pool's dtype;
            # an FP8 pool is converted to the q dtype first.
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS, _BF16,
                              frozenset({DType.BF16, DType.FP8_E4M3}), page_sizes=PAGE_SIZES,
                              max_heads=128,
                              kernel="flashinfer_mla (delegated; FP8 pool converted)"),
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS,
                              frozenset({DType.FP16}), frozenset({DType.FP16, DType.FP8_E4M3}),
                              page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="flashinfer_mla (delegated; FP8 pool converted)"),
        )
    fallback_mem = CaptureMemory(
        bytes_fn=fallback_capture_bytes,
        formula="flashinfer_mla's (graphs x 8 MiB + index buffers), plus 2 x kv_pool_bytes "
                "for an FP8 pool (converted to 16 bits inside the graph)")
    decode_mem = CaptureMemory(
        bytes_fn=decode_capture_bytes,
        formula="4 x max_batch_size x (block-table width (max_pages aligned to 128 / "
                "page_size) + 1)")
    modes = (
        # Verify graphs read the decode graphs' buffers (block tables, lengths): one
        # captured graph per (forward mode, shape), no extra capture memory.
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA,
                         capture_memory=decode_mem, forward_modes=DECODE_FORWARD_MODES),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, _fallback(),
                         pinned_method=ForwardMethod.MLA, capture_memory=fallback_mem),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, _fallback(),
                         pinned_method=ForwardMethod.MLA),
    )
    return Capabilities(
        backend="trtllm_mla", platform=plat, vendors=frozenset({Vendor.CUDA}), kernels=kernels,
        graph_modes=modes, platform_reason=reason,
        unavailable_kernels=unavailable, priority=40,
        notes=(_NOTE,), eager_forward_modes=EAGER_FORWARD_MODES,
    )
