"""Declaration of ``trtllm_mla``: TensorRT-LLM-gen MLA kernels shipped in flashinfer.

Facts (SEEDS.md, and the flashinfer 0.6.13 sources):

* the kernels are Blackwell-only (sm100/sm103) and load cubins at run time;
* ``trtllm_batch_decode_with_kv_cache_mla`` takes a concatenated 576-wide
  query and cache, writes a **bf16** output (so the query is bf16, or fp8 for
  an fp8 cache, which the backend casts to), pages of 32 or 64 tokens, and a
  page table whose width is a multiple of ``128 / page_size``.  flashinfer's
  own tests run it with 128 query heads; engines run it with 16..128 heads per
  rank (tensor parallelism of DeepSeek / Kimi), and later flashinfer releases
  reject 64 < heads < 128 (the Q tile is 64 heads): declared 16, 32, 64, 128;
* ``trtllm_ragged_attention_deepseek`` accepts only the head dims
  (q/k, v) = (192, 128), (128, 128) or (256, 256) -- it asserts otherwise --
  so absorbed (576, 576, 512) tensors must never reach it.  Batches with a
  cached prefix are run by flashinfer's ragged wrapper instead (bottom-right
  causal over prefix + new tokens), as the engines this is modelled on do;
* under any capture mode extend batches fall back to flashinfer's paged MLA,
  which on Blackwell (fa2) has no FP8 path and so converts an FP8 KV pool to
  bf16 in full (the 2.8x TTFT regression of sglang PR #32785).
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
                              frozenset({DType.BF16, DType.FP8_E4M3}), page_sizes=PAGE_SIZES,
                              max_heads=128, head_counts=DECODE_HEAD_COUNTS,
                              kernel="trtllm_batch_decode_with_kv_cache_mla"),
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
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA,
                         capture_memory=decode_mem),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, _fallback(),
                         pinned_method=ForwardMethod.MLA, capture_memory=fallback_mem),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, _fallback(),
                         pinned_method=ForwardMethod.MLA),
    )
    return Capabilities(
        backend="trtllm_mla", platform=plat, vendors=frozenset({Vendor.CUDA}), kernels=kernels,
        graph_modes=modes, platform_reason=reason,
        unavailable_kernels=unavailable, priority=40,
        notes=(_NOTE,),
    )
