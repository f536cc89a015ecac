"""P1 and P2: absorbed MLA decode of every available backend, against copy bandwidth.

P1 times ``forward_decode`` of each backend, created through the registry, on
seven (B, L, H) shapes at bf16 and page size 1.  Each backend's decode is
captured in a CUDA graph the way an engine runs decode (FULL graph mode; the
host planning of ``init_forward_metadata_replay`` runs once, outside the timed
replays) and the replay is timed with the L2 flushed before each call.  Where
capture fails the eager call is timed instead and the row says so.

Bytes per call = KV rows (latent 512 + rope 64) read once + q written once +
out written once (:func:`benchmarks.metrics.decode_bytes`); TB/s is that over
the median time and is set against the device copy bandwidth of the same run.

Every timed output is checked first against a float32 reference on four
sequences (rel. error, NaN-poisoned outputs), so a fast wrong kernel shows up
as wrong, not as fast.

P2 takes the best correct backend at (128, 4096, 16) from P1 (or measures that
shape alone when P1 did not run) as a share of the copy bandwidth.
"""

from __future__ import annotations

from typing import Any

from attnreg.profiling import random_pool

from ._backends import (
    DECODE_VARIANTS,
    Variant,
    available_variants,
    create_backend,
    declared_reasons,
    planned_splits,
    reference_decode,
    worst_row_rel_error,
)
from ._harness import RunContext, SkipSection, error_text
from ._report import Page, bar_groups, fmt, md_table, not_run_notes, pct
from .ceilings import copy_gbps
from .metrics import Check, decode_bytes, evaluate, geomean

SHAPES: tuple[tuple[int, int, int], ...] = (
    (128, 4096, 128), (128, 4096, 16), (32, 8192, 16), (1, 32768, 16), (1, 32768, 128),
    (8, 1024, 128), (64, 2048, 64))
DRY_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 64, 16), (1, 80, 16))
P2_SHAPE = (128, 4096, 16)
P2_DRY_SHAPE = DRY_SHAPES[0]
#: A bf16 kernel lands between 1e-3 and 1e-2 of a float32 reference (METHOD.md).
MAX_REL_ERR = 2e-2
PAGE_SIZE = 1
TRITON = "triton"
FA3 = "flashinfer_mla/fa3"
#: Triton at either page size, against the faster Hopper peer per shape (issue 20).
TRITON_ROWS = (TRITON, "triton (page 64)")
HOPPER_PEERS = (FA3, "flashmla (page 64)")


def run_p1(ctx: RunContext, data: dict[str, Any]) -> None:
    shapes = ctx.pick(SHAPES, SHAPES, DRY_SHAPES)
    variants, skipped = available_variants(ctx, DECODE_VARIANTS)
    if not variants:
        raise SkipSection(f"no decode backend can run here: {skipped}")
    copy = copy_gbps(ctx)
    data.update(dtype="bf16", page_size=PAGE_SIZE, page_order="shuffled (seeded)",
                copy_GBps=copy, variants=[v.label for v in variants],
                skipped_variants=skipped, rows=[],
                timing="CUDA graph replay of forward_decode, L2 flushed before each call")
    for shape in shapes:
        if ctx.out_of_time():
            data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                 "skipped": "time budget used up"})
            continue
        try:
            data["rows"].append(measure_shape(ctx, shape, variants, copy))
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the other shapes
            data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                 "error": error_text(exc)})
            ctx.log(f"P1 {shape}: {data['rows'][-1]['error']}")
        ctx.save()
    data["summary"] = summarize_p1(data)
    data["checks"] = [c.to_dict() for c in p1_checks(data)]


def run_p2(ctx: RunContext, data: dict[str, Any]) -> None:
    shape = ctx.pick(P2_SHAPE, P2_SHAPE, P2_DRY_SHAPE)
    copy = copy_gbps(ctx)
    row = None
    p1 = ctx.section_data("P1")
    if p1:
        row = next((r for r in p1.get("rows", []) if (r.get("B"), r.get("L"), r.get("H"))
                    == shape and r.get("results")), None)
    source = "the P1 row of this run"
    if row is None:
        variants, skipped = available_variants(ctx, DECODE_VARIANTS)
        if not variants:
            raise SkipSection(f"no decode backend can run here: {skipped}")
        row = measure_shape(ctx, shape, variants, copy)
        source = "measured by P2 (P1 did not run)"
    data.update(p2_from_row(row, copy))
    data["source"] = source


