"""Decisions: one entry per rule that looked at a phase's graph mode.

A :class:`Decision` is what a user reads to learn *why* a mode was chosen:
a stable rule id (one of :data:`~attnreg.graph_policy.RULES`; any other id
is a ``ValueError``), how binding the rule is, where the fact came from, the
mode before and after, and a message.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry.capabilities import GraphMode, Phase
from .rule_ids import check_rule_id
from .severity import Severity, Source

__all__ = ["Decision", "Severity", "Source", "Violation"]


@dataclass(frozen=True)
class Violation:
    """A rule that forbids (hard) or advises against (soft) a mode for a phase."""

    rule: str
    severity: Severity
    source: Source
    message: str

    def __post_init__(self) -> None:
        check_rule_id(self.rule)


@dataclass(frozen=True)
class Decision:
    """One step of the decision trace.

    ``before``/``after`` are the phase's graph mode around the step (equal for
    INFO entries and for soft rules that yielded to a lock); both are None for
    entries about the backend choice.
    """

    rule: str
    severity: Severity
    source: Source
    phase: Phase
    before: GraphMode | None
    after: GraphMode | None
    message: str

    def __post_init__(self) -> None:
        check_rule_id(self.rule)

    @property
    def changed(self) -> bool:
        return self.before is not None and self.after is not None and self.before != self.after

    def to_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "source": self.source.value,
            "phase": self.phase.value,
            "before": self.before.value if self.before else None,
            "after": self.after.value if self.after else None,
            "message": self.message,
        }

    def describe(self) -> str:
        move = ""
        if self.before is not None and self.after is not None:
            move = (f" {self.before.value} -> {self.after.value}" if self.changed
                    else f" {self.after.value}")
        return (f"[{self.severity.value}/{self.source.value}] {self.phase.value}{move}: "
                f"{self.rule}: {self.message}")
