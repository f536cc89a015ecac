"""The bridge's own decisions: what it did around attnreg's policy, and why.

attnreg's :class:`~attnreg.graph_policy.Decision` carries ids of attnreg's
rules only (``RULES``).  The bridge adds steps attnreg's policy does not
take: keeping an sglang rule attnreg has no fact for, deferring sglang's
early compatibility step, leaving a server to sglang's rules when a fact
has no attnreg equivalent, and writing the result back.  Their ids start
with ``sglang.`` and are listed in :data:`BRIDGE_RULES` (docs/integrations/
sglang.md shows the table).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from attnreg.registry.capabilities import GraphMode, Phase

__all__ = ["BRIDGE_RULES", "BridgeDecision"]

#: Every id a :class:`BridgeDecision` may carry -> what it means.
BRIDGE_RULES = MappingProxyType({
    "sglang.backend": "which attnreg declaration describes a phase's sglang attention "
                      "backend, and whether the user or sglang's defaults chose it",
    "sglang.deferred": "sglang's early compatibility step (before the attention backends "
                       "are known) is deferred: attnreg decides at the attention-backend step",
    "sglang.engine_rule": "an sglang rule attnreg has no fact for is kept as an engine rule "
                          "(its name follows the colon); it yields to a user's lock, as in "
                          "sglang",
    "sglang.gap": "a fact attnreg cannot represent (backend, model, KV dtype, graph mode): "
                  "sglang's own rules decide this server, unchanged",
    "sglang.host_modes": "a lock on a mode this sglang does not accept (e.g. tc_piecewise on "
                         "0.5.22+) fails startup in the bridge's first step; the policy never "
                         "plans such a mode (engine.mode_unsupported)",
    "sglang.declared": "attnreg's mode for a phase, written back with sglang's "
                       "declare_resolution",
    "sglang.runtime": "a condition of sglang's prefill replay check (can_replay_locally) that "
                      "attnreg has no fact for, kept as sglang states it (its name follows the "
                      "colon; runtime_gate.SGLANG_RUNTIME_RULES)",
})


@dataclass(frozen=True)
class BridgeDecision:
    """One step the bridge took.

    ``rule`` is a :data:`BRIDGE_RULES` id, optionally followed by ``:name``
    (``"sglang.engine_rule:multimodal_breakable_unvalidated"``).
    ``before``/``after`` are the phase's mode around the step (None when the
    step changed no mode).
    """

    rule: str
    phase: Phase | None
    before: GraphMode | None
    after: GraphMode | None
    message: str

    def __post_init__(self) -> None:
        base = self.rule.split(":", 1)[0]
        if base not in BRIDGE_RULES:
            raise ValueError(f"unknown bridge rule id {self.rule!r}; known: "
                             f"{', '.join(BRIDGE_RULES)}")

    @property
    def changed(self) -> bool:
        return self.before is not None and self.after is not None and self.before != self.after

    def describe(self) -> str:
        phase = self.phase.value if self.phase is not None else "server"
        move = ""
        if self.before is not None and self.after is not None:
            move = (f" {self.before.value} -> {self.after.value}" if self.changed
                    else f" {self.after.value}")
        return f"{phase}{move}: {self.rule}: {self.message}"

    def to_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "phase": self.phase.value if self.phase is not None else None,
            "before": self.before.value if self.before is not None else None,
            "after": self.after.value if self.after is not None else None,
            "message": self.message,
        }
