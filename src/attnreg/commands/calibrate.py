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

Timing: *device time* is measured with CUDA events while the stream is held
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnreg.graph_policy.config import DEFAULT_PREFILL_NUM_TOKENS
from attnreg.graph_policy.cost_profile import (
    PROFILE_SCHEMA,
    PROFILE_SCHEMA_VERSION,
    TERM_FEATURES,
    TERMS,
    CostProfile,
    PrefillShape,
    crossover_extend,
    fit_term,
    save_profile,
)

from ._common import add_json_argument, add_registry_arguments, print_json, table

__all__ = [
    "DRY_GRID",
    "DRY_LAYER",
    "FULL_GRID",
    "Clock",
    "Grid",
    "LayerShape",
    "MLALayer",
    "add_arguments",
    "default_profile_path",
    "rel_diff",
    "run",
]

#: Absorbed and MHA outputs compute the same function in another order (bf16).
MAX_REL_DIFF = 5e-2
#: Prefixes the crossover summary is printed for.
CROSSOVER_PREFIXES = (0, 4096, 32768)
#: L2 flush buffer: five times the H200's 50 MB L2.
_FLUSH_BYTES = 256 * 2 ** 20


@dataclass(frozen=True)
class LayerShape:
    """Projection widths of one MLA attention block (DeepSeek-V3 by default)."""

    hidden: int = 7168
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_dim: int = 128


#: Tiny widths for dry runs (kv_lora, rope, nope, v_dim are the kernels' fixed dims).
DRY_LAYER = LayerShape(hidden=256, q_lora=128)


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
# the layer
# ----------------------------------------------------------------------------------------

