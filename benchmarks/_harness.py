"""The benchmark harness: sections, the run context, timers, graphs, the JSON document.

A *section* is one figure of issue 7 (P1 ... P6, prefill) plus ``ceilings``
(the device copy bandwidth and matrix rate every other number is compared
with) and ``pool`` (the KV pool's page bookkeeping, on the CPU).  Each is a
function ``run(ctx, data)`` that fills the dict ``data`` as it measures; the
runner catches anything it raises, records it, saves the JSON and goes on, so
one failing section never loses the others.

Timing is :class:`attnreg.profiling.Clock` (the same clock ``attnreg
calibrate`` uses): CUDA events around each call, the L2 flushed before each
call unless asked otherwise, warm-up first, the median and the 20th/80th
percentiles of many calls reported.  On a machine
without CUDA, ``--dry-run`` runs the same code on tiny shapes (Triton kernels
in the interpreter, graphs replayed eagerly) to catch mistakes before a device
call; its times are wall-clock and are never rendered into docs/.

torch is imported lazily: P5 (process start-up) must run where torch is absent.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnreg.profiling import Clock, library_versions
from attnreg.profiling.progress import Progress

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "error_text",
    "shown_path",
    "RunContext",
    "Section",
    "SkipSection",
    "run_sections",
    "select_sections",
]

SCHEMA = "attnreg-bench/1"


class SkipSection(Exception):
    """Raised by a section that cannot run here; the message is the reason."""


@dataclass(frozen=True)
class Section:
    """One benchmark section: where it measures, states its checks and renders itself.

    Attributes
    ----------
    id : str
        ``ceilings``, ``P1`` ... ``P6``, ``prefill``, ``spec``, ``session``, ``peers``,
        ``sparse`` or ``pool``.
    title : str
    module : str
        The module under ``benchmarks`` that holds the three functions below.
    run, checks, render : str
        Names of ``run(ctx, data)`` (measures, fills ``data``),
        ``checks(data, runs=None)`` (the section's :class:`~benchmarks.metrics.Check`
        list; ``runs``: the data of every run of it, for figures stated as a
        median) and ``render(data, page)`` (markdown lines) in ``module``.
    where : str
        ``"device"``: needs CUDA (or ``--dry-run``); ``"host"``: measures this
        CPU machine (P5, pool), so on a GPU machine it runs only when asked by name.
    needs : tuple[str, ...]
        Sections whose data it reads; they are run first when selected implicitly.
    results : str
        A host section's committed results file under ``benchmarks/results/``.
    command : str
        How a device section that is run on its own is run, for the page's "Not
        measured yet" line ('': the whole device run's command).
    """

    id: str
    title: str
    module: str
    run: str = "run"
    checks: str = "checks"
    render: str = "render"
    where: str = "device"
    needs: tuple[str, ...] = ()
    results: str = ""
    command: str = ""

    def __post_init__(self) -> None:
        if self.where == "host" and not self.results:
            raise ValueError(f"host section {self.id} needs the name of its results file")

    def function(self, kind: str) -> Callable[..., Any]:
        """``run``, ``checks`` or ``render`` of this section, imported on first use."""
        module = importlib.import_module(f"benchmarks.{self.module}")
        return getattr(module, getattr(self, kind))

    def load(self) -> Callable[[RunContext, dict], None]:
        return self.function("run")

    @property
    def host_command(self) -> str:
        """How a host section is measured and its results committed (from the repo root)."""
        out = f"bench-out/{self.id.lower()}"
        return (f"python -m benchmarks --only {self.id} --out {out} && "
                f"cp {out}/results.json benchmarks/results/{self.results}")


#: Run order: cheap and most asked-for first, so a run cut short still has them.
SECTIONS: tuple[Section, ...] = (
    Section("ceilings", "Device ceilings: copy bandwidth and bf16 matrix rate", "ceilings"),
    Section("P1", "MLA decode: every backend, 7 shapes", "decode", "run_p1", "p1_checks",
            "render_p1", needs=("ceilings",)),
    Section("P2", "Best decode backend at (128, 4096, 16) against copy bandwidth", "decode",
            "run_p2", "p2_checks", "render_p2", needs=("ceilings",)),
    Section("P6", "Per-call overhead of a registry-resolved backend", "overhead",
            checks="p6_checks", render="render_p6"),
    Section("P3", "Split-KV inside a CUDA graph at B=1 vs forced one split", "split_kv",
            "run_p3", "p3_checks", "render_p3"),
    Section("P4", "8-layer DeepSeek-shaped MLA decode step: eager vs CUDA graph", "graphs",
            "run_p4", "p4_checks", "render_p4", needs=("ceilings",)),
    Section("prefill", "Prefill: absorbed extend vs MHA ragged prefill + decompression",
            "prefill", needs=("ceilings",)),
    Section("spec", "Speculative decoding: a 4-draft verify step, graph vs eager vs decode",
            "speculative"),
    Section("session", "8-layer DeepSeek-shaped attention step through GraphSession: decode "
            "and 4-draft verify, graph vs eager, host time of a step", "session_step"),
    Section("peers", "Decode against the raw kernels in one process: wrapper overhead, FP8 vs "
            "bf16, per-bucket backends (issue 31)", "decode_peers"),
    Section("sparse", "Sparse (DSA) MLA decode at top-k 2048 against dense decode at the same "
            "KV length (issue 32)", "sparse_decode",
            command="python -m benchmarks --only sparse --out bench-out/sparse --no-render"),
    Section("P5", "attnreg compat cold start vs python -c pass", "startup", where="host",
            results="cpu-startup.json"),
    Section("pool", "MLAKVPool.free: 100,000 pages of a 400,000-page pool", "pool_free",
            where="host", results="cpu-pool-free.json"),
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
        "device": {"kind": "cpu", "name": _cpu_model()},
    }
    try:
        import torch
    except ImportError:
        meta["versions"] = library_versions()
        return meta
    meta["versions"] = library_versions()  # with torch imported: its CUDA version too
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
    progress : Progress or None
        Where "section i of N" lines go (stderr, usually only on a terminal);
        None: no such lines.
    """

    out_dir: Path
    quick: bool = False
    dry_run: bool = False
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    time_budget_s: float = 300.0
    command: str = ""
    progress: Progress | None = None
    doc: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _torch: Any = None
    _clock: Clock | None = None

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
    @property
    def clock(self) -> Clock:
        """The run's one :class:`attnreg.profiling.Clock` (and its one L2-flush buffer)."""
        if self._clock is None:
            self._clock = Clock(self.torch, self.device, warmup_ms=self.warmup_ms,
                                rep_ms=self.rep_ms)
        return self._clock

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], *, flush_l2: bool = True) -> dict[str, Any]:
        """Median time of one call of ``fn`` with its spread (:meth:`Clock.calls`)."""
        return self.clock.calls(fn, flush_l2=flush_l2)

    def time_interleaved(self, fns: Mapping[str, Callable[[], Any]], *,
                         flush_l2: bool = True) -> dict[str, dict[str, Any]]:
        """:meth:`time` of several calls whose timed calls alternate
        (:meth:`Clock.interleaved`): their ratios compare calls timed alike."""
        return self.clock.interleaved(fns, flush_l2=flush_l2)

    def time_back_to_back(self, fn: Callable[[], Any], *, calls: int = 200,
                          rounds: int = 5) -> dict[str, Any]:
        """Per-call time of calls issued back to back (:meth:`Clock.back_to_back`); a dry
        run issues 3 calls once."""
        if self.dry_run:
            calls, rounds = 3, 1
        return self.clock.back_to_back(fn, calls=calls, rounds=rounds)


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
    progress = ctx.progress or Progress(len(sections), enabled=False)
    progress.total = len(sections)
    progress.budget_s = ctx.time_budget_s
    for sec in sections:
        progress.step(f"{sec.id}: {sec.title}")
        rec: dict[str, Any] = {"title": sec.title, "status": "running", "data": {}}
        ctx.doc["sections"][sec.id] = rec
        reason = _cannot_run_here(ctx, sec, named)
        if reason:
            rec.update(status="skipped", reason=reason)
            ctx.log(f"{sec.id}: skipped: {reason}")
            ctx.save()
            continue
        if not progress.enabled:
            # the progress line names the section on a terminal; a log keeps this line
            ctx.log(f"{sec.id}: {sec.title}")
        t0 = time.perf_counter()
        try:
            sec.load()(ctx, rec["data"])
            rec["status"] = "ok"
        except SkipSection as exc:
            rec.update(status="skipped", reason=str(exc))
            ctx.log(f"{sec.id}: skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - one section must not lose the others
            rec.update(status="error", error=error_text(exc),
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
            return (f"measures the CPU development machine; its results are "
                    f"benchmarks/results/{sec.results} (run it here with --only {sec.id})")
        return None
    if not ctx.cuda and not ctx.dry_run:
        return "needs a CUDA device (on a CPU machine, --dry-run exercises it on tiny shapes)"
    return None


def _release_memory(ctx: RunContext) -> None:
    import gc
    gc.collect()
    if ctx._torch is not None and ctx.cuda:
        ctx.torch.cuda.empty_cache()


def shown_path(path: str | Path) -> str:
    """``path`` relative to the working directory when inside it: committed results
    name no machine's paths (the repository root is where the benchmarks run)."""
    try:
        # absolute(), not resolve(): a venv's python is a link out of the tree
        return str(Path(path).absolute().relative_to(Path.cwd().absolute()))
    except ValueError:
        return str(path)


#: An absolute path of two or more parts (a kernel library's cache, a build directory)
_ABS_PATH = re.compile(r"(?<![\w.])/(?:[\w.+\-]+/)+([\w.+\-]*)")


def error_text(exc: BaseException, limit: int | None = None) -> str:
    """How a benchmark records an error it survives: ``Type: message``, every absolute
    path in the message cut to ``.../<last part>`` (committed results name no machine's
    paths; a JIT build failure quotes its cache directory), at most ``limit`` characters."""
    text = f"{type(exc).__name__}: {_ABS_PATH.sub(lambda m: '.../' + m.group(1), str(exc))}"
    return text if limit is None else text[:limit]


def python_command() -> str:
    """The command line as a user would type it (``python -m benchmarks ...``)."""
    argv = sys.argv[1:]
    return " ".join(["python", "-m", "benchmarks", *argv])
