"""The runtime of ``flashmla``: imported only when the backend is instantiated.

attnreg's :class:`~attnreg.runtime.AttentionBackend` has checked each request
against the declaration (page size, heads, dtypes, forward method and mode,
LSE, capture mode) before a hook here runs, and this class refuses at
construction a configuration the declaration does not cover, so no FlashMLA
assert or ``TORCH_CHECK`` ever reaches a user.

Two kinds of batch, one kernel call: a DECODE batch (one query token per
sequence) and a TARGET_VERIFY batch (``s_q`` draft tokens per sequence,
causal among themselves over the whole prefix), which arrives through
``forward_extend`` and runs the same call with ``q [B, s_q, H, 576]``.

Per batch the only plan is FlashMLA's split-KV schedule
(:class:`~attnreg_flashmla.kernel.Schedule`) for ``s_q * H`` query rows:
computed for an eager batch in ``init_forward_metadata``; for graphs held in
buffers allocated once and recomputed from the replayed sequence lengths in
``init_forward_metadata_replay``, outside the graph, before every replay
(declared ``split_kv: host_planned``).  One plan serves every layer of a
step: the forward hooks receive the layer (:class:`~attnreg.runtime.MLAKVLayer`)
and read its buffer and FP8 scale.

Sparse (DSA) MLA (``forward_sparse``; docs/sparse.md) runs on decode and extend
batches alike, one query row per index row: over ``fp8_ds_mla`` rows through
the sparse fp8 decode kernel, over bf16 rows through the sparse prefill kernel
(:func:`~attnreg_flashmla.kernel.sparse_decode` / ``sparse_prefill``).  The
runtime has refused every index that is neither -1 nor a pool slot before a
hook here runs.  The fp8 kernel's schedule depends only on (rows, heads,
top-k): the plan holds one library schedule object per top-k width, filled on
the device by the step's first call and reused by its other layers; under
capture it is filled inside the graph, so nothing is read on the host and
nothing is frozen that a replay would need changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from attnreg.registry import (
    Capabilities,
    DType,
    ForwardMethod,
    ForwardMode,
    Phase,
    SparseKVFormat,
    UnsupportedError,
)
from attnreg.runtime import (
    AttentionBackend,
    ForwardBatch,
    ForwardMetadata,
    GraphState,
    MLAConfig,
    MLAKVLayer,
)

from . import kernel
from .declaration import DECODE_FORWARD_MODES, MAX_SM90_SMS, scheduler_shapes

__all__ = ["FlashMLABackend", "FlashMLAGraphBuffers", "FlashMLAPlan"]

#: The forward modes one kernel call serves (DECODE, TARGET_VERIFY), from the declaration.
_SERVED_MODES = tuple(f.mode for f in DECODE_FORWARD_MODES)
_NOT_SERVED_HINT = ("run prefill / extend batches with another backend (e.g. flashinfer_mla "
                    "or triton); flashmla serves decode and target-verify batches only")
_DRAFT_EXTEND_WHY = ("a draft-extend batch carries ragged accepted lengths, and one FlashMLA "
                     "call takes one query length (s_q) for the whole batch")


@dataclass
class FlashMLAPlan:
    """What one batch (or captured shape) reads besides the runtime's buffers.

    ``schedule``: FlashMLA's split-KV schedule, fresh tensors for an eager
    batch, views of :class:`FlashMLAGraphBuffers` for a captured shape.
    ``tokens_per_seq``: the query tokens per sequence the call is made for
    (1 for decode, the draft tokens for target verify): the schedule depends
    on it (``s_q * H`` query rows).  An extend batch (served by the sparse
    kernels only) has no dense schedule (None).
    """

    schedule: kernel.Schedule | None
    tokens_per_seq: int = 1
    #: the sparse fp8 kernel's schedule objects (``FlashMLASchedMeta``) by top-k width,
    #: filled by the first sparse call of the step, reused by its other layers
    sparse_meta: dict[int, Any] = field(default_factory=dict)


@dataclass
class FlashMLAGraphBuffers:
    """Allocated once by ``init_cuda_graph_state``: the schedule every captured shape reads.

    ``tile_scheduler_metadata`` int32 ``[num_sm_parts(H), 8]`` and
    ``num_splits`` int32 ``[max_bs + 1]``, sized by
    :func:`attnreg_flashmla.declaration.scheduler_shapes`; a captured shape
    reads views of them shaped like its own schedule
    (:meth:`~attnreg_flashmla.kernel.Schedule.view_like`).
    """

    schedule: kernel.Schedule


class FlashMLABackend(AttentionBackend[FlashMLAPlan, FlashMLAGraphBuffers]):
    """FlashMLA's dense MLA decode (sgl-flash-mla legacy kernels, sm90).

    Constructed by attnreg as ``FlashMLABackend(config, capabilities=caps)``;
    takes no options.  Imports ``flash_mla`` on construction: without it the
    backend is unavailable with an install hint.

    Raises
    ------
    BackendUnavailableError
        When ``flash_mla`` cannot be imported or has no legacy kernels.
    UnsupportedError
        When ``config`` asks for what the declaration does not cover (page
        size other than 64, a head count not run on the device, fp16): neither
        the dense decode kernels nor a sparse kernel accepts it.
    """

    #: FlashMLA allocates its output: a forward called without ``out=`` (an engine's
    #: layer, a graph session) returns that tensor instead of copying it into another
    #: (measured on the H200: the copy was the one launch beside the library's two).
    returns_kernel_output = True

    def __init__(self, config: MLAConfig, *, capabilities: Capabilities,
                 **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        reasons = capabilities.check_request(
            ForwardMethod.MLA, Phase.DECODE, head_dims=config.mla_head_dims,
            q_dtype=config.q_dtype, kv_dtype=config.kv_dtype, page_size=config.page_size,
            num_heads=config.num_heads)
        if reasons and capabilities.sparse_kernels:
            # a configuration only the sparse kernels serve (a DSA model) is accepted too
            sparse = [capabilities.check_sparse_request(
                phase, q_dtype=config.q_dtype, kv_dtype=config.kv_dtype,
                page_size=config.page_size, num_heads=config.num_heads)
                for phase in (Phase.DECODE, Phase.PREFILL)]
            if config.mla_head_dims == (576, 512) and not all(sparse):
                reasons = []
            else:
                reasons = reasons + [f"sparse MLA: {r}" for r in sparse[0]]
        if reasons:
            raise UnsupportedError(self.name, "configuration", reasons,
                                   "see `attnreg backends --json` for what flashmla "
                                   "declares, or choose another backend")
        self._lib = kernel.load_library()
        self._fp8 = DType.parse(config.kv_dtype) is DType.FP8_E4M3

    # ------------------------------------------------------------------------------
    # planning
    # ------------------------------------------------------------------------------
    def _schedule(self, seq_lens: torch.Tensor, tokens_per_seq: int) -> kernel.Schedule:
        return kernel.schedule(self._lib, seq_lens, self.config.num_heads,
                               tokens_per_seq=tokens_per_seq, fp8=self._fp8)

    def _tokens_per_seq(self, md: ForwardMetadata[FlashMLAPlan]) -> int:
        """Query tokens per sequence of a batch this backend serves, or refuse the batch.

        Decode: 1.  Target verify: every sequence's draft tokens (uniform: the
        batch builder and the base class's forward-mode check insist), the
        captured draft tokens for graph metadata.  Extend: 0 (no dense kernel
        call; the sparse kernels serve it, one row per token).
        """
        if md.forward_mode is ForwardMode.EXTEND and self.capabilities.serves_sparse(
                Phase.PREFILL):
            return 0
        if md.forward_mode not in _SERVED_MODES:
            why = _DRAFT_EXTEND_WHY if md.forward_mode is ForwardMode.DRAFT_EXTEND else \
                "flashmla has no prefill kernel"
            raise UnsupportedError(self.name, f"{md.forward_mode} batch",
                                   f"flashmla serves decode and target-verify batches only: "
                                   f"{why}", _NOT_SERVED_HINT)
        return 1 if md.forward_mode is ForwardMode.DECODE else md.max_extend_len

    def _init_metadata_impl(self, md: ForwardMetadata[FlashMLAPlan]) -> None:
        tokens = self._tokens_per_seq(md)
        md.plan = FlashMLAPlan(self._schedule(md.seq_lens, tokens) if tokens else None, tokens)

    def _init_graph_state_impl(self, state: GraphState[FlashMLAGraphBuffers]) -> None:
        # sparse graphs read no dense schedule (their own is filled inside the graph)
        if Phase.DECODE not in state.graph_modes or state.sparse:
            return
        # The shape the declaration's capture memory is asked about: one source of the
        # SM count (the device's; the largest sm90 part's where torch cannot tell).
        meta_shape, splits_shape = scheduler_shapes(
            state.max_bs, self.config.num_heads,
            num_sms=state.capture_shape.num_sms or MAX_SM90_SMS)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=self.device)

        state.buffers = FlashMLAGraphBuffers(kernel.Schedule(ints(*meta_shape),
                                                             ints(*splits_shape)))

    def _init_capture_impl(self, md: ForwardMetadata[FlashMLAPlan]) -> None:
        tokens = self._tokens_per_seq(md)
        if not tokens or self._require_graph_state().sparse:
            # a sparse capture: the fp8 kernel's schedule is filled by the first call
            # inside the graph (a fresh plan: nothing of an eager batch's is reused)
            md.plan = FlashMLAPlan(None, tokens)
            return
        # the capture batch's own schedule, so warm-up and capture read real values; its
        # shape (partitions for s_q * H rows, bs + 1 splits) is the library's
        fresh = self._schedule(md.seq_lens, tokens)
        try:
            sched = self._require_buffers().schedule.view_like(fresh)
        except ValueError as exc:
            raise UnsupportedError(self.name, f"captured shape bs={md.batch_size}, "
                                   f"{tokens} tokens per sequence", str(exc),
                                   "call init_cuda_graph_state on the device the graphs run "
                                   "on, with bounds covering this shape") from exc
        sched.refresh(fresh)
        md.plan = FlashMLAPlan(sched, tokens)

    def _init_replay_impl(self, md: ForwardMetadata[FlashMLAPlan], batch: ForwardBatch) -> None:
        # Outside the graph, before every replay: the scheduler runs on the replayed
        # lengths (already in md.seq_lens) into the buffers the graph reads.  Never
        # frozen at capture (sglang #26019).
        plan = self._plan(md)
        if plan.schedule is not None:  # sparse graphs recompute theirs inside the graph
            plan.schedule.refresh(self._schedule(md.seq_lens, plan.tokens_per_seq))

    def _plan(self, md: ForwardMetadata[FlashMLAPlan]) -> FlashMLAPlan:
        if md.plan is None:  # the base class plans every metadata it hands out
            raise UnsupportedError(self.name, "forward without a plan",
                                   "this metadata was not planned by flashmla",
                                   "call init_forward_metadata (eager) or "
                                   "init_forward_metadata_capture (graphs) first")
        return md.plan

    # ------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------
    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[FlashMLAPlan], out: torch.Tensor | None, *,
                             lse: torch.Tensor | None = None,
                             q_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._attend(q, pool, md, out, lse, q_scale)

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[FlashMLAPlan], out: torch.Tensor | None, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None,
                             q_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        # Only target-verify batches get here (the plan refused every other extend); the
        # base class allows nothing but absorbed MLA over the pool for them.
        assert pool is not None and method is ForwardMethod.MLA
        return self._attend(q, pool, md, out, lse, q_scale)

    def _attend(self, q: torch.Tensor, layer: MLAKVLayer, md: ForwardMetadata[FlashMLAPlan],
                out: torch.Tensor | None, lse: torch.Tensor | None,
                q_scale: torch.Tensor | None) -> torch.Tensor | None:
        """One kernel call for ``s_q`` query tokens per sequence over ``layer``; an fp8
        ``q`` (the base class checked it comes with its ``q_scale``) goes in as given.
        Into ``out`` when given, else the library's own output is returned."""
        plan = self._plan(md)
        tokens = plan.tokens_per_seq
        if plan.schedule is None:
            raise UnsupportedError(self.name, "dense decode on sparse graph metadata",
                                   "this shape was captured for forward_sparse (no dense "
                                   "split-KV schedule was planned)",
                                   "capture dense decode in a graph state allocated with "
                                   "sparse=False")
        scale = self.config.softmax_scale
        q = q if q.is_contiguous() else q.contiguous()
        if self._fp8:
            if q_scale is not None:
                # the engine's own fp8 q and scale: the kernel's input as it is
                q8, q_descale = q, q_scale.reshape(1)
            else:
                # q is rounded to fp8 per tensor on the device (the declaration says so:
                # q_compute_dtype fp8); padded sequences of a replay (length 0) do not set
                # the scale: seq_lens is the live-row mask as is (nonzero = live, no
                # comparison launch).  Rows grouped per sequence: [B, s_q * H, 576].
                q8, q_descale = kernel.quantize_q(q.view(md.batch_size, -1, q.shape[-1]),
                                                  md.seq_lens)
            result, lse_lib = kernel.decode(self._lib, q8.view(q.shape), layer.buffer,
                                            md.page_table, md.seq_lens, plan.schedule,
                                            softmax_scale=scale, tokens_per_seq=tokens,
                                            q_descale=q_descale,
                                            kv_descale=layer.scale_tensor)
        else:
            result, lse_lib = kernel.decode(self._lib, q, layer.buffer, md.page_table,
                                            md.seq_lens, plan.schedule, softmax_scale=scale,
                                            tokens_per_seq=tokens)
        if self._fp8 or tokens > 1:
            # The bf16 kernel's rows for empty sequences (padding) were measured to be exactly
            # zero with one query token; not for the fp8 kernel, nor with several tokens
            # (causal over a length-0 sequence), so those are zeroed in the library's output
            # or as it is copied into out (one launch in a graph; nothing or a plain copy
            # for eager metadata, which has no padding).  The base class sets their LSE.
            if out is None:
                self.zero_padded_rows(result, md)
            else:
                self.zero_padded_rows(out, md, src=result)
        elif out is not None:
            out.copy_(result)
        if lse is not None:
            kernel.store_lse(lse_lib, lse)
        return result if out is None else None

    # ------------------------------------------------------------------------------
    # sparse (DSA)
    # ------------------------------------------------------------------------------
    def _forward_sparse_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[FlashMLAPlan], out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        """One library call for every query row: the fp8 kernel over ``fp8_ds_mla`` rows,
        the prefill kernel over bf16 rows (the base class matched the pool's rows to a
        declared kernel and checked every index)."""
        plan = self._plan(md)
        scale = self.config.softmax_scale
        q = q if q.is_contiguous() else q.contiguous()
        indices = indices if indices.is_contiguous() else indices.contiguous()
        if pool.kv_format is SparseKVFormat.FP8_DS_MLA:
            top_k = int(indices.shape[-1])
            meta = plan.sparse_meta.get(top_k)
            if meta is None:
                meta = plan.sparse_meta[top_k] = self._lib.get_mla_metadata()[0]
            result, lse_lib = kernel.sparse_decode(self._lib, q, pool.buffer, indices, meta,
                                                   softmax_scale=scale)
            lse_rows = None if lse_lib is None else lse_lib.view(q.shape[0], q.shape[1])
        else:
            result, lse_rows = kernel.sparse_prefill(self._lib, q, pool.buffer, indices,
                                                     softmax_scale=scale,
                                                     want_lse=lse is not None)
        out.copy_(result)
        # a row whose indices are all -1 attends nothing: 0 and -inf, whatever the kernel
        # left there (device ops only: capture-safe)
        empty = (indices == -1).all(dim=-1)
        out.masked_fill_(empty[:, None, None], 0.0)
        if lse is not None:
            assert lse_rows is not None
            lse.copy_(lse_rows)
            inf = float("inf")
            torch.nan_to_num(lse, nan=float("nan"), posinf=-inf, neginf=-inf, out=lse)
            lse.masked_fill_(empty[:, None], -inf)
