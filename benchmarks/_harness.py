"""The benchmark harness: sections, the run context, timers, graphs, the JSON document.

A *section* is one figure of issue 7 (P1 ... P6, prefill) plus ``ceilings``
(the device copy bandwidth and matrix rate every other number is compared
with).  Each is a function ``run(ctx, data)`` that fills the dict ``data`` as it
measures; the runner catches anything it raises, records it, saves the JSON
and goes on, so one failing section never loses the others.

Timing (see /work/.library/device/METHOD.md): CUDA events around each call,
the L2 flushed before each call unless asked otherwise, warm-up first, the
median and the 20th/80th percentiles of many calls reported.  On a machine
without CUDA, ``--dry-run`` runs the same code on tiny shapes (Triton kernels
in the interpreter, graphs replayed eagerly) to catch mistakes before a device
call; its times are wall-clock and are never rendered into docs/.

torch is imported lazily: P5 (process start-up) must run where torch is absent.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .metrics import spread

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "RunContext",
    "Section",
    "SkipSection",
    "run_sections",
    "select_sections",
]

SCHEMA = "attnreg-bench/1"

#: Distributions whose versions every results file records (read without importing them).
VERSIONED = ("torch", "triton", "flashinfer-python", "flash-attn-4", "numpy", "pluggy",
             "attnreg", "matplotlib")


class SkipSection(Exception):
    """Raised by a section that cannot run here; the message is the reason."""


@dataclass(frozen=True)
class Section:
    """One benchmark section.

    Attributes
    ----------
    id : str
        ``ceilings``, ``P1`` ... ``P6`` or ``prefill``.
    title : str
    target : str
        What runs it: ``"module:function"`` under ``benchmarks``.
    where : str
        ``"device"``: needs CUDA (or ``--dry-run``); ``"host"``: measures this
        CPU machine (P5), so on a GPU machine it runs only when asked by name.
    needs : tuple[str, ...]
        Sections whose data it reads; they are run first when selected implicitly.
    """

    id: str
    title: str
    target: str
    where: str = "device"
    needs: tuple[str, ...] = ()

    def load(self) -> Callable[[RunContext, dict], None]:
        module_name, _, func = self.target.partition(":")
        module = importlib.import_module(f"benchmarks.{module_name}")
        return getattr(module, func)


#: Run order: cheap and most asked-for first, so a run cut short still has them.
SECTIONS: tuple[Section, ...] = (
    Section("ceilings", "Device ceilings: copy bandwidth and bf16 matrix rate",
            "ceilings:run"),
    Section("P1", "MLA decode: every backend, 7 shapes", "decode:run_p1", needs=("ceilings",)),
    Section("P2", "Best decode backend at (128, 4096, 16) against copy bandwidth",
            "decode:run_p2", needs=("ceilings",)),
    Section("P6", "Per-call overhead of a registry-resolved backend", "overhead:run"),
    Section("P3", "Split-KV inside a CUDA graph at B=1 vs forced one split", "graphs:run_p3"),
    Section("P4", "8-layer DeepSeek-shaped MLA decode step: eager vs CUDA graph",
            "graphs:run_p4", needs=("ceilings",)),
    Section("prefill", "Prefill: absorbed extend vs MHA ragged prefill + decompression",
            "prefill:run", needs=("ceilings",)),
    Section("P5", "attnreg compat cold start vs python -c pass", "startup:run", where="host"),
)

_BY_ID = {s.id.lower(): s for s in SECTIONS}


def select_sections(only: str | None, skip: str | None = None) -> tuple[list[Section], set[str]]:
    """Sections to run, in run order, and the ids the user named explicitly.

    ``only`` / ``skip`` are comma-separated ids (case-insensitive).  Sections
    an explicitly named one needs are added.

    Raises
    ------
    ValueError
        On an unknown id, listing the known ones.
    """
    def parse(text: str | None) -> list[str]:
        ids = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
        unknown = [i for i in ids if i not in _BY_ID]
        if unknown:
            raise ValueError(f"unknown section(s) {unknown}; known: "
                             f"{', '.join(s.id for s in SECTIONS)}")
        return ids

    named = set(parse(only))
    skipped = set(parse(skip))
    wanted = set(named) if named else {s.id.lower() for s in SECTIONS}
    for sid in list(wanted):
        wanted.update(n.lower() for n in _BY_ID[sid].needs)
    wanted -= skipped
    return [s for s in SECTIONS if s.id.lower() in wanted], {_BY_ID[i].id for i in named}


# ----------------------------------------------------------------------------------------
# Environment facts
# ----------------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit(root: Path) -> str | None:
    """Short HEAD, with ``+dirty`` when tracked files differ from it.

    A copied working tree (the device machine's) may carry an older ``.git``
    than its files: ``+dirty`` then says the commit alone does not name the code.
    """
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], check=False,
                                 capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _nvidia_smi() -> dict[str, str]:
    fields = ("driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit",
              "temperature.gpu", "persistence_mode")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader"], check=False, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields, values))


def environment(command: str, *, quick: bool, dry_run: bool) -> dict[str, Any]:
    """Facts every results file carries: command, date, host, device, library versions."""
    root = Path(__file__).resolve().parent.parent
    meta: dict[str, Any] = {
        "command": command,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "git_commit": _git_commit(root),
        "quick": quick,
        "dry_run": dry_run,
        "versions": {d: _version(d) for d in VERSIONED},
        "device": {"kind": "cpu", "name": _cpu_model()},
    }
    try:
        import torch
    except ImportError:
        return meta
    meta["versions"]["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["device"] = {
            "kind": "cuda",
            "name": torch.cuda.get_device_name(0),
            "arch": f"sm{props.major}{props.minor}",
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            **{f"nvidia_smi.{k}": v for k, v in _nvidia_smi().items()},
        }
    return meta


# ----------------------------------------------------------------------------------------
# The run context
# ----------------------------------------------------------------------------------------

class _EagerGraph:
    """Stand-in for a CUDA graph on a machine without CUDA (dry runs only).

    ``replay()`` calls the function again under the same capture mode, so the
    backend code paths of capture and replay still run.
    """

    def __init__(self, fn: Callable[[], Any], mode: Any) -> None:
        self._fn = fn
        self._mode = mode

    def replay(self) -> None:
        from attnreg.graph_policy import capturing
        with capturing(self._mode):
            self._fn()


@dataclass
class RunContext:
    """What a section needs: where to write, how big to measure, how to time.

    Parameters
    ----------
    out_dir : Path
        ``results.json`` is written here after every section.
    quick : bool
        Fewer shapes and shorter timing (for a tight device call).
    dry_run : bool
        Tiny shapes; allowed without CUDA; times are not measurements.
    warmup_ms, rep_ms : float
        Time spent warming up and repeating each timed call.
    time_budget_s : float
        Sections and their items that would start after this many seconds of
        the run are skipped (with that reason) so the JSON is written before the
        device call's limit.
    command : str
        The command line, recorded in the results.
    """

    out_dir: Path
    quick: bool = False
    dry_run: bool = False
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    time_budget_s: float = 300.0
    command: str = ""
    doc: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _torch: Any = None
    _flush_buf: Any = None

    # -- environment ---------------------------------------------------------------
    @property
    def torch(self) -> Any:
        if self._torch is None:
            import torch
            self._torch = torch
        return self._torch

    @property
    def cuda(self) -> bool:
        try:
            return bool(self.torch.cuda.is_available())
        except ImportError:
            return False

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def pick(self, full: Any, quick: Any, dry: Any) -> Any:
        """The full, quick or dry-run variant of a size list."""
        if self.dry_run:
            return dry
        return quick if self.quick else full

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed_s() > self.time_budget_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed_s():6.1f}s] {msg}", flush=True)

    # -- results ---------------------------------------------------------------------
    @property
    def results_path(self) -> Path:
        return self.out_dir / "results.json"

    def save(self) -> None:
        """Write the document so far (atomically: a kill mid-write leaves the last one)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.results_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, sort_keys=False, default=str) + "\n")
        os.replace(tmp, self.results_path)

    def section_data(self, sid: str) -> dict | None:
        """Data of a section of this run that finished (ok or partly), else None."""
        rec = self.doc.get("sections", {}).get(sid)
        if rec and rec.get("data"):
            return rec["data"]
        return None

    # -- timing ----------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _flush_buffer(self) -> Any:
        # 256 MiB: five times the H200's 50 MB L2, so nothing of the previous call survives.
        if self._flush_buf is None:
            self._flush_buf = self.torch.empty(256 * 2**20, dtype=self.torch.int8,
                                               device="cuda")
        return self._flush_buf

    def time(self, fn: Callable[[], Any], *, flush_l2: bool = True) -> dict[str, Any]:
        """Median time of one call of ``fn`` in microseconds, with its spread.

        CUDA: events around each call, L2 flushed before each (unless
        ``flush_l2=False``), ``warmup_ms`` of warm-up and about ``rep_ms`` of
        timed calls (at least 3).  CPU (dry run): wall clock of 3 calls.

        Returns
        -------
        dict
            ``median_us``, ``p20_us``, ``p80_us``, ``min_us``, ``max_us``, ``n``, ``method``.
        """
        if not self.cuda:
            fn()
            samples = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
            return _timing(samples, "wall clock on cpu (dry run, not a measurement)")
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        cache = self._flush_buffer() if flush_l2 else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            if cache is not None:
                cache.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        est_ms = max(start.elapsed_time(end) / 3, 1e-3)
        n_warm = int(min(max(self.warmup_ms / est_ms, 1), 500))
        n_rep = int(min(max(self.rep_ms / est_ms, 3 if est_ms > 20 else 10), 2000))
        for _ in range(n_warm):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            if cache is not None:
                cache.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        method = "cuda events per call, L2 flushed" if flush_l2 else "cuda events per call"
        return _timing(samples, method)

    def time_back_to_back(self, fn: Callable[[], Any], *, calls: int = 200,
                          rounds: int = 5) -> dict[str, Any]:
        """Per-call time of ``calls`` calls issued back to back (no flush, no sync between).

        This is what an engine's eager loop sees: when the host issues calls
        slower than the device runs them, the host cost shows up here.  Also
        records the host time per call (``host_us``): the time to *issue* them.
        """
        calls = max(1, calls if not self.dry_run else 3)
        dev, host = [], []
        fn()
        self.sync()
        for _ in range(max(1, rounds if not self.dry_run else 1)):
            if self.cuda:
                torch = self.torch
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / calls)
                e.record()
                torch.cuda.synchronize()
                dev.append(s.elapsed_time(e) * 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / calls)
                dev.append(host[-1])
        out = _timing(dev, "cuda events around back-to-back calls" if self.cuda
                      else "wall clock on cpu (dry run, not a measurement)")
        out["host_us"] = spread(host)["median"]
        out["calls_per_round"] = calls
        return out

    # -- graphs ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], Any], mode: Any, *, warmup: int = 1) -> Any:
        """Capture ``fn`` into a CUDA graph under ``capturing(mode)``; return it.

        The warm-up calls run on a side stream under the same capture mode
        (Triton compiles there, outside the capture).  Without CUDA a stand-in
        whose ``replay()`` calls ``fn`` again is returned (dry runs).
        """
        from attnreg.graph_policy import capturing
        if not self.cuda:
            with capturing(mode):
                fn()
            return _EagerGraph(fn, mode)
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capturing(mode):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capturing(mode), torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph


