"""Pure arithmetic of the benchmarks: bytes and FLOPs counted, ratios, targets.

No torch here: the renderer and the CPU tests use these functions too, and the
numbers the docs show are derived from measured times only through them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "D_LATENT",
    "D_ROPE",
    "D_ROW",
    "Check",
    "decode_bytes",
    "evaluate",
    "extend_attention_flops",
    "extend_pairs",
    "geomean",
    "median_of_runs",
]

#: DeepSeek MLA widths: the latent (c_kv, K and V of absorbed attention), the
#: rope part, and one KV-pool row.
D_LATENT = 512
D_ROPE = 64
D_ROW = D_LATENT + D_ROPE


def decode_bytes(batch: int, seq_len: int, heads: int, *, kv_elem_bytes: int = 2,
                 q_elem_bytes: int = 2) -> int:
    """Fewest bytes one absorbed MLA decode step must move through device memory.

    The KV rows (latent 512 + rope 64) of every sequence read once, the query
    ``[B, H, 576]`` read once and the output ``[B, H, 512]`` written once.  The
    per-head re-reads a kernel may do (from L2 or not) are not counted: this is
    the floor the achieved bandwidth is measured against.

    >>> decode_bytes(128, 4096, 128)
    639631360
    """
    kv = batch * seq_len * D_ROW * kv_elem_bytes
    q = batch * heads * D_ROW * q_elem_bytes
    out = batch * heads * D_LATENT * q_elem_bytes
    return kv + q + out


def extend_pairs(prefix: int, extend: int) -> int:
    """(query, key) pairs causal extend attention evaluates for one sequence.

    Query ``i`` of ``extend`` new tokens sees the whole prefix and new tokens
    ``0..i``: ``extend * prefix + extend * (extend + 1) / 2``.
    """
    return extend * prefix + extend * (extend + 1) // 2


def extend_attention_flops(prefix: int, extend: int, heads: int, d_qk: int, d_v: int) -> int:
    """Matrix FLOPs of causal extend attention: ``2 * pairs * H * (d_qk + d_v)``.

    Absorbed MLA uses ``(576, 512)``; the non-absorbed MHA form ``(192, 128)``.
    """
    return 2 * extend_pairs(prefix, extend) * heads * (d_qk + d_v)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive values (raises ValueError on an empty or non-positive input)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("geomean of no values")
    if any(not v > 0 for v in vals):
        raise ValueError(f"geomean needs positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


Direction = Literal["<=", ">="]


@dataclass(frozen=True)
class Check:
    """One measured figure against its target (and optional stretch goal).

    ``status`` is ``"goal met"``, ``"target met"`` (goal missed or none),
    ``"missed"``, or ``"not measured"`` when ``measured`` is None.  ``runs``:
    the figure of every run when ``measured`` is their median (a host-bound
    figure moves between runs; the page shows min and max beside the median).
    """

    id: str
    what: str
    measured: float | None
    unit: str
    direction: Direction
    target: float | None = None
    goal: float | None = None
    status: str = ""
    detail: str = ""
    runs: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _meets(value: float, bound: float, direction: Direction) -> bool:
    return value <= bound if direction == "<=" else value >= bound


def evaluate(id: str, what: str, measured: float | None, unit: str, direction: Direction, *,
             target: float | None = None, goal: float | None = None,
             detail: str = "", runs: Sequence[float] = ()) -> Check:
    """Build a :class:`Check` and decide its status.

    A check with only a goal (the issue says "goal" without a "target") is
    "goal met" or "missed".
    """
    if direction not in ("<=", ">="):
        raise ValueError(f"direction must be '<=' or '>=', got {direction!r}")
    if target is None and goal is None:
        raise ValueError(f"check {id}: give a target, a goal or both")
    if measured is None or (isinstance(measured, float) and math.isnan(measured)):
        status = "not measured"
        measured = None
    elif goal is not None and _meets(measured, goal, direction):
        status = "goal met"
    elif target is not None and _meets(measured, target, direction):
        status = "target met"
    else:
        status = "missed"
    return Check(id, what, measured, unit, direction, target, goal, status, detail,
                 tuple(runs))


def median_of_runs(id: str, what: str, values: Sequence[float], unit: str,
                   direction: Direction, **kw: Any) -> Check:
    """A check on the median of one figure over several runs (None when there is none)."""
    return evaluate(id, what, statistics.median(values) if values else None, unit, direction,
                    runs=values if len(values) > 1 else (), **kw)
