"""Probe: the triton backend's captured decode against its own kernel called directly.

Usage (a CUDA GPU; ``TRITON_INTERPRET=1 ... --device cpu --small`` checks the script)::

    PYTHONPATH=src python3 scripts/probe_triton_backend_gap.py --out backend_gap.json

The H100 peers run of 2026-12-07 (benchmarks/results/probes/h100-peers-run4.json) timed
the triton backend over an fp8 cache at page 1, (B, L, H) = (128, 4096, 16), at 220.1 us;
the kernel probe (scripts/probe_triton_fp8_mma.py) timed the same kernel config at
188.8-190.1 us.  At page 64 the two agree.  To say whether the backend or the inputs
cost the difference, this times three paths per shape, page size and KV dtype in one
process, by one clock (``triton.testing.do_bench`` on a graph replay, L2 flushed,
median, us):

* ``kernel, probe inputs``: the tuning probes' cache and page table
  (``benchmarks.triton_decode_tuning.make_inputs``), the kernel called directly;
* ``kernel, pool inputs``: the peers run's pool and decode batch (``random_pool``,
  ``decode_batch`` with its shuffle), the kernel called directly with the backend's
  split count and the pool's scale tensor;
* ``backend, session``: the registry's ``triton`` backend captured by a
  ``GraphSession`` as the peers run captures it (its replay, inputs already in place).

Each output is checked against a float32 reference over every sequence first
(``err``: the worst sequence's relative error).

``--bisect`` instead takes the session's own launch apart (the 16-head shapes at page 1,
where the session was 5% over its kernel on 2026-12-07): it records the arguments the
backend's captured forward passes to ``mla_decode`` (the session's static q, output,
page-table and length views, its workspace, the pool's scale tensor), then times

* ``backend, session``: the session's graph, as above;
* ``kernel, session args``: a graph of ``mla_decode`` called directly on exactly those
  arguments;
* ``kernel, session args, own X``: the same with one argument replaced by a fresh
  contiguous copy (X: table, seq_lens, q, out, workspace, scale), and with all of them;

and lists the kernels each graph's replays run (``torch.profiler``: calls per replay,
mean us).  If the direct call on the session's arguments takes the session's time, the
arguments cost it (the one that brings it back down says which); if it takes the
kernel's, the session's graph runs something else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = ((128, 4096, 16), (32, 8192, 16), (64, 2048, 64))
BISECT_SHAPES = ((128, 4096, 16), (32, 8192, 16))
#: ``mla_decode``'s positional arguments, and what the bisect calls its keywords
POSITIONAL = ("q", "cache", "table", "seq_lens", "out")
KEYWORD = {"kv_scale": "scale"}
#: the arguments ``--bisect`` replaces, one at a time
OWN = ("table", "seq_lens", "q", "out", "workspace", "scale")
SMALL = ((3, 40, 16),)
PAGES = (1, 64)
SMALL_PAGES = (1, 16)


def run_meta(torch, dev: str, flags: str) -> dict:
    """The run's header: device, torch, date and the command that reproduces it."""
    return dict(device=torch.cuda.get_device_name(0) if dev == "cuda" else dev,
                torch=torch.__version__,
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="PYTHONPATH=src python3 scripts/probe_triton_backend_gap.py " + flags)


