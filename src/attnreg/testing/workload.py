"""Inputs and expected outputs of one named batch: the oracle of the suite (float64).

A :class:`Workload` holds a batch over a (canary-filled) KV pool whose prefix
tokens the harness wrote itself, random queries and new KV rows, and the
output a float64 dense computation over the *logical* sequences gives.

The oracle is deliberately independent of every backend, the reference one
included: it never reads the pool through a page table, it attends over the
per-sequence rows the harness generated, rounded exactly as the pool stores
them (:meth:`MLAKVPool.quantize_roundtrip`).  So a paging bug in the reference
backend is caught like any other.  The math is the reference backend's:
float64 scores, bottom-right causal mask, softmax, weighted sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from attnreg.registry import DType, ForwardMethod, ForwardMode, SparseKVFormat
from attnreg.runtime import (
    FP8_E4M3_MAX,
    ForwardBatch,
    MLAConfig,
    MLAKVPool,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    output_dtype,
    quantize_q_fp8,
    torch_dtype,
    verify_batch,
)

from .batches import BatchSpec
from .claims import Combo, head_dims_config
from .integrity import guarded_pool, ledger_of, nonfinite_problem

__all__ = [
    "FP8_POOL_SCALE",
    "FP8_Q_GAINS",
    "LARGE_Q_GAINS",
    "LSE_TOLERANCE",
    "TOLERANCES",
    "Tolerance",
    "Workload",
    "compare",
    "compare_lse",
    "layer_scales",
    "make_config",
    "make_layer_workloads",
    "make_pool",
    "make_workload",
    "oracle_attention",
    "ragged_attention",
    "round_q",
]

#: fp8 pools use a non-trivial scale so a kernel that ignores ``kv_scale`` is caught.
FP8_POOL_SCALE = 0.5
#: A multi-layer fp8 pool's layers get these scales (in turn), so a kernel that reads
#: another layer's scale is caught.
FP8_LAYER_SCALES = (0.5, 0.25, 1.0, 0.125)


@dataclass(frozen=True)
class Tolerance:
    """``|out - expected| <= atol + rtol * |expected|`` elementwise."""

    atol: float
    rtol: float


#: Per output (= query) dtype.  The oracle sees the inputs already rounded to
#: their storage dtypes, so what remains is the kernel's own rounding: the
#: softmax probabilities in the query dtype before ``P @ V`` (flash-style
#: kernels) and the output cast.  Outputs are averages of N(0, 1) values
#: (|o| < ~1.5), so an absolute floor dominates.
#: ``FP8_E4M3`` is for kernels that declare ``q_compute_dtype=fp8_e4m3`` (fp8 x fp8
#: products, probabilities rounded to fp8 before ``P @ V``; e4m3's unit roundoff is
#: 2**-4): FlashMLA 1.0.0's dense FP8 decode on the H200 needed at most 0.062 over
#: 384 configurations (16-128 heads, lengths 1-8000, two kv and q scales, three
#: seeds; oracle rounding q as the kernel does), its bf16 path 0.005.
#: Per-row gains of a large-query workload (``make_workload(..., q_gains=...)``), cycled
#: over the query rows: absorbed MLA queries (q_nope @ W_UK) of real models reach
#: |q| ~ 1000-4000, beyond fp8 e4m3's 448.  Powers of two, so the gained q is exact in
#: every query dtype; the first row is always gained (a one-row batch has one).  A
#: gained N(0, 1) row peaks near 4 x its gain.
LARGE_Q_GAINS: tuple[float, ...] = (1024.0, 1.0, 256.0)

TOLERANCES: dict[DType, Tolerance] = {
    DType.FP32: Tolerance(2e-4, 2e-4),
    DType.FP16: Tolerance(4e-3, 4e-3),
    DType.BF16: Tolerance(2e-2, 2e-2),
    DType.FP8_E4M3: Tolerance(8e-2, 8e-2),
}


#: The magnitudes of an engine's fp8 queries, by workload seed plus layer: each gain moves
#: the power-of-two ``q_scale`` by a factor of 2 to 16 from the one before, so no two
#: consecutive seeds share one, nor two adjacent layers of one step (a backend that
#: keeps a scale it saw before, or one layer's for the step, is refuted).
FP8_Q_GAINS = (1.0, 4.0, 0.25, 2.0, 0.5)


def make_config(combo: Combo, device: str, *, max_context_len: int = 8192) -> MLAConfig:
    """The MLAConfig of a claim's combination (head dims become config fields; a combo's
    ``sm_scale`` the config's, None keeping the default)."""
    dims = head_dims_config(combo.method, combo.head_dims) or {}
    kwargs: dict[str, int] = {}
    if combo.method is ForwardMethod.MLA:
        kwargs["kv_lora_rank"] = dims.get("kv_lora_rank", 512)
        kwargs["qk_rope_head_dim"] = dims.get("qk_rope_head_dim", 64)
    else:
        kwargs["qk_nope_head_dim"] = dims.get("qk_nope_head_dim", 128)
        kwargs["v_head_dim"] = dims.get("v_head_dim", 128)
        kwargs["qk_rope_head_dim"] = dims.get("qk_rope_head_dim", 64)
    return MLAConfig(num_heads=combo.num_heads, page_size=combo.page_size,
                     kv_dtype=combo.kv_dtype, q_dtype=combo.q_dtype, device=device,
                     max_context_len=max_context_len, sm_scale=combo.sm_scale, **kwargs)


