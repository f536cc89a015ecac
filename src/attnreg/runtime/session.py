"""``GraphSession``: what an engine's graph runner does around the kernel, once.

An engine that captures attention runs the same sequence every step: ask
the replay gate, choose the captured bucket, pad the batch to it, copy the
inputs into the static tensors the graph recorded, prepare the replay
metadata, replay (or run eagerly) and hand back only the real rows.  That
sequence is where the capture bugs of real engines lived (storage freed
during breakable capture, schedule-time and forward-time answers that
differ), so attnreg writes it once, here; the conformance suite, ``attnreg
calibrate``, the benchmarks and engines all drive it, and what is proven is
what is measured is what runs.

Capture (:meth:`GraphSession.capture`) goes through :class:`GraphRunner`:
``init_cuda_graph_state`` once for the largest shape, then per bucket
(largest first, so smaller ones reuse its blocks of the one shared private
memory pool) ``init_forward_metadata_capture``, a side-stream warm-up and the
recording, all under ``capturing(mode)`` (which makes ``dispose_tensor`` a
no-op and lets the backend refuse what it cannot capture).

* FULL decode, including TARGET_VERIFY and DRAFT_EXTEND buckets (decode-phase
  graphs keyed by batch size, ``bucket x draft tokens`` query rows);
* BREAKABLE prefill: the runner splits at every ``eager_break`` the step
  reaches (the caller's own, e.g. ``after_attention`` calling
  ``eager_break.run``, or one a backend takes inside attention);
* TC_PIECEWISE prefill: attention is the :class:`EagerStep` between the
  captured pieces (``after_attention`` is a captured piece), re-planned with
  ``init_forward_metadata`` for the real batch at every replay.

Every replay prepares its metadata in one method (``_replay_metadata``).  A
batch built in the session's :attr:`GraphSession.index_layout` is copied into
the graph buffers with one device copy (no host work per index tensor); one
built into :attr:`GraphSession.index_buffer` is already there (no copy); a
backend whose replay needs host planning (flashinfer's ``plan``) adds it in
its ``_init_replay_impl``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from attnreg.graph_policy import ReplayBatch, ReplayGate, ReplayReason
from attnreg.graph_policy.capture import capturing
from attnreg.graph_policy.replay import smallest_bucket
from attnreg.registry import ForwardMethod, ForwardMode, GraphMode, Phase
from attnreg.registry.capabilities import PHASE_FORWARD_MODES, VALID_GRAPH_MODES

from .backend import AttentionBackend
from .batch import SPECULATIVE_MODES, ForwardBatch
from .dtypes import output_dtype, torch_dtype
from .graph_runner import CapturedGraph, EagerStep, GraphRecorder, GraphRunner
from .index_buffer import IndexBuffer
from .indices import IndexLayout, PackedIndices
from .pool import MLAKVPool
from .session_types import (
    SYNC_EAGER,
    AgreedStep,
    BucketKey,
    SessionCounts,
    SessionError,
    SessionStep,
    StaticBuffers,
    StepFn,
    StepInputs,
    StepResult,
    replay_batch,
)

#: Distinct decisions a session remembers before starting over (each is a few ints):
#: enough for every bucket and length class an engine meets, bounded for one that
#: sends ever-new lengths.
_MAX_REMEMBERED_DECISIONS = 4096

__all__ = ["GraphSession"]


class GraphSession:
    """Captures a backend's attention for one phase and runs batches through it.

    Parameters
    ----------
    backend : AttentionBackend
    pool : MLAKVPool
        The KV pool the layers attend (``layers`` of its layers, ids 0, 1, ...).
    phase : Phase
        DECODE (FULL graphs per batch size) or PREFILL (BREAKABLE or
        TC_PIECEWISE graphs per token count).
    mode : GraphMode
        The phase's graph mode in the plan.
    buckets : sequence of int
        Decode: batch sizes; prefill: token counts.  Each is captured.
    gate : ReplayGate, optional
        The plan's gate: :meth:`run` asks it whether a batch replays and at
        which bucket.  Without one, a batch replays whenever a captured bucket
        holds it (its requests, tokens, draft tokens and longest sequence).
    forward_modes : mapping ForwardMode -> int, optional
        Decode phase: the forward modes captured and their query tokens per
        sequence, e.g. ``{"decode": 1, "target_verify": 4}`` (a verify graph
        of bucket ``b`` has ``4b`` rows; a draft-extend graph serves 1..q per
        sequence).  Default ``{DECODE: 1}``; prefill: ``{EXTEND: 0}``.
    layers : int
        Pool layers attended per step, each with its own static q, latent,
        rope and output (one captured plan serves them all).
    method : ForwardMethod, optional
        The forward method (default: the one the backend pins under the mode,
        else MLA).
    max_seq_len : int, optional
        The longest sequence a replay may carry (default: the backend's
        ``config.max_context_len``).
    max_requests : int, optional
        Prefill: sequences a token bucket is captured for (default: the
        bucket, up to 64).
    max_kv_rows : int, optional
        The MHA method: rows of the static ragged k / v (prefix + new tokens).
    writes_kv : bool
        The step writes each new token's latent / rope into the pool (static
        ``latent_new`` / ``rope_new`` per layer); False: the caller writes them.
    step : callable, optional
        Replaces the attention call (``step(SessionStep)``): a model step that
        reads tensors of its own (static inside the graph).  Default
        :meth:`attend`.
    after_attention : callable, optional
        ``after_attention(SessionStep)`` runs inside the captured function after
        the step (TC_PIECEWISE: as a captured piece); the place for the caller's
        own ``eager_break.run(...)`` under BREAKABLE.  Not run on eager steps.
    static_inputs : bool
        Allocate the static inputs and outputs (:attr:`statics`, sized for the
        largest bucket); False for a ``step`` that reads tensors of its own
        (then :meth:`run` takes no inputs and returns no outputs).
    runner : GraphRunner, optional
        Record into this runner (an engine's other sessions share its memory
        pool); default a new one built from the options below.
    mempool, forbid_sync, before_replay, device_graphs, capture_error_mode, warmup, recorder
        :class:`GraphRunner` options: a shared graph memory pool, refuse host
        syncs inside the graph, a hook before every replay (allocator churn),
        ``device_graphs=False`` on a cpu (capture runs once, replay re-runs),
        side-stream warm-up runs per bucket, a fake recorder in tests.
    kernel_outputs : bool
        Where the backend returns its kernel library's own output
        (``AttentionBackend.returns_kernel_output``; FULL or BREAKABLE graphs of
        :meth:`attend`-like steps), each bucket keeps the tensors its captured step
        returned (:meth:`outputs`) instead of copying them into the static outputs:
        one launch less per layer per replay, for one output per layer per bucket
        (the static outputs stay, for eager steps).  A step of your own then returns
        every layer's output, as :meth:`attend` does.  Default False.
    sparse : bool
        The step runs :meth:`~AttentionBackend.forward_sparse` (DSA; its own ``step``
        reads a static top-k index tensor): the graph state is allocated and each
        shape bound against the declaration's ``sparse_graph_modes``
        (``init_cuda_graph_state(sparse=True)``), so a backend whose phase only
        sparse kernels serve is captured.

    Examples
    --------
    See docs/runtime.md ("One graph session").
    """

    def __init__(self, backend: AttentionBackend, pool: MLAKVPool, *, phase: Phase | str,
                 mode: GraphMode | str, buckets: Iterable[int],
                 gate: ReplayGate | None = None,
                 forward_modes: Mapping[ForwardMode | str, int] | None = None,
                 layers: int = 1, method: ForwardMethod | str | None = None,
                 max_seq_len: int | None = None, max_requests: int | None = None,
                 max_kv_rows: int | None = None, writes_kv: bool = True,
                 step: StepFn | None = None, after_attention: StepFn | None = None,
                 static_inputs: bool = True, runner: GraphRunner | None = None,
                 mempool: Any = None,
                 forbid_sync: bool = False, before_replay: Callable[[], object] | None = None,
                 device_graphs: bool | None = None, capture_error_mode: str = "global",
                 warmup: int = 1, recorder: GraphRecorder | None = None,
                 sparse: bool = False, kernel_outputs: bool = False) -> None:
        self.backend = backend
        #: the step runs forward_sparse (DSA): capture checks read sparse_graph_modes
        self.sparse = bool(sparse)
        self.pool = pool
        self.phase = Phase.parse(phase)
        self.mode = GraphMode.parse(mode)
        if self.mode not in VALID_GRAPH_MODES[self.phase]:
            raise ValueError(f"{self.phase} graphs are captured in "
                             f"{[str(m) for m in VALID_GRAPH_MODES[self.phase]]}, not {self.mode}")
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be >= 1 and at least one, got {self.buckets}")
        if forward_modes is None:
            forward_modes = ({ForwardMode.DECODE: 1} if self.phase is Phase.DECODE
                             else {ForwardMode.EXTEND: 0})
        self.forward_modes: dict[ForwardMode, int] = {
            ForwardMode.parse(m): int(q) for m, q in forward_modes.items()}
        for fm, q in self.forward_modes.items():
            if fm not in PHASE_FORWARD_MODES[self.phase]:
                raise ValueError(f"{fm} batches are not served by {self.phase} graphs")
            if fm is ForwardMode.DECODE and q != 1:
                raise ValueError(f"a decode graph has 1 query token per sequence, not {q}")
            if fm in SPECULATIVE_MODES and q < 1:
                raise ValueError(f"{fm} needs its draft tokens per sequence (>= 1), got {q}")
        self.gate = gate
        self.layers = int(layers)
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        if self.layers > pool.num_layers:
            raise ValueError(f"{self.layers} layers asked, the pool has {pool.num_layers}")
        # an explicit method is the caller's (the suite checks the backend refuses it)
        # (sparse attention is absorbed MLA: nothing to pin)
        self.method = ForwardMethod.parse(method) if method is not None else (
            ForwardMethod.MLA if self.sparse else
            backend.forward_method_for(self.phase, self.mode) or ForwardMethod.MLA)
        self.max_seq_len = int(max_seq_len or backend.config.max_context_len)
        self.max_requests = int(max_requests) if max_requests else None
        self.writes_kv = bool(writes_kv)
        self._step_fn: StepFn = step if step is not None else GraphSession.attend
        self.after_attention = after_attention
        self.runner = runner if runner is not None else GraphRunner(
            pool.device, mempool=mempool, capture_error_mode=capture_error_mode,
            warmup=warmup, forbid_sync=forbid_sync, device_graphs=device_graphs,
            before_replay=before_replay, recorder=recorder)
        #: steps run, by rule id (:class:`SessionCounts`)
        self.counts = SessionCounts()
        self._shapes = {key: self._shape(key) for key in self._keys()}
        if self.method is not ForwardMethod.MLA and max_kv_rows is None and static_inputs:
            raise ValueError(f"the {self.method} method attends ragged k / v: give max_kv_rows")
        #: the static inputs and outputs (None with ``static_inputs=False``)
        self.statics: StaticBuffers | None = (
            self._allocate(max_kv_rows or 0) if static_inputs else None)
        #: each bucket keeps its captured step's outputs (``kernel_outputs=`` and a backend
        #: that returns its kernel's; not TC_PIECEWISE, whose attention runs eagerly)
        self.kernel_outputs = bool(
            kernel_outputs and backend.returns_kernel_output and static_inputs
            and self.mode is not GraphMode.TC_PIECEWISE and not self.sparse)
        self._kernel_outs: dict[BucketKey, list[torch.Tensor]] = {}
        self._graphs: dict[BucketKey, CapturedGraph] = {}
        self._outs_by_rows: dict[tuple[BucketKey | None, int], list[torch.Tensor]] = {}
        self._decisions: dict[tuple[Any, ...], tuple[bool, int | None, ReplayReason]] = {}
        self._state_ready = False
        #: TC_PIECEWISE: the batch the eager attention plans at the next (re)run
        self._piecewise_batch: ForwardBatch | None = None
        if gate is not None:
            self._check_gate(gate)

    @classmethod
    def from_plan(cls, backend: AttentionBackend, pool: MLAKVPool, gate: ReplayGate,
                  phase: Phase | str, **options: Any) -> GraphSession:
        """The session of one phase of ``gate.plan``: its mode, buckets, forward modes (with
        their draft tokens), longest sequence and prefill request slots.

        ``options`` are the other constructor arguments (``layers``, runner
        options, ...).  Raises ``ValueError`` when the plan captures nothing in
        that phase (the engine runs it eagerly: no session needed).
        """
        pp = gate.plan.phase(phase)
        if pp.mode is GraphMode.DISABLED or not pp.captured:
            raise ValueError(f"the plan captures no {pp.phase} graphs ({pp.mode}): run that "
                             "phase eagerly")
        first = pp.captured[0]
        modes = {s.forward_mode: int(s.query_len or 0) for s in pp.captured}
        options.setdefault("max_seq_len", max(s.max_seq_len for s in pp.captured))
        if first.keyed_by_tokens:
            options.setdefault("max_requests", first.max_requests)
        return cls(backend, pool, phase=pp.phase, mode=pp.mode, buckets=first.buckets(),
                   gate=gate, forward_modes=modes, **options)

    # -- shapes ------------------------------------------------------------------------
    def _keys(self) -> list[BucketKey]:
        return [(fm, b) for fm in self.forward_modes for b in self.buckets]

    def _shape(self, key: BucketKey) -> tuple[int, int]:
        """(bs, num_tokens) the backend captures for ``key``."""
        fm, b = key
        if fm is ForwardMode.EXTEND:
            return min(b, self.max_requests or min(b, 64)), b
        return b, b * self.forward_modes[fm]

    def shape(self, key: BucketKey) -> tuple[int, int]:
        """The captured ``(bs, num_tokens)`` of bucket ``key``."""
        return self._shapes[key]

    @property
    def keys(self) -> list[BucketKey]:
        """Every captured bucket, largest first (the capture order)."""
        return sorted(self._shapes, key=lambda k: (self._shapes[k][1], self._shapes[k][0]),
                      reverse=True)

    @property
    def index_layout(self) -> IndexLayout | None:
        """The layout of the graph buffers' index tensors: build each step's batch in it
        (``decode_batch(pool, lens, layout=session.index_layout)``) and every replay
        copies the batch's metadata with one device copy (:meth:`GraphState.fill`).

        Allocates the backend's graph state if :meth:`capture` has not yet; None
        under TC_PIECEWISE (attention runs eagerly: no graph buffers).
        """
        self.init_graph_state()
        state = self.backend.graph_state
        return None if self.mode is GraphMode.TC_PIECEWISE or state is None else state.layout

    @property
    def index_buffer(self) -> IndexBuffer | None:
        """The graph buffers' own index buffer: build each step's batch into it
        (``decode_batch(pool, lens, layout=session.index_buffer)``) and a replay copies
        nothing, the batch's index tensors being the ones the graph reads.

        One batch at a time: packing the next (or replaying a batch built
        elsewhere, which copies it in) overwrites the one held, which is then
        refused if run (``PackedIndices.overwritten``).  An engine that builds
        the next batch before launching the current one uses :attr:`index_layout`.
        None under TC_PIECEWISE, as :attr:`index_layout`.
        """
        self.init_graph_state()
        state = self.backend.graph_state
        return (None if self.mode is GraphMode.TC_PIECEWISE or state is None
                else state.index_buffer)

    def graph(self, key: BucketKey) -> CapturedGraph:
        """The captured graph of ``key``."""
        try:
            return self._graphs[key]
        except KeyError:
            raise SessionError(f"no graph captured for {key[0]} bucket {key[1]}; captured: "
                               f"{[(str(m), b) for m, b in self._graphs]}") from None

    def _allocate(self, max_kv_rows: int) -> StaticBuffers:
        cfg = self.backend.config
        rows = max(nt for _, nt in self._shapes.values())
        dev = self.pool.device
        qdt = torch_dtype(cfg.q_dtype)
        # an fp8 q's outputs and new KV rows are the model's bf16 (output_dtype)
        odt = output_dtype(qdt)
        heads = cfg.num_heads
        mla = self.method is ForwardMethod.MLA
        qk = cfg.kv_row_dim if mla else cfg.mha_head_dims[0]
        dv = cfg.kv_lora_rank if mla else cfg.mha_head_dims[1]

        def zeros(*shape: int, dtype: torch.dtype = qdt) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        n = self.layers
        statics = StaticBuffers(
            qs=[zeros(rows, heads, qk) for _ in range(n)],
            latents=[zeros(rows, cfg.kv_lora_rank, dtype=odt) for _ in range(n)]
            if self.writes_kv else [],
            ropes=[zeros(rows, cfg.qk_rope_head_dim, dtype=odt) for _ in range(n)]
            if self.writes_kv else [],
            outs=[zeros(rows, heads, dv, dtype=odt) for _ in range(n)],
            q_scales=[torch.ones(1, dtype=torch.float32, device=dev) for _ in range(n)]
            if qdt == torch.float8_e4m3fn else [])
        if not mla:
            statics.k = zeros(max_kv_rows, heads, cfg.mha_head_dims[0])
            statics.v = zeros(max_kv_rows, heads, cfg.mha_head_dims[1])
        return statics

    def _check_gate(self, gate: ReplayGate) -> None:
        """The gate's plan must capture no bucket this session lacks (else it would answer
        a replay no graph serves)."""
        for fm in self.forward_modes:
            shapes = gate.shapes_for(fm)
            if shapes is None:
                continue
            missing = sorted(set(shapes.buckets()) - set(self.buckets))
            if missing:
                raise SessionError(
                    f"the gate's plan replays {fm} batches at buckets {list(shapes.buckets())}, "
                    f"this session captures {list(self.buckets)}: {missing} would be answered "
                    "with no graph behind them; build the session from the plan's buckets")
            if fm in SPECULATIVE_MODES and shapes.query_len not in (None,
                                                                     self.forward_modes[fm]):
                raise SessionError(
                    f"the gate's plan captures {fm} with {shapes.query_len} tokens per "
                    f"sequence, this session with {self.forward_modes[fm]}")

    # -- capture -----------------------------------------------------------------------
    def init_graph_state(self) -> None:
        """``init_cuda_graph_state`` for the largest bucket (once; :meth:`capture` calls it).

        Skipped when the backend's graph state (another session's) already covers
        this phase, mode and bounds: sessions of one backend then share it.
        TC_PIECEWISE captures no attention, so it allocates nothing.
        """
        if self._state_ready or self.mode is GraphMode.TC_PIECEWISE:
            self._state_ready = True
            return
        max_bs = max(bs for bs, _ in self._shapes.values())
        max_tokens = max(max(nt for _, nt in self._shapes.values()), max_bs)
        state = self.backend.graph_state
        if (state is not None and state.graph_modes.get(self.phase) is self.mode
                and state.sparse is self.sparse and state.max_bs >= max_bs
                and state.max_num_tokens >= max_tokens and state.max_seq_len >= self.max_seq_len):
            # another session of this backend allocated state that covers this one: a new
            # init_cuda_graph_state would drop the metadata its graphs replay with
            self._state_ready = True
            return
        with capturing(self.mode):
            self.backend.init_cuda_graph_state(max_bs, max_tokens, max_seq_len=self.max_seq_len,
                                               graph_modes={self.phase: self.mode},
                                               sparse=self.sparse)
        self._state_ready = True

    def bind(self, key: BucketKey, batch: ForwardBatch | None = None) -> None:
        """``init_forward_metadata_capture`` of bucket ``key`` (``batch``: a representative
        batch that fits it; None: the backend's dummy batch)."""
        self.init_graph_state()
        if self.mode is GraphMode.TC_PIECEWISE:
            if batch is None:
                raise SessionError("TC_PIECEWISE runs attention eagerly at capture: give a "
                                   f"capture batch for {key[0]} bucket {key[1]}")
            self._piecewise_batch = batch
            return
        bs, nt = self._shapes[key]
        self.backend.init_forward_metadata_capture(bs, nt, batch=batch, forward_mode=key[0])

    def warm_up(self, key: BucketKey, times: int = 1) -> None:
        """Run bucket ``key``'s captured function eagerly under ``capturing(mode)`` (on CUDA
        on a side stream), after :meth:`bind`: kernels compile outside the graph."""
        self.runner.warm_up(self._function(key), self.mode, times)

    def record(self, key: BucketKey, *, warmup: int | None = None) -> CapturedGraph:
        """Record bucket ``key`` (after :meth:`bind`); ``warmup``: side-stream runs first."""
        # a warm-up's kept outputs are let go before the capture, not freed inside it
        self._kernel_outs.pop(key, None)
        self._outs_by_rows.clear()
        if self.mode is GraphMode.TC_PIECEWISE:
            pieces: list[Callable[[], object] | EagerStep] = [
                EagerStep(self._function(key, attention_only=True), "attention")]
            if self.after_attention is not None:
                after = self.after_attention
                step = self._graph_step(key)
                pieces.append(lambda: after(step))
            graph = self.runner.capture_pieces(pieces, self.mode, key=self._runner_key(key),
                                               warmup=warmup)
        else:
            graph = self.runner.capture(self._function(key), self.mode,
                                        key=self._runner_key(key), warmup=warmup)
        self._graphs[key] = graph
        return graph

    def capture(self, batches: Mapping[BucketKey | int, ForwardBatch] | None = None,
                inputs: Mapping[BucketKey | int, StepInputs] | None = None
                ) -> dict[BucketKey, CapturedGraph]:
        """Capture every bucket, largest first; return the graphs by key.

        ``batches``: a representative batch per bucket (keyed by ``(forward
        mode, bucket)`` or, for the session's one forward mode, the bucket);
        default the backend's dummy batch (required under TC_PIECEWISE).
        ``inputs``: what the static inputs hold while capturing (default zeros).
        """
        batches = batches or {}
        inputs = inputs or {}
        self.init_graph_state()
        for key in self.keys:
            batch = self._lookup(batches, key)
            given = self._lookup(inputs, key)
            if given is not None:
                self.load(key, given)
            self.bind(key, batch)
            self.record(key)
        return dict(self._graphs)

    def _lookup(self, table: Mapping[Any, Any], key: BucketKey) -> Any:
        if key in table:
            return table[key]
        if len(self.forward_modes) == 1:
            return table.get(key[1])
        return None

    def _runner_key(self, key: BucketKey) -> tuple[str, str, int]:
        # a shared runner holds every session's graphs: the phase keeps them apart
        return (str(self.phase), str(key[0]), key[1])

    # -- the captured function -----------------------------------------------------------
    def _views(self, rows: int) -> tuple[StepInputs, list[torch.Tensor]]:
        """The first ``rows`` rows of the static inputs and outputs."""
        s = self.statics
        assert s is not None

        def first(t: torch.Tensor) -> torch.Tensor:
            # the whole buffer is handed over itself, not as a view: a backend that
            # releases a tensor it was given (set_) then releases the session's own
            # storage, which the conformance suite's storage check sees
            return t if rows == t.shape[0] else t[:rows]

        inputs = StepInputs([first(q) for q in s.qs],
                            [first(t) for t in s.latents] if s.latents else [],
                            [first(t) for t in s.ropes] if s.ropes else [], s.k, s.v,
                            list(s.q_scales))
        return inputs, [first(o) for o in s.outs]

    def _graph_step(self, key: BucketKey, batch: ForwardBatch | None = None,
                    rows: int | None = None) -> SessionStep:
        """The step of bucket ``key`` over the static views (``rows`` of them)."""
        if self.statics is None:
            return SessionStep(self, key[0], batch, None, None, key[1])
        inputs, outs = self._views(self._shapes[key][1] if rows is None else rows)
        return SessionStep(self, key[0], batch, inputs, outs, key[1])

    def _function(self, key: BucketKey, attention_only: bool = False) -> Callable[[], None]:
        """What is captured for ``key``: the step over the static views, then the caller's
        ``after_attention`` (under TC_PIECEWISE: the eager attention alone)."""
        if self.mode is GraphMode.TC_PIECEWISE:
            def piecewise() -> None:
                batch = self._piecewise_batch
                assert batch is not None, "bind() or _replay_metadata() sets it"
                self.backend.init_forward_metadata(batch)
                step = self._graph_step(key, batch, batch.num_tokens)
                self._step_fn(step)
                if self.statics is not None:  # the rows the after piece reads as padding
                    for out in self.statics.outs:
                        out[batch.num_tokens:self._shapes[key][1]].zero_()
                if not attention_only and self.after_attention is not None:
                    self.after_attention(self._graph_step(key))
            return piecewise
        step = self._graph_step(key)
        after = self.after_attention
        if self.kernel_outputs:
            bare = replace(step, outputs=None)  # the backend returns its kernel's outputs

            def captured_own() -> None:
                outs = self._kernel_outs[key] = self._step_outputs(key, self._step_fn(bare))
                # views of earlier outputs are stale (capture; a re-run without device graphs)
                self._outs_by_rows.clear()
                if after is not None:
                    after(replace(step, outputs=outs))
            return captured_own

        def captured() -> None:
            self._step_fn(step)
            if after is not None:
                after(step)
        return captured

    def _step_outputs(self, key: BucketKey, outs: Any) -> list[torch.Tensor]:
        """What a step of a ``kernel_outputs`` session returned: every layer's output of
        the bucket's rows (refused otherwise: a replay would hand back nothing)."""
        rows = self._shapes[key][1]
        if isinstance(outs, list) and len(outs) == self.layers and all(
                isinstance(o, torch.Tensor) and o.shape[0] == rows for o in outs):
            return outs
        raise SessionError(
            f"the session keeps its backend's own outputs (kernel_outputs=True), but the "
            f"step of {key[0]} bucket {key[1]} returned {type(outs).__name__}, not "
            f"{self.layers} tensors of {rows} rows: return every layer's output from the "
            "step (GraphSession.attend does), or build the session with kernel_outputs=False")

    @staticmethod
    def attend(step: SessionStep) -> list[torch.Tensor]:
        """The default step: one forward per layer (``layer_id`` 0, 1, ...) of the session,
        into ``step.outputs`` (None: what the backend returns); every layer's output."""
        ses, inputs = step.session, step.inputs
        assert inputs is not None
        outs = step.outputs or [None] * ses.layers
        done: list[torch.Tensor] = []
        for i in range(ses.layers):
            latent = inputs.latent_new[i] if ses.writes_kv else None
            rope = inputs.rope_new[i] if ses.writes_kv else None
            if step.forward_mode is ForwardMode.DECODE:
                done.append(ses.backend.forward_decode(
                    inputs.q[i], latent, rope, ses.pool, step.batch, out=outs[i], layer_id=i,
                    q_scale=inputs.q_scale[i]))
            else:
                done.append(ses.backend.forward_extend(
                    inputs.q[i], latent, rope, ses.pool, step.batch, method=ses.method,
                    k=inputs.k, v=inputs.v, out=outs[i], layer_id=i, q_scale=inputs.q_scale[i]))
        return done

    # -- run ---------------------------------------------------------------------------
    def decide(self, batch: ForwardBatch, facts: ReplayBatch | None = None
               ) -> tuple[bool, int | None, ReplayReason]:
        """(replay?, bucket, reason) for ``batch``: the gate's answer (one question per step).

        ``facts``: the engine's own :class:`ReplayBatch` (with LoRA, embeddings,
        logprobs...); default :func:`replay_batch` of ``batch``.
        """
        packed = batch.packed
        return self._decide(batch, facts, packed is not None and packed.serves(batch))

    def _decide(self, batch: ForwardBatch, facts: ReplayBatch | None, served: bool
                ) -> tuple[bool, int | None, ReplayReason]:
        """:meth:`decide`, told whether ``batch.packed`` serves the batch (asked once a step)."""
        if served and facts is None and self.gate is None:
            return self._packed_decision(batch, batch.packed)  # type: ignore[arg-type]
        rb = facts if facts is not None else replay_batch(batch)
        if self.gate is not None:
            ok, reason = self.gate.can_replay(rb)
            if not ok:
                return False, None, reason
            bucket = self.gate.bucket_for(rb)
            if bucket is None or (rb.forward_mode, bucket) not in self._graphs:
                raise SessionError(
                    f"the gate replays this {rb.forward_mode} batch at bucket {bucket}, which "
                    f"this session did not capture (captured: "
                    f"{[(str(m), b) for m, b in sorted(self._graphs)]})")
            return True, bucket, reason
        return self._own_decision(rb)

    def _packed_decision(self, batch: ForwardBatch, packed: PackedIndices
                         ) -> tuple[bool, int | None, ReplayReason]:
        """:meth:`_own_decision` of a batch built in an index layout, from the lengths'
        summary made when it was packed, remembered per distinct answer's facts.

        The session's own decision reads only the forward mode, the request and
        token counts, whether the longest sequence fits, and (speculative modes)
        the fewest and most new tokens of a request; the key is exactly those, so
        a remembered answer is the one :meth:`_own_decision` gives (a property
        test compares the two).  This per-step question then costs a dict lookup
        instead of building a ``ReplayBatch``.
        """
        tokens, longest, fewest, most = packed.summary
        fm = batch.forward_mode
        key = (fm, len(packed.host_lens[0]), tokens,
               longest if longest > self.max_seq_len else 0,
               (fewest, most) if fm in SPECULATIVE_MODES else None)
        answer = self._decisions.get(key)
        if answer is None:
            if len(self._decisions) >= _MAX_REMEMBERED_DECISIONS:
                self._decisions.clear()
            answer = self._decisions[key] = self._own_decision(replay_batch(batch))
        return answer

    def _own_decision(self, rb: ReplayBatch) -> tuple[bool, int | None, ReplayReason]:
        """Without a gate: replay whenever a captured bucket holds the batch."""
        fm = rb.forward_mode
        if fm not in self.forward_modes:
            rule = "gate.spec_forward_mode" if fm in SPECULATIVE_MODES else "gate.phase_disabled"
            return False, None, ReplayReason(rule, f"this session captured no {fm} graphs "
                                             f"(it captures {[str(m) for m in self.forward_modes]})")
        if fm is ForwardMode.EXTEND:
            tokens = rb.tokens or 0
            bucket = smallest_bucket(tokens, self.buckets)
            if bucket is None:
                return False, None, ReplayReason(
                    "gate.num_tokens_above_max",
                    f"{tokens} tokens exceed the largest captured bucket ({self.buckets[-1]})")
            if rb.batch_size > self._shapes[(fm, bucket)][0]:
                return False, None, ReplayReason(
                    "gate.batch_slots", f"{rb.batch_size} requests exceed the "
                    f"{self._shapes[(fm, bucket)][0]} the {bucket}-token graph holds")
        else:
            bucket = smallest_bucket(rb.batch_size, self.buckets)
            if bucket is None:
                return False, None, ReplayReason(
                    "gate.batch_slots", f"{rb.batch_size} requests exceed the "
                    f"{self.buckets[-1]} captured {fm} slots")
            q = self.forward_modes[fm]
            lens = set(rb.extend_lens)
            if fm is ForwardMode.TARGET_VERIFY and lens and lens != {q}:
                return False, None, ReplayReason(
                    "gate.spec_query_len", f"verify graphs are captured for {q} tokens per "
                    f"sequence; this batch has {sorted(lens)}")
            if fm is ForwardMode.DRAFT_EXTEND and lens and max(lens) > q:
                return False, None, ReplayReason(
                    "gate.spec_query_len", f"draft-extend graphs are captured for 1..{q} "
                    f"tokens per sequence; this batch has up to {max(lens)}")
        longest = rb.max_seq_len
        if longest is not None and longest > self.max_seq_len:
            return False, None, ReplayReason(
                "gate.seq_len_above_max", f"a sequence of {longest} tokens exceeds the "
                f"{self.max_seq_len} the graphs were captured for")
        return True, bucket, ReplayReason("gate.ok", "the batch replays a captured graph")

    def run(self, batch: ForwardBatch, inputs: StepInputs | None = None, *,
            facts: ReplayBatch | None = None, agreed: AgreedStep | None = None) -> StepResult:
        """One step: ask the gate, then replay the bucket (padded) or run eagerly.

        ``inputs``: this step's attention inputs (real rows); None when the
        caller's own step reads its own tensors (``step=``), or the static
        inputs already hold them.  ``agreed``: what the data-parallel group
        agreed for this step (:func:`attnreg.graph_policy.sync` of
        ``gate.facts(...)``): replay at its bucket, or run eagerly when another
        rank could not replay (counted as :data:`SYNC_EAGER`).  Counted in
        :attr:`counts` by rule id.

        Raises
        ------
        SessionError
            When the group agreed to replay a batch this rank's gate refuses, or
            at a bucket this session did not capture (the ranks' plans differ).
        """
        packed = batch.packed
        served = packed is not None and packed.serves(batch)  # asked once for the step
        ok, bucket, reason = self._decide(batch, facts, served)
        rule = reason.rule
        if agreed is not None:
            if agreed.replay and not ok:
                raise SessionError(f"the data-parallel group agreed to replay this step, but "
                                   f"this rank's gate refuses it ({reason}): the ranks were "
                                   "asked about different facts or plans")
            if agreed.replay:
                bucket = agreed.bucket
                if bucket is None or (batch.forward_mode, bucket) not in self._graphs:
                    raise SessionError(
                        f"the data-parallel group agreed on {batch.forward_mode} bucket "
                        f"{bucket}, which this session did not capture (captured "
                        f"{list(self.buckets)}): the ranks' plans differ")
            elif ok:
                ok, rule = False, SYNC_EAGER
        if ok:
            assert bucket is not None
            # a served packed batch's token count was summed when it was packed
            rows = packed.summary[0] if served else batch.num_tokens  # type: ignore[union-attr]
            outputs = self._replay_at((batch.forward_mode, bucket), batch, inputs, rows)
        else:
            outputs = self.eager(batch, inputs)
        self.counts.record(ok, rule)
        return StepResult(outputs, ok, bucket if ok else None, reason, rule)

    def replay(self, batch: ForwardBatch, inputs: StepInputs | None = None, *,
               bucket: int | None = None) -> list[torch.Tensor]:
        """Replay ``batch`` through bucket ``bucket`` (default: the smallest that holds it),
        asking no gate; every layer's output rows of the batch (views of the static outputs).

        Raises
        ------
        SessionError
            When no captured bucket holds the batch.
        """
        fm = batch.forward_mode
        if bucket is None:
            size = batch.num_tokens if fm is ForwardMode.EXTEND else batch.batch_size
            bucket = smallest_bucket(size, self.buckets)
            if bucket is None:
                raise SessionError(f"no captured {fm} bucket holds {size} "
                                   f"({'tokens' if fm is ForwardMode.EXTEND else 'requests'}); "
                                   f"captured {list(self.buckets)}")
        packed = batch.packed
        # a served packed batch's token count was summed when it was packed (host time of a
        # step, issue 26); else the batch's own
        rows = (packed.summary[0] if packed is not None and packed.serves(batch)
                else batch.num_tokens)
        return self._replay_at((fm, bucket), batch, inputs, rows)

    def _replay_at(self, key: BucketKey, batch: ForwardBatch, inputs: StepInputs | None,
                   rows: int) -> list[torch.Tensor]:
        """:meth:`replay` at ``key`` for a batch of ``rows`` query rows."""
        graph = self.graph(key)
        if inputs is not None:
            self.load(key, inputs)
        self._replay_metadata(key, batch)
        graph.replay()
        if self.statics is None:
            return []
        return self._out_views(key, rows)

    def outputs(self, key: BucketKey) -> list[torch.Tensor]:
        """Every layer's whole output of bucket ``key``: the rows its graph writes (padding
        rows included), where each replay of it leaves them.  The static outputs' first
        rows, or under :attr:`kernel_outputs` the tensors its captured step returned (the
        last warm-up's before capture).

        Raises
        ------
        SessionError
            Without static outputs (``static_inputs=False``), or under
            :attr:`kernel_outputs` before the bucket's step ran under capture.
        """
        if self.statics is None:
            raise SessionError("this session has no static outputs (static_inputs=False): "
                               "its step writes tensors of its own")
        if not self.kernel_outputs:
            rows = self._shapes[key][1]
            return [o if o.shape[0] == rows else o[:rows] for o in self.statics.outs]
        try:
            return list(self._kernel_outs[key])
        except KeyError:
            raise SessionError(f"{key[0]} bucket {key[1]} has no outputs yet: the session "
                               "keeps the backend's own (kernel_outputs=True), which its "
                               "warm-up or capture returns") from None

    def _out_views(self, key: BucketKey, rows: int) -> list[torch.Tensor]:
        """The first ``rows`` rows of every output of bucket ``key``, made once: the
        outputs never move, so the views stay valid (and each replay skips a slice per
        layer).  The static outputs serve every bucket alike."""
        at = (key if self.kernel_outputs else None, rows)
        views = self._outs_by_rows.get(at)
        if views is None:
            views = self._outs_by_rows[at] = [o[:rows] for o in self.outputs(key)]
        return list(views)

    def _replay_metadata(self, key: BucketKey, batch: ForwardBatch) -> None:
        """The one place a replay's metadata is prepared: the backend's
        ``init_forward_metadata_replay`` (one device copy for a batch in
        :attr:`index_layout`, plus whatever host planning the backend needs)."""
        if self.mode is GraphMode.TC_PIECEWISE:
            self._piecewise_batch = batch  # the eager attention plans it when it runs
            return
        bs, nt = self._shapes[key]
        fm = key[0]  # passed only when it differs: the backend then parses nothing
        self.backend.init_forward_metadata_replay(
            bs, nt, batch, forward_mode=None if fm is batch.forward_mode else fm)

    def eager(self, batch: ForwardBatch, inputs: StepInputs | None = None
              ) -> list[torch.Tensor]:
        """Run ``batch`` eagerly (``init_forward_metadata`` + the step); the outputs.

        With ``inputs`` the step attends them and the backend allocates the
        outputs; without, the first rows of the static inputs (which must hold
        the batch) are attended into the static outputs.
        """
        fm = batch.forward_mode
        self.backend.init_forward_metadata(batch)
        if inputs is not None:
            self._check_inputs(inputs)
            if self._step_fn is GraphSession.attend:  # what the backend allocates
                return GraphSession.attend(SessionStep(self, fm, batch, inputs, None))
            self._step_fn(SessionStep(self, fm, batch, inputs, None))
            return []
        if self.statics is None:
            self._step_fn(SessionStep(self, fm, batch, None, None))
            return []
        rows, have = batch.num_tokens, self.statics.qs[0].shape[0]
        if rows > have:
            raise SessionError(f"an eager step of {rows} rows needs its inputs: the static "
                               f"ones hold {have}")
        views, outs = self._views(rows)
        self._step_fn(SessionStep(self, fm, batch, views, outs))
        return outs

    # -- inputs ------------------------------------------------------------------------
    def _check_inputs(self, inputs: StepInputs | None) -> None:
        if inputs is None:
            return
        if self._step_fn is GraphSession.attend and inputs.layers != self.layers:
            raise SessionError(f"inputs for {inputs.layers} layers, the session attends "
                               f"{self.layers}")

    def _check_query_scales(self, inputs: StepInputs) -> None:
        """A graph's static q is fp8 with a static scale exactly when the session's config
        says so: a copy would otherwise cast a 16-bit q to fp8 without a scale (or drop an
        fp8 q's scale), and a missing scale would leave the previous step's in place."""
        fp8 = bool(self.statics is not None and self.statics.q_scales)
        for i, (q, scale) in enumerate(zip(inputs.q, inputs.q_scale)):
            if (q.dtype == torch.float8_e4m3fn) != fp8 or (scale is None) == fp8:
                want = ("an fp8 q with its float32 q_scale" if fp8 else
                        f"a {torch_dtype(self.backend.config.q_dtype)} q and no q_scale")
                got = f"a {q.dtype} q " + ("without" if scale is None else "with") + \
                    " a q_scale"
                raise SessionError(f"layer {i}: {got}; this session's config (q_dtype "
                                   f"{self.backend.config.q_dtype}) takes {want}")

    def load(self, key: BucketKey, inputs: StepInputs) -> None:
        """Copy ``inputs`` into the static inputs of bucket ``key``; zero its padding rows
        (what :meth:`replay` does first; for a caller that warms up or captures itself)."""
        s = self.statics
        if s is None:
            return
        self._check_inputs(inputs)
        rows = self._shapes[key][1]
        n = inputs.rows
        if n > rows:
            raise SessionError(f"{n} input rows do not fit the {rows} rows of {key[0]} "
                               f"bucket {key[1]}")
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = list(zip(s.qs, inputs.q))
        if s.latents:
            pairs += list(zip(s.latents, inputs.latent_new)) + list(zip(s.ropes,
                                                                         inputs.rope_new))
        self._check_query_scales(inputs)
        for static, value in pairs:
            if value is None:
                continue
            static[:n].copy_(value)
            static[n:rows].zero_()
        for static_scale, value_scale in zip(s.q_scales, inputs.q_scale):
            if value_scale is not None:  # a scale is a value, not rows: nothing to pad
                static_scale.copy_(value_scale.reshape(static_scale.shape))
        for static_kv, value_kv in ((s.k, inputs.k), (s.v, inputs.v)):
            if static_kv is not None and value_kv is not None:
                t = value_kv.shape[0]
                static_kv[:t].copy_(value_kv)
                static_kv[t:].zero_()

    def __repr__(self) -> str:
        modes = ", ".join(f"{m}x{q}" if m in SPECULATIVE_MODES else str(m)
                          for m, q in self.forward_modes.items())
        return (f"GraphSession({self.backend.name}, {self.phase}/{self.mode}, {modes}, "
                f"buckets={list(self.buckets)}, layers={self.layers}, "
                f"captured={len(self._graphs)})")

