"""The capability model: what a backend *declares*, as immutable pure data.

Nothing here imports torch or a kernel library: declarations are read at
startup by the graph policy and the CLI, on machines that may have neither.

Vocabulary (see docs/concepts.md):

* :class:`Phase` - graph decisions are made per phase (decode, prefill).
* :class:`GraphMode` - how a phase is captured (DISABLED, FULL, BREAKABLE,
  TC_PIECEWISE).  Decode uses FULL or DISABLED; prefill uses BREAKABLE,
  TC_PIECEWISE or DISABLED.
* :class:`ForwardMethod` - which attention form runs: absorbed MLA over the
  latent cache, or the non-absorbed MHA "companion".
* :class:`CaptureSupport` - per (phase, graph mode): NATIVE, FALLBACK(to,
  cost) or UNSUPPORTED(reason).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .platform import Platform, Vendor
from .strenum import StrEnum

__all__ = [
    "CAPTURE_GRAPH_MODES",
    "METHOD_HEAD_DIMS",
    "VALID_GRAPH_MODES",
    "Capabilities",
    "CaptureBytesFn",
    "CaptureMemory",
    "CaptureShape",
    "CaptureSupport",
    "Cost",
    "DType",
    "ForwardMethod",
    "ForwardMode",
    "GraphMode",
    "GraphModeSupport",
    "KernelConstraints",
    "Phase",
    "Requirement",
    "SplitKV",
    "SupportKind",
]


class Phase(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"


class ForwardMode(StrEnum):
    """What a batch is."""

    DECODE = "decode"
    EXTEND = "extend"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"


class GraphMode(StrEnum):
    DISABLED = "disabled"
    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"


class ForwardMethod(StrEnum):
    """Which attention form runs.

    MLA: absorbed, q/k 576 (512 latent + 64 rope), v 512, over the latent cache.
    MHA: non-absorbed ragged "companion", q/k 192, v 128.
    MHA_CHUNKED_KV: MHA over the prefix in chunks (long prefixes).
    """

    MLA = "mla"
    MHA = "mha"
    MHA_CHUNKED_KV = "mha_chunked_kv"


class DType(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"
    FP32 = "fp32"


class Cost(StrEnum):
    """Cost of a capture fallback.

    HIGH means the fallback does work proportional to the whole KV pool
    (e.g. converting an FP8 pool), not to the batch.
    """

    NONE = "none"
    LOW = "low"
    HIGH = "high"


class SupportKind(StrEnum):
    NATIVE = "native"
    FALLBACK = "fallback"
    UNSUPPORTED = "unsupported"


class SplitKV(StrEnum):
    """What happens to split-KV parallelism under capture.

    DYNAMIC: a static grid sized by a maximum split count, with per-sequence
    split counts computed on the device, so replays with other lengths stay
    correct and keep the parallelism.
    HOST_PLANNED: split counts are re-planned on the host before every replay
    (``plan()`` outside the graph, into buffers the graph reads).
    SINGLE: forced to one split under capture (always correct, slower on long KV).
    NONE: no split-KV is claimed.
    """

    DYNAMIC = "dynamic"
    HOST_PLANNED = "host_planned"
    SINGLE = "single"
    NONE = "none"


#: Graph modes that involve capture (everything except DISABLED).
CAPTURE_GRAPH_MODES: tuple[GraphMode, ...] = (
    GraphMode.FULL,
    GraphMode.BREAKABLE,
    GraphMode.TC_PIECEWISE,
)

#: Which capture modes exist per phase.  DISABLED (eager) is always possible.
VALID_GRAPH_MODES: Mapping[Phase, tuple[GraphMode, ...]] = {
    Phase.DECODE: (GraphMode.FULL,),
    Phase.PREFILL: (GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE),
}

#: The (head_dim_qk, head_dim_v) each forward method uses for DeepSeek-style MLA.
METHOD_HEAD_DIMS: Mapping[ForwardMethod, tuple[int, int]] = {
    ForwardMethod.MLA: (576, 512),
    ForwardMethod.MHA: (192, 128),
    ForwardMethod.MHA_CHUNKED_KV: (192, 128),
}


@dataclass(frozen=True)
class CaptureSupport:
    """How a backend behaves under one (phase, graph mode).

    Build with :meth:`native`, :meth:`fallback` or :meth:`unsupported`.
    A fallback's cost may depend on the KV-pool dtype (``costs_by_kv_dtype``),
    because e.g. an FP8 pool must be converted in full by a bf16-only fallback.
    """

    kind: SupportKind
    fallback_to: str | None = None
    cost: Cost = Cost.NONE
    costs_by_kv_dtype: tuple[tuple[DType, Cost], ...] = ()
    reason: str = ""

    @classmethod
    def native(cls, reason: str = "") -> CaptureSupport:
        return cls(SupportKind.NATIVE, reason=reason)

    @classmethod
    def fallback(
        cls,
        to: str,
        cost: Cost,
        reason: str,
        costs_by_kv_dtype: Mapping[DType, Cost] | None = None,
    ) -> CaptureSupport:
        pairs = tuple(sorted((costs_by_kv_dtype or {}).items(), key=lambda kv: kv[0].value))
        return cls(SupportKind.FALLBACK, fallback_to=to, cost=cost, costs_by_kv_dtype=pairs,
                   reason=reason)

    @classmethod
    def unsupported(cls, reason: str) -> CaptureSupport:
        return cls(SupportKind.UNSUPPORTED, reason=reason)

    @property
    def is_native(self) -> bool:
        return self.kind is SupportKind.NATIVE

    @property
    def is_fallback(self) -> bool:
        return self.kind is SupportKind.FALLBACK

    @property
    def is_unsupported(self) -> bool:
        return self.kind is SupportKind.UNSUPPORTED

    def cost_for(self, kv_dtype: DType | str | None) -> Cost:
        """The fallback's cost for a KV pool of ``kv_dtype`` (NONE when native)."""
        if not self.is_fallback:
            return Cost.NONE
        if kv_dtype is not None:
            wanted = DType.parse(kv_dtype)
            for dtype, cost in self.costs_by_kv_dtype:
                if dtype is wanted:
                    return cost
        return self.cost

    def describe(self) -> str:
        if self.is_native:
            return "native"
        if self.is_fallback:
            extra = "".join(f", {c} for {d}" for d, c in self.costs_by_kv_dtype)
            return f"fallback->{self.fallback_to} (cost {self.cost}{extra})"
        return f"unsupported: {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "fallback_to": self.fallback_to,
            "cost": self.cost.value,
            "costs_by_kv_dtype": {d.value: c.value for d, c in self.costs_by_kv_dtype},
            "reason": self.reason,
        }


