"""peers: attnreg's decode backends against the raw kernels they wrap, in one process (issue 31).

At every P1 shape (B, L, H), with a bf16 and an FP8 (e4m3) KV pool, one
process times, each as a CUDA graph replay with the L2 flushed before every
replay, the replays of every peer over one pool interleaved
(:meth:`attnreg.profiling.Clock.interleaved`: a wrapper and its raw kernel see the same
device conditions):

* the raw kernels, called directly and captured through
  :class:`attnreg.runtime.GraphRunner`: flashinfer's
  ``BatchMLAPagedAttentionWrapper`` (fa3) at page 1 and 64, planned once
  outside the graph, ``run`` inside it; FlashMLA's dense decode
  ``flash_mla.flash_mla_with_kvcache(..., use_legacy=True)`` at page 64 (the
  sm90 call of ``../shared/gpu/README.md`` and the plugin's
  ``attnreg_flashmla/kernel.py``), its scheduler run outside the graph and,
  for FP8, q rounded to FP8 outside the graph (the raw kernel takes it as
  input);
* the overhead rows (:data:`OVERHEAD`, for ``peers.wrapper``): a raw call plus one piece
  of what attnreg's captured decode adds, or added, beside the kernel -- fa3 with
  contiguous q halves, with the padding-row zeroing (two launches, as before issue 31,
  and one), with a ``use_cuda_graph`` plan with a filler request (the zeroing and the
  filler are what flashinfer_mla's captured decode ran until 1cbb10b, and its verify
  graphs still run); FlashMLA FP8 with q rounded inside the graph by
  ``attnreg.runtime.quantize_q_fp8`` -- each beside its raw call and attnreg's wrapper of
  it (``data["overhead"]``);
* attnreg's backends created through the registry and captured through
  :class:`attnreg.runtime.GraphSession` (one bucket = B, replay metadata
  prepared once, then the graph alone timed): triton at page 1 and 64,
  flashinfer_mla (fa3) at page 1 and 64, the flashmla plugin at page 64 (with an FP8
  pool twice: the model's bf16 q, which it rounds inside the graph, and the engine's own
  fp8 q with its scale, the kernel's declared input, rounded outside as the raw peer's).

Every timed output is first compared with a float32 reference on its first
four sequences.  From the times: each wrapper over its raw kernel given the same
inputs (:func:`wrapped_raw`; target 1.03x at every shape and dtype), each FP8-declaring
path's bf16 / FP8 time
(target 1.25x at (128, 4096, 16), (32, 8192, 16), (64, 2048, 64), never below
1.0), and the per-bucket plan: a decode profile built from this run's
page-64 attnreg times per head count, resolved into a plan
(:func:`attnreg.graph_policy.resolve`, ``decode_profile=``), whose chosen
backend's GraphSession time is the planned time of each shape (that is the
graph :class:`attnreg.runtime.bucket_sessions.BucketSessions` replays for the
bucket); targets: planned geo-mean <= 0.95x the best single raw peer's, and
every shape <= 1.02x the fastest backend that shares its pool (page 64).  The
profile and the times come from the same run, so this checks the plan's
choice, not a prediction on unseen shapes.

``--dry-run`` on a CPU: tiny shapes, triton in the interpreter, graphs
replayed eagerly, raw peers skipped with the reason; nothing is measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from attnreg.profiling import random_pool

from ._backends import checked_output, reference_decode
from ._harness import RunContext, error_text
from ._report import Page, fmt, md_table
from .decode import SHAPES, Variant
from .metrics import Check, evaluate, geomean

DRY_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 64, 16), (1, 80, 16))
DTYPES = ("bf16", "fp8_e4m3")
FP8_SHAPES = ((128, 4096, 16), (32, 8192, 16), (64, 2048, 64))
WRAPPER_MAX = 1.03
FP8_SPEEDUP_MIN = 1.25
PLANNED_VS_RAW_MAX = 0.95
PLANNED_VS_FASTEST_MAX = 1.02
#: bf16 lands within 1e-2 of float32; with an FP8 pool a kernel that rounds q (and its
#: softmax probabilities) to FP8 lands within a few 1e-2; a wrong kernel lands near 1.
MAX_REL_ERR = {"bf16": 2e-2, "fp8_e4m3": 1e-1}
POOL_PAGE = 64

FA3_P1, FA3_P64, FLASHMLA_RAW = "raw fa3 p1", "raw fa3 p64", "raw FlashMLA"
RAW_PAGES = {FA3_P1: 1, FA3_P64: 64, FLASHMLA_RAW: 64}
#: attnreg's rows: (label, registry backend, page size, create options)
ROWS: tuple[Variant, ...] = (
    Variant("triton p1", "triton", page_size=1),
    Variant("triton p64", "triton", page_size=64),
    Variant("flashinfer_mla p1", "flashinfer_mla", {"mla_backend": "fa3"}, page_size=1),
    Variant("flashinfer_mla p64", "flashinfer_mla", {"mla_backend": "fa3"}, page_size=64),
    Variant("flashmla plugin", "flashmla", page_size=64),
)
#: attnreg's rows whose query the engine hands as fp8 with its scale (``q_scale=``, the
#: declared kernel input), over an FP8 pool only; not in the per-bucket plan's profile
FP8_Q_PLUGIN = "flashmla plugin, fp8 q"
ENGINE_FP8_Q_ROWS: tuple[Variant, ...] = (Variant(FP8_Q_PLUGIN, "flashmla", page_size=64),)
ROUNDED_RAW = f"{FLASHMLA_RAW} + q rounding"
#: wrapper -> the raw kernel it wraps, given the same inputs: the plugin's bf16-q FP8 decode
#: against the raw call with the same rounding in the graph (:data:`OVERHEAD`), its fp8-q
#: decode against the raw call alone (both take fp8 q)
WRAPS = {"flashinfer_mla p1": FA3_P1, "flashinfer_mla p64": FA3_P64,
         "flashmla plugin": FLASHMLA_RAW, FP8_Q_PLUGIN: FLASHMLA_RAW}


def wrapped_raw(wrapper: str, dtype: str) -> str:
    """The raw row ``wrapper`` is compared with at ``dtype`` (see :data:`WRAPS`)."""
    if wrapper == "flashmla plugin" and dtype == "fp8_e4m3":
        return ROUNDED_RAW
    return WRAPS[wrapper]


# ----------------------------------------------------------------------------------------
# the raw kernels
# ----------------------------------------------------------------------------------------

def _raw_reasons(ctx: RunContext) -> dict[str, str]:
    """Why each raw peer cannot run here ('' = it can)."""
    if not ctx.cuda:
        return dict.fromkeys(RAW_PAGES, "no CUDA device (dry run): the raw kernels are CUDA-only")
    out = dict.fromkeys(RAW_PAGES, "")
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a missing library is a row, not a crash
        out[FA3_P1] = out[FA3_P64] = f"flashinfer not importable ({type(exc).__name__})"
    try:
        import flash_mla  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        out[FLASHMLA_RAW] = f"flash_mla not importable ({type(exc).__name__})"
    return out


def _fa3(ctx: RunContext, pool: Any, batch: Any, q: Any, scale: float, *,
         contiguous_q: bool = False, zero_launches: int = 0, graph_wrapper: bool = False
         ) -> Callable[[], Any]:
    """flashinfer's MLA wrapper (fa3), planned here once; the returned call is ``run``.

    The overhead rows (:data:`OVERHEAD`) add, one at a time, what attnreg's captured
    decode does beside the call: ``contiguous_q`` passes q's halves as two contiguous
    tensors (made here, outside the graph) instead of two strided views of one
    ``[B, H, 576]`` tensor; ``zero_launches`` adds the padding-row zeroing after the call
    (2: the mask recomputed inside the graph then ``masked_fill_``, as attnreg did before
    issue 31; 1: ``GraphState``'s own fill from flags set outside the graph,
    ``fill_flagged_rows``: on CUDA one launch writing only the padding rows);
    ``graph_wrapper`` plans a ``use_cuda_graph=True`` wrapper over preallocated index
    buffers with a ``B + 1``-th (filler, empty) request, as attnreg's captured decode plan
    had until 1cbb10b (its verify plans still do; its decode plans now have ``B``
    requests, as the raw call).
    """
    import flashinfer

    from attnreg.backends.declarations.flashinfer_mla import FLOAT_WORKSPACE_BYTES
    from attnreg.runtime.graph_buffers import fill_flagged_rows

    torch = ctx.torch
    B, H = q.shape[0], q.shape[1]
    ps = pool.page_size
    lens = [int(n) for n in batch.seq_lens_cpu]
    pages = [-(-n // ps) for n in lens]
    qo = list(range(B + 1))
    if graph_wrapper:  # a filler-padded plan: one filler request owning the 0 padding rows
        lens, pages, qo = lens + [0], pages + [0], qo + [B]
    indptr = [0]
    for n in pages:
        indptr.append(indptr[-1] + n)
    kv_indices = torch.cat([batch.page_table[b, :pages[b]] for b in range(B)]).to(torch.int32)
    workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    extra: dict[str, Any] = {}
    if graph_wrapper:
        ints = lambda n: torch.zeros(n, dtype=torch.int32, device=q.device)  # noqa: E731
        extra = dict(use_cuda_graph=True, qo_indptr=ints(len(qo)), kv_indptr=ints(len(indptr)),
                     kv_indices=ints(int(kv_indices.numel())), kv_len_arr=ints(len(lens)))
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3", **extra)
    wrapper.plan(qo_indptr=torch.tensor(qo, dtype=torch.int32),
                 kv_indptr=torch.tensor(indptr, dtype=torch.int32), kv_indices=kv_indices,
                 kv_len_arr=torch.tensor(lens, dtype=torch.int32), num_heads=H,
                 head_dim_ckv=512, head_dim_kpe=64, page_size=ps, causal=False, sm_scale=scale,
                 q_data_type=q.dtype, kv_data_type=pool.buffer.dtype)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=q.device)
    buf = pool.buffer
    q_nope, q_pe = q[..., :512], q[..., 512:]
    if contiguous_q:
        q_nope, q_pe = q_nope.contiguous(), q_pe.contiguous()
    # the zeroing's inputs as GraphState holds them: row numbers, the mask and its int32
    # flags, qo_indptr
    row_index = torch.arange(B, dtype=torch.int32, device=q.device)
    pad_mask = torch.zeros(B, dtype=torch.bool, device=q.device)
    pad_flags = torch.zeros(B, dtype=torch.int32, device=q.device)
    qo_dev = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    torch.ge(row_index, qo_dev[-1:], out=pad_mask)  # the one-launch form: set outside

    def run() -> Any:
        wrapper.run(q_nope, q_pe, buf[..., :512], buf[..., 512:], out=out)
        if zero_launches == 2:
            torch.ge(row_index, qo_dev[-1:], out=pad_mask)
            out.masked_fill_(pad_mask.view(B, 1, 1), 0.0)
        elif zero_launches:
            fill_flagged_rows(out, pad_mask, 0.0, flags=pad_flags)
        return out
    return run


def _flashmla(ctx: RunContext, pool: Any, batch: Any, q: Any, scale: float, *,
              round_in_graph: bool = False) -> Callable[[], Any]:
    """FlashMLA's legacy dense decode (sm90), scheduled here once; fp8: q rounded here,
    or with ``round_in_graph`` inside the call by ``attnreg.runtime.quantize_q_fp8`` (what
    the plugin's captured FP8 decode does: the overhead row of :data:`OVERHEAD`)."""
    import flash_mla

    from attnreg.runtime import quantize_q_fp8

    torch = ctx.torch
    B, H = q.shape[0], q.shape[1]
    fp8 = pool.buffer.dtype == torch.float8_e4m3fn
    seq_lens = batch.seq_lens.to(torch.int32)
    table = batch.page_table.to(torch.int32)
    sched, splits = flash_mla.get_mla_decoding_metadata(seq_lens, H, 1, is_fp8_kvcache=fp8,
                                                        use_legacy=True)
    meta = flash_mla.get_mla_metadata()[0]
    meta.tile_scheduler_metadata, meta.num_splits = sched, splits
    k4 = pool.buffer.view(pool.buffer.shape[0], pool.buffer.shape[1], 1, 576)
    extra: dict[str, Any] = {}
    q4 = q.view(B, 1, H, 576)
    if fp8:
        # one power-of-two scale per batch, as attnreg's convention (plugin kernel.quantize_q)
        amax = float(q.abs().amax().float())
        descale = 2.0 ** max(-126, math.ceil(math.log2(max(amax, 1e-30) / 448.0)))
        q4 = (q4.float() / descale).to(torch.float8_e4m3fn)
        extra = {"is_fp8_kvcache": True,
                 "descale_q": torch.full((1,), descale, dtype=torch.float32, device=q.device),
                 "descale_k": pool.scale_tensor}
    keep = (q4, k4, table, seq_lens, meta, extra)
    q_bf16 = q.view(B, 1, H, 576)
    live = torch.ones(B, 1, dtype=torch.bool, device=q.device)

    def run() -> Any:
        if fp8 and round_in_graph:
            q8, descale_q = quantize_q_fp8(q_bf16, live)
            out, _ = flash_mla.flash_mla_with_kvcache(
                q8, keep[1], keep[2], keep[3], 512, keep[4], softmax_scale=scale,
                causal=False, use_legacy=True, **{**keep[5], "descale_q": descale_q})
            return out.view(B, H, 512)
        out, _ = flash_mla.flash_mla_with_kvcache(keep[0], keep[1], keep[2], keep[3], 512,
                                                  keep[4], softmax_scale=scale, causal=False,
                                                  use_legacy=True, **keep[5])
        return out.view(B, H, 512)
    return run


RAW_CALLS: dict[str, Callable[..., Callable[[], Any]]] = {
    FA3_P1: _fa3, FA3_P64: _fa3, FLASHMLA_RAW: _flashmla}

#: The overhead rows (issue 31, peers.wrapper): a raw call plus one piece of what attnreg's
#: captured decode adds beside the kernel, so one run says which piece costs what.
#: label -> (the raw row it adds to, its options, the KV dtype it runs with or None: both)
OVERHEAD: dict[str, tuple[str, dict[str, Any], str | None]] = {}
for _raw_label in (FA3_P1, FA3_P64):
    for _what, _opts in (("contiguous q", {"contiguous_q": True}),
                         ("+ zeroing x2", {"zero_launches": 2}),
                         ("+ zeroing x1", {"zero_launches": 1}),
                         ("graph plan", {"graph_wrapper": True}),
                         ("graph plan + zeroing x1", {"graph_wrapper": True,
                                                      "zero_launches": 1})):
        OVERHEAD[f"{_raw_label} {_what}"] = (_raw_label, _opts, "bf16")
OVERHEAD[ROUNDED_RAW] = (FLASHMLA_RAW, {"round_in_graph": True}, "fp8_e4m3")


# ----------------------------------------------------------------------------------------
# measuring one shape
# ----------------------------------------------------------------------------------------

#: a captured peer: its correctness entry and, when correct, the replay to time
Prepared = tuple[dict[str, Any], Callable[[], Any] | None]


def _check(ctx: RunContext, out: Any, ref: Any, dtype: str,
           replay: Callable[[], Any]) -> Prepared:
    res = checked_output(ctx, out, ref, MAX_REL_ERR[dtype])
    return res, replay if res["correct"] else None


def _raw(ctx: RunContext, label: str, pool: Any, batch: Any, q: Any, ref: Any, dtype: str,
         scale: float) -> Prepared:
    from attnreg.runtime import GraphRunner

    base, opts, _ = OVERHEAD.get(label, (label, {}, None))
    call = RAW_CALLS[base](ctx, pool, batch, q, scale, **opts)
    out = call()  # eager once: compiles, and is checked
    graph = GraphRunner(ctx.device).capture(call)
    graph.replay()
    # timed later, beside the pool's other peers: the graph holds call (CapturedGraph.captured),
    # and with it what its closure owns (flashinfer's wrapper and workspace, the output)
    return _check(ctx, out, ref, dtype, graph.replay)


def _attnreg(ctx: RunContext, v: Variant, pool: Any, batch: Any, q: Any, ref: Any, dtype: str,
             shape: tuple[int, int, int]) -> Prepared:
    from attnreg.registry import ForwardMode, get_registry
    from attnreg.runtime import GraphSession, MLAConfig, StepInputs

    B, L, H = shape
    fp8_q = v in ENGINE_FP8_Q_ROWS
    cfg = MLAConfig(num_heads=H, page_size=pool.page_size, kv_dtype=dtype, device=ctx.device,
                    max_context_len=L, q_dtype="fp8_e4m3" if fp8_q else "bf16")
    be = get_registry().create(v.backend, cfg, **v.options)
    # kernel_outputs: a backend that returns its library's own output is timed as an engine's
    # layer runs it (its output consumed where the library put it, not copied)
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[B], writes_kv=False,
                       device_graphs=None if ctx.cuda else False, kernel_outputs=True)
    ses.capture()
    inputs = StepInputs([q])
    if fp8_q:  # the engine's own rounding (outside the graph, as the raw peer's q is)
        from attnreg.runtime import quantize_q_fp8

        q8, q_scale = quantize_q_fp8(q, ctx.torch.ones(B, dtype=ctx.torch.bool,
                                                       device=q.device))
        inputs = StepInputs.one(q8, q_scale=q_scale)
    out = ses.replay(batch, inputs, bucket=B)[0]  # inputs + replay metadata, once
    # the graph holds the session's captured step, and the step its session and backend;
    # the inputs were copied into the session's static buffers
    return _check(ctx, out, ref, dtype, ses.graph((ForwardMode.DECODE, B)).replay)


