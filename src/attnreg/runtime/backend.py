"""The lifecycle every attention backend follows (modelled on sglang's ``AttentionBackend``).

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
              forward_* captured by a GraphRunner                      before capture
              init_forward_metadata_replay(bs, num_tokens, batch)      before each replay
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic

import torch

from attnreg.graph_policy.capture import current_capture, in_eager_break
from attnreg.registry import (
    VALID_GRAPH_MODES,
    Capabilities,
    CaptureShape,
    CaptureSupport,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    UnsupportedError,
)

from . import validation
from .batch import ForwardBatch
from .config import MLAConfig
from .dtypes import device_num_sms, dtype_from_torch, resolve_device
from .errors import KernelErrors
from .graph_buffers import BuffersT, GraphState, tensor_bytes
from .metadata import (
    ATTENTION_CAPTURE_MODES,
    DEFAULT_CAPTURE_MODE,
    ForwardMetadata,
    PlanT,
    phase_of,
)
from .pool import MLAKVPool

__all__ = ["AttentionBackend"]


class AttentionBackend(Generic[PlanT, BuffersT]):
    """Base class of MLA attention backends.

    Constructed by ``BackendRegistry.create(name, config)`` as
    ``cls(config, capabilities=caps, **kwargs)``.  Subclasses implement
    :meth:`_forward_decode_impl` and :meth:`_forward_extend_impl` and may
    override the planning hooks :meth:`_init_metadata_impl`,
    :meth:`_init_graph_state_impl`, :meth:`_init_capture_impl`,
    :meth:`_init_replay_impl` and :meth:`_write_kv`.  By the time a hook runs
    the request has been checked against ``self.capabilities``, the capture
    mode and the shapes below.

    Typed state: ``PlanT`` is the dataclass a backend plans per batch
    (``md.plan``), ``BuffersT`` the dataclass of its graph buffers
    (``graph_state.buffers``); e.g. ``class TritonMLABackend(
    AttentionBackend[TritonPlan, TritonGraphBuffers])``.

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
        self.forward_metadata: ForwardMetadata[PlanT] | None = None
        self.graph_state: GraphState[BuffersT] | None = None
        self._graph_metadata: dict[tuple[Phase, int, int], ForwardMetadata[PlanT]] = {}

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
            return DEFAULT_CAPTURE_MODE[Phase.parse(phase)]
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
        phase = Phase.parse(phase)
        mode = self.active_graph_mode(phase) if mode is None else GraphMode.parse(mode)
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
        phase = Phase.parse(phase)
        mode = GraphMode.parse(mode)
        pinned = self.forward_method_for(phase, mode)
        if method is not None and pinned is not None:
            method = ForwardMethod.parse(method)
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
        md: ForwardMetadata[PlanT] = ForwardMetadata.from_batch(batch)
        self._init_metadata_impl(md)
        self.forward_metadata = md

    # ------------------------------------------------------------------------------
    # graphs
    # ------------------------------------------------------------------------------
    def capture_shape(self, max_bs: int, max_num_tokens: int, max_seq_len: int
                      ) -> CaptureShape:
        """The :class:`~attnreg.registry.CaptureShape` of graph buffers for these bounds.

        What ``init_cuda_graph_state`` sizes the backend's buffers from, and what
        its declared ``CaptureMemory.estimate`` is asked about: this rank's heads,
        page size, KV dtype and the device's multiprocessor count (0 off CUDA).
        """
        return CaptureShape(max_batch_size=max_bs, max_num_tokens=max_num_tokens,
                            max_seq_len=max_seq_len, num_heads=self.config.num_heads,
                            page_size=self.config.page_size,
                            kv_dtype=DType.parse(self.config.kv_dtype),
                            num_sms=device_num_sms(self.device) or 0)

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
            one must be.  A backend allocates buffers only for the modes named.

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
        state: GraphState[BuffersT] = GraphState.allocate(
            max_bs=max_bs, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            page_size=self.config.page_size, graph_modes=modes,
            capture_shape=self.capture_shape(max_bs, max_num_tokens, max_seq_len),
            device=self.device)
        self.graph_state = state
        self._graph_metadata.clear()
        self._init_graph_state_impl(state)

    def _requested_graph_modes(self, graph_modes: Mapping[Phase | str, GraphMode | str] | None
                               ) -> dict[Phase, GraphMode]:
        if graph_modes is not None:
            wanted = {Phase.parse(p): GraphMode.parse(m) for p, m in graph_modes.items()}
        else:
            ctx = current_capture()
            if ctx is not None:
                wanted = {p: ctx for p, ms in VALID_GRAPH_MODES.items() if ctx in ms}
            else:
                supported: dict[Phase, GraphMode] = {}
                reasons = []
                for phase, mode in DEFAULT_CAPTURE_MODE.items():
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
            self.check_graph_mode(phase, mode)
            if mode is not GraphMode.DISABLED:
                out[phase] = mode
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
        fmode = ForwardMode.parse(forward_mode) if forward_mode is not None else (
            batch.forward_mode if batch is not None else ForwardMode.DECODE)
        phase = phase_of(fmode)
        mode = current_capture() or state.graph_modes.get(phase) or DEFAULT_CAPTURE_MODE[phase]
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
            batch = state.dummy_batch(fmode, bs, num_tokens, self.config.page_size, self.device)
        self._validate_batch(batch)
        md: ForwardMetadata[PlanT] = state.views(fmode, bs, num_tokens, mode)
        self._fill_graph_buffers(state, md, batch)
        self._init_capture_impl(md)
        self._graph_metadata[(phase, bs, num_tokens)] = md
        self.forward_metadata = md

    def init_forward_metadata_replay(self, bs: int, num_tokens: int, batch: ForwardBatch,
                                     forward_mode: ForwardMode | str | None = None) -> None:
        """Copy ``batch`` into the graph buffers of the captured shape ``(bs, num_tokens)``.

        Call it outside the graph, before the replay.  The batch may be smaller
        than the captured shape: missing sequences get length 0, missing tokens
        write to the reserved padding slot, and the output rows of padding are
        zero after the replay.

        Raises
        ------
        UnsupportedError
            When no graph was captured for the shape, or the batch does not fit.
        """
        fmode = ForwardMode.parse(forward_mode) if forward_mode is not None \
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
        self._fill_graph_buffers(self._require_graph_state(), md, batch)
        self._init_replay_impl(md, batch)
        self.forward_metadata = md

    def captured_metadata(self) -> list[ForwardMetadata[PlanT]]:
        """The metadata of every shape captured since ``init_cuda_graph_state``."""
        return list(self._graph_metadata.values())

    def graph_buffer_bytes(self) -> int:
        """Bytes of the tensors this backend holds for graphs (its buffers and captured plans).

        Not counting the runtime's own index buffers (``GraphState.base_bytes``).
        Read from the typed state, so it also works where no device allocator can
        be asked (the conformance suite's ``capture_memory`` claim on cpu).
        """
        state = self.graph_state
        if state is None:
            return 0
        return tensor_bytes(state.buffers, *(md.plan for md in self._graph_metadata.values()))

    def zero_padded_rows(self, out: torch.Tensor, md: ForwardMetadata[PlanT]) -> None:
        """Under graph metadata, zero the output rows of padding (capture-safe; else a no-op).

        For backends whose kernels leave rows beyond the replayed batch untouched
        or fill them with work on padding (see ``GraphState.zero_padded_rows``).
        """
        if md.is_graph and self.graph_state is not None:
            self.graph_state.zero_padded_rows(out, md)

    def _require_graph_state(self) -> GraphState[BuffersT]:
        if self.graph_state is None:
            raise UnsupportedError(self.name, "graph capture before init_cuda_graph_state",
                                   "the graph buffers are not allocated",
                                   "call init_cuda_graph_state(max_bs, max_num_tokens) first")
        return self.graph_state

    def _require_buffers(self) -> BuffersT:
        buffers = self._require_graph_state().buffers
        if buffers is None:
            raise UnsupportedError(self.name, "graph buffers of this backend",
                                   "init_cuda_graph_state allocated none for the modes asked",
                                   "pass the captured phase in graph_modes= of "
                                   "init_cuda_graph_state")
        return buffers

    def _fill_graph_buffers(self, state: GraphState[BuffersT], md: ForwardMetadata[PlanT],
                            batch: ForwardBatch) -> None:
        problems = state.fit_problems(md, batch)
        if problems:
            raise UnsupportedError(self.name, "batch for this captured graph", problems,
                                   "pad it to a captured shape or run it eagerly")
        state.fill(md, batch, self.config.page_size)

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
        self._raise_if("KV pool", validation.pool_problems(pool, self.config, self.device),
                       "build the pool with config.make_pool(num_pages)")
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
        method = ForwardMethod.parse(method)
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
            self._raise_if("KV pool", validation.pool_problems(pool, self.config, self.device),
                           "build the pool with config.make_pool(num_pages)")
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
            self._raise_if("ragged MHA k / v",
                           validation.ragged_kv_problems(q, k, v, self.config, md.num_kv_tokens,
                                                         self.device),
                           "k and v cover prefix + new tokens, ragged by kv_indptr")
            if pool is not None:
                self._raise_if("KV pool",
                               validation.pool_problems(pool, self.config, self.device),
                               "build the pool with config.make_pool(num_pages)")
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
    def _init_metadata_impl(self, md: ForwardMetadata[PlanT]) -> None:
        """Plan an eager batch (host values allowed); set ``md.plan``."""

    def _init_graph_state_impl(self, state: GraphState[BuffersT]) -> None:
        """Preallocate backend buffers for graphs up to ``state``'s bounds into ``state.buffers``.

        Size them from ``state.capture_shape`` with the same function the
        declaration's ``CaptureMemory`` uses, for the modes in ``state.graph_modes``.
        """

    def _init_capture_impl(self, md: ForwardMetadata[PlanT]) -> None:
        """Bind views of the preallocated buffers for one captured shape into ``md.plan``."""

    def _init_replay_impl(self, md: ForwardMetadata[PlanT], batch: ForwardBatch) -> None:
        """Per-replay host planning into existing buffers (runs outside the graph)."""

    def _write_kv(self, pool: MLAKVPool, md: ForwardMetadata[PlanT], latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        """Write new tokens' rows at ``md.out_cache_loc`` (override for a fused kernel)."""
        pool.write(md.out_cache_loc, latent_new, rope_new)

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool,
                             md: ForwardMetadata[PlanT], out: torch.Tensor) -> None:
        """Absorbed decode into ``out`` [B, H, 512]; new tokens are already in ``pool``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement decode")

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata[PlanT], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        """Extend attention into ``out``; for MLA the new tokens are already in ``pool``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extend")

    def kernel_errors(self, what: str) -> KernelErrors:
        """Turn a kernel library's pre-launch ``ValueError`` into :class:`UnsupportedError`.

        Use as ``with self.kernel_errors("decode inputs"): launch(...)``.
        """
        return KernelErrors(self.name, what)

    # ------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------
    def _raise_if(self, what: str, problems: list[str], hint: str) -> None:
        if problems:
            raise UnsupportedError(self.name, what, problems, hint)

    def _metadata_for(self, batch: ForwardBatch | None) -> ForwardMetadata[PlanT]:
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
        self._raise_if("batch", validation.batch_problems(batch, self.device,
                                                          self.config.page_size),
                       "build batches with decode_batch() / extend_batch()")

    def _check_q(self, q: torch.Tensor, rows: int, dim: int, name: str) -> None:
        self._raise_if(f"{name} tensor",
                       validation.query_problems(q, (rows, self.config.num_heads, dim),
                                                 self.device, name),
                       "see the shapes in AttentionBackend's docstring")

    def _check_new_rows(self, latent: torch.Tensor | None, rope: torch.Tensor | None,
                        rows: int, pool: MLAKVPool) -> None:
        problems = validation.new_rows_problems(latent, rope, rows, pool)
        if problems and (latent is None) != (rope is None):
            raise UnsupportedError(self.name, "KV write", "latent_new and rope_new go together",
                                   "pass both or neither")
        self._raise_if("new KV rows", problems, "one latent and one rope row per new token")

    def _output(self, out: torch.Tensor | None, q: torch.Tensor,
                shape: tuple[int, int, int]) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=q.dtype, device=q.device)
        self._raise_if("out tensor", validation.output_problems(out, q, shape),
                       "pass out=None to get a new tensor")
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, heads={self.config.num_heads}, "
                f"page_size={self.config.page_size}, kv_dtype={self.config.kv_dtype}, "
                f"device={self.device})")