@dataclass(frozen=True)
class CaptureShape:
    """The bounds one backend instance captures graphs for: what capture memory depends on.

    The graph policy builds one from the model and the engine's buckets to
    estimate; the runtime builds one in ``init_cuda_graph_state`` to allocate.
    Both then ask the same :class:`CaptureMemory`, so the estimate and the
    allocation come from one formula.

    Parameters
    ----------
    max_batch_size
        Request slots of the largest captured batch.
    max_num_tokens
        Query rows of the largest captured batch (decode: equal to
        ``max_batch_size``; speculative verify: batch x draft tokens).
    max_seq_len
        Longest sequence (prefix + new tokens) a replay may carry.
    num_heads
        Query heads on this rank.
    page_size
        Tokens per KV-pool page.
    kv_dtype
        dtype of the KV pool.
    kv_pool_bytes
        Size of the engine's whole KV pool; a fallback that converts or copies
        the pool inside the graph (trtllm_mla's FP8 path) scales with it.  0 when
        the engine did not say.
    """

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    num_heads: int
    page_size: int = 1
    kv_dtype: DType = DType.BF16
    kv_pool_bytes: int = 0


#: A pure function from a declaration module: bytes a backend allocates for graph
#: capture at a :class:`CaptureShape` (no torch, no device: arithmetic on the shape).
CaptureBytesFn = Callable[[CaptureShape], int]


@dataclass(frozen=True)
class CaptureMemory:
    """Device memory a backend allocates for graph capture, as a formula of the shape.

    ``fixed_bytes`` once per backend instance (workspaces), plus
    ``per_batch_slot_bytes`` for each request slot of the largest captured
    batch, plus ``bytes_fn(shape)`` when a backend's buffers depend on more
    than the batch (heads, tokens, sequence length, the pool).  A backend's
    runtime must size its graph buffers from the same constants or function
    (see docs/decisions.md, "capture memory has one formula"); the
    conformance suite measures the allocation against :meth:`estimate`.
    """

    fixed_bytes: int = 0
    per_batch_slot_bytes: int = 0
    bytes_fn: CaptureBytesFn | None = field(default=None, compare=False)
    #: How ``bytes_fn`` computes, in words (``attnreg backends --json``, docs).
    formula: str = ""

    def estimate(self, shape: CaptureShape) -> int:
        """Bytes allocated for capture at ``shape``."""
        total = self.fixed_bytes + self.per_batch_slot_bytes * shape.max_batch_size
        if self.bytes_fn is not None:
            total += int(self.bytes_fn(shape))
        return total

    def to_dict(self) -> dict[str, object]:
        return {"fixed_bytes": self.fixed_bytes,
                "per_batch_slot_bytes": self.per_batch_slot_bytes,
                "formula": self.formula or None}


