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

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .deprecation import warn_deprecated
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
    "ForwardModeSupport",
    "GraphMode",
    "GraphModeSupport",
    "PHASE_FORWARD_MODES",
    "KernelConstraints",
    "Phase",
    "Requirement",
    "SPECULATIVE_MODES",
    "SPARSE_INDEX_DTYPE",
    "SPARSE_INVALID_INDEX",
    "SparseKVFormat",
    "SparseKernel",
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


#: The speculative-decoding forward modes: decode-phase batches with several new
#: tokens per sequence (target verify: the draft tokens of every sequence; draft
#: extend: its accepted ones), run with absorbed MLA.  The one definition the
#: policy, the runtime and the conformance suite import.
SPECULATIVE_MODES: tuple[ForwardMode, ...] = (ForwardMode.TARGET_VERIFY,
                                              ForwardMode.DRAFT_EXTEND)


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

#: The forward modes a phase's graphs may serve.  Speculative batches belong to
#: the decode phase: engines capture target-verify and draft-extend batches with
#: their decode graph runners (sglang), as a uniform batch of a few query tokens
#: per sequence (vLLM's ``UNIFORM_BATCH``).
PHASE_FORWARD_MODES: Mapping[Phase, tuple[ForwardMode, ...]] = {
    Phase.DECODE: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND),
    Phase.PREFILL: (ForwardMode.EXTEND,),
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
    num_graphs
        Graphs captured within these bounds (one per bucket); a backend that
        allocates per captured graph scales with it.  0: unknown, assume one
        per batch size up to ``max_batch_size`` (the upper bound; see :attr:`graphs`).
    num_sms
        Multiprocessors of the device; a backend whose split-KV workspace
        fills one wave of them scales with it.  0: unknown (startup queries run
        without torch), each such backend assumes its declared upper bound.
    q_dtype
        dtype of the query the engine hands (absorbed MLA): an fp8 one comes with
        its scale, so a backend that would round a 16-bit q inside the graph
        allocates nothing for it.  Default bf16 (plugin API 1.2).
    """

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    num_heads: int
    page_size: int = 1
    kv_dtype: DType = DType.BF16
    kv_pool_bytes: int = 0
    num_graphs: int = 0
    num_sms: int = 0
    q_dtype: DType = DType.BF16

    @property
    def graphs(self) -> int:
        """``num_graphs``, or ``max_batch_size`` (one graph per batch size) when unknown."""
        return self.num_graphs or self.max_batch_size

    @property
    def max_pages(self) -> int:
        """Pages of the longest sequence: ``ceil(max_seq_len / page_size)``."""
        return -(-self.max_seq_len // max(1, self.page_size))


#: A pure function from a declaration module: bytes a backend allocates for graph
#: capture at a :class:`CaptureShape` (no torch, no device: arithmetic on the shape).
CaptureBytesFn = Callable[[CaptureShape], int]


@dataclass(frozen=True)
class CaptureMemory:
    """Device memory a backend allocates for graph capture, as a formula of the shape.

    Capture memory is what exists because graphs are captured: the buffers
    ``init_cuda_graph_state`` and ``init_forward_metadata_capture`` allocate
    and what the captured graphs keep in their memory pool (tensors created
    inside the graph, a pool converted inside the graph).  Workspaces a
    backend allocates when it is created serve eager runs too and are not
    counted; neither are the runtime's own index buffers (lengths, page table).

    ``fixed_bytes`` once per backend instance, plus ``per_batch_slot_bytes``
    for each request slot of the largest captured batch, plus
    ``bytes_fn(shape)`` when a backend's buffers depend on more than the batch
    (heads, tokens, sequence length, captured graphs, the pool).  A backend's
    runtime sizes its graph buffers from the same constants or function (see
    docs/decisions.md, "capture memory has one formula"); the conformance
    suite's ``capture_memory`` claim measures the allocation against
    :meth:`estimate`.
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
class ForwardModeSupport:
    """One forward mode a backend serves, eagerly or in a captured graph.

    ``max_query_len`` is the largest number of query (new) tokens per
    sequence served: 1 for DECODE, the draft tokens for TARGET_VERIFY /
    DRAFT_EXTEND (a verify batch carries that many tokens per sequence,
    causal among themselves, attending the whole prefix), None for no bound
    (EXTEND: ragged prefill).  ``uniform`` says every sequence of a batch
    must have the same query length (vLLM's ``UNIFORM_BATCH``); when False,
    shorter sequences are served too (a draft-extend batch of accepted
    lengths 1..max_query_len).
    """

    mode: ForwardMode
    max_query_len: int | None = 1
    uniform: bool = True

    def serves_query_len(self, query_len: int) -> bool:
        """Whether a sequence of ``query_len`` new tokens is served."""
        return self.max_query_len is None or 1 <= query_len <= self.max_query_len

    def describe(self) -> str:
        if self.max_query_len is None:
            return f"{self.mode} (any length)"
        if self.max_query_len == 1:
            return f"{self.mode} (1 token per sequence)"
        shape = "uniform" if self.uniform else "ragged"
        return f"{self.mode} (<= {self.max_query_len} tokens per sequence, {shape})"

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode.value, "max_query_len": self.max_query_len,
                "uniform": self.uniform}


