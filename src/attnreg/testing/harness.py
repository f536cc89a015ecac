"""Runs one claim against one backend and raises :class:`ClaimRefuted` when it does not hold.

Imported lazily by the pytest plugin (it imports torch and the runtime).
Every check drives the backend only through the public runtime interface of
``docs/runtime.md``, as an engine would; nothing reaches into a backend.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections.abc import Iterator, Sequence

import torch

from attnreg.graph_policy.capture import capturing, recording_served
from attnreg.registry import (
    BackendRegistry,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    Platform,
    SupportKind,
    UnsupportedError,
)
from attnreg.runtime import (
    AttentionBackend,
    EagerStep,
    GraphRunner,
    MLAConfig,
    MLAKVPool,
    output_dtype,
)

from .batches import BatchSpec, batch_spec, chunk_tokens
from .capture_harness import AllocatorChurn, CapturedForward, Served, capture_once
from .checks import CHECKS, KV_RESCALE, GraphOptions
from .claims import Claim, Combo, kernel_q_rounding
from .errors import ClaimRefuted, HarnessLimitation
from .integrity import InputGuard, kv_problems
from .timelimit import stage
from .workload import (
    Workload,
    compare,
    compare_lse,
    make_config,
    make_layer_workloads,
    make_pool,
    make_workload,
)

__all__ = ["Harness"]

#: Host scales of the BREAKABLE eager region, per replay (powers of two: exact).
_HOST_SCALES = (1.0, 0.5, 2.0, 0.25, 4.0)


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.rsplit('/', 2)[-1] if '/' in f.filename else f.filename}:{f.lineno} " \
           f"in {f.name}"


@contextlib.contextmanager
def explained(what: str) -> Iterator[None]:
    """Turn anything a backend raises while running a *declared* input into ClaimRefuted.

    ``what`` is also reported as the claim's current stage (a time limit names it).
    """
    stage(what)
    try:
        yield
    except (ClaimRefuted, HarnessLimitation):
        raise
    except UnsupportedError as exc:
        raise ClaimRefuted(f"{what}: refused an input its declaration accepts: {exc}") from exc
    except AssertionError as exc:
        raise ClaimRefuted(
            f"{what}: an assertion fired inside the backend or its kernel library "
            f"({_where(exc)}: {str(exc) or 'AssertionError'}); a backend must refuse inputs "
            "it cannot run with UnsupportedError before launching, or declare less") from exc
    except Exception as exc:
        raise ClaimRefuted(f"{what}: raised {type(exc).__name__} ({_where(exc)}): {exc}") from exc


class Harness:
    """Checks claims on one device.

    Parameters
    ----------
    registry
        Where backends are created (``registry.create(name, config)``).
    device
        ``cpu`` or ``cuda``; also selects the batch-size profile.
    platform
        The platform the declarations were evaluated on.
    """

    def __init__(self, registry: BackendRegistry, device: str, platform: Platform) -> None:
        self.registry = registry
        self.device = device
        self.platform = platform
        self.profile = "cpu" if device == "cpu" else "cuda"
        self.real_graphs = device == "cuda"
        #: per-row q gains every workload this harness builds gets (None: plain N(0, 1)
        #: queries); set for one check with :meth:`query_gains`
        self.q_gains: tuple[float, ...] | None = None

    @contextlib.contextmanager
    def query_gains(self, gains: Sequence[float]) -> Iterator[None]:
        """Every workload built inside gets ``make_workload(..., q_gains=gains)``: the
        same procedures (eager, capture path, graphs, piecewise) on large queries."""
        before, self.q_gains = self.q_gains, tuple(gains)
        try:
            yield
        finally:
            self.q_gains = before

    # ------------------------------------------------------------------------------
    def run(self, claim: Claim) -> None:
        """Check ``claim``; raise ClaimRefuted (or pytest's skip) when it does not hold."""
        try:
            self.check(claim)
        except HarnessLimitation as exc:
            import pytest

            pytest.skip(f"harness limitation: {exc}")

    def check(self, claim: Claim) -> None:
        """Check ``claim``; raise ClaimRefuted, or HarnessLimitation when it cannot be
        checked here (no pytest involved: what a claim worker runs)."""
        self._dispatch(claim)

    def _dispatch(self, claim: Claim) -> None:
        check = CHECKS.get(claim.check)
        if check is None or claim.kind not in check.kinds:
            raise HarnessLimitation(f"nothing to run for a {claim.kind} {claim.check} claim")
        check.run(self, claim)

    # ------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------
    def create(self, claim: Claim, config: MLAConfig) -> AttentionBackend:
        with explained(f"creating {claim.backend} for {config}"):
            return self.registry.create(claim.backend, config, platform=self.platform)

    def specs(self, names: Sequence[str], query_len: int | None = None) -> list[BatchSpec]:
        return [batch_spec(n, self.profile, query_len) for n in names]

    def claim_specs(self, claim: Claim, names: Sequence[str] | None = None) -> list[BatchSpec]:
        """The claim's batch specs (speculative ones at its draft tokens per sequence)."""
        return self.specs(claim.batches if names is None else names, claim.query_len)

    def workload(self, config: MLAConfig, pool: MLAKVPool, spec: BatchSpec,
                 method: ForwardMethod, *, seed: int, **kwargs: object) -> Workload:
        """:func:`make_workload`, with this profile's prefix chunk size for chunked MHA."""
        if method is ForwardMethod.MHA_CHUNKED_KV:
            kwargs.setdefault("chunk_tokens", chunk_tokens(self.profile))
        if self.q_gains is not None and method is ForwardMethod.MLA:
            kwargs.setdefault("q_gains", self.q_gains)
        return make_workload(config, pool, spec, method, seed=seed, **kwargs)  # type: ignore[arg-type]

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def eager_forward(backend: AttentionBackend, work: Workload, pool: MLAKVPool, *,
                      return_lse: bool = False, plan: bool = True) -> torch.Tensor:
        """One eager forward of ``work`` (its forward mode, method and layer), as an engine
        calls it; ``(out, lse)`` with ``return_lse``.  ``plan=False`` reuses the plan of
        the batch already made (every layer after the first of a step)."""
        if plan:
            backend.init_forward_metadata(work.batch)
        if work.batch.forward_mode is ForwardMode.DECODE:
            return backend.forward_decode(work.q, work.latent_new, work.rope_new, pool,
                                          work.batch, layer_id=work.layer_id,
                                          return_lse=return_lse, q_scale=work.q_scale)
        extra: dict[str, object] = {}
        if work.method is ForwardMethod.MHA_CHUNKED_KV:
            extra = {"decompress": work.decompress, "chunk_tokens": work.chunk_tokens}
        return backend.forward_extend(work.q, work.latent_new, work.rope_new, pool, work.batch,
                                      method=work.method, k=work.k, v=work.v,
                                      layer_id=work.layer_id, return_lse=return_lse,
                                      q_scale=work.q_scale, **extra)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------
    # eager correctness
    # ------------------------------------------------------------------------------
    def check_eager(self, claim: Claim, *, with_lse: bool = False, layers: int = 1) -> None:
        """Each batch of the claim, eagerly: output (and LSE) against the oracle, KV
        integrity, inputs unchanged; ``layers`` > 1: one plan per step over that many
        pool layers."""
        combo = _combo(claim)
        config = make_config(combo, self.device)
        specs = self.claim_specs(claim)
        backend = self.create(claim, config)
        if layers > 1:
            self._check_multi_layer_eager(claim, backend, config, specs, layers)
            return
        pool = make_pool(config, specs)
        problems: list[str] = []
        q_compute = kernel_q_rounding(backend.capabilities, combo)
        for i, spec in enumerate(specs):
            work = self.workload(config, pool, spec, combo.method, seed=100 + i,
                                 **q_compute)
            inputs = InputGuard([work])
            with explained(f"{spec.describe()}, eager"):
                result = self.eager_forward(backend, work, pool, return_lse=with_lse)
                self.sync()
            out = result
            if with_lse:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise ClaimRefuted(f"{spec.describe()}: forward(..., return_lse=True) "
                                       f"returned {type(result).__name__}, not (out, lse)")
                out, lse = result
                assert work.expected_lse is not None
                msg = compare_lse(lse, work.expected_lse, spec)
                if msg:
                    problems.append(msg)
            msg = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
            if msg:
                problems.append(msg)
            problems += kv_problems(pool, [work], f"{spec.name}, eager")
            problems += inputs.problems(f"{spec.describe()}, eager")
        if problems:
            raise ClaimRefuted("; ".join(problems))

    def check_q_rounding(self, claim: Claim) -> None:
        """An eager claim: the output is nearer (mean absolute error over every batch of
        the claim) the oracle of q rounded as the kernel declares than the oracle of q
        rounded the other way (see ``QRounding``), and within the tolerance of the
        declared one.  A wrong rounding is named as such before any tolerance miss."""
        combo = _combo(claim)
        config = make_config(combo, self.device)
        specs = self.claim_specs(claim)
        backend = self.create(claim, config)
        pool = make_pool(config, specs)
        declared = kernel_q_rounding(backend.capabilities, combo)
        dtype, per = declared["q_compute_dtype"], declared["q_compute_scale"]
        other: tuple[DType | None, str] = (None, "batch") if dtype is not None \
            else (DType.FP8_E4M3, "row")
        err_declared = err_other = 0.0
        elements = 0
        misses: list[str] = []
        for i, spec in enumerate(specs):
            work = self.workload(config, pool, spec, combo.method, seed=300 + i,
                                 alt_q_rounding=other, **declared)
            with explained(f"{spec.describe()}, eager"):
                out = self.eager_forward(backend, work, pool)
                self.sync()
            msg = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
            if msg:
                misses.append(msg)
            assert work.expected_alt is not None, "a 16-bit q's absorbed MLA workload"
            got = out.detach().float().cpu()
            if got.shape != work.expected.shape or not bool(torch.isfinite(got).all()):
                continue  # no rounding to tell apart: the tolerance miss says what is wrong
            err_declared += float((got - work.expected).abs().sum())
            err_other += float((got - work.expected_alt).abs().sum())
            elements += got.numel()
        if elements and not err_declared < err_other:
            said = f"q rounded to {dtype} (one scale per {per})" if dtype else "q as given"
            found = f"q rounded to {other[0]}" if other[0] else "q as given"
            fix = (f"declare KernelConstraints.q_compute_dtype={other[0]} (and its "
                   "q_compute_scale), or compute with q as given") if other[0] else \
                "declare no q_compute_dtype, or round q as declared"
            raise ClaimRefuted(
                f"the output is nearer the oracle of {found} (mean |err| "
                f"{err_other / elements:.2e}) than of {said}, as declared "
                f"({err_declared / elements:.2e}), over {elements} output elements: {fix}")
        if misses:
            raise ClaimRefuted("; ".join(misses))

    def _check_multi_layer_eager(self, claim: Claim, backend: AttentionBackend,
                                 config: MLAConfig, specs: Sequence[BatchSpec],
                                 layers: int) -> None:
        """One plan per step, one forward per layer: each layer matches its own oracle, and
        still holds after the later layers ran (an output tensor reused by every call would
        hand an engine that keeps a layer's output, e.g. two-batch overlap, another's)."""
        combo = _combo(claim)
        pool = make_pool(config, specs, num_layers=layers)
        problems: list[str] = []
        q_compute = kernel_q_rounding(backend.capabilities, combo)
        for i, spec in enumerate(specs):
            works = make_layer_workloads(config, pool, spec, combo.method, seed=500 + 10 * i,
                                         **q_compute)
            backend.init_forward_metadata(works[0].batch)
            planned = backend.forward_metadata
            held: list[tuple[torch.Tensor, torch.Tensor]] = []
            for work in works:
                inputs = InputGuard([work])
                with explained(f"{spec.describe()}, eager, layer {work.layer_id}"):
                    out = self.eager_forward(backend, work, pool, plan=False)
                    self.sync()
                # after each layer's forward: a write into another layer is named as such
                when = f"{spec.name}, eager, forward of layer {work.layer_id}"
                problems += kv_problems(pool, [work], when)
                problems += inputs.problems(when)
                if backend.forward_metadata is not planned:
                    problems.append(f"{spec.name}: the forward of layer {work.layer_id} "
                                    "re-planned the step (one plan per step must serve every "
                                    "layer)")
                msg = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
                if msg:
                    problems.append(f"layer {work.layer_id}: {msg}")
                held.append((out, out.clone()))
            for layer, (out, seen) in enumerate(held[:-1]):
                if not torch.equal(out.nan_to_num(), seen.nan_to_num()):
                    problems.append(
                        f"{spec.name}: layer {layer}'s output changed when a later layer's "
                        "forward ran: the backend hands every call the same output tensor, so "
                        "a caller that keeps one layer's output (two-batch overlap, a graph "
                        "session's per-layer outputs) reads another layer's rows; return a "
                        "new output per call (or write into the out= given)")
        if problems:
            raise ClaimRefuted("; ".join(problems))

    # ------------------------------------------------------------------------------
    # refusals
    # ------------------------------------------------------------------------------
    def check_refusal(self, claim: Claim, what: str, *,
                      int64_fields: Sequence[str] = ()) -> None:
        """The claim's undeclared input (``what``, as messages name it; ``int64_fields``:
        these index tensors of the batch as int64) is refused with UnsupportedError."""
        combo = _combo(claim)
        # always the tiny cpu sizes: a refusal must come before any work; several
        # sequences of different lengths, so wrongly read lengths show in the output
        spec = batch_spec("ragged_decode" if combo.phase is Phase.DECODE
                          else "mixed_lengths", "cpu")
        self._expect_refusal(claim, combo, spec, what, int64_fields=int64_fields)

    def _expect_refusal(self, claim: Claim, combo: Combo, spec: BatchSpec, what: str, *,
                        int64_fields: Sequence[str] = ()) -> None:
        stage = "creating the backend"
        try:
            config = make_config(combo, self.device)
            backend = self.registry.create(claim.backend, config, platform=self.platform)
            stage = "building the input"
            pool = make_pool(config, [spec])
            work = self.workload(config, pool, spec, combo.method, seed=7,
                                 q_dtype=combo.q_dtype)
            if int64_fields:
                work = work.with_index_dtype(torch.int64, int64_fields)
            stage = "running it"
            out = self.eager_forward(backend, work, pool)
            self.sync()
        except UnsupportedError:
            return
        except Exception as exc:
            if stage == "building the input":
                raise HarnessLimitation(f"cannot build {what} here: {type(exc).__name__}: "
                                        f"{exc}") from exc
            raise ClaimRefuted(
                f"{spec.name} with {what} (outside the declaration): {stage} raised "
                f"{type(exc).__name__} ({_where(exc)}: {exc}) instead of UnsupportedError; "
                "refuse undeclared inputs in Python before any kernel launch") from exc
        wrong = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
        verdict = (f" and its output is wrong ({wrong})" if wrong
                   else " (its output happens to be right)")
        raise ClaimRefuted(
            f"{spec.name} with {what} (outside the declaration) was accepted without "
            f"UnsupportedError{verdict}; "
            + ("index tensors must be int32: a kernel reading int64 lengths as int32 reads "
               "garbage" if int64_fields else
               "either refuse it before launching or declare it"))

    # ------------------------------------------------------------------------------
    # capture: unsupported modes
    # ------------------------------------------------------------------------------
    def check_refuses_capture(self, claim: Claim) -> None:
        combo = _combo(claim)
        config = make_config(combo, self.device)
        backend = self.create(claim, config)
        phase, mode = combo.phase, claim.graph_mode
        spec = batch_spec("ragged_decode" if phase is Phase.DECODE else "mixed_lengths",
                          self.profile)
        pool = make_pool(config, [spec])
        work = self.workload(config, pool, spec, combo.method, seed=11)
        stage = ("the graph session's capture (init_cuda_graph_state, "
                 "init_forward_metadata_capture, the forward under capture)")
        try:
            capture_once(backend, pool, work, phase=phase, mode=mode, method=combo.method)
        except UnsupportedError:
            return
        except Exception as exc:
            raise ClaimRefuted(
                f"{phase} under {mode} is declared unsupported, but {stage} raised "
                f"{type(exc).__name__} ({_where(exc)}: {exc}) instead of UnsupportedError"
            ) from exc
        raise ClaimRefuted(
            f"{phase} under {mode} is declared unsupported, yet init_cuda_graph_state, "
            "init_forward_metadata_capture and the forward all ran under capturing("
            f"{mode}) without UnsupportedError: an engine trusting the declaration would "
            "never capture it, one that does not would get no warning")

    # ------------------------------------------------------------------------------
    # capture: pinning
    # ------------------------------------------------------------------------------
    def check_pinning(self, claim: Claim) -> None:
        """Under the mode, the pinned method runs (prefix or not) and no other one does."""
        combo = _combo(claim)
        pinned = claim.pinned_method
        assert pinned is not None
        phase, mode = combo.phase, claim.graph_mode
        specs = self.specs(("extend_no_prefix", "extend_with_prefix"))
        config = make_config(combo, self.device)
        backend = self.create(claim, config)
        caps = backend.capabilities
        problems: list[str] = []
        # 1. the pinned method runs and is right, with and without a prefix
        self._run_capture_path(claim, backend, config, specs, pinned)
        # 2. every other declared method is refused under the mode
        others = [m for m in caps.methods(phase) if m is not pinned]
        for method in others:
            pool = make_pool(config, specs[:1])
            work = self.workload(config, pool, specs[0], method, seed=21)
            try:
                capture_once(backend, pool, work, phase=phase, mode=mode, method=method)
                self.sync()
            except UnsupportedError:
                continue
            except Exception as exc:  # noqa: BLE001 - any other error is the finding
                problems.append(f"forward_extend(method={method}) under {mode} raised "
                                f"{type(exc).__name__} ({_where(exc)}: {exc}) instead of "
                                "UnsupportedError")
                continue
            problems.append(
                f"{phase}/{mode} declares {pinned} pinned, but forward_extend(method={method}) "
                f"ran under capturing({mode}) instead of raising UnsupportedError: the "
                f"{method} companion would be captured, and batches with a prefix replayed "
                "through it (seed 000); refuse every other method under a pinning mode")
        if problems:
            raise ClaimRefuted("; ".join(problems))

    # ------------------------------------------------------------------------------
    # capture: FULL / BREAKABLE
    # ------------------------------------------------------------------------------
    def _bounds(self, specs: Sequence[BatchSpec]) -> dict[str, int]:
        return {
            "max_bs": max(s.batch_size for s in specs),
            "max_tokens": max(s.num_tokens for s in specs),
            "max_seq_len": max(s.max_seq_len for s in specs),
            "max_kv_rows": max(sum(s.seq_lens) for s in specs),
        }

    def _captured(self, claim: Claim, backend: AttentionBackend, config: MLAConfig,
                  pool: MLAKVPool, specs: Sequence[BatchSpec], method: ForwardMethod, *,
                  real_graphs: bool, sync_check: bool = False,
                  layers: int = 1) -> CapturedForward:
        """The CapturedForward of ``claim`` (its phase, graph mode and forward mode)."""
        return CapturedForward(backend, config, pool, phase=_combo(claim).phase,
                               mode=claim.graph_mode, method=method, real_graphs=real_graphs,
                               sync_check=sync_check, forward_mode=claim.forward_mode,
                               query_len=claim.query_len, layers=layers,
                               **self._bounds(specs))  # type: ignore[arg-type]

    def _run_capture_path(self, claim: Claim, backend: AttentionBackend, config: MLAConfig,
                          specs: Sequence[BatchSpec], method: ForwardMethod, *,
                          padded: bool = False, rescale: bool = False) -> Served:
        """Drive the capture-mode path without a device graph; refute on any wrong batch.

        Returns what the backend reported served each forward (``note_served_by``).
        """
        mode = claim.graph_mode
        if mode is GraphMode.TC_PIECEWISE:
            return self._piecewise_eager(claim, backend, config, specs, method)
        pool = make_pool(config, list(specs) + [specs[0]])
        captured = self._captured(claim, backend, config, pool, specs, method,
                                  real_graphs=False)
        problems = self._drive(captured, config, pool, specs, method, _combo(claim),
                               label=f"{mode} capture path (no device graph)", padded=padded,
                               rescale=rescale)
        if problems:
            raise ClaimRefuted("; ".join(problems))
        return captured.served

    def _drive(self, captured: CapturedForward, config: MLAConfig, pool: MLAKVPool,
               specs: Sequence[BatchSpec], method: ForwardMethod, combo: Combo, *, label: str,
               churn: AllocatorChurn | None = None, padded: bool = False,
               rescale: bool = False) -> list[str]:
        """prepare -> warm up -> capture -> replay every spec; the problems found.

        ``padded``: the attention output is filled with NaN before each replay and
        every row beyond the batch must come out exactly zero.  ``rescale``: the replays'
        rows are written, and their oracles computed, with every layer's fp8 scale
        multiplied by ``KV_RESCALE``, which ``set_scale`` puts in place only after the
        capture (which ran at the old scales).  A capture of
        several layers gets one workload per layer and batch (one batch, own
        contents per layer) and checks every layer.
        """
        problems: list[str] = []
        layers = captured.layers

        q_compute = kernel_q_rounding(captured.backend.capabilities, combo)

        def build(spec: BatchSpec, seed: int) -> list[Workload]:
            if layers > 1:
                return make_layer_workloads(config, pool, spec, method, seed=seed,
                                            **q_compute)
            return [self.workload(config, pool, spec, method, seed=seed,
                                  **q_compute)]

        # Every input is built (and every prefix written) before capture: nothing the
        # harness needs may be allocated after capture, where a block freed during
        # capture could be handed to it and overwritten by a replay.
        capture_works = build(specs[0], 1)
        capture_scales = pool.scales
        replay_scales = [s * KV_RESCALE for s in capture_scales]
        if rescale:  # the replays' rows and oracles at the scales set after capture
            _set_scales(pool, replay_scales)
        works = [build(spec, 200 + 10 * i) for i, spec in enumerate(specs)]
        if rescale:
            _set_scales(pool, capture_scales)
        # KV integrity and unchanged inputs around every run of the graph: byte copies
        # of the pool (taken as the workloads were built) and of each step's inputs
        inputs = [InputGuard(step) for step in [capture_works, *works]]

        def padded_step(step: list[Workload]) -> bool:
            """Whether the graph pads this step (its padding rows may write page 0): fewer
            sequences or fewer query rows than captured (a draft-extend batch accepts
            fewer tokens than the graph's bs * draft tokens)."""
            return (step[0].spec.batch_size < captured.bs
                    or step[0].rows < captured.num_tokens)

        with explained(f"{label}: preparing the capture ({specs[0].describe()})"):
            captured.prepare(capture_works[0])
        with explained(f"{label}: warm-up run under capturing({captured.mode}) on "
                       f"{specs[0].describe()}"):
            captured.warm_up(capture_works)
        for work, warm in zip(capture_works, captured.layer_outputs(capture_works[0].rows)):
            msg = compare(warm, work.expected, work.tolerance_dtype(combo.q_dtype), specs[0])
            at = f" (layer {work.layer_id})" if layers > 1 else ""
            if msg:
                problems.append(f"warm-up under capture{at}: {msg}")
        problems += kv_problems(pool, capture_works, "warm-up under capture",
                                padding=padded_step(capture_works))
        problems += inputs[0].problems("warm-up under capture")
        with explained(f"{label}: capturing"):
            captured.capture()
        if rescale:
            _set_scales(pool, replay_scales)  # in place: what the graph reads from here on
        for i, (spec, step) in enumerate(zip(specs, works)):
            between = churn.churn if churn is not None else None
            scale = _HOST_SCALES[i % len(_HOST_SCALES)]
            if padded:
                for out in captured.outs:
                    out.fill_(float("nan"))
            with explained(f"{label}: replay {i + 1} ({spec.describe()})"):
                outs = captured.replay_layers(step, host_scale=scale, between=between)
            for work, out in zip(step, outs):
                at = f" (layer {work.layer_id})" if layers > 1 else ""
                msg = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
                if msg:
                    problems.append(f"replay {i + 1}{at}: {msg}")
            problems += kv_problems(pool, step, f"replay {i + 1} ({spec.name})",
                                    padding=padded_step(step))
            problems += inputs[i + 1].problems(f"replay {i + 1} ({spec.name})")
            problems += _static_q_problems(captured, step, f"replay {i + 1} ({spec.name})")
            if padded:
                problems += [f"replay {i + 1}: {p}" for p in captured.padding_problems(step[0])]
            if churn is not None:
                bad = churn.corrupted()
                if bad:
                    problems.append(
                        f"replay {i + 1} ({spec.name}): wrote into {len(bad)} of "
                        f"{len(churn.tensors)} tensors allocated after capture (their bytes "
                        "changed): the graph uses storage that was freed during capture and "
                        "handed out again (seed 000 defect 3: a dispose that ignores the "
                        "capture mode)")
                churn.release()
        return problems

    def _graph_setup(self, claim: Claim) -> tuple[AttentionBackend, MLAConfig,
                                                  list[BatchSpec]]:
        specs = self.claim_specs(claim)
        config = make_config(_combo(claim), self.device,
                             max_context_len=max(s.max_seq_len for s in specs))
        return self.create(claim, config), config, specs

    def check_graph(self, claim: Claim, options: GraphOptions) -> None:
        """A FULL / BREAKABLE claim: capture once, replay every batch (see ``options``)."""
        combo = _combo(claim)
        phase, mode = combo.phase, claim.graph_mode
        method = combo.method
        backend, config, specs = self._graph_setup(claim)
        layers = options.layers
        if (options.path_only or not self.real_graphs) and layers == 1:
            served = self._run_capture_path(claim, backend, config, specs, method,
                                            padded=options.padded, rescale=options.rescale)
            if options.path_only:
                self._check_native_served(claim, served)
            return
        pool = make_pool(config, list(specs) + [specs[0]], num_layers=layers)
        captured = self._captured(claim, backend, config, pool, specs, method,
                                  real_graphs=self.real_graphs,
                                  sync_check=options.sync_check, layers=layers)
        churn = AllocatorChurn(pool.device) if options.churn else None
        label = f"{phase} {mode} graph" + (f" of {layers} layers" if layers > 1 else "")
        problems = self._drive(captured, config, pool, specs, method, combo, label=label,
                               churn=churn, padded=options.padded, rescale=options.rescale)
        if options.sync_check and captured.memory is not None:
            problems += captured.memory.problems()
        if problems:
            raise ClaimRefuted("; ".join(problems))

    # ------------------------------------------------------------------------------
    # capture: memory against the declaration
    # ------------------------------------------------------------------------------
    def check_capture_memory(self, claim: Claim) -> None:
        """init_cuda_graph_state + capture allocate what ``CaptureMemory.estimate`` declares.

        Captured through the graph runner at the bounds of the claim's batches
        (one graph); measured with the device allocator on CUDA, from the
        backend's typed graph state on cpu (see ``CaptureMemoryCheck``).
        """
        combo = _combo(claim)
        backend, config, specs = self._graph_setup(claim)
        pool = make_pool(config, [specs[0], specs[0]])
        captured = self._captured(claim, backend, config, pool, specs, combo.method,
                                  real_graphs=self.real_graphs)
        capture_work = self.workload(config, pool, specs[0], combo.method, seed=1)
        if self.real_graphs:
            self._prime(backend, self.workload(config, pool, specs[0], combo.method, seed=2),
                        pool)
        label = f"{combo.phase} {claim.graph_mode} capture"
        with explained(f"{label}: preparing ({specs[0].describe()})"):
            captured.prepare(capture_work)
        with explained(f"{label}: warm-up"):
            captured.warm_up(capture_work)
        with explained(f"{label}: capturing"):
            captured.capture()
        check = captured.capture_memory
        assert check is not None
        problem = check.problem()
        if problem:
            raise ClaimRefuted(problem)

    def _prime(self, backend: AttentionBackend, work: Workload, pool: MLAKVPool) -> None:
        """One eager forward before the capture-memory window opens.

        Kernel libraries set up lazy state on their first call (compiled kernels,
        module-level buffers) whether or not anything is captured; that is not
        capture memory.  A failure here is left to the capture that follows (it
        reports it under the claim), so it is not raised.
        """
        try:
            self.eager_forward(backend, work, pool)
            self.sync()
        except Exception:  # noqa: BLE001 - the capture below reports what is wrong
            pass
        backend.forward_metadata = None  # its eager plan must not be freed inside the window
        gc.collect()

    # ------------------------------------------------------------------------------
    # capture: which implementation served the forward
    # ------------------------------------------------------------------------------
    def check_fallback_served(self, claim: Claim) -> None:
        """A FALLBACK mode: every forward under capture is served by ``fallback_to``.

        The backend reports what served a forward through
        ``attnreg.graph_policy.capture.note_served_by``; a backend that reports
        nothing cannot be checked (skipped, with the call to add).
        """
        combo = _combo(claim)
        specs = self.claim_specs(claim)
        config = make_config(combo, self.device, max_context_len=max(s.max_seq_len
                                                                      for s in specs))
        backend = self.create(claim, config)
        served = self._run_capture_path(claim, backend, config, specs, combo.method)
        expected = claim.fallback_to or "?"
        problems = _served_problems(served, expected)
        if problems is None:
            raise HarnessLimitation(
                f"{claim.backend} does not report which implementation serves a forward, so "
                f"the harness cannot tell whether its declared fallback {expected} ran under "
                f"{claim.graph_mode}; call attnreg.graph_policy.capture.note_served_by("
                f"self.name, {expected!r}) where the fallback runs (and note_served_by("
                "self.name, self.name) on the native path)")
        if problems:
            raise ClaimRefuted(
                f"{combo.phase}/{claim.graph_mode} declares FALLBACK to {expected}, but "
                + "; ".join(problems)
                + f": the graph policy prices this mode by {expected}'s cost, so the "
                "declaration must name what actually runs (fix the routing under capture, or "
                "declare the fallback that runs)")

    @staticmethod
    def _check_native_served(claim: Claim, served: Served) -> None:
        """A NATIVE mode reported as served by another backend's kernels is refuted."""
        if claim.capture is not SupportKind.NATIVE:
            return
        problems = _served_problems(served, claim.backend)
        if problems:
            raise ClaimRefuted(
                f"{_combo(claim).phase}/{claim.graph_mode} is declared NATIVE, but "
                + "; ".join(problems)
                + ": declare CaptureSupport.fallback(to=..., cost=...) so the graph policy "
                "sees the fallback and its cost")

    # ------------------------------------------------------------------------------
    # capture: TC_PIECEWISE
    # ------------------------------------------------------------------------------
    def _piecewise_eager(self, claim: Claim, backend: AttentionBackend, config: MLAConfig,
                         specs: Sequence[BatchSpec], method: ForwardMethod) -> Served:
        """Attention under capturing(TC_PIECEWISE) runs the eager path: check each batch."""
        combo = _combo(claim)
        pool = make_pool(config, specs)
        problems: list[str] = []
        served: Served = []
        q_compute = kernel_q_rounding(backend.capabilities, combo)
        for i, spec in enumerate(specs):
            work = self.workload(config, pool, spec, method, seed=300 + i,
                                 **q_compute)
            inputs = InputGuard([work])
            with explained(f"{spec.describe()} under capturing(tc_piecewise)"):
                with capturing(GraphMode.TC_PIECEWISE), recording_served() as records:
                    out = self.eager_forward(backend, work, pool)
                self.sync()
            served.append((f"{spec.name} under capturing(tc_piecewise)", records))
            msg = compare(out, work.expected, work.tolerance_dtype(combo.q_dtype), spec)
            if msg:
                problems.append(msg)
            when = f"{spec.name} under capturing(tc_piecewise)"
            problems += kv_problems(pool, [work], when)
            problems += inputs.problems(when)
        if problems:
            raise ClaimRefuted("; ".join(problems))
        return served

    def check_piecewise(self, claim: Claim, *, path_only: bool = False) -> None:
        """A TC_PIECEWISE claim: pieces captured around an eager attention (``path_only``:
        the attention under capturing(tc_piecewise) only, and who served it)."""
        combo = _combo(claim)
        specs = self.claim_specs(claim)
        config = make_config(combo, self.device)
        backend = self.create(claim, config)
        if path_only or not self.real_graphs:
            served = self._piecewise_eager(claim, backend, config, specs, combo.method)
            if path_only:
                self._check_native_served(claim, served)
            return
        problems = _Piecewise(self, backend, config, combo, specs).run()
        if problems:
            raise ClaimRefuted("; ".join(problems))


class _Piecewise:
    """torch.compile-style piecewise graphs around an eager attention.

    Piece A (captured) computes the attention inputs into static buffers from
    static "hidden" buffers; attention runs eagerly on views of those buffers
    under ``capturing(TC_PIECEWISE)``; piece B (captured) consumes the output.
    Replays: fill the hidden buffers, replay A, run attention, replay B.
    """

    def __init__(self, harness: Harness, backend: AttentionBackend, config: MLAConfig,
                 combo: Combo, specs: Sequence[BatchSpec]) -> None:
        self.h = harness
        self.backend = backend
        self.config = config
        self.combo = combo
        self.specs = list(specs)

    def run(self) -> list[str]:
        combo, config = self.combo, self.config
        method = combo.method
        pool = make_pool(config, self.specs)
        q_compute = kernel_q_rounding(self.backend.capabilities, combo)
        works = [self.h.workload(config, pool, s, method, seed=400 + i,
                                 **q_compute)
                 for i, s in enumerate(self.specs)]
        rows = max(w.rows for w in works)
        kv_rows = max((w.k.shape[0] for w in works if w.k is not None), default=0)
        first = works[0]
        dev = pool.device

        def buf(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=dev)

        hidden = {name: buf(getattr(first, name), rows) for name in ("q", "latent_new",
                                                                      "rope_new")}
        # the inputs not sized by the query rows: the new tokens' k / v (ragged MHA) and
        # an fp8 q's [1] scale, copied in by piece A like the rest
        hidden_other = {name: buf(getattr(first, name), kv_rows) for name in ("k", "v")}
        hidden_other["q_scale"] = buf(first.q_scale, 1)
        static = {name: torch.zeros_like(t) for name, t in hidden.items() if t is not None}
        static_other = {name: torch.zeros_like(t) for name, t in hidden_other.items()
                        if t is not None}
        out_dim = config.kv_lora_rank if method is ForwardMethod.MLA else config.v_head_dim
        attn_out = torch.zeros(rows, config.num_heads, out_dim,
                               dtype=output_dtype(first.q.dtype), device=dev)
        final = torch.zeros_like(attn_out)
        # the batch the eager attention serves: the first one at capture, then each replay's
        current = [first]

        def piece_a() -> None:
            for name, t in hidden.items():
                if t is not None:
                    static[name].copy_(t)
            for name, t in hidden_other.items():
                if t is not None:
                    static_other[name].copy_(t)

        def attention() -> None:
            work = current[0]
            n = work.rows
            self.backend.init_forward_metadata(work.batch)
            kt, vt = static_other.get("k"), static_other.get("v")
            q_scale = static_other.get("q_scale")
            if work.spec.phase is Phase.DECODE:
                self.backend.forward_decode(static["q"][:n], static["latent_new"][:n],
                                            static["rope_new"][:n], pool, work.batch,
                                            out=attn_out[:n], q_scale=q_scale)
            else:
                tk = work.k.shape[0] if work.k is not None else 0
                self.backend.forward_extend(
                    static["q"][:n], static["latent_new"][:n], static["rope_new"][:n],
                    pool, work.batch, method=method,
                    k=kt[:tk] if kt is not None else None,
                    v=vt[:tk] if vt is not None else None, out=attn_out[:n], q_scale=q_scale)

        def piece_b() -> None:
            final.copy_(attn_out)

        churn = AllocatorChurn(dev)
        runner = GraphRunner(dev, before_replay=churn.churn)
        # captured with the first batch's inputs: they are rewritten into its slots later
        self._load(hidden, hidden_other, first)
        with explained("tc_piecewise capture"):
            graph = runner.capture_pieces([piece_a, EagerStep(attention, "attention"),
                                           piece_b], GraphMode.TC_PIECEWISE)
        problems: list[str] = []
        inputs = [InputGuard([w]) for w in works]
        for i, work in enumerate(works):
            n = work.rows
            self._load(hidden, hidden_other, work)
            current[0] = work
            with explained(f"tc_piecewise replay {i + 1} ({work.spec.describe()})"):
                graph.replay()
                torch.cuda.synchronize()
            msg = compare(final[:n], work.expected, work.tolerance_dtype(combo.q_dtype),
                          work.spec)
            if msg:
                problems.append(f"replay {i + 1}: {msg}")
            # attention ran eagerly on views of the static buffers: no padding rows
            problems += kv_problems(pool, [work], f"replay {i + 1} ({work.spec.name})")
            problems += inputs[i].problems(f"replay {i + 1} ({work.spec.name})")
            bad = churn.corrupted()
            if bad:
                problems.append(f"replay {i + 1}: wrote into {len(bad)} tensors allocated after "
                                "capture: storage recorded by a piece was freed")
            churn.release()
        return problems

    @staticmethod
    def _load(hidden: dict[str, torch.Tensor | None],
              hidden_other: dict[str, torch.Tensor | None], work: Workload) -> None:
        """Put ``work``'s inputs into the hidden buffers piece A reads (zero elsewhere)."""
        for name, t in hidden.items():
            if t is not None:
                t.zero_()
                t[:work.rows].copy_(getattr(work, name))
        for name, t in hidden_other.items():
            if t is not None:
                value = getattr(work, name)
                t.zero_()
                t[:value.shape[0]].copy_(value)


def _static_q_problems(captured: CapturedForward, step: list[Workload], when: str
                       ) -> list[str]:
    """The graph's static q after a replay must still hold what was copied in (the
    step's q): a backend that scales q in place inside the graph is refuted."""
    if len(step) != 1:
        return []  # one static q per layer; the public view is layer 0's
    work = step[0]
    static = captured.q[:work.rows]
    if static.shape == work.q.shape and not torch.equal(static.view(torch.uint8),
                                                        work.q.view(torch.uint8)):
        return [f"{when}: the forward changed its input q (the graph's static q no longer "
                "holds the q copied in before the replay); a backend must not write into q"]
    return []


def _served_problems(served: Served, expected: str) -> list[str] | None:
    """What contradicts "``expected`` served every forward under capture" (None: no reports).

    Only reports made under a capture mode and outside an eager break count
    (eager code may run anything).  Once a backend reports at all, a forward
    under capture without a report is a problem too: it would hide a path that
    serves the batch with something else.
    """
    under = [(when, [r for r in records if r.under_capture]) for when, records in served]
    if not any(records for _, records in under):
        return None
    silent: list[str] = []
    wrong: dict[str, list[str]] = {}  # "X (detail)" -> the forwards it served
    for when, records in under:
        if not records:
            silent.append(when)
        others = {r.implementation + (f" ({r.detail})" if r.detail else "")
                  for r in records if r.implementation != expected}
        for what in sorted(others):  # one entry per forward, however often it reported
            wrong.setdefault(what, []).append(when)
    total = len(under)
    problems = [f"{len(whens)} of {total} forwards under capture were served by {what}, not "
                f"{expected} (first: {whens[0]})" for what, whens in wrong.items()]
    if silent:
        problems.append(f"{len(silent)} of {total} forwards under capture reported no "
                        f"implementation while others did (first: {silent[0]})")
    return problems


def _combo(claim: Claim) -> Combo:
    if claim.combo is None:
        raise HarnessLimitation(f"claim {claim.id} has no input configuration")
    return claim.combo


def _set_scales(pool: MLAKVPool, scales: Sequence[float]) -> None:
    """Each layer's fp8 scale (``set_scale``, in place); nothing for other pools."""
    for layer, scale in zip(pool.layers, scales):
        if layer.is_fp8 and layer.scale != scale:
            layer.set_scale(scale)
