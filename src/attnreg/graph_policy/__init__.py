"""Graph policy: startup resolution, per-batch replay gate, capture context.

Reads only :mod:`attnreg.registry` declarations (never backend
implementations) and imports no torch at import time.

* :func:`resolve` -> :class:`GraphPlan` with a decision trace;
* :class:`ReplayGate` + :class:`ReplayBatch`: may a batch replay a graph,
  optionally deciding prefill batches with a measured :class:`CostProfile`
  (:func:`load_profile`);
* :data:`RULES`: every rule id a decision, violation or replay reason can
  carry, with its severity, source, what it reads and what it does;
* :func:`vote`: all data-parallel ranks agree;
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
from .config import GraphConfig, default_mode
from .cost_profile import CostProfile, CostProfileError, load_profile
from .decisions import Decision, Severity, Source
from .features import FEATURE_RULES, FeatureRule, ServerFeatures
from .model import AttentionKind, ModelFacts
from .plan import FallbackInEffect, GraphPlan, PhasePlan
from .presets import MODEL_PRESETS, preset
from .replay import GATE_RULES, HiddenCapture, ReplayBatch, ReplayGate, ReplayReason
from .resolve import resolve
from .rule_ids import RULES, RuleInfo
from .selection import BackendChoice
from .vote import vote

__all__ = [
    "FEATURE_RULES",
    "GATE_RULES",
    "MODEL_PRESETS",
    "RULES",
    "AttentionKind",
    "BackendChoice",
    "BreakHandler",
    "CostProfile",
    "CostProfileError",
    "Decision",
    "FallbackInEffect",
    "FeatureRule",
    "GraphConfig",
    "GraphPlan",
    "HiddenCapture",
    "ModelFacts",
    "PhasePlan",
    "ReplayBatch",
    "ReplayGate",
    "ReplayReason",
    "RuleInfo",
    "ServerFeatures",
    "Severity",
    "Source",
    "break_handler",
    "capturing",
    "current_capture",
    "default_mode",
    "dispose_tensor",
    "eager_break",
    "in_eager_break",
    "is_capturing",
    "load_profile",
    "preset",
    "resolve",
    "vote",
]
