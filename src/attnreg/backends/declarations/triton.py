"""Declaration of the ``triton`` backend (attnreg's own Triton MLA kernels).

Capture memory: the split-KV workspaces the runtime allocates in
``init_cuda_graph_state``, sized by :mod:`.triton_sizing` (the same functions
the kernels and the runtime use).  At DeepSeek-V3 sizes (128 heads, 256 decode
slots, 8192 tokens) the decode workspace is 64 MiB.

Speculative decoding: target-verify and draft-extend batches run the absorbed
*extend* kernel (a prefix plus a few causal query tokens per sequence is what
it computes), eagerly and inside the FULL decode graphs; see
:func:`attnreg.backends.triton_mla.TritonMLABackend` for why not the decode
kernel.  Every kernel returns the log-sum-exp (``lse``).
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
    SparseKernel,
    SparseKVFormat,
    SplitKV,
    Vendor,
)

from ._common import (
    HALF,
    MAX_DRAFT_TOKENS,
    MHA_DIMS,
    MLA_DIMS,
    SPECULATIVE_DECODE_MODES,
    SPECULATIVE_EAGER_MODES,
)
from .triton_sizing import (
    FP8_SCORES_T_MAX_HEADS,
    FP8_WHOLE_PAGE_TILES,
    decode_capture_bytes,
    decode_config,
    extend_capture_bytes,
    fp8_decode_head_ranges,
)

MIN_SM = 80
PAGE_SIZES = (1, 16, 32, 64)
DECODE_KERNEL = "triton mla_decode (split-KV; verify / draft extend: mla_extend)"
#: Page sizes at which the decode kernel over an fp8 cache, up to FP8_SCORES_T_MAX_HEADS
#: heads, runs its per-token-page config, and those (a page of whole tiles) at which it
#: runs the whole-page one (``triton_sizing.decode_config``).
FP8_PARTIAL_PAGE_SIZES = tuple(p for p in PAGE_SIZES if p < FP8_WHOLE_PAGE_TILES)
FP8_WHOLE_PAGE_SIZES = tuple(p for p in PAGE_SIZES if p >= FP8_WHOLE_PAGE_TILES)


def _fp8_decode_entries() -> tuple[tuple[int, int, tuple[int, ...], str, bool], ...]:
    """``(min_heads, max_heads, page_sizes, kernel note, rounds_q)`` of the decode entries
    over an fp8 cache: one per range of :func:`fp8_decode_head_ranges`, the range up to
    FP8_SCORES_T_MAX_HEADS heads split by page size too.  There the kernel computes
    differently from FP8_WHOLE_PAGE_TILES-token pages up (a tile is one page: another
    tile and stage config, one program per SM, so fewer KV splits and a smaller capture
    workspace), so the conformance suite claims that config, captured, at its own page
    size, as an engine with such pages captures it."""
    out: list[tuple[int, int, tuple[int, ...], str, bool]] = []
    for lo, hi, rounds in fp8_decode_head_ranges():
        note = ("; fp8 cache: fp8 score dots, q rounded per head row" if rounds
                else "; fp8 cache: 16-bit dots")
        if hi != FP8_SCORES_T_MAX_HEADS:
            out.append((lo, hi, PAGE_SIZES, note, rounds))
            continue
        whole = decode_config(hi, DType.FP8_E4M3, FP8_WHOLE_PAGE_TILES)
        out.append((lo, hi, FP8_PARTIAL_PAGE_SIZES, note, rounds))
        out.append((lo, hi, FP8_WHOLE_PAGE_SIZES,
                    f"{note}; pages >= {FP8_WHOLE_PAGE_TILES}: whole-page "
                    f"{whole.block_n}-token tiles, {whole.num_stages} stages", rounds))
    return tuple(out)

#: FULL decode: one flat fp32 workspace of partial outputs and LSEs serving every
#: captured batch size.
DECODE_CAPTURE_MEMORY = CaptureMemory(
    bytes_fn=decode_capture_bytes,
    formula="max over bs <= max_batch_size of bs x decode splits(bs, heads, max_seq_len, "
            "SMs), and, with speculative graphs (q = max_num_tokens / max_batch_size > 1), "
            "of bs x q x extend splits(bs, bs x q, ...) where > 1; x heads x (512 + 1) x 4 "
            "bytes")
#: BREAKABLE prefill: the split-extend workspace (0 when no captured token count splits).
EXTEND_CAPTURE_MEMORY = CaptureMemory(
    bytes_fn=extend_capture_bytes,
    formula="max over tokens <= max_num_tokens of tokens x extend splits(1, tokens, heads, "
            "max_seq_len, SMs) (only where > 1) x heads x (512 + 1) x 4 bytes")


def capabilities(ctx: DeclarationContext) -> Capabilities:
    plat = ctx.platform
    reason = ""
    if plat.vendor is Vendor.CUDA:
        if plat.sm is not None and plat.sm < MIN_SM:
            reason = f"needs sm{MIN_SM}+ (bf16 tensor cores); this is {plat}"
    elif plat.vendor is Vendor.CPU:
        if not ctx.triton_interpreter:
            reason = ("Triton kernels need a GPU; on cpu they run only under the Triton "
                      "interpreter (set TRITON_INTERPRET=1; slow, for tests)")
    else:
        reason = f"not validated on {plat.vendor} (declared for cuda sm{MIN_SM}+ only)"
    kernels: tuple[KernelConstraints, ...] = ()
    if not reason:
        # The kernels convert an fp8 cache to the query dtype in registers, but a
        # 16-bit cache must already be in the query dtype (bf16/bf16 or fp16/fp16;
        # they refuse bf16 queries over an fp16 cache): one entry per query dtype.
        # Decode over an fp8 cache computes differently by head count (up to 16 heads
        # tokens-major and from 33 up in 64-head tiles it takes fp8 x fp8 score dots on q
        # rounded per head row, and verify / draft-extend steps round q the same way;
        # 17-32 heads keep 16-bit dots), so its range is split there; and up to 16 heads
        # by page size (from 64-token pages: whole-page tiles, five stages, one program
        # per SM, so fewer splits and a smaller capture workspace; _fp8_decode_entries).
        kernels = tuple(
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE}), MLA_DIMS,
                              frozenset({dt}), frozenset(kv), page_sizes=pages,
                              min_heads=lo, max_heads=hi, kernel=DECODE_KERNEL + note,
                              split_kv=SplitKV.DYNAMIC, lse=True, q_compute_dtype=rounds,
                              q_compute_scale="row" if rounds else "batch")
            for dt in (DType.BF16, DType.FP16)
            for kv, lo, hi, pages, note, rounds in (
                ({dt}, 1, 128, PAGE_SIZES, "", None),
                *(({DType.FP8_E4M3}, lo, hi, pages, note,
                   DType.FP8_E4M3 if rounds else None)
                  for lo, hi, pages, note, rounds in _fp8_decode_entries()))
        ) + tuple(
            KernelConstraints(ForwardMethod.MLA, frozenset({Phase.PREFILL}), MLA_DIMS,
                              frozenset({dt}), frozenset({dt, DType.FP8_E4M3}),
                              page_sizes=PAGE_SIZES, max_heads=128,
                              kernel="triton mla_extend (split-KV)", split_kv=SplitKV.DYNAMIC,
                              lse=True)
            for dt in (DType.BF16, DType.FP16)
        ) + (
            KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF,
                              HALF, max_heads=128, kernel="triton mha_prefill", lse=True),
            KernelConstraints(ForwardMethod.MHA_CHUNKED_KV, frozenset({Phase.PREFILL}),
                              MHA_DIMS, HALF, HALF, max_heads=128,
                              kernel="triton mha_prefill (causal new tokens, unmasked prefix "
                                     "chunks)", lse=True),
        )
    modes = (
        # Decode graphs also serve speculative batches (up to MAX_DRAFT_TOKENS tokens
        # per sequence): the extend kernel's grid is static given the captured tokens
        # per sequence, its split counts are decided on the device.
        GraphModeSupport(Phase.DECODE, GraphMode.FULL, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC,
                         capture_memory=DECODE_CAPTURE_MEMORY,
                         forward_modes=SPECULATIVE_DECODE_MODES),
        # Breakable prefill captures attention: the absorbed extend kernel has a
        # static grid bounded by the captured token count, so MLA is pinned and
        # prefix batches can replay.  Its split count is fixed per captured shape and
        # its chunks are decided on the device, as in decode.
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, CaptureSupport.native(),
                         pinned_method=ForwardMethod.MLA, split_kv=SplitKV.DYNAMIC,
                         capture_memory=EXTEND_CAPTURE_MEMORY),
        GraphModeSupport(Phase.PREFILL, GraphMode.TC_PIECEWISE,
                         CaptureSupport.native("attention runs eagerly between pieces")),
    )
    # Sparse (DSA) decode over the pool's bf16 rows: mla_sparse_decode (one program per
    # sequence and head block, gathering its top-k slots; any width, the last tile
    # masked).  Decode only: the same kernel would serve extend rows, but no extend
    # claim was run.  FULL capture: grid and loop bound are shape facts, indices device
    # tensors, nothing allocated in the captured region.  Declared wherever the dense
    # kernels are: on the H200 (2026-12-02) `python scripts/probe_triton_sparse.py` passed
    # every case (page 1 / 64, 16 / 64 / 128 heads, top-k 16 / 40 / 2048, eager and
    # replayed with new indices) and `attnreg conformance --device cuda --backend triton
    # -k sparse` verified its claims (docs/sparse.md); on cpu under the interpreter.
    sparse: tuple[SparseKernel, ...] = ()
    sparse_modes: tuple[GraphModeSupport, ...] = ()
    if not reason:
        sparse = (SparseKernel(frozenset({Phase.DECODE}), frozenset({DType.BF16}),
                               SparseKVFormat.BF16, page_sizes=PAGE_SIZES, max_heads=128,
                               max_top_k=2048, kernel="triton mla_sparse_decode", lse=True),)
        sparse_modes = (GraphModeSupport(
            Phase.DECODE, GraphMode.FULL,
            CaptureSupport.native("indices are device tensors; grid and loop bound are "
                                  "shape facts; no workspace")),)
    return Capabilities(
        backend="triton", platform=plat, vendors=frozenset({Vendor.CUDA, Vendor.CPU}),
        kernels=kernels, graph_modes=modes, platform_reason=reason,
        priority=20, eager_forward_modes=SPECULATIVE_EAGER_MODES,
        sparse_kernels=sparse, sparse_graph_modes=sparse_modes,
        notes=(f"speculative batches (<= {MAX_DRAFT_TOKENS} draft tokens per sequence) run "
               "the extend kernel, in the decode graphs too",),
    )
