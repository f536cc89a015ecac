"""sparse: sparse (DSA) MLA decode at top-k 2048 against dense decode at the same KV length
(issue 32).

At each shape (B, L, H), page size 64, one process times, each as a CUDA graph
replay with the L2 flushed before every replay (:meth:`attnreg.profiling.Clock.calls`):

* **sparse**, every sequence attending ``top_k`` of its ``L`` tokens (distinct
  positions drawn at random, as a top-k indexer would pick them; unsorted):

  - the FlashMLA plugin's ``forward_sparse`` created through the registry,
    captured through :class:`attnreg.runtime.GraphSession` (``sparse=True``, its
    step reading a static top-k tensor, the replay metadata filled once outside
    the graph), as the conformance suite's sparse capture claims run it: over an ``MLAKVPool(kv_format="fp8_ds_mla")`` pool (DeepSeek-V3.2's
    656-byte rows: the legacy sparse fp8 decode kernel) and over a bf16 pool
    (the legacy sparse bf16 prefill kernel, one query row per sequence);
  - the raw kernels, called directly on the same pools and captured through
    ``GraphRunner``: ``flash_mla.flash_mla_with_kvcache(..., indices=...,
    is_fp8_kvcache=True, use_legacy=True, kv_format="V32")`` (its schedule object
    filled by the eager call before capture: it depends on rows, heads and top-k
    only) and ``flash_mla.flash_mla_sparse_fwd(..., use_legacy=True)``;

* **dense** at the same L over every token: the FlashMLA plugin (bf16 pool and
  a plain float8_e4m3 pool), triton and flashinfer_mla (fa3) at page 64 through
  :class:`attnreg.runtime.GraphSession` (as the ``peers`` section), and raw
  FlashMLA dense decode (``flash_mla_with_kvcache(..., use_legacy=True)``, the
  ``peers`` section's call: scheduled outside the graph, q rounded to FP8
  outside it for the FP8 pool).

Every timed output is first compared with a float32 reference on its first
four sequences (sparse: attention over the indexed rows as the pool stores
them); a wrong output is marked wrong and not timed.

From the times, per shape: each dense path over the plugin's sparse FP8 time,
raw over raw, the plugin over the raw sparse kernel, and the rows each reads
(``B * L`` dense, ``B * top_k`` sparse).  One check has a target:
**sparse.vs_dense_bf16**, the fastest dense bf16 decode of the shape over the
plugin's sparse FP8 decode, at every shape with ``L >= 8192``, ``>= 1.0x``
(sparse faster).  Why 1.0x and not more: top-k 2048 reads 2048 rows of 656
bytes per sequence where dense bf16 reads L rows of 1152 bytes (7x fewer bytes
at L = 8192, 28x at 32768), but the one H200 measurement so far (issue 32,
2026-12-01) was 35 us sparse against 66 us dense bf16 at (16, 8192, 64): 1.9x,
not the byte ratio (the sparse kernel dequantises its rows and gathers them
one index block at a time), so only "faster" is claimed; every other ratio is
reported without a target.

``--dry-run`` on a cpu: tiny shapes (top-k 128), the plugin's CPU stand-in for
``flash_mla`` (``plugins/attnreg-flashmla/tests/fake_flash_mla.py``, installed
as ``flash_mla`` for this section only), triton in the interpreter, graphs
replayed eagerly; nothing is measured.  With CUDA and no ``flash_mla`` the
section is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from attnreg.profiling import random_pool

from ._backends import Variant, checked_output, reference_decode
from ._harness import RunContext, SkipSection, error_text
from ._report import ROOT, Page, fmt, md_table, rel
from .metrics import Check, evaluate

SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 32768, 128), (16, 8192, 64), (64, 8192, 128), (128, 4096, 128))
#: 64 heads (what the sparse kernels take), top-k below L so sparse reads a part of it
DRY_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 256, 64),)
TOP_K, DRY_TOP_K = 2048, 128
PAGE = 64
DTYPES = ("bf16", "fp8_e4m3")
#: the check's range: shapes with at least this many tokens per sequence
CHECK_MIN_L = 8192
SPARSE_VS_DENSE_MIN = 1.0
#: norm-relative error against float32: bf16 kernels land near 1e-2; the FP8 dense kernel
#: rounds q to FP8 (a few 1e-2); the sparse FP8 kernel reads rows as the pool stores them;
#: a kernel that ignores its indices or reads the wrong rows lands near 1.
MAX_REL_ERR = {"bf16": 2e-2, "fp8_e4m3": 1e-1, "fp8_ds_mla": 5e-2}
#: the plugin's CPU stand-in for flash_mla (a dry run without CUDA uses it)
STAND_IN = ROOT / "plugins" / "attnreg-flashmla" / "tests" / "fake_flash_mla.py"

SPARSE_FP8, RAW_SPARSE_FP8 = "plugin sparse fp8_ds_mla", "raw sparse fp8_ds_mla"
SPARSE_BF16, RAW_SPARSE_BF16 = "plugin sparse bf16", "raw sparse bf16"
SPARSE_LABELS = (SPARSE_FP8, RAW_SPARSE_FP8, SPARSE_BF16, RAW_SPARSE_BF16)
PLUGIN, RAW_DENSE = "flashmla plugin", "raw FlashMLA"
#: attnreg's dense rows, through GraphSession
DENSE_ROWS: tuple[Variant, ...] = (
    Variant(PLUGIN, "flashmla", page_size=PAGE),
    Variant("triton p64", "triton", page_size=PAGE),
    Variant("flashinfer_mla p64", "flashinfer_mla", {"mla_backend": "fa3"}, page_size=PAGE),
)
DENSE_LABELS = (PLUGIN, RAW_DENSE) + tuple(v.label for v in DENSE_ROWS[1:])
#: rows a dry run on a cpu leaves out, and why (the dense path they share with the plugin's
#: dense row is exercised by that row)
DRY_CPU_SKIP = {"triton p64": "the Triton interpreter takes about 10 s a call at 64 heads; "
                              "the row runs on the device"}


# ----------------------------------------------------------------------------------------
# the library
# ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def flash_mla_library(ctx: RunContext) -> Iterator[str]:
    """``flash_mla`` for this section; yields what it is.

    With CUDA, the installed library (else :class:`SkipSection` with the reason).
    Without (a dry run), the plugin's CPU stand-in, put in ``sys.modules`` as
    ``flash_mla`` until the section ends (what was there before is put back).
    """
    if ctx.cuda:
        try:
            import flash_mla
        except Exception as exc:  # noqa: BLE001 - a missing library is a reason, not a crash
            raise SkipSection(f"flash_mla is not importable ({type(exc).__name__}: {exc}); "
                              "install sgl-flash-mla (pip install --no-deps "
                              "'sgl-flash-mla>=1.0.0')") from None
        yield (f"flash_mla {getattr(flash_mla, '__version__', '?')} "
               f"(has_legacy={getattr(flash_mla, 'has_legacy', lambda: '?')()})")
        return
    if not Path(STAND_IN).is_file():
        raise SkipSection(f"no CUDA device and no CPU stand-in for flash_mla ({rel(STAND_IN)} "
                          "is not in this tree): nothing to run the sparse kernels with")
    spec = importlib.util.spec_from_file_location("flash_mla", STAND_IN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get("flash_mla")
    sys.modules["flash_mla"] = module  # before it runs: its dataclasses look themselves up
    try:
        spec.loader.exec_module(module)
        yield f"the plugin's CPU stand-in {rel(STAND_IN)} (dry run: nothing is measured)"
    finally:
        if before is None:
            sys.modules.pop("flash_mla", None)
        else:
            sys.modules["flash_mla"] = before


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------

def fill_rows(ctx: RunContext, pool: Any, seed: int, chunk: int = 1 << 16) -> None:
    """Rows ~N(0, 1) in every slot of ``pool``, through ``pool.write`` (which packs the
    656-byte ``fp8_ds_mla`` rows), a chunk at a time."""
    torch = ctx.torch
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    for start in range(0, pool.num_slots, chunk):
        n = min(chunk, pool.num_slots - start)
        rows = torch.randn(n, pool.row_dim, generator=gen, device=pool.device)
        slots = torch.arange(start, start + n, dtype=torch.int32, device=pool.device)
        pool.write(slots, rows[:, :512], rows[:, 512:])


def topk_indices(ctx: RunContext, batch: Any, seq_len: int, top_k: int, seed: int) -> Any:
    """int32 ``[B, top_k]``: for each sequence ``top_k`` distinct positions of its
    ``seq_len`` tokens, in random order, as pool slots (-1 past the sequence)."""
    torch = ctx.torch
    B = batch.page_table.shape[0]
    gen = torch.Generator(device=batch.page_table.device).manual_seed(seed)
    keys = torch.rand(B, seq_len, generator=gen, device=batch.page_table.device)
    pos = keys.argsort(dim=1)[:, :top_k]
    table = batch.page_table.long()
    slots = torch.gather(table, 1, pos // PAGE) * PAGE + pos % PAGE
    if top_k > seq_len:
        pad = torch.full((B, top_k - seq_len), -1, dtype=slots.dtype, device=slots.device)
        slots = torch.cat([slots, pad], dim=1)
    return slots.to(torch.int32).contiguous()


def reference_sparse(ctx: RunContext, q: Any, pool: Any, indices: Any, scale: float,
                     rows: int | None = None) -> Any:
    """float32 attention of every query (or the first ``rows``) over its indexed rows as
    the pool stores them (dequantised): ``[B, H, 512]``."""
    torch = ctx.torch
    outs = []
    for b in range(q.shape[0] if rows is None else min(rows, q.shape[0])):
        idx = indices[b][indices[b] != -1]
        kv = pool.read_slots(idx)
        scores = (q[b].float() @ kv.T) * scale
        outs.append(torch.softmax(scores, -1) @ kv[:, :512])
    return torch.stack(outs)


# ----------------------------------------------------------------------------------------
# the timed paths
# ----------------------------------------------------------------------------------------

def _check_and_time(ctx: RunContext, out: Any, ref: Any, fmt_key: str,
                    replay: Callable[[], Any]) -> dict[str, Any]:
    res = checked_output(ctx, out, ref, MAX_REL_ERR[fmt_key])
    if not res["correct"]:
        return res
    m = ctx.time(replay)
    res.update(us=m["median_us"], p20_us=m["p20_us"], p80_us=m["p80_us"], n=m["n"])
    return res


def _captured(ctx: RunContext, call: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
    """``call`` (a raw kernel: it returns the output it allocated) captured through
    GraphRunner and replayed once into a NaN-poisoned output: that output and the replay."""
    from attnreg.runtime import GraphRunner

    held: dict[str, Any] = {}

    def step() -> None:
        held["out"] = call()  # under a device graph: the graph's own output tensor

    graph = GraphRunner(ctx.device).capture(step)
    held["out"].fill_(float("nan"))
    graph.replay()
    return held["out"], graph.replay  # the graph holds step, step the call and its schedule


def raw_sparse_fp8(ctx: RunContext, pool: Any, q: Any, indices: Any, scale: float
                   ) -> Callable[[], Any]:
    """FlashMLA's legacy sparse fp8 decode called directly over the ``fp8_ds_mla`` rows."""
    import flash_mla

    B, H = q.shape[0], q.shape[1]
    q4 = q.view(B, 1, H, 576)
    buf = pool.buffer
    k4 = buf.view(buf.shape[0], buf.shape[1], 1, buf.shape[-1])
    idx = indices.view(B, 1, indices.shape[-1])
    meta = flash_mla.get_mla_metadata()[0]

    def run() -> Any:
        out, _ = flash_mla.flash_mla_with_kvcache(q4, k4, None, None, 512, meta,
                                                  softmax_scale=scale, is_fp8_kvcache=True,
                                                  indices=idx, use_legacy=True,
                                                  kv_format="V32")
        return out.view(B, H, 512)
    return run


