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

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from attnreg.registry import DType, ForwardMethod, Phase
from attnreg.runtime import (
    FP8_E4M3_MAX,
    ForwardBatch,
    MLAConfig,
    MLAKVPool,
    decode_batch,
    extend_batch,
    torch_dtype,
)

from .batches import BatchSpec
from .claims import Combo, head_dims_config

__all__ = [
    "FP8_POOL_SCALE",
    "TOLERANCES",
    "Tolerance",
    "Workload",
    "compare",
    "make_config",
    "make_pool",
    "make_workload",
    "oracle_attention",
    "round_q",
]

#: fp8 pools use a non-trivial scale so a kernel that ignores ``kv_scale`` is caught.
FP8_POOL_SCALE = 0.5


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
TOLERANCES: dict[DType, Tolerance] = {
    DType.FP32: Tolerance(2e-4, 2e-4),
    DType.FP16: Tolerance(4e-3, 4e-3),
    DType.BF16: Tolerance(2e-2, 2e-2),
}


def make_config(combo: Combo, device: str, *, max_context_len: int = 8192) -> MLAConfig:
    """The MLAConfig of a claim's combination (head dims become config fields)."""
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
                     max_context_len=max_context_len, **kwargs)


def make_pool(config: MLAConfig, specs: Sequence[BatchSpec], *, spare_pages: int = 2,
              canary: bool = True) -> MLAKVPool:
    """A pool big enough for every spec at once (pages are never reused between them)."""
    pages = sum(-(-n // config.page_size) for s in specs for n in s.seq_lens)
    scale = FP8_POOL_SCALE if DType.parse(config.kv_dtype) is DType.FP8_E4M3 else 1.0
    pool = config.make_pool(1 + pages + spare_pages, scale=scale)
    if canary:
        pool.fill_canary()
    return pool


@dataclass
class Workload:
    """One batch ready to run, with what it must produce.

    ``q`` / ``latent_new`` / ``rope_new`` / ``k`` / ``v`` are in the query
    dtype on the device; ``expected`` is float32 ``[rows, H, Dv]`` on the cpu;
    ``new_rows`` the float32 rows the pool must hold at ``batch.out_cache_loc``
    after the forward; ``prefix_slots`` the slots the harness wrote when it
    built the workload, ``new_slots`` those the forward writes.
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


def round_q(q: torch.Tensor, dtype: DType | None) -> torch.Tensor:
    """``q`` as a kernel whose ``q_compute_dtype`` is ``dtype`` computes with it (float32).

    attnreg's convention (``KernelConstraints.q_compute_dtype``): one
    power-of-two scale for the whole batch, the smallest with
    ``max|q| / scale <= 448``, then one round to the nearest fp8 e4m3 value.
    Every row of a workload is a real query row, so all of them set the scale.
    ``dtype`` None: ``q`` unchanged.
    """
    if dtype is None:
        return q
    if DType.parse(dtype) is not DType.FP8_E4M3:
        raise ValueError(f"the oracle rounds q only to fp8_e4m3, not {dtype}")
    qf = q.float()
    # float32 arithmetic, as on the device: the same scale bit for bit
    ratio = torch.clamp(qf.abs().amax() / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(ratio)
    power = int(exponent) - (1 if float(mantissa) == 0.5 else 0)
    scale = 2.0 ** power
    return (qf / scale).to(torch.float8_e4m3fn).float() * scale


def make_workload(config: MLAConfig, pool: MLAKVPool, spec: BatchSpec, method: ForwardMethod,
                  *, seed: int, q_dtype: DType | None = None,
                  q_compute_dtype: DType | None = None) -> Workload:
    """Write the prefixes of ``spec`` into ``pool``, build the batch, compute the oracle.

    Pages are taken from the pool in shuffled order (a kernel assuming
    contiguous pages is caught).  ``q_dtype`` overrides the config's (refusal
    claims pass undeclared dtypes through here).  ``q_compute_dtype``: the
    declared kernel computes with q rounded to it (:func:`round_q`), so the
    oracle does too.
    """
    gen = torch.Generator().manual_seed(seed)
    dev = pool.device
    qdt = torch_dtype(q_dtype or DType.parse(config.q_dtype))
    # torch cannot draw random fp8 values directly: draw in float32, then cast
    pages = pool.allocate(spec.seq_lens, shuffle=seed + 1)
    seq_rows: list[torch.Tensor] = []  # per sequence float32 [L, 576] as the pool stores it
    new_latent, new_rope, new_rows = [], [], []
    prefix_slots: list[int] = []
    new_slots: list[int] = []
    for owned, (prefix, extend) in zip(pages, spec.seqs):
        length = prefix + extend
        raw = _randn(gen, length, pool.row_dim)
        if prefix:
            slots = pool.slots(owned, range(prefix))
            pool.write(torch.tensor(slots, dtype=torch.int32, device=dev),
                       raw[:prefix, :pool.kv_lora_rank].to(dev),
                       raw[:prefix, pool.kv_lora_rank:].to(dev))
            prefix_slots.extend(slots)
        new = raw[prefix:].to(qdt)                  # the model hands new rows in q dtype
        new_latent.append(new[:, :pool.kv_lora_rank])
        new_rope.append(new[:, pool.kv_lora_rank:])
        stored_prefix = pool.quantize_roundtrip(raw[:prefix].to(dev)).cpu()
        stored_new = pool.quantize_roundtrip(new.float().to(dev)).cpu()
        new_rows.append(stored_new)
        seq_rows.append(torch.cat([stored_prefix, stored_new]))
        new_slots.extend(pool.slots(owned, range(prefix, length)))
    if spec.phase is Phase.DECODE:
        batch = decode_batch(pool, spec.seq_lens, pages=pages)
    else:
        batch = extend_batch(pool, spec.prefix_lens, spec.extend_lens, pages=pages)
    heads = config.num_heads
    rows = batch.num_tokens
    k = v = None
    if method is ForwardMethod.MLA:
        q = _randn(gen, rows, heads, pool.row_dim).to(qdt).to(dev)
        expected = oracle_mla(round_q(q, q_compute_dtype), seq_rows, spec,
                              pool.kv_lora_rank, config.softmax_scale)
    else:
        qk, dv = config.mha_head_dims
        q = _randn(gen, rows, heads, qk).to(qdt).to(dev)
        k = _randn(gen, batch.num_kv_tokens, heads, qk).to(qdt).to(dev)
        v = _randn(gen, batch.num_kv_tokens, heads, dv).to(qdt).to(dev)
        expected = oracle_mha(q, k, v, spec, config.softmax_scale)
    return Workload(spec=spec, method=method, batch=batch, q=q,
                    latent_new=torch.cat(new_latent).to(dev),
                    rope_new=torch.cat(new_rope).to(dev), k=k, v=v, expected=expected,
                    new_rows=torch.cat(new_rows), prefix_slots=prefix_slots,
                    new_slots=new_slots)


def oracle_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """float32 attention of ``q [E, H, D]`` over ``keys [L, H|1, D]``, ``values [L, H|1, Dv]``.

    Bottom-right causal: query ``i`` sees keys ``0 .. L - E + i``.
    """
    e, length = q.shape[0], keys.shape[0]
    dev = q.device
    # float64 on the device: exact enough to be the truth, and free of TF32 matmuls
    qf = q.double()
    kf = keys.to(dev, torch.float64).expand(length, q.shape[1], keys.shape[-1])
    vf = values.to(dev, torch.float64).expand(length, q.shape[1], values.shape[-1])
    scores = torch.einsum("ehd,lhd->hel", qf, kf) * scale
    visible = (torch.arange(length, device=dev)[None, :]
               <= (torch.arange(e, device=dev) + (length - e))[:, None])
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hel,lhd->ehd", torch.softmax(scores, dim=-1), vf)
    return out.float().cpu()


def oracle_mla(q: torch.Tensor, seq_rows: list[torch.Tensor], spec: BatchSpec,
               latent: int, scale: float) -> torch.Tensor:
    """Absorbed MLA: every head attends over the 576-wide rows, values = the latent part."""
    outs = []
    start = 0
    for rows, (_, extend) in zip(seq_rows, spec.seqs):
        kv = rows.to(q.device)[:, None, :]
        outs.append(oracle_attention(q[start:start + extend], kv, kv[:, :, :latent], scale))
        start += extend
    return torch.cat(outs)


def oracle_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec,
               scale: float) -> torch.Tensor:
    """Ragged MHA: sequence ``b`` owns K/V rows ``kv_indptr[b]:kv_indptr[b+1]``."""
    outs = []
    q_start = kv_start = 0
    for prefix, extend in spec.seqs:
        length = prefix + extend
        outs.append(oracle_attention(q[q_start:q_start + extend],
                                     k[kv_start:kv_start + length],
                                     v[kv_start:kv_start + length], scale))
        q_start += extend
        kv_start += length
    return torch.cat(outs)


def compare(out: torch.Tensor, expected: torch.Tensor, q_dtype: DType,
            spec: BatchSpec) -> str | None:
    """None when ``out`` matches ``expected`` within the dtype's tolerance, else why not."""
    got = out.detach().float().cpu()
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{spec.describe()}: output shape {tuple(got.shape)}, expected "
                f"{tuple(expected.shape)}")
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
    return (f"{spec.describe()}: output differs from the float32 oracle in "
            f"{int(bad.sum())}/{bad.numel()} elements (tolerance atol {tol.atol}, rtol "
            f"{tol.rtol} for {q_dtype}); worst |err| {float(err.view(-1)[flat]):.3g} at "
            f"sequence {seq} (prefix {spec.seqs[seq][0]}), new token {tok}, head {head}, "
            f"column {col}: got {float(got[row, head, col]):.4g}, expected "
            f"{float(expected[row, head, col]):.4g}"
            + (f"; {int(nonfinite.sum())} non-finite values" if bool(nonfinite.any()) else ""))


