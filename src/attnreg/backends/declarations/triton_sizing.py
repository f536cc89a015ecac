"""Launch sizing of the Triton MLA kernels: split-KV heuristics and graph workspaces.

Pure arithmetic, no torch or triton import: the ``triton`` declaration
estimates its capture memory with these functions at startup, and the kernels
(``attnreg.backends._triton_kernels``) and the runtime
(``attnreg.backends.triton_mla``) size their launches and graph workspaces
with the same ones.  One formula, so what is declared is what is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from attnreg.registry import CaptureShape

__all__ = [
    "DEFAULT_NUM_SMS",
    "EXTEND_MIN_CHUNK_TOKENS",
    "FP8_SCORES_MIN_HEADS",
    "FP8_SCORES_T_MAX_HEADS",
    "FP8_WHOLE_PAGE_TILES",
    "LATENT",
    "MAX_SPLITS",
    "MIN_CHUNK_TOKENS",
    "PARTIAL_FLOATS_PER_ROW",
    "DecodeConfig",
    "SplitOptions",
    "decode_capture_bytes",
    "decode_config",
    "decode_graph_rows",
    "decode_partial_rows",
    "decode_rounds_q",
    "fp8_decode_head_ranges",
    "default_extend_splits",
    "default_max_splits",
    "extend_capture_bytes",
    "extend_partial_rows",
    "extend_tile",
    "splits_for_config",
    "verify_partial_rows",
]

#: Latent (= value) width of absorbed MLA: each split's partial output is this wide.
LATENT = 512
#: fp32 values one split keeps per (row, head): the partial output and its log-sum-exp.
PARTIAL_FLOATS_PER_ROW = LATENT + 1
#: Upper bound on a split count (the merge kernels reduce at most this many partials).
MAX_SPLITS = 256
#: Multiprocessors assumed when the device is unknown (startup estimates): above the
#: H100/H200 (132) and B200 (148), so an estimate does not come out short.
DEFAULT_NUM_SMS = 160

#: Default shortest chunk a split gets when the heuristic, not ``force_num_splits``, is in
#: charge: below a few hundred tokens the fixed cost of a program (loading up to 64x576
#: query values, the merge traffic of a 512-wide fp32 partial per head) outweighs the
#: parallelism it adds.  Each DecodeConfig carries its own value.
MIN_CHUNK_TOKENS = 256
#: Fewest query heads at which the decode kernel, over an fp8 cache, takes fp8 x fp8 score
#: dots on q rounded to fp8 per head row (``DecodeConfig.fp8_scores``: the 64-head tiles);
#: the ``triton`` declaration's ``q_compute_dtype`` / ``q_compute_scale`` hold from here.
FP8_SCORES_MIN_HEADS = 33
#: Most query heads at which the decode kernel, over an fp8 cache, takes its score dots
#: tokens-major (``DecodeConfig.fp8_scores_t``: S^T = K @ q^T, fp8 x fp8 on q rounded to fp8
#: per head row): from here to FP8_SCORES_MIN_HEADS - 1 it keeps 16-bit dots and exact q.
FP8_SCORES_T_MAX_HEADS = 16
#: Shortest page (tokens) at which the 16-head decode over an fp8 cache reads each 64-token
#: tile from one page and runs five stages at one program per SM (``decode_config``).
FP8_WHOLE_PAGE_TILES = 64
#: Shortest KV chunk an extend split gets from the heuristic: each split adds a 64-row x
#: 512 fp32 partial output to write and merge, which a few hundred tokens of attention repay.
EXTEND_MIN_CHUNK_TOKENS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class DecodeConfig(NamedTuple):
    """Launch configuration of the decode kernel (see :func:`decode_config`)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    isolate_qk: bool = False  # see the kernel: un-chain the QK dot (8 warps, 64 heads)
    ctas_per_sm: int = 1  # programs resident per SM: how many the split heuristic aims at
    min_chunk: int = MIN_CHUNK_TOKENS  # shortest split chunk (tokens) of the heuristic
    # fp8 cache only: fp16 dots, the score dot reading a second, transposed load of the
    # tile (an L2 hit), so each dot converts its own copy in its operand layout (see
    # kv_tile in _triton_kernels/_common.py); a bf16 q is cast to fp16 once per program,
    # exactly for 2^-14 <= |q| <= 65504
    fp8_two_loads: bool = False
    # a page of >= block_n tokens holds whole tiles: address a tile from one page-table
    # read instead of one per token (tile_rows in _triton_kernels/_common.py)
    page_tiles: bool = True
    # fp8 cache only: fp8 x fp8 score dots, q rounded to fp8 in the kernel with one
    # power-of-two scale per head row (declared: q_compute_dtype fp8, scale "row"); P @ V
    # in fp16 (see the kernel and kv_tile_fp8 in _triton_kernels/_common.py)
    fp8_scores: bool = False
    # with fp8_scores: the score dots tokens-major, S^T = K @ q^T, so the fp8 tile is the
    # dot's A operand as stored (K-contiguous) and q^T its B operand (rows of a 16-head
    # block are too few for a wgmma M); P^T is transposed back for a 16-bit P @ V
    fp8_scores_t: bool = False


