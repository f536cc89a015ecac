"""The runtime interface every attention backend implements (modelled on sglang's
``AttentionBackend``), with request validation centralised here.

A backend subclasses :class:`AttentionBackend` and implements two hooks,
:meth:`~AttentionBackend._forward_decode_impl` and
:meth:`~AttentionBackend._forward_extend_impl` (plus optional planning hooks).
The public methods validate every request against the backend's *declaration*
(``self.capabilities``) and the current capture mode before a hook runs, so a
backend, built-in or third-party, refuses anything it did not declare with an
:class:`~attnreg.registry.UnsupportedError` instead of an assert from inside a
kernel library.

Lifecycle (see docs/runtime.md)::

    eager:    init_forward_metadata(batch) -> forward_decode / forward_extend
    graphs:   init_cuda_graph_state(max_bs, max_num_tokens)            once
              init_forward_metadata_capture(bs, num_tokens, batch)     per captured shape,
              forward_* inside torch.cuda.graph + capturing(mode)      before capture
              init_forward_metadata_replay(bs, num_tokens, batch)      before each replay
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from attnreg.graph_policy.capture import current_capture, in_eager_break
from attnreg.graph_policy.config import DEFAULT_MAX_SEQ_LEN
from attnreg.registry import (
    VALID_GRAPH_MODES,
    Capabilities,
    CaptureSupport,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    UnsupportedError,
)

from .batch import ForwardBatch
from .kv_pool import PADDING_PAGE, MLAKVPool, dtype_from_torch, resolve_device

__all__ = [
    "ATTENTION_CAPTURE_MODES",
    "AttentionBackend",
    "ForwardMetadata",
    "GraphState",
    "KernelErrors",
    "MLAConfig",
    "phase_of",
]

#: Graph modes under which attention itself is recorded into a graph.  Under
#: TC_PIECEWISE attention is a splitting op that runs eagerly between pieces.
ATTENTION_CAPTURE_MODES: tuple[GraphMode, ...] = (GraphMode.FULL, GraphMode.BREAKABLE)

#: The graph mode assumed when attention is captured with no ``capturing()``
#: context: the mode that captures attention in each phase.
_DEFAULT_CAPTURE_MODE: Mapping[Phase, GraphMode] = {
    Phase.DECODE: GraphMode.FULL,
    Phase.PREFILL: GraphMode.BREAKABLE,
}

_INDEX_FIELDS = ("seq_lens", "prefix_lens", "extend_lens", "qo_indptr", "kv_indptr",
                 "page_table", "out_cache_loc")


_KERNEL_ERRORS_HINT = ("the kernel refused the inputs before launching; fix them or check "
                       "`attnreg backends --json` for what this backend declares")


class KernelErrors:
    """``with`` block that turns a library's pre-launch ``ValueError`` into
    :class:`UnsupportedError` (an UnsupportedError passes through unchanged).

    A plain class rather than ``contextlib.contextmanager``: it wraps every
    kernel launch, and a generator-based context manager costs a generator
    and two extra frames per launch.
    """

    __slots__ = ("backend", "what", "hint")

    def __init__(self, backend: str, what: str, hint: str) -> None:
        self.backend, self.what, self.hint = backend, what, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        # Returning None never swallows: anything but a library ValueError propagates.
        if isinstance(exc, ValueError) and not isinstance(exc, UnsupportedError):
            raise UnsupportedError(self.backend, self.what, str(exc), self.hint) from exc


def _phase(value: Phase | str) -> Phase:
    return cast(Phase, Phase.parse(value))


def _graph_mode(value: GraphMode | str) -> GraphMode:
    return cast(GraphMode, GraphMode.parse(value))


def _forward_mode(value: ForwardMode | str) -> ForwardMode:
    return cast(ForwardMode, ForwardMode.parse(value))


def _method(value: ForwardMethod | str) -> ForwardMethod:
    return cast(ForwardMethod, ForwardMethod.parse(value))


def phase_of(forward_mode: ForwardMode | str) -> Phase:
    """DECODE batches are the decode phase; every other forward mode is prefill."""
    return Phase.DECODE if _forward_mode(forward_mode) is ForwardMode.DECODE \
        else Phase.PREFILL


@dataclass(frozen=True)
class MLAConfig:
    """Shape and dtype facts of one MLA attention layer (per tensor-parallel rank).

    Parameters
    ----------
    num_heads : int
        Query heads on this rank.
    kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim : int
        DeepSeek-V2/V3 defaults: 512, 64, 128, 128.
    page_size : int
        Tokens per KV-pool page.
    kv_dtype, q_dtype : DType or str
        ``bf16``, ``fp16``, ``fp8_e4m3`` (kv only) or ``fp32``.
    device : str
        ``"cpu"`` or ``"cuda"`` (``"cuda:1"`` ...).
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
        (1/sqrt(192)), which DeepSeek uses for both the absorbed and the MHA form.
    max_context_len : int
        Longest sequence a captured graph must serve (sizes graph buffers).
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    page_size: int = 1
    kv_dtype: DType | str = DType.BF16
    q_dtype: DType | str = DType.BF16
    device: str = "cpu"
    sm_scale: float | None = None
    max_context_len: int = DEFAULT_MAX_SEQ_LEN

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", DType.parse(self.kv_dtype))
        object.__setattr__(self, "q_dtype", DType.parse(self.q_dtype))
        if self.sm_scale is None:
            object.__setattr__(self, "sm_scale",
                               1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim))
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim", "page_size", "max_context_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def softmax_scale(self) -> float:
        """``sm_scale`` as a float (never None after construction)."""
        assert self.sm_scale is not None
        return float(self.sm_scale)

    @property
    def kv_row_dim(self) -> int:
        """Width of one KV-pool row: latent + rope (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_head_dims(self) -> tuple[int, int]:
        """(head_dim_qk, head_dim_v) of the absorbed form: (576, 512)."""
        return self.kv_row_dim, self.kv_lora_rank

    @property
    def mha_head_dims(self) -> tuple[int, int]:
        """(head_dim_qk, head_dim_v) of the non-absorbed MHA form: (192, 128)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    def head_dims(self, method: ForwardMethod | str) -> tuple[int, int]:
        return self.mla_head_dims if _method(method) is ForwardMethod.MLA \
            else self.mha_head_dims

    def make_pool(self, num_pages: int, *, scale: float = 1.0) -> MLAKVPool:
        """An :class:`MLAKVPool` of this config's page size, dtype and device."""
        return MLAKVPool.from_config(self, num_pages, scale=scale)


