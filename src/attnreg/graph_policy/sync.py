"""sync(): every data-parallel rank agrees on one replay decision, bucket and forward mode.

Each rank describes its batch with :meth:`ReplayGate.facts
<attnreg.graph_policy.ReplayGate.facts>` (eligible, forward mode, batch size,
tokens, padded bucket, longest sequence, and the fingerprint of the plan the
rank's graphs were captured from).  :func:`sync` exchanges those facts in
**one** ``all_gather`` of a small int tensor and returns the same
:class:`Agreed` on every rank:

* every rank must carry the same plan fingerprint
  (:class:`~attnreg.graph_policy.PlanFingerprint`: modes, buckets per forward
  mode, backends, cost profile, pack version); otherwise every rank raises
  :class:`SyncError` naming the fingerprints (and, from :func:`sync`, the
  fields that differ), since "replay bucket 4" means nothing to a rank that
  never captured a bucket of 4;
* ``replay`` only if every busy rank is eligible;
* ``bucket``: the largest of the ranks' buckets (each rank pads to it, so all
  ranks replay the same graph; buckets grow with the batch, so this is the
  bucket of the largest batch);
* ``forward_mode``: the busy ranks' common forward mode.  Ranks that run
  different forward modes in one step (a decode rank beside a verify rank)
  are a scheduling error: every rank raises :class:`SyncError` naming the
  ranks, after the one collective, so none is left waiting in another.

A rank with no requests (``batch_size == 0``) is idle, and it still calls
:func:`sync`.  What it votes follows sglang's two graph runners: in a
decode-phase step (DECODE, TARGET_VERIFY, DRAFT_EXTEND) it follows the busy
ranks (pads to their bucket and replays their graph, as sglang's decode
runner replays an IDLE batch); in a prefill step (EXTEND) one idle rank
beside a busy one makes every rank run eagerly, as sglang's prefill runner
does (``_has_inactive_dp_rank``: its collectives need every rank on the
same path).  :attr:`Agreed.idle_ranks` lists them.

:func:`sync` waits at most ``timeout`` seconds (:data:`DEFAULT_SYNC_TIMEOUT_S`)
for the other ranks; a rank that never calls it makes every rank that did
raise :class:`SyncError` naming the timeout, and, on a gloo group, the
missing ranks (rank 0 of the group learns them from gloo's
``monitored_barrier``).  After that error the process group is not usable:
the engine should stop.

An engine that already gathers per-rank metadata each step (sglang's
``MLPSyncBatchInfo``, vLLM's ``coordinate_batch_across_dp``) appends
:func:`pack` to its own tensor and calls :func:`unpack` on the gathered rows
instead (its own exchange then owns the timeout).  torch is imported only
inside :func:`sync`.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..registry.capabilities import ForwardMode
from ..registry.errors import AttnregError

if TYPE_CHECKING:
    from .fingerprint import PlanFingerprint
    from .replay import ReplayReason

__all__ = ["DEFAULT_SYNC_TIMEOUT_S", "PACK_VERSION", "PACKED_WIDTH", "Agreed", "BatchFacts",
           "SyncError", "pack", "sync", "unpack"]

#: Format of a packed row; a rank running another attnreg packs another version.
#: 2: the plan fingerprint after the version.
PACK_VERSION = 2
#: Ints per packed row: version, plan fingerprint, eligible, forward mode, batch size,
#: tokens, bucket, longest sequence.
PACKED_WIDTH = 8
#: Seconds :func:`sync` waits for every rank by default (docs/policy.md says why 60).
DEFAULT_SYNC_TIMEOUT_S = 60.0
#: Forward modes as packed ints (stable: part of the exchange format).
_MODE_CODES: dict[ForwardMode, int] = {ForwardMode.DECODE: 0, ForwardMode.EXTEND: 1,
                                       ForwardMode.TARGET_VERIFY: 2, ForwardMode.DRAFT_EXTEND: 3}
_CODE_MODES = {code: mode for mode, code in _MODE_CODES.items()}
_UNKNOWN = -1
#: The packed fingerprint of facts that carry none (built by hand, not by a gate).
_NO_FINGERPRINT = 0
# column of each fact in a packed row
_VERSION, _FP, _ELIGIBLE, _MODE, _SIZE, _TOKENS, _BUCKET, _LONGEST = range(PACKED_WIDTH)


class SyncError(AttnregError, RuntimeError):
    """The ranks' facts cannot be agreed on, or not every rank took part in time.

    Raised on every rank that took part: plans with different fingerprints,
    different forward modes, another attnreg's row format, or (from
    :func:`sync`) a rank that did not call it within the timeout.

    Attributes
    ----------
    fingerprints
        per rank, the plan fingerprint it sent (``"none"``: facts without
        one), when the fingerprints differ; else empty.
    missing_ranks
        the ranks that did not reach :func:`sync` in time, where the process
        group can tell (gloo, on the group's rank 0); else None.
    timeout_s
        the timeout that ran out; None for other errors.
    """

    def __init__(self, message: str, *, fingerprints: Sequence[str] = (),
                 missing_ranks: Sequence[int] | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.fingerprints = tuple(fingerprints)
        self.missing_ranks = None if missing_ranks is None else tuple(missing_ranks)
        self.timeout_s = timeout_s


@dataclass(frozen=True)
class BatchFacts:
    """One rank's facts about its next batch (build with ``ReplayGate.facts``).

    ``num_tokens``, ``bucket`` and ``max_seq_len`` are None when unknown
    (``bucket`` is None for an ineligible batch).  ``fingerprint`` is the
    plan's (:attr:`ReplayGate.fingerprint`; None only for facts built by
    hand: every rank must then send None).  ``reason`` stays local: it is not
    exchanged.
    """

    eligible: bool
    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int | None = None
    bucket: int | None = None
    max_seq_len: int | None = None
    reason: ReplayReason | None = None
    fingerprint: PlanFingerprint | None = None

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
    replay; ``idle_ranks``: the ranks without a batch (in a prefill step with
    a busy rank they make every rank run eagerly; in a decode-phase step they
    pad to ``bucket``); ``fingerprint``: the plan fingerprint every rank
    shares (None: facts built without one).
    """

    replay: bool
    bucket: int | None
    forward_mode: ForwardMode
    num_tokens: tuple[int, ...]
    max_seq_len: int
    ineligible_ranks: tuple[int, ...]
    idle_ranks: tuple[int, ...] = ()
    fingerprint: str | None = None