#: What a phase's graphs and eager path serve when a declaration does not say:
#: decode one token per sequence, prefill ragged extend.  Speculative forward
#: modes are served only where a declaration lists them.
DEFAULT_FORWARD_MODES: Mapping[Phase, tuple[ForwardModeSupport, ...]] = {
    Phase.DECODE: (ForwardModeSupport(ForwardMode.DECODE, 1, True),),
    Phase.PREFILL: (ForwardModeSupport(ForwardMode.EXTEND, None, False),),
}


@dataclass(frozen=True)
class GraphModeSupport:
    """A backend's declaration for one (phase, graph mode).

    ``pinned_method`` is the forward method the backend forces under this mode
    (None = no pinning: the MHA companion may be captured).  ``split_kv`` says
    whether split-KV parallelism survives capture.  ``forward_modes`` lists
    the forward modes a graph captured under this mode serves, each with the
    largest query tokens per sequence; empty means the phase's plain mode
    (decode: DECODE, one token; prefill: EXTEND), which keeps declarations
    written before speculative decoding truthful.
    """

    phase: Phase
    mode: GraphMode
    capture: CaptureSupport
    pinned_method: ForwardMethod | None = None
    split_kv: SplitKV = SplitKV.NONE
    capture_memory: CaptureMemory = field(default_factory=CaptureMemory)
    forward_modes: tuple[ForwardModeSupport, ...] = ()

    def __post_init__(self) -> None:
        if not self.forward_modes:
            object.__setattr__(self, "forward_modes", DEFAULT_FORWARD_MODES[self.phase])

    def serving(self, mode: ForwardMode | str) -> ForwardModeSupport | None:
        """The entry for forward mode ``mode``, or None when these graphs do not serve it."""
        wanted = ForwardMode.parse(mode)
        return next((f for f in self.forward_modes if f.mode is wanted), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "phase": self.phase.value,
            "mode": self.mode.value,
            "capture": self.capture.to_dict(),
            "pinned_method": self.pinned_method.value if self.pinned_method else None,
            "split_kv": self.split_kv.value,
            "capture_memory": self.capture_memory.to_dict(),
            "forward_modes": [f.to_dict() for f in self.forward_modes],
        }


#: How a kernel that rounds q (``KernelConstraints.q_compute_dtype``) scales it: one
#: power-of-two scale per batch, or one per query row (token x head).
Q_COMPUTE_SCALES = ("batch", "row")