@dataclass
class ForwardMetadata:
    """What the forward hooks read: device tensors plus host bounds.

    Eager metadata references the batch's own tensors and carries host copies
    of the lengths (``seq_lens_cpu`` ...).  Graph metadata references slices of
    the preallocated graph buffers; its host copies are None (lengths change
    at every replay without the host being asked), and ``max_seq_len`` /
    ``max_extend_len`` are the capture-time bounds.  ``extras`` holds what a
    backend plans per batch (workspaces, split counts, wrapper objects).
    """

    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    max_seq_len: int
    max_extend_len: int
    graph_mode: GraphMode = GraphMode.DISABLED
    batch: ForwardBatch | None = None
    seq_lens_cpu: tuple[int, ...] | None = None
    prefix_lens_cpu: tuple[int, ...] | None = None
    extend_lens_cpu: tuple[int, ...] | None = None
    num_kv_tokens: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def phase(self) -> Phase:
        return phase_of(self.forward_mode)

    @property
    def is_graph(self) -> bool:
        return self.graph_mode is not GraphMode.DISABLED

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> ForwardMetadata:
        return cls(
            forward_mode=batch.forward_mode, batch_size=batch.batch_size,
            num_tokens=batch.num_tokens, seq_lens=batch.seq_lens,
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
            page_table=batch.page_table, out_cache_loc=batch.out_cache_loc,
            max_seq_len=batch.max_seq_len, max_extend_len=batch.max_extend_len,
            batch=batch, seq_lens_cpu=batch.seq_lens_cpu,
            prefix_lens_cpu=batch.prefix_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu,
            num_kv_tokens=batch.num_kv_tokens)


@dataclass
class GraphState:
    """Device buffers shared by every captured shape (graphs replay one at a time)."""

    max_bs: int
    max_num_tokens: int
    max_seq_len: int
    max_pages: int
    graph_modes: dict[Phase, GraphMode]
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


