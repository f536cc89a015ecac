"""What a forward must leave alone: every KV row it was not given, and its inputs.

Run around every forward of every claim (eager, warm-up, each replay):

* :class:`KVLedger` keeps a byte copy of every layer of a suite pool, plus the
  guard pages :func:`guarded_pool` puts before and after each layer.  After a
  step, every row outside the step's ``out_cache_loc`` slots (of the layers the
  step wrote) must be byte-identical to the copy, and the written slots must
  hold exactly the rows the harness handed over.  A refutation names the first
  changed slots and what owns them: sequence i's prefix, sequence j's new
  token (of this or an earlier batch), another layer, a free page, the padding
  page, beyond the pool's pages.  The comparison is one elementwise ``!=`` per
  region on the device; only a refutation walks slots on the host.
* The padding page (page 0) may change only in a replay of a batch smaller
  than its graph (the padding rows' dummy writes land there); docs/runtime.md
  ("The padding page") is the rule.
* :class:`InputGuard` keeps byte copies of a forward's inputs (q, the rows to
  write, K/V, every index tensor of the batch) and names each one that changed.
* :func:`nonfinite_problem` names a NaN/inf output where the oracle is finite,
  separately from the tolerance check.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnreg.registry import DType, SparseKVFormat
from attnreg.runtime import PADDING_PAGE, MLAKVPool, torch_dtype
from attnreg.runtime.kv_formats import pack_fp8_ds_mla

from .batches import BatchSpec

if TYPE_CHECKING:
    from .workload import Workload

__all__ = ["GUARD_PAGES", "InputGuard", "KVLedger", "guarded_pool", "kv_problems", "ledger_of",
           "nonfinite_problem"]

#: Pages of guard memory before and after each layer of a suite pool: a kernel that
#: indexes past the pool (a slot beyond ``num_slots``, a negative one) writes there.
GUARD_PAGES = 2


@dataclass
class _Backing:
    """The one allocation behind a guarded pool: ``[layers, G + pages + G, page, row]``."""

    storage: torch.Tensor
    guard: int


_BACKINGS: weakref.WeakKeyDictionary[MLAKVPool, _Backing] = weakref.WeakKeyDictionary()
_LEDGERS: weakref.WeakKeyDictionary[MLAKVPool, KVLedger] = weakref.WeakKeyDictionary()


def guarded_pool(num_pages: int, page_size: int, *, num_layers: int, kv_dtype: DType | str,
                 device: torch.device | str, kv_lora_rank: int, rope_dim: int,
                 scale: float | Sequence[float], fill: float = -3.0,
                 kv_format: SparseKVFormat | str | None = None) -> MLAKVPool:
    """An :class:`MLAKVPool` whose layers are views into one allocation with guard pages.

    Each layer is ``[num_pages, page_size, row]`` with :data:`GUARD_PAGES` pages of
    guard before and after it, so an out-of-bounds write of any layer lands in
    memory the :class:`KVLedger` watches instead of in an unrelated tensor.  Every
    row (guards included) starts as ``fill``: finite on purpose, since a kernel that
    loads a whole tile and masks the scores multiplies the masked values by a zero
    probability (harmless for a finite value, NaN for a NaN).  The pool's ledger
    (:func:`ledger_of`) is created with it.  ``kv_format="fp8_ds_mla"``: the layers
    hold 656-byte rows (``kv_dtype`` must be fp8_e4m3, ``scale`` 1.0), every row the
    packed row of ``fill``.
    """
    g = GUARD_PAGES
    fmt = None if kv_format is None or SparseKVFormat(kv_format) is SparseKVFormat.BF16 \
        else SparseKVFormat(kv_format)
    if fmt is None:
        storage = torch.full((num_layers, g + num_pages + g, page_size,
                              kv_lora_rank + rope_dim),
                             fill, dtype=torch_dtype(kv_dtype), device=device)
    else:
        row = pack_fp8_ds_mla(torch.full((1, kv_lora_rank + rope_dim), float(fill)),
                              kv_lora_rank)
        storage = row.to(device).expand(num_layers * (g + num_pages + g) * page_size, -1) \
            .reshape(num_layers, g + num_pages + g, page_size, -1).contiguous()
    views = [storage[i, g:g + num_pages] for i in range(num_layers)]
    pool = MLAKVPool(num_pages, page_size, num_layers=num_layers, kv_dtype=kv_dtype,
                     device=device, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                     scale=scale, buffers=views, kv_format=fmt)
    _BACKINGS[pool] = _Backing(storage, g)
    _LEDGERS[pool] = KVLedger(pool)
    return pool


def ledger_of(pool: MLAKVPool) -> KVLedger | None:
    """The ledger of a pool made by :func:`guarded_pool` (None for any other pool)."""
    return _LEDGERS.get(pool)


def kv_problems(pool: MLAKVPool, step: Sequence[Workload], when: str, *,
                padding: bool = False) -> list[str]:
    """:meth:`KVLedger.check` of ``pool``'s ledger after ``step`` (see there).

    ``when`` prefixes every message ("replay 2", "eager"); ``padding``: the step
    was a replay of a batch smaller than its graph.
    """
    ledger = _LEDGERS.get(pool)
    if ledger is None:
        raise RuntimeError("kv_problems() needs a pool made by guarded_pool() (make_pool)")
    return ledger.check(step, when, padding=padding)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[slots, row bytes]`` uint8 (a view)."""
    return t.reshape(-1, t.shape[-1]).view(torch.uint8)


