"""The ``triton`` backend: attnreg's own Triton MLA kernels behind the runtime interface.

* decode: ``mla_decode``, split-KV over a static grid of ``max_splits`` with
  per-sequence split counts computed on the device, so a graph captured once
  replays correctly for any lengths up to the capture bound;
* extend, MLA: ``mla_extend`` over the paged pool (causal within the new tokens),
  split-KV on the same static-grid / device-side-count scheme when a short extend
  over a long prefix would leave the GPU idle (a few new tokens at B=1);
* extend, MHA: ``mha_prefill`` over ragged k / v (bottom-right causal);
  chunked-prefix MHA: ``mha_prefill`` causal over the new tokens, then unmasked
  over each prefix chunk (the base class merges by LSE);
* speculative batches (target verify, draft extend): ``mla_extend`` with the
  prefix, eagerly and in the FULL decode graphs (see the class docstring).

* sparse (DSA) decode: ``mla_sparse_decode``, each sequence's query attends the pool
  slots of its top-k index row (bf16 rows; docs/sparse.md).

Every kernel writes the log-sum-exp when asked (``return_lse=True``).

Under capture the split counts and the workspaces are fixed in
``init_cuda_graph_state`` / ``init_forward_metadata_capture``; the captured
region then allocates nothing of its own and reads no host value (lengths are
read by the kernels on the device).  The workspaces are sized by
:mod:`attnreg.backends.declarations.triton_sizing`, the functions the
declaration estimates its capture memory with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from attnreg.registry import CaptureShape, ForwardMethod, Phase
from attnreg.runtime import (
    AttentionBackend,
    ForwardMetadata,
    GraphState,
    MLAConfig,
    MLAKVLayer,
    PrefixChunk,
    device_num_sms,
)

from ._triton_kernels import (
    MLADecodeWorkspace,
    MLAExtendWorkspace,
    mha_prefill,
    mla_decode,
    mla_decode_workspace,
    mla_extend,
    mla_extend_workspace,
    mla_sparse_decode,
)
from .declarations.triton_sizing import (
    LATENT,
    SplitOptions,
    decode_graph_rows,
    decode_rounds_q,
    default_extend_splits,
    default_max_splits,
    extend_partial_rows,
)

__all__ = ["TritonGraphBuffers", "TritonMLABackend", "TritonPlan"]

#: num_sms on a cpu, where the kernels run in the Triton interpreter.
_CPU_NUM_SMS = 8


@dataclass
class TritonPlan:
    """What the Triton backend plans per batch or captured shape.

    ``splits``: the static split count of the launch (decode ``max_splits``,
    extend ``num_splits``); ``workspace``: the split-KV partials it writes
    (None with one split, and for an eager extend until its first MLA forward).
    """

    splits: int
    workspace: MLADecodeWorkspace | MLAExtendWorkspace | None = None


@dataclass
class TritonGraphBuffers:
    """Flat fp32 split-KV workspaces every captured shape views (None: mode not captured)."""

    decode_partial_out: torch.Tensor | None = None
    decode_partial_lse: torch.Tensor | None = None
    extend_partial_out: torch.Tensor | None = None
    extend_partial_lse: torch.Tensor | None = None


class TritonMLABackend(AttentionBackend[TritonPlan, TritonGraphBuffers]):
    """MLA decode / extend and MHA prefill with the Triton kernels of ``_triton_kernels``.

    Speculative batches run the extend kernel, not the decode kernel with
    several query rows, because it is the faster design and already exact:
    it packs ``queries x heads`` into its 64-row MMA tile (``extend_tile``), so
    at 16 heads the 4 draft tokens of a sequence share one pass over its KV,
    where a decode program per query would stream the KV 4 times; at 128 heads
    both stream it ``drafts x 2`` times (one 64-head block per pass).  It
    also has the bottom-right causal mask among the drafts, split-KV with
    device-side chunks (a graph captured once replays any prefix length) and
    a static grid bounded by the captured tokens per sequence.  The decode
    kernel would need a causal mask and a query-row axis first.

    Parameters
    ----------
    config : MLAConfig
    capabilities : Capabilities
    num_sms : int, optional
        Multiprocessors the split heuristic fills (default: the device's count;
        8 on cpu, where the kernels run in the Triton interpreter).
    max_kv_splits : int, optional
        Cap on the static split count of decode and MLA extend launches (default:
        the heuristics ``default_max_splits`` / ``default_extend_splits``).
    force_kv_splits : int, optional
        Use exactly this many splits for every sequence, decode and MLA extend
        (tests, tuning; ``1`` turns split-KV off).
    """

    def __init__(self, config: MLAConfig, *, capabilities: Any, num_sms: int | None = None,
                 max_kv_splits: int | None = None, force_kv_splits: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        if num_sms is None:
            num_sms = device_num_sms(self.device) or _CPU_NUM_SMS
        for opt, value in (("num_sms", num_sms), ("max_kv_splits", max_kv_splits),
                           ("force_kv_splits", force_kv_splits)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{opt} must be a positive int, got {value!r}")
        self.num_sms = int(num_sms)
        self.max_kv_splits = max_kv_splits
        self.force_kv_splits = force_kv_splits
        self.split_options = SplitOptions(cap=max_kv_splits, force=force_kv_splits)

    # -- planning ----------------------------------------------------------------------
    def _splits_for(self, batch_size: int, max_seq_len: int) -> int:
        # Not cached: an engine's longest sequence grows every decode step, so a cache
        # keyed on it would miss every step and grow without bound.
        return self.split_options.apply(default_max_splits(
            batch_size, self.config.num_heads, max_seq_len, self.num_sms,
            self.config.kv_dtype, self.config.page_size))

    def _extend_splits_for(self, batch_size: int, num_tokens: int, max_seq_len: int) -> int:
        return self.split_options.apply(default_extend_splits(
            batch_size, num_tokens, self.config.num_heads, max_seq_len, self.num_sms))

    def capture_shape(self, max_bs: int, max_num_tokens: int, max_seq_len: int
                      ) -> CaptureShape:
        # the split heuristic fills this backend's num_sms (8 on cpu), not the device's
        return replace(super().capture_shape(max_bs, max_num_tokens, max_seq_len),
                       num_sms=self.num_sms)

    def _init_metadata_impl(self, md: ForwardMetadata[TritonPlan]) -> None:
        if not md.is_decode:
            # Extend, verify and draft extend run the extend kernel.  Its workspace is
            # allocated by the first MLA forward: an MHA prefill batch never needs it.
            md.plan = TritonPlan(self._extend_splits_for(md.batch_size, md.num_tokens,
                                                         md.max_seq_len))
            return
        splits = self._splits_for(md.batch_size, md.max_seq_len)
        # One split-KV workspace per batch, shared by every layer's forward (they run
        # one after another on the stream), instead of one allocation per forward.
        workspace = mla_decode_workspace(md.batch_size, self.config.num_heads, splits,
                                         self.device) \
            if splits > 1 and md.batch_size > 0 else None
        md.plan = TritonPlan(splits, workspace)

    def _init_graph_state_impl(self, state: GraphState[TritonGraphBuffers]) -> None:
        # Sized by the declaration's own functions (triton_sizing), for the modes captured.
        shape, options = state.capture_shape, self.split_options
        heads = self.config.num_heads
        buffers = TritonGraphBuffers()
        if state.sparse:  # sparse graphs run mla_sparse_decode: no split-KV workspace
            state.buffers = buffers
            return

        def floats(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.float32, device=self.device)

        if Phase.DECODE in state.graph_modes:
            # one flat workspace for decode and speculative graphs (they replay one at a time)
            rows = decode_graph_rows(shape, options)
            buffers.decode_partial_out = floats(rows * heads * LATENT)
            buffers.decode_partial_lse = floats(rows * heads)
        if Phase.PREFILL in state.graph_modes:
            rows = extend_partial_rows(shape, options)
            if rows:  # some captured token count would split
                buffers.extend_partial_out = floats(rows * heads * LATENT)
                buffers.extend_partial_lse = floats(rows * heads)
        state.buffers = buffers

    def _init_capture_impl(self, md: ForwardMetadata[TritonPlan]) -> None:
        state = self._require_graph_state()
        if state.sparse:  # mla_sparse_decode: one launch, nothing planned
            md.plan = TritonPlan(1)
            return
        buffers = self._require_buffers()
        heads, latent = self.config.num_heads, LATENT
        if md.phase is Phase.PREFILL:
            nt = md.num_tokens
            splits = self._extend_splits_for(md.batch_size, nt, state.max_seq_len)
            md.plan = TritonPlan(splits)
            if splits > 1:
                po, pl = buffers.extend_partial_out, buffers.extend_partial_lse
                assert po is not None and pl is not None, "sized for every captured shape"
                md.plan.workspace = MLAExtendWorkspace(
                    po[:nt * splits * heads * latent].view(nt, splits, heads, latent),
                    pl[:nt * splits * heads].view(nt, splits, heads))
            return
        bs = md.batch_size
        po, pl = buffers.decode_partial_out, buffers.decode_partial_lse
        if not md.is_decode:  # a verify / draft-extend graph: the split extend kernel
            nt = md.num_tokens
            splits = self._extend_splits_for(bs, nt, state.max_seq_len)
            md.plan = TritonPlan(splits)
            if splits > 1:
                assert po is not None and pl is not None, "sized for every captured shape"
                md.plan.workspace = MLAExtendWorkspace(
                    po[:nt * splits * heads * latent].view(nt, splits, heads, latent),
                    pl[:nt * splits * heads].view(nt, splits, heads))
            return
        splits = self._splits_for(bs, state.max_seq_len)
        md.plan = TritonPlan(splits)
        if splits > 1:
            assert po is not None and pl is not None, "sized for every captured shape"
            md.plan.workspace = MLADecodeWorkspace(
                po[:bs * splits * heads * latent].view(bs, splits, heads, latent),
                pl[:bs * splits * heads].view(bs, splits, heads))

    # -- forward -----------------------------------------------------------------------
    def _kv_scale(self, pool: MLAKVLayer) -> float | torch.Tensor:
        # A device tensor keeps a captured launch reading the pool's current scale.
        return pool.scale_tensor if pool.is_fp8 else 1.0

    def _plan(self, md: ForwardMetadata[TritonPlan]) -> TritonPlan:
        if md.plan is None:
            self._init_metadata_impl(md)
        assert md.plan is not None
        return md.plan

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[TritonPlan], out: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        plan = self._plan(md)
        with self.kernel_errors("decode inputs"):
            mla_decode(q, pool.buffer, md.page_table, md.seq_lens, out,
                       sm_scale=self.config.softmax_scale, kv_scale=self._kv_scale(pool),
                       max_splits=plan.splits, workspace=plan.workspace,
                       force_num_splits=plan.splits if self.force_kv_splits is not None
                       else None, lse=lse)
        # padded sequences have length 0: the kernel writes zeros for them already

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[TritonPlan], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None) -> None:
        if method is ForwardMethod.MLA:  # extend, target verify, draft extend
            assert pool is not None
            plan = self._plan(md)
            if plan.splits > 1 and plan.workspace is None:
                # eager: one workspace per batch, shared by every layer's forward
                plan.workspace = mla_extend_workspace(q.shape[0], self.config.num_heads,
                                                      plan.splits, self.device)
            with self.kernel_errors("MLA extend inputs"):
                mla_extend(q, pool.buffer, md.page_table, md.seq_lens, md.prefix_lens,
                           md.qo_indptr, out, sm_scale=self.config.softmax_scale,
                           kv_scale=self._kv_scale(pool), max_extend_len=md.max_extend_len,
                           num_splits=plan.splits, workspace=plan.workspace,
                           min_chunk=1 if self.force_kv_splits is not None else None, lse=lse,
                           round_q_fp8=md.phase is Phase.DECODE
                           and decode_rounds_q(self.config.num_heads, pool.buffer.dtype))
        else:
            assert k is not None and v is not None
            # MHA: k / v of prefix + new tokens (kv_indptr); MHA_CHUNKED_KV: of the new
            # tokens only, ragged like the queries
            kv_indptr = md.qo_indptr if method is ForwardMethod.MHA_CHUNKED_KV else md.kv_indptr
            with self.kernel_errors("MHA prefill inputs"):
                mha_prefill(q, k, v, md.qo_indptr, kv_indptr, out,
                            sm_scale=self.config.softmax_scale, causal=True,
                            max_q_len=md.max_extend_len, lse=lse)
        # rows of padding tokens belong to no sequence: the kernels never write them
        self.zero_padded_rows(out, md)

    def _forward_sparse_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[TritonPlan], out: torch.Tensor,
                             indices: torch.Tensor, *, lse: torch.Tensor | None = None) -> None:
        # forward_sparse checked the request against the sparse declaration and every
        # index (eagerly; under capture whoever fills the static index tensor does).
        # Padding rows of a captured bucket have all -1 indices: the kernel writes zeros.
        with self.kernel_errors("sparse decode inputs"):
            mla_sparse_decode(q, pool.buffer, indices, out,
                              sm_scale=self.config.softmax_scale, lse=lse)

    def _forward_prefix_chunk_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   md: ForwardMetadata[TritonPlan], chunk: PrefixChunk,
                                   out: torch.Tensor, lse: torch.Tensor) -> None:
        with self.kernel_errors("prefix chunk inputs"):
            mha_prefill(q, k, v, md.qo_indptr, chunk.kv_indptr, out,
                        sm_scale=self.config.softmax_scale, causal=False,
                        max_q_len=md.max_extend_len, lse=lse)
