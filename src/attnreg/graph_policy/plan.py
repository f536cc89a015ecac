"""GraphPlan: the result of :func:`attnreg.graph_policy.resolve`.

Frozen and JSON-ready (:meth:`GraphPlan.to_dict`).  Per phase: the mode, the
backend serving it, the forward method that backend pins under the mode, the
capture fallbacks in effect with their cost, the split-KV policy under
capture, the capture memory estimate and the captured shapes (per forward
mode: batch buckets, token buckets, query tokens per sequence, longest
sequence); how speculative batches run; the capture budget; plus the
ordered decision trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry.capabilities import Cost, ForwardMethod, ForwardMode, GraphMode, Phase, SplitKV
from ..registry.platform import Platform
from .config import GraphConfig
from .decisions import Decision
from .engine import EngineFacts
from .features import ServerFeatures
from .model import ModelFacts

__all__ = ["BucketBackend", "CaptureBudget", "CapturedShapes", "FallbackInEffect", "GraphPlan",
           "PhasePlan", "SpecModePlan"]


@dataclass(frozen=True)
class CapturedShapes:
    """The graphs captured for one forward mode of a phase.

    ``batch_sizes`` are the request-slot buckets (decode-phase graphs are
    keyed by them); ``num_tokens`` the query-row buckets (prefill graphs are
    keyed by them; for decode-phase graphs, ``batch_size x query_len``).
    ``query_len`` is the query tokens per sequence a decode-phase graph is
    captured for (1 for decode, the draft tokens for verify / draft extend),
    None for ragged prefill.  ``max_seq_len`` is the longest sequence a
    replay may carry.
    """

    forward_mode: ForwardMode
    batch_sizes: tuple[int, ...]
    num_tokens: tuple[int, ...]
    max_requests: int
    query_len: int | None
    max_seq_len: int

    @property
    def keyed_by_tokens(self) -> bool:
        """Prefill graphs are looked up by token count, decode-phase graphs by batch size."""
        return self.forward_mode is ForwardMode.EXTEND

    def buckets(self) -> tuple[int, ...]:
        """The keys graphs are captured for (tokens or batch sizes, see above)."""
        return self.num_tokens if self.keyed_by_tokens else self.batch_sizes

    def to_dict(self) -> dict[str, object]:
        return {"forward_mode": self.forward_mode.value,
                "batch_sizes": list(self.batch_sizes), "num_tokens": list(self.num_tokens),
                "max_requests": self.max_requests, "query_len": self.query_len,
                "max_seq_len": self.max_seq_len}


@dataclass(frozen=True)
class SpecModePlan:
    """How batches of one speculative forward mode run.

    ``how`` is ``"graph"`` (replayed from the decode graphs of ``backend``),
    ``"eager"`` (``backend`` serves them eagerly) or ``"unserved"`` (the
    decode backend does not declare them at all: the engine must run them
    some other way); ``message`` says why.
    """

    forward_mode: ForwardMode
    how: str
    backend: str
    query_len: int
    message: str

    def to_dict(self) -> dict[str, object]:
        return {"forward_mode": self.forward_mode.value, "how": self.how,
                "backend": self.backend, "query_len": self.query_len,
                "message": self.message}


@dataclass(frozen=True)
class CaptureBudget:
    """The capture memory budget the plan was checked against.

    ``source`` is ``"user"`` (``capture_memory_budget_bytes`` given),
    ``"engine"`` (a fraction of the device memory the engine passed),
    ``"platform"`` (a fraction of the known device memory of the platform),
    or ``"none"`` (no budget: device memory unknown, or the fraction is 0);
    ``note`` says it in words.
    """

    bytes: int | None
    source: str
    device_memory_bytes: int | None
    fraction: float
    note: str

    def to_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "source": self.source,
                "device_memory_bytes": self.device_memory_bytes, "fraction": self.fraction,
                "note": self.note}


@dataclass(frozen=True)
class FallbackInEffect:
    """The backend runs another implementation under this capture mode."""

    to: str
    cost: Cost
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"to": self.to, "cost": self.cost.value, "reason": self.reason}


@dataclass(frozen=True)
class BucketBackend:
    """The backend one decode capture bucket is captured with, and why.

    Present only when a decode profile was given to
    :func:`~attnreg.graph_policy.resolve` (``decode_profile=``); every bucket
    of every captured decode-phase forward mode of that batch size uses it.
    ``ratio`` is the profile's geometric-mean time of ``backend`` over the
    phase's backend at this bucket (1.0 when it is the phase's backend, None
    when the profile has no comparison there); ``rule`` is the decision's id.
    """

    bucket: int
    backend: str
    rule: str
    reason: str
    ratio: float | None = None

    def to_dict(self) -> dict[str, object]:
        return {"bucket": self.bucket, "backend": self.backend, "rule": self.rule,
                "reason": self.reason, "ratio": self.ratio}


@dataclass(frozen=True)
class PhasePlan:
    """The decision for one phase.

    ``pinned_method`` None means the backend pins nothing under this mode (or
    the phase runs eagerly), so an MLA model's MHA companion may run.
    ``split_kv`` is None when nothing is captured.  ``capture_memory_bytes`` is
    the backend's capture buffers for the largest captured batch plus the
    model's capture pool for this phase (0 when DISABLED).  ``captured``
    lists the graphs captured, one entry per forward mode they serve (empty
    when DISABLED).  ``bucket_backends`` (decode, with a decode profile only)
    gives each captured batch-size bucket its backend; empty: ``backend``
    serves every bucket.
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
    captured: tuple[CapturedShapes, ...] = ()
    bucket_backends: tuple[BucketBackend, ...] = ()

    def backend_for(self, bucket: int) -> str:
        """The backend bucket ``bucket`` is captured with (``backend`` unless a per-bucket
        choice names another)."""
        for b in self.bucket_backends:
            if b.bucket == bucket:
                return b.backend
        return self.backend

    @property
    def backends(self) -> tuple[str, ...]:
        """Every backend the phase's graphs are captured with, ``backend`` first."""
        return tuple(dict.fromkeys((self.backend, *(b.backend for b in self.bucket_backends))))

    @property
    def is_captured(self) -> bool:
        return self.mode is not GraphMode.DISABLED

    def shapes_for(self, mode: ForwardMode | str) -> CapturedShapes | None:
        """The graphs captured for forward mode ``mode``, or None when none serve it."""
        wanted = ForwardMode.parse(mode)
        return next((c for c in self.captured if c.forward_mode is wanted), None)

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
            "captured": [c.to_dict() for c in self.captured],
            "bucket_backends": [b.to_dict() for b in self.bucket_backends],
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
    engine: EngineFacts = EngineFacts()
    speculative: tuple[SpecModePlan, ...] = ()
    capture_budget: CaptureBudget | None = None

    def phase(self, phase: Phase | str) -> PhasePlan:
        return self.prefill if Phase.parse(phase) is Phase.PREFILL else self.decode

    @property
    def capture_memory_bytes(self) -> int:
        return self.prefill.capture_memory_bytes + self.decode.capture_memory_bytes

    def decisions_for(self, phase: Phase | str) -> tuple[Decision, ...]:
        ph = Phase.parse(phase)
        return tuple(d for d in self.decisions if d.phase is ph)

    def speculative_for(self, mode: ForwardMode | str) -> SpecModePlan | None:
        """How batches of speculative forward mode ``mode`` run (None: speculative
        decoding is off)."""
        wanted = ForwardMode.parse(mode)
        return next((s for s in self.speculative if s.forward_mode is wanted), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "schema_version": 1,
            "platform": str(self.platform),
            "model": self.model.to_dict(),
            "features": [name for name in self.features.enabled()],
            "config": self.config.to_dict(),
            "engine": self.engine.to_dict(),
            "phases": {
                Phase.PREFILL.value: self.prefill.to_dict(),
                Phase.DECODE.value: self.decode.to_dict(),
            },
            "capture_memory_bytes": self.capture_memory_bytes,
            "capture_budget": self.capture_budget.to_dict() if self.capture_budget else None,
            "speculative": [s.to_dict() for s in self.speculative],
            "decisions": [d.to_dict() for d in self.decisions],
        }
