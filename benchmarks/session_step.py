"""session: an 8-layer DeepSeek-shaped attention step through :class:`attnreg.runtime.GraphSession`.

What an engine's decode runner does per step, measured on the one session
attnreg ships: 8 pool layers of absorbed MLA attention (128 heads, kv_lora
512, rope 64, bf16, page size 64, sequences of 2048 cached tokens), each layer
writing its new tokens and attending, at B = 1, 8 and 64:

* **decode**: ``GraphSession.run`` replaying the bucket's FULL graph (the gate,
  ``init_forward_metadata_replay``, the replay) against the same step run
  eagerly (``init_forward_metadata`` + 8 forwards), as eager / graph time;
* **verify**: the same for a TARGET_VERIFY batch of 4 draft tokens per
  sequence (the verify graphs of the same session);
* **host**: at B = 64, the host time of one ``GraphSession.run`` with an empty
  device queue, and its parts: the gate (``decide``), the replay metadata
  (``init_forward_metadata_replay``, which pads the batch to its bucket) and
  the replay launch; for a batch packed into the session's ``index_buffer``
  (what the check reads), one built in its ``index_layout`` and one built in
  neither.

The static q / latent / rope hold the step's inputs before it is timed (in an
engine the projections captured before attention write them), so neither
path copies inputs.  Every figure is the median of ``RUNS`` runs, with min and
max.  ``--dry-run`` runs tiny shapes on a cpu (Triton interpreter, no device
graphs): it checks the harness and measures nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ._backends import PREFILL_VARIANTS, available_variants, create_backend, declared_reasons
from ._harness import RunContext, SkipSection, error_text
from ._report import Page, fmt, md_table, not_run_notes
from .metrics import Check, median_of_runs

BATCHES, DRY_BATCHES = (1, 8, 64), (1, 2)
SEQ_LEN, DRY_SEQ_LEN = 2048, 40
HEADS, DRY_HEADS = 128, 2
LAYERS, DRY_LAYERS = 8, 2
PAGE_SIZE, DRY_PAGE_SIZE = 64, 16
DRAFTS = 4
#: Each figure is measured this many times; the page states the median with min and max.
RUNS = 3
#: Host samples of one step per run (each after the device queue drained).
HOST_SAMPLES, DRY_HOST_SAMPLES = 200, 3
#: The batch the host time is stated at (the largest of the run).
HOST_B = 64
#: The issue's targets (issue 26, "Done when").
DECODE_TARGET, VERIFY_TARGET, HOST_TARGET_US = 3.0, 2.0, 30.0


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    from attnreg.registry import ForwardMode, GraphMode, Phase, Platform, get_registry

    variants, skipped = available_variants(ctx, PREFILL_VARIANTS)
    if not variants:
        raise SkipSection(f"no backend that captures decode can run here: {skipped}")
    batches = ctx.pick(BATCHES, BATCHES, DRY_BATCHES)
    seq_len = ctx.pick(SEQ_LEN, SEQ_LEN, DRY_SEQ_LEN)
    heads = ctx.pick(HEADS, HEADS, DRY_HEADS)
    layers = ctx.pick(LAYERS, LAYERS, DRY_LAYERS)
    page_size = ctx.pick(PAGE_SIZE, PAGE_SIZE, DRY_PAGE_SIZE)
    data.update(layers=layers, heads=heads, kv_lora=512, rope=64, seq_len=seq_len,
                page_size=page_size, drafts=DRAFTS, batches=list(batches), runs=RUNS,
                host_batch=max(batches), variants=[v.label for v in variants],
                skipped_variants=skipped, rows=[], host=[],
                timing="one GraphSession step of every layer, its metadata call included "
                       "(graph: GraphSession.run = gate, init_forward_metadata_replay, replay; "
                       "eager: GraphSession.eager = init_forward_metadata + the forwards), "
                       "L2 flushed, median per run")
    reg = get_registry()
    platform = Platform.detect() if ctx.cuda else Platform.parse("cpu")
    for v in variants:
        if ctx.out_of_time():
            data["rows"].append({"variant": v.label, "skipped": "time budget used up"})
            continue
        reasons = declared_reasons(ctx, v, "mla", "decode", heads=heads, head_dims=(576, 512),
                                   page_size=page_size)
        support = reg.declaration(v.backend, platform).graph_support(Phase.DECODE,
                                                                     GraphMode.FULL)
        if not reasons and support.capture.is_unsupported:
            reasons = [f"decode FULL graphs: {support.capture.reason}"]
        if reasons:
            data["rows"].append({"variant": v.label, "not_declared": "; ".join(reasons)})
            continue
        verify = support.serving(ForwardMode.TARGET_VERIFY)
        modes = {"decode": 1}
        if verify is not None and verify.serves_query_len(DRAFTS):
            modes["target_verify"] = DRAFTS
        try:
            step = _Steps(ctx, v, batches, seq_len, heads, layers, page_size, modes)
        except Exception as exc:  # noqa: BLE001 - one backend's failure is its row
            data["rows"].append({"variant": v.label, "error": error_text(exc)})
            continue
        for b in batches:
            for kind in ("decode", "verify"):
                row: dict[str, Any] = {"variant": v.label, "B": b, "kind": kind}
                if kind == "verify" and "target_verify" not in modes:
                    row["not_declared"] = (f"no TARGET_VERIFY graphs of {DRAFTS} drafts in the "
                                           "declaration")
                else:
                    try:
                        row.update(step.ratio(kind, b))
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = error_text(exc)
                data["rows"].append(row)
                ctx.log(f"session {v.label} {kind} B={b}: " + (
                    f"eager / graph {row['speedup']:.2f}x (runs {_runs(row['runs'])})"
                    if "speedup" in row else row.get("error") or row.get("not_declared", "?")))
                ctx.save()
        try:
            host = {"variant": v.label, "B": max(batches), **step.host(max(batches))}
        except Exception as exc:  # noqa: BLE001
            host = {"variant": v.label, "B": max(batches), "error": error_text(exc)}
        data["host"].append(host)
        ctx.log(f"session {v.label} host step at B={host['B']}: "
                + (f"{host['step_us']:.1f} us" if "step_us" in host else host["error"]))
        del step
        if ctx.cuda:
            ctx.torch.cuda.empty_cache()
        ctx.save()
    data["checks"] = [c.to_dict() for c in checks(data)]


def _runs(values: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class _Steps:
    """One backend's session (decode and verify buckets over ``layers`` pool layers)."""

    def __init__(self, ctx: RunContext, variant: Any, batches: tuple[int, ...], seq_len: int,
                 heads: int, layers: int, page_size: int, modes: dict[str, int]) -> None:
        from attnreg.runtime import GraphSession, StepInputs, decode_batch, verify_batch

        torch = ctx.torch
        self.ctx = ctx
        context = seq_len + DRAFTS
        self.backend = create_backend(ctx, variant, num_heads=heads, page_size=page_size,
                                      max_context_len=context)
        cfg = self.backend.config
        max_b = max(batches)
        pool = cfg.make_pool(max_b * -(-context // page_size) + 2, num_layers=layers)
        fill = torch.Generator(device=pool.device).manual_seed(3)
        for layer in pool.layers:  # rows ~N(0, 1), every layer its own
            layer.buffer.normal_(generator=fill)
        pages = pool.allocate([context] * max_b, shuffle=7)
        self.session = GraphSession(self.backend, pool, phase="decode", mode="full",
                                    buckets=batches, layers=layers, forward_modes=modes,
                                    max_seq_len=context)
        self.session.capture()
        gen = torch.Generator(device="cpu").manual_seed(5)

        def inputs(rows: int) -> Any:
            def rand(*shape: int) -> Any:
                return torch.randn(shape, generator=gen).to(torch.bfloat16).to(ctx.device)
            return StepInputs([rand(rows, heads, 576) for _ in range(layers)],
                              [rand(rows, 512) for _ in range(layers)],
                              [rand(rows, 64) for _ in range(layers)])

        # Built in the session's index layout, as an engine following docs/runtime.md does:
        # each replay then copies the batch's metadata with one device copy.
        layout = self.session.index_layout
        self.pool, self.pages, self.seq_len = pool, pages, seq_len
        self.batches = {
            ("decode", b): decode_batch(pool, [seq_len] * b, pages=pages[:b], layout=layout)
            for b in batches}
        if "target_verify" in modes:
            self.batches.update({("verify", b): verify_batch(pool, [seq_len - DRAFTS] * b,
                                                             DRAFTS, pages=pages[:b],
                                                             layout=layout)
                                 for b in batches})
        self.inputs = {key: inputs(batch.num_tokens) for key, batch in self.batches.items()}

    def _load(self, kind: str, b: int) -> Any:
        from attnreg.registry import ForwardMode
        batch = self.batches[(kind, b)]
        fm = ForwardMode.DECODE if kind == "decode" else ForwardMode.TARGET_VERIFY
        self.session.load((fm, b), self.inputs[(kind, b)])
        return batch

    def ratio(self, kind: str, b: int) -> dict[str, Any]:
        """Eager / graph time of one step, ``RUNS`` times; the replayed output checked
        against the eager one."""
        ctx, session = self.ctx, self.session
        batch = self._load(kind, b)
        inputs = self.inputs[(kind, b)]
        res = session.run(batch)
        if not res.replayed:
            raise RuntimeError(f"the session ran the {kind} batch eagerly: {res.reason}")
        graph_out = [o.clone() for o in res.outputs]
        eager_out = session.eager(batch, inputs)
        ctx.sync()
        err = max(float((g.float() - e.float()).abs().max()) for g, e in zip(graph_out,
                                                                          eager_out))
        del graph_out, eager_out
        eager, graph = [], []
        for _ in range(RUNS):
            eager.append(ctx.time(lambda: session.eager(batch, inputs))["median_us"])
            graph.append(ctx.time(lambda: session.run(batch))["median_us"])
        runs = [e / g for e, g in zip(eager, graph)]
        return {"eager_us": _spread(eager), "graph_us": _spread(graph),
                "speedup": statistics.median(runs), "runs": runs,
                "graph_vs_eager_max_abs": err, "counts": session.counts.to_dict()}

    def host(self, b: int) -> dict[str, Any]:
        """Host time of one ``GraphSession.run`` at ``b`` and its parts, ``RUNS`` runs."""
        ctx, session = self.ctx, self.session
        batch = self._load("decode", b)
        key = (batch.forward_mode, b)
        graph = session.graph(key)
        n = ctx.pick(HOST_SAMPLES, HOST_SAMPLES, DRY_HOST_SAMPLES)
        from attnreg.runtime import decode_batch
        # the same batch built without the layout: the per-tensor padded copy, for comparison
        plain = decode_batch(self.pool, [self.seq_len] * b, pages=self.pages[:b])
        layout = session.index_layout
        buffer = session.index_buffer
        parts: dict[str, list[float]] = {k: [] for k in (
            "step_us", "gate_us", "replay_metadata_us", "replay_launch_us",
            "replay_metadata_plain_us", "batch_build_us", "batch_build_plain_us",
            "step_in_place_us", "replay_metadata_in_place_us", "batch_build_in_place_us")}
        held: list[Any] = []

        def build_in_place() -> None:
            held[:] = [decode_batch(self.pool, [self.seq_len] * b, pages=self.pages[:b],
                                    layout=buffer)]

        def sample(fn: Any) -> float:
            ctx.sync()  # an empty queue: the launch does not wait for a full one
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6

        for _ in range(RUNS):
            per: dict[str, list[float]] = {k: [] for k in parts}
            for _ in range(n):
                per["step_us"].append(sample(lambda: session.run(batch)))
                per["gate_us"].append(sample(lambda: session.decide(batch)))
                # the session's one replay-metadata call (where device-side metadata will go)
                per["replay_metadata_us"].append(sample(
                    lambda: session._replay_metadata(key, batch)))
                per["replay_launch_us"].append(sample(graph.replay))
                per["replay_metadata_plain_us"].append(sample(
                    lambda: session._replay_metadata(key, plain)))
                # the engine's side of a step, outside the session: building the batch
                per["batch_build_us"].append(sample(lambda: decode_batch(
                    self.pool, [self.seq_len] * b, pages=self.pages[:b], layout=layout)))
                per["batch_build_plain_us"].append(sample(lambda: decode_batch(
                    self.pool, [self.seq_len] * b, pages=self.pages[:b])))
                # the batch packed into the graph's own index buffer (built anew each time:
                # the copies above overwrite the buffer): the replay copies nothing
                per["batch_build_in_place_us"].append(sample(build_in_place))
                per["step_in_place_us"].append(sample(lambda: session.run(held[0])))
                per["replay_metadata_in_place_us"].append(sample(
                    lambda: session._replay_metadata(key, held[0])))
            for k, values in per.items():
                parts[k].append(statistics.median(values))
        out: dict[str, Any] = {k: statistics.median(v) for k, v in parts.items()}
        out["runs"] = parts
        out["samples_per_run"] = n
        out["fills"] = dict(self.backend.graph_state.fills)
        out["method"] = ("host wall clock of one call after torch.cuda.synchronize() "
                         "(median of the samples of a run)" if ctx.cuda else
                         "host wall clock, dry run (no device graphs)")
        return out


# ----------------------------------------------------------------------------------------
# Checks and rendering
# ----------------------------------------------------------------------------------------

def _row(data: dict[str, Any], label: str, kind: str, b: int) -> dict[str, Any] | None:
    return next((r for r in data.get("rows", []) if r.get("variant") == label
                 and r.get("kind") == kind and r.get("B") == b and "speedup" in r), None)


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """Per backend: decode and verify eager / graph at B=1, host time of a step at B=64."""
    out = []
    for label in data.get("variants", []):
        if any(r.get("variant") == label and r.get("not_declared") and "kind" not in r
               for r in data.get("rows", [])):
            continue  # no decode graphs declared here: no figure is owed
        for kind, target in (("decode", DECODE_TARGET), ("verify", VERIFY_TARGET)):
            row = _row(data, label, kind, 1)
            if row is None and any(r.get("variant") == label and r.get("kind") == kind
                                   and r.get("not_declared") for r in data.get("rows", [])):
                continue
            values = list(row["runs"]) if row else []
            what = (f"{label}: {kind}{' (4 drafts)' if kind == 'verify' else ''} step of "
                    f"{data.get('layers')} layers through the session at B=1, eager / graph, "
                    "median of the runs")
            out.append(median_of_runs(f"session {label} {kind}", what, values, "x", ">=",
                                      target=target))
        host = next((h for h in data.get("host", []) if h.get("variant") == label
                     and "step_us" in h), None)
        # the step as docs/runtime.md tells an engine to run it: the batch packed into the
        # session's index buffer (a result from before that form: the copied batch's step)
        key = ("step_in_place_us" if host and "step_in_place_us" in host["runs"]
               else "step_us")
        values = list(host["runs"][key]) if host else []
        form = ("a batch packed into the session's index buffer"
                if key == "step_in_place_us" else "a batch built in the index layout")
        out.append(median_of_runs(f"session {label} host", f"{label}: host time of one "
                                  f"session step (gate, pad, replay metadata, replay launch) "
                                  f"of {form} at B={data.get('host_batch')}, median of the "
                                  "runs", values, "us", "<=", target=HOST_TARGET_US))
    return out


def render(data: dict[str, Any], page: Page) -> list[str]:
    header = ["backend", "step", "B", "eager us (min – max)", "graph us (min – max)",
              "eager / graph (runs)", "graph vs eager max |diff|"]
    rows = []
    for r in data.get("rows", []):
        if "speedup" not in r:
            why = r.get("error") or r.get("skipped") or (
                "not declared: " + r["not_declared"] if r.get("not_declared") else "-")
            rows.append([r.get("variant", "?"), r.get("kind", "-"), str(r.get("B", "-")), why,
                         "", "", ""])
            continue
        e, g = r["eager_us"], r["graph_us"]
        rows.append([r["variant"], r["kind"], str(r["B"]),
                     f"{e['median']:.0f} ({e['min']:.0f} – {e['max']:.0f})",
                     f"{g['median']:.0f} ({g['min']:.0f} – {g['max']:.0f})",
                     f"**{r['speedup']:.2f}x** ({_runs(r['runs'])})",
                     f"{r['graph_vs_eager_max_abs']:.1e}"])
    host_rows = []
    for h in data.get("host", []):
        if "step_us" not in h:
            host_rows.append([h.get("variant", "?"), str(h.get("B")), h.get("error", "-"),
                              "", "", ""])
            continue
        host_rows.append([h["variant"], str(h["B"]),
                          f"**{fmt(h.get('step_in_place_us'), '.1f')}** / "
                          f"{h['step_us']:.1f}",
                          fmt(h.get("gate_us"), ".1f"),
                          f"{fmt(h.get('replay_metadata_in_place_us'), '.1f')} / "
                          f"{fmt(h.get('replay_metadata_us'), '.1f')} / "
                          f"{fmt(h.get('replay_metadata_plain_us'), '.1f')}",
                          fmt(h.get("replay_launch_us"), ".1f"),
                          f"{fmt(h.get('batch_build_in_place_us'), '.1f')} / "
                          f"{fmt(h.get('batch_build_us'), '.1f')} / "
                          f"{fmt(h.get('batch_build_plain_us'), '.1f')}"])
    intro = (f"{data.get('layers')} pool layers of absorbed MLA ({data.get('heads')} heads, "
             f"kv_lora {data.get('kv_lora')}, rope {data.get('rope')}, bf16, page size "
             f"{data.get('page_size')}), sequences of {data.get('seq_len')} cached tokens, "
             f"verify with {data.get('drafts')} draft tokens per sequence.  "
             f"{data.get('timing')}; each figure over {data.get('runs')} runs (median, min – "
             "max).")
    return [intro, "", md_table(header, rows), "",
            f"Host time of one `GraphSession.run` at B={data.get('host_batch')} (device queue "
            "empty), and its parts, us (median of the runs):", "",
            md_table(["backend", "B", "step: in the buffer / in the layout", "gate",
                      "replay metadata (incl. padding): in the buffer / in the layout / "
                      "neither", "replay launch",
                      "batch build (engine side): in the buffer / in the layout / neither"],
                     host_rows), "",
            "The step's batch is packed into the session's `index_buffer` (the graph's own "
            "index buffer: the replay metadata copies nothing, plus the backend's own host "
            "planning: flashinfer's `plan`) or built in its `index_layout` (one device copy "
            "per replay), or neither (a padded copy per index tensor); the last column is the "
            "engine-side cost of building the batch each way, which is not part of the "
            "step."] + not_run_notes(data, {})
