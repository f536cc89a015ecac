"""Graph policy: startup resolution, per-batch replay gate, capture context.

Reads only :mod:`attnreg.registry` declarations (never backend
implementations) and imports no torch at import time.

* :func:`resolve` -> :class:`GraphPlan` with a decision trace;
* :class:`ReplayGate` + :class:`ReplayBatch`: may a batch replay a graph,
  optionally deciding prefill batches with a measured :class:`CostProfile`
  (:func:`load_profile`);
* :class:`EngineFacts`: page size, context, pool and device memory,
  speculative draft tokens and host graph modes, beside :class:`ModelFacts`,
  :class:`ServerFeatures` and :class:`GraphConfig`;
* :data:`RULES`: every rule id a decision, violation or replay reason can
  carry, with its severity, source, what it reads and what it does;
* :func:`sync` (and :func:`pack` / :func:`unpack`): all data-parallel ranks
  agree on one replay decision, bucket and forward mode in one gather, with a
  :class:`PlanFingerprint` (:func:`plan_fingerprint`) proving they share a plan
  and a timeout (:data:`DEFAULT_SYNC_TIMEOUT_S`); :func:`vote` is the
  bool-only AND it replaces;
* :func:`capturing`, :func:`dispose_tensor`, :class:`eager_break`: the
  capture context runtime code consults.
"""

from .capture import (
    BreakHandler,
    break_handler,
    capturing,
    current_capture,
    dispose_tensor,
    eager_break,
    in_eager_break,
    is_capturing,
)
from .config import DEFAULT_CAPTURE_BUDGET_FRACTION, DEFAULT_MAX_SEQ_LEN, GraphConfig, default_mode
from .cost_profile import CostProfile, CostProfileError, load_profile
from .decisions import Decision, Severity, Source
from .engine import EngineFacts
from .features import FEATURE_RULES, FeatureRule, ServerFeatures
from .fingerprint import PlanFingerprint, cost_profile_id, plan_fingerprint
from .model import AttentionKind, ModelFacts
from .plan import (
    CaptureBudget,
    CapturedShapes,
    FallbackInEffect,
    GraphPlan,
    PhasePlan,
    SpecModePlan,
)
from .presets import MODEL_PRESETS, preset
from .replay import GATE_RULES, HiddenCapture, ReplayBatch, ReplayGate, ReplayReason
from .resolve import resolve
from .rule_ids import RULES, RuleInfo
from .selection import BackendChoice
from .sync import (
    DEFAULT_SYNC_TIMEOUT_S,
    PACK_VERSION,
    PACKED_WIDTH,
    Agreed,
    BatchFacts,
    SyncError,
    pack,
    sync,
    unpack,
)
from .vote import vote

# The stable surface (docs/api.md): changed only through a deprecation.  The other
# names imported above stay importable from here for compatibility, but are not
# promised: import them from their module if you must.
__all__ = [
    "DEFAULT_SYNC_TIMEOUT_S",
    "MODEL_PRESETS",
    "PACK_VERSION",
    "RULES",
    "Agreed",
    "AttentionKind",
    "BatchFacts",
    "CaptureBudget",
    "CostProfile",
    "CostProfileError",
    "Decision",
    "EngineFacts",
    "FallbackInEffect",
    "GraphConfig",
    "GraphPlan",
    "ModelFacts",
    "PhasePlan",
    "PlanFingerprint",
    "ReplayBatch",
    "ReplayGate",
    "ReplayReason",
    "RuleInfo",
    "ServerFeatures",
    "Severity",
    "Source",
    "SpecModePlan",
    "SyncError",
    "capturing",
    "cost_profile_id",
    "current_capture",
    "dispose_tensor",
    "eager_break",
    "is_capturing",
    "load_profile",
    "plan_fingerprint",
    "preset",
    "resolve",
    "sync",
    "vote",
]
