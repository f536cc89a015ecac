#!/usr/bin/env python3
"""Probe the FlashMLA plugin's sparse (DSA) kernels on an sm90 GPU against the float64 oracle.

Run on an H200 with ``flash_mla`` (sgl-flash-mla) importable and this tree and
``plugins/attnreg-flashmla`` installed::

    python3 scripts/probe_flashmla_sparse.py [--quick] [--no-conformance]

What it runs, each case printed as PASS / FAIL with its largest errors (a
failure prints its traceback and the run goes on):

1. ``eager``: ``FlashMLABackend.forward_sparse`` on every sparse batch of
   :func:`attnreg.testing.sparse.sparse_cases` (top-k below, equal to and above
   the visible tokens, unsorted, repeated slots, rows of only -1) for each
   declared sparse kernel (fp8_ds_mla rows through the sparse fp8 decode
   kernel, bf16 rows through the sparse prefill kernel), decode and extend
   batches, 64 and 128 heads, top-k 64 and 2048 (``--quick``: 64 only), against
   :func:`attnreg.testing.sparse.oracle_sparse` (float64, over the rows as the
   pool stores them).  The LSE too where the kernel declares it (and reported,
   not judged, where it does not).  ``worst_rel`` is the largest error over the
   largest |expected| of the batch (issue 32: 1.5% fp8 decode, 0.4% bf16 prefill).
2. ``graph``: the same kernel captured once in a real CUDA graph through
   :class:`attnreg.runtime.GraphSession` (``sparse=True``: decode FULL, prefill
   BREAKABLE) and replayed for every batch, padded to the bucket (padding rows'
   indices all -1 must come out zero).
3. ``raw``: only when an eager case of a kernel failed: the library called
   directly (no attnreg code between) with ``kv_format`` ``"V32"`` and None, so
   the report says whether the plugin's call or the library is at fault.
4. ``conformance``: the declaration's sparse claims through attnreg's own
   harness (``attnreg.testing.sparse_checks``), as ``attnreg conformance
   --backend flashmla -k sparse`` would run them.

With ``$OUT`` set, ``$OUT/probe_flashmla_sparse.json`` holds every case's result.
Exit status 0 when every case passed, 1 otherwise.

``--cpu-fake`` runs the same script on the cpu against the plugin's CPU stand-in
(``plugins/attnreg-flashmla/tests/fake_flash_mla.py``, no device graphs): a
check of this script, not of the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

RESULTS: list[dict[str, Any]] = []
DEVICE = "cuda"


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _record(section: str, name: str, ok: bool, **info: Any) -> None:
    RESULTS.append({"section": section, "case": name, "status": "PASS" if ok else "FAIL",
                    **info})
    extra = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in info.items() if k not in ("traceback", "detail"))
    print(f"{'PASS' if ok else 'FAIL'}  {section:<11} {name}  {extra}", flush=True)
    if info.get("detail"):
        print(f"      detail: {info['detail']}", flush=True)
    if info.get("traceback"):
        print("      " + info["traceback"].replace("\n", "\n      "), flush=True)


def _guarded(section: str, name: str, fn: Callable[[], dict[str, Any]]) -> bool:
    """Run ``fn`` (returns ``{"ok": bool, ...}``); an exception is a FAIL with its traceback."""
    t0 = time.perf_counter()
    try:
        info = fn()
    except Exception as exc:  # noqa: BLE001 - the probe reports every failure and goes on
        _record(section, name, False, error=f"{type(exc).__name__}: {exc}"[:400],
                traceback=traceback.format_exc(), seconds=time.perf_counter() - t0)
        return False
    ok = bool(info.pop("ok"))
    _record(section, name, ok, seconds=time.perf_counter() - t0, **info)
    return ok


def _errors(got: Any, expected: Any) -> dict[str, float]:
    import torch

    g = got.detach().float().cpu()
    err = (g - expected).abs()
    scale = float(expected.abs().max()) or 1.0
    finite = bool(torch.isfinite(g).all())
    return {"max_abs": float(err.max()) if finite else float("inf"),
            "worst_rel": (float(err.max()) / scale) if finite else float("inf")}


def _lse_errors(got: Any, expected: Any) -> dict[str, float]:
    import torch

    g = got.detach().float().cpu()
    both = torch.isfinite(expected)
    same_inf = bool((torch.isneginf(g) == torch.isneginf(expected)).all())
    err = (g[both] - expected[both]).abs()
    return {"lse_max_abs": float(err.max()) if err.numel() else 0.0,
            "lse_empty_rows_ok": same_inf}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="top-k 64 only")
    ap.add_argument("--no-conformance", action="store_true",
                    help="skip the sparse conformance claims")
    ap.add_argument("--cpu-fake", action="store_true",
                    help="check this script on the cpu with the plugin's stand-in library")
    args = ap.parse_args()

    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}", flush=True)
    global DEVICE
    if args.cpu_fake:
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, os.path.join(here, "..", "plugins", "attnreg-flashmla", "tests"))
        import fake_flash_mla
        sys.modules["flash_mla"] = fake_flash_mla
        DEVICE, cap, name = "cpu", (9, 0), "cpu (fake flash_mla)"
    else:
        if not torch.cuda.is_available():
            print("FAIL: no CUDA device", flush=True)
            return 1
        cap, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    print(f"device {name} sm{cap[0]}{cap[1]}", flush=True)
    try:
        import flash_mla
        print(f"flash_mla from {flash_mla.__file__}, has_legacy={flash_mla.has_legacy()}",
              flush=True)
    except Exception:  # noqa: BLE001
        print("FAIL: flash_mla does not import\n" + traceback.format_exc(), flush=True)
        return 1

    from attnreg_flashmla.declaration import capabilities
    from attnreg_flashmla.runtime import FlashMLABackend

    from attnreg.registry import DeclarationContext, DType, ForwardMode, Phase, Platform
    from attnreg.runtime import GraphSession, MLAConfig, StepInputs
    from attnreg.runtime.refusals import sparse_index_problems
    from attnreg.testing import checks  # noqa: F401 - registers every check (sparse ones too)
    from attnreg.testing.sparse import make_sparse_workload, sparse_cases
    from attnreg.testing.sparse_checks import claim_top_k
    from attnreg.testing.workload import compare, compare_lse, make_pool

    plat = Platform.parse(f"cuda:sm{cap[0]}{cap[1]}")
    caps = capabilities(DeclarationContext(plat))
    if not caps.sparse_kernels:
        print(f"FAIL: flashmla declares no sparse kernel on {plat}: {caps.platform_reason}",
              flush=True)
        return 1
    failed_kernels: set[str] = set()

    def refused_width(kernel: Any, kv_dtype: str, fmt: Any) -> dict[str, Any]:
        """A width the kernel does not declare is refused before the library is called."""
        from attnreg.registry import UnsupportedError
        from attnreg.runtime import decode_batch

        width = next(w for w in range(1, kernel.max_top_k) if not kernel.accepts_top_k(w)
                     and w % 8 == 0)
        cfg = MLAConfig(num_heads=kernel.head_counts[0], page_size=64, kv_dtype=kv_dtype,
                        device=DEVICE)
        be = FlashMLABackend(cfg, capabilities=caps)
        pool = make_pool(cfg, [sparse_cases(Phase.DECODE, 64)[0].spec()], kv_format=fmt)
        batch = decode_batch(pool, [70, 10])
        idx = torch.full((2, width), -1, dtype=torch.int32, device=DEVICE)
        idx[:, 0] = batch.out_cache_loc
        q = torch.randn(2, cfg.num_heads, 576, device=DEVICE).bfloat16()
        try:
            be.forward_sparse(q, None, None, pool, batch, topk_indices=idx)
        except UnsupportedError as exc:
            return {"ok": f"top-k {width}" in str(exc), "width": width,
                    "detail": str(exc)[:300]}
        return {"ok": False, "width": width, "detail": "ran without UnsupportedError"}

    for kernel in caps.sparse_kernels:
        fmt = kernel.kv_format
        kv_dtype = "fp8_e4m3" if fmt.value == "fp8_ds_mla" else "bf16"
        # the smallest width the kernel declares (the suite's) and DeepSeek-V3.2's 2048
        top_ks = sorted({claim_top_k(kernel)} | (set() if args.quick else {2048}))
        _guarded("refusal", f"{fmt}/top-k outside {kernel.describe_top_k()}",
                 lambda kernel=kernel, kv_dtype=kv_dtype, fmt=fmt: refused_width(
                     kernel, kv_dtype, fmt))
        for heads in kernel.head_counts:
            for top_k in top_ks:
                for phase in sorted(kernel.phases, key=str):
                    cases = sparse_cases(phase, top_k)
                    longest = max(p + e for c in cases for p, e in c.seqs)
                    cfg = MLAConfig(num_heads=heads, page_size=64, kv_dtype=kv_dtype,
                                    device=DEVICE, max_context_len=max(longest, 64))
                    be = FlashMLABackend(cfg, capabilities=caps)
                    tag = f"{fmt}/{phase}/h{heads}/topk{top_k}"

                    def eager(case: Any, i: int, be: Any = be, cfg: Any = cfg,
                              fmt: Any = fmt, cases: Any = cases, kernel: Any = kernel
                              ) -> dict[str, Any]:
                        pool = make_pool(cfg, [case.spec()], kv_format=fmt)
                        sw = make_sparse_workload(cfg, pool, case, seed=700 + i)
                        be.init_forward_metadata(sw.work.batch)
                        w = sw.work
                        lse = None
                        if kernel.lse:
                            out, lse = be.forward_sparse(w.q, w.latent_new, w.rope_new, pool,
                                                         w.batch, topk_indices=sw.indices,
                                                         return_lse=True)
                        else:
                            out = be.forward_sparse(w.q, w.latent_new, w.rope_new, pool,
                                                    w.batch, topk_indices=sw.indices)
                        _sync()
                        msg = compare(out, sw.expected, DType.BF16, sw.spec)
                        info: dict[str, Any] = _errors(out, sw.expected)
                        for r in case.empty_rows:
                            if not bool((out[r] == 0).all()):
                                msg = (msg or "") + f"; row {r} (all -1) is not zero"
                        if lse is not None:
                            info.update(_lse_errors(lse, sw.expected_lse))
                            lmsg = compare_lse(lse, sw.expected_lse, sw.spec)
                            if lmsg:
                                msg = (msg or "") + f"; LSE: {lmsg}"
                        return {"ok": msg is None, "detail": msg, **info}

                    for i, case in enumerate(cases):
                        if not _guarded("eager", f"{tag}/{case.name}",
                                        lambda case=case, i=i: eager(case, i)):
                            failed_kernels.add(f"{fmt}")

                    mode_of = {Phase.DECODE: "full", Phase.PREFILL: "breakable"}

                    def graph(be: Any = be, cfg: Any = cfg, fmt: Any = fmt, cases: Any = cases,
                              phase: Any = phase) -> dict[str, Any]:
                        decode = phase is Phase.DECODE
                        pool = make_pool(cfg, [c.spec() for c in cases], spare_pages=4,
                                         kv_format=fmt)
                        works = [make_sparse_workload(cfg, pool, c, seed=800 + i)
                                 for i, c in enumerate(cases)]
                        rows = [w.work.batch.batch_size if decode else w.work.batch.num_tokens
                                for w in works]
                        bucket = max(rows) + (1 if decode else 2)
                        width = works[0].indices.shape[1]
                        static_idx = torch.full((bucket, width), -1, dtype=torch.int32,
                                                device=DEVICE)

                        def step(s: Any) -> None:
                            n = s.inputs.q[0].shape[0]
                            be.forward_sparse(s.inputs.q[0], s.inputs.latent_new[0],
                                              s.inputs.rope_new[0], pool, s.batch,
                                              out=s.outputs[0] if s.outputs else None,
                                              topk_indices=static_idx[:n])

                        def load(w: Any) -> None:
                            bad = sparse_index_problems(w.indices, w.indices.shape[0],
                                                        pool.layer(0).num_slots, pool.device)
                            assert not bad, bad
                            static_idx.fill_(-1)
                            static_idx[:w.indices.shape[0]].copy_(w.indices)

                        fm = ForwardMode.DECODE if decode else ForwardMode.EXTEND
                        session = GraphSession(
                            be, pool, phase=phase, mode=mode_of[phase], buckets=[bucket],
                            sparse=True, forward_modes={fm: 1} if decode else None,
                            max_seq_len=max(w.work.batch.max_seq_len for w in works),
                            max_requests=max(w.work.batch.batch_size for w in works) + 1,
                            step=step, device_graphs=DEVICE == "cuda", warmup=1)
                        first = works[0]
                        load(first)
                        session.capture(batches={bucket: first.work.batch},
                                        inputs={bucket: StepInputs.one(
                                            first.work.q, first.work.latent_new,
                                            first.work.rope_new)})
                        statics = session.statics
                        assert statics is not None
                        problems, worst, worst_rel = [], 0.0, 0.0
                        for w in works:
                            load(w)
                            statics.outs[0].fill_(float("nan"))
                            outs = session.replay(w.work.batch, StepInputs.one(
                                w.work.q, w.work.latent_new, w.work.rope_new), bucket=bucket)
                            _sync()
                            e = _errors(outs[0], w.expected)
                            worst, worst_rel = max(worst, e["max_abs"]), max(worst_rel,
                                                                           e["worst_rel"])
                            msg = compare(outs[0], w.expected, DType.BF16, w.spec)
                            if msg:
                                problems.append(f"{w.case.name}: {msg}")
                            rest = statics.outs[0][outs[0].shape[0]:]
                            if rest.numel() and not bool((rest == 0).all()):
                                problems.append(f"{w.case.name}: padding rows not zero")
                        return {"ok": not problems, "detail": "; ".join(problems) or None,
                                "max_abs": worst, "worst_rel": worst_rel,
                                "replays": len(works), "bucket": bucket}

                    _guarded("graph", f"{tag}/{mode_of[phase]}", graph)

    if failed_kernels or args.cpu_fake:
        _raw_diagnosis(failed_kernels or {"fp8_ds_mla", "bf16"})

    if not args.no_conformance:
        _conformance(caps, plat)

    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    print(f"\n{len(RESULTS) - len(failed)} PASS, {len(failed)} FAIL", flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "probe_flashmla_sparse.json")
        with open(path, "w") as f:
            json.dump({"device": name, "torch": torch.__version__,
                       "results": RESULTS}, f, indent=1, default=str)
        print(f"wrote {path}", flush=True)
    return 1 if failed else 0


def _raw_diagnosis(formats: set[str]) -> None:
    """Call the library directly, without attnreg, on a tiny problem: which call works."""
    import flash_mla
    import torch

    from attnreg.runtime.kv_formats import pack_fp8_ds_mla, unpack_fp8_ds_mla

    gen = torch.Generator().manual_seed(5)
    heads, top_k, pages = 64, 128, 4        # 128: a width both kernels take
    rows = torch.randn(pages * 64, 576, generator=gen)
    q = torch.randn(2, 1, heads, 576, generator=gen).bfloat16().to(DEVICE)
    idx = torch.randperm(pages * 64, generator=gen)[:2 * top_k].view(2, 1, top_k)
    idx = idx.to(torch.int32).to(DEVICE)
    scale = 576 ** -0.5

    def oracle(keys: Any) -> Any:
        k = keys[idx.view(2, top_k).long().cpu()].double()             # [2, K, 576]
        s = torch.einsum("bhd,bkd->bhk", q.view(2, heads, 576).double().cpu(), k) * scale
        return torch.einsum("bhk,bkd->bhd", torch.softmax(s, -1), k[..., :512])

    if "fp8_ds_mla" in formats:
        packed = pack_fp8_ds_mla(rows).to(DEVICE).view(pages, 64, 1, 656)
        want = oracle(unpack_fp8_ds_mla(packed.view(-1, 656).cpu()))
        for kv_format in ("V32", None):
            def call(kv_format: Any = kv_format) -> dict[str, Any]:
                meta = flash_mla.get_mla_metadata()[0]
                out, lse = flash_mla.flash_mla_with_kvcache(
                    q, packed, None, None, 512, meta, softmax_scale=scale,
                    is_fp8_kvcache=True, indices=idx, use_legacy=True, kv_format=kv_format)
                _sync()
                e = _errors(out.view(2, heads, 512), want.float())
                return {"ok": e["worst_rel"] < 0.05, "out_shape": tuple(out.shape),
                        "lse_shape": tuple(lse.shape), **e}
            _guarded("raw", f"flash_mla_with_kvcache sparse kv_format={kv_format}", call)
    if "bf16" in formats:
        kv = rows.bfloat16().to(DEVICE).view(-1, 1, 576)
        want = oracle(kv.view(-1, 576).float().cpu())

        def call_prefill() -> dict[str, Any]:
            out, _, lse = flash_mla.flash_mla_sparse_fwd(
                q.view(2, heads, 576), kv, idx, scale, d_v=512, use_legacy=True)
            _sync()
            e = _errors(out, want.float())
            return {"ok": e["worst_rel"] < 0.02, "out_shape": tuple(out.shape),
                    "lse_shape": None if lse is None else tuple(lse.shape), **e}
        _guarded("raw", "flash_mla_sparse_fwd", call_prefill)


def _conformance(caps: Any, plat: Any) -> None:
    """The declaration's sparse claims through attnreg's conformance harness."""
    from attnreg import load_registry
    from attnreg.testing.errors import ClaimRefuted, HarnessLimitation
    from attnreg.testing.harness import Harness
    from attnreg.testing.sparse_checks import sparse_claims

    registry = load_registry(autoload=True, allow=["flashmla"])
    harness = Harness(registry, DEVICE, plat)
    for claim in sparse_claims(caps, DEVICE):
        def run(claim: Any = claim) -> dict[str, Any]:
            try:
                harness.check(claim)
            except ClaimRefuted as exc:
                return {"ok": False, "detail": str(exc)[:2000]}
            except HarnessLimitation as exc:
                return {"ok": True, "detail": f"not run: {exc}"}
            return {"ok": True}
        _guarded("conformance", claim.id, run)


if __name__ == "__main__":
    sys.exit(main())
