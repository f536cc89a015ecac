"""Speculative decoding: a verify step of 4 draft tokens per sequence, graph vs eager vs decode.

One attention forward of a DeepSeek-shaped MLA layer (128 heads, bf16, page
size 64) over B = 32 sequences of 4096 cached tokens, for ``triton`` and
``flashinfer_mla``:

* **verify, graph**: a TARGET_VERIFY batch (4 draft tokens per sequence,
  causal among themselves, attending the whole prefix) replayed from a FULL
  decode-phase graph captured by :class:`attnreg.runtime.GraphSession`:
  ``GraphSession.run`` (gate, ``init_forward_metadata_replay``, replay) per step;
* **verify, eager**: the same batch, ``init_forward_metadata`` + ``forward_extend``
  per step (what an engine without verify graphs runs);
* **decode, graph** / **decode, eager**: plain decode (one token per
  sequence) of the same sequences: what a step without speculation costs.

Every timed step includes its metadata call (host planning is part of a
step); the L2 cache is flushed before each.  Before timing, each backend's
verify output (eager and replayed) and decode output are checked against a
float64 oracle at a small size (B = 3, prefixes up to 300, 16 heads).

Run it standalone (one device call)::

    python -m benchmarks.speculative --out $OUT/speculative.json

or as the ``spec`` section of ``python -m benchmarks`` (``--only spec``).  ``--dry-run`` runs tiny shapes on a
cpu (Triton interpreter, graphs replayed eagerly): it checks the harness and
measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._harness import RunContext, SkipSection, environment, error_text
from ._report import Page, fmt, md_table
from .metrics import Check, evaluate

#: The issue's shape: B sequences of L cached tokens, H heads, D draft tokens.
B, L, H, DRAFTS = 32, 4096, 128, 4
DRY_B, DRY_L, DRY_H = 2, 40, 2
PAGE_SIZE = 64
DRY_PAGE_SIZE = 16
#: The float64 check: a few sequences of different lengths at 16 heads.
CHECK_PREFIXES, CHECK_HEADS = (300, 7, 129), 16
DRY_CHECK_PREFIXES, DRY_CHECK_HEADS = (20, 3), 2
#: bf16 output against the float64 oracle (the conformance suite's bf16 tolerance).
MAX_ABS_ERR = 2e-2
BACKENDS = ("triton", "flashinfer_mla")


def _oracle(q: Any, pool: Any, batch: Any, scale: float) -> Any:
    """float64 absorbed MLA of ``batch`` (each sequence's new tokens bottom-right causal)."""
    import torch

    from attnreg.testing.workload import oracle_attention

    outs = []
    start = 0
    page_size = pool.page_size
    for b, (prefix, new) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        table = batch.page_table[b].tolist()
        slots = [table[t // page_size] * page_size + t % page_size
                 for t in range(prefix + new)]
        rows = pool.read_slots(torch.tensor(slots, dtype=torch.int32, device=pool.device))
        kv = rows[:, None, :]
        out, _ = oracle_attention(q[start:start + new], kv, kv[:, :, :512], scale)
        outs.append(out)
        start += new
    return torch.cat(outs)


class _Step:
    """One backend's verify and decode steps over one pool, eager and through graphs."""

    def __init__(self, ctx: RunContext, name: str, batch_size: int, prefix: list[int],
                 heads: int, page_size: int, *, seed: int) -> None:
        from attnreg.registry import ForwardMode, get_registry
        from attnreg.runtime import (
            GraphSession,
            MLAConfig,
            StepInputs,
            decode_batch,
            verify_batch,
        )

        torch = ctx.torch
        self.torch = torch
        context = max(prefix) + DRAFTS + 1
        self.cfg = MLAConfig(num_heads=heads, page_size=page_size, device=ctx.device,
                             max_context_len=context)
        self.backend = get_registry().create(name, self.cfg)
        pages_per_seq = -(-context // page_size)
        self.pool = self.cfg.make_pool(1 + batch_size * pages_per_seq + 1)
        gen = torch.Generator().manual_seed(seed)
        self.pool.buffer.copy_(torch.randn(self.pool.buffer.shape, generator=gen)
                               .to(self.pool.dtype))
        pages = self.pool.allocate([context] * batch_size, shuffle=seed)
        self.verify = verify_batch(self.pool, prefix, DRAFTS, pages=pages)
        self.decode = decode_batch(self.pool, [p + 1 for p in prefix], pages=pages)
        bs = batch_size
        self.q_verify = torch.randn(bs * DRAFTS, heads, 576, generator=gen).to(
            torch.bfloat16).to(ctx.device)
        self.q_decode = torch.randn(bs, heads, 576, generator=gen).to(
            torch.bfloat16).to(ctx.device)
        # one graph session with a decode and a 4-draft verify graph of one bucket, over
        # one graph state, as an engine's decode runner has; the static q holds this
        # step's rows (an engine's q projection, captured before attention, writes it)
        self.session = GraphSession(self.backend, self.pool, phase="decode", mode="full",
                                    buckets=[bs], writes_kv=False, max_seq_len=context,
                                    forward_modes={"decode": 1, "target_verify": DRAFTS})
        self._keys = {"verify": (ForwardMode.TARGET_VERIFY, bs),
                      "decode": (ForwardMode.DECODE, bs)}
        self.session.capture(batches={self._keys["verify"]: self.verify,
                                      self._keys["decode"]: self.decode})
        self._inputs = {"verify": StepInputs.one(self.q_verify),
                        "decode": StepInputs.one(self.q_decode)}
        self.bs = bs

    def load(self, kind: str) -> None:
        """Put the inputs of ``verify_*`` or ``decode_*`` steps into the static q (the two
        graphs share its rows)."""
        which = kind.split("_")[0]
        self.session.load(self._keys[which], self._inputs[which])

    # the timed steps: metadata + attention, as one engine step of one layer
    def verify_graph(self) -> Any:
        return self.session.run(self.verify).output

    def verify_eager(self) -> Any:
        return self.session.eager(self.verify, self._inputs["verify"])[0]

    def decode_graph(self) -> Any:
        return self.session.run(self.decode).output

    def decode_eager(self) -> Any:
        return self.session.eager(self.decode, self._inputs["decode"])[0]

    def errors(self, ctx: RunContext) -> dict[str, float]:
        """Max |out - float64 oracle| of each step kind (graph and eager)."""
        scale = self.cfg.softmax_scale
        found = {}
        want = {"verify": _oracle(self.q_verify, self.pool, self.verify, scale),
                "decode": _oracle(self.q_decode, self.pool, self.decode, scale)}
        for label in ("verify_graph", "verify_eager", "decode_graph", "decode_eager"):
            self.load(label)
            out = getattr(self, label)()
            ctx.sync()
            err = (out.float().cpu() - want[label.split("_")[0]]).abs().max()
            found[label] = float(err) if bool(self.torch.isfinite(err)) else float("inf")
        replayed = self.session.counts.replayed.get("gate.ok", 0)
        if replayed != 2:
            raise RuntimeError(f"the graph steps replayed {replayed} of 2 times: "
                               f"{self.session.counts.to_dict()}")
        return found


def run(ctx: RunContext, data: dict[str, Any]) -> None:
    """Check each backend at a small size in float64, then time the four steps."""
    from attnreg.registry import get_registry

    reg = get_registry()
    platform = None if ctx.cuda else "cpu"
    names = []
    skipped: dict[str, str] = {}
    for name in BACKENDS:
        avail = reg.availability(name, platform)
        if avail.available:
            names.append(name)
        else:
            skipped[name] = avail.reason
    if not names:
        raise SkipSection(f"neither backend can run here: {skipped}")
    bs = ctx.pick(B, B, DRY_B)
    length = ctx.pick(L, L, DRY_L)
    heads = ctx.pick(H, H, DRY_H)
    page_size = ctx.pick(PAGE_SIZE, PAGE_SIZE, DRY_PAGE_SIZE)
    check_prefixes = list(ctx.pick(CHECK_PREFIXES, CHECK_PREFIXES, DRY_CHECK_PREFIXES))
    check_heads = ctx.pick(CHECK_HEADS, CHECK_HEADS, DRY_CHECK_HEADS)
    data.update(batch=bs, prefix=length, heads=heads, drafts=DRAFTS, page_size=page_size,
                check={"prefixes": check_prefixes, "heads": check_heads,
                       "max_abs_err": MAX_ABS_ERR},
                backends=names, skipped_backends=skipped, rows=[],
                timing="one step of one layer incl. its metadata call (graph: "
                       "GraphSession.run = gate, init_forward_metadata_replay, replay; eager: "
                       "init_forward_metadata + forward), L2 flushed, median")
    for name in names:
        row: dict[str, Any] = {"backend": name}
        data["rows"].append(row)
        if ctx.out_of_time():
            row["skipped"] = "time budget used up"
            continue
        try:
            small = _Step(ctx, name, len(check_prefixes), check_prefixes, check_heads,
                          page_size, seed=11)
            row["errors"] = small.errors(ctx)
            del small
            ctx.log(f"spec: {name}: float64 check {row['errors']}")
            step = _Step(ctx, name, bs, [length] * bs, heads, page_size, seed=5)
            for kind in ("verify_graph", "verify_eager", "decode_graph", "decode_eager"):
                step.load(kind)
                row[kind] = ctx.time(getattr(step, kind))
                ctx.log(f"spec: {name} {kind}: {row[kind]['median_us']:.1f} us")
            del step
        except Exception as exc:  # noqa: BLE001 - recorded per backend, the others still run
            row["error"] = error_text(exc)
            ctx.log(f"spec: {name}: {row['error']}")
        if ctx.cuda:
            ctx.torch.cuda.empty_cache()


def _us(row: dict[str, Any], kind: str) -> float | None:
    value = row.get(kind)
    return float(value["median_us"]) if isinstance(value, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def checks(data: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> list[Check]:
    """Per backend: outputs match the float64 oracle; the verify graph is no slower than
    eager."""
    out = []
    for row in data.get("rows", []):
        name = row["backend"]
        errs = row.get("errors") or {}
        worst = max(errs.values()) if errs else None
        out.append(evaluate(f"spec {name} float64", f"{name}: verify and decode (graph and "
                            "eager) max |error| against the float64 oracle", worst, "abs",
                            "<=", target=MAX_ABS_ERR))
        out.append(evaluate(f"spec {name} graph", f"{name}: verify step, eager / graph time",
                            _ratio(_us(row, "verify_eager"), _us(row, "verify_graph")), "x",
                            ">=", target=1.0))
    return out


def render(data: dict[str, Any], page: Page) -> list[str]:
    header = ["backend", "verify graph us", "verify eager us", "decode graph us",
              "decode eager us", "eager / graph (verify)", "verify / decode (graph)",
              "max err vs float64"]
    rows = []
    for row in data.get("rows", []):
        if row.get("skipped") or row.get("error"):
            why = row.get("skipped") or "error: " + str(row["error"])[:80]
            rows.append([row["backend"]] + [why] * (len(header) - 1))
            continue
        vg, ve = _us(row, "verify_graph"), _us(row, "verify_eager")
        dg, de = _us(row, "decode_graph"), _us(row, "decode_eager")
        errs = row.get("errors") or {}
        rows.append([row["backend"], fmt(vg, ".1f"), fmt(ve, ".1f"), fmt(dg, ".1f"),
                     fmt(de, ".1f"), fmt(_ratio(ve, vg), ".2f") + "x",
                     fmt(_ratio(vg, dg), ".2f") + "x",
                     fmt(max(errs.values()) if errs else None, ".2e")])
    lines = [f"B = {data.get('batch')} sequences of {data.get('prefix')} cached tokens, "
             f"{data.get('heads')} heads, {data.get('drafts')} draft tokens per sequence "
             f"(verify), page size {data.get('page_size')}, bf16; {data.get('timing')}.  "
             "'decode' is the plain step of the same sequences (one token each).", "",
             md_table(header, rows)]
    for name, why in (data.get("skipped_backends") or {}).items():
        lines.append(f"\n{name}: not run here ({why}).")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="where the JSON result goes")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, allowed without CUDA; measures nothing")
    parser.add_argument("--quick", action="store_true", help="shorter timing")
    parser.add_argument("--time-budget-s", type=float, default=480.0)
    args = parser.parse_args(argv)
    command = "python -m benchmarks.speculative " + " ".join(argv or sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = RunContext(out_dir=Path(tmp), quick=args.quick, dry_run=args.dry_run,
                         warmup_ms=10.0 if args.quick else 25.0,
                         rep_ms=50.0 if args.quick else 100.0,
                         time_budget_s=args.time_budget_s, command=command)
        if not ctx.cuda and not args.dry_run:
            print("python -m benchmarks.speculative: no CUDA device here; it times GPU "
                  "kernels (use --dry-run to check the harness on a cpu)", file=sys.stderr)
            return 2
        data: dict[str, Any] = {}
        status, reason = "ok", ""
        try:
            run(ctx, data)
        except SkipSection as exc:
            status, reason = "skipped", str(exc)
        result = {"meta": environment(command, quick=args.quick, dry_run=args.dry_run),
                  "section": "spec", "status": status, "reason": reason, "data": data,
                  "checks": [c.to_dict() for c in checks(data)] if status == "ok" else []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({"checks": result["checks"], "status": status, "reason": reason},
                     indent=1))
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