def _is_fp8(kv_dtype: object) -> bool:
    # a torch dtype or an attnreg DType / name (this module imports neither torch nor triton)
    name = str(getattr(kv_dtype, "value", kv_dtype))
    return name.endswith(("float8_e4m3fn", "fp8_e4m3"))


def decode_config(num_heads: int, kv_dtype: object = None, page_size: int = 1) -> DecodeConfig:
    """Launch configuration for ``num_heads`` query heads and a ``kv_dtype`` cache of
    ``page_size``-token pages.

    Tuned on one H200 (issue 20, sweeps 1 and 2 of 2026-12-01, kernel time with the L2
    flushed, us; page size 1 unless said; docs/benchmarks-triton-tuning.md has the tables).

    * H <= 16 / 32: one head block holds every head; mma.sync tiles (M < 64), warps split
      the tokens, so no MMA work is duplicated.  Small shared-memory footprint: two
      programs fit on one SM, which the split heuristic uses for these memory-bound shapes.
      16-bit cache, 16 heads: three pipeline stages, where the page-table reads of the next
      tile become cp.async (with two they are synchronous loads in the loop): sweep 2
      170.9 vs 183.8 (B=128, L=4096), 102.6 vs 105.9 (B=32, L=8192); at B=1, L=32768
      33.3 vs 31.9 (a loss), where 128-token tiles with 8 warps would take 30.1 but lose
      at page 64 (34.7 vs 30.9) and at the larger batches (193.7, 109.0).
      fp8 cache, 16 heads: tokens-major fp8 score dots (``fp8_scores_t``: a 64-row fp8
      wgmma on the tile as stored, q rounded per head row, V converted in registers),
      64-token tiles, two stages (issue 31, ``scripts/probe_triton_fp8_mma.py
      --max-heads 16`` on an H100, 2026-12-07, page 1 / 64): 188.8 / 152.0, 112.4 / 90.7,
      33.4 / 28.5 us at the three shapes above, against 225.5 / 203.0, 127.8 / 115.8,
      36.2 / 33.9 for the 16-bit dots on two loads of each tile (``fp8_two_loads``, the
      default before) and 223.6 / 219.9, 130.3 / 126.7, 36.6 / 33.3 for the bf16 cache.
      From pages of :data:`FP8_WHOLE_PAGE_TILES` tokens up (a tile is one page): five
      stages and one program per SM, which gives the tile a second shared buffer (issue
      31, the same probe's ``fp8 s5 c1`` on an H100, 2026-12-07, page 64): 147.8, 85.4,
      24.8 us against 152.2, 91.7, 28.7 at two stages and two programs per SM.  At page
      1 (a page-table read per token) the same config loses: 220.4, 130.4, 34.3 against
      190.1, 113.2, 33.6.
    * H >= 64: head blocks of 64 (the wgmma M tile), 8 warps: the 64 x 512 fp32
      accumulator is 128 registers/thread.  ``isolate_qk`` keeps the two warpgroups from
      both computing the full score tile; BLOCK_N = 64 halves the shared-memory reads of
      the query per score (the QK wgmma reads its A operand, the query, from shared
      memory for every 16-wide k-step) and fits in 224 KB with two KV buffers.  Splits
      may go down to 64 tokens (B=8, L=1024: 30.8 us with 8 splits vs 43.4 with 4; issue
      26, `scripts/probe_decode_splits.py` on the H200, 2026-12-02, kernel + merge in a
      graph, bf16, page 1 / 64: B=1, L=2052, H=128 21.2 / 20.8 us with 33 splits vs 23.6 /
      23.4 with 17 at a 128-token floor; B=1, L=1024 20.0 / 18.7 vs 23.0 / 22.1; B=1,
      L=2052, H=64 19.9 / 19.3 vs 23.2 / 23.5; every other shape probed within 0.7 us;
      fp8 cache, `--fp8`: B=1, L=2052, H=128 21.9 / 22.2 vs 25.4 / 26.6, B=1, L=1024
      20.9 / 21.2 vs 25.5 / 26.1, none slower).
      No variant of sweep 1 beat it at more than one P1 shape, for either cache dtype.
      One-page tiles (page size 64): bf16 505.0 vs 572.0 per-token (B=128, L=4096),
      55.7 vs 65.3 (B=1, L=32768), 31.4 vs 32.7 (B=8, L=1024), 93.7 vs 99.3 (B=64,
      L=2048); with an fp8 cache they lose (715.2 vs 674.1, 33.5 vs 32.8, 114.3 vs
      110.6; 67.2 vs 68.2 the one gain) with fp16 dots on a converted tile.
      fp8 cache, 64+ heads: fp8 x fp8 score dots on q rounded per head row
      (``fp8_scores``; issue 31, ``scripts/probe_triton_fp8_mma.py`` on the H200,
      2026-12-03, graph replay, page 1 / 64): B=128, L=4096, H=128 527.5 / 517.9 us
      against 653.0 / 666.7 with fp16 dots (bf16 cache 535.2 / 502.4); B=64, L=2048,
      H=64 90.0 / 89.0 vs 103.5 / 107.4 (bf16 89.1 / 91.6); B=1, L=32768, H=128 55.8 /
      55.4 vs 62.0 / 63.8; B=8, L=1024, H=128 31.0 / 31.0 vs 31.1 / 31.6.  One-page
      tiles gain with it at page 64 (517.9 vs 545.0 per-token).  At 16 heads fp8 score
      dots are slower (318.3 vs 220.1 us at B=128, L=4096), so the fp16 dots stay.
      fp8 cache, 64+ heads, five stages (issue 31, the same probe on an H100,
      2026-12-07, page 1 / 64): Triton 3.6 gives a tile that is also read into registers
      (here V, converted for P @ V) one shared buffer below five stages, so the next
      tile's copy is issued after this one's last read and waited for at the top of the
      next iteration: with one program per SM nothing overlaps it.  At five stages the
      tile gets two buffers, the next one loading while this one is computed (189 KB,
      no spill; offline sm90 compile): B=128, L=4096, H=128 469.4 / 463.3 us against
      515.6 / 507.9 at three; B=64, L=2048, H=64 80.9 / 80.6 vs 90.9 / 89.5; B=1,
      L=32768, H=128 52.5 / 52.3 vs 57.2 / 56.4; B=8, L=1024, H=128 32.5 / 31.4 vs
      32.6 / 32.2.  A 16-bit tile already has two 64 KB buffers at three stages (229 KB).
    * Every config of one head class has the same ``block_h`` and ``min_chunk``; the
      16-bit config's ``ctas_per_sm`` is the class's largest, so the split count of
      :func:`default_max_splits` without a cache dtype and page size bounds every config's
      (the workspace estimates that know neither stay upper bounds).
    """
    fp8 = _is_fp8(kv_dtype)
    if num_heads <= FP8_SCORES_T_MAX_HEADS:
        if fp8 and page_size >= FP8_WHOLE_PAGE_TILES:
            return DecodeConfig(16, 64, 4, 5, ctas_per_sm=1, fp8_scores=True,
                                fp8_scores_t=True)
        if fp8:
            return DecodeConfig(16, 64, 4, 2, ctas_per_sm=2, fp8_scores=True,
                                fp8_scores_t=True)
        return DecodeConfig(16, 64, 4, 3, ctas_per_sm=2)
    if num_heads < FP8_SCORES_MIN_HEADS:
        return DecodeConfig(32, 64, 8, 2, ctas_per_sm=2)
    # five stages over an fp8 cache: the first count at which Triton 3.6 gives the tile two
    # shared buffers (the docstring's last paragraph); a 16-bit tile has two at three
    return DecodeConfig(64, 64, 8, 5 if fp8 else 3, isolate_qk=True, min_chunk=64,
                        page_tiles=True, fp8_scores=fp8)


