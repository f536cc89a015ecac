"""Input checks of the runtime contract: pure functions that return what is wrong.

Each function returns a list of problems (empty when the input is fine) and
changes nothing; :class:`~attnreg.runtime.refusals.RequestChecker` decides
which a request needs, and :class:`~attnreg.runtime.AttentionBackend` raises
one :class:`~attnreg.registry.UnsupportedError` listing them, before any
kernel launch.  Engines can call them too, e.g. to validate a batch they
built themselves once in a debug build.  ``INDEX_FIELDS`` (the index tensors
of a batch, every one int32 on the backend's device) is
:data:`attnreg.runtime.indices.INDEX_FIELDS`.
"""

from __future__ import annotations

import operator

import torch

from attnreg.registry import Capabilities, ForwardMethod

from .batch import ForwardBatch
from .config import MLAConfig
from .dtypes import output_dtype
from .index_buffer import OVERWRITTEN
from .indices import INDEX_FIELDS
from .pool import MLAKVLayer, MLAKVPool

__all__ = [
    "INDEX_FIELDS",
    "batch_problems",
    "new_rows_problems",
    "output_problems",
    "page_size_problems",
    "pool_problems",
    "query_problems",
    "ragged_kv_problems",
]


def batch_problems(batch: ForwardBatch, device: torch.device, page_size: int) -> list[str]:
    """What is wrong with ``batch`` for a backend on ``device`` with pages of ``page_size``."""
    problems = []
    packed = batch.packed
    if packed is not None and packed.overwritten:
        return [OVERWRITTEN]
    if packed is not None and packed.serves(batch):
        # Built by ForwardBatch.build into an IndexLayout and unchanged since: int32 views of
        # one buffer, of these shapes, seq = prefix + extend, the table wide enough for the
        # longest sequence (IndexLayout.pack refused otherwise).  What is left to check, once
        # per step, is the buffer's device and the layout's page size.
        if packed.flat.device != device:
            problems.append(f"the batch's index tensors are on {packed.flat.device}, the "
                            f"backend on {device}")
        if packed.layout.page_size != page_size:
            problems.append(f"the batch was packed for pages of {packed.layout.page_size}, the "
                            f"backend's are {page_size}")
        return problems
    seq, pre, ext = batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu
    b, t = len(seq), sum(ext)
    want_shape = {"seq_lens": (b,), "prefix_lens": (b,), "extend_lens": (b,),
                  "qo_indptr": (b + 1,), "kv_indptr": (b + 1,), "out_cache_loc": (t,)}
    for name, tensor in batch.indices.items():
        if tensor.dtype != torch.int32:
            problems.append(f"{name} is {tensor.dtype}; index tensors must be int32 "
                            "(convert once with .to(torch.int32) outside the hot path)")
        if tensor.device != device:
            problems.append(f"{name} is on {tensor.device}, the backend on {device}")
        if name in want_shape and tuple(tensor.shape) != want_shape[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected "
                            f"{want_shape[name]}")
    pt = batch.page_table
    if pt.dim() != 2 or pt.shape[0] != b:
        problems.append(f"page_table has shape {tuple(pt.shape)}, expected [{b}, pages]")
    elif pt.shape[1] * page_size < max(seq, default=0):
        problems.append(f"page_table has {pt.shape[1]} pages of {page_size} per sequence, "
                        f"too few for {max(seq, default=0)} tokens")
    # map() keeps the per-sequence comparison out of Python bytecode (B can be 100s).
    if len(pre) != b or len(ext) != b or any(
            map(operator.ne, seq, map(operator.add, pre, ext))):
        problems.append("host lengths disagree: seq_lens must equal prefix_lens + extend_lens")
    return problems


def page_size_problems(page_size: int, capabilities: Capabilities) -> list[str]:
    """Why no kernel of ``capabilities`` that reads the paged KV pool takes ``page_size``.

    The kernels that read the pool are the absorbed-MLA ones and any that
    declares page sizes; one without page sizes takes every size.  Empty when
    one of them takes ``page_size``, or when the backend declares none (ragged
    kernels only: nothing it runs depends on the page size).  What
    :class:`~attnreg.runtime.AttentionBackend` checks when it is created: a
    pool of that page size could serve none of its paged forwards.
    """
    readers = [k for k in capabilities.kernels
               if k.page_sizes or k.method is ForwardMethod.MLA]
    if not readers or any(not k.page_sizes or page_size in k.page_sizes for k in readers):
        return []
    declared = sorted({p for k in readers for p in k.page_sizes})
    return [f"page size {page_size} not in {declared} (the page sizes {capabilities.backend}'s "
            f"kernels that read the paged KV pool declare on {capabilities.platform})"]


