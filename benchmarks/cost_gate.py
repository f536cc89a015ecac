#!/usr/bin/env python3
"""Cost-aware prefill replay against the two fixed policies (issue 10).

A mix of prefill batch classes (extend 64..8192 tokens, prefix 0..32k) runs
through an 8-layer DeepSeek-V3-shaped MLA stack (random bf16 weights, real
projection shapes, the backend's attention) two ways:

* **graph**: absorbed MLA, the whole stack captured once per class in a
  BREAKABLE CUDA graph at the class's token bucket and replayed
  (``init_forward_metadata_replay`` + input copies + replay, timed together);
* **eager**: the MHA companion, eagerly (``init_forward_metadata``, then per
  layer: projections, KV write, latent decompression with ``kv_b_proj``,
  ragged MHA prefill, ``o_proj``).

The cost-aware policy is :class:`attnreg.graph_policy.ReplayGate` with the
profile; "always graph" replays whatever today's rules allow; "always eager"
never replays.  Per class: both times, the best, the gate's choice and its
ratio to the best; over the mix (each class once): the total of each policy.
Targets: the gate within 1.05x of the per-class best on every class, and at
least 1.3x faster than the worse fixed policy over the mix.

Run it standalone (no benchmarks harness; the attnreg package must import)::

    python3 benchmarks/cost_gate.py --profile h200-triton.json --out cost_gate.json
    python3 benchmarks/cost_gate.py --profile /tmp/dry.json --out /tmp/cg.json --dry-run

``--dry-run`` runs on the CPU with tiny shapes, the reference backend and the
graph path emulated eagerly (no CUDA graphs on a CPU): it checks the script,
and its times mean nothing.  Timing: CUDA events around each step, L2
flushed before each, median of repeated steps (at least 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

try:
    import attnreg  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnreg.commands.calibrate import (
    DRY_LAYER,
    LayerShape,
    MLALayer,
    kv_slots_of,
    random_pool,
    rel_diff,
)
from attnreg.graph_policy import GraphConfig, ModelFacts, ReplayBatch, ReplayGate, resolve
from attnreg.graph_policy.cost_profile import CostProfile, PrefillShape, load_profile
from attnreg.registry import ForwardMode, GraphMode, Platform

SCHEMA = "attnreg.bench.cost_gate"
#: (requests, prefix per request, extend per request); each class counts once in the mix.
MIX: tuple[tuple[int, int, int], ...] = (
    (1, 0, 64), (1, 0, 512), (1, 0, 2048), (1, 0, 8192),
    (1, 4096, 128), (1, 4096, 1024), (1, 4096, 4096),
    (1, 32768, 64), (1, 32768, 512), (1, 32768, 4096),
    (4, 0, 256), (8, 1024, 128), (4, 8192, 1024), (2, 16384, 2048),
)
DRY_MIX: tuple[tuple[int, int, int], ...] = ((1, 0, 4), (1, 24, 8), (2, 8, 4))
DRY_BUCKETS = (4, 8, 16, 32)
TARGET_RATIO_TO_BEST = 1.05
TARGET_SPEEDUP_OVER_WORSE = 1.3
MAX_REL_DIFF = 5e-2
_FLUSH_BYTES = 256 * 2 ** 20


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class StepTimer:
    """Median time of a whole step (host work included), in microseconds."""

    def __init__(self, torch: Any, cuda: bool, rep_ms: float) -> None:
        self.torch = torch
        self.cuda = cuda
        self.rep_ms = rep_ms
        self.flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda") if cuda \
            else None

    def __call__(self, fn: Any) -> dict[str, Any]:
        torch = self.torch
        samples: list[float] = []
        if not self.cuda:
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
            return {"us": _median(samples), "samples_us": samples,
                    "method": "wall clock on cpu (dry run: not a measurement)"}
        reps, spent_ms = 0, 0.0
        while reps < 2 or (spent_ms < self.rep_ms and reps < 10):
            torch.cuda.synchronize()
            self.flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
            spent_ms += samples[-1] / 1e3
            reps += 1
        return {"us": _median(samples), "samples_us": [round(s, 2) for s in samples],
                "method": "cuda events around the step, L2 flushed, median"}


def _mix(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        classes = tuple(tuple(int(v) for v in c.split(":")) for c in text.split(",") if c)
    except ValueError:
        classes = ()
    if not classes or any(len(c) != 3 or c[0] < 1 or c[1] < 0 or c[2] < 1 for c in classes):
        raise argparse.ArgumentTypeError(f"expected B:P:E,... (B, E >= 1, P >= 0), got {text!r}")
    return classes  # type: ignore[return-value]


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), n)


def _run_class(ctx: dict[str, Any], batch_size: int, prefix: int, extend: int,
               seed: int) -> dict[str, Any]:
    from attnreg.backends.batch import extend_batch
    from attnreg.graph_policy import capturing

    torch, backend, layers = ctx["torch"], ctx["backend"], ctx["layers"]
    cuda, dev, hidden = ctx["cuda"], ctx["device"], ctx["shape"].hidden
    seq_lens = [prefix + extend] * batch_size
    tokens = batch_size * extend
    padded = _bucket(tokens, ctx["buckets"])
    pools = [random_pool(torch, backend.config, sum(seq_lens), seed + i)
             for i in range(len(layers))]
    pages = pools[0].allocate(seq_lens, shuffle=seed)
    for pool in pools[1:]:
        pool.allocate(seq_lens, shuffle=seed)  # the same pages: one page table serves all
    batch = extend_batch(pools[0], [prefix] * batch_size, [extend] * batch_size, pages=pages)
    kv_slots = kv_slots_of(torch, pools[0], pages, seq_lens)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    positions = torch.tensor([prefix + j for _ in range(batch_size) for j in range(extend)],
                             dtype=torch.long, device=dev)

    def eager_step() -> Any:
        backend.init_forward_metadata(batch)
        h = x
        for layer, pool in zip(layers, pools):
            h = layer.forward_mha(h, positions, backend, pool, batch, kv_slots)
        return h

    row: dict[str, Any] = {"batch_size": batch_size, "prefix": prefix, "extend": extend,
                           "tokens": tokens, "padded_tokens": padded}
    out_eager = eager_step()
    if cuda:
        x_static = torch.zeros(padded, hidden, dtype=torch.bfloat16, device=dev)
        pos_static = torch.zeros(padded, dtype=torch.long, device=dev)
        x_static[:tokens].copy_(x)
        pos_static[:tokens].copy_(positions)
        backend.init_cuda_graph_state(batch_size, padded, max_seq_len=max(seq_lens),
                                      graph_modes={"prefill": "breakable"})
        backend.init_forward_metadata_capture(batch_size, padded, batch,
                                              forward_mode=ForwardMode.EXTEND)

        def absorbed_stack() -> Any:
            h = x_static
            for layer, pool in zip(layers, pools):
                h = layer.forward_absorbed(h, pos_static, backend, pool, None)
            return h

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), capturing(GraphMode.BREAKABLE):
            absorbed_stack()  # compiles kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capturing(GraphMode.BREAKABLE), torch.cuda.graph(graph):
            out_static = absorbed_stack()
        torch.cuda.synchronize()

        def graph_step() -> Any:
            backend.init_forward_metadata_replay(batch_size, padded, batch,
                                                 forward_mode=ForwardMode.EXTEND)
            x_static[:tokens].copy_(x)
            pos_static[:tokens].copy_(positions)
            graph.replay()
            return out_static[:tokens]

        row["graph"] = "cuda graph (breakable, absorbed MLA pinned)"
    else:
        def graph_step() -> Any:
            h = x
            for layer, pool in zip(layers, pools):
                h = layer.forward_absorbed(h, positions, backend, pool, batch)
            return h

        row["graph"] = "emulated eagerly (cpu dry run)"
    out_graph = graph_step()
    diff = rel_diff(torch, out_graph - x, out_eager - x)
    # JSON has no infinity: a non-finite output is recorded as null (and disagrees).
    row.update(rel_diff_graph_vs_eager=diff if math.isfinite(diff) else None,
               agree=diff <= MAX_REL_DIFF)
    del out_eager, out_graph
    row["graph_timing"] = ctx["timer"](graph_step)
    row["eager_timing"] = ctx["timer"](eager_step)
    if cuda:
        del graph
        backend.graph_state = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def _decide(ctx: dict[str, Any], row: dict[str, Any]) -> None:
    """Gate decisions and predictions for a measured class; fills the policy columns."""
    b, p, e = row["batch_size"], row["prefix"], row["extend"]
    batch = ReplayBatch(ForwardMode.EXTEND, b, num_tokens=b * e, prefix_lens=[p] * b,
                        extend_lens=[e] * b)
    eligible, why = ctx["plain_gate"].can_replay(batch)
    replay, reason = ctx["gate"].can_replay(batch)
    graph_ms = row["graph_timing"]["us"] / 1e3
    eager_ms = row["eager_timing"]["us"] / 1e3
    # A batch today's rules keep eager runs eagerly under every policy.
    always_graph_ms = graph_ms if eligible else eager_ms
    gate_ms = graph_ms if replay else eager_ms
    best_ms = min(always_graph_ms, eager_ms)
    profile: CostProfile = ctx["profile"]
    shape = PrefillShape.uniform(b, p, e, ctx["heads"])
    cmp = profile.compare(shape, graph_tokens=row["padded_tokens"])
    layers = len(ctx["layers"])
    row.update(
        graph_ms=graph_ms, eager_ms=eager_ms, eligible=eligible,
        eligible_reason=str(why), best="graph" if always_graph_ms < eager_ms else "eager",
        best_ms=best_ms, gate_choice="graph" if replay else "eager", gate_reason=str(reason),
        gate_ms=gate_ms, ratio_to_best=gate_ms / best_ms,
        predicted={"graph_ms": cmp.graph_us * layers / 1e3,
                   "eager_ms": cmp.eager_us * layers / 1e3,
                   "profile_backend": profile.backend})


def _summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "gate_ms" in r]
    if not done:
        return {"classes": 0}
    total = {k: sum(r[k] for r in done) for k in ("gate_ms", "best_ms", "eager_ms")}
    total["always_graph_ms"] = sum(r["graph_ms"] if r["eligible"] else r["eager_ms"]
                                   for r in done)
    worse = max(total["always_graph_ms"], total["eager_ms"])
    better = min(total["always_graph_ms"], total["eager_ms"])
    worst_class = max(done, key=lambda r: r["ratio_to_best"])
    out = {
        "classes": len(done),
        "total_ms": {"cost_aware": total["gate_ms"], "always_graph": total["always_graph_ms"],
                     "always_eager": total["eager_ms"], "per_class_best": total["best_ms"]},
        "speedup_over_worse_fixed": worse / total["gate_ms"],
        "speedup_over_better_fixed": better / total["gate_ms"],
        "ratio_to_per_class_best": total["gate_ms"] / total["best_ms"],
        "max_class_ratio_to_best": worst_class["ratio_to_best"],
        "worst_class": {k: worst_class[k] for k in ("batch_size", "prefix", "extend")},
        "all_outputs_agree": all(r["agree"] for r in done),
    }
    out["targets"] = {
        "max_class_ratio_to_best": TARGET_RATIO_TO_BEST,
        "min_speedup_over_worse_fixed": TARGET_SPEEDUP_OVER_WORSE,
        "met": (out["max_class_ratio_to_best"] <= TARGET_RATIO_TO_BEST
                and out["speedup_over_worse_fixed"] >= TARGET_SPEEDUP_OVER_WORSE),
    }
    return out


def _environment(torch: Any, cuda: bool) -> dict[str, Any]:
    from attnreg import __version__
    from attnreg.registry.spec import installed_version

    return {"attnreg": __version__, "torch": torch.__version__,
            "cuda": getattr(torch.version, "cuda", None),
            "triton": installed_version("triton"),
            "flashinfer-python": installed_version("flashinfer-python"),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "python": sys.version.split()[0],
            # what the renderer shows as the command: the argv this run was given
            "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _build_gate(profile: CostProfile, backend: str, heads: int, dry_run: bool,
                buckets: tuple[int, ...]) -> tuple[ReplayGate, ReplayGate, CostProfile]:
    facts = ModelFacts(attention="mla", kv_dtype="bf16", num_heads=heads, label="bench-mla")
    config = GraphConfig(prefill_num_tokens=buckets)
    if dry_run:
        # No breakable graphs on a CPU: decide as a simulated sm90 triton plan would, with
        # the dry-run profile relabelled to match it (its numbers are meaningless anyway).
        data = profile.to_dict()
        data.update(backend="triton", platform="cuda:sm90")
        profile = CostProfile.from_dict(data, source=f"{profile.source} (relabelled, dry run)")
        plan = resolve("cuda:sm90", facts, "triton", config, assume_installed=True)
    else:
        plan = resolve(Platform.detect(), facts, backend, config)
    return ReplayGate(plan, cost_profile=profile), ReplayGate(plan), profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="cost profile JSON")
    parser.add_argument("--out", required=True, help="where to write the results JSON")
    parser.add_argument("--backend", default=None,
                        help="registry backend (default: the profile's backend)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=None,
                        help="attention heads (default: 128; 4 in a dry run)")
    parser.add_argument("--rep-ms", type=float, default=300.0,
                        help="time each step about this long (at least 2 steps)")
    parser.add_argument("--time-budget-s", type=float, default=110.0,
                        help="classes that would start later are recorded as skipped")
    parser.add_argument("--mix", type=_mix, default=None, metavar="B:P:E,...",
                        help="batch classes to run instead of the default mix (requests : "
                             "prefix : extend per request), e.g. 1:0:64,4:4096:512")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, reference backend: checks the script only")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import torch

    from attnreg.backends.base import MLAConfig
    from attnreg.registry import get_registry

    profile = load_profile(args.profile)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("cost_gate: no CUDA device; pass --dry-run to check the script on a CPU",
              file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    shape = LayerShape() if cuda else DRY_LAYER
    heads = args.heads or (128 if cuda else 4)
    layers_n = args.layers if cuda else min(args.layers, 2)
    mix = args.mix or (MIX if cuda else DRY_MIX)
    buckets = GraphConfig().prefill_num_tokens if cuda else DRY_BUCKETS
    backend_name = args.backend or (profile.backend if cuda else "reference")
    gate, plain_gate, gate_profile = _build_gate(profile, backend_name, heads, args.dry_run,
                                                 buckets)
    max_seq = max(p + e for _, p, e in mix)
    config = MLAConfig(num_heads=heads, page_size=1, device=device, max_context_len=max_seq)
    backend = get_registry().create(backend_name, config,
                                    platform=None if cuda else "cpu")
    layers = [MLALayer(torch, shape, heads, device, seed=i, max_positions=max_seq + 1)
              for i in range(layers_n)]
    ctx = {"torch": torch, "backend": backend, "layers": layers, "cuda": cuda,
           "device": device, "shape": shape, "buckets": tuple(buckets), "heads": heads,
           "timer": StepTimer(torch, cuda, args.rep_ms), "gate": gate,
           "plain_gate": plain_gate, "profile": gate_profile}
    doc: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": 1, "dry_run": args.dry_run,
        "meta": _environment(torch, cuda),
        "setup": {"backend": backend_name, "layers": layers_n, "heads": heads,
                  "layer_shape": dataclasses.asdict(shape),
                  "buckets": list(buckets), "page_size": 1,
                  "mix": [list(m) for m in mix],
                  "graph": "breakable, absorbed MLA, captured per class at its token bucket",
                  "eager": "MHA companion: KV write, kv_b_proj decompression, ragged MHA"},
        "profile": {"source": profile.source, "label": profile.label,
                    "gate_note": gate.cost_model_note, "gate_uses_cost_model":
                    gate.uses_cost_model},
        "classes": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i, (b, p, e) in enumerate(mix):
        if time.perf_counter() - started > args.time_budget_s:
            doc["classes"].append({"batch_size": b, "prefix": p, "extend": e,
                                   "skipped": "time budget used up"})
            continue
        try:
            row = _run_class(ctx, b, p, e, seed=1000 + i)
            _decide(ctx, row)
            print(f"[{time.perf_counter() - started:6.1f}s] B={b} prefix={p} extend={e}: "
                  f"graph {row['graph_ms']:.2f} ms, eager {row['eager_ms']:.2f} ms "
                  f"(predicted {row['predicted']['graph_ms']:.2f} / "
                  f"{row['predicted']['eager_ms']:.2f}), gate -> {row['gate_choice']} "
                  f"({row['ratio_to_best']:.3f}x best), outputs "
                  f"{'agree' if row['agree'] else 'DISAGREE'}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - one class must not lose the others
            row = {"batch_size": b, "prefix": p, "extend": e,
                   "error": f"{type(exc).__name__}: {exc}"}
            print(f"B={b} prefix={p} extend={e}: {row['error']}", file=sys.stderr)
            if cuda:
                torch.cuda.empty_cache()
        doc["classes"].append(row)
        doc["summary"] = _summarize(doc["classes"])
        doc["wall_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    doc["summary"] = _summarize(doc["classes"])
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    s = doc["summary"]
    if s.get("classes"):
        t = s["total_ms"]
        print(f"mix of {s['classes']} classes: cost-aware {t['cost_aware']:.1f} ms, always "
              f"graph {t['always_graph']:.1f} ms, always eager {t['always_eager']:.1f} ms, "
              f"per-class best {t['per_class_best']:.1f} ms; "
              f"{s['speedup_over_worse_fixed']:.2f}x over the worse fixed policy, worst class "
              f"{s['max_class_ratio_to_best']:.3f}x its best; targets "
              f"{'met' if s['targets']['met'] else 'NOT met'}"
              + (" (DRY RUN: not a measurement)" if args.dry_run else ""))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
