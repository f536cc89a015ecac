"""The ``flash_attn_cute`` backend: flash-attn-4's CuTe DSL ``flash_attn_varlen_func``.

* MHA prefill (192/128, 128/128) on sm90 and sm100: ragged q / k / v by
  ``cu_seqlens_q`` / ``cu_seqlens_k``, bottom-right causal, so a cached prefix
  is simply the first rows of each sequence's k / v;
* absorbed MLA extend on sm100+ only: ``q = q_pe`` (64), ``qv = q_nope`` (512),
  ``k`` / ``v`` the rope / latent columns of the paged pool with
  ``page_table`` and ``seqused_k``.  The kernel that runs it has no split-KV
  variant, so it is always launched with ``num_splits=1`` (seed 000 defect 2:
  a split-KV choice under capture asserted) -- declared ``SplitKV.SINGLE``.

On sm90 FA4 itself asserts ("not supported on SM90") for the absorbed shapes;
this backend refuses them first with an :class:`UnsupportedError`: the sm90
declaration has no MLA kernel, and the runtime checks the device too, so a
backend built with an sm100 declaration on an sm90 device refuses as well.

Decode is not served (pair this backend with a decode backend).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from attnreg.registry import BackendUnavailableError, ForwardMethod, UnsupportedError
from attnreg.runtime import AttentionBackend, ForwardMetadata, MLAConfig, MLAKVPool, device_sm

from .declarations.flash_attn_cute import QV_MIN_SM

__all__ = ["QV_MIN_SM", "FlashAttnCuteBackend"]

INSTALL_HINT = "install attnreg[flash-attn-cute]"


def import_flash_attn_cute(backend: str) -> Any:
    """``flash_attn.cute.flash_attn_varlen_func``, or :class:`BackendUnavailableError`."""
    try:
        module = importlib.import_module("flash_attn.cute")
        return module.flash_attn_varlen_func
    except Exception as exc:  # ImportError, AttributeError, a CuTe DSL setup error
        raise BackendUnavailableError(
            backend, f"flash-attn-4 (flash_attn.cute) could not be imported "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc


class FlashAttnCuteBackend(AttentionBackend[None, None]):
    """flash-attn-4 varlen prefill: MHA everywhere it runs, absorbed MLA on sm100+.

    Parameters
    ----------
    config : MLAConfig
    capabilities : Capabilities
    """

    def __init__(self, config: MLAConfig, *, capabilities: Any, **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        self._varlen = import_flash_attn_cute(self.name)
        self.device_sm = device_sm(self.device)

    def _require_qv_device(self) -> None:
        if self.device_sm is not None and self.device_sm >= QV_MIN_SM:
            return
        here = f"sm{self.device_sm}" if self.device_sm is not None else self.device.type
        raise UnsupportedError(
            self.name, "absorbed MLA (qv) extend on this device",
            f"flash-attn-4's qv kernel (head_dim 64 + qv 512) is Blackwell-only (sm100+); "
            f"this is {here}",
            "use forward_extend(..., method=ForwardMethod.MHA) here, or flashinfer_mla / "
            "triton for absorbed extend")

    @staticmethod
    def _result_tensor(result: Any) -> torch.Tensor:
        return result[0] if isinstance(result, tuple) else result

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVPool | None,
                             md: ForwardMetadata[None], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None) -> None:
        if method is ForwardMethod.MLA:
            self._require_qv_device()  # before FA4 is called: it would assert on sm90
            assert pool is not None  # checked by the base class
            if md.num_tokens:
                self._absorbed(q, pool, md, out)
            self.zero_padded_rows(out, md)
            return
        assert k is not None and v is not None
        if md.num_tokens:
            self._mha(q, k, v, md, out)
        # rows of padding tokens belong to no sequence: FA4 leaves them unwritten
        self.zero_padded_rows(out, md)

    def _mha(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             md: ForwardMetadata[None], out: torch.Tensor) -> None:
        with self.kernel_errors("flash_attn_varlen_func inputs"):
            result = self._varlen(
                q, k, v, cu_seqlens_q=md.qo_indptr, cu_seqlens_k=md.kv_indptr,
                max_seqlen_q=md.max_extend_len, max_seqlen_k=md.max_seq_len,
                softmax_scale=self.config.softmax_scale, causal=True)
        out.copy_(self._result_tensor(result))

    def _absorbed(self, q: torch.Tensor, pool: MLAKVPool, md: ForwardMetadata[None],
                  out: torch.Tensor) -> None:
        latent = self.config.kv_lora_rank
        cache = pool.buffer                           # [pages, page_size, 576]
        k_pe = cache[..., latent:].unsqueeze(2)       # [pages, page_size, 1, 64]
        c_kv = cache[..., :latent].unsqueeze(2)       # [pages, page_size, 1, 512]
        with self.kernel_errors("flash_attn_varlen_func(qv=...) inputs"):
            result = self._varlen(
                q[..., latent:], k_pe, c_kv, qv=q[..., :latent], cu_seqlens_q=md.qo_indptr,
                seqused_k=md.seq_lens, page_table=md.page_table,
                max_seqlen_q=md.max_extend_len, max_seqlen_k=md.max_seq_len,
                softmax_scale=self.config.softmax_scale, causal=True,
                # the qv kernel has no split-KV variant: one split, always (also
                # under capture, where a split count would be frozen anyway)
                num_splits=1)
        out.copy_(self._result_tensor(result))
