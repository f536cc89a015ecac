"""The calls into FlashMLA, and nothing else; imported only by the runtime.

Each function takes attnreg's tensors (queries ``[rows, H, 576]`` with
``rows = B * s_q``, one pool layer's buffer ``[pages, 64, 576]``, int32 page
table and sequence lengths) and calls the library the way the H200 probe did
(legacy dense decode, one KV head, ``s_q`` query tokens per sequence).
Nothing here checks a request: the runtime has refused everything outside
the declaration before any of this runs.  Nothing here reads a value back to
the host either, so every function may run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from attnreg.registry import BackendUnavailableError
from attnreg.runtime.dtypes import FP8_E4M3_MAX, quantize_q_fp8

from .declaration import BACKEND_NAME, FLASH_MLA, SPARSE_KV_FORMAT_V32

__all__ = ["FP8_MAX", "Schedule", "decode", "load_library", "quantize_q", "schedule",
           "sparse_decode", "sparse_prefill", "store_lse"]

#: Largest finite float8_e4m3fn value.
FP8_MAX = FP8_E4M3_MAX
_LATENT = 512


def load_library() -> ModuleType:
    """Import ``flash_mla``, or raise :class:`BackendUnavailableError` with the install hint.

    The library loads its CUDA extensions at import; a build without the legacy
    kernels imports but has no dense decode, which is refused here too.
    """
    try:
        import flash_mla
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailableError(
            BACKEND_NAME, f"flash_mla could not be imported ({type(exc).__name__}: {exc}); "
                          f"install {FLASH_MLA.distribution}: {FLASH_MLA.install_hint()}"
        ) from exc
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        raise BackendUnavailableError(
            BACKEND_NAME, "this flash_mla build has no legacy kernels, which hold the only "
                          "dense MLA decode (sm90); install a build with them "
                          f"({FLASH_MLA.distribution} wheels have them)")
    return flash_mla


@dataclass
class Schedule:
    """The split-KV schedule one decode call reads: FlashMLA's scheduler output.

    ``tile_scheduler_metadata`` int32 ``[num_sm_parts, 8]`` and ``num_splits``
    int32 ``[batch + 1]``.  Graph buffers are allocated once and refreshed in
    place (:meth:`refresh`) before every replay; an eager batch gets fresh ones.
    """

    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor

    def refresh(self, fresh: Schedule) -> None:
        """Copy ``fresh`` into these buffers (the addresses a captured graph recorded)."""
        self.tile_scheduler_metadata.copy_(fresh.tile_scheduler_metadata)
        self.num_splits[: fresh.num_splits.shape[0]].copy_(fresh.num_splits)

    def view_like(self, fresh: Schedule) -> Schedule:
        """Views of these buffers shaped like ``fresh``: what one captured shape reads.

        ``fresh`` is the library's schedule for that shape, so its partition
        count (``num_sm_parts``: fewer with several query tokens per sequence)
        and split counts (``bs + 1``) come from the library itself.  Views, so a
        :meth:`refresh` before a replay reaches the addresses the graph recorded.

        Raises ``ValueError`` when ``fresh`` does not fit (buffers sized for
        fewer partitions or a smaller batch).
        """
        parts, ints = fresh.tile_scheduler_metadata.shape
        flat = self.tile_scheduler_metadata.view(-1)
        splits = fresh.num_splits.shape[0]
        if parts * ints > flat.shape[0] or splits > self.num_splits.shape[0]:
            raise ValueError(
                f"a schedule of {parts} partitions and {splits} split counts does not fit "
                f"buffers of {flat.shape[0] // max(ints, 1)} partitions and "
                f"{self.num_splits.shape[0]} split counts")
        return Schedule(flat[: parts * ints].view(parts, ints), self.num_splits[:splits])


def schedule(lib: ModuleType, seq_lens: torch.Tensor, num_heads: int, *,
             tokens_per_seq: int = 1, fp8: bool = False) -> Schedule:
    """Run FlashMLA's scheduler on the device sequence lengths ``seq_lens`` (int32 ``[B]``).

    The FP8 kernel has its own scheduler (``is_fp8_kvcache=True``); both are
    legacy ops and must match the decode call they serve.
    """
    meta, splits = lib.get_mla_decoding_metadata(seq_lens, tokens_per_seq * num_heads, 1,
                                                 is_fp8_kvcache=fp8, use_legacy=True)
    return Schedule(meta, splits)


#: q rounded to fp8 with one power-of-two scale over the live rows, on the device
#: (attnreg's convention for a kernel whose ``q_compute_dtype`` is fp8; the one
#: implementation is the runtime's): ``quantize_q(q, live_rows) -> (q_fp8, descale)``.
quantize_q = quantize_q_fp8


def decode(lib: ModuleType, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, sched: Schedule, *, softmax_scale: float,
           tokens_per_seq: int = 1, q_descale: torch.Tensor | None = None,
           kv_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode of ``q [B * tokens_per_seq, H, 576]`` over the paged ``cache``.

    ``cache`` is one layer's pool buffer ``[pages, 64, 576]`` (bf16, or
    float8_e4m3fn with ``kv_descale``; an fp8 cache needs fp8 ``q`` with
    ``q_descale``).  With several tokens per sequence the call is causal:
    token ``i`` of a sequence of length ``L`` sees keys ``0 .. L - tokens_per_seq
    + i`` (a target-verify batch).

    Returns ``(out [rows, H, 512] bf16, lse [B, H, tokens_per_seq] float32)``,
    fresh tensors the library allocated; the LSE in the library's layout and
    convention (:func:`store_lse` turns it into attnreg's), so a caller that
    does not want it pays nothing for it.
    """
    batch = seq_lens.shape[0]
    rows, heads, dim = q.shape
    q4 = q.view(batch, tokens_per_seq, heads, dim)
    k4 = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[2])
    meta = lib.get_mla_metadata()[0]
    meta.tile_scheduler_metadata = sched.tile_scheduler_metadata
    meta.num_splits = sched.num_splits
    fp8 = q_descale is not None
    extra = {"is_fp8_kvcache": True, "descale_q": q_descale, "descale_k": kv_descale} \
        if fp8 else {}
    out, lse = lib.flash_mla_with_kvcache(q4, k4, page_table, seq_lens, _LATENT, meta,
                                          softmax_scale=softmax_scale,
                                          causal=tokens_per_seq > 1, use_legacy=True, **extra)
    # out [B, s_q, H, 512] -> the runtime's [rows, H, 512] (a view)
    return out.reshape(rows, heads, _LATENT), lse


