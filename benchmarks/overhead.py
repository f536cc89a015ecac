"""P6: what the registry and the AttentionBackend interface cost per call.

Three ways to run the same decode kernel on the same inputs, per backend:

* ``kernel``: the kernel called directly -- Triton's ``mla_decode(...)`` with a
  preallocated workspace and the split count the backend would choose;
  flashinfer's ``BatchMLAPagedAttentionWrapper.run`` planned once by hand
  (and ``kernel_with_plan``: ``plan`` + ``run`` per call, the direct
  counterpart of "metadata included");
* ``backend``: a backend created by ``get_registry().create("triton", ...)``,
  ``init_forward_metadata(batch)`` then ``forward_decode(...)`` on every call
  (metadata included: what an engine's eager decode step pays per layer at most);
* ``backend, planned once``: ``forward_decode`` only (metadata planned once, as
  an engine does once per step for all layers).

Each is issued back to back many times with no synchronisation between calls
and timed with CUDA events around the whole loop: when the host issues calls
slower than the device runs them, the host cost shows in the per-call time,
as it does in an eager engine.  The host time to issue one call is recorded
too.  The overhead is ``backend / kernel - 1`` per shape (against
``kernel_with_plan`` where the kernel has a plan step of its own).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

from attnreg.profiling import random_pool

from ._backends import Variant, available_variants, create_backend, planned_splits
from ._harness import RunContext, SkipSection, error_text
from ._report import (
    REPEATS_COMMAND,
    REPEATS_DIR,
    Page,
    bar_groups,
    fmt,
    md_table,
    not_run_notes,
    pct,
    rel,
    runs_table,
)
from .metrics import Check, median_of_runs

SHAPES: tuple[tuple[int, int, int], ...] = ((8, 1024, 128), (64, 2048, 64), (128, 4096, 16),
                                            (1, 32768, 128))
QUICK_SHAPES: tuple[tuple[int, int, int], ...] = ((8, 1024, 128), (128, 4096, 16))
DRY_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 64, 16),)
GOAL = 0.02
VARIANTS = (Variant("triton", "triton"), Variant("flashinfer_mla", "flashinfer_mla"))


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    variants, skipped = available_variants(ctx, VARIANTS)
    if not variants:
        raise SkipSection(f"no backend with a direct kernel baseline is available: {skipped}")
    shapes = ctx.pick(SHAPES, QUICK_SHAPES, DRY_SHAPES)
    data.update(variants=[v.label for v in variants], skipped_variants=skipped, rows=[],
                timing="CUDA events around back-to-back calls (no sync, no L2 flush between)")
    for v in variants:
        for shape in shapes:
            if ctx.out_of_time():
                data["rows"].append({"variant": v.label, "B": shape[0], "L": shape[1],
                                     "H": shape[2], "skipped": "time budget used up"})
                continue
            try:
                row = _measure(ctx, v, shape)
            except Exception as exc:  # noqa: BLE001
                row = {"variant": v.label, "B": shape[0], "L": shape[1], "H": shape[2],
                       "error": error_text(exc)}
                ctx.log(f"P6 {v.label} {shape}: {row['error']}")
            data["rows"].append(row)
            ctx.save()
    data["checks"] = [c.to_dict() for c in p6_checks(data)]


def triton_direct(be: Any, pool: Any, batch: Any, q: Any, out: Any
                  ) -> dict[str, Callable[[], Any]]:
    """``mla_decode`` with a preallocated workspace and the split count the backend plans.

    Shared with ``benchmarks/host_overhead.py`` (its launches stubbed out there).
    """
    from attnreg.backends._triton_kernels import mla_decode, mla_decode_workspace

    be.init_forward_metadata(batch)
    splits = be.forward_metadata.plan.splits
    B, H = q.shape[0], q.shape[1]
    workspace = mla_decode_workspace(B, H, splits, q.device) if splits > 1 else None
    scale = be.config.softmax_scale

    def kernel() -> None:
        mla_decode(q, pool.buffer, batch.page_table, batch.seq_lens, out, sm_scale=scale,
                   max_splits=splits, workspace=workspace)

    return {"kernel": kernel}


def flashinfer_direct(be: Any, pool: Any, batch: Any, q: Any, out: Any
                      ) -> dict[str, Callable[[], Any]]:
    """flashinfer's ``BatchMLAPagedAttentionWrapper`` driven by hand (no attnreg in between).

    The CSR plan inputs are built once, as an engine keeps them in its own
    buffers; ``kernel`` is ``run`` of a wrapper planned once, ``kernel_with_plan``
    plans and runs on every call (the direct counterpart of "metadata included").
    Shared with ``benchmarks/host_overhead.py`` (a do-nothing ``flashinfer`` there).
    """
    import flashinfer
    import torch

    from attnreg.backends.declarations.flashinfer_mla import FLOAT_WORKSPACE_BYTES

    cfg = be.config
    B, H = q.shape[0], q.shape[1]
    lens = list(batch.seq_lens_cpu)
    ps = cfg.page_size
    pages = [-(-n // ps) for n in lens]
    qo_indptr = torch.arange(B + 1, dtype=torch.int32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
    kv_indices = torch.cat([batch.page_table[b, :pages[b]] for b in range(B)]).to(torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        workspace, backend=getattr(be.kernels, "mla_backend", "auto"))
    latent = cfg.kv_lora_rank

    def plan() -> None:
        wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                     kv_len_arr=kv_lens, num_heads=H, head_dim_ckv=latent,
                     head_dim_kpe=cfg.qk_rope_head_dim, page_size=ps, causal=False,
                     sm_scale=cfg.softmax_scale, q_data_type=q.dtype,
                     kv_data_type=pool.buffer.dtype)

    def kernel() -> None:
        wrapper.run(q[..., :latent], q[..., latent:], pool.buffer[..., :latent],
                    pool.buffer[..., latent:], out=out)

    def kernel_with_plan() -> None:
        plan()
        kernel()

    plan()
    return {"kernel": kernel, "kernel_with_plan": kernel_with_plan}


#: The direct-kernel paths of each backend: ``DIRECT[name](be, pool, batch, q, out)``.
DIRECT: dict[str, Callable[..., dict[str, Callable[[], Any]]]] = {
    "triton": triton_direct, "flashinfer_mla": flashinfer_direct}


def _measure(ctx: RunContext, variant: Variant, shape: tuple[int, int, int]) -> dict[str, Any]:
    from attnreg.runtime import decode_batch

    torch = ctx.torch
    B, L, H = shape
    torch.manual_seed(B + L + H)
    be = create_backend(ctx, variant, num_heads=H, page_size=1, max_context_len=L)
    pool = random_pool(ctx.torch, be.config, B * L, seed=H)
    batch = decode_batch(pool, [L] * B, pages=pool.allocate([L] * B, shuffle=L))
    q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=ctx.device)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=ctx.device)
    paths = DIRECT[variant.backend](be, pool, batch, q, out)

    def backend_with_metadata() -> None:
        be.init_forward_metadata(batch)
        be.forward_decode(q, None, None, pool, batch, out=out)

    def backend_planned() -> None:
        be.forward_decode(q, None, None, pool, batch, out=out)

    # Same answer first: the comparison is only fair if both run the same kernel work.
    paths["kernel"]()
    ref = out.float().clone()
    backend_with_metadata()
    ctx.sync()
    row: dict[str, Any] = {"variant": variant.label, "B": B, "L": L, "H": H,
                           "max_abs_diff_backend_vs_kernel": float((out.float() - ref).abs()
                                                                   .max())}
    splits = planned_splits(be.forward_metadata)
    if splits is not None:
        row["max_splits"] = splits
    paths["backend"] = backend_with_metadata
    be.init_forward_metadata(batch)
    paths["backend_planned_once"] = backend_planned
    for name, fn in paths.items():
        row[name] = ctx.time_back_to_back(fn)
    # "metadata included" on both sides where the kernel has a plan step of its own.
    base = row.get("kernel_with_plan", row["kernel"])["median_us"]
    row["baseline"] = "kernel_with_plan" if "kernel_with_plan" in row else "kernel"
    row["overhead"] = row["backend"]["median_us"] / base - 1.0
    row["overhead_planned_once"] = (row["backend_planned_once"]["median_us"]
                                    / row["kernel"]["median_us"] - 1.0)
    row["host_us"] = {n: row[n]["host_us"] for n in paths}
    ctx.log(f"P6 {variant.label} {shape}: direct {base:.1f} us/call, backend "
            f"{row['backend']['median_us']:.1f} (+{row['overhead']:.1%}), planned once "
            f"{row['backend_planned_once']['median_us']:.1f} "
            f"(+{row['overhead_planned_once']:.1%}); host us/call "
            + " / ".join(f"{n} {u:.1f}" for n, u in row["host_us"].items()))
    return row


def _worst(data: dict[str, Any], key: str = "overhead") -> dict[str, Any] | None:
    rows = [r for r in data.get("rows", []) if key in r]
    return max(rows, key=lambda r: r[key]) if rows else None


def p6_checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """The worst overhead over shapes and backends; over several runs, the median of each
    run's worst (P6 is host-bound: one run's figure moves up to 2x between runs)."""
    runs = runs or [data]
    values = [w["overhead"] for d in runs if (w := _worst(d))]
    worst = _worst(data)
    detail = (f"worst: {worst['variant']} at (B, L, H) = ({worst['B']}, {worst['L']}, "
              f"{worst['H']}) of {len([r for r in data.get('rows', []) if 'overhead' in r])} "
              "rows") if worst else ""
    if len(runs) > 1 and worst:
        detail = f"median of each run's worst row; in the file above, {detail}"
    return [median_of_runs("P6", "backend forward (metadata included) over the direct kernel "
                           "call, worst shape and backend", values, "overhead", "<=", goal=GOAL,
                           detail=detail)]


# ----------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------

def render_p6(data: dict[str, Any], page: Page) -> list[str]:
    rows = []
    for r in data.get("rows", []):
        shape = f"({r['B']}, {r['L']}, {r['H']})"
        if "overhead" not in r:
            rows.append([r.get("variant", "?"), shape,
                         r.get("error") or r.get("skipped", "-")] + [""] * 5)
            continue
        baseline = r.get("baseline", "kernel")
        base = r[baseline]["median_us"]
        host = r["host_us"]
        rows.append([r.get("variant", "triton"), shape,
                     f"{base:.1f} ({baseline.replace('_', ' ')})",
                     f"{r['backend']['median_us']:.1f}",
                     f"**{r['overhead'] * 100:+.1f}%**",
                     (f"{r['backend_planned_once']['median_us']:.1f} vs "
                     f"{r['kernel']['median_us']:.1f} "
                     f"({r['overhead_planned_once'] * 100:+.1f}%)"),
                     (f"{host[baseline]:.1f} / {host['backend']:.1f} / "
                     f"{host['backend_planned_once']:.1f}"),
                     fmt(r.get("max_splits"), "d")])
    out = [(f"{data.get('timing')}.  Direct: Triton's `mla_decode` with a preallocated "
           "workspace; flashinfer's wrapper driven by hand (`plan` + `run` per call when "
           "metadata is included, `run` of a wrapper planned once otherwise).  Backend: "
           "created by the registry, `init_forward_metadata` + `forward_decode` per call; "
           "planned once: `forward_decode` only."), "",
           md_table(["backend", "(B, L, H)", "direct us/call", "backend us/call",
                     "overhead", "planned once vs run only, us/call",
                     "host us to issue (direct / backend / planned once)", "splits"], rows)]
    out += not_run_notes(data, {})
    ok = [r for r in data.get("rows", []) if "overhead" in r]
    if page.plot.available and ok:
        fig, ax = page.plot.plt.subplots(figsize=(max(7, 1.2 * len(ok)), 3.8))
        groups = [f"{r.get('variant', '')}\n{r['B']},{r['L']},{r['H']}" for r in ok]
        bar_groups(ax, groups, {"metadata + forward": [r["overhead"] * 100 for r in ok],
                                "forward, planned once": [r["overhead_planned_once"] * 100
                                                          for r in ok]},
                   "% over the direct kernel call")
        ax.axhline(2.0, color="tab:red", ls="--", lw=1)
        ax.set_title("per-call overhead of the backend interface (goal <= 2%)")
        out += page.image(fig, "p6_overhead.png", "P6 overhead")
    return out + render_runs(page)


def render_runs(page: Page) -> list[str]:
    """Each run's worst overheads, and their medians (P6 is host-bound)."""
    runs = page.runs.get("P6", [])
    if len(runs) < 2:
        return []

    def worst(data: dict[str, Any], key: str) -> float | None:
        row = _worst(data, key)
        return row[key] if row else None

    def median(key: str) -> str:
        values = [v for _, d in runs if (v := worst(d, key)) is not None]
        return pct(statistics.median(values)) if values else "-"

    return ["", (f"P6 is bound by how fast the host issues calls: the same code on the same "
                 f"kind of machine moves from run to run.  The check above is the median of "
                 f"these {len(runs)} runs (more runs: `{REPEATS_COMMAND}`, brought back to "
                 f"`{rel(REPEATS_DIR, page.root)}/`)."), "",
            runs_table(runs, ["worst overhead", "worst, planned once"],
                       lambda d: [pct(worst(d, "overhead")),
                                  pct(worst(d, "overhead_planned_once"))],
                       [median("overhead"), median("overhead_planned_once")], page.root)]
