"""Claims: what a backend's declaration promises, as a list of checkable statements.

Pure data, no torch: :func:`expand_claims` turns one
:class:`~attnreg.registry.Capabilities` into :class:`Claim` objects, and the
pytest plugin turns each claim into one test item.  Three kinds:

* ``eager`` - one declared input configuration (forward method x phase x q/kv
  dtype x page size x head count x head dims) computes what the float64 oracle
  computes on the named batch specs of its phase, and writes nothing outside
  the KV slots it was given; so do the speculative forward modes a backend
  declares eagerly (target verify, draft extend, at the declared draft tokens
  per sequence) and chunked-prefix MHA; ``lse`` claims check the log-sum-exp
  of every kernel that declares one; ``multi_layer`` claims run several layers
  of one pool (own contents, own fp8 scales) with one plan per step;
* ``refusal`` - an input *outside* the declaration (page size, dtype, head
  dims, head count, forward method, int64 index tensors) is refused with
  ``UnsupportedError`` before any kernel launch;
* ``capture`` - each declared (phase, graph mode): NATIVE and FALLBACK modes
  run correctly through capture and replay (several batches, allocator churn,
  KV canaries, no sync or allocation while capturing, pinned forward method,
  split-KV surviving capture, zero output rows for the padding of a smaller
  batch, capture memory within the declared estimate, several layers sharing
  one captured plan), for every forward mode the entry serves (a FULL decode
  graph's target-verify and draft-extend batches too); FALLBACK modes are
  served by the declared
  ``fallback_to`` (as the backend reports through
  :func:`~attnreg.graph_policy.capture.note_served_by`); UNSUPPORTED modes are
  refused.

Combinations: by default every declared value of every dimension is covered at
least once (a base configuration, then one dimension varied at a time); with
``exhaustive=True`` the full cartesian product is expanded.  Head counts: 16,
128 and the largest declared on cuda; on cpu the base runs 2 (or the smallest
declared), 16 and the largest declared run one small batch.  Each (method,
phase) and each capture mode's capture path is also claimed at
:data:`YARN_SM_SCALE` as ``MLAConfig.sm_scale`` (ids ending ``/sm_scale0.1352``).

:func:`other_platform_claims` lists what a backend declares only for other
CUDA platforms (:data:`CUDA_PLATFORMS`), as claims skipped with a reason that
names those platforms, so a report shows what this device could not check.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from attnreg.registry.capabilities import (
    SPECULATIVE_MODES,
    Capabilities,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    SplitKV,
    SupportKind,
)
from attnreg.registry.strenum import StrEnum

from .batches import eager_specs, quick_specs, replay_specs

__all__ = [
    "CUDA_PLATFORMS",
    "YARN_SM_SCALE",
    "Check",
    "Claim",
    "ClaimKind",
    "Combo",
    "expand_claims",
    "declares_kernels",
    "head_dims_config",
    "kernel_q_compute_dtype",
    "other_platform_claims",
    "unavailable_claim",
]


class ClaimKind(StrEnum):
    EAGER = "eager"
    REFUSAL = "refusal"
    CAPTURE = "capture"
    AVAILABILITY = "availability"



class Check(StrEnum):
    """What one claim checks.  Values appear in claim ids and the report."""

    # eager
    MATCHES_REFERENCE = "matches_reference"
    LSE = "lse"
    # eager and capture: several layers of one pool sharing one plan per step
    MULTI_LAYER = "multi_layer"
    # refusals
    PAGE_SIZE = "page_size"
    Q_DTYPE = "q_dtype"
    KV_DTYPE = "kv_dtype"
    HEAD_DIMS = "head_dims"
    NUM_HEADS = "num_heads"
    INDEX_DTYPE = "index_dtype"
    METHOD = "method"
    # capture
    REFUSES_CAPTURE = "refuses_capture"
    CAPTURE_PATH = "capture_path"
    FALLBACK_SERVED = "fallback_served"
    PINNING = "pinning"
    REPLAY = "replay"
    ALLOCATOR_CHURN = "allocator_churn"
    NO_SYNC_ALLOC = "no_sync_alloc"
    SPLIT_KV = "split_kv"
    PADDED_ROWS = "padded_rows"
    CAPTURE_MEMORY = "capture_memory"
    PIECEWISE = "piecewise"
    # availability
    AVAILABLE = "available"
    # sparse (DSA) MLA: attnreg.testing.sparse_checks
    SPARSE = "sparse"
    SPARSE_INDEX = "sparse_index"
    SPARSE_REFUSES_CAPTURE = "sparse_refuses_capture"
    SPARSE_REPLAY = "sparse_replay"



#: Pool layers a ``multi_layer`` claim runs (each with its own contents and fp8 scale).
MULTI_LAYER_COUNT = 3

#: DeepSeek-style MLA: (head_dim_qk, head_dim_v) -> the MLAConfig fields that give it.
#: MLA: q/k = kv_lora_rank + rope, v = kv_lora_rank.  MHA: q/k = nope + rope, v = v_head_dim.
_ROPE = 64


def head_dims_config(method: ForwardMethod, head_dims: tuple[int, int]) -> dict[str, int] | None:
    """MLAConfig fields that produce ``head_dims`` for ``method`` (None if none can).

    Examples
    --------
    >>> head_dims_config(ForwardMethod.MHA, (128, 128))
    {'qk_nope_head_dim': 64, 'v_head_dim': 128, 'qk_rope_head_dim': 64}
    >>> head_dims_config(ForwardMethod.MLA, (576, 512))
    {'kv_lora_rank': 512, 'qk_rope_head_dim': 64}
    """
    qk, v = head_dims
    if method is ForwardMethod.MLA:
        if qk - v != _ROPE or v <= 0:
            return None
        return {"kv_lora_rank": v, "qk_rope_head_dim": _ROPE}
    if qk - _ROPE <= 0 or v <= 0:
        return None
    return {"qk_nope_head_dim": qk - _ROPE, "v_head_dim": v, "qk_rope_head_dim": _ROPE}


@dataclass(frozen=True)
class Combo:
    """One concrete input configuration of a forward pass.

    ``sm_scale`` None: ``MLAConfig``'s default softmax scale (1/sqrt of the
    q/k nope + rope dims); a value: that scale (a YaRN-scaled model's).
    """

    method: ForwardMethod
    phase: Phase
    q_dtype: DType
    kv_dtype: DType
    page_size: int
    num_heads: int
    head_dims: tuple[int, int]
    sm_scale: float | None = None

    def label(self) -> str:
        scale = "" if self.sm_scale is None else f"/sm_scale{self.sm_scale:.4g}"
        return (f"{self.q_dtype}-{self.kv_dtype}/p{self.page_size}/h{self.num_heads}/"
                f"{self.head_dims[0]}x{self.head_dims[1]}{scale}")

    def describe(self) -> str:
        scale = "" if self.sm_scale is None else f" sm_scale={self.sm_scale:.4g}"
        return (f"{self.phase} {self.method} q={self.q_dtype} kv={self.kv_dtype} "
                f"page={self.page_size} heads={self.num_heads} "
                f"dims={self.head_dims[0]}/{self.head_dims[1]}{scale}")

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method.value, "phase": self.phase.value,
                "q_dtype": self.q_dtype.value, "kv_dtype": self.kv_dtype.value,
                "page_size": self.page_size, "num_heads": self.num_heads,
                "head_dims": list(self.head_dims), "sm_scale": self.sm_scale}


@dataclass(frozen=True)
class Claim:
    """One checkable statement about one backend.

    ``combo`` is the configuration the check runs with (for a refusal: the
    undeclared request itself).  ``graph_mode``/``capture``/``pinned_method``/
    ``split_kv`` copy the declaration entry a capture claim comes from.
    """

    backend: str
    kind: ClaimKind
    check: Check
    combo: Combo | None
    statement: str
    graph_mode: GraphMode = GraphMode.DISABLED
    capture: SupportKind | None = None
    fallback_to: str | None = None
    pinned_method: ForwardMethod | None = None
    split_kv: SplitKV = SplitKV.NONE
    batches: tuple[str, ...] = ()
    needs_device_graphs: bool = False
    skip_reason: str = ""
    #: The platforms whose declarations make this claim, when it is listed from
    #: other platforms than the one under test (see :func:`other_platform_claims`).
    declared_for: tuple[str, ...] = ()
    #: The forward mode the claim runs (None: the phase's plain mode, DECODE or
    #: EXTEND); speculative claims carry ``query_len``, the draft tokens per sequence.
    forward_mode: ForwardMode | None = None
    query_len: int | None = None

    @property
    def speculative(self) -> bool:
        return self.forward_mode in SPECULATIVE_MODES

    @property
    def id(self) -> str:
        """Stable, ``-k``-friendly id: ``backend/kind/phase/.../check/params``.

        Speculative claims name their forward mode after the phase (eager) or the
        graph mode (capture); eager claims other than ``matches_reference`` name
        their check.
        """
        parts: list[str] = [self.backend, self.kind.value]
        if self.kind is ClaimKind.AVAILABILITY:
            return "/".join(parts)
        c = self.combo
        spec = [f"{self.forward_mode}"] if self.speculative else []
        if self.kind is ClaimKind.CAPTURE:
            assert c is not None
            parts += [c.phase.value, self.graph_mode.value, *spec, self.check.value,
                      c.method.value, c.label()]
        elif self.kind is ClaimKind.REFUSAL:
            assert c is not None
            parts += [c.phase.value, c.method.value, self.check.value, self._refused_value()]
        else:
            assert c is not None
            check = [] if self.check is Check.MATCHES_REFERENCE else [self.check.value]
            parts += [c.phase.value, c.method.value, *spec, *check, c.label()]
        return "/".join(parts)

    def _refused_value(self) -> str:
        c = self.combo
        assert c is not None
        return {
            Check.PAGE_SIZE: f"p{c.page_size}",
            Check.Q_DTYPE: f"q-{c.q_dtype}",
            Check.KV_DTYPE: f"kv-{c.kv_dtype}",
            Check.HEAD_DIMS: f"{c.head_dims[0]}x{c.head_dims[1]}",
            Check.NUM_HEADS: f"h{c.num_heads}",
            Check.INDEX_DTYPE: "int64",
            Check.METHOD: c.method.value,
        }.get(self.check, self.check.value)

    def to_dict(self) -> dict[str, object]:
        return {
            "id": self.id, "backend": self.backend, "kind": self.kind.value,
            "check": self.check.value, "statement": self.statement,
            "combo": self.combo.to_dict() if self.combo else None,
            "graph_mode": self.graph_mode.value,
            "capture": self.capture.value if self.capture else None,
            "fallback_to": self.fallback_to,
            "pinned_method": self.pinned_method.value if self.pinned_method else None,
            "split_kv": self.split_kv.value, "batches": list(self.batches),
            "needs_device_graphs": self.needs_device_graphs,
            "forward_mode": self.forward_mode.value if self.forward_mode else None,
            "query_len": self.query_len,
        }


# ---------------------------------------------------------------------------
# choosing values
# ---------------------------------------------------------------------------

_DTYPE_ORDER = (DType.BF16, DType.FP16, DType.FP32, DType.FP8_E4M3)
#: Head counts tried per device (each kernel adds the largest it declares): DeepSeek-V3's
#: 128 heads split over TP 8 / TP 1; on cpu the base configuration runs 2 (the Triton
#: interpreter runs every head's program in turn), 16 and the largest run one small
#: batch each (:func:`~attnreg.testing.batches.quick_specs`).
_HEADS = {"cpu": (2, 16), "cuda": (16, 128)}
_PREFERRED_PAGE = 16

#: A softmax scale other than ``MLAConfig``'s default 1/sqrt(192): DeepSeek-V3's under
#: YaRN (rope factor 40, mscale_all_dim 1), ``mscale ** 2 / sqrt(192)`` with ``mscale =
#: 0.1 ln 40 + 1``, about 0.1352.  ``sm_scale`` claims run with it, so a backend that
#: hard-codes the default scale is refuted.
YARN_SM_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


def _ordered(dtypes: Iterable[DType]) -> list[DType]:
    have = set(dtypes)
    return [d for d in _DTYPE_ORDER if d in have]


def _dtype_pairs(k: KernelConstraints) -> list[tuple[DType, DType]]:
    """(q, kv) pairs the kernel should accept: kv equal to q, or an fp8 cache.

    Mixed half types (bf16 queries over an fp16 cache) are not a pairing any
    engine uses and declarations cannot express them, so they are not claimed.
    For kernels reading no paged cache (ragged MHA) K/V come in the q dtype.
    """
    pairs: list[tuple[DType, DType]] = []
    for q in _ordered(k.q_dtypes):
        if q is DType.FP8_E4M3:
            continue  # fp8 queries are not part of any built-in claim
        if not k.page_sizes:
            if q in k.kv_dtypes:
                pairs.append((q, q))
            continue
        for kv in _ordered(k.kv_dtypes):
            if kv is q or kv is DType.FP8_E4M3:
                pairs.append((q, kv))
    return pairs


def _head_counts(k: KernelConstraints, device: str,
                 heads: Sequence[int] | None = None) -> list[int]:
    """The head counts claimed for kernel ``k``; the first is the base configuration's.

    cuda: every declared count (a fixed list), else 16, 128 and ``max_heads``.  cpu:
    the smallest declared (else 2), then at least 16 and the largest declared, so a
    kernel wrong above a few heads is refuted there too.
    """
    if heads:
        # the caller fixed the head counts (e.g. one tensor-parallel rank's share):
        # claim those the kernel declares, and nothing else
        return sorted({h for h in heads if k.accepts_heads(h)})
    if k.head_counts:
        declared = sorted(k.head_counts)
        if device != "cpu":
            return declared
        return sorted({declared[0], *[h for h in declared if h >= 16][:1], declared[-1]})
    wanted = {h for h in (*_HEADS.get(device, _HEADS["cuda"]), k.max_heads)
              if k.accepts_heads(h)}
    return sorted(wanted) or [1]


def _page_sizes(k: KernelConstraints, caps: Capabilities, phase: Phase) -> list[int]:
    if k.page_sizes:
        sizes = list(k.page_sizes)
        # the base configuration goes first
        if _PREFERRED_PAGE in sizes:
            sizes.remove(_PREFERRED_PAGE)
            sizes.insert(0, _PREFERRED_PAGE)
        return sizes
    # A ragged kernel reads no cache, but the pass still writes the new tokens
    # into the pool: use a page size some paged kernel of the backend takes.
    for other in caps.kernels:
        if other.page_sizes:
            return [_PREFERRED_PAGE if _PREFERRED_PAGE in other.page_sizes
                    else other.page_sizes[0]]
    return [_PREFERRED_PAGE]


def _combos(caps: Capabilities, k: KernelConstraints, phase: Phase, device: str,
            exhaustive: bool, head_counts: Sequence[int] | None = None) -> list[Combo]:
    pairs = _dtype_pairs(k)
    pages = _page_sizes(k, caps, phase)
    heads = _head_counts(k, device, head_counts)
    dims = [d for d in k.head_dims if head_dims_config(k.method, d) is not None]
    if not (pairs and pages and heads and dims):
        return []
    if exhaustive:
        return [Combo(k.method, phase, q, kv, p, h, d)
                for (q, kv), p, h, d in itertools.product(pairs, pages, heads, dims)]
    base = Combo(k.method, phase, pairs[0][0], pairs[0][1], pages[0], heads[0], dims[0])
    out = [base]
    for q, kv in pairs[1:]:
        out.append(replace(base, q_dtype=q, kv_dtype=kv))
    for p in pages[1:]:
        out.append(replace(base, page_size=p))
    for h in heads[1:]:
        out.append(replace(base, num_heads=h))
    for d in dims[1:]:
        out.append(replace(base, head_dims=d))
    return out


def kernel_q_compute_dtype(caps: Capabilities, combo: Combo) -> DType | None:
    """The ``q_compute_dtype`` of the declared kernel that serves ``combo`` (None: q as given)."""
    for k in caps.kernels_for(combo.method, combo.phase):
        if combo.q_dtype in k.q_dtypes and combo.kv_dtype in k.kv_dtypes \
                and (not k.page_sizes or combo.page_size in k.page_sizes) \
                and k.accepts_heads(combo.num_heads):
            return k.q_compute_dtype
    return None


def base_combo(caps: Capabilities, method: ForwardMethod, phase: Phase,
               device: str, heads: Sequence[int] | None = None) -> Combo | None:
    """The base configuration of ``method`` in ``phase`` (None if not declared)."""
    for k in caps.kernels_for(method, phase):
        combos = _combos(caps, k, phase, device, exhaustive=False, head_counts=heads)
        if combos:
            return combos[0]
    return None


# ---------------------------------------------------------------------------
# eager claims
# ---------------------------------------------------------------------------

def _eager_claims(caps: Capabilities, device: str, exhaustive: bool,
                  heads: Sequence[int] | None) -> list[Claim]:
    claims: list[Claim] = []
    seen: set[Combo] = set()
    for k in caps.kernels:
        for phase in (Phase.DECODE, Phase.PREFILL):
            if phase not in k.phases:
                continue
            base_heads = min(_head_counts(k, device, heads), default=0)
            for combo in _combos(caps, k, phase, device, exhaustive, heads):
                if combo in seen:
                    continue
                seen.add(combo)
                specs = eager_specs(phase, method=combo.method)
                if device == "cpu" and not heads and combo.num_heads != base_heads:
                    # the interpreter runs each head's programs in turn: one small batch
                    specs = quick_specs(phase)
                claims.append(Claim(
                    caps.backend, ClaimKind.EAGER, Check.MATCHES_REFERENCE, combo,
                    f"{combo.describe()} matches the float64 oracle on "
                    f"{', '.join(specs)} and writes only its own KV slots",
                    batches=specs))
    claims += _sm_scale_eager_claims(caps, device, heads)
    claims += _speculative_eager_claims(caps, device, exhaustive, heads)
    claims += _lse_claims(caps, device, heads)
    claims += _multi_layer_eager_claims(caps, device, heads)
    return claims


def _sm_scale_eager_claims(caps: Capabilities, device: str,
                           heads: Sequence[int] | None) -> list[Claim]:
    """One per (method, phase): the base configuration with :data:`YARN_SM_SCALE` as
    ``MLAConfig.sm_scale`` (on cpu on one small batch)."""
    claims: list[Claim] = []
    for phase in (Phase.DECODE, Phase.PREFILL):
        for method in caps.methods(phase):
            base = base_combo(caps, method, phase, device, heads)
            if base is None:
                continue
            combo = replace(base, sm_scale=YARN_SM_SCALE)
            specs = quick_specs(phase) if device == "cpu" \
                else eager_specs(phase, method=method)
            claims.append(Claim(
                caps.backend, ClaimKind.EAGER, Check.MATCHES_REFERENCE, combo,
                f"{combo.describe()} (MLAConfig.sm_scale set to a YaRN-scaled model's, not "
                f"the default 1/sqrt(qk dims)) matches the float64 oracle at that scale on "
                f"{', '.join(specs)} and writes only its own KV slots", batches=specs))
    return claims


def _speculative_eager_claims(caps: Capabilities, device: str, exhaustive: bool,
                              heads: Sequence[int] | None) -> list[Claim]:
    """Each speculative forward mode the backend serves eagerly, at its declared draft
    tokens, for each declared (q, kv) dtype pair of the decode phase's MLA kernels (the
    base pair only on cpu, unless exhaustive)."""
    claims: list[Claim] = []
    base = base_combo(caps, ForwardMethod.MLA, Phase.DECODE, device, heads)
    if base is None:
        return claims
    for served in caps.eager_forward_modes:
        if served.mode not in SPECULATIVE_MODES or served.max_query_len is None:
            continue
        q = served.max_query_len
        specs = eager_specs(Phase.DECODE, served.mode)
        combos = _dtype_variants(caps, base, ForwardMethod.MLA, Phase.DECODE, device, heads) \
            if exhaustive or device != "cpu" else [base]
        for combo in combos:
            claims.append(Claim(
                caps.backend, ClaimKind.EAGER, Check.MATCHES_REFERENCE, combo,
                f"eager {served.mode} batches of {q} tokens per sequence ({served.describe()}"
                f"), {combo.describe()}: causal among the new tokens over the whole prefix, "
                f"match the float64 oracle on {', '.join(specs)} and write only their own KV "
                "slots", batches=specs, forward_mode=served.mode, query_len=q))
    return claims


def _dtype_variants(caps: Capabilities, base: Combo, method: ForwardMethod, phase: Phase,
                    device: str, heads: Sequence[int] | None) -> list[Combo]:
    """``base`` and one configuration per other declared (q, kv) dtype pair of ``method``
    in ``phase``, each one its kernel accepts (see :func:`_declared_variant`)."""
    out = [base]
    for q, kv in _pairs_for(caps, method, phase):
        if (q, kv) != (base.q_dtype, base.kv_dtype):
            variant = _declared_variant(caps, replace(base, q_dtype=q, kv_dtype=kv), device,
                                        heads)
            if variant is not None:
                out.append(variant)
    return out


def _lse_claims(caps: Capabilities, device: str, heads: Sequence[int] | None) -> list[Claim]:
    """One per (method, phase) whose kernels declare an LSE output, at the base configuration
    of those kernels."""
    claims: list[Claim] = []
    for phase in (Phase.DECODE, Phase.PREFILL):
        for method in caps.methods(phase):
            lse_kernels = [k for k in caps.kernels_for(method, phase) if k.lse]
            combo = next((c for k in lse_kernels
                          for c in _combos(caps, k, phase, device, False, heads)), None)
            if combo is None:
                continue
            specs = eager_specs(phase, method=method)
            claims.append(Claim(
                caps.backend, ClaimKind.EAGER, Check.LSE, combo,
                f"{combo.describe()} with return_lse=True returns float32 [tokens, heads] "
                "log-sum-exps equal to the oracle's (natural log of the summed exp(sm_scale "
                f"* q . k) over the visible keys) on {', '.join(specs)}, beside an output "
                "that matches it", batches=specs))
    return claims


def _multi_layer_combo(caps: Capabilities, method: ForwardMethod, phase: Phase, device: str,
                       heads: Sequence[int] | None) -> Combo | None:
    """The base configuration, with an fp8 pool where declared (per-layer scales matter):
    the fp8 kernel's own base where it takes other head counts than the base's."""
    base = base_combo(caps, method, phase, device, heads)
    if base is None:
        return None
    fp8 = [(q, kv) for q, kv in _pairs_for(caps, method, phase) if kv is DType.FP8_E4M3]
    if not fp8:
        return base
    # the fp8 kernel may take other head counts or page sizes than the base's
    return _declared_variant(caps, replace(base, q_dtype=fp8[0][0], kv_dtype=fp8[0][1]),
                             device, heads) or base


def _multi_layer_eager_claims(caps: Capabilities, device: str,
                              heads: Sequence[int] | None) -> list[Claim]:
    claims: list[Claim] = []
    for phase in (Phase.DECODE, Phase.PREFILL):
        if ForwardMethod.MLA not in caps.methods(phase):
            continue
        combo = _multi_layer_combo(caps, ForwardMethod.MLA, phase, device, heads)
        if combo is None:
            continue
        specs = eager_specs(phase)[:2]
        claims.append(Claim(
            caps.backend, ClaimKind.EAGER, Check.MULTI_LAYER, combo,
            f"{MULTI_LAYER_COUNT} layers of one pool (own contents and kv scales), planned "
            f"once per step with init_forward_metadata and run per layer_id, each match "
            f"their own oracle on {', '.join(specs)} ({combo.describe()}); every layer "
            "writes only its own slots", batches=specs))
    return claims


# ---------------------------------------------------------------------------
# refusal claims
# ---------------------------------------------------------------------------

_PAGE_CANDIDATES = (3, 7, 128, 2, 5)
_DTYPE_CANDIDATES = (DType.FP32, DType.FP8_E4M3, DType.FP16, DType.BF16)
_DIMS_CANDIDATES = {
    ForwardMethod.MLA: ((320, 256), (576 + 64, 576)),
    ForwardMethod.MHA: ((256, 128), (96, 64), (192, 192)),
    ForwardMethod.MHA_CHUNKED_KV: ((256, 128), (96, 64), (192, 192)),
}


def _refused(caps: Capabilities, combo: Combo, **fields: object) -> bool:
    """Whether the declaration rejects ``combo`` (with the given fields) for its method."""
    return bool(caps.check_request(combo.method, combo.phase, **fields))  # type: ignore[arg-type]


def _refusal_claims(caps: Capabilities, device: str,
                    heads: Sequence[int] | None) -> list[Claim]:
    claims: list[Claim] = []

    def add(check: Check, combo: Combo, what: str) -> None:
        claims.append(Claim(
            caps.backend, ClaimKind.REFUSAL, check, combo,
            f"{combo.phase} {combo.method} with {what} (undeclared) is refused with "
            "UnsupportedError before any kernel launch"))

    for phase in (Phase.DECODE, Phase.PREFILL):
        methods = caps.methods(phase)
        for method in methods:
            base = base_combo(caps, method, phase, device, heads)
            if base is None:
                continue
            # page size: only meaningful where a paged cache is read
            if any(k.page_sizes for k in caps.kernels_for(method, phase)):
                for p in _PAGE_CANDIDATES:
                    if _refused(caps, base, page_size=p):
                        add(Check.PAGE_SIZE, replace(base, page_size=p), f"page size {p}")
                        break
            for dt in _DTYPE_CANDIDATES:
                if dt is not base.q_dtype and _refused(caps, base, q_dtype=dt):
                    kv = dt if not any(k.page_sizes for k in caps.kernels_for(method, phase)) \
                        else base.kv_dtype
                    add(Check.Q_DTYPE, replace(base, q_dtype=dt, kv_dtype=kv), f"q dtype {dt}")
                    break
            if any(k.page_sizes for k in caps.kernels_for(method, phase)):
                for dt in _DTYPE_CANDIDATES:
                    if dt is not base.kv_dtype and _refused(caps, base, kv_dtype=dt):
                        add(Check.KV_DTYPE, replace(base, kv_dtype=dt), f"kv dtype {dt}")
                        break
            for dims in _DIMS_CANDIDATES.get(method, ()):
                if _refused(caps, base, head_dims=dims) and head_dims_config(method, dims):
                    add(Check.HEAD_DIMS, replace(base, head_dims=dims),
                        f"head dims {dims[0]}/{dims[1]}")
                    break
            max_heads = max(k.max_heads for k in caps.kernels_for(method, phase))
            too_many = max_heads + 1
            if _refused(caps, base, num_heads=too_many):
                add(Check.NUM_HEADS, replace(base, num_heads=too_many), f"{too_many} heads")
            claims.append(Claim(
                caps.backend, ClaimKind.REFUSAL, Check.INDEX_DTYPE, base,
                f"{phase} {method} with int64 index tensors (sequence lengths, page table; "
                "the runtime contract is int32) is refused with UnsupportedError before any "
                "kernel launch"))
        # an undeclared forward method for a phase the backend serves
        if methods:
            for method in ForwardMethod:
                if method in methods:
                    continue
                donor = base_combo(caps, methods[0], phase, device, heads)
                if donor is None:
                    continue
                dims = {ForwardMethod.MLA: (576, 512)}.get(method, (192, 128))
                if phase is Phase.DECODE and method is not ForwardMethod.MLA:
                    # decode runs through forward_decode, which takes no method
                    continue
                add(Check.METHOD, replace(donor, method=method, head_dims=dims),
                    f"forward method {method}")
    return claims


# ---------------------------------------------------------------------------
# capture claims
# ---------------------------------------------------------------------------

def _capture_methods(caps: Capabilities, entry: GraphModeSupport) -> list[ForwardMethod]:
    """The forward methods that can run under ``entry``'s capture mode."""
    declared = caps.methods(entry.phase)
    if entry.pinned_method is not None:
        return [entry.pinned_method] if entry.pinned_method in declared else []
    if entry.phase is Phase.DECODE:
        return [m for m in declared if m is ForwardMethod.MLA]
    return [m for m in declared if m is not ForwardMethod.MHA_CHUNKED_KV]


