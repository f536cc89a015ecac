"""Claims: what a backend's declaration promises, as a list of checkable statements.

Pure data, no torch: :func:`expand_claims` turns one
:class:`~attnreg.registry.Capabilities` into :class:`Claim` objects, and the
pytest plugin turns each claim into one test item.  This module holds the claim
types, the sites checks expand at (the declaration as a whole, each
:class:`RefusalSite`, each :class:`CaptureSite`) and the helpers that choose
configurations; what each check claims at a site is its class's, in
:mod:`attnreg.testing.checks` (one class per check, one table).  Three kinds:

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
from typing import TypedDict

from attnreg.registry.capabilities import (
    SPECULATIVE_MODES,
    Capabilities,
    CaptureSupport,
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

from .batches import replay_specs

__all__ = [
    "CUDA_PLATFORMS",
    "MULTI_LAYER_COUNT",
    "YARN_SM_SCALE",
    "CaptureSite",
    "Check",
    "Claim",
    "ClaimKind",
    "Combo",
    "Expansion",
    "RefusalSite",
    "base_combo",
    "capture_sites",
    "expand_claims",
    "refusal_sites",
    "declares_kernels",
    "head_dims_config",
    "kernel_q_compute_dtype",
    "kernel_q_rounding",
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
    Q_ROUNDING = "q_rounding"
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
    KV_SCALE_CHANGE = "kv_scale_change"
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
    #: the check's id: a :class:`Check` for the built-in ones, any ``snake_case`` string
    #: for a check class registered from another module (see attnreg.testing.checks)
    check: Check | str
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
    #: What a refusal claim asks for, as its id names it (``p7``, ``q-fp32``; empty:
    #: the check's id)
    refused: str = ""

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
            parts += [c.phase.value, self.graph_mode.value, *spec, str(self.check),
                      c.method.value, c.label()]
        elif self.kind is ClaimKind.REFUSAL:
            assert c is not None
            parts += [c.phase.value, c.method.value, str(self.check),
                      self.refused or str(self.check)]
        else:
            assert c is not None
            check = [] if self.check == Check.MATCHES_REFERENCE else [str(self.check)]
            parts += [c.phase.value, c.method.value, *spec, *check, c.label()]
        return "/".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {
            "id": self.id, "backend": self.backend, "kind": self.kind.value,
            "check": str(self.check), "statement": self.statement,
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


def dtype_pairs(k: KernelConstraints) -> list[tuple[DType, DType]]:
    """(q, kv) pairs the kernel should accept: kv equal to q, or an fp8 cache.

    Mixed half types (bf16 queries over an fp16 cache) are not a pairing any
    engine uses and declarations cannot express them, so they are not claimed.
    For kernels reading no paged cache (ragged MHA) K/V come in the q dtype.
    """
    pairs: list[tuple[DType, DType]] = []
    for q in _ordered(k.q_dtypes):
        if q is DType.FP8_E4M3:
            # an engine's fp8 q (with its scale) over an fp8 cache: absorbed MLA only
            if k.page_sizes and DType.FP8_E4M3 in k.kv_dtypes:
                pairs.append((q, q))
            continue
        if not k.page_sizes:
            if q in k.kv_dtypes:
                pairs.append((q, q))
            continue
        for kv in _ordered(k.kv_dtypes):
            if kv is q or kv is DType.FP8_E4M3:
                pairs.append((q, kv))
    return pairs


def claimed_head_counts(k: KernelConstraints, device: str,
                        heads: Sequence[int] | None = None) -> list[int]:
    """The head counts claimed for kernel ``k``; the first is the base configuration's.

    cuda: every declared count (a fixed list), else 16, 128 and ``max_heads``.  cpu:
    the smallest declared (else 2), then at least 16 and the largest declared, so a
    kernel wrong above a few heads is refuted there too; a range from ``min_heads`` > 1
    (a kernel entry split by head count): ``min_heads`` alone.
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
    if device == "cpu" and k.min_heads > 1:
        # a range split at min_heads: its smallest count (the interpreter's cost grows
        # with heads)
        return [k.min_heads]
    wanted = {h for h in (*_HEADS.get(device, _HEADS["cuda"]), k.max_heads)
              if k.accepts_heads(h)}
    return sorted(wanted) or [max(1, k.min_heads)]


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


def combos_of(caps: Capabilities, k: KernelConstraints, phase: Phase, device: str,
              exhaustive: bool, head_counts: Sequence[int] | None = None) -> list[Combo]:
    pairs = dtype_pairs(k)
    pages = _page_sizes(k, caps, phase)
    heads = claimed_head_counts(k, device, head_counts)
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


