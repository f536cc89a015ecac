"""ReplayGate: may this batch replay a captured graph, or must it run eagerly?

The single source of truth for both forward-time ("can this batch run the
graph?") and schedule-time (the data-parallel exchange, :func:`sync`)
decisions: every data-parallel rank must reach the same answer or their
collectives mismatch, so the gate is a pure, deterministic function of the
plan and a small torch-free batch description.

It never answers from a fact it was not given.  Every fact of
:class:`ReplayBatch` but the forward mode and the batch size may be None,
"not known at this call site" (a scheduler has no ``capture_hidden_mode``
yet; sglang passes no prefix lengths for a decode batch converted to
extend).  A rule that needs a fact the batch lacks answers eagerly with its
own rule id, ``gate.fact_missing``, naming the fact and the rule
(``reason.fact``).  So the answer from fewer facts is the answer from all of
them or ``gate.fact_missing``: a schedule-time question never replays where
the forward-time question would not, and never pads to another bucket.

Mapping an engine batch onto :class:`ReplayBatch` (sglang names):

===================  =========================================================
ReplayBatch          engine batch
===================  =========================================================
forward_mode         ``forward_mode`` (DECODE, EXTEND, TARGET_VERIFY, DRAFT_EXTEND;
                     the phase word ``"prefill"`` means EXTEND)
batch_size           number of requests (``batch_size``; 0 for an idle DP rank)
num_tokens           tokens in the forward (``extend_num_tokens``; verify:
                     batch x draft tokens); needed by EXTEND and speculative
                     batches unless ``extend_lens`` are given
prefix_lens          ``extend_prefix_lens_cpu`` (host ints, never a device tensor);
                     cached tokens per request
extend_lens          ``extend_seq_lens_cpu`` (host ints): new tokens per request;
                     needed by the cost model and by draft-extend batches
seq_lens             ``seq_lens_cpu``: tokens per request after this forward
                     (cached + new); or give ``prefix_lens`` and the new tokens
lora                 the batch uses LoRA adapters
has_input_embeds     ``input_embeds is not None``
has_replace_embeds   ``replace_embeds is not None`` (multimodal embeds spliced in)
capture_hidden       ``capture_hidden_mode`` (NULL < LAST < FULL)
return_logprob       ``return_logprob``
===================  =========================================================

None in any field but the first two means "not known here" (the default for
the lengths; the flags default to their usual value, False / NULL).
"""

from __future__ import annotations

import enum
import logging
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union, cast

from ..registry.capabilities import (
    PHASE_FORWARD_MODES,
    SPECULATIVE_MODES,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
)
from .cost_profile import (
    CostComparison,
    CostProfile,
    PrefillShape,
    find_shipped_profile,
    load_profile,
)
from .fingerprint import PlanFingerprint, cost_profile_id, plan_fingerprint
from .plan import CapturedShapes, GraphPlan, PhasePlan
from .rule_ids import RULES, check_rule_id
from .sync import BatchFacts

__all__ = ["GATE_RULES", "CostProfileArg", "HiddenCapture", "ReplayBatch", "ReplayGate",
           "ReplayReason", "smallest_bucket"]

logger = logging.getLogger("attnreg.graph_policy")

#: What ``ReplayGate(cost_profile=...)`` accepts: a profile, a path to one,
#: ``"auto"`` (the shipped profile for the plan, if any) or None (no cost model).
CostProfileArg = Union[CostProfile, str, "os.PathLike[str]", None]

# one source for which phase serves a forward mode: the registry's PHASE_FORWARD_MODES
# (the runtime's phase_of reads it too)
_PHASE_OF_MODE = {mode: phase for phase, modes in PHASE_FORWARD_MODES.items() for mode in modes}


class HiddenCapture(enum.IntEnum):
    """Which hidden states a forward returns (ordered: a graph captured with
    FULL also serves LAST and NULL)."""

    NULL = 0
    LAST = 1
    FULL = 2