@dataclass(frozen=True)
class KernelConstraints:
    """What one kernel of a backend accepts, for one forward method.

    ``page_sizes`` is empty for kernels that read no paged cache (ragged MHA
    over materialised K/V).  ``head_counts`` empty means any count from
    ``min_heads`` (default 1) to ``max_heads``: two entries of one kernel that
    computes differently above some head count (another tile, another
    ``q_compute_dtype``) split the range there.  ``max_seq_len`` is the longest sequence (cached + new
    tokens) the kernel serves, None for no declared limit.  ``lse`` says the
    kernel returns the float32 log-sum-exp per (token, head) beside the
    output when asked (``forward_*(..., return_lse=True)``; natural log, see
    ``attnreg.runtime.lse``); a request for it elsewhere is refused.

    ``q_dtypes`` may hold ``fp8_e4m3`` for absorbed MLA: the kernel takes an
    engine's own fp8 query as its input, with one float32 dequantisation scale
    (``forward_*(q, q_scale=)``, real q = q * q_scale), and writes a bf16 output.

    ``q_compute_dtype`` is set when the kernel takes q in one of ``q_dtypes``
    but computes with it rounded to another dtype, e.g. an FP8-KV decode
    kernel that multiplies fp8 by fp8 and so quantises a bf16 q to fp8 e4m3.
    The rounding is attnreg's convention for it: one power-of-two scale per
    batch, the smallest with ``max|q| / scale <= 448`` over the batch's real
    query rows, then one round-to-nearest to fp8.  ``q_compute_scale`` "row"
    declares one such scale per query row instead (per token and head, over
    that row's 576 values), as a kernel that rounds q itself on chip does.
    The conformance oracle rounds q the same way, so the tolerance measures
    the kernel and not the quantisation it declared; the output is held to
    the compute dtype's tolerance (such a kernel may also round its softmax
    probabilities to it), not the query dtype's.
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
    max_seq_len: int | None = None
    q_compute_dtype: DType | None = None
    lse: bool = False
    q_compute_scale: str = "batch"
    min_heads: int = 1

    def __post_init__(self) -> None:
        if self.q_compute_scale not in Q_COMPUTE_SCALES:
            raise ValueError(f"KernelConstraints.q_compute_scale: expected one of "
                             f"{', '.join(Q_COMPUTE_SCALES)}, got {self.q_compute_scale!r}")

    def accepts_heads(self, num_heads: int) -> bool:
        if self.head_counts:
            return num_heads in self.head_counts
        return max(1, self.min_heads) <= num_heads <= self.max_heads

    @property
    def head_range(self) -> str:
        """The head counts it takes, as an error message names them."""
        if self.head_counts:
            return str(list(self.head_counts))
        return f"{max(1, self.min_heads)}..{self.max_heads}"

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method.value,
            "phases": sorted(p.value for p in self.phases),
            "head_dims": [list(p) for p in self.head_dims],
            "q_dtypes": sorted(d.value for d in self.q_dtypes),
            "kv_dtypes": sorted(d.value for d in self.kv_dtypes),
            "page_sizes": list(self.page_sizes),
            "min_heads": self.min_heads,
            "max_heads": self.max_heads,
            "head_counts": list(self.head_counts),
            "causal": self.causal,
            "kernel": self.kernel,
            "split_kv": self.split_kv.value,
            "max_seq_len": self.max_seq_len,
            "q_compute_dtype": self.q_compute_dtype.value if self.q_compute_dtype else None,
            "q_compute_scale": self.q_compute_scale if self.q_compute_dtype else None,
            "lse": self.lse,
        }


class SparseKVFormat(StrEnum):
    """The KV row format a sparse (DSA) MLA kernel reads, one row per token.

    BF16: the pool's own row, 576 bf16 values (512 latent + 64 rope), 1152 bytes.
    FP8_DS_MLA: DeepSeek-V3.2's FP8 row as FlashMLA documents it (its
    ``flash_mla_with_kvcache`` sparse decode, ``is_fp8_kvcache=True``): 656
    bytes, 512 float8 e4m3 latent values, 4 float32 scales (one per 128
    latent values, dequantised value = e4m3 x scale), then 64 bf16 rope values.
    """

    BF16 = "bf16"
    FP8_DS_MLA = "fp8_ds_mla"

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row."""
        return _SPARSE_ROW_BYTES[self]

    @property
    def dtype(self) -> DType:
        """The KV dtype an engine names for a pool of these rows."""
        return DType.BF16 if self is SparseKVFormat.BF16 else DType.FP8_E4M3


_SPARSE_ROW_BYTES = {SparseKVFormat.BF16: 576 * 2,
                     SparseKVFormat.FP8_DS_MLA: 512 + 4 * 4 + 64 * 2}

#: The dtype of top-k index tensors (sglang's NSA indexer and FlashMLA both use int32).
SPARSE_INDEX_DTYPE = "int32"
#: The one invalid index value: an entry equal to it is no key (FlashMLA: exactly -1).
SPARSE_INVALID_INDEX = -1