class QRounding(TypedDict):
    """How a kernel rounds q: :func:`~attnreg.testing.workload.make_workload`'s keywords."""

    q_compute_dtype: DType | None
    q_compute_scale: str


def kernel_q_compute_dtype(caps: Capabilities, combo: Combo) -> DType | None:
    """The ``q_compute_dtype`` of the declared kernel that serves ``combo`` (None: q as given)."""
    return kernel_q_rounding(caps, combo)["q_compute_dtype"]


def kernel_q_rounding(caps: Capabilities, combo: Combo) -> QRounding:
    """How the declared kernel that serves ``combo`` rounds q, as the keyword arguments
    of :func:`~attnreg.testing.workload.make_workload`: ``q_compute_dtype`` (None: q as
    given) and ``q_compute_scale``."""
    for k in caps.kernels_for(combo.method, combo.phase):
        if combo.q_dtype in k.q_dtypes and combo.kv_dtype in k.kv_dtypes \
                and (not k.page_sizes or combo.page_size in k.page_sizes) \
                and k.accepts_heads(combo.num_heads):
            return QRounding(q_compute_dtype=k.q_compute_dtype,
                             q_compute_scale=k.q_compute_scale)
    return QRounding(q_compute_dtype=None, q_compute_scale="batch")


def base_combo(caps: Capabilities, method: ForwardMethod, phase: Phase,
               device: str, heads: Sequence[int] | None = None) -> Combo | None:
    """The base configuration of ``method`` in ``phase`` (None if not declared)."""
    for k in caps.kernels_for(method, phase):
        combos = combos_of(caps, k, phase, device, exhaustive=False, head_counts=heads)
        if combos:
            return combos[0]
    return None


# ---------------------------------------------------------------------------
# shared helpers of the checks' claim expansion (attnreg.testing.checks)
# ---------------------------------------------------------------------------

def dtype_variants(caps: Capabilities, base: Combo, method: ForwardMethod, phase: Phase,
                   device: str, heads: Sequence[int] | None) -> list[Combo]:
    """``base`` and one configuration per other declared (q, kv) dtype pair of ``method``
    in ``phase``, each one its kernel accepts (see :func:`declared_variant`); and one
    per kernel entry that serves a listed pair only at configurations none of those
    take, i.e. no listed configuration of its dtypes has a head count *and* a page size
    it accepts (a kernel whose declaration is split where it computes differently:
    triton's fp8 score dots from 33 heads up, by head count; its whole-page 16-head fp8
    config from 64-token pages, by page size), at its own base head count and its own
    base page size (the preferred page first where it has it)."""
    out = [base]
    for q, kv in pairs_for(caps, method, phase):
        if (q, kv) != (base.q_dtype, base.kv_dtype):
            variant = declared_variant(caps, replace(base, q_dtype=q, kv_dtype=kv), device,
                                       heads)
            if variant is not None:
                out.append(variant)
    for k in caps.kernels_for(method, phase):
        if any(k.accepts_heads(c.num_heads)
               and (not k.page_sizes or c.page_size in k.page_sizes) for c in out
               if c.q_dtype in k.q_dtypes and c.kv_dtype in k.kv_dtypes):
            continue
        counts = claimed_head_counts(k, device, heads)
        # a kernel reading no paged cache takes the configuration's page as it is
        page = _page_sizes(k, caps, phase)[0] if k.page_sizes else None
        for c in list(out):
            if counts and c.q_dtype in k.q_dtypes and c.kv_dtype in k.kv_dtypes:
                # several earlier configurations of the pair (a range split twice) give
                # the entry one configuration, not one each
                own = replace(c, num_heads=counts[0],
                              page_size=c.page_size if page is None else page)
                if own not in out:
                    out.append(own)
    return out