def raw_sparse_bf16(ctx: RunContext, pool: Any, q: Any, indices: Any, scale: float
                    ) -> Callable[[], Any]:
    """FlashMLA's legacy sparse bf16 prefill kernel called directly, one row per sequence."""
    import flash_mla

    B = q.shape[0]
    kv = pool.buffer.view(-1, 1, pool.buffer.shape[-1])
    idx = indices.view(B, 1, indices.shape[-1])

    def run() -> Any:
        out, _, _ = flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, d_v=512,
                                                   use_legacy=True, return_log2_lse=False)
        return out
    return run


def plugin_sparse(ctx: RunContext, platform: str, pool: Any, batch: Any, q: Any, indices: Any,
                  kv_dtype: str, seq_len: int) -> tuple[Any, Callable[[], None]]:
    """The plugin's ``forward_sparse`` captured in a FULL decode graph through
    GraphSession (``sparse=True``, one bucket = B, its step reading a static top-k
    tensor, replay metadata prepared once): the graph's output after one replay, and
    the graph's replay."""
    from attnreg.registry import ForwardMode, get_registry
    from attnreg.runtime import GraphSession, MLAConfig, StepInputs

    B, H = q.shape[0], q.shape[1]
    cfg = MLAConfig(num_heads=H, page_size=PAGE, kv_dtype=kv_dtype, device=ctx.device,
                    max_context_len=seq_len)
    be = get_registry().create("flashmla", cfg, platform=platform)

    def step(s: Any) -> None:
        assert s.inputs is not None
        out = s.outputs[0] if s.outputs else None
        be.forward_sparse(s.inputs.q[0], None, None, pool, s.batch, out=out,
                          topk_indices=indices[:s.inputs.q[0].shape[0]])

    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[B], writes_kv=False,
                       sparse=True, max_seq_len=seq_len, step=step,
                       device_graphs=None if ctx.cuda else False)
    ses.capture(batches={B: batch}, inputs={B: StepInputs([q])})
    out = ses.replay(batch, StepInputs([q]), bucket=B)[0]
    out.fill_(float("nan"))
    graph = ses.graph((ForwardMode.DECODE, B))
    graph.replay()
    return out, graph.replay  # the graph holds the session's step (be, indices)