class KVLedger:
    """A byte copy of a suite pool, and who owns each of its slots.

    ``own(work)`` registers the slots a workload's sequences own (its prefix
    rows, written by the harness, and its new tokens); :meth:`snapshot` takes
    the copy; :meth:`check` after a step lists what changed that the step did
    not own, then takes the copy again (the next step is checked against the
    pool as this one left it).
    """

    def __init__(self, pool: MLAKVPool) -> None:
        self.pool = pool
        backing = _BACKINGS.get(pool)
        if backing is not None:
            self._regions = [_bytes(backing.storage)]
            self._guard = backing.guard
        else:  # a pool built elsewhere: its layers only, no guard memory
            self._regions = [_bytes(layer.buffer) for layer in pool.layers]
            self._guard = 0
        self._saved: list[torch.Tensor] = []
        self._works: list[Workload] = []  # newest last
        self.snapshot()

    # -- bookkeeping -----------------------------------------------------------------
    def own(self, works: Iterable[Workload]) -> None:
        """Register the sequences of ``works`` (Workloads) as owners of their slots."""
        self._works.extend(works)

    def snapshot(self) -> None:
        """Take the byte copy the next :meth:`check` compares with."""
        if self._saved:
            for saved, region in zip(self._saved, self._regions):
                saved.copy_(region)
        else:
            self._saved = [r.clone() for r in self._regions]

    # -- the check -------------------------------------------------------------------
    def check(self, step: Sequence[Workload], when: str, *, padding: bool = False) -> list[str]:
        """Problems after ``step`` (the Workloads of one forward or of one replayed step).

        Allowed to change: the ``out_cache_loc`` slots of each workload's layer, and
        with ``padding`` (a replay of a batch smaller than its graph) the padding
        page of those layers.  Everything else (every other slot of every layer, the
        guard pages) must be byte-identical; the written slots must hold exactly the
        workload's ``new_rows``.
        """
        pool = self.pool
        problems: list[str] = []
        for work in step:
            problem = self._written_rows_problem(work, when)
            if problem:
                problems.append(problem)
        changed = self._changed_rows()  # [layers, G + slots + G] bool, on the device
        layers_written = sorted({w.layer_id for w in step})
        g = self._guard * pool.page_size
        for w in step:
            idx = w.batch.out_cache_loc.to(device=changed.device, dtype=torch.long)
            changed[w.layer_id, g + idx] = False
        if padding:
            for layer in layers_written:
                changed[layer, g:g + (PADDING_PAGE + 1) * pool.page_size] = False
        if bool(changed.any()):
            problems.append(self._describe(changed, step, when, layers_written))
        self.snapshot()
        return problems

    def _changed_rows(self) -> torch.Tensor:
        pool = self.pool
        rows = [(cur != saved).any(dim=1) for cur, saved in zip(self._regions, self._saved)]
        per_layer = 2 * self._guard * pool.page_size + pool.num_slots
        return torch.cat(rows).view(pool.num_layers, per_layer)

    def _written_rows_problem(self, work: Workload, when: str) -> str | None:
        pool = self.pool
        layer_id = work.layer_id
        slots = work.batch.out_cache_loc.to(device=pool.device)
        held = pool.read_slots(slots, layer_id=layer_id).cpu()
        want = work.new_rows
        if held.shape != want.shape or torch.equal(held, want):
            return None
        bad = (held != want).any(dim=1)
        first = int(torch.nonzero(bad)[0])
        where = f" of layer {layer_id}" if pool.num_layers > 1 else ""
        return (f"{when}: {work.spec.name}: {int(bad.sum())}/{held.shape[0]} new tokens were "
                f"not written to their out_cache_loc slots{where} as given (latent_new/"
                f"rope_new); first: slot {int(slots[first])}, "
                f"{self.owner(int(slots[first]), layer_id, [work], [layer_id])}")

    def _describe(self, changed: torch.Tensor, step: Sequence[Workload], when: str,
                  layers_written: list[int]) -> str:
        pool = self.pool
        g = self._guard * pool.page_size
        hits = torch.nonzero(changed)  # only on a refutation: a host walk of a few slots
        total = hits.shape[0]
        named = []
        for layer, pos in hits[:4].tolist():
            slot = pos - g
            at = f" of layer {layer}" if pool.num_layers > 1 else ""
            named.append(f"slot {slot}{at} ({self.owner(slot, layer, step, layers_written)})")
        more = f" and {total - 4} more" if total > 4 else ""
        wrote = ", ".join(f"layer {w}" for w in layers_written)
        return (f"{when}: {total} KV rows the step did not own changed: {'; '.join(named)}"
                f"{more}; a forward may write only its batch's out_cache_loc slots "
                f"({wrote}): a forward that writes "
                "KV it does not own corrupts other requests silently")

    def owner(self, slot: int, layer: int, step: Sequence[Workload] = (),
              step_layers: Sequence[int] = ()) -> str:
        """Who owns ``slot`` of ``layer``, in words (for a refutation message).

        ``step``: the workloads of the step being checked (their tokens are "this
        batch's", the others' are cached from an earlier one); ``step_layers``: the
        layers the step wrote (any other is "another layer").
        """
        pool = self.pool
        ps = pool.page_size
        other = (f"another layer (the forward wrote layer "
                 f"{', '.join(map(str, step_layers))}): "
                 if step_layers and layer not in step_layers else "")
        if slot < 0:
            return (f"{other}beyond the pool's pages: {-slot} slots before the first page "
                    f"of layer {layer}")
        if slot >= pool.num_slots:
            return (f"{other}beyond the pool's pages: {slot - pool.num_slots + 1} slots past "
                    f"the last page of layer {layer} ({pool.num_pages} pages of {ps})")
        page, row = divmod(slot, ps)
        if page == PADDING_PAGE:
            return (f"{other}the padding page (page {PADDING_PAGE}), which only the padding "
                    "rows of a replay smaller than its graph may write")
        # the step's own workloads first, then the newest of that layer, then any (the
        # layers of one step share their pages)
        candidates = [*step, *(w for w in reversed(self._works) if w.layer_id == layer),
                      *reversed(self._works)]
        for work in candidates:
            for i, (owned, (prefix, extend)) in enumerate(zip(work.pages, work.spec.seqs)):
                if page not in owned:
                    continue
                pos = owned.index(page) * ps + row
                name = work.spec.name
                if pos < prefix:
                    what = f"sequence {i}'s prefix token {pos} of {name}"
                elif pos < prefix + extend:
                    what = f"sequence {i}'s new token {pos - prefix} (position {pos}) of {name}"
                else:
                    what = (f"sequence {i} of {name}'s last page, row {row}, past its "
                            f"{prefix + extend} tokens")
                mine = any(work is w for w in step)
                return other + what + ("" if mine else " (cached by an earlier batch)")
        return f"{other}a free page (page {page}, owned by no sequence)"


