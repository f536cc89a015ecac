"""How binding a rule is (:class:`Severity`) and where its fact comes from (:class:`Source`).

A module of its own so that the rule registry (:mod:`.rule_ids`), the
feature rules and the decision records can all import these without an
import cycle.
"""

from __future__ import annotations

from attnreg.registry.strenum import StrEnum

__all__ = ["Severity", "Source"]


class Severity(StrEnum):
    """HARD: always holds.  SOFT: adjusts defaults, yields to locks.  INFO: no change."""

    HARD = "hard"
    SOFT = "soft"
    INFO = "info"



class Source(StrEnum):
    """Where the fact behind a decision comes from."""

    USER = "user"
    BACKEND = "backend"
    PLATFORM = "platform"
    FEATURE = "feature"
    MODEL = "model"
    #: what the engine passes about itself (EngineFacts: page size, context, modes, memory)
    ENGINE = "engine"
    #: the batch being scheduled (replay-gate rules only)
    BATCH = "batch"

