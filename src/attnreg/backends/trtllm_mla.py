"""The ``trtllm_mla`` backend: TensorRT-LLM-gen MLA kernels shipped in flashinfer.

Routing (the seed-000 defect 1 and the engines this is modelled on):

* decode: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` over the
  576-wide pool (sm100/sm103 only); an FP8 pool gets an FP8 query, scaled per
  tensor on the device first (:func:`attnreg.runtime.quantize_q_fp8`, declared
  as ``q_compute_dtype`` fp8), its descale passed in ``bmm1_scale`` as a tensor;
* target verify: the same kernel with the query ``[B, q_len, H, 576]`` (every
  request the same ``q_len`` draft tokens; the kernel masks each token causally
  from ``seq_lens``), eagerly and in the FULL decode graphs; a batch whose
  requests differ in length is refused before the kernel;
* MHA extend (eager): ``trtllm_ragged_attention_deepseek`` for batches without
  a cached prefix; batches with a prefix go to flashinfer's ragged wrapper
  (bottom-right causal over prefix + new tokens).  The ragged kernel only takes
  MHA head dims, and :meth:`TRTLLMMLABackend._run_ragged_kernel` refuses
  anything else before calling it: absorbed (576, 576, 512) tensors never reach
  it;
* absorbed MLA extend, eager or under any capture mode: flashinfer's paged MLA
  (the declared FALLBACK to ``flashinfer_mla``).  flashinfer's Blackwell MLA
  kernel has no FP8 path, so an FP8 pool is converted to the query dtype in
  full first (inside the graph under capture: the declared HIGH cost);
* MHA under any capture mode (``current_capture()``) is refused: extend is
  pinned to MLA there.

The native kernels need a Blackwell GPU; elsewhere they are refused with an
:class:`UnsupportedError` before flashinfer is called, while the flashinfer
fallback runs anywhere flashinfer does (tests run it on sm90 with the sm100
declaration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attnreg.graph_policy.capture import current_capture, in_eager_break, note_served_by
from attnreg.registry import ForwardMethod, ForwardMode, Phase, UnsupportedError
from attnreg.runtime import (
    PADDING_PAGE,
    AttentionBackend,
    ForwardBatch,
    ForwardMetadata,
    GraphState,
    MLAConfig,
    MLAKVPool,
    device_sm,
    quantize_q_fp8,
    torch_dtype,
)

from .declarations.trtllm_mla import BLACKWELL, WORKSPACE_BYTES, decode_table_width
from .flashinfer_mla import (
    FlashInferGraphBuffers,
    FlashInferMLAKernels,
    FlashInferPlan,
    import_flashinfer,
    lookup,
)

__all__ = ["RAGGED_HEAD_DIMS", "TRTLLMGraphBuffers", "TRTLLMMLABackend", "TRTLLMPlan"]

#: (q, k, v) head dims ``trtllm_ragged_attention_deepseek`` accepts (it asserts otherwise).
RAGGED_HEAD_DIMS = ((192, 192, 128), (128, 128, 128), (256, 256, 256))


@dataclass
class TRTLLMPlan:
    """Decode: the aligned block tables and lengths the kernel reads (None until first
    needed); prefill: the flashinfer fallback's plan."""

    decode_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    fallback: FlashInferPlan = field(default_factory=FlashInferPlan)


@dataclass
class TRTLLMGraphBuffers:
    """Decode block tables / clamped lengths, and the fallback's index buffers (None:
    that phase is not captured)."""

    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    fallback: FlashInferGraphBuffers | None = None