def multi_layer_combos(caps: Capabilities, method: ForwardMethod, phase: Phase, device: str,
                       heads: Sequence[int] | None) -> list[Combo]:
    """The configurations a multi-layer claim runs: the base, with an fp8 pool where
    declared (per-layer kv scales matter; the fp8 kernel's own base where it takes other
    head counts than the base's), and, where a kernel takes an engine's fp8 query over
    that pool, that pair too (each layer's query carries its own ``q_scale``)."""
    base = base_combo(caps, method, phase, device, heads)
    if base is None:
        return []
    fp8 = [(q, kv) for q, kv in pairs_for(caps, method, phase) if kv is DType.FP8_E4M3]
    if not fp8:
        return [base]
    # a 16-bit query over the fp8 pool first (the claim ids of one fp8 pair predate the
    # fp8-query one), then an engine's fp8 query over it where declared
    fp8.sort(key=lambda pair: pair[0] is DType.FP8_E4M3)
    first = declared_variant(caps, replace(base, q_dtype=fp8[0][0], kv_dtype=fp8[0][1]),
                             device, heads) or base
    out = [first]
    for q, kv in fp8[1:]:
        if q is DType.FP8_E4M3:
            variant = declared_variant(caps, replace(base, q_dtype=q, kv_dtype=kv), device,
                                       heads)
            if variant is not None and variant != first:
                out.append(variant)
            break
    return out


def is_refused(caps: Capabilities, combo: Combo, **fields: object) -> bool:
    """Whether the declaration rejects ``combo`` (with the given fields) for its method."""
    return bool(caps.check_request(combo.method, combo.phase, **fields))  # type: ignore[arg-type]


def capture_methods(caps: Capabilities, entry: GraphModeSupport) -> list[ForwardMethod]:
    """The forward methods that can run under ``entry``'s capture mode."""
    declared = caps.methods(entry.phase)
    if entry.pinned_method is not None:
        return [entry.pinned_method] if entry.pinned_method in declared else []
    if entry.phase is Phase.DECODE:
        return [m for m in declared if m is ForwardMethod.MLA]
    return [m for m in declared if m is not ForwardMethod.MHA_CHUNKED_KV]


def declared_variant(caps: Capabilities, combo: Combo, device: str,
                     heads: Sequence[int] | None) -> Combo | None:
    """``combo`` if the declaration accepts it, else the base configuration of the
    kernel that serves its dtypes (a kernel may take other head counts or page
    sizes than the base's, e.g. an fp8-pool kernel proven for fewer head counts)."""
    if not is_refused(caps, combo, head_dims=combo.head_dims, q_dtype=combo.q_dtype,
                      kv_dtype=combo.kv_dtype, page_size=combo.page_size,
                      num_heads=combo.num_heads):
        return combo
    for k in caps.kernels_for(combo.method, combo.phase):
        if combo.q_dtype in k.q_dtypes and combo.kv_dtype in k.kv_dtypes:
            for candidate in combos_of(caps, k, combo.phase, device, False, heads):
                if (candidate.q_dtype, candidate.kv_dtype) == (combo.q_dtype, combo.kv_dtype):
                    return candidate
    return None


def pairs_for(caps: Capabilities, method: ForwardMethod,
               phase: Phase) -> list[tuple[DType, DType]]:
    out: list[tuple[DType, DType]] = []
    for k in caps.kernels_for(method, phase):
        for pair in dtype_pairs(k):
            if pair not in out:
                out.append(pair)
    return out


# ---------------------------------------------------------------------------
# where checks expand: the declaration, its refusal sites, its capture sites
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Expansion:
    """One :func:`expand_claims` call: the declaration and the run's settings, with the
    shared helpers a check's expansion uses bound to them."""

    caps: Capabilities
    device: str
    exhaustive: bool = False
    heads: tuple[int, ...] | None = None

    @property
    def backend(self) -> str:
        return self.caps.backend

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def base_combo(self, method: ForwardMethod, phase: Phase) -> Combo | None:
        """:func:`base_combo` of ``method`` in ``phase``."""
        return base_combo(self.caps, method, phase, self.device, self.heads)

    def combos(self, kernel: KernelConstraints, phase: Phase, *,
               exhaustive: bool | None = None) -> list[Combo]:
        """:func:`combos_of` one kernel (the run's ``exhaustive`` unless given)."""
        return combos_of(self.caps, kernel, phase, self.device,
                         self.exhaustive if exhaustive is None else exhaustive, self.heads)

    def head_counts(self, kernel: KernelConstraints) -> list[int]:
        return claimed_head_counts(kernel, self.device, self.heads)

    def dtype_variants(self, base: Combo, method: ForwardMethod, phase: Phase) -> list[Combo]:
        """:func:`dtype_variants` of ``base``."""
        return dtype_variants(self.caps, base, method, phase, self.device, self.heads)

    def multi_layer_combos(self, method: ForwardMethod, phase: Phase) -> list[Combo]:
        return multi_layer_combos(self.caps, method, phase, self.device, self.heads)

    def refused(self, combo: Combo, **fields: object) -> bool:
        """Whether the declaration rejects ``combo`` with ``fields`` changed."""
        return is_refused(self.caps, combo, **fields)


