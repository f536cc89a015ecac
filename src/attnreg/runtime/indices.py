"""The seven index tensors of a batch, as one type: :class:`BatchIndices`.

A :class:`~attnreg.runtime.ForwardBatch`, the graph buffers of
:class:`~attnreg.runtime.GraphState` and a
:class:`~attnreg.runtime.ForwardMetadata` each carry one ``BatchIndices``
(``.indices``), so the tensors are declared once, sliced once
(:meth:`BatchIndices.view`) and copied into the graph buffers by one method
(:meth:`BatchIndices.copy_padded_`).  :class:`IndexLayout` places the seven
in one flat int32 buffer padded to a capacity: a batch built in the layout of
a session's graph buffers (:class:`PackedIndices`) is copied into them by one
device copy, with no host work per field.  :class:`IndexFields` keeps the old
attribute names (``md.seq_lens``, ``batch.kv_indptr`` ...) readable and
assignable, and :func:`accepts_index_keywords` keeps the old constructor
keywords (``ForwardBatch(seq_lens=..., ...)``, ``dataclasses.replace(md,
prefix_lens=...)``) working, so backends and plugins written against the
seven separate fields run unchanged.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

if TYPE_CHECKING:
    from .index_buffer import IndexBuffer

__all__ = ["INDEX_FIELDS", "BatchIndices", "IndexFields", "IndexLayout", "PackedIndices",
           "accepts_index_keywords"]

#: The index tensors of a batch, in declaration order; every one is int32 on the
#: backend's device.
INDEX_FIELDS: tuple[str, ...] = ("seq_lens", "prefix_lens", "extend_lens", "qo_indptr",
                                 "kv_indptr", "page_table", "out_cache_loc")

#: The byte of an int32 holding its lowest 8 bits (0 on little-endian machines).
_LOW_BYTE = 0 if sys.byteorder == "little" else 3
#: Entries (int32) the page table's start in a flat index buffer is a multiple of: 256
#: bytes, the CUDA allocator's alignment, as a page table allocated on its own has it.
#: A kernel reading one entry per token (page size 1) pays for a table that is not
#: 16-byte aligned: the triton decode over an fp8 cache at 16 heads took 185.4 instead of
#: 176.1 us with the table 8 bytes past a 16-byte boundary (H100, B=128, L=4096;
#: ``scripts/probe_triton_backend_gap.py --bisect``).
PAGE_TABLE_ALIGN_ENTRIES = 64


@dataclass(frozen=True, slots=True)
class BatchIndices:
    """The device index tensors of one batch (all int32).

    Attributes
    ----------
    seq_lens, prefix_lens, extend_lens : Tensor [B]
        Whole, cached and new tokens per sequence (``seq = prefix + extend``).
    qo_indptr, kv_indptr : Tensor [B + 1]
        Cumulative ``extend_lens`` (query rows) and ``seq_lens`` (ragged MHA K / V).
    page_table : Tensor [B, max_pages]
    out_cache_loc : Tensor [num_tokens]
        Flat pool slots of the new tokens.

    Frozen: a batch and the eager metadata planned from it share one object;
    changing a tensor means a new ``BatchIndices`` (:meth:`replace`).
    """

    FIELDS: ClassVar[tuple[str, ...]] = INDEX_FIELDS

    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor

    @classmethod
    def zeros(cls, max_bs: int, max_num_tokens: int, max_pages: int,
              device: torch.device) -> BatchIndices:
        """Zeroed buffers for batches up to ``max_bs`` sequences and ``max_num_tokens`` tokens."""
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return cls(seq_lens=ints(max_bs), prefix_lens=ints(max_bs), extend_lens=ints(max_bs),
                   qo_indptr=ints(max_bs + 1), kv_indptr=ints(max_bs + 1),
                   page_table=ints(max_bs, max_pages), out_cache_loc=ints(max_num_tokens))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The seven tensors in :data:`INDEX_FIELDS` order."""
        return (self.seq_lens, self.prefix_lens, self.extend_lens, self.qo_indptr,
                self.kv_indptr, self.page_table, self.out_cache_loc)

    def items(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """``(name, tensor)`` pairs in :data:`INDEX_FIELDS` order."""
        return tuple(zip(INDEX_FIELDS, self.tensors()))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def replace(self, **changes: torch.Tensor) -> BatchIndices:
        """A copy with some tensors replaced (the object itself is frozen)."""
        return dataclasses.replace(self, **changes)

    def view(self, bs: int, num_tokens: int) -> BatchIndices:
        """The leading ``bs`` sequences and ``num_tokens`` tokens (views, no copy)."""
        return BatchIndices(
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], qo_indptr=self.qo_indptr[:bs + 1],
            kv_indptr=self.kv_indptr[:bs + 1], page_table=self.page_table[:bs],
            out_cache_loc=self.out_cache_loc[:num_tokens])

    def copy_padded_(self, src: BatchIndices, *, bs: int, num_tokens: int, num_kv_tokens: int,
                     pad_page: int, pad_slot: int) -> None:
        """Copy ``src`` (b sequences, t tokens) into the first ``bs`` / ``num_tokens``
        rows of these buffers and pad the rest, in place.

        Padding sequences get lengths 0 (their indptr entries repeat the last real
        one: ``t`` for ``qo_indptr``, ``num_kv_tokens``, the host total of
        ``src.seq_lens``, for ``kv_indptr``) and pages of ``pad_page``; padding
        tokens write to ``pad_slot``.  Page-table columns beyond these buffers'
        width are dropped.  Device copies only: nothing waits for the device.
        """
        b, t = src.seq_lens.shape[0], src.out_cache_loc.shape[0]
        cols = min(src.page_table.shape[1], self.page_table.shape[1])
        for dst, values in ((self.seq_lens, src.seq_lens), (self.prefix_lens, src.prefix_lens),
                            (self.extend_lens, src.extend_lens)):
            dst[:b].copy_(values)
            dst[b:bs].zero_()
        self.qo_indptr[:b + 1].copy_(src.qo_indptr)
        self.qo_indptr[b + 1:bs + 1].fill_(t)
        self.kv_indptr[:b + 1].copy_(src.kv_indptr)
        self.kv_indptr[b + 1:bs + 1].fill_(num_kv_tokens)
        self.page_table[:bs].fill_(pad_page)
        self.page_table[:b, :cols].copy_(src.page_table[:, :cols])
        self.out_cache_loc[:t].copy_(src.out_cache_loc)
        self.out_cache_loc[t:num_tokens].fill_(pad_slot)