def _time_together(ctx: RunContext, results: dict[str, Any],
                   replays: Mapping[str, Callable[[], Any]]) -> None:
    """Time the correct peers of one pool together, their replays interleaved
    (:meth:`RunContext.time_interleaved`): a wrapper and its raw kernel are timed under
    the same device conditions (at (128, 4096, 128) raw fa3's replays fell in two modes
    about 6% apart for stretches of a run, so peers timed one after another compared
    modes, not code).  A failure there times each alone, and one that fails alone is
    that peer's error."""
    try:
        timed = ctx.time_interleaved(replays)
    except Exception as exc:  # noqa: BLE001 - then one at a time, each its own row
        ctx.log(f"peers: interleaved timing failed ({error_text(exc, 200)}); one at a time")
        timed = {}
        for label, replay in replays.items():
            try:
                timed[label] = ctx.time(replay)
            except Exception as exc1:  # noqa: BLE001 - one peer must not lose the row
                results[label] = {"error": error_text(exc1, 300)}
    for label, m in timed.items():
        results[label].update(us=m["median_us"], p20_us=m["p20_us"], p80_us=m["p80_us"],
                              n=m["n"])


#: what a failed JIT build raises (flashinfer's ninja); its module is named by dtypes and
#: head dims, not by the shape, so it fails alike at every shape
BUILD_FAILED = "Ninja build failed"