def dense_session(ctx: RunContext, platform: str, v: Variant, pool: Any, batch: Any, q: Any,
                  kv_dtype: str, seq_len: int) -> tuple[Any, Callable[[], None]]:
    """An attnreg backend's dense decode through GraphSession (one bucket = B, replay
    metadata prepared once): the output and the graph's replay."""
    from attnreg.registry import ForwardMode, get_registry
    from attnreg.runtime import GraphSession, MLAConfig, StepInputs

    B, H = q.shape[0], q.shape[1]
    cfg = MLAConfig(num_heads=H, page_size=PAGE, kv_dtype=kv_dtype, device=ctx.device,
                    max_context_len=seq_len)
    be = get_registry().create(v.backend, cfg, platform=_platform_of(ctx, v, platform),
                               **v.options)
    ses = GraphSession(be, pool, phase="decode", mode="full", buckets=[B], writes_kv=False,
                       device_graphs=None if ctx.cuda else False)
    ses.capture()
    out = ses.replay(batch, StepInputs([q]), bucket=B)[0]
    return out, ses.graph((ForwardMode.DECODE, B)).replay


def _platform_of(ctx: RunContext, v: Variant, platform: str) -> str | None:
    """The platform a row's backend is created for: the device's; on a cpu dry run the
    plugin's rows are the stand-in's sm90 (the others run on the cpu)."""
    if ctx.cuda or v.backend == "flashmla":
        return platform
    return None