def _capture_claims(caps: Capabilities, device: str, exhaustive: bool,
                    heads: Sequence[int] | None) -> list[Claim]:
    claims: list[Claim] = []
    for entry in caps.graph_modes:
        if entry.mode is GraphMode.DISABLED or not caps.serves(entry.phase):
            continue
        phase, mode, sup = entry.phase, entry.mode, entry.capture
        common: dict[str, object] = {
            "graph_mode": mode, "capture": sup.kind, "fallback_to": sup.fallback_to,
                  "pinned_method": entry.pinned_method, "split_kv": entry.split_kv}
        where = f"{phase} under {mode}"
        methods = _capture_methods(caps, entry)
        if sup.is_unsupported:
            method = methods[0] if methods else caps.methods(phase)[0]
            combo = base_combo(caps, method, phase, device, heads)
            if combo is not None:
                claims.append(Claim(
                    caps.backend, ClaimKind.CAPTURE, Check.REFUSES_CAPTURE, combo,
                    f"{where} is declared unsupported ({sup.reason}); the backend refuses "
                    "to prepare a capture with UnsupportedError", **common))  # type: ignore[arg-type]
            continue
        for method in methods:
            base = base_combo(caps, method, phase, device, heads)
            if base is None:
                continue
            claims += _mode_capture_claims(caps, entry, method, base, None, device, exhaustive,
                                           common, heads=heads)
            if mode is GraphMode.TC_PIECEWISE or method is not ForwardMethod.MLA:
                continue
            for served in entry.forward_modes:
                if served.mode in SPECULATIVE_MODES and served.max_query_len is not None:
                    claims += _mode_capture_claims(caps, entry, method, base, served.mode,
                                                   device, exhaustive, common, heads=heads,
                                                   query_len=served.max_query_len)
    return claims


