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

from attnreg.profiling import load_average, spread

from ._harness import RunContext, SkipSection, shown_path
from ._report import Page, md_table
from .metrics import Check, evaluate

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
    load_before = load_average()
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
    data.update(tool=tool, attnreg=" ".join(shown_path(a) for a in attnreg),
                python=shown_path(sys.executable),
                results=results, imports=imports,
                load_average={"before": load_before, "after": load_average()})
    data["checks"] = [c.to_dict() for c in checks(data)]


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """Start-up above ``python -c pass`` against the goal, and no heavy import."""
    compat = data.get("results", {}).get("attnreg compat --model deepseek-v3", {})
    heavy = data.get("imports", {}).get("heavy")
    return [
        evaluate("P5", "attnreg compat cold start above python -c pass (median)",
                 compat.get("above_python_ms"), "ms", "<=", goal=GOAL_MS),
        evaluate("P5 imports", "heavy modules imported by attnreg compat (torch, triton, "
                 "flashinfer, flash_attn, numpy)", None if heavy is None else float(len(heavy)),
                 "modules", "<=", goal=0.0, detail=", ".join(heavy or []) or "none"),
    ]


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

# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def render(data: dict[str, Any], page: Page) -> list[str]:
    results = data.get("results", {})
    rows = [[f"`{k}`", f"{r['median_ms']:.1f}", f"{r['p20_ms']:.1f} – {r['p80_ms']:.1f}",
             f"{r['min_ms']:.1f} – {r['max_ms']:.1f}", str(r["runs"]),
             f"+{r['above_python_ms']:.1f}"] for k, r in results.items()]
    imports = data.get("imports", {})
    load = data.get("load_average") or {}
    load_txt = (f"  Load average (1/5/15 min) before / after: {load.get('before')} / "
                f"{load.get('after')}.") if load else ""
    out = [f"Tool: {data.get('tool')}.  Each run is a new process.{load_txt}", "",
           md_table(["command", "median ms", "p20 – p80 ms", "min – max ms", "runs",
                     "above python -c pass (ms)"], rows), "",
           (f"Imports (`{imports.get('command')}`): {imports.get('count')} modules, "
           f"{len(imports.get('attnreg_modules', []))} of them attnreg's; torch / kernel "
           f"libraries: **{', '.join(imports.get('heavy', [])) or 'none'}**.")]
    if page.plot.available and results:
        fig, ax = page.plot.plt.subplots(figsize=(9, 3.2))
        names = list(results)
        data_ms = [results[n]["times_ms"] for n in names]
        try:  # matplotlib >= 3.10 names it orientation; vert= is deprecated there
            ax.boxplot(data_ms, orientation="horizontal", widths=0.5)
        except TypeError:
            ax.boxplot(data_ms, vert=False, widths=0.5)
        ax.set_yticks(range(1, len(names) + 1))
        ax.set_yticklabels(names, fontsize=8)
        goal = next((c.get("goal") for c in data.get("checks", []) if c.get("id") == "P5"), None)
        base = results.get("python -c pass", {}).get("median_ms")
        if goal is not None and base is not None:
            ax.axvline(base + goal, color="tab:red", ls="--", lw=1,
                       label=f"goal: python -c pass + {goal:.0f} ms")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel("ms per process (cold start)")
        ax.grid(axis="x", alpha=0.3)
        ax.set_title("attnreg compat start-up vs python -c pass")
        out += page.image(fig, "p5_startup.png", "P5 start-up")
    return out
