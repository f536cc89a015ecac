#!/usr/bin/env python3
"""Cost-aware prefill replay against the two fixed policies (issue 10).

A mix of prefill batch classes (extend 64..8192 tokens, prefix 0..32k) runs
through an 8-layer DeepSeek-V3-shaped MLA stack (random bf16 weights, real
projection shapes, the backend's attention) two ways:

* **graph**: absorbed MLA, the whole stack captured once per class in a
  BREAKABLE CUDA graph (:class:`attnreg.runtime.GraphRunner`) at the class's
  token bucket and replayed
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

``--dry-run`` runs on the CPU with tiny shapes and the reference backend, whose
graph path is emulated eagerly (it declares no prefill graph); with ``--backend
triton`` (Triton interpreter) the graph path goes through
:class:`attnreg.runtime.GraphRunner`, which on a CPU runs the captured function
once and re-runs it at each replay.  It checks the script; its times mean
nothing.  Timing: CUDA events around each step, L2 flushed before each, median
of repeated steps (at least 2).
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
if __package__ in (None, ""):  # run as a script: the renderer helpers are benchmarks'
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnreg.graph_policy import GraphConfig, ModelFacts, ReplayBatch, ReplayGate, resolve
from attnreg.graph_policy.cost_profile import CostProfile, PrefillShape, load_profile
from attnreg.graph_policy.replay import smallest_bucket
from attnreg.profiling import (
    DRY_LAYER,
    Clock,
    LayerShape,
    MLALayer,
    kv_slots_of,
    library_versions,
    random_pool,
    rel_error,
)
from attnreg.registry import ForwardMode, GraphMode, Phase, Platform
from benchmarks._harness import error_text
from benchmarks._report import (
    SETUP_COMMAND,
    Page,
    ResultsFile,
    bar_groups,
    fmt,
    k_tokens,
    md_table,
    rel,
)
from benchmarks.metrics import Check, evaluate

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


def _mix(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        classes = tuple(tuple(int(v) for v in c.split(":")) for c in text.split(",") if c)
    except ValueError:
        classes = ()
    if not classes or any(len(c) != 3 or c[0] < 1 or c[1] < 0 or c[2] < 1 for c in classes):
        raise argparse.ArgumentTypeError(f"expected B:P:E,... (B, E >= 1, P >= 0), got {text!r}")
    return classes  # type: ignore[return-value]


def _run_class(ctx: dict[str, Any], batch_size: int, prefix: int, extend: int,
               seed: int) -> dict[str, Any]:
    from attnreg.runtime import GraphSession, extend_batch

    torch, backend, layers = ctx["torch"], ctx["backend"], ctx["layers"]
    cuda, dev, hidden = ctx["cuda"], ctx["device"], ctx["shape"].hidden
    seq_lens = [prefix + extend] * batch_size
    tokens = batch_size * extend
    padded = smallest_bucket(tokens, ctx["buckets"]) or tokens
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
    session: GraphSession | None = None
    if cuda or _captures_prefill(backend):
        x_static = torch.zeros(padded, hidden, dtype=torch.bfloat16, device=dev)
        pos_static = torch.zeros(padded, dtype=torch.long, device=dev)
        x_static[:tokens].copy_(x)
        pos_static[:tokens].copy_(positions)

        def absorbed_stack() -> Any:
            h = x_static
            for layer, pool in zip(layers, pools):
                h = layer.forward_absorbed(h, pos_static, backend, pool, None)
            return h

        out_static: list[Any] = []

        def capture_stack(_: Any) -> None:
            out_static[:] = [absorbed_stack()]

        # one token bucket of the graph session, the model's layers as its step (their
        # own static input x_static); the warm-up run on a side stream compiles the kernels
        # outside the capture; on a cpu no device graph is recorded (capture runs once,
        # replay re-runs)
        session = GraphSession(backend, pools[0], phase="prefill", mode="breakable",
                               buckets=[padded], max_requests=batch_size,
                               max_seq_len=max(seq_lens), step=capture_stack,
                               static_inputs=False)
        session.capture(batches={padded: batch})

        def graph_step() -> Any:
            x_static[:tokens].copy_(x)
            pos_static[:tokens].copy_(positions)
            assert session is not None
            session.replay(batch, bucket=padded)
            return out_static[0][:tokens]

        row["graph"] = ("cuda graph (breakable, absorbed MLA pinned)"
                        if session.runner.device_graphs
                        else "GraphSession without device graphs (cpu dry run: replay re-runs "
                             "the capture-mode path)")
    else:
        def graph_step() -> Any:
            h = x
            for layer, pool in zip(layers, pools):
                h = layer.forward_absorbed(h, positions, backend, pool, batch)
            return h

        row["graph"] = "emulated eagerly (cpu dry run)"
    out_graph = graph_step()
    diff = rel_error(torch, out_graph - x, out_eager - x)
    # JSON has no infinity: a non-finite output is recorded as null (and disagrees).
    row.update(rel_diff_graph_vs_eager=diff if math.isfinite(diff) else None,
               agree=diff <= MAX_REL_DIFF)
    del out_eager, out_graph
    row["graph_timing"] = ctx["clock"].step(graph_step, rep_ms=ctx["rep_ms"])
    row["eager_timing"] = ctx["clock"].step(eager_step, rep_ms=ctx["rep_ms"])
    if session is not None:
        del session
        backend.graph_state = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def _captures_prefill(backend: Any) -> bool:
    """Whether the backend declares a BREAKABLE prefill graph (the reference one does not)."""
    support = backend.capabilities.graph_support(Phase.PREFILL, GraphMode.BREAKABLE)
    return not support.capture.is_unsupported


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
    return {**library_versions(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
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

    from attnreg.registry import get_registry
    from attnreg.runtime import MLAConfig

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
           "clock": Clock(torch, device), "rep_ms": args.rep_ms, "gate": gate,
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
                   "error": error_text(exc)}
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



# ----------------------------------------------------------------------------------------
# Rendering (python -m benchmarks.render: results/cost-gate/*.json)
# ----------------------------------------------------------------------------------------

TITLE = "Cost-aware prefill replay (issue 10)"
#: The targets of issue 10, for result files that do not carry their own.
TARGETS = {"max_class_ratio_to_best": TARGET_RATIO_TO_BEST,
           "min_speedup_over_worse_fixed": TARGET_SPEEDUP_OVER_WORSE}
COMMAND = (f"{SETUP_COMMAND} && python3 benchmarks/cost_gate.py --profile "
           "src/attnreg/data/profiles/h200-BACKEND.json --out $OUT/cost-gate/h200-BACKEND.json")
RESULTS = ("cost-gate", "*.json")


def read(path: Path) -> dict[str, Any]:
    """A results file of this script (``ValueError`` for anything else)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, expected {SCHEMA!r} "
                         "(written by benchmarks/cost_gate.py)")
    return dict(doc)