def _refusal(ctx: RunContext, platform: str, v: Variant, kv_dtype: str, heads: int) -> str:
    """Why this backend is not run here ('' = it is): unavailable, or not declared."""
    from attnreg.registry import Platform, get_registry

    if not ctx.cuda and v.label in DRY_CPU_SKIP:
        return f"skipped: {DRY_CPU_SKIP[v.label]}"
    reg = get_registry()
    plat = _platform_of(ctx, v, platform) or "cpu"
    try:
        avail = reg.availability(v.backend, plat)
    except Exception as exc:  # noqa: BLE001 - an unknown backend is a cell, not a crash
        return f"skipped: {type(exc).__name__}: {exc}"
    if not avail.available:
        return f"skipped: {avail.reason or 'not available here'}"
    caps = reg.declaration(v.backend, Platform.parse(plat))
    why = caps.check_request("mla", "decode", head_dims=(576, 512), q_dtype="bf16",
                             kv_dtype=kv_dtype, page_size=PAGE, num_heads=heads)
    return f"not declared: {'; '.join(why)}" if why else ""


def _plugin_refusal(ctx: RunContext, platform: str, heads: int, top_k: int, fmt_key: str
                    ) -> str:
    """Why the plugin's sparse kernel for these rows is not run here ('' = it is)."""
    from attnreg.registry import Phase, Platform, get_registry

    reg = get_registry()
    try:
        avail = reg.availability("flashmla", platform)
    except Exception as exc:  # noqa: BLE001
        return f"skipped: {type(exc).__name__}: {exc}"
    if not avail.available:
        return f"skipped: {avail.reason or 'not available here'}"
    caps = reg.declaration("flashmla", Platform.parse(platform))
    kernel = next((k for k in caps.sparse_kernels if k.kv_format.value == fmt_key), None)
    if kernel is None:
        return f"not declared: no sparse kernel over {fmt_key} rows"
    why = [] if kernel.accepts_top_k(top_k) else [f"top-k {top_k} not in "
                                                   f"{kernel.describe_top_k()}"]
    why += list(caps.check_sparse_request(Phase.DECODE, q_dtype="bf16",
                                          kv_dtype="fp8_e4m3" if fmt_key == "fp8_ds_mla"
                                          else "bf16", page_size=PAGE, num_heads=heads))
    return f"not declared: {'; '.join(dict.fromkeys(why))}" if why else ""


