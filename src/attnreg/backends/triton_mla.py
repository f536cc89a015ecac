"""The ``triton`` backend: attnreg's own Triton MLA kernels behind the runtime interface.

* decode: ``mla_decode``, split-KV over a static grid of ``max_splits`` with
  per-sequence split counts computed on the device, so a graph captured once
  replays correctly for any lengths up to the capture bound;
* extend, MLA: ``mla_extend`` over the paged pool (causal within the new tokens),
  split-KV on the same static-grid / device-side-count scheme when a short extend
  over a long prefix would leave the GPU idle (a few new tokens at B=1);
* extend, MHA: ``mha_prefill`` over ragged k / v (bottom-right causal).

Under capture the split counts and the workspaces are fixed in
``init_cuda_graph_state`` / ``init_forward_metadata_capture``; the captured
region then allocates nothing of its own and reads no host value (lengths are
read by the kernels on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from attnreg.registry import ForwardMethod, GraphMode, Phase

from ._triton_kernels import (
    MLADecodeWorkspace,
    MLAExtendWorkspace,
    default_extend_splits,
    default_max_splits,
    mha_prefill,
    mla_decode,
    mla_decode_workspace,
    mla_extend,
    mla_extend_workspace,
)
from .base import AttentionBackend, ForwardMetadata, GraphState, MLAConfig
from .kv_pool import MLAKVPool

__all__ = ["TritonMLABackend"]


class TritonMLABackend(AttentionBackend):
    """MLA decode / extend and MHA prefill with the Triton kernels of ``_triton_kernels``.

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
            if self.device.type == "cuda":
                num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            else:
                num_sms = 8
        for opt, value in (("num_sms", num_sms), ("max_kv_splits", max_kv_splits),
                           ("force_kv_splits", force_kv_splits)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{opt} must be a positive int, got {value!r}")
        self.num_sms = int(num_sms)
        self.max_kv_splits = max_kv_splits
        self.force_kv_splits = force_kv_splits

    # -- planning ----------------------------------------------------------------------
    def _with_split_options(self, heuristic: int) -> int:
        """The split count after ``force_kv_splits`` / ``max_kv_splits``."""
        if self.force_kv_splits is not None:
            return self.force_kv_splits
        if self.max_kv_splits is not None:
            heuristic = min(heuristic, self.max_kv_splits)
        return max(1, heuristic)

    def _splits_for(self, batch_size: int, max_seq_len: int) -> int:
        # Not cached: an engine's longest sequence grows every decode step, so a cache
        # keyed on it would miss every step and grow without bound.
        return self._with_split_options(default_max_splits(
            batch_size, self.config.num_heads, max_seq_len, self.num_sms))

    def _extend_splits_for(self, batch_size: int, num_tokens: int, max_seq_len: int) -> int:
        return self._with_split_options(default_extend_splits(
            batch_size, num_tokens, self.config.num_heads, max_seq_len, self.num_sms))

    def _init_metadata_impl(self, md: ForwardMetadata) -> None:
        if md.phase is Phase.PREFILL:
            # The workspace is allocated by the first MLA extend forward: an MHA prefill
            # batch never needs it.
            md.extras["extend_splits"] = self._extend_splits_for(
                md.batch_size, md.num_tokens, md.max_seq_len)
        if md.phase is Phase.DECODE:
            splits = self._splits_for(md.batch_size, md.max_seq_len)
            md.extras["max_splits"] = splits
            # One split-KV workspace per batch, shared by every layer's forward (they run
            # one after another on the stream), instead of one allocation per forward.
            md.extras["workspace"] = mla_decode_workspace(
                md.batch_size, self.config.num_heads, splits, self.device) \
                if splits > 1 and md.batch_size > 0 else None

    def _init_graph_state_impl(self, state: GraphState) -> None:
        # One flat fp32 buffer serves every captured batch size: a launch for bs
        # sequences with S splits views its first bs * S * H * 512 floats.  bs * S
        # stays near num_sms / head blocks for small bs and is bs for large bs, so the
        # buffer is far smaller than [max_bs, max_splits(bs=1), H, 512].
        heads, latent = self.config.num_heads, self.config.kv_lora_rank
        most = max(bs * self._splits_for(bs, state.max_seq_len)
                   for bs in range(1, state.max_bs + 1))
        state.extras["partial_out"] = torch.empty(most * heads * latent, dtype=torch.float32,
                                                  device=self.device)
        state.extras["partial_lse"] = torch.empty(most * heads, dtype=torch.float32,
                                                  device=self.device)
        if state.graph_modes.get(Phase.PREFILL, GraphMode.DISABLED) is not GraphMode.DISABLED:
            # Split extend: num_tokens x splits x heads rows for the captured shape that
            # needs the most; bs = 1 gets the most splits for a token count.  Only short
            # extends split, so this stays near one wave of 64-row programs.
            splits = ((nt, self._extend_splits_for(1, nt, state.max_seq_len))
                      for nt in range(1, state.max_num_tokens + 1))
            rows = max((nt * s for nt, s in splits if s > 1), default=0)
            if rows:  # some captured shape would split
                state.extras["extend_partial_out"] = torch.empty(
                    rows * heads * latent, dtype=torch.float32, device=self.device)
                state.extras["extend_partial_lse"] = torch.empty(
                    rows * heads, dtype=torch.float32, device=self.device)

    def _init_capture_impl(self, md: ForwardMetadata) -> None:
        state = self.graph_state
        assert state is not None
        if md.phase is Phase.PREFILL:
            nt, heads, latent = md.num_tokens, self.config.num_heads, self.config.kv_lora_rank
            splits = self._extend_splits_for(md.batch_size, nt, state.max_seq_len)
            md.extras["extend_splits"] = splits
            if splits > 1:
                po = state.extras["extend_partial_out"][:nt * splits * heads * latent]
                pl = state.extras["extend_partial_lse"][:nt * splits * heads]
                md.extras["extend_workspace"] = MLAExtendWorkspace(
                    po.view(nt, splits, heads, latent), pl.view(nt, splits, heads))
            return
        if md.phase is not Phase.DECODE:
            return
        bs, heads, latent = md.batch_size, self.config.num_heads, self.config.kv_lora_rank
        splits = self._splits_for(bs, state.max_seq_len)
        md.extras["max_splits"] = splits
        if splits > 1:
            po = state.extras["partial_out"][:bs * splits * heads * latent]
            pl = state.extras["partial_lse"][:bs * splits * heads]
            md.extras["workspace"] = MLADecodeWorkspace(po.view(bs, splits, heads, latent),
                                                        pl.view(bs, splits, heads))
        else:
            md.extras["workspace"] = None

    # -- forward -----------------------------------------------------------------------
    def _kv_scale(self, pool: MLAKVPool) -> float | torch.Tensor:
        # A device tensor keeps a captured launch reading the pool's current scale.
        return pool.scale_tensor if pool.is_fp8 else 1.0

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVPool, md: ForwardMetadata,
                             out: torch.Tensor) -> None:
        splits = int(md.extras["max_splits"])
        with self.kernel_errors("decode inputs"):
            mla_decode(q, pool.buffer, md.page_table, md.seq_lens, out,
                       sm_scale=self.config.softmax_scale, kv_scale=self._kv_scale(pool),
                       max_splits=splits, workspace=md.extras.get("workspace"),
                       force_num_splits=splits if self.force_kv_splits is not None else None)

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata, out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        if method is ForwardMethod.MLA:
            assert pool is not None
            splits = int(md.extras.get("extend_splits", 1))
            workspace = md.extras.get("extend_workspace")
            if splits > 1 and workspace is None:
                # eager: one workspace per batch, shared by every layer's forward
                workspace = md.extras["extend_workspace"] = mla_extend_workspace(
                    q.shape[0], self.config.num_heads, splits, self.device)
            with self.kernel_errors("MLA extend inputs"):
                mla_extend(q, pool.buffer, md.page_table, md.seq_lens, md.prefix_lens,
                           md.qo_indptr, out, sm_scale=self.config.softmax_scale,
                           kv_scale=self._kv_scale(pool), max_extend_len=md.max_extend_len,
                           num_splits=splits, workspace=workspace,
                           min_chunk=1 if self.force_kv_splits is not None else None)
        else:
            assert k is not None and v is not None
            with self.kernel_errors("MHA prefill inputs"):
                mha_prefill(q, k, v, md.qo_indptr, md.kv_indptr, out,
                            sm_scale=self.config.softmax_scale, causal=True,
                            max_q_len=md.max_extend_len)
