"""Capture and replay of one backend's forward through :class:`~attnreg.runtime.GraphSession`.

:class:`CapturedForward` drives a one-bucket session for one (phase, graph
mode) stage by stage: its ``init_cuda_graph_state`` ->
``init_forward_metadata_capture`` -> warm-up + capture of the forward over its
static buffers -> for each batch its replay (copy in,
``init_forward_metadata_replay``, replay).  The session is the one engines,
``attnreg calibrate`` and the benchmarks use, on :class:`GraphRunner`.

* FULL: the runner records one graph around the forward.
* BREAKABLE: the captured function is the forward, then an eager break of the
  harness (``eager_break.run``: it scales the output by a host value that
  changes per replay), then a copy after it; the runner splits the capture at
  that break and at any break the backend takes inside attention, and re-runs
  each break's callable between the replayed segments.  A ``with``-form break
  cannot be re-run: such a backend is a harness limitation (a skip).
* ``real_graphs=False`` (cpu): the runner records no device graph; capture runs
  the forward once under ``capturing(mode)`` with the graph metadata, and each
  replay runs it again after ``init_forward_metadata_replay``.  This checks the
  capture-mode *code path* (pinning, fallbacks, refusals, what is planned at
  capture versus replay, padding), not what a recorded graph would do.

:class:`AllocatorChurn` fills the allocator's cached free memory with
patterned tensors between capture and replay (the runner's ``before_replay``
hook): storage the graph recorded but that was freed during capture gets
handed to them, so a replay that writes into it changes a pattern, and one
that reads it reads garbage.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from attnreg.graph_policy.capture import ServedForward, eager_break, recording_served
from attnreg.registry import ForwardMethod, ForwardMode, GraphMode, Phase
from attnreg.runtime import (
    AttentionBackend,
    BucketKey,
    CapturedGraph,
    GraphSession,
    MLAConfig,
    MLAKVPool,
    SessionError,
    SessionStep,
    StepInputs,
    UnreplayableBreakError,
)

from .errors import ClaimRefuted, HarnessLimitation
from .workload import Workload

__all__ = ["CAPTURE_MEMORY_SLACK", "CAPTURE_MEMORY_TOLERANCE", "HARNESS_BREAK",
           "AllocatorChurn", "CaptureMemoryCheck", "CapturedForward", "MemoryDelta", "Served",
           "capture_once"]

#: Label of the harness's own eager break in BREAKABLE capture.
HARNESS_BREAK = "attnreg.conformance.harness"

#: A declared capture memory within this factor of the measured one (either way) holds.
CAPTURE_MEMORY_TOLERANCE = 1.25
#: ...and so does one within this many bytes: allocator rounding, the KV write's
#: temporaries inside the graph and torch's own per-capture state are not declared.
CAPTURE_MEMORY_SLACK = 1 << 20

#: What :func:`~attnreg.graph_policy.capture.note_served_by` reported per forward the
#: harness drove: (when, e.g. "warm-up" or "replay of long_kv", the records).
Served = list[tuple[str, list[ServedForward]]]


@dataclass
class MemoryDelta:
    """Allocator counters around the captured region (device graphs only).

    ``bytes_delta`` is net of the bytes an empty capture of the same shape keeps.
    """

    bytes_delta: int
    allocations: int
    frees: int

    def problems(self) -> list[str]:
        out = []
        if self.bytes_delta < 0:
            out.append(f"the captured region freed {-self.bytes_delta} bytes that were allocated "
                       "before capture: storage the graph may have recorded was released "
                       "(free nothing under capture; attnreg.graph_policy.dispose_tensor skips "
                       "under every capture mode)")
        elif self.bytes_delta > 0:
            out.append(f"{self.bytes_delta} bytes allocated inside the captured region are still "
                       "held after capture: the backend allocates state while capturing "
                       "(allocate it in init_cuda_graph_state instead)")
        return out


@dataclass(frozen=True)
class CaptureMemoryCheck:
    """What one capture allocated, against what the declaration says it allocates.

    ``measured``: on CUDA the allocator's peak from ``init_cuda_graph_state``
    to the end of the capture, less what was allocated before and the
    runtime's own index buffers; on cpu the bytes of the tensors the backend
    holds for graphs (its typed buffers and captured plans).  ``declared``:
    ``CaptureMemory.estimate`` of the backend's declaration at the capture's
    shape (one graph, the pool's bytes).
    """

    measured: int
    declared: int
    how: str

    def problem(self) -> str | None:
        """Why the declaration is off (None when within the tolerance)."""
        lo, hi = sorted((self.measured, self.declared))
        if hi - lo <= CAPTURE_MEMORY_SLACK or hi <= CAPTURE_MEMORY_TOLERANCE * lo:
            return None
        ratio = hi / lo if lo else float("inf")
        more = "more" if self.measured > self.declared else "less"
        return (f"init_cuda_graph_state + capture allocated {_mib(self.measured)} ({self.how}), "
                f"the declaration's CaptureMemory.estimate says {_mib(self.declared)}: "
                f"{ratio:.2f}x {more} than declared (tolerance {CAPTURE_MEMORY_TOLERANCE}x or "
                f"{_mib(CAPTURE_MEMORY_SLACK)}); the graph policy budgets capture memory by the "
                "declaration, so size the graph buffers with the declaration module's own "
                "capture-bytes function, or declare what is allocated")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _block_bytes(starts: set[int]) -> int:
    """Bytes the CUDA caching allocator counts as allocated for the blocks that start at
    the storage addresses ``starts`` (its block sizes, which round the request up)."""
    if not starts:
        return 0
    total = 0
    for segment in torch.cuda.memory_snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and address in starts:
                total += block["size"]
            address += block["size"]
    return total


class CapturedForward:
    """One captured forward of ``backend`` for ``phase`` under ``mode`` (FULL or BREAKABLE).

    A one-bucket :class:`~attnreg.runtime.GraphSession` driven step by step
    (prepare, warm up, capture, replay) so the suite can check each stage: what
    the suite proves is the session engines, calibration and the benchmarks run.

    Parameters
    ----------
    backend, config, pool
        The backend under test, its config and the KV pool it attends over.
    phase, mode, method
        What is captured: decode under FULL, prefill under BREAKABLE, with
        ``method`` (the pinned one when the declaration pins).
    max_bs, max_tokens, max_seq_len, max_kv_rows
        Capture bounds (the largest replay batch); ``max_kv_rows`` sizes the
        ragged k / v buffers of the MHA method.
    real_graphs
        False on cpu: the capture-mode code path is driven without a graph.
    sync_check
        Capture with ``forbid_sync`` (an operation that synchronises with the
        host inside the captured region raises) and account the allocator's
        bytes around it (:attr:`memory`), net of what torch itself keeps per
        capture.
    forward_mode, query_len
        A speculative forward mode of the decode phase (TARGET_VERIFY,
        DRAFT_EXTEND) and its draft tokens per sequence: the graph is captured
        for ``max_bs * query_len`` query rows and run by ``forward_extend``.
        Default: the phase's plain mode.
    layers
        Pool layers the captured function runs, one forward each over one
        captured plan (``layer_id`` 0, 1, ...), each with its own static inputs
        and output.
    """

    def __init__(self, backend: AttentionBackend, config: MLAConfig, pool: MLAKVPool, *,
                 phase: Phase, mode: GraphMode, method: ForwardMethod, max_bs: int,
                 max_tokens: int, max_seq_len: int, max_kv_rows: int, real_graphs: bool,
                 sync_check: bool = False, forward_mode: ForwardMode | None = None,
                 query_len: int | None = None, layers: int = 1) -> None:
        self.backend = backend
        self.config = config
        self.pool = pool
        self.phase = phase
        self.mode = mode
        self.method = method
        self.real_graphs = real_graphs
        self.sync_check = sync_check and real_graphs
        self.forward_mode = forward_mode or (ForwardMode.DECODE if phase is Phase.DECODE
                                             else ForwardMode.EXTEND)
        self.bs = max_bs
        if self.forward_mode is ForwardMode.DECODE:
            self.num_tokens, per_seq, bucket = max_bs, 1, max_bs
        elif self.forward_mode is ForwardMode.EXTEND:
            self.num_tokens, per_seq, bucket = max_tokens, 0, max_tokens
        else:
            per_seq = int(query_len or 1)
            self.num_tokens, bucket = max_bs * per_seq, max_bs
        self.max_seq_len = max_seq_len
        self.layers = int(layers)
        self.memory: MemoryDelta | None = None
        self.capture_memory: CaptureMemoryCheck | None = None
        self.host_scale = 1.0
        self.session = GraphSession(
            backend, pool, phase=phase, mode=mode, buckets=[bucket],
            forward_modes={self.forward_mode: per_seq}, layers=self.layers, method=method,
            max_seq_len=max_seq_len, max_requests=max_bs, max_kv_rows=max_kv_rows,
            step=self._forward,
            after_attention=self._after_attention if mode is GraphMode.BREAKABLE else None,
            device_graphs=real_graphs, warmup=0, forbid_sync=self.sync_check,
            kernel_outputs=True)
        self.key: BucketKey = (self.forward_mode, bucket)
        #: replays so far: every other one sends its batch packed in the session's index
        #: layout, so both fills of the replay metadata (one copy, per-tensor padded) are
        #: proven by every claim that replays more than once
        self.replays = 0
        self.runner = self.session.runner
        statics = self.session.statics
        assert statics is not None
        self.qs, self.latents, self.ropes = statics.qs, statics.latents, statics.ropes
        self.k, self.v = statics.k, statics.v
        # BREAKABLE: the eager region scales each attention output by a host value
        # into ``mids``; the second segment copies them into ``finals``.
        self.mids = [torch.zeros_like(o) for o in statics.outs]
        self.finals = [torch.zeros_like(o) for o in statics.outs]
        self.graph: CapturedGraph | None = None
        self._empty_graphs: list[CapturedGraph] = []
        self._storage = {name: _storage_of(t) for name, t in self._statics().items()}
        self._window_start: int | None = None
        self._when = "capture"
        #: note_served_by reports per forward driven here (see :data:`Served`).
        self.served: Served = []

    # layer 0's static tensors (the only ones of a one-layer capture)
    @property
    def q(self) -> torch.Tensor:
        return self.qs[0]

    @property
    def out(self) -> torch.Tensor:
        return self.outs[0]

    @property
    def outs(self) -> list[torch.Tensor]:
        """Every layer's whole attention output (the session's: its static outputs, or
        the tensors a backend returning its kernel's own output returned; after warm-up)."""
        return self.session.outputs(self.key)

    def _statics(self) -> dict[str, torch.Tensor]:
        statics = self.session.statics
        assert statics is not None
        return statics.named()

    def check_storage(self, when: str) -> None:
        """Raise ClaimRefuted when the backend released or replaced a graph input's storage."""
        for name, t in self._statics().items():
            if _storage_of(t) != self._storage[name]:
                _, was_numel = self._storage[name]
                raise ClaimRefuted(
                    f"{when}: the backend released the storage of {name} (an input/output of "
                    f"the captured forward: {was_numel} elements, now {t.numel()}) while "
                    f"running under capturing({self.mode}); a graph records that address, so "
                    "freeing it lets the allocator hand the memory to other tensors that every "
                    "replay then overwrites (seed 000 defect 3); free nothing under any capture "
                    "mode (attnreg.graph_policy.dispose_tensor skips under all of them)")

    @property
    def on_cuda(self) -> bool:
        return self.real_graphs and self.pool.device.type == "cuda"

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self, capture_work: Workload) -> None:
        """The session's ``init_cuda_graph_state`` + ``init_forward_metadata_capture`` for
        the capture batch.

        Starts the capture-memory window (see :class:`CaptureMemoryCheck`).
        """
        if self.on_cuda:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._window_start = torch.cuda.memory_allocated()
        self.session.init_graph_state()
        self.session.bind(self.key, capture_work.batch)

    def warm_up(self, capture_work: Workload | list[Workload]) -> torch.Tensor:
        """Run the captured function once eagerly on the capture batch (compiles kernels).

        Through the session's runner: on CUDA on a side stream, under
        ``capturing(mode)``.  Returns layer 0's output rows.
        """
        works = _as_list(capture_work)
        self._fill(works)
        self._when = "warm-up"
        # not under the sync guard: first launches compile kernels and may set up state
        self.session.warm_up(self.key)
        self.check_storage("warm-up")
        return self.outs[0][:works[0].rows]

    def layer_outputs(self, rows: int) -> list[torch.Tensor]:
        """Every layer's attention output rows (after :meth:`warm_up`)."""
        return [o[:rows] for o in self.outs]

    def capture(self) -> None:
        """Record the function (without device graphs: run it once under ``capturing``)."""
        overhead = self._capture_overhead() if self.sync_check else 0
        before = self._output_storages()
        self._when = "capture"
        try:
            self.graph = self.session.record(self.key, warmup=0)
        except UnreplayableBreakError as exc:
            raise HarnessLimitation(
                f"the backend entered eager_break({exc.labels[0]!r}) as a `with` block inside "
                "attention: a breakable-graph runner cannot re-run that code at replay (the "
                "handler gets no callable); use the decorator form or "
                "eager_break.run(label, fn, *args) so the region can be replayed") from exc
        self.check_storage("capture")
        stats = self.graph.stats
        if stats is not None:
            # the outputs a backend returning its kernel's own hands the session stay
            # allocated by design (the session keeps them): not the backend's state
            kept = _block_bytes(self._output_storages() - before)
            self.memory = MemoryDelta(bytes_delta=stats.bytes_held - overhead - kept,
                                      allocations=stats.allocations, frees=stats.frees)
        self.capture_memory = self._measure_capture_memory()

    def _output_storages(self) -> set[int]:
        """Where the outputs a ``kernel_outputs`` session kept before a capture live (those
        allocated before it are not the capture's to account)."""
        if not self.session.kernel_outputs:
            return set()
        try:
            return {o.untyped_storage().data_ptr() for o in self.outs}
        except SessionError:
            return set()

    def _measure_capture_memory(self) -> CaptureMemoryCheck:
        state = self.backend.graph_state
        assert state is not None
        declared_shape = replace(state.capture_shape, kv_pool_bytes=self.pool.buffer.nbytes,
                                 num_graphs=1)
        support = self.backend.capabilities.graph_support(self.phase, self.mode)
        declared = support.capture_memory.estimate(declared_shape)
        if self.on_cuda and self._window_start is not None:
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - self._window_start - state.base_bytes
            how = "peak of the device allocator, less the runtime's index buffers"
        else:
            measured = self.backend.graph_buffer_bytes()
            how = "bytes of the backend's graph buffers and captured plans"
        return CaptureMemoryCheck(measured=max(0, int(measured)), declared=int(declared), how=how)

    def _capture_overhead(self) -> int:
        """Bytes torch itself keeps allocated per capture of this shape (not the backend's).

        The first capture while no other graph exists registers the RNG state
        (two small tensors, held while any graph lives); later ones may hold
        nothing.  Empty captures absorb one-time costs, a second round measures
        the steady cost, and all stay alive until this object goes away.
        """
        segments = 2 if self.mode is GraphMode.BREAKABLE else 1

        def empty_round() -> int:
            held = 0
            for _ in range(segments):
                graph = self.runner.capture(self.mids[0].zero_, GraphMode.FULL, warmup=0)
                self._empty_graphs.append(graph)
                held += graph.stats.bytes_held if graph.stats is not None else 0
            return held

        empty_round()
        return empty_round()

    def replay(self, work: Workload | list[Workload], host_scale: float = 1.0,
               between: Callable[[], None] | None = None) -> torch.Tensor:
        """Copy ``work`` in, re-plan its metadata, replay; layer 0's output rows of ``work``.

        ``work`` may be one workload per layer (one batch); :meth:`replay_layers`
        returns every layer's rows.  ``between`` runs after the metadata replay and
        right before the graph replay (the runner's ``before_replay`` hook:
        allocator churn goes there).
        """
        return self.replay_layers(work, host_scale, between)[0]

    def replay_layers(self, work: Workload | list[Workload], host_scale: float = 1.0,
                      between: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """As :meth:`replay`, every layer's output rows."""
        assert self.graph is not None, "capture() first"
        works = _as_list(work)
        first = works[0]
        self.host_scale = host_scale
        self._when = f"replay of {first.spec.name}"
        self.runner.before_replay = between
        batch = first.batch
        self.replays += 1
        layout = self.session.index_layout if self.replays % 2 == 0 else None
        if layout is not None and not layout.fit_problems(batch.seq_lens_cpu, batch.num_tokens):
            batch = batch.in_layout(layout)
        try:
            # the session asks no gate here: the suite replays every batch it built
            outs = self.session.replay(batch, self._inputs(works), bucket=self.key[1])
        finally:
            self.runner.before_replay = None
        if self.on_cuda:
            torch.cuda.synchronize()
        if not self.real_graphs:
            self.check_storage(f"replay of {first.spec.name}")
        if self.mode is GraphMode.BREAKABLE:
            # undo the eager region's exact power-of-two scaling
            return [f[:first.rows] / host_scale for f in self.finals]
        return outs

    def padding_problems(self, work: Workload) -> list[str]:
        """Rows of the attention outputs beyond ``work``'s that are not exactly zero."""
        out: list[str] = []
        for layer, full in enumerate(self.outs):
            rest = full[work.rows:]
            if rest.numel() == 0:
                continue
            bad = ~(rest == 0).flatten(1).all(dim=1)
            if not bool(bad.any()):
                continue
            rows = [work.rows + int(i) for i in torch.nonzero(bad).flatten().tolist()]
            nonfinite = int((~torch.isfinite(rest.float())).flatten(1).any(dim=1).sum())
            at = f" (layer {layer})" if self.layers > 1 else ""
            out.append(
                f"{work.spec.describe()} replayed through a graph captured for "
                f"bs={self.bs}, num_tokens={self.num_tokens}{at}: {len(rows)} of "
                f"{full.shape[0] - work.rows} padding output rows are not zero (rows "
                f"{rows[:6]}{'...' if len(rows) > 6 else ''}"
                + (f", {nonfinite} with non-finite values" if nonfinite else "")
                + "); docs/runtime.md promises zero output for the missing sequences: zero "
                "them inside the graph (AttentionBackend.zero_padded_rows)")
        return out

    # -- pieces ------------------------------------------------------------------------
    def _inputs(self, works: list[Workload]) -> StepInputs:
        """One workload per layer (the first for layers without one of their own)."""
        per_layer = [works[i] if i < len(works) else works[0] for i in range(self.layers)]
        return StepInputs([w.q for w in per_layer], [w.latent_new for w in per_layer],
                          [w.rope_new for w in per_layer], works[0].k, works[0].v,
                          [w.q_scale for w in per_layer])

    def _fill(self, works: list[Workload]) -> None:
        self.session.load(self.key, self._inputs(works))

    def _forward(self, step: SessionStep) -> list[torch.Tensor]:
        """The session's step: one forward per layer over the static buffers; what served it
        goes to :attr:`served`.  Every layer's output (the session keeps a backend's own)."""
        with recording_served() as records:
            outs = GraphSession.attend(step)
        self.served.append((self._when, records))
        return outs

    def _after_attention(self, step: SessionStep) -> None:
        """BREAKABLE: the harness's own eager break after attention, then a copy after it."""
        eager_break.run(HARNESS_BREAK, self._eager_region)
        for mid, final in zip(self.mids, self.finals):
            final.copy_(mid)

    def _eager_region(self) -> None:
        for out, mid in zip(self.outs, self.mids):
            torch.mul(out, self.host_scale, out=mid)


def capture_once(backend: AttentionBackend, pool: MLAKVPool, work: Workload, *,
                 phase: Phase, mode: GraphMode, method: ForwardMethod) -> GraphSession:
    """Capture ``work`` once through a one-bucket session without device graphs.

    The capture-mode code path of ``mode`` (``init_cuda_graph_state``,
    ``init_forward_metadata_capture`` and the forward under ``capturing(mode)``;
    TC_PIECEWISE: the eager attention of the batch) with ``work``'s inputs, as
    an engine's session would run it: where the suite checks that a backend
    refuses a mode or a method with ``UnsupportedError``.
    """
    batch = work.batch
    decode_phase = phase is Phase.DECODE
    fm = batch.forward_mode
    bucket = batch.num_tokens if fm is ForwardMode.EXTEND else batch.batch_size
    per_seq = 0 if fm is ForwardMode.EXTEND else (1 if fm is ForwardMode.DECODE
                                                   else int(batch.max_extend_len))
    session = GraphSession(
        backend, pool, phase=phase, mode=mode, buckets=[bucket],
        forward_modes={fm: per_seq} if decode_phase else None, method=method,
        max_seq_len=batch.max_seq_len, max_requests=batch.batch_size,
        max_kv_rows=work.k.shape[0] if work.k is not None else None,
        device_graphs=False, warmup=0, kernel_outputs=True)
    session.capture(batches={bucket: batch},
                    inputs={bucket: StepInputs.one(work.q, work.latent_new, work.rope_new,
                                                   k=work.k, v=work.v, q_scale=work.q_scale)})
    return session


def _as_list(work: Workload | list[Workload]) -> list[Workload]:
    return list(work) if isinstance(work, list) else [work]


def _storage_of(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.numel()


class AllocatorChurn:
    """Fill the caching allocator's free memory with patterned tensors, check them, free them.

    :meth:`scramble` takes every cached free block it can, writes 0xFF bytes
    into it and frees it again: storage that was freed while the graph had it
    recorded now holds garbage that a replay reading it would pick up.
    :meth:`fill` then takes the free blocks again with tensors holding
    :attr:`PATTERN`, kept alive through the replay; :meth:`corrupted` lists
    those whose bytes a replay changed (it wrote into storage it no longer owns).
    """

    PATTERN = 0xA5
    JUNK = 0xFF

    def __init__(self, device: torch.device, max_tensors: int = 4096) -> None:
        self.device = device
        self.max_tensors = max_tensors
        self.tensors: list[torch.Tensor] = []

    def churn(self) -> None:
        """:meth:`scramble` then :meth:`fill`: what runs between capture and a replay."""
        self.scramble()
        self.fill()

    def scramble(self) -> None:
        junk = self._take(self.JUNK)
        del junk

    def fill(self) -> int:
        self.tensors = self._take(self.PATTERN)
        return sum(t.numel() for t in self.tensors)

    def _take(self, value: int) -> list[torch.Tensor]:
        """Take every cached free block (best fit, 64 MiB down to 512 B) and fill it.

        An allocation that makes the allocator map a new segment means no cached
        block of that size is left: it is parked (so the next size does not reuse
        the fresh segment) and the next smaller size is tried.
        """
        torch.cuda.synchronize(self.device)
        taken: list[torch.Tensor] = []
        parked: list[torch.Tensor] = []
        size = 64 << 20
        while size >= 512 and len(taken) < self.max_tensors:
            reserved = torch.cuda.memory_reserved(self.device)
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            if torch.cuda.memory_reserved(self.device) > reserved:
                parked.append(t)
                size //= 2
                continue
            t.fill_(value)
            taken.append(t)
        torch.cuda.synchronize(self.device)
        del parked
        return taken

    def corrupted(self) -> list[int]:
        if not self.tensors:
            return []
        changed = torch.stack([(t != self.PATTERN).any() for t in self.tensors])
        return [int(i) for i in torch.nonzero(changed).flatten().tolist()]

    def release(self) -> None:
        self.tensors = []