def _mode_capture_claims(caps: Capabilities, entry: GraphModeSupport, method: ForwardMethod,
                         base: Combo, forward_mode: ForwardMode | None, device: str,
                         exhaustive: bool, common: dict[str, object], *,
                         heads: Sequence[int] | None, query_len: int | None = None
                         ) -> list[Claim]:
    """The capture claims of one forward mode (None: the phase's plain one) of one entry."""
    claims: list[Claim] = []
    phase, mode, sup = entry.phase, entry.mode, entry.capture
    spec_common = dict(common, forward_mode=forward_mode, query_len=query_len)
    what = f"{forward_mode} batches of {query_len} tokens per sequence" \
        if forward_mode is not None else ""
    where = f"{phase} under {mode}" + (f", {what}" if what else "")
    how = "natively" if sup.is_native else f"through its fallback to {sup.fallback_to}"
    replay = replay_specs(phase, forward_mode)

    def add(check: Check, statement: str, combo: Combo = base,
            batches: Sequence[str] = replay) -> None:
        from .checks import needs_device_graphs  # the check's class says where it runs

        claims.append(Claim(caps.backend, ClaimKind.CAPTURE, check, combo, statement,
                            batches=tuple(batches),
                            needs_device_graphs=needs_device_graphs(check),
                            **spec_common))  # type: ignore[arg-type]

    add(Check.CAPTURE_PATH,
        f"{where}, {method} runs {how} and matches the oracle when its capture-mode "
        "code path (capture metadata, then replay metadata for each batch) is "
        "driven without a device graph")
    if forward_mode is None:
        # what is planned at capture must use the config's scale too (on cpu: the
        # capture batch and one replay)
        scaled = replace(base, sm_scale=YARN_SM_SCALE)
        add(Check.CAPTURE_PATH,
            f"{where}, {method} with MLAConfig.sm_scale {YARN_SM_SCALE:.4g} (a YaRN-scaled "
            f"model's) runs {how} and matches the oracle at that scale when its "
            "capture-mode code path is driven without a device graph", combo=scaled,
            batches=replay[:2] if device == "cpu" else replay)
    if forward_mode is None and sup.is_fallback:
        add(Check.FALLBACK_SERVED,
            f"{where}, {method} is served by the declared fallback {sup.fallback_to} "
            "(as the backend reports through note_served_by), on every batch")
    if forward_mode is None and entry.pinned_method is not None and phase is Phase.PREFILL:
        # decode has one form (forward_decode takes no method): nothing to pin
        add(Check.PINNING,
            f"{where} every extend batch (prefix or not) runs the pinned "
            f"{entry.pinned_method} method, never another one")
    if mode is GraphMode.TC_PIECEWISE:
        add(Check.PIECEWISE,
            f"{where}, {method} runs eagerly between captured graph pieces (static "
            "input/output buffers, replayed pieces) and matches the oracle "
            f"on {', '.join(replay)}")
        return claims
    kv_variants = [base]
    if exhaustive or device != "cpu":
        kv_variants = _dtype_variants(caps, base, method, phase, device, heads)
    for combo in kv_variants:
        add(Check.REPLAY,
            f"{where}, {method} captured once replays {', '.join(replay)} "
            "(new lengths and contents each time) and matches the oracle, leaving "
            "every KV slot outside the written ones untouched", combo=combo)
    for combo in kv_variants:
        add(Check.CAPTURE_MEMORY,
            f"{where}, what init_cuda_graph_state and the capture allocate is within "
            "1.25x (or 1 MiB) of the declared CaptureMemory.estimate for the captured "
            "shape", combo=combo)
    add(Check.PADDED_ROWS,
        f"{where}, a graph captured for the largest of {', '.join(replay)} "
        "replays the smaller ones with every output row of the padding exactly zero")
    if method is ForwardMethod.MLA:  # the layer decides what MLA reads (MHA: k / v given)
        add(Check.MULTI_LAYER,
            f"{where}, {MULTI_LAYER_COUNT} layers of one pool (own contents and kv scales) "
            "captured in one graph over one captured plan replay "
            f"{', '.join(replay[:2])} with every layer matching its own oracle",
            combo=_multi_layer_combo(caps, method, phase, device, heads) or base,
            batches=replay[:2])
    add(Check.ALLOCATOR_CHURN,
        f"{where}, replays stay correct after large tensors are allocated and "
        "freed between them (storage the graph recorded was not freed)")
    add(Check.NO_SYNC_ALLOC,
        f"{where}, nothing in the captured region synchronises with the host or "
        "allocates outside the graph's pool", batches=replay[:1])
    if entry.split_kv in (SplitKV.DYNAMIC, SplitKV.HOST_PLANNED, SplitKV.SINGLE):
        longs = tuple(s for s in replay if "long_kv" in s) or replay
        # Prefill: captured for few tokens, as a split-KV extend is (a graph sized
        # for hundreds of tokens fills the GPU without splits and proves nothing).
        short = "short_extend" if forward_mode is None and phase is Phase.PREFILL \
            else replay[0]
        kind = {SplitKV.DYNAMIC: "device-side split counts follow each replay's "
                                 "lengths",
                SplitKV.HOST_PLANNED: "split counts re-planned on the host before "
                                      "each replay follow its lengths",
                SplitKV.SINGLE: "one split under capture"}[entry.split_kv]
        add(Check.SPLIT_KV,
            f"{where}, split-KV is {entry.split_kv} ({kind}): a graph captured on "
            "short sequences replays long ones correctly",
            batches=(short,) + longs)
    return claims