def _timing(samples_us: list[float], method: str) -> dict[str, Any]:
    s = spread(samples_us)
    return {"median_us": s["median"], "p20_us": s["p20"], "p80_us": s["p80"],
            "min_us": s["min"], "max_us": s["max"], "n": s["n"], "method": method}


# ----------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------

def run_sections(ctx: RunContext, sections: list[Section], named: set[str]) -> dict[str, Any]:
    """Run ``sections`` in order, recording each one's status, data and time.

    A section raising :class:`SkipSection` is recorded as skipped with the
    reason; any other exception as an error with its traceback; either way the
    JSON is saved and the next section runs.
    """
    ctx.doc.setdefault("schema", SCHEMA)
    ctx.doc.setdefault("meta", environment(ctx.command, quick=ctx.quick, dry_run=ctx.dry_run))
    ctx.doc.setdefault("sections", {})
    ctx.save()
    for sec in sections:
        rec: dict[str, Any] = {"title": sec.title, "status": "running", "data": {}}
        ctx.doc["sections"][sec.id] = rec
        reason = _cannot_run_here(ctx, sec, named)
        if reason:
            rec.update(status="skipped", reason=reason)
            ctx.log(f"{sec.id}: skipped: {reason}")
            ctx.save()
            continue
        ctx.log(f"{sec.id}: {sec.title}")
        t0 = time.perf_counter()
        try:
            sec.load()(ctx, rec["data"])
            rec["status"] = "ok"
        except SkipSection as exc:
            rec.update(status="skipped", reason=str(exc))
            ctx.log(f"{sec.id}: skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - one section must not lose the others
            rec.update(status="error", error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc(limit=12))
            ctx.log(f"{sec.id}: ERROR {type(exc).__name__}: {exc}")
        finally:
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            ctx.save()
            _release_memory(ctx)
    ctx.doc["meta"]["total_seconds"] = round(ctx.elapsed_s(), 1)
    ctx.save()
    return ctx.doc


def _cannot_run_here(ctx: RunContext, sec: Section, named: set[str]) -> str | None:
    if ctx.out_of_time():
        return (f"time budget of {ctx.time_budget_s:.0f} s used up before this section "
                "(raise --time-budget-s or run it alone with --only)")
    if sec.where == "host":
        if ctx.cuda and sec.id not in named:
            return ("measures process start-up of the CPU development machine; its results "
                    "are benchmarks/results/cpu-startup.json (run it here with --only P5)")
        return None
    if not ctx.cuda and not ctx.dry_run:
        return "needs a CUDA device (on a CPU machine, --dry-run exercises it on tiny shapes)"
    return None


def _release_memory(ctx: RunContext) -> None:
    import gc
    gc.collect()
    if ctx._torch is not None and ctx.cuda:
        ctx.torch.cuda.empty_cache()


def python_command() -> str:
    """The command line as a user would type it (``python -m benchmarks ...``)."""
    argv = sys.argv[1:]
    return " ".join(["python", "-m", "benchmarks", *argv])
