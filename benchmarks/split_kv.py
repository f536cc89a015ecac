"""P3: split-KV under capture.

At B=1 a decode (or a short extend) over a long KV has almost no parallelism
unless the KV is split.  The ``triton`` backend
keeps split-KV inside a captured graph (static grid, split counts computed on
the device); ``force_kv_splits=1`` is what a backend that must force one split
under capture (seed 000 defect 2) gets.  Both are captured (decode under FULL,
extend under BREAKABLE) and their replays timed at L in {8k, 32k, 128k}.  Any
other backend that captures (flashinfer's host-planned split) is timed as a
reference row.
"""

from __future__ import annotations

from typing import Any

from attnreg.profiling import random_pool, rel_error

from ._backends import (
    PREFILL_VARIANTS,
    Variant,
    available_variants,
    create_backend,
    declared_reasons,
    planned_splits,
    reference_decode,
)
from ._harness import RunContext, SkipSection, error_text
from ._report import Page, fmt, md_table, not_run_notes
from .metrics import Check, evaluate

P3_LENS = (8192, 32768, 131072)
P3_DRY_LENS = (96, 300)
P3_HEADS = (128, 16)
P3_DRY_HEADS = (16,)
#: New tokens of the P3 extend: a short chunk (draft / verify sized), where the
#: query block alone gives too few programs to fill the device.
P3_EXTEND = 16
P3_DRY_EXTEND = 4
P3_TARGET_LEN = 32768
P3_DRY_TARGET_LEN = 300
MAX_REL_ERR = 2e-2

def run_p3(ctx: RunContext, data: dict[str, Any]) -> None:
    variants, skipped = available_variants(ctx, PREFILL_VARIANTS)
    if not any(v.backend == "triton" for v in variants):
        raise SkipSection("the triton backend (capture-safe split-KV) is not available: "
                          f"{skipped.get('triton', '?')}")
    lens = ctx.pick(P3_LENS, P3_LENS, P3_DRY_LENS)
    heads_list = ctx.pick(P3_HEADS, P3_HEADS, P3_DRY_HEADS)
    extend = ctx.pick(P3_EXTEND, P3_EXTEND, P3_DRY_EXTEND)
    rows_variants = [Variant("triton split-KV", "triton"),
                     Variant("triton one split", "triton", {"force_kv_splits": 1})]
    rows_variants += [Variant(v.label, v.backend, v.options) for v in variants
                      if v.backend != "triton"]
    data.update(batch=1, extend_tokens=extend, lens=list(lens), heads=list(heads_list),
                variants=[v.label for v in rows_variants], skipped_variants=skipped,
                timing="CUDA graph replay (decode FULL, extend BREAKABLE), L2 flushed",
                rows=[])
    for heads in heads_list:
        for length in lens:
            if ctx.out_of_time():
                data["rows"].append({"H": heads, "L": length, "skipped": "time budget used up"})
                continue
            try:
                data["rows"].append(_p3_point(ctx, heads, length, extend, rows_variants))
            except Exception as exc:  # noqa: BLE001 - keep the other points
                data["rows"].append({"H": heads, "L": length,
                                     "error": error_text(exc)})
                ctx.log(f"P3 H={heads} L={length}: {data['rows'][-1]['error']}")
            ctx.save()
    data["target_len"] = ctx.pick(P3_TARGET_LEN, P3_TARGET_LEN, P3_DRY_TARGET_LEN)
    data["checks"] = [c.to_dict() for c in p3_checks(data)]


