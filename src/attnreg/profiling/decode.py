"""Decode time per backend and capture bucket, replayed through a GraphSession.

What ``attnreg calibrate --decode`` writes into a decode profile
(:mod:`attnreg.graph_policy.decode_profile`) and what the per-bucket
benchmark (``benchmarks/decode_peers.py``) measures attnreg's backends with:
for each backend, one :class:`attnreg.runtime.GraphSession` (FULL decode)
captures every bucket over one pool; for each bucket and KV length, a batch
of that many sequences of that length is loaded into the bucket's static
inputs and its replay metadata prepared once (``session.replay``), then the
recorded graph alone is timed with :meth:`Clock.calls` (CUDA events, L2
flushed before each replay).  The time is the attention of one layer as a
replay runs it: the kernels the backend records, nothing of the host.

torch is passed in (importing this module imports nothing heavy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["DecodePoint", "decode_points", "measure_decode"]

#: (bucket, kv_len) pairs measured, in that order.
DecodePoint = tuple[int, int]


def decode_points(buckets: Sequence[int], kv_lens: Sequence[int], max_tokens: int
                  ) -> list[DecodePoint]:
    """Every (bucket, kv_len) whose KV (bucket x kv_len tokens) fits ``max_tokens``."""
    return [(b, n) for b in sorted(set(buckets)) for n in sorted(set(kv_lens))
            if b * n <= max_tokens]


def measure_decode(torch: Any, backends: Mapping[str, Any], pool: Any,
                   points: Sequence[DecodePoint], clock: Any, *,
                   device_graphs: bool | None = None, seed: int = 0,
                   skip: Callable[[str, int, int], str] | None = None,
                   log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One entry per (backend, bucket): ``{"backend", "bucket", "points": [{"kv_len", "us",
    "p20_us", "p80_us", "n"}]}`` (a point ``skip`` names a reason for is left out and
    listed under ``"skipped"``).

    Parameters
    ----------
    backends
        name -> backend instance, each built for ``pool`` (same page size, KV dtype).
    pool
        The KV pool (rows already random); it must hold the largest point.
    points
        (bucket, kv_len) pairs (:func:`decode_points`).
    clock
        :class:`attnreg.profiling.Clock`.
    device_graphs
        ``GraphRunner`` option (False on a cpu: a replay re-runs the function).
    skip
        ``skip(backend, bucket, kv_len)`` -> a reason to skip ('' = measure).
    """
    from attnreg.registry import ForwardMode
    from attnreg.runtime import GraphSession, StepInputs, decode_batch

    buckets = sorted({b for b, _ in points})
    heads = next(iter(backends.values())).config.num_heads
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    entries: list[dict[str, Any]] = []
    for name, backend in backends.items():
        ses = GraphSession(backend, pool, phase="decode", mode="full", buckets=buckets,
                           writes_kv=False, device_graphs=device_graphs)
        ses.capture()
        by_bucket: dict[int, dict[str, Any]] = {}
        for bucket, kv_len in points:
            entry = by_bucket.setdefault(bucket, {"backend": name, "bucket": bucket,
                                                  "points": [], "skipped": []})
            why = skip(name, bucket, kv_len) if skip is not None else ""
            if why:
                entry["skipped"].append({"kv_len": kv_len, "reason": why})
                continue
            pages = pool.allocate([kv_len] * bucket)
            try:
                batch = decode_batch(pool, [kv_len] * bucket, pages=pages)
                q = torch.randn(bucket, heads, backend.config.kv_row_dim, generator=gen,
                                device=pool.device).to(torch.bfloat16)
                ses.replay(batch, StepInputs([q]), bucket=bucket)  # inputs + replay metadata
                m = clock.calls(ses.graph((ForwardMode.DECODE, bucket)).replay)
            finally:
                pool.free([p for seq in pages for p in seq])
            entry["points"].append({"kv_len": kv_len, "us": m["median_us"],
                                    "p20_us": m["p20_us"], "p80_us": m["p80_us"],
                                    "n": m["n"]})
            if log is not None:
                log(f"{name} bucket {bucket} kv {kv_len}: {m['median_us']:.1f} us")
        del ses
        entries += [e for e in by_bucket.values() if e["points"]]
        if getattr(clock, "cuda", False):
            torch.cuda.empty_cache()
    for e in entries:
        if not e["skipped"]:
            del e["skipped"]
    return entries
