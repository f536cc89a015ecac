"""Named batch specs of the conformance suite (pure data, no torch).

A batch spec is a list of sequences, each ``(prefix_len, extend_len)``: the
number of tokens already in the KV pool and the number of new tokens this
forward pass brings (decode: exactly one).  Names follow vLLM's attention
tests ("small_decode", "mixed_long"): a refuted claim names the spec that
failed, so the cause is readable from the table.

Two size profiles: ``cpu`` keeps everything tiny (the Triton interpreter runs
every program sequentially), ``cuda`` uses lengths that exercise several KV
splits, page boundaries and padding of captured graphs.

Speculative batches (TARGET_VERIFY, DRAFT_EXTEND) are decode-phase specs whose
new tokens per sequence come from the claim (the declared draft tokens):
:func:`batch_spec` builds them from the prefixes in :data:`SPECULATIVE_PREFIXES`
given ``query_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnreg.graph_policy.config import GraphConfig
from attnreg.registry.capabilities import ForwardMethod, ForwardMode, Phase

__all__ = ["CAPTURE_REPLAY_SPECS", "CHUNKED_PREFIX_SPECS", "QUICK_SPECS", "SPECS",
           "SPECULATIVE_EAGER_SPECS", "SPECULATIVE_PREFIXES", "SPECULATIVE_REPLAY_SPECS",
           "WIDE_DECODE_CUDA", "BatchSpec", "batch_names", "batch_spec", "chunk_tokens",
           "eager_specs", "largest_decode_bucket", "padded_replay_specs", "quick_specs",
           "replay_specs"]


def largest_decode_bucket(config: GraphConfig | None = None) -> int:
    """The largest decode batch size captured under ``config`` (default: attnreg's
    defaults, ``GraphConfig.decode_batch_sizes``).

    Declarations bound no batch size: every FULL decode graph is captured for each
    of the policy's decode buckets, so the largest of them is the widest graph an
    engine replays with attnreg's defaults (256).
    """
    return max((config or GraphConfig()).decode_batch_sizes)


#: Sequences of the cuda ``wide_decode`` batch: the largest default decode capture
#: bucket.  It is the widest batch of the decode replay list, so every FULL decode
#: graph claim on cuda captures a graph of that many sequences and replays the others
#: padded through it.
WIDE_DECODE_CUDA = largest_decode_bucket()


@dataclass(frozen=True)
class BatchSpec:
    """One named batch: ``seqs[i] = (prefix_len, extend_len)``.

    ``phase`` is DECODE for decode and speculative batches; ``forward_mode``
    says which (None: the phase's plain mode, DECODE or EXTEND).
    """

    name: str
    phase: Phase
    seqs: tuple[tuple[int, int], ...]
    about: str
    forward_mode: ForwardMode | None = None

    @property
    def mode(self) -> ForwardMode:
        """The batch's forward mode."""
        if self.forward_mode is not None:
            return self.forward_mode
        return ForwardMode.DECODE if self.phase is Phase.DECODE else ForwardMode.EXTEND

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
        return max(self.seq_lens, default=0)

    @property
    def has_prefix(self) -> bool:
        return any(p > 0 for p in self.prefix_lens)

    def describe(self) -> str:
        return f"{self.name} (bs={self.batch_size}, seq_lens={list(self.seq_lens)})"


def _decode(name: str, prefixes: tuple[int, ...], about: str) -> BatchSpec:
    return BatchSpec(name, Phase.DECODE, tuple((p, 1) for p in prefixes), about)


def _extend(name: str, seqs: tuple[tuple[int, int], ...], about: str) -> BatchSpec:
    return BatchSpec(name, Phase.PREFILL, seqs, about)


#: An idle data-parallel rank in a decode-phase step: no request, yet it replays the busy
#: ranks' graph (sglang's decode runner replays its IDLE batch padded to their bucket, and
#: attnreg's ``sync`` has it follow them), so every row of the replay is padding.
_IDLE_ABOUT = ("no request: an idle data-parallel rank replaying the busy ranks' graph, "
               "every row padding")

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
        # many sequences, tiny lengths: a kernel wrong (or NaN) above a few sequences
        "wide_decode": _decode("wide_decode", (3, 0, 9, 1, 17, 5, 2, 12, 0, 7, 30, 4, 1, 16,
                                               8, 11),
                               "sixteen short requests"),
        "idle_decode": _decode("idle_decode", (), _IDLE_ABOUT),
        "odd_extend": _extend("odd_extend", ((0, 2), (3, 1), (5, 3), (0, 1), (9, 2), (1, 1),
                                             (4, 4), (0, 3), (12, 1), (2, 2), (6, 1)),
                              "eleven short prompts (not a power of two)"),
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
        # many sequences, every one real: the largest default decode bucket (the
        # workload and its oracle are built for all sequences at once, see
        # docs/conformance.md "The oracle")
        "wide_decode": _decode("wide_decode",
                               tuple((37 * i) % 700 for i in range(WIDE_DECODE_CUDA)),
                               f"{WIDE_DECODE_CUDA} requests: the largest default decode "
                               "capture bucket, every sequence real"),
        "idle_decode": _decode("idle_decode", (), _IDLE_ABOUT),
        "odd_extend": _extend("odd_extend", tuple(((61 * i) % 400, 1 + (7 * i) % 23)
                                                  for i in range(13)),
                              "thirteen prompts (not a power of two)"),
    },
}