def _p3_point(ctx: RunContext, heads: int, length: int, extend: int,
              variants: list[Variant]) -> dict[str, Any]:
    from attnreg.runtime import MLAConfig, decode_batch, extend_batch

    torch = ctx.torch
    torch.manual_seed(length + heads)
    cfg = MLAConfig(num_heads=heads, page_size=1, device=ctx.device)
    pool = random_pool(ctx.torch, cfg, length + extend, seed=length)
    pages = pool.allocate([length + extend], shuffle=length)
    dec = decode_batch(pool, [length], pages=pages)
    ext = extend_batch(pool, [length], [extend], pages=pages)
    q_dec = torch.randn(1, heads, 576, dtype=torch.bfloat16, device=ctx.device)
    q_ext = torch.randn(extend, heads, 576, dtype=torch.bfloat16, device=ctx.device)
    ref_dec = reference_decode(ctx, q_dec, pool, dec.page_table, [length], cfg.softmax_scale)
    ref_ext = _reference_extend(ctx, q_ext, pool, ext.page_table, length, extend,
                                cfg.softmax_scale)
    inputs = {"decode": (dec, q_dec, ref_dec), "extend": (ext, q_ext, ref_ext)}
    row: dict[str, Any] = {"H": heads, "L": length, "results": {}}
    for v in variants:
        # Asked first: a backend with neither absorbed path here (flash_attn_cute on sm90)
        # would refuse its graph state, and that is "not declared", not an error.
        undeclared = {kind: "; ".join(reasons) for kind in inputs
                      if (reasons := declared_reasons(
                          ctx, v, "mla", "decode" if kind == "decode" else "prefill",
                          heads=heads, head_dims=(576, 512)))}
        res: dict[str, Any] = {k: {"not_declared": why} for k, why in undeclared.items()}
        if len(undeclared) == len(inputs):
            row["results"][v.label] = res
            continue
        try:
            be = create_backend(ctx, v, num_heads=heads, page_size=1,
                                max_context_len=length + extend)
        except Exception as exc:  # noqa: BLE001
            row["results"][v.label] = {"error": error_text(exc)}
            continue
        for kind, (batch, q, ref) in inputs.items():
            if kind in undeclared:
                continue
            try:
                res[kind] = _p3_graph(ctx, be, kind, batch, q, ref, pool)
            except Exception as exc:  # noqa: BLE001
                res[kind] = {"error": error_text(exc)}
            ctx.log(f"P3 H={heads} L={length} {v.label} {kind}: "
                    + (f"{res[kind]['us']:.1f} us, rel.err {res[kind]['rel_err']:.1e}"
                       if "us" in res[kind] else res[kind]["error"]))

        row["results"][v.label] = res
    for kind in ("decode", "extend"):
        split = row["results"].get("triton split-KV", {}).get(kind, {})
        one = row["results"].get("triton one split", {}).get(kind, {})
        if "us" in split and "us" in one:
            row[f"{kind}_speedup"] = one["us"] / split["us"]
    return row


def _p3_graph(ctx: RunContext, be: Any, kind: str, batch: Any, q: Any, ref: Any,
              pool: Any) -> dict[str, Any]:
    """Capture one decode (FULL) or extend (BREAKABLE) call, check a replay, time replays."""
    from attnreg.registry import ForwardMethod, GraphMode
    from attnreg.runtime import GraphSession, StepInputs

    decode = kind == "decode"
    bucket = 1 if decode else batch.num_tokens
    # a graph session of one bucket per kind (each allocates the graph state it captures)
    session = GraphSession(be, pool, phase="decode" if decode else "prefill",
                           mode=GraphMode.FULL if decode else GraphMode.BREAKABLE,
                           buckets=[bucket], max_requests=1, writes_kv=False,
                           method=None if decode else ForwardMethod.MLA)
    session.capture(batches={bucket: batch}, inputs={bucket: StepInputs.one(q)})
    assert session.statics is not None
    session.statics.outs[0].fill_(float("nan"))
    out = session.replay(batch, bucket=bucket)[0]
    ctx.sync()
    err = rel_error(ctx.torch, out, ref)
    # the kernels in the graph only: the replay metadata was prepared above
    timing = ctx.time(session.graph(next(iter(session.keys))).replay)
    res: dict[str, Any] = {"us": timing["median_us"], "timing": timing, "rel_err": err,
                           "correct": err <= MAX_REL_ERR}
    splits = planned_splits(be.forward_metadata)  # decode or extend: the captured shape's
    if splits is not None:
        res["max_splits"] = splits
    return res