def store_lse(lse: torch.Tensor, into: torch.Tensor) -> None:
    """Write the library's LSE ``[B, H, s_q]`` into attnreg's ``into [B * s_q, H]``.

    Both are natural-log float32; the library gives a sequence with no key
    ``+inf``, attnreg's convention is ``-inf`` (so merging it changes nothing).
    Device operations only (capture-safe): a copy and one in-place map.
    """
    into.copy_(lse.transpose(1, 2).reshape(into.shape))
    # +inf is what an empty key set gets; a real row's LSE is finite (fp32 scores).  One
    # launch, no temporary; NaN and -inf are kept as they are (each needs saying).
    inf = float("inf")
    torch.nan_to_num(into, nan=float("nan"), posinf=-inf, neginf=-inf, out=into)


def sparse_decode(lib: ModuleType, q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                  sched_meta: object, *, softmax_scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA of ``q [rows, H, 576]`` bf16 over ``fp8_ds_mla`` rows: FlashMLA's legacy
    sparse fp8 decode, one query token per row (a decode sequence or an extend token).

    ``cache`` is one layer's pool buffer ``uint8 [pages, 64, 656]`` (V3.2's rows);
    ``indices`` int32 ``[rows, top_k]`` pool slots or -1, already checked.
    ``sched_meta`` is a ``FlashMLASchedMeta`` (``lib.get_mla_metadata()[0]``): empty,
    the call fills it on the device (the sparse schedule depends on rows, heads and
    top-k only); the later calls of the step pass the same one back.

    Returns ``(out [rows, H, 512] bf16, lse [rows, H, 1] float32)`` as the library
    allocated them (the LSE is not declared for this kernel).
    """
    rows, heads, dim = q.shape
    q4 = q.view(rows, 1, heads, dim)
    k4 = cache.view(cache.shape[0], cache.shape[1], 1, cache.shape[-1])
    idx = indices.view(rows, 1, indices.shape[-1])
    out, lse = lib.flash_mla_with_kvcache(q4, k4, None, None, _LATENT, sched_meta,
                                          softmax_scale=softmax_scale, is_fp8_kvcache=True,
                                          indices=idx, use_legacy=True,
                                          kv_format=SPARSE_KV_FORMAT_V32)
    return out.view(rows, heads, _LATENT), lse


def sparse_prefill(lib: ModuleType, q: torch.Tensor, cache: torch.Tensor,
                   indices: torch.Tensor, *, softmax_scale: float, want_lse: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA of ``q [rows, H, 576]`` bf16 over the pool's bf16 rows: FlashMLA's legacy
    sparse prefill (``flash_mla_sparse_fwd``), one query token per row.

    ``cache`` is one layer's buffer ``[pages, page_size, 576]`` bf16, read as
    ``[slots, 1, 576]`` (an index is a flat slot); ``indices`` int32 ``[rows,
    top_k]``, already checked.  Returns ``(out [rows, H, 512] bf16, lse [rows, H]
    float32 natural log, or None when not wanted: the kernel then skips it)``.
    """
    rows = q.shape[0]
    kv = cache.view(-1, 1, cache.shape[-1])
    idx = indices.view(rows, 1, indices.shape[-1])
    out, _max_logits, lse = lib.flash_mla_sparse_fwd(
        q, kv, idx, softmax_scale, d_v=_LATENT, use_legacy=True,
        return_log2_lse=None if want_lse else False)
    return out, lse
