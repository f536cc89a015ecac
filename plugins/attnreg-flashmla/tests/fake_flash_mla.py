"""A CPU stand-in for ``flash_mla`` (sgl-flash-mla 1.0.0), for the plugin's CPU tests.

The real library needs CUDA, so the CPU tests install this module as
``flash_mla`` (see the ``fake_library`` fixture).  It keeps the parts of the
real one that the runtime must get right:

* the same entry points and signatures (``get_mla_metadata``,
  ``get_mla_decoding_metadata``, ``flash_mla_with_kvcache``, ``has_legacy``);
* the checks the library makes, raising what it raises: ``RuntimeError`` for
  the C++ checks (page size 64, dtypes, shapes, descales), ``AssertionError``
  for the Python interface's asserts.  A test that sees one of these has
  found a request the runtime should have refused first;
* a schedule the kernel really depends on: ``num_splits`` holds the running
  count of 64-token KV blocks per sequence, and the kernel attends over only
  the blocks the schedule gives each sequence, so a schedule computed for
  other lengths (frozen at capture) gives wrong outputs, as on the device;
* outputs allocated per call, zero rows and ``+inf`` LSE for empty sequences,
  a bf16 output from the fp8 path;
* the legacy sparse (DSA) kernels: sparse decode over V3.2's 656-byte rows
  (``indices`` with ``is_fp8_kvcache=True``, ``use_legacy=True``; the rows
  unpacked here, by this module's own code: 512 e4m3 latent values, 4 float32
  scales of 128 values each, 64 bf16 rope values) and ``flash_mla_sparse_fwd``
  over bf16 rows, with their checks (64 or 128 heads, top-k a multiple of 64,
  of 128 for the prefill kernel, page size 64, ``kv_format``) and their index rule: only -1 is invalid, and an
  index past the cache raises here where the device would read out of bounds.

Every call is recorded in :data:`CALLS` so tests can assert that a refused
request never reached the library.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__version__ = "1.0.0"

#: SM count of the pretend device (an H200's).
NUM_SMS = 132
#: (entry point name, keyword summary) of every call, in order.
CALLS: list[tuple[str, dict[str, object]]] = []


def has_legacy() -> bool:
    return True


@dataclasses.dataclass
class FlashMLASchedMeta:
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    have_initialized: bool = False
    #: (b, s_q, h_q, topk) of the first sparse call: later calls must match (as upstream)
    config: tuple[int, ...] | None = None


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def _parts(num_q_tokens_per_head_k: int) -> int:
    return max(NUM_SMS // math.ceil(num_q_tokens_per_head_k / 64), 1)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _schedule(seqlens_k: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.div(seqlens_k.long() + 63, 64, rounding_mode="floor")
    splits = torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=seqlens_k.device)
    splits[1:] = torch.cumsum(blocks, 0).to(torch.int32)
    meta = torch.zeros(_parts(n), 8, dtype=torch.int32, device=seqlens_k.device)
    meta[:, 0] = seqlens_k.shape[0]
    return meta, splits


def get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None,
                              is_fp8_kvcache=False, topk=None, use_legacy=False):
    CALLS.append(("get_mla_decoding_metadata",
                  {"n": num_q_tokens_per_head_k, "fp8": is_fp8_kvcache,
                   "legacy": use_legacy, "batch": seqlens_k.shape[0]}))
    if is_fp8_kvcache and topk is None:
        assert use_legacy, "dense fp8 decoding exists only on the legacy side"
    _check(seqlens_k.dtype == torch.int32, "seqlens_k must have dtype int32")
    _check(seqlens_k.is_contiguous(), "seqlens_k must be contiguous")
    _check(h_k == 1, "the fake serves one KV head")
    return _schedule(seqlens_k, num_q_tokens_per_head_k)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, enable_batch_invariant=False,
                           use_legacy=False, kv_format=None, descale_q=None, descale_k=None):
    sched = tile_scheduler_metadata
    assert isinstance(sched, FlashMLASchedMeta), \
        "tile_scheduler_metadata must be of type FlashMLASchedMeta"
    assert num_splits is None, "num_splits must be None"
    if is_fp8_kvcache is None:
        is_fp8_kvcache = indices is not None
    if indices is not None:
        return _sparse_decode(q, k_cache, indices, head_dim_v, sched, softmax_scale, causal,
                              is_fp8_kvcache, topk_length, use_legacy, kv_format)
    assert use_legacy, ("Sparse attention is required: `indices` must be provided. Dense MLA "
                        "decoding was removed from the current kernels; pass use_legacy=True")
    CALLS.append(("flash_mla_with_kvcache",
                  {"q_shape": tuple(q.shape), "fp8": bool(is_fp8_kvcache), "causal": causal,
                   "page": k_cache.shape[1]}))
    batch, s_q, h_q, d = q.shape
    if is_fp8_kvcache:
        assert sched.tile_scheduler_metadata is not None, (
            "dense fp8 decoding needs metadata from get_mla_decoding_metadata(..., "
            "is_fp8_kvcache=True, use_legacy=True) before the first call")
        _check(q.dtype == torch.float8_e4m3fn, "fwd_kvcache_mla_fp8: q must be fp8")
        _check(descale_q is not None and descale_k is not None,
               "descale is required when input dtype is fp8")
        _check(tuple(descale_q.shape) == (1,), "descale_q_ must have shape (1)")
        _check(tuple(descale_k.shape) == (1,), "descale_k_ must have shape (1)")
        _check(descale_q.dtype == torch.float32 and descale_k.dtype == torch.float32,
               "descales must be float32")
    else:
        assert descale_q is None and descale_k is None, \
            "descale_q/descale_k apply to the dense fp8 path only"
        _check(q.dtype in (torch.bfloat16, torch.float16), "q must be bf16 or fp16")
    _check(k_cache.dtype == q.dtype, "query and key must have the same dtype")
    _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(q.stride(-1) == 1 and k_cache.stride(-1) == 1, "last dims must be contiguous")
    _check(d == 576, "Only head_size_k == 576 is supported")
    _check(head_dim_v == 512, "Only head_size_v == 512 is supported")
    _check(k_cache.dim() == 4 and k_cache.shape[2] == 1, "one KV head: [blocks, 64, 1, 576]")
    _check(k_cache.shape[1] == 64, "Currently page_block_size must be 64")
    _check(batch > 0, "batch size must be positive")
    _check(tuple(cache_seqlens.shape) == (batch,), "seqlens_k must have shape (batch_size)")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch,
           "block_table must have shape (batch_size, max_num_blocks_per_seq)")
    parts = _parts(s_q * h_q)
    if sched.tile_scheduler_metadata is None:
        sched.tile_scheduler_metadata, sched.num_splits = _schedule(cache_seqlens, s_q * h_q)
    meta, splits = sched.tile_scheduler_metadata, sched.num_splits
    _check(meta.dtype == torch.int32 and splits.dtype == torch.int32,
           "tile_scheduler_metadata and num_splits must have dtype int32")
    _check(meta.is_contiguous() and splits.is_contiguous(), "metadata must be contiguous")
    _check(tuple(meta.shape) == (parts, 8),
           f"tile_scheduler_metadata must have shape ({parts}, 8)")
    _check(tuple(splits.shape) == (batch + 1,), "num_splits must have shape (batch_size+1)")
    if softmax_scale is None:
        softmax_scale = d ** -0.5

    qf = q.float() * (descale_q.float() if is_fp8_kvcache else 1.0)
    kv = k_cache[:, :, 0, :].float() * (descale_k.float() if is_fp8_kvcache else 1.0)
    out_dtype = torch.bfloat16 if is_fp8_kvcache else q.dtype
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=out_dtype, device=q.device)
    lse = torch.full((batch, h_q, s_q), float("inf"), dtype=torch.float32, device=q.device)
    blocks_of = (splits[1:] - splits[:-1]).tolist()
    for b in range(batch):
        length = int(cache_seqlens[b])
        # The kernel walks the blocks the schedule assigned: with a schedule made for
        # other lengths it reads whole blocks, written or not (wrong, as on the device).
        blocks = int(blocks_of[b])
        visible = length if blocks == (length + 63) // 64 \
            else min(blocks, block_table.shape[1]) * 64
        if visible <= 0:
            continue
        pages = block_table[b, : (visible + 63) // 64].long()
        keys = kv[pages].reshape(-1, d)[:visible]
        scores = torch.einsum("shd,ld->hsl", qf[b], keys) * softmax_scale
        if causal and s_q > 1:
            pos = torch.arange(visible)[None, :]
            limit = torch.arange(s_q)[:, None] + (visible - s_q)
            scores = scores.masked_fill((pos > limit)[None], float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("hsl,ld->shd", torch.softmax(scores, -1),
                              keys[:, :head_dim_v]).to(out_dtype)
    return out, lse


# -- the legacy sparse kernels ------------------------------------------------------------

#: bytes of a V3.2 row: 512 e4m3 latent, 4 float32 scales, 64 bf16 rope
_V32_BYTES = 512 + 16 + 128
_B_TOPK = 64


def _unpack_v32(rows: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 656]`` V3.2 rows as float32 ``[N, 576]`` (this fake's own reading)."""
    n = rows.shape[0]
    latent = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(n, 4, 128)
    scales = rows[:, 512:528].contiguous().view(torch.float32).view(n, 4, 1)
    rope = rows[:, 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat([(latent * scales).view(n, 512), rope], dim=-1)


def _gather(keys: torch.Tensor, idx: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
    """Rows ``keys[idx]`` (``[R, K, 576]``); an index past ``keys`` raises, as the device
    would read out of bounds."""
    flat = idx[~invalid]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= keys.shape[0]):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (an index "
                           "that is neither -1 nor inside the KV cache)")
    safe = torch.where(invalid, torch.zeros_like(idx), idx).long()
    return keys[safe]


def _attend(qf, keys, invalid, softmax_scale, d_v):  # type: ignore[no-untyped-def]
    """float32 sparse attention: ``qf [R, H, D]``, ``keys [R, K, D]``; returns out [R, H,
    d_v] and lse [R, H] (natural log, -inf for a row with no valid key)."""
    scores = torch.einsum("rhd,rkd->rhk", qf, keys) * softmax_scale
    scores = scores.masked_fill(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse,
                                           torch.zeros_like(lse))[..., None])
    return torch.einsum("rhk,rkd->rhd", probs, keys[..., :d_v]), lse


