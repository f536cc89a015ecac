"""The device buffers every captured shape of a backend reads: :class:`GraphState`.

``init_cuda_graph_state`` allocates them once for the largest captured shape;
each captured shape reads views of them (``ForwardMetadata`` with
``graph_mode`` set), and ``init_forward_metadata_replay`` copies a real batch
into them outside the graph.  The backend's own buffers (workspaces, library
index arrays) hang off :attr:`GraphState.buffers`, a dataclass of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from attnreg.registry import CaptureShape, ForwardMode, GraphMode, Phase

from .batch import ForwardBatch
from .metadata import ForwardMetadata
from .pool import PADDING_PAGE

__all__ = ["BuffersT", "GraphState", "tensor_bytes"]

#: A backend's own graph buffers (a dataclass: workspaces, library index arrays).
BuffersT = TypeVar("BuffersT")

_BASE_FIELDS = ("seq_lens", "prefix_lens", "extend_lens", "qo_indptr", "kv_indptr",
                "page_table", "out_cache_loc", "row_index", "pad_mask")


@dataclass
class GraphState(Generic[BuffersT]):
    """Device buffers shared by every captured shape (graphs replay one at a time).

    The index buffers mirror :class:`~attnreg.runtime.ForwardBatch` at the
    largest captured shape; ``row_index`` (0, 1, 2, ...) and ``pad_mask`` let
    a backend zero the output rows of padding inside the graph
    (:meth:`zero_padded_rows`).  ``capture_shape`` is what the backend's
    declared ``CaptureMemory`` is asked about, and what ``buffers`` was sized
    from.
    """

    max_bs: int
    max_num_tokens: int
    max_seq_len: int
    max_pages: int
    graph_modes: dict[Phase, GraphMode]
    capture_shape: CaptureShape
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    row_index: torch.Tensor
    pad_mask: torch.Tensor
    buffers: BuffersT | None = None

    @classmethod
    def allocate(cls, *, max_bs: int, max_num_tokens: int, max_seq_len: int, page_size: int,
                 graph_modes: Mapping[Phase, GraphMode], capture_shape: CaptureShape,
                 device: torch.device) -> GraphState[Any]:
        """Zeroed index buffers for captured shapes up to the given bounds."""
        max_pages = -(-max_seq_len // page_size)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(
            max_bs=max_bs, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            max_pages=max_pages, graph_modes=dict(graph_modes), capture_shape=capture_shape,
            seq_lens=ints(max_bs), prefix_lens=ints(max_bs), extend_lens=ints(max_bs),
            qo_indptr=ints(max_bs + 1), kv_indptr=ints(max_bs + 1),
            page_table=ints(max_bs, max_pages), out_cache_loc=ints(max_num_tokens),
            row_index=torch.arange(max_num_tokens, dtype=torch.int32, device=device),
            pad_mask=torch.zeros(max_num_tokens, dtype=torch.bool, device=device))

    @property
    def base_bytes(self) -> int:
        """Bytes of the runtime's own index buffers (not the backend's ``buffers``)."""
        return sum(getattr(self, name).nbytes for name in _BASE_FIELDS)

    # -- captured shapes ---------------------------------------------------------------
    @staticmethod
    def query_bound(forward_mode: ForwardMode, bs: int, num_tokens: int) -> int:
        """New tokens one sequence may bring in the captured shape ``(bs, num_tokens)``.

        DECODE: 1; TARGET_VERIFY / DRAFT_EXTEND: ``num_tokens / bs`` (the captured
        draft tokens per sequence); EXTEND: ``num_tokens`` (ragged prefill).
        """
        if forward_mode is ForwardMode.DECODE:
            return 1
        if forward_mode is ForwardMode.EXTEND:
            return num_tokens
        return -(-num_tokens // max(1, bs))

    def views(self, forward_mode: ForwardMode, bs: int, num_tokens: int,
              mode: GraphMode) -> ForwardMetadata[Any]:
        """Graph metadata of the captured shape ``(bs, num_tokens)``: views of the buffers."""
        return ForwardMetadata(
            forward_mode=forward_mode, batch_size=bs, num_tokens=num_tokens,
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], qo_indptr=self.qo_indptr[:bs + 1],
            kv_indptr=self.kv_indptr[:bs + 1], page_table=self.page_table[:bs],
            out_cache_loc=self.out_cache_loc[:num_tokens], max_seq_len=self.max_seq_len,
            max_extend_len=self.query_bound(forward_mode, bs, num_tokens), graph_mode=mode)

    def dummy_batch(self, forward_mode: ForwardMode, bs: int, num_tokens: int,
                    page_size: int, device: torch.device) -> ForwardBatch:
        """A batch of the captured shape whose every token sits in the padding page."""
        if forward_mode is ForwardMode.EXTEND:
            extend = [num_tokens // bs] * bs
            extend[0] += num_tokens - sum(extend)
        else:  # decode-phase shapes: each sequence brings the captured query tokens
            extend = [self.query_bound(forward_mode, bs, num_tokens)] * bs
        loc = [PADDING_PAGE * page_size + t % page_size for e in extend for t in range(e)]
        table = torch.full((bs, self.max_pages), PADDING_PAGE, dtype=torch.int32,
                           device=device)
        return ForwardBatch.build(forward_mode, [0] * bs, extend, table, loc)

    def fit_problems(self, md: ForwardMetadata[Any], batch: ForwardBatch) -> list[str]:
        """Why ``batch`` cannot be replayed through the captured shape of ``md`` ([] if it can)."""
        problems = []
        bs, nt = md.batch_size, md.num_tokens
        if batch.forward_mode is not md.forward_mode:
            problems.append(f"batch is {batch.forward_mode}, the graph was captured for "
                            f"{md.forward_mode}")
        if batch.batch_size > bs or batch.num_tokens > nt:
            problems.append(f"batch has {batch.batch_size} sequences / {batch.num_tokens} "
                            f"tokens, the graph {bs} / {nt}")
        q = md.max_extend_len
        lens = set(batch.extend_lens_cpu)
        if md.forward_mode is ForwardMode.TARGET_VERIFY and lens and lens != {q}:
            problems.append(f"the verify graph was captured for {q} draft tokens per "
                            f"sequence, the batch has {sorted(lens)}")
        if md.forward_mode is ForwardMode.DRAFT_EXTEND and lens and max(lens) > q:
            problems.append(f"the draft-extend graph was captured for up to {q} tokens per "
                            f"sequence, the batch has {max(lens)}")
        if batch.max_seq_len > self.max_seq_len:
            problems.append(f"longest sequence {batch.max_seq_len} exceeds the capture bound "
                            f"max_seq_len={self.max_seq_len}")
        return problems

    def fill(self, md: ForwardMetadata[Any], batch: ForwardBatch, page_size: int) -> None:
        """Copy ``batch`` into the buffers of ``md``'s shape, padding the rest.

        Missing sequences get length 0 and the padding page; missing tokens
        write to the padding slot.  Device copies only: nothing waits for the
        device.  Check :meth:`fit_problems` first.
        """
        bs, nt = md.batch_size, md.num_tokens
        b, t = batch.batch_size, batch.num_tokens
        cols = min(batch.page_table.shape[1], self.max_pages)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.seq_lens[b:bs].zero_()
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        self.prefix_lens[b:bs].zero_()
        self.extend_lens[:b].copy_(batch.extend_lens)
        self.extend_lens[b:bs].zero_()
        self.qo_indptr[:b + 1].copy_(batch.qo_indptr)
        self.qo_indptr[b + 1:bs + 1].fill_(t)
        self.kv_indptr[:b + 1].copy_(batch.kv_indptr)
        self.kv_indptr[b + 1:bs + 1].fill_(batch.num_kv_tokens)
        self.page_table[:bs].fill_(PADDING_PAGE)
        self.page_table[:b, :cols].copy_(batch.page_table[:, :cols])
        self.out_cache_loc[:t].copy_(batch.out_cache_loc)
        self.out_cache_loc[t:nt].fill_(PADDING_PAGE * page_size)
        md.batch = batch

    def zero_padded_rows(self, out: torch.Tensor, md: ForwardMetadata[Any]) -> None:
        """Zero the rows of ``out`` that belong to padding, inside the graph.

        Row ``r`` is padding when ``r >= qo_indptr[bs]`` (the real tokens of the
        replayed batch; padded sequences own no rows).  Computed on the device
        from the buffers a replay fills, so it is right for every replay, and
        it neither allocates nor syncs: two launches, capture-safe.  A no-op
        for eager metadata, which has no padding.
        """
        self.fill_padded_rows(out, md, 0.0)

    def fill_padded_rows(self, t: torch.Tensor, md: ForwardMetadata[Any], value: float) -> None:
        """Set the rows of ``t`` (output ``[rows, ...]`` or LSE ``[rows, H]``) that belong to
        padding to ``value``, inside the graph (see :meth:`zero_padded_rows`)."""
        if not md.is_graph:
            return
        rows = t.shape[0]
        mask = self.pad_mask[:rows]
        torch.ge(self.row_index[:rows], md.qo_indptr[-1:], out=mask)
        t.masked_fill_(mask.view((rows,) + (1,) * (t.dim() - 1)), value)


def tensor_bytes(*roots: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots``.

    Follows dataclass fields, named and plain tuples, lists and dict values
    (the shapes of a backend's typed plans and buffers); a storage seen twice
    (a workspace and its views) counts once.  What the conformance suite
    measures on machines without a device allocator to ask.
    """
    seen: dict[int, int] = {}

    def visit(obj: object, depth: int) -> None:
        if depth > 8 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
            return
        children: Iterable[object]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            children = (getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif isinstance(obj, (tuple, list)):
            children = obj
        elif isinstance(obj, dict):
            children = obj.values()
        else:
            return
        for child in children:
            visit(child, depth + 1)

    for root in roots:
        visit(root, 0)
    return sum(seen.values())
