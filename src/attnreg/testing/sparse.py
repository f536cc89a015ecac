"""The float64 sparse (DSA) MLA oracle and the sparse batches the conformance suite runs.

Sparse MLA (docs/sparse.md): query row ``i`` (a decode sequence, or one new token of
an extend batch) attends, without a causal mask, only the pool slots listed in row
``i`` of an int32 top-k index tensor; an entry of -1 is no key and a slot listed
twice counts twice.  :func:`oracle_sparse` computes that in float64, one row at a
time, from rows held apart from the pool (what was written, as the pool stores it),
so it shares no code with any backend.

Each :class:`SparseCase` names what its indices exercise: top-k smaller than, equal
to and larger than the visible tokens (the rest padded with -1, scattered, not only
at the end), indices in no particular order, a slot listed twice, and a row with no
valid entry at all.  Indices are drawn among the tokens a causal indexer may pick
(positions up to the query's own), mapped to slots through the batch's page table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnreg.registry import DType, ForwardMethod, Phase
from attnreg.runtime import MLAConfig, MLAKVPool

from .batches import BatchSpec
from .workload import Workload, make_workload

__all__ = ["SPARSE_CASES", "SparseCase", "sparse_cases", "SparseWorkload", "make_sparse_workload",
           "oracle_sparse", "sparse_index_rows"]


@dataclass(frozen=True)
class SparseCase:
    """One named sparse batch: sequences ``(prefix, new tokens)``, the index width, and
    which rows repeat a slot or have no valid entry."""

    name: str
    phase: Phase
    seqs: tuple[tuple[int, int], ...]
    top_k: int
    about: str
    #: query rows whose indices list one slot twice
    repeated_rows: tuple[int, ...] = ()
    #: query rows whose indices are all -1 (a padded row: no key)
    empty_rows: tuple[int, ...] = ()

    def spec(self) -> BatchSpec:
        return BatchSpec(f"sparse_{self.name}", self.phase, self.seqs, self.about)


def sparse_cases(phase: Phase, top_k: int) -> tuple[SparseCase, ...]:
    """The sparse batches of ``phase`` at index width ``top_k`` (tiny at the cpu width 16:
    they run in every conformance run)."""
    k = top_k
    if phase is Phase.DECODE:
        return (
            SparseCase("topk_below_seq", phase, ((2 * k + 7, 1), (k + 6, 1)), k,
                       f"top-k {k} of {2 * k + 8} and {k + 7} tokens: a subset, unsorted"),
            SparseCase("topk_equal_seq", phase, ((k - 1, 1), (k - 1, 1)), k,
                       f"top-k {k} of {k} tokens: every token, permuted"),
            SparseCase("topk_above_seq", phase, ((k // 2, 1), (2, 1)), k,
                       f"top-k {k} of {k // 2 + 1} and 3 tokens: every token, -1 scattered"),
            SparseCase("repeated_and_empty", phase, ((2 * k - 2, 1), (k - 5, 1), (5, 1)), k,
                       "a slot listed twice, and a row of only -1", repeated_rows=(0, 1),
                       empty_rows=(2,)),
        )
    return (
        SparseCase("extend_mixed", phase, ((k + 4, 4), (0, 6), (k - 4, 4)), k,
                   f"per new token top-k {k} of more, fewer and exactly {k} visible tokens"),
        SparseCase("repeated_and_empty", phase, ((2 * k + 4, 3), (3, 2)), k,
                   "slots listed twice, and rows of only -1", repeated_rows=(0, 3),
                   empty_rows=(1, 4)),
    )


#: The sparse batches of each phase at the cpu width, 16.
SPARSE_CASES: dict[Phase, tuple[SparseCase, ...]] = {
    phase: sparse_cases(phase, 16) for phase in (Phase.DECODE, Phase.PREFILL)}


def sparse_index_rows(case: SparseCase, page_table: torch.Tensor, page_size: int,
                      seed: int) -> torch.Tensor:
    """int32 ``[query rows, top_k]`` pool slots for ``case`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    table = page_table.cpu().long()
    for b, (prefix, extend) in enumerate(case.seqs):
        for t in range(extend):
            visible = prefix + t + 1            # positions 0 .. own position
            r = len(rows)
            k = case.top_k
            if r in case.empty_rows:
                rows.append([-1] * k)
                continue
            chosen = torch.randperm(visible, generator=gen)[:k].tolist()
            if r in case.repeated_rows and len(chosen) >= 2:
                chosen[-1] = chosen[0]           # one slot twice (still k entries)
            entry = [int(table[b, p // page_size]) * page_size + p % page_size
                     for p in chosen]
            entry += [-1] * (k - len(entry))
            order = torch.randperm(k, generator=gen).tolist()   # -1 scattered, unsorted
            rows.append([entry[i] for i in order])
    return torch.tensor(rows, dtype=torch.int32)


def oracle_sparse(q: torch.Tensor, slot_rows: dict[int, torch.Tensor], indices: torch.Tensor,
                  kv_lora_rank: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 sparse MLA: ``out [R, H, kv_lora_rank]`` and ``lse [R, H]``.

    ``slot_rows[s]`` is the float64 row ``[576]`` stored at slot ``s``; row ``r``
    attends ``slot_rows[s]`` for each entry ``s != -1`` of ``indices[r]`` (twice when
    listed twice).  A row without one gets zeros and ``-inf``.
    """
    q64 = q.detach().double().cpu()
    rows, heads = q64.shape[0], q64.shape[1]
    out = torch.zeros(rows, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for r in range(rows):
        slots = [int(s) for s in indices[r].tolist() if int(s) != -1]
        if not slots:
            continue
        keys = torch.stack([slot_rows[s] for s in slots])      # [n, 576]
        scores = (q64[r] @ keys.T) * sm_scale                   # [H, n]
        lse[r] = torch.logsumexp(scores, dim=-1)
        out[r] = torch.softmax(scores, dim=-1) @ keys[:, :kv_lora_rank]
    return out, lse


@dataclass
class SparseWorkload:
    """One sparse step: the dense :class:`Workload` (batch, q, new rows, pages; its dense
    oracle unused) with the top-k indices and the sparse oracle's output and LSE."""

    case: SparseCase
    work: Workload
    indices: torch.Tensor
    expected: torch.Tensor
    expected_lse: torch.Tensor

    @property
    def spec(self) -> BatchSpec:
        return self.work.spec


def make_sparse_workload(config: MLAConfig, pool: MLAKVPool, case: SparseCase, *,
                         seed: int, q_dtype: DType | None = None) -> SparseWorkload:
    """Write ``case``'s prefixes into layer 0 of ``pool``, build the batch and its
    indices, and compute the float64 oracle over the rows as the pool stores them."""
    work = make_workload(config, pool, case.spec(), ForwardMethod.MLA, seed=seed,
                         q_dtype=q_dtype)
    layer = pool.layer(0)
    slot_rows: dict[int, torch.Tensor] = {}
    if work.prefix_slots:
        stored = layer.read_slots(torch.tensor(work.prefix_slots, device=pool.device))
        for s, row in zip(work.prefix_slots, stored.double().cpu()):
            slot_rows[s] = row
    for s, row in zip(work.new_slots, work.new_rows.double()):
        slot_rows[s] = row
    indices = sparse_index_rows(case, work.batch.page_table, pool.page_size, seed)
    expected, lse = oracle_sparse(work.q, slot_rows, indices, pool.kv_lora_rank,
                                  config.softmax_scale)
    return SparseWorkload(case, work, indices.to(pool.device), expected.float(), lse.float())
