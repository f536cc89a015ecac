"""Time the Triton MLA decode kernel on an NVIDIA GPU and (optionally) sweep its configs.

Usage::

    PYTHONPATH=src python3 benchmarks/triton_decode_tuning.py --out decode.json
    PYTHONPATH=src python3 benchmarks/triton_decode_tuning.py --sweep --out sweep.json

What it measures
----------------
* The 7 reference shapes (B, L, H) at bf16, page_size 1, a shuffled page table, with
  ``triton.testing.do_bench`` (median; do_bench flushes L2 between repetitions, so these
  are cold-cache times).  Each time is printed next to the flashinfer fa3 and the widely
  used Triton MLA kernel times measured on an H200 (given, not re-measured here), with the
  geometric mean of our time / fa3 time.
* Split-KV against ``force_num_splits=1`` at B=1, H=128, L in {8192, 32768, 131072},
  both captured in a CUDA graph and timed by graph replay.
* ``--sweep``: every candidate launch config on every shape (compiled in parallel worker
  processes first), each checked against a float32 torch reference before it is timed.

Prints a table and writes everything as JSON to ``--out``.

What the sweeps on one H200 (triton 3.6, torch 2.11) showed, and why the defaults are
what they are (see ``decode_config`` in ``_triton_kernels/decode.py``):

* 64+ heads (B=128, L=4096, H=128, eager): BLOCK_H 64, 8 warps, BLOCK_N 64,
  num_stages 3, ``isolate_qk``: 536 us.  At BLOCK_N 32 / num_stages 3 the duplicated-QK
  layout Triton picks by default took 816 us against 750 with ``isolate_qk``;
  num_stages 2 at BLOCK_N 64 took 793 us; BLOCK_N 32 with 3 buffers (num_stages 5)
  630 us; BLOCK_N 16 1195 us; V split over two 4-warp programs 1616 us.  An L2 bulk
  prefetch of the next tile made most shapes slower (540 -> 648 us here) and was removed.
* 16 heads: BLOCK_H 16 (mma.sync, warps split the tokens), BLOCK_N 64, 4 warps, and
  splits sized for two resident programs per SM (B=128, L=4096: ~250 us with 1 split,
  ~184 us with 2).
* Eager timings include the Python cost of two Triton launches (tens of us on the
  device's CPU), which dominates the small shapes; the graph column is kernel time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the helpers are benchmarks'
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._backends import worst_row_rel_error  # noqa: E402
from benchmarks._report import Page, ResultsFile, fmt, md_table, rel  # noqa: E402
from benchmarks.metrics import Check  # noqa: E402

# torch is imported where it is used: the docs renderer imports this module for render().

SHAPES = [(128, 4096, 128), (128, 4096, 16), (32, 8192, 16), (1, 32768, 16),
          (1, 32768, 128), (8, 1024, 128), (64, 2048, 64)]
FA3_US = [283, 169, 96, 53, 47, 25, 64]
TRITON_REF_US = [2396, 342, 184, 94, 177, 75, 304]
GRAPH_LENS = [8192, 32768, 131072]


def _kernels():
    from attnreg.backends._triton_kernels import decode as dec
    return dec


def make_inputs(B, L, H, page_size=1, dtype=None, kv_dtype=None, seed=0, device="cuda"):
    """Random q / cache with a shuffled page table (each sequence L tokens)."""
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator(device=device).manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    pages_per_seq = math.ceil(L / page_size)
    npages = B * pages_per_seq
    cache = torch.randn(npages, page_size, 576, device=device, dtype=torch.float32,
                        generator=g).to(kv_dtype)
    perm = torch.randperm(npages, device=device, generator=g).to(torch.int32)
    table = perm.view(B, pages_per_seq).contiguous()
    q = torch.randn(B, H, 576, device=device, dtype=torch.float32, generator=g).to(dtype)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
    out = torch.empty(B, H, 512, device=device, dtype=dtype)
    return q, cache, table, seq_lens, out


def reference(q, cache, table, seq_lens, sm_scale, kv_scale=1.0, max_b=None):
    """float32 torch reference ``[B, H, 512]`` of every sequence (or the first ``max_b``).

    Every sequence by default: a race or a missed tile in the last programs of a launch
    shows only in the last rows of the output.
    """
    import torch

    ps = cache.shape[1]
    outs = []
    for b in range(q.shape[0] if max_b is None else min(max_b, q.shape[0])):
        L = int(seq_lens[b])
        t = torch.arange(L, device=q.device)
        rows = cache[table[b, t // ps].long(), t % ps].float() * kv_scale
        s = (q[b].float() @ rows.T) * sm_scale
        outs.append(torch.softmax(s, -1) @ rows[:, :512])
    return torch.stack(outs)


def max_abs_error(out, ref) -> float:
    """Largest ``|out - ref|`` over ``ref``'s rows; ``inf`` where ``out`` is not finite.

    Fill ``out`` with NaN before the run: a row the kernel never wrote then counts as
    wrong, instead of passing on what an earlier run left in the allocation.
    """
    diff = (out[:ref.shape[0]].float() - ref).abs()
    return float(diff.max()) if bool(diff.isfinite().all()) else float("inf")


def splits_for(cfg, B, H, L, num_sms):
    return _kernels().splits_for_config(cfg, B, H, L, num_sms)


def run_cfg(q, cache, table, seq_lens, out, cfg, splits, ws=None, sm_scale=0.1):
    dec = _kernels()
    return dec._mla_decode_impl(q, cache, table, seq_lens, out, sm_scale=sm_scale,
                                kv_scale=1.0, num_splits=splits,
                                min_chunk=max(cfg.block_n, cfg.min_chunk), workspace=ws,
                                cfg=cfg)


def candidate_configs(H):
    """Configs the sweep tries (kernel params x split-heuristic params).

    Earlier sweeps on the H200 (recorded in the module docstring) already dropped: an L2
    bulk-prefetch of the next tile (slower everywhere), BLOCK_N 16, num_stages 2 at
    BLOCK_N 64, and the duplicated-QK layout (isolate_qk=False) for 64 heads.
    """
    C = _kernels().DecodeConfig
    if H <= 16:
        return [C(16, 64, 4, 2, ctas_per_sm=2), C(16, 64, 4, 2, ctas_per_sm=1),
                C(16, 64, 4, 2, ctas_per_sm=4), C(16, 128, 8, 2, ctas_per_sm=1),
                C(16, 64, 4, 2, ctas_per_sm=2, min_chunk=512)]
    return [C(64, 64, 8, 3, isolate_qk=True), C(64, 64, 8, 3, isolate_qk=True, min_chunk=128),
            C(64, 32, 8, 5, isolate_qk=True)]


def _kernel_key(cfg):
    return tuple(cfg._replace(ctas_per_sm=1, min_chunk=256))



def _precompile_worker(job):
    """Compile one kernel variant (config x split flag) on tiny inputs."""
    import torch

    H, cfg_t, split = job
    try:
        dec = _kernels()
        cfg = dec.DecodeConfig(*cfg_t)
        q, cache, table, sl, out = make_inputs(1, 512, H)
        splits = 2 if split else 1
        ws = dec.mla_decode_workspace(1, H, splits, "cuda") if split else None
        run_cfg(q, cache, table, sl, out, cfg, splits, ws)
        torch.cuda.synchronize()
        k = dec._LAST_LAUNCH.get("decode")
        info = (f"ok regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} "
                f"smem={getattr(getattr(k, 'metadata', None), 'shared', '?')}")
        return (H, cfg_t, split, info)
    except Exception as e:
        return (H, cfg_t, split, f"{type(e).__name__}: {str(e)[:300]}")


def compile_in_workers(worker, jobs, workers, what="variants"):
    """``[worker(job) for job in jobs]``, each in one of ``workers`` spawned processes (the
    Triton binaries land in the shared cache, so the timed process only loads them)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t = time.time()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(worker, jobs))
    print(f"compiled {len(jobs)} {what} in {time.time() - t:.1f}s", flush=True)
    return res