class MLALayer:
    """One MLA attention layer with random bf16 weights: the projections around attention.

    ``pre`` -> (absorbed: ``absorb`` -> attention -> ``unabsorb``; MHA:
    ``decompress`` -> attention) -> ``post``.  ``kv_b`` [H * (nope + v), kv_lora]
    is one matrix; its per-head blocks are ``w_uk`` and ``w_uv``, so both forms
    compute the same function.

    Parameters
    ----------
    torch : module
        torch (passed in so that importing this module never imports it).
    shape : LayerShape
    heads : int
        Attention heads on this rank.
    device : str
    seed : int
    max_positions : int
        Rows of the rope tables.
    """

    def __init__(self, torch: Any, shape: LayerShape, heads: int, device: str, *, seed: int,
                 max_positions: int) -> None:
        self.torch = torch
        self.shape = shape
        self.heads = heads
        s, h = shape, heads
        bf16 = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*dims: int, fan_in: int) -> Any:
            # ~N(0, 1/fan_in): activations keep unit scale through the layer.
            w = torch.empty(*dims, dtype=bf16, device=device)
            return w.normal_(0.0, fan_in ** -0.5, generator=gen)

        def ones(n: int) -> Any:
            return torch.ones(n, dtype=bf16, device=device)

        self.in_norm, self.q_a_norm, self.kv_a_norm = ones(s.hidden), ones(s.q_lora), \
            ones(s.kv_lora)
        self.q_a = weight(s.q_lora, s.hidden, fan_in=s.hidden)
        self.q_b = weight(h * (s.nope + s.rope), s.q_lora, fan_in=s.q_lora)
        self.kv_a = weight(s.kv_lora + s.rope, s.hidden, fan_in=s.hidden)
        self.kv_b = weight(h * (s.nope + s.v_dim), s.kv_lora, fan_in=s.kv_lora)
        per_head = self.kv_b.view(h, s.nope + s.v_dim, s.kv_lora)
        self.w_uk = per_head[:, :s.nope, :].contiguous()                  # [H, nope, kv_lora]
        self.w_uv = per_head[:, s.nope:, :].transpose(1, 2).contiguous()  # [H, kv_lora, v]
        self.o = weight(s.hidden, h * s.v_dim, fan_in=h * s.v_dim)
        half = s.rope // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32, device=device)
                                      / half))
        angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] \
            * inv_freq[None, :]
        self.cos, self.sin = angles.cos().to(bf16), angles.sin().to(bf16)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.shape.rope // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def pre(self, x: Any, positions: Any) -> tuple[Any, Any, Any, Any]:
        """``x [N, hidden]`` -> ``q_nope [N,H,nope], q_pe [N,H,rope], c_kv [N,kv_lora],
        k_pe [N,rope]``."""
        F = self.torch.nn.functional
        s, n = self.shape, x.shape[0]
        h = F.rms_norm(x, (s.hidden,), self.in_norm, eps=1e-6)
        qa = F.rms_norm(F.linear(h, self.q_a), (s.q_lora,), self.q_a_norm, eps=1e-6)
        q = F.linear(qa, self.q_b).view(n, self.heads, s.nope + s.rope)
        q_nope, q_pe = q.split([s.nope, s.rope], dim=-1)
        c_kv, k_pe = F.linear(h, self.kv_a).split([s.kv_lora, s.rope], dim=-1)
        c_kv = F.rms_norm(c_kv, (s.kv_lora,), self.kv_a_norm, eps=1e-6)
        cos, sin = self.cos[positions], self.sin[positions]
        q_pe = self._rope(q_pe, cos[:, None, :], sin[:, None, :])
        k_pe = self._rope(k_pe, cos, sin)
        return q_nope, q_pe, c_kv, k_pe

    def absorb(self, q_nope: Any, q_pe: Any) -> Any:
        """The absorbed query ``[N, H, kv_lora + rope]``: ``q_nope @ W_UK`` then the rope part."""
        torch = self.torch
        q_abs = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        return torch.cat([q_abs, q_pe], dim=-1)

    def unabsorb(self, attn: Any) -> Any:
        """``[N, H, kv_lora]`` -> ``[N, H, v]`` with ``W_UV``."""
        return self.torch.bmm(attn.transpose(0, 1), self.w_uv).transpose(0, 1)

    def decompress(self, rows: Any) -> tuple[Any, Any]:
        """Latent rows ``[Tk, kv_lora + rope]`` -> ``k [Tk, H, nope + rope]``, ``v [Tk, H, v]``."""
        torch = self.torch
        F = torch.nn.functional
        s, tk = self.shape, rows.shape[0]
        kv = F.linear(rows[:, :s.kv_lora], self.kv_b).view(tk, self.heads, s.nope + s.v_dim)
        k_nope, v = kv.split([s.nope, s.v_dim], dim=-1)
        k_pe = rows[:, None, s.kv_lora:].expand(tk, self.heads, s.rope)
        return torch.cat([k_nope, k_pe], dim=-1), v.contiguous()

    def post(self, x: Any, out: Any) -> Any:
        """Residual add of ``o_proj(out [N, H, v])``."""
        F = self.torch.nn.functional
        return x + F.linear(out.reshape(x.shape[0], self.heads * self.shape.v_dim), self.o)

    def forward_absorbed(self, x: Any, positions: Any, backend: Any, pool: Any,
                         batch: Any) -> Any:
        """The graph path: absorbed MLA (``batch`` None under capture)."""
        from attnreg.registry import ForwardMethod

        q_nope, q_pe, c_kv, k_pe = self.pre(x, positions)
        attn = backend.forward_extend(self.absorb(q_nope, q_pe), c_kv, k_pe, pool, batch,
                                      method=ForwardMethod.MLA)
        return self.post(x, self.unabsorb(attn))

    def forward_mha(self, x: Any, positions: Any, backend: Any, pool: Any, batch: Any,
                    kv_slots: Any) -> Any:
        """The eager path: write the new rows, decompress prefix + new tokens, ragged MHA.

        ``kv_slots``: flat pool slots of every sequence's tokens in ``kv_indptr`` order.
        """
        from attnreg.registry import ForwardMethod

        torch = self.torch
        q_nope, q_pe, c_kv, k_pe = self.pre(x, positions)
        pool.write(batch.out_cache_loc, c_kv, k_pe)
        k, v = self.decompress(pool.buffer.view(-1, pool.row_dim)[kv_slots])
        attn = backend.forward_extend(torch.cat([q_nope, q_pe], dim=-1), None, None, pool,
                                      batch, method=ForwardMethod.MHA, k=k, v=v)
        return self.post(x, attn)