def pack(facts: BatchFacts) -> tuple[int, ...]:
    """This rank's facts as :data:`PACKED_WIDTH` ints (append them to your own gather)."""
    def opt(value: int | None) -> int:
        return _UNKNOWN if value is None else int(value)

    fp = _NO_FINGERPRINT if facts.fingerprint is None else facts.fingerprint.as_int()
    return (PACK_VERSION, fp, 1 if facts.eligible else 0, _MODE_CODES[facts.forward_mode],
            int(facts.batch_size), opt(facts.num_tokens),
            opt(facts.bucket if facts.eligible else None), opt(facts.max_seq_len))


def _row(rank: int, row: Sequence[Any]) -> tuple[int, ...]:
    values = tuple(int(v) for v in row)
    if len(values) != PACKED_WIDTH:
        raise SyncError(f"rank {rank} sent {len(values)} ints, expected {PACKED_WIDTH} (pack() "
                        "output); all ranks must run the same attnreg version")
    if values[_VERSION] != PACK_VERSION:
        raise SyncError(f"rank {rank} packed format {values[_VERSION]}, this rank reads "
                        f"{PACK_VERSION}: all ranks must run the same attnreg version")
    if values[_MODE] not in _CODE_MODES:
        raise SyncError(f"rank {rank} sent an unknown forward mode code {values[_MODE]}")
    return values


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _fingerprint_text(value: int) -> str:
    from .fingerprint import FINGERPRINT_HEX_DIGITS

    return "none" if value == _NO_FINGERPRINT else f"{value:0{FINGERPRINT_HEX_DIGITS}x}"


