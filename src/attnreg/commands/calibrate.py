"""``attnreg calibrate``: measure prefill costs on this GPU and write a cost profile.

The replay gate's cost model (:mod:`attnreg.graph_policy.cost_profile`)
predicts, per prefill batch, the time of the absorbed-MLA graph and of the
eager MHA companion.  This command measures its six terms on the current
device through a registry-created backend, fits them and writes the profile
JSON (raw measurements and fit residuals included):

* ``absorbed_attention``: ``q_nope @ W_UK``, ``forward_extend(method=MLA)``
  (KV write included), ``@ W_UV``; device time;
* ``mha_attention``: ``forward_extend(method=MHA)`` over ragged K/V; device time;
* ``decompress``: gather the latent rows of prefix + new tokens, a real
  ``kv_b_proj`` GEMM ([tokens, 512] x [512, H * 256], bf16), assemble K (rope
  appended) and V; device time;
* ``layer_gpu`` / ``graph_host``: one DeepSeek-V3-shaped layer's
  projections (norms, q_a, q_b, kv_a, rope, o_proj) captured in a CUDA graph:
  device time of a replay and host time to replay, per layer;
* ``eager_host``: host time to issue one eager layer (projections,
  decompression, MHA prefill).

This module holds the arguments and the measurement loop; the layer model,
the clock and the fit are :mod:`attnreg.profiling`'s (shared with the
benchmarks).  Timing (:meth:`attnreg.profiling.Clock.device_us` /
:meth:`~attnreg.profiling.Clock.host_us`): *device time* is measured with CUDA
events while the stream is held
back by ``torch.cuda._sleep`` (so the host has queued the whole call before
the device starts it: no launch gaps, as in a graph replay), with the L2
flushed before each call; *host time* is ``perf_counter`` around issuing the
call while the device is held back.  A measurement is flagged
``host_blocked`` when issuing the call took the host longer than the stall (a
hidden synchronisation, or far more host work than the first call showed):
its device time may then include launch gaps.

``--dry-run`` checks the whole pipeline (measure -> fit -> JSON) on the CPU
with the float32 reference backend and tiny shapes; its profile says
``dry_run: true`` and its numbers mean nothing.

Exit codes: 0 a profile was written; 1 the absorbed and MHA outputs
disagreed somewhere (profile written, ``checks.passed`` false); 2 no CUDA
device (without ``--dry-run``), torch missing, or bad input.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform as pyplatform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnreg.graph_policy.config import DEFAULT_PREFILL_NUM_TOKENS
from attnreg.graph_policy.cost_profile import (
    PROFILE_SCHEMA,
    PROFILE_SCHEMA_VERSION,
    TERMS,
    CostProfile,
    PrefillShape,
    save_profile,
)
from attnreg.profiling import (
    CROSSOVER_PREFIXES,
    DRY_LAYER,
    Clock,
    LayerShape,
    MLALayer,
    batch_record,
    crossover_extend,
    fit_profile_terms,
    kv_slots_of,
    library_versions,
    random_pool,
    rel_error,
)
from attnreg.profiling.progress import Progress

from ._common import (
    add_json_argument,
    add_registry_arguments,
    add_wide_argument,
    check_output_path,
    print_json,
    table,
    width_of,
)

__all__ = [
    "DRY_GRID",
    "FULL_GRID",
    "Grid",
    "add_arguments",
    "default_profile_path",
    "run",
]

#: Absorbed and MHA outputs compute the same function in another order (bf16).
MAX_REL_DIFF = 5e-2

#: The decode profile's default grid: the P1 batch sizes and KV lengths of issue 31.
DECODE_BUCKETS = (1, 8, 32, 64, 128)
DECODE_KV_LENS = (1024, 2048, 4096, 8192, 32768)
#: 2**20 KV tokens (1.2 GB of bf16 rows): every P1 shape fits.
DECODE_MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Grid:
    """What is measured: attention points (B x prefix x extend) and layer token counts."""

    batch_sizes: tuple[int, ...]
    prefixes: tuple[int, ...]
    extends: tuple[int, ...]
    layer_tokens: tuple[int, ...]
    heads: int
    graph_layers: int

    def attention_points(self) -> list[PrefillShape]:
        """Every (B, prefix, extend) point, cheapest first (by attention pairs)."""
        pts = [PrefillShape.uniform(b, p, e, self.heads) for b in self.batch_sizes
               for p in self.prefixes for e in self.extends]
        return sorted(pts, key=lambda s: (s.pairs, s.kv_tokens, s.batch_size))

    @property
    def max_seq_len(self) -> int:
        return max(self.prefixes) + max(self.extends)


FULL_GRID = Grid(batch_sizes=(1, 4), prefixes=(0, 4096, 16384), extends=(128, 512, 2048, 4096),
                 layer_tokens=(128, 512, 2048, 8192, 16384), heads=128, graph_layers=4)
DRY_GRID = Grid(batch_sizes=(1, 2), prefixes=(0, 24), extends=(4, 16), layer_tokens=(4, 16, 48),
                heads=4, graph_layers=2)


# ----------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------

@dataclass
class Session:
    """Everything one calibration run shares."""

    torch: Any
    device: str
    backend_name: str
    grid: Grid
    layer_shape: LayerShape
    page_size: int
    clock: Clock
    budget_s: float
    progress: Progress
    started: float = 0.0

    def log(self, msg: str) -> None:
        """A result of the current step, under its progress line."""
        self.progress.note(f"    {msg}")

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed_s() > self.budget_s


def _measure_layers(ses: Session, layers: list[MLALayer]) -> list[dict[str, Any]]:
    """layer_gpu and graph_host at every layer token count (graph of ``len(layers)`` layers)."""
    torch = ses.torch
    s, heads = ses.layer_shape, ses.grid.heads
    n_layers = len(layers)
    records: list[dict[str, Any]] = []
    gen = torch.Generator(device=ses.device).manual_seed(11)
    for tokens in ses.grid.layer_tokens:
        if ses.out_of_time():
            ses.progress.step(f"layer projections at {tokens} tokens: skipped, time budget "
                              "used up")
            records.append({"term": "layer_gpu", "tokens": tokens,
                            "skipped": "time budget used up"})
            continue
        ses.progress.step(f"layer projections at {tokens} tokens ({n_layers} layers in a graph)")
        x = torch.randn(tokens, s.hidden, dtype=torch.bfloat16, device=ses.device,
                        generator=gen)
        attn = torch.randn(tokens, heads, s.v_dim, dtype=torch.bfloat16, device=ses.device,
                           generator=gen)
        positions = torch.arange(tokens, device=ses.device) % layers[0].cos.shape[0]

        def projections(x: Any = x, attn: Any = attn, positions: Any = positions) -> Any:
            h = x
            for layer in layers:
                layer.pre(h, positions)  # q and kv projections feed attention, not post
                h = layer.post(h, attn)
            return h

        replay, how = _graph_of(ses, projections)
        replay()
        dev = ses.clock.device_us(replay)
        host = ses.clock.host_us(replay)
        eager = ses.clock.eager_us(projections)
        shape = PrefillShape.uniform(1, 0, tokens, heads)
        for term, m in (("layer_gpu", dev), ("graph_host", host)):
            records.append({"term": term, "tokens": tokens, "batch": batch_record(shape),
                            "us": m["us"] / n_layers, "per": f"layer ({n_layers} in the graph)",
                            "samples_us": m["samples_us"], "flags": m["flags"],
                            "graph": how})
        records.append({"term": "layer_eager_wall", "tokens": tokens,
                        "us": eager["us"] / n_layers, "samples_us": eager["samples_us"],
                        "info": "eager projections, events around the call (not fitted)"})
        ses.log(f"graph device {dev['us'] / n_layers:.1f} us/layer, replay host "
                f"{host['us'] / n_layers:.1f} us/layer, eager {eager['us'] / n_layers:.1f} "
                "us/layer")
        del replay
    return records


def _graph_of(ses: Session, fn: Callable[[], Any]) -> tuple[Callable[[], Any], str]:
    """A replay callable for ``fn`` captured by :class:`attnreg.runtime.GraphRunner`.

    On a cpu (dry run) the runner records no device graph: capture runs ``fn``
    once and each replay runs it again, eagerly.
    """
    from attnreg.runtime import GraphRunner

    runner = GraphRunner(ses.device)
    graph = runner.capture(fn)
    how = "cuda graph" if runner.device_graphs else "none (cpu dry run: the layer runs eagerly)"
    return graph.replay, how


def _measure_point(ses: Session, backend: Any, layer: MLALayer, shape: PrefillShape,
                   seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """absorbed_attention, mha_attention, decompress and eager_host at one batch shape."""
    from attnreg.registry import ForwardMethod
    from attnreg.runtime import extend_batch

    torch = ses.torch
    s, heads, dev = ses.layer_shape, shape.heads, ses.device
    seq_lens = [p + e for p, e in zip(shape.prefix_lens, shape.extend_lens)]
    pool = random_pool(torch, backend.config, shape.kv_tokens, seed)
    pages = pool.allocate(seq_lens, shuffle=seed)
    batch = extend_batch(pool, shape.prefix_lens, shape.extend_lens, pages=pages)
    kv_slots = kv_slots_of(torch, pool, pages, seq_lens)
    rows = pool.buffer.view(-1, pool.row_dim)
    new_rows = rows[batch.out_cache_loc.long()]
    # The pool already holds the new tokens' rows: writing them again changes nothing, so
    # both paths attend over the same keys and their outputs can be compared.
    latent_new = new_rows[:, :s.kv_lora].contiguous()
    rope_new = new_rows[:, s.kv_lora:].contiguous()
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    n = shape.q_tokens
    q_nope = torch.randn(n, heads, s.nope, dtype=torch.bfloat16, device=dev, generator=gen)
    q_pe = torch.randn(n, heads, s.rope, dtype=torch.bfloat16, device=dev, generator=gen)
    backend.init_forward_metadata(batch)

    def absorbed() -> Any:
        attn = backend.forward_extend(layer.absorb(q_nope, q_pe), latent_new, rope_new, pool,
                                      batch, method=ForwardMethod.MLA)
        return layer.unabsorb(attn)

    decompressed: dict[str, Any] = {}

    def decompress() -> Any:
        k, v = layer.decompress(rows[kv_slots])
        decompressed["kv"] = (k, v)
        return k

    q_mha = torch.cat([q_nope, q_pe], dim=-1)

    def mha() -> Any:
        k, v = decompressed["kv"]
        return backend.forward_extend(q_mha, latent_new, rope_new, pool, batch,
                                      method=ForwardMethod.MHA, k=k, v=v)

    out_abs = absorbed()
    decompress()
    out_mha = mha()
    diff = rel_error(torch, out_abs, out_mha)
    # JSON has no infinity: a non-finite output is recorded as null (and disagrees).
    check = {"batch": batch_record(shape),
             "rel_diff_absorbed_vs_mha": diff if math.isfinite(diff) else None,
             "agree": diff <= MAX_REL_DIFF}
    records = []
    for term, fn in (("absorbed_attention", absorbed), ("decompress", decompress),
                     ("mha_attention", mha)):
        m = ses.clock.device_us(fn)
        records.append({"term": term, "batch": batch_record(shape), "us": m["us"],
                        "samples_us": m["samples_us"], "flags": m["flags"]})
    del out_abs, out_mha
    # Host time of one whole eager layer (last: its KV write changes the pool).
    x = torch.randn(n, s.hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    positions = torch.arange(n, device=dev) % layer.cos.shape[0]

    def eager_layer() -> Any:
        return layer.forward_mha(x, positions, backend, pool, batch, kv_slots)

    eager_layer()
    m = ses.clock.host_us(eager_layer)
    records.append({"term": "eager_host", "batch": batch_record(shape), "us": m["us"],
                    "samples_us": m["samples_us"], "flags": m["flags"]})
    decompressed.clear()
    by_term = {r["term"]: r["us"] for r in records}
    ses.log(f"absorbed {by_term['absorbed_attention']:.1f} us, "
            f"MHA {by_term['mha_attention']:.1f} + decompress {by_term['decompress']:.1f} us, "
            f"eager host {by_term['eager_host']:.1f} us, rel.diff {diff:.1e}")
    return records, check


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------

def _ints(what: str, minimum: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated ints >= ``minimum`` (``what`` they count)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not allowed: expected comma-separated integers >= {minimum} "
                f"({what}), e.g. {'0,4096' if minimum == 0 else '1,4'}")
        return values
    parse.__name__ = "list"
    return parse


def _count(what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 1 (``what`` it counts)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected an integer "
                                             f">= 1 ({what})")
        return value
    parse.__name__ = "count"
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected a number of "
                                         "seconds above 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="registry backend to calibrate (required unless --dry-run, whose "
                             "default is the reference backend); with --decode, a "
                             "comma-separated list")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the pipeline on the CPU with tiny shapes and the reference "
                             "backend: writes a profile marked dry_run, NOT a measurement")
    grid = parser.add_argument_group("grid (defaults: B 1,4; prefix 0,4096,16384; extend "
                                     "128,512,2048,4096; 128 heads)")
    grid.add_argument("--heads", type=_count("attention heads on one rank"), default=None,
                      metavar="N", help="attention heads on one rank (dry run default 4)")
    grid.add_argument("--batch-sizes", type=_ints("sequences per measured batch", 1),
                      default=None, metavar="B,...",
                      help="sequences per measured prefill batch (dry run default 1,2)")
    grid.add_argument("--prefixes", type=_ints("cached tokens per sequence", 0), default=None,
                      metavar="P,...", help="cached prefix tokens per sequence, 0 allowed "
                                            "(dry run default 0,24)")
    grid.add_argument("--extends", type=_ints("new tokens per sequence", 1), default=None,
                      metavar="E,...", help="new (extend) tokens per sequence (dry run "
                                            "default 4,16)")
    grid.add_argument("--layer-tokens", type=_ints("tokens of a layer measurement", 1),
                      default=None, metavar="N,...",
                      help="token counts of the layer projection measurements (default "
                           "128,512,2048,8192,16384; dry run 4,16,48)")
    grid.add_argument("--page-size", type=_count("tokens per KV-pool page"), default=1,
                      metavar="N", help="tokens per KV-pool page of the measured pool "
                                        "(default 1)")
    grid.add_argument("--time-budget-s", type=_seconds, default=85.0,
                      help="stop starting new measurements after this many seconds (the "
                           "rest is recorded as skipped; default 85)")
    decode = parser.add_argument_group(
        "decode profile (--decode: per backend and capture bucket, for per-bucket decode "
        "backends in the plan)")
    decode.add_argument("--decode", action="store_true",
                        help="measure decode replays per backend (--backend A,B,...), bucket "
                             "and KV length through a GraphSession and write a decode profile "
                             "(default backends: every one given; dry run: triton)")
    decode.add_argument("--buckets", type=_ints("decode batch buckets", 1), default=None,
                        metavar="B,...", help="decode capture buckets (default "
                        f"{','.join(map(str, DECODE_BUCKETS))}; dry run 1,2)")
    decode.add_argument("--kv-lens", type=_ints("KV tokens per sequence", 1), default=None,
                        metavar="L,...", help="KV lengths per sequence (default "
                        f"{','.join(map(str, DECODE_KV_LENS))}; dry run 16,40)")
    decode.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3"), default="bf16",
                        help="KV pool dtype of the decode profile (default bf16)")
    decode.add_argument("--max-kv-tokens", type=_count("KV tokens of one measured batch"),
                        default=DECODE_MAX_TOKENS, metavar="N",
                        help="skip (bucket, KV length) points above this many KV tokens "
                             f"(default {DECODE_MAX_TOKENS})")
    shown = parser.add_argument_group("output")
    shown.add_argument("-o", "--output", default=None, metavar="FILE",
                       help="where to write the profile JSON (default: "
                            "~/.cache/attnreg/profiles/BACKEND-PLATFORM-KV.json)")
    add_json_argument(shown)
    add_wide_argument(shown)
    shown.add_argument("-q", "--quiet", action="store_true",
                       help="no progress lines (shown on stderr when it is a terminal)")
    shown.add_argument("--progress", action="store_true",
                       help="progress lines on stderr even when it is not a terminal (a log "
                            "file)")
    add_registry_arguments(parser)


def default_profile_path(backend: str, platform: str, kv_dtype: str, *,
                         dry_run: bool = False) -> Path:
    """``$XDG_CACHE_HOME/attnreg/profiles/BACKEND-PLATFORM-KV[-dry-run].json``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = f"{backend}-{platform.replace(':', '-')}-{kv_dtype}" + ("-dry-run" if dry_run else "")
    return cache / "attnreg" / "profiles" / f"{name}.json"


