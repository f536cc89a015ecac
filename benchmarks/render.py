"""``python -m benchmarks.render [FILES ...]``: results JSON -> docs/benchmarks.md + docs/img/.

The driver only: each section renders itself where it measures (``render(data,
page)``, ``checks(data, runs)``; the standalone scripts ``render(files, page)``,
``checks(doc)``).  This loads the results (default ``benchmarks/results/*.json``,
device runs first), picks a file per section, orders the sections, builds the
summary and refuses dry runs (accepted only for ``python -m benchmarks``'s
preview).  Why a check misses is hand-written in ``benchmarks/notes.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from . import cost_gate, host_overhead, multi_gpu, triton_decode_tuning
from ._harness import SCHEMA, SECTIONS, Section
from ._report import (
    NOTES,
    ROOT,
    SETUP_COMMAND,
    Page,
    Plotter,
    ResultsFile,
    anchor,
    bounds,
    device,
    load_notes,
    md_table,
    measured_text,
    provenance,
    rel,
)

RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS_MD = ROOT / "docs" / "benchmarks.md"
DOCS_IMG = ROOT / "docs" / "img"
#: More runs of the harness (P4, P6 are host-bound): their figures are medians over runs.
REPEATS = "repeats"
#: Benchmarks with a script and a results folder of their own, rendered after the harness's.
STANDALONE: tuple[ModuleType, ...] = (cost_gate, multi_gpu, host_overhead, triton_decode_tuning)

DEVICE_COMMAND = f"{SETUP_COMMAND} && python3 -m benchmarks --out $OUT/bench"

Standalone = dict[str, list[ResultsFile]]


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


def load_standalone(results_dir: Path = RESULTS_DIR) -> Standalone:
    """Each standalone script's files, from ``results_dir/<its folder>/<its pattern>``.

    Raises
    ------
    ValueError
        When a file there is not one its script writes.
    """
    out: Standalone = {}
    for module in STANDALONE:
        folder, pattern = module.RESULTS
        out[module.__name__] = [ResultsFile(p, module.read(p))
                                for p in sorted((Path(results_dir) / folder).glob(pattern))]
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


def section_runs(files: list[ResultsFile], chosen: dict[str, tuple[ResultsFile, dict[str, Any]]]
                 ) -> dict[str, list[tuple[ResultsFile, dict]]]:
    """Every ok run of each chosen section on the chosen file's kind of device (a file
    counts once; a dry run never joins a measurement, nor another GPU's run)."""
    runs: dict[str, list[tuple[ResultsFile, dict]]] = {}
    for sid, (first, _) in chosen.items():
        kind = (device(first.meta), first.dry_run)
        for f in files:
            rec = f.doc.get("sections", {}).get(sid, {})
            if rec.get("status") == "ok" and rec.get("data") and \
                    (device(f.meta), f.dry_run) == kind:
                runs.setdefault(sid, []).append((f, rec["data"]))
    return runs


# ----------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------

def heading(sec: Section) -> str:
    return f"{sec.id}: {sec.title}"


def _checks(sec: Section, rec: dict[str, Any], page: Page) -> list[dict[str, Any]]:
    """A section's checks, over every run of it; none when it has no figures to state."""
    data = rec.get("data", {})
    if rec.get("status") != "ok" and not (rec.get("status") == "error" and data.get("rows")):
        return []
    runs = [d for _, d in page.runs.get(sec.id, [])] or None
    return [c.to_dict() for c in sec.function("checks")(data, runs)]


def page_checks(chosen: dict[str, tuple[ResultsFile, dict[str, Any]]], standalone: Standalone,
                page: Page) -> list[tuple[str, str, dict[str, Any]]]:
    """(section heading, where, check) of every figure the page states, in page order."""
    out = []
    for sec in SECTIONS:
        if sec.id in chosen:
            f, rec = chosen[sec.id]
            where = device(f.meta).split(" (")[0]
            out += [(heading(sec), where, c) for c in _checks(sec, rec, page)]
    for module in STANDALONE:
        for f in standalone.get(module.__name__, []):
            out += [(module.TITLE, module.where(f.doc), c.to_dict()) for c in module.checks(f.doc)]
    return out


