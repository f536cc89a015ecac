"""The lifecycle every attention backend follows (modelled on sglang's ``AttentionBackend``).

The contract only: refusals are :mod:`attnreg.runtime.refusals`' (one UnsupportedError
with every reason, before any launch), graph bookkeeping :class:`GraphState`'s and
chunked-prefix MHA :mod:`attnreg.runtime.chunked_prefix`'s.  Lifecycle (docs/runtime.md)::

    eager:   init_forward_metadata(batch) -> forward_decode / forward_extend
    graphs:  init_cuda_graph_state(max_bs, max_num_tokens)           once
             init_forward_metadata_capture(bs, num_tokens, batch)    per shape, before capture
             init_forward_metadata_replay(bs, num_tokens, batch)     before each replay
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic

import torch

from attnreg.graph_policy.capture import current_capture
from attnreg.registry import (
    Capabilities,
    CaptureShape,
    CaptureSupport,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
)

from .batch import ForwardBatch, PrefixChunk
from .chunked_prefix import merge_prefix_chunks
from .config import MLAConfig
from .dtypes import resolve_device
from .errors import KernelErrors
from .forward_io import hook_options, hook_result, lse_for, output_for
from .graph_buffers import BuffersT, GraphState
from .lse import PrefixDecompress
from .metadata import ATTENTION_CAPTURE_MODES, ForwardMetadata, PlanT, graph_mode_now, phase_of
from .pool import MLAKVLayer, MLAKVPool
from .refusals import Refusal, RequestChecker, refusal_error
from .sparse import SparseForward

__all__ = ["AttentionBackend"]


class AttentionBackend(SparseForward, Generic[PlanT, BuffersT]):
    """Base class of MLA attention backends.

    Built by ``BackendRegistry.create`` as ``cls(config, capabilities=caps, **options)``
    (the base class takes no option: a misspelt one is an error).  Subclasses implement
    the ``_forward_*_impl`` hooks and may override the planning hooks; a hook runs only
    on a request ``self.refusals`` accepted.  ``PlanT``: the backend's per-batch plan
    (``md.plan``); ``BuffersT``: its graph buffers (``graph_state.buffers``).  A
    ``config.page_size`` no kernel reading the paged pool declares is refused here.
    Sparse (DSA) MLA: :meth:`forward_sparse` (:mod:`attnreg.runtime.sparse`)."""

    #: Overridden per instance by ``capabilities.backend``.
    name: str = "base"
    #: True: hooks get ``out=None`` when none is given and return their kernel's output
    returns_kernel_output: bool = False

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
        self.device = resolve_device(config.device)
        #: every refusal of this backend, built once from its declaration
        self.refusals = RequestChecker(self.name, capabilities, config, self.device)
        self.forward_metadata: ForwardMetadata[PlanT] | None = None
        self.graph_state: GraphState[BuffersT] | None = None
        # Refused here, not at the first forward: every forward reads a pool of
        # config.page_size (and before the subclass imports its kernel library).
        self._refuse(self.refusals.page_size())

    # -- capture mode ------------------------------------------------------------------
    def active_graph_mode(self, phase: Phase | str) -> GraphMode:
        """The graph mode the code runs under for ``phase``: ``current_capture()``,
        DISABLED inside an ``eager_break``; a CUDA stream capturing with no
        ``capturing()`` context captures attention (FULL decode, BREAKABLE prefill)."""
        return graph_mode_now(phase, self.device)

    def capture_support(self, phase: Phase | str, mode: GraphMode | str) -> CaptureSupport:
        """The declared :class:`CaptureSupport` for (phase, mode)."""
        return self.capabilities.graph_support(phase, mode).capture

    def forward_method_for(self, phase: Phase | str,
                           mode: GraphMode | str | None = None) -> ForwardMethod | None:
        """The method the declaration pins for ``phase`` under ``mode`` (default
        :meth:`active_graph_mode`; ``GraphModeSupport.pinned_method``), None when nothing
        is; UnsupportedError when ``(phase, mode)`` is declared UNSUPPORTED."""
        phase = Phase.parse(phase)
        mode = self.active_graph_mode(phase) if mode is None else GraphMode.parse(mode)
        if mode is GraphMode.DISABLED:
            return None
        self._refuse(self.refusals.graph_mode(phase, mode))
        return self.capabilities.graph_support(phase, mode).pinned_method

    def check_graph_mode(self, phase: Phase | str, mode: GraphMode | str,
                         method: ForwardMethod | str | None = None) -> None:
        """Raise UnsupportedError when (phase, mode) is declared UNSUPPORTED, or ``method``
        is not the one the mode pins (a pinned MLA: the MHA companion is never captured)."""
        self._refuse(self.refusals.graph_mode(
            Phase.parse(phase), GraphMode.parse(mode),
            None if method is None else ForwardMethod.parse(method)))

    # -- eager metadata ----------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan an eager forward of ``batch`` (once per batch, before all layers)."""
        phase = phase_of(batch.forward_mode)
        self._refuse(self.refusals.eager_metadata(phase, self.active_graph_mode(phase)))
        self._validate_batch(batch)
        md: ForwardMetadata[PlanT] = ForwardMetadata.from_batch(batch)
        self._init_metadata_impl(md)
        self.forward_metadata = md

    # -- graphs ------------------------------------------------------------------------
    def capture_shape(self, max_bs: int, max_num_tokens: int, max_seq_len: int
                      ) -> CaptureShape:
        """The ``CaptureShape`` graph buffers are sized for (``CaptureMemory.estimate``'s)."""
        return GraphState.shape_for(self.config, self.device, max_bs, max_num_tokens,
                                    max_seq_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *,
                              max_seq_len: int | None = None,
                              graph_modes: Mapping[Phase | str, GraphMode | str] | None = None,
                              sparse: bool = False) -> None:
        """Preallocate the buffers every captured shape uses (once), for shapes up to
        ``max_bs`` / ``max_num_tokens`` and sequences up to ``max_seq_len`` (default
        ``config.max_context_len``), for ``graph_modes`` only (default: the
        ``capturing()`` mode, else every declared decode FULL / prefill BREAKABLE); with
        ``sparse`` (graphs of :meth:`forward_sparse`) as ``sparse_graph_modes`` declare them.
        UnsupportedError when a requested mode is declared UNSUPPORTED (or none is)."""
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"need 1 <= max_bs <= max_num_tokens, got max_bs={max_bs}, "
                             f"max_num_tokens={max_num_tokens}")
        modes, refused = self.refusals.for_sparse(sparse).capture_modes(graph_modes,
                                                                        current_capture())
        self._refuse(refused)
        max_seq_len = int(max_seq_len or self.config.max_context_len)
        state: GraphState[BuffersT] = GraphState.allocate(
            max_bs=max_bs, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            page_size=self.config.page_size, graph_modes=modes,
            capture_shape=self.capture_shape(max_bs, max_num_tokens, max_seq_len),
            device=self.device, sparse=sparse)
        self.graph_state = state
        self._init_graph_state_impl(state)

    def init_forward_metadata_capture(self, bs: int, num_tokens: int,
                                      batch: ForwardBatch | None = None,
                                      forward_mode: ForwardMode | str | None = None) -> None:
        """Bind the graph buffers for one captured shape; call it *before* capturing.

        q has ``bs`` (decode) or ``num_tokens`` rows (speculative: ``bs * draft tokens``).
        ``batch``: one padded up to the shape (None: a dummy in the padding page);
        ``forward_mode``: the batch's, or DECODE.  Afterwards ``forward_*`` (this batch or
        None) record launches reading the graph buffers, which each replay refills."""
        state = self._require_graph_state()
        fmode = ForwardMode.parse(forward_mode) if forward_mode is not None else (
            batch.forward_mode if batch is not None else ForwardMode.DECODE)
        phase = phase_of(fmode)
        mode = state.capture_mode(phase)
        self._refuse(self.refusals.for_sparse(state.sparse).capture(state, fmode, phase, mode,
                                                                    bs, num_tokens))
        if batch is None:
            batch = state.dummy_batch(fmode, bs, num_tokens, self.config.page_size, self.device)
        self._validate_batch(batch)
        md: ForwardMetadata[PlanT] = state.views(fmode, bs, num_tokens, mode)
        self._refuse(self.refusals.graph_fit(state, md, batch))
        state.fill(md, batch, self.config.page_size)
        self._init_capture_impl(md)
        state.keep(md)
        self.forward_metadata = md

    def init_forward_metadata_replay(self, bs: int, num_tokens: int, batch: ForwardBatch,
                                     forward_mode: ForwardMode | str | None = None) -> None:
        """Copy ``batch`` into the graph buffers of the captured shape, outside the graph,
        before the replay (missing sequences get length 0, missing tokens the padding
        slot); refused when no graph was captured for it, or the batch does not fit."""
        fmode = batch.forward_mode if forward_mode is None else ForwardMode.parse(forward_mode)
        state = self.graph_state
        md = None if state is None else state.captured.get((fmode, bs, num_tokens))
        if md is None:
            raise refusal_error(self.name, self.refusals.replay(state, fmode, bs, num_tokens))
        if not state.fill_packed(md, batch):  # else: checked per tensor, copied per tensor
            self._validate_batch(batch)
            self._refuse(self.refusals.graph_fit(state, md, batch))
            state.fill(md, batch, self.config.page_size)
        self._init_replay_impl(md, batch)
        self.forward_metadata = md

    def captured_metadata(self) -> list[ForwardMetadata[PlanT]]:
        """The metadata of every shape captured since ``init_cuda_graph_state``."""
        return [] if self.graph_state is None else list(self.graph_state.captured.values())

    def graph_buffer_bytes(self) -> int:
        """Bytes of its graph buffers and captured plans (from the typed state; not
        ``GraphState.base_bytes``)."""
        return 0 if self.graph_state is None else self.graph_state.buffer_bytes()

    def zero_padded_rows(self, out: torch.Tensor, md: ForwardMetadata[PlanT], *,
                         src: torch.Tensor | None = None) -> None:
        """Under graph metadata zero ``out``'s padding rows (capture-safe), copying ``src`` (a
        library's own result) in by the same launch; ``out`` may be that result itself."""
        if md.is_graph and self.graph_state is not None:
            self.graph_state.fill_padded_rows(out, md, 0.0, src=src)
        elif src is not None:
            out.copy_(src)

    def _require_graph_state(self) -> GraphState[BuffersT]:
        if (state := self.graph_state) is None:
            raise refusal_error(self.name, self.refusals.graph_state(None))
        return state

    def _require_buffers(self) -> BuffersT:
        """The backend's own graph buffers (refused before ``init_cuda_graph_state``)."""
        if (state := self._require_graph_state()).buffers is None:
            raise refusal_error(self.name, self.refusals.graph_state(state, buffers=True))
        return state.buffers

    # -- forward -----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                rope_new: torch.Tensor | None, pool: MLAKVPool | None,
                batch: ForwardBatch | None = None, **kwargs: Any) -> Any:
        """Dispatch on the batch's forward mode, like sglang's ``forward``: DECODE to
        :meth:`forward_decode`, EXTEND / TARGET_VERIFY / DRAFT_EXTEND to :meth:`forward_extend`."""
        md = self._metadata_for(batch)
        if md.forward_mode is not ForwardMode.DECODE:
            return self.forward_extend(q, latent_new, rope_new, pool, batch, **kwargs)
        if pool is None:
            raise refusal_error(self.name, self.refusals.no_pool(
                "decode without a KV pool", "decode attends over the paged pool"))
        return self.forward_decode(q, latent_new, rope_new, pool, batch, **kwargs)

    def forward_decode(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool,
                       batch: ForwardBatch | None = None, *,
                       out: torch.Tensor | None = None, layer_id: int = 0,
                       return_lse: bool = False, lse: torch.Tensor | None = None,
                       q_scale: torch.Tensor | None = None) -> Any:
        """Write each sequence's new token (latent_new / rope_new ``[B, 512]`` / ``[B, 64]``,
        None: written) at ``batch.out_cache_loc`` of layer ``layer_id``, then attend with q
        ``[B, H, 576]``; returns ``[B, H, 512]`` (``out=``), or with ``return_lse`` / a
        float32 ``lse=[B, H]`` ``(out, lse)`` where the kernel declares ``lse``.
        ``batch``: eager the batch (planned if it was not); under capture the captured
        one, or None.  ``q_scale``: an fp8 ``q``'s float32 ``[1]`` scale (bf16 output).
        See docs/runtime.md, "Shapes", "Log-sum-exp" and "An fp8 query"."""
        md = self._metadata_for(batch)
        mode = self.active_graph_mode(Phase.DECODE)
        kv = self._layer(pool, layer_id)
        want_lse = return_lse or lse is not None
        self._refuse(self.refusals.decode(md, mode, q, kv, latent_new, rope_new, out, lse,
                                          want_lse, q_scale))
        if latent_new is not None and rope_new is not None:
            self._write_kv(kv, md, latent_new, rope_new)
        shape = (md.batch_size, self.config.kv_lora_rank)
        out = output_for(q, out, *shape, kernel_owns=self.returns_kernel_output)
        hook = hook_options(q_scale, lse_for(lse, q) if want_lse else None)
        out = hook_result("decode", out, self._forward_decode_impl(q, kv, md, out, **hook), q,
                          *shape)
        if not want_lse:
            return out
        self._mask_padded_lse(hook["lse"], md)
        return out, hook["lse"]

    def forward_extend(self, q: torch.Tensor, latent_new: torch.Tensor | None,
                       rope_new: torch.Tensor | None, pool: MLAKVPool | None,
                       batch: ForwardBatch | None = None, *,
                       method: ForwardMethod | str = ForwardMethod.MLA,
                       k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, layer_id: int = 0,
                       return_lse: bool = False, lse: torch.Tensor | None = None,
                       decompress: PrefixDecompress | None = None,
                       chunk_tokens: int | None = None,
                       q_scale: torch.Tensor | None = None) -> Any:
        """Write the new tokens (when given) into layer ``layer_id`` of ``pool``, then attend:
        EXTEND and the speculative TARGET_VERIFY / DRAFT_EXTEND (absorbed MLA) batches.

        ``method``: MLA (q ``[T, H, 576]`` over ``pool``), MHA (``k`` / ``v`` ragged by
        ``kv_indptr``) or MHA_CHUNKED_KV (eager; ``k`` / ``v`` of the new tokens, the
        prefix read in chunks of ``chunk_tokens`` and decompressed by ``decompress(latent,
        rope) -> (k, v)``: :mod:`attnreg.runtime.chunked_prefix`).  Other options as for
        :meth:`forward_decode` (``q_scale`` too); docs/runtime.md, "Shapes"."""
        method = ForwardMethod.parse(method)
        md = self._metadata_for(batch)
        mode = self.active_graph_mode(md.phase)
        kv = self._layer(pool, layer_id) if pool is not None else None
        want_lse = return_lse or lse is not None
        self._refuse(self.refusals.extend(md, mode, method, q, kv, k, v, latent_new, rope_new,
                                          out, lse, want_lse, decompress, chunk_tokens,
                                          q_scale))
        if latent_new is not None and rope_new is not None:
            assert kv is not None
            self._write_kv(kv, md, latent_new, rope_new)
        v_dim = self.config.kv_lora_rank if method is ForwardMethod.MLA else \
            self.config.mha_head_dims[1]
        chunked = method is ForwardMethod.MHA_CHUNKED_KV  # chunks merge into one out by LSE
        out = output_for(q, out, md.num_tokens, v_dim,
                         kernel_owns=self.returns_kernel_output and not chunked)
        hook = hook_options(q_scale, lse_for(lse, q) if want_lse or chunked else None)
        out = hook_result("extend", out, self._forward_extend_impl(
            q, kv, md, out, method=method, k=k, v=v, **hook), q, md.num_tokens, v_dim)
        if "lse" not in hook:
            return out
        lse_out = hook["lse"]
        if chunked:
            merge_prefix_chunks(q, kv, md, out, lse_out, decompress=decompress,
                                chunk_tokens=chunk_tokens, page_size=self.config.page_size,
                                attend=self._forward_prefix_chunk_impl, checker=self.refusals)
        self._mask_padded_lse(lse_out, md)
        return (out, lse_out) if want_lse else out

    # -- hooks for subclasses ----------------------------------------------------------
    def _init_metadata_impl(self, md: ForwardMetadata[PlanT]) -> None:
        """Plan an eager batch (host values allowed); set ``md.plan``."""

    def _init_graph_state_impl(self, state: GraphState[BuffersT]) -> None:
        """Allocate ``state.buffers`` for ``state.graph_modes``, sized from
        ``state.capture_shape`` by the function the declared ``CaptureMemory`` uses."""

    def _init_capture_impl(self, md: ForwardMetadata[PlanT]) -> None:
        """Bind views of the preallocated buffers for one captured shape into ``md.plan``."""

    def _init_replay_impl(self, md: ForwardMetadata[PlanT], batch: ForwardBatch) -> None:
        """Per-replay host planning into existing buffers (runs outside the graph)."""

    def _write_kv(self, pool: MLAKVLayer, md: ForwardMetadata[PlanT], latent_new: torch.Tensor,
                  rope_new: torch.Tensor) -> None:
        """Write new tokens' rows at ``md.out_cache_loc`` (override for a fused kernel)."""
        pool.write(md.out_cache_loc, latent_new, rope_new)

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[PlanT], out: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> torch.Tensor | None:
        """Absorbed decode into ``out`` (None: returned, ``returns_kernel_output``) over
        ``pool`` (the layer, new tokens written); ``lse`` (float32 [B, H]) only where the
        decode kernel declares it; ``q_scale`` only with an fp8 q (where one is declared)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement decode")

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[PlanT], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None
                             ) -> torch.Tensor | None:
        """Extend attention into ``out`` (None: returned, as for decode): EXTEND, or MLA over
        the pool for TARGET_VERIFY / DRAFT_EXTEND (new tokens already in ``pool``);
        MHA_CHUNKED_KV: causal MHA of the new tokens over ``k`` / ``v`` (by ``qo_indptr``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement extend")

    def _forward_prefix_chunk_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   md: ForwardMetadata[PlanT], chunk: PrefixChunk,
                                   out: torch.Tensor, lse: torch.Tensor) -> None:
        """MHA_CHUNKED_KV: the new tokens (ragged by ``md.qo_indptr``) over one prefix chunk
        (``k`` / ``v`` ragged by ``chunk.kv_indptr``), without a mask, into ``out`` and
        ``lse`` (a row whose sequence has no token in the chunk: 0 and ``-inf``)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement chunked MHA")

    def kernel_errors(self, what: str) -> KernelErrors:
        """``with self.kernel_errors("decode inputs"): launch(...)``: a library's pre-launch
        ``ValueError`` becomes UnsupportedError."""
        return KernelErrors(self.name, what)

    def _validate_batch(self, batch: ForwardBatch) -> None:
        self._refuse(self.refusals.batch(batch))  # int32 indices, shapes (the contract's)

    def _layer(self, pool: MLAKVPool, layer_id: int) -> MLAKVLayer:
        try:
            return pool.layer(layer_id)
        except IndexError as exc:
            raise refusal_error(self.name, self.refusals.layer(layer_id, str(exc))) from exc

    def _refuse(self, refusals: list[Refusal]) -> None:
        if refusals:
            raise refusal_error(self.name, refusals)

    def _metadata_for(self, batch: ForwardBatch | None) -> ForwardMetadata[PlanT]:
        md = self.forward_metadata
        if batch is not None and (md is None or md.batch is not batch):
            if self.active_graph_mode(phase_of(batch.forward_mode)) in ATTENTION_CAPTURE_MODES:
                self._refuse(self.refusals.unplanned_batch())
            self.init_forward_metadata(batch)
            md = self.forward_metadata
        if md is None:
            raise refusal_error(self.name, self.refusals.no_metadata())
        return md

    def _mask_padded_lse(self, lse: torch.Tensor, md: ForwardMetadata[PlanT]) -> None:
        if md.is_graph and self.graph_state is not None:  # padding rows attend no key: -inf
            self.graph_state.fill_padded_rows(lse, md, float("-inf"))

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}(name={self.name!r}, heads={c.num_heads}, page_size="
                f"{c.page_size}, kv_dtype={c.kv_dtype}, device={self.device})")