def _cell(reason: str) -> dict[str, str]:
    kind, _, why = reason.partition(": ")
    return {"not_declared" if kind == "not declared" else "skipped": why}


# ----------------------------------------------------------------------------------------
# one shape
# ----------------------------------------------------------------------------------------

class _Shape:
    """One shape's run: its query, its row of results, and how each path is run."""

    def __init__(self, ctx: RunContext, shape: tuple[int, int, int], top_k: int,
                 platform: str) -> None:
        torch = ctx.torch
        self.ctx, self.shape, self.top_k, self.platform = ctx, shape, top_k, platform
        B, L, H = shape
        torch.manual_seed(B * 1_000_003 + L * 7 + H)
        self.q = torch.randn(B, H, 576, dtype=torch.bfloat16, device=ctx.device)
        self.row: dict[str, Any] = {
            "B": B, "L": L, "H": H, "top_k": top_k,
            "kv_rows": {"dense": B * L, "sparse": B * min(top_k, L)},
            "sparse": {}, "dense": {d: {} for d in DTYPES}}

    def job(self, where: dict[str, Any], label: str, fmt_key: str, ref: Any,
            make: Callable[[], tuple[Any, Callable[[], None]]]) -> None:
        """Run ``make`` (the output of one replay, and the replay), check it, time it."""
        ctx = self.ctx
        if ctx.out_of_time():
            where[label] = {"skipped": "time budget used up"}
        else:
            try:
                out, replay = make()
                where[label] = _check_and_time(ctx, out, ref, fmt_key, replay)
            except Exception as exc:  # noqa: BLE001 - one path must not lose the row
                where[label] = {"error": error_text(exc, 300)}
        ctx.log(f"sparse {self.shape} {label}: {_describe(where[label])}")
        if ctx.cuda:
            ctx.torch.cuda.empty_cache()

    def sparse_rows(self, pool: Any, batch: Any, fmt_key: str, scale: float) -> None:
        """The plugin's sparse kernel over ``pool``'s rows and the raw kernel, same indices."""
        ctx, (_, L, H), q = self.ctx, self.shape, self.q
        idx = topk_indices(ctx, batch, L, self.top_k, seed=H + L)
        ref = reference_sparse(ctx, q, pool, idx, scale)
        fp8 = fmt_key == "fp8_ds_mla"
        plugin, raw = (SPARSE_FP8, RAW_SPARSE_FP8) if fp8 else (SPARSE_BF16, RAW_SPARSE_BF16)
        why = _plugin_refusal(ctx, self.platform, H, self.top_k, fmt_key)
        if why:
            self.row["sparse"][plugin] = _cell(why)
        else:
            self.job(self.row["sparse"], plugin, fmt_key, ref, lambda: plugin_sparse(
                ctx, self.platform, pool, batch, q, idx, "fp8_e4m3" if fp8 else "bf16", L))
        call = raw_sparse_fp8 if fp8 else raw_sparse_bf16
        self.job(self.row["sparse"], raw, fmt_key, ref,
                 lambda: _captured(ctx, call(ctx, pool, q, idx, scale)))

    def dense_rows(self, pool: Any, batch: Any, dtype: str, scale: float) -> None:
        """attnreg's dense decode rows over every token of ``pool``, and raw FlashMLA."""
        from .decode_peers import _flashmla

        ctx, (B, L, H), q = self.ctx, self.shape, self.q
        ref = reference_decode(ctx, q, pool, batch.page_table, [L] * B, scale)
        dense = self.row["dense"][dtype]
        for v in DENSE_ROWS:
            why = _refusal(ctx, self.platform, v, dtype, H)
            if why:
                dense[v.label] = _cell(why)
                continue
            self.job(dense, v.label, dtype, ref, lambda v=v: dense_session(
                ctx, self.platform, v, pool, batch, q, dtype, L))
        self.job(dense, RAW_DENSE, dtype, ref,
                 lambda: _captured(ctx, _flashmla(ctx, pool, batch, q, scale)))

    def pool(self, kv_dtype: str, kv_format: str | None = None) -> tuple[Any, Any, float]:
        """A pool of random rows (``fp8_ds_mla``: written, so packed) holding B sequences of
        L tokens on shuffled pages, their decode batch, and the softmax scale."""
        from attnreg.runtime import MLAConfig, decode_batch

        ctx, (B, L, H) = self.ctx, self.shape
        cfg = MLAConfig(num_heads=H, page_size=PAGE, kv_dtype=kv_dtype, device=ctx.device,
                        max_context_len=L)
        if kv_format:
            pool = cfg.make_pool(-(-B * L // PAGE) + 2, kv_format=kv_format)
            fill_rows(ctx, pool, seed=B + L + H)
        else:
            pool = random_pool(ctx.torch, cfg, B * L, seed=B + L + H)
        return pool, decode_batch(pool, [L] * B, shuffle=B + L), cfg.softmax_scale


def measure_shape(ctx: RunContext, shape: tuple[int, int, int], top_k: int, platform: str
                  ) -> dict[str, Any]:
    """Every path at one shape, a pool at a time (each freed before the next is made):
    fp8_ds_mla rows (the headline), bf16 rows (dense bf16 and sparse bf16), fp8 rows."""
    run = _Shape(ctx, shape, top_k, platform)
    pool, batch, scale = run.pool("fp8_e4m3", "fp8_ds_mla")
    run.sparse_rows(pool, batch, "fp8_ds_mla", scale)
    del pool, batch
    pool, batch, scale = run.pool("bf16")
    run.dense_rows(pool, batch, "bf16", scale)
    run.sparse_rows(pool, batch, "bf16", scale)
    del pool, batch
    pool, batch, scale = run.pool("fp8_e4m3")
    run.dense_rows(pool, batch, "fp8_e4m3", scale)
    return run.row


def _describe(res: dict[str, Any]) -> str:
    if "us" in res:
        return f"{res['us']:.1f} us (rel. err {res['rel_err']:.1e})"
    return str(res.get("skipped") or res.get("not_declared") or res.get("error"))


# ----------------------------------------------------------------------------------------
# the section
# ----------------------------------------------------------------------------------------

def run(ctx: RunContext, data: dict[str, Any]) -> None:
    from attnreg.registry import Platform

    shapes = ctx.pick(SHAPES, SHAPES, DRY_SHAPES)
    top_k = ctx.pick(TOP_K, TOP_K, DRY_TOP_K)
    with flash_mla_library(ctx) as library:
        platform = str(Platform.detect()) if ctx.cuda else "cuda:sm90"
        data.update(rows=[], top_k=top_k, page_size=PAGE, library=library,
                    platform=platform, dry_run=ctx.dry_run,
                    timing="CUDA graph replay, L2 flushed before each replay (Clock.calls)")
        for shape in shapes:
            if ctx.out_of_time():
                data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                     "skipped": "time budget used up"})
                continue
            try:
                data["rows"].append(measure_shape(ctx, shape, top_k, platform))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory: keep the others
                data["rows"].append({"B": shape[0], "L": shape[1], "H": shape[2],
                                     "error": error_text(exc)})
                ctx.log(f"sparse {shape}: {data['rows'][-1]['error']}")
            ctx.save()
    data["checks"] = [c.to_dict() for c in checks(data)]


