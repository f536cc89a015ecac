"""Render benchmark results (JSON) into docs/benchmarks.md and PNG plots.

``python -m benchmarks.render [FILES ...]`` (default: ``benchmarks/results/*.json``,
device results first) writes ``docs/benchmarks.md`` and ``docs/img/*.png``.
After the harness's sections it renders the two standalone benchmarks:
``benchmarks/results/cost-gate/*.json`` (``benchmarks/cost_gate.py``, issue 10)
and ``benchmarks/results/multi/*-summary.json`` (``benchmarks/multi_gpu.py``,
issue 9).
Every number in the page comes from a results file, next to the command,
date, device and library versions that produced it; a section no file has
measured says "not measured" and how to measure it.  Missed targets get the
reason the data shows and the next step.

Dry-run results (tiny shapes, CPU wall clock) are refused for docs/ and
accepted only for a preview (``python -m benchmarks`` renders one into its
output folder, with a banner).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._harness import SCHEMA, SECTIONS

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS_MD = ROOT / "docs" / "benchmarks.md"
DOCS_IMG = ROOT / "docs" / "img"
NOTES = RESULTS_DIR / "notes.md"
COST_GATE_DIR = RESULTS_DIR / "cost-gate"
MULTI_DIR = RESULTS_DIR / "multi"
REPEATS_DIR = RESULTS_DIR / "repeats"

DEVICE_COMMAND = ("source .gpu/setup.sh && pip install --no-deps --no-build-isolation -e . -q "
                  "&& python3 -m benchmarks --out $OUT/bench")
HOST_COMMAND = ("python -m benchmarks --only P5 --out /tmp/p5 && "
                "cp /tmp/p5/results.json benchmarks/results/cpu-startup.json")


@dataclass
class ResultsFile:
    path: Path
    doc: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.doc.get("meta", {})

    @property
    def dry_run(self) -> bool:
        return bool(self.meta.get("dry_run"))


# ----------------------------------------------------------------------------------------
# Loading and choosing
# ----------------------------------------------------------------------------------------

def default_result_files(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """Committed results, device runs (``h200*``) first, then the rest by name."""
    files = sorted(results_dir.glob("*.json"))
    return sorted(files, key=lambda p: (not p.name.startswith("h200"), p.name))


def load(paths: list[Path]) -> list[ResultsFile]:
    out = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"{p}: schema {doc.get('schema')!r}, expected {SCHEMA!r} "
                             "(written by python -m benchmarks)")
        out.append(ResultsFile(Path(p), doc))
    return out


def choose(files: list[ResultsFile]) -> dict[str, tuple[ResultsFile, dict[str, Any]]]:
    """For each section: the first file where it is ok, else the first file that has it."""
    chosen: dict[str, tuple[ResultsFile, dict[str, Any]]] = {}
    for sec in SECTIONS:
        fallback = None
        for f in files:
            rec = f.doc.get("sections", {}).get(sec.id)
            if rec is None:
                continue
            if rec.get("status") == "ok":
                chosen[sec.id] = (f, rec)
                break
            fallback = fallback or (f, rec)
        else:
            if fallback:
                chosen[sec.id] = fallback
    return chosen


# ----------------------------------------------------------------------------------------
# Formatting helpers
# ----------------------------------------------------------------------------------------

def fmt(value: Any, spec: str = ".3g", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return none if value is None or math.isnan(value) else "inf"
    return format(value, spec)


def pct(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f}%"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _versions(meta: dict[str, Any]) -> str:
    v = meta.get("versions", {})
    parts = [f"{k} {v[k]}" for k in ("torch", "triton", "flashinfer-python", "flash-attn-4")
             if v.get(k)]
    if v.get("torch_cuda"):
        parts.append(f"CUDA {v['torch_cuda']}")
    parts.append(f"python {meta.get('python', '?')}")
    return ", ".join(parts)


def _device(meta: dict[str, Any]) -> str:
    d = meta.get("device", {})
    if d.get("kind") == "cuda":
        extra = f", driver {d['nvidia_smi.driver_version']}" \
            if d.get("nvidia_smi.driver_version") else ""
        return f"{d.get('name')} ({d.get('arch')}, {d.get('sms')} SMs{extra})"
    return f"CPU: {d.get('name') or meta.get('cpu')} ({meta.get('cpu_count')} cores)"


def provenance(f: ResultsFile, rec: dict[str, Any], root: Path = ROOT) -> str:
    m = f.meta
    try:
        rel = f.path.resolve().relative_to(root)
    except ValueError:
        rel = f.path
    commit = f", commit {m['git_commit']}" if m.get("git_commit") else ""
    quick = " (--quick)" if m.get("quick") else ""
    return (f"*Measured* {m.get('date_utc', '?')} on {_device(m)}; {_versions(m)}{commit}.  \n"
            f"*Command:* `{m.get('command', '?')}`{quick}; section took "
            f"{fmt(rec.get('seconds'), '.0f')} s; data: `{rel}`.")


def _check_line(c: dict[str, Any]) -> str:
    bounds = []
    for key in ("target", "goal"):
        if c.get(key) is not None:
            bounds.append(f"{key} {c['direction']} {_fmt_unit(c[key], c['unit'])}")
    measured = _fmt_unit(c.get("measured"), c["unit"])
    ratio = ""
    ref = c.get("target") if c.get("target") is not None else c.get("goal")
    if c.get("measured") is not None and ref:
        ratio = f"; measured / {'target' if c.get('target') is not None else 'goal'} = " \
                f"{c['measured'] / ref:.2f}"
    detail = f" ({c['detail']})" if c.get("detail") else ""
    return (f"**{c['id']}** — {c['what']}: **{measured}**{detail}; {', '.join(bounds)}"
            f"{ratio} → **{c['status']}**")


def _fmt_unit(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "ratio":  # an "x" figure whose target sits close to it (1.045 vs 1.05)
        return f"{value:.3f}x"
    if unit in ("of copy", "overhead"):
        return f"{value * 100:.1f}%"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "modules":
        return f"{value:.0f}"
    return f"{value:.3g} {unit}"


# ----------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------

class Plotter:
    """Writes PNGs with matplotlib (Agg); ``available`` is False without matplotlib."""

    def __init__(self, img_dir: Path, enabled: bool = True) -> None:
        self.img_dir = img_dir
        self.written: list[Path] = []
        self.plt: Any = None
        self.why_not = ""
        if not enabled:
            self.why_not = "plots disabled (--no-plots)"
            return
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            self.plt = plt
        except ImportError:
            self.why_not = "matplotlib is not installed where this was rendered"

    @property
    def available(self) -> bool:
        return self.plt is not None

    def save(self, fig: Any, name: str) -> Path:
        self.img_dir.mkdir(parents=True, exist_ok=True)
        path = self.img_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.plt.close(fig)
        self.written.append(path)
        return path


def _bar_groups(ax: Any, groups: list[str], series: dict[str, list[float | None]],
                ylabel: str, *, log: bool = False) -> None:
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in vals]
        bars = ax.bar(xs, ys, width, label=name)
        for b, v in zip(bars, vals):
            if v is None:
                b.set_hatch("//")
                b.set_alpha(0.2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


# ----------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------

def _not_run_notes(data: dict[str, Any], not_declared: dict[str, str]) -> list[str]:
    """Why a backend has no numbers: not available here, or the request is not declared."""
    out = []
    skipped = data.get("skipped_variants") or {}
    if skipped:
        out += ["", "Not run here: " + "; ".join(f"`{k}`: {v}" for k, v in skipped.items())]
    if not_declared:
        out += ["", "Not declared for these requests (the backend's own declaration): "
                + "; ".join(f"`{k}`: {v}" for k, v in not_declared.items())]
    return out


SectionRenderer = Callable[[dict[str, Any], Plotter, str], list[str]]


def render_ceilings(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    copy, gemm = data.get("copy", {}), data.get("gemm_bf16", {})
    rows = []
    if copy:
        rows.append(["device-to-device copy", f"{copy['bytes_copied'] / 2**30:.2f} GiB",
                     f"{copy['timing']['median_us']:.0f} us",
                     f"**{copy['GBps'] / 1e3:.2f} TB/s** (read + write)"])
    if gemm:
        rows.append([f"bf16 matmul {gemm['n']}³", f"{gemm['flops'] / 1e12:.2f} TFLOP",
                     f"{gemm['timing']['median_us']:.0f} us",
                     f"**{gemm['TFLOPs']:.0f} TFLOP/s**"])
    return [md_table(["ceiling", "size", "median time", "rate"], rows)]


def render_p1(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    labels = data.get("variants", [])
    copy = data.get("copy_GBps")
    header = ["(B, L, H)", "MB moved"] + [f"{v} us (TB/s, % copy)" for v in labels] + \
        ["triton / fa3"]
    rows = []
    not_declared: dict[str, str] = {}
    summary = data.get("summary", {})
    per_shape = {tuple(p["shape"]): p for p in summary.get("per_shape", [])}
    for r in data.get("rows", []):
        shape = (r["B"], r["L"], r["H"])
        if r.get("skipped") or r.get("error"):
            why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + r["error"]
            rows.append([str(shape), "-"] + [why[:80]] * len(labels) + ["-"])
            continue
        cells = [f"({r['B']}, {r['L']}, {r['H']})", f"{r['bytes'] / 1e6:.1f}"]
        best = per_shape.get(shape, {}).get("best")
        for v in labels:
            res = r["results"].get(v, {})
            if res.get("not_declared"):
                not_declared[v] = res["not_declared"]
                cells.append("not declared")
                continue
            if "us" not in res:
                cells.append("error: " + res.get("error", "?")[:60])
                continue
            cell = f"{res['us']:.1f} ({res['GBps'] / 1e3:.2f}, {pct(res.get('copy_share'))})"
            if res.get("mode") == "eager":
                cell += " eager"
            if not res.get("correct", True):
                cell += f" **wrong: rel.err {res['rel_err']:.1e}**"
            if v == best:
                cell = f"**{cell}**"
            cells.append(cell)
        ratio = per_shape.get(shape, {}).get("triton_over_fa3")
        cells.append(fmt(ratio, ".2f") + ("x" if ratio else ""))
        rows.append(cells)
    out = [(f"bf16, page size {data.get('page_size')}, page order {data.get('page_order')}; "
           f"{data.get('timing')}.  Bytes = KV rows (512 + 64) read once + q + out.  Copy "
           f"bandwidth of the same run: {fmt(copy and copy / 1e3, '.2f')} TB/s.  Bold: the "
           "fastest correct backend of the shape."), "", md_table(header, rows)]
    out += _not_run_notes(data, not_declared)
    errs = [f"{r['B'], r['L'], r['H']} {v}: {res.get('graph_error')}"
            for r in data.get("rows", []) for v, res in r.get("results", {}).items()
            if res.get("graph_error")]
    if errs:
        out += ["", "Timed eagerly because capture failed: " + "; ".join(errs)]
    if plot.available and data.get("rows"):
        timed = [r for r in data["rows"] if r.get("results")]
        groups = [f"{r['B']},{r['L']},{r['H']}" for r in timed]
        series = {v: [(r["results"].get(v, {}).get("GBps") or 0) / 1e3 or None for r in timed]
                  for v in labels}
        fig, (ax1, ax2) = plot.plt.subplots(1, 2, figsize=(13, 4.2),
                                            gridspec_kw={"width_ratios": [3, 1.4]})
        _bar_groups(ax1, groups, series, "achieved TB/s (min. bytes / median time)")
        if copy:
            ax1.axhline(copy / 1e3, color="k", ls="--", lw=1)
            ax1.text(len(groups) - 0.5, copy / 1e3 * 1.01, f"copy {copy / 1e3:.2f} TB/s",
                     fontsize=8, ha="right", va="bottom")
        ax1.set_xlabel("(B, L, H)")
        ax1.set_title("MLA decode bandwidth per backend")
        ratios = [per_shape.get((r["B"], r["L"], r["H"]), {}).get("triton_over_fa3")
                  for r in timed]
        bars = ax2.bar(range(len(groups)), [x or 0 for x in ratios], color="tab:blue")
        for bar, x in zip(bars, ratios):
            if x:
                ax2.text(bar.get_x() + bar.get_width() / 2, x, f"{x:.2f}", ha="center",
                         va="bottom", fontsize=7)
        ax2.axhline(1.25, color="tab:red", ls="--", lw=1, label="target 1.25")
        ax2.axhline(1.0, color="tab:green", ls=":", lw=1, label="goal 1.0")
        ax2.set_xticks(range(len(groups)))
        ax2.set_xticklabels(groups, rotation=45, fontsize=7)
        ax2.set_title("triton / flashinfer fa3 time")
        ax2.legend(fontsize=7)
        plot.save(fig, "p1_decode.png")
        out += ["", f"![P1 decode bandwidth and triton/fa3 ratio]({img_rel}/p1_decode.png)"]
    return out


def render_p2(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    shares = data.get("shares", {})
    rows = [[k, f"{v * data['copy_GBps'] / 1e3:.2f} TB/s", pct(v, 1)]
            for k, v in sorted(shares.items(), key=lambda kv: -kv[1])]
    return [(f"Shape {tuple(data.get('shape', []))}; source: {data.get('source')}; copy "
            f"bandwidth {fmt((data.get('copy_GBps') or 0) / 1e3, '.2f')} TB/s."), "",
            md_table(["backend", "achieved", "share of copy"], rows)]


def render_p3(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    labels = data.get("variants", [])
    header = ["H", "L"] + [f"{k}: {v} us" for k in ("decode", "extend") for v in labels] + \
        ["decode one/split", "extend one/split"]
    rows = []
    not_declared: dict[str, str] = {}
    for r in data.get("rows", []):
        if r.get("skipped") or r.get("error"):
            why = "skipped" if r.get("skipped") else "error: " + r["error"][:60]
            rows.append([str(r["H"]), str(r["L"])] + [why] * (2 * len(labels) + 2))
            continue
        cells = [str(r["H"]), str(r["L"])]
        for kind in ("decode", "extend"):
            for v in labels:
                res = r["results"].get(v, {})
                k = res.get(kind, {}) if "error" not in res else {"error": res["error"]}
                if k.get("not_declared"):
                    not_declared[v] = k["not_declared"]
                    cells.append("not declared")
                    continue
                if "us" in k:
                    cell = f"{k['us']:.1f}"
                    if k.get("max_splits"):
                        cell += f" ({k['max_splits']} splits)"
                    if not k.get("correct", True):
                        cell += f" **wrong {k['rel_err']:.1e}**"
                else:
                    cell = "error: " + str(k.get("error", "?"))[:50]
                cells.append(cell)
        cells += [fmt(r.get("decode_speedup"), ".1f") + "x", fmt(r.get("extend_speedup"),
                                                                 ".1f") + "x"]
        rows.append(cells)
    out = [(f"B = 1, {data.get('extend_tokens')} new tokens for extend; {data.get('timing')}.  "
           "'triton one split' is the same backend with `force_kv_splits=1`: what a backend "
           "that must force one split under capture (seed 000, defect 2) gets."), "",
           md_table(header, rows)]
    out += _not_run_notes(data, not_declared)
    if plot.available and data.get("rows"):
        fig, axes = plot.plt.subplots(1, 2, figsize=(12, 4))
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
        styles = ["-", "--", ":", "-."]
        for ax, kind in zip(axes, ("decode", "extend")):
            for hi, heads in enumerate(data.get("heads", [])):
                rs = [r for r in data["rows"] if r.get("H") == heads and r.get("results")]
                for vi, v in enumerate(labels):
                    pts = [(r["L"], r["results"].get(v, {}).get(kind, {}).get("us"))
                           for r in rs]
                    pts = [(x, y) for x, y in pts if y]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                color=colors[hi % len(colors)], ls=styles[vi % len(styles)],
                                label=f"{v}, H={heads}")
                for r in rs:
                    if r.get(f"{kind}_speedup"):
                        one = r["results"].get("triton one split", {}).get(kind, {}).get("us")
                        if one:
                            ax.annotate(f"{r[kind + '_speedup']:.1f}x", (r["L"], one),
                                        textcoords="offset points", xytext=(0, 5),
                                        ha="center", fontsize=7,
                                        color=colors[hi % len(colors)])
            lens = data.get("lens") or []
            ax.set_xscale("log", base=2)
            ax.set_xticks(lens)
            ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in lens])
            ax.set_yscale("log")
            ax.set_xlabel("KV length L")
            ax.set_ylabel("us per call (graph replay)")
            ax.set_title(f"absorbed {kind}, B=1 (labels: one split / split-KV)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        plot.save(fig, "p3_split_kv.png")
        out += ["", f"![P3 split-KV vs one split]({img_rel}/p3_split_kv.png)"]
    return out


def render_p4(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    shape = data.get("shape", {})
    header = ["backend", "B", "eager us", "graph us", "eager / graph", "memory floor us",
              "graph / floor", "graph vs eager rel.err"]
    rows = []
    for r in data.get("rows", []):
        if "eager_us" not in r:
            why = r.get("error") or r.get("skipped") or (
                "not declared: " + r["not_declared"] if r.get("not_declared") else "-")
            rows.append([r.get("variant", "?"), str(r.get("B", "-")), why, "", "", "", "", ""])
            continue
        floor = r.get("floor_us")
        rows.append([r["variant"], str(r["B"]), f"{r['eager_us']:.0f}", f"{r['graph_us']:.0f}",
                     f"**{r['speedup']:.2f}x**", fmt(floor, ".0f"),
                     fmt(floor and r["graph_us"] / floor, ".2f"),
                     f"{r['graph_vs_eager_rel_err']:.1e}"])
    out = [(f"{shape.get('layers')} layers, hidden {shape.get('hidden')}, q_lora "
           f"{shape.get('q_lora')}, kv_lora {shape.get('kv_lora')}, rope {shape.get('rope')}, "
           f"nope {shape.get('nope')}, v {shape.get('v_dim')}, {shape.get('heads')} heads, "
           f"bf16 random weights ({(data.get('weight_bytes') or 0) / 1e9:.2f} GB), KV length "
           f"{data.get('seq_len')}; attention blocks only (no MoE/MLP).  {data.get('timing')}.  "
           "Memory floor: weights + KV read once at the copy bandwidth."), "",
           md_table(header, rows)] + _not_run_notes(data, {})
    if plot.available and data.get("rows"):
        ok = [r for r in data["rows"] if "eager_us" in r]
        groups = [f"{r['variant']}\nB={r['B']}" for r in ok]
        series = {"eager": [r["eager_us"] / 1e3 for r in ok],
                  "CUDA graph": [r["graph_us"] / 1e3 for r in ok]}
        fig, ax = plot.plt.subplots(figsize=(max(6, 1.3 * len(ok)), 4))
        _bar_groups(ax, groups, series, "ms per decode step")
        floors = [r.get("floor_us") for r in ok]
        if any(floors):
            ax.scatter(range(len(ok)), [(f or 0) / 1e3 for f in floors], marker="_", s=600,
                       color="k", label="memory floor", zorder=3)
            ax.legend(fontsize=8)
        for i, r in enumerate(ok):
            ax.text(i, r["eager_us"] / 1e3, f"{r['speedup']:.1f}x", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylim(0, max(r["eager_us"] for r in ok) / 1e3 * 1.25)
        ax.legend(fontsize=8, loc="upper left", ncol=3)
        ax.set_title("8-layer MLA decode step: eager vs CUDA graph (labels: eager / graph)")
        plot.save(fig, "p4_graphs.png")
        out += ["", f"![P4 eager vs graph]({img_rel}/p4_graphs.png)"]
    return out


def render_prefill(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    labels = data.get("variants", [])
    header = ["prefix", "extend", "backend", "absorbed ms", "MHA + decompress ms",
              "absorbed / MHA", "attention ms (absorbed / MHA)",
              "attention TFLOP/s (absorbed / MHA)", "rel.diff"]
    rows = []
    not_declared: dict[str, str] = {}
    for r in data.get("rows", []):
        if r.get("skipped") or r.get("error"):
            why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + r["error"]
            rows.append([str(r["prefix"]), str(r["extend"]), "-", why[:100]] + [""] * 5)
            continue
        for v in labels:
            res = r["results"].get(v, {})
            if res.get("not_declared"):
                not_declared[v] = res["not_declared"]
                rows.append([str(r["prefix"]), str(r["extend"]), v, "not declared"] + [""] * 5)
                continue
            if "absorbed" not in res and "mha" in res:
                # MHA prefill only (e.g. flash_attn_cute on sm90): its eager side alone
                not_declared[v] = res.get("absorbed_not_declared", "absorbed not declared")
                rows.append([
                    str(r["prefix"]), str(r["extend"]), v, "not declared",
                    f"{res['mha']['us'] / 1e3:.3f}", "-",
                    f"- / {res['mha_attention']['us'] / 1e3:.3f}",
                    f"- / {res['mha_attention']['TFLOPs']:.0f}",
                    f"{res['rel_diff_mha_vs_reference']:.1e} vs reference"
                    + ("" if res.get("agree", True) else " **disagree**")])
                continue
            if "absorbed" not in res:
                rows.append([str(r["prefix"]), str(r["extend"]), v,
                             "error: " + res.get("error", "?")[:80]] + [""] * 5)
                continue
            rows.append([
                str(r["prefix"]), str(r["extend"]), v, f"{res['absorbed']['us'] / 1e3:.3f}",
                f"{res['mha']['us'] / 1e3:.3f}", f"**{res['absorbed_over_mha']:.2f}x**",
                (f"{res['absorbed_attention']['us'] / 1e3:.3f} / "
                f"{res['mha_attention']['us'] / 1e3:.3f}"),
                (f"{res['absorbed_attention']['TFLOPs']:.0f} / "
                f"{res['mha_attention']['TFLOPs']:.0f}"),
                f"{res['rel_diff_absorbed_vs_mha']:.1e}" + ("" if res.get("agree", True)
                                                             else " **disagree**")])
    out = [(f"B = {data.get('batch')}, {data.get('heads')} heads, bf16, page size 1; "
           f"{data.get('timing')}.  Absorbed = q·W_UK, extend over the latent pool "
           "(576/512), ·W_UV.  MHA = gather latent rows, kv_b_proj (prefix + new tokens), "
           "ragged prefill (192/128).  rel.diff compares the two outputs."), "",
           md_table(header, rows)]
    out += _not_run_notes(data, not_declared)
    summary = data.get("summary", {})
    for label, s in summary.items():
        out += ["", (f"- `{label}`: absorbed costs at most **{s['worst']['ratio']:.2f}x** the "
                    f"MHA path (prefix {s['worst']['prefix']}, extend {s['worst']['extend']}) "
                    f"and at least {s['best']['ratio']:.2f}x (prefix {s['best']['prefix']}, "
                    f"extend {s['best']['extend']}).")]
    if summary:
        out += ["", ("For the policy: a ratio above 1 is the price of pinning MLA (absorbed) "
                    "for prefix batches under BREAKABLE capture; a soft rule can prefer eager "
                    "MHA prefill where the ratio is large and the launch savings of the "
                    "graph (P4) are small against a prefill this long.")]
    ok_rows = [r for r in data.get("rows", []) if r.get("results")]
    plotted = [v for v in labels if any("absorbed" in r["results"].get(v, {}) for r in ok_rows)]
    if plot.available and plotted:
        fig, axes = plot.plt.subplots(1, len(plotted), figsize=(6 * len(plotted), 4),
                                      squeeze=False)
        for ax, v in zip(axes[0], plotted):
            groups = [f"P={r['prefix']}\nE={r['extend']}" for r in ok_rows]
            series = {
                "absorbed (MLA)": [r["results"].get(v, {}).get("absorbed", {}).get("us")
                                   for r in ok_rows],
                "MHA + kv_b_proj": [r["results"].get(v, {}).get("mha", {}).get("us")
                                    for r in ok_rows]}
            series = {k: [x / 1e3 if x else None for x in vals] for k, vals in series.items()}
            _bar_groups(ax, groups, series, "ms", log=True)
            ax.set_title(f"prefill, {v}")
        plot.save(fig, "prefill.png")
        out += ["", f"![Prefill absorbed vs MHA]({img_rel}/prefill.png)"]
    return out


def render_p5(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
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
    if plot.available and results:
        fig, ax = plot.plt.subplots(figsize=(9, 3.2))
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
        plot.save(fig, "p5_startup.png")
        out += ["", f"![P5 start-up]({img_rel}/p5_startup.png)"]
    return out


def render_p6(data: dict[str, Any], plot: Plotter, img_rel: str) -> list[str]:
    rows = []
    for r in data.get("rows", []):
        shape = f"({r['B']}, {r['L']}, {r['H']})"
        if "overhead" not in r:
            rows.append([r.get("variant", "?"), shape,
                         r.get("error") or r.get("skipped", "-")] + [""] * 5)
            continue
        baseline = r.get("baseline", "kernel")
        base = r[baseline]["median_us"]
        host = r["host_us"]
        rows.append([r.get("variant", "triton"), shape,
                     f"{base:.1f} ({baseline.replace('_', ' ')})",
                     f"{r['backend']['median_us']:.1f}",
                     f"**{r['overhead'] * 100:+.1f}%**",
                     (f"{r['backend_planned_once']['median_us']:.1f} vs "
                     f"{r['kernel']['median_us']:.1f} "
                     f"({r['overhead_planned_once'] * 100:+.1f}%)"),
                     (f"{host[baseline]:.1f} / {host['backend']:.1f} / "
                     f"{host['backend_planned_once']:.1f}"),
                     fmt(r.get("max_splits"), "d")])
    out = [(f"{data.get('timing')}.  Direct: Triton's `mla_decode` with a preallocated "
           "workspace; flashinfer's wrapper driven by hand (`plan` + `run` per call when "
           "metadata is included, `run` of a wrapper planned once otherwise).  Backend: "
           "created by the registry, `init_forward_metadata` + `forward_decode` per call; "
           "planned once: `forward_decode` only."), "",
           md_table(["backend", "(B, L, H)", "direct us/call", "backend us/call",
                     "overhead", "planned once vs run only, us/call",
                     "host us to issue (direct / backend / planned once)", "splits"], rows)]
    out += _not_run_notes(data, {})
    ok = [r for r in data.get("rows", []) if "overhead" in r]
    if plot.available and ok:
        fig, ax = plot.plt.subplots(figsize=(max(7, 1.2 * len(ok)), 3.8))
        groups = [f"{r.get('variant', '')}\n{r['B']},{r['L']},{r['H']}" for r in ok]
        _bar_groups(ax, groups, {"metadata + forward": [r["overhead"] * 100 for r in ok],
                                 "forward, planned once": [r["overhead_planned_once"] * 100
                                                           for r in ok]},
                    "% over the direct kernel call")
        ax.axhline(2.0, color="tab:red", ls="--", lw=1)
        ax.set_title("per-call overhead of the backend interface (goal <= 2%)")
        plot.save(fig, "p6_overhead.png")
        out += ["", f"![P6 overhead]({img_rel}/p6_overhead.png)"]
    return out


RENDERERS: dict[str, SectionRenderer] = {
    "ceilings": render_ceilings, "P1": render_p1, "P2": render_p2, "P3": render_p3,
    "P4": render_p4, "prefill": render_prefill, "P5": render_p5, "P6": render_p6,
}


# ----------------------------------------------------------------------------------------
# Missed targets: the reason the data shows, and the next step
# ----------------------------------------------------------------------------------------

def explain_miss(sid: str, check: dict[str, Any], data: dict[str, Any]) -> tuple[str, str]:
    """(reason, next step) for a missed check, from the measured data only."""
    cid = check["id"]
    if sid == "P1":
        rows = [p for p in data.get("summary", {}).get("per_shape", [])
                if p.get("triton_over_fa3")]
        bad = sorted((p for p in rows if p["triton_over_fa3"] > 1.25),
                     key=lambda p: -p["triton_over_fa3"])
        where = ", ".join(f"{tuple(p['shape'])} {p['triton_over_fa3']:.2f}x" for p in bad)
        return ((f"the Triton kernel is more than 1.25x slower than fa3 at {where or 'no shape'}"
                f" ({len(bad)} of {len(rows)} shapes)."),
                ("sweep the launch configuration of those shapes with "
                "`benchmarks/triton_decode_tuning.py --sweep`, then profile the slowest one "
                "(ncu --clock-control none: DRAM bytes read against the bytes counted here, "
                "and achieved bandwidth) to see whether it moves more bytes or moves them "
                "slower."))
    if sid == "P2":
        best = data.get("best")
        gbps = data.get("best_GBps")
        copy = data.get("copy_GBps")
        gap = f"{(copy - gbps) / 1e3:.2f} TB/s" if gbps and copy else "?"
        return ((f"the best backend ({best}) reaches {pct(data.get('best_share'), 1)} of the "
                f"copy bandwidth, {gap} short."),
                ("profile the best kernel at this shape (ncu --clock-control none: achieved "
                "DRAM throughput, stall reasons) to tell whether the tail wave or the split "
                "merge costs the remainder."))
    if sid == "P3":
        kind = "extend" if "extend" in cid else "decode"
        heads = cid.rsplit("H=", 1)[-1]
        row: dict[str, Any] = next((r for r in data.get("rows", []) if str(r.get("H")) == heads
                                    and r.get("L") == data.get("target_len")), {})
        split = row.get("results", {}).get("triton split-KV", {}).get(kind, {})
        one = row.get("results", {}).get("triton one split", {}).get(kind, {})
        if kind == "extend" and split.get("us") and one.get("us") and \
                abs(split["us"] / one["us"] - 1) < 0.1 and \
                not data.get("extend_kernel_split_params", ["?"]):
            return (("the split-KV and one-split rows take the same time: the Triton extend "
                    "kernel (`mla_extend`) has no split-KV, so at B=1 with "
                    f"{data.get('extend_tokens')} new tokens its grid has only "
                    "cdiv(E, BLOCK_Q) x head blocks programs for the whole KV."),
                    ("add split-KV to `mla_extend` the way `mla_decode` has it (static grid, "
                    "device-side split count, LSE merge), then rerun P3."))
        return ((f"one split takes {fmt(one.get('us'), '.1f')} us and split-KV "
                f"{fmt(split.get('us'), '.1f')} us ({fmt(split.get('max_splits'))} splits)."),
                ("check that the split heuristic fills the device at B=1 "
                "(`default_max_splits`) and that the merge kernel is not the bottleneck."))
    if sid == "P4":
        label = cid[len("P4 "):]
        row = next((r for r in data.get("rows", []) if r.get("variant") == label
                    and r.get("B") == 1), {})
        if not row.get("eager_us"):
            return ("not measured.", "see the section's error.")
        floor = row.get("floor_us")
        bound = row["eager_us"] / floor if floor else None
        target = check.get("target") or 3.0
        if bound is not None and bound < target:
            return ((f"at B=1 the step reads {(data.get('weight_bytes') or 0) / 1e9:.2f} GB of "
                    f"bf16 weights: its memory floor is {floor:.0f} us, the eager step takes "
                    f"{row['eager_us']:.0f} us, so no graph could reach more than eager / floor "
                    f"= {bound:.2f}x (the graph step takes {row['graph_us']:.0f} us); the launch "
                    "gaps a graph removes are small next to the weight reads."),
                    ("measure with fp8 weights (DeepSeek's checkpoints are fp8: half the floor) "
                    "and with more layers per graph; fusing rope / norms / cat lowers eager "
                    "time but not the floor, so the 3x target needs launch-bound eager steps."))
        return ((f"the graph step takes {row['graph_us']:.0f} us, "
                f"{fmt(floor and row['graph_us'] / floor, '.1f')}x its memory floor of "
                f"{fmt(floor, '.0f')} us, and the eager step {row['eager_us']:.0f} us: the "
                "replayed kernels themselves, not the launch gaps, keep the ratio down."),
                ("profile one replay (torch.profiler, per-kernel device time) and compare "
                "each projection's and attention's time with its bytes / copy bandwidth."))
    if sid == "P5":
        imports = data.get("imports", {})
        return ((f"`attnreg compat` imports {imports.get('count')} modules "
                f"({len(imports.get('attnreg_modules', []))} of attnreg)."),
                ("`python -X importtime -m attnreg compat ...` names the slowest imports; "
                "defer them to the code paths that need them."))
    if sid == "P6":
        rows = [r for r in data.get("rows", []) if "overhead" in r]
        worst: dict[str, Any] = max(rows, key=lambda r: r["overhead"]) if rows else {}
        if not worst:
            return ("not measured.", "see the section's error.")
        base = worst.get("baseline", "kernel")
        host_b, host_k = worst["host_us"]["backend"], worst["host_us"][base]
        dev_k = worst[base]["median_us"]
        shape = f"{worst.get('variant', '')} ({worst['B']}, {worst['L']}, {worst['H']})"
        if host_b > dev_k:
            return ((f"at {shape} the host needs {host_b:.1f} us to issue one backend call "
                    f"(metadata included) against {host_k:.1f} us for the kernel alone, while "
                    f"the kernel runs {dev_k:.1f} us: the backend call is host-bound there."),
                    ("make init_forward_metadata cheaper (it runs once per step for all "
                    "layers in an engine) and keep forward_decode's per-call checks to shape "
                    "comparisons; under a CUDA graph none of this is paid per replay. "
                    "[benchmarks-host-overhead.md](benchmarks-host-overhead.md) breaks the "
                    "host cost down per step on the CPU, with the kernels stubbed."))
        return ((f"at {shape} the host issues a backend call in {host_b:.1f} us, less than the "
                f"kernel's {dev_k:.1f} us, yet each call costs "
                f"{worst['backend']['median_us'] - dev_k:.1f} us more on the device: the "
                "backend path launches work the direct call does not."),
                ("list both paths' launches with torch.profiler (e.g. a per-call workspace "
                "allocation or a KV-write launch) and remove the extra ones."))
    return ("see the table.", "investigate.")


def explain_unmeasured(check: dict[str, Any], data: dict[str, Any]) -> str:
    """What the data says about a figure that has no value: skipped rows and errors."""
    reasons = [f"`{k}` did not run: {v}" for k, v in (data.get("skipped_variants") or {}).items()
               if k in check.get("what", "") or ("fa3" in k and "fa3" in check.get("what", ""))]
    for row in data.get("rows", []):
        if row.get("skipped"):
            reasons.append(f"rows skipped: {row['skipped']}")
            break
    for row in data.get("rows", []):
        for label, res in (row.get("results") or {}).items():
            if isinstance(res, dict) and res.get("error"):
                reasons.append(f"`{label}` failed: {res['error']}")
                break
        else:
            if row.get("error"):
                reasons.append(f"failed: {row['error']}")
            continue
        break
    return "; ".join(reasons) or "no row of the table has the values it needs (see above)."


# ----------------------------------------------------------------------------------------
# Standalone benchmarks: cost-aware prefill replay (issue 10) and multi-GPU (issue 9)
# ----------------------------------------------------------------------------------------

COST_GATE_TITLE = "Cost-aware prefill replay (issue 10)"
MULTI_TITLE = "Multi-GPU (issue 9)"
#: benchmarks/cost_gate.py's SCHEMA; not imported from there, because that module
#: imports attnreg's calibration code and the renderer must not need it.
COST_GATE_SCHEMA = "attnreg.bench.cost_gate"
#: Issue 10's targets, used only when a results file does not carry its own.
COST_GATE_TARGETS = {"max_class_ratio_to_best": 1.05, "min_speedup_over_worse_fixed": 1.3}
COST_GATE_COMMAND = (DEVICE_COMMAND.split(" && python3 ")[0] + " && python3 "
                     "benchmarks/cost_gate.py --profile src/attnreg/data/profiles/"
                     "h200-BACKEND.json --out $OUT/cost-gate/h200-BACKEND.json")
MULTI_COMMAND = ("python3 benchmarks/multi_gpu.py --nprocs N --backend nccl --trials 1000 "
                 "--out $OUT/tpN")
#: World sizes issue 9 asks for, and why a size has no summary file (where known).
MULTI_SIZES = (2, 4, 8)
MULTI_UNMEASURED_WHY = {n: f"nvidia-h200-x{n} machines were not lent when issue 9 was measured"
                        for n in (4, 8)}


@dataclass
class Extras:
    """Results of the standalone benchmark scripts (not ``python -m benchmarks``)."""

    cost_gate: list[ResultsFile]
    multi: list[ResultsFile]
    #: extra ``python -m benchmarks`` runs (P4, P6) for the run-to-run spread
    repeats: list[ResultsFile] = field(default_factory=list)

    @property
    def files(self) -> list[ResultsFile]:
        return self.cost_gate + self.multi + self.repeats


def load_extras(cost_gate_dir: Path = COST_GATE_DIR, multi_dir: Path = MULTI_DIR,
                repeats_dir: Path = REPEATS_DIR) -> Extras:
    """``cost_gate_dir/*.json``, ``multi_dir/*-summary.json`` and ``repeats_dir/*.json``.

    Raises
    ------
    ValueError
        When a file in ``cost_gate_dir`` is not a cost_gate.py result, or a
        summary is not one written by multi_gpu.py.
    """
    gates = []
    for p in sorted(Path(cost_gate_dir).glob("*.json")):
        doc = json.loads(p.read_text())
        if doc.get("schema") != COST_GATE_SCHEMA:
            raise ValueError(f"{p}: schema {doc.get('schema')!r}, expected "
                             f"{COST_GATE_SCHEMA!r} (written by benchmarks/cost_gate.py)")
        gates.append(ResultsFile(p, doc))
    multi = []
    for p in sorted(Path(multi_dir).glob("*-summary.json")):
        doc = json.loads(p.read_text())
        if not {"nprocs", "backend", "workers"} <= doc.keys():
            raise ValueError(f"{p}: not a summary written by benchmarks/multi_gpu.py "
                             "(needs nprocs, backend, workers)")
        multi.append(ResultsFile(p, doc))
    repeats = load(sorted(Path(repeats_dir).glob("*.json")))
    return Extras(gates, multi, repeats)


# ---- cost gate ------------------------------------------------------------------------

def _gate_backend(f: ResultsFile) -> str:
    return str(f.doc.get("setup", {}).get("backend", f.path.stem))


def _gate_targets(doc: dict[str, Any]) -> dict[str, float]:
    recorded = doc.get("summary", {}).get("targets", {})
    return {k: recorded.get(k, v) for k, v in COST_GATE_TARGETS.items()}


def cost_gate_checks(f: ResultsFile) -> list[dict[str, Any]]:
    """Issue 10's two targets for one results file, as check dicts (metrics.evaluate)."""
    from .metrics import evaluate

    doc, backend = f.doc, _gate_backend(f)
    s = doc.get("summary", {})
    targets = _gate_targets(doc)
    n_done, n_all = s.get("classes", 0), len(doc.get("classes", []))
    worst = s.get("worst_class") or {}
    where = (f"B={worst.get('batch_size')}, prefix {worst.get('prefix')}, extend "
             f"{worst.get('extend')}; " if worst else "")
    totals = s.get("total_ms", {})
    worse = max(("always_graph", "always_eager"), key=lambda k: totals.get(k, 0.0))
    mix = (f"{worse.replace('_', ' ')} {totals[worse]:.1f} ms vs cost-aware "
           f"{totals['cost_aware']:.1f} ms" if totals else "")
    return [
        evaluate(f"cost gate {backend}: classes", "cost-aware / per-class best, worst batch class",
                 s.get("max_class_ratio_to_best"), "ratio", "<=",
                 target=targets["max_class_ratio_to_best"],
                 detail=f"{where}{n_done} of {n_all} classes measured").to_dict(),
        evaluate(f"cost gate {backend}: mix", "worse fixed policy / cost-aware, total over the mix",
                 s.get("speedup_over_worse_fixed"), "ratio", ">=",
                 target=targets["min_speedup_over_worse_fixed"], detail=mix).to_dict(),
    ]


def _gate_provenance(f: ResultsFile, root: Path) -> str:
    m = f.doc.get("meta", {})
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "triton", "flashinfer-python")
                         if m.get(k))
    cuda = f", CUDA {m['cuda']}" if m.get("cuda") else ""
    source = f.doc.get("profile", {}).get("source", "PROFILE.json")
    recorded = f.doc.get("command") or m.get("command")
    command = recorded or (
        f"python3 benchmarks/cost_gate.py --profile {source} --out {_rel(f.path, root)}")
    how = "" if recorded else \
        " (rebuilt from the file's profile source: cost_gate.py does not record its command)"
    return (f"*Measured* {m.get('date', '?')} on {m.get('device', '?')}; {versions}{cuda}, "
            f"python {m.get('python', '?')}, attnreg {m.get('attnreg', '?')}.  \n"
            f"*Command:* `{command}`{how}; took {fmt(f.doc.get('wall_s'), '.0f')} s; data: "
            f"`{_rel(f.path, root)}`.")


def _gate_row(r: dict[str, Any], target: float) -> list[str]:
    head = [str(r.get("batch_size")), str(r.get("prefix")), str(r.get("extend"))]
    if "gate_ms" not in r:
        why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + \
            str(r.get("error", "?"))
        return head + ["-", why[:100]] + [""] * 4
    graph, eager = f"{r['graph_ms']:.2f}", f"{r['eager_ms']:.2f}"
    if r["best"] == "graph":
        graph = f"**{graph}**"
    else:
        eager = f"**{eager}**"
    if not r.get("eligible", True):  # always-graph runs this class eagerly too
        graph += " (not eligible)"
    pred = r.get("predicted", {})
    ratio = f"{r['ratio_to_best']:.3f}x"
    if r["ratio_to_best"] > target:
        ratio = f"**{ratio}**"
    if not r.get("agree", True):
        ratio += f" **outputs disagree (rel.diff {fmt(r.get('rel_diff_graph_vs_eager'))})**"
    return head + [f"{r.get('tokens')} ({r.get('padded_tokens')})", graph, eager,
                   f"{fmt(pred.get('graph_ms'), '.2f')} / {fmt(pred.get('eager_ms'), '.2f')}",
                   r["gate_choice"], ratio]


def _gate_totals(s: dict[str, Any]) -> list[str]:
    t = s.get("total_ms")
    if not t:
        return ["No class was measured: no totals."]
    best = t["per_class_best"]
    worse = max(("always graph", "always_graph"), ("always eager", "always_eager"),
                key=lambda nk: t[nk[1]])[0]
    rows = [[name, f"{t[key]:.1f}", f"{t[key] / best:.3f}x"]
            for name, key in (("cost-aware (the gate)", "cost_aware"),
                              ("always graph (absorbed, replayed)", "always_graph"),
                              ("always eager (MHA)", "always_eager"),
                              ("per-class best", "per_class_best"))]
    return [md_table(["policy over the mix (each class once)", "total ms", "/ per-class best"],
                     rows), "",
            (f"Cost-aware is **{s['speedup_over_worse_fixed']:.2f}x** faster than the worse "
             f"fixed policy ({worse}) and {s['speedup_over_better_fixed']:.2f}x faster than the better "
             "one.")]


def _gate_table(f: ResultsFile, root: Path) -> list[str]:
    doc = f.doc
    target = _gate_targets(doc)["max_class_ratio_to_best"]
    header = ["requests", "prefix", "extend", "tokens (graph bucket)", "graph ms", "eager ms",
              "predicted graph / eager ms", "gate's choice", "gate / best"]
    rows = [_gate_row(r, target) for r in doc.get("classes", [])]
    prof = doc.get("profile", {})
    done = [r for r in doc.get("classes", []) if "gate_ms" in r]
    diffs = [r["rel_diff_graph_vs_eager"] for r in done
             if r.get("rel_diff_graph_vs_eager") is not None]
    agree = ("the graph and eager outputs agree on every measured class (cost_gate.py's "
             f"tolerance; largest relative difference {max(diffs):.1e})"
             if done and all(r.get("agree") for r in done) and diffs else
             "**the graph and eager outputs disagree on some class** (see the table)"
             if done else "")
    out = [f"### `{_gate_backend(f)}`", "", _gate_provenance(f, root), "",
           (f"Profile: {prof.get('label', '?')} (`{prof.get('source', '?')}`); the gate "
            f"{'uses' if prof.get('gate_uses_cost_model') else '**does not use**'} the cost "
            f"model.  Bold: the faster of graph and eager.  Predicted: the profile's per-layer "
            f"terms x {doc.get('setup', {}).get('layers', '?')} layers.{'  ' if agree else ''}"
            f"{agree[:1].upper() + agree[1:]}{'.' if agree else ''}"), "",
           md_table(header, rows), ""]
    out += _gate_totals(doc.get("summary", {})) + [""]
    for c in cost_gate_checks(f):
        out += ["- " + _check_line(c)]
        if c["status"] == "missed":
            reason, step = explain_gate_miss(c, doc)
            out += [f"  - *Why it is missed (from the data):* {reason}",
                    f"  - *Next step:* {step}"]
        elif c["status"] == "not measured":
            out += ["  - *Why it was not measured:* no batch class was measured (the table "
                    "gives each class's error or skip reason)."]
    return out + [""]


def explain_gate_miss(check: dict[str, Any], doc: dict[str, Any]) -> tuple[str, str]:
    """(reason, next step) for a missed issue-10 check, from the measured data only."""
    backend = doc.get("setup", {}).get("backend", "BACKEND")
    done = [r for r in doc.get("classes", []) if "gate_ms" in r]
    s = doc.get("summary", {})
    if check["id"].endswith("classes"):
        target = check.get("target") or COST_GATE_TARGETS["max_class_ratio_to_best"]
        bad = [r for r in done if r["ratio_to_best"] > target]
        where = "; ".join(
            f"B={r['batch_size']}, prefix {r['prefix']}, extend {r['extend']}: the gate chose "
            f"{r['gate_choice']} (predicted graph {r['predicted']['graph_ms']:.2f} / eager "
            f"{r['predicted']['eager_ms']:.2f} ms), measured graph {r['graph_ms']:.2f} / eager "
            f"{r['eager_ms']:.2f} ms, {r['ratio_to_best']:.3f}x the best" for r in bad)
        return ((f"the profile's prediction puts {len(bad)} class(es) on the wrong side of "
                 f"the crossover by more than {target:.2f}x: {where}."),
                (f"recalibrate on this device (`attnreg calibrate --backend {backend}`) and "
                 "rerun; if the prediction stays wrong there, compare the profile's per-layer "
                 "terms for that shape with the measured steps."))
    t = s.get("total_ms", {})
    if not t:
        return ("no class was measured.", "see the table's errors.")
    worse = max(t["always_graph"], t["always_eager"])
    bound = worse / t["per_class_best"]
    if bound < check["target"]:
        return ((f"even choosing the best path for every class is only {bound:.2f}x faster "
                 "than the worse fixed policy on this mix: the two fixed policies cost about "
                 "the same here, so no gate could reach the target."),
                ("the figure depends on the mix: add classes where the two paths differ most "
                 "(`--mix`), then rerun."))
    lost = t["cost_aware"] - t["per_class_best"]
    return ((f"the per-class best is {bound:.2f}x faster than the worse fixed policy, but the "
             f"gate's choices cost {lost:.1f} ms over the per-class best."),
            "see the classes where the gate's choice is not the best, and recalibrate.")


def _plot_cost_gate(files: list[ResultsFile], plot: Plotter, img_rel: str) -> list[str]:
    plotted = [f for f in files if any("gate_ms" in r for r in f.doc.get("classes", []))]
    if not plot.available or not plotted:
        return []
    fig, axes = plot.plt.subplots(len(plotted), 1, figsize=(13, 3.8 * len(plotted)),
                                  squeeze=False)
    for ax, f in zip(axes[:, 0], plotted):
        rows = [r for r in f.doc["classes"] if "gate_ms" in r]
        groups = [f"B={r['batch_size']}\nP={_k(r['prefix'])}\nE={_k(r['extend'])}"
                  for r in rows]
        series = {
            "cost-aware": [r["gate_ms"] / r["best_ms"] for r in rows],
            "always graph": [(r["graph_ms"] if r["eligible"] else r["eager_ms"]) / r["best_ms"]
                             for r in rows],
            "always eager": [r["eager_ms"] / r["best_ms"] for r in rows]}
        _bar_groups(ax, groups, series, "time / per-class best (log)", log=True)
        target = _gate_targets(f.doc)["max_class_ratio_to_best"]
        ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target:.2f}x")
        for i, ratio in enumerate(series["cost-aware"]):
            if ratio > 1.0005:  # the gate missed the best path here: say by how much
                ax.text(i - 0.27, ratio, f"{ratio:.3f}", ha="center", va="bottom", fontsize=7)
        _ratio_axis(ax, max(max(v) for v in series.values()))
        ax.legend(fontsize=8, loc="upper left", ncol=4)
        t = f.doc.get("summary", {}).get("total_ms", {})
        totals = (f" (mix: cost-aware {t['cost_aware']:.0f} ms, always graph "
                  f"{t['always_graph']:.0f} ms, always eager {t['always_eager']:.0f} ms)"
                  if t else "")
        ax.set_title(f"{_gate_backend(f)}: prefill step time per batch class{totals}",
                     fontsize=10)
    plot.save(fig, "cost_gate.png")
    return [f"![Cost-aware prefill replay: time per class / per-class best]({img_rel}/"
            "cost_gate.png)", ""]


def _ratio_axis(ax: Any, top: float) -> None:
    """Plain 1x, 1.5x, 2x ... ticks on a log axis, with room above for the legend."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = [t for t in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if t <= top * 1.05]
    ax.set_ylim(0.9, top * 1.6)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:g}x" for t in ticks])


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def render_cost_gate(files: list[ResultsFile], plot: Plotter, img_rel: str,
                     root: Path = ROOT) -> list[str]:
    """The issue-10 section: one table per results file, the checks, one plot."""
    lines = [f"## {COST_GATE_TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{COST_GATE_COMMAND}` once per backend and "
                        "bring back each JSON as "
                        "`benchmarks/results/cost-gate/h200-BACKEND.json`.", ""]
    setup = files[0].doc.get("setup", {})
    shape = setup.get("layer_shape", {})
    targets = _gate_targets(files[0].doc)
    timing = next((r["graph_timing"].get("method") for f in files
                   for r in f.doc.get("classes", []) if r.get("graph_timing")), "?")
    lines += [
        (f"A mix of {len(setup.get('mix', []))} prefill batch classes (requests, prefix and "
         f"extend tokens per request) runs through a DeepSeek-shaped MLA stack of "
         f"{setup.get('layers')} layers (hidden {shape.get('hidden')}, q_lora {shape.get('q_lora')}, "
         f"kv_lora {shape.get('kv_lora')}, rope {shape.get('rope')}, nope {shape.get('nope')}, "
         f"v {shape.get('v_dim')}, {setup.get('heads')} heads, bf16 random weights, page size "
         f"{setup.get('page_size')}) two ways: **graph** = {setup.get('graph')} (metadata, "
         f"input copies and replay timed together; token buckets {setup.get('buckets')}); "
         f"**eager** = {setup.get('eager')}.  The cost-aware policy is `ReplayGate` with the "
         "backend's cost profile; always graph replays whatever today's rules allow; always "
         f"eager never replays.  Timing: {timing}.  Targets (issue 10): cost-aware within "
         f"{targets['max_class_ratio_to_best']:.2f}x of the per-class best on every class, and "
         f"at least {targets['min_speedup_over_worse_fixed']:.1f}x faster than the worse fixed "
         "policy over the mix."), ""]
    for f in files:
        lines += _gate_table(f, root)
    return lines + _plot_cost_gate(files, plot, img_rel)


# ---- multi-GPU ------------------------------------------------------------------------

def _conformance_k(doc: dict[str, Any]) -> str | None:
    """The ``-k`` expression of the conformance runs (multi_gpu.py appends it last)."""
    for row in doc.get("conformance", []):
        if " -k " in row.get("command", ""):
            return str(row["command"].split(" -k ", 1)[1])
    return None


def _multi_command(doc: dict[str, Any]) -> str:
    # multi_gpu.py joins argv with spaces: quote the -k expression again so it can be pasted
    command, expr = str(doc.get("command", "?")), _conformance_k(doc)
    if expr and f" -k {expr}" in command:
        command = command.replace(f" -k {expr}", f" -k {shlex.quote(expr)}", 1)
    return command


def _multi_devices(doc: dict[str, Any]) -> str:
    w = doc.get("workers", {})
    ranks = w.get("ranks") or []
    names = sorted({str(r.get("gpu", {}).get("name")) for r in ranks if r.get("gpu")})
    if not names:
        return f"{doc.get('nprocs')} ranks on {doc.get('device', '?')}"
    extra = [f"{k} {v}" for k, v in (("NCCL", ranks[0].get("nccl")),
                                     ("torch", ranks[0].get("torch"))) if v]
    return (f"{doc.get('nprocs')} x {' / '.join(names)} ({w.get('distinct_gpus')} distinct "
            f"GPUs){'; ' + ', '.join(extra) if extra else ''}")


def _multi_checks_table(doc: dict[str, Any]) -> list[str]:
    w = doc.get("workers", {})
    if "vote" not in w:
        return [f"Vote/gate workers **failed**: exit codes {w.get('exit_codes')}"
                + (" (timed out)" if w.get("timed_out") else "") + "."]
    v, g = w["vote"], w["gate"]
    s = g.get("setup", {})
    step = "CUDA graph replay" if s.get("real_graphs") else \
        "capture-mode code path, no device graph"

    def zero(n: int) -> str:
        return "pass" if n == 0 else "**FAIL**"

    rows = [
        ["vote: trials", f"{v['trials']} ({v['and_true']} AND true, {v['and_false']} false)",
         ""],
        ["vote: disagreeing trials (gathered / seen by each rank)",
         f"{v['disagreements']} / {v['seen_by_ranks']}",
         zero(v["disagreements"] + sum(v["seen_by_ranks"]))],
        ["gate: decode steps", f"{g['steps']} ({g['graph_steps']} replayed, "
         f"{g['eager_steps']} eager)", ""],
        ["gate: steps where ranks ran different paths", str(g["paths"]), zero(g["paths"])],
        ["gate: votes not the AND of local eligibility", str(g["vote_not_the_and"]),
         zero(g["vote_not_the_and"])],
        ["gate: paths not the vote", str(g["path_not_the_vote"]), zero(g["path_not_the_vote"])],
        ["gate: replays that differ from eager", f"{g['replay_mismatches']} (max abs err "
         f"{fmt(g.get('max_abs_err'))})", zero(g["replay_mismatches"])],
        ["gate: decode step", f"{step}; {s.get('heads')} heads, "
         f"{s.get('max_bs')} slots, seq <= {s.get('max_seq')}; plan {s.get('plan_platform')}"
         f"{' (simulated)' if s.get('simulated_plan') else ''}, decode "
         f"{s.get('decode_mode')}", ""],
        ["gate: rules fired (all ranks)",
         ", ".join(f"{k} {n}" for k, n in g.get("rules", {}).items()), ""],
    ]
    if doc.get("backend") == "nccl":
        rows.append(["distinct GPUs", str(w.get("distinct_gpus")),
                     "pass" if w.get("distinct_gpus") == doc.get("nprocs") else "**FAIL**"])
    return [md_table(["check", "result", "status"], rows)]


def _multi_conformance_table(doc: dict[str, Any]) -> list[str]:
    rows = []
    for r in doc.get("conformance", []):
        claims = sum(r.get(k, 0) for k in ("verified", "refuted", "skipped"))
        exit_ = str(r.get("exit_code")) + (" (killed at the deadline)" if r.get("timed_out")
                                           else "")
        rows.append([str(r["rank"]), str(r.get("device_name") or r.get("device")),
                     str(r.get("cuda_visible_devices") or "-"), str(r["heads"]),
                     ", ".join(map(str, r.get("claim_head_counts") or ["-"])), str(claims),
                     f"**{r.get('verified', '-')}**", str(r.get("refuted", "-")),
                     str(r.get("skipped", "-")), exit_, fmt(r.get("wall_s"), ".0f")])
    if not rows:
        return ["The per-rank conformance did not run (`--skip-conformance`)."]
    return [md_table(["rank", "device", "CUDA_VISIBLE_DEVICES", "heads", "claims ran at heads",
                      "claims", "verified", "refuted", "skipped", "exit", "wall s"], rows)]


def multi_check(doc: dict[str, Any]) -> dict[str, Any]:
    """One summary-table check per run: multi_gpu.py's own list of failures must be empty."""
    from .metrics import evaluate

    n = doc.get("nprocs")
    return evaluate(f"multi-GPU {n} ranks", f"{n} ranks over {doc.get('backend')}: failed "
                    "checks (vote, replay-gate paths, replays vs eager, per-rank conformance)",
                    len(doc.get("failures", [])), "failed checks", "<=", target=0,
                    detail="; ".join(doc.get("failures", []))).to_dict()


def _multi_file(f: ResultsFile, root: Path) -> list[str]:
    doc = f.doc
    n, backend = int(doc["nprocs"]), str(doc["backend"])  # load_extras checked both
    date = doc.get("date_utc") or doc.get("date")
    date = f" {date}" if date else ""
    undated = "" if date else "; date not recorded (multi_gpu.py writes none into its summary)"
    w = doc.get("workers", {})
    conf = doc.get("conformance", [])
    walls = [f"vote + gate workers {fmt(w.get('wall_s'), '.0f')} s"] + \
        ([f"conformance {fmt(conf[0].get('wall_s'), '.0f')} s"] if conf else [])
    expr = _conformance_k(doc)
    claims = sorted({sum(r.get(k, 0) for k in ("verified", "refuted", "skipped"))
                     for r in conf})
    heads = sorted({r["heads"] for r in conf})
    share = f" (DeepSeek-V3's 128 split over TP={n})" if heads == [128 // n] else ""
    on = (f"{n} GPUs with {backend.upper()}, one rank per GPU" if doc.get("device") == "cuda"
          else f"{n} ranks over {backend} on a {doc.get('device')}")
    multicast = ", ".join(f"{k}={v}" for k, v in doc.get("multicast_env", {}).items())
    conf_txt = ("" if not conf else
                f"  The per-rank tensor-parallel conformance ran at "
                f"{' / '.join(map(str, heads))} heads{share}, every rank at once on its own "
                "device, "
                + (f"**only the `-k {shlex.quote(expr)}` subset**: " if expr else
                   "the whole suite: ")
                + f"{' / '.join(str(c) for c in claims)} claims per rank.")
    out = [f"### {n} ranks, {backend}", "",
           f"*Measured*{date} on {_multi_devices(doc)}{undated}.  \n"
           f"*Command:* `{_multi_command(doc)}`; {', '.join(walls)}; data: "
           f"`{_rel(f.path, root)}`.", "",
           f"Ran on {on}{'; ' + multicast if multicast else ''}.{conf_txt}", ""]
    out += _multi_checks_table(doc) + [""] + _multi_conformance_table(doc) + [""]
    return out + ["- " + _check_line(multi_check(doc)), ""]


def render_multi(files: list[ResultsFile], root: Path = ROOT) -> list[str]:
    """The issue-9 section: each summary's checks and per-rank conformance."""
    lines = [f"## {MULTI_TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{MULTI_COMMAND}` on an N-GPU machine (N in "
                        f"{', '.join(map(str, MULTI_SIZES))}) and bring back "
                        "`$OUT/tpN/summary.json` as "
                        "`benchmarks/results/multi/h200-xN-summary.json`.", ""]
    lines += [("`benchmarks/multi_gpu.py` (see [multi_gpu.md](multi_gpu.md)): every rank "
               "votes on random local eligibility (all results must be the AND), runs a "
               "replay-gate decode step whose path (graph replay or eager) follows the vote "
               "(all ranks must run the same path; replays must match eager), and runs "
               "`attnreg conformance` at its tensor-parallel share of the heads."), ""]
    for f in files:
        lines += _multi_file(f, root)
    done = {f.doc.get("nprocs") for f in files if f.doc.get("backend") == "nccl"}
    missing = [f"{n} GPUs ({MULTI_UNMEASURED_WHY.get(n, 'no summary file yet')})"
               for n in MULTI_SIZES if n not in done]
    if missing:
        lines += [f"Not measured with NCCL: {'; '.join(missing)}.", ""]
    return lines


# ---- run-to-run spread of the host-bound figures ----------------------------------------

REPEATS_TITLE = "Run-to-run spread of P4 and P6"
REPEATS_COMMAND = "python3 -m benchmarks --only P4,P6 --out $OUT/runN --no-render"


def _b1_speedup(doc: dict[str, Any], variant: str) -> tuple[float, float, float] | None:
    """(eager us, graph us, eager / graph) of P4 at B=1 for one backend."""
    rows = doc.get("sections", {}).get("P4", {}).get("data", {}).get("rows", [])
    row = next((r for r in rows if r.get("variant") == variant and r.get("B") == 1
                and r.get("eager_us")), None)
    return (row["eager_us"], row["graph_us"], row["speedup"]) if row else None


def _p6_worst(doc: dict[str, Any], key: str) -> float | None:
    rows = doc.get("sections", {}).get("P6", {}).get("data", {}).get("rows", [])
    values = [r[key] for r in rows if key in r]
    return max(values) if values else None


def _spread_runs(files: list[ResultsFile]) -> list[ResultsFile]:
    return [f for f in files if {"P4", "P6"} & set(f.doc.get("sections", {}))]


def repeats_checks(files: list[ResultsFile]) -> list[dict[str, Any]]:
    """P4's and P6's checks again, on the median of every run's figure (two runs or more)."""
    from .metrics import evaluate

    runs = _spread_runs(files)
    if len(runs) < 2:
        return []
    measured: dict[str, list[float]] = {}
    first: dict[str, dict[str, Any]] = {}
    for f in runs:
        for sid in ("P4", "P6"):
            for c in f.doc.get("sections", {}).get(sid, {}).get("data", {}).get("checks", []):
                first.setdefault(c["id"], c)
                if c.get("measured") is not None:
                    measured.setdefault(c["id"], []).append(c["measured"])
    out = []
    for cid, c in first.items():
        values = measured.get(cid, [])
        out.append(evaluate(
            f"{cid}, median", f"{c['what']}: median of {len(values)} runs",
            statistics.median(values) if values else None, c["unit"], c["direction"],
            target=c.get("target"), goal=c.get("goal"),
            detail=f"runs: {', '.join(_fmt_unit(v, c['unit']) for v in values)}").to_dict())
    return out


def render_repeats(files: list[ResultsFile], root: Path = ROOT) -> list[str]:
    """P4 at B=1 and P6's worst overheads, one row per run, with the median of the runs.

    P4's eager step and P6's per-call cost are bounded by how fast the host
    issues launches; the same code on the same kind of machine gives other
    figures from one run to the next.  One run's check says little on its own.
    """
    runs = _spread_runs(files)
    if len(runs) < 2:
        return []
    variants = sorted({r.get("variant") for f in runs for r in f.doc["sections"].get("P4", {})
                       .get("data", {}).get("rows", []) if r.get("eager_us")})
    header = ["run (UTC)", "commit", "data"] + \
        [f"P4 {v} B=1: eager / graph us (x)" for v in variants] + \
        ["P6 worst overhead", "P6 worst, planned once"]
    table, columns = [], {v: [] for v in variants}
    p6, p6_once = [], []
    for f in sorted(runs, key=lambda f: str(f.meta.get("date_utc"))):
        row = [str(f.meta.get("date_utc", "?")), str(f.meta.get("git_commit", "?")),
               f"`{_rel(f.path, root)}`"]
        for v in variants:
            got = _b1_speedup(f.doc, v)
            if got:
                columns[v].append(got[2])
            row.append(f"{got[0]:.0f} / {got[1]:.0f} ({got[2]:.2f}x)" if got else "-")
        worst, once = _p6_worst(f.doc, "overhead"), _p6_worst(f.doc, "overhead_planned_once")
        p6 += [worst] if worst is not None else []
        p6_once += [once] if once is not None else []
        table.append(row + [pct(worst), pct(once)])

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    table.append(["**median**", "", f"{len(runs)} runs"]
                 + [f"**{fmt(median(columns[v]), '.2f')}x**" for v in variants]
                 + [f"**{pct(median(p6))}**", f"**{pct(median(p6_once))}**"])
    def spread(key: int) -> str:
        """Largest max / min over the runs of one backend (0: eager, 1: graph)."""
        ratios = []
        for v in variants:
            values = [g[key] for g in (_b1_speedup(f.doc, v) for f in runs) if g]
            ratios += [max(values) / min(values)] if values else []
        return f"{max(ratios):.2f}x" if ratios else "-"

    lines = [f"## {REPEATS_TITLE}", "",
             ("P4's eager step and P6's per-call cost are bounded by how fast the host issues "
              "kernel launches, not by the GPU. Over these runs of the same code on the same "
              f"kind of machine (some within one device call), the slowest B=1 graph step of "
              f"a backend is at most {spread(1)} its fastest, its eager step up to "
              f"{spread(0)}. Read one run's P4 / P6 check against this spread. Runs: the main "
              f"results file(s) above, plus `{REPEATS_COMMAND}` repeated and brought back to "
              f"`{_rel(REPEATS_DIR, root)}/`."), "",
             md_table(header, table), ""]
    lines += ["- " + _check_line(c) for c in repeats_checks(runs)]
    return lines + [""]


# ----------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------

def render_markdown(files: list[ResultsFile], plot: Plotter, img_rel: str, *,
                    preview: bool = False, root: Path = ROOT,
                    extras: Extras | None = None) -> str:
    """The whole page: summary, the harness's sections, then the standalone benchmarks'."""
    extras = extras or Extras([], [])
    chosen = choose(files)
    used = []
    for f, _ in chosen.values():
        if f not in used:
            used.append(f)
    used += extras.files
    lines = ["# Benchmarks", ""]
    if any(f.dry_run or f.doc.get("dry_run") for f in used):
        lines += [("> **DRY RUN preview**: tiny shapes on a CPU (Triton interpreter, wall "
                  "clock). These numbers are not measurements and must never be published."), ""]
    sources = ", ".join(f"`{_rel(f.path, root)}`" for f in used) or "no results file"
    lines += [
        "Generated by `python -m benchmarks.render` from " + sources + ". Do not edit by "
        "hand: re-run the benchmarks and the renderer. Every number below was measured by "
        "the command shown with it; a section that was not measured says so.", "",
        "How to run: on the H200, in one device call, `" + DEVICE_COMMAND + "` (bring back "
        "`$OUT/bench/results.json` as `benchmarks/results/h200.json`); on the CPU "
        "development machine, `" + HOST_COMMAND + "`; then `python -m benchmarks.render`. "
        "See `benchmarks/README.md`.", ""]
    lines += ["## Summary", ""]
    summary_rows = []
    for sec in SECTIONS:
        if sec.id not in chosen:
            continue
        f, rec = chosen[sec.id]
        where = _device(f.meta).split(" (")[0]
        summary_rows += [_summary_row(c, _anchor(f"{sec.id}: {sec.title}"), where)
                         for c in rec.get("data", {}).get("checks", [])]
    for f in extras.cost_gate:
        summary_rows += [_summary_row(c, _anchor(COST_GATE_TITLE),
                                      str(f.doc.get("meta", {}).get("device", "?")))
                         for c in cost_gate_checks(f)]
    for f in extras.multi:
        summary_rows.append(_summary_row(multi_check(f.doc), _anchor(MULTI_TITLE),
                                         _multi_devices(f.doc).split(" (")[0]))
    spread_runs = [f for f in used if f not in extras.cost_gate + extras.multi]
    summary_rows += [_summary_row(c, _anchor(REPEATS_TITLE), _device(spread_runs[0].meta)
                                  .split(" (")[0]) for c in repeats_checks(spread_runs)]
    lines += [md_table(["id", "figure", "measured", "target / goal", "status", "where"],
                       summary_rows) if summary_rows else "No figure has been measured yet.",
              ""]
    for sec in SECTIONS:
        lines += [f"## {sec.id}: {sec.title}", ""]
        if sec.id not in chosen:
            where = HOST_COMMAND if sec.where == "host" else DEVICE_COMMAND
            lines += [f"Not measured yet. Run `{where}`.", ""]
            continue
        f, rec = chosen[sec.id]
        lines += [provenance(f, rec, root), ""]
        status = rec.get("status")
        if status == "skipped":
            lines += [f"Skipped: {rec.get('reason')}.", ""]
            continue
        if status == "error":
            lines += [f"**Error** (no figures): `{rec.get('error')}`", ""]
            if not rec.get("data", {}).get("rows"):
                continue
            lines += ["Partial data measured before the error:", ""]
        data = rec.get("data", {})
        lines += RENDERERS[sec.id](data, plot, img_rel) + [""]
        for c in data.get("checks", []):
            lines += ["- " + _check_line(c)]
            if c.get("status") == "missed":
                reason, step = explain_miss(sec.id, c, data)
                lines += [f"  - *Why it is missed (from the data):* {reason}",
                          f"  - *Next step:* {step}"]
            elif c.get("status") == "not measured":
                lines += [f"  - *Why it was not measured:* {explain_unmeasured(c, data)}"]
        lines += [""]
    lines += render_cost_gate(extras.cost_gate, plot, img_rel, root)
    lines += render_multi(extras.multi, root)
    lines += render_repeats(spread_runs, root)
    if not plot.available:
        lines += [f"_Plots not rendered: {plot.why_not}._", ""]
    if NOTES.exists() and not preview:
        lines += ["## Notes", "", NOTES.read_text().strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def _summary_row(c: dict[str, Any], anchor: str, where: str) -> list[str]:
    bounds = [f"{k} {c['direction']} {_fmt_unit(c[k], c['unit'])}"
              for k in ("target", "goal") if c.get(k) is not None]
    return [f"[{c['id']}](#{anchor})", c["what"], _fmt_unit(c.get("measured"), c["unit"]),
            ", ".join(bounds), f"**{c['status']}**", where]


def _anchor(heading: str) -> str:
    """The link target a markdown renderer gives ``## heading``."""
    keep = [ch if ch.isalnum() or ch in " -_" else "" for ch in heading.lower()]
    return "".join(keep).replace(" ", "-")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def render_files(paths: list[Path], md_path: Path, img_dir: Path, *, plots: bool = True,
                 allow_dry_run: bool = False, preview: bool = False,
                 cost_gate_dir: Path = COST_GATE_DIR, multi_dir: Path = MULTI_DIR,
                 repeats_dir: Path = REPEATS_DIR) -> Path:
    """Render ``paths`` into ``md_path`` with plots in ``img_dir``; return ``md_path``.

    The cost-gate results (``cost_gate_dir/*.json``) and the multi-GPU
    summaries (``multi_dir/*-summary.json``) are rendered after the harness's
    sections; a directory that is missing or empty gives "Not measured yet".

    Raises
    ------
    ValueError
        When a dry-run results file would be rendered without ``allow_dry_run``,
        or a file in those directories is not what its script writes.
    """
    files = load([p for p in paths if Path(p).exists()])
    extras = load_extras(cost_gate_dir, multi_dir, repeats_dir)
    dry = [str(f.path) for f in files + extras.repeats if f.dry_run] + \
        [str(f.path) for f in extras.cost_gate if f.doc.get("dry_run")]
    if dry and not allow_dry_run:
        raise ValueError(f"dry-run results {dry} are not measurements; they are rendered "
                         "only as a preview (python -m benchmarks --dry-run --out DIR)")
    plot = Plotter(img_dir, enabled=plots)
    img_rel = os.path.relpath(img_dir, md_path.parent)
    text = render_markdown(files, plot, img_rel, preview=preview, extras=extras)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    return md_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render",
                                description="Render benchmark JSON into markdown + PNG plots.")
    p.add_argument("files", nargs="*", type=Path,
                   help="results files (default: benchmarks/results/*.json, h200 first)")
    p.add_argument("--md", type=Path, default=DOCS_MD, help="markdown output "
                   "(default docs/benchmarks.md)")
    p.add_argument("--img-dir", type=Path, default=DOCS_IMG, help="PNG output (default docs/img)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--cost-gate-dir", type=Path, default=COST_GATE_DIR,
                   help="benchmarks/cost_gate.py results (default benchmarks/results/cost-gate)")
    p.add_argument("--multi-dir", type=Path, default=MULTI_DIR,
                   help="benchmarks/multi_gpu.py summaries, *-summary.json (default "
                        "benchmarks/results/multi)")
    p.add_argument("--repeats-dir", type=Path, default=REPEATS_DIR,
                   help="extra python -m benchmarks runs for the P4/P6 spread (default "
                        "benchmarks/results/repeats)")
    args = p.parse_args(argv)
    files = args.files or default_result_files()
    try:
        out = render_files(files, args.md, args.img_dir, plots=not args.no_plots,
                           cost_gate_dir=args.cost_gate_dir, multi_dir=args.multi_dir,
                           repeats_dir=args.repeats_dir)
    except ValueError as exc:
        print(f"python -m benchmarks.render: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
