"""sglang's ``ForwardBatch`` as an attnreg :class:`~attnreg.runtime.ForwardBatch`.

What is read (sglang 0.5.23 field names; the decode graph runner's replay view,
a ``SimpleNamespace`` with the same fields, works too):

| sglang | attnreg |
|---|---|
| ``forward_mode`` DECODE / EXTEND / MIXED / TARGET_VERIFY | DECODE / EXTEND / EXTEND / TARGET_VERIFY |
| ``seq_lens_cpu`` (DECODE: includes the new token; TARGET_VERIFY: the committed prefix) | ``seq_lens`` / ``prefix_lens`` |
| ``extend_prefix_lens_cpu``, ``extend_seq_lens_cpu`` (EXTEND, MIXED) | ``prefix_lens``, ``extend_lens`` |
| ``spec_info.draft_token_num`` (TARGET_VERIFY, a chain: ``topk`` 1) | ``extend_lens`` (the same for every sequence) |
| ``req_to_token_pool.req_to_token[req_pool_indices]`` (a slot per token) | ``page_table`` (a page per ``page_size`` tokens) |
| ``out_cache_loc`` (int64 slots) | ``out_cache_loc`` (int32) |

Not zero-copy: the page table is gathered per step (every ``page_size``-th
column of each sequence's ``req_to_token`` row, up to its length, as int32) and
``out_cache_loc`` is converted to int32: ``B x max_seq_len / page_size`` and
``T`` integers, the same order of work as sglang's own ``kv_indices`` build.
Where a host copy of a length is missing (sglang's ``gpu_only`` batches) it is
read from the device, one synchronisation.

Refused with :class:`~attnreg.registry.UnsupportedError` (one reason each):
``DRAFT_EXTEND_V2`` (a draft model's batches; attnreg backends are not among
sglang's draft-attention choices), ``DLLM_EXTEND``, ``SPLIT_PREFILL``,
``PREBUILT``, and tree verification (``spec_info.topk > 1``, a custom mask).
``IDLE`` batches carry no tokens: callers skip them (:func:`is_idle`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from attnreg.registry import ForwardMode, UnsupportedError
from attnreg.runtime import ForwardBatch

if TYPE_CHECKING:
    from attnreg.runtime import IndexBuffer, IndexLayout

__all__ = ["MAPPED_MODES", "UNMAPPED_MODES", "attnreg_mode", "is_idle", "to_attnreg_batch"]

#: sglang ``ForwardMode`` name -> attnreg forward mode.
MAPPED_MODES: dict[str, ForwardMode] = {
    "DECODE": ForwardMode.DECODE,
    "EXTEND": ForwardMode.EXTEND,
    # chunked prefill with decode requests mixed in: every request has its prefix and
    # extend lengths (a decode request extends by 1), which is an attnreg EXTEND batch
    "MIXED": ForwardMode.EXTEND,
    "TARGET_VERIFY": ForwardMode.TARGET_VERIFY,
}

#: sglang modes the bridge refuses, with why.
UNMAPPED_MODES: dict[str, str] = {
    "DRAFT_EXTEND_V2": "a draft model's extend batch: attnreg backends are not among sglang's "
                       "draft-attention backends (--speculative-draft-attention-backend)",
    "DLLM_EXTEND": "diffusion-LM block attention (bidirectional within a block) is not an "
                   "attnreg forward mode",
    "SPLIT_PREFILL": "PD-multiplexing split prefill is not an attnreg forward mode",
    "PREBUILT": "a disaggregated decode worker's prebuilt batch runs no attention",
}


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def is_idle(forward_batch: Any) -> bool:
    """Whether the batch is sglang's IDLE (no sequence on this data-parallel rank)."""
    return _mode_name(forward_batch.forward_mode) == "IDLE"


def attnreg_mode(mode: Any, backend: str = "sglang bridge") -> ForwardMode:
    """attnreg's forward mode for an sglang ``ForwardMode``; UnsupportedError if none."""
    name = _mode_name(mode)
    if name in MAPPED_MODES:
        return MAPPED_MODES[name]
    raise UnsupportedError(backend, f"sglang forward mode {name}",
                           UNMAPPED_MODES.get(name, "no attnreg forward mode corresponds"),
                           "use one of sglang's own attention backends for it")


def _host(values: Any, fallback: Any = None) -> list[int] | None:
    """Host ints from a cpu tensor / list, else from ``fallback`` (a device tensor: a sync)."""
    src = values if values is not None else fallback
    if src is None:
        return None
    if isinstance(src, torch.Tensor):
        return [int(v) for v in src.tolist()]
    return [int(v) for v in src]


