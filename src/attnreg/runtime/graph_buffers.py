"""The graph state of a backend: :class:`GraphState`.

``init_cuda_graph_state`` allocates the index buffers once for the largest
captured shape (one :class:`~attnreg.runtime.BatchIndices`, views of one flat
buffer in an :class:`~attnreg.runtime.IndexLayout`); each captured
shape reads views of them (``ForwardMetadata`` with ``graph_mode`` set), kept
in :attr:`GraphState.captured` per (forward mode, bs, num_tokens), and
``init_forward_metadata_replay`` copies a real batch into them outside the
graph (:meth:`GraphState.fill`): one device copy for a batch built in the same
layout, else a padded copy per tensor.  The backend's own buffers (workspaces,
library index arrays) hang off :attr:`GraphState.buffers`, a dataclass of its
own; :meth:`GraphState.buffer_bytes` counts them with the captured plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from attnreg.graph_policy.capture import current_capture
from attnreg.registry import CaptureShape, DType, ForwardMode, GraphMode, Phase

from ._optional import triton_kernel_module
from .batch import ForwardBatch
from .config import MLAConfig
from .dtypes import device_num_sms
from .index_buffer import OVERWRITTEN, IndexBuffer
from .indices import BatchIndices, IndexLayout
from .metadata import DEFAULT_CAPTURE_MODE, ForwardMetadata
from .pool import PADDING_PAGE

__all__ = ["BuffersT", "GraphState", "tensor_bytes"]

#: A backend's own graph buffers (a dataclass: workspaces, library index arrays).
BuffersT = TypeVar("BuffersT")

#: A captured shape: (forward mode, bs, num_tokens).
ShapeKey = tuple[ForwardMode, int, int]


@dataclass
class GraphState(Generic[BuffersT]):
    """Device buffers shared by every captured shape (graphs replay one at a time).

    ``indices`` mirrors :class:`~attnreg.runtime.ForwardBatch`'s index tensors at
    the largest captured shape; ``pad_mask`` (rows of padding: a bool view of the
    layout's padding rows in :attr:`flat`, which a packed batch brings in its one
    copy and the per-tensor fill computes from ``row_index`` = 0, 1, 2, ...) lets a
    backend zero the output rows of padding inside the graph
    (:meth:`zero_padded_rows`).  ``capture_shape`` is what the backend's declared
    ``CaptureMemory`` is asked about, and what ``buffers`` was sized from.
    ``captured`` holds the metadata of every shape captured since this state was
    allocated.
    """

    max_bs: int
    max_num_tokens: int
    max_seq_len: int
    max_pages: int
    graph_modes: dict[Phase, GraphMode]
    capture_shape: CaptureShape
    indices: BatchIndices
    row_index: torch.Tensor
    pad_mask: torch.Tensor
    buffers: BuffersT | None = None
    captured: dict[ShapeKey, ForwardMetadata[Any]] = field(default_factory=dict)
    #: where ``indices`` sit in :attr:`flat` (a batch built in it fills them in one copy)
    layout: IndexLayout | None = None
    #: the one int32 buffer ``indices`` are views of
    flat: torch.Tensor | None = None
    #: replays filled by one copy / by the padded per-tensor copy (what the session benchmark
    #: and tests read to see which path ran)
    fills: dict[str, int] = field(default_factory=lambda: {"packed": 0, "padded": 0,
                                                           "in_place": 0})
    #: allocated for sparse (DSA) captures: the lifecycle's capture checks read the
    #: declaration's ``sparse_graph_modes`` (``Capabilities.sparse_view()``)
    sparse: bool = False
    #: the int32 padding-row flags :attr:`pad_mask` is the low bytes of (a view of
    #: :attr:`flat`), what :meth:`fill_padded_rows`'s one-launch CUDA form reads
    pad_rows: torch.Tensor | None = None
    #: :attr:`flat` as the place an engine packs a batch into (no copy at replay)
    index_buffer: IndexBuffer | None = None

    @classmethod
    def allocate(cls, *, max_bs: int, max_num_tokens: int, max_seq_len: int, page_size: int,
                 graph_modes: Mapping[Phase, GraphMode], capture_shape: CaptureShape,
                 device: torch.device, sparse: bool = False) -> GraphState[Any]:
        """Zeroed index buffers for captured shapes up to the given bounds."""
        max_pages = -(-max_seq_len // page_size)
        layout = IndexLayout(max_bs, max_num_tokens, max_pages, page_size, PADDING_PAGE)
        flat, indices = layout.allocate(device)
        return cls(
            max_bs=max_bs, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
            max_pages=max_pages, graph_modes=dict(graph_modes), capture_shape=capture_shape,
            indices=indices,
            row_index=torch.arange(max_num_tokens, dtype=torch.int32, device=device),
            pad_mask=layout.padding_mask(flat), layout=layout, flat=flat, sparse=sparse,
            pad_rows=layout.padding_rows(flat), index_buffer=IndexBuffer(layout, flat))

    def capture_mode(self, phase: Phase) -> GraphMode:
        """The mode ``phase`` is captured in: the ``capturing()`` mode, else the one this
        state was allocated for, else the one that captures attention."""
        return current_capture() or self.graph_modes.get(phase) or DEFAULT_CAPTURE_MODE[phase]

    @staticmethod
    def shape_for(config: MLAConfig, device: torch.device, max_bs: int, max_num_tokens: int,
                  max_seq_len: int) -> CaptureShape:
        """The :class:`~attnreg.registry.CaptureShape` of these bounds for ``config`` on
        ``device``: its heads, page size, KV and query dtypes and the device's
        multiprocessor count (0 off CUDA)."""
        return CaptureShape(max_batch_size=max_bs, max_num_tokens=max_num_tokens,
                            max_seq_len=max_seq_len, num_heads=config.num_heads,
                            page_size=config.page_size, kv_dtype=DType.parse(config.kv_dtype),
                            num_sms=device_num_sms(device) or 0,
                            q_dtype=DType.parse(config.q_dtype))

    @property
    def base_bytes(self) -> int:
        """Bytes of the runtime's own index buffers (not the backend's ``buffers``)."""
        # storages counted once: the index views and pad_mask share the flat buffer
        return tensor_bytes(self.indices, self.row_index, self.pad_mask)

    def buffer_bytes(self) -> int:
        """Bytes of the backend's ``buffers`` and the plans of every captured shape."""
        return tensor_bytes(self.buffers, *(md.plan for md in self.captured.values()))

    def captured_for(self, forward_mode: ForwardMode, bs: int,
                     num_tokens: int) -> ForwardMetadata[Any] | None:
        """The metadata captured for the shape, or None."""
        return self.captured.get((forward_mode, bs, num_tokens))

    def keep(self, md: ForwardMetadata[Any]) -> None:
        """Remember ``md`` as the metadata of its captured shape (what replays fill)."""
        self.captured[(md.forward_mode, md.batch_size, md.num_tokens)] = md

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
            indices=self.indices.view(bs, num_tokens), max_seq_len=self.max_seq_len,
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
        fm = md.forward_mode
        packed = batch.packed
        if packed is not None and packed.serves(batch):
            # the lengths' summary made when the batch was packed: no pass over them
            b, (tokens, longest, fewest, most) = len(packed.host_lens[0]), packed.summary
        else:
            ext = batch.extend_lens_cpu
            b, tokens, longest = len(ext), sum(ext), batch.max_seq_len
            fewest, most = min(ext, default=0), max(ext, default=0)
        if batch.forward_mode is not fm:
            problems.append(f"batch is {batch.forward_mode}, the graph was captured for {fm}")
        if b > bs or tokens > nt:
            problems.append(f"batch has {b} sequences / {tokens} tokens, the graph {bs} / {nt}")
        q = md.max_extend_len
        if fm is ForwardMode.TARGET_VERIFY and b and (fewest, most) != (q, q):
            problems.append(f"the verify graph was captured for {q} draft tokens per "
                            f"sequence, the batch has {sorted(set(batch.extend_lens_cpu))}")
        if fm is ForwardMode.DRAFT_EXTEND and b and most > q:
            problems.append(f"the draft-extend graph was captured for up to {q} tokens per "
                            f"sequence, the batch has {most}")
        if longest > self.max_seq_len:
            problems.append(f"longest sequence {longest} exceeds the capture bound "
                            f"max_seq_len={self.max_seq_len}")
        return problems

    def fill_packed(self, md: ForwardMetadata[Any], batch: ForwardBatch) -> bool:
        """The replay path of a batch built in this state's :attr:`layout`: when it is still
        what was packed, on this state's device, and fits ``md``'s shape (read from the
        summary made when it was packed), copy its flat buffer whole and return True.
        False (nothing copied) for any other batch: the caller then checks it per tensor
        (``batch_problems``, :meth:`fit_problems`, whose messages say why) and
        copies it with :meth:`fill`.  Everything this skips was checked by ``IndexLayout.pack``
        (int32 views of one buffer, the shapes, seq = prefix + extend, the page table)."""
        packed = batch.packed
        if packed is None or batch.forward_mode is not md.forward_mode or packed.overwritten:
            return False  # an overwritten batch: the caller's per-tensor check refuses it
        flat = self.flat
        src = packed.flat
        in_place = src is flat  # IndexBuffer.pack: this layout, this device
        if flat is None or not packed.serves(batch) or not in_place and (
                not (packed.layout is self.layout or packed.layout == self.layout)
                or src.get_device() != flat.get_device()):
            return False
        tokens, longest, fewest, most = packed.summary
        fm = md.forward_mode
        if (tokens > md.num_tokens or longest > self.max_seq_len
                or len(packed.host_lens[0]) > md.batch_size):
            return False
        if fm is not ForwardMode.DECODE:  # the speculative modes' tokens per request
            q = md.max_extend_len
            if ((fm is ForwardMode.TARGET_VERIFY and tokens and (fewest, most) != (q, q))
                    or (fm is ForwardMode.DRAFT_EXTEND and most > q)):
                return False
        self._take_packed(src)
        md.batch = batch
        return True

    def fill(self, md: ForwardMetadata[Any], batch: ForwardBatch, page_size: int) -> None:
        """Copy ``batch`` into the buffers of ``md``'s shape, padding the rest.

        Missing sequences get length 0 and the padding page; missing tokens
        write to the padding slot.  Device copies only: nothing waits for the
        device.  A batch built in this state's :attr:`layout` (``batch.packed``,
        still holding the batch's own tensors) is already padded to every
        captured shape: its flat buffer is copied whole, one device copy with
        no host work per tensor.  Check :meth:`fit_problems` first.
        """
        packed = batch.packed
        if packed is not None and packed.overwritten:
            raise ValueError(OVERWRITTEN)
        if (packed is not None and self.flat is not None and packed.layout == self.layout
                and packed.serves(batch)):
            self._take_packed(packed.flat)
        else:
            self._overwritten()
            self.indices.copy_padded_(batch.indices, bs=md.batch_size,
                                      num_tokens=md.num_tokens,
                                      num_kv_tokens=batch.num_kv_tokens, pad_page=PADDING_PAGE,
                                      pad_slot=PADDING_PAGE * page_size)
            self.mark_padding(md)
            self.fills["padded"] += 1
        md.batch = batch

    def _take_packed(self, src: torch.Tensor) -> None:
        """Bring a packed flat buffer of this layout into :attr:`flat`: nothing when it is
        :attr:`flat` itself (``IndexBuffer.pack``), else one device copy (the padding rows
        included), which overwrites the batch the index buffer held."""
        assert self.flat is not None
        if src is self.flat:
            self.fills["in_place"] += 1
            return
        self.flat.copy_(src)
        self._overwritten()
        self.fills["packed"] += 1

    def _overwritten(self) -> None:
        if self.index_buffer is not None:
            self.index_buffer.overwritten()

    def mark_padding(self, md: ForwardMetadata[Any]) -> None:
        """Set :attr:`pad_mask` for the shape of ``md`` from the buffers just filled by the
        per-tensor copy: row ``r`` is padding when ``r >= qo_indptr[bs]`` (the real tokens
        of the batch; padded sequences own no rows).  One device op, outside the graph and
        never waited on, so every layer's :meth:`zero_padded_rows` inside the graph is one
        launch (issue 31: the mask was recomputed per layer).  A packed batch brings the
        mask in its one copy (``IndexLayout.pack`` writes the padding rows; issue 26: a
        second launch per replay was host time), so only :meth:`fill`'s per-tensor path
        calls this."""
        # into the flags' low bytes (pad_mask's view); their other bytes stay 0 (the flat
        # buffer starts zeroed and a pack writes whole 0 / 1 flags)
        torch.ge(self.row_index, md.qo_indptr[-1:], out=self.pad_mask)

    def zero_padded_rows(self, out: torch.Tensor, md: ForwardMetadata[Any]) -> None:
        """Zero the rows of ``out`` that belong to padding, inside the graph.

        Row ``r`` is padding when ``r >= qo_indptr[bs]`` (the real tokens of the
        replayed batch; padded sequences own no rows): :attr:`pad_mask`, which
        every fill of the buffers sets on the device (:meth:`mark_padding`), so it
        is right for every replay.  One launch reading it (on CUDA one that writes
        only the padding rows, :func:`fill_flagged_rows`); it neither allocates
        nor syncs, capture-safe.  A no-op for eager metadata, which has no padding.
        """
        self.fill_padded_rows(out, md, 0.0)

    def fill_padded_rows(self, t: torch.Tensor, md: ForwardMetadata[Any], value: float,
                         *, src: torch.Tensor | None = None) -> None:
        """Set the rows of ``t`` (output ``[rows, ...]`` or LSE ``[rows, H]``) that belong to
        padding to ``value``, inside the graph (see :meth:`zero_padded_rows`).  With
        ``src``, ``t`` takes ``src``'s rows first (one launch for a kernel's output copied
        into ``t`` with its padding set; under eager metadata just the copy)."""
        if not md.is_graph:
            if src is not None:
                t.copy_(src)
            return
        rows = t.shape[0]
        flags = None if self.pad_rows is None else self.pad_rows[:rows]
        fill_flagged_rows(t, self.pad_mask[:rows], value, flags=flags, src=src)


def fill_flagged_rows(t: torch.Tensor, mask: torch.Tensor, value: float, *,
                      flags: torch.Tensor | None = None, src: torch.Tensor | None = None
                      ) -> None:
    """Set the rows ``r`` of ``t`` where ``mask[r]`` (bool, one per row) to ``value``, in place;
    with ``src`` (``t``'s shape), copy ``src`` into ``t`` first: the other rows become ``src``'s.

    ``flags``: the same mask as int32 (nonzero = set), when the caller has it
    (``GraphState.pad_rows``).  With it, on CUDA (and triton installed) this is one
    Triton launch that writes only the flagged rows, or with ``src`` every row once
    (``attnreg.runtime._pad_rows_kernel``); else ``masked_fill_`` (after ``copy_``),
    which reads and writes every element (issue 31: +3 to +7 us per decode layer at the
    P1 shapes on the H200).  Both give the same values.  Capture-safe: no allocation,
    no sync.
    """
    if flags is not None and t.is_cuda:
        fused = triton_kernel_module("_pad_rows_kernel")
        if fused is not None and fused.supports(t, flags, src):
            fused.fill_flagged_rows_fused(t, flags, value, src)
            return
    if src is not None:
        t.copy_(src)
    rows = t.shape[0]
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