def where(doc: dict[str, Any]) -> str:
    return str(doc.get("meta", {}).get("device", "?"))


def _gate_backend(doc: dict[str, Any]) -> str:
    return str(doc.get("setup", {}).get("backend", "?"))


def _gate_targets(doc: dict[str, Any]) -> dict[str, float]:
    recorded = doc.get("summary", {}).get("targets", {})
    return {k: recorded.get(k, v) for k, v in TARGETS.items()}


def checks(doc: dict[str, Any]) -> list[Check]:
    """Issue 10's two targets for one results file."""
    backend = _gate_backend(doc)
    s = doc.get("summary", {})
    targets = _gate_targets(doc)
    n_done, n_all = s.get("classes", 0), len(doc.get("classes", []))
    worst = s.get("worst_class") or {}
    worst_at = (f"B={worst.get('batch_size')}, prefix {worst.get('prefix')}, extend "
                f"{worst.get('extend')}; " if worst else "")
    totals = s.get("total_ms", {})
    worse = max(("always_graph", "always_eager"), key=lambda k: totals.get(k, 0.0))
    mix = (f"{worse.replace('_', ' ')} {totals[worse]:.1f} ms vs cost-aware "
           f"{totals['cost_aware']:.1f} ms" if totals else "")
    return [
        evaluate(f"cost gate {backend}: classes", "cost-aware / per-class best, worst batch class",
                 s.get("max_class_ratio_to_best"), "ratio", "<=",
                 target=targets["max_class_ratio_to_best"],
                 detail=f"{worst_at}{n_done} of {n_all} classes measured"),
        evaluate(f"cost gate {backend}: mix", "worse fixed policy / cost-aware, total over the mix",
                 s.get("speedup_over_worse_fixed"), "ratio", ">=",
                 target=targets["min_speedup_over_worse_fixed"], detail=mix),
    ]


