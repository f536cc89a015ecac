"""Prefill: absorbed MLA extend against non-absorbed MHA ragged prefill, per backend.

Pinning MLA under BREAKABLE capture (seed 000) means prefix batches run the
*absorbed* form (576/512-wide heads over the latent pool) instead of the MHA
companion (192/128-wide heads after decompressing the latent with kv_b_proj).
This section measures what that costs, one sequence (B=1), 128 heads, at
prefix lengths {0, 4k, 32k} and extend lengths {512, 4k}:

* absorbed: ``q_nope @ W_UK`` -> ``forward_extend(method=MLA)`` -> ``@ W_UV``;
* MHA: gather the latent rows of prefix + new tokens, ``kv_b_proj`` them into
  per-head K_nope and V, append the shared rope key, ``forward_extend(method=MHA)``.

Both produce the ``[E, H, 128]`` value-projected output and are checked
against each other.  Each path is timed whole and attention-only (the
``forward_extend`` call alone), eagerly (prefill attention is not replayed
from a graph in the MHA form), with the L2 flushed before each call.
"""

from __future__ import annotations

from typing import Any

from attnreg.profiling import LayerShape, MLALayer, random_pool, rel_error

from ._backends import (
    PREFILL_VARIANTS,
    Variant,
    available_variants,
    create_backend,
    declared_reasons,
)
from ._harness import RunContext, SkipSection, error_text
from ._report import Page, bar_groups, md_table, not_run_notes
from .ceilings import gemm_tflops
from .metrics import D_LATENT, D_ROPE, D_ROW, Check, extend_attention_flops

PREFIXES = (0, 4096, 32768)
EXTENDS = (512, 4096)
QUICK_PREFIXES = (0, 32768)
DRY_PREFIXES = (0, 40)
DRY_EXTENDS = (16,)
HEADS = 128
DRY_HEADS = 16
#: The projections around attention (only W_UK, W_UV and kv_b_proj run here).
SHAPE = LayerShape()
DRY_SHAPE = LayerShape(hidden=256, q_lora=128)
NOPE, V_DIM = SHAPE.nope, SHAPE.v_dim
#: The two paths compute the same function in different orders (bf16 inputs).
MAX_REL_DIFF = 3e-2
#: Query rows (the last ones) the MHA-only path is checked on against the reference.
REFERENCE_ROWS = 256


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    variants, skipped = available_variants(ctx, PREFILL_VARIANTS)
    if not variants:
        raise SkipSection(f"no prefill backend can run here: {skipped}")
    heads = ctx.pick(HEADS, HEADS, DRY_HEADS)
    prefixes = ctx.pick(PREFIXES, QUICK_PREFIXES, DRY_PREFIXES)
    extends = ctx.pick(EXTENDS, EXTENDS, DRY_EXTENDS)
    # kv_b_proj [H * (nope + v), 512]; its per-head blocks are W_UK and W_UV.
    layer = MLALayer(ctx.torch, ctx.pick(SHAPE, SHAPE, DRY_SHAPE), heads, ctx.device, seed=5,
                     max_positions=1)
    data.update(batch=1, heads=heads, prefixes=list(prefixes), extends=list(extends),
                variants=[v.label for v in variants], skipped_variants=skipped,
                gemm_TFLOPs=gemm_tflops(ctx), rows=[],
                timing="eager, CUDA events per call, L2 flushed")
    for prefix in prefixes:
        for extend in extends:
            if ctx.out_of_time():
                data["rows"].append({"prefix": prefix, "extend": extend,
                                     "skipped": "time budget used up"})
                continue
            try:
                data["rows"].append(_point(ctx, variants, heads, prefix, extend, layer))
            except Exception as exc:  # noqa: BLE001 - keep the other points
                data["rows"].append({"prefix": prefix, "extend": extend,
                                     "error": error_text(exc)})
                ctx.log(f"prefill P={prefix} E={extend}: {data['rows'][-1]['error']}")
            ctx.save()
    data["summary"] = summarize(data)


