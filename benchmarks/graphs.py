"""P4: what CUDA graphs buy.

One decode step of an 8-layer DeepSeek-shaped MLA stack
(:class:`attnreg.profiling.MLALayer`: real projection shapes, random weights,
attention blocks only, no MoE / MLP), eager (metadata planned each step, as an
engine does) against CUDA graph replay through :class:`attnreg.runtime.GraphSession`
(gate, ``init_forward_metadata_replay``, replay), per backend, at B in {1, 8, 64}.  The step's memory floor (weights + KV over the
copy bandwidth) bounds what a graph can reach.

The eager step is bound by how fast the host issues launches and moves up to
2x between runs of the same code, so the page states P4 as the median over
every run it has (``benchmarks/results/repeats/``), with min and max beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from attnreg.profiling import LayerShape, MLALayer, random_pool, rel_error

from ._backends import PREFILL_VARIANTS, available_variants, create_backend, declared_reasons
from ._harness import RunContext, SkipSection, error_text
from ._report import (
    REPEATS_COMMAND,
    REPEATS_DIR,
    Page,
    bar_groups,
    fmt,
    md_table,
    not_run_notes,
    rel,
    runs_table,
)
from .ceilings import copy_gbps
from .metrics import Check, median_of_runs

P4_BATCHES = (1, 8, 64)
P4_DRY_BATCHES = (1, 2)
P4_SEQ_LEN = 2048
P4_DRY_SEQ_LEN = 48
#: DeepSeek-V3's attention block: 128 heads, 8 layers per step.
P4_SHAPE, P4_HEADS, P4_LAYERS = LayerShape(), 128, 8
P4_DRY_SHAPE, P4_DRY_HEADS, P4_DRY_LAYERS = LayerShape(hidden=256, q_lora=128), 16, 2


def run_p4(ctx: RunContext, data: dict[str, Any]) -> None:
    from attnreg.runtime import MLAConfig, decode_batch

    torch = ctx.torch
    variants, skipped = available_variants(ctx, PREFILL_VARIANTS)
    variants = [v for v in variants if v.backend != "reference"]
    if not variants:
        raise SkipSection(f"no backend that captures decode can run here: {skipped}")
    shape: LayerShape = ctx.pick(P4_SHAPE, P4_SHAPE, P4_DRY_SHAPE)
    heads = ctx.pick(P4_HEADS, P4_HEADS, P4_DRY_HEADS)
    n_layers = ctx.pick(P4_LAYERS, P4_LAYERS, P4_DRY_LAYERS)
    batches = ctx.pick(P4_BATCHES, P4_BATCHES, P4_DRY_BATCHES)
    seq_len = ctx.pick(P4_SEQ_LEN, P4_SEQ_LEN, P4_DRY_SEQ_LEN)
    copy = copy_gbps(ctx)
    max_b = max(batches)
    cfg = MLAConfig(num_heads=heads, page_size=1, device=ctx.device, max_context_len=seq_len)
    layers = [MLALayer(torch, shape, heads, ctx.device, seed=i, max_positions=seq_len + 1)
              for i in range(n_layers)]
    weight_bytes = n_layers * shape.weight_bytes(heads)
    pools = [random_pool(ctx.torch, cfg, max_b * seq_len, seed=100 + i)
             for i in range(n_layers)]
    pages = pools[0].allocate([seq_len] * max_b, shuffle=7)
    batches_by_b = {b: decode_batch(pools[0], [seq_len] * b, pages=pages[:b]) for b in batches}
    data.update(shape={**asdict(shape), "layers": n_layers, "heads": heads}, seq_len=seq_len,
                batches=list(batches), weight_bytes=weight_bytes, copy_GBps=copy,
                variants=[v.label for v in variants], skipped_variants=skipped, rows=[],
                timing="one GraphSession step incl. metadata (eager: "
                       "init_forward_metadata + the layers; graph: GraphSession.run = gate, "
                       "init_forward_metadata_replay, replay), L2 flushed")
    for v in variants:
        if ctx.out_of_time():
            data["rows"].append({"variant": v.label, "skipped": "time budget used up"})
            continue
        reasons = declared_reasons(ctx, v, "mla", "decode", heads=heads, head_dims=(576, 512))
        if reasons:
            data["rows"].append({"variant": v.label, "not_declared": "; ".join(reasons)})
            continue
        try:
            be = create_backend(ctx, v, num_heads=heads, page_size=1, max_context_len=seq_len)
            session, model = _p4_session(ctx, layers, be, pools, batches, seq_len)
        except Exception as exc:  # noqa: BLE001
            data["rows"].append({"variant": v.label, "error": error_text(exc)})
            continue
        for b in batches:
            row = {"variant": v.label, "B": b}
            try:
                row.update(_p4_point(ctx, session, model, batches_by_b[b], b))
                kv_bytes = n_layers * b * seq_len * 576 * 2
                row["floor_bytes"] = weight_bytes + kv_bytes
                if copy:
                    row["floor_us"] = row["floor_bytes"] / (copy * 1e3)
            except Exception as exc:  # noqa: BLE001
                row["error"] = error_text(exc)
            data["rows"].append(row)
            ctx.log(f"P4 {v.label} B={b}: " + (
                f"eager {row['eager_us']:.0f} us, graph {row['graph_us']:.0f} us, "
                f"{row['speedup']:.2f}x" if "speedup" in row else row.get("error", "?")))
            ctx.save()
    data["checks"] = [c.to_dict() for c in p4_checks(data)]


def decode_step(layers: list[MLALayer], x: Any, positions: Any, backend: Any, pools: list[Any],
                batch: Any) -> Any:
    """One decode step through every layer (``batch`` None under capture): ``[B, hidden]``."""
    rope = layers[0].rope_at(positions)  # the same tables in every layer: looked up once
    for layer, pool in zip(layers, pools):
        x = layer.forward_decode(x, rope, backend, pool, batch)
    return x


class _P4Step:
    """The step of the P4 session: every layer over static hidden states, one set per B."""

    def __init__(self, ctx: RunContext, layers: list[MLALayer], pools: list[Any],
                 batches: Any) -> None:
        torch = ctx.torch
        self.layers, self.pools = layers, pools
        hidden = layers[0].shape.hidden
        self.x = {b: torch.randn(b, hidden, dtype=torch.bfloat16, device=ctx.device)
                  for b in batches}
        self.positions = {b: torch.zeros(b, dtype=torch.long, device=ctx.device)
                          for b in batches}
        self.out = {b: torch.empty_like(x) for b, x in self.x.items()}

    def __call__(self, step: Any) -> None:
        # in a graph: the bucket's statics; eager: those of the batch's size
        b = step.bucket if step.bucket is not None else step.batch.batch_size
        self.out[b].copy_(decode_step(self.layers, self.x[b], self.positions[b],
                                      step.session.backend, self.pools, step.batch))


def _p4_session(ctx: RunContext, layers: list[MLALayer], be: Any, pools: list[Any],
                batches: Any, seq_len: int) -> tuple[Any, _P4Step]:
    """The backend's decode graph session: a bucket per B, the model step as its step."""
    from attnreg.runtime import GraphSession

    model = _P4Step(ctx, layers, pools, batches)
    session = GraphSession(be, pools[0], phase="decode", mode="full", buckets=batches,
                           max_seq_len=seq_len, step=model, static_inputs=False)
    session.capture()
    return session, model