def _declared_variant(caps: Capabilities, combo: Combo, device: str,
                      heads: Sequence[int] | None) -> Combo | None:
    """``combo`` if the declaration accepts it, else the base configuration of the
    kernel that serves its dtypes (a kernel may take other head counts or page
    sizes than the base's, e.g. an fp8-pool kernel proven for fewer head counts)."""
    if not _refused(caps, combo, head_dims=combo.head_dims, q_dtype=combo.q_dtype,
                    kv_dtype=combo.kv_dtype, page_size=combo.page_size,
                    num_heads=combo.num_heads):
        return combo
    for k in caps.kernels_for(combo.method, combo.phase):
        if combo.q_dtype in k.q_dtypes and combo.kv_dtype in k.kv_dtypes:
            for candidate in _combos(caps, k, combo.phase, device, False, heads):
                if (candidate.q_dtype, candidate.kv_dtype) == (combo.q_dtype, combo.kv_dtype):
                    return candidate
    return None


def _pairs_for(caps: Capabilities, method: ForwardMethod,
               phase: Phase) -> list[tuple[DType, DType]]:
    out: list[tuple[DType, DType]] = []
    for k in caps.kernels_for(method, phase):
        for pair in _dtype_pairs(k):
            if pair not in out:
                out.append(pair)
    return out


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------