def _point(ctx: RunContext, variants: list[Variant], heads: int, prefix: int, extend: int,
           layer: MLALayer) -> dict[str, Any]:
    from attnreg.runtime import MLAConfig, extend_batch

    torch = ctx.torch
    tokens = prefix + extend
    torch.manual_seed(tokens + heads)
    cfg = MLAConfig(num_heads=heads, page_size=1, device=ctx.device, max_context_len=tokens)
    pool = random_pool(ctx.torch, cfg, tokens, seed=tokens)
    pages = pool.allocate([tokens], shuffle=tokens)
    batch = extend_batch(pool, [prefix], [extend], pages=pages)
    slots = torch.tensor(pool.slots(pages[0], range(tokens)), dtype=torch.long,
                         device=ctx.device)
    q_nope = torch.randn(extend, heads, NOPE, dtype=torch.bfloat16, device=ctx.device)
    q_pe = torch.randn(extend, heads, D_ROPE, dtype=torch.bfloat16, device=ctx.device)
    flops = {
        "absorbed_attention": extend_attention_flops(prefix, extend, heads, D_ROW, D_LATENT),
        "mha_attention": extend_attention_flops(prefix, extend, heads, NOPE + D_ROPE, V_DIM),
        "absorption": 2 * 2 * extend * heads * NOPE * D_LATENT,
        "decompression": 2 * tokens * D_LATENT * heads * (NOPE + V_DIM),
    }
    row: dict[str, Any] = {"prefix": prefix, "extend": extend, "flops": flops, "results": {}}
    inputs = {"pool": pool, "batch": batch, "slots": slots, "q_nope": q_nope, "q_pe": q_pe,
              "pages": pages}
    for v in variants:
        mla_reasons = declared_reasons(ctx, v, "mla", "prefill", heads=heads,
                                       head_dims=(576, 512))
        mha_reasons = declared_reasons(ctx, v, "mha", "prefill", heads=heads,
                                       head_dims=(NOPE + D_ROPE, V_DIM), page_size=None)
        if mha_reasons:
            row["results"][v.label] = {"not_declared": "; ".join(mla_reasons + mha_reasons)}
            continue
        try:
            # a backend with MHA prefill only (flash_attn_cute on sm90) still gets its
            # MHA path timed: it is the eager side of the replay decision
            res = _measure_variant(ctx, v, heads, tokens, inputs, layer, flops,
                                   absorbed_not_declared="; ".join(mla_reasons))
            ctx.log(f"prefill P={prefix} E={extend} {v.label}: {_describe(res)}")
        except Exception as exc:  # noqa: BLE001 - one backend must not lose the row
            res = {"error": error_text(exc)}
            ctx.log(f"prefill P={prefix} E={extend} {v.label}: {res['error']}")
        row["results"][v.label] = res
    return row


def _describe(res: dict[str, Any]) -> str:
    mha = (f"MHA+decompress {res['mha']['us'] / 1e3:.2f} ms, attention "
           f"{res['mha_attention']['TFLOPs']:.0f} TFLOP/s")
    if "absorbed" not in res:
        return f"{mha} (absorbed not declared)"
    return (f"absorbed {res['absorbed']['us'] / 1e3:.2f} ms, {mha}, absorbed/MHA "
            f"{res['absorbed_over_mha']:.2f}x, absorbed attention "
            f"{res['absorbed_attention']['TFLOPs']:.0f} TFLOP/s, "
            f"rel.diff {res['rel_diff_absorbed_vs_mha']:.1e}")