@dataclass(frozen=True)
class SparseKernel:
    """A sparse (DSA) absorbed-MLA kernel: attention restricted to indexed tokens.

    Sparse MLA is absorbed MLA (q/k 576, v 512, over the paged latent cache)
    in which each query token attends only the pool slots listed in its row
    of a top-k index tensor ``[query tokens, top_k]`` (dtype
    :data:`SPARSE_INDEX_DTYPE`; slot = page * page_size + offset; an entry
    equal to :data:`SPARSE_INVALID_INDEX` is no key; a slot listed twice
    counts twice).  No causal mask is applied: the indexer chose the tokens.
    It is declared in :attr:`Capabilities.sparse_kernels`, apart from the
    dense kernels, so that a dense request never lands on it and a sparse
    one never lands on a dense kernel (docs/decisions.md, "sparse MLA").

    ``top_k_sizes`` lists the index widths accepted; empty means every
    multiple of ``top_k_multiple`` from it up to ``max_top_k``.
    ``kv_format`` is the row format read (its dtype is the pool's KV dtype).
    """

    phases: frozenset[Phase]
    q_dtypes: frozenset[DType]
    kv_format: SparseKVFormat
    page_sizes: tuple[int, ...]
    max_heads: int = 128
    head_counts: tuple[int, ...] = ()
    top_k_sizes: tuple[int, ...] = ()
    top_k_multiple: int = 1
    max_top_k: int = 2048
    kernel: str = ""
    lse: bool = False

    @property
    def method(self) -> ForwardMethod:
        return ForwardMethod.MLA

    @property
    def kv_dtype(self) -> DType:
        return self.kv_format.dtype

    def accepts_heads(self, num_heads: int) -> bool:
        if self.head_counts:
            return num_heads in self.head_counts
        return 1 <= num_heads <= self.max_heads

    def accepts_top_k(self, top_k: int) -> bool:
        if self.top_k_sizes:
            return top_k in self.top_k_sizes
        step = max(1, self.top_k_multiple)
        return step <= top_k <= self.max_top_k and top_k % step == 0

    def describe_top_k(self) -> str:
        if self.top_k_sizes:
            return str(list(self.top_k_sizes))
        if self.top_k_multiple > 1:
            return f"multiples of {self.top_k_multiple} up to {self.max_top_k}"
        return f"1..{self.max_top_k}"

    def as_dense_constraints(self) -> KernelConstraints:
        """The same kernel as :class:`KernelConstraints` of absorbed MLA (what the dense
        acceptance checks read: dims, dtypes, page sizes, heads)."""
        return KernelConstraints(ForwardMethod.MLA, self.phases, ((576, 512),), self.q_dtypes,
                                 frozenset({self.kv_dtype}), page_sizes=self.page_sizes,
                                 max_heads=self.max_heads, head_counts=self.head_counts,
                                 causal=False, kernel=self.kernel, lse=self.lse)

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method.value,
            "phases": sorted(p.value for p in self.phases),
            "q_dtypes": sorted(d.value for d in self.q_dtypes),
            "kv_format": self.kv_format.value,
            "kv_row_bytes": self.kv_format.row_bytes,
            "kv_dtype": self.kv_dtype.value,
            "page_sizes": list(self.page_sizes),
            "max_heads": self.max_heads,
            "head_counts": list(self.head_counts),
            "index_dtype": SPARSE_INDEX_DTYPE,
            "invalid_index": SPARSE_INVALID_INDEX,
            "top_k_sizes": list(self.top_k_sizes),
            "top_k_multiple": self.top_k_multiple,
            "max_top_k": self.max_top_k,
            "kernel": self.kernel,
            "lse": self.lse,
        }


#: What a ``min_version`` must look like: dotted numbers, optionally a suffix (``2.4``, ``0.6.13``, ``1.0rc1``).
_VERSION_RE = re.compile(r"^\d+(\.\d+)*([.+-]?[0-9A-Za-z]+)*$")