@dataclass(frozen=True)
class RefusalSite:
    """One (phase, method) the declaration serves, with its base configuration; or, with
    ``method`` None, the phase as a whole (``methods``: the ones it declares, ``base``
    the first one's base configuration)."""

    phase: Phase
    method: ForwardMethod | None
    base: Combo | None
    methods: tuple[ForwardMethod, ...]


@dataclass(frozen=True)
class CaptureSite:
    """One declared (phase, graph mode) entry, one method that runs under it at its base
    configuration, one forward mode (None: the phase's plain one) and its draft tokens."""

    entry: GraphModeSupport
    method: ForwardMethod
    base: Combo
    forward_mode: ForwardMode | None = None
    query_len: int | None = None

    @property
    def phase(self) -> Phase:
        return self.entry.phase

    @property
    def mode(self) -> GraphMode:
        return self.entry.mode

    @property
    def support(self) -> CaptureSupport:
        return self.entry.capture

    @property
    def where(self) -> str:
        """``decode under full`` (and the forward mode's batches), for statements."""
        where = f"{self.phase} under {self.mode}"
        if self.forward_mode is not None:
            where += f", {self.forward_mode} batches of {self.query_len} tokens per sequence"
        return where

    @property
    def how(self) -> str:
        sup = self.support
        return "natively" if sup.is_native else f"through its fallback to {sup.fallback_to}"

    @property
    def replay(self) -> tuple[str, ...]:
        """The batches one captured graph of this site replays."""
        return replay_specs(self.phase, self.forward_mode)

    def fields(self) -> dict[str, object]:
        """The :class:`Claim` fields every claim of this site copies from it."""
        sup = self.support
        return {"graph_mode": self.mode, "capture": sup.kind, "fallback_to": sup.fallback_to,
                "pinned_method": self.entry.pinned_method, "split_kv": self.entry.split_kv,
                "forward_mode": self.forward_mode, "query_len": self.query_len}


def refusal_sites(x: Expansion) -> list[RefusalSite]:
    """Per phase: each declared method with a base configuration, then the phase."""
    sites: list[RefusalSite] = []
    for phase in (Phase.DECODE, Phase.PREFILL):
        methods = tuple(x.caps.methods(phase))
        for method in methods:
            base = x.base_combo(method, phase)
            if base is not None:
                sites.append(RefusalSite(phase, method, base, methods))
        if methods:
            sites.append(RefusalSite(phase, None, x.base_combo(methods[0], phase), methods))
    return sites


def capture_sites(x: Expansion) -> list[CaptureSite]:
    """Per declared capture entry of a served phase: an UNSUPPORTED one once (at the
    base configuration of a method it would run), else each method that runs under it,
    each with the phase's plain forward mode, then (MLA outside TC_PIECEWISE) each
    speculative forward mode the entry serves at its declared draft tokens."""
    caps = x.caps
    sites: list[CaptureSite] = []
    for entry in caps.graph_modes:
        if entry.mode is GraphMode.DISABLED or not caps.serves(entry.phase):
            continue
        methods = capture_methods(caps, entry)
        if entry.capture.is_unsupported:
            method = methods[0] if methods else caps.methods(entry.phase)[0]
            base = x.base_combo(method, entry.phase)
            if base is not None:
                sites.append(CaptureSite(entry, method, base))
            continue
        for method in methods:
            base = x.base_combo(method, entry.phase)
            if base is None:
                continue
            sites.append(CaptureSite(entry, method, base))
            if entry.mode is GraphMode.TC_PIECEWISE or method is not ForwardMethod.MLA:
                continue
            for served in entry.forward_modes:
                if served.mode in SPECULATIVE_MODES and served.max_query_len is not None:
                    sites.append(CaptureSite(entry, method, base, served.mode,
                                             served.max_query_len))
    return sites


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
    from .checks import CHECKS  # the check classes import this module

    x = Expansion(caps, device, exhaustive, tuple(int(h) for h in heads) if heads else heads)
    checks = list(CHECKS.values())
    claims: list[Claim] = []
    for check in checks:
        claims += check.declaration_claims(x)
    for refusal in refusal_sites(x):
        for check in checks:
            claims += check.refusal_claims(x, refusal)
    for capture in capture_sites(x):
        for check in checks:
            if check.for_unsupported is capture.support.is_unsupported:
                claims += check.capture_claims(x, capture)
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
