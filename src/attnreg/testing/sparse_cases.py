"""The sparse (DSA) batches the conformance suite runs, by name (no torch: claim expansion
reads their names; :mod:`attnreg.testing.sparse` builds their workloads and oracle)."""

from __future__ import annotations

from dataclasses import dataclass

from attnreg.registry import Phase

from .batches import BatchSpec

__all__ = ["SPARSE_CASES", "SparseCase", "sparse_cases"]


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