class AttentionBackend:
    """Base class of MLA attention backends.

    Constructed by ``BackendRegistry.create(name, config)`` as
    ``cls(config, capabilities=caps, **kwargs)``.  Subclasses implement
    :meth:`_forward_decode_impl` and :meth:`_forward_extend_impl` and may
    override the planning hooks :meth:`_init_metadata_impl`,
    :meth:`_init_graph_state_impl`, :meth:`_init_capture_impl`,
    :meth:`_init_replay_impl` and :meth:`_write_kv`.  By the time a hook runs
    the request has been checked against ``self.capabilities``, the capture
    mode and the shapes below.

    Shapes (H = heads, B = sequences, T = new tokens, Tk = prefix + new tokens):

    * decode: q ``[B, H, 576]``, latent_new ``[B, 512]``, rope_new ``[B, 64]`` ->
      out ``[B, H, 512]``
    * extend, MLA: q ``[T, H, 576]``, latent_new ``[T, 512]``, rope_new
      ``[T, 64]`` -> out ``[T, H, 512]``, causal within the new tokens
    * extend, MHA: q ``[T, H, 192]``, k ``[Tk, H, 192]``, v ``[Tk, H, 128]``
      ragged by ``kv_indptr`` -> out ``[T, H, 128]`` (bottom-right causal)

    Parameters
    ----------
    config : MLAConfig
    capabilities : Capabilities
        The backend's declaration on this platform.
    **kwargs
        Backend-specific options; the base class accepts none, so a misspelt
        option is an error rather than silently ignored.
    """

    #: Overridden per instance by ``capabilities.backend``.
    name: str = "base"

    def __init__(self, config: MLAConfig, *, capabilities: Capabilities,
                 **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown options "
                            f"{sorted(kwargs)}; see its docstring for the options it takes")
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        self.config = config
        self.capabilities = capabilities
        #: requests already found inside the declaration: the declaration is
        #: frozen, so the eager hot path checks each distinct request once
        self._accepted_requests: set[tuple[object, ...]] = set()
        self.name = capabilities.backend
        self.device = resolve_device(config.device)
        self.forward_metadata: ForwardMetadata | None = None
        self.graph_state: GraphState | None = None
        self._graph_metadata: dict[tuple[Phase, int, int], ForwardMetadata] = {}

    # ------------------------------------------------------------------------------
    # capture mode
    # ------------------------------------------------------------------------------
    def active_graph_mode(self, phase: Phase | str) -> GraphMode:
        """The graph mode the current code runs under, for ``phase``.

        From :func:`attnreg.graph_policy.capture.current_capture`; inside an
        ``eager_break`` region DISABLED.  When a CUDA stream is capturing with
        no ``capturing()`` context, the mode that captures attention in that
        phase is assumed (FULL for decode, BREAKABLE for prefill), so a
        backend that cannot be captured still refuses with a clear error.
        """
        if in_eager_break():
            return GraphMode.DISABLED
        mode = current_capture()
        if mode is not None:
            return mode
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return _DEFAULT_CAPTURE_MODE[_phase(phase)]
        return GraphMode.DISABLED

    def capture_support(self, phase: Phase | str, mode: GraphMode | str) -> CaptureSupport:
        """The declared :class:`CaptureSupport` for (phase, mode)."""
        return self.capabilities.graph_support(phase, mode).capture

    def forward_method_for(self, phase: Phase | str,
                           mode: GraphMode | str | None = None) -> ForwardMethod | None:
        """The forward method this backend pins for ``phase`` under ``mode``.

        Read from the declaration (``GraphModeSupport.pinned_method``), so an
        engine (or the conformance suite) can ask which attention form a
        captured prefill will run before it builds the inputs, instead of
        knowing backend names.  The forward methods refuse any other method
        under that mode (see :meth:`check_graph_mode`).

        Parameters
        ----------
        phase : Phase or str
        mode : GraphMode or str, optional
            Default: the mode the calling code runs under
            (:meth:`active_graph_mode`; DISABLED outside any capture and
            inside an ``eager_break``).

        Returns
        -------
        ForwardMethod or None
            The pinned method; None when nothing is pinned (eager, or a mode
            without pinning): the caller chooses among
            ``capabilities.methods(phase)``, and the MHA companion may run.

        Raises
        ------
        UnsupportedError
            When the declaration marks ``(phase, mode)`` UNSUPPORTED.
        """
        phase = _phase(phase)
        mode = self.active_graph_mode(phase) if mode is None else _graph_mode(mode)
        if mode is GraphMode.DISABLED:
            return None
        support = self.capabilities.graph_support(phase, mode)
        if support.capture.is_unsupported:
            raise UnsupportedError(
                self.name, f"{phase} under {mode} graph capture",
                support.capture.reason or "declared unsupported",
                f"run {phase} eagerly (graph mode disabled) or choose a backend that declares "
                f"{mode} for {phase}; `attnreg compat` shows what each backend declares")
        return support.pinned_method

    def check_graph_mode(self, phase: Phase | str, mode: GraphMode | str,
                         method: ForwardMethod | str | None = None) -> None:
        """Raise UnsupportedError when (phase, mode) or the method under it is not declared.

        A mode the declaration marks UNSUPPORTED is refused; under a mode that
        *pins* a forward method (:meth:`forward_method_for`), any other method
        is refused (the seed-000 rule: a pinned MLA means the MHA companion is
        never captured).
        """
        phase = _phase(phase)
        mode = _graph_mode(mode)
        pinned = self.forward_method_for(phase, mode)
        if method is not None and pinned is not None:
            method = _method(method)
            if method is not pinned:
                raise UnsupportedError(
                    self.name, f"forward method {method} under {mode} capture of {phase}",
                    f"{self.name} pins {pinned} under {phase}/{mode}",
                    f"call forward_extend(..., method=ForwardMethod.{pinned.name})"
                    f" under capture (forward_method_for(phase) says which), or run this "
                    f"batch eagerly")

    # ------------------------------------------------------------------------------
    # eager metadata
    # ------------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan an eager forward of ``batch`` (once per batch, before all layers)."""
        phase = phase_of(batch.forward_mode)
        mode = self.active_graph_mode(phase)
        if mode in ATTENTION_CAPTURE_MODES:
            raise UnsupportedError(
                self.name, "eager metadata under graph capture",
                f"init_forward_metadata was called while {phase} attention is being "
                f"captured in {mode} mode",
                "call init_forward_metadata_capture(bs, num_tokens, batch) before capture")
        self._validate_batch(batch)
        md = ForwardMetadata.from_batch(batch)
        self._init_metadata_impl(md)
        self.forward_metadata = md

    # ------------------------------------------------------------------------------
    # CUDA graphs
    # ------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *,
                              max_seq_len: int | None = None,
                              graph_modes: Mapping[Phase | str, GraphMode | str] | None = None
                              ) -> None:
        """Preallocate the device buffers every captured shape uses (once).

        Parameters
        ----------
        max_bs, max_num_tokens : int
            Largest captured batch and token count (decode: tokens == batch).
        max_seq_len : int, optional
            Longest sequence a replay may carry (default ``config.max_context_len``).
        graph_modes : mapping Phase -> GraphMode, optional
            The modes that will be captured.  Default: the current
            ``capturing()`` mode if any, else every phase whose attention-capturing
            mode (decode FULL, prefill BREAKABLE) the backend supports; at least
            one must be.

        Raises
        ------
        UnsupportedError
            When a requested mode is declared UNSUPPORTED (or none is supported).
        """
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"need 1 <= max_bs <= max_num_tokens, got max_bs={max_bs}, "
                             f"max_num_tokens={max_num_tokens}")
        modes = self._requested_graph_modes(graph_modes)
        max_seq_len = int(max_seq_len or self.config.max_context_len)
        max_pages = -(-max_seq_len // self.config.page_size)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=self.device)

        self.graph_state = GraphState(
            max_bs=max_bs, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            max_pages=max_pages, graph_modes=modes,
            seq_lens=ints(max_bs), prefix_lens=ints(max_bs), extend_lens=ints(max_bs),
            qo_indptr=ints(max_bs + 1), kv_indptr=ints(max_bs + 1),
            page_table=ints(max_bs, max_pages), out_cache_loc=ints(max_num_tokens))
        self._graph_metadata.clear()
        self._init_graph_state_impl(self.graph_state)

    def _requested_graph_modes(self, graph_modes: Mapping[Phase | str, GraphMode | str] | None
                               ) -> dict[Phase, GraphMode]:
        if graph_modes is not None:
            wanted = {_phase(p): _graph_mode(m) for p, m in graph_modes.items()}
        else:
            ctx = current_capture()
            if ctx is not None:
                wanted = {p: ctx for p, ms in VALID_GRAPH_MODES.items() if ctx in ms}
            else:
                supported: dict[Phase, GraphMode] = {}
                reasons = []
                for phase, mode in _DEFAULT_CAPTURE_MODE.items():
                    cap = self.capture_support(phase, mode)
                    if cap.is_unsupported:
                        reasons.append(f"{phase}/{mode}: {cap.reason}")
                    else:
                        supported[phase] = mode
                if not supported:
                    raise UnsupportedError(
                        self.name, "CUDA graph capture", reasons,
                        "run this backend eagerly (graph modes disabled) or choose a backend "
                        "that declares FULL decode or BREAKABLE prefill capture")
                return supported
        out: dict[Phase, GraphMode] = {}
        for phase, mode in wanted.items():
            self.check_graph_mode(phase, mode)  # type: ignore[arg-type]
            if mode is not GraphMode.DISABLED:
                out[phase] = mode  # type: ignore[assignment]
        return out

    def init_forward_metadata_capture(self, bs: int, num_tokens: int,
                                      batch: ForwardBatch | None = None,
                                      forward_mode: ForwardMode | str | None = None) -> None:
        """Bind the graph buffers for one captured shape; call it *before* capturing.

        Parameters
        ----------
        bs, num_tokens : int
            The captured shape: q has ``bs`` (decode) or ``num_tokens`` (extend) rows.
        batch : ForwardBatch, optional
            A representative batch that fits the shape (padded up to it).  None:
            a dummy batch whose tokens live in the reserved padding page.
        forward_mode : ForwardMode, optional
            Default: the batch's mode, or DECODE.

        After this, ``forward_decode`` / ``forward_extend`` (with this batch or
        None) record launches that read the graph buffers, so a later
        :meth:`init_forward_metadata_replay` can change lengths and contents.
        """
        state = self._require_graph_state()
        fmode = _forward_mode(forward_mode) if forward_mode is not None else (
            batch.forward_mode if batch is not None else ForwardMode.DECODE)
        phase = phase_of(fmode)
        mode = current_capture() or state.graph_modes.get(phase) or _DEFAULT_CAPTURE_MODE[phase]
        self.check_graph_mode(phase, mode)
        if phase not in state.graph_modes:
            raise UnsupportedError(
                self.name, f"{phase} capture", "init_cuda_graph_state was called for "
                f"{sorted(str(p) for p in state.graph_modes)} only",
                f"pass graph_modes={{'{phase}': '{mode}'}} to init_cuda_graph_state")
        if bs < 1 or bs > state.max_bs or num_tokens > state.max_num_tokens or num_tokens < 1:
            raise UnsupportedError(
                self.name, f"captured shape bs={bs}, num_tokens={num_tokens}",
                f"init_cuda_graph_state sized the buffers for max_bs={state.max_bs}, "
                f"max_num_tokens={state.max_num_tokens}",
                "call init_cuda_graph_state with larger bounds")
        if phase is Phase.DECODE and num_tokens != bs:
            raise UnsupportedError(self.name, f"decode capture with num_tokens={num_tokens}",
                                   f"a decode batch has one token per sequence (bs={bs})",
                                   "pass num_tokens=bs")
        if batch is None:
            batch = self._dummy_batch(fmode, bs, num_tokens)
        self._validate_batch(batch)
        md = self._graph_views(fmode, bs, num_tokens, _graph_mode(mode))
        self._fill_graph_buffers(md, batch)
        self._init_capture_impl(md)
        self._graph_metadata[(phase, bs, num_tokens)] = md
        self.forward_metadata = md

    def init_forward_metadata_replay(self, bs: int, num_tokens: int, batch: ForwardBatch,
                                     forward_mode: ForwardMode | str | None = None) -> None:
        """Copy ``batch`` into the graph buffers of the captured shape ``(bs, num_tokens)``.

        Call it outside the graph, before ``graph.replay()``.  The batch may be
        smaller than the captured shape: missing sequences get length 0 and
        missing tokens write to the reserved padding slot.

        Raises
        ------
        UnsupportedError
            When no graph was captured for the shape, or the batch does not fit.
        """
        fmode = _forward_mode(forward_mode) if forward_mode is not None \
            else batch.forward_mode
        phase = phase_of(fmode)
        md = self._graph_metadata.get((phase, bs, num_tokens))
        if md is None:
            have = sorted((str(p), b, t) for p, b, t in self._graph_metadata)
            raise UnsupportedError(self.name, f"replay of {phase} bs={bs}, "
                                   f"num_tokens={num_tokens}",
                                   f"no graph metadata was captured for it (captured: {have})",
                                   "call init_forward_metadata_capture for this shape first")
        self._validate_batch(batch)
        self._fill_graph_buffers(md, batch)
        self._init_replay_impl(md, batch)
        self.forward_metadata = md

    def _require_graph_state(self) -> GraphState:
        if self.graph_state is None:
            raise UnsupportedError(self.name, "graph capture before init_cuda_graph_state",
                                   "the graph buffers are not allocated",
                                   "call init_cuda_graph_state(max_bs, max_num_tokens) first")
        return self.graph_state

    def _dummy_batch(self, fmode: ForwardMode, bs: int, num_tokens: int) -> ForwardBatch:
        state = self._require_graph_state()
        if fmode is ForwardMode.DECODE:
            extend = [1] * bs
        else:
            extend = [num_tokens // bs] * bs
            extend[0] += num_tokens - sum(extend)
        ps = self.config.page_size
        # Every token sits in the reserved padding page (the page table is all zeros).
        loc = [PADDING_PAGE * ps + t % ps for e in extend for t in range(e)]
        table = torch.full((bs, state.max_pages), PADDING_PAGE, dtype=torch.int32,
                           device=self.device)
        return ForwardBatch.build(fmode, [0] * bs, extend, table, loc)

    def _graph_views(self, fmode: ForwardMode, bs: int, num_tokens: int,
                     mode: GraphMode) -> ForwardMetadata:
        s = self._require_graph_state()
        return ForwardMetadata(
            forward_mode=fmode, batch_size=bs, num_tokens=num_tokens,
            seq_lens=s.seq_lens[:bs], prefix_lens=s.prefix_lens[:bs],
            extend_lens=s.extend_lens[:bs], qo_indptr=s.qo_indptr[:bs + 1],
            kv_indptr=s.kv_indptr[:bs + 1], page_table=s.page_table[:bs],
            out_cache_loc=s.out_cache_loc[:num_tokens], max_seq_len=s.max_seq_len,
            max_extend_len=1 if fmode is ForwardMode.DECODE else num_tokens,
            graph_mode=mode)

    def _fill_graph_buffers(self, md: ForwardMetadata, batch: ForwardBatch) -> None:
        s = self._require_graph_state()
        bs, nt = md.batch_size, md.num_tokens
        b, t = batch.batch_size, batch.num_tokens
        problems = []
        if phase_of(batch.forward_mode) is not md.phase:
            problems.append(f"batch is {batch.forward_mode}, the graph was captured for "
                            f"{md.forward_mode}")
        if b > bs or t > nt:
            problems.append(f"batch has {b} sequences / {t} tokens, the graph {bs} / {nt}")
        if batch.max_seq_len > s.max_seq_len:
            problems.append(f"longest sequence {batch.max_seq_len} exceeds the capture bound "
                            f"max_seq_len={s.max_seq_len}")
        if problems:
            raise UnsupportedError(self.name, "batch for this captured graph", problems,
                                   "pad it to a captured shape or run it eagerly")
        cols = min(batch.page_table.shape[1], s.max_pages)
        s.seq_lens[:b].copy_(batch.seq_lens)
        s.seq_lens[b:bs].zero_()
        s.prefix_lens[:b].copy_(batch.prefix_lens)
        s.prefix_lens[b:bs].zero_()
        s.extend_lens[:b].copy_(batch.extend_lens)
        s.extend_lens[b:bs].zero_()
        s.qo_indptr[:b + 1].copy_(batch.qo_indptr)
        s.qo_indptr[b + 1:bs + 1].fill_(t)
        s.kv_indptr[:b + 1].copy_(batch.kv_indptr)
        s.kv_indptr[b + 1:bs + 1].fill_(batch.num_kv_tokens)
        s.page_table[:bs].fill_(PADDING_PAGE)
        s.page_table[:b, :cols].copy_(batch.page_table[:, :cols])
        s.out_cache_loc[:t].copy_(batch.out_cache_loc)
        s.out_cache_loc[t:nt].fill_(PADDING_PAGE * self.config.page_size)
        md.batch = batch

    # ------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                rope_new: torch.Tensor | None, pool: MLAKVPool | None,
                batch: ForwardBatch | None = None, **kwargs: Any) -> torch.Tensor:
        """Dispatch on the batch's forward mode, like sglang's ``forward``."""
        md = self._metadata_for(batch)
        if md.forward_mode is ForwardMode.DECODE:
            if pool is None:
                raise UnsupportedError(self.name, "decode without a KV pool",
                                       "decode attends over the paged pool", "pass the pool")
            return self.forward_decode(q, latent_new, rope_new, pool, batch, **kwargs)
        return self.forward_extend(q, latent_new, rope_new, pool, batch, **kwargs)

    def forward_decode(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool,
                       batch: ForwardBatch | None = None, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Write each sequence's new token into ``pool``, then attend (absorbed MLA).

        Parameters
        ----------
        q : Tensor [B, H, 576]
        latent_new, rope_new : Tensor [B, 512] and [B, 64], or None
            The new tokens' cache rows, written at ``batch.out_cache_loc``; None
            when the caller has written them already.
        pool : MLAKVPool
        batch : ForwardBatch, optional
            Eager: the batch (metadata is planned if it was not).  Under capture:
            the batch given to ``init_forward_metadata_capture``, or None.
        out : Tensor [B, H, 512], optional
            Output buffer (default: a new tensor of q's dtype).
        """
        md = self._metadata_for(batch)
        if md.forward_mode is not ForwardMode.DECODE:
            raise UnsupportedError(self.name, "forward_decode on an extend batch",
                                   f"the metadata is for {md.forward_mode}",
                                   "call forward_extend for extend batches")
        mode = self.active_graph_mode(Phase.DECODE)
        if mode is not GraphMode.DISABLED:  # eager pins nothing: nothing to check
            self.check_graph_mode(Phase.DECODE, mode, ForwardMethod.MLA)
        self._check_declared(ForwardMethod.MLA, Phase.DECODE, q, (q.shape[-1], pool.kv_lora_rank),
                             kv_dtype=pool.kv_dtype, page_size=pool.page_size)
        self._check_pool(pool)
        self._check_q(q, md.batch_size, self.config.kv_row_dim, "q")
        self._check_new_rows(latent_new, rope_new, md.num_tokens, pool)
        out = self._output(out, q, (md.batch_size, q.shape[1], self.config.kv_lora_rank))
        if latent_new is not None and rope_new is not None:
            self._write_kv(pool, md, latent_new, rope_new)
        self._forward_decode_impl(q, pool, md, out)
        return out

    def forward_extend(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool | None,
                       batch: ForwardBatch | None = None, *,
                       method: ForwardMethod | str = ForwardMethod.MLA,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Write the new tokens into ``pool`` (when given), then attend.

        Parameters
        ----------
        q : Tensor
            MLA: ``[T, H, 576]``; MHA: ``[T, H, 192]``.
        latent_new, rope_new : Tensor [T, 512], [T, 64], or None
            Written at ``batch.out_cache_loc`` (the MHA method writes them too, so
            later decode steps see the tokens).  None: already written.
        pool : MLAKVPool or None
            Required for MLA (it attends over the pool) and for writing.
        method : ForwardMethod
            MLA (absorbed, over the paged pool) or MHA (ragged ``k`` / ``v``).
        k, v : Tensor [Tk, H, 192], [Tk, H, 128]
            MHA only: prefix plus new tokens of every sequence, ragged by
            ``kv_indptr``.
        out : Tensor, optional
            ``[T, H, 512]`` (MLA) or ``[T, H, 128]`` (MHA).
        """
        method = _method(method)
        md = self._metadata_for(batch)
        if md.forward_mode is ForwardMode.DECODE:
            raise UnsupportedError(self.name, "forward_extend on a decode batch",
                                   "the metadata is for decode",
                                   "call forward_decode for decode batches")
        mode = self.active_graph_mode(Phase.PREFILL)
        if mode is not GraphMode.DISABLED:  # eager pins nothing: nothing to check
            self.check_graph_mode(Phase.PREFILL, mode, method)
        if method is ForwardMethod.MLA:
            if pool is None:
                raise UnsupportedError(self.name, "MLA extend without a KV pool",
                                       "absorbed MLA attends over the paged pool",
                                       "pass the pool")
            self._check_declared(method, Phase.PREFILL, q, (q.shape[-1], pool.kv_lora_rank),
                                 kv_dtype=pool.kv_dtype, page_size=pool.page_size)
            self._check_pool(pool)
            self._check_q(q, md.num_tokens, self.config.kv_row_dim, "q")
            v_dim = self.config.kv_lora_rank
        else:
            if k is None or v is None:
                raise UnsupportedError(self.name, f"{method} extend without k and v",
                                       "the MHA method attends over ragged k / v",
                                       "pass k=[Tk, H, 192] and v=[Tk, H, 128]")
            kv_dt = dtype_from_torch(k.dtype)
            if kv_dt is None:
                raise UnsupportedError(self.name, f"{method} k dtype",
                                       f"k dtype {k.dtype} has no attnreg name",
                                       "use bf16, fp16 or fp32 k / v")
            self._check_declared(method, Phase.PREFILL, q, (q.shape[-1], v.shape[-1]),
                                 kv_dtype=kv_dt)
            qk_dim, v_dim = self.config.mha_head_dims
            self._check_q(q, md.num_tokens, qk_dim, "q")
            self._check_ragged_kv(q, k, v, md)
            if pool is not None:
                self._check_pool(pool)
        if latent_new is not None or rope_new is not None:
            if pool is None:
                raise UnsupportedError(self.name, "KV write without a pool",
                                       "latent_new / rope_new were given but pool is None",
                                       "pass the pool, or None for latent_new and rope_new")
            self._check_new_rows(latent_new, rope_new, md.num_tokens, pool)
        out = self._output(out, q, (md.num_tokens, q.shape[1], v_dim))
        if pool is not None and latent_new is not None and rope_new is not None:
            self._write_kv(pool, md, latent_new, rope_new)
        self._forward_extend_impl(q, pool, md, out, method=method, k=k, v=v)
        return out

    # ------------------------------------------------------------------------------
    # hooks for subclasses
    # ------------------------------------------------------------------------------
    def _init_metadata_impl(self, md: ForwardMetadata) -> None:
        """Plan an eager batch (host values allowed); store results in ``md.extras``."""

    def _init_graph_state_impl(self, state: GraphState) -> None:
        """Preallocate backend buffers (workspaces) for graphs up to ``state``'s bounds."""

    def _init_capture_impl(self, md: ForwardMetadata) -> None:
        """Bind preallocated buffers of one captured shape into ``md.extras``."""

    def _init_replay_impl(self, md: ForwardMetadata, batch: ForwardBatch) -> None:
        """Per-replay host planning into existing buffers (runs outside the graph)."""

    def _write_kv(self, pool: MLAKVPool, md: ForwardMetadata, latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        """Write new tokens' rows at ``md.out_cache_loc`` (override for a fused kernel)."""
        pool.write(md.out_cache_loc, latent_new, rope_new)

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool, md: ForwardMetadata,
                             out: torch.Tensor) -> None:
        """Absorbed decode into ``out`` [B, H, 512]; new tokens are already in ``pool``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement decode")

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata, out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        """Extend attention into ``out``; for MLA the new tokens are already in ``pool``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extend")

    def kernel_errors(self, what: str) -> KernelErrors:
        """Turn a kernel library's pre-launch ``ValueError`` into :class:`UnsupportedError`.

        Use as ``with self.kernel_errors("decode inputs"): launch(...)``.
        """
        return KernelErrors(self.name, what, _KERNEL_ERRORS_HINT)

    # ------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------
    def _metadata_for(self, batch: ForwardBatch | None) -> ForwardMetadata:
        md = self.forward_metadata
        if batch is not None and (md is None or md.batch is not batch):
            phase = phase_of(batch.forward_mode)
            if self.active_graph_mode(phase) in ATTENTION_CAPTURE_MODES:
                raise UnsupportedError(
                    self.name, "forward on an unplanned batch under capture",
                    "this batch is not the one given to init_forward_metadata_capture",
                    "pass that batch (or None) to forward_* while capturing")
            self.init_forward_metadata(batch)
            md = self.forward_metadata
        if md is None:
            raise UnsupportedError(self.name, "forward without metadata",
                                   "no batch was given and none was planned",
                                   "call init_forward_metadata(batch) or pass batch=")
        return md

    def _check_declared(self, method: ForwardMethod, phase: Phase, q: torch.Tensor,
                        head_dims: tuple[int, int], *, kv_dtype: DType | str,
                        page_size: int | None = None) -> None:
        # The cache is keyed on the raw request (torch dtype, kv dtype as given), so an
        # accepted request costs one tuple and one set lookup per forward.
        key = None
        if q.dim() == 3:
            key = (method, phase, tuple(head_dims), q.dtype, kv_dtype, page_size, q.shape[1])
            if key in self._accepted_requests:
                return
        q_dt = dtype_from_torch(q.dtype)
        if q_dt is None:
            raise UnsupportedError(self.name, f"{method} {phase} query dtype",
                                   f"q dtype {q.dtype} has no attnreg name",
                                   "use bf16, fp16 or fp32 queries")
        if key is None:
            raise UnsupportedError(self.name, f"{method} {phase} query shape",
                                   f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}",
                                   "reshape q to 3-d")
        reasons = self.capabilities.check_request(
            method, phase, head_dims=head_dims, q_dtype=q_dt, kv_dtype=kv_dtype,
            page_size=page_size, num_heads=q.shape[1])
        if reasons:
            raise UnsupportedError(self.name, f"{method} {phase} request", reasons)
        self._accepted_requests.add(key)

    def _validate_batch(self, batch: ForwardBatch) -> None:
        problems = []
        seq, pre, ext = batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu
        b, t = len(seq), sum(ext)
        want_shape = {"seq_lens": (b,), "prefix_lens": (b,), "extend_lens": (b,),
                      "qo_indptr": (b + 1,), "kv_indptr": (b + 1,), "out_cache_loc": (t,)}
        for name in _INDEX_FIELDS:
            tensor = getattr(batch, name)
            if tensor.dtype != torch.int32:
                problems.append(f"{name} is {tensor.dtype}; index tensors must be int32 "
                                "(convert once with .to(torch.int32) outside the hot path)")
            if tensor.device != self.device:
                problems.append(f"{name} is on {tensor.device}, the backend on {self.device}")
            if name in want_shape and tuple(tensor.shape) != want_shape[name]:
                problems.append(f"{name} has shape {tuple(tensor.shape)}, expected "
                                f"{want_shape[name]}")
        pt = batch.page_table
        if pt.dim() != 2 or pt.shape[0] != b:
            problems.append(f"page_table has shape {tuple(pt.shape)}, expected [{b}, pages]")
        elif pt.shape[1] * self.config.page_size < max(seq, default=0):
            problems.append(f"page_table has {pt.shape[1]} pages of {self.config.page_size} "
                            f"per sequence, too few for {max(seq, default=0)} tokens")
        # map() keeps the per-sequence comparison out of Python bytecode (B can be 100s).
        if len(pre) != b or len(ext) != b or any(
                map(operator.ne, seq, map(operator.add, pre, ext))):
            problems.append("host lengths disagree: seq_lens must equal prefix_lens + "
                            "extend_lens")
        if problems:
            raise UnsupportedError(self.name, "batch", problems,
                                   "build batches with decode_batch() / extend_batch()")

    def _check_pool(self, pool: MLAKVPool) -> None:
        problems = []
        if pool.page_size != self.config.page_size:
            problems.append(f"pool page size {pool.page_size} != config page size "
                            f"{self.config.page_size}")
        if pool.row_dim != self.config.kv_row_dim or pool.kv_lora_rank != \
                self.config.kv_lora_rank:
            problems.append(f"pool rows are {pool.kv_lora_rank}+{pool.rope_dim}, the config "
                            f"{self.config.kv_lora_rank}+{self.config.qk_rope_head_dim}")
        if pool.device != self.device:
            problems.append(f"pool is on {pool.device}, the backend on {self.device}")
        if problems:
            raise UnsupportedError(self.name, "KV pool", problems,
                                   "build the pool with config.make_pool(num_pages)")

    def _check_q(self, q: torch.Tensor, rows: int, dim: int, name: str) -> None:
        want = (rows, self.config.num_heads, dim)
        problems = []
        if tuple(q.shape) != want:
            problems.append(f"{name} has shape {tuple(q.shape)}, expected {want}")
        if q.device != self.device:
            problems.append(f"{name} is on {q.device}, the backend on {self.device}")
        if problems:
            raise UnsupportedError(self.name, f"{name} tensor", problems,
                                   "see the shapes in AttentionBackend's docstring")

    def _check_new_rows(self, latent: torch.Tensor | None, rope: torch.Tensor | None,
                        rows: int, pool: MLAKVPool) -> None:
        if (latent is None) != (rope is None):
            raise UnsupportedError(self.name, "KV write", "latent_new and rope_new go together",
                                   "pass both or neither")
        if latent is None or rope is None:
            return
        problems = []
        if tuple(latent.shape) != (rows, pool.kv_lora_rank):
            problems.append(f"latent_new has shape {tuple(latent.shape)}, expected "
                            f"{(rows, pool.kv_lora_rank)}")
        if tuple(rope.shape) != (rows, pool.rope_dim):
            problems.append(f"rope_new has shape {tuple(rope.shape)}, expected "
                            f"{(rows, pool.rope_dim)}")
        if problems:
            raise UnsupportedError(self.name, "new KV rows", problems,
                                   "one latent and one rope row per new token")

    def _check_ragged_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         md: ForwardMetadata) -> None:
        qk_dim, v_dim = self.config.mha_head_dims
        heads = self.config.num_heads
        problems = []
        if k.dim() != 3 or tuple(k.shape[1:]) != (heads, qk_dim):
            problems.append(f"k has shape {tuple(k.shape)}, expected [Tk, {heads}, {qk_dim}]")
        if v.dim() != 3 or tuple(v.shape[1:]) != (heads, v_dim):
            problems.append(f"v has shape {tuple(v.shape)}, expected [Tk, {heads}, {v_dim}]")
        if k.shape[0] != v.shape[0]:
            problems.append(f"k has {k.shape[0]} rows, v {v.shape[0]}")
        if md.num_kv_tokens is not None and k.shape[0] != md.num_kv_tokens:
            problems.append(f"k / v have {k.shape[0]} rows, the batch has "
                            f"{md.num_kv_tokens} prefix + new tokens")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            problems.append(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        if k.device != self.device or v.device != self.device:
            problems.append(f"k / v are on {k.device} / {v.device}, the backend on "
                            f"{self.device}")
        if problems:
            raise UnsupportedError(self.name, "ragged MHA k / v", problems,
                                   "k and v cover prefix + new tokens, ragged by kv_indptr")

    def _output(self, out: torch.Tensor | None, q: torch.Tensor,
                shape: tuple[int, int, int]) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=q.dtype, device=q.device)
        if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
            raise UnsupportedError(self.name, "out tensor",
                                   f"got {tuple(out.shape)} {out.dtype} on {out.device}, "
                                   f"expected {shape} {q.dtype} on {q.device}",
                                   "pass out=None to get a new tensor")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, heads={self.config.num_heads}, "
                f"page_size={self.config.page_size}, kv_dtype={self.config.kv_dtype}, "
                f"device={self.device})")