def compile_report(worker, jobs, workers) -> dict:
    """:func:`compile_in_workers` over the sorted ``jobs`` (``worker`` returns ``(job,
    status)``): ``job -> status``, each printed as a ``kernel`` line."""
    compiled = dict(compile_in_workers(worker, sorted(jobs), workers, "kernels"))
    for job, status in sorted(compiled.items()):
        print("kernel", job, status, flush=True)
    return compiled


def precompile(jobs, workers):
    return compile_in_workers(_precompile_worker, jobs, workers)


def bench(fn, rep=60):
    import triton
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median") * 1000.0


def graph_of(fn):
    """``fn`` (already compiled) captured by attnreg's one graph runner; ``.replay`` it.

    On a machine without CUDA the runner records no device graph (replay re-runs ``fn``).
    """
    from attnreg.runtime import GraphRunner

    return GraphRunner().capture(fn)


def time_shapes(configs_for, num_sms, results, tag):
    import torch

    dec = _kernels()
    rows = []
    for (B, L, H), fa3, tref in zip(SHAPES, FA3_US, TRITON_REF_US, strict=True):
        q, cache, table, sl, out = make_inputs(B, L, H)
        ref = reference(q, cache, table, sl, 0.1)
        for cfg, splits in configs_for(B, L, H):
            rec = dict(tag=tag, B=B, L=L, H=H, cfg=list(cfg), splits=splits, fa3_us=fa3,
                       triton_ref_us=tref)
            try:
                ws = dec.mla_decode_workspace(B, H, splits, "cuda") if splits > 1 else None
                out.fill_(float("nan"))
                run_cfg(q, cache, table, sl, out, cfg, splits, ws)
                torch.cuda.synchronize()
                rec["rel_err"] = worst_row_rel_error(torch, out, ref)
                if not rec["rel_err"] < 2e-2:
                    rec["error"] = "WRONG"
                else:
                    def fn(q=q, cache=cache, table=table, sl=sl, out=out, cfg=cfg,
                           splits=splits, ws=ws):
                        run_cfg(q, cache, table, sl, out, cfg, splits, ws)
                    # Primary number: CUDA-graph replay (the decode runs captured in
                    # serving; eager adds the Python launch cost of two Triton launches).
                    rec["us"] = bench(graph_of(fn).replay, rep=30 if tag == "sweep" else 60)
                    if tag != "sweep":
                        rec["eager_us"] = bench(fn)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(rec)
            results.append(rec)
            us = rec.get("us")
            eager = f" (eager {rec['eager_us']:.1f} us)" if "eager_us" in rec else ""
            print(f"[{tag}] B={B:4d} L={L:6d} H={H:4d} cfg={tuple(cfg)} splits={splits:3d} "
                  f"err={rec.get('rel_err', float('nan')):.1e} "
                  + (f"{us:8.1f} us graph  x{us / fa3:.2f} fa3{eager}" if us
                     else rec.get("error", "")), flush=True)
        torch.cuda.empty_cache()
    return rows


