"""Page bookkeeping of ``MLAKVPool``: freeing 100,000 pages of a 400,000-page pool (CPU).

An engine frees the pages of finished requests every step, so ``free`` must
cost O(1) per page (issue 15: a list search made freeing 10,000 pages take
33 s, and one 87k-page free stalled an H200 run for minutes).  The pool's
buffer is made tiny (1-wide rows) so only the bookkeeping is timed; pages
are freed in shuffled order, as finished requests return them.

A section of ``python -m benchmarks`` (id ``pool``, measured on the CPU
development machine like P5)::

    python -m benchmarks --only pool --out bench-out/pool
    cp bench-out/pool/results.json benchmarks/results/cpu-pool-free.json

``python -m benchmarks.pool_free`` runs the measurement alone and prints its
JSON (exit status 1 when the median misses the 50 ms target).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from attnreg.profiling import load_average, spread

from ._harness import RunContext
from ._report import Page, md_table
from .metrics import Check, evaluate

POOL_PAGES = 400_000
FREED_PAGES = 100_000
REPEATS = 7
#: ``--dry-run``: the same code on a small pool, to check the section quickly.
DRY_POOL_PAGES, DRY_FREED_PAGES, DRY_REPEATS = 16_000, 4_000, 2
TARGET_MS = 50.0


def measure(pool_pages: int = POOL_PAGES, freed: int = FREED_PAGES,
            repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Time ``allocate`` and ``free`` of ``freed`` pages in a ``pool_pages`` pool."""
    from attnreg.runtime import MLAKVPool

    free_ms, free_cpu_ms, alloc_ms = [], [], []
    for r in range(repeats):
        pool = MLAKVPool(pool_pages, 1, kv_dtype="bf16", kv_lora_rank=1, rope_dim=0)
        t0 = time.perf_counter()
        pages = pool.allocate([1] * freed)
        alloc_ms.append((time.perf_counter() - t0) * 1e3)
        flat = [p for owned in pages for p in owned]
        random.Random(seed + r).shuffle(flat)
        c0, t0 = time.process_time(), time.perf_counter()
        pool.free(flat)
        free_ms.append((time.perf_counter() - t0) * 1e3)
        # this process's CPU time too: on a shared machine the wall time also holds the
        # time other processes had the core
        free_cpu_ms.append((time.process_time() - c0) * 1e3)
        if pool.num_free_pages != pool_pages - 1:  # every page back but the padding page
            raise RuntimeError(f"after freeing, {pool.num_free_pages} of {pool_pages - 1} "
                               "pages are free")
    free, cpu, alloc = spread(free_ms), spread(free_cpu_ms), spread(alloc_ms)
    return {
        "what": f"MLAKVPool.free of {freed} pages (shuffled) in a pool of {pool_pages} pages",
        "pool_pages": pool_pages, "freed_pages": freed,
        "free_ms": {"median": free["median"], "min": free["min"], "max": free["max"],
                    "runs": free["n"], "samples": [round(t, 3) for t in free_ms]},
        "free_cpu_ms": {"median": cpu["median"], "min": cpu["min"], "max": cpu["max"]},
        "allocate_ms": {"median": alloc["median"], "min": alloc["min"], "max": alloc["max"],
                        "sequences": freed},
        "target_ms": TARGET_MS,
        "met": free["median"] < TARGET_MS,
        "python": sys.version.split()[0],
    }


# ----------------------------------------------------------------------------------------
# The section of python -m benchmarks
# ----------------------------------------------------------------------------------------

def run(ctx: RunContext, data: dict[str, Any]) -> None:
    pool_pages = ctx.pick(POOL_PAGES, POOL_PAGES, DRY_POOL_PAGES)
    freed = ctx.pick(FREED_PAGES, FREED_PAGES, DRY_FREED_PAGES)
    repeats = ctx.pick(REPEATS, REPEATS, DRY_REPEATS)
    before = load_average()
    data.update(measure(pool_pages, freed, repeats))
    # 1, 5 and 15 minute load averages: the machine is shared, and this is wall clock
    data["load_average"] = {"before": before, "after": load_average()}
    data["timing"] = (f"time.perf_counter around one free() of all {freed} pages, "
                      f"{repeats} runs, a new pool each")
    ctx.log(f"pool: free {freed} of {pool_pages} pages: median "
            f"{data['free_ms']['median']:.1f} ms (min {data['free_ms']['min']:.1f}, max "
            f"{data['free_ms']['max']:.1f}); allocate {data['allocate_ms']['median']:.1f} ms")
    data["checks"] = [c.to_dict() for c in checks(data)]


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """The median time of one free of the pages against the 50 ms target."""
    free = data.get("free_ms") or {}
    what = (f"MLAKVPool.free of {data.get('freed_pages', FREED_PAGES):,} shuffled pages of a "
            f"{data.get('pool_pages', POOL_PAGES):,}-page pool (median of "
            f"{free.get('runs', '?')} runs)")
    detail = (f"min {free['min']:.1f} ms, max {free['max']:.1f} ms" if "min" in free else "")
    return [evaluate("pool free", what, free.get("median"), "ms", "<=", target=TARGET_MS,
                     detail=detail)]


def render(data: dict[str, Any], page: Page) -> list[str]:
    free, alloc = data.get("free_ms", {}), data.get("allocate_ms", {})
    cpu = data.get("free_cpu_ms") or {}
    load = data.get("load_average") or {}

    def row(what: str, t: dict[str, Any]) -> list[str]:
        return [what, f"{t.get('median', 0):.1f}",
                f"{t.get('min', 0):.1f} – {t.get('max', 0):.1f}", str(free.get("runs"))]

    rows = [row("`free` of every page, shuffled (wall clock: the figure)", free)]
    rows += [row("the same `free`s, this process's CPU time", cpu)] if cpu else []
    rows += [row(f"`allocate` of {alloc.get('sequences', 0):,} one-page sequences", alloc)]
    return [(f"{data.get('what')}: {data.get('timing')}.  The pool's rows are 1 element wide, "
             "so only the page bookkeeping is timed.  Python "
             f"{data.get('python')}; load average (1/5/15 min) before / after: "
             f"{load.get('before')} / {load.get('after')}."), "",
            md_table(["operation", "median ms", "min – max ms", "runs"], rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pool_free",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=POOL_PAGES, help="pool size in pages")
    parser.add_argument("--free", type=int, default=FREED_PAGES, help="pages to free")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args(argv)
    result = measure(args.pages, args.free, args.repeats)
    print(json.dumps(result, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
