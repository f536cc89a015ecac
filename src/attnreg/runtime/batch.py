"""What one forward pass runs on: :class:`ForwardBatch` and its builders.

Modelled on sglang's ``ForwardBatch``: device tensors for the kernels (all
index tensors int32) plus host copies of the lengths, so backends that plan on
the host (eager runs, the reference) never read a device value back.

Conventions
-----------
* ``seq_lens`` are whole lengths *including* the new tokens:
  ``seq_lens = prefix_lens + extend_lens``.  A decode batch has
  ``extend_lens == 1`` and ``prefix_lens == seq_lens - 1``.
* New tokens of sequence ``b`` are query rows ``qo_indptr[b]:qo_indptr[b+1]``
  and sit at positions ``prefix_lens[b] .. seq_lens[b]-1``; ``out_cache_loc``
  lists the flat KV-pool slots they are written to, in the same order.
* ``kv_indptr`` (cumulative ``seq_lens``) indexes ragged K/V of the
  non-absorbed MHA method, which covers prefix and new tokens.
* Speculative decoding: a TARGET_VERIFY batch carries ``num_draft`` new
  tokens per sequence (the same for every sequence), causal among themselves
  and attending the whole prefix; a DRAFT_EXTEND batch carries 1 or more new
  tokens per sequence (the accepted ones, ragged).  Both are decode-phase
  batches (``attnreg.registry.capabilities.PHASE_FORWARD_MODES``) that run absorbed MLA
  through ``forward_extend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from attnreg.registry import SPECULATIVE_MODES, ForwardMode  # SPECULATIVE_MODES: re-exported

from .dtypes import resolve_device
from .index_buffer import OVERWRITTEN
from .indices import BatchIndices, IndexFields, IndexLayout, PackedIndices, accepts_index_keywords

if TYPE_CHECKING:
    from .index_buffer import IndexBuffer
    from .pool import MLAKVPool

__all__ = ["SPECULATIVE_MODES", "ForwardBatch", "PrefixChunk", "decode_batch", "draft_extend_batch", "extend_batch",
           "verify_batch"]


def _cumsum(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + int(v))
    return out


@accepts_index_keywords
@dataclass
class ForwardBatch(IndexFields):
    """One forward pass: device tensors for kernels, host copies for planning.

    Build it with :func:`decode_batch` or :func:`extend_batch`; fields are as in
    sglang.  Every device index tensor is int32.

    Attributes
    ----------
    forward_mode : ForwardMode
    indices : BatchIndices
        The device index tensors, also readable by name (:class:`IndexFields`):
    seq_lens, prefix_lens, extend_lens : int32 Tensor [B]
    qo_indptr, kv_indptr : int32 Tensor [B + 1]
    page_table : int32 Tensor [B, max_pages]
    out_cache_loc : int32 Tensor [num_tokens]
        Flat pool slots of the new tokens.
    seq_lens_cpu, prefix_lens_cpu, extend_lens_cpu : tuple[int, ...]
        Host copies of the lengths.
    packed : PackedIndices or None
        Set when the batch was built in an :class:`~attnreg.runtime.IndexLayout`
        (``build(..., layout=session.index_layout)``): its index tensors are views
        of one padded buffer that a session's replay copies in one device copy.

    ``ForwardBatch(forward_mode, seq_lens=..., ..., out_cache_loc=..., seq_lens_cpu=...)``
    (the seven tensors as keywords) still builds one
    (:func:`~attnreg.runtime.indices.accepts_index_keywords`).
    """

    forward_mode: ForwardMode
    indices: BatchIndices
    seq_lens_cpu: tuple[int, ...]
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    packed: PackedIndices | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch (query rows)."""
        return sum(self.extend_lens_cpu)

    @property
    def num_kv_tokens(self) -> int:
        """Prefix plus new tokens over all sequences (rows of ragged MHA K/V)."""
        return sum(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu, default=0)

    @property
    def has_prefix(self) -> bool:
        return any(p > 0 for p in self.prefix_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def is_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DECODE

    @property
    def query_len(self) -> int | None:
        """New tokens per sequence when every sequence has the same number (decode: 1;
        target verify: the draft tokens), else None."""
        lens = set(self.extend_lens_cpu)
        return lens.pop() if len(lens) == 1 else None

    def in_layout(self, layout: IndexLayout | IndexBuffer) -> ForwardBatch:
        """This batch with its index tensors packed in ``layout`` (as ``build(...,
        layout=)`` makes it): the same lengths, pages and slots, one padded buffer."""
        if self.packed is not None and self.packed.overwritten:
            raise ValueError(OVERWRITTEN)
        return ForwardBatch.build(self.forward_mode, self.prefix_lens_cpu, self.extend_lens_cpu,
                                  self.page_table, self.out_cache_loc, layout=layout)

    @classmethod
    def from_token_table(cls, forward_mode: ForwardMode | str, prefix_lens: Sequence[int],
                         extend_lens: Sequence[int], token_table: torch.Tensor,
                         out_cache_loc: torch.Tensor, page_size: int) -> ForwardBatch:
        """A batch from an engine's per-token slot table (sglang's ``req_to_token``).

        ``token_table[b, t]`` is the flat pool slot of token ``t`` of sequence
        ``b`` (sglang: ``req_to_token_pool.req_to_token[req_pool_indices]``);
        slots of one page are consecutive, so the page table is every
        ``page_size``-th column divided by ``page_size`` (at page size 1, the
        table itself, without a copy when it is int32).  ``out_cache_loc`` is
        converted to int32 if needed.  Host lengths as in :meth:`build`.
        """
        if token_table.dim() != 2:
            raise ValueError(f"token_table must be [B, tokens], got {tuple(token_table.shape)}")
        table = token_table if page_size == 1 else \
            torch.div(token_table[:, ::page_size], page_size, rounding_mode="floor")
        table = table.to(torch.int32)
        return cls.build(forward_mode, prefix_lens, extend_lens, table,
                         out_cache_loc.to(device=table.device, dtype=torch.int32))

    def prefix_chunks(self, chunk_tokens: int, page_size: int) -> list[PrefixChunk]:
        """The cached prefixes cut into chunks of ``chunk_tokens`` tokens (chunked-prefix MHA).

        Chunk ``c`` holds prefix positions ``c * chunk_tokens ..`` of every
        sequence whose prefix reaches them (others contribute 0 tokens).  Each
        chunk's pool slots are computed on the device from the page table, so
        the host handles one value per sequence per chunk.
        """
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        prefix = self.prefix_lens_cpu
        dev = self.device
        out: list[PrefixChunk] = []
        for index, start in enumerate(range(0, max(prefix, default=0), chunk_tokens)):
            lens = tuple(max(0, min(chunk_tokens, p - start)) for p in prefix)
            total = sum(lens)
            indptr = _cumsum(lens)
            indptr_dev = torch.tensor(indptr, dtype=torch.int32, device=dev)
            if total:
                lens_dev = torch.tensor(lens, dtype=torch.long, device=dev)
                seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_dev,
                                              output_size=total)
                pos = torch.arange(total, device=dev) - torch.repeat_interleave(
                    indptr_dev[:-1].long(), lens_dev, output_size=total) + start
                pages = self.page_table[seq, torch.div(pos, page_size, rounding_mode="floor")]
                slots = (pages.long() * page_size + pos % page_size).to(torch.int32)
            else:
                slots = torch.zeros((0,), dtype=torch.int32, device=dev)
            out.append(PrefixChunk(index, start, lens, indptr_dev, slots))
        return out

    @classmethod
    def build(cls, forward_mode: ForwardMode | str, prefix_lens: Sequence[int],
              extend_lens: Sequence[int], page_table: torch.Tensor,
              out_cache_loc: Sequence[int] | torch.Tensor,
              device: str | torch.device | None = None,
              layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
        """Build a batch from host lengths, a page table and the new tokens' slots.

        Parameters
        ----------
        forward_mode
            DECODE requires every extend length to be 1.
        prefix_lens, extend_lens
            Cached and new tokens per sequence.
        page_table
            int32 ``[B, max_pages]`` (see :meth:`MLAKVPool.page_table`).
        out_cache_loc
            Flat slots of the new tokens, ``sum(extend_lens)`` of them.
        device
            Defaults to the page table's device.
        layout
            Pack the index tensors in this layout (a session's
            :attr:`~attnreg.runtime.GraphSession.index_layout`): one padded buffer,
            so each replay copies the batch's metadata with one device copy.
            The page table is then ``layout.max_pages`` wide.  A session's
            :attr:`~attnreg.runtime.GraphSession.index_buffer`: packed into the
            graph's own buffer, so the replay copies nothing; one batch at a
            time (packing the next overwrites this one, which is then refused).
        """
        mode = cast(ForwardMode, ForwardMode.parse(forward_mode))
        prefix = tuple(int(p) for p in prefix_lens)
        extend = tuple(int(e) for e in extend_lens)
        if len(prefix) != len(extend):
            raise ValueError(f"prefix_lens has {len(prefix)} entries, extend_lens "
                             f"{len(extend)}")
        if any(p < 0 for p in prefix) or any(e < 0 for e in extend):
            raise ValueError("lengths must be >= 0")
        if mode is ForwardMode.DECODE and any(e != 1 for e in extend):
            raise ValueError(f"a decode batch has exactly one new token per sequence, got "
                             f"extend_lens {list(extend)}")
        if mode is ForwardMode.TARGET_VERIFY and (len(set(extend)) > 1 or 0 in extend):
            raise ValueError(f"a target-verify batch has the same number (>= 1) of draft "
                             f"tokens per sequence, got extend_lens {list(extend)}")
        if mode is ForwardMode.DRAFT_EXTEND and 0 in extend:
            raise ValueError(f"a draft-extend batch has >= 1 new token per sequence, got "
                             f"extend_lens {list(extend)}")
        seq = tuple(p + e for p, e in zip(prefix, extend))
        dev = resolve_device(device) if device is not None else page_table.device
        if page_table.dim() != 2 or page_table.shape[0] != len(seq):
            raise ValueError(f"page_table must be [B={len(seq)}, max_pages], got "
                             f"{tuple(page_table.shape)}")

        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int32, device=dev)

        loc: torch.Tensor | list[int]
        if isinstance(out_cache_loc, torch.Tensor):
            loc = out_cache_loc.to(device=dev)
            loc_shape = tuple(loc.shape)
        else:  # host slots stay on the host until the one copy that sends them
            loc = [int(x) for x in out_cache_loc]
            loc_shape = (len(loc),)
        if loc_shape != (sum(extend),):
            raise ValueError(f"out_cache_loc must list {sum(extend)} slots (one per new "
                             f"token), got shape {loc_shape}")
        if layout is not None:
            packed = layout.pack(seq, prefix, extend, page_table, loc, dev)
            seq, prefix, extend = packed.host_lens  # the very tuples packed.serves() checks
            return cls(forward_mode=mode, indices=packed.indices, seq_lens_cpu=seq,
                       prefix_lens_cpu=prefix, extend_lens_cpu=extend, packed=packed)
        if isinstance(loc, list):
            loc = ints(loc)
        indices = BatchIndices(
            seq_lens=ints(seq), prefix_lens=ints(prefix), extend_lens=ints(extend),
            qo_indptr=ints(_cumsum(extend)), kv_indptr=ints(_cumsum(seq)),
            page_table=page_table.to(dev), out_cache_loc=loc)
        return cls(forward_mode=mode, indices=indices, seq_lens_cpu=seq,
                   prefix_lens_cpu=prefix, extend_lens_cpu=extend)


