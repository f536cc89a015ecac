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

from attnreg.registry import DType, ForwardMethod
from attnreg.runtime import MLAConfig, MLAKVPool

from .batches import BatchSpec
from .sparse_cases import SPARSE_CASES, SparseCase, sparse_cases
from .workload import Workload, make_workload

__all__ = ["SPARSE_CASES", "SparseCase", "sparse_cases", "SparseWorkload", "make_sparse_workload",
           "oracle_sparse", "sparse_index_rows"]


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
