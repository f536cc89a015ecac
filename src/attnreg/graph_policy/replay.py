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
lora                 the batch uses LoRA adapters
has_input_embeds     ``input_embeds is not None``
has_replace_embeds   ``replace_embeds is not None`` (multimodal embeds spliced in)
capture_hidden       ``capture_hidden_mode`` (NULL < LAST < FULL)
return_logprob       ``return_logprob``
===================  =========================================================
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from ..registry.capabilities import ForwardMethod, ForwardMode, GraphMode, Phase
from .plan import GraphPlan

__all__ = ["GATE_RULES", "HiddenCapture", "ReplayBatch", "ReplayGate", "ReplayReason"]


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

    def __post_init__(self) -> None:
        # Host ints only (a device tensor here would sync); a tuple keeps it hashable.
        object.__setattr__(self, "prefix_lens", tuple(int(n) for n in self.prefix_lens))

    @property
    def has_prefix(self) -> bool:
        return any(n != 0 for n in self.prefix_lens)


@dataclass(frozen=True)
class ReplayReason:
    """A stable rule id and a message; ``str()`` is ``"rule: message"``."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


#: Every rule id the gate can return, in evaluation order.
GATE_RULES: tuple[str, ...] = (
    "gate.spec_forward_mode",
    "gate.phase_disabled",
    "gate.batch_slots",
    "gate.lora",
    "gate.input_embeds",
    "gate.replace_embeds",
    "gate.mha_companion_prefix",
    "gate.hidden_capture",
    "gate.logprob_without_eager_tail",
    "gate.num_tokens_above_max",
    "gate.padding_waste",
    "gate.ok",
)

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

    Notes
    -----
    A batch with a non-zero prefix under BREAKABLE prefill replays only if the
    prefill backend's declaration pins MLA for BREAKABLE on this platform;
    otherwise the MHA companion's prefix path could be captured, and it is
    not capturable: the batch runs eagerly (``gate.mha_companion_prefix``).
    This replaces the engine-wide "is this CUDA?" proxy.  TARGET_VERIFY and
    DRAFT_EXTEND batches never replay these graphs (they are captured as
    DECODE/EXTEND without speculative state).
    """

    def __init__(self, plan: GraphPlan, *, captured_hidden: HiddenCapture = HiddenCapture.NULL,
                 eager_logprob_tail: bool = False) -> None:
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

    def can_replay(self, batch: ReplayBatch) -> tuple[bool, ReplayReason]:
        """``(True, gate.ok)`` or ``(False, reason)``; first failing rule wins.

        Deterministic: the same plan and batch give the same answer on every
        rank.
        """
        reason = self._first_blocker(batch)
        if reason is None:
            return True, ReplayReason("gate.ok", "the batch replays a captured graph")
        return False, reason

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
        if phase is Phase.PREFILL and batch.num_tokens is not None:
            buckets = self.plan.config.prefill_num_tokens
            padded = _bucket(batch.num_tokens, buckets)
            if padded is None:
                return ReplayReason("gate.num_tokens_above_max",
                                    f"{batch.num_tokens} tokens exceed the largest captured "
                                    f"bucket ({buckets[-1]})")
            factor = self.plan.config.padding_waste_factor
            if padded > batch.num_tokens * factor:
                return ReplayReason("gate.padding_waste",
                                    f"{batch.num_tokens} tokens pad to {padded}, more than "
                                    f"{factor:g}x")
        return None
