"""``python -m benchmarks.compare``: one section's times in new runs against older runs.

Were the figures moved by a change (a new graph runner, say) or only by run-to-run
noise?  Every time of the section (``us``, ``eager_us``, ``graph_us`` ... leaves,
identified by their row: variant, B, L, H and the path to them) is printed with
the old runs' median and min - max beside the new runs' median::

    python -m benchmarks.compare --sections P1,P3,P4 \\
        --old benchmarks/results/h200.json benchmarks/results/repeats/h200-run-a.json \\
        --new bench-out/h200/bench/results.json

A new median outside the old runs' range, by more than ``--tolerance`` of the
old median, is flagged ``<<`` (faster) or ``>>`` (slower).  Prints markdown;
measures nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: What names a row of a section's table.
ROW_KEYS = ("variant", "B", "L", "H", "batch_size", "prefix", "extend")
#: Subtrees that repeat a time already seen (spreads, samples) or are not times.
SKIP = {"timing", "eager_timing", "graph_timing", "checks", "samples_us", "host_us", "floor_us"}


def times(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(path, microseconds) of every time leaf under ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in SKIP:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and (key == "us" or key.endswith("_us")) and math.isfinite(value):
                yield f"{path}/{key}", float(value)
            else:
                yield from times(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            name = ",".join(f"{k}={item[k]}" for k in ROW_KEYS
                            if isinstance(item, dict) and k in item) or str(i)
            yield from times(item, f"{path}[{name}]")


def section_times(paths: list[Path], section: str) -> dict[str, list[float]]:
    """Every time of ``section`` over the files that have it ok, by path."""
    out: dict[str, list[float]] = {}
    for p in paths:
        rec = json.loads(Path(p).read_text()).get("sections", {}).get(section, {})
        if rec.get("status") != "ok":
            continue
        for key, us in times(rec.get("data", {})):
            out.setdefault(key, []).append(us)
    return out


def compare(old: list[Path], new: list[Path], section: str, tolerance: float) -> list[str]:
    """A markdown table of one section: old median (min - max), new median, new / old."""
    before, after = section_times(old, section), section_times(new, section)
    lines = [f"## {section}", "", "| time | old median us (min - max, runs) | new median us "
             "(runs) | new / old |", "|---|---|---|---|"]
    ratios = []
    for key in sorted(before.keys() & after.keys()):
        o, n = before[key], after[key]
        om, nm = statistics.median(o), statistics.median(n)
        if om <= 0:
            continue
        ratio = nm / om
        ratios.append(ratio)
        flag = ""
        if nm < min(o) - tolerance * om:
            flag = " <<"
        elif nm > max(o) + tolerance * om:
            flag = " >>"
        lines.append(f"| `{key}` | {om:.1f} ({min(o):.1f} - {max(o):.1f}, {len(o)}) | "
                     f"{nm:.1f} ({len(n)}) | {ratio:.3f}{flag} |")
    if not ratios:
        return lines[:2] + ["No time in both the old and the new runs.", ""]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    only = sorted(before.keys() ^ after.keys())
    lines += ["", f"{len(ratios)} times; geometric mean of new / old: **{geo:.3f}**; flagged "
              f"(outside the old range by more than {tolerance:.0%}): "
              f"{sum('<<' in ln or '>>' in ln for ln in lines)}"
              + (f"; in one side only: {len(only)}" if only else ""), ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare",
                                description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="P1,P3,P4", help="comma-separated section ids")
    p.add_argument("--old", nargs="+", type=Path, required=True, help="results files before")
    p.add_argument("--new", nargs="+", type=Path, required=True, help="results files after")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="flag a new median this far outside the old range (default 0.05)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.old + args.new if not f.exists()]
    if missing:
        print(f"python -m benchmarks.compare: no such file {missing}", file=sys.stderr)
        return 2
    for section in (s.strip() for s in args.sections.split(",") if s.strip()):
        print("\n".join(compare(args.old, args.new, section, args.tolerance)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