@dataclass(frozen=True)
class PrefixChunk:
    """One chunk of every sequence's cached prefix (see :meth:`ForwardBatch.prefix_chunks`).

    Attributes
    ----------
    index, start : int
        Chunk number and the first prefix position it covers.
    kv_lens_cpu : tuple[int, ...]
        Tokens each sequence has in this chunk (0 when its prefix is shorter).
    kv_indptr : int32 Tensor [B + 1]
        Cumulative ``kv_lens_cpu``: sequence ``b``'s rows of the chunk's K / V.
    slots : int32 Tensor [sum(kv_lens_cpu)]
        Pool slots of the chunk's tokens, sequence by sequence.
    """

    index: int
    start: int
    kv_lens_cpu: tuple[int, ...]
    kv_indptr: torch.Tensor
    slots: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(self.kv_lens_cpu)


def _pages_for(pool: MLAKVPool, seq_lens: Sequence[int],
               pages: Sequence[Sequence[int]] | None, shuffle: bool | int
               ) -> list[list[int]]:
    if pages is None:
        return pool.allocate(seq_lens, shuffle=shuffle)
    owned = [list(p) for p in pages]
    for n, p in zip(seq_lens, owned):
        if len(p) < pool.pages_needed(n):
            raise ValueError(f"a sequence of {n} tokens needs {pool.pages_needed(n)} pages "
                             f"of {pool.page_size}, got {len(p)}")
    return owned