def measure_shape(ctx: RunContext, shape: tuple[int, int, int], dtype: str,
                  raw_reasons: dict[str, str], rows: list[Variant],
                  row_reasons: dict[str, str],
                  build_failures: dict[tuple[str, str], str] | None = None) -> dict[str, Any]:
    """Every peer of one shape and KV dtype, each pool's peers timed together.

    ``build_failures`` (kept by the caller across shapes): (raw call, dtype) -> the error
    its JIT build gave; such a raw call is not built again at a later shape (each
    rebuild cost ~10 s of nvcc on the device) and its row repeats the first error.
    """
    from attnreg.runtime import MLAConfig, decode_batch

    build_failures = {} if build_failures is None else build_failures

    torch = ctx.torch
    B, L, H = shape
    torch.manual_seed(B * 1_000_003 + L * 7 + H)
    q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=ctx.device)
    row: dict[str, Any] = {"B": B, "L": L, "H": H, "dtype": dtype, "results": {}}
    results = row["results"]
    for page in (1, POOL_PAGE):
        cfg = MLAConfig(num_heads=H, page_size=page, kv_dtype=dtype, device=ctx.device,
                        max_context_len=L)
        scale = cfg.softmax_scale
        pool = random_pool(torch, cfg, B * L, seed=B + L + H)
        batch = decode_batch(pool, [L] * B, shuffle=B + L)
        ref = reference_decode(ctx, q, pool, batch.page_table, [L] * B, scale)
        jobs: list[tuple[str, Variant | None]] = []
        for label, p in RAW_PAGES.items():
            if p != page:
                continue
            if raw_reasons[label]:
                results[label] = {"skipped": raw_reasons[label]}
            else:
                jobs.append((label, None))
        for label, (base, _, only) in OVERHEAD.items():
            if RAW_PAGES[base] != page or only not in (None, dtype):
                continue
            if raw_reasons[base]:
                results[label] = {"skipped": raw_reasons[base]}
            else:
                jobs.append((label, None))
        for v in rows:
            if v.page_size != page:
                continue
            refused = [row_reasons[v.label]] if row_reasons.get(v.label) else []
            if refused:
                results[v.label] = {"skipped": refused[0]}
                continue
            refused = _kv_refusals(v, dtype, page, H,
                                   q_dtype="fp8_e4m3" if v in ENGINE_FP8_Q_ROWS else "bf16")
            if refused:
                results[v.label] = {"not_declared": "; ".join(refused)}
            else:
                jobs.append((v.label, v))
        replays: dict[str, Callable[[], Any]] = {}
        for label, variant in jobs:
            built = (OVERHEAD.get(label, (label, {}, None))[0], dtype)
            if variant is None and built in build_failures:
                results[label] = {"error": build_failures[built] + " (not rebuilt here: the "
                                  "same module failed at an earlier shape)"}
                continue
            try:
                results[label], replay = (
                    _raw(ctx, label, pool, batch, q, ref, dtype, scale) if variant is None
                    else _attnreg(ctx, variant, pool, batch, q, ref, dtype, shape))
                if replay is not None:
                    replays[label] = replay
            except Exception as exc:  # noqa: BLE001 - one peer must not lose the row
                results[label] = {"error": error_text(exc, 300)}
                if variant is None and BUILD_FAILED in str(exc):
                    build_failures[built] = results[label]["error"]
        _time_together(ctx, results, replays)
        for label, _ in jobs:
            ctx.log(f"peers {shape} {dtype} {label}: " + _describe(results[label]))
        # every graph of this pool is released before the next pool is built
        del pool, batch, ref, replays
        if ctx.cuda:
            torch.cuda.empty_cache()
    return row