def _summary(checks: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    rows = [[f"[{c['id']}](#{anchor(head)})", c["what"], measured_text(c), bounds(c),
             f"**{c['status']}**", where] for head, where, c in checks]
    return [md_table(["id", "figure", "measured", "target / goal", "status", "where"], rows)
            if rows else "No figure has been measured yet.", ""]


def _section(sec: Section, chosen: dict[str, tuple[ResultsFile, dict[str, Any]]],
             page: Page) -> list[str]:
    lines = [f"## {heading(sec)}", ""]
    if sec.id not in chosen:
        if sec.where != "host" and sec.command:
            return lines + [f"Not measured yet. Run on the H200, after the setup of "
                            f"`benchmarks/README.md`: `{sec.command}`; bring its "
                            "`results.json` back into `benchmarks/results/` as an "
                            "`h200-*.json` file and re-render.", ""]
        where = sec.host_command if sec.where == "host" else DEVICE_COMMAND
        return lines + [f"Not measured yet. Run `{where}`.", ""]
    f, rec = chosen[sec.id]
    lines += [provenance(f, rec, page.root), ""]
    status, data = rec.get("status"), rec.get("data", {})
    if status == "skipped":
        return lines + [f"Skipped: {rec.get('reason')}.", ""]
    if status == "error":
        lines += [f"**Error** (no figures): `{rec.get('error')}`", ""]
        if not data.get("rows"):
            return lines
        lines += ["Partial data measured before the error:", ""]
    return lines + sec.function("render")(data, page) + [""] + \
        page.check_lines(_checks(sec, rec, page), data) + [""]


def _prepare(files: list[ResultsFile], repeats: list[ResultsFile], page: Page
             ) -> tuple[dict[str, tuple[ResultsFile, dict[str, Any]]], list[ResultsFile]]:
    """The chosen file of each section, the files used (in order), and ``page.runs``."""
    chosen = choose(files)
    used: list[ResultsFile] = []
    for f, _ in chosen.values():
        if f not in used:
            used.append(f)
    page.runs = section_runs(used + [f for f in files if f not in used] + repeats, chosen)
    return chosen, used


def stated_checks(paths: list[Path], results_dir: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """Every check the page states for these results (what ``benchmarks/notes.md`` explains)."""
    files, repeats, standalone = _load_all(paths, results_dir)
    page = Page(Plotter(Path("."), enabled=False), "img")
    chosen, _ = _prepare(files, repeats, page)
    return [c for _, _, c in page_checks(chosen, standalone, page)]


def render_markdown(files: list[ResultsFile], page: Page, *,
                    standalone: Standalone | None = None,
                    repeats: list[ResultsFile] | None = None) -> str:
    """The whole page: summary, the harness's sections, then the standalone benchmarks'."""
    standalone = standalone or {}
    chosen, used = _prepare(files, repeats or [], page)
    sources = used + (repeats or []) + [f for fs in standalone.values() for f in fs]
    lines = ["# Benchmarks", ""]
    if any(f.dry_run for f in sources):
        lines += [("> **DRY RUN preview**: tiny shapes on a CPU (Triton interpreter, wall "
                   "clock). These numbers are not measurements and must never be published."),
                  ""]
    listed = ", ".join(f"`{rel(f.path, page.root)}`" for f in sources) or "no results file"
    lines += [
        f"Generated by `python -m benchmarks.render` from {listed}. Do not edit by hand: "
        "re-run the benchmarks and the renderer. Every number below was measured by the "
        "command shown with it; a section that was not measured says so.", "",
        f"How to run: on the H200, in one device call, `{DEVICE_COMMAND}` (bring back "
        "`$OUT/bench/results.json` as `benchmarks/results/h200.json`); on the CPU "
        "development machine, " + "; ".join(f"`{s.host_command}`" for s in SECTIONS
                                             if s.where == "host")
        + "; then `python -m benchmarks.render`. See `benchmarks/README.md`.", "",
        "## Summary", ""]
    lines += _summary(page_checks(chosen, standalone, page))
    for sec in SECTIONS:
        lines += _section(sec, chosen, page)
    for module in STANDALONE:
        lines += module.render(standalone.get(module.__name__, []), page)
    if not page.plot.available:
        lines += [f"_Plots not rendered: {page.plot.why_not}._", ""]
    return "\n".join(lines).rstrip() + "\n"


def _load_all(paths: list[Path], results_dir: Path
              ) -> tuple[list[ResultsFile], list[ResultsFile], Standalone]:
    return (load([p for p in paths if Path(p).exists()]),
            load(sorted((Path(results_dir) / REPEATS).glob("*.json"))),
            load_standalone(results_dir))


def render_files(paths: list[Path], md_path: Path, img_dir: Path, *, plots: bool = True,
                 allow_dry_run: bool = False, results_dir: Path = RESULTS_DIR,
                 notes: Path = NOTES) -> Path:
    """Render ``paths`` into ``md_path`` with plots in ``img_dir``; return ``md_path``.

    The standalone benchmarks' results and the repeat runs are read from their
    folders under ``results_dir``; a folder that is missing or empty gives
    "Not measured yet".

    Raises
    ------
    ValueError
        When a dry-run results file would be rendered without ``allow_dry_run``,
        or a file in those folders is not what its script writes.
    """
    files, repeats, standalone = _load_all(paths, results_dir)
    dry = [str(f.path) for f in files + repeats + [g for fs in standalone.values() for g in fs]
           if f.dry_run]
    if dry and not allow_dry_run:
        raise ValueError(f"dry-run results {dry} are not measurements; they are rendered "
                         "only as a preview (python -m benchmarks --dry-run --out DIR)")
    page = Page(Plotter(img_dir, enabled=plots), os.path.relpath(img_dir, md_path.parent),
                notes=load_notes(notes))
    text = render_markdown(files, page, standalone=standalone, repeats=repeats)
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
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                   help="where the repeats/ and the standalone scripts' folders (cost-gate/, "
                        "multi/, host/, tuning/) are read (default benchmarks/results)")
    p.add_argument("--notes", type=Path, default=NOTES,
                   help="why missed checks miss, one '## CHECK ID' each (default "
                        "benchmarks/notes.md)")
    args = p.parse_args(argv)
    files = args.files or default_result_files()
    try:
        out = render_files(files, args.md, args.img_dir, plots=not args.no_plots,
                           results_dir=args.results_dir, notes=args.notes)
    except ValueError as exc:
        print(f"python -m benchmarks.render: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