def measure_shape(ctx: RunContext, shape: tuple[int, int, int], variants: list[Variant],
                  copy: float | None) -> dict[str, Any]:
    """Time every variant on one (B, L, H) shape: one query, one pool per page size.

    Pools of different page sizes hold the same tokens (same seed), laid out in
    shuffled pages of their size, so every row reads the same bytes.
    """
    torch = ctx.torch
    B, L, H = shape
    torch.manual_seed(B * 1_000_003 + L * 7 + H)
    q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=ctx.device)
    nbytes = decode_bytes(B, L, H)
    row: dict[str, Any] = {"B": B, "L": L, "H": H, "bytes": nbytes, "results": {}}
    by_page: dict[int, list[Variant]] = {}
    for v in variants:
        by_page.setdefault(v.page_size or PAGE_SIZE, []).append(v)
    for page_size, group in by_page.items():
        pool, batch, ref = _decode_inputs(ctx, shape, page_size, q)
        for v in group:
            reasons = declared_reasons(ctx, v, "mla", "decode", heads=H, head_dims=(576, 512),
                                       page_size=page_size)
            if reasons:
                row["results"][v.label] = {"not_declared": "; ".join(reasons)}
                continue
            try:
                res = measure_variant(ctx, v, H, L, pool, batch, q, ref, page_size=page_size)
            except Exception as exc:  # noqa: BLE001 - one backend must not lose the row
                res = {"error": error_text(exc)}
            if "us" in res:
                res["GBps"] = nbytes / (res["us"] * 1e3)
                if copy:
                    res["copy_share"] = res["GBps"] / copy
            row["results"][v.label] = res
            ctx.log(f"P1 {shape} {v.label}: " + _describe(res))
        del pool, batch
    return row


def _decode_inputs(ctx: RunContext, shape: tuple[int, int, int], page_size: int,
                   q: Any) -> tuple[Any, Any, Any]:
    """(pool, decode batch, float32 reference of the first rows) at ``page_size``."""
    from attnreg.runtime import MLAConfig, decode_batch

    B, L, H = shape
    cfg = MLAConfig(num_heads=H, page_size=page_size, device=ctx.device, max_context_len=L)
    pool = random_pool(ctx.torch, cfg, B * L, seed=L + H)
    pages = pool.allocate([L] * B, shuffle=B + L + H)
    batch = decode_batch(pool, [L] * B, pages=pages)
    ref = reference_decode(ctx, q, pool, batch.page_table, [L] * B, cfg.softmax_scale)
    return pool, batch, ref


def _describe(res: dict[str, Any]) -> str:
    if "us" not in res:
        return res.get("error", "no time")
    share = f", {res['copy_share']:.0%} of copy" if "copy_share" in res else ""
    return (f"{res['us']:.1f} us, {res['GBps'] / 1e3:.2f} TB/s{share}, "
            f"rel.err {res.get('rel_err', float('nan')):.1e} ({res['mode']})")


