"""Capture and replay of one backend's forward, as an engine's graph runner does it.

:class:`CapturedForward` drives the runtime lifecycle of ``docs/runtime.md``
for one (phase, graph mode): ``init_cuda_graph_state`` ->
``init_forward_metadata_capture`` -> warm-up + capture of the forward over
static buffers -> for each batch ``init_forward_metadata_replay`` + replay.

* FULL: one ``torch.cuda.CUDAGraph`` around the forward.
* BREAKABLE: the forward is captured in a first segment, then an
  :func:`~attnreg.graph_policy.capture.eager_break` owned by the harness ends
  it (the break handler closes the segment), eager code runs (and runs again
  at every replay, reading a host value that changes per replay), and a second
  segment is captured after it, as a breakable-graph runner does.  Breaks the
  backend takes itself inside attention split the capture the same way; the
  replay callable they hand the handler (decorator or ``eager_break.run``
  form) runs between the same segments at every replay.  A ``with``-form
  break cannot be re-run: such a backend is a harness limitation (a skip).
* ``real_graphs=False`` (cpu): no device graph exists; "capture" runs the
  forward once under ``capturing(mode)`` with the graph metadata, and each
  "replay" runs it again after ``init_forward_metadata_replay``.  This checks
  the capture-mode *code path* (pinning, fallbacks, refusals, what is planned
  at capture versus replay), not what a recorded graph would do.

:class:`AllocatorChurn` fills the allocator's cached free memory with
patterned tensors between replays: storage the graph recorded but that was
freed during capture gets handed to them, so a replay that writes into it
changes a pattern, and one that reads it reads garbage.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from attnreg.backends.base import AttentionBackend, MLAConfig
from attnreg.backends.kv_pool import MLAKVPool
from attnreg.graph_policy.capture import (
    EagerReplay,
    ServedForward,
    break_handler,
    capturing,
    eager_break,
    recording_served,
)
from attnreg.registry import ForwardMethod, ForwardMode, GraphMode, Phase

from .errors import ClaimRefuted, HarnessLimitation
from .workload import Workload

__all__ = ["HARNESS_BREAK", "AllocatorChurn", "CapturedForward", "MemoryDelta", "Served"]

#: Label of the harness's own eager break in BREAKABLE capture.
HARNESS_BREAK = "attnreg.conformance.harness"

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


class _CudaSegments:
    """Opens and closes CUDA-graph segments (what :class:`_Segments` records into)."""

    def __init__(self, mempool: Any) -> None:
        self.mempool = mempool

    def begin(self) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        ctx = torch.cuda.graph(graph, pool=self.mempool)
        ctx.__enter__()
        return graph, ctx

    @staticmethod
    def end(handle: tuple[Any, Any], exc: BaseException | None = None) -> Any:
        graph, ctx = handle
        if exc is None:
            ctx.__exit__(None, None, None)
        else:
            ctx.__exit__(type(exc), exc, None)
        return graph

    @staticmethod
    @contextlib.contextmanager
    def eager() -> Iterator[None]:
        """Eager regions may synchronise: lift a sync guard set around the capture."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


class _Segments:
    """Breakable capture: consecutive graphs separated by eager regions.

    Installed with ``break_handler(seg.handler, with_replay=True)``.  Each
    break ends the current segment, adds an eager step to the replay plan and
    begins the next segment when the region is left.  The harness's own break
    replays ``eager_fn``; a backend's break replays the callable it handed
    over; a ``with``-form break of the backend has none and is listed in
    :attr:`unreplayable` (:meth:`check_replayable` then raises).

    ``segments`` opens and closes segments (CUDA graphs by default; the cpu
    tests pass a fake one to check the plan).
    """

    def __init__(self, mempool: Any, eager_fn: Callable[[], None], *,
                 segments: Any = None) -> None:
        self.segments = segments if segments is not None else _CudaSegments(mempool)
        self.eager_fn = eager_fn
        self.plan: list[tuple[str, Any]] = []
        self.unreplayable: list[str] = []
        self.backend_breaks: list[str] = []
        self._current: Any = None

    def begin(self) -> None:
        self._current = self.segments.begin()

    def end(self) -> None:
        assert self._current is not None
        handle, self._current = self._current, None
        self.plan.append(("graph", self.segments.end(handle)))

    def abort(self) -> None:
        if self._current is not None:
            handle, self._current = self._current, None
            with contextlib.suppress(Exception):
                self.segments.end(handle, RuntimeError("aborted"))

    def handler(self, label: str, replay: EagerReplay | None
                ) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def split() -> Iterator[None]:
            self.end()
            if label == HARNESS_BREAK:
                self.plan.append(("eager", self.eager_fn))
            elif replay is not None:
                self.backend_breaks.append(label)
                self.plan.append(("eager", replay))
            else:
                self.unreplayable.append(label)
            with self.segments.eager():
                yield
            self.begin()
        return split()

    def check_replayable(self) -> None:
        """Raise HarnessLimitation when the backend took a break no runner can re-run."""
        if self.unreplayable:
            raise HarnessLimitation(
                f"the backend entered eager_break({self.unreplayable[0]!r}) as a `with` block "
                "inside attention: a breakable-graph runner cannot re-run that code at replay "
                "(the handler gets no callable); use the decorator form or "
                "eager_break.run(label, fn, *args) so the region can be replayed")

    def replay(self) -> None:
        for kind, step in self.plan:
            if kind == "graph":
                step.replay()
            else:
                step()