def _by_value(values: Sequence[Any]) -> dict[Any, list[int]]:
    """value -> the ranks that sent it, in order of first appearance."""
    out: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def _check_fingerprints(parsed: Sequence[tuple[int, ...]]) -> str | None:
    groups = _by_value([_fingerprint_text(row[_FP]) for row in parsed])
    if len(groups) > 1:
        listed = "; ".join(f"{fp} on {_ranks(ranks)}" for fp, ranks in groups.items())
        raise SyncError(f"data-parallel ranks run different graph plans: fingerprint {listed}. "
                        "Every rank must resolve the same plan (the same GraphConfig, backends, "
                        "engine facts, features and cost profile) and build its gate the same "
                        "way; compare ReplayGate.fingerprint.fields on those ranks",
                        fingerprints=[_fingerprint_text(row[_FP]) for row in parsed])
    (fp,) = groups
    return None if fp == "none" else fp


def unpack(rows: Sequence[Sequence[Any]]) -> Agreed:
    """The agreed answer from every rank's packed row, in rank order.

    Pure and deterministic: every rank that unpacks the same gathered rows
    gets the same :class:`Agreed`, or the same :class:`SyncError` (plans with
    different fingerprints, busy ranks with different forward modes).
    """
    if not rows:
        raise SyncError("no ranks to agree: unpack() needs one packed row per rank")
    parsed = [_row(rank, row) for rank, row in enumerate(rows)]
    fingerprint = _check_fingerprints(parsed)
    busy = [rank for rank, row in enumerate(parsed) if row[_SIZE] > 0]
    idle = tuple(rank for rank, row in enumerate(parsed) if row[_SIZE] == 0)
    modes = _by_value([_CODE_MODES[parsed[rank][_MODE]] for rank in busy])
    if len(modes) > 1:
        listed = "; ".join(f"{mode} on {_ranks([busy[i] for i in idx])}"
                           for mode, idx in modes.items())
        raise SyncError(f"data-parallel ranks disagree on the forward mode of this step: "
                        f"{listed}. Every busy rank must run the same kind of batch in one "
                        "step (schedule them together, or make the others idle)")
    forward_mode = next(iter(modes)) if modes else _CODE_MODES[parsed[0][_MODE]]
    ineligible = tuple(rank for rank in busy if parsed[rank][_ELIGIBLE] != 1)
    buckets = [parsed[rank][_BUCKET] for rank in busy]
    # sglang's prefill runner: a rank without tokens beside busy ones forces eager
    idle_forces_eager = forward_mode is ForwardMode.EXTEND and bool(idle)
    replay = (bool(busy) and not ineligible and not idle_forces_eager
              and all(b != _UNKNOWN for b in buckets))
    return Agreed(
        replay=replay,
        bucket=max(buckets) if replay else None,
        forward_mode=forward_mode,
        num_tokens=tuple(row[_TOKENS] for row in parsed),
        max_seq_len=max(row[_LONGEST] for row in parsed),
        ineligible_ranks=ineligible,
        idle_ranks=idle,
        fingerprint=fingerprint,
    )


def sync(local: BatchFacts, group: Any = None, *,
         timeout: float = DEFAULT_SYNC_TIMEOUT_S) -> Agreed:
    """Exchange every rank's facts in one ``all_gather`` and return the agreed answer.

    Parameters
    ----------
    local
        this rank's facts (``ReplayGate.facts(batch)``); an idle rank (no
        batch this step) passes the facts of an empty batch and takes part.
    group
        a ``torch.distributed`` process group (None = the default group).  The
        tensor lives where the group's backend communicates: CPU for gloo, the
        current CUDA device for NCCL.  A gloo group (sglang's ``cpu_group``)
        also names the ranks that did not arrive.
    timeout
        seconds to wait for every rank of ``group`` (default
        :data:`DEFAULT_SYNC_TIMEOUT_S`, 60).

    Returns
    -------
    Agreed
        the same on every rank.  Without an initialised process group (one
        process), this rank's own facts decide, and torch is not imported if
        nothing imported it.

    Raises
    ------
    SyncError
        on every rank, after the collective, when the ranks' plan fingerprints
        differ (naming every rank's fingerprint and the fields that differ),
        when busy ranks run different forward modes, or another attnreg's
        format; and on every rank that called it, when not every rank arrived
        within ``timeout`` (naming the timeout and, on gloo, the missing
        ranks).  After a timeout the group is unusable.
    ValueError
        ``timeout`` is not a positive number of seconds.
    """
    if not 0 < timeout < math.inf:
        raise ValueError(f"sync(timeout={timeout!r}): give a positive, finite number of "
                         f"seconds (default {DEFAULT_SYNC_TIMEOUT_S:g})")
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
    deadline = time.monotonic() + timeout
    gloo = "gloo" in backend
    if gloo:
        _arrive(dist, group, timeout)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    _wait(work, deadline, timeout, backend, blocking=gloo)
    # Every rank unpacks the same rows: the same answer, or the same error on all.
    try:
        return unpack([r.tolist() for r in rows])
    except SyncError as exc:
        if not exc.fingerprints:
            raise
        # Every rank is here (they all unpacked the same rows): one more exchange, of
        # the fingerprints' fields, says which facts differ.
        raise _name_differences(dist, group, local, exc) from None


