"""The one call from the sglang bridge into :func:`attnreg.graph_policy.resolve`.

:func:`plan_for` is the only function of the bridge that knows resolve()'s
signature.  resolve() takes the engine facts (page size, context, running
requests, draft tokens) and the host's graph modes in
:class:`~attnreg.graph_policy.EngineFacts`: a mode sglang lacks is never a
default and a lock on it is a hard error (``engine.mode_unsupported``).
:func:`check_host_locks` refuses such a lock earlier, in the bridge's first
step, before sglang's own validation would stop startup with a bare
``not allowed``.  resolve()'s errors split in two: a lock that breaks a
hard rule fails startup (:class:`SglangGraphPolicyError`); a declaration
that cannot serve a phase at all (:class:`DeclarationGap`) leaves the server
to sglang's rules.
"""

from __future__ import annotations

from dataclasses import replace

from attnreg.graph_policy import RULES, GraphPlan, resolve
from attnreg.registry.capabilities import (
    VALID_GRAPH_MODES,
    Capabilities,
    CaptureSupport,
    DType,
    GraphMode,
    GraphModeSupport,
    Phase,
    SparseKernel,
    SparseKVFormat,
)
from attnreg.registry.errors import GraphPolicyError

from . import facts as _facts
from .facts import SglangFacts

__all__ = ["PLACEHOLDER", "DeclarationGap", "SglangGraphPolicyError", "check_host_locks",
           "plan_for", "sglang_placeholder"]

#: resolve()'s errors that mean "no attnreg declaration serves this" (no plan at all),
#: as opposed to a lock that breaks a hard rule.
_SELECTION_RULES = tuple(rule.id for rule in RULES.values() if rule.kind == "error")
_PHASES = (Phase.PREFILL, Phase.DECODE)


class SglangGraphPolicyError(GraphPolicyError, ValueError):
    """attnreg refuses sglang's graph configuration; a ValueError like sglang's own
    argument errors, so sglang's startup reports it the same way."""


class DeclarationGap(Exception):
    """attnreg's declaration of the mapped backend cannot serve a phase of this server
    (unavailable on the platform, no kernel for the phase or the model): attnreg
    has nothing to decide with, so sglang's own rules decide.  ``reasons`` lists why;
    ``phases`` the phases they name (all of them when a reason names none)."""

    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        # resolve()'s reasons about a phase start with it ("decode: ...", "prefill
        # breakable (set by the user): ..."); one about no phase with its rule id.
        def about(reason: str, phase: Phase) -> bool:
            return reason.startswith((f"{phase.value}:", f"{phase.value} "))

        named = {p for p in _PHASES for r in reasons if about(r, p)}
        unnamed = any(not any(about(r, p) for p in _PHASES) for r in reasons)
        self.phases = frozenset(_PHASES) if unnamed or not named else frozenset(named)
        super().__init__("; ".join(reasons))


def check_host_locks(locked: dict[Phase, GraphMode],
                     host_modes: dict[Phase, frozenset[GraphMode]]) -> None:
    """Raise :class:`SglangGraphPolicyError` when a locked mode is one the host lacks."""
    reasons = [f"sglang.host_modes: {phase} {mode} was set explicitly, but this sglang accepts "
               f"only {', '.join(sorted(m.value for m in host_modes[phase]))} for {phase}"
               for phase, mode in locked.items() if mode not in host_modes[phase]]
    if reasons:
        raise SglangGraphPolicyError(
            reasons, hint="To fix: choose a mode this sglang release supports "
                          "(--cuda-graph-backend-prefill / --cuda-graph-config).")


#: The backend name of :func:`sglang_placeholder`'s declarations.
PLACEHOLDER = "sglang"
_SPARSE_FORMATS = {DType.BF16: SparseKVFormat.BF16, DType.FP8_E4M3: SparseKVFormat.FP8_DS_MLA}


