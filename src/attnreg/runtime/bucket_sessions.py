"""``BucketSessions``: decode graphs whose buckets are captured with different backends.

A plan resolved with a decode profile
(:func:`attnreg.graph_policy.resolve`, ``decode_profile=``) may give each
decode capture bucket its own backend (``plan.decode.bucket_backends``),
among backends that declare the same KV pool layout.  This runs such a plan:
one :class:`GraphSession` per backend over the one pool, each capturing the
buckets the plan gives that backend, all recording into one
:class:`GraphRunner` (one graph memory pool); one :class:`ReplayGate` asks
once per step whether the batch replays and at which bucket, and the step
runs through the session that captured that bucket.  The sessions hold no
gate of their own (each captures only some of the plan's buckets); this
object is the gate's only caller.

Eager steps (the gate refused, or another data-parallel rank could not
replay) run on the phase's backend (``plan.decode.backend``), or, when the
plan moved every bucket away from it, on the backend of the largest bucket
(the one closest to the batches the graphs cannot hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnreg.graph_policy import ReplayBatch, ReplayGate, ReplayReason
from attnreg.registry import GraphMode, Phase

from .backend import AttentionBackend
from .batch import ForwardBatch
from .graph_runner import CapturedGraph, GraphRunner
from .pool import MLAKVPool
from .session import GraphSession
from .session_types import (
    SYNC_EAGER,
    AgreedStep,
    BucketKey,
    SessionCounts,
    SessionError,
    StepInputs,
    StepResult,
    replay_batch,
)

__all__ = ["BucketSessions"]

#: GraphRunner options a caller may pass (the one runner every session records into).
_RUNNER_OPTIONS = ("mempool", "capture_error_mode", "warmup", "forbid_sync", "device_graphs",
                   "before_replay", "recorder")


class BucketSessions:
    """The decode phase of ``gate.plan`` with per-bucket backends, over one pool.

    Parameters
    ----------
    backends : mapping name -> AttentionBackend
        An instance of every backend the plan's decode graphs use
        (``plan.decode.backends``), each built for this pool (same page size and
        KV dtype: checked).
    pool : MLAKVPool
    gate : ReplayGate
        The plan's gate; its decode phase must capture full graphs.
    runner : GraphRunner, optional
        Record into this runner; default a new one from the runner options in
        ``options`` (``device_graphs``, ``recorder``, ``mempool``, ...).
    options
        Other :class:`GraphSession` arguments, the same for every session
        (``layers``, ``writes_kv``, ...).

    Raises
    ------
    ValueError
        The plan captures no decode graphs, a backend the plan names is missing,
        or a backend was built for another pool.
    """

    def __init__(self, backends: Mapping[str, AttentionBackend], pool: MLAKVPool,
                 gate: ReplayGate, *, runner: GraphRunner | None = None,
                 **options: Any) -> None:
        pp = gate.plan.decode
        if pp.mode is GraphMode.DISABLED or not pp.captured:
            raise ValueError(f"the plan captures no decode graphs ({pp.mode}): run decode "
                             "eagerly")
        missing = [n for n in pp.backends if n not in backends]
        if missing:
            raise ValueError(f"the plan captures decode buckets with {list(pp.backends)}; give "
                             f"an instance of {missing} too")
        for name in pp.backends:
            cfg = backends[name].config
            if cfg.page_size != pool.page_size or cfg.kv_dtype is not pool.kv_dtype:
                raise ValueError(
                    f"{name} was built for page size {cfg.page_size}, {cfg.kv_dtype} KV; the "
                    f"pool has page size {pool.page_size}, {pool.kv_dtype} KV: every backend "
                    "of a bucket must read the one pool")
        runner_options = {k: options.pop(k) for k in _RUNNER_OPTIONS if k in options}
        self.gate = gate
        self.pool = pool
        self.runner = runner if runner is not None else GraphRunner(pool.device,
                                                                    **runner_options)
        first = pp.captured[0]
        modes = {s.forward_mode: int(s.query_len or 0) for s in pp.captured}
        options.setdefault("max_seq_len", max(s.max_seq_len for s in pp.captured))
        by_backend: dict[str, list[int]] = {}
        for bucket in first.batch_sizes:
            by_backend.setdefault(pp.backend_for(bucket), []).append(bucket)
        #: one session per backend that captures buckets, keyed by backend name
        self.sessions: dict[str, GraphSession] = {
            name: GraphSession(backends[name], pool, phase=Phase.DECODE, mode=pp.mode,
                               buckets=buckets, forward_modes=modes, runner=self.runner,
                               **options)
            for name, buckets in by_backend.items()}
        self._owner = {b: name for name, bs in by_backend.items() for b in bs}
        largest = self._owner[max(self._owner)]
        #: the backend eager steps run on (see the module doc)
        self.eager_backend = pp.backend if pp.backend in self.sessions else largest
        #: steps run, by rule id
        self.counts = SessionCounts()

    # -- lookups -------------------------------------------------------------------------
    def backend_for(self, bucket: int) -> str:
        """The backend bucket ``bucket`` was captured with."""
        try:
            return self._owner[bucket]
        except KeyError:
            raise SessionError(f"no decode bucket {bucket} in this plan (buckets: "
                               f"{sorted(self._owner)})") from None

    def session_for(self, bucket: int) -> GraphSession:
        """The session that captured bucket ``bucket``."""
        return self.sessions[self.backend_for(bucket)]

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._owner))

    # -- capture ---------------------------------------------------------------------------
    def capture(self) -> dict[tuple[str, BucketKey], CapturedGraph]:
        """Capture every session's buckets; the session holding the largest bucket first (the
        shared memory pool is sized by it and smaller graphs reuse its blocks)."""
        out: dict[tuple[str, BucketKey], CapturedGraph] = {}
        order = sorted(self.sessions.items(), key=lambda kv: kv[1].buckets[-1], reverse=True)
        for name, ses in order:
            for key, graph in ses.capture().items():
                out[(name, key)] = graph
        return out

    # -- run ---------------------------------------------------------------------------
    def decide(self, batch: ForwardBatch, facts: ReplayBatch | None = None
               ) -> tuple[bool, int | None, ReplayReason]:
        """(replay?, bucket, reason): the gate's answer for ``batch`` (one question a step)."""
        rb = facts if facts is not None else replay_batch(batch)
        ok, reason = self.gate.can_replay(rb)
        if not ok:
            return False, None, reason
        bucket = self.gate.bucket_for(rb)
        if bucket is None or bucket not in self._owner:
            raise SessionError(f"the gate replays this {rb.forward_mode} batch at bucket "
                               f"{bucket}, which no session captured (buckets: "
                               f"{sorted(self._owner)})")
        return True, bucket, reason

    def run(self, batch: ForwardBatch, inputs: StepInputs | None = None, *,
            facts: ReplayBatch | None = None, agreed: AgreedStep | None = None) -> StepResult:
        """One step (as :meth:`GraphSession.run`): replay through the session of the bucket
        the gate (or the data-parallel group) picked, or run eagerly on
        :attr:`eager_backend`."""
        ok, bucket, reason = self.decide(batch, facts)
        rule = reason.rule
        if agreed is not None:
            if agreed.replay and not ok:
                raise SessionError(f"the data-parallel group agreed to replay this step, but "
                                   f"this rank's gate refuses it ({reason}): the ranks were "
                                   "asked about different facts or plans")
            if agreed.replay:
                bucket = agreed.bucket
                if bucket is None or bucket not in self._owner:
                    raise SessionError(
                        f"the data-parallel group agreed on {batch.forward_mode} bucket "
                        f"{bucket}, which no session captured (buckets "
                        f"{sorted(self._owner)}): the ranks' plans differ")
            elif ok:
                ok, rule = False, SYNC_EAGER
        if ok:
            assert bucket is not None
            outputs = self.session_for(bucket).replay(batch, inputs, bucket=bucket)
        else:
            outputs = self.sessions[self.eager_backend].eager(batch, inputs)
        self.counts.record(ok, rule)
        return StepResult(outputs, ok, bucket if ok else None, reason, rule)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {list(s.buckets)}" for n, s in self.sessions.items())
        return f"BucketSessions({parts}; eager on {self.eager_backend})"