def layer_scales(config: MLAConfig, num_layers: int = 1) -> list[float]:
    """The FP8 scale of each layer of a suite pool (1.0 for 16/32-bit pools)."""
    if DType.parse(config.kv_dtype) is not DType.FP8_E4M3:
        return [1.0] * num_layers
    if num_layers == 1:
        return [FP8_POOL_SCALE]
    return [FP8_LAYER_SCALES[i % len(FP8_LAYER_SCALES)] for i in range(num_layers)]


def make_pool(config: MLAConfig, specs: Sequence[BatchSpec], *, spare_pages: int = 2,
              num_layers: int = 1, kv_format: SparseKVFormat | str | None = None) -> MLAKVPool:
    """A pool big enough for every spec at once (pages are never reused between them).

    Guarded and ledgered (:func:`~attnreg.testing.integrity.guarded_pool`): every
    row starts as a finite fill value, and :func:`~attnreg.testing.integrity.kv_problems`
    checks a step against a byte copy of the whole pool.  ``kv_format``: the rows'
    format (``fp8_ds_mla``: 656-byte rows with their own scales, for a sparse kernel
    that declares them; None: dense rows of ``config.kv_dtype``).
    """
    pages = sum(-(-n // config.page_size) for s in specs for n in s.seq_lens)
    packed = kv_format is not None and SparseKVFormat(kv_format) is SparseKVFormat.FP8_DS_MLA
    return guarded_pool(1 + pages + spare_pages, config.page_size, num_layers=num_layers,
                        kv_dtype=config.kv_dtype, device=config.device,
                        kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim,
                        scale=1.0 if packed else layer_scales(config, num_layers),
                        kv_format=SparseKVFormat.FP8_DS_MLA if packed else None)


@dataclass
class Workload:
    """One batch ready to run on one pool layer, with what it must produce.

    ``q`` / ``latent_new`` / ``rope_new`` / ``k`` / ``v`` are in the query
    dtype on the device; ``expected`` is float32 ``[rows, H, Dv]`` on the cpu
    and ``expected_lse`` its float32 log-sum-exp ``[rows, H]``; ``new_rows``
    the float32 rows layer ``layer_id`` must hold at ``batch.out_cache_loc``
    after the forward; ``prefix_slots`` the slots the harness wrote when it
    built the workload, ``new_slots`` those the forward writes.  For chunked-
    prefix MHA, ``k`` / ``v`` are the new tokens' only and ``decompress`` maps
    cached prefix rows to their K / V (``chunk_tokens`` per chunk).
    """

    spec: BatchSpec
    method: ForwardMethod
    batch: ForwardBatch
    q: torch.Tensor
    latent_new: torch.Tensor
    rope_new: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    expected: torch.Tensor
    new_rows: torch.Tensor
    prefix_slots: list[int]
    new_slots: list[int]
    expected_lse: torch.Tensor | None = None
    layer_id: int = 0
    pages: list[list[int]] = field(default_factory=list)
    decompress: Callable[[torch.Tensor, torch.Tensor],
                         tuple[torch.Tensor, torch.Tensor]] | None = None
    chunk_tokens: int | None = None
    #: the declared kernel's ``q_compute_dtype`` the oracle rounded q to (None: none)
    q_compute_dtype: DType | None = None
    #: and its ``q_compute_scale``: one scale per batch, or per query row
    q_compute_scale: str = "batch"
    #: an fp8 ``q``'s float32 ``[1]`` dequantisation scale (``forward_*(q_scale=)``)
    q_scale: torch.Tensor | None = None
    #: absorbed MLA built with ``alt_q_rounding``: the oracle's output for ``q`` rounded
    #: that other way (what the ``q_rounding`` claims also hold an output against)
    expected_alt: torch.Tensor | None = None

    def tolerance_dtype(self, q_dtype: DType) -> DType:
        """The dtype whose :data:`TOLERANCES` entry the output is held to: the kernel's
        declared compute dtype when it has one (it rounds its softmax probabilities
        to it as well), else the query dtype."""
        return self.q_compute_dtype or q_dtype

    @property
    def written_slots(self) -> list[int]:
        """Every slot this workload writes: its prefixes, then its new tokens."""
        return self.prefix_slots + self.new_slots

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def with_index_dtype(self, dtype: torch.dtype, fields: Sequence[str]) -> Workload:
        """A copy whose batch carries ``fields`` (e.g. ``seq_lens``) in ``dtype``."""
        changed = {name: getattr(self.batch, name).to(dtype) for name in fields}
        return replace(self, batch=replace(self.batch, **changed))


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def round_q(q: torch.Tensor, dtype: DType | None, scale_per: str = "batch") -> torch.Tensor:
    """``q`` as a kernel whose ``q_compute_dtype`` is ``dtype`` computes with it (float32).

    attnreg's convention (``KernelConstraints.q_compute_dtype``): one
    power-of-two scale for the whole batch (``scale_per`` "batch"; every row of
    a workload is a real query row, so all of them set it) or for each query
    row (``scale_per`` "row": each token's head, over its last dim), the
    smallest with ``max|q| / scale <= 448``, then one round to the nearest fp8
    e4m3 value.  ``dtype`` None: ``q`` unchanged.
    """
    if dtype is None:
        return q
    if DType.parse(dtype) is not DType.FP8_E4M3:
        raise ValueError(f"the oracle rounds q only to fp8_e4m3, not {dtype}")
    if scale_per not in ("batch", "row"):
        raise ValueError(f"round_q: scale_per must be 'batch' or 'row', not {scale_per!r}")
    qf = q.float()
    if qf.numel() == 0:  # an idle batch: nothing to round (amax of no element raises)
        return qf
    # float32 arithmetic, as on the device: the same scale bit for bit
    amax = qf.abs().amax() if scale_per == "batch" else qf.abs().amax(-1, keepdim=True)
    ratio = torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(ratio)
    scale = torch.ldexp(torch.ones_like(ratio), exponent - (mantissa == 0.5).to(exponent.dtype))
    return (qf / scale).to(torch.float8_e4m3fn).float() * scale


def _batch_for(pool: MLAKVPool, spec: BatchSpec, pages: list[list[int]]) -> ForwardBatch:
    mode = spec.mode
    if mode is ForwardMode.DECODE:
        return decode_batch(pool, spec.seq_lens, pages=pages)
    if mode is ForwardMode.TARGET_VERIFY:
        # an idle batch (no sequence) has no draft count of its own: any one is no token
        drafts = spec.extend_lens[0] if spec.seqs else 1
        return verify_batch(pool, spec.prefix_lens, drafts, pages=pages)
    if mode is ForwardMode.DRAFT_EXTEND:
        return draft_extend_batch(pool, spec.prefix_lens, spec.extend_lens, pages=pages)
    return extend_batch(pool, spec.prefix_lens, spec.extend_lens, pages=pages)


class _Decompress:
    """A fixed random projection of cached rows to MHA K / V (the harness's ``kv_b_proj``).

    Computed in float64 and rounded to q's dtype, so the backend's calls (one per
    prefix chunk) and the oracle's (one per sequence) give the same values.
    """

    def __init__(self, gen: torch.Generator, row_dim: int, heads: int, qk: int, v: int,
                 latent: int) -> None:
        self.heads, self.qk, self.v, self.latent = heads, qk, v, latent
        self.weight = torch.randn(row_dim, heads * (qk + v), generator=gen,
                                  dtype=torch.float64) / row_dim ** 0.5

    def __call__(self, latent: torch.Tensor, rope: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.cat([latent, rope], dim=-1).double()
        x = rows @ self.weight.to(rows.device)
        h = self.heads
        k = x[:, :h * self.qk].reshape(-1, h, self.qk).to(latent.dtype)
        v = x[:, h * self.qk:].reshape(-1, h, self.v).to(latent.dtype)
        return k, v


def _layout(spec: BatchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the flat rows of ``spec``'s sequences, one after another (prefix, then new
    tokens): each row's sequence, its position in it, and whether it is cached."""
    lengths = torch.tensor(spec.seq_lens, dtype=torch.long)
    prefixes = torch.tensor(spec.prefix_lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(spec.seqs)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(int(lengths.sum())) - starts[seq]
    return seq, pos, pos < prefixes[seq]


def _flat_slots(pool: MLAKVPool, pages: Sequence[Sequence[int]], seq: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
    """:meth:`MLAKVPool.slots` of every flat row at once (int64, cpu)."""
    ps = pool.page_size
    width = max((len(p) for p in pages), default=0) or 1
    table = torch.tensor([list(p) + [0] * (width - len(p)) for p in pages],
                         dtype=torch.long).reshape(len(pages), width)
    return table[seq, torch.div(pos, ps, rounding_mode="floor")] * ps + pos % ps


def make_workload(config: MLAConfig, pool: MLAKVPool, spec: BatchSpec, method: ForwardMethod,
                  *, seed: int, q_dtype: DType | None = None, layer_id: int = 0,
                  pages: list[list[int]] | None = None, batch: ForwardBatch | None = None,
                  chunk_tokens: int | None = None,
                  q_compute_dtype: DType | None = None,
                  q_compute_scale: str = "batch",
                  q_gains: Sequence[float] | None = None,
                  alt_q_rounding: tuple[DType | None, str] | None = None) -> Workload:
    """Write the prefixes of ``spec`` into layer ``layer_id`` of ``pool``, build the batch,
    compute the oracle.

    Pages are taken from the pool in shuffled order (a kernel assuming
    contiguous pages is caught), unless ``pages`` (and the ``batch`` built on
    them) are given: another layer of the same step.  ``q_dtype`` overrides
    the config's (refusal claims pass undeclared dtypes through here).
    ``q_compute_dtype``: the declared kernel computes with q rounded to it, with one
    scale per ``q_compute_scale`` (:func:`round_q`), so the oracle does too.  ``q_gains``: absorbed MLA queries
    only, row ``i`` of q multiplied by ``q_gains[i % len(q_gains)]`` (e.g.
    :data:`LARGE_Q_GAINS`) before the oracle sees it.  ``alt_q_rounding``: absorbed MLA
    from a 16-bit q only, ``(q_compute_dtype, q_compute_scale)`` of a second oracle over
    the same rows (``expected_alt``).

    Every sequence is built at once (one write of all prefixes, one rounding, one
    batched oracle): a 256-sequence batch costs about what a handful of sequences
    did one by one.  The random draws are the per-sequence ones, in order.
    """
    gen = torch.Generator().manual_seed(seed)
    dev = pool.device
    layer = pool.layer(layer_id)
    qdt = torch_dtype(q_dtype or DType.parse(config.q_dtype))
    lora = pool.kv_lora_rank
    if pages is None:
        pages = pool.allocate(spec.seq_lens, shuffle=seed + 1)
    # torch cannot draw random fp8 values directly: draw in float32, then cast.  One
    # draw per sequence, in order (the contents the suite has always used)
    raw = torch.empty(sum(spec.seq_lens), pool.row_dim)
    start = 0
    for length in spec.seq_lens:
        torch.randn(length, pool.row_dim, generator=gen, out=raw[start:start + length])
        start += length
    seq, pos, cached = _layout(spec)
    slots = _flat_slots(pool, pages, seq, pos)
    prefix_rows = raw[cached].to(dev)
    if prefix_rows.shape[0]:
        layer.write(slots[cached].to(device=dev, dtype=torch.int32),
                    prefix_rows[:, :lora], prefix_rows[:, lora:])
    # the model hands new rows in its own dtype: q's, bf16 beside an fp8 q
    new = raw[~cached].to(output_dtype(qdt))
    # every sequence's rows as the pool stores them (float32, on the device): the oracle's
    stored = layer.quantize_roundtrip(raw.to(dev))
    stored_new = layer.quantize_roundtrip(new.float().to(dev))
    stored[(~cached).to(dev)] = stored_new
    if batch is None:
        batch = _batch_for(pool, spec, pages)
    heads = config.num_heads
    rows = batch.num_tokens
    k = v = None
    decompress = None
    q_scale = None
    expected_alt = None
    if method is ForwardMethod.MLA:
        q = _randn(gen, rows, heads, pool.row_dim)
        if q_gains:
            gains = torch.tensor([float(q_gains[i % len(q_gains)]) for i in range(rows)])
            q = q * gains[:, None, None]
        if qdt == torch.float8_e4m3fn:
            # an engine's fp8 q: the model's q rounded with attnreg's one power-of-two
            # scale per batch (the runtime's own rounding), handed with that scale.  Its
            # magnitude moves with the seed and the layer (FP8_Q_GAINS: x1/4 .. x4), so the
            # workloads of one claim, and the layers of one step, carry different scales
            gain = FP8_Q_GAINS[(seed + layer_id) % len(FP8_Q_GAINS)]
            q, q_scale = quantize_q_fp8((q * gain).to(torch.bfloat16).to(dev),
                                        torch.ones(rows, dtype=torch.bool, device=dev))
            oracle_q = q.float() * q_scale
        else:
            q = q.to(qdt).to(dev)
            oracle_q = round_q(q, q_compute_dtype, q_compute_scale)
        expected, lse = oracle_mla(oracle_q, stored, spec, lora, config.softmax_scale)
        if alt_q_rounding is not None and qdt != torch.float8_e4m3fn:
            expected_alt = oracle_mla(round_q(q, *alt_q_rounding), stored, spec, lora,
                                      config.softmax_scale)[0]
    elif method is ForwardMethod.MHA_CHUNKED_KV:
        qk, dv = config.mha_head_dims
        q = _randn(gen, rows, heads, qk).to(qdt).to(dev)
        k = _randn(gen, rows, heads, qk).to(qdt).to(dev)
        v = _randn(gen, rows, heads, dv).to(qdt).to(dev)
        decompress = _Decompress(gen, pool.row_dim, heads, qk, dv, lora)
        expected, lse = oracle_chunked(q, k, v, stored, spec, decompress, lora,
                                       config.softmax_scale)
    else:
        qk, dv = config.mha_head_dims
        q = _randn(gen, rows, heads, qk).to(qdt).to(dev)
        k = _randn(gen, batch.num_kv_tokens, heads, qk).to(qdt).to(dev)
        v = _randn(gen, batch.num_kv_tokens, heads, dv).to(qdt).to(dev)
        expected, lse = oracle_mha(q, k, v, spec, config.softmax_scale)
    work = Workload(spec=spec, method=method, batch=batch, q=q,
                    latent_new=new[:, :lora].contiguous().to(dev),
                    rope_new=new[:, lora:].contiguous().to(dev), k=k, v=v, expected=expected,
                    new_rows=stored_new.cpu(), prefix_slots=slots[cached].tolist(),
                    new_slots=slots[~cached].tolist(), expected_lse=lse, layer_id=layer_id,
                    pages=[list(p) for p in pages], decompress=decompress,
                    chunk_tokens=chunk_tokens, q_compute_dtype=q_compute_dtype,
                    q_compute_scale=q_compute_scale, q_scale=q_scale, expected_alt=expected_alt)
    ledger = ledger_of(pool)
    if ledger is not None:
        # the prefixes just written are the pool's new baseline; the slots are this
        # workload's (named in a refutation)
        ledger.own([work])
        ledger.snapshot()
    return work


def make_layer_workloads(config: MLAConfig, pool: MLAKVPool, spec: BatchSpec,
                         method: ForwardMethod, *, seed: int,
                         q_compute_dtype: DType | None = None,
                         q_compute_scale: str = "batch") -> list[Workload]:
    """One workload per layer of ``pool``, one batch for all of them (a step of a model).

    Every layer gets its own prefix contents, queries and new rows (and, for an
    fp8 pool, its own scale), so a forward that reads another layer is caught.
    """
    first = make_workload(config, pool, spec, method, seed=seed,
                          q_compute_dtype=q_compute_dtype, q_compute_scale=q_compute_scale)
    works = [first]
    for layer_id in range(1, pool.num_layers):
        works.append(make_workload(config, pool, spec, method, seed=seed + 1000 * layer_id,
                                   layer_id=layer_id, pages=first.pages, batch=first.batch,
                                   q_compute_dtype=q_compute_dtype,
                                   q_compute_scale=q_compute_scale))
    return works


def oracle_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float, *, causal: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [E, H, D]`` over ``keys [L, H|1, D]``, ``values [L, H|1, Dv]``.

    Float64 on q's device; bottom-right causal (query ``i`` sees keys ``0 .. L - E +
    i``) unless ``causal=False``.  Returns float32 ``out [E, H, Dv]`` and the
    natural-log LSE ``[E, H]`` on the cpu; a query that sees no key gets 0 and
    ``-inf``.
    """
    e, length = q.shape[0], keys.shape[0]
    dev = q.device
    heads = q.shape[1]
    if length == 0:
        return (torch.zeros(e, heads, values.shape[-1]),
                torch.full((e, heads), float("-inf")))
    # float64 on the device: exact enough to be the truth, and free of TF32 matmuls
    qf = q.double()
    kf = keys.to(dev, torch.float64).expand(length, heads, keys.shape[-1])
    vf = values.to(dev, torch.float64).expand(length, heads, values.shape[-1])
    scores = torch.einsum("ehd,lhd->hel", qf, kf) * scale
    if causal:
        visible = (torch.arange(length, device=dev)[None, :]
                   <= (torch.arange(e, device=dev) + (length - e))[:, None])
        scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                    # [H, E]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.einsum("hel,lhd->ehd", torch.exp(scores - safe[..., None]), vf)
    return out.float().cpu(), lse.transpose(0, 1).float().cpu()


#: Elements of the largest float64 tensor (scores, gathered keys or values) one batched
#: oracle step builds: sequences are grouped up to it (a longer sequence goes alone).
ORACLE_GROUP_ELEMENTS = 1 << 24


def _prefix_sums(lengths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def _groups(q_lens: Sequence[int], kv_lens: Sequence[int], cost_per_pair: int,
            cost_per_key: int, limit: int) -> list[list[int]]:
    """Sequences grouped (by length, so little is padded) with each group's padded
    tensors within ``limit`` elements; every sequence is in exactly one group."""
    order = sorted(range(len(q_lens)), key=lambda b: (kv_lens[b], q_lens[b]))
    groups: list[list[int]] = []
    cur: list[int] = []
    e_max = l_max = 0
    for b in order:
        e, length = max(e_max, q_lens[b]), max(l_max, kv_lens[b])
        size = (len(cur) + 1) * max(e * length * cost_per_pair, length * cost_per_key)
        if cur and size > limit:
            groups.append(cur)
            cur, e, length = [], q_lens[b], kv_lens[b]
        cur.append(b)
        e_max, l_max = e, length
    if cur:
        groups.append(cur)
    return groups


def ragged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | int,
                     q_lens: Sequence[int], kv_lens: Sequence[int], scale: float, *,
                     causal: bool = True, max_elements: int = ORACLE_GROUP_ELEMENTS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`oracle_attention` of every sequence of a ragged batch, batched.

    Sequence ``b`` owns query rows ``q_lens[b]`` of ``q [sum q_lens, H, D]`` and key /
    value rows ``kv_lens[b]`` of ``keys [sum kv_lens, H|1, D]`` (or ``[sum, D]``: one
    head shared by all, absorbed MLA) and ``values`` (or, an int ``n``: the first ``n``
    columns of the keys, absorbed MLA's latent part), one sequence after another;
    bottom-right causal per sequence unless ``causal=False``.  Sequences of similar
    length are padded into groups (masked keys; at most ``max_elements`` per padded
    float64 tensor) and each group is one float64 computation on q's device, so the
    result equals the per-sequence one up to float64 rounding.  Returns float32
    ``out [sum q_lens, H, Dv]`` and the natural-log LSE ``[sum q_lens, H]`` on the
    cpu; a query that sees no key gets 0 and ``-inf``.
    """
    dev = q.device
    total, heads = q.shape[0], q.shape[1]
    shared = keys.dim() == 2  # one key head for every query head
    k3 = keys[:, None, :] if shared else keys
    from_keys = isinstance(values, int)
    v3 = k3 if isinstance(values, int) else (values[:, None, :] if values.dim() == 2
                                             else values)
    dv = values if isinstance(values, int) else v3.shape[-1]
    out = torch.zeros(total, heads, dv, dtype=torch.float64, device=dev)
    lse = torch.full((total, heads), float("-inf"), dtype=torch.float64, device=dev)
    if total == 0:
        return out.float().cpu(), lse.float().cpu()
    q_starts, kv_starts = _prefix_sums(q_lens), _prefix_sums(kv_lens)
    qf = q.double()
    key_cost = k3.shape[1] * (k3.shape[-1] + (0 if from_keys else dv))
    for group in _groups(q_lens, kv_lens, heads, key_cost, max_elements):
        e_max = max(q_lens[b] for b in group)
        l_max = max(kv_lens[b] for b in group)
        if e_max == 0 or l_max == 0:
            continue  # no query rows, or nothing to see: 0 and -inf
        ql = torch.tensor([q_lens[b] for b in group], device=dev)
        kl = torch.tensor([kv_lens[b] for b in group], device=dev)
        qs = torch.tensor([q_starts[b] for b in group], device=dev)
        ks = torch.tensor([kv_starts[b] for b in group], device=dev)
        ar_e = torch.arange(e_max, device=dev)
        ar_l = torch.arange(l_max, device=dev)
        q_ok = ar_e[None, :] < ql[:, None]                                  # [G, E]
        k_ok = ar_l[None, :] < kl[:, None]                                  # [G, L]
        q_idx = torch.where(q_ok, qs[:, None] + ar_e[None, :], 0)
        k_idx = torch.where(k_ok, ks[:, None] + ar_l[None, :], 0)
        kp = k3[k_idx].to(dev, torch.float64)                               # [G, L, Hk, D]
        vp = kp[..., :dv] if from_keys else v3[k_idx].to(dev, torch.float64)  # [G, L, Hk, Dv]
        qp = qf[q_idx]                                                      # [G, E, H, D]
        if kp.shape[2] == 1:
            scores = torch.einsum("gehd,gld->ghel", qp, kp[:, :, 0]) * scale
        else:
            scores = torch.einsum("gehd,glhd->ghel", qp, kp) * scale
        visible = k_ok[:, None, :].expand(-1, e_max, -1)                    # [G, E, L]
        if causal:
            # query i of a sequence sees keys 0 .. kv_len - q_len + i
            last = ar_e[None, :] + (kl - ql)[:, None]                       # [G, E]
            visible = visible & (ar_l[None, None, :] <= last[:, :, None])
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        group_lse = torch.logsumexp(scores, dim=-1)                          # [G, H, E]
        safe = torch.where(torch.isfinite(group_lse), group_lse,
                           torch.zeros_like(group_lse))
        probs = torch.exp(scores - safe[..., None])
        if vp.shape[2] == 1:
            o = torch.einsum("ghel,gld->gehd", probs, vp[:, :, 0])
        else:
            o = torch.einsum("ghel,glhd->gehd", probs, vp)
        rows = q_idx[q_ok]
        out[rows] = o[q_ok]
        lse[rows] = group_lse.permute(0, 2, 1)[q_ok]
    return out.float().cpu(), lse.float().cpu()


def _flat(rows: torch.Tensor | Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per-sequence rows (a list) or already one tensor: one tensor on ``device``."""
    if isinstance(rows, torch.Tensor):
        return rows.to(device)
    return torch.cat([r.to(device) for r in rows]) if len(rows) else torch.zeros(0, device=device)


def oracle_mla(q: torch.Tensor, seq_rows: torch.Tensor | Sequence[torch.Tensor],
               spec: BatchSpec, latent: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA: every head attends over the 576-wide rows, values = the latent part.

    ``seq_rows``: every sequence's rows ``[L, 576]`` as the pool stores them (float32),
    one sequence after another in one tensor, or a list of one tensor per sequence.
    Serves every forward mode: decode, extend, verify and draft extend are all
    "the new tokens of each sequence, bottom-right causal over the whole sequence".
    """
    rows = _flat(seq_rows, q.device)
    return ragged_attention(q, rows, latent, spec.extend_lens, spec.seq_lens, scale)


def oracle_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged MHA: sequence ``b`` owns K/V rows ``kv_indptr[b]:kv_indptr[b+1]``."""
    return ragged_attention(q, k, v, spec.extend_lens, spec.seq_lens, scale)


def oracle_chunked(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   seq_rows: torch.Tensor | Sequence[torch.Tensor], spec: BatchSpec,
                   decompress: Callable[[torch.Tensor, torch.Tensor],
                                        tuple[torch.Tensor, torch.Tensor]],
                   latent: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked-prefix MHA computes full MHA over the decompressed prefix + the new tokens.

    The prefix rows are decompressed as the backend reads them: the stored
    values in q's dtype (all prefixes in one call: the projection is per row).
    """
    rows = _flat(seq_rows, q.device)
    seq, pos, cached = _layout(spec)
    cached_rows = rows[cached.to(rows.device)].to(dtype=q.dtype)
    k_p, v_p = decompress(cached_rows[:, :latent], cached_rows[:, latent:])
    # each sequence's keys in the flat layout: its decompressed prefix rows, then its
    # new tokens' k / v rows
    prefixes = torch.tensor(spec.prefix_lens, dtype=torch.long)
    prefix_before = torch.tensor(_prefix_sums(spec.prefix_lens), dtype=torch.long)
    new_before = torch.tensor(_prefix_sums(spec.extend_lens), dtype=torch.long)
    index = torch.where(cached, prefix_before[seq] + pos,
                        k_p.shape[0] + new_before[seq] + pos - prefixes[seq]).to(q.device)
    keys = torch.cat([k_p, k_new])[index]
    values = torch.cat([v_p, v_new])[index]
    return ragged_attention(q, keys, values, spec.extend_lens, spec.seq_lens, scale)


def compare(out: torch.Tensor, expected: torch.Tensor, q_dtype: DType,
            spec: BatchSpec) -> str | None:
    """None when ``out`` matches ``expected`` within the dtype's tolerance, else why not."""
    got = out.detach().float().cpu()
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{spec.describe()}: output shape {tuple(got.shape)}, expected "
                f"{tuple(expected.shape)}")
    # a NaN is not a large error: named as what it is, before any tolerance
    nonfinite_msg = nonfinite_problem(got, expected, spec)
    if nonfinite_msg:
        return nonfinite_msg
    tol = TOLERANCES.get(q_dtype, TOLERANCES[DType.BF16])
    nonfinite = ~torch.isfinite(got)
    err = (got - expected).abs()
    bad = nonfinite | (err > tol.atol + tol.rtol * expected.abs())
    if not bool(bad.any()):
        return None
    err = torch.where(nonfinite, torch.full_like(err, float("inf")), err)
    flat = int(torch.argmax(err))
    row, head, col = (flat // (err.shape[1] * err.shape[2]),
                      (flat // err.shape[2]) % err.shape[1], flat % err.shape[2])
    seq, tok = _locate(row, spec)
    return (f"{spec.describe()}: output differs from the float64 oracle in "
            f"{int(bad.sum())}/{bad.numel()} elements (tolerance atol {tol.atol}, rtol "
            f"{tol.rtol} for {q_dtype}); worst |err| {float(err.view(-1)[flat]):.3g} at "
            f"sequence {seq} (prefix {spec.seqs[seq][0]}), new token {tok}, head {head}, "
            f"column {col}: got {float(got[row, head, col]):.4g}, expected "
            f"{float(expected[row, head, col]):.4g}"
            + (f"; {int(nonfinite.sum())} non-finite values" if bool(nonfinite.any()) else ""))


#: LSE tolerance, any dtype: the kernels sum exp(scores) of exactly rounded inputs in
#: float32, so only the summation order differs from the float64 oracle.
LSE_TOLERANCE = Tolerance(2e-3, 2e-4)


def compare_lse(lse: torch.Tensor, expected: torch.Tensor, spec: BatchSpec) -> str | None:
    """None when ``lse`` matches the oracle's (same ``-inf`` rows, finite rows within
    :data:`LSE_TOLERANCE`), else why not."""
    got = lse.detach().float().cpu()
    if tuple(got.shape) != tuple(expected.shape) or lse.dtype != torch.float32:
        return (f"{spec.describe()}: lse is {lse.dtype} {tuple(got.shape)}, expected "
                f"torch.float32 {tuple(expected.shape)}")
    finite = torch.isfinite(expected)
    wrong_inf = (torch.isfinite(got) != finite) | torch.isnan(got)
    err = torch.where(finite, (got - expected).abs(), torch.zeros_like(got))
    tol = LSE_TOLERANCE
    bad = wrong_inf | (err > tol.atol + tol.rtol * expected.abs().nan_to_num(posinf=0,
                                                                              neginf=0))
    if not bool(bad.any()):
        return None
    flat = int(torch.argmax(bad.flatten().to(torch.uint8) * (1 + err.flatten())))
    row, head = divmod(flat, got.shape[1])
    seq, tok = _locate(row, spec)
    return (f"{spec.describe()}: log-sum-exp differs from the float64 oracle's (natural log "
            f"of the summed exp(sm_scale * q . k)) in {int(bad.sum())}/{bad.numel()} "
            f"(token, head) pairs (tolerance atol {tol.atol}, rtol {tol.rtol}); e.g. "
            f"sequence {seq}, new token {tok}, head {head}: got {float(got[row, head]):.5g}, "
            f"expected {float(expected[row, head]):.5g} (a base-2 LSE would be "
            f"{float(expected[row, head]) / 0.6931471805599453:.5g})")


def _locate(row: int, spec: BatchSpec) -> tuple[int, int]:
    start = 0
    for i, (_, extend) in enumerate(spec.seqs):
        if row < start + extend:
            return i, row - start
        start += extend
    return len(spec.seqs) - 1, 0