def decode_batch(pool: MLAKVPool, seq_lens: Sequence[int], *,
                 pages: Sequence[Sequence[int]] | None = None, shuffle: bool | int = False,
                 page_table_width: int | None = None,
                 layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
    """A decode batch: one new token per sequence, at position ``seq_len - 1``.

    Parameters
    ----------
    pool
        The KV pool; pages are taken from it unless ``pages`` is given.
    seq_lens
        Whole lengths including the new token (each >= 1).
    pages
        Pages each sequence owns (from ``pool.allocate``), or None to allocate.
    shuffle
        Passed to :meth:`MLAKVPool.allocate` when allocating.
    page_table_width
        Columns of the page table (default: the longest sequence's pages).
    layout
        Build the index tensors packed in a session's
        :attr:`~attnreg.runtime.GraphSession.index_layout` (one-copy replay metadata)
        or into its :attr:`~attnreg.runtime.GraphSession.index_buffer` (no copy).
    """
    if any(n < 1 for n in seq_lens):
        raise ValueError(f"decode seq_lens include the new token, so each is >= 1; got "
                         f"{list(seq_lens)}")
    owned = _pages_for(pool, seq_lens, pages, shuffle)
    loc = [pool.slots(p, [n - 1])[0] for p, n in zip(owned, seq_lens)]
    table = pool.page_table(owned, width=page_table_width)
    return ForwardBatch.build(ForwardMode.DECODE, [n - 1 for n in seq_lens],
                              [1] * len(seq_lens), table, loc, layout=layout)


def extend_batch(pool: MLAKVPool, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                 *, pages: Sequence[Sequence[int]] | None = None, shuffle: bool | int = False,
                 page_table_width: int | None = None,
                 forward_mode: ForwardMode | str = ForwardMode.EXTEND,
                 layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
    """An extend (prefill) batch: ``extend_lens[b]`` new tokens after ``prefix_lens[b]``.

    The prefix tokens must already be in the pool at the positions the page
    table gives (write them with :meth:`MLAKVPool.write` or an earlier forward).
    See :func:`decode_batch` for the other parameters.
    """
    seq_lens = [int(p) + int(e) for p, e in zip(prefix_lens, extend_lens)]
    owned = _pages_for(pool, seq_lens, pages, shuffle)
    loc: list[int] = []
    for p, pre, n in zip(owned, prefix_lens, seq_lens):
        loc.extend(pool.slots(p, range(pre, n)))
    table = pool.page_table(owned, width=page_table_width)
    return ForwardBatch.build(forward_mode, prefix_lens, extend_lens, table, loc,
                              layout=layout)


def verify_batch(pool: MLAKVPool, prefix_lens: Sequence[int], num_draft: int, *,
                 pages: Sequence[Sequence[int]] | None = None, shuffle: bool | int = False,
                 page_table_width: int | None = None,
                 layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
    """A TARGET_VERIFY batch: ``num_draft`` draft tokens after each sequence's prefix.

    The draft tokens are causal among themselves and attend the whole prefix
    (a chain of drafts, as MTP / EAGLE with one candidate per step verify).
    Pages cover ``prefix + num_draft`` tokens; see :func:`extend_batch`.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    return extend_batch(pool, prefix_lens, [int(num_draft)] * len(prefix_lens), pages=pages,
                        shuffle=shuffle, page_table_width=page_table_width,
                        forward_mode=ForwardMode.TARGET_VERIFY, layout=layout)


def draft_extend_batch(pool: MLAKVPool, prefix_lens: Sequence[int],
                       extend_lens: Sequence[int], *,
                       pages: Sequence[Sequence[int]] | None = None,
                       shuffle: bool | int = False,
                       page_table_width: int | None = None,
                       layout: IndexLayout | IndexBuffer | None = None) -> ForwardBatch:
    """A DRAFT_EXTEND batch: each sequence's accepted tokens (>= 1, ragged) after its prefix.

    See :func:`extend_batch`.
    """
    if any(int(e) < 1 for e in extend_lens):
        raise ValueError(f"a draft-extend batch has >= 1 new token per sequence, got "
                         f"extend_lens {list(extend_lens)}")
    return extend_batch(pool, prefix_lens, extend_lens, pages=pages, shuffle=shuffle,
                        page_table_width=page_table_width,
                        forward_mode=ForwardMode.DRAFT_EXTEND, layout=layout)