class TRTLLMMLABackend(AttentionBackend[TRTLLMPlan, TRTLLMGraphBuffers]):
    """TRT-LLM-gen MLA decode and ragged prefill, with flashinfer's paged MLA for extend.

    Parameters
    ----------
    config : MLAConfig
    capabilities : Capabilities
    fallback_mla_backend : {"auto", "fa3", "fa2"}
        flashinfer's paged-MLA implementation used for absorbed extend.
    """

    def __init__(self, config: MLAConfig, *, capabilities: Any,
                 fallback_mla_backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        fi = import_flashinfer(self.name)
        self._decode_kernel = lookup(fi, "decode", "trtllm_batch_decode_with_kv_cache_mla",
                                     owner=self.name)
        self._ragged_kernel = lookup(fi, "prefill", "trtllm_ragged_attention_deepseek",
                                     owner=self.name)
        self.fallback = FlashInferMLAKernels(self.name, config, self.device,
                                             mla_backend=fallback_mla_backend)
        # trtllm-gen keeps multi-CTA counters in its workspace: it must start zeroed.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.int8, device=self.device)
        self.device_sm = device_sm(self.device)

    # -- the native kernels need Blackwell -------------------------------------------------
    def _require_blackwell(self, kernel: str) -> None:
        if self.device_sm in BLACKWELL:
            return
        here = f"sm{self.device_sm}" if self.device_sm is not None else self.device.type
        raise UnsupportedError(
            self.name, f"{kernel} on this device",
            f"trtllm-gen MLA needs sm100/sm103 (Blackwell); this is {here}",
            "run trtllm_mla on a Blackwell GPU, or choose flashinfer_mla / triton here")

    def _padded_width(self, width: int) -> int:
        return decode_table_width(width, self.config.page_size)

    # -- planning ----------------------------------------------------------------------
    def _fallback_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(q, kv) dtypes flashinfer sees: an FP8 pool is converted to the q dtype."""
        q_dtype = torch_dtype(self.config.q_dtype)
        kv_dtype = torch_dtype(self.config.kv_dtype)
        return q_dtype, (q_dtype if kv_dtype == torch.float8_e4m3fn else kv_dtype)

    def _init_metadata_impl(self, md: ForwardMetadata[TRTLLMPlan]) -> None:
        md.plan = TRTLLMPlan()

    def _init_graph_state_impl(self, state: GraphState[TRTLLMGraphBuffers]) -> None:
        # the declaration's decode_table_width / flashinfer's graph_index_sizes size these
        buffers = TRTLLMGraphBuffers()
        if Phase.DECODE in state.graph_modes:
            width = self._padded_width(state.max_pages)
            buffers.block_tables = torch.full((state.max_bs, width), PADDING_PAGE,
                                              dtype=torch.int32, device=self.device)
            buffers.seq_lens = torch.ones((state.max_bs,), dtype=torch.int32,
                                          device=self.device)
        if Phase.PREFILL in state.graph_modes:
            buffers.fallback = self.fallback.init_graph_buffers(state.capture_shape)
        state.buffers = buffers

    def _init_capture_impl(self, md: ForwardMetadata[TRTLLMPlan]) -> None:
        buffers = self._require_buffers()
        plan = md.plan = TRTLLMPlan()
        if md.phase is Phase.DECODE:
            assert buffers.block_tables is not None and buffers.seq_lens is not None
            bs = md.batch_size
            plan.decode_tables = buffers.block_tables[:bs]
            plan.decode_seq_lens = buffers.seq_lens[:bs]
        else:
            assert buffers.fallback is not None
            q_dtype, kv_dtype = self._fallback_dtypes()
            self.fallback.plan_capture(md, buffers.fallback, plan.fallback, q_dtype=q_dtype,
                                       kv_dtype=kv_dtype)

    def _init_replay_impl(self, md: ForwardMetadata[TRTLLMPlan], batch: ForwardBatch) -> None:
        if md.phase is Phase.PREFILL:
            self.fallback.plan_replay(md, md.plan.fallback if md.plan else None, batch)

    def _plan_of(self, md: ForwardMetadata[TRTLLMPlan]) -> TRTLLMPlan:
        if md.plan is None:
            md.plan = TRTLLMPlan()
        return md.plan

    def _decode_inputs(self, md: ForwardMetadata[TRTLLMPlan], query_len: int = 1
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables of an aligned width, seq_lens) for the decode kernel, whose
        requests bring ``query_len`` tokens each."""
        plan = self._plan_of(md)
        if md.is_graph:
            tables, seq_lens = plan.decode_tables, plan.decode_seq_lens
            assert tables is not None and seq_lens is not None, "bound at capture"
            # Device copies, recorded into the graph: the columns past the graph's
            # page table stay the padding page; padded sequences (length 0 in the
            # graph buffers) read padding rows instead of none -- query_len of them,
            # so that each query token (masked causally from seq_lens) sees one.
            tables[:, : md.page_table.shape[1]].copy_(md.page_table)
            torch.clamp(md.seq_lens, min=query_len, out=seq_lens)
            return tables, seq_lens
        if plan.decode_tables is None or plan.decode_seq_lens is None:
            width = md.page_table.shape[1]
            pad = self._padded_width(width) - width
            tables = torch.nn.functional.pad(md.page_table, (0, pad), value=PADDING_PAGE)
            plan.decode_tables, plan.decode_seq_lens = tables.contiguous(), md.seq_lens
        return plan.decode_tables, plan.decode_seq_lens

    # -- forward -----------------------------------------------------------------------
    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool,
                             md: ForwardMetadata[TRTLLMPlan], out: torch.Tensor) -> None:
        self._require_blackwell("trtllm_batch_decode_with_kv_cache_mla")
        # [B, q_len_per_request=1, H, 576]
        self._run_decode_kernel(q.unsqueeze(1), out.unsqueeze(1), pool, md,
                                self._decode_inputs(md), "trtllm decode inputs")
        # padded sequences attended over one padding row (the clamp above): zero them
        self.zero_padded_rows(out, md)
        note_served_by(self.name, self.name, "trtllm-gen decode")

    def _run_decode_kernel(self, query: torch.Tensor, out: torch.Tensor, pool: MLAKVPool,
                           md: ForwardMetadata[TRTLLMPlan],
                           inputs: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
        """One trtllm-gen decode launch of ``query [B, q_len, H, 576]`` into ``out
        [B, q_len, H, 512]`` (decode: q_len 1; verify: the draft tokens)."""
        cfg = self.config
        tables, seq_lens = inputs
        scale = pool.kv_scale
        bmm1_scale: float | torch.Tensor = cfg.softmax_scale * scale
        if pool.is_fp8:
            # The kernels pair an fp8 cache with an fp8 query.  A plain cast would turn
            # every |q| > 448 into 448 or NaN (absorbed queries get there), so q is
            # scaled per tensor first, on the device (declared: q_compute_dtype fp8),
            # and the descale rides in bmm1_scale as a float32 tensor (flashinfer 0.6.13
            # multiplies a tensor bmm1_scale by log2(e) itself).  Padded requests of a
            # replayed graph (length 0) hold stale q and do not set the scale.
            live = (md.seq_lens > 0)[:, None].expand(query.shape[0], query.shape[1])
            query, descale = quantize_q_fp8(query, live)
            bmm1_scale = descale * bmm1_scale
        with self.kernel_errors(what):
            self._decode_kernel(
                query=query, kv_cache=pool.buffer, workspace_buffer=self.workspace,
                qk_nope_head_dim=cfg.qk_nope_head_dim, kv_lora_rank=cfg.kv_lora_rank,
                qk_rope_head_dim=cfg.qk_rope_head_dim, block_tables=tables, seq_lens=seq_lens,
                max_seq_len=md.max_seq_len, out=out, bmm1_scale=bmm1_scale,
                bmm2_scale=scale)

    def _verify_query_len(self, md: ForwardMetadata[TRTLLMPlan]) -> int:
        """Draft tokens per request of a target-verify batch; refused unless every
        request has the same number (the kernel takes one ``q_len_per_request``)."""
        bs, q_len = md.batch_size, md.max_extend_len
        lens = md.extend_lens_cpu  # None under graph metadata: the shape is captured
        if bs * q_len != md.num_tokens or (lens is not None and len(set(lens)) > 1):
            got = list(lens) if lens is not None else f"{md.num_tokens} tokens for {bs}"
            raise UnsupportedError(
                self.name, "target-verify batch with uneven draft tokens",
                "trtllm_batch_decode_with_kv_cache_mla takes one query length for every "
                f"request ([B, q_len, H, 576]); this batch has {got}",
                "verify the same number of draft tokens in every sequence, or run ragged "
                "verify batches on flashinfer_mla")
        return q_len

    def _forward_verify(self, q: torch.Tensor, pool: MLAKVPool,
                        md: ForwardMetadata[TRTLLMPlan], out: torch.Tensor) -> None:
        """Target verify: the decode kernel with ``q_len`` causal query tokens per request."""
        q_len = self._verify_query_len(md)
        self._require_blackwell("trtllm_batch_decode_with_kv_cache_mla")
        bs, heads = md.batch_size, q.shape[1]
        # [B * q_len, H, 576] -> [B, q_len_per_request, H, 576]: token rows are grouped by
        # request (qo_indptr = arange * q_len), so this is a view
        self._run_decode_kernel(q.view(bs, q_len, heads, q.shape[-1]),
                                out.view(bs, q_len, heads, out.shape[-1]), pool, md,
                                self._decode_inputs(md, q_len), "trtllm target-verify inputs")
        # padded sequences attended over padding rows (the clamp above): zero them
        self.zero_padded_rows(out, md)
        note_served_by(self.name, self.name, "trtllm-gen target verify")

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata[TRTLLMPlan], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        if md.num_tokens == 0:
            return
        if md.forward_mode is ForwardMode.TARGET_VERIFY:
            assert pool is not None and method is ForwardMethod.MLA  # checked by the base
            self._forward_verify(q, pool, md, out)
            return
        mode = None if in_eager_break() else current_capture()
        if method is ForwardMethod.MLA:
            # No trtllm kernel takes absorbed extend: it is flashinfer's paged MLA,
            # eagerly and under every capture mode (the declared fallback).
            assert pool is not None  # checked by the base class
            self.fallback.run_mla(q, self._fallback_cache(pool, q.dtype), md,
                                  self._plan_of(md).fallback, out)
            # the fallback's filler request computed the padding rows: zero them
            self.zero_padded_rows(out, md)
            # what ran is flashinfer_mla's paged MLA: the conformance suite checks
            # this against the declared FALLBACK target
            note_served_by(self.name, "flashinfer_mla", "paged MLA")
            return
        if mode is not None or md.is_graph:
            raise UnsupportedError(
                self.name, f"{method} extend under {mode or 'graph'} capture",
                "under capture trtllm_mla falls back to flashinfer's paged MLA, which takes "
                "absorbed tensors only", "call forward_extend(..., method=ForwardMethod.MLA)")
        assert k is not None and v is not None
        if md.prefix_lens_cpu is None or any(p > 0 for p in md.prefix_lens_cpu):
            self.fallback.run_ragged(q, k, v, md, self._plan_of(md).fallback, out)
            note_served_by(self.name, "flashinfer_mla", "ragged prefill with prefix")
        else:
            self._run_ragged_kernel(q, k, v, md, out)
            note_served_by(self.name, self.name, "trtllm ragged prefill")

    def _fallback_cache(self, pool: MLAKVPool, q_dtype: torch.dtype) -> torch.Tensor:
        """The pool as flashinfer's paged MLA reads it: an FP8 pool converted in full.

        Under capture the converted copy is allocated inside the graph and stays in its
        pool: the declaration's ``fallback_capture_bytes`` counts it from
        ``CaptureShape.kv_pool_bytes``.
        """
        if not pool.is_fp8:
            return pool.buffer
        converted = pool.buffer.to(q_dtype)
        if pool.kv_scale != 1.0:
            converted.mul_(pool.kv_scale)
        return converted

    def _run_ragged_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           md: ForwardMetadata[TRTLLMPlan], out: torch.Tensor) -> None:
        dims = (q.shape[-1], k.shape[-1], v.shape[-1])
        if dims not in RAGGED_HEAD_DIMS:
            raise UnsupportedError(
                self.name, "ragged prefill head dims",
                f"trtllm_ragged_attention_deepseek takes (q, k, v) head dims "
                f"{list(RAGGED_HEAD_DIMS)}, got {dims}",
                "absorbed MLA extend runs through flashinfer's paged MLA: call "
                "forward_extend(..., method=ForwardMethod.MLA)")
        self._require_blackwell("trtllm_ragged_attention_deepseek")
        with self.kernel_errors("trtllm ragged prefill inputs"):
            self._ragged_kernel(
                query=q, key=k, value=v, workspace_buffer=self.workspace, seq_lens=md.seq_lens,
                max_q_len=md.max_extend_len, max_kv_len=md.max_seq_len,
                bmm1_scale=self.config.softmax_scale, bmm2_scale=1.0, o_sf_scale=1.0,
                batch_size=md.batch_size, window_left=-1, cum_seq_lens_q=md.qo_indptr,
                cum_seq_lens_kv=md.kv_indptr, enable_pdl=False, is_causal=True,
                return_lse=False, out=out)
