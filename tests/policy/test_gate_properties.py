"""One gate answer: schedule time and forward time agree, and so do the ranks.

An engine asks the gate twice about a batch: when it schedules it (and the
data-parallel ranks exchange their answers) and when it runs it.  The two
calls may describe the batch differently (``num_tokens`` or ``extend_lens``,
``seq_lens`` or prefix + new tokens), and the schedule-time call may lack
facts (None: not known there).  The gate must give the same answer from the
same facts, and must never answer from a fact it lacks: a rule that needs a
missing fact answers ``gate.fact_missing``, so removing facts never turns an
eager answer into a replay and never changes a replay's bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from attnreg.graph_policy import (
    GATE_RULES,
    CostProfile,
    EngineFacts,
    GraphConfig,
    HiddenCapture,
    ReplayBatch,
    ReplayGate,
    ReplayReason,
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
        """Schedule time: some of the facts, in another form; the others None (unknown)."""
        fields: dict[str, Any] = {flag: (value if flag in keep else None)
                                  for flag, value in self.flags()}
        if "num_tokens" in keep:
            fields["num_tokens"] = sum(self.new)
        if "extend_lens" in keep:
            fields["extend_lens"] = self.new
        if "prefix_lens" in keep:
            fields["prefix_lens"] = self.prefix
        if "seq_lens" in keep:
            fields["seq_lens"] = tuple(p + n for p, n in zip(self.prefix, self.new))
        return ReplayBatch(self.mode, len(self.new), **fields)

    def flags(self) -> tuple[tuple[str, Any], ...]:
        """Every flag's value (the defaults where the draw set none)."""
        values = {**FLAG_DEFAULTS, **dict(self.extras)}
        return tuple(sorted(values.items()))


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


FLAG_DEFAULTS: dict[str, Any] = {"lora": False, "has_input_embeds": False,
                                 "has_replace_embeds": False, "return_logprob": False,
                                 "capture_hidden": HiddenCapture.NULL}
LENGTHS = ("num_tokens", "extend_lens", "prefix_lens", "seq_lens")
FIELDS = LENGTHS + tuple(FLAG_DEFAULTS)


def _answer(gate: ReplayGate, batch: ReplayBatch) -> tuple[bool, ReplayReason, int | None]:
    """(ok, reason, bucket of a replay)."""
    ok, reason = gate.can_replay(batch)
    return ok, reason, gate.bucket_for(batch) if ok else None


@given(st.sampled_from(range(len(GATES))), batch_facts(),
       st.frozensets(st.sampled_from(FIELDS)))
def test_removing_facts_never_turns_eager_into_replay_nor_changes_the_bucket(
        which: int, facts: Facts, keep: frozenset[str]) -> None:
    gate = GATES[which]
    forward = _answer(gate, facts.full())
    assert forward[1].rule != "gate.fact_missing", "every fact was given"
    event(f"{facts.mode}: {forward[1].rule}")
    scheduled = _answer(gate, facts.partial(keep))
    # The answer from fewer facts is the answer from all of them, or eager for a
    # named missing fact: never a replay where forward time runs eagerly, never
    # another bucket.
    if scheduled != forward:
        ok, reason, _ = scheduled
        assert not ok and reason.rule == "gate.fact_missing", (keep, facts, scheduled)
        assert reason.fact in FIELDS and reason.needed_by in GATE_RULES
        event(f"schedule time lacked {reason.fact}: eager")
    if scheduled[0]:
        assert forward[0] and scheduled[2] == forward[2]
    # What an engine's scheduler always has (new and cached tokens per request, the
    # flags) is enough for every answer.
    if {"extend_lens", "prefix_lens", *FLAG_DEFAULTS} <= keep:
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
    idle = [r for r, f in enumerate(local) if f.batch_size == 0]
    assert agreed.idle_ranks == tuple(idle)
    # an idle rank beside a busy one keeps a prefill step eager (sglang's prefill runner)
    idle_prefill = bool(busy and idle) and agreed.forward_mode is ForwardMode.EXTEND
    assert agreed.replay == (bool(busy) and all(f.eligible for f in busy) and not idle_prefill)
    assert agreed.fingerprint == gate.fingerprint.digest
    if idle_prefill and all(f.eligible for f in busy):
        event("an idle rank kept an eligible prefill step eager")
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
