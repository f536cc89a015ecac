"""The paged MLA KV pool: one 576-wide latent row per token per layer, O(1) page bookkeeping.

Layout
------
Every layer has its own buffer ``[num_pages, page_size, kv_lora_rank + rope_dim]``
(sglang's ``MLATokenToKVPool`` keeps one tensor per layer too).  Row
``buffer[page, row, :]`` holds one token: ``kv_lora_rank`` (512) latent values
(``c_kv``, used as both K and V by absorbed MLA) followed by ``qk_rope_head_dim``
(64) rope values (``k_pe``).  Token ``t`` of a sequence lives at
``page_table[b, t // page_size]``, row ``t % page_size``; its *flat slot* is
``page * page_size + row`` (what ``ForwardBatch.out_cache_loc`` holds), the same
in every layer: pages are allocated once for all layers.

Page 0 is reserved, as in sglang's token pool: padded requests of a replayed
CUDA graph write their dummy tokens there, so it is never handed out by
:meth:`MLAKVPool.allocate`.  What a backend may write there is in
docs/runtime.md ("The padding page").

The pool is storage and an allocator, nothing else: canary fills and checks
of stray writes live in :mod:`attnreg.testing.kv_canary` and
:mod:`attnreg.testing.integrity`.

FP8 pools store ``value / scale`` as ``float8_e4m3fn`` and read back
``stored * scale``, with one scale per layer (per-tensor scaling per layer, as
engines keep a ``k_scale`` per attention layer).  Each layer's scale is also a
1-element float32 device tensor (:attr:`MLAKVLayer.scale_tensor`), which
kernels read on the device.

A forward works on one layer: :meth:`MLAKVPool.layer` returns an
:class:`MLAKVLayer`, the view a backend's kernels read (its ``buffer``,
``kv_scale``, ``scale_tensor``, ``write``, ``read_slots``).

Row formats
-----------
By default a row is the 576 values above in the pool's ``kv_dtype`` (dense
rows, what every dense kernel reads).  A pool built with
``kv_format="fp8_ds_mla"`` (:class:`~attnreg.registry.SparseKVFormat`) holds
DeepSeek-V3.2's 656-byte rows instead (:mod:`attnreg.runtime.kv_formats`):
``buffer`` is ``uint8 [num_pages, page_size, 656]``, ``write`` packs (one
float32 scale per 128 latent values, computed on the device), ``read_slots``
and ``dequantized`` unpack, and the per-layer ``scale`` is 1.0 (the scales are
in the rows).  :attr:`MLAKVLayer.row_format` names a pool's rows
(``"fp8_ds_mla"``, else its kv dtype): a sparse kernel is run only on the rows
it declares, and a dense kernel never on ``fp8_ds_mla`` rows.
"""

from __future__ import annotations

import array
import math
import random
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import TYPE_CHECKING

import torch

from attnreg.registry import DType, SparseKVFormat, UnsupportedError

from .dtypes import FP8_E4M3_MAX, dtype_from_torch, resolve_device, torch_dtype
from .kv_formats import (
    FP8_DS_MLA_TILE,
    fp8_ds_mla_row_bytes,
    pack_fp8_ds_mla,
    unpack_fp8_ds_mla,
)

if TYPE_CHECKING:
    from .config import MLAConfig

__all__ = ["PADDING_PAGE", "MLAKVLayer", "MLAKVPool"]

#: The reserved page that padded graph replays write into.
PADDING_PAGE = 0


def _parse_format(kv_format: SparseKVFormat | str | None, kv_dtype: DType | str | None,
                  kv_lora_rank: int) -> tuple[DType, SparseKVFormat | None]:
    """The pool's kv dtype and packed row format (None: dense 576-value rows)."""
    fmt = None if kv_format is None else SparseKVFormat(kv_format)
    if fmt is SparseKVFormat.BF16:
        fmt = None                    # the dense bf16 row is that format
        want = DType.BF16
        if kv_dtype is not None and DType.parse(kv_dtype) is not want:
            raise ValueError(f"kv_format bf16 is the dense bf16 row; kv_dtype "
                             f"{DType.parse(kv_dtype)} contradicts it")
        return want, None
    if fmt is None:
        return DType.parse(kv_dtype if kv_dtype is not None else DType.BF16), None
    if kv_dtype is not None and DType.parse(kv_dtype) is not fmt.dtype:
        raise ValueError(f"kv_format {fmt} rows are {fmt.dtype}; kv_dtype "
                         f"{DType.parse(kv_dtype)} contradicts it (leave kv_dtype out)")
    if kv_lora_rank % FP8_DS_MLA_TILE:
        raise ValueError(f"kv_format {fmt} needs kv_lora_rank a multiple of "
                         f"{FP8_DS_MLA_TILE} (one scale per {FP8_DS_MLA_TILE} latent values), "
                         f"got {kv_lora_rank}")
    return fmt.dtype, fmt