def _locate(row: int, spec: BatchSpec) -> tuple[int, int]:
    start = 0
    for i, (_, extend) in enumerate(spec.seqs):
        if row < start + extend:
            return i, row - start
        start += extend
    return len(spec.seqs) - 1, 0


def check_pool_after(pool: MLAKVPool, work: Workload, extra_written: Sequence[int] = ()
                     ) -> list[str]:
    """Problems with the pool after a forward: new rows not written, canaries overwritten.

    ``extra_written``: slots other workloads legitimately wrote (their prefixes, the new
    tokens of forwards that already ran).
    """
    problems = []
    slots = work.batch.out_cache_loc.to(device=pool.device)
    held = pool.read_slots(slots).cpu()
    if held.shape == work.new_rows.shape and not torch.equal(held, work.new_rows):
        wrong = int((held != work.new_rows).any(dim=1).sum())
        problems.append(f"{work.spec.name}: {wrong}/{held.shape[0]} new tokens were not "
                        "written to their out_cache_loc slots as given (latent_new/rope_new)")
    corrupted = pool.corrupted_slots(list(work.written_slots) + list(extra_written))
    if corrupted:
        problems.append(f"{work.spec.name}: {len(corrupted)} KV slots outside the written ones "
                        f"changed (canary overwritten), e.g. slots {corrupted[:8]} (page "
                        f"{corrupted[0] // pool.page_size}): the backend writes outside "
                        "out_cache_loc")
    return problems
