"""Pure arithmetic of the benchmarks: bytes and FLOPs counted, ratios, targets.

No torch here: the renderer and the CPU tests use these functions too, and the
numbers the docs show are derived from measured times only through them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

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
    "mla_layer_weight_bytes",
    "spread",
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


def mla_layer_weight_bytes(hidden: int, q_lora: int, kv_lora: int, rope: int, nope: int,
                           v_dim: int, heads: int, elem_bytes: int = 2) -> int:
    """Bytes of one MLA attention layer's projection weights (no norms, no MLP).

    q_a ``hidden x q_lora``, q_b ``q_lora x H(nope + rope)``, kv_a
    ``hidden x (kv_lora + rope)``, kv_b (W_UK and W_UV) ``kv_lora x H(nope + v)``,
    o ``H v x hidden``.
    """
    params = (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
              + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden)
    return params * elem_bytes


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive values (raises ValueError on an empty or non-positive input)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("geomean of no values")
    if any(not v > 0 for v in vals):
        raise ValueError(f"geomean needs positive values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, 20th / 80th percentiles, min and max of timing samples."""
    xs = sorted(float(s) for s in samples)
    if not xs:
        raise ValueError("no samples")

    def quantile(q: float) -> float:
        # linear interpolation between closest ranks (numpy's default)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": statistics.median(xs), "p20": quantile(0.2), "p80": quantile(0.8),
            "min": xs[0], "max": xs[-1], "n": len(xs)}


Direction = Literal["<=", ">="]


@dataclass(frozen=True)
class Check:
    """One measured figure against its target (and optional stretch goal).

    ``status`` is ``"goal met"``, ``"target met"`` (goal missed or none),
    ``"missed"``, or ``"not measured"`` when ``measured`` is None.
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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _meets(value: float, bound: float, direction: Direction) -> bool:
    return value <= bound if direction == "<=" else value >= bound


def evaluate(id: str, what: str, measured: float | None, unit: str, direction: Direction, *,
             target: float | None = None, goal: float | None = None,
             detail: str = "") -> Check:
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
    return Check(id, what, measured, unit, direction, target, goal, status, detail)
