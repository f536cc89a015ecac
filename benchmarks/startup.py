"""P5: cold process time of ``attnreg compat`` against ``python -c pass``.

An engine asks ``attnreg compat`` (or its Python API) at startup, so the
answer must cost little more than starting Python.  Measured with hyperfine
(``--shell=none``, warm-up runs, then many runs; each run is a new process, so
every import is paid again) and, where hyperfine is missing, with the same
number of ``subprocess`` runs timed by the wall clock.  Reported: median,
20th/80th percentile and min/max of each command, and the median difference.

Also checked, in a separate run: which modules ``attnreg compat`` has loaded
when it finishes.  torch (and any kernel library) must not be one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._harness import RunContext, SkipSection
from .metrics import evaluate, spread

#: Top-level packages ``attnreg compat`` must never import.
HEAVY = ("torch", "triton", "flashinfer", "flash_attn", "numpy")
COMPAT_ARGS = ("compat", "--model", "deepseek-v3")
COMPAT_SIM_ARGS = ("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3", "--json")
RUNS = 40
DRY_RUNS = 3
WARMUP = 5
GOAL_MS = 150.0


def _commands(python: str, attnreg: list[str]) -> dict[str, list[str]]:
    return {
        "python -c pass": [python, "-c", "pass"],
        "attnreg compat --model deepseek-v3": [*attnreg, *COMPAT_ARGS],
        "attnreg compat --platform cuda:sm90 --model deepseek-v3 --json":
            [*attnreg, *COMPAT_SIM_ARGS],
    }


def attnreg_command() -> list[str]:
    """The installed ``attnreg`` console script beside this Python, else ``python -m attnreg``."""
    script = Path(sys.executable).with_name("attnreg")
    if script.exists():
        return [str(script)]
    found = shutil.which("attnreg")
    return [found] if found else [sys.executable, "-m", "attnreg"]


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    attnreg = attnreg_command()
    commands = _commands(sys.executable, attnreg)
    # The commands must work before they are timed: a failing command starts fast.
    env = _clean_env()
    for label, argv in commands.items():
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env,
                              timeout=60)
        if proc.returncode != 0:
            raise SkipSection(f"`{label}` exits {proc.returncode}: {proc.stderr.strip()[-300:]}")
    runs = DRY_RUNS if ctx.dry_run else RUNS
    load_before = _loadavg()
    hyperfine = shutil.which("hyperfine")
    if hyperfine:
        results = _hyperfine(hyperfine, commands, runs, env)
        tool = f"hyperfine {_hyperfine_version(hyperfine)} --shell=none --warmup {WARMUP} " \
               f"--runs {runs}"
    else:
        results = _repeat(commands, runs, env)
        tool = f"subprocess.run, wall clock, {WARMUP} warm-up + {runs} runs (no hyperfine)"
    base = results["python -c pass"]["median_ms"]
    for label, r in results.items():
        r["above_python_ms"] = r["median_ms"] - base
        ctx.log(f"P5 {label}: median {r['median_ms']:.1f} ms "
                f"(p20 {r['p20_ms']:.1f}, p80 {r['p80_ms']:.1f}), +{r['above_python_ms']:.1f} ms")
    imports = imported_modules(COMPAT_ARGS, env)
    data.update(tool=tool, attnreg=" ".join(attnreg), python=sys.executable,
                results=results, imports=imports,
                load_average={"before": load_before, "after": _loadavg()})
    compat = results["attnreg compat --model deepseek-v3"]
    data["checks"] = [
        evaluate("P5", "attnreg compat cold start above python -c pass (median)",
                 compat["above_python_ms"], "ms", "<=", goal=GOAL_MS),
        evaluate("P5 imports", "heavy modules imported by attnreg compat (torch, triton, "
                 "flashinfer, flash_attn, numpy)", float(len(imports["heavy"])), "modules",
                 "<=", goal=0.0, detail=", ".join(imports["heavy"]) or "none"),
    ]
    data["checks"] = [c.to_dict() for c in data["checks"]]


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine widens the spread."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    # Measure what a user gets: no interpreter flag, no platform override from the harness.
    for key in ("TRITON_INTERPRET", "PYTHONPROFILEIMPORTTIME", "ATTNREG_PLATFORM"):
        env.pop(key, None)
    return env


def _hyperfine_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], check=False, capture_output=True, text=True)
    return out.stdout.strip().split()[-1] if out.returncode == 0 and out.stdout else "?"


def _hyperfine(exe: str, commands: dict[str, list[str]], runs: int,
               env: dict[str, str]) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "hyperfine.json"
        argv = [exe, "--shell=none", "--warmup", str(WARMUP), "--runs", str(runs),
                "--export-json", str(export), "--style", "none"]
        for label, cmd in commands.items():
            argv += ["--command-name", label, " ".join(cmd)]
        subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
        raw = json.loads(export.read_text())
    out = {}
    for entry in raw["results"]:
        times_ms = [t * 1e3 for t in entry["times"]]
        out[entry["command"]] = _summary(times_ms, entry.get("stddev"))
    return out


def _repeat(commands: dict[str, list[str]], runs: int,
            env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for label, cmd in commands.items():
        for _ in range(WARMUP):
            subprocess.run(cmd, capture_output=True, env=env, check=True)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=env, check=True)
            times.append((time.perf_counter() - t0) * 1e3)
        out[label] = _summary(times, None)
    return out


def _summary(times_ms: list[float], stddev_s: float | None) -> dict[str, Any]:
    s = spread(times_ms)
    res: dict[str, Any] = {"median_ms": s["median"], "p20_ms": s["p20"], "p80_ms": s["p80"],
                           "min_ms": s["min"], "max_ms": s["max"], "runs": s["n"],
                           "times_ms": [round(t, 3) for t in times_ms]}
    if stddev_s is not None:
        res["stddev_ms"] = stddev_s * 1e3
    return res


_LIST_MODULES = """
import json, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
sys.argv = ["attnreg", *args]
try:
    runpy.run_module("attnreg", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
with open(out, "w") as f:
    json.dump(sorted(sys.modules), f)
"""


def imported_modules(args: tuple[str, ...] | list[str], env: dict[str, str]) -> dict[str, Any]:
    """Modules loaded by ``attnreg ARGS`` (what is in ``sys.modules`` when it finishes).

    Runs the command in a fresh interpreter through ``runpy`` (the console
    script runs the same ``attnreg.cli:main``) and lists ``sys.modules`` at the
    end; ``-X importtime`` is not used for this because it also logs failed
    import attempts (``find_spec("flash_attn.cute")`` without flash-attn).
    """
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "modules.json"
        proc = subprocess.run([sys.executable, "-c", _LIST_MODULES, str(listing), *args],
                              check=False, capture_output=True, text=True, env=env, timeout=60)
        modules = json.loads(listing.read_text()) if listing.exists() else []
    heavy = sorted({m.split(".")[0] for m in modules if m.split(".")[0] in HEAVY})
    return {"command": "attnreg " + " ".join(args), "exit_code": proc.returncode,
            "count": len(modules), "heavy": heavy,
            "attnreg_modules": sorted(m for m in modules if m.startswith("attnreg"))}