def _sparse_decode(q, k_cache, indices, head_dim_v, sched, softmax_scale, causal,  # type: ignore[no-untyped-def]
                   is_fp8_kvcache, topk_length, use_legacy, kv_format):
    assert not causal, "causal must be False when sparse attention is enabled"
    assert is_fp8_kvcache, ("is_fp8_kvcache must be True, since only sparse attention with a "
                            "quantized KV cache is supported")
    CALLS.append(("flash_mla_with_kvcache",
                  {"q_shape": tuple(q.shape), "sparse": True, "topk": indices.shape[-1],
                   "page": k_cache.shape[1], "kv_format": kv_format}))
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    config = (b, s_q, h_q, topk)
    if sched.config is None:
        sched.config = config
    else:
        assert sched.config == config, ("Your input arguments are inconsistent with "
                                        "sched_meta (b, s_q, h_q, topk)")
    _check(use_legacy, "the current kernels read V4.1 rows only (this is sm90)")
    _check(q.dtype == torch.bfloat16, "q must be bf16")
    _check(h_q in (64, 128), "Expected h_q == 64 || h_q == 128 to be true, but got false.")
    _check(d in (576, 512), "Only head_size_k == 576 or 512 is supported for sparse decoding")
    _check(head_dim_v == 512, "Only head_size_v == 512 is supported for sparse decoding")
    _check(k_cache.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn),
           "k_cache must be float8_e4m3fn, int8 or uint8")
    _check(k_cache.dim() == 4 and k_cache.shape[2] == 1,
           "Currently only MQA (i.e. h_kv == 1) is supported for sparse decoding")
    _check(k_cache.shape[-1] == _V32_BYTES and d == 576,
           f"Unsupported KV cache formats for this implementation: kv {k_cache.shape[-1]}")
    _check(kv_format in (None, "V32"), "Expected model_type == *kv_format_hint to be true")
    _check(k_cache.shape[1] == 64, "Currently page_block_size must be 64")
    _check(indices.dtype == torch.int32 and tuple(indices.shape) == (b, s_q, topk),
           "indices must be int32 [b, s_q, topk]")
    _check(topk % _B_TOPK == 0, f": topk ({topk}) mod B_TOPK ({_B_TOPK}) must be 0")
    _check(topk_length is None, ": V3.2 does not support dynamic topk length")
    _check(q.stride(-1) == 1, "q must be contiguous in its last dim")
    if sched.tile_scheduler_metadata is None:
        blocks = torch.full((b,), -(-topk // _B_TOPK), dtype=torch.int32, device=q.device)
        sched.tile_scheduler_metadata, sched.num_splits = _schedule(blocks * 64, s_q * h_q)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    keys_all = _unpack_v32(k_cache.view(torch.uint8).reshape(-1, _V32_BYTES))
    rows = b * s_q
    idx = indices.reshape(rows, topk)
    invalid = idx == -1
    keys = _gather(keys_all, idx, invalid)
    out, lse = _attend(q.float().reshape(rows, h_q, d), keys, invalid, softmax_scale,
                       head_dim_v)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    return (out.to(torch.bfloat16).view(b, s_q, h_q, head_dim_v),
            lse.view(b, s_q, h_q).transpose(1, 2).contiguous())


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                         use_legacy=False, return_log2_lse=None):
    CALLS.append(("flash_mla_sparse_fwd",
                  {"q_shape": tuple(q.shape), "topk": indices.shape[-1], "legacy": use_legacy,
                   "lse": return_log2_lse}))
    s_q, h_q, d_qk = q.shape
    _check(use_legacy, "the current kernels are sm100 only (this is sm90)")
    _check(q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, "q and kv must be bf16")
    _check(h_q in (64, 128), "Expected h_q == 64 || h_q == 128 to be true, but got false.")
    _check(d_qk in (576, 512), "Expected d_qk == 576 || d_qk == 512 to be true")
    _check(d_v == 512, "Expected d_v == 512 to be true, but got false.")
    _check(kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == d_qk,
           "kv must be [s_kv, h_kv=1, d_qk]")
    topk = indices.shape[-1]
    _check(indices.dtype == torch.int32 and tuple(indices.shape) == (s_q, 1, topk),
           "Expected indices.sizes().equals({s_q, h_kv, topk})")
    # the sm90 prefill kernel's own assert (phase1.cuh), seen on the H200 at top-k 64
    _check(topk % (2 * _B_TOPK) == 0, "Assertion `params.topk % (2*B_TOPK) == 0` failed")
    _check(q.stride(1) == d_qk, "Expected q.stride(1) == d_qk to be true, but got false.")
    idx = indices.reshape(s_q, topk)
    # prefill: -1 or any index >= s_kv is invalid (its documented rule)
    invalid = (idx == -1) | (idx >= kv.shape[0])
    keys = _gather(kv[:, 0, :].float(), idx, invalid)
    out, lse = _attend(q.float(), keys, invalid, sm_scale, d_v)
    if return_log2_lse is False:
        return out.to(torch.bfloat16), None, None
    max_logits = torch.einsum("rhd,rkd->rhk", q.float(), keys).mul(sm_scale).masked_fill(
        invalid[:, None, :], float("-inf")).amax(dim=-1)
    if return_log2_lse:
        return out.to(torch.bfloat16), max_logits / math.log(2), lse / math.log(2)
    return out.to(torch.bfloat16), max_logits, lse