def _check_scale(scale: float, is_fp8: bool, kv_dtype: DType, where: str,
                 kv_format: SparseKVFormat | None = None) -> float:
    scale = float(scale)
    if kv_format is not None and scale != 1.0:
        raise ValueError(f"{where}: scale={scale}, but {kv_format} rows carry their own "
                         "scales (one per 128 latent values); leave the pool's scale at 1.0")
    if not is_fp8 and scale != 1.0:
        raise ValueError(f"{where}: scale={scale} is only meaningful for an fp8 pool; "
                         f"this pool is {kv_dtype}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a positive finite float, got {scale}")
    return scale


class _PagedGeometry:
    """What a pool and each of its layers derive alike from their page geometry."""

    __slots__ = ()
    kv_lora_rank: int
    rope_dim: int
    num_pages: int
    page_size: int
    kv_dtype: DType
    kv_format: SparseKVFormat | None

    @property
    def row_dim(self) -> int:
        """Width of one token's row: latent + rope (576)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def row_bytes(self) -> int:
        """Bytes one token's row takes in the buffer (1152 for bf16, 656 for fp8_ds_mla)."""
        if self.kv_format is SparseKVFormat.FP8_DS_MLA:
            return fp8_ds_mla_row_bytes(self.kv_lora_rank, self.rope_dim)
        return self.row_dim * torch_dtype(self.kv_dtype).itemsize

    @property
    def packed(self) -> bool:
        """True for ``fp8_ds_mla`` rows (bytes, not 576 values)."""
        return self.kv_format is not None

    @property
    def row_format(self) -> str:
        """What a row is: ``"fp8_ds_mla"`` for packed rows, else the kv dtype (``"bf16"``,
        ``"fp8_e4m3"`` ...): 576 values of it.  A sparse kernel's ``kv_format`` must name it."""
        return self.kv_format.value if self.kv_format is not None else self.kv_dtype.value

    @property
    def padding_slot(self) -> int:
        """The slot padded graph replays write their dummy tokens to."""
        return PADDING_PAGE * self.page_size


