"""``MLAConfig``: the shape and dtype facts of one MLA attention layer (no torch import)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnreg.graph_policy.config import DEFAULT_MAX_SEQ_LEN
from attnreg.registry import DType, ForwardMethod

if TYPE_CHECKING:
    from .pool import MLAKVPool

__all__ = ["MLAConfig"]


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
        ``bf16``, ``fp16``, ``fp8_e4m3`` or ``fp32``.  An ``fp8_e4m3`` q is an engine's
        own fp8 query, handed with its ``q_scale`` to a kernel that declares it
        (docs/runtime.md, "An fp8 query"); the output is then bf16.
    device : str
        ``"cpu"`` or ``"cuda"`` (``"cuda:1"`` ...).  ``BackendRegistry.create``
        takes the platform from it (``cpu``, or the detected GPU).
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
        (1/sqrt(192)), which DeepSeek uses for both the absorbed and the MHA form.
    max_context_len : int
        Longest sequence a captured graph must serve (sizes graph buffers);
        default :data:`attnreg.graph_policy.config.DEFAULT_MAX_SEQ_LEN`, the
        length the graph policy estimates capture memory for.

    Examples
    --------
    >>> cfg = MLAConfig(num_heads=16, page_size=64)
    >>> cfg.mla_head_dims, cfg.mha_head_dims
    ((576, 512), (192, 128))
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
        """(head_dim_qk, head_dim_v) of ``method``."""
        return self.mla_head_dims if ForwardMethod.parse(method) is ForwardMethod.MLA \
            else self.mha_head_dims

    def make_pool(self, num_pages: int, *, num_layers: int = 1,
                  scale: float | Sequence[float] = 1.0,
                  kv_format: str | None = None) -> MLAKVPool:
        """An :class:`~attnreg.runtime.MLAKVPool` of this config's page size, dtype and device.

        ``num_layers`` layers share the pages; ``scale`` is the FP8 scale of
        every layer (a float) or of each (a sequence); ``kv_format``
        ``"fp8_ds_mla"``: 656-byte rows (an fp8 config; the scales are in the rows).
        """
        from .pool import MLAKVPool

        return MLAKVPool.from_config(self, num_pages, num_layers=num_layers, scale=scale,
                                     kv_format=kv_format)
