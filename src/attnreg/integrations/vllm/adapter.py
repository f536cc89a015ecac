"""The one call from the vLLM bridge into :func:`attnreg.graph_policy.resolve`.

:func:`plan_for` is the only function of the bridge that knows resolve()'s
signature.  resolve()'s errors split in two, as in the sglang bridge: a
lock that breaks a hard rule fails startup (:class:`VllmGraphPolicyError`,
a ``ValueError`` like vLLM's own cudagraph errors); a declaration that
cannot serve a phase at all (:class:`DeclarationGap`) leaves the engine to
vLLM's own stated support.
"""

from __future__ import annotations

from attnreg.graph_policy import RULES, GraphPlan, resolve
from attnreg.registry.capabilities import Phase
from attnreg.registry.errors import GraphPolicyError

from .facts import VllmFacts

__all__ = ["DeclarationGap", "VllmGraphPolicyError", "plan_for"]

#: resolve()'s errors that mean "no attnreg declaration serves this" (no plan at all),
#: as opposed to a lock that breaks a hard rule.
_SELECTION_RULES = tuple(rule.id for rule in RULES.values() if rule.kind == "error")


class VllmGraphPolicyError(GraphPolicyError, ValueError):
    """attnreg refuses vLLM's explicit ``cudagraph_mode``: every reason is listed."""


class DeclarationGap(Exception):
    """The mapped declaration cannot serve a phase of this engine (unavailable on the
    platform, no kernel for the model, KV dtype or page size): vLLM decides."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("; ".join(reasons))


def plan_for(facts: VllmFacts) -> GraphPlan:
    """attnreg's plan for an engine whose facts have no gap.

    vLLM runs MLA prefill with its own kernels (``MLACommonImpl``) whatever the
    decode backend, so prefill uses the mapped declaration when it serves
    prefill, else attnreg's choice by need.  Raises :class:`VllmGraphPolicyError`
    when a locked mode breaks a hard rule and :class:`DeclarationGap` when the
    declaration cannot serve the engine.
    """
    if facts.model is None or facts.config is None:
        raise ValueError("plan_for needs facts without gaps: " + "; ".join(facts.gaps))
    from attnreg.registry import get_registry

    name = facts.backend.attnreg
    try:
        serves_prefill = get_registry().declaration(name, facts.platform).serves(Phase.PREFILL)
    except Exception:  # noqa: BLE001 - unknown name, failing plugin: resolve() reports it
        serves_prefill = False
    backends = (name if serves_prefill else None, name)
    try:
        # assume_installed: the kernels run inside vLLM, whose install carries the
        # libraries; attnreg's own optional extras need not be present.
        return resolve(facts.platform, facts.model, backends, facts.config, facts.features,
                       facts.engine, assume_installed=True)
    except GraphPolicyError as exc:
        if any(f"{rule}:" in reason for reason in exc.reasons for rule in _SELECTION_RULES):
            raise DeclarationGap(exc.reasons) from exc
        raise VllmGraphPolicyError(exc.reasons, exc.hint) from exc
