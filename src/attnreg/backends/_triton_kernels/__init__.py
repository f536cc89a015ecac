"""Triton kernels for DeepSeek-style MLA attention.

* :func:`mla_decode` - absorbed decode over a paged 576-wide latent cache, split-KV with
  device-side split counts (CUDA-graph capturable); :func:`mla_decode_workspace` and
  :func:`default_max_splits` size it.
* :func:`mla_extend` - absorbed extend/prefill with a cached prefix over the same cache,
  split-KV for short extends over long prefixes (same device-side split counts);
  :func:`mla_extend_workspace` and :func:`default_extend_splits` size it.
* :func:`mla_sparse_decode` - sparse (DSA) absorbed MLA: each query row attends the
  cache slots of its top-k index row (-1: no key), capturable.
* :func:`mha_prefill` - non-absorbed ragged MHA prefill (Dqk 192 / Dv 128, or any dims).

All take int32 index tensors (int64 is refused with ``ValueError``), accumulate in fp32
and validate their inputs before launching.  Importing this package imports torch and
triton.
"""

from .decode import MLADecodeWorkspace, default_max_splits, mla_decode, mla_decode_workspace
from .extend import MLAExtendWorkspace, default_extend_splits, mla_extend, mla_extend_workspace
from .mha_prefill import mha_prefill
from .sparse_decode import mla_sparse_decode

__all__ = [
    "MLADecodeWorkspace",
    "MLAExtendWorkspace",
    "default_extend_splits",
    "default_max_splits",
    "mha_prefill",
    "mla_decode",
    "mla_decode_workspace",
    "mla_extend",
    "mla_extend_workspace",
    "mla_sparse_decode",
]