def captured_session(cfg, pool, bucket: int, cuda: bool):
    """The registry's ``triton`` backend and a one-bucket decode ``GraphSession`` of it,
    captured as the peers run captures it."""
    from attnreg.registry import get_registry
    from attnreg.runtime import GraphSession

    be = get_registry().create("triton", cfg)
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[bucket],
                       writes_kv=False, device_graphs=None if cuda else False,
                       kernel_outputs=True)
    ses.capture()
    return be, ses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check of the script)")
    ap.add_argument("--bisect", action="store_true",
                    help="take the session's launch apart (16 heads, page 1; see above)")
    args = ap.parse_args(argv)
    if args.bisect:
        return bisect(args)
    import torch

    from attnreg.backends._triton_kernels import decode as dec
    from attnreg.profiling import random_pool
    from attnreg.registry import ForwardMode
    from attnreg.runtime import MLAConfig, StepInputs, decode_batch
    from benchmarks._backends import worst_row_rel_error
    from benchmarks.triton_decode_tuning import bench, graph_of, make_inputs, reference

    dev, cuda = args.device, args.device == "cuda"
    shapes, pages = (SMALL, SMALL_PAGES) if args.small else (SHAPES, PAGES)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    meta = run_meta(torch, dev, "--out backend_gap.json" + (" --small" if args.small else ""))
    rows = []

    def record(rec, out, ref, call, *, captured=False):
        # captured: ``call`` replays a graph already (timed as it is, not captured again)
        try:
            out.fill_(float("nan"))
            call()
            if cuda:
                torch.cuda.synchronize()
            rec["err"] = worst_row_rel_error(torch, out, ref)
            if cuda:
                rec["us"] = bench(call if captured else graph_of(call).replay)
        except Exception as e:  # noqa: BLE001 (a probe records every failure)
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(rec)
        print(f"B={rec['B']:4d} L={rec['L']:6d} H={rec['H']:4d} p{rec['page']:<3d} "
              f"{rec['kv']:4s} {rec['path']:22s} "
              + (f"{rec.get('us', float('nan')):8.1f} us err {rec['err']:.1e}"
                 if "err" in rec else rec["error"]), flush=True)

    for (B, L, H) in shapes:
        for ps in pages:
            for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                base = dict(B=B, L=L, H=H, page=ps, kv=kv_name)
                splits = dec.default_max_splits(B, H, L, num_sms, kv_dtype, ps)
                ws = dec.mla_decode_workspace(B, H, splits, dev) if splits > 1 else None

                # the tuning probes' inputs, the kernel called directly
                q, cache, table, sl, out = make_inputs(B, L, H, page_size=ps,
                                                       kv_dtype=kv_dtype, device=dev)
                ref = reference(q, cache, table, sl, 0.1)
                record(dict(base, path="kernel, probe inputs", splits=splits), out, ref,
                       lambda q=q, cache=cache, table=table, sl=sl, out=out, ws=ws:
                       dec.mla_decode(q, cache, table, sl, out, sm_scale=0.1,
                                      max_splits=splits, workspace=ws))

                # the peers run's pool and batch (benchmarks/decode_peers.py)
                cfg = MLAConfig(num_heads=H, page_size=ps, kv_dtype=kv_name if kv_name ==
                                "bf16" else "fp8_e4m3", device=dev, max_context_len=L)
                pool = random_pool(torch, cfg, B * L, seed=B + L + H)
                batch = decode_batch(pool, [L] * B, shuffle=B + L)
                layer = pool.layer(0)
                scale_arg = layer.scale_tensor if layer.is_fp8 else 1.0
                ref = reference(q, layer.buffer, batch.page_table, batch.seq_lens,
                                cfg.softmax_scale, kv_scale=layer.kv_scale)
                out = torch.empty(B, H, 512, dtype=q.dtype, device=dev)
                record(dict(base, path="kernel, pool inputs", splits=splits), out, ref,
                       lambda out=out, layer=layer, batch=batch, ws=ws, cfg=cfg, s=scale_arg:
                       dec.mla_decode(q, layer.buffer, batch.page_table, batch.seq_lens, out,
                                      sm_scale=cfg.softmax_scale, kv_scale=s,
                                      max_splits=splits, workspace=ws))

                # the backend as the peers run captures it
                be, ses = captured_session(cfg, pool, B, cuda)
                sout = ses.replay(batch, StepInputs([q]), bucket=B)[0]
                graph = ses.graph((ForwardMode.DECODE, B))
                record(dict(base, path="backend, session"), sout, ref, graph.replay, captured=True)
                del ses, be, pool
                if cuda:
                    torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


