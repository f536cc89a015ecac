"""Probe: which kernels the FlashMLA plugin's captured decode runs beside raw FlashMLA's.

Usage (a CUDA GPU with flash_mla and the plugin)::

    PYTHONPATH=src:plugins/attnreg-flashmla/src python3 scripts/profile_peers_kernels.py

For the peers benchmark's worst wrapper shapes it captures, exactly as
``benchmarks/decode_peers.py`` does, the raw FlashMLA call (one CUDA graph) and the
plugin's decode through a one-bucket ``GraphSession`` (bf16 q over a bf16 pool, and the
engine's fp8 q over an fp8 pool), replays each graph under ``torch.profiler`` and prints
every kernel the replays ran: calls per replay and mean device time.  It also prints the
mean replay time from CUDA events over back-to-back replays (L2 warm, unlike the
benchmark).  Nothing is written; the point is the kernel list.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((1, 32768, 128), (8, 1024, 128), (128, 4096, 16))
REPLAYS = 20


def kernels(replay, torch) -> list[tuple[str, float, float]]:
    """(kernel name, calls per replay, mean us) of ``REPLAYS`` replays."""
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            replay()
        torch.cuda.synchronize()
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        calls[ev.name] += 1
        total[ev.name] += ev.device_time
    return sorted(((n[:110], calls[n] / REPLAYS, total[n] / calls[n]) for n in calls),
                  key=lambda r: -r[1] * r[2])


def event_us(replay, torch, n: int = 200) -> float:
    for _ in range(10):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / n


def main() -> int:
    import torch

    from attnreg.profiling import random_pool
    from attnreg.registry import ForwardMode, get_registry
    from attnreg.runtime import (
        GraphRunner,
        GraphSession,
        MLAConfig,
        StepInputs,
        decode_batch,
        quantize_q_fp8,
    )
    from benchmarks.decode_peers import _flashmla

    ctx = SimpleNamespace(torch=torch)
    print(torch.cuda.get_device_name(0), torch.__version__)
    for B, L, H in SHAPES:
        for dtype in ("bf16", "fp8_e4m3"):
            torch.manual_seed(0)
            q = torch.randn(B, H, 576, dtype=torch.bfloat16, device="cuda")
            cfg = MLAConfig(num_heads=H, page_size=64, kv_dtype=dtype, device="cuda",
                            max_context_len=L)
            pool = random_pool(torch, cfg, B * L, seed=1)
            batch = decode_batch(pool, [L] * B, shuffle=B + L)
            call = _flashmla(ctx, pool, batch, q, cfg.softmax_scale)
            call()  # eager once first, as the benchmark does (the library's lazy set-up)
            raw = GraphRunner("cuda").capture(call)
            fp8_q = dtype == "fp8_e4m3"
            scfg = MLAConfig(num_heads=H, page_size=64, kv_dtype=dtype, device="cuda",
                             max_context_len=L, q_dtype="fp8_e4m3" if fp8_q else "bf16")
            be = get_registry().create("flashmla", scfg)
            ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[B],
                               writes_kv=False, kernel_outputs=True)
            ses.capture()
            inputs = StepInputs([q])
            if fp8_q:
                q8, q_scale = quantize_q_fp8(q, torch.ones(B, dtype=torch.bool, device="cuda"))
                inputs = StepInputs.one(q8, q_scale=q_scale)
            ses.replay(batch, inputs, bucket=B)
            graph = ses.graph((ForwardMode.DECODE, B))
            for label, replay in (("raw FlashMLA", raw.replay),
                                  ("plugin" + (", fp8 q" if fp8_q else ""), graph.replay)):
                print(f"\n({B}, {L}, {H}) {dtype} {label}: {event_us(replay, torch):.1f} us "
                      "per replay (events, L2 warm)")
                for name, per, us in kernels(replay, torch):
                    print(f"  {per:4.1f} x {us:7.2f} us  {name}")
            del ses, be, raw, pool, batch
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