@dataclass(frozen=True)
class GraphModeSupport:
    """A backend's declaration for one (phase, graph mode).

    ``pinned_method`` is the forward method the backend forces under this mode
    (None = no pinning: the MHA companion may be captured).  ``split_kv`` says
    whether split-KV parallelism survives capture.
    """

    phase: Phase
    mode: GraphMode
    capture: CaptureSupport
    pinned_method: ForwardMethod | None = None
    split_kv: SplitKV = SplitKV.NONE
    capture_memory: CaptureMemory = field(default_factory=CaptureMemory)

    def to_dict(self) -> dict[str, object]:
        return {
            "phase": self.phase.value,
            "mode": self.mode.value,
            "capture": self.capture.to_dict(),
            "pinned_method": self.pinned_method.value if self.pinned_method else None,
            "split_kv": self.split_kv.value,
            "capture_memory": self.capture_memory.to_dict(),
        }


@dataclass(frozen=True)
class KernelConstraints:
    """What one kernel of a backend accepts, for one forward method.

    ``page_sizes`` is empty for kernels that read no paged cache (ragged MHA
    over materialised K/V).  ``head_counts`` empty means any count from 1 to
    ``max_heads``.

    ``q_compute_dtype`` is set when the kernel takes q in one of ``q_dtypes``
    but computes with it rounded to another dtype: FlashMLA's FP8 decode
    quantises a bf16 q to fp8 e4m3 because its kernel multiplies fp8 by fp8.
    The rounding is attnreg's convention for it: one power-of-two scale per
    batch, the smallest with ``max|q| / scale <= 448`` over the batch's real
    query rows, then one round-to-nearest to fp8.  The conformance oracle
    rounds q the same way, so the tolerance measures the kernel and not the
    quantisation it declared.
    """

    method: ForwardMethod
    phases: frozenset[Phase]
    head_dims: tuple[tuple[int, int], ...]
    q_dtypes: frozenset[DType]
    kv_dtypes: frozenset[DType]
    page_sizes: tuple[int, ...] = ()
    max_heads: int = 128
    head_counts: tuple[int, ...] = ()
    causal: bool = True
    kernel: str = ""
    split_kv: SplitKV = SplitKV.NONE
    q_compute_dtype: DType | None = None

    def accepts_heads(self, num_heads: int) -> bool:
        if self.head_counts:
            return num_heads in self.head_counts
        return 1 <= num_heads <= self.max_heads

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method.value,
            "phases": sorted(p.value for p in self.phases),
            "head_dims": [list(p) for p in self.head_dims],
            "q_dtypes": sorted(d.value for d in self.q_dtypes),
            "kv_dtypes": sorted(d.value for d in self.kv_dtypes),
            "page_sizes": list(self.page_sizes),
            "max_heads": self.max_heads,
            "head_counts": list(self.head_counts),
            "causal": self.causal,
            "kernel": self.kernel,
            "split_kv": self.split_kv.value,
            "q_compute_dtype": self.q_compute_dtype.value if self.q_compute_dtype else None,
        }


@dataclass(frozen=True)
class Requirement:
    """An optional dependency: import name, distribution, and the extra that brings it.

    A plugin's own dependency has no attnreg extra: leave ``extra`` empty and
    the install hint names the distribution.
    """

    import_name: str
    distribution: str
    extra: str
    min_version: str | None = None

    def install_hint(self) -> str:
        # An empty extra marks a plugin's own dependency, which no attnreg extra brings.
        if not self.extra:
            return f"install {self.distribution}"
        return f"install attnreg[{self.extra}]"