def _kv_refusals(v: Variant, dtype: str, page: int, heads: int, *,
                 q_dtype: str = "bf16") -> list[str]:
    """Why the declaration refuses a pool of ``dtype`` for queries of ``q_dtype``."""
    from attnreg.registry import Platform, get_registry
    caps = get_registry().declaration(v.backend, Platform.detect())
    return list(caps.check_request("mla", "decode", head_dims=(576, 512), q_dtype=q_dtype,
                                   kv_dtype=dtype, page_size=page, num_heads=heads))


def _describe(res: dict[str, Any]) -> str:
    if "us" in res:
        return f"{res['us']:.1f} us (rel. err {res['rel_err']:.1e})"
    return str(res.get("skipped") or res.get("not_declared") or res.get("error"))


# ----------------------------------------------------------------------------------------
# the per-bucket plan
# ----------------------------------------------------------------------------------------

def _us(row: dict[str, Any], label: str) -> float | None:
    res = row.get("results", {}).get(label) or {}
    return res.get("us")


def planned(ctx: RunContext | None, rows: list[dict[str, Any]], dtype: str,
            platform: str) -> dict[str, Any]:
    """Per head count, a decode profile of this run's page-64 attnreg rows, resolved into a
    plan; each shape's planned backend and time (see the module doc)."""
    from attnreg.graph_policy import EngineFacts, GraphConfig, ModelFacts, resolve
    from attnreg.graph_policy.decode_profile import DecodeProfile

    mine = [r for r in rows if r.get("dtype") == dtype and r.get("results")]
    pooled = [v for v in ROWS if v.page_size == POOL_PAGE]
    out: dict[str, Any] = {"rows": [], "platform": platform}
    for heads in sorted({r["H"] for r in mine}):
        group = [r for r in mine if r["H"] == heads]
        entries = [{"backend": v.backend, "bucket": r["B"],
                    "points": [{"kv_len": r["L"], "us": _us(r, v.label)}]}
                   for r in group for v in pooled if _us(r, v.label)]
        # one entry per (backend, bucket): two shapes of one B and H join their points
        merged: dict[tuple[str, int], dict[str, Any]] = {}
        for e in entries:
            key = (e["backend"], e["bucket"])
            if key in merged:
                merged[key]["points"] += e["points"]
            else:
                merged[key] = e
        if not merged:
            continue
        profile = DecodeProfile.from_dict({
            "schema": "attnreg.decode_profile", "schema_version": 1, "platform": platform,
            "heads": heads, "kv_dtype": dtype, "page_size": POOL_PAGE,
            "entries": list(merged.values())}, source=f"this run ({heads} heads)")
        sizes = tuple(sorted({r["B"] for r in group}))
        plan = resolve(platform, ModelFacts(attention="mla", kv_dtype=dtype, num_heads=heads),
                       assume_installed=not (ctx and ctx.cuda),
                       config=GraphConfig(decode_batch_sizes=sizes),
                       engine=EngineFacts(page_size=POOL_PAGE,
                                          max_context_len=max(r["L"] for r in group)),
                       decode_profile=profile)
        note = next((d.message for d in plan.decisions if d.rule.startswith("decode.bucket")),
                    "")
        for r in group:
            backend = plan.decode.backend_for(r["B"])
            label = next((v.label for v in pooled if v.backend == backend), None)
            fastest = min(((_us(r, v.label), v.label) for v in pooled if _us(r, v.label)),
                          default=(None, None))
            out["rows"].append({"B": r["B"], "L": r["L"], "H": heads, "backend": backend,
                                "us": _us(r, label) if label else None,
                                "fastest": fastest[1], "fastest_us": fastest[0],
                                "plan": note})
    times = [r["us"] for r in out["rows"]]
    out["geomean_us"] = geomean(times) if times and all(times) else None
    raws: dict[str, float] = {}
    for label in RAW_PAGES:
        ts = [_us(r, label) for r in mine]
        if ts and all(ts) and len(ts) == len(out["rows"]):
            raws[label] = geomean(t for t in ts if t)
    out["raw_geomeans_us"] = raws
    out["best_raw"] = min(raws, key=raws.__getitem__) if raws else None
    return out