def _gate_provenance(f: ResultsFile, root: Path) -> str:
    m = f.doc.get("meta", {})
    versions = ", ".join(f"{k} {m[k]}" for k in ("torch", "triton", "flashinfer-python")
                         if m.get(k))
    cuda = f", CUDA {m['cuda']}" if m.get("cuda") else ""
    source = f.doc.get("profile", {}).get("source", "PROFILE.json")
    recorded = f.doc.get("command") or m.get("command")
    command = recorded or (
        f"python3 benchmarks/cost_gate.py --profile {source} --out {rel(f.path, root)}")
    how = "" if recorded else \
        " (rebuilt from the file's profile source: cost_gate.py does not record its command)"
    return (f"*Measured* {m.get('date', '?')} on {m.get('device', '?')}; {versions}{cuda}, "
            f"python {m.get('python', '?')}, attnreg {m.get('attnreg', '?')}.  \n"
            f"*Command:* `{command}`{how}; took {fmt(f.doc.get('wall_s'), '.0f')} s; data: "
            f"`{rel(f.path, root)}`.")


def _gate_row(r: dict[str, Any], target: float) -> list[str]:
    head = [str(r.get("batch_size")), str(r.get("prefix")), str(r.get("extend"))]
    if "gate_ms" not in r:
        why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + \
            str(r.get("error", "?"))
        return head + ["-", why[:100]] + [""] * 4
    graph, eager = f"{r['graph_ms']:.2f}", f"{r['eager_ms']:.2f}"
    if r["best"] == "graph":
        graph = f"**{graph}**"
    else:
        eager = f"**{eager}**"
    if not r.get("eligible", True):  # always-graph runs this class eagerly too
        graph += " (not eligible)"
    pred = r.get("predicted", {})
    ratio = f"{r['ratio_to_best']:.3f}x"
    if r["ratio_to_best"] > target:
        ratio = f"**{ratio}**"
    if not r.get("agree", True):
        ratio += f" **outputs disagree (rel.diff {fmt(r.get('rel_diff_graph_vs_eager'))})**"
    return head + [f"{r.get('tokens')} ({r.get('padded_tokens')})", graph, eager,
                   f"{fmt(pred.get('graph_ms'), '.2f')} / {fmt(pred.get('eager_ms'), '.2f')}",
                   r["gate_choice"], ratio]


def _gate_totals(s: dict[str, Any]) -> list[str]:
    t = s.get("total_ms")
    if not t:
        return ["No class was measured: no totals."]
    best = t["per_class_best"]
    worse = max(("always graph", "always_graph"), ("always eager", "always_eager"),
                key=lambda nk: t[nk[1]])[0]
    rows = [[name, f"{t[key]:.1f}", f"{t[key] / best:.3f}x"]
            for name, key in (("cost-aware (the gate)", "cost_aware"),
                              ("always graph (absorbed, replayed)", "always_graph"),
                              ("always eager (MHA)", "always_eager"),
                              ("per-class best", "per_class_best"))]
    return [md_table(["policy over the mix (each class once)", "total ms", "/ per-class best"],
                     rows), "",
            (f"Cost-aware is **{s['speedup_over_worse_fixed']:.2f}x** faster than the worse "
             f"fixed policy ({worse}) and {s['speedup_over_better_fixed']:.2f}x faster than the better "
             "one.")]


def _gate_table(f: ResultsFile, page: Page) -> list[str]:
    doc = f.doc
    target = _gate_targets(doc)["max_class_ratio_to_best"]
    header = ["requests", "prefix", "extend", "tokens (graph bucket)", "graph ms", "eager ms",
              "predicted graph / eager ms", "gate's choice", "gate / best"]
    rows = [_gate_row(r, target) for r in doc.get("classes", [])]
    prof = doc.get("profile", {})
    done = [r for r in doc.get("classes", []) if "gate_ms" in r]
    diffs = [r["rel_diff_graph_vs_eager"] for r in done
             if r.get("rel_diff_graph_vs_eager") is not None]
    agree = ("the graph and eager outputs agree on every measured class (cost_gate.py's "
             f"tolerance; largest relative difference {max(diffs):.1e})"
             if done and all(r.get("agree") for r in done) and diffs else
             "**the graph and eager outputs disagree on some class** (see the table)"
             if done else "")
    out = [f"### `{_gate_backend(f.doc)}`", "", _gate_provenance(f, page.root), "",
           (f"Profile: {prof.get('label', '?')} (`{prof.get('source', '?')}`); the gate "
            f"{'uses' if prof.get('gate_uses_cost_model') else '**does not use**'} the cost "
            f"model.  Bold: the faster of graph and eager.  Predicted: the profile's per-layer "
            f"terms x {doc.get('setup', {}).get('layers', '?')} layers.{'  ' if agree else ''}"
            f"{agree[:1].upper() + agree[1:]}{'.' if agree else ''}"), "",
           md_table(header, rows), ""]
    out += _gate_totals(doc.get("summary", {})) + [""]
    return out + page.check_lines([c.to_dict() for c in checks(doc)], doc) + [""]


