"""Section ``ceilings``: the two device rates every other figure is judged against.

* copy bandwidth: a large device-to-device copy, bytes read plus bytes written
  (the roof of a memory-bound kernel such as MLA decode);
* bf16 matrix rate: a large square ``torch.matmul`` on random data (the roof of
  prefill attention and projections).

Both are measured in the same run as the figures that use them, on the same
device state (METHOD.md: "measure the two ceilings once on the device machine").
"""

from __future__ import annotations

from typing import Any

from ._harness import RunContext
from ._report import Page, md_table
from .metrics import Check

#: Copy size: far above the 50 MB L2, so the copy streams HBM.
COPY_BYTES = 2 * 2**30
GEMM_N = 8192


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    torch = ctx.torch
    dev = ctx.device
    nbytes = ctx.pick(COPY_BYTES, COPY_BYTES // 2, 2**20)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    t = ctx.time(lambda: dst.copy_(src), flush_l2=False)
    moved = 2 * nbytes
    data["copy"] = {"bytes_copied": nbytes, "bytes_moved": moved, "timing": t,
                    "GBps": moved / (t["median_us"] * 1e3)}
    ctx.log(f"copy {nbytes / 2**30:.2f} GiB: {t['median_us']:.0f} us, "
            f"{data['copy']['GBps']:.0f} GB/s (read + write)")

    n = ctx.pick(GEMM_N, GEMM_N, 128)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    t = ctx.time(lambda: torch.matmul(a, b, out=c), flush_l2=False)
    flops = 2 * n ** 3
    data["gemm_bf16"] = {"n": n, "flops": flops, "timing": t,
                         "TFLOPs": flops / (t["median_us"] * 1e6)}
    ctx.log(f"bf16 matmul {n}^3: {t['median_us']:.0f} us, "
            f"{data['gemm_bf16']['TFLOPs']:.0f} TFLOP/s")


def copy_gbps(ctx: RunContext) -> float | None:
    """Copy bandwidth (GB/s, read + write) measured earlier in this run, or None."""
    data = ctx.section_data("ceilings")
    if data and "copy" in data:
        return float(data["copy"]["GBps"])
    return None


def gemm_tflops(ctx: RunContext) -> float | None:
    data = ctx.section_data("ceilings")
    if data and "gemm_bf16" in data:
        return float(data["gemm_bf16"]["TFLOPs"])
    return None

# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """None: the ceilings are what the other figures are judged against."""
    return []


def render(data: dict[str, Any], page: Page) -> list[str]:
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
