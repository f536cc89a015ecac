"""What every section's ``render`` uses: markdown helpers, plots, provenance, the notes file.

A section module measures (``run``), states its figures (``checks(data)``:
:class:`~benchmarks.metrics.Check` objects) and renders itself
(``render(data, page)``: markdown lines).  ``benchmarks/render.py`` only puts
the sections in order; :class:`Page` carries what they share (the plotter,
where images go, the notes, every run of a section).

Why a check misses is hand-written prose in ``benchmarks/notes.md``, one
``## CHECK ID`` heading per check, never code: a reader writes it after
looking at the data, and a test keeps the file to the checks that miss now.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Installs the project on the device machine (see the gpu README), before any device command.
SETUP_COMMAND = "source .gpu/setup.sh && pip install --no-deps --no-build-isolation -e . -q"
NOTES = Path(__file__).resolve().parent / "notes.md"


@dataclass
class ResultsFile:
    """One results JSON as loaded (the harness's, a repeat, or a standalone script's)."""

    path: Path
    doc: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.doc.get("meta", {})

    @property
    def dry_run(self) -> bool:
        return bool(self.meta.get("dry_run") or self.doc.get("dry_run"))


# ----------------------------------------------------------------------------------------
# formatting
# ----------------------------------------------------------------------------------------

def fmt(value: Any, spec: str = ".3g", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return none if value is None or math.isnan(value) else "inf"
    return format(value, spec)


def pct(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 100:.{digits}f}%"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_unit(value: float | None, unit: str) -> str:
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


def bounds(c: dict[str, Any]) -> str:
    """``target <= 1.25x, goal <= 1.00x``."""
    return ", ".join(f"{k} {c['direction']} {fmt_unit(c[k], c['unit'])}"
                     for k in ("target", "goal") if c.get(k) is not None)


def measured_text(c: dict[str, Any]) -> str:
    """The measured figure; for a median of runs, their min and max beside it."""
    text = fmt_unit(c.get("measured"), c["unit"])
    runs = c.get("runs") or ()
    if len(runs) > 1:
        text += (f" (min {fmt_unit(min(runs), c['unit'])}, max "
                 f"{fmt_unit(max(runs), c['unit'])}, {len(runs)} runs)")
    return text


def check_line(c: dict[str, Any]) -> str:
    measured = measured_text(c)
    ratio = ""
    ref = c.get("target") if c.get("target") is not None else c.get("goal")
    if c.get("measured") is not None and ref:
        ratio = f"; measured / {'target' if c.get('target') is not None else 'goal'} = " \
                f"{c['measured'] / ref:.2f}"
    detail = f" ({c['detail']})" if c.get("detail") else ""
    return (f"**{c['id']}** — {c['what']}: **{measured}**{detail}; {bounds(c)}"
            f"{ratio} → **{c['status']}**")


def anchor(heading: str) -> str:
    """The link target a markdown renderer gives ``## heading``."""
    keep = [ch if ch.isalnum() or ch in " -_" else "" for ch in heading.lower()]
    return "".join(keep).replace(" ", "-")


def rel(path: Path, root: Path = ROOT) -> str:
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def k_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ----------------------------------------------------------------------------------------
# provenance of a harness results file
# ----------------------------------------------------------------------------------------

def versions(meta: dict[str, Any]) -> str:
    v = meta.get("versions", {})
    parts = [f"{k} {v[k]}" for k in ("torch", "triton", "flashinfer-python", "flash-attn-4")
             if v.get(k)]
    cuda = v.get("cuda") or v.get("torch_cuda")  # torch_cuda: files written before 2026-12
    if cuda:
        parts.append(f"CUDA {cuda}")
    parts.append(f"python {meta.get('python', '?')}")
    return ", ".join(parts)


def device(meta: dict[str, Any]) -> str:
    d = meta.get("device", {})
    if d.get("kind") == "cuda":
        extra = f", driver {d['nvidia_smi.driver_version']}" \
            if d.get("nvidia_smi.driver_version") else ""
        return f"{d.get('name')} ({d.get('arch')}, {d.get('sms')} SMs{extra})"
    return f"CPU: {d.get('name') or meta.get('cpu')} ({meta.get('cpu_count')} cores)"


def provenance(f: ResultsFile, rec: dict[str, Any], root: Path = ROOT) -> str:
    m = f.meta
    commit = f", commit {m['git_commit']}" if m.get("git_commit") else ""
    if m.get("commit_note"):  # e.g. a run whose commit was rebased before it landed
        commit += f" ({m['commit_note']})"
    quick = " (--quick)" if m.get("quick") else ""
    return (f"*Measured* {m.get('date_utc', '?')} on {device(m)}; {versions(m)}{commit}.  \n"
            f"*Command:* `{m.get('command', '?')}`{quick}; section took "
            f"{fmt(rec.get('seconds'), '.0f')} s; data: `{rel(f.path, root)}`.")