def measure_variant(ctx: RunContext, variant: Variant, heads: int, max_len: int, pool: Any,
                    batch: Any, q: Any, ref: Any, *, page_size: int = PAGE_SIZE
                    ) -> dict[str, Any]:
    """Check one backend's decode against ``ref`` and time it (graph replay, else eager)."""
    from attnreg.runtime import GraphSession, StepInputs

    torch = ctx.torch
    B = batch.batch_size
    be = create_backend(ctx, variant, num_heads=heads, page_size=page_size,
                        max_context_len=max_len)
    out = torch.full((B, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    be.init_forward_metadata(batch)
    be.forward_decode(q, None, None, pool, batch, out=out)
    ctx.sync()
    res: dict[str, Any] = {"rel_err_eager": worst_row_rel_error(ctx.torch, out, ref)}
    splits = planned_splits(be.forward_metadata)
    if splits is not None:
        res["max_splits"] = int(splits)
    try:
        session = GraphSession(be, pool, phase="decode", mode="full", buckets=[B],
                               max_seq_len=max_len, writes_kv=False, kernel_outputs=True)
        session.capture(batches={B: batch}, inputs={B: StepInputs.one(q)})
        session.outputs(session.keys[0])[0].fill_(float("nan"))
        gout = session.replay(batch, bucket=B)[0]
        ctx.sync()
        res["rel_err"] = worst_row_rel_error(ctx.torch, gout, ref)
        # the kernel in the graph only: its replay metadata was prepared above
        timing = ctx.time(session.graph(session.keys[0]).replay)
        res["mode"] = "graph"
    except Exception as exc:  # noqa: BLE001 - fall back to eager, say why
        res["graph_error"] = error_text(exc)
        res["rel_err"] = res["rel_err_eager"]
        be.init_forward_metadata(batch)
        timing = ctx.time(lambda: be.forward_decode(q, None, None, pool, batch, out=out))
        res["mode"] = "eager"
    res["timing"] = timing
    res["us"] = timing["median_us"]
    res["correct"] = bool(res["rel_err"] <= MAX_REL_ERR and res["rel_err_eager"] <= MAX_REL_ERR)
    return res


# ----------------------------------------------------------------------------------------
# Derived figures and checks (pure: measured once, recomputed when rendered)
# ----------------------------------------------------------------------------------------

def _us(row: dict[str, Any], label: str) -> float | None:
    res = row.get("results", {}).get(label) or {}
    if "us" in res and res.get("correct", True):
        return float(res["us"])
    return None


def _fastest(row: dict[str, Any], labels: tuple[str, ...]) -> float | None:
    times = [t for t in (_us(row, label) for label in labels) if t]
    return min(times) if times else None


def summarize_p1(data: dict[str, Any]) -> dict[str, Any]:
    """Per shape: triton / fa3, triton (either page size) / the faster Hopper peer (fa3,
    FlashMLA), the best backend; geo-means over the shapes that have both sides."""
    ratios, peer_ratios = [], []
    per_shape = []
    for row in data.get("rows", []):
        if not row.get("results"):
            continue
        t, f = _us(row, TRITON), _us(row, FA3)
        ratio = t / f if t and f else None
        if ratio:
            ratios.append(ratio)
        tb, peer = _fastest(row, TRITON_ROWS), _fastest(row, HOPPER_PEERS)
        peer_ratio = tb / peer if tb and peer else None
        if peer_ratio:
            peer_ratios.append(peer_ratio)
        timed = {k: r["us"] for k, r in row["results"].items()
                 if "us" in r and r.get("correct", True)}
        best = min(timed, key=timed.get) if timed else None  # type: ignore[arg-type]
        per_shape.append({"shape": [row["B"], row["L"], row["H"]], "triton_over_fa3": ratio,
                          "triton_over_best_peer": peer_ratio, "best": best})
    return {"per_shape": per_shape, "triton_over_fa3_geomean": geomean(ratios) if ratios
            else None, "shapes_with_both": len(ratios),
            "triton_over_best_peer_geomean": geomean(peer_ratios) if peer_ratios else None,
            "triton_over_best_peer_worst": max(peer_ratios) if peer_ratios else None,
            "shapes_with_peer": len(peer_ratios),
            "shapes_total": len(data.get("rows", []))}


def p1_checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    s = data.get("summary") or summarize_p1(data)
    n, total = s["shapes_with_both"], s["shapes_total"]
    checks = [evaluate("P1", "triton / flashinfer fa3 decode time, geo-mean over shapes",
                       s["triton_over_fa3_geomean"], "x", "<=", target=1.25, goal=1.0,
                       detail=f"over {n} of {total} shapes")]
    if s.get("shapes_with_peer"):
        worst = s.get("triton_over_best_peer_worst")
        checks.append(evaluate(
            "P1-peer", "triton (page 1 or 64) / the faster of flashinfer fa3 and FlashMLA, "
            "geo-mean over shapes", s["triton_over_best_peer_geomean"], "x", "<=", target=1.0,
            detail=f"over {s['shapes_with_peer']} of {total} shapes; worst shape "
                   f"{fmt(worst, '.2f')}x (issue 20: none above 1.25x)"))
    return checks


def p2_from_row(row: dict[str, Any], copy: float | None) -> dict[str, Any]:
    """Best correct backend of one P1 row as a share of the copy bandwidth."""
    shares = {}
    for label, res in row.get("results", {}).items():
        if "us" in res and res.get("correct", True) and copy:
            shares[label] = row["bytes"] / (res["us"] * 1e3) / copy
    best = max(shares, key=shares.get) if shares else None  # type: ignore[arg-type]
    share = shares[best] if best else None
    out = {"shape": [row.get("B"), row.get("L"), row.get("H")], "copy_GBps": copy,
           "shares": shares, "best": best, "best_share": share,
           "best_GBps": share * copy if share and copy else None}
    out["checks"] = [c.to_dict() for c in p2_checks(out)]
    return out


def p2_checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    best = data.get("best")
    return [evaluate("P2", f"best decode backend at {tuple(P2_SHAPE)} as a share of copy "
                     "bandwidth", data.get("best_share"), "of copy", ">=", goal=0.90,
                     detail=f"best: {best}" if best else "no correct backend timed")]


# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def render_p1(data: dict[str, Any], page: Page) -> list[str]:
    labels = data.get("variants", [])
    copy = data.get("copy_GBps")
    header = ["(B, L, H)", "MB moved"] + [f"{v} us (TB/s, % copy)" for v in labels] + \
        ["triton / fa3"]
    rows = []
    not_declared: dict[str, str] = {}
    summary = data.get("summary", {})
    per_shape = {tuple(p["shape"]): p for p in summary.get("per_shape", [])}
    for r in data.get("rows", []):
        shape = (r["B"], r["L"], r["H"])
        if r.get("skipped") or r.get("error"):
            why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + r["error"]
            rows.append([str(shape), "-"] + [why[:80]] * len(labels) + ["-"])
            continue
        cells = [f"({r['B']}, {r['L']}, {r['H']})", f"{r['bytes'] / 1e6:.1f}"]
        best = per_shape.get(shape, {}).get("best")
        for v in labels:
            res = r["results"].get(v, {})
            if res.get("not_declared"):
                not_declared[v] = res["not_declared"]
                cells.append("not declared")
                continue
            if "us" not in res:
                cells.append("error: " + res.get("error", "?")[:60])
                continue
            cell = f"{res['us']:.1f} ({res['GBps'] / 1e3:.2f}, {pct(res.get('copy_share'))})"
            if res.get("mode") == "eager":
                cell += " eager"
            if not res.get("correct", True):
                cell += f" **wrong: rel.err {res['rel_err']:.1e}**"
            if v == best:
                cell = f"**{cell}**"
            cells.append(cell)
        ratio = per_shape.get(shape, {}).get("triton_over_fa3")
        cells.append(fmt(ratio, ".2f") + ("x" if ratio else ""))
        rows.append(cells)
    out = [(f"bf16, page size {data.get('page_size')}, page order {data.get('page_order')}; "
           f"{data.get('timing')}.  Bytes = KV rows (512 + 64) read once + q + out.  Copy "
           f"bandwidth of the same run: {fmt(copy and copy / 1e3, '.2f')} TB/s.  Bold: the "
           "fastest correct backend of the shape."), "", md_table(header, rows)]
    out += not_run_notes(data, not_declared)
    errs = [f"{r['B'], r['L'], r['H']} {v}: {res.get('graph_error')}"
            for r in data.get("rows", []) for v, res in r.get("results", {}).items()
            if res.get("graph_error")]
    if errs:
        out += ["", "Timed eagerly because capture failed: " + "; ".join(errs)]
    if page.plot.available and data.get("rows"):
        timed = [r for r in data["rows"] if r.get("results")]
        groups = [f"{r['B']},{r['L']},{r['H']}" for r in timed]
        series = {v: [(r["results"].get(v, {}).get("GBps") or 0) / 1e3 or None for r in timed]
                  for v in labels}
        fig, (ax1, ax2) = page.plot.plt.subplots(1, 2, figsize=(13, 4.2),
                                                 gridspec_kw={"width_ratios": [3, 1.4]})
        bar_groups(ax1, groups, series, "achieved TB/s (min. bytes / median time)")
        if copy:
            ax1.axhline(copy / 1e3, color="k", ls="--", lw=1)
            ax1.text(len(groups) - 0.5, copy / 1e3 * 1.01, f"copy {copy / 1e3:.2f} TB/s",
                     fontsize=8, ha="right", va="bottom")
        ax1.set_xlabel("(B, L, H)")
        ax1.set_title("MLA decode bandwidth per backend")
        ratios = [per_shape.get((r["B"], r["L"], r["H"]), {}).get("triton_over_fa3")
                  for r in timed]
        bars = ax2.bar(range(len(groups)), [x or 0 for x in ratios], color="tab:blue")
        for bar, x in zip(bars, ratios):
            if x:
                ax2.text(bar.get_x() + bar.get_width() / 2, x, f"{x:.2f}", ha="center",
                         va="bottom", fontsize=7)
        ax2.axhline(1.25, color="tab:red", ls="--", lw=1, label="target 1.25")
        ax2.axhline(1.0, color="tab:green", ls=":", lw=1, label="goal 1.0")
        ax2.set_xticks(range(len(groups)))
        ax2.set_xticklabels(groups, rotation=45, fontsize=7)
        ax2.set_title("triton / flashinfer fa3 time")
        ax2.legend(fontsize=7)
        out += page.image(fig, "p1_decode.png", "P1 decode bandwidth and triton/fa3 ratio")
    return out


def render_p2(data: dict[str, Any], page: Page) -> list[str]:
    shares = data.get("shares", {})
    rows = [[k, f"{v * data['copy_GBps'] / 1e3:.2f} TB/s", pct(v, 1)]
            for k, v in sorted(shares.items(), key=lambda kv: -kv[1])]
    return [(f"Shape {tuple(data.get('shape', []))}; source: {data.get('source')}; copy "
            f"bandwidth {fmt((data.get('copy_GBps') or 0) / 1e3, '.2f')} TB/s."), "",
            md_table(["backend", "achieved", "share of copy"], rows)]