def bisect(args) -> int:
    """``--bisect``: the session's recorded ``mla_decode`` arguments, called directly."""
    import torch
    from profile_peers_kernels import kernels  # this folder's kernel lister

    import attnreg.backends.triton_mla as triton_mla
    from attnreg.backends._triton_kernels import decode as dec
    from attnreg.profiling import random_pool
    from attnreg.registry import ForwardMode
    from attnreg.runtime import MLAConfig, StepInputs, decode_batch
    from benchmarks._backends import worst_row_rel_error
    from benchmarks.triton_decode_tuning import bench, graph_of, reference

    dev, cuda = args.device, args.device == "cuda"
    shapes = SMALL if args.small else BISECT_SHAPES
    page = SMALL_PAGES[0]
    meta = run_meta(torch, dev, "--bisect --out backend_gap_bisect.json"
                    + (" --small" if args.small else ""))
    rows: list[dict] = []
    recorded: list[tuple[tuple, dict]] = []
    real = triton_mla.mla_decode

    def recording(*a, **kw):
        recorded.append((a, kw))
        return real(*a, **kw)

    def own(value):
        if isinstance(value, torch.Tensor):
            return value.clone()  # a fresh allocation: contiguous, the allocator's alignment
        if isinstance(value, tuple):  # the workspace
            return type(value)(*(v.clone() for v in value))
        return value  # no workspace, a float scale

    for (B, L, H) in shapes:
        for kv_name in ("bf16", "fp8_e4m3"):
            cfg = MLAConfig(num_heads=H, page_size=page, kv_dtype=kv_name, device=dev,
                            max_context_len=L)
            pool = random_pool(torch, cfg, B * L, seed=B + L + H)
            batch = decode_batch(pool, [L] * B, shuffle=B + L)
            layer = pool.layer(0)
            torch.manual_seed(B + L + H)  # the same q every run (its err compares)
            q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=dev)
            ref = reference(q, layer.buffer, batch.page_table, batch.seq_lens,
                            cfg.softmax_scale, kv_scale=layer.kv_scale)
            recorded.clear()
            triton_mla.mla_decode = recording
            try:
                be, ses = captured_session(cfg, pool, B, cuda)
            finally:
                triton_mla.mla_decode = real
            sout = ses.replay(batch, StepInputs([q]), bucket=B)[0]
            graph = ses.graph((ForwardMode.DECODE, B))
            a, kw = recorded[-1]
            base = dict(B=B, L=L, H=H, page=page, kv=kv_name, splits=kw["max_splits"],
                        args={n: (list(t.shape), list(t.stride()), t.data_ptr() % 256)
                              for n, t in zip(POSITIONAL, a)})

            def time_one(path, call, out, captured=False):
                rec = dict(base, path=path)
                try:
                    if captured:
                        call()
                    else:
                        out.fill_(float("nan"))
                        call()
                    if cuda:
                        torch.cuda.synchronize()
                    rec["err"] = worst_row_rel_error(torch, out[:B], ref)
                    if cuda:
                        replay = call if captured else graph_of(call).replay
                        rec["us"] = bench(replay)
                        rec["kernels"] = [list(k) for k in kernels(replay, torch)]
                except Exception as e:  # noqa: BLE001 (a probe records every failure)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(rec)
                print(f"B={B:4d} L={L:6d} H={H:4d} p{page} {kv_name:8s} {path:36s} "
                      + (f"{rec.get('us', float('nan')):8.1f} us err {rec['err']:.1e}"
                         if "err" in rec else rec["error"]), flush=True)

            time_one("backend, session", graph.replay, sout, captured=True)
            # every argument by name (OWN's): the positional ones, then the keywords
            named = dict(zip(POSITIONAL, a)) | {KEYWORD.get(k, k): v for k, v in kw.items()}
            for which in (None, *OWN, "all"):
                args_now = dict(named)
                for n in OWN if which == "all" else (which,) if which else ():
                    args_now[n] = own(args_now[n])
                pos = [args_now[n] for n in POSITIONAL]
                kws = {k: args_now[KEYWORD.get(k, k)] for k in kw}
                time_one("kernel, session args" + (f", own {which}" if which else ""),
                         lambda p=pos, k=kws: dec.mla_decode(*p, **k), pos[4])
            del ses, be, pool
            if cuda:
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