def fp8_decode_head_ranges() -> tuple[tuple[int, int, bool], ...]:
    """``(min_heads, max_heads, rounds_q)`` of the decode kernel over an fp8 cache, 1 to
    128 heads: where it computes with q rounded to fp8 per head row (the declaration's
    entries, one per range; :func:`decode_rounds_q` agrees at every head count)."""
    return ((1, FP8_SCORES_T_MAX_HEADS, True),
            (FP8_SCORES_T_MAX_HEADS + 1, FP8_SCORES_MIN_HEADS - 1, False),
            (FP8_SCORES_MIN_HEADS, 128, True))


def decode_rounds_q(num_heads: int, kv_dtype: object) -> bool:
    """Whether a decode-phase step of ``num_heads`` over a ``kv_dtype`` cache computes with
    q rounded to fp8 per (token, head) row: the decode kernel's fp8 score dots, and the
    extend kernel on verify / draft-extend steps, so that both compute the same."""
    return decode_config(num_heads, kv_dtype).fp8_scores


def splits_for_config(cfg: DecodeConfig, batch_size: int, num_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """The split heuristic of :func:`default_max_splits` for a given config."""
    base = max(1, batch_size) * _cdiv(max(1, num_heads), cfg.block_h)
    splits = max(1, (num_sms * cfg.ctas_per_sm) // base)
    splits = min(splits, max(1, _cdiv(max(1, max_seq_len), cfg.min_chunk)), MAX_SPLITS)
    return int(splits)


def default_max_splits(batch_size: int, num_heads: int, max_seq_len: int, num_sms: int,
                       kv_dtype: object = None, page_size: int = 1) -> int:
    """Number of KV splits to build a decode launch (and its workspace) for.

    Heuristic: a launch without splits has ``batch_size * ceil(num_heads / BLOCK_H)``
    programs.  Add splits until the grid fills one wave of ``num_sms * ctas_per_sm``
    resident programs (``floor``, not ``ceil``: a partial extra wave costs a whole wave),
    but never make a chunk shorter than the config's ``min_chunk`` tokens of
    ``max_seq_len`` (shorter sequences get fewer splits on the device anyway).  Capped at
    256.

    Parameters
    ----------
    batch_size, num_heads : int
        Decode batch and query heads.
    max_seq_len : int
        Longest KV length the launch must serve (the capture-time bound for graphs).
    num_sms : int
        Multiprocessor count (``torch.cuda.get_device_properties(d).multi_processor_count``).
    kv_dtype, page_size
        The cache the launch reads (its config depends on both: :func:`decode_config`).
        Left out, the 16-bit cache's config, whose split count is the largest of its
        head class: an upper bound for a workspace sized before the cache is known.
    """
    return splits_for_config(decode_config(num_heads, kv_dtype, page_size), batch_size,
                             num_heads, max_seq_len, num_sms)


def extend_tile(num_heads: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_Q) of the extend kernel: 64 MMA rows per program (heads x queries)."""
    block_h = min(64, _next_pow2(max(1, num_heads)))
    return block_h, max(1, 64 // block_h)


def default_extend_splits(batch_size: int, num_tokens: int, num_heads: int, max_seq_len: int,
                          num_sms: int) -> int:
    """KV splits of an extend launch over ``num_tokens`` query rows in ``batch_size`` sequences.

    Without splits the launch has about ``(cdiv(num_tokens, BLOCK_Q) + batch_size - 1) *
    head blocks`` working programs (one per 64 query-head rows).  A short extend over a
    long prefix (a few new tokens at B=1) leaves most of the GPU idle; splits are added
    until one wave of ``num_sms`` programs is full, but no chunk gets shorter than
    :data:`EXTEND_MIN_CHUNK_TOKENS` of ``max_seq_len``.  Capped at 256.  Long extends
    get 1: they fill the GPU by themselves.
    """
    block_h, block_q = extend_tile(num_heads)
    blocks = _cdiv(max(1, num_tokens), block_q) + max(1, batch_size) - 1
    base = blocks * _cdiv(max(1, num_heads), block_h)
    splits = max(1, num_sms // base)
    splits = min(splits, max(1, _cdiv(max(1, max_seq_len), EXTEND_MIN_CHUNK_TOKENS)),
                 MAX_SPLITS)
    return int(splits)


@dataclass(frozen=True)
class SplitOptions:
    """The backend's split options (``max_kv_splits`` / ``force_kv_splits``).

    ``force`` replaces the heuristic (``1`` turns split-KV off); ``cap`` bounds it.
    """

    cap: int | None = None
    force: int | None = None

    def apply(self, heuristic: int) -> int:
        """The split count after the options."""
        if self.force is not None:
            return self.force
        if self.cap is not None:
            heuristic = min(heuristic, self.cap)
        return max(1, heuristic)


_DEFAULT_OPTIONS = SplitOptions()


def _sms(shape: CaptureShape) -> int:
    return shape.num_sms or DEFAULT_NUM_SMS


def decode_partial_rows(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """(sequence, split) rows of the decode graph workspace: ``max(bs * splits(bs))``.

    One flat buffer serves every captured batch size: a launch for ``bs``
    sequences with ``S`` splits views its first ``bs * S`` rows.  ``bs * S``
    stays near the SM count for small ``bs`` and is ``bs`` for large ``bs``, so
    the buffer is far smaller than ``[max_bs, splits(bs=1)]``.
    """
    sms = _sms(shape)
    return max(bs * options.apply(default_max_splits(bs, shape.num_heads, shape.max_seq_len,
                                                     sms, shape.kv_dtype, shape.page_size))
               for bs in range(1, shape.max_batch_size + 1))


def extend_partial_rows(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """(token, split) rows of the split-extend graph workspace (0: no captured shape splits).

    ``num_tokens x splits`` for the captured token count that needs the most,
    at one sequence (the most splits for a token count).  Only short extends
    split, so this stays near one wave of 64-row programs.
    """
    sms = _sms(shape)
    rows = 0
    for nt in range(1, shape.max_num_tokens + 1):
        s = options.apply(default_extend_splits(1, nt, shape.num_heads, shape.max_seq_len,
                                                sms))
        if s > 1:
            rows = max(rows, nt * s)
    return rows


def verify_partial_rows(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """(token, split) rows the speculative graphs of the decode phase need (0: none captured).

    Target-verify and draft-extend batches run the split extend kernel with
    ``q = ceil(max_num_tokens / max_batch_size)`` tokens per sequence; a graph
    for ``bs`` sequences views ``bs * q * splits(bs, bs * q)`` rows.  Decode
    graphs capture one token per sequence (``max_num_tokens == max_batch_size``):
    then 0.
    """
    bs_max, tokens = shape.max_batch_size, shape.max_num_tokens
    if tokens <= bs_max:
        return 0
    q = -(-tokens // bs_max)
    sms = _sms(shape)
    rows = 0
    for bs in range(1, bs_max + 1):
        s = options.apply(default_extend_splits(bs, bs * q, shape.num_heads, shape.max_seq_len,
                                                sms))
        if s > 1:
            rows = max(rows, bs * q * s)
    return rows


def decode_graph_rows(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """Rows of the one flat workspace every decode-phase graph views: decode and, where
    captured, verify / draft-extend graphs (they replay one at a time, so they share it)."""
    return max(decode_partial_rows(shape, options), verify_partial_rows(shape, options))


def _row_bytes(shape: CaptureShape) -> int:
    return shape.num_heads * PARTIAL_FLOATS_PER_ROW * 4


def decode_capture_bytes(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """Bytes of the FULL-decode graph workspace (decode, target verify, draft extend):
    fp32 partial outputs and LSEs."""
    return decode_graph_rows(shape, options) * _row_bytes(shape)


def extend_capture_bytes(shape: CaptureShape, options: SplitOptions = _DEFAULT_OPTIONS) -> int:
    """Bytes of the BREAKABLE-prefill (split extend) graph workspace."""
    return extend_partial_rows(shape, options) * _row_bytes(shape)