def graph_compare(num_sms, results, H=128):
    import torch

    from attnreg.backends._triton_kernels import (
        default_max_splits,
        mla_decode,
        mla_decode_workspace,
    )
    rows = []
    for L in GRAPH_LENS:
        q, cache, table, sl, out = make_inputs(1, L, H)
        splits = default_max_splits(1, H, L, num_sms)
        ws = mla_decode_workspace(1, H, splits, "cuda")
        times = {}
        for name, force in (("split", None), ("one_split", 1)):
            def call(q=q, cache=cache, table=table, sl=sl, out=out, splits=splits, ws=ws,
                     force=force):
                mla_decode(q, cache, table, sl, out, sm_scale=0.1, max_splits=splits,
                           workspace=ws, force_num_splits=force)
            times[name] = bench(graph_of(call).replay)
        rec = dict(tag="graph", B=1, L=L, H=H, splits=splits, split_us=times["split"],
                   one_split_us=times["one_split"],
                   speedup=times["one_split"] / times["split"])
        print(f"[graph] B=1 L={L:6d} H={H} splits={splits:3d} split {times['split']:8.1f} us  "
              f"one-split {times['one_split']:8.1f} us  speedup x{rec['speedup']:.2f}",
              flush=True)
        results.append(rec)
        rows.append(rec)
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--sweep", action="store_true", help="sweep candidate configs")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes")
    ap.add_argument("--no-graph", action="store_true")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dec = _kernels()
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    results: list[dict] = []
    meta = dict(device=props.name, num_sms=num_sms, torch=torch.__version__,
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command=" ".join(["python3", "benchmarks/triton_decode_tuning.py", *sys.argv[1:]]))
    import triton
    meta["triton"] = triton.__version__
    print(meta, flush=True)

    if args.sweep:
        jobs = set()
        for (B, L, H) in SHAPES:
            for cfg in candidate_configs(H):
                for split in (True, False):
                    jobs.add((16 if H <= 16 else 128, _kernel_key(cfg), split))
        comp = precompile(sorted(jobs), args.workers)
        for h, c, sp, st in comp:
            print("kernel", c, "split" if sp else "one-split", st, flush=True)
        meta["kernels"] = [[list(c), sp, st] for h, c, sp, st in comp]
        bad = {(c, sp): st for h, c, sp, st in comp if not st.startswith("ok")}
        for k, v in bad.items():
            print("compile/run failed:", k, v, flush=True)

        def sweep_cfgs(B, L, H):
            seen = set()
            for cfg in candidate_configs(H):
                s = splits_for(cfg, B, H, L, num_sms)
                key = (_kernel_key(cfg), s, max(cfg.block_n, cfg.min_chunk))
                if key in seen or (_kernel_key(cfg), s > 1) in bad:
                    continue
                seen.add(key)
                yield cfg, s
        rows = time_shapes(sweep_cfgs, num_sms, results, "sweep")
        best = {}
        for r in rows:
            if r.get("us"):
                k = (r["B"], r["L"], r["H"])
                if k not in best or r["us"] < best[k]["us"]:
                    best[k] = r
        print("\n=== best per shape (sweep) ===")
        for k, r in best.items():
            print(k, r["cfg"], r["splits"], f"{r['us']:.1f} us", f"x{r['us'] / r['fa3_us']:.2f}")
        if len(best) == len(SHAPES):
            meta["sweep_best_geomean_vs_fa3"] = math.exp(
                sum(math.log(r["us"] / r["fa3_us"]) for r in best.values()) / len(best))
            print("best-of-sweep geo-mean vs fa3:", meta["sweep_best_geomean_vs_fa3"])

    def default_cfgs(B, L, H):
        cfg = dec.decode_config(H, torch.bfloat16)
        yield cfg, dec.default_max_splits(B, H, L, num_sms)
    rows = time_shapes(default_cfgs, num_sms, results, "default")
    ratios = [r["us"] / r["fa3_us"] for r in rows if r.get("us")]
    if len(ratios) == len(SHAPES):
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        meta["geomean_vs_fa3"] = gm
        gm_ref = math.exp(sum(math.log(r["us"] / r["triton_ref_us"]) for r in rows)
                          / len(rows))
        meta["geomean_vs_triton_ref"] = gm_ref
    if not args.no_graph:
        graph_compare(num_sms, results)

    print("\n=== default config, bf16, page_size 1, cold L2; us (graph replay / eager); "
          "fa3 and triton-ref times are the given H200 numbers ===")
    print(f"{'B':>4} {'L':>6} {'H':>4} {'splits':>6} {'graph':>8} {'eager':>8} {'fa3':>6} "
          f"{'x fa3':>6} {'tri-ref':>7}")
    for r in rows:
        us = r.get("us")
        ours = f"{us:8.1f}" if us else str(r.get("error", "?"))[:8]
        eager = f"{r['eager_us']:8.1f}" if "eager_us" in r else "-"
        ratio = f"{us / r['fa3_us']:6.2f}" if us else "-"
        print(f"{r['B']:>4} {r['L']:>6} {r['H']:>4} {r['splits']:>6} {ours:>8} {eager:>8} "
              f"{r['fa3_us']:>6} {ratio:>6} {r['triton_ref_us']:>7}")
    if "geomean_vs_fa3" in meta:
        print(f"geo-mean (graph) ours/fa3 = {meta['geomean_vs_fa3']:.3f}   "
              f"ours/triton-ref = {meta['geomean_vs_triton_ref']:.3f}")
        eg = [r["eager_us"] / r["fa3_us"] for r in rows if "eager_us" in r]
        if len(eg) == len(SHAPES):
            meta["geomean_eager_vs_fa3"] = math.exp(sum(math.log(x) for x in eg) / len(eg))
            print(f"geo-mean (eager) ours/fa3 = {meta['geomean_eager_vs_fa3']:.3f}")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)