# ----------------------------------------------------------------------------------------
# the section
# ----------------------------------------------------------------------------------------

def run(ctx: RunContext, data: dict[str, Any]) -> None:
    from attnreg.registry import Platform, get_registry

    shapes = ctx.pick(SHAPES, SHAPES, DRY_SHAPES)
    raw_reasons = _raw_reasons(ctx)
    reg = get_registry()
    row_reasons: dict[str, str] = {}
    for v in ROWS + ENGINE_FP8_Q_ROWS:
        try:
            avail = reg.availability(v.backend)
            row_reasons[v.label] = "" if avail.available else (avail.reason or "unavailable")
        except Exception as exc:  # noqa: BLE001 - a broken plugin is a row
            row_reasons[v.label] = error_text(exc)
    data.update(rows=[], dtypes=list(DTYPES),
                timing=("CUDA graph replay, L2 flushed before each replay, the peers over one "
                        "pool interleaved (Clock.interleaved)"),
                raw_skipped={k: v for k, v in raw_reasons.items() if v},
                rows_skipped={k: v for k, v in row_reasons.items() if v})
    build_failures: dict[tuple[str, str], str] = {}
    # shape-major: a run cut by the time budget still has both dtypes of its first shapes
    for shape in shapes:
        for dtype in DTYPES:
            if ctx.out_of_time():
                data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                     "dtype": dtype, "skipped": "time budget used up"})
                continue
            try:
                data["rows"].append(measure_shape(
                    ctx, shape, dtype, raw_reasons,
                    list(ROWS + (ENGINE_FP8_Q_ROWS if dtype == "fp8_e4m3" else ())),
                    row_reasons, build_failures))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the others
                data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                     "dtype": dtype, "error": error_text(exc)})
            ctx.save()
    platform = str(Platform.detect()) if ctx.cuda else "cuda:sm90"
    data["planned"] = {}
    for dtype in DTYPES:
        try:
            data["planned"][dtype] = planned(ctx, data["rows"], dtype, platform)
        except Exception as exc:  # noqa: BLE001 - the times stay
            data["planned"][dtype] = {"error": error_text(exc)}
    data["overhead"] = overhead(data)
    data["checks"] = [c.to_dict() for c in checks(data)]


