"""attnreg's plan in vLLM's words: the one table between the two vocabularies.

vLLM 0.33 has one ``cudagraph_mode`` for the whole engine, whose two halves
are the mode of uniform decode batches and the mode of mixed (prefill)
batches (``CUDAGraphMode.decode_mode()`` / ``mixed_mode()``); attnreg plans
each phase.  :data:`MODES` maps one onto the other:

* vLLM's PIECEWISE graphs keep attention outside the graph (a splitting op),
  as attnreg's ``tc_piecewise`` prefill does ("attention runs eagerly between
  pieces"); vLLM has no breakable mode, so the bridge offers attnreg only
  ``tc_piecewise`` and ``disabled`` for prefill;
* a FULL decode graph is attnreg's ``full`` decode.  vLLM's decode batches
  under speculative decoding are verify batches (1 + k tokens per
  request), so decode counts as captured only when the plan replays
  target-verify batches from the full graphs (``spec.graph``);
* vLLM's FULL (mixed batches in full graphs) has no attnreg counterpart:
  attnreg has no ``full`` prefill, so a FULL request is a gap.

:data:`SUPPORT` reads a declaration's decode ``full`` graphs as vLLM's
``AttentionCGSupport``.  Values are vLLM's enum member names, so this
module imports no vLLM.
"""

from __future__ import annotations

from attnreg.graph_policy import GraphPlan
from attnreg.registry.capabilities import Capabilities, ForwardMode, GraphMode, Phase

__all__ = ["ADAPTER_SUPPORT", "MODES", "SUPPORT", "cg_support", "requested_modes", "vllm_mode"]

#: Decisions that set the requested mode itself (vLLM's value), not a change of it.
_REQUEST_RULES = frozenset({"default.mode", "user.locked"})

#: (attnreg prefill mode, decode captured ``full``) <-> vLLM ``CUDAGraphMode`` name.
MODES: dict[tuple[GraphMode, bool], str] = {
    (GraphMode.TC_PIECEWISE, True): "FULL_AND_PIECEWISE",
    (GraphMode.DISABLED, True): "FULL_DECODE_ONLY",
    (GraphMode.TC_PIECEWISE, False): "PIECEWISE",
    (GraphMode.DISABLED, False): "NONE",
}

#: The first forward mode a backend's decode ``full`` graphs serve, widest first ->
#: vLLM's ``AttentionCGSupport`` name.  A backend whose decode ``full`` is not
#: capturable at all is ``NEVER``.
SUPPORT: tuple[tuple[ForwardMode, str], ...] = (
    (ForwardMode.EXTEND, "ALWAYS"),              # any query length: mixed batches
    (ForwardMode.TARGET_VERIFY, "UNIFORM_BATCH"),  # 1 + k tokens per request, uniform
    (ForwardMode.DECODE, "UNIFORM_SINGLE_TOKEN_DECODE"),
)


#: The ``AttentionCGSupport`` of attnreg's own backends behind the vLLM adapter
#: (``ATTNREG_*``): the adapter runs them eagerly, whatever their declaration captures.
ADAPTER_SUPPORT = "NEVER"


def requested_modes(vllm_mode_name: str) -> tuple[GraphMode, GraphMode] | None:
    """attnreg's (prefill, decode) modes for a vLLM ``cudagraph_mode`` name; None for
    FULL, which attnreg cannot express (full graphs of mixed batches).

    >>> requested_modes("FULL_DECODE_ONLY")
    (<GraphMode.DISABLED: 'disabled'>, <GraphMode.FULL: 'full'>)
    """
    for (prefill, decode_full), name in MODES.items():
        if name == vllm_mode_name:
            return prefill, GraphMode.FULL if decode_full else GraphMode.DISABLED
    return None


def _changes(plan: GraphPlan, phase: Phase) -> tuple[str, ...]:
    return tuple(d.rule for d in plan.decisions_for(phase)
                 if d.changed and d.rule not in _REQUEST_RULES)


def decode_captured(plan: GraphPlan, num_draft_tokens: int) -> tuple[bool, tuple[str, ...]]:
    """Whether vLLM's decode batches replay full graphs under ``plan``, and the rule ids
    that say so (the decode phase's changing decisions, or the verify plan's)."""
    why = _changes(plan, Phase.DECODE)
    if plan.phase(Phase.DECODE).mode is not GraphMode.FULL:
        return False, why
    if num_draft_tokens <= 0:
        return True, why
    verify = plan.speculative_for(ForwardMode.TARGET_VERIFY)
    if verify is not None and verify.how == "graph":
        return True, ("spec.graph",)
    return False, ("spec.eager",)


def vllm_mode(plan: GraphPlan, num_draft_tokens: int) -> tuple[str, tuple[str, ...]]:
    """vLLM's ``cudagraph_mode`` name for ``plan``, and the rule ids of every phase
    decision that changed a mode on the way (with ``spec.*`` for verify batches)."""
    prefill = plan.phase(Phase.PREFILL).mode
    decode, decode_why = decode_captured(plan, num_draft_tokens)
    prefill_why = _changes(plan, Phase.PREFILL)
    return MODES[(prefill, decode)], prefill_why + decode_why


def cg_support(declaration: Capabilities, num_draft_tokens: int) -> str:
    """vLLM's ``AttentionCGSupport`` name for a decode backend's declaration.

    TARGET_VERIFY counts only when its graphs are uniform and hold the
    engine's verify length (``num_draft_tokens``; any declared length when
    speculative decoding is off).
    """
    full = declaration.graph_support(Phase.DECODE, GraphMode.FULL)
    if not (full.capture.is_native or full.capture.is_fallback):
        return "NEVER"
    for mode, name in SUPPORT:
        served = full.serving(mode)
        if served is None:
            continue
        if mode is ForwardMode.TARGET_VERIFY and not (
                served.uniform and served.serves_query_len(max(num_draft_tokens, 1))):
            continue
        return name
    return "NEVER"