@dataclass(frozen=True)
class Requirement:
    """A library a backend needs at run time; missing, the backend is *unavailable*.

    Declared once per backend, in ``BackendSpec(requires=...)``.

    Parameters
    ----------
    import_name
        The module it provides (``"acme_kernels"``), used when the
        distribution has no metadata (a source checkout on ``PYTHONPATH``).
    distribution
        The installable distribution (``"acme-kernels"``), whose installed
        version decides.
    min_version
        Oldest version that works (``"1.2"``), or None for any.
    extra
        The *attnreg* extra that brings it (``"flashinfer"`` for
        ``attnreg[flashinfer]``); only for attnreg's own backends.  A third
        party leaves it None and the hint names the distribution.
    install
        A custom install hint, when ``pip install <distribution>`` is not how
        it is installed (``"conda install -c acme acme-kernels"``).
    """

    import_name: str
    distribution: str
    min_version: str | None = None
    extra: str | None = None
    install: str | None = None

    def __post_init__(self) -> None:
        if self.min_version is None or _VERSION_RE.match(self.min_version):
            return
        # attnreg 0.1.0's signature was Requirement(import_name, distribution, extra,
        # min_version=None): a name in the third place is that extra, and the fourth
        # (now ``extra``) the version.  Deprecated in 0.2.0, removed in 0.3.0.
        old_extra, old_version = self.min_version, self.extra
        if old_version is not None and not _VERSION_RE.match(old_version):
            raise ValueError(
                f"Requirement({self.import_name!r}, {self.distribution!r}, ...): min_version "
                f"{self.min_version!r} is not a version such as '1.2'; the signature is "
                "Requirement(import_name, distribution, min_version=None, extra=None, "
                "install=None) (attnreg extras go in extra=)")
        object.__setattr__(self, "extra", old_extra)
        object.__setattr__(self, "min_version", old_version)
        new_form = ", ".join([repr(self.import_name), repr(self.distribution)]
                             + ([repr(old_version)] if old_version else [])
                             + [f"extra={old_extra!r}"])
        message = (
            f"Requirement({self.import_name!r}, {self.distribution!r}, {old_extra!r}"
            + (f", {old_version!r}" if old_version else "") + ") uses attnreg 0.1.0's "
            "positional extra, deprecated since 0.2.0 and removed in 0.3.0: write "
            f"Requirement({new_form}) (the signature is Requirement(import_name, "
            "distribution, min_version=None, extra=None, install=None))")
        # Kept on the instance (not a field: equality is unchanged) so the registry can
        # attribute it to its plugin on every load, not only the one that imported it.
        object.__setattr__(self, "_deprecation", message)
        warn_deprecated(message, stacklevel=3)

    def install_hint(self) -> str:
        """What to run to install it: the custom hint, the attnreg extra, or pip."""
        if self.install:
            return self.install
        if self.extra:
            return f"install attnreg[{self.extra}]"
        wanted = self.distribution + (f">={self.min_version}" if self.min_version else "")
        return f"pip install '{wanted}'"

    def describe(self) -> str:
        """``acme-kernels >= 1.2``."""
        return self.distribution + (f" >= {self.min_version}" if self.min_version else "")

    def to_dict(self) -> dict[str, object]:
        return {"import_name": self.import_name, "distribution": self.distribution,
                "min_version": self.min_version, "extra": self.extra,
                "install": self.install, "install_hint": self.install_hint()}


def requires_deprecation(backend: str) -> str:
    """The deprecation message of ``Capabilities(requires=...)`` for ``backend``."""
    return (f"Capabilities(requires=...) of backend {backend!r} is deprecated since attnreg "
            "0.2.0 and removed in 0.3.0: declare requirements once, in "
            "BackendSpec(requires=...), and drop requires= from the capability function "
            "(until then attnreg merges them into the BackendSpec)")


