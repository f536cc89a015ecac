"""One gate answer: schedule time and forward time agree, and so do the ranks.

An engine asks the gate twice about a batch: when it schedules it (and the
data-parallel ranks exchange their answers) and when it runs it.  The two
calls may describe the batch differently (``num_tokens`` or ``extend_lens``,
``seq_lens`` or prefix + new tokens).  The gate must give the same answer
from the same facts, and must never answer from a fact it lacks: a call
without a fact the answer depends on raises ``ValueError``, it does not guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from attnreg.graph_policy import (
    CostProfile,
    EngineFacts,
    GraphConfig,
    HiddenCapture,
    ReplayBatch,
    ReplayGate,
    ServerFeatures,
    SyncError,
    pack,
    unpack,
)
from attnreg.graph_policy.cost_profile import PROFILE_SCHEMA, TERMS
from attnreg.registry import ForwardMode, ForwardModeSupport, GraphMode, Phase

from ._helpers import declaration, sim

pytestmark = pytest.mark.slow

CONFIG = GraphConfig(decode_batch_sizes=(1, 2, 4, 8), prefill_num_tokens=(64, 128, 256, 512),
                     prefill_max_requests=6)
DRAFT = 3
VERIFYING = declaration(
    "gen_verify", "cuda:sm90",
    forward_modes={(Phase.DECODE, GraphMode.FULL): (
        ForwardModeSupport(ForwardMode.DECODE), ForwardModeSupport(ForwardMode.TARGET_VERIFY, 4),
        ForwardModeSupport(ForwardMode.DRAFT_EXTEND, 4, uniform=False))},
    eager_forward_modes=(ForwardModeSupport(ForwardMode.DECODE),
                         ForwardModeSupport(ForwardMode.EXTEND, None, False),
                         ForwardModeSupport(ForwardMode.TARGET_VERIFY, 8),
                         ForwardModeSupport(ForwardMode.DRAFT_EXTEND, 8, uniform=False)))


def _profile() -> CostProfile:
    """Absorbed attention ~3x the MHA form per head-pair, a constant eager host cost."""
    terms: dict[str, dict[str, float]] = {t: {"one": 0.0} for t in TERMS}
    terms.update(absorbed_attention={"head_pairs": 1e-6}, mha_attention={"head_pairs": 3e-7},
                 eager_host={"one": 5.0})
    return CostProfile.from_dict({
        "schema": PROFILE_SCHEMA, "schema_version": 1, "backend": "triton",
        "platform": "cuda:sm90", "kv_dtype": "bf16", "calibration": {"heads": 128},
        "terms": {t: {"coefficients_us": c} for t, c in terms.items()}}, source="<test>")


def _gates() -> list[ReplayGate]:
    engine = EngineFacts(max_context_len=700, num_draft_tokens=DRAFT)
    return [
        # absorbed MLA pinned under breakable, verify graphs, a short context
        ReplayGate(sim("cuda:sm90", "deepseek-v3", VERIFYING, CONFIG, engine=engine)),
        # the cost model decides prefill batches
        ReplayGate(sim("cuda:sm90", "deepseek-v3", "triton", CONFIG, engine=engine),
                   cost_profile=_profile()),
        # nothing pinned under breakable: prefix batches run eagerly
        ReplayGate(sim("rocm:gfx942", "deepseek-v3", declaration("gen", "rocm:gfx942"),
                       GraphConfig(prefill_mode=GraphMode.BREAKABLE,
                                   decode_batch_sizes=(1, 2, 4, 8),
                                   prefill_num_tokens=(64, 128, 256, 512)),
                       ServerFeatures(lora=True), engine)),
    ]


GATES = _gates()


@dataclass(frozen=True)
class Facts:
    """Everything about a batch, from which both descriptions are built."""

    mode: ForwardMode
    prefix: tuple[int, ...]
    new: tuple[int, ...]
    extras: tuple[tuple[str, Any], ...]

    def full(self) -> ReplayBatch:
        """Forward time: every fact, in every form."""
        return ReplayBatch(self.mode, len(self.new), num_tokens=sum(self.new),
                           prefix_lens=self.prefix, extend_lens=self.new,
                           seq_lens=tuple(p + n for p, n in zip(self.prefix, self.new)),
                           **dict(self.extras))

    def partial(self, keep: frozenset[str]) -> ReplayBatch:
        """Schedule time: some of the facts, in another form."""
        fields: dict[str, Any] = dict(self.extras)
        if "num_tokens" in keep:
            fields["num_tokens"] = sum(self.new)
        if "extend_lens" in keep:
            fields["extend_lens"] = self.new
        if "prefix_lens" in keep:
            fields["prefix_lens"] = self.prefix
        if "seq_lens" in keep:
            fields["seq_lens"] = tuple(p + n for p, n in zip(self.prefix, self.new))
        return ReplayBatch(self.mode, len(self.new), **fields)


@st.composite
def batch_facts(draw: st.DrawFn) -> Facts:
    mode = draw(st.sampled_from(list(ForwardMode)))
    size = draw(st.sampled_from([0, 1, 1, 2, 3, 4, 6, 9]))
    prefix = tuple(draw(st.lists(st.sampled_from([0, 0, 0, 5, 100, 650, 699, 700]),
                                 min_size=size, max_size=size)))
    if mode is ForwardMode.DECODE:
        new = (1,) * size
    elif mode is ForwardMode.TARGET_VERIFY:
        new = (draw(st.sampled_from([DRAFT, DRAFT, DRAFT, 1, 5])),) * size
    elif mode is ForwardMode.DRAFT_EXTEND:
        new = tuple(draw(st.lists(st.integers(1, DRAFT + 1), min_size=size, max_size=size)))
    else:
        new = tuple(draw(st.lists(st.sampled_from([1, 7, 40, 64, 100, 300]), min_size=size,
                                  max_size=size)))
    extras = {} if draw(st.integers(0, 3)) else draw(st.dictionaries(
        st.sampled_from(["lora", "has_input_embeds", "has_replace_embeds", "return_logprob",
                         "capture_hidden"]), st.booleans(), max_size=2))
    if "capture_hidden" in extras:
        extras["capture_hidden"] = HiddenCapture.LAST if extras["capture_hidden"] \
            else HiddenCapture.NULL
    return Facts(mode, prefix, new, tuple(sorted(extras.items())))


FIELDS = ("num_tokens", "extend_lens", "prefix_lens", "seq_lens")


def _answer(gate: ReplayGate, batch: ReplayBatch) -> tuple[Any, ...] | None:
    """(ok, reason, bucket), or None when the gate refuses to answer without a fact."""
    try:
        ok, reason = gate.can_replay(batch)
        return ok, reason, gate.bucket_for(batch) if ok else None
    except ValueError as exc:
        assert "is required here" in str(exc), exc
        return None


@given(st.sampled_from(range(len(GATES))), batch_facts(),
       st.frozensets(st.sampled_from(FIELDS)))
def test_schedule_time_and_forward_time_answers_are_identical(
        which: int, facts: Facts, keep: frozenset[str]) -> None:
    gate = GATES[which]
    if facts.partial(keep).max_seq_len is None:
        # Without lengths the engine vouches for its context limit (see the module doc).
        longest = max((p + n for p, n in zip(facts.prefix, facts.new)), default=0)
        assume(longest <= gate.plan.engine.max_context_len)
    forward = _answer(gate, facts.full())
    assert forward is not None, "every fact was given"
    event(f"{facts.mode}: {forward[1].rule}")
    scheduled = _answer(gate, facts.partial(keep))
    if scheduled is None:
        event("schedule time lacked a fact the answer depends on: refused, not guessed")
        # What an engine's scheduler always has (new tokens and cached tokens per
        # request) is enough for every answer.
        assert not {"extend_lens", "prefix_lens"} <= keep
        return
    assert scheduled == forward, (keep, facts)
    # The same facts on another "rank" (a second gate on the same plan) agree too.
    twin = ReplayGate(gate.plan, cost_profile=gate.cost_profile)
    assert _answer(twin, facts.full()) == forward


@given(st.lists(st.tuples(st.sampled_from(range(len(GATES[:1]))), batch_facts()),
                min_size=1, max_size=4))
def test_unpack_agrees_on_one_answer_or_refuses_mixed_forward_modes(
        ranks: list[tuple[int, Facts]]) -> None:
    gate = GATES[0]
    local = [gate.facts(f.full()) for _, f in ranks]
    rows = [pack(f) for f in local]
    busy = [f for f in local if f.batch_size > 0]
    modes = {f.forward_mode for f in busy}
    if len(modes) > 1:
        with pytest.raises(SyncError, match="disagree on the forward mode"):
            unpack(rows)
        event("mixed forward modes: refused")
        return
    agreed = unpack(rows)
    assert unpack(list(rows)) == agreed  # every rank unpacks the same rows to the same answer
    assert agreed.replay == (bool(busy) and all(f.eligible for f in busy))
    if agreed.replay:
        assert agreed.bucket == max(f.bucket for f in busy if f.bucket is not None)
        # The agreed bucket holds every rank's batch.
        for f in busy:
            assert f.bucket is not None and f.bucket <= agreed.bucket
        assert agreed.forward_mode in modes
    else:
        assert agreed.bucket is None
    assert agreed.ineligible_ranks == tuple(r for r, f in enumerate(local)
                                            if f.batch_size > 0 and not f.eligible)
    event(f"agreed replay={agreed.replay}")
