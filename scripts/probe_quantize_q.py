"""Probe the fused ``quantize_q_fp8`` (two Triton launches) against the torch form on a GPU.

1. Bits: rows 1..128 x heads 16 / 64 / 128 x 576, bf16 and fp16 (and fp32 at a few
   shapes), q of varied magnitudes with negative zeros, an exact power-of-two max, dead
   rows holding stale inf / NaN, and live inf / NaN rows.  Every byte of q_fp8 and the
   descale must equal the torch form's; where q holds a NaN both must be an e4m3 NaN
   (bytes that differ only there are counted apart, as ``nan_sign``).
2. Time: each form inside a CUDA graph of 10 calls (median of 50 replays, CUDA events,
   per call), and eager (host wall time per call over 200 calls, one sync at the end),
   at q [8, 128, 576], [64, 128, 576], [128, 16, 576] bf16.

Exit status 1 on any mismatch.  ``--json`` prints the results as JSON.
Run: ``python scripts/probe_quantize_q.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from attnreg.runtime import _quantize_q_kernel as fused  # noqa: E402
from attnreg.runtime import quantize_q_fp8  # noqa: E402
from attnreg.runtime.dtypes import _quantize_q_fp8_torch  # noqa: E402

MAGNITUDES = (0.0, 1e-30, 1e-6, 0.3, 1.0, 448.0, 896.0, 3e4, 448 * 2.0 ** 20)
TIMED = ((8, 128, 576), (64, 128, 576), (128, 16, 576))
DEVICE = "cuda"


def make_q(rows: int, heads: int, dtype: torch.dtype, case: int, gen: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    magnitude = min(MAGNITUDES[case % len(MAGNITUDES)], torch.finfo(dtype).max / 8)
    if case % 2:  # max = magnitude exactly (448 * 2**k: an exact power-of-two ratio)
        q = (torch.rand(rows, heads, 576, generator=gen, device=DEVICE) * 2 - 1) * magnitude
        q.view(-1)[17 + case % (q.numel() - 17)] = -magnitude  # past the -0.0 below
    else:
        q = torch.randn(rows, heads, 576, generator=gen, device=DEVICE) * magnitude
    q.view(-1)[1:17] = -0.0
    q = q.to(dtype)
    live = torch.rand(rows, generator=gen, device=DEVICE) < 0.75
    live[0] = True
    dead = (~live).nonzero().flatten()
    if dead.numel():
        q[dead[0]] = float("nan") if case % 3 else float("inf")
    if case % 17 == 5:  # a live non-finite row: scale 1, every value cast as it is
        q[0, 0, :4] = torch.tensor([float("inf"), 470.0, 1e4, float("nan")], device=DEVICE)
    return q, live


def compare(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
            q: torch.Tensor) -> tuple[int, int]:
    """(mismatched bytes outside q's NaNs + a descale mismatch, NaN-only differences)."""
    bad = int(not torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)))
    g, w = got[0].view(torch.uint8), want[0].view(torch.uint8)
    nan = torch.isnan(q)
    bad += int(((g != w) & ~nan).sum())
    bad += int((((g & 0x7F) != 0x7F) & nan).sum() + (((w & 0x7F) != 0x7F) & nan).sum())
    return bad, int(((g != w) & nan).sum())


def check_bits() -> dict[str, int]:
    gen = torch.Generator(device=DEVICE).manual_seed(31)
    cases = bad = nan_sign = fused_calls = 0
    shapes = [(r, h, dt) for dt in (torch.bfloat16, torch.float16) for h in (16, 64, 128)
              for r in range(1, 129)]
    shapes += [(r, h, torch.float32) for h in (16, 128) for r in (1, 7, 64, 128)]
    for i, (rows, heads, dtype) in enumerate(shapes):
        q, live = make_q(rows, heads, dtype, i, gen)
        fused_calls += int(fused.supports(q, live))
        got, want = quantize_q_fp8(q, live), _quantize_q_fp8_torch(q, live)
        b, n = compare(got, want, q)
        if b:
            print(f"MISMATCH rows {rows} heads {heads} {dtype} case {i}: {b} bytes"
                  f" (descale {got[1].item()} vs {want[1].item()})")
        cases, bad, nan_sign = cases + 1, bad + b, nan_sign + n
    return {"cases": cases, "fused": fused_calls, "mismatched": bad, "nan_sign": nan_sign}


def graph_us(fn, calls: int = 10, replays: int = 50) -> float:  # type: ignore[no-untyped-def]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_us(fn, calls: int = 200) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def timings() -> list[dict[str, object]]:
    rows_out = []
    for shape in TIMED:
        q = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
        live = torch.ones(shape[0], dtype=torch.bool, device=DEVICE)
        live[-1] = shape[0] == 1
        row: dict[str, object] = {"q": list(shape)}
        for name, fn in (("torch", _quantize_q_fp8_torch), ("fused", quantize_q_fp8)):
            row[f"{name}_graph_us"] = round(graph_us(lambda fn=fn: fn(q, live)), 2)
            row[f"{name}_eager_us"] = round(eager_us(lambda fn=fn: fn(q, live)), 2)
        rows_out.append(row)
    return rows_out


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    bits = check_bits()
    times = timings()
    result = {"torch": torch.__version__, "saturates": fused.SATURATES,
              "device": torch.cuda.get_device_name(), "bits": bits, "time": times}
    if "--json" in argv:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['device']}, torch {result['torch']}, e4m3 cast saturates:"
              f" {result['saturates']}")
        print(f"bits: {bits['cases']} cases ({bits['fused']} through the fused kernel),"
              f" {bits['mismatched']} mismatched bytes, {bits['nan_sign']} NaN-sign-only")
        print(f"{'q':<16}{'torch graph':>12}{'fused graph':>12}{'torch eager':>12}"
              f"{'fused eager':>12}   (us per call)")
        for row in times:
            print(f"{str(tuple(row['q'])):<16}{row['torch_graph_us']:>12}"
                  f"{row['fused_graph_us']:>12}{row['torch_eager_us']:>12}"
                  f"{row['fused_eager_us']:>12}")
    ok = bits["mismatched"] == 0 and bits["fused"] == bits["cases"]
    print("OK" if ok else "FAILED: fused and torch forms differ (or the fused form was not used)",
          file=sys.stderr if "--json" in argv else sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
