"""ReplayGate: may this batch replay a captured graph, or must it run eagerly?

The single source of truth for both forward-time ("can this batch run the
graph?") and schedule-time (the data-parallel vote, :func:`vote`) decisions:
every data-parallel rank must reach the same answer or their collectives
mismatch, so the gate is a pure, deterministic function of the plan and a
small torch-free batch description.

Mapping an engine batch onto :class:`ReplayBatch` (sglang names):

===================  =========================================================
ReplayBatch          engine batch
===================  =========================================================
forward_mode         ``forward_mode`` (DECODE, EXTEND, TARGET_VERIFY, DRAFT_EXTEND)
batch_size           number of requests (``batch_size``)
num_tokens           tokens in the forward (``extend_num_tokens`` / sum of extend
                     lengths); None at schedule time if unknown (skips token checks)
prefix_lens          ``extend_prefix_lens_cpu`` (host ints, never a device tensor)
extend_lens          ``extend_seq_lens_cpu`` (host ints; read only by the cost model)
lora                 the batch uses LoRA adapters
has_input_embeds     ``input_embeds is not None``
has_replace_embeds   ``replace_embeds is not None`` (multimodal embeds spliced in)
capture_hidden       ``capture_hidden_mode`` (NULL < LAST < FULL)
return_logprob       ``return_logprob``
===================  =========================================================
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union, cast

from ..registry.capabilities import ForwardMethod, ForwardMode, GraphMode, Phase
from .cost_profile import (
    CostComparison,
    CostProfile,
    PrefillShape,
    find_shipped_profile,
    load_profile,
)
from .plan import GraphPlan
from .rule_ids import RULES, check_rule_id

__all__ = ["GATE_RULES", "CostProfileArg", "HiddenCapture", "ReplayBatch", "ReplayGate",
           "ReplayReason"]

logger = logging.getLogger("attnreg.graph_policy")

#: What ``ReplayGate(cost_profile=...)`` accepts: a profile, a path to one,
#: ``"auto"`` (the shipped profile for the plan, if any) or None (no cost model).
CostProfileArg = Union[CostProfile, str, "os.PathLike[str]", None]


class HiddenCapture(enum.IntEnum):
    """Which hidden states a forward returns (ordered: a graph captured with
    FULL also serves LAST and NULL)."""

    NULL = 0
    LAST = 1
    FULL = 2


@dataclass(frozen=True)
class ReplayBatch:
    """What the gate needs to know about a batch; plain Python values only."""

    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int | None = None
    prefix_lens: Sequence[int] = ()
    lora: bool = False
    has_input_embeds: bool = False
    has_replace_embeds: bool = False
    capture_hidden: HiddenCapture = HiddenCapture.NULL
    return_logprob: bool = False
    extend_lens: Sequence[int] = ()

    def __post_init__(self) -> None:
        # Host ints only (a device tensor here would sync); a tuple keeps it hashable.
        object.__setattr__(self, "prefix_lens", tuple(int(n) for n in self.prefix_lens))
        object.__setattr__(self, "extend_lens", tuple(int(n) for n in self.extend_lens))
        if self.extend_lens:
            problems = []
            if len(self.extend_lens) != self.batch_size:
                problems.append(f"{len(self.extend_lens)} extend_lens for batch_size "
                                f"{self.batch_size}")
            if self.prefix_lens and len(self.prefix_lens) != len(self.extend_lens):
                problems.append(f"{len(self.prefix_lens)} prefix_lens and "
                                f"{len(self.extend_lens)} extend_lens")
            if self.num_tokens is not None and self.num_tokens != sum(self.extend_lens):
                problems.append(f"num_tokens {self.num_tokens} != sum(extend_lens) "
                                f"{sum(self.extend_lens)}")
            if problems:
                raise ValueError("inconsistent ReplayBatch: " + "; ".join(problems)
                                 + " (one extend length per request, summing to num_tokens)")

    @property
    def has_prefix(self) -> bool:
        return any(n != 0 for n in self.prefix_lens)

    @property
    def tokens(self) -> int | None:
        """``num_tokens``, else the sum of ``extend_lens`` when given, else None."""
        if self.num_tokens is not None:
            return self.num_tokens
        return sum(self.extend_lens) if self.extend_lens else None


@dataclass(frozen=True)
class ReplayReason:
    """A stable rule id (one of :data:`GATE_RULES`) and a message; ``str()`` is
    ``"rule: message"``.

    ``cost`` holds both per-layer predictions when the cost model decided.
    """

    rule: str
    message: str
    cost: CostComparison | None = None

    def __post_init__(self) -> None:
        check_rule_id(self.rule)

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


#: Every rule id the gate can return, in evaluation order (from :data:`RULES`).
GATE_RULES: tuple[str, ...] = tuple(r.id for r in RULES.values() if r.kind == "gate")

_PHASE_OF_MODE = {ForwardMode.DECODE: Phase.DECODE, ForwardMode.EXTEND: Phase.PREFILL}


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class ReplayGate:
    """Replay eligibility for the graphs a :class:`GraphPlan` describes.

    Parameters
    ----------
    plan
        the resolved plan: modes, pinned methods, capture sizes, model facts.
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
    DRAFT_EXTEND batches never replay these graphs (they are captured as
    DECODE/EXTEND without speculative state).

    With a cost profile, a prefill batch that passed every other rule under
    a BREAKABLE graph that runs absorbed MLA (MLA pinned, a model with an MHA
    companion) replays only if the profile predicts the graph strictly faster
    per layer than the eager MHA companion; otherwise it runs eagerly
    (``gate.cost_model``).  Both predictions are in the reason's message and
    in ``reason.cost``.  The prediction is arithmetic on host ints, so every
    rank agrees.
    """

    def __init__(self, plan: GraphPlan, *, captured_hidden: HiddenCapture = HiddenCapture.NULL,
                 eager_logprob_tail: bool = False,
                 cost_profile: CostProfileArg = None) -> None:
        self.plan = plan
        self.captured_hidden = HiddenCapture(captured_hidden)
        self.eager_logprob_tail = eager_logprob_tail
        cfg = plan.config
        # LoRA prefill replay needs static LoRA metadata the prefill graphs only
        # have when LoRA was on at capture, and stays eager under DP attention
        # (seed 000); decode graphs capture LoRA batch info when LoRA is on.
        self._lora_replays = {
            Phase.DECODE: plan.features.lora,
            Phase.PREFILL: plan.features.lora and not plan.features.dp_attention,
        }
        self._max_slots = {p: cfg.max_slots(p) for p in Phase}
        self.cost_profile, self.cost_model_note = _select_profile(plan, cost_profile)
        logger.info("replay gate: %s", self.cost_model_note)

    @property
    def uses_cost_model(self) -> bool:
        """Whether a cost profile decides this plan's prefill batches."""
        return self.cost_profile is not None and _cost_model_applies(self.plan)

    def can_replay(self, batch: ReplayBatch) -> tuple[bool, ReplayReason]:
        """``(True, gate.ok)`` or ``(False, reason)``; first failing rule wins.

        Deterministic: the same plan and batch give the same answer on every
        rank.
        """
        reason = self._first_blocker(batch)
        if reason is not None:
            return False, reason
        cost = self._cost_decision(batch)
        if cost is not None:
            return cost.rule == "gate.ok", cost
        return True, ReplayReason("gate.ok", "the batch replays a captured graph")

    def _first_blocker(self, batch: ReplayBatch) -> ReplayReason | None:
        phase = _PHASE_OF_MODE.get(cast(ForwardMode, ForwardMode.parse(batch.forward_mode)))
        if phase is None:
            return ReplayReason("gate.spec_forward_mode",
                                f"{batch.forward_mode} batches are not captured by these "
                                "graphs (captured as decode/extend without speculative "
                                "state)")
        pp = self.plan.phase(phase)
        if pp.mode is GraphMode.DISABLED:
            return ReplayReason("gate.phase_disabled", f"{phase} graphs are disabled in the "
                                "plan")
        if batch.batch_size > self._max_slots[phase]:
            return ReplayReason("gate.batch_slots",
                                f"{batch.batch_size} requests exceed the "
                                f"{self._max_slots[phase]} captured {phase} slots")
        if batch.lora and not self._lora_replays[phase]:
            why = ("LoRA was not enabled when the graphs were captured" if
                   not self.plan.features.lora else
                   "LoRA prefill stays eager under DP attention")
            return ReplayReason("gate.lora", why)
        if batch.has_input_embeds:
            return ReplayReason("gate.input_embeds", "input embeddings bypass the captured "
                                "embedding lookup")
        if batch.has_replace_embeds:
            return ReplayReason("gate.replace_embeds", "replaced (multimodal) embeddings are "
                                "not part of the captured graph")
        if (phase is Phase.PREFILL and pp.mode is GraphMode.BREAKABLE
                and self.plan.model.has_mha_companion and batch.has_prefix
                and pp.pinned_method is not ForwardMethod.MLA):
            return ReplayReason("gate.mha_companion_prefix",
                                f"{pp.backend} does not pin mla under breakable on "
                                f"{self.plan.platform}, so the MHA companion's prefix path "
                                "would be captured, and it is not capturable")
        if batch.capture_hidden > self.captured_hidden:
            return ReplayReason("gate.hidden_capture",
                                f"the batch wants {batch.capture_hidden.name} hidden states; "
                                f"graphs captured {self.captured_hidden.name}")
        if phase is Phase.PREFILL and batch.return_logprob and not self.eager_logprob_tail:
            return ReplayReason("gate.logprob_without_eager_tail",
                                "prefill logprobs need an eager tail after replay, which this "
                                "engine does not run")
        tokens = batch.tokens
        if phase is Phase.PREFILL and tokens is not None:
            buckets = self.plan.config.prefill_num_tokens
            padded = _bucket(tokens, buckets)
            if padded is None:
                return ReplayReason("gate.num_tokens_above_max",
                                    f"{tokens} tokens exceed the largest captured "
                                    f"bucket ({buckets[-1]})")
            factor = self.plan.config.padding_waste_factor
            if padded > tokens * factor:
                return ReplayReason("gate.padding_waste",
                                    f"{tokens} tokens pad to {padded}, more than "
                                    f"{factor:g}x")
        return None

    def _cost_decision(self, batch: ReplayBatch) -> ReplayReason | None:
        """The cost model's verdict on an otherwise eligible batch, or None if it does not apply.

        Applies to prefill batches under a BREAKABLE graph that runs absorbed
        MLA for a model that has an MHA companion, when the batch's lengths
        are known (``extend_lens``, or ``num_tokens`` split evenly).
        """
        profile = self.cost_profile
        if profile is None or not self.uses_cost_model:
            return None
        if ForwardMode.parse(batch.forward_mode) is not ForwardMode.EXTEND:
            return None
        shape, estimated = _prefill_shape(batch, self.plan.model.num_heads)
        if shape is None:
            return None  # schedule time without lengths: the other rules decided
        tokens = shape.q_tokens
        padded = _bucket(tokens, self.plan.config.prefill_num_tokens) or tokens
        cmp = profile.compare(shape, graph_tokens=padded)
        what = (f"{shape.describe()}" + (f", padded to {padded}" if padded != tokens else "")
                + (" (extend lengths estimated: num_tokens split evenly)" if estimated else ""))
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
    pp = plan.prefill
    return (pp.mode is GraphMode.BREAKABLE and pp.pinned_method is ForwardMethod.MLA
            and plan.model.has_mha_companion)


def _prefill_shape(batch: ReplayBatch, heads: int) -> tuple[PrefillShape | None, bool]:
    """The batch's lengths for the cost model, and whether they were estimated."""
    prefix = list(batch.prefix_lens)
    if batch.extend_lens:
        extend = list(batch.extend_lens)
        return PrefillShape(tuple(prefix or [0] * len(extend)), tuple(extend), heads), False
    if batch.num_tokens is None:
        return None, False
    n = len(prefix) if prefix else max(batch.batch_size, 1)
    share, extra = divmod(batch.num_tokens, n)
    extend = [share + (1 if i < extra else 0) for i in range(n)]
    return PrefillShape(tuple(prefix or [0] * n), tuple(extend), heads), True


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
        profile = load_profile(arg)
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