# ----------------------------------------------------------------------------------------
# rendering (python -m benchmarks.render: results/tuning/*.json)
# ----------------------------------------------------------------------------------------

TITLE = "Triton decode kernel: default configuration and split-KV in a graph"
RESULTS = ("tuning", "*.json")
COMMAND = "PYTHONPATH=src python3 benchmarks/triton_decode_tuning.py --out $OUT/final.json"


def read(path: Path) -> dict[str, Any]:
    """A results file of this script (``ValueError`` for anything else)."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{path}: not a results file of benchmarks/triton_decode_tuning.py "
                         "(needs meta and results)")
    return dict(doc)


def where(doc: dict[str, Any]) -> str:
    return str(doc["meta"].get("device", "?"))


def checks(doc: dict[str, Any]) -> list[Check]:
    """None: P1 and P3 carry the targets; this is the kernel's own sweep."""
    return []


def render(files: list[ResultsFile], page: Page) -> list[str]:
    """The default configuration per shape against the given fa3 times, and split-KV."""
    lines = [f"## {TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{COMMAND}` on the device.", ""]
    for f in files:
        m = f.doc["meta"]
        rows = [r for r in f.doc["results"] if r.get("tag") == "default"]
        graph = [r for r in f.doc["results"] if r.get("tag") == "graph"]
        when = m.get("date_utc") or "date not recorded (the script wrote none then)"
        lines += [f"*Measured* {when} on {m.get('device')} ({m.get('num_sms')} SMs); torch "
                  f"{m.get('torch')}, triton {m.get('triton')}.  \n*Command:* "
                  f"`{m.get('command') or COMMAND}`; data: `{rel(f.path, page.root)}`.", "",
                  ("`triton.testing.do_bench` median, cold L2, bf16, page size 1, shuffled page "
                   "table.  fa3 times are the figures given in issue 4, not measured in this "
                   "run (P1 measures both side by side).  Why the defaults are what they are: "
                   "[benchmarks-triton-tuning.md](benchmarks-triton-tuning.md)."), "",
                  md_table(["(B, L, H)", "splits", "graph us", "eager us", "fa3 us (issue 4)",
                            "graph / fa3"],
                           [[f"({r['B']}, {r['L']}, {r['H']})", str(r["splits"]),
                             fmt(r.get("us"), ".1f"), fmt(r.get("eager_us"), ".1f"),
                             str(r["fa3_us"]), fmt(r["us"] / r["fa3_us"] if r.get("us") else None,
                                                   ".2f")] for r in rows]), ""]
        if m.get("geomean_vs_fa3"):
            lines += [f"Geo-mean over the shapes, ours / fa3: {m['geomean_vs_fa3']:.2f} (graph), "
                      f"{fmt(m.get('geomean_eager_vs_fa3'), '.2f')} (eager: two Triton launches "
                      "cost Python time that the graph removes).", ""]
        if graph:
            lines += [f"Split-KV inside a CUDA graph against `force_num_splits=1`, B=1, "
                      f"H={graph[0]['H']}:", "",
                      md_table(["L", "splits", "split us", "one split us", "speed-up"],
                               [[str(r["L"]), str(r["splits"]), f"{r['split_us']:.1f}",
                                 f"{r['one_split_us']:.1f}", f"{r['speedup']:.1f}x"]
                                for r in graph]), ""]
    return lines


if __name__ == "__main__":
    main()