@dataclass(frozen=True)
class Capabilities:
    """A backend's whole declaration on one platform.

    Produced by the backend's capability function, a pure function of
    ``(platform, installed library versions)``.  ``kernels`` lists what runs on
    this platform; ``unavailable_kernels`` lists (kernel, reason) for what the
    backend has elsewhere but not here, so reports can say why.
    ``platform_reason`` is non-empty when nothing of the backend runs here.

    ``requires`` is deprecated since 0.2.0 (removed in 0.3.0): requirements
    are declared once, in ``BackendSpec(requires=...)``.  When a registered
    declaration has a non-empty value, the registry merges it into the
    backend's ``BackendSpec.requires`` and emits an
    :class:`~attnreg.registry.deprecation.AttnregDeprecationWarning` pointing
    at the capability function (at registration, not here: attnreg itself
    copies declarations with ``dataclasses.replace``).
    ``eager_forward_modes`` lists the forward modes the backend serves
    eagerly, with the largest query tokens per sequence; empty means the
    plain ones (DECODE, one token; EXTEND, ragged).

    ``sparse_kernels`` are the backend's sparse (DSA) MLA kernels and
    ``sparse_graph_modes`` their capture support per (phase, graph mode),
    declared like ``graph_modes`` for every capture mode of a phase a sparse
    kernel serves.  Dense queries (``kernels``, ``graph_modes``) never read
    them; :meth:`sparse_view` is the declaration a sparse model sees.
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
    eager_forward_modes: tuple[ForwardModeSupport, ...] = ()
    sparse_kernels: tuple[SparseKernel, ...] = ()
    sparse_graph_modes: tuple[GraphModeSupport, ...] = ()

    def __post_init__(self) -> None:
        if not self.eager_forward_modes:
            object.__setattr__(self, "eager_forward_modes",
                               DEFAULT_FORWARD_MODES[Phase.DECODE]
                               + DEFAULT_FORWARD_MODES[Phase.PREFILL])

    # -- queries -----------------------------------------------------------
    def graph_support(self, phase: Phase | str, mode: GraphMode | str) -> GraphModeSupport:
        """The declaration for (phase, mode).  DISABLED is always native (eager)."""
        phase = Phase.parse(phase)
        mode = GraphMode.parse(mode)
        if mode is GraphMode.DISABLED:
            eager = tuple(f for f in self.eager_forward_modes
                          if f.mode in PHASE_FORWARD_MODES[phase])
            return GraphModeSupport(phase, mode, CaptureSupport.native("eager"),
                                    forward_modes=eager)
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

    def sparse_kernels_for(self, phase: Phase | str) -> tuple[SparseKernel, ...]:
        """The sparse kernels serving ``phase``."""
        ph = Phase.parse(phase)
        return tuple(k for k in self.sparse_kernels if ph in k.phases)

    def serves_sparse(self, phase: Phase | str) -> bool:
        return bool(self.sparse_kernels_for(phase))

    def sparse_graph_support(self, phase: Phase | str,
                             mode: GraphMode | str) -> GraphModeSupport:
        """The sparse declaration for (phase, mode).  DISABLED is native (eager)."""
        phase = Phase.parse(phase)
        mode = GraphMode.parse(mode)
        if mode is GraphMode.DISABLED:
            return GraphModeSupport(phase, mode, CaptureSupport.native("eager"))
        for entry in self.sparse_graph_modes:
            if entry.phase is phase and entry.mode is mode:
                return entry
        return GraphModeSupport(
            phase, mode, CaptureSupport.unsupported(f"{self.backend} declares no sparse "
                                                    f"{phase} under {mode}"))

    def sparse_view(self) -> Capabilities:
        """This declaration as a sparse (DSA) model sees it: the sparse kernels as its
        absorbed-MLA kernels and their capture support as its graph modes.

        Graph policy rules written for dense declarations (capture support, pinning,
        capture memory) then read the sparse facts unchanged.
        """
        import dataclasses

        return dataclasses.replace(
            self, kernels=tuple(k.as_dense_constraints() for k in self.sparse_kernels),
            graph_modes=self.sparse_graph_modes,
            eager_forward_modes=DEFAULT_FORWARD_MODES[Phase.DECODE]
            + DEFAULT_FORWARD_MODES[Phase.PREFILL])

    def check_sparse_request(self, phase: Phase | str, *, top_k: int | None = None,
                             q_dtype: DType | str | None = None,
                             kv_dtype: DType | str | None = None,
                             page_size: int | None = None,
                             num_heads: int | None = None,
                             kv_format: str | None = None) -> list[str]:
        """Reasons a sparse request falls outside every sparse kernel (empty = accepted).

        ``top_k`` None: the width is not known (not checked).  ``kv_format``: what the
        pool's rows are (``MLAKVLayer.row_format``: ``"fp8_ds_mla"``, else its kv dtype,
        576 values of it); a kernel accepts only the rows its ``kv_format`` names.  None:
        not checked (a plan, before any pool exists).
        """
        phase = Phase.parse(phase)
        candidates = self.sparse_kernels_for(phase)
        if not candidates:
            return [f"{self.backend} declares no sparse MLA kernel for {phase} on "
                    f"{self.platform}"]
        best: list[str] | None = None
        if kv_dtype is not None:
            # on a tie the kernel that reads the pool's rows explains the refusal
            kv = DType.parse(kv_dtype)
            fmt = None if kv_format is None else str(kv_format)
            candidates = tuple(sorted(candidates, key=lambda k: (
                k.kv_dtype is not kv, fmt is not None and fmt != k.kv_format.value)))
        for k in candidates:
            reasons: list[str] = []
            if top_k is not None and not k.accepts_top_k(top_k):
                reasons.append(f"top-k {top_k} not in {k.describe_top_k()}")
            if q_dtype is not None and DType.parse(q_dtype) not in k.q_dtypes:
                reasons.append(f"q dtype {DType.parse(q_dtype)} not in "
                               f"{sorted(d.value for d in k.q_dtypes)}")
            if kv_dtype is not None and DType.parse(kv_dtype) is not k.kv_dtype:
                reasons.append(f"kv dtype {DType.parse(kv_dtype)} is not its "
                               f"{k.kv_format} rows' {k.kv_dtype}")
            elif kv_format is not None and str(kv_format) != k.kv_format.value:
                reasons.append(f"the pool holds {kv_format} rows; the kernel reads "
                               f"{k.kv_format} rows ({k.kv_format.row_bytes} bytes)")
            if page_size is not None and page_size not in k.page_sizes:
                reasons.append(f"page size {page_size} not in {list(k.page_sizes)}")
            if num_heads is not None and not k.accepts_heads(num_heads):
                allowed = list(k.head_counts) if k.head_counts else f"1..{k.max_heads}"
                reasons.append(f"{num_heads} heads not in {allowed}")
            if not reasons:
                return []
            if best is None or len(reasons) < len(best):
                best = [f"{self.backend} sparse MLA ({k.kernel or 'kernel'}): {r}"
                        for r in reasons]
        return best or []

    def eager_serving(self, mode: ForwardMode | str) -> ForwardModeSupport | None:
        """The eager entry for forward mode ``mode``, or None when it is not served."""
        wanted = ForwardMode.parse(mode)
        return next((f for f in self.eager_forward_modes if f.mode is wanted), None)

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
        max_seq_len: int | None = None,
    ) -> list[str]:
        """Reasons a request falls outside every kernel's declaration (empty = accepted).

        ``max_seq_len`` is the longest sequence the engine serves (its max
        context); a kernel declaring a shorter ``max_seq_len`` rejects it.
        """
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
        # the kv dtypes of every kernel that takes this q dtype: entries of one kernel
        # split by head count each list only their own
        q_ok = [k for k in candidates
                if q_dtype is None or DType.parse(q_dtype) in k.q_dtypes] or candidates
        kv_any = sorted({d.value for k in q_ok for d in k.kv_dtypes})
        for k in candidates:
            reasons: list[str] = []
            if head_dims is not None and tuple(head_dims) not in k.head_dims:
                reasons.append(f"head dims {tuple(head_dims)} not in {list(k.head_dims)}")
            if q_dtype is not None and DType.parse(q_dtype) not in k.q_dtypes:
                reasons.append(f"q dtype {DType.parse(q_dtype)} not in "
                               f"{sorted(d.value for d in k.q_dtypes)}")
            if kv_dtype is not None and DType.parse(kv_dtype) not in k.kv_dtypes:
                reasons.append(f"kv dtype {DType.parse(kv_dtype)} not in {kv_any}")
            if page_size is not None and k.page_sizes and page_size not in k.page_sizes:
                reasons.append(f"page size {page_size} not in {list(k.page_sizes)}")
            if num_heads is not None and not k.accepts_heads(num_heads):
                reasons.append(f"{num_heads} heads not in {k.head_range}")
            if max_seq_len is not None and k.max_seq_len is not None \
                    and max_seq_len > k.max_seq_len:
                reasons.append(f"max context {max_seq_len} above the kernel's "
                               f"{k.max_seq_len} tokens")
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
            "kernels": [k.to_dict() for k in self.kernels],
            "unavailable_kernels": [{"kernel": n, "reason": r}
                                    for n, r in self.unavailable_kernels],
            "graph_modes": [g.to_dict() for g in self.graph_modes],
            "eager_forward_modes": [f.to_dict() for f in self.eager_forward_modes],
            "sparse_kernels": [k.to_dict() for k in self.sparse_kernels],
            "sparse_graph_modes": [g.to_dict() for g in self.sparse_graph_modes],
            "notes": list(self.notes),
        }