def _us(cell: dict[str, Any] | None) -> float | None:
    return (cell or {}).get("us")


def fastest_dense(row: dict[str, Any], dtype: str) -> tuple[str | None, float | None]:
    """The fastest correct dense path of ``dtype`` at this shape (label, us)."""
    cells = [(us, label) for label, c in (row.get("dense", {}).get(dtype) or {}).items()
             if (us := _us(c))]
    if not cells:
        return None, None
    us, label = min(cells)
    return label, us


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """Per shape: the dense / sparse and wrapper / raw time ratios (None where a side
    has no time)."""
    sp, dn = row.get("sparse", {}), row.get("dense", {})
    bf16, fp8 = dn.get("bf16", {}), dn.get("fp8_e4m3", {})

    def r(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None
    s8 = _us(sp.get(SPARSE_FP8))
    return {
        "fastest dense bf16 / sparse fp8": r(fastest_dense(row, "bf16")[1], s8),
        "plugin dense bf16 / sparse fp8": r(_us(bf16.get(PLUGIN)), s8),
        "plugin dense fp8 / sparse fp8": r(_us(fp8.get(PLUGIN)), s8),
        "raw dense bf16 / raw sparse fp8": r(_us(bf16.get(RAW_DENSE)),
                                             _us(sp.get(RAW_SPARSE_FP8))),
        "plugin dense bf16 / sparse bf16": r(_us(bf16.get(PLUGIN)), _us(sp.get(SPARSE_BF16))),
        "plugin / raw sparse fp8": r(s8, _us(sp.get(RAW_SPARSE_FP8))),
        "plugin / raw sparse bf16": r(_us(sp.get(SPARSE_BF16)), _us(sp.get(RAW_SPARSE_BF16))),
    }


RATIO_KEYS = tuple(ratios({}))


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    key = "fastest dense bf16 / sparse fp8"
    rows = [r for r in data.get("rows", []) if r["L"] >= CHECK_MIN_L]
    got = [(x, r) for r in rows if (x := ratios(r)[key]) is not None]
    # every shape in range must have the figure, else it is not measured
    worst = min(got, key=lambda t: t[0]) if got and len(got) == len(rows) else None
    if worst:
        r = worst[1]
        detail = (f"at ({r['B']}, {r['L']}, {r['H']}), top-k {r['top_k']}: "
                  f"{fastest_dense(r, 'bf16')[0]} bf16 over {SPARSE_FP8}")
    elif not rows:
        detail = f"no shape of this run has L >= {CHECK_MIN_L}"
    else:
        missing = [f"({r['B']}, {r['L']}, {r['H']})" for r in rows
                   if ratios(r)[key] is None]
        detail = f"no sparse FP8 or dense bf16 time at {', '.join(missing)}"
    return [evaluate("sparse.vs_dense_bf16",
                     f"fastest dense bf16 decode over the plugin's sparse FP8 decode (top-k "
                     f"{data.get('top_k', TOP_K)}, graph replay), worst shape with L >= "
                     f"{CHECK_MIN_L}",
                     worst[0] if worst else None, "x", ">=", target=SPARSE_VS_DENSE_MIN,
                     detail=detail)]


def _cell_text(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    if "us" in c:
        return fmt(c["us"], ".1f")
    return "n/d" if "not_declared" in c else "skip" if "skipped" in c else "err"


def render(data: dict[str, Any], page: Page) -> list[str]:
    lines = [f"One process, {data.get('timing')}; us per decode of one layer, page "
             f"{data.get('page_size', PAGE)}, top-k {data.get('top_k', TOP_K)} distinct "
             "random positions per sequence.  Sparse: the FlashMLA plugin's `forward_sparse` "
             "(fp8_ds_mla rows: sparse fp8 decode kernel; bf16 rows: sparse bf16 prefill "
             "kernel) captured through GraphSession (sparse=True), and the raw kernels called "
             "directly (captured through GraphRunner).  "
             "Dense over all L tokens: attnreg's backends through GraphSession, raw "
             f"FlashMLA called directly.  Library: {data.get('library', '?')}.", ""]
    rows = data.get("rows", [])
    sparse_rows, dense_rows, ratio_rows, notes = [], [], [], []
    for r in rows:
        shape = f"{r['B']}, {r['L']}, {r['H']}"
        if not r.get("sparse") and not r.get("dense"):
            why = str(r.get("skipped") or r.get("error"))
            notes.append(f"({shape}): {why}")
            continue
        sparse_rows.append([shape] + [_cell_text(r["sparse"].get(k)) for k in SPARSE_LABELS])
        dense_rows.append([shape] + [_cell_text(r["dense"][d].get(k)) for d in DTYPES
                                     for k in DENSE_LABELS])
        rs = ratios(r)
        kv = r.get("kv_rows", {})
        ratio_rows.append([shape, f"{kv.get('dense', 0) / max(kv.get('sparse', 1), 1):.1f}"]
                          + [fmt(rs[k], ".2f") for k in RATIO_KEYS])
        for where, cells in [("sparse", r["sparse"])] + [(f"dense {d}", r["dense"][d])
                                                         for d in DTYPES]:
            for label, c in cells.items():
                why = c.get("error") or c.get("not_declared") or c.get("skipped")
                if why:
                    notes.append(f"({shape}) {where} `{label}`: {why}")
    lines += ["**Sparse decode, top-k rows per sequence (us)**", "",
              md_table(["(B, L, H)", *SPARSE_LABELS], sparse_rows), "",
              "**Dense decode, all L rows per sequence (us)**", "",
              md_table(["(B, L, H)", *[f"{k} {d}" for d in DTYPES for k in DENSE_LABELS]],
                       dense_rows), "",
              "**Ratios** (a time over a time; above 1: the second is faster; rows read: "
              "dense B x L over sparse B x top-k)", "",
              md_table(["(B, L, H)", "rows read dense / sparse", *RATIO_KEYS], ratio_rows),
              ""]
    if notes:
        lines += ["Not timed: " + "; ".join(notes) + ".", ""]
    return lines