class MLAKVLayer(_PagedGeometry):
    """One layer of an :class:`MLAKVPool`: its buffer, its FP8 scale, reads and writes.

    What a backend's forward hooks receive as ``pool``: the kernels read
    :attr:`buffer` (``[num_pages, page_size, 576]``; ``uint8 [.., 656]`` for
    ``fp8_ds_mla`` rows) and :attr:`kv_scale` (a float) or :attr:`scale_tensor`
    (the same value as a 1-element float32 device tensor, which a captured
    launch reads at replay time).  Geometry (``page_size``, ``row_dim`` ...) is
    the pool's.  Build it with :meth:`MLAKVPool.layer`, not directly.
    """

    __slots__ = ("layer_id", "buffer", "scale", "scale_tensor", "kv_dtype", "is_fp8",
                 "page_size", "num_pages", "kv_lora_rank", "rope_dim", "device", "kv_format")

    def __init__(self, layer_id: int, buffer: torch.Tensor, scale: float, kv_dtype: DType,
                 kv_lora_rank: int, rope_dim: int,
                 kv_format: SparseKVFormat | None = None) -> None:
        self.layer_id = int(layer_id)
        self.buffer = buffer
        self.kv_dtype = kv_dtype
        #: packed row format (``fp8_ds_mla``), None for dense 576-value rows
        self.kv_format = kv_format
        #: an fp8 pool of dense rows with one per-layer scale (not ``fp8_ds_mla`` rows)
        self.is_fp8 = kv_dtype is DType.FP8_E4M3 and kv_format is None
        self.scale = _check_scale(scale, self.is_fp8, kv_dtype, f"layer {layer_id}",
                                  kv_format)
        self.num_pages, self.page_size = int(buffer.shape[0]), int(buffer.shape[1])
        self.kv_lora_rank = int(kv_lora_rank)
        self.rope_dim = int(rope_dim)
        self.device = buffer.device
        #: ``scale`` as a 1-element float32 device tensor: kernels read it on the device,
        #: so it can be passed to a captured launch (and changed between replays).
        self.scale_tensor = torch.full((1,), self.scale, dtype=torch.float32,
                                       device=self.device)

    # -- geometry: row_dim, num_slots, padding_slot from _PagedGeometry ----------------
    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def kv_scale(self) -> float:
        """The scale the kernels multiply stored values by (1.0 unless fp8)."""
        return self.scale

    def set_scale(self, scale: float) -> None:
        """Change this layer's FP8 scale (host float and device tensor, in place).

        For engines that learn a layer's ``k_scale`` after allocating the pool
        (loading a checkpoint).  Rows already written were quantised with the
        old scale and now read back scaled by the new one: set it before the
        layer's first write.  The device tensor is updated in place, so graphs
        that captured it read the new value.
        """
        self.scale = _check_scale(scale, self.is_fp8, self.kv_dtype, f"layer {self.layer_id}",
                                  self.kv_format)
        self.scale_tensor.fill_(self.scale)

    # -- writes and reads ------------------------------------------------------------
    def write(self, slots: torch.Tensor | Sequence[int], latent: torch.Tensor,
              rope: torch.Tensor) -> None:
        """Write new tokens' latent ``[N, 512]`` and rope ``[N, 64]`` rows at flat ``slots``.

        ``slots``: an int32 device tensor, or the list :meth:`MLAKVPool.slots`
        returns (copied to the device first, so eager code only).  Quantises for
        an fp8 pool (``value / scale``, clamped to the e4m3 range); packs for
        ``fp8_ds_mla`` rows (a scale per 128 latent values, on the device).  With a
        tensor it reads no host value, so it can run inside a captured graph;
        its temporaries then come from the graph's private memory pool.

        Raises
        ------
        UnsupportedError
            On wrong shapes, devices or a non-int32 ``slots`` tensor.
        """
        if not isinstance(slots, torch.Tensor):
            slots = torch.tensor(_whole_numbers(slots, "slots", minimum=0),
                                 dtype=torch.int32, device=self.device)
        n = latent.shape[0] if latent.dim() == 2 else -1
        problems = []
        if latent.dim() != 2 or latent.shape[1] != self.kv_lora_rank:
            problems.append(f"latent must be [N, {self.kv_lora_rank}], got "
                            f"{tuple(latent.shape)}")
        if rope.dim() != 2 or rope.shape != (n, self.rope_dim):
            problems.append(f"rope must be [N={n}, {self.rope_dim}], got {tuple(rope.shape)}")
        if slots.dtype != torch.int32 or slots.dim() != 1 or slots.shape[0] != n:
            problems.append(f"slots must be int32 [N={n}], got {slots.dtype} "
                            f"{tuple(slots.shape)}")
        for name, t in (("latent", latent), ("rope", rope), ("slots", slots)):
            if t.device != self.device:
                problems.append(f"{name} is on {t.device}, the pool on {self.device}")
        if problems:
            raise UnsupportedError("kv_pool", "KV write", problems,
                                   "pass latent [N, 512], rope [N, 64] and int32 slots "
                                   "[N] on the pool's device")
        if n == 0:
            return
        rows = torch.cat([latent, rope], dim=-1)
        if self.kv_format is not None:
            self._rows()[slots] = pack_fp8_ds_mla(rows, self.kv_lora_rank)
            return
        if self.is_fp8:
            # the device scale, not the host float: inside a captured graph a host value is
            # frozen at capture, and a later set_scale would leave the graph's writes
            # quantised with the old scale while every kernel reads the new one
            rows = _to_stored(rows, self.scale_tensor)
        self.buffer.view(self.num_slots, self.row_dim)[slots] = rows.to(self.buffer.dtype)

    def _rows(self) -> torch.Tensor:
        """The buffer as ``[num_slots, row]`` (a view; bytes for packed rows)."""
        return self.buffer.view(self.num_slots, -1)

    def read_slots(self, slots: torch.Tensor, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
        """Dequantised rows ``[N, 576]`` of the given flat slots (float32 by default).

        ``dtype`` picks the result's dtype (e.g. the activations' bf16, for an
        engine that decompresses prefix rows with its own projection).
        """
        if self.kv_format is not None:
            rows = unpack_fp8_ds_mla(self._rows()[slots.long()], self.kv_lora_rank)
        else:
            rows = self.buffer.view(self.num_slots, self.row_dim)[slots.long()].float()
            rows = rows * self.scale_tensor if self.is_fp8 else rows
        return rows if dtype == torch.float32 else rows.to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole layer as float32 ``[num_pages, page_size, 576]`` (a copy)."""
        if self.kv_format is not None:
            return unpack_fp8_ds_mla(self._rows(), self.kv_lora_rank).view(
                self.num_pages, self.page_size, self.row_dim)
        full = self.buffer.float()
        return full * self.scale_tensor if self.is_fp8 else full

    def fill(self, value: float) -> None:
        """Make every row hold ``value`` in each of its 576 positions as stored: the raw
        stored value for dense rows (for an fp8 pool it reads back as ``value * scale``),
        the packed row of ``value`` for ``fp8_ds_mla`` rows (finite when unpacked)."""
        if self.kv_format is None:
            self.buffer.fill_(value)
            return
        row = torch.full((1, self.row_dim), float(value), device=self.device)
        self._rows().copy_(pack_fp8_ds_mla(row, self.kv_lora_rank).expand(self.num_slots, -1))

    def quantize_roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What reading back ``x`` after a write gives (float32): for exact references."""
        if self.kv_format is not None:
            flat = x.reshape(-1, self.row_dim)
            return unpack_fp8_ds_mla(pack_fp8_ds_mla(flat, self.kv_lora_rank),
                                     self.kv_lora_rank).view(x.shape)
        if self.is_fp8:
            # the write's arithmetic on x's device, with the same float32 scale
            scale = self.scale_tensor.to(x.device)
            return _to_stored(x, scale).to(self.buffer.dtype).float() * scale
        return x.to(self.buffer.dtype).float()

    def __repr__(self) -> str:
        scale = f", scale={self.scale}" if self.is_fp8 else ""
        fmt = f", kv_format={self.kv_format}" if self.kv_format is not None else ""
        return (f"MLAKVLayer(layer_id={self.layer_id}, num_pages={self.num_pages}, "
                f"page_size={self.page_size}, kv_dtype={self.kv_dtype}{fmt}{scale})")


def _to_stored(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``rows / scale`` clamped to the e4m3 range: what an fp8 layer stores, before
    the cast (``scale`` a 1-element float32 tensor on ``rows``' device)."""
    return (rows.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)


def _whole_numbers(values: Sequence[int], what: str, *, minimum: int | None = None
                   ) -> list[int]:
    """``values`` as a list of Python ints, or ValueError naming the first bad one.

    Accepts ints and integer scalars (numpy, 0-d tensors via ``__index__``); refuses
    bools (``True`` is not page 1), floats (``3.7`` is not page 3) and strings, which
    ``int()`` would silently convert.  The common case (all plain ints) is one
    C-level pass.
    """
    out = list(values)
    if all(map(int.__instancecheck__, out)) and not any(
            map(bool.__instancecheck__, out)):
        ints = out
    else:
        ints = []
        for i, v in enumerate(out):
            if isinstance(v, bool) or not hasattr(type(v), "__index__"):
                raise ValueError(f"{what}[{i}] is {v!r} ({type(v).__name__}), not an integer: "
                                 f"pass whole numbers (nothing was changed)")
            ints.append(v.__index__())
    if minimum is not None and ints and min(ints) < minimum:
        i = next(j for j, v in enumerate(ints) if v < minimum)
        raise ValueError(f"{what}[{i}] is {ints[i]}, below {minimum}: a sequence cannot "
                         "hold a negative number of tokens (nothing was allocated)")
    return ints


def _scales(scale: float | Sequence[float], num_layers: int) -> list[float]:
    if isinstance(scale, (int, float)):
        return [float(scale)] * num_layers
    values = [float(s) for s in scale]
    if len(values) != num_layers:
        raise ValueError(f"scale lists {len(values)} values for {num_layers} layers; give one "
                         "per layer, or one float for all")
    return values


class MLAKVPool(_PagedGeometry):
    """A paged latent KV cache of ``num_layers`` layers, each ``[num_pages, page_size, 576]``.

    One page bookkeeping (free list) serves every layer: a sequence owns the
    same pages, hence the same slots, in all of them.

    Parameters
    ----------
    num_pages : int
        Pages in the pool, including the reserved padding page 0.
    page_size : int
        Tokens per page (1, 16, 32 or 64 for the built-in backends).
    num_layers : int
        Attention layers (default 1: a one-layer pool, whose :attr:`buffer` is
        its only buffer).
    kv_dtype : DType or str, optional
        ``bf16`` (the default), ``fp16``, ``fp32`` or ``fp8_e4m3``; with
        ``kv_format`` it may be left out (it is the format's).
    device : str or torch.device
    kv_lora_rank, rope_dim : int
        Widths of the latent and rope parts (512 and 64 for DeepSeek).
    scale : float or sequence of float
        Dequantisation scale of an fp8 pool: one float for every layer, or one
        per layer (ignored, and kept at 1.0, for 16/32-bit pools).
    buffers : sequence of Tensor, optional
        Existing per-layer buffers to use instead of allocating (see
        :meth:`wrap`).
    kv_format : SparseKVFormat or str, optional
        ``"fp8_ds_mla"``: every layer holds DeepSeek-V3.2's 656-byte rows
        (``uint8 [num_pages, page_size, 656]``; see the module docstring);
        None (default) or ``"bf16"``: dense 576-value rows.

    Examples
    --------
    >>> pool = MLAKVPool(num_pages=8, page_size=16, num_layers=2, kv_dtype="bf16")
    >>> pages = pool.allocate([20])            # 2 pages for a 20-token sequence
    >>> slots = pool.slots(pages[0], range(20))
    >>> pool.write(slots, torch.randn(20, 512), torch.randn(20, 64), layer_id=1)
    >>> pool.layer(1).buffer.shape
    torch.Size([8, 16, 576])
    >>> pool.free(pages[0])
    """

    def __init__(self, num_pages: int, page_size: int, *, num_layers: int = 1,
                 kv_dtype: DType | str | None = None, device: str | torch.device = "cpu",
                 kv_lora_rank: int = 512, rope_dim: int = 64,
                 scale: float | Sequence[float] = 1.0,
                 buffers: Sequence[torch.Tensor] | None = None,
                 kv_format: SparseKVFormat | str | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {PADDING_PAGE} is reserved for "
                             f"padding), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.kv_dtype, self.kv_format = _parse_format(kv_format, kv_dtype, int(kv_lora_rank))
        self.is_fp8 = self.kv_dtype is DType.FP8_E4M3 and self.kv_format is None
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.num_layers = int(num_layers)
        self.kv_lora_rank = int(kv_lora_rank)
        self.rope_dim = int(rope_dim)
        self.device = resolve_device(device)
        scales = _scales(scale, self.num_layers)
        shape = (self.num_pages, self.page_size, self._row_width)
        if buffers is None:
            tensors = [torch.zeros(shape, dtype=self._storage_dtype, device=self.device)
                       for _ in range(self.num_layers)]
        else:
            tensors = self._adopt(buffers, shape)
        #: The per-layer views (buffer, scale, reads and writes), in layer order.
        self.layers: tuple[MLAKVLayer, ...] = tuple(
            MLAKVLayer(i, t, s, self.kv_dtype, self.kv_lora_rank, self.rope_dim, self.kv_format)
            for i, (t, s) in enumerate(zip(tensors, scales)))
        # Free pages as a stack (the next page handed out is at the end, so a fresh pool
        # hands out 1, 2, 3, ...) and one flag byte per page: allocate and free are O(1)
        # per page, and a double free or a foreign page is found without a search.
        self._free_pages = list(range(self.num_pages - 1, PADDING_PAGE, -1))
        self._is_free = bytearray(self.num_pages)
        self._is_free[PADDING_PAGE + 1:] = b"\x01" * (self.num_pages - 1 - PADDING_PAGE)

    @property
    def _storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.kv_format is not None else torch_dtype(self.kv_dtype)

    @property
    def _row_width(self) -> int:
        """Elements of one row in the buffer (576 values, or 656 bytes)."""
        return self.row_bytes if self.kv_format is not None else self.row_dim

    def _adopt(self, buffers: Sequence[torch.Tensor], shape: tuple[int, int, int]
               ) -> list[torch.Tensor]:
        """Views ``[num_pages, page_size, row]`` of the caller's buffers (no copy)."""
        tensors = list(buffers)
        if len(tensors) != self.num_layers:
            raise ValueError(f"{len(tensors)} buffers for num_layers={self.num_layers}: give "
                             "one per layer")
        want = self._storage_dtype
        out = []
        for i, t in enumerate(tensors):
            if self.is_fp8 and t.dtype == torch.uint8:
                t = t.view(want)  # engines keep fp8 pools as uint8 storage (index_put)
            problems = []
            if t.dtype != want:
                held = f"kv_format {self.kv_format}" if self.kv_format is not None else \
                    f"kv_dtype {self.kv_dtype}"
                problems.append(f"dtype {t.dtype}, the pool's {held} is {want}")
            if resolve_device(t.device) != self.device:
                problems.append(f"on {t.device}, the pool on {self.device}")
            if t.numel() != math.prod(shape):
                problems.append(f"{t.numel()} elements, {math.prod(shape)} expected for "
                                f"{shape[0]} pages of {shape[1]} tokens x {shape[2]}")
            elif not t.is_contiguous():
                problems.append("not contiguous (the pool views it without a copy)")
            if problems:
                raise ValueError(f"buffer of layer {i}: " + "; ".join(problems))
            out.append(t.view(shape))
        return out

    @classmethod
    def wrap(cls, buffers: Sequence[torch.Tensor], page_size: int, *,
             kv_dtype: DType | str | None = None, scale: float | Sequence[float] = 1.0,
             kv_lora_rank: int = 512, rope_dim: int = 64,
             kv_format: SparseKVFormat | str | None = None) -> MLAKVPool:
        """A pool over an engine's existing per-layer buffers, without copying them.

        Each buffer holds ``num_slots x (kv_lora_rank + rope_dim)`` values in
        any contiguous shape (sglang's ``MLATokenToKVPool.kv_buffer[layer]`` is
        ``[num_slots, 1, 576]``); ``num_slots`` must be a multiple of
        ``page_size``, and slots ``0 .. page_size - 1`` (page 0) are the
        padding page (sglang reserves slot 0 for padding at page size 1).  An
        fp8 pool may be given as ``uint8`` storage.  The engine's own allocator
        owns the pages: this pool's :meth:`allocate` / :meth:`free` need not be
        used.

        Parameters
        ----------
        buffers
            One tensor per layer, all of one dtype and device.
        page_size
            Tokens per page of the engine's page table.
        kv_dtype
            Default: from the buffers' dtype (``uint8`` must say ``fp8_e4m3``).
        scale
            The layers' FP8 scales (one float for all, or one per layer).
        kv_format
            ``"fp8_ds_mla"``: the buffers hold 656-byte rows (``uint8``), e.g.
            vLLM's ``fp8_ds_mla`` cache.
        """
        tensors = list(buffers)
        if not tensors:
            raise ValueError("wrap() needs one buffer per layer, got none")
        first = tensors[0]
        fmt = _parse_format(kv_format, kv_dtype, kv_lora_rank)[1]
        if fmt is not None:
            row = fp8_ds_mla_row_bytes(kv_lora_rank, rope_dim)
            slots, rest = divmod(first.numel() * first.element_size(), row)
            if rest or slots % page_size:
                raise ValueError(f"a buffer of {first.numel() * first.element_size()} bytes "
                                 f"is not a whole number of pages of {page_size} {fmt} rows "
                                 f"of {row} bytes")
            return cls(slots // page_size, page_size, num_layers=len(tensors),
                       device=first.device, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                       scale=scale, buffers=[t.view(torch.uint8) for t in tensors],
                       kv_format=fmt)
        if kv_dtype is None:
            found = dtype_from_torch(first.dtype)
            if found is None:
                raise ValueError(f"cannot tell the KV dtype of a {first.dtype} buffer; pass "
                                 "kv_dtype= (e.g. 'fp8_e4m3' for uint8 storage)")
            kv_dtype = found
        row = kv_lora_rank + rope_dim
        slots, rest = divmod(first.numel(), row)
        if rest or slots % page_size:
            raise ValueError(f"a buffer of {first.numel()} elements is not a whole number of "
                             f"pages of {page_size} rows of {row}")
        return cls(slots // page_size, page_size, num_layers=len(tensors), kv_dtype=kv_dtype,
                   device=first.device, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                   scale=scale, buffers=tensors)

    @classmethod
    def from_config(cls, config: MLAConfig, num_pages: int, *, num_layers: int = 1,
                    scale: float | Sequence[float] = 1.0,
                    kv_format: SparseKVFormat | str | None = None) -> MLAKVPool:
        """A pool shaped for an :class:`~attnreg.runtime.MLAConfig` (``kv_format``: its
        rows' format, e.g. ``"fp8_ds_mla"`` for an fp8 config; None: dense rows)."""
        return cls(num_pages, config.page_size, num_layers=num_layers,
                   kv_dtype=config.kv_dtype, device=config.device,
                   kv_lora_rank=config.kv_lora_rank,
                   rope_dim=config.qk_rope_head_dim, scale=scale, kv_format=kv_format)

    # -- layers ----------------------------------------------------------------------
    def layer(self, layer_id: int) -> MLAKVLayer:
        """The view of layer ``layer_id`` (what a forward with that ``layer_id`` reads).

        Raises
        ------
        IndexError
            When ``layer_id`` is not in ``0 .. num_layers - 1``.
        """
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer_id {layer_id!r} is not a layer of this pool (0.."
                             f"{self.num_layers - 1}); build the pool with num_layers= "
                             "covering every attention layer")
        return self.layers[layer_id]

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every layer's buffer, in layer order."""
        return tuple(layer.buffer for layer in self.layers)

    @property
    def scales(self) -> tuple[float, ...]:
        """Every layer's FP8 scale (all 1.0 for 16/32-bit pools)."""
        return tuple(layer.scale for layer in self.layers)

    @property
    def buffer(self) -> torch.Tensor:
        """Layer 0's buffer: the only one of a one-layer pool."""
        return self.layers[0].buffer

    @property
    def scale(self) -> float:
        """Layer 0's scale (see :attr:`scales` for every layer)."""
        return self.layers[0].scale

    @property
    def scale_tensor(self) -> torch.Tensor:
        """Layer 0's scale as a device tensor (see :meth:`layer`)."""
        return self.layers[0].scale_tensor

    @property
    def kv_scale(self) -> float:
        """Layer 0's dequantisation scale (1.0 unless fp8)."""
        return self.layers[0].scale

    # -- geometry: row_dim, num_slots, padding_slot from _PagedGeometry --------------
    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].buffer.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's buffer."""
        return sum(layer.buffer.nbytes for layer in self.layers)

    def pages_needed(self, seq_len: int) -> int:
        return -(-int(seq_len) // self.page_size)

    # -- page bookkeeping ------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages :meth:`allocate` can still hand out."""
        return len(self._free_pages)

    def allocate(self, seq_lens: Sequence[int], *, shuffle: bool | int = False
                 ) -> list[list[int]]:
        """Take pages for sequences of the given lengths from the free list (O(1) per page).

        The pages hold the sequence in every layer.

        Parameters
        ----------
        seq_lens
            Tokens each sequence must hold (its whole length, prefix included).
        shuffle
            False: pages in free-list order (ascending on a fresh pool; pages freed
            last are handed out first).  True or an int seed: the free list is
            shuffled first (O(free pages)), so a kernel that assumes contiguous
            pages is caught.

        Raises
        ------
        ValueError
            When a length is negative or not an integer (a bool, a float, a string),
            or the pool has too few free pages; nothing is allocated then.
        """
        ps = self.page_size
        counts = [-(-n // ps) for n in _whole_numbers(seq_lens, "seq_lens", minimum=0)]
        need = sum(counts)
        free = self._free_pages
        if need > len(free):
            raise ValueError(f"pool has {len(free)} free pages, {need} needed for "
                             f"seq_lens {list(seq_lens)} at page size {self.page_size}; "
                             "make the pool bigger or free pages first")
        if shuffle is not False:
            rng = random.Random(None if shuffle is True else int(shuffle))
            rng.shuffle(free)
        # the last `need` entries, nearest the end first: a fresh pool gives 1, 2, 3, ...
        taken = free[len(free) - need:][::-1] if need else []
        del free[len(free) - need:]
        # per-page work in C (map over the flags), not in bytecode: an engine frees and
        # allocates pages every step
        deque(map(self._is_free.__setitem__, taken, repeat(0)), maxlen=0)
        starts = accumulate(counts, initial=0)
        return [taken[start:start + k] for start, k in zip(starts, counts)]

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the free list (O(1) per page).

        Raises
        ------
        ValueError
            When a page is not an integer (a bool, a float, a string), is not one
            :meth:`allocate` can hand out (out of range, or the reserved padding page),
            is already free, or is listed twice; nothing is freed then.
        """
        pages = _whole_numbers(pages, "pages")
        if not pages:
            return
        flags = self._is_free
        n = self.num_pages
        # the checks run in C (min / max / map / set); only an error walks the pages
        if (min(pages) <= PADDING_PAGE or max(pages) >= n
                or any(map(flags.__getitem__, pages)) or len(set(pages)) != len(pages)):
            self._raise_bad_free(pages)
        deque(map(flags.__setitem__, pages, repeat(1)), maxlen=0)
        self._free_pages.extend(reversed(pages))

    def _raise_bad_free(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for p in pages:
            if not PADDING_PAGE < p < self.num_pages:
                raise ValueError(f"page {p} is not an allocatable page of this pool (pages "
                                 f"{PADDING_PAGE + 1}..{self.num_pages - 1}; page "
                                 f"{PADDING_PAGE} is reserved for padding): free only pages "
                                 "allocate() returned")
            if self._is_free[p] or p in seen:
                raise ValueError(f"page {p} is already free (double free): free each page "
                                 "once, after allocate() returned it")
            seen.add(p)
        raise AssertionError("unreachable: free() found a problem _raise_bad_free did not")

    def slots(self, pages: Sequence[int], positions: Sequence[int] | range) -> list[int]:
        """Flat slot of each token position of a sequence that owns ``pages``.

        A list of ints, which :meth:`write` accepts as it is (or as an int32 tensor).
        """
        ps = self.page_size
        return [pages[t // ps] * ps + t % ps for t in positions]

    def page_table(self, pages_per_seq: Sequence[Sequence[int]], *,
                   width: int | None = None) -> torch.Tensor:
        """An int32 page table ``[B, width]`` on the pool's device.

        Rows are padded with the padding page; ``width`` defaults to the longest row.
        """
        width = max((len(p) for p in pages_per_seq), default=0) if width is None else width
        width = max(width, 1)
        # filled in C through an array (torch.tensor of nested lists converts element by
        # element: 180 us of a 64-sequence decode batch's build)
        flat = array.array("i")
        for pages in pages_per_seq:
            if len(pages) > width:
                raise ValueError(f"a sequence owns {len(pages)} pages, wider than {width}")
            flat.extend(pages)
            flat.extend(repeat(PADDING_PAGE, width - len(pages)))
        if not flat:
            return torch.empty((0, width), dtype=torch.int32, device=self.device)
        table = torch.frombuffer(flat, dtype=torch.int32).view(len(pages_per_seq), width)
        return table.to(self.device)

    # -- writes and reads (one layer; layer 0 by default) ------------------------------
    def write(self, slots: torch.Tensor | Sequence[int], latent: torch.Tensor,
              rope: torch.Tensor, *, layer_id: int = 0) -> None:
        """Write new tokens' rows into layer ``layer_id`` (see :meth:`MLAKVLayer.write`)."""
        self.layer(layer_id).write(slots, latent, rope)

    def read_slots(self, slots: torch.Tensor, *, layer_id: int = 0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised rows ``[N, 576]`` of layer ``layer_id`` (see :meth:`MLAKVLayer.read_slots`)."""
        return self.layer(layer_id).read_slots(slots, dtype)

    def dequantized(self, *, layer_id: int = 0) -> torch.Tensor:
        """Layer ``layer_id`` as float32 ``[num_pages, page_size, 576]`` (a copy)."""
        return self.layer(layer_id).dequantized()

    def quantize_roundtrip(self, x: torch.Tensor, *, layer_id: int = 0) -> torch.Tensor:
        """What reading back ``x`` from layer ``layer_id`` after a write gives (float32)."""
        return self.layer(layer_id).quantize_roundtrip(x)

    def __repr__(self) -> str:
        scale = f", scales={list(self.scales)}" if self.is_fp8 else ""
        layers = f", num_layers={self.num_layers}" if self.num_layers > 1 else ""
        fmt = f", kv_format={self.kv_format}" if self.kv_format is not None else ""
        return (f"MLAKVPool(num_pages={self.num_pages}, page_size={self.page_size}{layers}, "
                f"kv_dtype={self.kv_dtype}{fmt}, row_dim={self.row_dim}, "
                f"device={self.device}{scale})")