def _p4_point(ctx: RunContext, session: Any, model: _P4Step, batch: Any, b: int
              ) -> dict[str, Any]:
    torch = ctx.torch
    model.positions[b].copy_((batch.seq_lens - 1).long())

    def eager_step() -> Any:
        session.eager(batch)
        return model.out[b]

    eager_out = eager_step().clone()
    ctx.sync()

    def graph_step() -> None:
        session.run(batch)

    model.out[b].fill_(float("nan"))
    graph_step()
    ctx.sync()
    err = rel_error(ctx.torch, model.out[b], eager_out.float())
    eager = ctx.time(eager_step)
    replay = ctx.time(graph_step)
    return {"eager_us": eager["median_us"], "graph_us": replay["median_us"],
            "eager_timing": eager, "graph_timing": replay,
            "speedup": eager["median_us"] / replay["median_us"],
            "graph_vs_eager_rel_err": err, "finite": bool(torch.isfinite(eager_out).all()),
            "replayed": session.counts.replays > 0}


def _b1(data: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The B=1 row of one backend, if it was timed."""
    return next((r for r in data.get("rows", []) if r.get("variant") == label
                 and r.get("B") == 1 and r.get("speedup")), None)


def p4_checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """Eager / graph step time at B=1 per backend; over several runs, their median."""
    runs = runs or [data]
    checks = []
    for label in data.get("variants", []):
        if any(r.get("variant") == label and r.get("not_declared") for r in data.get("rows", [])):
            continue  # the declaration says it has no decode here: no figure is owed
        values = [row["speedup"] for d in runs if (row := _b1(d, label))]
        what = f"{label}: eager / graph step time at B=1"
        checks.append(median_of_runs(f"P4 {label}", what + (", median of the runs"
                                                            if len(runs) > 1 else ""),
                                     values, "x", ">=", target=3.0))
    return checks


# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def _over_runs(data: dict[str, Any], page: Page) -> list[dict[str, Any]]:
    """P4's rows, each timed row with the median of every run's same row.

    The eager step moves up to 2x from run to run (host-bound), so with
    several runs the table states medians (``runs``: the speedups of the row
    in each run), never the chosen file's single run.
    """
    runs = [d for _, d in page.runs.get("P4", [])]
    if len(runs) < 2:
        return list(data.get("rows", []))
    timed: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for d in runs:
        for r in d.get("rows", []):
            if "eager_us" in r:
                timed.setdefault((r["variant"], r["B"]), []).append(r)
    out = []
    for r in data.get("rows", []):
        same = timed.get((r.get("variant"), r.get("B")), [])
        if "eager_us" not in r or len(same) < 2:
            out.append(r)
            continue
        out.append({**r, **{k: statistics.median(x[k] for x in same)
                            for k in ("eager_us", "graph_us", "speedup")},
                    "runs": [x["speedup"] for x in same]})
    return out


def render_p4(data: dict[str, Any], page: Page) -> list[str]:
    shape = data.get("shape", {})
    table = _over_runs(data, page)
    several = any(r.get("runs") for r in table)
    header = ["backend", "B", "eager us", "graph us",
              "eager / graph" + (" (min – max)" if several else ""), "memory floor us",
              "graph / floor", "graph vs eager rel.err"]
    rows = []
    for r in table:
        if "eager_us" not in r:
            why = r.get("error") or r.get("skipped") or (
                "not declared: " + r["not_declared"] if r.get("not_declared") else "-")
            rows.append([r.get("variant", "?"), str(r.get("B", "-")), why, "", "", "", "", ""])
            continue
        floor = r.get("floor_us")
        spread = f" ({min(r['runs']):.2f} – {max(r['runs']):.2f}x)" if r.get("runs") else ""
        rows.append([r["variant"], str(r["B"]), f"{r['eager_us']:.0f}", f"{r['graph_us']:.0f}",
                     f"**{r['speedup']:.2f}x**{spread}", fmt(floor, ".0f"),
                     fmt(floor and r["graph_us"] / floor, ".2f"),
                     f"{r['graph_vs_eager_rel_err']:.1e}"])
    runs_note = (f"  Times and ratios are medians over the {len(page.runs.get('P4', []))} runs "
                 "listed below (min – max of the ratio beside it); memory floor and rel.err "
                 "are this file's." if several else "")
    out = [(f"{shape.get('layers')} layers, hidden {shape.get('hidden')}, q_lora "
           f"{shape.get('q_lora')}, kv_lora {shape.get('kv_lora')}, rope {shape.get('rope')}, "
           f"nope {shape.get('nope')}, v {shape.get('v_dim')}, {shape.get('heads')} heads, "
           f"bf16 random weights ({(data.get('weight_bytes') or 0) / 1e9:.2f} GB), KV length "
           f"{data.get('seq_len')}; attention blocks only (no MoE/MLP).  {data.get('timing')}.  "
           f"Memory floor: weights + KV read once at the copy bandwidth.{runs_note}"), "",
           md_table(header, rows)] + not_run_notes(data, {})
    if page.plot.available and data.get("rows"):
        ok = [r for r in table if "eager_us" in r]
        groups = [f"{r['variant']}\nB={r['B']}" for r in ok]
        series = {"eager": [r["eager_us"] / 1e3 for r in ok],
                  "CUDA graph": [r["graph_us"] / 1e3 for r in ok]}
        fig, ax = page.plot.plt.subplots(figsize=(max(6, 1.3 * len(ok)), 4))
        bar_groups(ax, groups, series, "ms per decode step")
        floors = [r.get("floor_us") for r in ok]
        if any(floors):
            ax.scatter(range(len(ok)), [(f or 0) / 1e3 for f in floors], marker="_", s=600,
                       color="k", label="memory floor", zorder=3)
            ax.legend(fontsize=8)
        for i, r in enumerate(ok):
            ax.text(i, r["eager_us"] / 1e3, f"{r['speedup']:.1f}x", ha="center", va="bottom",
                    fontsize=8)
        ax.set_ylim(0, max(r["eager_us"] for r in ok) / 1e3 * 1.25)
        ax.legend(fontsize=8, loc="upper left", ncol=3)
        ax.set_title("8-layer MLA decode step: eager vs CUDA graph (labels: eager / graph"
                     + (", medians of the runs)" if several else ")"))
        out += page.image(fig, "p4_graphs.png", "P4 eager vs graph")
    return out + render_runs(page)


def render_runs(page: Page) -> list[str]:
    """P4 at B=1 in every run, and the medians the check states."""
    runs = page.runs.get("P4", [])
    if len(runs) < 2:
        return []
    variants = sorted({r["variant"] for _, d in runs for r in d.get("rows", [])
                       if r.get("eager_us")})

    def cells(data: dict[str, Any]) -> list[str]:
        rows = [_b1(data, v) for v in variants]
        return [f"{r['eager_us']:.0f} / {r['graph_us']:.0f} ({r['speedup']:.2f}x)" if r else "-"
                for r in rows]

    def most_over_least(key: str) -> str:
        """Largest max / min over the runs of one backend's B=1 time."""
        ratios = []
        for v in variants:
            values = [row[key] for _, d in runs if (row := _b1(d, v))]
            ratios += [max(values) / min(values)] if values else []
        return f"{max(ratios):.2f}x" if ratios else "-"

    speedups = [[row["speedup"] for _, d in runs if (row := _b1(d, v))] for v in variants]
    medians = [f"{statistics.median(x):.2f}x" if x else "-" for x in speedups]
    return ["", (f"The eager step is bound by how fast the host issues kernel launches, not by "
                 f"the GPU: over these {len(runs)} runs of the same code on the same kind of "
                 f"machine, the slowest B=1 graph step of a backend is at most "
                 f"{most_over_least('graph_us')} its fastest, its eager step up to "
                 f"{most_over_least('eager_us')}.  The check below is the median of the runs "
                 f"(more runs: `{REPEATS_COMMAND}`, brought back to "
                 f"`{rel(REPEATS_DIR, page.root)}/`)."), "",
            runs_table(runs, [f"{v} B=1: eager / graph us (x)" for v in variants], cells,
                       medians, page.root)]
