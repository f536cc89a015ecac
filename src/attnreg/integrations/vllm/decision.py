"""One engine's decision: attnreg's plan for a vLLM backend, in vLLM's words, logged.

:func:`decide` reads the facts, asks the adapter for attnreg's plan and
turns it into vLLM's ``cudagraph_mode`` and ``AttentionCGSupport``
(:mod:`.vocabulary`).  Every decision is logged on the ``vllm.attnreg``
logger, a child of vLLM's own ``vllm`` logger, so it appears in vLLM's log
with its rule id.  A gap (no declaration, a fact attnreg cannot represent,
a declaration that cannot serve the engine) leaves vLLM's answer as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from attnreg.graph_policy import GraphPlan
from attnreg.integrations._policy_log import policy_log_silenced
from attnreg.registry import get_registry
from attnreg.registry.capabilities import GraphMode

from .adapter import DeclarationGap, plan_for
from .facts import VllmFacts, read_facts
from .vocabulary import ADAPTER_SUPPORT, cg_support, vllm_mode

__all__ = ["VllmOutcome", "decide"]

logger = logging.getLogger("vllm.attnreg")


@dataclass(frozen=True)
class VllmOutcome:
    """What the bridge decided for one vLLM backend of one engine.

    ``plan`` is None when a gap left the engine to vLLM (``gaps`` says why);
    then ``mode`` and ``support`` are vLLM's own.  ``reasons`` are the rule
    ids behind every change from vLLM's requested mode, attnreg's first.
    """

    facts: VllmFacts
    plan: GraphPlan | None
    mode: str
    support: str
    vllm_support: str
    reasons: tuple[str, ...]
    gaps: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.plan is not None and (self.mode != self.facts.requested
                                          or self.support != self.vllm_support)

    def to_dict(self) -> dict[str, object]:
        return {"facts": self.facts.to_dict(), "mode": self.mode, "support": self.support,
                "vllm_support": self.vllm_support, "reasons": list(self.reasons),
                "gaps": list(self.gaps),
                "plan": self.plan.to_dict() if self.plan is not None else None}




def decide(vllm_config: Any, backend_name: str, kv_cache_spec: Any, *, requested: str,
           locked: bool, vllm_support: str) -> VllmOutcome:
    """attnreg's answer for vLLM's backend ``backend_name`` (``requested``: vLLM's
    ``cudagraph_mode`` name before resolution; ``vllm_support``: the builder's own
    ``AttentionCGSupport`` name).

    Raises :class:`~.adapter.VllmGraphPolicyError` when the user's explicit
    mode breaks a hard rule (every reason listed).
    """
    facts = read_facts(vllm_config, backend_name, kv_cache_spec, requested=requested,
                       locked=locked)
    gaps = list(facts.gaps)
    plan = None
    if facts.decidable:
        try:
            with policy_log_silenced():
                plan = plan_for(facts)
        except DeclarationGap as gap:
            gaps = [f"attnreg's declaration cannot serve it: {r}" for r in gap.reasons]
    if plan is None:
        logger.info("attnreg: %s left to vLLM (support %s, cudagraph_mode %s): %s",
                    backend_name, vllm_support, requested, "; ".join(gaps))
        return VllmOutcome(facts, None, requested, vllm_support, vllm_support, (),
                           tuple(gaps))
    for decision in plan.decisions:
        level = (logging.WARNING if decision.changed and decision.after is GraphMode.DISABLED
                 else logging.INFO)
        logger.log(level, "attnreg: %s", decision.describe())
    draft = facts.engine.num_draft_tokens
    mode, reasons = vllm_mode(plan, draft)
    if facts.backend.exact:
        # attnreg's own backend behind the adapter: the support its builder wires
        support = ADAPTER_SUPPORT
    else:
        declaration = get_registry().declaration(plan.decode.backend, facts.platform)
        support = cg_support(declaration, draft)
    outcome = VllmOutcome(facts, plan, mode, support, vllm_support, reasons, ())
    level = logging.WARNING if mode != requested else logging.INFO
    logger.log(level, "attnreg: %s (attnreg's %s): AttentionCGSupport %s (vLLM states %s), "
               "cudagraph_mode %s -> %s%s", backend_name, facts.backend.attnreg, support,
               vllm_support, requested, mode,
               f" ({', '.join(reasons)})" if reasons else "")
    return outcome