def _measure_variant(ctx: RunContext, v: Variant, heads: int, tokens: int,
                     inputs: dict[str, Any], layer: MLALayer,
                     flops: dict[str, int], absorbed_not_declared: str = "") -> dict[str, Any]:
    """Both paths of one backend: check they agree, then time each whole and attention-only.

    With ``absorbed_not_declared`` (the backend's reasons) only the MHA path is
    timed, and checked against the reference backend's absorbed output instead.
    """
    from attnreg.registry import ForwardMethod

    torch = ctx.torch
    pool, batch, slots = inputs["pool"], inputs["batch"], inputs["slots"]
    q_nope, q_pe = inputs["q_nope"], inputs["q_pe"]
    be = create_backend(ctx, v, num_heads=heads, page_size=1, max_context_len=tokens)
    be.init_forward_metadata(batch)

    def absorbed_inputs() -> Any:
        return layer.absorb(q_nope, q_pe)

    def absorbed_attention(q: Any) -> Any:
        return be.forward_extend(q, None, None, pool, batch, method=ForwardMethod.MLA)

    def absorbed() -> Any:
        return layer.unabsorb(absorbed_attention(absorbed_inputs()))

    def mha_inputs() -> tuple[Any, Any, Any]:
        k, v_part = layer.decompress(pool.buffer.view(-1, D_ROW)[slots])
        return torch.cat([q_nope, q_pe], dim=-1), k, v_part

    def mha_attention(q: Any, k: Any, v_part: Any) -> Any:
        return be.forward_extend(q, None, None, pool, batch, method=ForwardMethod.MHA,
                                 k=k, v=v_part)

    def mha() -> Any:
        return mha_attention(*mha_inputs())

    res: dict[str, Any] = {}
    mha_in = mha_inputs()
    timed: dict[str, Any] = {"mha": mha, "mha_attention": lambda: mha_attention(*mha_in)}
    if absorbed_not_declared:
        res["absorbed_not_declared"] = absorbed_not_declared
        # The reference materialises fp32 scores (rows x tokens x heads: 72 GiB for the
        # last 4096 rows of 36864 at 128 heads), so only the last REFERENCE_ROWS query rows
        # are checked: as a sequence of their own over the same pages they see the same keys.
        from attnreg.runtime import extend_batch

        extend = q_nope.shape[0]
        rows = min(REFERENCE_ROWS, extend)
        tail = extend_batch(pool, [tokens - rows], [rows], pages=inputs["pages"])
        reference = create_backend(ctx, Variant("reference", "reference"), num_heads=heads,
                                   page_size=1, max_context_len=tokens)
        reference.init_forward_metadata(tail)
        q_ref = absorbed_inputs()[extend - rows:]
        out_ref = layer.unabsorb(reference.forward_extend(q_ref, None, None, pool, tail,
                                                          method=ForwardMethod.MLA))
        out_mha = mha()
        ctx.sync()
        res["reference_rows"] = rows
        res["rel_diff_mha_vs_reference"] = rel_error(ctx.torch, out_ref, out_mha[extend - rows:].float())
        res["agree"] = res["rel_diff_mha_vs_reference"] <= MAX_REL_DIFF
    else:
        out_abs, out_mha = absorbed(), mha()
        ctx.sync()
        res["rel_diff_absorbed_vs_mha"] = rel_error(ctx.torch, out_abs, out_mha.float())
        res["agree"] = res["rel_diff_absorbed_vs_mha"] <= MAX_REL_DIFF
        q_abs_in = absorbed_inputs()
        timed.update(absorbed=absorbed,
                     absorbed_attention=lambda: absorbed_attention(q_abs_in))
    for name, fn in timed.items():
        t = ctx.time(fn)
        res[name] = {"us": t["median_us"], "timing": t}
        if name.endswith("_attention"):
            res[name]["TFLOPs"] = flops[name] / (res[name]["us"] * 1e6)
    if "absorbed" in res:
        res["absorbed_over_mha"] = res["absorbed"]["us"] / res["mha"]["us"]
    return res


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per backend: where absorbed costs the most relative to MHA + decompression."""
    out: dict[str, Any] = {}
    for label in data.get("variants", []):
        pts = [(r["prefix"], r["extend"], r["results"][label]["absorbed_over_mha"])
               for r in data.get("rows", [])
               if "absorbed_over_mha" in r.get("results", {}).get(label, {})]
        if not pts:
            continue
        worst = max(pts, key=lambda p: p[2])
        best = min(pts, key=lambda p: p[2])
        out[label] = {"points": len(pts),
                      "worst": {"prefix": worst[0], "extend": worst[1], "ratio": worst[2]},
                      "best": {"prefix": best[0], "extend": best[1], "ratio": best[2]}}
    return out

# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """None: the ratios inform the policy's soft rules; no target is set."""
    return []


