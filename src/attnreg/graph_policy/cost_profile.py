"""Cost profiles: measured prefill costs that let the replay gate choose per batch.

Under a breakable prefill graph with MLA pinned, a prefill batch that replays
runs the *absorbed* form (q/k 576, v 512: about 3x the attention FLOPs of the
MHA form); a batch that runs eagerly runs the MHA companion instead (q/k 192,
v 128, after decompressing the latent cache with ``kv_b_proj``).  The graph
saves launch overhead, the MHA form saves FLOPs: which one wins depends on the
batch.  A :class:`CostProfile` holds a small fitted model of both, per
backend and platform, and :class:`~attnreg.graph_policy.ReplayGate` compares
the two predictions per batch.  Everything here is plain data and arithmetic
on host ints (no torch, no timing), so every data-parallel rank computes the
same answer for the same batch.

The model (microseconds per layer)
----------------------------------
For a batch of sequences with prefix ``p_i`` and new (extend) tokens ``e_i``
on ``H`` heads, the *features* are::

    one             1
    sequences       B
    q_tokens        sum e_i                       (new tokens; the graph pads them
                                                   to its token bucket)
    kv_tokens       sum (p_i + e_i)
    head_q_tokens   H * q_tokens
    head_kv_tokens  H * kv_tokens
    head_pairs      H * sum (e_i * p_i + e_i * (e_i + 1) / 2)   (causal query-key
                                                   pairs: attention FLOPs / head dim)

Each *term* is a non-negative linear combination of features,
``term(batch) = sum_f coefficient_f * feature_f``:

==================== ======================================================== =====================
term                 what was measured                                        features fitted
==================== ======================================================== =====================
absorbed_attention   device time of q_nope @ W_UK, the backend's absorbed     one, head_pairs,
                     extend (``forward_extend(method=MLA)``, KV write         head_q_tokens,
                     included) and @ W_UV                                     kv_tokens
mha_attention        device time of the backend's ragged MHA prefill          one, head_pairs,
                     (``forward_extend(method=MHA)``, KV write included)      head_q_tokens,
                                                                              head_kv_tokens
decompress           device time of gathering the latent rows of prefix +     one, head_kv_tokens,
                     new tokens, ``kv_b_proj`` ([tokens, 512] x [512,         kv_tokens
                     H * 256], bf16) and assembling K (rope appended) and V
layer_gpu            device time of one layer's non-attention projections     one, q_tokens
                     (norms, q_a, q_b, kv_a, rope, o_proj), replayed from a
                     CUDA graph
eager_host           host time to issue one eager layer (projections,         one, sequences
                     decompression, MHA prefill)
graph_host           host time to replay one layer of a captured graph        one
==================== ======================================================== =====================

and the two predictions are::

    graph_absorbed = max(graph_host, layer_gpu(padded tokens) + absorbed_attention)
    eager_mha      = max(eager_host, layer_gpu(tokens) + mha_attention + decompress)

A replayed graph runs its kernels back to back, so it costs its device time
unless replaying it takes the host longer; an eager layer costs the slower of
issuing it (host) and running it (device), since host and device overlap
across layers.  The coefficients are microseconds per feature unit, fitted by
``attnreg calibrate`` (:func:`attnreg.profiling.fit_term`: non-negative least
squares on relative errors); this module only reads a profile and predicts.

Profile JSON (``schema`` ``attnreg.cost_profile``, ``schema_version`` 1)
-----------------------------------------------------------------------
Required: ``schema``, ``schema_version``, ``backend`` (registry name),
``platform`` (``cuda:sm90``), ``kv_dtype`` (``bf16``), ``terms`` (all six
terms above, each ``{"coefficients_us": {feature: number >= 0}}``).
Informational (kept, not interpreted): ``device``, ``created``, ``versions``,
``dry_run``, ``note``, ``calibration`` (heads, layer shape, grid, timing
method), per-term ``fit`` (points, residuals) and ``measurements`` (the raw
timings with their predictions).  Written by ``attnreg calibrate``; shipped
profiles live in ``attnreg/data/profiles/*.json``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..registry.capabilities import DType
from ..registry.errors import AttnregError
from ..registry.jsonfile import (
    Bool,
    Check,
    Int,
    Map,
    Nullable,
    Num,
    Obj,
    Str,
    newer_schema_problem,
    problems_text,
    read_json,
    write_json,
)
from ..registry.platform import Platform

__all__ = [
    "FEATURES",
    "PROFILE_SCHEMA",
    "PROFILE_SCHEMA_CHECK",
    "PROFILE_SCHEMA_VERSION",
    "TERMS",
    "TERM_FEATURES",
    "CostComparison",
    "CostProfile",
    "CostProfileError",
    "CostTerm",
    "PrefillShape",
    "find_shipped_profile",
    "load_profile",
    "shipped_profile_dir",
    "shipped_profile_paths",
]

logger = logging.getLogger("attnreg.graph_policy")

PROFILE_SCHEMA = "attnreg.cost_profile"
PROFILE_SCHEMA_VERSION = 1

#: Every feature a term may use, in a fixed order.
FEATURES: tuple[str, ...] = ("one", "sequences", "q_tokens", "kv_tokens", "head_q_tokens",
                             "head_kv_tokens", "head_pairs")

#: The features each term is fitted with (schema version 1).
TERM_FEATURES: dict[str, tuple[str, ...]] = {
    "absorbed_attention": ("one", "head_pairs", "head_q_tokens", "kv_tokens"),
    "mha_attention": ("one", "head_pairs", "head_q_tokens", "head_kv_tokens"),
    "decompress": ("one", "head_kv_tokens", "kv_tokens"),
    "layer_gpu": ("one", "q_tokens"),
    "eager_host": ("one", "sequences"),
    "graph_host": ("one",),
}
TERMS: tuple[str, ...] = tuple(TERM_FEATURES)

#: Predictions are compared at this resolution (microseconds): a nanosecond.
#: Rounding first makes "equal" well defined; equal predictions run eagerly.
_COMPARE_DECIMALS = 3


class CostProfileError(AttnregError, ValueError):
    """A cost profile that cannot be used: names the file and the problem.

    Subclasses for other measured profiles set :attr:`kind` and :attr:`default_hint`.
    """

    kind = "cost profile"
    default_hint = ("regenerate it with `attnreg calibrate --backend NAME --output PATH` on "
                    "the device it describes, or pass another profile")

    def __init__(self, source: str, problem: str, *, hint: str = "") -> None:
        self.source = source
        self.problem = problem
        super().__init__(f"{self.kind} {source}: {problem}; {hint or self.default_hint}")


# ----------------------------------------------------------------------------------------
# batches and features
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillShape:
    """Lengths of a prefill batch and the heads on one rank: all a prediction reads.

    Parameters
    ----------
    prefix_lens, extend_lens
        Cached and new tokens per sequence (host ints, equal length).
    heads
        Attention heads on one rank.
    """

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    heads: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_lens", tuple(int(n) for n in self.prefix_lens))
        object.__setattr__(self, "extend_lens", tuple(int(n) for n in self.extend_lens))
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ValueError(f"prefix_lens has {len(self.prefix_lens)} entries, extend_lens "
                             f"{len(self.extend_lens)}; give one of each per sequence")
        if any(n < 0 for n in self.prefix_lens + self.extend_lens):
            raise ValueError("prefix and extend lengths must be >= 0")
        if int(self.heads) < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")
        object.__setattr__(self, "heads", int(self.heads))

    @classmethod
    def uniform(cls, batch_size: int, prefix: int, extend: int, heads: int) -> PrefillShape:
        """``batch_size`` sequences with the same prefix and extend length."""
        return cls((prefix,) * batch_size, (extend,) * batch_size, heads)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def q_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def kv_tokens(self) -> int:
        return sum(self.prefix_lens) + sum(self.extend_lens)

    @property
    def pairs(self) -> int:
        """Causal query-key pairs: query ``j`` of a sequence sees ``p + j + 1`` keys."""
        return sum(e * p + e * (e + 1) // 2 for p, e in zip(self.prefix_lens, self.extend_lens))

    def features(self) -> dict[str, float]:
        """Every feature of :data:`FEATURES` for this batch."""
        h = self.heads
        q, kv = self.q_tokens, self.kv_tokens
        return {"one": 1.0, "sequences": float(self.batch_size), "q_tokens": float(q),
                "kv_tokens": float(kv), "head_q_tokens": float(h * q),
                "head_kv_tokens": float(h * kv), "head_pairs": float(h * self.pairs)}

    def describe(self) -> str:
        b = self.batch_size
        seqs = "1 sequence" if b == 1 else f"{b} sequences"
        prefix = max(self.prefix_lens, default=0)
        return f"{seqs}, {self.q_tokens} new tokens, prefix up to {prefix}, {self.heads} heads"


# ----------------------------------------------------------------------------------------
# terms and the profile
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostTerm:
    """``sum_f coefficients[f] * features[f]`` in microseconds (coefficients >= 0)."""

    coefficients: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, coefficients: Mapping[str, float]) -> CostTerm:
        return cls(tuple((f, float(coefficients[f])) for f in FEATURES if f in coefficients))

    def as_dict(self) -> dict[str, float]:
        return dict(self.coefficients)

    def predict(self, features: Mapping[str, float]) -> float:
        return sum(c * features[f] for f, c in self.coefficients)


@dataclass(frozen=True)
class CostComparison:
    """Both predictions for one batch, per layer, in microseconds.

    ``graph_wins`` is True only when the graph is *strictly* faster at
    nanosecond resolution: a tie runs eagerly (no padding, no graph needed).
    """

    graph_us: float
    eager_us: float
    breakdown: tuple[tuple[str, float], ...] = ()

    @property
    def graph_wins(self) -> bool:
        return round(self.graph_us, _COMPARE_DECIMALS) < round(self.eager_us, _COMPARE_DECIMALS)

    def to_dict(self) -> dict[str, object]:
        return {"graph_absorbed_us": self.graph_us, "eager_mha_us": self.eager_us,
                "graph_wins": self.graph_wins, "terms_us": dict(self.breakdown)}


@dataclass(frozen=True)
class CostProfile:
    """A validated cost profile; build it with :func:`load_profile` or :meth:`from_dict`.

    Examples
    --------
    >>> terms = {t: {"coefficients_us": {"one": 1.0}} for t in TERMS}
    >>> terms["absorbed_attention"] = {"coefficients_us": {"one": 5.0, "head_pairs": 1e-6}}
    >>> terms["mha_attention"] = {"coefficients_us": {"one": 5.0, "head_pairs": 4e-7}}
    >>> terms["eager_host"] = {"coefficients_us": {"one": 60.0}}
    >>> profile = CostProfile.from_dict({"schema": PROFILE_SCHEMA, "schema_version": 1,
    ...     "backend": "mybackend", "platform": "cuda:sm90", "kv_dtype": "bf16",
    ...     "terms": terms})
    >>> short = PrefillShape.uniform(1, prefix=0, extend=128, heads=128)
    >>> profile.compare(short).graph_wins
    True
    >>> long = PrefillShape.uniform(1, prefix=0, extend=8192, heads=128)
    >>> profile.compare(long).graph_wins
    False
    """

    backend: str
    platform: Platform
    kv_dtype: DType
    terms: tuple[tuple[str, CostTerm], ...]
    source: str = "<dict>"
    device: str = ""
    created: str = ""
    dry_run: bool = False
    calibrated_heads: int | None = None
    data: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False,
                                    repr=False)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> CostProfile:
        """Validate ``data`` (a parsed profile JSON) and build the profile.

        Raises
        ------
        CostProfileError
            Naming ``source`` and the first problems found (:data:`PROFILE_SCHEMA_CHECK`).
        """
        too_new = newer_schema_problem(data, PROFILE_SCHEMA_VERSION)
        if too_new:
            raise CostProfileError(source, too_new, hint="upgrade attnreg or recalibrate")
        problem = problems_text(PROFILE_SCHEMA_CHECK, data)
        if problem:
            raise CostProfileError(source, problem)
        calibration = data.get("calibration") or {}
        return cls(backend=data["backend"], platform=Platform.parse(data["platform"]),
                   kv_dtype=DType(data["kv_dtype"]),
                   terms=tuple((t, CostTerm.of(data["terms"][t]["coefficients_us"]))
                               for t in TERMS), source=source,
                   device=str(data.get("device") or ""), created=str(data.get("created") or ""),
                   dry_run=bool(data.get("dry_run", False)),
                   calibrated_heads=calibration.get("heads"), data=dict(data))

    # -- identity ----------------------------------------------------------------------
    def term(self, name: str) -> CostTerm:
        return dict(self.terms)[name]

    def matches(self, backend: str, platform: Platform | str, kv_dtype: DType | str) -> bool:
        """Whether this profile describes ``backend`` on ``platform`` with a ``kv_dtype`` pool."""
        return (self.backend == backend and self.platform == Platform.parse(platform)
                and self.kv_dtype is DType.parse(kv_dtype))

    @property
    def label(self) -> str:
        """``"NAME on cuda:sm90 (bf16 KV; DEVICE, DATE)"``, for messages."""
        extra = ", ".join(x for x in (self.device, self.created[:10]) if x)
        dry = "; DRY RUN, not a measurement" if self.dry_run else ""
        return (f"{self.backend} on {self.platform} ({self.kv_dtype} KV"
                f"{'; ' + extra if extra else ''}{dry})")

    def to_dict(self) -> dict[str, Any]:
        """The profile JSON: the data it was built from, with the validated terms."""
        out = dict(self.data)
        out.update(schema=PROFILE_SCHEMA, schema_version=PROFILE_SCHEMA_VERSION,
                   backend=self.backend, platform=str(self.platform),
                   kv_dtype=self.kv_dtype.value)
        terms = dict(out.get("terms") or {})
        for name, term in self.terms:
            entry = dict(terms.get(name) or {})
            entry["coefficients_us"] = term.as_dict()
            terms[name] = entry
        out["terms"] = terms
        return out

    # -- predictions (per layer, microseconds) -----------------------------------------
    def predict_terms(self, batch: PrefillShape, *, graph_tokens: int | None = None
                      ) -> dict[str, float]:
        """Every term for ``batch``; ``layer_gpu_graph`` uses the padded token count."""
        f = batch.features()
        out = {name: term.predict(f) for name, term in self.terms}
        padded = dict(f)
        tokens = batch.q_tokens if graph_tokens is None else max(int(graph_tokens),
                                                                 batch.q_tokens)
        padded["q_tokens"] = float(tokens)
        padded["head_q_tokens"] = float(tokens * batch.heads)
        out["layer_gpu_graph"] = self.term("layer_gpu").predict(padded)
        return out

    def predict_graph_absorbed(self, batch: PrefillShape, *,
                               graph_tokens: int | None = None) -> float:
        """Per-layer time of replaying the absorbed graph (tokens padded to ``graph_tokens``)."""
        return self.compare(batch, graph_tokens=graph_tokens).graph_us

    def predict_eager_mha(self, batch: PrefillShape) -> float:
        """Per-layer time of the eager layer running the MHA companion."""
        return self.compare(batch).eager_us

    def compare(self, batch: PrefillShape, *, graph_tokens: int | None = None
                ) -> CostComparison:
        """Both predictions and the terms behind them (the model's two formulas)."""
        t = self.predict_terms(batch, graph_tokens=graph_tokens)
        graph = max(t["graph_host"], t["layer_gpu_graph"] + t["absorbed_attention"])
        eager = max(t["eager_host"], t["layer_gpu"] + t["mha_attention"] + t["decompress"])
        return CostComparison(graph, eager, tuple(sorted(t.items())))


def _platform_problem(text: str) -> str | None:
    try:
        Platform.parse(text)
    except ValueError as exc:
        return str(exc)
    return None


def _terms_problem(terms: Mapping[str, Any]) -> str | None:
    unknown = sorted(str(t) for t in terms if t not in TERMS)
    if unknown:
        return f"unknown terms {unknown} (known: {list(TERMS)})"
    return None


#: One term: ``{"coefficients_us": {feature: microseconds per unit >= 0}}``, more kept.
_TERM = Obj({"coefficients_us": Map(Num(minimum=0.0), keys=FEATURES, nonempty=True)})

#: The whole profile, as :func:`attnreg.registry.jsonfile.read_json` checks it; the
#: informational keys are checked only where they are read (``calibration.heads``).
PROFILE_SCHEMA_CHECK = Obj({
    "schema": Str(choices=(PROFILE_SCHEMA,)),
    "schema_version": Int(minimum=PROFILE_SCHEMA_VERSION, maximum=PROFILE_SCHEMA_VERSION),
    "backend": Str(nonempty=True),
    "platform": Check(Str(nonempty=True), _platform_problem),
    "kv_dtype": Str(choices=tuple(d.value for d in DType)),
    "terms": Check(Obj(dict.fromkeys(TERMS, _TERM)), _terms_problem),
    "calibration": Nullable(Obj({"heads": Nullable(Int(minimum=1))}, optional=("heads",))),
    "dry_run": Bool(),
}, optional=("calibration", "dry_run"))


# ----------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------

def load_profile(path: str | os.PathLike[str]) -> CostProfile:
    """Read and validate a profile JSON file.

    ``path`` is a file, or the bare file name of a profile shipped with
    attnreg (in ``attnreg/data/profiles``; a file of that name in the working
    directory comes first).

    Raises
    ------
    CostProfileError
        The file is missing, not JSON, or not a valid profile; the message
        names the file and the problem.
    """
    p = _shipped_by_name(Path(path))
    if not p.exists() and not p.is_symlink():
        shipped = ", ".join(q.name for q in shipped_profile_paths()) or "none"
        raise CostProfileError(str(p), "no such file", hint=(
            f"give a path to a profile, or the name of a shipped one ({shipped})"))
    data = read_json(p, CostProfileError)
    return CostProfile.from_dict(data, source=str(p))


def save_profile(profile: CostProfile | Mapping[str, Any], path: str | os.PathLike[str]
                 ) -> Path:
    """Validate and write a profile (a :class:`CostProfile` or its JSON dict)."""
    data = profile.to_dict() if isinstance(profile, CostProfile) else dict(profile)
    CostProfile.from_dict(data, source=str(path))  # never write what cannot be read back
    return write_json(path, data, CostProfileError, what="the profile")


def _shipped_by_name(path: Path) -> Path:
    """``path``, or the shipped profile it names when it is a bare file name not found here."""
    if path.parent != Path("") or path.exists():
        return path
    shipped = shipped_profile_dir() / path.name
    return shipped if shipped.is_file() else path


def shipped_profile_dir() -> Path:
    """Where the profiles shipped with attnreg live (``attnreg/data/profiles``)."""
    return Path(str(resources.files("attnreg"))) / "data" / "profiles"


def shipped_profile_paths() -> list[Path]:
    """The shipped profile files, sorted by name."""
    d = shipped_profile_dir()
    return sorted(d.glob("*.json")) if d.is_dir() else []


def find_shipped_profile(backend: str, platform: Platform | str,
                         kv_dtype: DType | str = DType.BF16) -> CostProfile | None:
    """The shipped profile for (backend, platform, KV dtype), or None.

    Several matches (two GPUs of one architecture): the first file by name
    wins, so every rank and every run picks the same one.  A malformed
    shipped file raises :class:`CostProfileError` (a packaging bug, never
    silently skipped).
    """
    for path in shipped_profile_paths():
        profile = load_profile(path)
        if profile.matches(backend, platform, kv_dtype):
            return profile
    return None