def _ratios(data: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """wrapper / raw per (dtype, shape, wrapper), and bf16 / fp8 per (path, shape)."""
    rows = [r for r in data.get("rows", []) if r.get("results")]
    wrap: list[tuple[str, float]] = []
    for r in rows:
        for w in WRAPS:
            raw = wrapped_raw(w, r["dtype"])
            a, b = _us(r, w), _us(r, raw)
            if a and b:
                wrap.append((f"{w} / {raw} at ({r['B']}, {r['L']}, {r['H']}) {r['dtype']}",
                             a / b))
    fp8: list[tuple[str, float]] = []
    named: list[tuple[str, float]] = []
    by = {(r["B"], r["L"], r["H"], r["dtype"]): r for r in rows}
    for (B, L, H, dt), r in by.items():
        if dt != "bf16" or (B, L, H, "fp8_e4m3") not in by:
            continue
        f = by[(B, L, H, "fp8_e4m3")]
        for label in [v.label for v in ROWS] + [FLASHMLA_RAW, FA3_P1, FA3_P64]:
            a, b = _us(r, label), _us(f, label)
            if a and b:
                fp8.append((f"{label} at ({B}, {L}, {H})", a / b))
                if (B, L, H) in FP8_SHAPES and label in [v.label for v in ROWS]:
                    named.append((f"{label} at ({B}, {L}, {H})", a / b))
        # the plugin serving an FP8 pool from the engine's fp8 q, against its bf16 pool
        a, b = _us(r, "flashmla plugin"), _us(f, FP8_Q_PLUGIN)
        if a and b:
            fp8.append((f"{FP8_Q_PLUGIN} at ({B}, {L}, {H})", a / b))
            if (B, L, H) in FP8_SHAPES:
                named.append((f"{FP8_Q_PLUGIN} at ({B}, {L}, {H})", a / b))
    return {"wrapper": wrap, "fp8_all": fp8, "fp8_named": named}


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    r = _ratios(data)
    worst_wrap = max(r["wrapper"], key=lambda x: x[1], default=None)
    fp8_attnreg = [x for x in r["fp8_all"] if not x[0].startswith("raw")]
    worst_named = min(r["fp8_named"], key=lambda x: x[1], default=None)
    worst_any = min(fp8_attnreg, key=lambda x: x[1], default=None)
    out = [
        evaluate("peers.wrapper", "slowest attnreg backend over the raw kernel it wraps, "
                 "given the same inputs (graph replay, every P1 shape, bf16 and FP8)",
                 worst_wrap[1] if worst_wrap else None, "x", "<=", target=WRAPPER_MAX,
                 detail=worst_wrap[0] if worst_wrap else ""),
        evaluate("peers.fp8_speedup", "smallest bf16 / FP8 time of an attnreg backend at "
                 "(128, 4096, 16), (32, 8192, 16), (64, 2048, 64)",
                 worst_named[1] if worst_named else None, "x", ">=", target=FP8_SPEEDUP_MIN,
                 detail=worst_named[0] if worst_named else ""),
        evaluate("peers.fp8_never_slower", "smallest bf16 / FP8 time of an attnreg backend at "
                 "any P1 shape", worst_any[1] if worst_any else None, "x", ">=", target=1.0,
                 detail=worst_any[0] if worst_any else ""),
    ]
    p = (data.get("planned") or {}).get("bf16") or {}
    best = p.get("best_raw")
    geo = p.get("geomean_us")
    ratio = geo / p["raw_geomeans_us"][best] if geo and best else None
    out.append(evaluate("peers.planned_vs_raw", "per-bucket planned decode geo-mean over the "
                        "best single raw peer's (bf16, P1 shapes)", ratio, "x", "<=",
                        target=PLANNED_VS_RAW_MAX, detail=f"best raw peer: {best}" if best
                        else ""))
    worst = [(x["us"] / x["fastest_us"], f"({x['B']}, {x['L']}, {x['H']}): {x['backend']} vs "
              f"{x['fastest']}") for x in p.get("rows", []) if x.get("us") and
             x.get("fastest_us")]
    w = max(worst, default=None)
    out.append(evaluate("peers.planned_vs_fastest", "planned decode over the fastest backend "
                        "sharing its pool (page 64), worst P1 shape (bf16)",
                        w[0] if w else None, "x", "<=", target=PLANNED_VS_FASTEST_MAX,
                        detail=w[1] if w else ""))
    return out


def overhead(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each overhead row's time beside the raw call it adds to, and beside attnreg's wrapper
    of that call (us; None where either did not run)."""
    wrapper_of = {raw: w for w, raw in WRAPS.items() if w != FP8_Q_PLUGIN}
    out = []
    for r in data.get("rows", []):
        if not r.get("results"):
            continue
        for label, (base, _, _) in OVERHEAD.items():
            us, raw = _us(r, label), _us(r, base)
            if us is None:
                continue
            wrapped = _us(r, wrapper_of.get(base, ""))
            out.append({"B": r["B"], "L": r["L"], "H": r["H"], "dtype": r["dtype"],
                        "row": label, "us": us, "raw": base, "raw_us": raw,
                        "added_us": us - raw if raw else None, "wrapper_us": wrapped})
    return out


def _render_overhead(data: dict[str, Any]) -> list[str]:
    rows = [[f"{x['B']}, {x['L']}, {x['H']}", x["dtype"], x["row"], fmt(x["us"], ".1f"),
             fmt(x["raw_us"], ".1f"), fmt(x["added_us"], "+.1f"), fmt(x["wrapper_us"], ".1f")]
            for x in overhead(data)]
    if not rows:
        return []
    return ["Overhead rows (peers.wrapper): the raw call plus one piece of what attnreg's "
            "captured decode adds (us per decode of one layer).", "",
            md_table(["(B, L, H)", "KV", "row", "us", "raw us", "added", "attnreg us"], rows),
            ""]


def render(data: dict[str, Any], page: Page) -> list[str]:
    labels = [FA3_P1, FA3_P64, FLASHMLA_RAW] + [v.label for v in ROWS]
    if any(FP8_Q_PLUGIN in (r.get("results") or {}) for r in data.get("rows", [])):
        labels.append(FP8_Q_PLUGIN)
    lines = [f"One process, {data.get('timing')}; us per decode of one layer.  Raw peers "
             "called directly (planned / scheduled outside the graph); attnreg's backends "
             "through GraphSession.", ""]
    for dtype in data.get("dtypes", []):
        rows = []
        for r in data.get("rows", []):
            if r.get("dtype") != dtype:
                continue
            shape = f"{r['B']}, {r['L']}, {r['H']}"
            if not r.get("results"):
                rows.append([shape] + [str(r.get("skipped") or r.get("error"))[:40]]
                            + ["-"] * (len(labels) - 1))
                continue
            cells = []
            for label in labels:
                res = r["results"].get(label) or {}
                cells.append(fmt(res.get("us"), ".1f") if "us" in res else
                             ("n/d" if "not_declared" in res else
                              "skip" if "skipped" in res else "err" if res else "-"))
            rows.append([shape] + cells)
        lines += [f"**{dtype} KV**", "", md_table(["(B, L, H)", *labels], rows), ""]
    lines += _render_overhead(data)
    r = _ratios(data)
    if r["wrapper"]:
        lines += ["Wrapper / raw: " + "; ".join(f"{k} {v:.3f}x" for k, v in r["wrapper"]), ""]
    if r["fp8_all"]:
        lines += ["bf16 / FP8 time: " + "; ".join(f"{k} {v:.2f}x" for k, v in r["fp8_all"]),
                  ""]
    for dtype, p in (data.get("planned") or {}).items():
        if p.get("error") or not p.get("rows"):
            lines += [f"Per-bucket plan ({dtype}): {p.get('error') or 'nothing measured'}.",
                      ""]
            continue
        rows = [[f"{x['B']}, {x['L']}, {x['H']}", x["backend"], fmt(x["us"], ".1f"),
                 str(x["fastest"]), fmt(x["fastest_us"], ".1f")] for x in p["rows"]]
        raws = ", ".join(f"{k} {v:.1f}" for k, v in p.get("raw_geomeans_us", {}).items())
        lines += [f"Per-bucket plan ({dtype} KV, page {POOL_PAGE}): planned geo-mean "
                  f"{fmt(p.get('geomean_us'), '.1f')} us; raw peers' geo-means: {raws or '-'}",
                  "", md_table(["(B, L, H)", "planned backend", "us", "fastest (page 64)",
                                "us"], rows), ""]
    for what, skipped in (("raw peers", data.get("raw_skipped")),
                          ("attnreg rows", data.get("rows_skipped"))):
        for k, why in (skipped or {}).items():
            lines.append(f"{what}: {k} not run here ({why}).")
    return lines