class CapturedForward:
    """One captured forward of ``backend`` for ``phase`` under ``mode`` (FULL or BREAKABLE).

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
        Capture with ``torch.cuda.set_sync_debug_mode("error")`` (an operation
        that synchronises with the host inside the captured region raises) and
        account the allocator's bytes around it (:attr:`memory`), net of what
        torch itself keeps per capture.
    """

    def __init__(self, backend: AttentionBackend, config: MLAConfig, pool: MLAKVPool, *,
                 phase: Phase, mode: GraphMode, method: ForwardMethod, max_bs: int,
                 max_tokens: int, max_seq_len: int, max_kv_rows: int, real_graphs: bool,
                 sync_check: bool = False) -> None:
        self.backend = backend
        self.config = config
        self.pool = pool
        self.phase = phase
        self.mode = mode
        self.method = method
        self.real_graphs = real_graphs
        self.sync_check = sync_check and real_graphs
        self.bs = max_bs
        self.num_tokens = max_bs if phase is Phase.DECODE else max_tokens
        self.max_seq_len = max_seq_len
        self.memory: MemoryDelta | None = None
        self.host_scale = 1.0
        dev = pool.device
        qdt = _torch_q_dtype(config)
        heads = config.num_heads
        rows = self.num_tokens
        qk = config.kv_row_dim if method is ForwardMethod.MLA else config.mha_head_dims[0]
        dv = config.kv_lora_rank if method is ForwardMethod.MLA else config.mha_head_dims[1]
        self.q = torch.zeros(rows, heads, qk, dtype=qdt, device=dev)
        self.latent = torch.zeros(rows, config.kv_lora_rank, dtype=qdt, device=dev)
        self.rope = torch.zeros(rows, config.qk_rope_head_dim, dtype=qdt, device=dev)
        self.out = torch.zeros(rows, heads, dv, dtype=qdt, device=dev)
        self.k = self.v = None
        if method is not ForwardMethod.MLA:
            self.k = torch.zeros(max_kv_rows, heads, config.mha_head_dims[0], dtype=qdt,
                                 device=dev)
            self.v = torch.zeros(max_kv_rows, heads, config.mha_head_dims[1], dtype=qdt,
                                 device=dev)
        # BREAKABLE: the eager region scales the attention output by a host value
        # into ``mid``; the second segment copies ``mid`` into ``final``.
        self.mid = torch.zeros_like(self.out)
        self.final = torch.zeros_like(self.out)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._segments: _Segments | None = None
        self._empty_graphs: list[torch.cuda.CUDAGraph] = []
        self._mempool = torch.cuda.graph_pool_handle() if real_graphs else None
        self._storage = {name: _storage_of(t) for name, t in self._statics().items()}
        #: note_served_by reports per forward driven here (see :data:`Served`).
        self.served: Served = []

    def _statics(self) -> dict[str, torch.Tensor]:
        named = {"q": self.q, "latent_new": self.latent, "rope_new": self.rope, "out": self.out}
        if self.k is not None and self.v is not None:
            named.update(k=self.k, v=self.v)
        return named

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

    # -- lifecycle ---------------------------------------------------------------------
    def prepare(self, capture_work: Workload) -> None:
        """``init_cuda_graph_state`` + ``init_forward_metadata_capture`` for the capture batch."""
        fmode = ForwardMode.DECODE if self.phase is Phase.DECODE else ForwardMode.EXTEND
        with capturing(self.mode):
            self.backend.init_cuda_graph_state(self.bs, max(self.num_tokens, self.bs),
                                               max_seq_len=self.max_seq_len,
                                               graph_modes={self.phase: self.mode})
        self.backend.init_forward_metadata_capture(self.bs, self.num_tokens,
                                                   batch=capture_work.batch,
                                                   forward_mode=fmode)

    def warm_up(self, capture_work: Workload) -> torch.Tensor:
        """Run the capture-mode path once eagerly on the capture batch (compiles kernels)."""
        self._fill(capture_work)
        # not under the sync guard: first launches compile kernels and may set up state
        with capturing(self.mode):
            self._forward("warm-up")
        self.check_storage("warm-up")
        if self.real_graphs:
            torch.cuda.synchronize()
        return self.out[:capture_work.rows]

    def capture(self) -> None:
        """Record the forward (nothing to do without device graphs)."""
        if not self.real_graphs:
            return
        overhead = self._capture_overhead() if self.sync_check else 0
        # torch.cuda.graph collects garbage on entry: do it first, so tensors that were
        # already dead do not count as freed by the captured region
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        if self.mode is GraphMode.BREAKABLE:
            seg = _Segments(self._mempool, self._eager_region)
            try:
                with capturing(self.mode), break_handler(seg.handler, with_replay=True):
                    seg.begin()
                    with self._sync_guard():
                        self._forward("capture")
                    with eager_break(HARNESS_BREAK):
                        self._eager_region()
                    self.final.copy_(self.mid)
                    seg.end()
            except BaseException:
                seg.abort()
                raise
            seg.check_replayable()
            self._segments = seg
        else:
            graph = torch.cuda.CUDAGraph()
            capture = torch.cuda.graph(graph, pool=self._mempool)
            with capturing(self.mode), capture, self._sync_guard():
                self._forward("capture")
            self._graph = graph
        self.check_storage("capture")
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        self.memory = MemoryDelta(
            bytes_delta=int(after.get("allocated_bytes.all.current", 0)
                            - before.get("allocated_bytes.all.current", 0)) - overhead,
            allocations=int(after.get("allocation.all.allocated", 0)
                            - before.get("allocation.all.allocated", 0)),
            frees=int(after.get("allocation.all.freed", 0)
                      - before.get("allocation.all.freed", 0)))

    def _empty_captures(self) -> list[torch.cuda.CUDAGraph]:
        """As many graphs as the real capture makes, each around one tiny kernel."""
        graphs = []
        for _ in range(2 if self.mode is GraphMode.BREAKABLE else 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                self.mid.zero_()
            graphs.append(graph)
        return graphs

    def _capture_overhead(self) -> int:
        """Bytes torch itself keeps allocated per capture of this shape (not the backend's).

        The first capture while no other graph exists registers the RNG state
        (two small tensors, held while any graph lives); later ones may hold
        nothing.  An empty capture absorbs one-time costs, a second one measures
        the steady cost, and both stay alive until this object goes away.
        """
        self._empty_graphs = self._empty_captures()
        gc.collect()
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        self._empty_graphs += self._empty_captures()
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated() - start)

    def replay(self, work: Workload, host_scale: float = 1.0,
               between: Callable[[], None] | None = None) -> torch.Tensor:
        """Copy ``work`` in, re-plan its metadata, replay; the output rows of ``work``.

        ``between`` runs after the metadata replay and right before the graph
        replay (allocator churn goes there).
        """
        self._fill(work)
        fmode = ForwardMode.DECODE if self.phase is Phase.DECODE else ForwardMode.EXTEND
        self.backend.init_forward_metadata_replay(self.bs, self.num_tokens, work.batch,
                                                  forward_mode=fmode)
        self.host_scale = host_scale
        if between is not None:
            between()
        if not self.real_graphs:
            with capturing(self.mode):
                self._forward(f"replay of {work.spec.name}")
            self.check_storage(f"replay of {work.spec.name}")
            if self.mode is GraphMode.BREAKABLE:
                self._eager_region()
                self.final.copy_(self.mid)
        elif self._segments is not None:
            self._segments.replay()
        else:
            assert self._graph is not None, "capture() first"
            self._graph.replay()
        if self.real_graphs:
            torch.cuda.synchronize()
        if self.mode is GraphMode.BREAKABLE:
            # undo the eager region's exact power-of-two scaling
            return self.final[:work.rows] / host_scale
        return self.out[:work.rows]

    # -- pieces ------------------------------------------------------------------------
    def _fill(self, work: Workload) -> None:
        n = work.rows
        for static, value in ((self.q, work.q), (self.latent, work.latent_new),
                              (self.rope, work.rope_new)):
            static[:n].copy_(value)
            static[n:].zero_()
        if self.k is not None and self.v is not None:
            assert work.k is not None and work.v is not None
            t = work.k.shape[0]
            self.k[:t].copy_(work.k)
            self.v[:t].copy_(work.v)
            self.k[t:].zero_()
            self.v[t:].zero_()

    def _forward(self, when: str) -> None:
        """One forward over the static buffers; what served it goes to :attr:`served`."""
        with recording_served() as records:
            if self.phase is Phase.DECODE:
                self.backend.forward_decode(self.q, self.latent, self.rope, self.pool, None,
                                            out=self.out)
            else:
                self.backend.forward_extend(self.q, self.latent, self.rope, self.pool, None,
                                            method=self.method, k=self.k, v=self.v,
                                            out=self.out)
        self.served.append((when, records))

    def _eager_region(self) -> None:
        torch.mul(self.out, self.host_scale, out=self.mid)

    @contextlib.contextmanager
    def _sync_guard(self) -> Iterator[None]:
        if not self.sync_check:
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _storage_of(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.numel()


def _torch_q_dtype(config: MLAConfig) -> torch.dtype:
    from attnreg.backends.kv_pool import torch_dtype

    return torch_dtype(config.q_dtype)


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
