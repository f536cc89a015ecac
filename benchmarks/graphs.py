"""P3 and P4: what CUDA graphs keep and what they buy.

P3 - split-KV under capture.  At B=1 a decode (or a short extend) over a long
KV has almost no parallelism unless the KV is split.  The ``triton`` backend
keeps split-KV inside a captured graph (static grid, split counts computed on
the device); ``force_kv_splits=1`` is what a backend that must force one split
under capture (seed 000 defect 2) gets.  Both are captured (decode under FULL,
extend under BREAKABLE) and their replays timed at L in {8k, 32k, 128k}.  Any
other backend that captures (flashinfer's host-planned split) is timed as a
reference row.

P4 - launch overhead.  One decode step of an 8-layer DeepSeek-shaped MLA stack
(:mod:`benchmarks._mla_stack`), eager (metadata planned each step, as an engine
does) against CUDA graph replay (``init_forward_metadata_replay`` + replay), per
backend, at B in {1, 8, 64}.  The step's memory floor (weights + KV over the
copy bandwidth) bounds what a graph can reach.
"""

from __future__ import annotations

from typing import Any

from ._backends import (
    PREFILL_VARIANTS,
    Variant,
    available_variants,
    create_backend,
    declared_reasons,
    random_pool,
    reference_decode,
    rel_error,
)
from ._harness import RunContext, SkipSection
from ._mla_stack import DEEPSEEK, MLAStack, StackShape
from .ceilings import copy_gbps
from .metrics import evaluate

# -- P3 ------------------------------------------------------------------------------------
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

# -- P4 ------------------------------------------------------------------------------------
P4_BATCHES = (1, 8, 64)
P4_DRY_BATCHES = (1, 2)
P4_SEQ_LEN = 2048
P4_DRY_SEQ_LEN = 48
P4_DRY_SHAPE = StackShape(layers=2, hidden=256, q_lora=128, heads=16)


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
    data["extend_kernel_split_params"] = _extend_split_params()
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
                                     "error": f"{type(exc).__name__}: {exc}"})
                ctx.log(f"P3 H={heads} L={length}: {data['rows'][-1]['error']}")
            ctx.save()
    target_len = ctx.pick(P3_TARGET_LEN, P3_TARGET_LEN, P3_DRY_TARGET_LEN)
    data["target_len"] = target_len
    data["checks"] = [c.to_dict() for c in p3_checks(data, target_len)]


def _extend_split_params() -> list[str]:
    """Split-KV parameters of the Triton ``mla_extend`` (recorded: the miss explanation of P3
    extend depends on whether it has any)."""
    import inspect

    from attnreg.backends._triton_kernels import mla_extend

    params = inspect.signature(mla_extend).parameters
    return [p for p in params if "split" in p]


def _p3_point(ctx: RunContext, heads: int, length: int, extend: int,
              variants: list[Variant]) -> dict[str, Any]:
    from attnreg.backends.base import MLAConfig
    from attnreg.backends.batch import decode_batch, extend_batch

    torch = ctx.torch
    torch.manual_seed(length + heads)
    cfg = MLAConfig(num_heads=heads, page_size=1, device=ctx.device)
    pool = random_pool(ctx, cfg, length + extend, seed=length)
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
            be.init_cuda_graph_state(1, extend, max_seq_len=length + extend,
                                     graph_modes={"decode": "full", "prefill": "breakable"})
        except Exception as exc:  # noqa: BLE001
            row["results"][v.label] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        for kind, (batch, q, ref) in inputs.items():
            if kind in undeclared:
                continue
            try:
                res[kind] = _p3_graph(ctx, be, kind, batch, q, ref, pool)
            except Exception as exc:  # noqa: BLE001
                res[kind] = {"error": f"{type(exc).__name__}: {exc}"}
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

    torch = ctx.torch
    rows, heads = q.shape[0], q.shape[1]
    tokens = batch.num_tokens
    out = torch.full((rows, heads, 512), float("nan"), dtype=q.dtype, device=q.device)
    be.init_forward_metadata_capture(1, tokens, batch)
    if kind == "decode":
        graph = ctx.capture(lambda: be.forward_decode(q, None, None, pool, None, out=out),
                            GraphMode.FULL)
    else:
        graph = ctx.capture(lambda: be.forward_extend(q, None, None, pool, None,
                                                      method=ForwardMethod.MLA, out=out),
                            GraphMode.BREAKABLE)
    be.init_forward_metadata_replay(1, tokens, batch)
    out.fill_(float("nan"))
    graph.replay()
    ctx.sync()
    err = rel_error(ctx, out, ref)
    timing = ctx.time(graph.replay)
    res: dict[str, Any] = {"us": timing["median_us"], "timing": timing, "rel_err": err,
                           "correct": err <= MAX_REL_ERR}
    md = be.forward_metadata
    key = "max_splits" if kind == "decode" else "extend_splits"  # the triton backend's
    if md is not None and md.extras.get(key) is not None:
        res["max_splits"] = int(md.extras[key])
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


def p3_checks(data: dict[str, Any], target_len: int) -> list[Any]:
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
# P4
# ----------------------------------------------------------------------------------------