def pool_problems(pool: MLAKVPool | MLAKVLayer, config: MLAConfig,
                  device: torch.device) -> list[str]:
    """What makes ``pool`` unusable with ``config`` on ``device``."""
    problems = []
    if pool.page_size != config.page_size:
        problems.append(f"pool page size {pool.page_size} != config page size "
                        f"{config.page_size}")
    if pool.row_dim != config.kv_row_dim or pool.kv_lora_rank != config.kv_lora_rank:
        problems.append(f"pool rows are {pool.kv_lora_rank}+{pool.rope_dim}, the config "
                        f"{config.kv_lora_rank}+{config.qk_rope_head_dim}")
    if pool.device != device:
        problems.append(f"pool is on {pool.device}, the backend on {device}")
    return problems


def query_problems(q: torch.Tensor, shape: tuple[int, int, int], device: torch.device,
                   name: str = "q") -> list[str]:
    """What is wrong with a query tensor that must be ``shape`` on ``device``."""
    problems = []
    if tuple(q.shape) != shape:
        problems.append(f"{name} has shape {tuple(q.shape)}, expected {shape}")
    if q.device != device:
        problems.append(f"{name} is on {q.device}, the backend on {device}")
    return problems


def new_rows_problems(latent: torch.Tensor | None, rope: torch.Tensor | None, rows: int,
                      pool: MLAKVPool | MLAKVLayer) -> list[str]:
    """What is wrong with the new tokens' cache rows (both None: nothing to write)."""
    if (latent is None) != (rope is None):
        return ["latent_new and rope_new go together: pass both or neither"]
    if latent is None or rope is None:
        return []
    problems = []
    if tuple(latent.shape) != (rows, pool.kv_lora_rank):
        problems.append(f"latent_new has shape {tuple(latent.shape)}, expected "
                        f"{(rows, pool.kv_lora_rank)}")
    if tuple(rope.shape) != (rows, pool.rope_dim):
        problems.append(f"rope_new has shape {tuple(rope.shape)}, expected "
                        f"{(rows, pool.rope_dim)}")
    return problems


def ragged_kv_problems(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: MLAConfig,
                       num_kv_tokens: int | None, device: torch.device) -> list[str]:
    """What is wrong with the ragged ``k`` / ``v`` of the MHA method."""
    qk_dim, v_dim = config.mha_head_dims
    heads = config.num_heads
    problems = []
    if k.dim() != 3 or tuple(k.shape[1:]) != (heads, qk_dim):
        problems.append(f"k has shape {tuple(k.shape)}, expected [Tk, {heads}, {qk_dim}]")
    if v.dim() != 3 or tuple(v.shape[1:]) != (heads, v_dim):
        problems.append(f"v has shape {tuple(v.shape)}, expected [Tk, {heads}, {v_dim}]")
    if k.shape[0] != v.shape[0]:
        problems.append(f"k has {k.shape[0]} rows, v {v.shape[0]}")
    if num_kv_tokens is not None and k.shape[0] != num_kv_tokens:
        problems.append(f"k / v have {k.shape[0]} rows, the batch has {num_kv_tokens} prefix "
                        "+ new tokens")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        problems.append(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != device or v.device != device:
        problems.append(f"k / v are on {k.device} / {v.device}, the backend on {device}")
    return problems


def output_problems(out: torch.Tensor, q: torch.Tensor, shape: tuple[int, int, int]
                    ) -> list[str]:
    """What is wrong with a caller's ``out=`` tensor for queries ``q``."""
    want = output_dtype(q.dtype)
    if tuple(out.shape) != shape or out.dtype != want or out.device != q.device:
        return [f"got {tuple(out.shape)} {out.dtype} on {out.device}, expected {shape} "
                f"{want} on {q.device}"]
    return []


def query_scale_problems(q: torch.Tensor, q_scale: torch.Tensor | None) -> list[str]:
    """What is wrong with the ``q_scale`` given with ``q``: an fp8 query needs one (float32,
    one element, on q's device: real q = q * q_scale), any other query takes none."""
    if q.dtype != torch.float8_e4m3fn:
        if q_scale is None:
            return []
        return [f"q_scale was given with a {q.dtype} query; only an fp8 query carries a "
                "scale"]
    if q_scale is None:
        return ["an fp8 query needs its float32 dequantisation scale (q_scale=, one "
                "element: real q = q * q_scale)"]
    if q_scale.dtype != torch.float32 or q_scale.numel() != 1 or q_scale.device != q.device:
        return [f"q_scale is {tuple(q_scale.shape)} {q_scale.dtype} on {q_scale.device}; "
                f"expected one float32 element on {q.device}"]
    return []