def _fail(message: str) -> int:
    print(f"attnreg calibrate: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_output_path(args.output, "the profile")  # before minutes of measuring
    if args.decode and args.dry_run:
        # the triton kernels run in the interpreter on a cpu; set before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import torch
    except ImportError:
        return _fail("torch is not installed; calibration runs kernels (pip install "
                     "attnreg[torch] plus the backend's extra)")
    if args.decode:
        return _calibrate_decode(args, torch)
    if args.dry_run:
        device, grid, shape = "cpu", DRY_GRID, DRY_LAYER
        backend_name = args.backend or "reference"
    else:
        if not torch.cuda.is_available():
            return _fail("no CUDA device: calibration measures the GPU the profile will "
                         "describe, so run it on that machine; or pass --dry-run to check the "
                         "pipeline on this CPU (tiny shapes, reference backend, not a real "
                         "profile)")
        if not args.backend:
            return _fail("pass --backend NAME (e.g. --backend triton): a profile describes "
                         "one backend")
        device, grid, shape = "cuda", FULL_GRID, LayerShape()
        backend_name = args.backend
    # the option types refuse 0 (and negative) values, so `or` only fills what was not given
    grid = Grid(batch_sizes=args.batch_sizes or grid.batch_sizes,
                prefixes=args.prefixes or grid.prefixes,
                extends=args.extends or grid.extends,
                layer_tokens=args.layer_tokens or grid.layer_tokens,
                heads=args.heads or grid.heads, graph_layers=grid.graph_layers)
    return _calibrate(args, torch, device, grid, shape, backend_name)


def _calibrate(args: argparse.Namespace, torch: Any, device: str, grid: Grid,
               shape: LayerShape, backend_name: str) -> int:
    from attnreg.registry import Platform, UnsupportedError
    from attnreg.runtime import MLAConfig

    from ._common import registry_from

    started = time.perf_counter()
    points = grid.attention_points()
    progress = Progress.for_terminal(len(grid.layer_tokens) + len(points), quiet=args.quiet,
                                     force=args.progress, budget_s=float(args.time_budget_s),
                                     started=started)
    platform = Platform.parse("cpu") if args.dry_run else Platform.detect()
    reg = registry_from(args)
    max_positions = max(grid.max_seq_len, max(grid.layer_tokens)) + 1
    config = MLAConfig(num_heads=grid.heads, page_size=args.page_size, device=device,
                       max_context_len=grid.max_seq_len)
    backend = reg.create(backend_name, config, platform=platform)
    clock = Clock(torch, device)
    ses = Session(torch, device, backend_name, grid, shape, args.page_size, clock,
                  float(args.time_budget_s), progress, started)
    progress.note(f"calibrating {backend_name} on {platform} ({_device_name(torch, device)}), "
                  f"{grid.heads} heads: {progress.total} measurements, at most "
                  f"{args.time_budget_s:g} s")
    layers = [MLALayer(torch, shape, grid.heads, device, seed=i, max_positions=max_positions)
              for i in range(grid.graph_layers)]
    measurements: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    measurements += _measure_layers(ses, layers)
    last: tuple[float, int] | None = None  # (seconds, pairs) of the previous point
    for i, point in enumerate(points):
        # Points grow in cost; one predicted to end after the budget is not started.
        predicted_s = 0.0 if last is None else last[0] * max(1.0, point.pairs / max(last[1], 1))
        what = (f"attention at B={point.batch_size} prefix={point.prefix_lens[0]} "
                f"extend={point.extend_lens[0]}")
        if ses.out_of_time() or ses.elapsed_s() + predicted_s > ses.budget_s:
            progress.step(f"{what}: skipped, the time budget is used up (or would be)")
            measurements.append({"term": "attention", "batch": batch_record(point),
                                 "skipped": "time budget used up (or would be)"})
            continue
        progress.step(what)
        t0 = time.perf_counter()
        try:
            recs, check = _measure_point(ses, backend, layers[0], point, seed=100 + i)
        except UnsupportedError as exc:
            return _fail(f"{backend_name} cannot run a measurement: {exc}")
        last = (time.perf_counter() - t0, point.pairs)
        measurements += recs
        checks.append(check)
        if clock.cuda:
            torch.cuda.empty_cache()
    terms, missing = fit_profile_terms(measurements)
    if missing:
        return _fail(f"no measurement of {missing} within the time budget "
                     f"({args.time_budget_s:g} s); raise --time-budget-s or shrink the grid")
    passed = all(c["agree"] for c in checks)
    profile = {
        "schema": PROFILE_SCHEMA,
        "schema_version": PROFILE_SCHEMA_VERSION,
        "backend": backend_name,
        "platform": str(platform),
        "kv_dtype": str(config.kv_dtype),
        "device": _device_name(torch, device),
        "dry_run": bool(args.dry_run),
        "note": ("DRY RUN on the CPU with tiny shapes: the numbers mean nothing; not a "
                 "profile to ship or to decide with") if args.dry_run else
                "measured by `attnreg calibrate`",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "calibration": {
            "heads": grid.heads, "page_size": args.page_size, "q_dtype": "bf16",
            "layer": asdict(shape), "grid": asdict(grid), "timing": clock.method,
            "wall_s": round(time.perf_counter() - started, 2),
            "time_budget_s": args.time_budget_s,
            "skipped": sum(1 for m in measurements if "skipped" in m),
        },
        "model": {"graph_absorbed": "max(graph_host, layer_gpu(padded tokens) + "
                                    "absorbed_attention)",
                  "eager_mha": "max(eager_host, layer_gpu(tokens) + mha_attention + "
                               "decompress)",
                  "unit": "microseconds per layer"},
        "terms": terms,
        "checks": {"passed": passed, "max_rel_diff_allowed": MAX_REL_DIFF, "points": checks},
        "measurements": measurements,
    }
    out = Path(args.output) if args.output else default_profile_path(
        backend_name, str(platform), str(config.kv_dtype), dry_run=args.dry_run)
    save_profile(profile, out)
    loaded = CostProfile.from_dict(profile, source=str(out))
    if args.json:
        print_json(dict(profile, written_to=str(out)))
    else:
        print(_summary(loaded, terms, checks, out, time.perf_counter() - started,
                       width_of(args)))
    if not passed:
        bad = [c for c in checks if not c["agree"]]
        print(f"attnreg calibrate: absorbed and MHA outputs disagree at {len(bad)} point(s) "
              f"(rel. diff above {MAX_REL_DIFF:g}), e.g. {bad[0]}: a kernel computes something "
              "else, so these timings do not describe it", file=sys.stderr)
        return 1
    return 0


def _calibrate_decode(args: argparse.Namespace, torch: Any) -> int:
    """``--decode``: a decode profile of every backend given, per bucket and KV length."""
    from attnreg.graph_policy.decode_profile import (
        DECODE_PROFILE_SCHEMA,
        DECODE_PROFILE_SCHEMA_VERSION,
        DecodeProfile,
        save_decode_profile,
    )
    from attnreg.profiling import decode_points, measure_decode
    from attnreg.registry import AttnregError, Platform
    from attnreg.runtime import MLAConfig

    from ._common import registry_from

    started = time.perf_counter()
    if args.dry_run:
        device, platform = "cpu", Platform.parse("cpu")
        names = _names(args.backend or "triton")
        buckets, kv_lens, heads = args.buckets or (1, 2), args.kv_lens or (16, 40), \
            args.heads or 2
    else:
        if not torch.cuda.is_available():
            return _fail("no CUDA device: a decode profile describes the GPU it was measured "
                         "on; run it there, or pass --dry-run to check the pipeline on this CPU")
        if not args.backend:
            return _fail("pass --backend A,B,... (the backends whose buckets the plan may "
                         "choose between), e.g. --backend flashmla,triton")
        device, platform = "cuda", Platform.detect()
        names = _names(args.backend)
        buckets, kv_lens, heads = args.buckets or DECODE_BUCKETS, \
            args.kv_lens or DECODE_KV_LENS, args.heads or 16
    if not names:
        return _fail(f"--backend {args.backend!r} names no backend")
    points = decode_points(buckets, kv_lens, args.max_kv_tokens)
    if not points:
        return _fail(f"no (bucket, KV length) point fits --max-kv-tokens {args.max_kv_tokens}")
    config = MLAConfig(num_heads=heads, page_size=args.page_size, kv_dtype=args.kv_dtype,
                       device=device, max_context_len=max(kv_lens))
    reg = registry_from(args)
    try:
        backends = {n: reg.create(n, config, platform=platform) for n in names}
    except AttnregError as exc:
        return _fail(f"cannot create a backend for this pool ({heads} heads, page size "
                     f"{args.page_size}, {args.kv_dtype} KV): {str(exc).splitlines()[0]}")
    tokens = max(b * n for b, n in points)
    pool = random_pool(torch, config, tokens, seed=7)
    clock = Clock(torch, device)
    progress = Progress.for_terminal(len(names) * len(points), quiet=args.quiet,
                                     force=args.progress, budget_s=float(args.time_budget_s),
                                     started=started)
    progress.note(f"decode profile of {', '.join(names)} on {platform} "
                  f"({_device_name(torch, device)}), {heads} heads, page {args.page_size}, "
                  f"{args.kv_dtype} KV: {len(points)} points per backend")

    def skip(name: str, bucket: int, kv_len: int) -> str:
        progress.step(f"{name} at bucket {bucket}, KV {kv_len}")
        if time.perf_counter() - started > float(args.time_budget_s):
            return "time budget used up"
        return ""

    try:
        entries = measure_decode(torch, backends, pool, points, clock,
                                 device_graphs=False if device == "cpu" else None, skip=skip,
                                 log=lambda m: progress.note(f"    {m}"))
    except AttnregError as exc:
        return _fail(f"a backend refused a measurement: {str(exc).splitlines()[0]}")
    if not entries:
        return _fail(f"nothing measured within the time budget ({args.time_budget_s:g} s)")
    profile = {
        "schema": DECODE_PROFILE_SCHEMA, "schema_version": DECODE_PROFILE_SCHEMA_VERSION,
        "platform": str(platform), "heads": heads, "kv_dtype": args.kv_dtype,
        "page_size": args.page_size, "device": _device_name(torch, device),
        "dry_run": bool(args.dry_run),
        "note": ("DRY RUN on the CPU with tiny shapes: the numbers mean nothing" if args.dry_run
                 else "measured by `attnreg calibrate --decode`: one layer's decode, the "
                      "captured graph replayed, L2 flushed before each replay"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "timing": {"method": clock.method, "wall_s": round(time.perf_counter() - started, 2),
                   "time_budget_s": args.time_budget_s},
        "entries": entries,
    }
    out = Path(args.output) if args.output else default_profile_path(
        "decode-" + "+".join(names), str(platform), args.kv_dtype, dry_run=args.dry_run)
    save_decode_profile(profile, out)
    loaded = DecodeProfile.from_dict(profile, source=str(out))
    if args.json:
        print_json(dict(profile, written_to=str(out)))
        return 0
    rows = []
    for e in loaded.entries:
        for kv_len, us in e.points:
            rows.append((e.backend, e.bucket, kv_len, f"{us:.1f}"))
    print(f"decode profile {loaded.label}\n")
    print(table(("backend", "bucket", "KV length", "us (median)"), rows, width=width_of(args)))
    print(f"\nwritten to {out} in {time.perf_counter() - started:.1f} s")
    if loaded.dry_run:
        print("DRY RUN: these numbers mean nothing; do not plan with this profile")
    return 0


def _names(text: str) -> list[str]:
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def _device_name(torch: Any, device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name())
    return f"cpu ({pyplatform.processor() or pyplatform.machine()})"


def _fmt_coef(value: float) -> str:
    return f"{value:.3g}"


def _summary(profile: CostProfile, terms: dict[str, dict[str, Any]],
             checks: list[dict[str, Any]], out: Path, wall_s: float,
             width: int | None = None) -> str:
    rows = []
    for name in TERMS:
        t = terms[name]
        coefs = ", ".join(f"{f}={_fmt_coef(c)}" for f, c in t["coefficients_us"].items() if c)
        fit = t["fit"]
        rows.append((name, coefs or "0", fit["points"],
                     f"{100 * fit['max_abs_relative_residual']:.1f}%",
                     f"{100 * fit['rms_relative_residual']:.1f}%"))
    lines = [f"cost profile for {profile.label}", "",
             table(("term", "coefficients (us per unit)", "points", "max |rel. residual|",
                    "rms"), rows, wrap_columns=("coefficients (us per unit)",), width=width),
             ""]
    heads = profile.calibrated_heads or 128
    buckets = DEFAULT_PREFILL_NUM_TOKENS
    lines.append(f"crossover (1 sequence, {heads} heads, token buckets up to {buckets[-1]}):")
    for prefix in CROSSOVER_PREFIXES:
        point = crossover_extend(profile, heads=heads, prefix=prefix, max_extend=buckets[-1],
                                 buckets=buckets)
        lines.append(f"  {point.describe()}")
    diffs = [c["rel_diff_absorbed_vs_mha"] for c in checks]
    worst = max((math.inf if d is None else d for d in diffs), default=math.nan)
    lines += ["", (f"checks: absorbed vs MHA outputs, max rel. diff {worst:.1e} "
                   f"(allowed {MAX_REL_DIFF:g}) over {len(checks)} points"),
              f"written to {out} in {wall_s:.1f} s"]
    if profile.dry_run:
        lines.append("DRY RUN: these numbers mean nothing; do not ship this profile")
    return "\n".join(lines)
