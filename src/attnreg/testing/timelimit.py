"""A time limit per claim: claims run in a worker process that the run can end.

A kernel that never returns (or a Python loop in a backend) would hang the
whole conformance run; nothing inside the process can interrupt a CUDA kernel
or a C call.  So :class:`ClaimRunner` sends each claim to a worker process and
waits at most the limit for its answer.  When the limit passes, the worker is
killed, the claim is refuted with ``timed out after N s in <eager step |
capture | replay> (<what ran last>)``, and the next claim gets a fresh worker.

The worker is started once per run (and again after a timeout or a crash):

* on cpu it is a ``fork`` of the run (no import, no start-up cost); it runs
  torch with one intra-op thread, because a forked child of a process that has
  used OpenMP threads hangs in its first parallel region;
* on cuda it is a fresh interpreter (``python -m attnreg.testing.timelimit``),
  because CUDA does not survive a fork; it rebuilds the registry and the
  harness from the run's options (:class:`HarnessRecipe`), which costs one
  import of torch and the backends (seconds) per start.

The harness reports what it is doing through :func:`stage` (``explained``
calls it), which is how a timeout names where it happened.

Limits: ``--attnreg-time-limit SECONDS`` (``attnreg conformance --time-limit``),
else the environment variable :data:`ENV`, else :data:`DEFAULT_LIMITS` for the
device.  ``0`` runs claims in the run's own process, without a limit.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

from .errors import ClaimRefuted, HarnessLimitation

if TYPE_CHECKING:
    from .claims import Claim
    from .harness import Harness

__all__ = ["DEFAULT_LIMITS", "ENV", "ClaimRunner", "ClaimWorkerError", "HarnessRecipe",
           "resolve_limit", "stage"]

#: Environment variable with the per-claim limit in seconds (``0``: no limit).
ENV = "ATTNREG_CLAIM_TIME_LIMIT"
#: Default per-claim limit, seconds, by device.  cpu runs Triton kernels in the
#: interpreter, where the slowest built-in claim takes under a minute on a shared
#: 2-core machine; cuda claims take seconds, the first of a backend maybe a minute of
#: kernel compilation.
DEFAULT_LIMITS = {"cpu": 600.0, "cuda": 300.0}
#: Seconds a new worker may take to build its harness (at least the claim limit).
STARTUP_LIMIT = 300.0

_CHILD: Connection | None = None  # set in a worker: where stage() reports
#: What a CUDA error that leaves the context unusable says (the worker is replaced).
_CONTEXT_LOST = ("illegal memory access", "device-side assert", "unspecified launch failure",
                 "CUDA error: an illegal instruction")


class ClaimWorkerError(RuntimeError):
    """Something other than a refutation went wrong while the worker ran a claim."""


def resolve_limit(option: float | None, device: str) -> float:
    """The per-claim limit: the option, else :data:`ENV`, else the device default.

    Raises
    ------
    ValueError
        When :data:`ENV` is not a number, or a limit is negative.
    """
    if option is None:
        text = os.environ.get(ENV, "").strip()
        if text:
            try:
                option = float(text)
            except ValueError:
                raise ValueError(f"{ENV}={text!r} is not a number of seconds (use e.g. "
                                 f"{ENV}=120, or 0 for no limit)") from None
    limit = DEFAULT_LIMITS.get(device, DEFAULT_LIMITS["cuda"]) if option is None \
        else float(option)
    if not limit >= 0:
        raise ValueError(f"a claim time limit must be >= 0 seconds, got {limit}")
    return limit


def stage(label: str) -> None:
    """Report, from inside a worker, what the claim is doing now (no-op elsewhere)."""
    if _CHILD is not None:
        try:
            _CHILD.send(("stage", label))
        except OSError:  # the run went away: nothing to report to
            pass


def _kind(label: str) -> str:
    """``eager step``, ``capture`` or ``replay``: which part of a claim ``label`` is."""
    low = label.lower()
    if "replay" in low:
        return "replay"
    if any(word in low for word in ("captur", "warm-up", "prepar")):
        return "capture"
    return "eager step"


@dataclass(frozen=True)
class HarnessRecipe:
    """What a fresh worker process needs to build the run's harness (picklable)."""

    device: str
    plugin_modules: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def build(self) -> Harness:
        import importlib

        from attnreg.registry import Platform, load_registry

        from .harness import Harness

        extra = [(m, importlib.import_module(m)) for m in self.plugin_modules]
        registry = load_registry(list(self.disable), extra_plugins=extra)
        platform = Platform.parse("cpu") if self.device == "cpu" else Platform.detect()
        return Harness(registry, self.device, platform)


def _answer(harness: Harness, claim: Claim) -> tuple[str, str]:
    """Run one claim; what to send back."""
    try:
        harness.check(claim)
    except ClaimRefuted as exc:
        return "refuted", str(exc)
    except HarnessLimitation as exc:
        return "skip", f"harness limitation: {exc}"
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the run
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        where = traceback.extract_tb(exc.__traceback__)[-1:] or ["?"]
        return "error", f"{text} (at {where[0]})"
    return "ok", ""


def _serve(conn: Connection, harness: Harness) -> None:
    """The worker's loop: claims in, answers out, until the run closes the connection."""
    global _CHILD
    _CHILD = conn
    conn.send(("ready", ""))
    while True:
        try:
            claim = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_answer(harness, claim))


def _forked_main(address: str, authkey: bytes, harness: Harness) -> None:
    import torch

    # a forked child of a process that ran OpenMP threads hangs in its first parallel
    # region unless it runs one thread
    torch.set_num_threads(1)
    _serve(Client(address, authkey=authkey), harness)


