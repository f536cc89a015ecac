"""Progress of a conformance run: one line per claim, and a notice before a known-slow step.

``attnreg conformance`` registers a :class:`ClaimProgress` with pytest when its
progress lines are on (stderr is a terminal, or ``--progress``; never with
``--quiet``).  The lines themselves come from the object it is given, the
``attnreg.profiling.progress.Progress`` that ``calibrate`` and the benchmarks
use (``[  12.3s] 3 of 14: claim <id> (about 40 s left)``); this module only
knows claims.  Claims skipped before they run (no CUDA graphs on cpu, declared
for another platform) are not counted: N is what will run.

The time left is estimated from the measured time of each claim that has
run, per *class* of claim (backend, kind, graph mode, forward method: a
captured claim takes several times an eager one): each claim still to run
counts the mean of its class, or, for a class none of whose claims has run
yet, the slowest class mean measured so far (the classes not yet seen are
the later, larger ones: counting them at the mean of the fast early claims
is what made the estimate low).

The known-slow step is flashinfer's JIT compilation: a backend that requires
flashinfer builds each kernel variant (paged MLA per q / kv dtype, ragged
prefill per dtype and head dims) with nvcc the first time it is planned, unless
flashinfer's on-disk cache already holds it.  The first claim of a run that
uses a variant gets a notice that it *may* compile (this module cannot see the
cache), naming the variant and that it is cached afterwards.  Importing this
module imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from .claims import Claim, ClaimKind, Combo
from .plugin import SESSION_KEY, _claim_of

if TYPE_CHECKING:
    from attnreg.registry import BackendRegistry

__all__ = ["FLASHINFER_IMPORT", "ClaimProgress", "ClaimTimes", "StepLines", "claim_class",
           "jit_variant"]

#: The import name of the library whose kernels compile on first use (``Requirement``).
FLASHINFER_IMPORT = "flashinfer"
#: What a first build takes, measured on an H200 with nvcc (docs/conformance.md).
_JIT_TIME = {"paged MLA": "about 20 s", "ragged prefill": "100-135 s"}


class StepLines(Protocol):
    """What :class:`ClaimProgress` prints through (``attnreg.profiling.progress.Progress``)."""

    total: int

    def step(self, what: str, *, left_s: float | None = None) -> str: ...

    def note(self, line: str) -> None: ...


def jit_variant(combo: Combo) -> str:
    """The flashinfer kernel variant a claim's configuration builds, e.g.
    ``paged MLA bf16/bf16 576x512``: one compiled module per (form, dtypes, head dims).

    Examples
    --------
    >>> from attnreg.registry import DType, ForwardMethod, Phase
    >>> jit_variant(Combo(ForwardMethod.MHA_CHUNKED_KV, Phase.PREFILL, DType.FP16,
    ...                   DType.FP16, 16, 16, (192, 128)))
    'ragged prefill fp16/fp16 192x128'
    """
    return (f"{_jit_form(combo)} {combo.q_dtype}/{combo.kv_dtype} "
            f"{combo.head_dims[0]}x{combo.head_dims[1]}")


def _jit_form(combo: Combo) -> str:
    from attnreg.registry import ForwardMethod

    return "paged MLA" if combo.method is ForwardMethod.MLA else "ragged prefill"


def claim_class(claim: Claim) -> Hashable:
    """What claims of similar cost share: backend, kind, graph mode and forward method."""
    method = claim.combo.method if claim.combo is not None else None
    return (claim.backend, claim.kind, claim.graph_mode, method)


class ClaimTimes:
    """Measured claim times, and the estimate of what the claims still to run will take.

    Examples
    --------
    >>> times = ClaimTimes()
    >>> times.add("eager", 1.0); times.add("eager", 3.0); times.add("capture", 10.0)
    >>> times.estimate(["eager", "capture", "new"])  # 2 + 10 + 10 (slowest class so far)
    22.0
    >>> ClaimTimes().estimate(["eager"]) is None
    True
    """

    def __init__(self) -> None:
        self._sums: dict[Hashable, tuple[float, int]] = {}

    def add(self, key: Hashable, seconds: float) -> None:
        total, count = self._sums.get(key, (0.0, 0))
        self._sums[key] = (total + max(0.0, seconds), count + 1)

    def estimate(self, keys: Iterable[Hashable]) -> float | None:
        """Seconds the claims of ``keys`` will take; None before any claim was measured."""
        if not self._sums:
            return None
        means = {k: total / count for k, (total, count) in self._sums.items()}
        slowest = max(means.values())
        return sum(means.get(k, slowest) for k in keys)


def _runs(claim: Claim) -> bool:
    """Whether ``claim`` runs kernels (refusals stop before; skipped ones never start)."""
    return not claim.skip_reason and claim.kind in (ClaimKind.EAGER, ClaimKind.CAPTURE) \
        and claim.combo is not None


class ClaimProgress:
    """A pytest plugin object: a progress line before each claim that runs.

    Parameters
    ----------
    lines
        Prints the lines; its ``total`` is set to the number of claims that
        will run once pytest has collected (and deselected, ``-k``) them.
    registry
        Where backends' requirements are read (default: the run's own, once
        its claims are collected).
    """

    def __init__(self, lines: StepLines, registry: BackendRegistry | None = None, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.lines = lines
        self._claim_ids: set[str] = set()  # every claim's node id
        self._running: set[str] = set()  # those that run (a line each)
        self._order: list[tuple[str, Hashable]] = []  # (node id, class) of those, in order
        self._times = ClaimTimes()
        self._clock = clock
        self._current: tuple[Hashable, float] | None = None  # class and start of the running one
        self._jit_backends: dict[str, bool] = {}
        self._built: set[str] = set()
        self._registry = registry
        self._verbose = False

    # -- pytest hooks ------------------------------------------------------------------
    def pytest_configure(self, config: pytest.Config) -> None:
        self._verbose = config.getoption("verbose") > 0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        claims = [(item.nodeid, _claim_of(item)) for item in session.items]
        running = [(nodeid, c) for nodeid, c in claims if c is not None and not c.skip_reason]
        self._claim_ids = {nodeid for nodeid, c in claims if c is not None}
        self._running = {nodeid for nodeid, _ in running}
        self._order = [(nodeid, claim_class(c)) for nodeid, c in running if c is not None]
        self.lines.total = len(running)
        skipped = sum(1 for _, c in claims if c is not None and c.skip_reason)
        if running:
            also = f" ({skipped} more listed as skipped)" if skipped else ""
            self.lines.note(f"attnreg conformance: {len(running)} claims to run{also}")
        state = session.config.stash.get(SESSION_KEY, None)
        if self._registry is None and state is not None and state.claims_generated:
            self._registry = state.registry

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if item.nodeid not in self._running:
            return
        claim = _claim_of(item)
        assert claim is not None
        terminal = item.config.pluginmanager.get_plugin("terminalreporter")
        if self._verbose and terminal is not None:
            # end pytest's line of the previous claim, and let it out before ours
            terminal.ensure_newline()
            terminal.flush()
        notice = self.slow_step_notice(claim)
        if notice:
            self.lines.note(notice)
        self.lines.step(f"claim {claim.id}", left_s=self.left_s(item.nodeid))
        self._current = (claim_class(claim), self._clock())

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        if self._current is not None and nodeid in self._running:
            key, started = self._current
            self._times.add(key, self._clock() - started)
            self._current = None

    def left_s(self, nodeid: str) -> float | None:
        """Estimated seconds until the last claim ends, ``nodeid`` (starting now) included:
        :class:`ClaimTimes` over the claims from ``nodeid`` on."""
        keys = [key for _, key in self._order]
        start = next((i for i, (n, _) in enumerate(self._order) if n == nodeid), len(keys))
        return self._times.estimate(keys[start:])

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport,
                                 config: pytest.Config) -> tuple[str, str, str] | None:
        # The progress line names each claim: pytest's dots would only interleave
        # with it.  Counted as usual (the summary line), written as nothing.
        if self._verbose or report.nodeid not in self._claim_ids:
            return None
        if report.when == "call" or not report.passed:
            return report.outcome, "", ""
        return "", "", ""

    # -- the known-slow step -----------------------------------------------------------
    def slow_step_notice(self, claim: Claim) -> str | None:
        """A line to print before ``claim`` when it may JIT-compile a flashinfer variant
        for the first time in this run (None otherwise)."""
        if not _runs(claim) or not self._uses_flashinfer(claim.backend):
            return None
        assert claim.combo is not None
        variant = jit_variant(claim.combo)
        if variant in self._built:
            return None
        self._built.add(variant)
        took = _JIT_TIME[_jit_form(claim.combo)]
        return (f"  {claim.backend}: first use of flashinfer's {variant} kernel in this run: "
                f"flashinfer may JIT-compile it now ({took} on an H200); once built it is "
                "cached on disk (~/.cache/flashinfer) and loads in seconds afterwards")

    def _uses_flashinfer(self, backend: str) -> bool:
        if backend not in self._jit_backends:
            self._jit_backends[backend] = self._requires(backend, FLASHINFER_IMPORT)
        return self._jit_backends[backend]

    def _requires(self, backend: str, import_name: str) -> bool:
        if self._registry is None:
            return False
        try:
            requirements: Iterable[Any] = self._registry.get(backend).requires
        except Exception:  # noqa: BLE001 - a notice is never worth failing the run
            return False
        return any(getattr(req, "import_name", None) == import_name for req in requirements)
