"""Probe: can the padding-row zeroing leave the captured decode's critical path? (issue 31)

Usage (a CUDA GPU with flash_mla and flashinfer)::

    PYTHONPATH=src:plugins/attnreg-flashmla/src python3 scripts/probe_padding_launch.py \
        --out probe-padding.json

The one launch attnreg's captured decode adds over the raw kernels (peers.wrapper) is the
padding-row fill after the kernel.  It must follow the kernel only where the kernel writes
those rows.  This probe measures, on the H200:

1. which rows each kernel writes for an empty (padding) sequence: FlashMLA's fp8 decode
   (length 0) and flashinfer's fa3 MLA (a request of ``kv_len`` 0 with one query row, in
   place of attnreg's filler request), eagerly and in a replayed graph, against output
   rows set to NaN first (flashinfer takes ``out=``; FlashMLA's own output is checked for
   exact zeros after replays of alternating padding);
2. the replay time (L2 flushed, :meth:`attnreg.profiling.Clock.calls`) of the raw call,
   the call with the fill after it (what attnreg does), the same fill as a programmatic
   dependent launch ("after, pdl": ``fill_flagged_rows_fused(..., dependent_launch=True)``,
   not used by the runtime until this measures it), and the call with the fill on a
   forked stream beside it (it then depends only on what came before the kernel).
   FlashMLA fp8's padded replays (half the batch empty) check the dependent fill's rows.

Nothing here is a claim; the numbers go to ``--out`` as JSON and to stdout.  The H200
runs of 2026-12-04: ``benchmarks/results/probes/h200-padding-launch.json`` (the script as of
d1ebf77), ``benchmarks/results/probes/h200-padding-rows.json`` (``--rows-only``) and
``benchmarks/results/probes/h200-padding-flashmla-rows.json`` (``--flashmla-rows``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((128, 4096, 128), (128, 4096, 16), (32, 8192, 16), (1, 32768, 16),
          (1, 32768, 128), (8, 1024, 128), (64, 2048, 64))


def padding_state(pad: Any) -> str:
    """What output rows set to NaN before a call hold after it: "unwritten" (the NaN
    stayed), "zero" or "other"."""
    import torch

    return ("unwritten" if bool(torch.isnan(pad).all()) else
            "zero" if bool((pad == 0).all()) else "other")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-padding.json")
    ap.add_argument("--rows-only", action="store_true",
                    help="only flashinfer's rows for requests of no key: fa3 and fa2, page 1 "
                         "and 64, eager and replayed (no timing)")
    ap.add_argument("--verify-rows", action="store_true",
                    help="as --rows-only for target-verify batches: 2 and 4 causal query rows "
                         "per request, padding requests of those rows and no key")
    ap.add_argument("--flashmla-rows", action="store_true",
                    help="only FlashMLA fp8's rows of empty sequences in replayed graphs, with "
                         "no fill and with the fill beside the kernel (no timing)")
    args = ap.parse_args()
    if args.rows_only:
        return rows_only(args.out)
    if args.verify_rows:
        return rows_only(args.out, rows_per_request=(2, 4))
    if args.flashmla_rows:
        return flashmla_rows(args.out)
    import flash_mla
    import flashinfer
    import torch

    from attnreg.profiling import Clock, random_pool
    from attnreg.runtime import GraphRunner, MLAConfig, decode_batch
    from attnreg.runtime._pad_rows_kernel import fill_flagged_rows_fused

    dev = "cuda"
    clock = Clock(torch, dev)
    side = torch.cuda.Stream()
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": [], "padding": []}

    def beside_after(ev: Any, launch: Any) -> None:
        """``launch()`` on the side stream after ``ev`` (recorded before the kernel), then
        the main stream waits for it: in a graph a branch parallel to the kernel."""
        main = torch.cuda.current_stream()
        side.wait_event(ev)
        with torch.cuda.stream(side):
            launch()
        main.wait_stream(side)

    def timed(call: Any) -> float:
        call()
        g = GraphRunner(dev).capture(call)
        g.replay()
        torch.cuda.synchronize()
        return round(clock.calls(g.replay)["median_us"], 2)

    for B, L, H in SHAPES:
        torch.manual_seed(B + L + H)
        q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=dev)
        flags = torch.zeros(B, dtype=torch.int32, device=dev)
        row: dict[str, Any] = {"B": B, "L": L, "H": H}
        # ---- FlashMLA fp8, the engine's fp8 q (rounded here)
        cfg = MLAConfig(num_heads=H, page_size=64, kv_dtype="fp8_e4m3", device=dev,
                        max_context_len=L)
        scale = cfg.softmax_scale
        pool = random_pool(torch, cfg, B * L, seed=B + L)
        batch = decode_batch(pool, [L] * B, shuffle=B + L)
        seq_lens = batch.seq_lens.to(torch.int32)
        table = batch.page_table.to(torch.int32)
        sched, splits = flash_mla.get_mla_decoding_metadata(seq_lens, H, 1, is_fp8_kvcache=True,
                                                            use_legacy=True)
        meta = flash_mla.get_mla_metadata()[0]
        meta.tile_scheduler_metadata, meta.num_splits = sched, splits
        k4 = pool.buffer.view(pool.buffer.shape[0], 64, 1, 576)
        amax = float(q.abs().amax().float())
        descale = 2.0 ** max(-126, math.ceil(math.log2(max(amax, 1e-30) / 448.0)))
        q8 = (q.view(B, 1, H, 576).float() / descale).to(torch.float8_e4m3fn)
        extra = {"is_fp8_kvcache": True, "descale_k": pool.scale_tensor,
                 "descale_q": torch.full((1,), descale, dtype=torch.float32, device=dev)}

        held: dict[str, Any] = {}

        def mla(mode: str) -> Any:
            def call() -> Any:
                ev = torch.cuda.Event()
                ev.record()
                out, _ = flash_mla.flash_mla_with_kvcache(q8, k4, table, seq_lens, 512, meta,
                                                          softmax_scale=scale, causal=False,
                                                          use_legacy=True, **extra)
                o = out.view(B, H, 512)
                if mode.startswith("after"):
                    fill_flagged_rows_fused(o, flags, 0.0, dependent_launch=mode == "after, pdl")
                elif mode == "beside":
                    beside_after(ev, lambda: fill_flagged_rows_fused(o, flags, 0.0))
                held["o"] = o  # under capture: the graph's own output tensor
                return o
            return call

        ref = mla("raw")().clone()
        for mode in ("raw", "after", "after, pdl", "beside"):
            out = mla(mode)()
            assert torch.equal(out, ref), f"flashmla {mode} differs at {(B, L, H)}"
            row[f"flashmla_fp8 {mode}"] = timed(mla(mode))
        # padding: the last half of the batch (at least one) empty, then full, in one graph
        if B > 1:
            live = B - max(1, B // 2)
            call = mla("after, pdl")
            call()
            g = GraphRunner(dev).capture(call)
            bad = 0
            for step in range(6):
                padded = step % 2 == 0
                lens = [L] * B if not padded else [L] * live + [0] * (B - live)
                seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
                flags.copy_(torch.tensor([0 if n else 1 for n in lens], dtype=torch.int32))
                s2, n2 = flash_mla.get_mla_decoding_metadata(seq_lens, H, 1,
                                                            is_fp8_kvcache=True,
                                                            use_legacy=True)
                sched.copy_(s2)
                splits.copy_(n2)
                g.replay()
                torch.cuda.synchronize()
                got = held["o"]
                if padded:
                    bad += int((got[live:] != 0).any()) + int(torch.isnan(got).any())
                else:
                    bad += int(not torch.equal(got, ref))
            seq_lens.fill_(L)
            flags.zero_()
            doc["padding"].append({"kernel": "flashmla_fp8, fill after (pdl)",
                                   "shape": [B, L, H], "replays_wrong": bad})
        # ---- flashinfer fa3, page 64, bf16
        cfg = MLAConfig(num_heads=H, page_size=64, kv_dtype="bf16", device=dev,
                        max_context_len=L)
        pool = random_pool(torch, cfg, B * L, seed=B + L + 1)
        batch = decode_batch(pool, [L] * B, shuffle=B + L)
        buf = pool.buffer
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        pages = -(-L // 64)

        def fi_wrapper(lens: list[int], graph: bool = False) -> Any:
            n = len(lens)
            extra: dict[str, Any] = {}
            if graph:
                ints = lambda k: torch.zeros(k, dtype=torch.int32, device=dev)  # noqa: E731
                extra = dict(use_cuda_graph=True, qo_indptr=ints(n + 1),
                             kv_indptr=ints(n + 1), kv_indices=ints(B * pages),
                             kv_len_arr=ints(n))
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3", **extra)

            def plan(lens2: list[int]) -> None:
                pg2 = [-(-m // 64) for m in lens2]
                ip = [0]
                for p in pg2:
                    ip.append(ip[-1] + p)
                ix = torch.cat([batch.page_table[b, :pg2[b]] for b in range(n) if pg2[b]]
                               ).to(torch.int32)
                w.plan(qo_indptr=torch.arange(n + 1, dtype=torch.int32),
                       kv_indptr=torch.tensor(ip, dtype=torch.int32), kv_indices=ix,
                       kv_len_arr=torch.tensor(lens2, dtype=torch.int32), num_heads=H,
                       head_dim_ckv=512, head_dim_kpe=64, page_size=64, causal=False,
                       sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=buf.dtype)
            plan(lens)
            return w, plan

        qn, qp = q[..., :512], q[..., 512:]
        out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=dev)
        w, _ = fi_wrapper([L] * B)

        def fi(mode: str) -> Any:
            def call() -> Any:
                if mode == "beside":
                    ev = torch.cuda.Event()
                    ev.record()
                    beside_after(ev, lambda: fill_flagged_rows_fused(out, flags, 0.0))
                w.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)
                if mode.startswith("after"):
                    fill_flagged_rows_fused(out, flags, 0.0,
                                            dependent_launch=mode == "after, pdl")
                return out
            return call

        fi("raw")()
        ref_fi = out.clone()
        for mode in ("raw", "after", "after, pdl", "beside"):
            fi(mode)()
            assert torch.equal(out, ref_fi), f"fa3 {mode} differs at {(B, L, H)}"
            row[f"fa3_p64 {mode}"] = timed(fi(mode))
        # padding requests of kv_len 0 (one query row each), eager and in a graph
        if B > 1:
            live = B - max(1, B // 2)
            lens = [L] * live + [0] * (B - live)
            w0, _ = fi_wrapper(lens)
            out.fill_(float("nan"))
            w0.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)
            torch.cuda.synchronize()
            eager = padding_state(out[live:])
            live_ok = bool(torch.allclose(out[:live].float(), ref_fi[:live].float(),
                                          atol=1e-2, rtol=1e-2))
            wg, plan = fi_wrapper([L] * B, graph=True)
            call = lambda: wg.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)  # noqa: E731
            call()
            g = GraphRunner(dev).capture(call)
            plan(lens)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            graph_rows = padding_state(out[live:])
            graph_live_ok = bool(torch.allclose(out[:live].float(), ref_fi[:live].float(),
                                                atol=1e-2, rtol=1e-2))
            doc["padding"].append({"kernel": "fa3_p64 kv_len 0", "shape": [B, L, H],
                                   "eager_rows": eager, "eager_live_ok": live_ok,
                                   "graph_rows": graph_rows, "graph_live_ok": graph_live_ok})
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(doc["padding"], indent=1))
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def flashmla_rows(out_path: str) -> int:
    """FlashMLA fp8 decode (fp8 q) captured with no padding fill ("none") and with the fill
    on a forked stream beside the kernel ("beside"), replayed full, padded (the last half
    of the sequences empty), full, padded...: for each replay, what the padding rows hold
    ("zero", "nan", "stale": the previous replay's rows, "other") and the largest
    difference of the live rows from an eager call over the same lengths."""
    import flash_mla
    import torch

    from attnreg.profiling import random_pool
    from attnreg.runtime import GraphRunner, MLAConfig, decode_batch
    from attnreg.runtime._pad_rows_kernel import fill_flagged_rows_fused

    dev = "cuda"
    side = torch.cuda.Stream()
    found: list[dict[str, Any]] = []
    for B, L, H in ((8, 1024, 128), (32, 8192, 16), (64, 2048, 64), (128, 4096, 16)):
        cfg = MLAConfig(num_heads=H, page_size=64, kv_dtype="fp8_e4m3", device=dev,
                        max_context_len=L)
        pool = random_pool(torch, cfg, B * L, seed=B + L)
        batch = decode_batch(pool, [L] * B, shuffle=B + L)
        seq_lens = batch.seq_lens.to(torch.int32)
        table = batch.page_table.to(torch.int32)
        k4 = pool.buffer.view(pool.buffer.shape[0], 64, 1, 576)
        q = torch.randn(B, 1, H, 576, device=dev)
        q8 = (q / 2.0 ** -4).to(torch.float8_e4m3fn)
        extra = {"is_fp8_kvcache": True, "descale_k": pool.scale_tensor,
                 "descale_q": torch.full((1,), 2.0 ** -4, dtype=torch.float32, device=dev)}
        flags = torch.zeros(B, dtype=torch.int32, device=dev)
        live = B // 2
        lens_of = {"full": [L] * B, "padded": [L] * live + [0] * (B - live)}
        for mode in ("none", "beside"):
            sched, splits = flash_mla.get_mla_decoding_metadata(
                seq_lens, H, 1, is_fp8_kvcache=True, use_legacy=True)
            meta = flash_mla.get_mla_metadata()[0]
            meta.tile_scheduler_metadata, meta.num_splits = sched, splits
            held: dict[str, Any] = {}

            def call() -> Any:
                ev = torch.cuda.Event()
                ev.record()
                out, _ = flash_mla.flash_mla_with_kvcache(
                    q8, k4, table, seq_lens, 512, meta, softmax_scale=cfg.softmax_scale,
                    causal=False, use_legacy=True, **extra)  # noqa: B023
                o = out.view(B, H, 512)
                if mode == "beside":  # noqa: B023
                    main = torch.cuda.current_stream()
                    side.wait_event(ev)
                    with torch.cuda.stream(side):
                        fill_flagged_rows_fused(o, flags, 0.0)  # noqa: B023
                    main.wait_stream(side)
                held["o"] = o  # noqa: B023
                return o

            def set_lens(kind: str) -> None:
                lens = lens_of[kind]  # noqa: B023
                seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))  # noqa: B023
                flags.copy_(torch.tensor([0 if n else 1 for n in lens], dtype=torch.int32))  # noqa: B023
                s2, n2 = flash_mla.get_mla_decoding_metadata(seq_lens, H, 1,  # noqa: B023
                                                            is_fp8_kvcache=True,
                                                            use_legacy=True)
                sched.copy_(s2)  # noqa: B023
                splits.copy_(n2)  # noqa: B023

            eager = {}
            for kind in ("full", "padded"):
                set_lens(kind)
                eager[kind] = call().clone()
            set_lens("full")
            call()
            g = GraphRunner(dev).capture(call)
            previous = None
            replays = []
            for step in range(6):
                kind = "full" if step % 2 == 0 else "padded"
                set_lens(kind)
                g.replay()
                torch.cuda.synchronize()
                got = held["o"].clone()
                n = live if kind == "padded" else B
                entry = {"replay": kind, "live_max_diff": float(
                    (got[:n].float() - eager[kind][:n].float()).abs().max())}
                if kind == "padded":
                    pad = got[live:]
                    entry["padding_rows"] = (
                        "zero" if bool((pad == 0).all()) else
                        "nan" if bool(torch.isnan(pad).any()) else
                        "stale" if previous is not None and torch.equal(pad, previous[live:])
                        else "other")
                replays.append(entry)
                previous = got
            result = {"shape": [B, L, H], "fill": mode, "replays": replays}
            found.append(result)
            print(json.dumps(result), flush=True)
    Path(out_path).write_text(json.dumps({"flashmla_fp8": found}, indent=1) + "\n")
    return 0


def rows_only(out_path: str, rows_per_request: tuple[int, ...] = (1,)) -> int:
    """flashinfer's output rows for requests of ``kv_len`` 0 beside real ones, per MLA
    backend, page size and query rows per request (1: a decode, not causal; more: a
    target-verify batch's draft rows, causal, whose padding requests have the same rows
    and no key), eagerly and in a graph replayed after a re-plan from the full batch:
    "zero", "unwritten" (the NaN set before stayed, or NaN written) or "other"; and
    whether the real rows match the full batch's."""
    import flashinfer
    import torch

    from attnreg.profiling import random_pool
    from attnreg.runtime import GraphRunner, MLAConfig, decode_batch

    dev = "cuda"
    found: list[dict[str, Any]] = []
    for backend, page, s_q, (B, L, H) in itertools.product(
            ("fa3", "fa2"), (1, 64), rows_per_request,
            ((8, 1024, 128), (32, 2048, 16), (4, 4096, 64))):
        cfg = MLAConfig(num_heads=H, page_size=page, kv_dtype="bf16", device=dev,
                        max_context_len=L)
        pool = random_pool(torch, cfg, B * L, seed=B + L + page)
        batch = decode_batch(pool, [L] * B, shuffle=B + L)
        buf = pool.buffer
        q = torch.randn(B * s_q, H, 576, dtype=torch.bfloat16, device=dev)
        qn, qp = q[..., :512], q[..., 512:]
        out = torch.empty(B * s_q, H, 512, dtype=torch.bfloat16, device=dev)
        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
        width = batch.page_table.shape[1]
        live = B // 2
        live_rows = live * s_q

        def plan(w: Any, lens: list[int]) -> None:
            w.plan(qo_indptr=torch.arange(0, (B + 1) * s_q, s_q, dtype=torch.int32),
                   kv_indptr=torch.arange(0, (B + 1) * width, width,
                                          dtype=torch.int32),
                   kv_indices=batch.page_table.reshape(-1).to(torch.int32),
                   kv_len_arr=torch.tensor(lens, dtype=torch.int32), num_heads=H,
                   head_dim_ckv=512, head_dim_kpe=64, page_size=page,
                   causal=s_q > 1, sm_scale=cfg.softmax_scale,
                   q_data_type=torch.bfloat16, kv_data_type=buf.dtype)

        full = [L] * B
        padded = [L] * live + [0] * (B - live)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
        plan(w, full)
        w.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)
        ref = out.clone()
        plan(w, padded)
        out.fill_(float("nan"))
        w.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)
        torch.cuda.synchronize()
        eager = padding_state(out[live_rows:])
        eager_ok = bool(torch.equal(out[:live_rows], ref[:live_rows]))
        ints = lambda k: torch.zeros(k, dtype=torch.int32, device=dev)  # noqa: E731
        wg = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            ws, backend=backend, use_cuda_graph=True, qo_indptr=ints(B + 1),
            kv_indptr=ints(B + 1), kv_indices=ints(B * width), kv_len_arr=ints(B))
        plan(wg, full)
        call = lambda: wg.run(qn, qp, buf[..., :512], buf[..., 512:], out=out)  # noqa: E731,B023
        call()
        g = GraphRunner(dev).capture(call)
        grid = tuple(int(x) for x in wg._plan_info[:2])
        plan(wg, padded)
        grid_padded = tuple(int(x) for x in wg._plan_info[:2])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        entry = {"backend": backend, "page": page, "rows_per_request": s_q,
                 "shape": [B, L, H], "eager_rows": eager, "eager_live_equal": eager_ok,
                 "graph_rows": padding_state(out[live_rows:]),
                 "graph_live_equal": bool(torch.equal(out[:live_rows], ref[:live_rows])),
                 "grid_full": grid, "grid_padded": grid_padded}
        found.append(entry)
        print(json.dumps(entry), flush=True)
    Path(out_path).write_text(json.dumps({"padding_rows": found}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