@dataclass
class _Worker:
    conn: Connection
    pid: int
    proc: Any

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.join() if hasattr(self.proc, "join") else self.proc.wait()
        except Exception:  # noqa: BLE001 - it is gone either way
            pass
        self.conn.close()

    def exit_status(self) -> str:
        code = getattr(self.proc, "exitcode", None)
        if code is None and hasattr(self.proc, "poll"):
            code = self.proc.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class ClaimRunner:
    """Runs claims in a worker process, each within ``limit`` seconds.

    Parameters
    ----------
    harness_factory
        Builds the harness in the run's process (used by a forked worker).
    recipe
        Builds it in a fresh interpreter (cuda, or ``start="spawn"``).
    limit
        Seconds per claim (> 0).
    start
        ``fork`` or ``spawn``; default: fork on cpu, spawn on cuda.
    """

    def __init__(self, harness_factory: Any, recipe: HarnessRecipe, limit: float, *,
                 start: str | None = None) -> None:
        if not limit > 0:
            raise ValueError(f"ClaimRunner needs a positive limit, got {limit}")
        self.harness_factory = harness_factory
        self.recipe = recipe
        self.limit = float(limit)
        self.start = start or ("fork" if recipe.device == "cpu" else "spawn")
        self._worker: _Worker | None = None
        self._dir = tempfile.mkdtemp(prefix="attnreg-claims-")

    # -- worker lifecycle --------------------------------------------------------------
    def _start(self) -> _Worker:
        address = os.path.join(self._dir, f"w{secrets.token_hex(4)}")
        authkey = secrets.token_bytes(16)
        with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
            if self.start == "fork":
                import multiprocessing

                ctx = multiprocessing.get_context("fork")
                proc: Any = ctx.Process(target=_forked_main,
                                        args=(address, authkey, self.harness_factory()),
                                        daemon=True)
                proc.start()
                pid = proc.pid
            else:
                # the run's import path (pytest's rootdir insertions included), so the
                # worker imports the same plugin modules
                env = dict(os.environ, **self.recipe.env, _ATTNREG_WORKER=address,
                           _ATTNREG_WORKER_KEY=authkey.hex(),
                           PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
                proc = subprocess.Popen([sys.executable, "-m", "attnreg.testing.timelimit"],
                                        env=env)
                pid = proc.pid
            conn = listener.accept()
        if self.start != "fork":
            conn.send(self.recipe)
        return _Worker(conn, pid, proc)

    def close(self) -> None:
        """End the worker (the run is over)."""
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    # -- one claim ---------------------------------------------------------------------
    def run(self, claim: Claim) -> None:
        """Check ``claim`` in the worker; raise ClaimRefuted, skip, or ClaimWorkerError."""
        answer = self.answer(claim)
        kind, text = answer
        if kind == "ok":
            return
        if kind == "refuted":
            raise ClaimRefuted(text)
        if kind == "skip":
            import pytest

            pytest.skip(text)
        raise ClaimWorkerError(text)

    def answer(self, claim: Claim) -> tuple[str, str]:
        """``(kind, text)``: ``ok``, ``refuted``, ``skip`` or ``error`` (no pytest)."""
        if self._worker is None:
            self._worker = self._start()
            problem = self._await_ready(self._worker)
            if problem:
                return "error", problem
        worker = self._worker
        deadline = time.monotonic() + self.limit
        last = "starting the claim"
        worker.conn.send(claim)
        while True:
            remaining = deadline - time.monotonic()
            try:
                ready = remaining > 0 and worker.conn.poll(remaining)
                message = worker.conn.recv() if ready else None
            except (EOFError, OSError):
                self._worker = None
                worker.kill()
                return ("refuted", f"the worker process running the claim died "
                        f"({worker.exit_status()}) in {_kind(last)} ({last}): a crash in the "
                        "backend or its kernel library")
            if message is None:
                self._worker = None
                worker.kill()
                return ("refuted", f"timed out after {self.limit:g} s in {_kind(last)} "
                        f"({last}); the claim was ended and the run went on (limit: "
                        f"--time-limit or {ENV}; a kernel that never returns hangs an "
                        "engine the same way)")
            if message[0] == "stage":
                last = message[1]
                continue
            if message[0] != "ok" and any(sign in message[1] for sign in _CONTEXT_LOST):
                # the device context is unusable now: the next claim gets a fresh worker
                self._worker = None
                worker.kill()
            return message

    def _await_ready(self, worker: _Worker) -> str | None:
        """Wait for a new worker's harness (a fresh interpreter imports torch and the
        backends: that start-up is not any claim's time)."""
        wait = max(self.limit, STARTUP_LIMIT)
        try:
            if worker.conn.poll(wait) and worker.conn.recv() == ("ready", ""):
                return None
        except (EOFError, OSError):
            pass
        self._worker = None
        worker.kill()
        return (f"the conformance worker process did not start within {wait:g} s "
                f"({worker.exit_status()}); run with --time-limit 0 to run claims in the "
                "run's own process and see why")


def _spawned_main() -> None:
    """Entry of a fresh worker interpreter (``python -m attnreg.testing.timelimit``)."""
    address = os.environ.pop("_ATTNREG_WORKER")
    key = bytes.fromhex(os.environ.pop("_ATTNREG_WORKER_KEY"))
    conn = Client(address, authkey=key)
    recipe: HarnessRecipe = conn.recv()
    if recipe.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _serve(conn, recipe.build())


if __name__ == "__main__":
    _spawned_main()