def _tensors(obj: object, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor field of a dataclass (one nested level)."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            yield f"{prefix}{f.name}", value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            # the batch's BatchIndices are named as the batch's own fields (batch.seq_lens),
            # the names engines and backends read them by
            inner = prefix if f.name == "indices" else f"{prefix}{f.name}."
            yield from _tensors(value, inner)


class InputGuard:
    """Byte copies of a forward's inputs; :meth:`problems` names each one that changed.

    Covers q, latent_new / rope_new (the rows to write), k / v, and every tensor
    of the batch (page table, sequence lengths, positions, indptrs, out_cache_loc),
    of each workload given.  ``extra`` adds named tensors (a graph's static q).
    """

    def __init__(self, works: Sequence[Workload],
                 extra: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        named: list[tuple[str, torch.Tensor]] = []
        for work in works:
            at = f" (layer {work.layer_id})" if len(works) > 1 else ""
            for name in ("q", "latent_new", "rope_new", "k", "v"):
                t = getattr(work, name)
                if isinstance(t, torch.Tensor):
                    named.append((name + at, t))
            named += [(f"batch.{n}{at}", t) for n, t in _tensors(work.batch, "")]
        named += list(extra)
        seen: set[int] = set()
        self._saved: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, t in named:
            if id(t) in seen:  # a batch shared by every layer's workload
                continue
            seen.add(id(t))
            self._saved.append((name, t, t.detach().clone()))

    def problems(self, when: str) -> list[str]:
        """One message naming every input whose bytes changed since construction."""
        changed = []
        for name, t, saved in self._saved:
            if t.shape != saved.shape or t.dtype != saved.dtype:
                changed.append(f"{name} (now {t.dtype} {tuple(t.shape)}, was {saved.dtype} "
                               f"{tuple(saved.shape)})")
                continue
            a, b = t.detach().contiguous(), saved
            if a.element_size() and not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum()
                changed.append(f"{name} ({int(diff)} of {a.numel() * a.element_size()} bytes)")
        if not changed:
            return []
        return [f"{when}: the forward changed its inputs: {', '.join(changed)}; a backend "
                "must not write into q, the rows to write, K/V or the batch's index tensors "
                "(the engine reuses them: the next layer reads the same q buffer and "
                "the scheduler the same lengths)"]


def nonfinite_problem(out: torch.Tensor, expected: torch.Tensor, spec: BatchSpec,
                      when: str = "") -> str | None:
    """Why ``out`` has NaN/inf where the oracle is finite (None if it has not).

    Names the kind (NaN, +inf, -inf), how many, the batch size and the first
    sequence and token, apart from the tolerance (a NaN is no large error).
    """
    got = out.detach().float().cpu()
    if tuple(got.shape) != tuple(expected.shape):
        return None  # compare() names the shape
    bad = ~torch.isfinite(got) & torch.isfinite(expected)
    if not bool(bad.any()):
        return None
    rows = bad.flatten(1).any(dim=1)
    first = int(torch.nonzero(rows)[0])
    value = float(got[first][bad[first]].flatten()[0])
    kind = "NaN" if value != value else ("+inf" if value > 0 else "-inf")
    seqs, start = [], 0
    for i, (_, extend) in enumerate(spec.seqs):
        if bool(rows[start:start + extend].any()):
            seqs.append(i)
        start += extend
    seq, tok = _locate(first, spec)
    at = f"{when}: " if when else ""
    return (f"{at}{spec.describe()}: {kind} in the output where the oracle is finite: "
            f"{int(bad.sum())} values in {int(rows.sum())} of {rows.numel()} rows, at batch "
            f"size {spec.batch_size}, sequences {seqs[:8]}{'...' if len(seqs) > 8 else ''} "
            f"(first: sequence {seq}, new token {tok})")


def _locate(row: int, spec: BatchSpec) -> tuple[int, int]:
    start = 0
    for i, (_, extend) in enumerate(spec.seqs):
        if row < start + extend:
            return i, row - start
        start += extend
    return len(spec.seqs) - 1, 0