def _plot(files: list[ResultsFile], page: Page) -> list[str]:
    plotted = [f for f in files if any("gate_ms" in r for r in f.doc.get("classes", []))]
    if not page.plot.available or not plotted:
        return []
    fig, axes = page.plot.plt.subplots(len(plotted), 1, figsize=(13, 3.8 * len(plotted)),
                                  squeeze=False)
    for ax, f in zip(axes[:, 0], plotted):
        rows = [r for r in f.doc["classes"] if "gate_ms" in r]
        groups = [f"B={r['batch_size']}\nP={k_tokens(r['prefix'])}\nE={k_tokens(r['extend'])}"
                  for r in rows]
        series = {
            "cost-aware": [r["gate_ms"] / r["best_ms"] for r in rows],
            "always graph": [(r["graph_ms"] if r["eligible"] else r["eager_ms"]) / r["best_ms"]
                             for r in rows],
            "always eager": [r["eager_ms"] / r["best_ms"] for r in rows]}
        bar_groups(ax, groups, series, "time / per-class best (log)", log=True)
        target = _gate_targets(f.doc)["max_class_ratio_to_best"]
        ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"target {target:.2f}x")
        for i, ratio in enumerate(series["cost-aware"]):
            if ratio > 1.0005:  # the gate missed the best path here: say by how much
                ax.text(i - 0.27, ratio, f"{ratio:.3f}", ha="center", va="bottom", fontsize=7)
        _ratio_axis(ax, max(max(v) for v in series.values()))
        ax.legend(fontsize=8, loc="upper left", ncol=4)
        t = f.doc.get("summary", {}).get("total_ms", {})
        totals = (f" (mix: cost-aware {t['cost_aware']:.0f} ms, always graph "
                  f"{t['always_graph']:.0f} ms, always eager {t['always_eager']:.0f} ms)"
                  if t else "")
        ax.set_title(f"{_gate_backend(f.doc)}: prefill step time per batch class{totals}",
                     fontsize=10)
    return page.image(fig, "cost_gate.png",
                      "Cost-aware prefill replay: time per class / per-class best")[1:] + [""]


def _ratio_axis(ax: Any, top: float) -> None:
    """Plain 1x, 1.5x, 2x ... ticks on a log axis, with room above for the legend."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = [t for t in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if t <= top * 1.05]
    ax.set_ylim(0.9, top * 1.6)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:g}x" for t in ticks])


def render(files: list[ResultsFile], page: Page) -> list[str]:
    """The issue-10 section: one table per results file, the checks, one plot."""
    lines = [f"## {TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{COMMAND}` once per backend and "
                        "bring back each JSON as "
                        "`benchmarks/results/cost-gate/h200-BACKEND.json`.", ""]
    setup = files[0].doc.get("setup", {})
    shape = setup.get("layer_shape", {})
    targets = _gate_targets(files[0].doc)
    timing = next((r["graph_timing"].get("method") for f in files
                   for r in f.doc.get("classes", []) if r.get("graph_timing")), "?")
    lines += [
        (f"A mix of {len(setup.get('mix', []))} prefill batch classes (requests, prefix and "
         f"extend tokens per request) runs through a DeepSeek-shaped MLA stack of "
         f"{setup.get('layers')} layers (hidden {shape.get('hidden')}, q_lora {shape.get('q_lora')}, "
         f"kv_lora {shape.get('kv_lora')}, rope {shape.get('rope')}, nope {shape.get('nope')}, "
         f"v {shape.get('v_dim')}, {setup.get('heads')} heads, bf16 random weights, page size "
         f"{setup.get('page_size')}) two ways: **graph** = {setup.get('graph')} (metadata, "
         f"input copies and replay timed together; token buckets {setup.get('buckets')}); "
         f"**eager** = {setup.get('eager')}.  The cost-aware policy is `ReplayGate` with the "
         "backend's cost profile; always graph replays whatever today's rules allow; always "
         f"eager never replays.  Timing: {timing}.  Targets (issue 10): cost-aware within "
         f"{targets['max_class_ratio_to_best']:.2f}x of the per-class best on every class, and "
         f"at least {targets['min_speedup_over_worse_fixed']:.1f}x faster than the worse fixed "
         "policy over the mix."), ""]
    for f in files:
        lines += _gate_table(f, page)
    return lines + _plot(files, page)


if __name__ == "__main__":
    sys.exit(main())