def expand_claims(caps: Capabilities, device: str = "cpu", *,
                  exhaustive: bool = False, heads: Sequence[int] | None = None) -> list[Claim]:
    """All claims of one declaration, for a run on ``device`` (``cpu`` or ``cuda``).

    Parameters
    ----------
    caps
        The backend's declaration on the platform under test.
    device
        ``cpu`` keeps head counts and the capture dtype variants minimal;
        ``cuda`` adds 128 heads and one replay claim per declared kv dtype.
    exhaustive
        Expand the full product of declared values instead of covering each
        value once.
    heads
        Run every configuration with these head counts only (e.g. ``(32,)``:
        128 heads split over tensor-parallel 4) instead of the device's
        defaults.  A kernel that declares none of them makes no claims.

    Examples
    --------
    >>> from attnreg.registry import get_registry
    >>> caps = get_registry().declaration("reference", "cpu")
    >>> claims = expand_claims(caps, "cpu")
    >>> sorted({c.kind.value for c in claims})
    ['capture', 'eager', 'refusal']
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if heads is not None and any(int(h) < 1 for h in heads):
        raise ValueError(f"head counts must be >= 1, got {list(heads)}")
    claims = (_eager_claims(caps, device, exhaustive, heads)
              + _refusal_claims(caps, device, heads)
              + _capture_claims(caps, device, exhaustive, heads))
    if caps.sparse_kernels:
        from .sparse_checks import sparse_claims

        claims += sparse_claims(caps, device, heads)
    if device == "cpu":
        claims = [replace(c, skip_reason="no CUDA graphs on cpu: needs real capture and "
                                         "replay (run with --device cuda)")
                  if c.needs_device_graphs else c for c in claims]
    ids = [c.id for c in claims]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:  # a bug here would silently merge two claims in the report
        raise AssertionError(f"duplicate claim ids: {sorted(dupes)}")
    return claims


#: The CUDA platforms whose declarations are compared with the one under test:
#: Hopper (H100/H200) and the Blackwell data-centre parts (B200, B300).
CUDA_PLATFORMS = ("cuda:sm90", "cuda:sm100", "cuda:sm103")


def declares_kernels(caps: Capabilities) -> bool:
    """Whether the declaration runs anything on its platform (no platform reason, a kernel)."""
    return not caps.platform_reason and bool(caps.kernels)


def other_platform_claims(here: Iterable[Claim], others: Iterable[Capabilities],
                          platform: str, device: str = "cpu", *, exhaustive: bool = False,
                          heads: Sequence[int] | None = None) -> list[Claim]:
    """Claims of ``others`` (declarations on other platforms) absent from ``here``, skipped.

    Each declaration is expanded as :func:`expand_claims` would for ``device``
    (the same settings as the run, so that equal promises get equal ids); a
    claim whose id is in ``here`` (the claims of ``platform``, the one under
    test) is left out, and an id several platforms make is listed once, its
    skip reason naming them all: ``declared for cuda:sm100, cuda:sm103 only;
    this is cuda:sm90``.  Declarations that run nothing on their platform, or
    are for ``platform`` itself, add nothing.

    Examples
    --------
    >>> from attnreg.registry import get_registry
    >>> reg = get_registry()
    >>> here = expand_claims(reg.declaration("flash_attn_cute", "cuda:sm90"), "cuda")
    >>> others = [reg.declaration("flash_attn_cute", p) for p in ("cuda:sm100", "cuda:sm103")]
    >>> extra = other_platform_claims(here, others, "cuda:sm90", "cuda")
    >>> extra[0].skip_reason
    'declared for cuda:sm100, cuda:sm103 only; this is cuda:sm90'
    """
    taken = {c.id for c in here}
    first: dict[str, Claim] = {}
    where: dict[str, list[str]] = {}
    for caps in others:
        name = str(caps.platform)
        if name == platform or not declares_kernels(caps):
            continue
        for claim in expand_claims(caps, device, exhaustive=exhaustive, heads=heads):
            if claim.id in taken:
                continue
            first.setdefault(claim.id, claim)
            if name not in where.setdefault(claim.id, []):
                where[claim.id].append(name)
    return [replace(claim, declared_for=tuple(where[cid]),
                    skip_reason=f"declared for {', '.join(where[cid])} only; this is {platform}")
            for cid, claim in first.items()]


def unavailable_claim(backend: str, reason: str) -> Claim:
    """A placeholder claim for a requested backend that cannot run here (always skipped)."""
    return Claim(backend, ClaimKind.AVAILABILITY, Check.AVAILABLE, None,
                 f"{backend} can run here", skip_reason=f"backend not available: {reason}")
