"""Where the host time of a session step and the device time of a B=1 decode graph go
(issue 26), on a CUDA device.

    python scripts/probe_session_host.py

1. Host time (wall clock after ``torch.cuda.synchronize()``, median of 400 samples) of a
   device-to-device copy of a packed index buffer's size in the ways a Python runtime can
   issue it, beside one graph launch, so the replay metadata's floor is known.
2. The kernels of one replay of the session benchmark's 8-layer triton decode graph at
   B=1 (torch.profiler, device time per kernel), so the graph's own time is known.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from attnreg.registry import get_registry  # noqa: E402
from attnreg.runtime import GraphSession, MLAConfig, StepInputs, decode_batch  # noqa: E402


def host_us(fn, samples: int = 400) -> float:
    out = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def main() -> int:
    b, seq, ps, heads, layers = 64, 2048, 64, 128, 8
    cfg = MLAConfig(num_heads=heads, page_size=ps, max_context_len=seq + 4, device="cuda")
    backend = get_registry().create("triton", cfg)
    pool = cfg.make_pool(b * -(-(seq + 4) // ps) + 2, num_layers=layers)
    pages = pool.allocate([seq + 4] * b, shuffle=7)
    ses = GraphSession(backend, pool, phase="decode", mode="full", buckets=(1, 8, b),
                       layers=layers, max_seq_len=seq + 4)
    ses.capture()
    batch = decode_batch(pool, [seq] * b, pages=pages[:b], layout=ses.index_layout)
    dst = backend.graph_state.flat
    src = batch.packed.flat
    print(f"flat buffer: {dst.numel()} int32 ({dst.nbytes} bytes)")
    rows = []
    rows.append(("session.run (B=64)", host_us(lambda: ses.run(batch))))
    rows.append(("Tensor.copy_", host_us(lambda: dst.copy_(src))))

    def inference_copy():
        with torch.inference_mode():
            dst.copy_(src)
    rows.append(("copy_ under inference_mode", host_us(inference_copy)))
    rows.append(("torch.ops.aten.copy_.default", host_us(
        lambda: torch.ops.aten.copy_.default(dst, src))))
    lib = cudart()
    if lib is not None:
        d, s, n = ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), dst.nbytes
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        fn = lib.cudaMemcpyAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_void_p]
        rows.append(("cudaMemcpyAsync via ctypes (D2D)", host_us(lambda: fn(d, s, n, 3, stream))))
        rows.append(("  + current_stream() lookup", host_us(
            lambda: fn(d, s, n, 3, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))))
    graph = ses.graph((batch.forward_mode, b))
    rows.append(("graph launch (CapturedGraph.replay)", host_us(graph.replay)))
    for name, us in rows:
        print(f"{name:40s} {us:8.1f} us")
    ok = torch.equal(dst, src)
    print("copies equal:", ok)

    # 2. the B=1 graph's kernels
    one = decode_batch(pool, [seq], pages=pages[:1], layout=ses.index_layout)
    gen = torch.Generator(device="cpu").manual_seed(5)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    ses.load((one.forward_mode, 1), StepInputs([rand(1, heads, 576) for _ in range(layers)],
                                               [rand(1, 512) for _ in range(layers)],
                                               [rand(1, 64) for _ in range(layers)]))
    for _ in range(20):
        ses.run(one)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            ses.run(one)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    g1 = ses.graph((one.forward_mode, 1))
    times = []
    for _ in range(50):
        ev[0].record()
        g1.replay()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) * 1e3)
    print(f"B=1 graph replay (no L2 flush), median of 50: {statistics.median(times):.1f} us")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