# ----------------------------------------------------------------------------------------
# plots
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


def bar_groups(ax: Any, groups: list[str], series: dict[str, list[float | None]],
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
# notes and the page
# ----------------------------------------------------------------------------------------

def load_notes(path: Path = NOTES) -> dict[str, str]:
    """``{check id: prose}`` from ``## CHECK ID`` headings of a markdown file (none: {})."""
    if not Path(path).exists():
        return {}
    notes: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in Path(path).read_text().splitlines():
        if line.startswith("## "):
            current = notes.setdefault(line[3:].strip(), [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v).strip() for k, v in notes.items()}


def not_run_notes(data: dict[str, Any], not_declared: dict[str, str]) -> list[str]:
    """Why a backend has no numbers: not available here, or the request is not declared."""
    out = []
    skipped = data.get("skipped_variants") or {}
    if skipped:
        out += ["", "Not run here: " + "; ".join(f"`{k}`: {v}" for k, v in skipped.items())]
    if not_declared:
        out += ["", "Not declared for these requests (the backend's own declaration): "
                + "; ".join(f"`{k}`: {v}" for k, v in not_declared.items())]
    return out


def why_not_measured(check: dict[str, Any], data: dict[str, Any]) -> str:
    """What the data says about a figure with no value: backends not run, rows skipped, errors."""
    what = check.get("what", "")
    reasons = [f"`{k}` did not run: {v}" for k, v in (data.get("skipped_variants") or {}).items()
               if k in what or ("fa3" in k and "fa3" in what)]
    rows = data.get("rows") or data.get("classes") or []
    for row in rows:
        if row.get("skipped"):
            reasons.append(f"rows skipped: {row['skipped']}")
            break
    for row in rows:
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


@dataclass
class Page:
    """What the sections of one page share.

    ``runs`` maps a section id to every run of it that was loaded (the chosen
    file's first, then the repeats), for figures stated over several runs.
    """

    plot: Plotter
    img_rel: str
    root: Path = ROOT
    notes: dict[str, str] = field(default_factory=dict)
    runs: dict[str, list[tuple[ResultsFile, dict[str, Any]]]] = field(default_factory=dict)

    def image(self, fig: Any, name: str, alt: str) -> list[str]:
        """Save ``fig`` as ``name`` and return the markdown that embeds it."""
        self.plot.save(fig, name)
        return ["", f"![{alt}]({self.img_rel}/{name})"]

    def check_lines(self, checks: Sequence[dict[str, Any]], data: dict[str, Any]) -> list[str]:
        """One bullet per check; a miss gets its note from the notes file."""
        out = []
        for c in checks:
            out.append("- " + check_line(c))
            note = self.notes.get(c["id"])
            if c.get("status") == "missed":
                out += ["  " + line if line else "" for line in (note or (
                    f"- *Not explained yet:* add a `## {c['id']}` note to "
                    "`benchmarks/notes.md` saying why it misses and what to do next.")
                ).splitlines()]
            elif c.get("status") == "not measured":
                out.append(f"  - *Why it was not measured:* {why_not_measured(c, data)}")
        return out


#: How further runs of the host-bound sections (P4, P6) are made; they go in results/repeats/.
REPEATS_COMMAND = "python3 -m benchmarks --only P4,P6 --out $OUT/runN --no-render"
REPEATS_DIR = Path(__file__).resolve().parent / "results" / "repeats"


def runs_table(runs: Sequence[tuple[ResultsFile, dict[str, Any]]], header: Sequence[str],
               cells: Callable[[dict[str, Any]], list[str]], medians: Sequence[str],
               root: Path = ROOT) -> str:
    """One row per run (oldest first: date, commit, file, ``cells(data)``), then the medians."""
    rows = [[str(f.meta.get("date_utc", "?")), str(f.meta.get("git_commit", "?")),
             f"`{rel(f.path, root)}`"] + cells(data)
            for f, data in sorted(runs, key=lambda r: str(r[0].meta.get("date_utc")))]
    rows.append(["**median**", "", f"{len(runs)} runs"] + [f"**{m}**" for m in medians])
    return md_table(["run (UTC)", "commit", "data", *header], rows)


Renderer = Callable[[dict[str, Any], Page], list[str]]