def kv_slots_of(torch: Any, pool: Any, pages: Sequence[Sequence[int]],
                seq_lens: Sequence[int]) -> Any:
    """Flat slots of every token of every sequence, in ``kv_indptr`` order (int64)."""
    slots: list[int] = []
    for p, n in zip(pages, seq_lens):
        slots.extend(pool.slots(p, range(n)))
    return torch.tensor(slots, dtype=torch.long, device=pool.device)


def random_pool(torch: Any, config: Any, tokens: int, seed: int) -> Any:
    """A pool with room for ``tokens`` tokens (plus the padding page), rows ~N(0, 1)."""
    pool = config.make_pool(-(-tokens // config.page_size) + 2)
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    pool.buffer.normal_(generator=gen)
    return pool


def rel_diff(torch: Any, out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float32; inf when ``out`` is not finite."""
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------

def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class Clock:
    """Device and host times of a call, the way the cost model needs them.

    On CUDA: ``device_us`` = CUDA events around the call while the stream is
    held back by ``torch.cuda._sleep`` (the host queues the whole call first,
    as a graph replay would run it), L2 flushed before each call;
    ``host_us`` = ``perf_counter`` around issuing the call while the device is
    held back.  On CPU (dry runs) both are wall-clock times.
    """

    def __init__(self, torch: Any, device: str, *, target_ms: float = 40.0,
                 min_reps: int = 3, max_reps: int = 15) -> None:
        self.torch = torch
        self.cuda = str(device).startswith("cuda")
        self.target_ms = target_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self._flush: Any = None
        self.cycles_per_us: float | None = None
        if self.cuda:
            self._flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=device)
            self.cycles_per_us = self._sleep_rate()

    @property
    def method(self) -> dict[str, str]:
        if not self.cuda:
            return {"device": "wall clock on cpu (dry run: not a measurement)",
                    "host": "wall clock on cpu (dry run: not a measurement)"}
        stall = ("stream held back with torch.cuda._sleep" if self.cycles_per_us
                 else "torch.cuda._sleep unavailable: launch gaps included")
        return {"device": f"CUDA events per call, {stall}, L2 flushed, median",
                "host": f"perf_counter around issuing the call, {stall}, median"}

    def _sleep_rate(self) -> float | None:
        torch = self.torch
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        sleep(1000)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 2_000_000
        start.record()
        sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3
        return cycles / us if us > 0 else None

    def _stall(self, us: float) -> None:
        if self.cycles_per_us:
            self.torch.cuda._sleep(int(us * self.cycles_per_us))

    def reps_for(self, estimate_us: float) -> int:
        """Timed calls for a call of about ``estimate_us``: ``target_ms`` worth, clamped."""
        n = int(self.target_ms * 1e3 / max(estimate_us, 1.0))
        return max(self.min_reps, min(self.max_reps, n))

    def _probe(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """One call: (host time to issue it, device time with events around it), us."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e6
        end.record()
        torch.cuda.synchronize()
        return host, start.elapsed_time(end) * 1e3

    def _wall(self, fn: Callable[[], Any], kind: str) -> dict[str, Any]:
        samples = []
        for _ in range(self.min_reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return _sample(samples, [], kind)

    def device_us(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Median device time of ``fn`` (call it once before, to compile and plan)."""
        if not self.cuda:
            return self._wall(fn, "device")
        torch = self.torch
        host, estimate = self._probe(fn)
        # Hold the stream back long enough for the host to queue the whole call.
        stall_us = min(max(3.0 * host + 200.0, 500.0), 500_000.0)
        samples, flags = [], []
        for _ in range(self.reps_for(estimate)):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            self._stall(stall_us)
            self._flush.zero_()
            start.record()
            fn()
            end.record()
            issued_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
            if self.cycles_per_us and issued_us >= 0.9 * stall_us:
                flags.append("host_blocked")
        return _sample(samples, sorted(set(flags)), "device")

    def host_us(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Median host time to issue ``fn`` (call it once before)."""
        if not self.cuda:
            return self._wall(fn, "host")
        torch = self.torch
        host, _ = self._probe(fn)
        stall_us = min(max(3.0 * host + 500.0, 1000.0), 500_000.0)
        samples, flags = [], []
        for _ in range(max(self.min_reps, 5)):
            torch.cuda.synchronize()
            self._stall(stall_us)
            t0 = time.perf_counter()
            fn()
            issued_us = (time.perf_counter() - t0) * 1e6
            samples.append(issued_us)
            if self.cycles_per_us and issued_us >= 0.9 * stall_us:
                flags.append("host_blocked")
        torch.cuda.synchronize()
        return _sample(samples, sorted(set(flags)), "host")


def _sample(samples: list[float], flags: list[str], kind: str) -> dict[str, Any]:
    return {"us": _median(samples), "samples_us": [round(s, 3) for s in samples],
            "kind": kind, "flags": flags}


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
    log: Callable[[str], None]
    started: float = 0.0

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
            records.append({"term": "layer_gpu", "tokens": tokens,
                            "skipped": "time budget used up"})
            continue
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
        eager = ses.clock.device_us(projections) if not ses.clock.cuda else \
            _eager_wall_us(ses, projections)
        shape = PrefillShape.uniform(1, 0, tokens, heads)
        for term, m in (("layer_gpu", dev), ("graph_host", host)):
            records.append({"term": term, "tokens": tokens, "batch": _batch_dict(shape),
                            "us": m["us"] / n_layers, "per": f"layer ({n_layers} in the graph)",
                            "samples_us": m["samples_us"], "flags": m["flags"],
                            "graph": how})
        records.append({"term": "layer_eager_wall", "tokens": tokens,
                        "us": eager["us"] / n_layers, "samples_us": eager["samples_us"],
                        "info": "eager projections, events around the call (not fitted)"})
        ses.log(f"layer x{n_layers} tokens={tokens}: graph device "
                f"{dev['us'] / n_layers:.1f} us/layer, replay host {host['us'] / n_layers:.1f} "
                f"us/layer, eager {eager['us'] / n_layers:.1f} us/layer")
        del replay
    return records


def _eager_wall_us(ses: Session, fn: Callable[[], Any]) -> dict[str, Any]:
    """Events around an eager call with nothing queued before it (host cost included)."""
    torch = ses.torch
    fn()
    samples = []
    for _ in range(ses.clock.min_reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return _sample(samples, [], "device")


def _graph_of(ses: Session, fn: Callable[[], Any]) -> tuple[Callable[[], Any], str]:
    """A replay callable for ``fn`` captured in a CUDA graph (on CPU: ``fn`` itself)."""
    torch = ses.torch
    if not ses.clock.cuda:
        return fn, "none (cpu dry run: the layer runs eagerly)"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay, "cuda graph"


def _batch_dict(shape: PrefillShape) -> dict[str, Any]:
    return {"prefix_lens": list(shape.prefix_lens), "extend_lens": list(shape.extend_lens),
            "heads": shape.heads}


def _measure_point(ses: Session, backend: Any, layer: MLALayer, shape: PrefillShape,
                   seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """absorbed_attention, mha_attention, decompress and eager_host at one batch shape."""
    from attnreg.backends.batch import extend_batch
    from attnreg.registry import ForwardMethod

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
    diff = rel_diff(torch, out_abs, out_mha)
    # JSON has no infinity: a non-finite output is recorded as null (and disagrees).
    check = {"batch": _batch_dict(shape),
             "rel_diff_absorbed_vs_mha": diff if math.isfinite(diff) else None,
             "agree": diff <= MAX_REL_DIFF}
    records = []
    for term, fn in (("absorbed_attention", absorbed), ("decompress", decompress),
                     ("mha_attention", mha)):
        m = ses.clock.device_us(fn)
        records.append({"term": term, "batch": _batch_dict(shape), "us": m["us"],
                        "samples_us": m["samples_us"], "flags": m["flags"]})
    del out_abs, out_mha
    # Host time of one whole eager layer (last: its KV write changes the pool).
    x = torch.randn(n, s.hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    positions = torch.arange(n, device=dev) % layer.cos.shape[0]

    def eager_layer() -> Any:
        return layer.forward_mha(x, positions, backend, pool, batch, kv_slots)

    eager_layer()
    m = ses.clock.host_us(eager_layer)
    records.append({"term": "eager_host", "batch": _batch_dict(shape), "us": m["us"],
                    "samples_us": m["samples_us"], "flags": m["flags"]})
    decompressed.clear()
    by_term = {r["term"]: r["us"] for r in records}
    ses.log(f"B={shape.batch_size} prefix={shape.prefix_lens[0]} "
            f"extend={shape.extend_lens[0]}: absorbed {by_term['absorbed_attention']:.1f} us, "
            f"MHA {by_term['mha_attention']:.1f} + decompress {by_term['decompress']:.1f} us, "
            f"eager host {by_term['eager_host']:.1f} us, rel.diff {diff:.1e}")
    return records, check


def fit_profile_terms(measurements: Sequence[dict[str, Any]]
                      ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Fit every term from its measurements; annotate each measurement with its prediction.

    Returns the ``terms`` object of the profile and the names of terms that
    had no measurement (fitted as zero, which makes the profile useless: the
    caller refuses it).
    """
    terms: dict[str, dict[str, Any]] = {}
    missing = []
    for term in TERMS:
        rows = [m for m in measurements if m.get("term") == term and "us" in m]
        features = TERM_FEATURES[term]
        if not rows:
            missing.append(term)
            continue
        samples = [(PrefillShape(tuple(m["batch"]["prefix_lens"]),
                                 tuple(m["batch"]["extend_lens"]),
                                 m["batch"]["heads"]).features(), float(m["us"]))
                   for m in rows]
        fit = fit_term(samples, features)
        for m, pred, res in zip(rows, fit.predicted_us, fit.relative_residuals):
            m["predicted_us"] = pred
            m["relative_residual"] = res
        terms[term] = {"coefficients_us": fit.coefficients, "features": list(features),
                       "fit": fit.summary()}
    return terms, missing


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") \
            from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative ints, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None,
                        help="registry backend to calibrate (required unless --dry-run, whose "
                             "default is the reference backend)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="where to write the profile JSON (default: "
                             "~/.cache/attnreg/profiles/BACKEND-PLATFORM-KV.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the pipeline on the CPU with tiny shapes and the reference "
                             "backend: writes a profile marked dry_run, NOT a measurement")
    grid = parser.add_argument_group("grid (defaults: B 1,4; prefix 0,4096,16384; extend "
                                     "128,512,2048,4096; 128 heads)")
    grid.add_argument("--heads", type=int, default=None, help="attention heads on one rank")
    grid.add_argument("--batch-sizes", type=_ints, default=None, metavar="B,...")
    grid.add_argument("--prefixes", type=_ints, default=None, metavar="P,...")
    grid.add_argument("--extends", type=_ints, default=None, metavar="E,...")
    grid.add_argument("--layer-tokens", type=_ints, default=None, metavar="N,...",
                      help="token counts of the layer projection measurements")
    grid.add_argument("--page-size", type=int, default=1)
    grid.add_argument("--time-budget-s", type=float, default=85.0,
                      help="stop starting new measurements after this many seconds (the "
                           "rest is recorded as skipped; default 85)")
    add_registry_arguments(parser)
    add_json_argument(parser)


def default_profile_path(backend: str, platform: str, kv_dtype: str, *,
                         dry_run: bool = False) -> Path:
    """``$XDG_CACHE_HOME/attnreg/profiles/BACKEND-PLATFORM-KV[-dry-run].json``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = f"{backend}-{platform.replace(':', '-')}-{kv_dtype}" + ("-dry-run" if dry_run else "")
    return cache / "attnreg" / "profiles" / f"{name}.json"


def _fail(message: str) -> int:
    print(f"attnreg calibrate: {message}", file=sys.stderr)
    return 2


def _versions(torch: Any) -> dict[str, str | None]:
    from attnreg import __version__
    from attnreg.registry.spec import installed_version

    out: dict[str, str | None] = {"attnreg": __version__, "python": pyplatform.python_version(),
                                  "torch": getattr(torch, "__version__", None),
                                  "cuda": getattr(torch.version, "cuda", None)}
    for dist in ("triton", "flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl"):
        out[dist] = installed_version(dist)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        return _fail("torch is not installed; calibration runs kernels (pip install "
                     "attnreg[torch] plus the backend's extra)")
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
    grid = Grid(batch_sizes=args.batch_sizes or grid.batch_sizes,
                prefixes=args.prefixes or grid.prefixes,
                extends=args.extends or grid.extends,
                layer_tokens=args.layer_tokens or grid.layer_tokens,
                heads=args.heads or grid.heads, graph_layers=grid.graph_layers)
    if min(grid.batch_sizes) < 1 or min(grid.extends) < 1 or min(grid.layer_tokens) < 1 \
            or grid.heads < 1 or args.page_size < 1:
        return _fail("batch sizes, extends, layer tokens, heads and page size must be >= 1")
    return _calibrate(args, torch, device, grid, shape, backend_name)


def _calibrate(args: argparse.Namespace, torch: Any, device: str, grid: Grid,
               shape: LayerShape, backend_name: str) -> int:
    from attnreg.backends.base import MLAConfig
    from attnreg.registry import Platform, UnsupportedError

    from ._common import registry_from

    started = time.perf_counter()
    quiet = bool(args.json)

    def log(msg: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    platform = Platform.parse("cpu") if args.dry_run else Platform.detect()
    reg = registry_from(args)
    max_positions = max(grid.max_seq_len, max(grid.layer_tokens)) + 1
    config = MLAConfig(num_heads=grid.heads, page_size=args.page_size, device=device,
                       max_context_len=grid.max_seq_len)
    backend = reg.create(backend_name, config, platform=platform)
    clock = Clock(torch, device)
    ses = Session(torch, device, backend_name, grid, shape, args.page_size, clock,
                  float(args.time_budget_s), log, started)
    log(f"calibrating {backend_name} on {platform} ({_device_name(torch, device)}), "
        f"{grid.heads} heads")
    layers = [MLALayer(torch, shape, grid.heads, device, seed=i, max_positions=max_positions)
              for i in range(grid.graph_layers)]
    measurements: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    measurements += _measure_layers(ses, layers)
    last: tuple[float, int] | None = None  # (seconds, pairs) of the previous point
    for i, point in enumerate(grid.attention_points()):
        # Points grow in cost; one predicted to end after the budget is not started.
        predicted_s = 0.0 if last is None else last[0] * max(1.0, point.pairs / max(last[1], 1))
        if ses.out_of_time() or ses.elapsed_s() + predicted_s > ses.budget_s:
            measurements.append({"term": "attention", "batch": _batch_dict(point),
                                 "skipped": "time budget used up (or would be)"})
            continue
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
        "versions": _versions(torch),
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
    out = Path(args.out) if args.out else default_profile_path(
        backend_name, str(platform), str(config.kv_dtype), dry_run=args.dry_run)
    save_profile(profile, out)
    loaded = CostProfile.from_dict(profile, source=str(out))
    if args.json:
        print_json(dict(profile, written_to=str(out)))
    else:
        print(_summary(loaded, terms, checks, out, time.perf_counter() - started))
    if not passed:
        bad = [c for c in checks if not c["agree"]]
        print(f"attnreg calibrate: absorbed and MHA outputs disagree at {len(bad)} point(s) "
              f"(rel. diff above {MAX_REL_DIFF:g}), e.g. {bad[0]}: a kernel computes something "
              "else, so these timings do not describe it", file=sys.stderr)
        return 1
    return 0


def _device_name(torch: Any, device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name())
    return f"cpu ({pyplatform.processor() or pyplatform.machine()})"


def _fmt_coef(value: float) -> str:
    return f"{value:.3g}"


def _summary(profile: CostProfile, terms: dict[str, dict[str, Any]],
             checks: list[dict[str, Any]], out: Path, wall_s: float) -> str:
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
                    "rms"), rows), ""]
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
