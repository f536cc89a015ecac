"""Page bookkeeping of ``MLAKVPool``: freeing 100,000 pages of a 400,000-page pool (CPU).

An engine frees the pages of finished requests every step, so ``free`` must
cost O(1) per page (issue 15: a list search made freeing 10,000 pages take
33 s, and one 87k-page free stalled an H200 run for minutes).  The pool's
buffer is made tiny (1-wide rows) so only the bookkeeping is timed; pages
are freed in shuffled order, as finished requests return them.

Run ``python -m benchmarks.pool_free``; prints JSON (median and spread of
``REPEATS`` runs, and whether the median meets the 50 ms target).  Not part
of ``python -m benchmarks``: it needs no device and measures one function.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

POOL_PAGES = 400_000
FREED_PAGES = 100_000
REPEATS = 7
TARGET_MS = 50.0


def measure(pool_pages: int = POOL_PAGES, freed: int = FREED_PAGES,
            repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Time ``allocate`` and ``free`` of ``freed`` pages in a ``pool_pages`` pool."""
    from attnreg.runtime import MLAKVPool

    free_ms, alloc_ms = [], []
    for r in range(repeats):
        pool = MLAKVPool(pool_pages, 1, kv_dtype="bf16", kv_lora_rank=1, rope_dim=0)
        t0 = time.perf_counter()
        pages = pool.allocate([1] * freed)
        alloc_ms.append((time.perf_counter() - t0) * 1e3)
        flat = [p for owned in pages for p in owned]
        random.Random(seed + r).shuffle(flat)
        t0 = time.perf_counter()
        pool.free(flat)
        free_ms.append((time.perf_counter() - t0) * 1e3)
        assert pool.num_free_pages == pool_pages - 1
    median = sorted(free_ms)[len(free_ms) // 2]
    return {
        "what": f"MLAKVPool.free of {freed} pages (shuffled) in a pool of {pool_pages} pages",
        "free_ms": {"median": median, "min": min(free_ms), "max": max(free_ms),
                    "runs": len(free_ms)},
        "allocate_ms": {"median": sorted(alloc_ms)[len(alloc_ms) // 2], "min": min(alloc_ms),
                        "max": max(alloc_ms), "sequences": freed},
        "target_ms": TARGET_MS,
        "met": median < TARGET_MS,
        "python": sys.version.split()[0],
    }


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