#: The specs a claim runs, per phase (eager correctness).
EAGER_SPECS: dict[Phase, tuple[str, ...]] = {
    Phase.DECODE: ("single_decode", "ragged_decode", "long_kv", "wide_decode"),
    Phase.PREFILL: ("extend_no_prefix", "extend_with_prefix", "mixed_lengths", "odd_extend"),
}

#: The batches replayed through one captured graph, per phase: different batch
#: sizes, lengths and contents.  The first one is replayed twice with fresh
#: contents, so a graph that baked in the capture batch's values is caught.  The
#: widest batch (16 on cpu, the largest default decode bucket on cuda) sets the
#: captured size, so every other batch is replayed padded.
CAPTURE_REPLAY_SPECS: dict[Phase, tuple[str, ...]] = {
    Phase.DECODE: ("ragged_decode", "single_decode", "long_kv", "wide_decode",
                   "ragged_decode"),
    Phase.PREFILL: ("mixed_lengths", "extend_no_prefix", "extend_with_prefix",
                    "long_kv_extend", "odd_extend", "mixed_lengths"),
}


#: Prefix lengths of the speculative specs per profile (new tokens: the claim's draft
#: tokens; draft extend cycles 1..draft tokens over the sequences).
SPECULATIVE_PREFIXES: dict[str, dict[str, tuple[int, ...]]] = {
    "cpu": {"ragged": (5, 16, 33, 2), "single": (37,), "long_kv": (1100, 40), "idle": ()},
    "cuda": {"ragged": (16, 129, 1022, 2047, 63, 300, 7, 1000), "single": (1000,),
             "long_kv": (8180, 4000, 100), "idle": ()},
}
_SPEC_KIND = {"verify": ForwardMode.TARGET_VERIFY, "draft_extend": ForwardMode.DRAFT_EXTEND}
_SPEC_ABOUT = {"ragged": "requests of different lengths", "single": "one request",
               "long_kv": "long histories next to a short one (several KV splits)",
               "idle": _IDLE_ABOUT}

#: The speculative specs a claim runs eagerly and replays through one graph, by mode.
SPECULATIVE_EAGER_SPECS: dict[ForwardMode, tuple[str, ...]] = {
    ForwardMode.TARGET_VERIFY: ("verify_single", "verify_ragged", "verify_long_kv"),
    ForwardMode.DRAFT_EXTEND: ("draft_extend_single", "draft_extend_ragged",
                               "draft_extend_long_kv"),
}
SPECULATIVE_REPLAY_SPECS: dict[ForwardMode, tuple[str, ...]] = {
    ForwardMode.TARGET_VERIFY: ("verify_ragged", "verify_single", "verify_long_kv",
                                "verify_ragged"),
    ForwardMode.DRAFT_EXTEND: ("draft_extend_ragged", "draft_extend_single",
                               "draft_extend_long_kv", "draft_extend_ragged"),
}
#: One small batch per phase: what a cpu run checks the configurations that vary the
#: head count beyond the base (16, the largest declared) or the softmax scale on.  Several
#: sequences of different lengths, with and without a cached prefix.
QUICK_SPECS: dict[Phase, tuple[str, ...]] = {
    Phase.DECODE: ("ragged_decode",),
    Phase.PREFILL: ("short_extend",),
}
#: Prefill specs with a cached prefix: what chunked-prefix MHA is checked on.
CHUNKED_PREFIX_SPECS: tuple[str, ...] = ("extend_with_prefix", "mixed_lengths",
                                         "long_kv_extend")
