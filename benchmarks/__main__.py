"""``python -m benchmarks``: run the benchmark sections, write JSON, render a preview.

Examples
--------
On the H200 (one device call)::

    python -m benchmarks --out $OUT/bench

Here, before that call (tiny shapes, Triton interpreter, no timing meaning)::

    python -m benchmarks --dry-run --out /tmp/bench-dry

The process start-up figure (P5) is measured on the CPU machine::

    python -m benchmarks --only P5 --out /tmp/p5 && cp /tmp/p5/results.json \
        benchmarks/results/cpu-startup.json

Then ``python -m benchmarks.render`` renders docs/benchmarks.md from
``benchmarks/results/*.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

from attnreg.profiling.progress import Progress

from ._harness import SECTIONS, RunContext, python_command, run_sections, select_sections

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run attnreg's benchmarks, write DIR/results.json and render "
                    "DIR/benchmarks.md with plots in DIR/img.")
    ids = ", ".join(s.id for s in SECTIONS)
    p.add_argument("--only", default=None, metavar="IDS",
                   help=f"comma-separated sections to run (of: {ids}); the sections they "
                        "read (ceilings) are added")
    p.add_argument("--skip", default=None, metavar="IDS", help="comma-separated sections to skip")
    p.add_argument("--out", default="bench-out", metavar="DIR",
                   help="where results.json, benchmarks.md and img/ go (default: bench-out)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes (P6, prefill) and shorter timing (10 ms warm-up, "
                        "50 ms of repeats)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes; allowed without CUDA (Triton interpreter, graphs "
                        "replayed eagerly): checks the harness, measures nothing")
    p.add_argument("--warmup-ms", type=float, default=None)
    p.add_argument("--rep-ms", type=float, default=None)
    p.add_argument("--time-budget-s", type=float, default=300.0,
                   help="skip what would start after this many seconds (default 300), so "
                        "the JSON is complete before a device call's limit")
    p.add_argument("--no-render", action="store_true", help="write JSON only")
    p.add_argument("--no-jit-cache", action="store_true",
                   help="do not copy flashinfer's JIT cache to DIR/fi-cache.tgz")
    p.add_argument("--list", action="store_true", help="list the sections and exit")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no 'section i of N' progress lines (shown on stderr when it is a "
                        "terminal)")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr even when it is not a terminal (a log file)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for s in SECTIONS:
            print(f"{s.id:9s} {s.title}" + ("  [CPU machine]" if s.where == "host" else ""))
        return 0
    try:
        sections, named = select_sections(args.only, args.skip)
    except ValueError as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        _interpret_triton_without_gpu()
    out = Path(args.out)
    ctx = RunContext(
        out_dir=out, quick=args.quick, dry_run=args.dry_run,
        warmup_ms=args.warmup_ms if args.warmup_ms is not None else (10.0 if args.quick
                                                                       else 25.0),
        rep_ms=args.rep_ms if args.rep_ms is not None else (50.0 if args.quick else 100.0),
        time_budget_s=args.time_budget_s, command=python_command(),
        progress=Progress.for_terminal(len(sections), quiet=args.quiet, force=args.progress))
    doc = run_sections(ctx, sections, named)
    if not args.no_jit_cache:
        saved = save_flashinfer_jit_cache(out)
        if saved:
            ctx.log(f"flashinfer JIT cache saved to {saved} (carry it as .gpu/fi-cache.tgz)")
    print_summary(doc)
    if not args.no_render:
        _render_preview(ctx, out)
    errors = [sid for sid, rec in doc["sections"].items() if rec.get("status") == "error"]
    return 1 if errors else 0


def _interpret_triton_without_gpu() -> None:
    # Must happen before triton is imported: @triton.jit reads it at decoration time.
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def save_flashinfer_jit_cache(out: Path, max_source_bytes: int = 256 * 2**20,
                              max_archive_bytes: int = 40 * 2**20) -> Path | None:
    """Tar ``~/.cache/flashinfer`` into ``out/fi-cache.tgz`` when flashinfer ran here.

    ``.gpu/setup.sh`` unpacks a carried ``.gpu/fi-cache.tgz`` into ``~/.cache``,
    so the next device call skips flashinfer's ~20 s-per-variant JIT.  Nothing
    is written when the cache is missing or the archive would be too large to
    bring back.

    Every member's time is rounded *down* to the second.  ninja's ``.ninja_deps``
    keeps each object's mtime in nanoseconds and treats the deps as stale when
    the file on disk is newer; a pax archive keeps microseconds, rounded to the
    nearest, so about half the unpacked objects came out a few hundred ns
    "newer" and every module was compiled again (seen on the H200: ``ninja -d
    explain`` printed "stored deps info out of date").  A time rounded down is
    never newer than the recorded one, and still newer than the sources.
    """
    if "flashinfer" not in sys.modules:
        return None
    cache = Path.home() / ".cache" / "flashinfer"
    if not cache.is_dir():
        return None
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    if size > max_source_bytes:
        print(f"flashinfer JIT cache is {size / 2**20:.0f} MiB: not saved", flush=True)
        return None
    out.mkdir(parents=True, exist_ok=True)
    target = out / "fi-cache.tgz"
    with tarfile.open(target, "w:gz") as tar:
        tar.add(cache, arcname="flashinfer", filter=_whole_seconds)
    if target.stat().st_size > max_archive_bytes:
        print(f"flashinfer JIT cache archive is {target.stat().st_size / 2**20:.0f} MiB: "
              "not kept", flush=True)
        target.unlink()
        return None
    return target


def _whole_seconds(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.mtime = int(member.mtime)
    return member


def print_summary(doc: dict[str, Any]) -> None:
    """A short table last, so the end of a device call's output carries it."""
    print("\n== sections ==")
    for sid, rec in doc.get("sections", {}).items():
        status = rec.get("status", "?")
        why = rec.get("reason") or rec.get("error") or ""
        print(f"{sid:9s} {status:8s} {rec.get('seconds', 0):7.1f}s  {why[:110]}")
    print("== checks ==")
    for rec in doc.get("sections", {}).values():
        for c in rec.get("data", {}).get("checks", []):
            measured = "-" if c.get("measured") is None else f"{c['measured']:.4g}"
            bound = " ".join(f"{k} {c['direction']} {c[k]:g}" for k in ("target", "goal")
                             if c.get(k) is not None)
            print(f"{c['id']:26s} {measured:>10s} {c['unit']:9s} {bound:34s} {c['status']}")
    print(f"total {doc.get('meta', {}).get('total_seconds', '?')} s", flush=True)


def _render_preview(ctx: RunContext, out: Path) -> None:
    try:
        from . import render
        files = [ctx.results_path] + [p for p in render.default_result_files(RESULTS_DIR)
                                      if p.resolve() != ctx.results_path.resolve()]
        md = render.render_files(files, out / "benchmarks.md", out / "img",
                                 allow_dry_run=True)
        ctx.log(f"rendered {md}")
    except Exception as exc:  # noqa: BLE001 - the JSON is what matters; say why
        ctx.log(f"render preview failed ({type(exc).__name__}: {exc}); the JSON is complete: "
                f"render it with python -m benchmarks.render")


if __name__ == "__main__":
    sys.exit(main())