def _draft_tokens(forward_batch: Any, bs: int, backend: str) -> int:
    spec = getattr(forward_batch, "spec_info", None)
    topk = int(getattr(spec, "topk", 1) or 1)
    if topk > 1:
        raise UnsupportedError(backend, f"tree verification (speculative topk {topk})",
                               "attnreg's TARGET_VERIFY batches are a chain of draft tokens, "
                               "causal among themselves; a tree needs sglang's custom mask",
                               "run speculative decoding with --speculative-eagle-topk 1")
    for name in ("draft_token_num", "num_tokens_per_req"):
        n = int(getattr(spec, name, 0) or 0)
        if n > 0:
            return n
    loc = forward_batch.out_cache_loc
    if bs and loc is not None and loc.shape[0] % bs == 0:
        return int(loc.shape[0]) // bs
    raise UnsupportedError(backend, "target-verify batch without its draft token count",
                           "neither spec_info.draft_token_num nor out_cache_loc tells how many "
                           "draft tokens each sequence verifies", "")


def _lengths(forward_batch: Any, mode: ForwardMode, bs: int, backend: str
             ) -> tuple[list[int], list[int]]:
    """(prefix_lens, extend_lens) of the first ``bs`` sequences."""
    fb = forward_batch
    if bs == 0:  # an idle rank replaying a padded graph
        return [], []
    if mode is ForwardMode.EXTEND:
        prefix = _host(getattr(fb, "extend_prefix_lens_cpu", None),
                       getattr(fb, "extend_prefix_lens", None))
        extend = _host(getattr(fb, "extend_seq_lens_cpu", None),
                       getattr(fb, "extend_seq_lens", None))
        if prefix is None or extend is None:
            raise UnsupportedError(backend, "extend batch without its lengths",
                                   "extend_prefix_lens / extend_seq_lens are missing", "")
        return prefix[:bs], extend[:bs]
    seq = _host(getattr(fb, "seq_lens_cpu", None), fb.seq_lens)
    assert seq is not None
    seq = seq[:bs]
    if mode is ForwardMode.DECODE:
        # sglang's decode seq_lens already count the token being decoded
        return [n - 1 for n in seq], [1] * len(seq)
    # TARGET_VERIFY: seq_lens are the committed tokens; the drafts come on top
    n = _draft_tokens(fb, bs, backend)
    return seq, [n] * len(seq)


def to_attnreg_batch(forward_batch: Any, req_to_token: torch.Tensor, page_size: int, *,
                     batch_size: int | None = None, forward_mode: ForwardMode | None = None,
                     backend: str = "sglang bridge",
                     layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
    """attnreg's batch for (the first ``batch_size`` sequences of) an sglang batch.

    Parameters
    ----------
    forward_batch
        sglang's ``ForwardBatch``, or the decode graph runner's replay view.
    req_to_token
        ``req_to_token_pool.req_to_token``: ``[rows, max_context_len]`` slots.
    page_size
        Tokens per page of sglang's pool (slots of a page are consecutive).
    batch_size
        How many leading sequences are real (the replay view carries the padded
        batch; its padding sequences are left to attnreg's own padding).
        Default: ``forward_batch.batch_size``.
    forward_mode
        Default: mapped from ``forward_batch.forward_mode``.
    layout
        Pack the index tensors as ``ForwardBatch.build(..., layout=)`` does (a replay:
        the graph state's ``IndexBuffer``, so the replay copies nothing).  A batch the
        layout cannot hold is built without it (the backend's own checks then say why).
    """
    mode = forward_mode or attnreg_mode(forward_batch.forward_mode, backend)
    bs = int(forward_batch.batch_size if batch_size is None else batch_size)
    prefix, extend = _lengths(forward_batch, mode, bs, backend)
    if len(prefix) != bs or len(extend) != bs:
        raise UnsupportedError(backend, "sglang batch lengths",
                               f"{bs} sequences but {len(prefix)} prefix and {len(extend)} "
                               "extend lengths", "")
    seq_lens: Sequence[int] = [p + e for p, e in zip(prefix, extend)]
    longest = max(seq_lens, default=0)
    width = max(1, -(-longest // page_size))          # pages of the longest sequence
    if longest > req_to_token.shape[1]:
        raise UnsupportedError(backend, f"sequence of {longest} tokens",
                               f"req_to_token holds {req_to_token.shape[1]} tokens per request",
                               "raise sglang's --context-length")
    indices = forward_batch.req_pool_indices[:bs].to(device=req_to_token.device,
                                                     dtype=torch.long)
    # one slot per page (the page's first), then the page number; only the pages in use
    first_slots = req_to_token[:, : width * page_size : page_size]
    table = first_slots[indices]
    if page_size > 1:
        table = torch.div(table, page_size, rounding_mode="floor")
    table = table.to(torch.int32)
    loc = forward_batch.out_cache_loc[: sum(extend)].to(device=table.device,
                                                         dtype=torch.int32)
    if layout is not None and layout.fit_problems(seq_lens, sum(extend)):
        layout = None  # the per-tensor path: the backend's checks refuse it with its reasons
    return ForwardBatch.build(mode, prefix, extend, table, loc, layout=layout)