_LENGTHS = ("prefix_lens", "extend_lens", "seq_lens")
_INT = {int}
#: Facts about a batch's requests; an empty batch has none of them.
_FLAGS = {"lora": False, "has_input_embeds": False, "has_replace_embeds": False,
          "return_logprob": False}


def _forward_mode(value: ForwardMode | str) -> ForwardMode:
    """A forward mode, or the phase word ``prefill`` (EXTEND); else a ValueError naming both."""
    if isinstance(value, ForwardMode):  # the per-step case: no parsing
        return value
    if isinstance(value, str) and value.strip().lower() == "prefill":
        return ForwardMode.EXTEND
    try:
        return ForwardMode.parse(value)
    except ValueError:
        words = ", ".join(m.value for m in ForwardMode)
        raise ValueError(f"ReplayBatch: unknown forward mode {value!r}; expected one of {words} "
                         "(or the phase word prefill, meaning extend)") from None


@dataclass(frozen=True)
class ReplayBatch:
    """What the gate needs to know about a batch; plain Python values only.

    ``forward_mode`` is a :class:`ForwardMode` or its word (``"decode"``,
    ``"extend"``, ``"target_verify"``, ``"draft_extend"``; the phase word
    ``"prefill"`` means EXTEND).  Every other fact but ``batch_size`` may be
    None: not known at this call site, and the gate answers
    ``gate.fact_missing`` wherever a rule needs it (see the module doc).  An
    empty length sequence of a non-empty batch means "not known" too.  For an
    empty batch (an idle data-parallel rank) every per-request fact is known
    and read as such, whatever was passed: no lengths, no LoRA, no
    embeddings, no logprobs, no hidden states.

    Lengths that are given must agree with each other (one entry per
    request; ``sum(extend_lens) == num_tokens``; ``seq_lens == prefix_lens +
    new tokens``; a target-verify batch has the same new tokens, the draft
    tokens, in every request), else ``ValueError``.
    """

    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int | None = None
    prefix_lens: Sequence[int] | None = None
    lora: bool | None = False
    has_input_embeds: bool | None = False
    has_replace_embeds: bool | None = False
    capture_hidden: HiddenCapture | None = HiddenCapture.NULL
    return_logprob: bool | None = False
    extend_lens: Sequence[int] | None = None
    seq_lens: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward_mode", _forward_mode(self.forward_mode))
        empty = self.batch_size == 0
        # Host ints only (a device tensor here would sync); a tuple keeps it hashable.
        for name in _LENGTHS:
            values = getattr(self, name)
            # Once per step at every call site of the gate: a tuple of plain ints (what
            # ForwardBatch carries) is kept as is; anything else is converted, in C.
            if values is None:
                values = ()
            elif type(values) is not tuple or (values and set(map(type, values)) != _INT):
                values = tuple(map(int, values))
            object.__setattr__(self, name, values if values or empty else None)
        if empty:  # the flags describe requests, and there are none: nothing is unknown
            for name, value in _FLAGS.items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "capture_hidden", HiddenCapture.NULL)
        if self.capture_hidden is not None:
            object.__setattr__(self, "capture_hidden", HiddenCapture(self.capture_hidden))
        problems = []
        if self.batch_size < 0:
            problems.append(f"batch_size {self.batch_size} < 0")
        for name in _LENGTHS:
            values = getattr(self, name)
            if values and len(values) != self.batch_size:
                problems.append(f"{len(values)} {name} for batch_size {self.batch_size}")
            if values and min(values) < 0:
                problems.append(f"negative {name}")
        if self.extend_lens and self.num_tokens is not None \
                and self.num_tokens != sum(self.extend_lens):
            problems.append(f"num_tokens {self.num_tokens} != sum(extend_lens) "
                            f"{sum(self.extend_lens)}")
        if self.forward_mode is ForwardMode.DECODE:
            if self.num_tokens is not None and self.num_tokens != self.batch_size:
                problems.append(f"a decode batch has one token per request: num_tokens "
                                f"{self.num_tokens} != batch_size {self.batch_size}")
            if self.extend_lens and (min(self.extend_lens) != 1 or max(self.extend_lens) != 1):
                problems.append("a decode batch has one new token per request")
        if self.forward_mode is ForwardMode.TARGET_VERIFY and not empty:
            # Uniform by definition (every request verifies the draft tokens), which is
            # what lets num_tokens alone say the tokens per request.
            if self.extend_lens and len(set(self.extend_lens)) > 1:
                problems.append("a target-verify batch has the same new tokens (the draft "
                                f"tokens) in every request, not {list(self.extend_lens)}")
            if self.num_tokens is not None and self.num_tokens % self.batch_size:
                problems.append(f"a target-verify batch has the same new tokens in every "
                                f"request: num_tokens {self.num_tokens} is not a multiple of "
                                f"batch_size {self.batch_size}")
        if not problems and self.seq_lens and self.prefix_lens:
            query = self.query_lens
            if query is not None and any(
                    map(operator.ne, self.seq_lens, map(operator.add, self.prefix_lens, query))):
                problems.append("seq_lens != prefix_lens + new tokens per request")
        if problems:
            raise ValueError("inconsistent ReplayBatch: " + "; ".join(problems)
                             + " (give one length per request; they must agree)")

    @classmethod
    def checked(cls, forward_mode: ForwardMode, batch_size: int, num_tokens: int,
                prefix_lens: tuple[int, ...], extend_lens: tuple[int, ...],
                seq_lens: tuple[int, ...]) -> ReplayBatch:
        """A batch's facts whose lengths were already checked where they were made.

        For the runtime's own conversion of a batch that ``ForwardBatch.build``
        checked and that has not changed since (``attnreg.runtime.replay_batch``):
        tuples of plain ints, one per request, ``seq = prefix + extend``, one
        token per decode request, the same draft tokens in every verify request,
        no engine flags.  It skips the per-length checks of the constructor,
        which this per-step question would otherwise repeat for every request.
        Anything else: call ``ReplayBatch(...)``.
        """
        obj = object.__new__(cls)
        for name, value in (("forward_mode", forward_mode), ("batch_size", batch_size),
                            ("num_tokens", num_tokens), ("prefix_lens", prefix_lens or None),
                            ("lora", False), ("has_input_embeds", False),
                            ("has_replace_embeds", False), ("capture_hidden", HiddenCapture.NULL),
                            ("return_logprob", False), ("extend_lens", extend_lens or None),
                            ("seq_lens", seq_lens or None)):
            object.__setattr__(obj, name, value)
        if batch_size == 0:  # what the constructor reads an empty batch as
            for name in _LENGTHS:
                object.__setattr__(obj, name, ())
        return obj

    @property
    def has_prefix(self) -> bool | None:
        """Whether a request has cached tokens; None when ``prefix_lens`` is not known."""
        if self.prefix_lens is None:
            return None
        return any(n != 0 for n in self.prefix_lens)

    @property
    def tokens(self) -> int | None:
        """Query tokens of the forward: ``num_tokens``, else the sum of ``extend_lens``,
        else ``batch_size`` for a decode batch, else None (not given)."""
        if self.num_tokens is not None:
            return self.num_tokens
        if self.extend_lens is not None:
            return sum(self.extend_lens)
        if self.forward_mode is ForwardMode.DECODE or self.batch_size == 0:
            return self.batch_size
        return None

    @property
    def query_lens(self) -> tuple[int, ...] | None:
        """New tokens per request, when the batch says them (decode: 1 each; a verify
        batch's ``num_tokens`` split evenly, which verify batches are by definition; a
        single request's ``num_tokens``)."""
        if self.extend_lens is not None:
            return tuple(self.extend_lens)
        if self.forward_mode is ForwardMode.DECODE:
            return (1,) * self.batch_size
        if self.forward_mode is ForwardMode.TARGET_VERIFY and self.num_tokens is not None \
                and self.num_tokens % self.batch_size == 0:
            return (self.num_tokens // self.batch_size,) * self.batch_size
        if self.batch_size == 1 and self.num_tokens is not None:
            return (self.num_tokens,)
        return None

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence after this forward: from ``seq_lens``, else from
        ``prefix_lens`` and the new tokens; None when not given."""
        if self.batch_size == 0:
            return 0
        if self.seq_lens is not None:
            return max(self.seq_lens)
        query = self.query_lens
        if self.prefix_lens is not None and query is not None:
            return max(p + q for p, q in zip(self.prefix_lens, query))
        return None


@dataclass(frozen=True)
class ReplayReason:
    """A stable rule id (one of :data:`GATE_RULES`) and a message; ``str()`` is
    ``"rule: message"``.

    ``cost`` holds both per-layer predictions when the cost model decided;
    ``fact`` names the missing :class:`ReplayBatch` field of a
    ``gate.fact_missing`` reason (and ``needed_by`` the rule that needs it).
    """

    rule: str
    message: str
    cost: CostComparison | None = None
    fact: str | None = None
    needed_by: str | None = None

    def __post_init__(self) -> None:
        check_rule_id(self.rule)

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


#: Every rule id the gate can return, in evaluation order (from :data:`RULES`).
GATE_RULES: tuple[str, ...] = tuple(r.id for r in RULES.values() if r.kind == "gate")


def smallest_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The padding rule: the smallest of ``buckets`` (ascending) that holds ``n``; None above all.

    What :meth:`ReplayGate.bucket_for` pads a batch to, and what the cost
    model's graph time is predicted at (``attnreg.profiling`` uses it too).

    >>> smallest_bucket(300, (64, 512, 1024)), smallest_bucket(2000, (64, 512, 1024))
    (512, None)
    """
    for b in buckets:
        if b >= n:
            return b
    return None


def _missing(fact: str, rule: str, why: str) -> ReplayReason:
    """The eager answer for a batch that lacks ``fact``, which ``rule`` needs."""
    return ReplayReason("gate.fact_missing",
                        f"{fact} is not known at this call, and {rule} needs it: {why}. The "
                        "gate never answers from a missing fact, so the batch runs eagerly "
                        "(give the fact to decide it)", fact=fact, needed_by=rule)


class ReplayGate:
    """Replay eligibility for the graphs a :class:`GraphPlan` describes.

    Parameters
    ----------
    plan
        the resolved plan: modes, pinned methods, captured shapes, model facts.
    captured_hidden
        the hidden-state mode the graphs were captured with.
    eager_logprob_tail
        the engine computes prefill logprobs eagerly after replay; without
        it, a prefill batch that wants logprobs runs eagerly.
    cost_profile
        measured prefill costs (:mod:`attnreg.graph_policy.cost_profile`): a
        :class:`CostProfile`, a path to its JSON, ``"auto"`` for the profile
        shipped with attnreg for the plan's prefill backend, platform and KV
        dtype (if there is one), or None (default) for no cost model.  A
        profile for another backend, platform or KV dtype is ignored
        (:attr:`cost_model_note` says why).

    Notes
    -----
    A batch with a non-zero prefix under BREAKABLE prefill replays only if the
    prefill backend's declaration pins MLA for BREAKABLE on this platform;
    otherwise the MHA companion's prefix path could be captured, and it is
    not capturable: the batch runs eagerly (``gate.mha_companion_prefix``).
    This replaces the engine-wide "is this CUDA?" proxy.  TARGET_VERIFY and
    DRAFT_EXTEND batches replay the decode graphs only where the plan captured
    them (speculative decoding with a known draft length and a decode backend
    that declares them); otherwise ``gate.spec_forward_mode`` says why not.

    With a cost profile, a prefill batch that passed every other rule under
    a BREAKABLE graph that runs absorbed MLA (MLA pinned, a model with an MHA
    companion) replays only if the profile predicts the graph strictly faster
    per layer than the eager MHA companion; otherwise it runs eagerly
    (``gate.cost_model``).  The prediction reads every request's
    ``prefix_lens`` and ``extend_lens`` (never estimated from ``num_tokens``;
    without them: ``gate.fact_missing``).  Both predictions are in the
    reason's message and in ``reason.cost``.  It is arithmetic on host ints,
    so every rank agrees.

    :attr:`fingerprint` is what every data-parallel rank's gate must share
    (the plan's graphs, the cost profile, the gate's own settings);
    :meth:`facts` carries it into :func:`~attnreg.graph_policy.sync`.
    """

    def __init__(self, plan: GraphPlan, *, captured_hidden: HiddenCapture = HiddenCapture.NULL,
                 eager_logprob_tail: bool = False,
                 cost_profile: CostProfileArg = None) -> None:
        self.plan = plan
        self.captured_hidden = HiddenCapture(captured_hidden)
        self.eager_logprob_tail = eager_logprob_tail
        # LoRA prefill replay needs static LoRA metadata the prefill graphs only
        # have when LoRA was on at capture, and stays eager under DP attention
        # (seed 000); decode graphs capture LoRA batch info when LoRA is on.
        self._lora_replays = {
            Phase.DECODE: plan.features.lora,
            Phase.PREFILL: plan.features.lora and not plan.features.dp_attention,
        }
        self.cost_profile, self.cost_model_note = _select_profile(plan, cost_profile)
        logger.info("replay gate: %s", self.cost_model_note)
        used = self.cost_profile if self.uses_cost_model else None
        self._fingerprint = plan_fingerprint(
            plan, cost_profile_id=cost_profile_id(used),
            gate_settings={"captured_hidden": self.captured_hidden.name,
                           "eager_logprob_tail": str(bool(eager_logprob_tail))})

    @property
    def uses_cost_model(self) -> bool:
        """Whether a cost profile decides this plan's prefill batches."""
        return self.cost_profile is not None and _cost_model_applies(self.plan)

    @property
    def fingerprint(self) -> PlanFingerprint:
        """What every data-parallel rank's gate must share (:func:`plan_fingerprint` of
        the plan, the id of the cost profile in use, the captured hidden states and the
        eager logprob tail); ``str()`` is its 12-digit hash."""
        return self._fingerprint

    def can_replay(self, batch: ReplayBatch) -> tuple[bool, ReplayReason]:
        """``(True, gate.ok)`` or ``(False, reason)``; first failing rule wins.

        Deterministic: the same plan and batch give the same answer on every
        rank.  A rule that needs a fact the batch does not carry answers
        ``gate.fact_missing`` (``reason.fact`` names it), never a guess.
        """
        reason = self._first_blocker(batch)
        if reason is not None:
            return False, reason
        cost = self._cost_decision(batch)
        if cost is not None:
            return cost.rule == "gate.ok", cost
        return True, ReplayReason("gate.ok", "the batch replays a captured graph")

    def shapes_for(self, mode: ForwardMode | str) -> CapturedShapes | None:
        """The graphs captured for forward mode ``mode`` (None: nothing serves it)."""
        fm = _forward_mode(mode)
        pp = self.plan.phase(_PHASE_OF_MODE[fm])
        return None if pp.mode is GraphMode.DISABLED else pp.shapes_for(fm)

    def bucket_for(self, batch: ReplayBatch) -> int | None:
        """The captured bucket the batch pads to, None when no captured graph holds it
        (or the batch's size in the graphs' unit is not known).

        The unit is the graphs' key: tokens for EXTEND (prefill graphs are
        captured per token count), requests for DECODE, TARGET_VERIFY and
        DRAFT_EXTEND (decode-phase graphs are captured per batch size, each
        sequence with the captured query tokens).  This is the padding rule
        the gate itself applies; it does not say whether the batch is eligible
        (:meth:`can_replay` does).
        """
        shapes = self.shapes_for(batch.forward_mode)
        if shapes is None:
            return None
        return self._bucket_in(shapes, batch)

    def facts(self, batch: ReplayBatch) -> BatchFacts:
        """This rank's facts for :func:`~attnreg.graph_policy.sync`: eligibility (with
        its reason), forward mode, size, padded bucket, longest sequence and the
        gate's :attr:`fingerprint`.  An idle rank passes ``ReplayBatch(mode, 0)``."""
        ok, reason = self.can_replay(batch)
        return BatchFacts(eligible=ok, forward_mode=batch.forward_mode,
                          batch_size=batch.batch_size, num_tokens=batch.tokens,
                          bucket=self.bucket_for(batch) if ok else None,
                          max_seq_len=batch.max_seq_len, reason=reason,
                          fingerprint=self._fingerprint)

    @staticmethod
    def _bucket_in(shapes: CapturedShapes, batch: ReplayBatch) -> int | None:
        if shapes.keyed_by_tokens:
            tokens = batch.tokens
            return None if tokens is None else smallest_bucket(tokens, shapes.buckets())
        return smallest_bucket(batch.batch_size, shapes.buckets())

    def _first_blocker(self, batch: ReplayBatch) -> ReplayReason | None:
        """The first rule (in :data:`GATE_RULES` order) that keeps the batch eager.

        A rule whose fact the batch lacks answers ``gate.fact_missing`` in its
        place: the rules before it were decided from facts the batch has, so
        the answer with every fact is this one or a later rule's eager answer.
        """
        mode = batch.forward_mode
        phase = _PHASE_OF_MODE[mode]
        pp = self.plan.phase(phase)
        shapes = self.shapes_for(mode)
        busy = batch.batch_size > 0
        if mode in SPECULATIVE_MODES and shapes is None:
            spec = self.plan.speculative_for(mode)
            why = spec.message if spec is not None else (
                "speculative decoding is off in this plan (ServerFeatures."
                "speculative_decoding, EngineFacts.num_draft_tokens)")
            return ReplayReason("gate.spec_forward_mode",
                                f"no captured graph serves {mode} batches: {why}")
        if shapes is None:
            why = (f"{phase} graphs are disabled in the plan" if pp.mode is GraphMode.DISABLED
                   else f"the {phase} graphs of {pp.backend} serve no {mode} batches")
            return ReplayReason("gate.phase_disabled", why)
        if batch.batch_size > shapes.max_requests:
            return ReplayReason("gate.batch_slots",
                                f"{batch.batch_size} requests exceed the "
                                f"{shapes.max_requests} captured {mode} slots")
        if mode in SPECULATIVE_MODES and busy:
            reason = self._spec_query_reason(batch, shapes)
            if reason is not None:
                return reason
        if not self._lora_replays[phase]:
            if batch.lora is None:
                return _missing("lora", "gate.lora", f"{phase} graphs do not replay LoRA "
                                "batches here")
            if batch.lora:
                why = ("LoRA was not enabled when the graphs were captured" if
                       not self.plan.features.lora else
                       "LoRA prefill stays eager under DP attention")
                return ReplayReason("gate.lora", why)
        if batch.has_input_embeds is None:
            return _missing("has_input_embeds", "gate.input_embeds",
                            "input embeddings bypass the captured embedding lookup")
        if batch.has_input_embeds:
            return ReplayReason("gate.input_embeds", "input embeddings bypass the captured "
                                "embedding lookup")
        if batch.has_replace_embeds is None:
            return _missing("has_replace_embeds", "gate.replace_embeds",
                            "replaced embeddings are not part of the captured graph")
        if batch.has_replace_embeds:
            return ReplayReason("gate.replace_embeds", "replaced (multimodal) embeddings are "
                                "not part of the captured graph")
        if (phase is Phase.PREFILL and pp.mode is GraphMode.BREAKABLE
                and self.plan.model.has_mha_companion
                and pp.pinned_method is not ForwardMethod.MLA and busy):
            if batch.has_prefix is None:
                return _missing("prefix_lens", "gate.mha_companion_prefix",
                                f"{pp.backend} does not pin mla under breakable, so a batch "
                                "with a cached prefix must run eagerly")
            if batch.has_prefix:
                return ReplayReason("gate.mha_companion_prefix",
                                    f"{pp.backend} does not pin mla under breakable on "
                                    f"{self.plan.platform}, so the MHA companion's prefix "
                                    "path would be captured, and it is not capturable")
        if self.captured_hidden < HiddenCapture.FULL:  # FULL graphs serve every batch
            if batch.capture_hidden is None:
                return _missing("capture_hidden", "gate.hidden_capture",
                                f"graphs captured {self.captured_hidden.name} hidden states")
            if batch.capture_hidden > self.captured_hidden:
                return ReplayReason("gate.hidden_capture",
                                    f"the batch wants {batch.capture_hidden.name} hidden "
                                    f"states; graphs captured {self.captured_hidden.name}")
        if phase is Phase.PREFILL and not self.eager_logprob_tail:
            if batch.return_logprob is None:
                return _missing("return_logprob", "gate.logprob_without_eager_tail",
                                "prefill logprobs need an eager tail this engine does not run")
            if batch.return_logprob:
                return ReplayReason("gate.logprob_without_eager_tail",
                                    "prefill logprobs need an eager tail after replay, which "
                                    "this engine does not run")
        padded: int | None = None
        tokens = batch.tokens
        if phase is Phase.PREFILL and busy:
            if tokens is None:
                return _missing("num_tokens", "gate.num_tokens_above_max",
                                "prefill graphs are chosen by token count (give num_tokens or "
                                "extend_lens)")
            padded = smallest_bucket(tokens, shapes.buckets())
            if padded is None:
                return ReplayReason("gate.num_tokens_above_max",
                                    f"{tokens} tokens exceed the largest captured "
                                    f"bucket ({shapes.buckets()[-1]})")
        longest = batch.max_seq_len
        if longest is None:
            return _missing("seq_lens", "gate.seq_len_above_max",
                            f"the {mode} graphs were captured for sequences up to "
                            f"{shapes.max_seq_len} tokens (give seq_lens, or prefix_lens and "
                            "the new tokens)")
        if longest > shapes.max_seq_len:
            return ReplayReason("gate.seq_len_above_max",
                                f"a sequence of {longest} tokens exceeds the {shapes.max_seq_len} "
                                f"the {mode} graphs were captured for (the engine's max context)")
        if padded is not None and tokens is not None:
            factor = self.plan.config.padding_waste_factor
            if padded > tokens * factor:
                return ReplayReason("gate.padding_waste",
                                    f"{tokens} tokens pad to {padded}, more than "
                                    f"{factor:g}x")
        return None

    @staticmethod
    def _spec_query_reason(batch: ReplayBatch, shapes: CapturedShapes) -> ReplayReason | None:
        q = shapes.query_len or 1
        mode = batch.forward_mode
        query = batch.query_lens
        if mode is ForwardMode.TARGET_VERIFY:
            if query is None:
                return _missing("num_tokens", "gate.spec_query_len",
                                "a verify batch replays only with the captured draft tokens per "
                                "sequence (give num_tokens or extend_lens)")
            if any(n != q for n in query):
                return ReplayReason("gate.spec_query_len",
                                    f"verify graphs are captured for {q} tokens per sequence; "
                                    f"this batch has {sorted(set(query))}")
            return None
        if query is None:
            return _missing("extend_lens", "gate.spec_query_len",
                            "a draft-extend batch replays only when no sequence has more than "
                            "the captured draft tokens")
        longest = max(query)
        if longest > q or min(query) < 1:
            return ReplayReason("gate.spec_query_len",
                                f"draft-extend graphs are captured for 1..{q} tokens per "
                                f"sequence; this batch has up to {longest}")
        return None

    def _cost_decision(self, batch: ReplayBatch) -> ReplayReason | None:
        """The cost model's verdict on an otherwise eligible batch, or None if it does not apply.

        Applies to non-empty prefill batches under a BREAKABLE graph that runs
        absorbed MLA for a model that has an MHA companion; it reads every
        request's ``prefix_lens`` and ``extend_lens`` (without them:
        ``gate.fact_missing``).
        """
        profile = self.cost_profile
        if profile is None or not self.uses_cost_model:
            return None
        if batch.forward_mode is not ForwardMode.EXTEND or batch.batch_size == 0:
            return None
        if batch.extend_lens is None:
            return _missing("extend_lens", "gate.cost_model", "the cost model predicts from "
                            "every request's new tokens (num_tokens alone would be a guess)")
        if batch.prefix_lens is None:
            return _missing("prefix_lens", "gate.cost_model", "the cost model predicts from "
                            "every request's cached tokens")
        shape = PrefillShape(tuple(batch.prefix_lens), tuple(batch.extend_lens),
                             self.plan.model.num_heads)
        tokens = shape.q_tokens
        padded = smallest_bucket(tokens, self.plan.config.prefill_num_tokens) or tokens
        cmp = profile.compare(shape, graph_tokens=padded)
        what = f"{shape.describe()}" + (f", padded to {padded}" if padded != tokens else "")
        if cmp.graph_wins:
            return ReplayReason("gate.ok",
                                f"the batch replays a captured graph: the cost model predicts "
                                f"absorbed graph {cmp.graph_us:.1f} us/layer < eager MHA "
                                f"{cmp.eager_us:.1f} us/layer for {what} (profile "
                                f"{profile.label})", cost=cmp)
        return ReplayReason("gate.cost_model",
                            f"eager MHA is predicted no slower: {cmp.eager_us:.1f} us/layer "
                            f"vs absorbed graph {cmp.graph_us:.1f} us/layer for {what} "
                            f"(profile {profile.label}; ties run eagerly)", cost=cmp)


def _cost_model_applies(plan: GraphPlan) -> bool:
    pp: PhasePlan = plan.prefill
    return (pp.mode is GraphMode.BREAKABLE and pp.pinned_method is ForwardMethod.MLA
            and plan.model.has_mha_companion)


def _select_profile(plan: GraphPlan, arg: CostProfileArg) -> tuple[CostProfile | None, str]:
    """The profile the gate will use (None: no cost model) and a note saying why."""
    pp = plan.prefill
    kv = plan.model.kv_dtype
    want = f"{pp.backend} on {plan.platform} with a {kv} KV pool"
    if arg is None:
        return None, "no cost profile: eligible prefill batches always replay"
    if isinstance(arg, CostProfile):
        profile = arg
    elif isinstance(arg, str) and arg == "auto":
        found = find_shipped_profile(pp.backend, plan.platform, kv)
        if found is None:
            return None, (f"no shipped cost profile for {want}: eligible prefill batches "
                          "always replay (calibrate one with `attnreg calibrate`)")
        profile = found
    else:
        profile = load_profile(cast("str | os.PathLike[str]", arg))
    if not profile.matches(pp.backend, plan.platform, kv):
        return None, (f"cost profile {profile.source} ({profile.label}) ignored: the plan "
                      f"runs prefill with {want}")
    if not _cost_model_applies(plan):
        return profile, (f"cost profile {profile.source} ({profile.label}) loaded, but "
                         f"prefill is {pp.mode} with pinned method "
                         f"{pp.pinned_method.value if pp.pinned_method else 'none'}: the "
                         "cost model decides only breakable graphs that run absorbed MLA "
                         "for a model with an MHA companion")
    heads = plan.model.num_heads
    scaled = ""
    if profile.calibrated_heads is not None and profile.calibrated_heads != heads:
        scaled = (f" (calibrated at {profile.calibrated_heads} heads; its per-head terms are "
                  f"scaled linearly to {heads})")
    return profile, (f"cost model from {profile.source} ({profile.label}): a prefill batch "
                     "replays only when the absorbed graph is predicted faster than eager "
                     f"MHA{scaled}")