#: gloo's monitored_barrier message on the group's rank 0: "Ranks 3, 5 failed to pass ..."
_MISSING = re.compile(r"Ranks? ([\d, ]+?) failed to pass monitoredBarrier")


def _arrive(dist: Any, group: Any, timeout: float) -> None:
    """Wait until every rank of a gloo group has called sync, at most ``timeout`` seconds."""
    from datetime import timedelta

    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout),
                               wait_all_ranks=True)
    except RuntimeError as exc:
        me = dist.get_rank(group)
        found = _MISSING.search(str(exc))
        if found:
            missing = [int(r) for r in found.group(1).replace(" ", "").split(",") if r]
            if group is not None and group is not dist.group.WORLD:
                missing = [dist.get_global_rank(group, r) for r in missing]
            raise SyncError(f"sync timed out after {timeout:g} s: {_ranks(missing)} never "
                            "called sync (every other rank did). Every data-parallel rank, "
                            "idle ones included, must call sync each step; the process group "
                            "is unusable now", missing_ranks=missing, timeout_s=timeout) from None
        where = ("the other ranks did not all arrive" if me == 0 else
                 "the group's rank 0 did not release it (a rank never called sync: rank 0's "
                 "SyncError names it; or rank 0 is the missing one)")
        cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise SyncError(f"sync timed out after {timeout:g} s on rank {me}: this rank arrived, "
                        f"but {where}. Every data-parallel rank, idle ones included, must call "
                        "sync each step; the process group is unusable now (gloo: "
                        f"{cause})", timeout_s=timeout) from None


def _wait(work: Any, deadline: float, timeout: float, backend: str, *, blocking: bool) -> None:
    """Wait for an async collective until ``deadline``.

    gloo's ``wait(timeout)`` blocks in C++ and honours the timeout; NCCL's only
    orders the streams (its host wait never times out), so it is polled.
    """
    def timed_out() -> SyncError:
        return SyncError(f"sync timed out after {timeout:g} s: not every rank joined the "
                         f"exchange ({backend} cannot tell which ranks are missing; a gloo "
                         "group names them). Every data-parallel rank, idle ones included, "
                         "must call sync each step; the process group is unusable now",
                         timeout_s=timeout)

    if blocking:
        from datetime import timedelta

        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except RuntimeError:
            raise timed_out() from None
        return
    spin_until = time.monotonic() + 2e-3  # a healthy exchange is quick: spin, then doze
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise timed_out()
        if now > spin_until:
            time.sleep(2e-4)
    work.wait()


def _name_differences(dist: Any, group: Any, local: BatchFacts, exc: SyncError) -> SyncError:
    """``exc`` with the fields that differ between the plans, gathered from every rank."""
    mine = None if local.fingerprint is None else local.fingerprint.fields
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    groups = _by_value(list(exc.fingerprints))
    (first_fp, first_ranks), *others = groups.items()
    lines = []
    for fp, ranks in others:
        a, b = every[first_ranks[0]], every[ranks[0]]
        if a is None or b is None:
            lines.append(f"{_ranks(ranks)} ({fp}) vs {_ranks(first_ranks)} ({first_fp}): one "
                         "side sent facts without a fingerprint")
            continue
        from .fingerprint import PlanFingerprint

        diff = PlanFingerprint(tuple(map(tuple, b))).describe_differences(
            PlanFingerprint(tuple(map(tuple, a))))
        lines.append(f"{_ranks(ranks)} ({fp}) vs {_ranks(first_ranks)} ({first_fp}): {diff}")
    return SyncError(f"{exc}. Fields that differ: " + " | ".join(lines),
                     fingerprints=exc.fingerprints)