#: Prefix tokens per chunk of chunked-prefix MHA claims (several chunks per prefix).
_CHUNK_TOKENS = {"cpu": 8, "cuda": 512}


def chunk_tokens(profile: str) -> int:
    """The chunk size chunked-prefix MHA claims run with on profile ``profile``."""
    return _CHUNK_TOKENS.get(profile, _CHUNK_TOKENS["cuda"])


def _speculative(name: str, profile: str, query_len: int) -> BatchSpec:
    kind, _, shape = name.partition("_") if name.startswith("verify") else \
        ("draft_extend", "_", name[len("draft_extend_"):])
    prefixes = SPECULATIVE_PREFIXES[profile][shape]
    mode = _SPEC_KIND[kind]
    if mode is ForwardMode.TARGET_VERIFY:
        seqs = tuple((p, query_len) for p in prefixes)
    else:  # accepted tokens: 1..query_len, the longest first
        seqs = tuple((p, query_len - i % query_len) for i, p in enumerate(prefixes))
    return BatchSpec(name, Phase.DECODE, seqs,
                     f"{mode} of {query_len} draft tokens: {_SPEC_ABOUT[shape]}", mode)


def batch_spec(name: str, profile: str, query_len: int | None = None) -> BatchSpec:
    """The spec ``name`` of size profile ``profile`` (``cpu`` or ``cuda``).

    Speculative specs (``verify_*``, ``draft_extend_*``) need ``query_len``:
    the draft tokens per sequence.
    """
    if name.startswith(("verify_", "draft_extend_")):
        if query_len is None or query_len < 1:
            raise KeyError(f"speculative batch spec {name!r} needs query_len >= 1")
        try:
            return _speculative(name, profile, query_len)
        except KeyError:
            raise KeyError(f"no speculative batch spec {name!r} in profile {profile!r}"
                           ) from None
    try:
        return SPECS[profile][name]
    except KeyError:
        raise KeyError(f"no batch spec {name!r} in profile {profile!r}; known: "
                       f"{sorted(SPECS.get(profile, {}))}") from None


def batch_names(phase: Phase) -> tuple[str, ...]:
    """The eager-correctness specs of ``phase``."""
    return EAGER_SPECS[phase]


def eager_specs(phase: Phase, forward_mode: ForwardMode | None = None,
                method: ForwardMethod | None = None) -> tuple[str, ...]:
    """The specs an eager claim runs: by forward mode (speculative), method (chunked-prefix
    MHA needs prefixes), else phase."""
    if forward_mode in SPECULATIVE_EAGER_SPECS:
        return SPECULATIVE_EAGER_SPECS[forward_mode]  # type: ignore[index]
    if method is ForwardMethod.MHA_CHUNKED_KV:
        return CHUNKED_PREFIX_SPECS
    return EAGER_SPECS[phase]


def quick_specs(phase: Phase) -> tuple[str, ...]:
    """:data:`QUICK_SPECS` of ``phase`` (every method: ``short_extend`` has a cached
    prefix, so it serves chunked-prefix MHA too)."""
    return QUICK_SPECS[phase]


def replay_specs(phase: Phase, forward_mode: ForwardMode | None = None) -> tuple[str, ...]:
    """The specs one captured graph replays (by forward mode for speculative graphs)."""
    if forward_mode in SPECULATIVE_REPLAY_SPECS:
        return SPECULATIVE_REPLAY_SPECS[forward_mode]  # type: ignore[index]
    return CAPTURE_REPLAY_SPECS[phase]


#: The idle batch of each decode-phase forward mode (None: plain decode).
IDLE_SPECS: dict[ForwardMode | None, str] = {
    None: "idle_decode", ForwardMode.DECODE: "idle_decode",
    ForwardMode.TARGET_VERIFY: "verify_idle", ForwardMode.DRAFT_EXTEND: "draft_extend_idle",
}


def padded_replay_specs(phase: Phase, forward_mode: ForwardMode | None = None
                        ) -> tuple[str, ...]:
    """What a ``padded_rows`` claim replays: :func:`replay_specs`, and in a decode-phase
    graph an idle batch (no request, every row padding) before the last replay, so the
    replay after it shows the graph still right once an idle rank has run it.  A prefill
    step with an idle rank runs eagerly on every rank (``graph_policy.sync``)."""
    specs = replay_specs(phase, forward_mode)
    if phase is not Phase.DECODE:
        return specs
    return (*specs[:-1], IDLE_SPECS[forward_mode], specs[-1])
