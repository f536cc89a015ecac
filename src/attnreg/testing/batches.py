"""Named batch specs of the conformance suite (pure data, no torch).

A batch spec is a list of sequences, each ``(prefix_len, extend_len)``: the
number of tokens already in the KV pool and the number of new tokens this
forward pass brings (decode: exactly one).  Names follow vLLM's attention
tests ("small_decode", "mixed_long"): a refuted claim names the spec that
failed, so the cause is readable from the table.

Two size profiles: ``cpu`` keeps everything tiny (the Triton interpreter runs
every program sequentially), ``cuda`` uses lengths that exercise several KV
splits, page boundaries and padding of captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnreg.registry.capabilities import Phase

__all__ = ["CAPTURE_REPLAY_SPECS", "SPECS", "BatchSpec", "batch_names", "batch_spec"]


@dataclass(frozen=True)
class BatchSpec:
    """One named batch: ``seqs[i] = (prefix_len, extend_len)``.

    ``phase`` is DECODE when every sequence brings exactly one token.
    """

    name: str
    phase: Phase
    seqs: tuple[tuple[int, int], ...]
    about: str

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Whole length of each sequence after this pass (prefix + new tokens)."""
        return tuple(p + e for p, e in self.seqs)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(p for p, _ in self.seqs)

    @property
    def extend_lens(self) -> tuple[int, ...]:
        return tuple(e for _, e in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def has_prefix(self) -> bool:
        return any(p > 0 for p in self.prefix_lens)

    def describe(self) -> str:
        return f"{self.name} (bs={self.batch_size}, seq_lens={list(self.seq_lens)})"


def _decode(name: str, prefixes: tuple[int, ...], about: str) -> BatchSpec:
    return BatchSpec(name, Phase.DECODE, tuple((p, 1) for p in prefixes), about)


def _extend(name: str, seqs: tuple[tuple[int, int], ...], about: str) -> BatchSpec:
    return BatchSpec(name, Phase.PREFILL, seqs, about)


#: profile -> name -> spec.  Lengths are chosen to straddle page boundaries of
#: every declared page size (16, 32, 64) and, on cuda, several KV splits.
SPECS: dict[str, dict[str, BatchSpec]] = {
    "cpu": {
        "single_decode": _decode("single_decode", (37,), "one request, one new token"),
        "ragged_decode": _decode("ragged_decode", (0, 5, 16, 33),
                                 "four requests of different lengths, one with no history"),
        "long_kv": _decode("long_kv", (1100, 40),
                           "a long history next to a short one (several KV splits)"),
        "extend_no_prefix": _extend("extend_no_prefix", ((0, 5), (0, 9)),
                                    "fresh prompts, nothing cached"),
        "extend_with_prefix": _extend("extend_with_prefix", ((12, 4), (20, 3)),
                                      "prompts continuing a cached prefix"),
        "mixed_lengths": _extend("mixed_lengths", ((0, 6), (17, 1), (3, 9), (40, 2)),
                                 "with and without prefix, one single-token extend"),
        "long_kv_extend": _extend("long_kv_extend", ((600, 3),),
                                  "a short extend over a long cached prefix"),
        "short_extend": _extend("short_extend", ((5, 3), (0, 2)),
                                "few new tokens over short histories"),
    },
    "cuda": {
        "single_decode": _decode("single_decode", (1000,), "one request, one new token"),
        "ragged_decode": _decode("ragged_decode", (0, 16, 129, 1022, 2047, 63, 300, 7),
                                 "eight requests of different lengths, one with no history"),
        "long_kv": _decode("long_kv", (8191, 4000, 100),
                           "long histories next to a short one (many KV splits)"),
        "extend_no_prefix": _extend("extend_no_prefix", ((0, 128), (0, 37), (0, 300)),
                                    "fresh prompts, nothing cached"),
        "extend_with_prefix": _extend("extend_with_prefix", ((1000, 64), (37, 100), (64, 1)),
                                      "prompts continuing a cached prefix"),
        "mixed_lengths": _extend("mixed_lengths",
                                 ((0, 200), (513, 1), (64, 77), (2000, 15), (0, 1)),
                                 "with and without prefix, single-token extends"),
        "long_kv_extend": _extend("long_kv_extend", ((8000, 16), (3000, 5)),
                                  "short extends over long cached prefixes"),
        "short_extend": _extend("short_extend", ((300, 3), (0, 2)),
                                "few new tokens over short histories"),
    },
}

#: The specs a claim runs, per phase (eager correctness).
EAGER_SPECS: dict[Phase, tuple[str, ...]] = {
    Phase.DECODE: ("single_decode", "ragged_decode", "long_kv"),
    Phase.PREFILL: ("extend_no_prefix", "extend_with_prefix", "mixed_lengths"),
}

#: The batches replayed through one captured graph, per phase: different batch
#: sizes, lengths and contents.  The first one is replayed twice with fresh
#: contents, so a graph that baked in the capture batch's values is caught.
CAPTURE_REPLAY_SPECS: dict[Phase, tuple[str, ...]] = {
    Phase.DECODE: ("ragged_decode", "single_decode", "long_kv", "ragged_decode"),
    Phase.PREFILL: ("mixed_lengths", "extend_no_prefix", "extend_with_prefix",
                    "long_kv_extend", "mixed_lengths"),
}


def batch_spec(name: str, profile: str) -> BatchSpec:
    """The spec ``name`` of size profile ``profile`` (``cpu`` or ``cuda``)."""
    try:
        return SPECS[profile][name]
    except KeyError:
        raise KeyError(f"no batch spec {name!r} in profile {profile!r}; known: "
                       f"{sorted(SPECS.get(profile, {}))}") from None


def batch_names(phase: Phase) -> tuple[str, ...]:
    """The eager-correctness specs of ``phase``."""
    return EAGER_SPECS[phase]
