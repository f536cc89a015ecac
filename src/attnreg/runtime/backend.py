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

import dataclasses
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
from .batch import SPECULATIVE_MODES, ForwardBatch, PrefixChunk
from .config import MLAConfig
from .dtypes import device_num_sms, dtype_from_torch, resolve_device
from .errors import KernelErrors
from .graph_buffers import BuffersT, GraphState, tensor_bytes
from .lse import PrefixDecompress, merge_attention_states
from .metadata import (
    ATTENTION_CAPTURE_MODES,
    DEFAULT_CAPTURE_MODE,
    ForwardMetadata,
    PlanT,
    phase_of,
)
from .pool import MLAKVLayer, MLAKVPool

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

    Raises
    ------
    UnsupportedError
        When ``config.page_size`` is a page size none of the backend's kernels
        that read the paged pool declares
        (:func:`~attnreg.runtime.validation.page_size_problems`).  Everything
        else of a request (heads, dtypes, head dims, method, capture mode) is
        checked at each forward, before any launch.
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
        self.name = capabilities.backend
        #: requests already found inside the declaration: the declaration is
        #: frozen, so the eager hot path checks each distinct request once
        self._accepted_requests: set[tuple[object, ...]] = set()
        self._lse_caps: Capabilities | None = None
        self.device = resolve_device(config.device)
        self.forward_metadata: ForwardMetadata[PlanT] | None = None
        self.graph_state: GraphState[BuffersT] | None = None
        #: captured shapes: (forward mode, bs, num_tokens) -> their graph metadata
        self._graph_metadata: dict[tuple[ForwardMode, int, int], ForwardMetadata[PlanT]] = {}
        #: (forward mode, graph mode, query tokens) already found served by the declaration
        self._served: set[tuple[ForwardMode, GraphMode, int | None]] = set()
        # Refused here, not at the first forward: every forward of this backend reads a
        # pool of config.page_size, so a page size none of its paged kernels declares
        # could only fail later (before the subclass imports its kernel library).
        self._raise_if("page size",
                       validation.page_size_problems(config.page_size, capabilities),
                       "build the MLAConfig with a page size the backend declares "
                       "(`attnreg backends --json` lists them), or choose a backend that "
                       "declares this one")

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
            The captured shape: q has ``bs`` (decode) or ``num_tokens`` (extend,
            target verify, draft extend) rows.  Speculative shapes are captured
            in the decode phase with ``num_tokens = bs * draft tokens``: a
            TARGET_VERIFY graph serves exactly that many tokens per sequence, a
            DRAFT_EXTEND graph 1 up to that many.
        batch : ForwardBatch, optional
            A representative batch that fits the shape (padded up to it).  None:
            a dummy batch whose tokens live in the reserved padding page.
        forward_mode : ForwardMode, optional
            Default: the batch's mode, or DECODE.  Graphs are kept per (forward
            mode, bs, num_tokens): a decode and a verify graph of one batch size
            are two shapes.

        Raises
        ------
        UnsupportedError
            When the declaration does not serve ``forward_mode`` under the
            phase's graph mode (``GraphModeSupport.forward_modes``) with that
            many tokens per sequence, or the shape exceeds the graph state.

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
        if fmode is ForwardMode.DECODE and num_tokens != bs:
            raise UnsupportedError(self.name, f"decode capture with num_tokens={num_tokens}",
                                   f"a decode batch has one token per sequence (bs={bs})",
                                   "pass num_tokens=bs")
        if fmode in SPECULATIVE_MODES and num_tokens % bs:
            raise UnsupportedError(self.name, f"{fmode} capture with num_tokens={num_tokens}",
                                   f"a {fmode} graph is captured for the same number of query "
                                   f"tokens per sequence: num_tokens must be a multiple of "
                                   f"bs={bs}", "pass num_tokens=bs * draft tokens")
        self._check_forward_mode(fmode, phase, mode, state.query_bound(fmode, bs, num_tokens))
        if batch is None:
            batch = state.dummy_batch(fmode, bs, num_tokens, self.config.page_size, self.device)
        self._validate_batch(batch)
        md: ForwardMetadata[PlanT] = state.views(fmode, bs, num_tokens, mode)
        self._fill_graph_buffers(state, md, batch)
        self._init_capture_impl(md)
        self._graph_metadata[(fmode, bs, num_tokens)] = md
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
        md = self._graph_metadata.get((fmode, bs, num_tokens))
        if md is None:
            have = sorted((str(m), b, t) for m, b, t in self._graph_metadata)
            raise UnsupportedError(self.name, f"replay of {fmode} bs={bs}, "
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
                batch: ForwardBatch | None = None, **kwargs: Any) -> Any:
        """Dispatch on the batch's forward mode, like sglang's ``forward``: DECODE to
        :meth:`forward_decode`, EXTEND / TARGET_VERIFY / DRAFT_EXTEND to :meth:`forward_extend`."""
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
                       out: torch.Tensor | None = None, layer_id: int = 0,
                       return_lse: bool = False, lse: torch.Tensor | None = None) -> Any:
        """Write each sequence's new token into layer ``layer_id`` of ``pool``, then attend.

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
        layer_id : int
            The pool layer attended (and written); every layer of a step shares
            the step's metadata, planned once.
        return_lse, lse : bool, Tensor [B, H] float32, optional
            Also return the log-sum-exp per (token, head): ``(out, lse)``.
            ``lse`` is a preallocated float32 buffer (implies ``return_lse``).
            Natural log of the sum over the visible keys of ``exp(sm_scale *
            q . k)`` (``-inf`` for a row with no key, and for padding rows);
            only where the kernel declares ``lse`` (else UnsupportedError).

        Returns
        -------
        Tensor, or (Tensor, Tensor) with ``return_lse``
        """
        md = self._metadata_for(batch)
        if md.forward_mode is not ForwardMode.DECODE:
            what = "an extend" if md.forward_mode is ForwardMode.EXTEND else \
                f"a {md.forward_mode}"
            raise UnsupportedError(self.name, f"forward_decode on {what} batch",
                                   f"the metadata is for {md.forward_mode}",
                                   "call forward_extend for extend, target-verify and "
                                   "draft-extend batches")
        mode = self.active_graph_mode(Phase.DECODE)
        if mode is not GraphMode.DISABLED:  # eager pins nothing: nothing to check
            self.check_graph_mode(Phase.DECODE, mode, ForwardMethod.MLA)
        kv = self._layer(pool, layer_id)
        want_lse = return_lse or lse is not None
        self._check_declared(ForwardMethod.MLA, Phase.DECODE, q, (q.shape[-1], kv.kv_lora_rank),
                             kv_dtype=kv.kv_dtype, page_size=kv.page_size, lse=want_lse)
        self._raise_if("KV pool", validation.pool_problems(kv, self.config, self.device),
                       "build the pool with config.make_pool(num_pages)")
        self._check_q(q, md.batch_size, self.config.kv_row_dim, "q")
        self._check_new_rows(latent_new, rope_new, md.num_tokens, kv)
        out = self._output(out, q, (md.batch_size, q.shape[1], self.config.kv_lora_rank))
        lse_out = self._lse_output(lse, q, md.batch_size) if want_lse else None
        if latent_new is not None and rope_new is not None:
            self._write_kv(kv, md, latent_new, rope_new)
        if lse_out is None:
            self._forward_decode_impl(q, kv, md, out)
            return out
        self._forward_decode_impl(q, kv, md, out, lse=lse_out)
        self._mask_padded_lse(lse_out, md)
        return out, lse_out

    def forward_extend(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool | None,
                       batch: ForwardBatch | None = None, *,
                       method: ForwardMethod | str = ForwardMethod.MLA,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, layer_id: int = 0,
                       return_lse: bool = False, lse: torch.Tensor | None = None,
                       decompress: PrefixDecompress | None = None,
                       chunk_tokens: int | None = None) -> Any:
        """Write the new tokens into layer ``layer_id`` of ``pool`` (when given), then attend.

        Serves EXTEND (prefill) batches and the decode-phase speculative batches
        (TARGET_VERIFY: the draft tokens of each sequence, causal among
        themselves over the whole prefix; DRAFT_EXTEND: the accepted tokens),
        which run absorbed MLA.

        Parameters
        ----------
        q : Tensor
            MLA: ``[T, H, 576]``; MHA and MHA_CHUNKED_KV: ``[T, H, 192]``.
        latent_new, rope_new : Tensor [T, 512], [T, 64], or None
            Written at ``batch.out_cache_loc`` (the MHA methods write them too, so
            later decode steps see the tokens).  None: already written.
        pool : MLAKVPool or None
            Required for MLA (it attends over the pool), for MHA_CHUNKED_KV with a
            prefix (read from it) and for writing.
        method : ForwardMethod
            MLA (absorbed, over the paged pool), MHA (ragged ``k`` / ``v`` of prefix
            + new tokens) or MHA_CHUNKED_KV (see below).
        k, v : Tensor
            MHA: ``[Tk, H, 192]``, ``[Tk, H, 128]``, prefix plus new tokens of every
            sequence, ragged by ``kv_indptr``.  MHA_CHUNKED_KV: ``[T, H, 192]``,
            ``[T, H, 128]``, the new tokens only, ragged by ``qo_indptr``.
        out : Tensor, optional
            ``[T, H, 512]`` (MLA) or ``[T, H, 128]`` (MHA).
        layer_id : int
            The pool layer attended (and written).
        return_lse, lse : bool, Tensor [T, H] float32, optional
            Also return the log-sum-exp per (token, head), as for
            :meth:`forward_decode`.
        decompress : callable, MHA_CHUNKED_KV only
            ``decompress(latent [n, 512], rope [n, 64]) -> (k [n, H, 192], v [n, H,
            128])`` in q's dtype: the engine's ``kv_b_proj`` applied to cached prefix
            rows (read from ``pool`` in q's dtype).
        chunk_tokens : int, MHA_CHUNKED_KV only
            Prefix tokens per sequence decompressed at once (default: the whole
            prefix in one chunk).

        MHA_CHUNKED_KV (sglang's chunked-prefix MHA) computes what MHA computes
        without materialising the whole prefix's K / V: causal ragged MHA of
        the new tokens over the new tokens, then for every prefix chunk
        (:meth:`ForwardBatch.prefix_chunks`) the rows are read from the pool,
        decompressed, attended without a mask, and merged by their log-sum-exp
        (:func:`attnreg.runtime.merge_attention_states`).  Eager only.

        Returns
        -------
        Tensor, or (Tensor, Tensor) with ``return_lse``
        """
        method = ForwardMethod.parse(method)
        md = self._metadata_for(batch)
        fmode = md.forward_mode
        if fmode is ForwardMode.DECODE:
            raise UnsupportedError(self.name, "forward_extend on a decode batch",
                                   "the metadata is for decode",
                                   "call forward_decode for decode batches")
        phase = md.phase
        mode = self.active_graph_mode(phase)
        if fmode in SPECULATIVE_MODES and method is not ForwardMethod.MLA:
            raise UnsupportedError(self.name, f"{fmode} with method {method}",
                                   "speculative batches attend the paged pool with absorbed "
                                   "MLA", "call forward_extend(..., method=ForwardMethod.MLA)")
        if mode is not GraphMode.DISABLED:  # eager pins nothing: nothing to check
            self.check_graph_mode(phase, mode, method)
        self._check_forward_mode(fmode, phase, mode, md.max_extend_len, md.extend_lens_cpu)
        want_lse = return_lse or lse is not None
        kv = self._layer(pool, layer_id) if pool is not None else None
        if method is ForwardMethod.MHA_CHUNKED_KV:
            return self._forward_chunked(q, latent_new, rope_new, kv, md, k=k, v=v, out=out,
                                         lse=lse, want_lse=want_lse, decompress=decompress,
                                         chunk_tokens=chunk_tokens)
        if decompress is not None or chunk_tokens is not None:
            raise UnsupportedError(self.name, f"decompress / chunk_tokens with method {method}",
                                   "only the MHA_CHUNKED_KV method reads a prefix in chunks",
                                   "pass method=ForwardMethod.MHA_CHUNKED_KV")
        if method is ForwardMethod.MLA:
            if kv is None:
                raise UnsupportedError(self.name, "MLA extend without a KV pool",
                                       "absorbed MLA attends over the paged pool",
                                       "pass the pool")
            self._check_declared(method, phase, q, (q.shape[-1], kv.kv_lora_rank),
                                 kv_dtype=kv.kv_dtype, page_size=kv.page_size, lse=want_lse)
            self._raise_if("KV pool", validation.pool_problems(kv, self.config, self.device),
                           "build the pool with config.make_pool(num_pages)")
            self._check_q(q, md.num_tokens, self.config.kv_row_dim, "q")
            v_dim = self.config.kv_lora_rank
        else:
            if k is None or v is None:
                raise UnsupportedError(self.name, f"{method} extend without k and v",
                                       "the MHA method attends over ragged k / v",
                                       "pass k=[Tk, H, 192] and v=[Tk, H, 128]")
            self._check_declared(method, phase, q, (q.shape[-1], v.shape[-1]),
                                 kv_dtype=self._ragged_kv_dtype(method, k), lse=want_lse)
            qk_dim, v_dim = self.config.mha_head_dims
            self._check_q(q, md.num_tokens, qk_dim, "q")
            self._raise_if("ragged MHA k / v",
                           validation.ragged_kv_problems(q, k, v, self.config, md.num_kv_tokens,
                                                         self.device),
                           "k and v cover prefix + new tokens, ragged by kv_indptr")
            if kv is not None:
                self._raise_if("KV pool",
                               validation.pool_problems(kv, self.config, self.device),
                               "build the pool with config.make_pool(num_pages)")
        self._write_new_rows(kv, md, latent_new, rope_new)
        out = self._output(out, q, (md.num_tokens, q.shape[1], v_dim))
        lse_out = self._lse_output(lse, q, md.num_tokens) if want_lse else None
        if lse_out is None:
            self._forward_extend_impl(q, kv, md, out, method=method, k=k, v=v)
            return out
        self._forward_extend_impl(q, kv, md, out, method=method, k=k, v=v, lse=lse_out)
        self._mask_padded_lse(lse_out, md)
        return out, lse_out

    def _forward_chunked(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                         rope_new: torch.Tensor | None, kv: MLAKVLayer | None,
                         md: ForwardMetadata[PlanT], *, k: torch.Tensor | None,
                         v: torch.Tensor | None, out: torch.Tensor | None,
                         lse: torch.Tensor | None, want_lse: bool,
                         decompress: PrefixDecompress | None,
                         chunk_tokens: int | None) -> Any:
        """MHA_CHUNKED_KV: new tokens causally, then each prefix chunk, merged by LSE."""
        method = ForwardMethod.MHA_CHUNKED_KV
        if md.is_graph:
            raise UnsupportedError(self.name, f"{method} under graph capture",
                                   "the prefix chunks are planned per batch on the host",
                                   "run chunked-prefix MHA batches eagerly")
        if k is None or v is None:
            raise UnsupportedError(self.name, f"{method} extend without k and v",
                                   "the new tokens' k / v are attended causally first",
                                   "pass k=[T, H, 192] and v=[T, H, 128] of the new tokens")
        # the chunks are merged by their LSE: the kernel must produce it
        self._check_declared(method, Phase.PREFILL, q, (q.shape[-1], v.shape[-1]),
                             kv_dtype=self._ragged_kv_dtype(method, k), lse=True)
        qk_dim, v_dim = self.config.mha_head_dims
        self._check_q(q, md.num_tokens, qk_dim, "q")
        self._raise_if("new tokens' k / v",
                       validation.ragged_kv_problems(q, k, v, self.config, md.num_tokens,
                                                     self.device),
                       "with MHA_CHUNKED_KV, k and v hold the new tokens only, ragged by "
                       "qo_indptr")
        has_prefix = any(md.prefix_lens_cpu or ())
        if has_prefix and (kv is None or decompress is None):
            raise UnsupportedError(self.name, f"{method} over a cached prefix",
                                   "the prefix is read from the pool and decompressed by the "
                                   "engine", "pass pool= and decompress=(latent, rope) -> (k, v)")
        if kv is not None:
            self._raise_if("KV pool", validation.pool_problems(kv, self.config, self.device),
                           "build the pool with config.make_pool(num_pages)")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise UnsupportedError(self.name, f"{method} chunk size",
                                   f"chunk_tokens must be >= 1, got {chunk_tokens}",
                                   "pass a positive chunk size, or None for one chunk")
        self._write_new_rows(kv, md, latent_new, rope_new)
        out = self._output(out, q, (md.num_tokens, q.shape[1], v_dim))
        lse_out = self._lse_output(lse, q, md.num_tokens)
        self._forward_extend_impl(q, kv, md, out, method=method, k=k, v=v, lse=lse_out)
        if has_prefix:
            assert kv is not None and decompress is not None
            acc = out.float()
            heads = q.shape[1]
            for chunk in self._prefix_chunks(md, chunk_tokens):
                if chunk.num_tokens == 0:
                    continue
                rows = kv.read_slots(chunk.slots, q.dtype)
                k_c, v_c = decompress(rows[:, :kv.kv_lora_rank], rows[:, kv.kv_lora_rank:])
                n = chunk.num_tokens
                self._raise_if("decompressed prefix chunk",
                               [f"decompress returned k {tuple(k_c.shape)} {k_c.dtype} and v "
                                f"{tuple(v_c.shape)} {v_c.dtype}, expected "
                                f"[{n}, {heads}, {qk_dim}] and [{n}, {heads}, {v_dim}] in "
                                f"{q.dtype}"] if (tuple(k_c.shape) != (n, heads, qk_dim)
                                                  or tuple(v_c.shape) != (n, heads, v_dim)
                                                  or k_c.dtype != q.dtype
                                                  or v_c.dtype != q.dtype) else [],
                               "return one k / v row per prefix row, in q's dtype")
                o_c = torch.empty_like(out)
                lse_c = torch.empty_like(lse_out)
                self._forward_prefix_chunk_impl(q, k_c, v_c, md, chunk, o_c, lse_c)
                if 0 in chunk.kv_lens_cpu:
                    # sequences without a token in this chunk: nothing to merge, whatever a
                    # kernel leaves for a zero-length key set
                    empty = torch.tensor([n == 0 for n in chunk.kv_lens_cpu], device=q.device)
                    rows = torch.repeat_interleave(
                        empty, torch.tensor(md.extend_lens_cpu, device=q.device),
                        output_size=md.num_tokens)
                    o_c.masked_fill_(rows[:, None, None], 0)
                    lse_c.masked_fill_(rows[:, None], float("-inf"))
                merge_attention_states(acc, lse_out, o_c, lse_c, out=acc, lse_out=lse_out)
            out.copy_(acc)
        return (out, lse_out) if want_lse else out

    def _prefix_chunks(self, md: ForwardMetadata[PlanT], chunk_tokens: int | None
                       ) -> list[PrefixChunk]:
        """The batch's prefix chunks, computed once per batch (every layer reuses them)."""
        longest = max(md.prefix_lens_cpu or (0,))
        size = int(chunk_tokens) if chunk_tokens else max(1, longest)
        found = md.prefix_chunk_cache.get(size)
        if found is None:
            assert md.batch is not None  # eager metadata always has its batch
            found = md.batch.prefix_chunks(size, self.config.page_size)
            md.prefix_chunk_cache[size] = found
        return found

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

    def _write_kv(self, pool: MLAKVLayer, md: ForwardMetadata[PlanT], latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        """Write new tokens' rows at ``md.out_cache_loc`` of one layer (override for a fused
        kernel)."""
        pool.write(md.out_cache_loc, latent_new, rope_new)

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[PlanT], out: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        """Absorbed decode into ``out`` [B, H, 512]; new tokens are already in ``pool``.

        ``pool`` is the layer the forward reads (:class:`MLAKVLayer`: ``buffer``,
        ``kv_scale``, ``scale_tensor``).  ``lse`` (float32 [B, H]) is passed only
        when the caller asked for it, which the base class allows only where the
        decode kernel declares ``lse``: a backend declaring none need not accept it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement decode")

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[PlanT], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None) -> None:
        """Extend attention into ``out``; for MLA the new tokens are already in ``pool``.

        ``md.forward_mode`` is EXTEND, TARGET_VERIFY or DRAFT_EXTEND (the latter
        two: MLA over the pool, causal within each sequence's new tokens, as an
        extend with a prefix).  MHA_CHUNKED_KV: causal ragged MHA of the new
        tokens over ``k`` / ``v`` of the new tokens only (both ragged by
        ``md.qo_indptr``), always with ``lse``.  ``lse`` as for
        :meth:`_forward_decode_impl`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement extend")

    def _forward_prefix_chunk_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   md: ForwardMetadata[PlanT], chunk: PrefixChunk,
                                   out: torch.Tensor, lse: torch.Tensor) -> None:
        """MHA_CHUNKED_KV: the new tokens (ragged by ``md.qo_indptr``) over one prefix chunk
        (``k`` / ``v`` ragged by ``chunk.kv_indptr``), without a mask, into ``out`` and
        ``lse`` (a row whose sequence has no token in the chunk: 0 and ``-inf``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement chunked-prefix "
                                  "MHA")

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
                        page_size: int | None = None, lse: bool = False) -> None:
        # The cache is keyed on the raw request (torch dtype, kv dtype as given), so an
        # accepted request costs one tuple and one set lookup per forward.
        key = None
        if q.dim() == 3:
            key = (method, phase, tuple(head_dims), q.dtype, kv_dtype, page_size, q.shape[1],
                   lse)
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
        request = {"head_dims": head_dims, "q_dtype": q_dt, "kv_dtype": kv_dtype,
                   "page_size": page_size, "num_heads": q.shape[1]}
        reasons = self.capabilities.check_request(method, phase, **request)  # type: ignore[arg-type]
        if reasons:
            raise UnsupportedError(self.name, f"{method} {phase} request", reasons)
        if lse:
            # the same request against the kernels that declare an LSE output only
            with_lse = self._lse_capabilities().check_request(method, phase, **request)  # type: ignore[arg-type]
            if with_lse:
                declared = [k.kernel or str(k.method) for k in
                            self.capabilities.kernels_for(method, phase)]
                raise UnsupportedError(
                    self.name, f"{method} {phase} log-sum-exp output",
                    f"no kernel that accepts this request declares an LSE output (kernels: "
                    f"{', '.join(declared)}; KernelConstraints.lse)",
                    "call without return_lse, or choose a backend whose kernel declares lse")
        self._accepted_requests.add(key)

    def _lse_capabilities(self) -> Capabilities:
        """The declaration restricted to the kernels that return the log-sum-exp."""
        if self._lse_caps is None:
            self._lse_caps = dataclasses.replace(
                self.capabilities, kernels=tuple(k for k in self.capabilities.kernels if k.lse))
        return self._lse_caps

    def _check_forward_mode(self, fmode: ForwardMode, phase: Phase, mode: GraphMode,
                            query_len: int, extend_lens: tuple[int, ...] | None = None) -> None:
        """Refuse a forward mode the declaration does not serve under ``mode`` (DISABLED:
        ``eager_forward_modes``; a capture mode: that entry's ``forward_modes``) with
        ``query_len`` tokens per sequence, or unevenly where it must be uniform."""
        if (fmode, mode, None) in self._served:  # served at any length
            return
        uniform = extend_lens is None or len(set(extend_lens)) <= 1
        key = (fmode, mode, query_len if uniform else -query_len)
        if key in self._served:
            return
        eager = mode is GraphMode.DISABLED or mode is GraphMode.TC_PIECEWISE
        entry = (self.capabilities.eager_serving(fmode) if eager
                 else self.capabilities.graph_support(phase, mode).serving(fmode))
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
        if problem:
            declared = self.capabilities.eager_forward_modes if eager else \
                self.capabilities.graph_support(phase, mode).forward_modes
            raise UnsupportedError(
                self.name, f"{fmode} batch {where}", problem,
                "run it where it is declared (Capabilities.eager_forward_modes, "
                "GraphModeSupport.forward_modes: "
                + (", ".join(f.describe() for f in declared) or "nothing") + ")")
        # an unbounded entry (ragged extend) is cached once, not once per length
        assert entry is not None
        self._served.add((fmode, mode, None) if entry.max_query_len is None else key)

    def _layer(self, pool: MLAKVPool, layer_id: int) -> MLAKVLayer:
        try:
            return pool.layer(layer_id)
        except IndexError as exc:
            raise UnsupportedError(self.name, f"layer_id {layer_id}", str(exc),
                                   "pass a layer_id of the pool") from exc

    @staticmethod
    def _ragged_kv_dtype(method: ForwardMethod, k: torch.Tensor) -> DType:
        kv_dt = dtype_from_torch(k.dtype)
        if kv_dt is None:
            raise UnsupportedError("runtime", f"{method} k dtype",
                                   f"k dtype {k.dtype} has no attnreg name",
                                   "use bf16, fp16 or fp32 k / v")
        return kv_dt

    def _write_new_rows(self, kv: MLAKVLayer | None, md: ForwardMetadata[PlanT],
                        latent_new: torch.Tensor | None, rope_new: torch.Tensor | None) -> None:
        if latent_new is None and rope_new is None:
            return
        if kv is None:
            raise UnsupportedError(self.name, "KV write without a pool",
                                   "latent_new / rope_new were given but pool is None",
                                   "pass the pool, or None for latent_new and rope_new")
        self._check_new_rows(latent_new, rope_new, md.num_tokens, kv)
        assert latent_new is not None and rope_new is not None
        self._write_kv(kv, md, latent_new, rope_new)

    def _lse_output(self, lse: torch.Tensor | None, q: torch.Tensor, rows: int) -> torch.Tensor:
        shape = (rows, q.shape[1])
        if lse is None:
            return torch.empty(shape, dtype=torch.float32, device=q.device)
        if tuple(lse.shape) != shape or lse.dtype != torch.float32 or lse.device != q.device:
            raise UnsupportedError(self.name, "lse tensor",
                                   f"got {tuple(lse.shape)} {lse.dtype} on {lse.device}, "
                                   f"expected {shape} torch.float32 on {q.device}",
                                   "pass lse=None to get a new tensor")
        return lse

    def _mask_padded_lse(self, lse: torch.Tensor, md: ForwardMetadata[PlanT]) -> None:
        """Padding rows of a replayed graph get an LSE of -inf (they attend no key)."""
        if md.is_graph and self.graph_state is not None:
            self.graph_state.fill_padded_rows(lse, md, float("-inf"))

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
                        rows: int, pool: MLAKVLayer) -> None:
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
