"""GraphPlan: the result of :func:`attnreg.graph_policy.resolve`.

Frozen and JSON-ready (:meth:`GraphPlan.to_dict`).  Per phase: the mode, the
backend serving it, the forward method that backend pins under the mode, the
capture fallbacks in effect with their cost, the split-KV policy under
capture and the capture memory estimate; plus the ordered decision trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry.capabilities import Cost, ForwardMethod, GraphMode, Phase, SplitKV
from ..registry.platform import Platform
from .config import GraphConfig
from .decisions import Decision
from .features import ServerFeatures
from .model import ModelFacts

__all__ = ["FallbackInEffect", "GraphPlan", "PhasePlan"]


@dataclass(frozen=True)
class FallbackInEffect:
    """The backend runs another implementation under this capture mode."""

    to: str
    cost: Cost
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"to": self.to, "cost": self.cost.value, "reason": self.reason}


@dataclass(frozen=True)
class PhasePlan:
    """The decision for one phase.

    ``pinned_method`` None means the backend pins nothing under this mode (or
    the phase runs eagerly), so an MLA model's MHA companion may run.
    ``split_kv`` is None when nothing is captured.  ``capture_memory_bytes`` is
    the backend's capture buffers for the largest captured batch plus the
    model's capture pool for this phase (0 when DISABLED).
    """

    phase: Phase
    mode: GraphMode
    default_mode: GraphMode
    locked: bool
    backend: str
    backend_choice: str
    pinned_method: ForwardMethod | None
    fallbacks: tuple[FallbackInEffect, ...]
    split_kv: SplitKV | None
    capture_memory_bytes: int

    @property
    def captured(self) -> bool:
        return self.mode is not GraphMode.DISABLED

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode.value,
            "default_mode": self.default_mode.value,
            "locked": self.locked,
            "backend": self.backend,
            "backend_choice": self.backend_choice,
            "pinned_method": self.pinned_method.value if self.pinned_method else None,
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "split_kv": self.split_kv.value if self.split_kv else None,
            "capture_memory_bytes": self.capture_memory_bytes,
        }


@dataclass(frozen=True)
class GraphPlan:
    """Graph modes for every phase, and why.

    Build it with :func:`attnreg.graph_policy.resolve`; hand it to
    :class:`attnreg.graph_policy.ReplayGate` for per-batch replay decisions.
    """

    platform: Platform
    model: ModelFacts
    features: ServerFeatures
    config: GraphConfig
    prefill: PhasePlan
    decode: PhasePlan
    decisions: tuple[Decision, ...]

    def phase(self, phase: Phase | str) -> PhasePlan:
        return self.prefill if Phase.parse(phase) is Phase.PREFILL else self.decode

    @property
    def capture_memory_bytes(self) -> int:
        return self.prefill.capture_memory_bytes + self.decode.capture_memory_bytes

    def decisions_for(self, phase: Phase | str) -> tuple[Decision, ...]:
        ph = Phase.parse(phase)
        return tuple(d for d in self.decisions if d.phase is ph)

    def to_dict(self) -> dict[str, object]:
        return {
            "schema_version": 1,
            "platform": str(self.platform),
            "model": self.model.to_dict(),
            "features": [name for name in self.features.enabled()],
            "config": self.config.to_dict(),
            "phases": {
                Phase.PREFILL.value: self.prefill.to_dict(),
                Phase.DECODE.value: self.decode.to_dict(),
            },
            "capture_memory_bytes": self.capture_memory_bytes,
            "decisions": [d.to_dict() for d in self.decisions],
        }