def render(data: dict[str, Any], page: Page) -> list[str]:
    labels = data.get("variants", [])
    header = ["prefix", "extend", "backend", "absorbed ms", "MHA + decompress ms",
              "absorbed / MHA", "attention ms (absorbed / MHA)",
              "attention TFLOP/s (absorbed / MHA)", "rel.diff"]
    rows = []
    not_declared: dict[str, str] = {}
    for r in data.get("rows", []):
        if r.get("skipped") or r.get("error"):
            why = "skipped: " + r["skipped"] if r.get("skipped") else "error: " + r["error"]
            rows.append([str(r["prefix"]), str(r["extend"]), "-", why[:100]] + [""] * 5)
            continue
        for v in labels:
            res = r["results"].get(v, {})
            if res.get("not_declared"):
                not_declared[v] = res["not_declared"]
                rows.append([str(r["prefix"]), str(r["extend"]), v, "not declared"] + [""] * 5)
                continue
            if "absorbed" not in res and "mha" in res:
                # MHA prefill only (e.g. flash_attn_cute on sm90): its eager side alone
                not_declared[v] = res.get("absorbed_not_declared", "absorbed not declared")
                rows.append([
                    str(r["prefix"]), str(r["extend"]), v, "not declared",
                    f"{res['mha']['us'] / 1e3:.3f}", "-",
                    f"- / {res['mha_attention']['us'] / 1e3:.3f}",
                    f"- / {res['mha_attention']['TFLOPs']:.0f}",
                    f"{res['rel_diff_mha_vs_reference']:.1e} vs reference"
                    + ("" if res.get("agree", True) else " **disagree**")])
                continue
            if "absorbed" not in res:
                rows.append([str(r["prefix"]), str(r["extend"]), v,
                             "error: " + res.get("error", "?")[:80]] + [""] * 5)
                continue
            rows.append([
                str(r["prefix"]), str(r["extend"]), v, f"{res['absorbed']['us'] / 1e3:.3f}",
                f"{res['mha']['us'] / 1e3:.3f}", f"**{res['absorbed_over_mha']:.2f}x**",
                (f"{res['absorbed_attention']['us'] / 1e3:.3f} / "
                f"{res['mha_attention']['us'] / 1e3:.3f}"),
                (f"{res['absorbed_attention']['TFLOPs']:.0f} / "
                f"{res['mha_attention']['TFLOPs']:.0f}"),
                f"{res['rel_diff_absorbed_vs_mha']:.1e}" + ("" if res.get("agree", True)
                                                             else " **disagree**")])
    out = [(f"B = {data.get('batch')}, {data.get('heads')} heads, bf16, page size 1; "
           f"{data.get('timing')}.  Absorbed = q·W_UK, extend over the latent pool "
           "(576/512), ·W_UV.  MHA = gather latent rows, kv_b_proj (prefix + new tokens), "
           "ragged prefill (192/128).  rel.diff compares the two outputs."), "",
           md_table(header, rows)]
    out += not_run_notes(data, not_declared)
    summary = data.get("summary", {})
    for label, s in summary.items():
        out += ["", (f"- `{label}`: absorbed costs at most **{s['worst']['ratio']:.2f}x** the "
                    f"MHA path (prefix {s['worst']['prefix']}, extend {s['worst']['extend']}) "
                    f"and at least {s['best']['ratio']:.2f}x (prefix {s['best']['prefix']}, "
                    f"extend {s['best']['extend']}).")]
    if summary:
        out += ["", ("For the policy: a ratio above 1 is the price of pinning MLA (absorbed) "
                    "for prefix batches under BREAKABLE capture; a soft rule can prefer eager "
                    "MHA prefill where the ratio is large and the launch savings of the "
                    "graph (P4) are small against a prefill this long.")]
    ok_rows = [r for r in data.get("rows", []) if r.get("results")]
    plotted = [v for v in labels if any("absorbed" in r["results"].get(v, {}) for r in ok_rows)]
    if page.plot.available and plotted:
        fig, axes = page.plot.plt.subplots(1, len(plotted), figsize=(6 * len(plotted), 4),
                                      squeeze=False)
        for ax, v in zip(axes[0], plotted):
            groups = [f"P={r['prefix']}\nE={r['extend']}" for r in ok_rows]
            series = {
                "absorbed (MLA)": [r["results"].get(v, {}).get("absorbed", {}).get("us")
                                   for r in ok_rows],
                "MHA + kv_b_proj": [r["results"].get(v, {}).get("mha", {}).get("us")
                                    for r in ok_rows]}
            series = {k: [x / 1e3 if x else None for x in vals] for k, vals in series.items()}
            bar_groups(ax, groups, series, "ms", log=True)
            ax.set_title(f"prefill, {v}")
        out += page.image(fig, "prefill.png", "Prefill absorbed vs MHA")
    return out