def run_p4(ctx: RunContext, data: dict[str, Any]) -> None:
    from attnreg.backends.base import MLAConfig
    from attnreg.backends.batch import decode_batch

    torch = ctx.torch
    variants, skipped = available_variants(ctx, PREFILL_VARIANTS)
    variants = [v for v in variants if v.backend != "reference"]
    if not variants:
        raise SkipSection(f"no backend that captures decode can run here: {skipped}")
    shape: StackShape = ctx.pick(DEEPSEEK, DEEPSEEK, P4_DRY_SHAPE)
    batches = ctx.pick(P4_BATCHES, P4_BATCHES, P4_DRY_BATCHES)
    seq_len = ctx.pick(P4_SEQ_LEN, P4_SEQ_LEN, P4_DRY_SEQ_LEN)
    copy = copy_gbps(ctx)
    max_b = max(batches)
    cfg = MLAConfig(num_heads=shape.heads, page_size=1, device=ctx.device,
                    max_context_len=seq_len)
    stack = MLAStack(torch, shape, ctx.device, max_positions=seq_len + 1)
    pools = [random_pool(ctx, cfg, max_b * seq_len, seed=100 + i) for i in range(shape.layers)]
    pages = pools[0].allocate([seq_len] * max_b, shuffle=7)
    batches_by_b = {b: decode_batch(pools[0], [seq_len] * b, pages=pages[:b]) for b in batches}
    data.update(shape=shape.__dict__, seq_len=seq_len, batches=list(batches),
                weight_bytes=shape.weight_bytes, copy_GBps=copy,
                variants=[v.label for v in variants], skipped_variants=skipped, rows=[],
                timing="one step incl. metadata (eager: init_forward_metadata; graph: "
                       "init_forward_metadata_replay + replay), L2 flushed")
    for v in variants:
        if ctx.out_of_time():
            data["rows"].append({"variant": v.label, "skipped": "time budget used up"})
            continue
        reasons = declared_reasons(ctx, v, "mla", "decode", heads=shape.heads,
                                   head_dims=(576, 512))
        if reasons:
            data["rows"].append({"variant": v.label, "not_declared": "; ".join(reasons)})
            continue
        try:
            be = create_backend(ctx, v, num_heads=shape.heads, page_size=1,
                                max_context_len=seq_len)
            be.init_cuda_graph_state(max_b, max_b, max_seq_len=seq_len,
                                     graph_modes={"decode": "full"})
        except Exception as exc:  # noqa: BLE001
            data["rows"].append({"variant": v.label, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for b in batches:
            row = {"variant": v.label, "B": b}
            try:
                row.update(_p4_point(ctx, stack, be, pools, batches_by_b[b], b, seq_len))
                kv_bytes = shape.layers * b * seq_len * 576 * 2
                row["floor_bytes"] = shape.weight_bytes + kv_bytes
                if copy:
                    row["floor_us"] = row["floor_bytes"] / (copy * 1e3)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
            data["rows"].append(row)
            ctx.log(f"P4 {v.label} B={b}: " + (
                f"eager {row['eager_us']:.0f} us, graph {row['graph_us']:.0f} us, "
                f"{row['speedup']:.2f}x" if "speedup" in row else row.get("error", "?")))
            ctx.save()
    data["checks"] = [c.to_dict() for c in p4_checks(data)]


def _p4_point(ctx: RunContext, stack: MLAStack, be: Any, pools: list[Any], batch: Any,
              b: int, seq_len: int) -> dict[str, Any]:
    from attnreg.registry import GraphMode

    torch = ctx.torch
    x = torch.randn(b, stack.shape.hidden, dtype=torch.bfloat16, device=ctx.device)
    positions = (batch.seq_lens - 1).long()

    def eager_step() -> Any:
        be.init_forward_metadata(batch)
        return stack.forward(x, positions, be, pools, batch)

    eager_out = eager_step()
    ctx.sync()
    be.init_forward_metadata_capture(b, b, batch)
    graph_out = torch.empty_like(eager_out)
    graph = ctx.capture(lambda: graph_out.copy_(stack.forward(x, positions, be, pools, None)),
                        GraphMode.FULL)

    def graph_step() -> None:
        be.init_forward_metadata_replay(b, b, batch)
        graph.replay()

    graph_out.fill_(float("nan"))
    graph_step()
    ctx.sync()
    err = rel_error(ctx, graph_out, eager_out.float())
    eager = ctx.time(eager_step)
    replay = ctx.time(graph_step)
    return {"eager_us": eager["median_us"], "graph_us": replay["median_us"],
            "eager_timing": eager, "graph_timing": replay,
            "speedup": eager["median_us"] / replay["median_us"],
            "graph_vs_eager_rel_err": err, "finite": bool(torch.isfinite(eager_out).all())}


def p4_checks(data: dict[str, Any]) -> list[Any]:
    checks = []
    for label in data.get("variants", []):
        if any(r.get("variant") == label and r.get("not_declared") for r in data.get("rows", [])):
            continue  # the declaration says it has no decode here: no figure is owed
        row = next((r for r in data.get("rows", []) if r.get("variant") == label
                    and r.get("B") == 1), None)
        checks.append(evaluate(f"P4 {label}", f"{label}: eager / graph step time at B=1",
                               row.get("speedup") if row else None, "x", ">=", target=3.0))
    return checks
