"""Named batch specs: the batch sizes the suite covers, per profile (pure, no torch)."""

from __future__ import annotations

from attnreg.graph_policy.config import DEFAULT_DECODE_BATCH_SIZES, GraphConfig
from attnreg.registry import ForwardMode, Phase, get_registry
from attnreg.testing.batches import (
    batch_spec,
    eager_specs,
    largest_decode_bucket,
    padded_replay_specs,
    replay_specs,
)
from attnreg.testing.claims import Check, expand_claims


def test_cuda_wide_decode_is_the_largest_default_decode_capture_bucket():
    assert largest_decode_bucket() == max(DEFAULT_DECODE_BATCH_SIZES) == 256
    assert batch_spec("wide_decode", "cuda").batch_size == largest_decode_bucket()
    # an engine's own buckets give their largest
    assert largest_decode_bucket(GraphConfig(decode_batch_sizes=(1, 8, 96))) == 96


def test_every_cuda_decode_graph_is_captured_for_the_largest_bucket():
    """The capture bounds are the widest replay batch: wide_decode, every sequence real."""
    specs = [batch_spec(n, "cuda") for n in replay_specs(Phase.DECODE)]
    assert max(s.batch_size for s in specs) == largest_decode_bucket()
    assert "wide_decode" in eager_specs(Phase.DECODE)
    wide = batch_spec("wide_decode", "cuda")
    assert len(set(wide.seq_lens)) > 100  # ragged, not one length repeated
    caps = get_registry().declaration("triton", "cuda:sm90")
    replays = [c for c in expand_claims(caps, "cuda") if c.check is Check.REPLAY
               and c.combo.phase is Phase.DECODE and c.forward_mode in (None,
                                                                        ForwardMode.DECODE)]
    assert replays and all("wide_decode" in c.batches for c in replays)


def test_cpu_batches_reach_16_sequences_and_a_non_power_of_two():
    sizes = {batch_spec(n, "cpu").batch_size
             for phase in (Phase.DECODE, Phase.PREFILL) for n in eager_specs(phase)}
    assert max(sizes) == 16
    assert any(s & (s - 1) for s in sizes)  # 11 sequences: not a power of two


def test_padded_decode_phase_graphs_replay_an_idle_batch_before_their_last_replay():
    """An idle data-parallel rank replays the busy ranks' decode-phase graph with no request
    (graph_policy.sync); a prefill step with an idle rank runs eagerly, so no idle extend."""
    for mode, query_len in ((None, None), (ForwardMode.TARGET_VERIFY, 3),
                            (ForwardMode.DRAFT_EXTEND, 3)):
        names = padded_replay_specs(Phase.DECODE, mode)
        plain = replay_specs(Phase.DECODE, mode)
        assert names == (*plain[:-1], names[-2], plain[-1])
        for profile in ("cpu", "cuda"):
            idle = batch_spec(names[-2], profile, query_len)
            assert (idle.batch_size, idle.num_tokens, idle.max_seq_len) == (0, 0, 0)
            assert idle.mode is (mode or ForwardMode.DECODE)
    assert padded_replay_specs(Phase.PREFILL) == replay_specs(Phase.PREFILL)
    caps = get_registry().declaration("triton", "cuda:sm90")
    padded = [c for c in expand_claims(caps, "cuda") if c.check is Check.PADDED_ROWS]
    assert {c.forward_mode for c in padded if any("idle" in b for b in c.batches)} == {
        None, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    assert not [c for c in padded if c.combo.phase is Phase.PREFILL
                and any("idle" in b for b in c.batches)]
