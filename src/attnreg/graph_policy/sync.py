"""sync(): every data-parallel rank agrees on one replay decision, bucket and forward mode.

Each rank describes its batch with :meth:`ReplayGate.facts
<attnreg.graph_policy.ReplayGate.facts>` (eligible, forward mode, batch size,
tokens, padded bucket, longest sequence).  :func:`sync` exchanges those facts
in **one** ``all_gather`` of a small int tensor and returns the same
:class:`Agreed` on every rank:

* ``replay`` only if every busy rank is eligible;
* ``bucket``: the largest of the ranks' buckets (each rank pads to it, so all
  ranks replay the same graph; buckets grow with the batch, so this is the
  bucket of the largest batch);
* ``forward_mode``: the busy ranks' common forward mode.  Ranks that run
  different forward modes in one step (a decode rank beside a verify rank)
  are a scheduling error: every rank raises :class:`SyncError` naming the
  ranks, after the one collective, so none is left waiting in another.

A rank with no requests (``batch_size == 0``) is idle: it follows the busy
ranks (pads to their bucket, runs their forward mode) and changes nothing.

An engine that already gathers per-rank metadata each step (sglang's
``MLPSyncBatchInfo``, vLLM's ``coordinate_batch_across_dp``) appends
:func:`pack` to its own tensor and calls :func:`unpack` on the gathered rows
instead.  torch is imported only inside :func:`sync`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..registry.capabilities import ForwardMode
from ..registry.errors import AttnregError

if TYPE_CHECKING:
    from .replay import ReplayReason

__all__ = ["PACK_VERSION", "PACKED_WIDTH", "Agreed", "BatchFacts", "SyncError", "pack", "sync",
           "unpack"]

#: Format of a packed row; a rank running another attnreg packs another version.
PACK_VERSION = 1
#: Ints per packed row: version, eligible, forward mode, batch size, tokens, bucket,
#: longest sequence.
PACKED_WIDTH = 7
#: Forward modes as packed ints (stable: part of the exchange format).
_MODE_CODES: dict[ForwardMode, int] = {ForwardMode.DECODE: 0, ForwardMode.EXTEND: 1,
                                       ForwardMode.TARGET_VERIFY: 2, ForwardMode.DRAFT_EXTEND: 3}
_CODE_MODES = {code: mode for mode, code in _MODE_CODES.items()}
_UNKNOWN = -1


class SyncError(AttnregError, RuntimeError):
    """The ranks' facts cannot be agreed on (different forward modes, another format)."""


@dataclass(frozen=True)
class BatchFacts:
    """One rank's facts about its next batch (build with ``ReplayGate.facts``).

    ``num_tokens``, ``bucket`` and ``max_seq_len`` are None when unknown
    (``bucket`` is None for an ineligible batch).  ``reason`` stays local: it
    is not exchanged.
    """

    eligible: bool
    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int | None = None
    bucket: int | None = None
    max_seq_len: int | None = None
    reason: ReplayReason | None = None

    @property
    def idle(self) -> bool:
        return self.batch_size == 0


@dataclass(frozen=True)
class Agreed:
    """What every rank runs this step; identical on every rank.

    ``replay``: replay the captured graph (else every rank runs eagerly);
    ``bucket``: the graph every rank pads to (None when not replaying; the
    unit of ``ReplayGate.bucket_for``); ``forward_mode``: the step's forward
    mode; ``num_tokens``: each rank's tokens (-1 unknown), as DP attention
    needs them for its gathers; ``max_seq_len``: the longest sequence on any
    rank (-1 unknown); ``ineligible_ranks``: the busy ranks that could not
    replay.
    """

    replay: bool
    bucket: int | None
    forward_mode: ForwardMode
    num_tokens: tuple[int, ...]
    max_seq_len: int
    ineligible_ranks: tuple[int, ...]


def pack(facts: BatchFacts) -> tuple[int, ...]:
    """This rank's facts as :data:`PACKED_WIDTH` ints (append them to your own gather)."""
    def opt(value: int | None) -> int:
        return _UNKNOWN if value is None else int(value)

    return (PACK_VERSION, 1 if facts.eligible else 0, _MODE_CODES[facts.forward_mode],
            int(facts.batch_size), opt(facts.num_tokens),
            opt(facts.bucket if facts.eligible else None), opt(facts.max_seq_len))


def _row(rank: int, row: Sequence[Any]) -> tuple[int, ...]:
    values = tuple(int(v) for v in row)
    if len(values) != PACKED_WIDTH:
        raise SyncError(f"rank {rank} sent {len(values)} ints, expected {PACKED_WIDTH} (pack() "
                        "output); all ranks must run the same attnreg version")
    if values[0] != PACK_VERSION:
        raise SyncError(f"rank {rank} packed format {values[0]}, this rank reads "
                        f"{PACK_VERSION}: all ranks must run the same attnreg version")
    if values[2] not in _CODE_MODES:
        raise SyncError(f"rank {rank} sent an unknown forward mode code {values[2]}")
    return values


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def unpack(rows: Sequence[Sequence[Any]]) -> Agreed:
    """The agreed answer from every rank's packed row, in rank order.

    Pure and deterministic: every rank that unpacks the same gathered rows
    gets the same :class:`Agreed`, or the same :class:`SyncError`.
    """
    if not rows:
        raise SyncError("no ranks to agree: unpack() needs one packed row per rank")
    parsed = [_row(rank, row) for rank, row in enumerate(rows)]
    busy = [rank for rank, row in enumerate(parsed) if row[3] > 0]
    modes: dict[ForwardMode, list[int]] = {}
    for rank in busy:
        modes.setdefault(_CODE_MODES[parsed[rank][2]], []).append(rank)
    if len(modes) > 1:
        listed = "; ".join(f"{mode} on {_ranks(ranks)}" for mode, ranks in modes.items())
        raise SyncError(f"data-parallel ranks disagree on the forward mode of this step: "
                        f"{listed}. Every busy rank must run the same kind of batch in one "
                        "step (schedule them together, or make the others idle)")
    forward_mode = next(iter(modes)) if modes else _CODE_MODES[parsed[0][2]]
    ineligible = tuple(rank for rank in busy if parsed[rank][1] != 1)
    buckets = [parsed[rank][5] for rank in busy]
    replay = bool(busy) and not ineligible and all(b != _UNKNOWN for b in buckets)
    return Agreed(
        replay=replay,
        bucket=max(buckets) if replay else None,
        forward_mode=forward_mode,
        num_tokens=tuple(row[4] for row in parsed),
        max_seq_len=max(row[6] for row in parsed),
        ineligible_ranks=ineligible,
    )


def sync(local: BatchFacts, group: Any = None) -> Agreed:
    """Exchange every rank's facts in one ``all_gather`` and return the agreed answer.

    Parameters
    ----------
    local
        this rank's facts (``ReplayGate.facts(batch)``).
    group
        a ``torch.distributed`` process group (None = the default group).  The
        tensor lives where the group's backend communicates: CPU for gloo, the
        current CUDA device for NCCL.

    Returns
    -------
    Agreed
        the same on every rank.  Without an initialised process group (one
        process), this rank's own facts decide, and torch is not imported if
        nothing imported it.

    Raises
    ------
    SyncError
        on every rank, after the collective, when busy ranks run different
        forward modes (or another attnreg's format).
    """
    row = pack(local)
    if "torch.distributed" not in sys.modules:
        return unpack([row])  # nobody can have initialised a process group
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return unpack([row])
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    # Every rank unpacks the same rows: the same answer, or the same error on all.
    return unpack([r.tolist() for r in rows])
