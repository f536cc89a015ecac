"""Every refusal of a backend, in one place: :class:`RequestChecker`.

Built once per backend instance from its declaration (``Capabilities``), its
``MLAConfig`` and device.  Each method answers one request of the lifecycle
(a forward, a captured shape, a replay, a batch) with the list of every
:class:`Refusal` it earns (empty: accepted), and :func:`refusal_error` turns
them into one :class:`~attnreg.registry.UnsupportedError` carrying every
reason, which :class:`~attnreg.runtime.AttentionBackend` raises before any
kernel launch.

What the declaration says is asked of the declaration itself
(:meth:`~attnreg.registry.Capabilities.check_request` for kernels,
``eager_serving`` / ``graph_support`` for forward and graph modes); what is
wrong with a tensor is asked of the pure functions of
:mod:`attnreg.runtime.validation`.  This module only decides which of them a
request needs and says what to do instead.  Accepted declaration-level
requests are cached (the declaration is frozen), so an eager forward pays one
set lookup for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnreg.registry import (
    VALID_GRAPH_MODES,
    Capabilities,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    UnsupportedError,
)

from . import validation
from .batch import SPECULATIVE_MODES, ForwardBatch
from .config import MLAConfig
from .dtypes import dtype_from_torch
from .graph_buffers import GraphState
from .lse import PrefixDecompress
from .metadata import ATTENTION_CAPTURE_MODES, DEFAULT_CAPTURE_MODE, ForwardMetadata
from .pool import MLAKVLayer

__all__ = ["Refusal", "RequestChecker", "refusal_error", "sparse_index_problems"]

_POOL_HINT = "build the pool with config.make_pool(num_pages)"
_SHAPES_HINT = "see the shapes in AttentionBackend's docstring"


@dataclass(frozen=True, slots=True)
class Refusal:
    """One thing refused: what, every reason, and what to do instead."""

    what: str
    reasons: tuple[str, ...]
    hint: str = ""

    @classmethod
    def of(cls, what: str, reasons: Sequence[str] | str, hint: str = "") -> Refusal:
        return cls(what, (reasons,) if isinstance(reasons, str) else tuple(reasons), hint)


def refusal_error(backend: str, refusals: Sequence[Refusal]) -> UnsupportedError:
    """One :class:`UnsupportedError` naming every refusal (one refusal: its own words)."""
    if len(refusals) == 1:
        r = refusals[0]
        return UnsupportedError(backend, r.what, list(r.reasons), r.hint)
    return UnsupportedError(
        backend, " and ".join(dict.fromkeys(r.what for r in refusals)),
        [f"{r.what}: {reason}" for r in refusals for reason in r.reasons],
        "; ".join(dict.fromkeys(r.hint for r in refusals if r.hint)))


def sparse_index_problems(indices: torch.Tensor, rows: int, pool_slots: int,
                          device: torch.device | None = None, *,
                          check_values: bool = True) -> list[str]:
    """What is wrong with a top-k index tensor for ``rows`` query tokens over a pool of
    ``pool_slots`` token slots (empty: nothing).

    The tensor must be int32 ``[rows, top_k]`` on the pool's device.  Each entry is a pool
    slot in ``0 .. pool_slots - 1`` or exactly -1 (no key); any other value would make a
    kernel that checks only for -1 (FlashMLA) read outside the pool, so it is named here,
    before any launch.  ``check_values`` reads the values (one host sync): an eager
    forward does it; a captured forward cannot, and whoever fills the static index
    tensor checks them there (the same function).
    """
    problems: list[str] = []
    if indices.dtype != torch.int32:
        problems.append(f"top-k indices must be torch.int32, got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != rows or indices.shape[1] < 1:
        problems.append(f"top-k indices must be [{rows} query tokens, top_k >= 1], got "
                        f"{tuple(indices.shape)}")
    if device is not None and indices.device.type != device.type:
        problems.append(f"top-k indices are on {indices.device}, the pool on {device}")
    if problems or not check_values or indices.numel() == 0:
        return problems
    bad = (indices < -1) | (indices >= pool_slots)
    if bool(bad.any()):
        where = bad.nonzero()
        r, c = (int(x) for x in where[0])
        value = int(indices[r, c])
        problems.append(
            f"top-k index {value} at (token {r}, entry {c}) is neither -1 nor a slot of the "
            f"pool (0..{pool_slots - 1}); {int(where.shape[0])} such entries")
    return problems


def _if(what: str, problems: list[str], hint: str) -> list[Refusal]:
    return [Refusal(what, tuple(problems), hint)] if problems else []


class RequestChecker:
    """What a backend refuses, built once from its declaration.

    Parameters
    ----------
    name : str
        The backend's name (every refusal names it).
    capabilities : Capabilities
        Its declaration on this platform.
    config : MLAConfig
    device : torch.device
    """

    def __init__(self, name: str, capabilities: Capabilities, config: MLAConfig,
                 device: torch.device) -> None:
        self.name, self.capabilities, self.config, self.device = name, capabilities, config, device
        #: declaration-level requests already accepted (the declaration is frozen)
        self._accepted: set[tuple[object, ...]] = set()
        #: (forward mode, graph mode, query tokens) already found served
        self._served: set[tuple[ForwardMode, GraphMode, int | None]] = set()
        #: the declaration restricted to the kernels that return the log-sum-exp
        self._lse_caps = dataclasses.replace(
            capabilities, kernels=tuple(k for k in capabilities.kernels if k.lse))
        self._sparse_checker: RequestChecker | None = None

    def for_sparse(self, sparse: bool = True) -> RequestChecker:
        """The checker of the declaration as a sparse (DSA) capture sees it
        (``Capabilities.sparse_view()``: the sparse kernels, ``sparse_graph_modes`` as the
        graph modes), for the capture lifecycle of sparse forwards (built once); this
        checker itself when ``sparse`` is False."""
        if not sparse:
            return self
        if self._sparse_checker is None:
            self._sparse_checker = RequestChecker(self.name, self.capabilities.sparse_view(),
                                                  self.config, self.device)
        return self._sparse_checker

    # -- the backend itself ------------------------------------------------------------
    def page_size(self) -> list[Refusal]:
        """A page size none of the kernels that read the paged pool declares (at creation:
        every forward reads a pool of ``config.page_size``)."""
        return _if("page size",
                   validation.page_size_problems(self.config.page_size, self.capabilities),
                   "build the MLAConfig with a page size the backend declares (`attnreg "
                   "backends --json` lists them), or choose a backend that declares this one")

    # -- graph modes -------------------------------------------------------------------
    def graph_mode(self, phase: Phase, mode: GraphMode,
                   method: ForwardMethod | None = None) -> list[Refusal]:
        """``(phase, mode)`` declared UNSUPPORTED, or ``method`` other than the one it pins."""
        if mode is GraphMode.DISABLED:
            return []
        support = self.capabilities.graph_support(phase, mode)
        if support.capture.is_unsupported:
            return [Refusal.of(
                f"{phase} under {mode} graph capture",
                support.capture.reason or "declared unsupported",
                f"run {phase} eagerly (graph mode disabled) or choose a backend that declares "
                f"{mode} for {phase}; `attnreg compat` shows what each backend declares")]
        pinned = support.pinned_method
        if method is None or pinned is None or method is pinned:
            return []
        return [Refusal.of(
            f"forward method {method} under {mode} capture of {phase}",
            f"{self.name} pins {pinned} under {phase}/{mode}",
            f"call forward_extend(..., method=ForwardMethod.{pinned.name}) under capture "
            f"(forward_method_for(phase) says which), or run this batch eagerly")]

    def capture_modes(self, graph_modes: Mapping[Phase | str, GraphMode | str] | None,
                      context: GraphMode | None) -> tuple[dict[Phase, GraphMode], list[Refusal]]:
        """The modes ``init_cuda_graph_state`` allocates for, and what refuses them.

        ``graph_modes`` None: every phase the ``capturing()`` ``context`` captures, else
        every phase whose attention-capturing mode (decode FULL, prefill BREAKABLE) is
        declared; none declared is a refusal.
        """
        if graph_modes is not None:
            wanted = {Phase.parse(p): GraphMode.parse(m) for p, m in graph_modes.items()}
        elif context is not None:
            wanted = {p: context for p, ms in VALID_GRAPH_MODES.items() if context in ms}
        else:
            supported: dict[Phase, GraphMode] = {}
            reasons = []
            for phase, mode in DEFAULT_CAPTURE_MODE.items():
                cap = self.capabilities.graph_support(phase, mode).capture
                if cap.is_unsupported:
                    reasons.append(f"{phase}/{mode}: {cap.reason}")
                else:
                    supported[phase] = mode
            return supported, [] if supported else [Refusal.of(
                "CUDA graph capture", reasons,
                "run this backend eagerly (graph modes disabled) or choose a backend that "
                "declares FULL decode or BREAKABLE prefill capture")]
        refused = [r for phase, mode in wanted.items() for r in self.graph_mode(phase, mode)]
        return {p: m for p, m in wanted.items() if m is not GraphMode.DISABLED}, refused

    # -- forward modes -----------------------------------------------------------------
    def forward_mode(self, fmode: ForwardMode, phase: Phase, mode: GraphMode, query_len: int,
                     extend_lens: tuple[int, ...] | None = None) -> list[Refusal]:
        """A forward mode the declaration does not serve under ``mode`` (DISABLED and
        TC_PIECEWISE: ``eager_forward_modes``; a capture mode: that entry's
        ``forward_modes``) with ``query_len`` tokens per sequence, or unevenly where it
        must be uniform."""
        if (fmode, mode, None) in self._served:  # served at any length
            return []
        uniform = extend_lens is None or len(set(extend_lens)) <= 1
        key = (fmode, mode, query_len if uniform else -query_len)
        if key in self._served:
            return []
        caps = self.capabilities
        eager = mode is GraphMode.DISABLED or mode is GraphMode.TC_PIECEWISE
        entry = caps.eager_serving(fmode) if eager else \
            caps.graph_support(phase, mode).serving(fmode)
        where = "eagerly" if eager else f"in {phase} {mode} graphs"
        problem = ""
        if entry is None:
            problem = f"{self.name} does not declare {fmode} batches {where}"
        elif query_len > 0 and not entry.serves_query_len(query_len):
            problem = (f"{self.name} declares {entry.describe()} {where}; this batch has "
                       f"{query_len} tokens per sequence")
        elif entry.uniform and not uniform and fmode is not ForwardMode.EXTEND:
            problem = (f"{self.name} declares {entry.describe()} {where}; this batch has "
                       "sequences of different lengths")
        if problem or entry is None:
            declared = caps.eager_forward_modes if eager else \
                caps.graph_support(phase, mode).forward_modes
            return [Refusal.of(
                f"{fmode} batch {where}", problem,
                "run it where it is declared (Capabilities.eager_forward_modes, "
                "GraphModeSupport.forward_modes: "
                + (", ".join(f.describe() for f in declared) or "nothing") + ")")]
        # an unbounded entry (ragged extend) is cached once, not once per length
        self._served.add((fmode, mode, None) if entry.max_query_len is None else key)
        return []

    # -- the declaration's kernels -----------------------------------------------------
    @staticmethod
    def query_form(method: ForwardMethod, phase: Phase, q: torch.Tensor) -> list[Refusal]:
        """A query of a dtype attnreg has no name for, or not 3-d (every other check of a
        forward reads ``[tokens, heads, head_dim]``)."""
        if dtype_from_torch(q.dtype) is None:
            return [Refusal.of(f"{method} {phase} query dtype",
                               f"q dtype {q.dtype} has no attnreg name",
                               "use bf16, fp16 or fp32 queries")]
        if q.dim() != 3:
            return [Refusal.of(f"{method} {phase} query shape",
                               f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}",
                               "reshape q to 3-d")]
        return []

    def declared(self, method: ForwardMethod, phase: Phase, q: torch.Tensor,
                 head_dims: tuple[int, int], *, kv_dtype: DType | str,
                 page_size: int | None = None, lse: bool = False) -> list[Refusal]:
        """A request no kernel of the declaration accepts (``check_request``), or an LSE
        output that no kernel accepting it declares."""
        # keyed on the raw request (torch dtype, kv dtype as given): an accepted request
        # costs one tuple and one set lookup per forward
        key = None
        if q.dim() == 3:
            key = (method, phase, head_dims, q.dtype, kv_dtype, page_size, q.shape[1], lse)
            if key in self._accepted:
                return []
        q_dt = dtype_from_torch(q.dtype)
        if q_dt is None or key is None:
            return self.query_form(method, phase, q)
        request = {"head_dims": head_dims, "q_dtype": q_dt, "kv_dtype": kv_dtype,
                   "page_size": page_size, "num_heads": q.shape[1]}
        reasons = self.capabilities.check_request(method, phase, **request)  # type: ignore[arg-type]
        if reasons:
            return [Refusal.of(f"{method} {phase} request", reasons)]
        if lse and self._lse_caps.check_request(method, phase, **request):  # type: ignore[arg-type]
            kernels = [k.kernel or str(k.method)
                       for k in self.capabilities.kernels_for(method, phase)]
            return [Refusal.of(
                f"{method} {phase} log-sum-exp output",
                f"no kernel that accepts this request declares an LSE output (kernels: "
                f"{', '.join(kernels)}; KernelConstraints.lse)",
                "call without return_lse, or choose a backend whose kernel declares lse")]
        self._accepted.add(key)
        return []

    # -- batches and tensors -----------------------------------------------------------
    def batch(self, batch: ForwardBatch) -> list[Refusal]:
        return _if("batch", validation.batch_problems(batch, self.device, self.config.page_size),
                   "build batches with decode_batch() / extend_batch()")

    def pool(self, kv: MLAKVLayer | None) -> list[Refusal]:
        if kv is None:
            return []
        return _if("KV pool", validation.pool_problems(kv, self.config, self.device), _POOL_HINT)

    @staticmethod
    def dense_rows(kv: MLAKVLayer | None, what: str) -> list[Refusal]:
        """A dense kernel asked to read packed (``fp8_ds_mla``) rows: only a sparse kernel
        that declares that format reads them."""
        if kv is None or kv.kv_format is None:
            return []
        return [Refusal.of(f"{what} over {kv.row_format} rows",
                           f"the pool holds {kv.row_format} rows ({kv.row_bytes} bytes: "
                           "fp8 latent with one scale per 128 values, bf16 rope); dense "
                           f"kernels read 576 values of the pool's kv dtype",
                           "attend these rows with forward_sparse on a backend whose "
                           "sparse_kernels declare kv_format fp8_ds_mla, or build the pool "
                           "with dense rows")]

    def query(self, q: torch.Tensor, rows: int, dim: int) -> list[Refusal]:
        return _if("q tensor", validation.query_problems(q, (rows, self.config.num_heads, dim),
                                                         self.device, "q"), _SHAPES_HINT)

    @staticmethod
    def query_scale(q: torch.Tensor, q_scale: torch.Tensor | None) -> list[Refusal]:
        """An fp8 query without its ``q_scale`` (or a bad one), or a scale with any other."""
        if q_scale is None and q.dtype != torch.float8_e4m3fn:
            return []  # every forward of a 16-bit q asks: answered without building anything
        return _if("q_scale", validation.query_scale_problems(q, q_scale),
                   "pass q_scale=<float32 [1] on q's device> with an fp8 q, and only then")

    def new_rows(self, kv: MLAKVLayer | None, latent: torch.Tensor | None,
                 rope: torch.Tensor | None, rows: int) -> list[Refusal]:
        """The new tokens' cache rows (both None: nothing to write)."""
        if latent is None and rope is None:
            return []
        if kv is None:
            return [Refusal.of("KV write without a pool",
                               "latent_new / rope_new were given but pool is None",
                               "pass the pool, or None for latent_new and rope_new")]
        if (latent is None) != (rope is None):
            return [Refusal.of("KV write", "latent_new and rope_new go together",
                               "pass both or neither")]
        return _if("new KV rows", validation.new_rows_problems(latent, rope, rows, kv),
                   "one latent and one rope row per new token")

    def outputs(self, q: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, int, int],
                lse: torch.Tensor | None) -> list[Refusal]:
        """A caller's ``out=`` / ``lse=`` of the wrong shape, dtype or device."""
        refused = [] if out is None else _if(
            "out tensor", validation.output_problems(out, q, shape),
            "pass out=None to get a new tensor")
        if lse is None:
            return refused
        want = (shape[0], q.shape[1])
        if (tuple(lse.shape) != want or lse.dtype != torch.float32
                or lse.device != q.device):
            refused.append(Refusal.of(
                "lse tensor", f"got {tuple(lse.shape)} {lse.dtype} on {lse.device}, expected "
                f"{want} torch.float32 on {q.device}", "pass lse=None to get a new tensor"))
        return refused

    def ragged_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: int | None, what: str, hint: str) -> list[Refusal]:
        return _if(what, validation.ragged_kv_problems(q, k, v, self.config, rows, self.device),
                   hint)

    # -- forwards ----------------------------------------------------------------------
    def decode(self, md: ForwardMetadata[Any], mode: GraphMode, q: torch.Tensor,
               kv: MLAKVLayer, latent: torch.Tensor | None, rope: torch.Tensor | None,
               out: torch.Tensor | None, lse: torch.Tensor | None, want_lse: bool,
               q_scale: torch.Tensor | None = None) -> list[Refusal]:
        """Everything ``forward_decode`` refuses, once the metadata is a decode batch's."""
        if md.forward_mode is not ForwardMode.DECODE:
            what = "an extend" if md.forward_mode is ForwardMode.EXTEND else \
                f"a {md.forward_mode}"
            return [Refusal.of(f"forward_decode on {what} batch",
                               f"the metadata is for {md.forward_mode}",
                               "call forward_extend for extend, target-verify and "
                               "draft-extend batches")]
        if q.dim() != 3:
            return self.query_form(ForwardMethod.MLA, Phase.DECODE, q)
        cfg = self.config
        # one list extended in place: this runs once per layer of every eager step
        refused = self.declared(ForwardMethod.MLA, Phase.DECODE, q, (q.shape[-1], kv.kv_lora_rank),
                                kv_dtype=kv.kv_dtype, page_size=kv.page_size, lse=want_lse)
        if mode is not GraphMode.DISABLED:
            refused += self.graph_mode(Phase.DECODE, mode, ForwardMethod.MLA)
        refused += self.pool(kv)
        if kv.kv_format is not None:
            refused += self.dense_rows(kv, "dense MLA decode")
        refused += self.query(q, md.batch_size, cfg.kv_row_dim)
        refused += self.query_scale(q, q_scale)
        if latent is not None or rope is not None:
            refused += self.new_rows(kv, latent, rope, md.num_tokens)
        if out is not None or lse is not None:
            refused += self.outputs(q, out, (md.batch_size, q.shape[1], cfg.kv_lora_rank), lse)
        return refused

    def extend(self, md: ForwardMetadata[Any], mode: GraphMode, method: ForwardMethod,
               q: torch.Tensor, kv: MLAKVLayer | None, k: torch.Tensor | None,
               v: torch.Tensor | None, latent: torch.Tensor | None, rope: torch.Tensor | None,
               out: torch.Tensor | None, lse: torch.Tensor | None, want_lse: bool,
               decompress: PrefixDecompress | None = None, chunk_tokens: int | None = None,
               q_scale: torch.Tensor | None = None) -> list[Refusal]:
        """Everything ``forward_extend`` refuses (MHA_CHUNKED_KV with :meth:`chunked`)."""
        fmode, phase = md.forward_mode, md.phase
        if fmode is ForwardMode.DECODE:
            return [Refusal.of("forward_extend on a decode batch", "the metadata is for decode",
                               "call forward_decode for decode batches")]
        refused = self.modes(md, mode, method)
        if q.dim() != 3:
            return refused + self.query_form(method, phase, q)
        if method is ForwardMethod.MHA_CHUNKED_KV:
            refused += self.query_scale(q, q_scale)
            return refused + self.chunked(md, q, kv, k, v, latent, rope, out, lse, decompress,
                                          chunk_tokens)
        if decompress is not None or chunk_tokens is not None:
            refused.append(Refusal.of(
                f"decompress / chunk_tokens with method {method}",
                "only the MHA_CHUNKED_KV method reads a prefix in chunks",
                "pass method=ForwardMethod.MHA_CHUNKED_KV"))
        cfg = self.config
        if method is ForwardMethod.MLA:
            v_dim = cfg.kv_lora_rank
            if kv is None:
                refused.append(Refusal.of("MLA extend without a KV pool",
                                          "absorbed MLA attends over the paged pool",
                                          "pass the pool"))
            else:
                refused += self.declared(method, phase, q, (q.shape[-1], kv.kv_lora_rank),
                                         kv_dtype=kv.kv_dtype, page_size=kv.page_size,
                                         lse=want_lse)
                refused += self.dense_rows(kv, f"dense MLA {phase}")
            refused += self.query(q, md.num_tokens, cfg.kv_row_dim)
        else:
            qk_dim, v_dim = cfg.mha_head_dims
            if k is None or v is None:
                refused.append(Refusal.of(f"{method} extend without k and v",
                                          "the MHA method attends over ragged k / v",
                                          "pass k=[Tk, H, 192] and v=[Tk, H, 128]"))
            else:
                refused += self._ragged_declared(method, phase, q, k, v, want_lse)
            refused += self.query(q, md.num_tokens, qk_dim)
            if k is not None and v is not None:
                refused += self.ragged_kv(q, k, v, md.num_kv_tokens, "ragged MHA k / v",
                                          "k and v cover prefix + new tokens, ragged by "
                                          "kv_indptr")
        refused += self.query_scale(q, q_scale)
        return (refused + self.pool(kv) + self.new_rows(kv, latent, rope, md.num_tokens)
                + self.outputs(q, out, (md.num_tokens, q.shape[1], v_dim), lse))

    def sparse(self, md: ForwardMetadata[Any], mode: GraphMode, q: torch.Tensor,
               kv: MLAKVLayer | None, indices: torch.Tensor, latent: torch.Tensor | None,
               rope: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None,
               want_lse: bool) -> list[Refusal]:
        """Everything ``forward_sparse`` refuses: a request no sparse kernel declares, a
        graph mode its sparse declaration does not support, and an index tensor of the
        wrong dtype or shape or holding a value that is neither -1 nor a pool slot (read
        unless the forward is being captured)."""
        phase, cfg = md.phase, self.config
        is_decode = md.forward_mode is ForwardMode.DECODE
        capturing = mode is not GraphMode.DISABLED and md.is_graph
        if q.dim() != 3:
            return self.query_form(ForwardMethod.MLA, phase, q)
        if kv is None:
            return [Refusal.of(f"sparse {phase} without a KV pool",
                               "sparse MLA attends over the paged pool", "pass the pool")]
        refused: list[Refusal] = []
        q_dt = dtype_from_torch(q.dtype)
        top_k = int(indices.shape[-1]) if indices.dim() == 2 else None
        reasons = self.capabilities.check_sparse_request(
            phase, top_k=top_k, q_dtype=q_dt, kv_dtype=kv.kv_dtype, page_size=kv.page_size,
            num_heads=q.shape[1], kv_format=kv.row_format)
        if reasons:
            refused.append(Refusal.of(f"sparse MLA {phase} request", reasons,
                                      "`attnreg backends --json` lists each backend's "
                                      "sparse_kernels"))
        elif want_lse and not any(k.lse for k in self.capabilities.sparse_kernels_for(phase)):
            refused.append(Refusal.of(f"sparse MLA {phase} log-sum-exp output",
                                      "no sparse kernel declares an LSE output",
                                      "call without return_lse"))
        if mode is not GraphMode.DISABLED:
            support = self.capabilities.sparse_graph_support(phase, mode)
            if support.capture.is_unsupported:
                refused.append(Refusal.of(
                    f"sparse {phase} under {mode} graph capture",
                    support.capture.reason or "declared unsupported",
                    f"run sparse {phase} eagerly or choose a backend whose sparse_graph_modes "
                    f"declare {mode}"))
        rows = md.batch_size if is_decode else md.num_tokens
        refused += _if("top-k indices",
                       sparse_index_problems(indices, rows, kv.num_slots, self.device,
                                             check_values=not capturing),
                       "pass int32 [query tokens, top_k] pool slots, -1 for no key")
        refused += self.pool(kv)
        refused += self.query(q, rows, cfg.kv_row_dim)
        if latent is not None or rope is not None:
            refused += self.new_rows(kv, latent, rope, md.num_tokens)
        if out is not None or lse is not None:
            refused += self.outputs(q, out, (rows, q.shape[1], cfg.kv_lora_rank), lse)
        return refused

    def modes(self, md: ForwardMetadata[Any], mode: GraphMode,
              method: ForwardMethod) -> list[Refusal]:
        """An extend-method batch's forward mode, graph mode and method together."""
        fmode, phase = md.forward_mode, md.phase
        refused = []
        if fmode in SPECULATIVE_MODES and method is not ForwardMethod.MLA:
            refused.append(Refusal.of(f"{fmode} with method {method}",
                                      "speculative batches attend the paged pool with absorbed "
                                      "MLA", "call forward_extend(..., method=ForwardMethod.MLA)"))
        return (refused + self.graph_mode(phase, mode, method)
                + self.forward_mode(fmode, phase, mode, md.max_extend_len, md.extend_lens_cpu))

    def chunked(self, md: ForwardMetadata[Any], q: torch.Tensor, kv: MLAKVLayer | None,
                k: torch.Tensor | None, v: torch.Tensor | None, latent: torch.Tensor | None,
                rope: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None,
                decompress: PrefixDecompress | None, chunk_tokens: int | None
                ) -> list[Refusal]:
        """Everything chunked-prefix MHA refuses, past :meth:`extend`'s mode checks."""
        method = ForwardMethod.MHA_CHUNKED_KV
        has_prefix = any(md.prefix_lens_cpu or ())
        if md.is_graph:
            return [Refusal.of(f"{method} under graph capture",
                               "the prefix chunks are planned per batch on the host",
                               "run chunked-prefix MHA batches eagerly")]
        qk_dim, v_dim = self.config.mha_head_dims
        refused = []
        if k is None or v is None:
            refused.append(Refusal.of(f"{method} extend without k and v",
                                      "the new tokens' k / v are attended causally first",
                                      "pass k=[T, H, 192] and v=[T, H, 128] of the new tokens"))
        else:
            # the chunks are merged by their LSE: the kernel must produce it
            refused += self._ragged_declared(method, Phase.PREFILL, q, k, v, True)
            refused += self.ragged_kv(q, k, v, md.num_tokens, "new tokens' k / v",
                                      "with MHA_CHUNKED_KV, k and v hold the new tokens only, "
                                      "ragged by qo_indptr")
        refused += self.query(q, md.num_tokens, qk_dim)
        if has_prefix and (kv is None or decompress is None):
            refused.append(Refusal.of(f"{method} over a cached prefix",
                                      "the prefix is read from the pool and decompressed by "
                                      "the engine",
                                      "pass pool= and decompress=(latent, rope) -> (k, v)"))
        if chunk_tokens is not None and chunk_tokens < 1:
            refused.append(Refusal.of(f"{method} chunk size",
                                      f"chunk_tokens must be >= 1, got {chunk_tokens}",
                                      "pass a positive chunk size, or None for one chunk"))
        return (refused + self.pool(kv) + self.new_rows(kv, latent, rope, md.num_tokens)
                + self.outputs(q, out, (md.num_tokens, q.shape[1], v_dim), lse))

    def decompressed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     rows: int) -> list[Refusal]:
        """What the engine's ``decompress`` returned for one prefix chunk of ``rows`` rows."""
        heads = q.shape[1]
        qk_dim, v_dim = self.config.mha_head_dims
        if (tuple(k.shape) == (rows, heads, qk_dim) and tuple(v.shape) == (rows, heads, v_dim)
                and k.dtype == q.dtype and v.dtype == q.dtype):
            return []
        return [Refusal.of(
            "decompressed prefix chunk",
            f"decompress returned k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} "
            f"{v.dtype}, expected [{rows}, {heads}, {qk_dim}] and [{rows}, {heads}, {v_dim}] "
            f"in {q.dtype}", "return one k / v row per prefix row, in q's dtype")]

    def _ragged_declared(self, method: ForwardMethod, phase: Phase, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, lse: bool) -> list[Refusal]:
        kv_dt = dtype_from_torch(k.dtype)
        if kv_dt is None:
            return [Refusal.of(f"{method} k dtype", f"k dtype {k.dtype} has no attnreg name",
                               "use bf16, fp16 or fp32 k / v")]
        return self.declared(method, phase, q, (q.shape[-1], v.shape[-1]), kv_dtype=kv_dt,
                             lse=lse)

    # -- metadata and graphs -----------------------------------------------------------
    def eager_metadata(self, phase: Phase, mode: GraphMode) -> list[Refusal]:
        """``init_forward_metadata`` while ``phase`` attention is being captured."""
        if mode not in ATTENTION_CAPTURE_MODES:
            return []
        return [Refusal.of("eager metadata under graph capture",
                           f"init_forward_metadata was called while {phase} attention is being "
                           f"captured in {mode} mode",
                           "call init_forward_metadata_capture(bs, num_tokens, batch) before "
                           "capture")]

    @staticmethod
    def unplanned_batch() -> list[Refusal]:
        return [Refusal.of("forward on an unplanned batch under capture",
                           "this batch is not the one given to init_forward_metadata_capture",
                           "pass that batch (or None) to forward_* while capturing")]

    @staticmethod
    def no_metadata() -> list[Refusal]:
        return [Refusal.of("forward without metadata", "no batch was given and none was planned",
                           "call init_forward_metadata(batch) or pass batch=")]

    @staticmethod
    def no_pool(what: str, why: str) -> list[Refusal]:
        return [Refusal.of(what, why, "pass the pool")]

    @staticmethod
    def layer(layer_id: int, why: str) -> list[Refusal]:
        return [Refusal.of(f"layer_id {layer_id}", why, "pass a layer_id of the pool")]

    @staticmethod
    def graph_state(state: GraphState[Any] | None, *, buffers: bool = False
                    ) -> list[Refusal]:
        """No graph state yet, or (``buffers``) none of the backend's own buffers in it."""
        if state is None:
            return [Refusal.of("graph capture before init_cuda_graph_state",
                               "the graph buffers are not allocated",
                               "call init_cuda_graph_state(max_bs, max_num_tokens) first")]
        if buffers and state.buffers is None:
            return [Refusal.of("graph buffers of this backend",
                               "init_cuda_graph_state allocated none for the modes asked",
                               "pass the captured phase in graph_modes= of "
                               "init_cuda_graph_state")]
        return []

    def capture(self, state: GraphState[Any], fmode: ForwardMode, phase: Phase,
                mode: GraphMode, bs: int, num_tokens: int) -> list[Refusal]:
        """Every reason ``(fmode, bs, num_tokens)`` cannot be captured under ``mode``."""
        refused = self.graph_mode(phase, mode)
        if phase not in state.graph_modes:
            refused.append(Refusal.of(
                f"{phase} capture", "init_cuda_graph_state was called for "
                f"{sorted(str(p) for p in state.graph_modes)} only",
                f"pass graph_modes={{'{phase}': '{mode}'}} to init_cuda_graph_state"))
        if bs < 1 or bs > state.max_bs or num_tokens > state.max_num_tokens or num_tokens < 1:
            return refused + [Refusal.of(
                f"captured shape bs={bs}, num_tokens={num_tokens}",
                f"init_cuda_graph_state sized the buffers for max_bs={state.max_bs}, "
                f"max_num_tokens={state.max_num_tokens}",
                "call init_cuda_graph_state with larger bounds")]
        if fmode is ForwardMode.DECODE and num_tokens != bs:
            refused.append(Refusal.of(f"decode capture with num_tokens={num_tokens}",
                                      f"a decode batch has one token per sequence (bs={bs})",
                                      "pass num_tokens=bs"))
        if fmode in SPECULATIVE_MODES and num_tokens % bs:
            refused.append(Refusal.of(
                f"{fmode} capture with num_tokens={num_tokens}",
                f"a {fmode} graph is captured for the same number of query tokens per "
                f"sequence: num_tokens must be a multiple of bs={bs}",
                "pass num_tokens=bs * draft tokens"))
        if refused:  # the served check reads a query bound only a valid shape has
            return refused
        return self.forward_mode(fmode, phase, mode, state.query_bound(fmode, bs, num_tokens))

    @staticmethod
    def replay(state: GraphState[Any] | None, fmode: ForwardMode, bs: int, num_tokens: int
               ) -> list[Refusal]:
        """No graph captured for the shape ``(fmode, bs, num_tokens)`` (none at all before
        ``init_cuda_graph_state``)."""
        if state is not None and state.captured_for(fmode, bs, num_tokens) is not None:
            return []
        have = sorted((str(m), b, t) for m, b, t in (state.captured if state else ()))
        return [Refusal.of(f"replay of {fmode} bs={bs}, num_tokens={num_tokens}",
                           f"no graph metadata was captured for it (captured: {have})",
                           "call init_forward_metadata_capture for this shape first")]

    @staticmethod
    def graph_fit(state: GraphState[Any], md: ForwardMetadata[Any], batch: ForwardBatch
                  ) -> list[Refusal]:
        return _if("batch for this captured graph", state.fit_problems(md, batch),
                   "pad it to a captured shape or run it eagerly")