def sglang_placeholder(phase: Phase, facts: SglangFacts) -> Capabilities | None:
    """A stand-in for sglang's own backend in a phase attnreg does not decide, for a
    sparse model; None for a dense one (attnreg's default backend stands in) or a
    pool no sparse row format names.

    resolve() plans both phases.  A dense model always has some declared backend to
    stand in for the undecided phase; a sparse one may have none (no declared sparse
    prefill kernel reads fp8_ds_mla rows, say), which would leave the decided phase
    undecided too.  This declaration accepts exactly the model, serves the phase
    eagerly and declares every capture mode UNSUPPORTED; the phase is planned
    disabled, so it adds no capture memory, and the plan's entry for it is never used.
    It is never registered and never runs.
    """
    model, engine = facts.model, facts.engine
    if model is None or not model.sparse:
        return None
    fmt = _SPARSE_FORMATS.get(model.kv_dtype)
    if fmt is None or model.act_dtype is None:
        return None
    why = f"sglang's own rules decide {phase}: attnreg has no declaration of its kernel"
    label = f"sglang's own {phase} backend (a placeholder: attnreg does not decide it)"
    pages = (engine.page_size,) if engine.page_size else (1,)
    sparse = SparseKernel(frozenset({phase}), frozenset({model.act_dtype}), fmt,
                          page_sizes=pages, head_counts=(model.num_heads,),
                          top_k_sizes=(int(model.sparse_top_k or 1),), kernel=label)
    modes = tuple(GraphModeSupport(phase, mode, CaptureSupport.unsupported(why))
                  for mode in VALID_GRAPH_MODES[phase])
    return Capabilities(
        backend=PLACEHOLDER, platform=facts.platform, vendors=frozenset({facts.platform.vendor}),
        kernels=(), graph_modes=modes,
        sparse_kernels=(sparse,), sparse_graph_modes=modes, notes=(why,))


def plan_for(facts: SglangFacts, phases: frozenset[Phase] | None = None) -> GraphPlan:
    """attnreg's plan for the ``phases`` it decides (default: every phase without a gap).

    A phase outside ``phases`` is sglang's: resolve() sees it disabled and
    unlocked, with attnreg's default backend for it as a placeholder (for a
    sparse model :func:`sglang_placeholder`, since no declared backend may fit
    it), so it adds no capture memory and no lock; the caller uses only the
    decided phases' modes and decisions.

    Raises :class:`SglangGraphPolicyError` when a locked mode breaks a hard
    rule or is one the host lacks (every reason listed), and
    :class:`DeclarationGap` when the mapped declaration cannot serve a phase
    at all (sglang's backend may well run it; attnreg cannot judge it).
    """
    if facts.model is None or facts.config is None:
        raise ValueError("plan_for needs facts without gaps: " + "; ".join(facts.gaps))
    decided = facts.decidable_phases if phases is None else phases
    if not decided:
        raise ValueError("plan_for needs a phase to decide: " + "; ".join(facts.all_gaps))
    backends = tuple(facts.backends[p].attnreg if p in decided
                     else sglang_placeholder(p, facts) for p in _PHASES)
    config = facts.config
    for phase in _PHASES:
        if phase not in decided:
            config = replace(config, **{f"{phase.value}_mode": GraphMode.DISABLED},
                             locked=config.locked - {f"{phase.value}_mode"})
    try:
        # assume_installed: the kernels run inside sglang, whose install carries the
        # libraries; attnreg's own optional extras need not be present.
        plan = resolve(facts.platform, facts.model, backends, config, facts.features,
                       facts.engine, registry=_facts.bridge_registry(), assume_installed=True)
    except GraphPolicyError as exc:
        if any(f"{rule}:" in reason for reason in exc.reasons for rule in _SELECTION_RULES):
            raise DeclarationGap(exc.reasons) from exc
        raise SglangGraphPolicyError(exc.reasons, exc.hint) from exc
    return plan
