"""The runtime of ``flashmla``: imported only when the backend is instantiated.

attnreg's :class:`~attnreg.runtime.AttentionBackend` has checked each request
against the declaration (page size, heads, dtypes, forward method, capture
mode) before a hook here runs, and this class refuses at construction a
configuration the declaration does not cover, so no FlashMLA assert or
``TORCH_CHECK`` ever reaches a user.

Per batch the only plan is FlashMLA's split-KV schedule
(:class:`~attnreg_flashmla.kernel.Schedule`): computed for an eager batch in
``init_forward_metadata``; for graphs held in buffers allocated once and
recomputed from the replayed sequence lengths in
``init_forward_metadata_replay``, outside the graph, before every replay
(declared ``split_kv: host_planned``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from attnreg.registry import (
    Capabilities,
    DType,
    ForwardMethod,
    ForwardMode,
    Phase,
    UnsupportedError,
)
from attnreg.runtime import (
    AttentionBackend,
    ForwardBatch,
    ForwardMetadata,
    GraphState,
    MLAConfig,
    MLAKVPool,
)

from . import kernel
from .declaration import MAX_SM90_SMS, scheduler_shapes

__all__ = ["FlashMLABackend", "FlashMLAGraphBuffers", "FlashMLAPlan"]

_DECODE_ONLY_HINT = ("run prefill / extend batches with another backend "
                     "(e.g. flashinfer_mla or triton); flashmla serves decode only")


@dataclass
class FlashMLAPlan:
    """What one decode batch (or captured shape) reads besides the runtime's buffers.

    ``schedule``: FlashMLA's split-KV schedule, fresh tensors for an eager
    batch, views of :class:`FlashMLAGraphBuffers` for a captured shape.
    """

    schedule: kernel.Schedule


@dataclass
class FlashMLAGraphBuffers:
    """Allocated once by ``init_cuda_graph_state``: the schedule every captured shape reads.

    ``tile_scheduler_metadata`` int32 ``[num_sm_parts, 8]`` (the same for
    every batch size) and ``num_splits`` int32 ``[max_bs + 1]`` (a captured
    batch of ``bs`` reads the first ``bs + 1``), sized by
    :func:`attnreg_flashmla.declaration.scheduler_shapes`.
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
        size other than 64, a head count not run on the device, fp16).
    """

    def __init__(self, config: MLAConfig, *, capabilities: Capabilities,
                 **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        reasons = capabilities.check_request(
            ForwardMethod.MLA, Phase.DECODE, head_dims=config.mla_head_dims,
            q_dtype=config.q_dtype, kv_dtype=config.kv_dtype, page_size=config.page_size,
            num_heads=config.num_heads)
        if reasons:
            raise UnsupportedError(self.name, "configuration", reasons,
                                   "see `attnreg backends --json` for what flashmla "
                                   "declares, or choose another backend")
        self._lib = kernel.load_library()
        self._fp8 = DType.parse(config.kv_dtype) is DType.FP8_E4M3

    # ------------------------------------------------------------------------------
    # planning
    # ------------------------------------------------------------------------------
    def _schedule(self, seq_lens: torch.Tensor) -> kernel.Schedule:
        return kernel.schedule(self._lib, seq_lens, self.config.num_heads, fp8=self._fp8)

    def _require_decode(self, md: ForwardMetadata[FlashMLAPlan]) -> None:
        if md.forward_mode is not ForwardMode.DECODE:
            raise UnsupportedError(self.name, f"{md.forward_mode} batch",
                                   "flashmla serves decode batches only", _DECODE_ONLY_HINT)

    def _init_metadata_impl(self, md: ForwardMetadata[FlashMLAPlan]) -> None:
        self._require_decode(md)
        md.plan = FlashMLAPlan(self._schedule(md.seq_lens))

    def _init_graph_state_impl(self, state: GraphState[FlashMLAGraphBuffers]) -> None:
        if Phase.DECODE not in state.graph_modes:
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
        self._require_decode(md)
        sched = self._require_buffers().schedule.for_batch(md.batch_size)
        # the capture batch's own schedule, so warm-up and capture read real values
        sched.refresh(self._schedule(md.seq_lens))
        md.plan = FlashMLAPlan(sched)

    def _init_replay_impl(self, md: ForwardMetadata[FlashMLAPlan], batch: ForwardBatch) -> None:
        # Outside the graph, before every replay: the scheduler runs on the replayed
        # lengths (already in md.seq_lens) into the buffers the graph reads.  Never
        # frozen at capture (sglang #26019).
        self._plan(md).schedule.refresh(self._schedule(md.seq_lens))

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
    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool,
                             md: ForwardMetadata[FlashMLAPlan], out: torch.Tensor) -> None:
        schedule = self._plan(md).schedule
        scale = self.config.softmax_scale
        q = q if q.is_contiguous() else q.contiguous()
        if self._fp8:
            # q is rounded to fp8 per tensor on the device (the declaration says so:
            # q_compute_dtype fp8); padded rows of a replay (length 0) do not set the scale
            q8, q_descale = kernel.quantize_q(q, md.seq_lens > 0)
            result, _ = kernel.decode(self._lib, q8, pool.buffer, md.page_table, md.seq_lens,
                                      schedule, softmax_scale=scale, q_descale=q_descale,
                                      kv_descale=pool.scale_tensor)
        else:
            result, _ = kernel.decode(self._lib, q, pool.buffer, md.page_table, md.seq_lens,
                                      schedule, softmax_scale=scale)
        out.copy_(result)
        if self._fp8:
            # The bf16 kernel's rows for empty sequences (padding) were measured to be exactly
            # zero; the fp8 kernel's were not, so they are zeroed here (two launches,
            # capture-safe; a no-op for eager metadata).
            self.zero_padded_rows(out, md)