@dataclass(frozen=True)
class IndexLayout:
    """Where a batch's seven index tensors sit in one flat int32 buffer, padded to a capacity.

    The order is ``seq_lens, prefix_lens, extend_lens`` (``max_bs`` each),
    ``qo_indptr, kv_indptr`` (``max_bs + 1`` each), ``out_cache_loc``
    (``max_num_tokens``), the padding rows (``max_num_tokens``: 1 where a query
    row is padding, ``r >= t``; :meth:`padding_mask`), zeros up to a 256-byte
    boundary, then ``page_table`` (``max_bs x max_pages``).  A
    batch of ``b`` sequences and ``t`` tokens packed in it (:meth:`pack`) is
    padded as :meth:`BatchIndices.copy_padded_` pads to any ``bs <= max_bs``:
    lengths 0, indptrs repeating their last entry, the padding page, the
    padding slot (``pad_page * page_size``).  So the whole flat buffer copied
    onto the graph buffers of the same layout is exactly the padded fill of
    every captured bucket: the replay metadata of :class:`GraphSession` is one
    device copy (see docs/runtime.md, "Device-side replay metadata"), the rows a
    replay must zero included: no second launch computes them (issue 26, host step).
    """

    max_bs: int
    max_num_tokens: int
    max_pages: int
    page_size: int
    pad_page: int = 0

    def __post_init__(self) -> None:
        for name in ("max_bs", "max_num_tokens", "max_pages", "page_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"IndexLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def pad_slot(self) -> int:
        """The flat slot padding tokens write to (the padding page's first)."""
        return self.pad_page * self.page_size

    @functools.cached_property
    def _spans(self) -> dict[str, tuple[int, int]]:
        """Each field before the page table, by name, with its ``[start, stop)`` in the flat
        buffer, in the buffer's order: the one place that order and those sizes are
        written (:meth:`views`, :meth:`padding_rows` and :attr:`head_entries` read it)."""
        m, n = self.max_bs, self.max_num_tokens
        sizes = (("seq_lens", m), ("prefix_lens", m), ("extend_lens", m),
                 ("qo_indptr", m + 1), ("kv_indptr", m + 1), ("out_cache_loc", n),
                 ("padding_rows", n))
        spans: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes:
            spans[name] = (start, start + size)
            start += size
        return spans

    @property
    def head_entries(self) -> int:
        """Entries the lengths, the indptrs, the slots and the padding rows take."""
        return next(reversed(self._spans.values()))[1]

    @property
    def head_size(self) -> int:
        """Entries before the page table: :attr:`head_entries`, then zeros up to a
        multiple of ``PAGE_TABLE_ALIGN_ENTRIES`` (the table starts 256-byte aligned in a
        buffer that is)."""
        align = PAGE_TABLE_ALIGN_ENTRIES
        return -(-self.head_entries // align) * align

    def padding_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The int32 padding-row flags of ``flat`` (1 where a query row is padding), a view."""
        start, stop = self._spans["padding_rows"]
        return flat[start:stop]

    def padding_mask(self, flat: torch.Tensor) -> torch.Tensor:
        """:meth:`padding_rows` as a bool view (no copy): each flag's lowest byte, which
        holds its 0 / 1, so the mask a replay's ``masked_fill_`` reads moves with the one
        copy of ``flat``."""
        return self.padding_rows(flat).view(torch.uint8)[_LOW_BYTE::4].view(torch.bool)

    @property
    def size(self) -> int:
        """Entries of the flat buffer."""
        return self.head_size + self.max_bs * self.max_pages

    def views(self, flat: torch.Tensor) -> BatchIndices:
        """The seven tensors at full capacity, as views of ``flat`` (no copy)."""
        if flat.shape != (self.size,) or flat.dtype != torch.int32:
            raise ValueError(f"a flat index buffer of this layout is int32 [{self.size}], got "
                             f"{flat.dtype} {tuple(flat.shape)}")
        fields = {name: flat[start:stop] for name, (start, stop) in self._spans.items()
                  if name != "padding_rows"}
        return BatchIndices(**fields,
                            page_table=flat[self.head_size:].view(self.max_bs, self.max_pages))

    def allocate(self, device: torch.device | str) -> tuple[torch.Tensor, BatchIndices]:
        """A zeroed flat buffer on ``device`` and its capacity views."""
        flat = torch.zeros(self.size, dtype=torch.int32, device=device)
        return flat, self.views(flat)

    def fit_problems(self, seq_lens: Sequence[int], num_tokens: int) -> list[str]:
        """Why a batch of these lengths cannot be packed in this layout ([] if it can)."""
        problems = []
        if len(seq_lens) > self.max_bs:
            problems.append(f"{len(seq_lens)} sequences, the layout holds {self.max_bs}")
        if num_tokens > self.max_num_tokens:
            problems.append(f"{num_tokens} new tokens, the layout holds {self.max_num_tokens}")
        longest = max(seq_lens, default=0)
        if longest > self.max_pages * self.page_size:
            problems.append(f"a sequence of {longest} tokens needs more than the layout's "
                            f"{self.max_pages} pages of {self.page_size}")
        return problems

    def pack(self, seq_lens: Sequence[int], prefix_lens: Sequence[int],
             extend_lens: Sequence[int], page_table: torch.Tensor,
             out_cache_loc: Sequence[int] | torch.Tensor, device: torch.device,
             into: IndexBuffer | None = None) -> PackedIndices:
        """The batch's index tensors in this layout, padded, on ``device``.

        The host values (lengths, indptrs, slots given as ints) go in one
        host-to-device copy; the page table (and slots given as a tensor) in
        one device copy each.  Page-table columns beyond ``max_pages`` must be
        unused (they are dropped).  ``ValueError`` when the batch does not fit.
        ``into``: write a graph state's own buffer instead of a new one (use
        ``IndexBuffer.pack``, which keeps track of the batch it holds).
        """
        b, t = len(seq_lens), sum(extend_lens)
        problems = self.fit_problems(seq_lens, t)
        if problems:
            raise ValueError("the batch does not fit the index layout: " + "; ".join(problems))
        m, n = self.max_bs, self.max_num_tokens
        pad = m - b
        head = array.array("i", seq_lens)
        head.extend(itertools.repeat(0, pad))
        head.extend(prefix_lens)
        head.extend(itertools.repeat(0, pad))
        head.extend(extend_lens)
        head.extend(itertools.repeat(0, pad))
        head.extend(itertools.accumulate(extend_lens, initial=0))
        head.extend(itertools.repeat(t, pad))
        head.extend(itertools.accumulate(seq_lens, initial=0))
        head.extend(itertools.repeat(sum(seq_lens), pad))
        loc_tensor = out_cache_loc if isinstance(out_cache_loc, torch.Tensor) else None
        if loc_tensor is None:
            head.extend(out_cache_loc)  # type: ignore[arg-type]
        else:
            head.extend(itertools.repeat(self.pad_slot, t))
        head.extend(itertools.repeat(self.pad_slot, n - t))
        head.extend(itertools.repeat(0, t))  # the padding rows: the real ones 0, the rest 1
        head.extend(itertools.repeat(1, n - t))
        head.extend(itertools.repeat(0, self.head_size - self.head_entries))
        if into is None:
            flat = torch.empty(self.size, dtype=torch.int32, device=device)
        else:
            flat = into.flat
            # a source that is a view of the buffer (a batch packed there before) would be
            # overwritten by the fill below before it is read: copy it out first
            if _shares_storage(page_table, flat):
                page_table = page_table.clone()
            if isinstance(out_cache_loc, torch.Tensor) and _shares_storage(out_cache_loc, flat):
                out_cache_loc = out_cache_loc.clone()
        flat[:self.head_size].copy_(torch.frombuffer(head, dtype=torch.int32))
        full = self.views(flat)
        if loc_tensor is not None and t:
            full.out_cache_loc[:t].copy_(loc_tensor)
        table = full.page_table
        table.fill_(self.pad_page)
        cols = min(page_table.shape[1], self.max_pages)
        if b:
            table[:b, :cols].copy_(page_table[:, :cols])
        seq_t, ext_t = tuple(seq_lens), tuple(extend_lens)
        return PackedIndices(self, flat, full.view(b, t), (seq_t, tuple(prefix_lens), ext_t),
                             (t, max(seq_t, default=0), min(ext_t, default=0),
                              max(ext_t, default=0)), into)


@dataclass(frozen=True)
class PackedIndices:
    """A batch's index tensors packed in an :class:`IndexLayout` (see :meth:`IndexLayout.pack`).

    ``flat`` is the whole padded buffer; ``indices`` the batch's own tensors
    (``b`` sequences, ``t`` tokens; the page table ``max_pages`` wide), views
    of it.  A :class:`~attnreg.runtime.ForwardBatch` built with a layout
    carries one; graph buffers of the same layout take it in one copy
    (:meth:`~attnreg.runtime.GraphState.fill`).
    """

    layout: IndexLayout
    flat: torch.Tensor
    indices: BatchIndices
    #: the host lengths packed (seq, prefix, extend), the very tuples the batch carries
    host_lens: tuple[tuple[int, ...], ...] = ()
    #: what a replay decision reads of those lengths, computed once when packed:
    #: (new tokens, longest sequence, fewest and most new tokens of a request)
    summary: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: the graph state's buffer this batch was packed into (``IndexBuffer.pack``), else None
    buffer: IndexBuffer | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def overwritten(self) -> bool:
        """Packed into a graph state's :class:`IndexBuffer` that has been written since: the
        index tensors (views of it) no longer hold this batch, which must not run."""
        return self.buffer is not None and self.buffer.current is not self

    def serves(self, batch: Any) -> bool:
        """Whether ``batch`` (a ForwardBatch) still holds what was packed: these very index
        tensors and host lengths.  A batch whose tensors or lengths were replaced since it
        was built (``dataclasses.replace``) is not served, and is copied and checked per
        tensor.  Identity checks only: constant time."""
        lens = self.host_lens
        return (batch.indices is self.indices and len(lens) == 3
                and batch.seq_lens_cpu is lens[0] and batch.prefix_lens_cpu is lens[1]
                and batch.extend_lens_cpu is lens[2])


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class IndexFields:
    """The seven index tensors of ``self.indices`` as attributes (read and assign).

    Mixed into :class:`~attnreg.runtime.ForwardBatch` and
    :class:`~attnreg.runtime.ForwardMetadata`.  Assigning one (``md.seq_lens =
    t``) gives this object a new ``BatchIndices``; an object sharing the old one
    (the batch of eager metadata) is not changed.
    """

    __slots__ = ()
    indices: BatchIndices

    def _set_index(self, name: str, value: torch.Tensor) -> None:
        self.indices = dataclasses.replace(self.indices, **{name: value})

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.indices.seq_lens

    @seq_lens.setter
    def seq_lens(self, value: torch.Tensor) -> None:
        self._set_index("seq_lens", value)

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.indices.prefix_lens

    @prefix_lens.setter
    def prefix_lens(self, value: torch.Tensor) -> None:
        self._set_index("prefix_lens", value)

    @property
    def extend_lens(self) -> torch.Tensor:
        return self.indices.extend_lens

    @extend_lens.setter
    def extend_lens(self, value: torch.Tensor) -> None:
        self._set_index("extend_lens", value)

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.indices.qo_indptr

    @qo_indptr.setter
    def qo_indptr(self, value: torch.Tensor) -> None:
        self._set_index("qo_indptr", value)

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.indices.kv_indptr

    @kv_indptr.setter
    def kv_indptr(self, value: torch.Tensor) -> None:
        self._set_index("kv_indptr", value)

    @property
    def page_table(self) -> torch.Tensor:
        return self.indices.page_table

    @page_table.setter
    def page_table(self, value: torch.Tensor) -> None:
        self._set_index("page_table", value)

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.indices.out_cache_loc

    @out_cache_loc.setter
    def out_cache_loc(self, value: torch.Tensor) -> None:
        self._set_index("out_cache_loc", value)


_C = TypeVar("_C", bound=type)
_INDEX_NAMES = frozenset(INDEX_FIELDS)


def accepts_index_keywords(cls: _C) -> _C:
    """Let the dataclass ``cls`` (with an ``indices`` field) also be built from the seven
    tensors as keywords, as before :class:`BatchIndices` existed.

    ``cls(..., seq_lens=t, ...)`` with all seven builds the ``BatchIndices``;
    with ``indices=`` and some of them (what ``dataclasses.replace(obj,
    seq_lens=t)`` passes), those replace the ones in ``indices``.
    """
    init = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs and not _INDEX_NAMES.isdisjoint(kwargs):
            given = {name: kwargs.pop(name) for name in INDEX_FIELDS if name in kwargs}
            base = kwargs.get("indices")
            kwargs["indices"] = (BatchIndices(**given) if base is None
                                 else dataclasses.replace(base, **given))
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
