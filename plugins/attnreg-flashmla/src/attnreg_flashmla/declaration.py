"""What ``flashmla`` declares: a pure function of the platform, importing only attnreg.registry.

attnreg calls :func:`capabilities` at startup (``attnreg backends``,
``attnreg compat``) on machines without torch or a GPU, and the conformance
suite turns every value here into a test on the device.  The runtime
(:mod:`attnreg_flashmla.runtime`) imports its constants and its capture
memory arithmetic from this module, so each fact has one source.

Facts (sgl-flash-mla 1.0.0: its Python interface ``flash_mla_interface.py``
and the dense decode entry it calls; measured on an H200 on 2026-12-01):

* Dense MLA decode exists only in the *legacy* kernels
  (``flash_mla_with_kvcache(..., use_legacy=True)``), which are built for
  sm90a only ("Dense decode MLA is only supported on SM90a").  The current
  kernels (sm100) are sparse only: without ``indices`` they assert that sparse
  attention is required.  So: declared on cuda:sm90, nowhere else.
* Page size: 64 only (``Currently page_block_size must be 64``); every other
  size (1, 16, 32, 128, 256 were tried) raises inside the library.
* Heads: 1, 2, 4, 8, 16, 32, 64 and 128 ran, max relative error
  2.4e-3..3.3e-3 against a float64 oracle.  Other counts were not run.
* bf16 q over a bf16 cache ``[num_pages, 64, 1, 576]``.  fp16 ran once but
  its accuracy was not checked: not declared.
* FP8 cache: the dense FP8 kernel reads a plain float8_e4m3fn cache with one
  per-tensor dequantisation scale (attnreg's own FP8 pool, viewed with one KV
  head) but refuses a bf16 q: q must be fp8 too, with one per-tensor scale.
  The runtime rounds q on the device (``q_compute_dtype`` fp8); with q rounded
  the relative error was 2.9e-2..3.5e-2 for 16, 32, 64 and 128 heads, the
  heads declared for it.  Output bf16.  An engine that rounds q itself (fused
  into its q projection) hands it as fp8 with ``q_scale``: the kernel's own
  input, declared as a third entry (fp8 q over the fp8 cache), which costs no
  launch beside the kernel (issue 31).
* Split-KV: the kernel's grid is ``num_sm_parts`` thread-block groups, each
  working through the (sequence, KV block) ranges a scheduler kernel
  (``get_mla_decoding_metadata``) assigns from the *device* sequence lengths.
  Scheduler output frozen at capture gave relative errors 0.17 and 5.6 on
  replays at other lengths (sglang #26019); recomputed before each replay it
  was correct at every length.
* LSE: the bf16 kernel returns the float32 log-sum-exp as ``[B, H, s_q]``,
  natural log, within ~1e-6 of the float64 oracle; a zero-length sequence
  gets ``+inf`` (attnreg's convention is ``-inf``: the runtime converts).  The
  FP8 kernel's LSE was not compared with an oracle: not declared for it.
* Several query tokens per sequence (``q [B, s_q, H, 576]``): s_q 1, 2, 3, 4
  and 8 ran with ``causal=True`` (bottom-right among the new tokens, over the
  whole prefix), errors ~3e-3: a TARGET_VERIFY batch.  The scheduler takes
  ``s_q * H`` query rows.  Only the bf16 kernel was run so: forward modes are
  declared per backend, not per kernel, so the conformance suite's fp8-pool
  verify claims (eager and replayed) are what prove the fp8 one.  A
  DRAFT_EXTEND batch has ragged accepted lengths, which one call (one ``s_q``
  for the batch) cannot take: not declared.
* Per call the kernel allocates its output, LSE and the split-KV accumulators
  (``out_accum`` / ``lse_accum``, ``batch + num_sm_parts`` rows); under a CUDA
  graph they come from the graph's memory pool.  :func:`decode_call_bytes`
  is that arithmetic.

Sparse (DSA) MLA, ``Capabilities.sparse_kernels`` (docs/sparse.md), from the
library's interface (``flash_mla_interface.py``, and the checks its legacy
extension makes) and the H200 run of attnreg issue 32 (2026-12-01: sparse
decode on V3.2's 656-byte rows within 1.5% of a float64 oracle, captured and
replayed in a CUDA graph, at 64 heads and top-k 2048; sparse prefill on bf16
rows within 0.4%):

* Sparse decode, ``flash_mla_with_kvcache(indices=..., is_fp8_kvcache=True,
  use_legacy=True, kv_format="V32")``: the ``fp8_ds_mla`` rows (kv cache
  ``[pages, 64, 1, 656]`` bytes), q ``[rows, 1, H, 576]`` bf16, indices
  ``[rows, 1, top_k]`` int32 pool slots, -1 = none (the only value it treats
  as invalid: anything else out of range reads out of bounds, so attnreg
  refuses it first).  ``h_q`` 64 or 128; page size 64; top-k a multiple of the
  kernel's 64-index block (``topk mod B_TOPK must be 0``), up to 2048 (V3.2's
  ``index_topk``, the largest run); no per-row top-k length for V3.2.  Each
  query row is attended on its own (no causal mask, no lengths): a decode
  batch is ``rows = B``; an extend batch runs as ``rows = T`` one-token rows
  (what vLLM does with this kernel for prefill).
* Its split-KV schedule is a function of the shapes only (rows, heads,
  top-k: the sparse op takes no lengths): the first call of a step computes
  it on the device (the library's own scheduler, inside the graph when
  captured), every later layer of the step reuses it.  Nothing is read on the
  host, so FULL decode and BREAKABLE prefill capture are declared NATIVE.
* Sparse prefill, ``flash_mla_sparse_fwd(q [rows, H, 576], kv [slots, 1,
  576], indices [rows, 1, top_k], use_legacy=True)`` over the pool's bf16
  rows: the same heads and no host read, top-k a multiple of 128 (its sm90
  kernel asserts ``topk % (2 * B_TOPK) == 0``: top-k 64 reached that assert on
  the H200, 2026-12-02); it returns the natural-log LSE (declared).  The decode kernel's LSE was not compared with an oracle:
  not declared.  Both kernels serve decode and extend batches (one query row
  per index row); rows whose indices are all -1 are zeroed (LSE ``-inf``) by
  the runtime, whatever the kernel leaves there.
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
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Requirement,
    SparseKernel,
    SparseKVFormat,
    SplitKV,
    Vendor,
)

__all__ = [
    "BACKEND_NAME",
    "DECODE_FORWARD_MODES",
    "SPARSE_DECODE_KERNEL",
    "SPARSE_HEAD_COUNTS",
    "SPARSE_KV_FORMAT_V32",
    "SPARSE_MAX_TOP_K",
    "SPARSE_PREFILL_KERNEL",
    "SPARSE_PREFILL_TOP_K_MULTIPLE",
    "SPARSE_TOP_K_MULTIPLE",
    "FLASH_MLA",
    "FP8_HEAD_COUNTS",
    "FP8_KERNEL",
    "HEAD_COUNTS",
    "KERNEL",
    "MAX_SM90_SMS",
    "MAX_VERIFY_TOKENS",
    "PAGE_SIZE",
    "SCHEDULER_INTS",
    "SM",
    "TORCH",
    "VERIFY_TOKENS_RUN",
    "capabilities",
    "capture_bytes",
    "decode_call_bytes",
    "fp8_query_bytes",
    "num_sm_parts",
    "scheduler_bytes",
    "scheduler_shapes",
    "sparse_call_bytes",
    "sparse_capture_bytes",
]

BACKEND_NAME = "flashmla"

#: The kernel library.  Its 1.0.0 metadata asks for torch >= 2.14.1, but its
#: libraries use torch's stable ABI and load on older torch (2.11 on the H200),
#: so the hint installs it without its dependencies.
FLASH_MLA = Requirement("flash_mla", "sgl-flash-mla", min_version="1.0.0",
                        install="pip install --no-deps 'sgl-flash-mla>=1.0.0'")
TORCH = Requirement("torch", "torch", min_version="2.4")

#: The only architecture with a dense MLA decode kernel in sgl-flash-mla 1.0.0.
SM = 90
PAGE_SIZE = 64
#: Head counts run on the H200 (2026-12-01); nothing else is claimed.
HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Head counts the FP8 kernel was run with.
FP8_HEAD_COUNTS = (16, 32, 64, 128)
#: Query tokens per sequence run with causal=True on the H200 (2026-12-01).
VERIFY_TOKENS_RUN = (1, 2, 3, 4, 8)
#: The largest verify batch declared: draft chains of up to 8 tokens (MTP / EAGLE), the
#: most that was run.  5, 6 and 7 are the same kernel at other row counts (the kernel
#: flattens ``s_q * H`` query rows into tiles of 64); the GPU tests run every count.
MAX_VERIFY_TOKENS = max(VERIFY_TOKENS_RUN)
#: What the decode phase serves, eagerly and in FULL decode graphs: one-token decode and
#: target-verify batches (the same kernel call with ``s_q`` query tokens per sequence,
#: causal).  No DRAFT_EXTEND: its accepted lengths are ragged and one call takes one
#: ``s_q``.  No EXTEND: no prefill kernel.
DECODE_FORWARD_MODES = (
    ForwardModeSupport(ForwardMode.DECODE, 1, True),
    ForwardModeSupport(ForwardMode.TARGET_VERIFY, MAX_VERIFY_TOKENS, True),
)
KERNEL = "flash_mla_with_kvcache (legacy dense decode, sm90)"
FP8_KERNEL = "flash_mla_with_kvcache(is_fp8_kvcache=True) (legacy dense fp8 decode, sm90)"

#: Query heads the legacy sparse kernels take (``h_q == 64 || h_q == 128``).
SPARSE_HEAD_COUNTS = (64, 128)
#: Top-k widths of the fp8 decode kernel: multiples of its 64-index block, up to V3.2's
#: index_topk (64 and 2048 ran on the H200, 2026-12-02).
SPARSE_TOP_K_MULTIPLE = 64
#: The sm90 sparse prefill kernel asserts ``topk % (2 * B_TOPK) == 0`` (phase1.cuh; top-k
#: 64 reached that assert on the H200, 2048 ran): multiples of 128.
SPARSE_PREFILL_TOP_K_MULTIPLE = 128
SPARSE_MAX_TOP_K = 2048
#: The ``kv_format`` name of DeepSeek-V3.2's 656-byte rows in the legacy kernels.
SPARSE_KV_FORMAT_V32 = "V32"
SPARSE_DECODE_KERNEL = ("flash_mla_with_kvcache(indices, is_fp8_kvcache=True, kv_format=V32) "
                        "(legacy sparse fp8 decode, sm90)")
SPARSE_PREFILL_KERNEL = "flash_mla_sparse_fwd (legacy sparse bf16 prefill, sm90)"

#: SMs of the largest sm90 part (H100 SXM, H200): the scheduler's partition count
#: grows with the SM count, so capture memory is declared for the largest.
MAX_SM90_SMS = 132
#: Query rows per tile of the kernel (the scheduler divides the SMs by the tiles).
_BLOCK_M = 64
#: int32 words per scheduler partition (``tile_scheduler_metadata`` is ``[parts, 8]``).
SCHEDULER_INTS = 8
_LATENT = 512
#: Sizes the CUDA caching allocator hands out are multiples of this.
_ALLOC_GRANULE = 512

_DECODE_ONLY = ("FlashMLA serves MLA decode only: its dense prefill is Blackwell MHA "
                "(flash_attn_varlen_func, sm100) and its sparse prefill needs DSA top-k "
                "indices; pair it with a prefill backend (e.g. --prefill-backend "
                "flashinfer_mla)")
_SPARSE_CAPTURE_NOTE = ("sparse: indices are a device tensor and the fp8 kernel's split-KV "
                        "schedule depends only on (rows, heads, top-k), computed on the device "
                        "by the step's first call (inside the graph); no host value is read")
_SPARSE_PIECEWISE_NOTE = "sparse attention runs eagerly between the captured pieces"
_SCHEDULER_NOTE = ("split-KV schedule re-planned before every replay: the scheduler kernel "
                   "runs on the replay's device sequence lengths into the buffers the graph "
                   "reads (never frozen at capture: sglang #26019)")


def num_sm_parts(num_heads: int, tokens_per_seq: int = 1, num_sms: int = MAX_SM90_SMS) -> int:
    """Partitions FlashMLA's scheduler splits the KV work into (its ``num_sm_parts``).

    With one KV head the dense decode entry uses
    ``max(num_sms // ceil(tokens_per_seq * num_heads / 64), 1)``: 132 at 16
    heads and 66 at 128 heads on a 132-SM H200.
    """
    tiles = -(-(tokens_per_seq * num_heads) // _BLOCK_M)
    return max(num_sms // tiles, 1)


def _granules(nbytes: int) -> int:
    return -(-nbytes // _ALLOC_GRANULE) * _ALLOC_GRANULE


def scheduler_shapes(max_batch_size: int, num_heads: int,
                     num_sms: int = MAX_SM90_SMS) -> tuple[tuple[int, int], tuple[int]]:
    """Shapes of the scheduler buffers the runtime allocates once for graphs.

    ``tile_scheduler_metadata`` int32 ``[num_sm_parts(H), 8]`` and
    ``num_splits`` int32 ``[max_batch_size + 1]``, shared by every captured
    shape (graphs replay one at a time and each replay re-plans first).  One
    query token per sequence has the most partitions; a verify shape of
    ``s_q`` tokens reads the first ``num_sm_parts(H, s_q)`` rows, a batch of
    ``bs`` the first ``bs + 1`` split counts.
    """
    return ((num_sm_parts(num_heads, 1, num_sms), SCHEDULER_INTS), (max_batch_size + 1,))


def scheduler_bytes(max_batch_size: int, num_heads: int,
                    num_sms: int = MAX_SM90_SMS) -> dict[str, int]:
    """Bytes of :func:`scheduler_shapes`' buffers, by name (allocator-rounded)."""
    meta, splits = scheduler_shapes(max_batch_size, num_heads, num_sms)
    return {"tile_scheduler_metadata": _granules(meta[0] * meta[1] * 4),
            "num_splits": _granules(splits[0] * 4)}


def decode_call_bytes(batch_size: int, num_heads: int, tokens_per_seq: int = 1,
                      num_sms: int = MAX_SM90_SMS, out_itemsize: int = 2) -> dict[str, int]:
    """What one decode call allocates inside the library, by name (bytes, allocator-rounded).

    The output ``[B, s_q * H, 512]`` (bf16), the LSE ``[B, s_q * H]`` float32
    and the split-KV accumulators for ``B + num_sm_parts`` splits: ``lse_accum``
    ``[splits, s_q * H]`` and ``out_accum`` ``[splits, s_q * H, 512]`` float32.
    Several query tokens per sequence with several heads also reorder the LSE
    into ``[B, H, s_q]`` (a copy).  They are freed when the call returns, so
    the layers of one captured step reuse one set.
    """
    rows = tokens_per_seq * num_heads
    splits = batch_size + num_sm_parts(num_heads, tokens_per_seq, num_sms)
    sizes = {
        "out": batch_size * rows * _LATENT * out_itemsize,
        "lse": batch_size * rows * 4,
        "lse_accum": splits * rows * 4,
        "out_accum": splits * rows * _LATENT * 4,
    }
    if tokens_per_seq > 1 and num_heads > 1:
        sizes["lse_reordered"] = batch_size * rows * 4
    return {name: _granules(n) for name, n in sizes.items()}


def fp8_query_bytes(batch_size: int, num_heads: int, tokens_per_seq: int = 1) -> dict[str, int]:
    """What the runtime allocates per FP8 call besides the library: q rounded to fp8 and its scale.

    (The bf16 product q / scale it is cast from is freed before the kernel
    allocates its accumulators, which are larger, so it adds nothing to the peak.)
    """
    return {"q_fp8": _granules(batch_size * tokens_per_seq * num_heads * 576),
            "q_descale": _granules(4)}


def capture_bytes(shape: CaptureShape) -> int:
    """Capture memory of FULL decode at ``shape``: scheduler buffers plus one call's allocations.

    ``max_num_tokens / max_batch_size`` query tokens per sequence (above 1:
    target-verify graphs, captured beside the decode graphs of the same
    buffers): the larger of a one-token call and a verify call at the largest
    batch.  The policy's estimate and the runtime's allocation both come from
    here (``CaptureMemory.bytes_fn``).  Graphs captured into one shared pool
    (largest batch first) reuse the largest one's memory.
    """
    batch, heads = shape.max_batch_size, shape.num_heads
    tokens = max(1, shape.max_num_tokens // max(1, batch))
    sms = shape.num_sms or MAX_SM90_SMS
    call = max(sum(decode_call_bytes(batch, heads, t, sms).values()) for t in {1, tokens})
    total = sum(scheduler_bytes(batch, heads, sms).values()) + call
    if DType.parse(shape.kv_dtype) is DType.FP8_E4M3 and \
            DType.parse(shape.q_dtype) is not DType.FP8_E4M3:
        # a 16-bit q is rounded in the graph; the engine's own fp8 q is the kernel's input
        total += sum(fp8_query_bytes(batch, heads, tokens).values())
    return total


_CAPTURE_MEMORY = CaptureMemory(
    bytes_fn=capture_bytes,
    formula=("scheduler int32 [num_sm_parts(H, 1), 8] + [B+1], plus the larger captured call "
             "of s_q = 1 and s_q = max_num_tokens / B query tokens per sequence: bf16 out "
             "[B, s_q H, 512], fp32 lse [B, s_q H], fp32 split-KV accumulators "
             "[B + num_sm_parts(H, s_q), s_q H, 512 + 1]; num_sm_parts(H, s_q) = "
             "max(SMs // ceil(s_q H / 64), 1), 132 SMs when unknown; an fp8 pool adds q "
             "rounded to fp8 [B, s_q H, 576] unless the engine hands q in fp8"))


def sparse_call_bytes(rows: int, num_heads: int, *, fp8_rows: bool,
                      num_sms: int = MAX_SM90_SMS) -> dict[str, int]:
    """What one sparse call allocates, by name (bytes, allocator-rounded), for ``rows``
    query rows: inside a captured graph these come from its memory pool.

    The fp8 decode kernel (``fp8_rows``): bf16 out ``[rows, H, 512]``, fp32 LSE
    ``[rows, H]``, its schedule (``[num_sm_parts(H), 8]`` and ``[rows + 1]`` int32)
    and, as the dense decode kernel allocates them, the split-KV accumulators for
    ``rows + num_sm_parts(H)`` splits.  The prefill kernel: bf16 out, fp32 max
    logits and LSE.  Both: the runtime's mask of rows with no valid index.  The
    sparse kernels' allocations were not measured on a device: this is the
    interface's shapes and the dense kernel's accumulator scheme.
    """
    heads = num_heads
    if fp8_rows:
        parts = num_sm_parts(heads, 1, num_sms)
        splits = rows + parts
        sizes = {"out": rows * heads * _LATENT * 2, "lse": rows * heads * 4,
                 "tile_scheduler_metadata": parts * SCHEDULER_INTS * 4,
                 "num_splits": (rows + 1) * 4,
                 "lse_accum": splits * heads * 4, "out_accum": splits * heads * _LATENT * 4}
    else:
        sizes = {"out": rows * heads * _LATENT * 2, "max_logits": rows * heads * 4,
                 "lse": rows * heads * 4}
    sizes["empty_rows"] = rows
    return {name: _granules(n) for name, n in sizes.items()}


def sparse_capture_bytes(shape: CaptureShape) -> int:
    """Capture memory of a sparse graph at ``shape``: one sparse call of
    ``max_num_tokens`` rows (decode: the batch; prefill: the tokens), by the kernel
    the pool's KV dtype selects (fp8: ``fp8_ds_mla`` rows).  Layers reuse it."""
    fp8 = DType.parse(shape.kv_dtype) is DType.FP8_E4M3
    return sum(sparse_call_bytes(max(shape.max_num_tokens, shape.max_batch_size),
                                 shape.num_heads, fp8_rows=fp8,
                                 num_sms=shape.num_sms or MAX_SM90_SMS).values())


_SPARSE_CAPTURE_MEMORY = CaptureMemory(
    bytes_fn=sparse_capture_bytes,
    formula=("one sparse call of R = max_num_tokens rows: fp8_ds_mla rows (fp8 decode "
             "kernel): bf16 out [R, H, 512], fp32 lse [R, H], schedule int32 "
             "[num_sm_parts(H, 1), 8] + [R+1], fp32 split-KV accumulators [R + "
             "num_sm_parts(H, 1), H, 512 + 1]; bf16 rows (prefill kernel): bf16 out, fp32 "
             "max logits and lse [R, H]; not measured on a device"))


def _platform_reason(ctx: DeclarationContext) -> str:
    plat = ctx.platform
    if plat.vendor is not Vendor.CUDA:
        return f"FlashMLA is a CUDA library (dense MLA decode on sm90); this is {plat}"
    if plat.sm is None:
        return (f"FlashMLA's dense MLA decode needs sm{SM}; the platform {plat} names no "
                f"architecture (give one, e.g. cuda:sm{SM})")
    if plat.sm != SM:
        if plat.sm >= 100:
            return (f"FlashMLA's dense MLA decode exists only in its legacy sm{SM} kernels; "
                    f"its {plat.arch} kernels are sparse (DSA top-k) attention over "
                    f"DeepSeek's KV formats, not declared by this plugin (only sm{SM} was "
                    f"run); this is {plat}")
        return f"FlashMLA's dense MLA decode needs sm{SM} (Hopper); this is {plat}"
    return ""


def capabilities(ctx: DeclarationContext) -> Capabilities:
    """The declaration of ``flashmla`` on ``ctx.platform``.

    Parameters
    ----------
    ctx
        The platform and the installed library versions.  Read only these:
        importing torch or ``flash_mla`` here would slow every startup query.
    """
    plat = ctx.platform
    reason = _platform_reason(ctx)
    kernels: tuple[KernelConstraints, ...] = ()
    sparse: tuple[SparseKernel, ...] = ()
    sparse_modes: tuple[GraphModeSupport, ...] = ()
    unavailable: tuple[tuple[str, str], ...] = ()
    if not reason:
        bf16 = frozenset({DType.BF16})
        kernels = (
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),),
                              q_dtypes=bf16, kv_dtypes=bf16, page_sizes=(PAGE_SIZE,),
                              max_heads=max(HEAD_COUNTS), head_counts=HEAD_COUNTS,
                              kernel=KERNEL, split_kv=SplitKV.HOST_PLANNED, lse=True),
            # The engine hands bf16 q; the kernel computes with it rounded to fp8.  Its LSE
            # was never compared with an oracle: not declared (lse=False).
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),),
                              q_dtypes=bf16, kv_dtypes=frozenset({DType.FP8_E4M3}),
                              page_sizes=(PAGE_SIZE,), max_heads=max(FP8_HEAD_COUNTS),
                              head_counts=FP8_HEAD_COUNTS, kernel=FP8_KERNEL,
                              split_kv=SplitKV.HOST_PLANNED, q_compute_dtype=DType.FP8_E4M3),
            # The kernel's own input: the engine hands q already in fp8 with its scale
            # (forward_*(q_scale=)), so nothing is rounded in the graph beside the kernel.
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), ((576, 512),),
                              q_dtypes=frozenset({DType.FP8_E4M3}),
                              kv_dtypes=frozenset({DType.FP8_E4M3}), page_sizes=(PAGE_SIZE,),
                              max_heads=max(FP8_HEAD_COUNTS), head_counts=FP8_HEAD_COUNTS,
                              kernel=FP8_KERNEL, split_kv=SplitKV.HOST_PLANNED),
        )
        unavailable = (("prefill / extend", _DECODE_ONLY),)
        both = frozenset({Phase.DECODE, Phase.PREFILL})
        sparse = (
            SparseKernel(both, bf16, SparseKVFormat.FP8_DS_MLA, page_sizes=(PAGE_SIZE,),
                         max_heads=max(SPARSE_HEAD_COUNTS), head_counts=SPARSE_HEAD_COUNTS,
                         top_k_multiple=SPARSE_TOP_K_MULTIPLE, max_top_k=SPARSE_MAX_TOP_K,
                         kernel=SPARSE_DECODE_KERNEL, lse=False),
            SparseKernel(both, bf16, SparseKVFormat.BF16, page_sizes=(PAGE_SIZE,),
                         max_heads=max(SPARSE_HEAD_COUNTS), head_counts=SPARSE_HEAD_COUNTS,
                         top_k_multiple=SPARSE_PREFILL_TOP_K_MULTIPLE,
                         max_top_k=SPARSE_MAX_TOP_K, kernel=SPARSE_PREFILL_KERNEL, lse=True),
        )
        sparse_modes = (
            GraphModeSupport(Phase.DECODE, GraphMode.FULL,
                             CaptureSupport.native(_SPARSE_CAPTURE_NOTE),
                             capture_memory=_SPARSE_CAPTURE_MEMORY),
            GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE,
                             CaptureSupport.native(_SPARSE_CAPTURE_NOTE),
                             capture_memory=_SPARSE_CAPTURE_MEMORY),
            GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                             CaptureSupport.native(_SPARSE_PIECEWISE_NOTE)),
        )
    unserved = CaptureSupport.unsupported(_DECODE_ONLY)
    modes = (
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(_SCHEDULER_NOTE),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.HOST_PLANNED,
                         capture_memory=_CAPTURE_MEMORY, forward_modes=DECODE_FORWARD_MODES),
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, unserved),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE, unserved),
    )
    return Capabilities(
        backend=BACKEND_NAME, platform=plat, vendors=frozenset({Vendor.CUDA}),
        kernels=kernels, graph_modes=modes,
        sparse_kernels=sparse, sparse_graph_modes=sparse_modes,
        unavailable_kernels=unavailable, platform_reason=reason,
        # Above flashinfer_mla (30), its sm90 alternative: on the H200 FlashMLA
        # decoded the P1 shapes in 0.975x fa3's time (geometric mean).  Below
        # trtllm_mla (40), which runs only where this does not.
        priority=35,
        eager_forward_modes=DECODE_FORWARD_MODES,
        notes=(f"decode only, page size {PAGE_SIZE} only; bf16 pool: heads "
               f"{', '.join(map(str, HEAD_COUNTS))}; fp8 pool: heads "
               f"{', '.join(map(str, FP8_HEAD_COUNTS))}, q rounded to fp8 per tensor on the "
               "device (q_compute_dtype fp8)",
               f"target-verify batches (<= {MAX_VERIFY_TOKENS} draft tokens per sequence, "
               "causal) are one kernel call of s_q tokens per sequence, eagerly and in the "
               "decode graphs; draft-extend batches (ragged accepted lengths) are not served",
               "log-sum-exp (return_lse) from the bf16-pool kernel only",
               _SCHEDULER_NOTE,
               f"sparse (DSA) MLA, decode and extend, heads "
               f"{', '.join(map(str, SPARSE_HEAD_COUNTS))}, top-k up to {SPARSE_MAX_TOP_K}: "
               f"fp8_ds_mla rows (656 bytes) through the sparse fp8 decode kernel (top-k "
               f"multiples of {SPARSE_TOP_K_MULTIPLE}), bf16 rows through the sparse prefill "
               f"kernel (multiples of {SPARSE_PREFILL_TOP_K_MULTIPLE}, with its LSE); captured "
               "in decode FULL and prefill BREAKABLE graphs"),
    )