def _reference_extend(ctx: RunContext, q: Any, pool: Any, page_table: Any, prefix: int,
                      extend: int, sm_scale: float) -> Any:
    """float32 absorbed extend of one sequence: query i sees tokens 0 .. prefix + i."""
    torch = ctx.torch
    ps = pool.page_size
    t = torch.arange(prefix + extend, device=q.device)
    kv = pool.buffer[page_table[0, t // ps].long(), t % ps].float()
    scores = torch.einsum("ehd,ld->ehl", q.float(), kv) * sm_scale
    qpos = prefix + torch.arange(extend, device=q.device)
    scores = scores.masked_fill(t[None, None, :] > qpos[:, None, None], float("-inf"))
    return torch.einsum("ehl,ld->ehd", torch.softmax(scores, -1), kv[:, :512])


def p3_checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """One split / split-KV time at the target length, per head count and kind."""
    target_len = data.get("target_len", P3_TARGET_LEN)
    checks = []
    for heads in data.get("heads", []):
        row = next((r for r in data.get("rows", []) if r.get("H") == heads
                    and r.get("L") == target_len), None)
        for kind in ("decode", "extend"):
            value = row.get(f"{kind}_speedup") if row else None
            checks.append(evaluate(
                f"P3 {kind} H={heads}", f"{kind} at B=1, L={target_len}: one split / "
                "split-KV time, inside a CUDA graph", value, "x", ">=", target=4.0))
    return checks


# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def render_p3(data: dict[str, Any], page: Page) -> list[str]:
    labels = data.get("variants", [])
    header = ["H", "L"] + [f"{k}: {v} us" for k in ("decode", "extend") for v in labels] + \
        ["decode one/split", "extend one/split"]
    rows = []
    not_declared: dict[str, str] = {}
    for r in data.get("rows", []):
        if r.get("skipped") or r.get("error"):
            why = "skipped" if r.get("skipped") else "error: " + r["error"][:60]
            rows.append([str(r["H"]), str(r["L"])] + [why] * (2 * len(labels) + 2))
            continue
        cells = [str(r["H"]), str(r["L"])]
        for kind in ("decode", "extend"):
            for v in labels:
                res = r["results"].get(v, {})
                k = res.get(kind, {}) if "error" not in res else {"error": res["error"]}
                if k.get("not_declared"):
                    not_declared[v] = k["not_declared"]
                    cells.append("not declared")
                    continue
                if "us" in k:
                    cell = f"{k['us']:.1f}"
                    if k.get("max_splits"):
                        cell += f" ({k['max_splits']} splits)"
                    if not k.get("correct", True):
                        cell += f" **wrong {k['rel_err']:.1e}**"
                else:
                    cell = "error: " + str(k.get("error", "?"))[:50]
                cells.append(cell)
        cells += [fmt(r.get("decode_speedup"), ".1f") + "x", fmt(r.get("extend_speedup"),
                                                                 ".1f") + "x"]
        rows.append(cells)
    out = [(f"B = 1, {data.get('extend_tokens')} new tokens for extend; {data.get('timing')}.  "
           "'triton one split' is the same backend with `force_kv_splits=1`: what a backend "
           "that must force one split under capture (seed 000, defect 2) gets."), "",
           md_table(header, rows)]
    out += not_run_notes(data, not_declared)
    if page.plot.available and data.get("rows"):
        fig, axes = page.plot.plt.subplots(1, 2, figsize=(12, 4))
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
        styles = ["-", "--", ":", "-."]
        for ax, kind in zip(axes, ("decode", "extend")):
            for hi, heads in enumerate(data.get("heads", [])):
                rs = [r for r in data["rows"] if r.get("H") == heads and r.get("results")]
                for vi, v in enumerate(labels):
                    pts = [(r["L"], r["results"].get(v, {}).get(kind, {}).get("us"))
                           for r in rs]
                    pts = [(x, y) for x, y in pts if y]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                color=colors[hi % len(colors)], ls=styles[vi % len(styles)],
                                label=f"{v}, H={heads}")
                for r in rs:
                    if r.get(f"{kind}_speedup"):
                        one = r["results"].get("triton one split", {}).get(kind, {}).get("us")
                        if one:
                            ax.annotate(f"{r[kind + '_speedup']:.1f}x", (r["L"], one),
                                        textcoords="offset points", xytext=(0, 5),
                                        ha="center", fontsize=7,
                                        color=colors[hi % len(colors)])
            lens = data.get("lens") or []
            ax.set_xscale("log", base=2)
            ax.set_xticks(lens)
            ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in lens])
            ax.set_yscale("log")
            ax.set_xlabel("KV length L")
            ax.set_ylabel("us per call (graph replay)")
            ax.set_title(f"absorbed {kind}, B=1 (labels: one split / split-KV)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        out += page.image(fig, "p3_split_kv.png", "P3 split-KV vs one split")
    return out
