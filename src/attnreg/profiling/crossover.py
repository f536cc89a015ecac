"""Where the absorbed prefill graph stops winning: the crossover of a cost profile.

``attnreg calibrate`` prints it after a fit and ``attnreg compat`` shows it
for the shipped profile.  The graph pads a batch's tokens to a captured
bucket exactly as :class:`~attnreg.graph_policy.ReplayGate` does
(:func:`bucket_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnreg.graph_policy.cost_profile import CostProfile, PrefillShape

__all__ = ["CROSSOVER_PREFIXES", "CrossoverPoint", "bucket_for", "crossover_extend"]

#: Prefix lengths the crossover is reported at.
CROSSOVER_PREFIXES = (0, 4096, 32768)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``n`` tokens (``buckets`` ascending); None above them all.

    >>> bucket_for(300, (64, 512, 1024)), bucket_for(2000, (64, 512, 1024))
    (512, None)
    """
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass(frozen=True)
class CrossoverPoint:
    """Where the absorbed graph stops winning at one prefix length.

    ``max_graph_extend``: the largest extend length (per sequence) up to which
    the graph is predicted faster; 0 when eager wins from the first token,
    ``max_extend`` when the graph wins everywhere it was asked about.
    """

    prefix: int
    batch_size: int
    heads: int
    max_extend: int
    max_graph_extend: int

    def describe(self) -> str:
        where = f"at prefix {self.prefix}"
        if self.batch_size != 1:
            where += f", {self.batch_size} sequences"
        if self.max_graph_extend == 0:
            return f"eager MHA for every extend length {where}"
        if self.max_graph_extend >= self.max_extend:
            return f"absorbed graph for every extend <= {self.max_extend} tokens {where}"
        return (f"absorbed graph for extend <= {self.max_graph_extend} tokens {where}, "
                "eager MHA above")

    def to_dict(self) -> dict[str, object]:
        return {"prefix": self.prefix, "batch_size": self.batch_size, "heads": self.heads,
                "max_extend": self.max_extend, "max_graph_extend": self.max_graph_extend,
                "text": self.describe()}


def crossover_extend(profile: CostProfile, *, heads: int, prefix: int, max_extend: int,
                     buckets: Sequence[int] = (), batch_size: int = 1) -> CrossoverPoint:
    """The largest extend length for which the absorbed graph is predicted faster.

    Evaluates the comparison at powers of two, every bucket and ``max_extend``
    (tokens padded to ``buckets`` for the graph, as the gate pads them), then
    bisects between the last winning and the first losing length.  Assumes
    the graph's advantage shrinks as the extend grows (true of the model's
    terms: absorbed attention grows fastest), so the answer is exact up to
    padding steps between sampled lengths.
    """
    if max_extend < 1:
        raise ValueError(f"max_extend must be >= 1, got {max_extend}")
    ordered = sorted({int(b) for b in buckets})

    def graph_wins(extend: int) -> bool:
        shape = PrefillShape.uniform(batch_size, prefix, extend, heads)
        tokens = extend * batch_size
        return profile.compare(shape, graph_tokens=bucket_for(tokens, ordered)
                               or tokens).graph_wins

    samples = sorted({1, max_extend} | {2 ** k for k in range(max_extend.bit_length())
                                        if 2 ** k <= max_extend}
                     | {b // batch_size for b in ordered if 1 <= b // batch_size <= max_extend})
    last_win = 0
    first_loss: int | None = None
    for e in samples:
        if graph_wins(e):
            last_win = e
        else:
            first_loss = e
            break
    if first_loss is None:
        return CrossoverPoint(prefix, batch_size, heads, max_extend, max_extend)
    lo, hi = last_win, first_loss  # graph wins at lo (or lo == 0), loses at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if graph_wins(mid):
            lo = mid
        else:
            hi = mid
    return CrossoverPoint(prefix, batch_size, heads, max_extend, lo)