@dataclass(frozen=True)
class Capabilities:
    """A backend's whole declaration on one platform.

    Produced by the backend's capability function, a pure function of
    ``(platform, installed library versions)``.  ``kernels`` lists what runs on
    this platform; ``unavailable_kernels`` lists (kernel, reason) for what the
    backend has elsewhere but not here, so reports can say why.
    ``platform_reason`` is non-empty when nothing of the backend runs here.
    """

    backend: str
    platform: Platform
    vendors: frozenset[Vendor]
    kernels: tuple[KernelConstraints, ...]
    graph_modes: tuple[GraphModeSupport, ...]
    requires: tuple[Requirement, ...] = ()
    unavailable_kernels: tuple[tuple[str, str], ...] = ()
    platform_reason: str = ""
    priority: int = 0
    notes: tuple[str, ...] = ()

    # -- queries -----------------------------------------------------------
    def graph_support(self, phase: Phase | str, mode: GraphMode | str) -> GraphModeSupport:
        """The declaration for (phase, mode).  DISABLED is always native (eager)."""
        phase = Phase.parse(phase)
        mode = GraphMode.parse(mode)
        if mode is GraphMode.DISABLED:
            return GraphModeSupport(phase, mode, CaptureSupport.native("eager"))
        for entry in self.graph_modes:
            if entry.phase is phase and entry.mode is mode:
                return entry
        return GraphModeSupport(
            phase, mode, CaptureSupport.unsupported(f"{self.backend} declares nothing for "
                                                    f"{phase} under {mode}"))

    def kernels_for(self, method: ForwardMethod | str,
                    phase: Phase | str | None = None) -> tuple[KernelConstraints, ...]:
        method = ForwardMethod.parse(method)
        ph = Phase.parse(phase) if phase is not None else None
        return tuple(k for k in self.kernels
                     if k.method is method and (ph is None or ph in k.phases))

    def methods(self, phase: Phase | str | None = None) -> tuple[ForwardMethod, ...]:
        ph = Phase.parse(phase) if phase is not None else None
        seen: list[ForwardMethod] = []
        for k in self.kernels:
            if (ph is None or ph in k.phases) and k.method not in seen:
                seen.append(k.method)
        return tuple(seen)

    def serves(self, phase: Phase | str) -> bool:
        return bool(self.methods(phase))

    def check_request(
        self,
        method: ForwardMethod | str,
        phase: Phase | str,
        *,
        head_dims: tuple[int, int] | None = None,
        q_dtype: DType | str | None = None,
        kv_dtype: DType | str | None = None,
        page_size: int | None = None,
        num_heads: int | None = None,
    ) -> list[str]:
        """Reasons a request falls outside every kernel's declaration (empty = accepted)."""
        method = ForwardMethod.parse(method)
        phase = Phase.parse(phase)
        candidates = self.kernels_for(method, phase)
        if not candidates:
            have = ", ".join(m.value for m in self.methods(phase)) or "none"
            why = f"{self.backend} has no {method} kernel for {phase} on {self.platform}"
            for name, reason in self.unavailable_kernels:
                why += f"; {name}: {reason}"
            return [f"{why} (methods it has here: {have})"]
        best: list[str] | None = None
        for k in candidates:
            reasons: list[str] = []
            if head_dims is not None and tuple(head_dims) not in k.head_dims:
                reasons.append(f"head dims {tuple(head_dims)} not in {list(k.head_dims)}")
            if q_dtype is not None and DType.parse(q_dtype) not in k.q_dtypes:
                reasons.append(f"q dtype {DType.parse(q_dtype)} not in "
                               f"{sorted(d.value for d in k.q_dtypes)}")
            if kv_dtype is not None and DType.parse(kv_dtype) not in k.kv_dtypes:
                reasons.append(f"kv dtype {DType.parse(kv_dtype)} not in "
                               f"{sorted(d.value for d in k.kv_dtypes)}")
            if page_size is not None and k.page_sizes and page_size not in k.page_sizes:
                reasons.append(f"page size {page_size} not in {list(k.page_sizes)}")
            if num_heads is not None and not k.accepts_heads(num_heads):
                allowed = list(k.head_counts) if k.head_counts else f"1..{k.max_heads}"
                reasons.append(f"{num_heads} heads not in {allowed}")
            if not reasons:
                return []
            if best is None or len(reasons) < len(best):
                best = [f"{self.backend} {method} ({k.kernel or 'kernel'}): {r}" for r in reasons]
        return best or []

    def to_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "platform": str(self.platform),
            "vendors": sorted(v.value for v in self.vendors),
            "priority": self.priority,
            "platform_reason": self.platform_reason,
            "requires": [
                {"import_name": r.import_name, "distribution": r.distribution,
                 "extra": r.extra, "min_version": r.min_version}
                for r in self.requires
            ],
            "kernels": [k.to_dict() for k in self.kernels],
            "unavailable_kernels": [{"kernel": n, "reason": r}
                                    for n, r in self.unavailable_kernels],
            "graph_modes": [g.to_dict() for g in self.graph_modes],
            "notes": list(self.notes),
        }

