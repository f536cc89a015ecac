"""Host cost of a backend's eager decode path against the direct kernel call, on the CPU.

Usage::

    .venv/bin/python benchmarks/host_overhead.py [--label after] [--profile] [--quick]
    .venv/bin/python benchmarks/host_overhead.py --compare before after

The CPU-side counterpart of benchmark P6 (``benchmarks/overhead.py``): the same
shapes (B, L, H) with page size 1, the same three paths per backend, but every
kernel launch is stubbed out, so what is timed is only the Python and torch
host work around the kernels -- attnreg's share of an eager decode step.

* ``triton``: the two Triton launches of ``mla_decode`` are replaced by no-ops;
  the host wrapper (argument checks, launch config, workspace) still runs.
  ``kernel`` is ``mla_decode`` with a preallocated workspace: P6's own direct
  path (``benchmarks.overhead.DIRECT``).
* ``flashinfer_mla``: ``flashinfer`` is replaced by a stub whose
  ``BatchMLAPagedAttentionWrapper.plan`` / ``run`` only keep their arguments.
  ``kernel`` is ``run`` of a wrapper planned once; ``kernel_with_plan`` is
  ``plan`` + ``run`` with CSR inputs built once by hand: P6's direct paths,
  run against the stub.
* ``backend``: ``init_forward_metadata(batch)`` + ``forward_decode(...)`` per
  call; ``planned_once``: ``forward_decode`` only; ``metadata_only``:
  ``init_forward_metadata`` only (flashinfer plans lazily in the first forward,
  so for it the plan is in ``backend`` but not here).

Each path is timed with ``time.perf_counter_ns`` around back-to-back calls
(rounds of about ``--round-s`` seconds; the table shows the best round, per
call, since other processes share the machine; the JSON also has the median
and worst round).  torch runs one intra-op thread (``--threads``).  The ``device`` is ``cpu``, so device-side torch ops (the page-index
gather, say) run on the host here, and a host-to-device copy costs a memcpy
rather than a synchronising transfer: the numbers say where host time goes,
not what an H200 run will show.

Results go to ``benchmarks/results/host/cpu-host-overhead.json`` under
``runs[<label>]`` (other labels already in the file are kept, so a "before"
and an "after" run sit side by side).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

if __package__ in (None, ""):  # run as a script: the helpers are benchmarks'
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnreg.profiling import load_average  # noqa: E402
from benchmarks._harness import _cpu_model, shown_path  # noqa: E402
from benchmarks._report import Page, ResultsFile, rel  # noqa: E402
from benchmarks.metrics import Check  # noqa: E402
from benchmarks.overhead import DIRECT  # noqa: E402

SHAPES: tuple[tuple[int, int, int], ...] = ((8, 1024, 128), (64, 2048, 64), (128, 4096, 16),
                                            (1, 32768, 128))
QUICK_SHAPES: tuple[tuple[int, int, int], ...] = ((8, 1024, 128), (128, 4096, 16))
#: Extra rows: (B, L, H) with a page table twice as wide as the sequences need, as an
#: engine whose table spans the longest context has; the P6 shapes use every column.
WIDE_SHAPES: tuple[tuple[int, int, int], ...] = ((128, 4096, 16),)
OUT = Path(__file__).resolve().parent / "results" / "host" / "cpu-host-overhead.json"
COMMAND = ".venv/bin/python benchmarks/host_overhead.py"


# ----------------------------------------------------------------------------------------
# stubs
# ----------------------------------------------------------------------------------------
class _StubCompiled:
    """What a JIT launch returns, as the direct-launch cache reads it: a no-op launcher."""

    function = 0
    packed_metadata = (4, 1, 0)

    def run(self, *args: Any) -> None:
        return None


class _StubLaunch:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](*args)`` does nothing."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: Any) -> Callable[..., _StubCompiled]:
        def launch(*args: Any, **kwargs: Any) -> _StubCompiled:
            self.launches += 1
            return _StubCompiled()
        return launch


def stub_triton_launches() -> None:
    """Replace the decode and merge kernels of ``mla_decode`` with no-op launches.

    The direct-launch path (``_triton_kernels._launch``) is kept on with a stub
    device/stream query and no launch hooks, so the CPU timings hold the cached
    host path a GPU run takes, not Triton's JIT argument binding.
    """
    from attnreg.backends._triton_kernels import _launch
    from attnreg.backends._triton_kernels import decode as dec
    dec._mla_decode_kernel = _StubLaunch()  # type: ignore[assignment]
    dec._mla_merge_kernel = _StubLaunch()  # type: ignore[assignment]
    no_hook = types.SimpleNamespace(calls=())
    knobs = types.SimpleNamespace(launch_enter_hook=no_hook, launch_exit_hook=no_hook)
    if _launch.direct_launch_enabled():
        _launch._RT = (lambda: 0, lambda device: 0, knobs)


class _StubMLAWrapper:
    """flashinfer 0.6.13's ``BatchMLAPagedAttentionWrapper`` without any work.

    ``plan`` (positional form) and ``run`` keep their arguments and return, so
    the timings hold attnreg's host work and nothing of flashinfer's.
    """

    def __init__(self, float_workspace_buffer: Any, use_cuda_graph: bool = False,
                 qo_indptr: Any = None, kv_indptr: Any = None, kv_indices: Any = None,
                 kv_len_arr: Any = None, backend: str = "auto") -> None:
        self.backend = backend
        self._plan_info: list[int] | None = None
        self.planned: tuple[Any, ...] = ()

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype, use_profiler: bool = False) -> None:
        self.planned = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._plan_info = [1, 132]

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None, **kwargs: Any
            ) -> torch.Tensor | None:
        return out


class _StubRaggedWrapper:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def install_stub_flashinfer() -> None:
    """Put a do-nothing ``flashinfer`` (mla, prefill, decode) into ``sys.modules``."""
    fi = types.ModuleType("flashinfer")
    mla = types.ModuleType("flashinfer.mla")
    prefill = types.ModuleType("flashinfer.prefill")
    decode = types.ModuleType("flashinfer.decode")
    mla.BatchMLAPagedAttentionWrapper = _StubMLAWrapper  # type: ignore[attr-defined]
    prefill.BatchPrefillWithRaggedKVCacheWrapper = _StubRaggedWrapper  # type: ignore
    fi.mla, fi.prefill, fi.decode = mla, prefill, decode  # type: ignore[attr-defined]
    for name, module in (("flashinfer", fi), ("flashinfer.mla", mla),
                         ("flashinfer.prefill", prefill), ("flashinfer.decode", decode)):
        sys.modules[name] = module


# ----------------------------------------------------------------------------------------
# the paths of one shape
# ----------------------------------------------------------------------------------------
def make_backend(name: str, heads: int, max_len: int) -> Any:
    """A backend on ``cpu`` with the declaration it has where P6 ran it (sm90 for flashinfer)."""
    from attnreg.registry import load_registry
    from attnreg.runtime import MLAConfig

    cfg = MLAConfig(num_heads=heads, page_size=1, max_context_len=max_len, device="cpu")
    reg = load_registry(autoload=False)
    if name == "triton":
        return reg.create("triton", cfg, platform="cpu")
    from attnreg.backends.flashinfer_mla import FlashInferMLABackend
    return FlashInferMLABackend(cfg, capabilities=reg.declaration("flashinfer_mla",
                                                                  "cuda:sm90"))


def build_paths(name: str, shape: tuple[int, int, int], width: int
                ) -> dict[str, Callable[[], Any]]:
    """The timed callables of one (backend, shape), inputs built as P6 builds them.

    ``width``: columns of the page table (P6: ``L``, every column used).
    """
    import torch

    from attnreg.runtime import decode_batch

    B, L, H = shape
    torch.manual_seed(B + L + H)
    be = make_backend(name, H, max(L, width))
    pool = be.config.make_pool(B * L + 2)   # zeros: nothing reads the values
    batch = decode_batch(pool, [L] * B, pages=pool.allocate([L] * B, shuffle=L),
                         page_table_width=width)
    q = torch.randn(B, H, 576).to(torch.bfloat16)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16)
    paths = DIRECT[name](be, pool, batch, q, out)  # P6's direct paths, kernels stubbed

    def backend() -> None:
        be.init_forward_metadata(batch)
        be.forward_decode(q, None, None, pool, batch, out=out)

    def planned_once() -> None:
        be.forward_decode(q, None, None, pool, batch, out=out)

    def metadata_only() -> None:
        be.init_forward_metadata(batch)

    paths["backend"] = backend
    paths["metadata_only"] = metadata_only
    backend()  # plan once, for planned_once
    paths["planned_once"] = planned_once
    return paths


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------
def time_per_call(fn: Callable[[], Any], *, round_s: float, rounds: int) -> dict[str, Any]:
    """Best, median and worst of ``rounds`` rounds of back-to-back calls, in us per call.

    The calls per round are calibrated on a batch of calls lasting at least a
    tenth of ``round_s`` (one call alone can be an outlier).  The best round is
    the one least disturbed by other processes on the machine (``timeit``'s
    advice); the table shows it.
    """
    for _ in range(3):
        fn()
    n, spent = 1, 0
    while spent < round_s * 1e8:  # ns: a tenth of round_s
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        spent = time.perf_counter_ns() - t0
        if spent < round_s * 1e8:
            n *= 2
    n = max(1, min(200_000, int(n * round_s * 1e9 / max(spent, 1))))
    per_call = []
    gc.collect()
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / n / 1e3)
    per_call.sort()
    return {"best_us": per_call[0], "median_us": per_call[len(per_call) // 2],
            "max_us": per_call[-1], "calls_per_round": n, "rounds": rounds}


def profile(fn: Callable[[], Any], calls: int, top: int) -> str:
    """cProfile of ``calls`` back-to-back calls: the ``top`` entries by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def measure(backends: list[str], cases: list[tuple[tuple[int, int, int], int]], *,
            round_s: float, rounds: int, prof: bool) -> list[dict[str, Any]]:
    """One row per (backend, (shape, page-table width))."""
    rows = []
    for name in backends:
        for shape, width in cases:
            paths = build_paths(name, shape, width)
            row: dict[str, Any] = {"variant": name, "B": shape[0], "L": shape[1],
                                   "H": shape[2], "table_width": width}
            for label, fn in paths.items():
                row[label] = time_per_call(fn, round_s=round_s, rounds=rounds)
            base = "kernel_with_plan" if "kernel_with_plan" in row else "kernel"
            row["baseline"] = base
            row["added_us"] = row["backend"]["best_us"] - row[base]["best_us"]
            row["added_us_planned_once"] = (row["planned_once"]["best_us"]
                                            - row["kernel"]["best_us"])
            rows.append(row)
            print(_row_line(row), flush=True)
            if prof:
                for label in ("backend", "planned_once"):
                    print(f"--- cProfile {name} {shape} width {width} {label} ---")
                    print(profile(paths[label], max(1, row[label]["calls_per_round"]), 25))
            del paths
            gc.collect()
    return rows


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------
HEADER = ("| variant | (B, L, H) | table width | direct us/call "
          "| backend us/call (metadata + forward) | added us | metadata only us "
          "| planned once us | run only us | added us, planned once |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _row_line(row: dict[str, Any]) -> str:
    def us(key: str) -> str:
        return f"{row[key]['best_us']:.1f}"

    return (f"| {row['variant']} | ({row['B']}, {row['L']}, {row['H']}) | "
            f"{row['table_width']} | {us(row['baseline'])} ({row['baseline']}) | {us('backend')} | "
            f"{row['added_us']:+.1f} | {us('metadata_only')} | {us('planned_once')} | "
            f"{us('kernel')} | {row['added_us_planned_once']:+.1f} |")


def write(label: str, argv: list[str], rows: list[dict[str, Any]], path: Path,
          load_start: list[float] | None) -> None:
    """Store this run as ``runs[label]`` of the JSON file, keeping the other runs."""
    import torch

    import attnreg

    doc: dict[str, Any] = {"schema": "attnreg-host-overhead/1", "runs": {}}
    if path.exists():
        doc = json.loads(path.read_text())
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    doc["runs"][label] = {
        "command": env + " ".join([COMMAND, *argv]),
        "attnreg_source": shown_path(Path(attnreg.__file__).resolve().parent),
        "date_utc": datetime.datetime.now(datetime.timezone.utc)
        .strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "os": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
        "method": "time.perf_counter_ns around back-to-back calls, best of the rounds; "
                  "kernels stubbed (Triton launches are no-ops, flashinfer plan/run keep "
                  "their arguments)",
        # 1, 5 and 15 minute load averages: other processes share the machine
        "load_average_start": load_start, "load_average_end": load_average(),
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def compare(doc: dict[str, Any], before: str, after: str) -> str:
    """A markdown table of two stored runs, row by row (best round, us per call)."""
    runs = doc["runs"]
    old = {_key(r): r for r in runs[before]["rows"]}
    lines = [f"| variant | (B, L, H) | table width | direct (plan +) run "
             f"| metadata + forward, {before} | metadata + forward, {after} | direct run "
             f"| forward only, {before} | forward only, {after} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for new in runs[after]["rows"]:
        was = old.get(_key(new))
        if was is None:
            continue

        def us(row: dict[str, Any], key: str) -> str:
            return f"{row[key]['best_us']:,.1f}"

        lines.append(f"| {new['variant']} | ({new['B']}, {new['L']}, {new['H']}) | "
                     f"{new['table_width']} | {us(new, new['baseline'])} | "
                     f"{us(was, 'backend')} | **{us(new, 'backend')}** | "
                     f"{us(new, 'kernel')} | "
                     f"{us(was, 'planned_once')} | **{us(new, 'planned_once')}** |")
    return "\n".join(lines)


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["variant"], row["B"], row["L"], row["H"], row["table_width"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after",
                    help="key of this run in the JSON file (default: after)")
    ap.add_argument("--backends", default="triton,flashinfer_mla")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--round-s", type=float, default=0.2,
                    help="seconds of back-to-back calls per round (default 0.2)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1)")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of the backend paths of each shape")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="measure nothing: print a table of two runs stored in --out")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(json.loads(args.out.read_text()), *args.compare))
        return 0
    # The Triton kernels are never launched here, but importing them without a GPU
    # needs the interpreter mode the test-suite uses (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "1")
    import torch

    # One intra-op thread: the device ops that run on the host here (cpu "device")
    # would otherwise compete for the 2 cores with whatever else runs.
    torch.set_num_threads(args.threads)
    stub_triton_launches()
    install_stub_flashinfer()
    load_start = load_average()
    cases = [(s, s[1]) for s in (QUICK_SHAPES if args.quick else SHAPES)]
    cases += [(s, 2 * s[1]) for s in WIDE_SHAPES]
    print(HEADER, flush=True)
    rows = measure(args.backends.split(","), cases, round_s=args.round_s,
                   rounds=args.rounds, prof=args.profile)
    if not args.no_write:
        write(args.label, argv, rows, args.out, load_start)
        print(f"wrote {args.out} (runs[{args.label!r}])")
    return 0



# ----------------------------------------------------------------------------------------
# rendering (python -m benchmarks.render: results/host/*.json)
# ----------------------------------------------------------------------------------------

TITLE = "Host cost of the eager decode path (CPU, kernels stubbed)"
SCHEMA = "attnreg-host-overhead/1"
RESULTS = ("host", "*.json")


def read(path: Path) -> dict[str, Any]:
    """A results file of this script (``ValueError`` for anything else)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA or not isinstance(doc.get("runs"), dict):
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r} "
                         "(written by benchmarks/host_overhead.py)")
    return dict(doc)


def where(doc: dict[str, Any]) -> str:
    return "CPU"


def checks(doc: dict[str, Any]) -> list[Check]:
    """None: this breaks P6's host cost down; P6 carries the goal."""
    return []


def render(files: list[ResultsFile], page: Page) -> list[str]:
    """Each stored run's provenance, then before / after side by side (or each run alone)."""
    lines = [f"## {TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{COMMAND} --label LABEL` on the CPU machine.",
                        ""]
    lines += [("The CPU-side counterpart of P6: the same shapes and paths with every kernel "
               "launch stubbed, so only the host work around the kernels is timed.  What the "
               "host does in each path, and what changed between the runs: "
               "[benchmarks-host-overhead.md](benchmarks-host-overhead.md)."), ""]
    for f in files:
        runs = f.doc["runs"]
        for label, run in runs.items():
            lines += [f"- *{label}*: measured {run.get('date_utc', '?')} on {run.get('cpu')} "
                      f"({run.get('cpu_count')} cores), python {run.get('python')}, torch "
                      f"{run.get('torch')}, {run.get('torch_threads')} torch thread(s), "
                      f"load average {run.get('load_average_start')} -> "
                      f"{run.get('load_average_end')}; command `{run.get('command')}`."]
        lines += ["", f"{next(iter(runs.values())).get('method', '')}; us per call, best round; "
                  f"data: `{rel(f.path, page.root)}`.", ""]
        if {"before", "after"} <= runs.keys():
            lines += [compare(f.doc, "before", "after"), ""]
        else:
            for label, run in runs.items():
                lines += [f"*{label}*:", "", HEADER] + [_row_line(r) for r in run["rows"]] + [""]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
