"""Issue 9: data-parallel agreement and tensor-parallel conformance across N ranks.

One command, one process per rank (one GPU per rank with NCCL)::

    python3 benchmarks/multi_gpu.py --nprocs 2 --backend nccl --trials 1000 --out DIR

It checks three things and writes ``DIR/summary.json`` and ``DIR/summary.md``:

1. **vote**: per trial every rank draws its own seeded random eligibility and
   calls :func:`attnreg.graph_policy.vote`; all ranks' inputs and results are
   gathered, and a trial *disagrees* when some rank's result differs from
   another's or from the AND of the inputs.  Must be 0.
2. **replay gate**: a real :class:`~attnreg.graph_policy.ReplayGate` from a
   resolved plan (a model preset with the ``triton`` backend), a different
   random :class:`~attnreg.graph_policy.ReplayBatch` on each rank per step,
   ``can_replay`` for the local eligibility, ``vote``, then a decode step of the
   triton backend: a replay of a graph captured once by
   :class:`attnreg.runtime.GraphRunner` (``capture_error_mode="thread_local"``)
   when the vote says replay, an eager forward otherwise.  Every rank records the
   path it actually ran; a step *disagrees* when ranks ran different paths.
   Must be 0.  Replayed outputs are also compared with an eager forward of the
   same inputs.  On a cpu the runner records no device graph: its "replay"
   drives the backend's capture-mode code path (``init_forward_metadata_replay``
   and the forward under ``capturing(FULL)``) in the Triton interpreter.
3. **tensor-parallel conformance**: ``attnreg conformance --backend triton
   --heads H`` with ``H = 128 / N`` (DeepSeek-V3's 128 heads split over TP=N),
   one process per rank at the same time, each on its own GPU
   (``CUDA_VISIBLE_DEVICES=rank``), one report per rank.

NVLink multicast stays off in every process this script starts
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``): the workplace's multi-GPU machines require it.

Exit status: 0 when every check passed (0 disagreements, 0 replay mismatches,
no conformance claim refuted), 1 when one failed, 2 on bad input.
Needs only torch (and triton for the gate's forward and the conformance part);
``src/`` is put on the children's ``PYTHONPATH``, so attnreg need not be installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the renderer helpers are benchmarks'
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._report import Page, ResultsFile, fmt, md_table, rel
from benchmarks.metrics import Check, evaluate

#: Set in the environment of every child this script starts (the parent never
#: imports torch); each worker checks them before it imports torch: NVLink
#: multicast can take a shared host's GPUs out of service.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
#: DeepSeek-V3's query heads at tensor-parallel size 1; each TP rank gets 128 / N.
TOTAL_HEADS = 128
MODEL = "deepseek-v3"
#: Captured decode batch (request slots) of the gate's graph, and the page size.
GATE_MAX_BS = {"cuda": 8, "cpu": 4}
GATE_MAX_SEQ = {"cuda": 512, "cpu": 48}
GATE_PAGE = 16
#: bf16 output tolerance of a replay against an eager forward of the same inputs.
REPLAY_ATOL = REPLAY_RTOL = 2e-2
#: Per-trial odds that a rank is eligible, drawn per trial (shared by all ranks) so
#: that both vote outcomes are common at any world size.
ODDS = (0.5, 0.8, 0.95)
#: The sequence length of every gate batch: well inside any plan's captured context (the
#: gate answers gate.fact_missing for a batch whose lengths it is not told).
GATE_SEQ_LEN = 16
#: What makes a drawn batch ineligible (the gate rule that must fire).
BLOCKERS = ("gate.batch_slots", "gate.lora", "gate.input_embeds", "gate.replace_embeds",
            "gate.hidden_capture", "gate.spec_forward_mode")


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 benchmarks/multi_gpu.py",
        description="vote() and replay-gate agreement across N ranks, and tensor-parallel "
                    "head-count conformance on each GPU at once (issue 9).")
    p.add_argument("--nprocs", type=int, required=True, help="ranks (one GPU each with nccl)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="torch.distributed backend (default nccl; gloo runs on a cpu)")
    p.add_argument("--trials", type=int, default=1000, help="vote trials (default 1000)")
    p.add_argument("--gate-steps", type=int, default=None,
                   help="replay-gate decode steps (default 200 on cuda, 20 on cpu)")
    p.add_argument("--out", type=Path, required=True, help="directory for reports and logs")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="where the gate's decode step runs (default: cuda for nccl, cpu for "
                        "gloo)")
    p.add_argument("--plan-platform", default=None,
                   help="platform the gate's plan is resolved for (default: the detected one "
                        "on cuda; cuda:sm90, simulated, on a cpu, whose own plan disables "
                        "decode graphs)")
    p.add_argument("--gate-heads", type=int, default=None,
                   help="query heads of the gate's decode step (default: 128 / nprocs on "
                        "cuda, 2 on cpu)")
    p.add_argument("--heads", type=int, default=None,
                   help="conformance head count per rank (default 128 / nprocs)")
    p.add_argument("--conformance-device", choices=("cuda", "cpu"), default=None,
                   help="default: the --device value")
    p.add_argument("-k", "--conformance-k", dest="conformance_k", default=None, metavar="EXPR",
                   help="only the conformance claims matching EXPR (pytest -k)")
    p.add_argument("--skip-conformance", action="store_true",
                   help="run the vote and gate parts only")
    p.add_argument("--seed", type=int, default=0)
    # the defaults add up to 540 s: under the device tool's 600 s per command
    p.add_argument("--timeout", type=float, default=180,
                   help="seconds for the vote and gate workers (default 180)")
    p.add_argument("--conformance-timeout", type=float, default=360,
                   help="seconds for the conformance processes (default 360)")
    # internal: one rank of the vote/gate part
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def _problems(args: argparse.Namespace) -> list[str]:
    out = []
    if args.nprocs < 1:
        out.append(f"--nprocs must be >= 1, got {args.nprocs}")
    if args.trials < 1:
        out.append(f"--trials must be >= 1, got {args.trials}")
    if args.gate_steps is not None and args.gate_steps < 0:
        out.append(f"--gate-steps must be >= 0, got {args.gate_steps}")
    if args.heads is None and args.nprocs >= 1 and TOTAL_HEADS % args.nprocs:
        out.append(f"{TOTAL_HEADS} heads do not split evenly over {args.nprocs} ranks; "
                   "pass --heads")
    if args.backend == "nccl" and args.device == "cpu":
        out.append("--backend nccl communicates through GPUs; use --backend gloo on a cpu")
    for name in ("heads", "gate_heads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return out


# ---------------------------------------------------------------------------
# seeded draws (plain Python, identical on every machine)
# ---------------------------------------------------------------------------

def _rng(*parts: int) -> random.Random:
    """A generator seeded from the parts (``random.Random(tuple)`` is not portable)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (1 << 61)
    return random.Random(seed)


def draw_eligibility(seed: int, trial: int, rank: int) -> bool:
    """Rank ``rank``'s local eligibility in vote trial ``trial``."""
    p_true = _rng(seed, trial, 0xDD).choice(ODDS)  # shared by every rank
    return _rng(seed, trial, rank, 0xE1).random() < p_true


def draw_replay_batch(seed: int, step: int, rank: int, max_bs: int) -> tuple[Any, str]:
    """A random decode-time :class:`ReplayBatch` for ``rank`` and the rule meant to decide it.

    With the step's odds the batch is clean (a decode batch that fits the
    captured slots); otherwise one blocker from :data:`BLOCKERS` is planted.
    """
    from attnreg.graph_policy import HiddenCapture, ReplayBatch
    from attnreg.registry import ForwardMode

    p_clean = _rng(seed, step, 0x5C).choice(ODDS)
    rng = _rng(seed, step, rank, 0x6A)
    bs = rng.randint(1, max_bs)
    if rng.random() < p_clean:
        return ReplayBatch(ForwardMode.DECODE, bs, seq_lens=[GATE_SEQ_LEN] * bs), "gate.ok"
    blocker = rng.choice(BLOCKERS)
    fields: dict[str, Any] = {}
    mode = ForwardMode.DECODE
    if blocker == "gate.batch_slots":
        bs = max_bs + rng.randint(1, 4)
    elif blocker == "gate.lora":
        fields["lora"] = True
    elif blocker == "gate.input_embeds":
        fields["has_input_embeds"] = True
    elif blocker == "gate.replace_embeds":
        fields["has_replace_embeds"] = True
    elif blocker == "gate.hidden_capture":
        fields["capture_hidden"] = rng.choice((HiddenCapture.LAST, HiddenCapture.FULL))
    else:
        mode = rng.choice((ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND))
    return ReplayBatch(mode, bs, seq_lens=[GATE_SEQ_LEN] * bs, **fields), blocker


# ---------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------

class DecodeStep:
    """The triton backend's decode over a small paged pool: graph replay or eager.

    The graph is captured once for ``max_bs`` request slots; a replay serves
    any batch of at most ``max_bs`` sequences (the rest padded), an eager run
    any batch up to ``max_bs + 4`` (the gate's over-slot batches).
    """

    def __init__(self, torch: Any, device: str, heads: int, max_bs: int, max_seq: int,
                 seed: int) -> None:
        from attnreg.registry import Platform, get_registry
        from attnreg.runtime import GraphSession, MLAConfig, StepInputs, decode_batch

        self.torch = torch
        self._inputs = StepInputs.one
        self.real_graphs = device.startswith("cuda")
        self.max_bs, self.max_seq = max_bs, max_seq
        self.config = MLAConfig(num_heads=heads, page_size=GATE_PAGE, kv_dtype="bf16",
                                q_dtype="bf16", device=device, max_context_len=max_seq)
        platform = Platform.detect() if self.real_graphs else Platform.parse("cpu")
        self.backend = get_registry().create("triton", self.config, platform=platform)
        self.pool = self.config.make_pool(num_pages=(max_bs + 4) * (max_seq // GATE_PAGE) + 2)
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.pool.buffer.copy_((torch.randn(self.pool.buffer.shape, generator=self.gen) * 0.5)
                               .to(self.pool.buffer.dtype))
        self.pages = self.pool.allocate([max_seq] * (max_bs + 4))
        self.width = max_seq // GATE_PAGE
        self._decode_batch = decode_batch
        # one graph session of one bucket, captured for a short batch (the session warms the
        # forward up first).  thread_local: the process group's watchdog thread may query
        # CUDA events while this thread captures; "global" would make that an error.  On a
        # cpu the session records no device graph: capture runs the forward once under
        # capturing(FULL) and each replay runs it again (the capture-mode code path).
        capture_batch = self.batch([1 + (i * 7) % 16 for i in range(max_bs)])
        self.session = GraphSession(self.backend, self.pool, phase="decode", mode="full",
                                    buckets=[max_bs], max_seq_len=max_seq,
                                    capture_error_mode="thread_local")
        self.session.capture(batches={max_bs: capture_batch})

    def batch(self, seq_lens: list[int]) -> Any:
        return self._decode_batch(self.pool, seq_lens, pages=self.pages[:len(seq_lens)],
                                  page_table_width=self.width)

    def inputs(self, b: int) -> tuple[Any, Any, Any, list[int]]:
        torch, c, g = self.torch, self.config, self.gen
        seq_lens = [int(n) for n in torch.randint(1, self.max_seq + 1, (b,), generator=g)]
        q = torch.randn(b, c.num_heads, c.kv_row_dim, generator=g).to(torch.bfloat16)
        latent = torch.randn(b, c.kv_lora_rank, generator=g).to(torch.bfloat16)
        rope = torch.randn(b, c.qk_rope_head_dim, generator=g).to(torch.bfloat16)
        dev = self.pool.device
        return q.to(dev), latent.to(dev), rope.to(dev), seq_lens

    def replay(self, q: Any, latent: Any, rope: Any, seq_lens: list[int]) -> Any:
        outs = self.session.replay(self.batch(seq_lens), self._inputs(q, latent, rope),
                                   bucket=self.max_bs)
        return outs[0].clone()

    def eager(self, q: Any, latent: Any, rope: Any, seq_lens: list[int]) -> Any:
        return self.session.eager(self.batch(seq_lens), self._inputs(q, latent, rope))[0]


def _gather(torch: Any, dist: Any, rows: list[list[int]], device: Any) -> list[list[list[int]]]:
    """Every rank's ``rows`` (same shape on all ranks), through the process group."""
    local = torch.tensor(rows, dtype=torch.int32, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [p.cpu().tolist() for p in parts]


def worker(rank: int, cfg: dict[str, Any]) -> int:
    """One rank of parts 1 and 2; writes ``rank{r}.json`` in the output directory."""
    from datetime import timedelta

    env_seen = {k: os.environ.get(k) for k in MULTICAST_OFF}
    if env_seen != MULTICAST_OFF:  # checked before torch is imported
        raise SystemExit(f"rank {rank}: multicast variables not set as required: {env_seen}")
    import torch
    import torch.distributed as dist

    from attnreg.graph_policy import GraphConfig, ReplayGate, resolve, vote
    from attnreg.registry import Platform

    world, device, seed = cfg["world"], cfg["device"], cfg["seed"]
    out: dict[str, Any] = {"rank": rank, "world": world, "backend": cfg["backend"],
                           "env": env_seen, "torch": torch.__version__}
    if device == "cuda":
        if torch.cuda.device_count() < world:
            raise SystemExit(f"rank {rank}: {world} ranks need {world} GPUs, torch sees "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_device(rank)
        props = torch.cuda.get_device_properties(rank)
        out["gpu"] = {"index": rank, "name": props.name, "uuid": str(props.uuid)}
        if cfg["backend"] == "nccl":
            version = torch.cuda.nccl.version()  # a tuple in recent torch, an int before
            out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) \
                else str(version)
    dist.init_process_group(cfg["backend"], init_method=cfg["init_method"], rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg["pg_timeout_s"]))
    comm_device = torch.device("cuda", rank) if cfg["backend"] == "nccl" else \
        torch.device("cpu")
    subgroup = dist.new_group(list(range(world)), backend=cfg["backend"])

    # -- part 2 setup first: the graph is captured before any collective runs
    plan_platform = cfg["plan_platform"] or str(Platform.detect())
    plan = resolve(plan_platform, MODEL, "triton",
                   GraphConfig(decode_batch_sizes=tuple(sorted({1, 2, cfg["max_bs"]}))),
                   assume_installed=cfg["simulated_plan"])
    gate = ReplayGate(plan)
    t0 = time.perf_counter()
    step = DecodeStep(torch, f"cuda:{rank}" if device == "cuda" else "cpu",
                      cfg["gate_heads"], cfg["max_bs"], cfg["max_seq"], seed * 7919 + rank)
    out["gate_setup_s"] = round(time.perf_counter() - t0, 3)

    # -- part 1: vote trials
    votes: list[list[int]] = []
    t0 = time.perf_counter()
    for trial in range(cfg["trials"]):
        eligible = draw_eligibility(seed, trial, rank)
        # alternate the default group and an explicit subgroup, as engines use both
        got = vote(eligible, group=subgroup if trial % 2 else None)
        votes.append([int(eligible), int(got)])
    out["vote_wall_s"] = round(time.perf_counter() - t0, 4)
    out["votes"] = votes
    gathered = _gather(torch, dist, votes, comm_device)
    out["vote_disagreements_seen_by_rank"] = count_vote_disagreements(gathered)

    # -- part 2: gate decisions and the decode step
    steps: list[list[int]] = []
    rules: list[str] = []
    max_err = 0.0
    t0 = time.perf_counter()
    for s in range(cfg["gate_steps"]):
        batch, planted = draw_replay_batch(seed, s, rank, cfg["max_bs"])
        eligible, reason = gate.can_replay(batch)
        if reason.rule != planted:
            raise SystemExit(f"rank {rank} step {s}: planted {planted} but the gate said "
                             f"{reason}")
        agreed = vote(eligible)
        q, latent, rope, seq_lens = step.inputs(batch.batch_size)
        mismatch = 0
        if agreed:
            path = 1
            got = step.replay(q, latent, rope, seq_lens)
            ref = step.eager(q, latent, rope, seq_lens)
            err = (got.float() - ref.float()).abs()
            bound = REPLAY_ATOL + REPLAY_RTOL * ref.float().abs()
            mismatch = int(bool((err > bound).any()))
            max_err = max(max_err, float(err.max()))
        else:
            path = 0
            step.eager(q, latent, rope, seq_lens)
        steps.append([int(eligible), int(agreed), path, mismatch])
        rules.append(reason.rule)
    if device == "cuda":
        torch.cuda.synchronize()
    out["gate_wall_s"] = round(time.perf_counter() - t0, 3)
    out["gate"] = {"plan_platform": plan_platform, "simulated_plan": cfg["simulated_plan"],
                   "decode_mode": plan.decode.mode.value, "heads": cfg["gate_heads"],
                   "max_bs": cfg["max_bs"], "max_seq": cfg["max_seq"],
                   "real_graphs": step.real_graphs, "max_abs_err": max_err}
    out["steps"] = steps
    out["rules"] = rules
    gathered_steps = _gather(torch, dist, steps, comm_device)
    out["path_disagreements_seen_by_rank"] = count_path_disagreements(gathered_steps)["paths"]
    if cfg["backend"] == "nccl":
        dist.barrier(device_ids=[rank])  # name the GPU: NCCL would otherwise guess it
    else:
        dist.barrier()
    dist.destroy_process_group()
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------
# checks (on the gathered per-rank records)
# ---------------------------------------------------------------------------

def count_vote_disagreements(per_rank: list[list[list[int]]]) -> dict[str, int]:
    """Trials where ranks' results differ, or differ from the AND of their inputs."""
    trials = len(per_rank[0])
    differ = wrong = true_outcomes = 0
    for t in range(trials):
        results = {r[t][1] for r in per_rank}
        expected = int(all(r[t][0] for r in per_rank))
        differ += len(results) > 1
        wrong += results != {expected}  # includes every trial where ranks differ
        true_outcomes += expected
    return {"trials": trials, "disagreements": wrong, "ranks_differ": differ,
            "and_true": true_outcomes, "and_false": trials - true_outcomes}


def count_path_disagreements(per_rank: list[list[list[int]]]) -> dict[str, int]:
    """Steps where ranks ran different paths, or a vote that is not the AND."""
    steps = len(per_rank[0])
    paths = not_and = path_not_vote = graph = mismatches = 0
    for s in range(steps):
        ran = {r[s][2] for r in per_rank}
        expected = int(all(r[s][0] for r in per_rank))
        paths += len(ran) > 1
        not_and += any(r[s][1] != expected for r in per_rank)
        path_not_vote += any(r[s][2] != r[s][1] for r in per_rank)
        graph += ran == {1}
        mismatches += sum(r[s][3] for r in per_rank)
    return {"steps": steps, "paths": paths, "vote_not_the_and": not_and,
            "path_not_the_vote": path_not_vote, "graph_steps": graph,
            "eager_steps": steps - graph, "replay_mismatches": mismatches}


# ---------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float
              ) -> tuple[list[int | None], bool]:
    """Exit codes (None: killed at the deadline) and whether the deadline passed."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * len(procs)
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        if all(c is not None for c in codes):
            return codes, False
        if any(c not in (None, 0) for c in codes):
            # a failed rank leaves the others blocked in a collective: stop waiting
            time.sleep(2.0)
            codes = [p.poll() for p in procs]
            break
        time.sleep(0.1)
    timed_out = any(c is None for c in codes)
    for p in procs:
        if p.poll() is None:
            p.kill()  # only the processes this script started
            p.wait()
    return codes, timed_out


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_workers(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    out_dir = Path(cfg["out"])
    config_path = out_dir / "run-config.json"
    config_path.write_text(json.dumps(cfg, indent=2))
    env = child_env({"GLOO_SOCKET_IFNAME": "lo"} if cfg["backend"] == "gloo" else None)
    if cfg["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the triton backend runs in the interpreter
    procs, logs = [], []
    t0 = time.perf_counter()
    for r in range(cfg["world"]):
        log = out_dir / f"rank{r}.log"
        logs.append(log)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", str(r),
                 "--config", str(config_path), "--nprocs", str(cfg["world"]),
                 "--out", str(out_dir)], env=env, stdout=fh, stderr=subprocess.STDOUT))
    codes, timed_out = _wait_all(procs, timeout)
    result: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 2), "exit_codes": codes,
                              "timed_out": timed_out}
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        result["errors"] = {f"rank{r}": _tail(logs[r]) for r in failed}
        return result
    per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg["world"])]
    result["vote"] = count_vote_disagreements([p["votes"] for p in per_rank])
    result["vote"]["seen_by_ranks"] = [p["vote_disagreements_seen_by_rank"]["disagreements"]
                                       for p in per_rank]
    result["vote"]["wall_s_per_rank"] = [p["vote_wall_s"] for p in per_rank]
    result["gate"] = count_path_disagreements([p["steps"] for p in per_rank])
    result["gate"]["seen_by_ranks"] = [p["path_disagreements_seen_by_rank"] for p in per_rank]
    result["gate"]["rules"] = dict(sorted(Counter(
        rule for p in per_rank for rule in p["rules"]).items()))
    result["gate"]["setup"] = per_rank[0]["gate"]
    result["gate"]["max_abs_err"] = max(p["gate"]["max_abs_err"] for p in per_rank)
    result["gate"]["wall_s_per_rank"] = [p["gate_wall_s"] for p in per_rank]
    result["ranks"] = [{k: p.get(k) for k in ("rank", "gpu", "nccl", "torch", "env")}
                       for p in per_rank]
    uuids = [p["gpu"]["uuid"] for p in per_rank if p.get("gpu")]
    result["distinct_gpus"] = len(set(uuids)) if uuids else 0
    return result


def run_conformance(args: argparse.Namespace, out_dir: Path, heads: int,
                    device: str) -> list[dict[str, Any]]:
    """``attnreg conformance`` for ``heads`` heads, one process per rank, all at once."""
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for r in range(args.nprocs):
        report = out_dir / f"conformance-rank{r}-h{heads}.json"
        text = out_dir / f"conformance-rank{r}-h{heads}.txt"
        cmd = [sys.executable, "-m", "attnreg", "conformance", "--backend", "triton",
               "--device", device, "--heads", str(heads), "-o", str(report),
               "--pytest-arg=--tb=short"]
        if args.conformance_k:
            cmd += ["-k", args.conformance_k]
        extra = {"CUDA_VISIBLE_DEVICES": str(r)} if device == "cuda" else \
            {"TRITON_INTERPRET": "1"}
        with open(text, "wb") as fh:
            procs.append(subprocess.Popen(cmd, env=child_env(extra), stdout=fh,
                                          stderr=subprocess.STDOUT, cwd=out_dir))
        # recorded as anyone would type it: no interpreter path or output folder of this machine
        shown = ["python3", *cmd[1:]]
        shown[shown.index("-o") + 1] = report.name
        rows.append({"rank": r, "heads": heads, "device": device, "command": " ".join(shown),
                     "report": report.name, "output": text.name,
                     "cuda_visible_devices": extra.get("CUDA_VISIBLE_DEVICES")})
    codes = _wait_all_independent(procs, args.conformance_timeout)
    wall = round(time.perf_counter() - t0, 2)
    for row, code in zip(rows, codes):
        row.update(exit_code=code, timed_out=code is None, wall_s=wall)
        report = out_dir / str(row["report"])
        if report.exists():
            data = json.loads(report.read_text())
            row.update({k: data["summary"][k] for k in ("verified", "refuted", "skipped")})
            row["device_name"] = data["header"].get("device_name")
            row["header_heads"] = data["header"].get("heads")
            heads_seen = {c["combo"]["num_heads"] for c in data["claims"]
                          if c.get("combo") and c["kind"] != "refusal"}
            row["claim_head_counts"] = sorted(heads_seen)
        else:
            row["error"] = _tail(out_dir / str(row["output"]))
    return rows


def _wait_all_independent(procs: list[subprocess.Popen[bytes]], timeout: float
                          ) -> list[int | None]:
    """Exit codes, None for a process killed at the deadline; one failure stops no other."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            p.kill()  # only the processes this script started
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes


def verdict(result: dict[str, Any]) -> list[str]:
    """What failed, one line each (empty: everything passed)."""
    fails = []
    w = result["workers"]
    if "vote" not in w:
        fails.append(f"vote/gate workers failed: exit codes {w['exit_codes']}"
                     + (" (timed out)" if w["timed_out"] else ""))
    else:
        if w["vote"]["disagreements"] or any(w["vote"]["seen_by_ranks"]):
            fails.append(f"vote: {w['vote']['disagreements']} disagreeing trials")
        g = w["gate"]
        for key in ("paths", "vote_not_the_and", "path_not_the_vote", "replay_mismatches"):
            if g[key]:
                fails.append(f"gate: {key} = {g[key]}")
        if any(g["seen_by_ranks"]):
            fails.append(f"gate: ranks saw path disagreements {g['seen_by_ranks']}")
        if result["backend"] == "nccl" and w["distinct_gpus"] != result["nprocs"]:
            fails.append(f"{result['nprocs']} ranks ran on {w['distinct_gpus']} distinct GPUs")
    for row in result.get("conformance", []):
        where = f"conformance rank {row['rank']} h{row['heads']}"
        if row.get("exit_code") != 0 or row.get("refuted", 0):
            fails.append(f"{where}: exit code {row.get('exit_code')}"
                         + (" (killed at the deadline)" if row["timed_out"] else "")
                         + f", refuted {row.get('refuted')}")
        elif not row.get("verified"):
            fails.append(f"{where}: nothing verified")
        elif row.get("claim_head_counts") != [row["heads"]]:
            fails.append(f"{where}: claims ran with head counts "
                         f"{row.get('claim_head_counts')}, not [{row['heads']}]")
    return fails


def markdown(result: dict[str, Any]) -> str:
    """``summary.md``: the same tables the benchmarks page shows, and the verdict."""
    w = result["workers"]
    lines = [f"# multi-rank run: {result['nprocs']} ranks, {result['backend']}, "
             f"device {result['device']}", "",
             f"Command: `{result['command']}`", ""]
    lines += checks_table(result)
    for rank, tail in w.get("errors", {}).items():
        lines += ["", f"{rank}, end of its log:", "", "```text", tail.rstrip(), "```"]
    lines += [""] + conformance_table(result)
    fails = result["failures"]
    lines += ["", "PASSED" if not fails else "FAILED: " + "; ".join(fails), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        assert args.config is not None
        return worker(args.worker, json.loads(args.config.read_text()))
    problems = _problems(args)
    if problems:
        for p in problems:
            print(f"multi_gpu: error: {p}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    heads = args.heads or TOTAL_HEADS // args.nprocs
    cfg = {
        "world": args.nprocs, "backend": args.backend, "device": device, "seed": args.seed,
        "trials": args.trials,
        "gate_steps": args.gate_steps if args.gate_steps is not None else
        (200 if device == "cuda" else 20),
        "gate_heads": args.gate_heads or (heads if device == "cuda" else 2),
        "max_bs": GATE_MAX_BS[device], "max_seq": GATE_MAX_SEQ[device],
        "plan_platform": args.plan_platform or (None if device == "cuda" else "cuda:sm90"),
        "simulated_plan": device != "cuda" and not args.plan_platform,
        "init_method": f"tcp://127.0.0.1:{_free_port()}", "pg_timeout_s": 120,
        "out": str(out_dir),
    }
    if args.plan_platform and device == "cpu":
        cfg["simulated_plan"] = True  # a named platform other than this machine's
    # shlex.join: the recorded command must paste back as is (-k "a and b")
    command = "python3 benchmarks/multi_gpu.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {"nprocs": args.nprocs, "backend": args.backend, "device": device,
                              "command": command, "seed": args.seed,
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "multicast_env": MULTICAST_OFF}
    print(f"multi_gpu: {args.nprocs} ranks over {args.backend}: vote ({args.trials} trials) "
          f"and gate ({cfg['gate_steps']} steps)...", flush=True)
    result["workers"] = run_workers(cfg, args.timeout)
    # written now too, so that a run cut short during conformance keeps this part
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    if not args.skip_conformance:
        conf_device = args.conformance_device or device
        print(f"multi_gpu: conformance --backend triton --heads {heads} on {args.nprocs} "
              f"ranks ({conf_device})...", flush=True)
        result["conformance"] = run_conformance(args, out_dir, heads, conf_device)
    result["failures"] = verdict(result)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (out_dir / "summary.md").write_text(text)
    print(text)
    return 0 if not result["failures"] else 1



# ---------------------------------------------------------------------------
# rendering (python -m benchmarks.render: results/multi/*-summary.json)
# ---------------------------------------------------------------------------

TITLE = "Multi-GPU (issue 9)"
COMMAND = ("python3 benchmarks/multi_gpu.py --nprocs N --backend nccl --trials 1000 "
           "--out $OUT/tpN")
RESULTS = ("multi", "*-summary.json")
#: World sizes issue 9 asks for, and why a size has no summary file (where known).
SIZES = (2, 4, 8)
UNMEASURED_WHY = {n: f"nvidia-h200-x{n} machines were not lent when issue 9 was measured"
                  for n in (4, 8)}


def read(path: Path) -> dict[str, Any]:
    """A ``summary.json`` of this script (``ValueError`` for anything else)."""
    doc = json.loads(Path(path).read_text())
    if not {"nprocs", "backend", "workers"} <= doc.keys():
        raise ValueError(f"{path}: not a summary written by benchmarks/multi_gpu.py "
                         "(needs nprocs, backend, workers)")
    return dict(doc)


def where(doc: dict[str, Any]) -> str:
    return _multi_devices(doc).split(" (")[0]


def _conformance_k(doc: dict[str, Any]) -> str | None:
    """The ``-k`` expression of the conformance runs (multi_gpu.py appends it last)."""
    for row in doc.get("conformance", []):
        if " -k " in row.get("command", ""):
            return str(row["command"].split(" -k ", 1)[1])
    return None


def _multi_command(doc: dict[str, Any]) -> str:
    # multi_gpu.py joins argv with spaces: quote the -k expression again so it can be pasted
    command, expr = str(doc.get("command", "?")), _conformance_k(doc)
    if expr and f" -k {expr}" in command:
        command = command.replace(f" -k {expr}", f" -k {shlex.quote(expr)}", 1)
    return command


def _multi_devices(doc: dict[str, Any]) -> str:
    w = doc.get("workers", {})
    ranks = w.get("ranks") or []
    names = sorted({str(r.get("gpu", {}).get("name")) for r in ranks if r.get("gpu")})
    if not names:
        return f"{doc.get('nprocs')} ranks on {doc.get('device', '?')}"
    extra = [f"{k} {v}" for k, v in (("NCCL", ranks[0].get("nccl")),
                                     ("torch", ranks[0].get("torch"))) if v]
    return (f"{doc.get('nprocs')} x {' / '.join(names)} ({w.get('distinct_gpus')} distinct "
            f"GPUs){'; ' + ', '.join(extra) if extra else ''}")


def checks_table(doc: dict[str, Any]) -> list[str]:
    w = doc.get("workers", {})
    if "vote" not in w:
        return [f"Vote/gate workers **failed**: exit codes {w.get('exit_codes')}"
                + (" (timed out)" if w.get("timed_out") else "") + "."]
    v, g = w["vote"], w["gate"]
    s = g.get("setup", {})
    step = "CUDA graph replay" if s.get("real_graphs") else \
        "capture-mode code path, no device graph"

    def zero(n: int) -> str:
        return "pass" if n == 0 else "**FAIL**"

    rows = [
        ["vote: trials", f"{v['trials']} ({v['and_true']} AND true, {v['and_false']} false)",
         ""],
        ["vote: disagreeing trials (gathered / seen by each rank)",
         f"{v['disagreements']} / {v['seen_by_ranks']}",
         zero(v["disagreements"] + sum(v["seen_by_ranks"]))],
        ["gate: decode steps", f"{g['steps']} ({g['graph_steps']} replayed, "
         f"{g['eager_steps']} eager)", ""],
        ["gate: steps where ranks ran different paths", str(g["paths"]), zero(g["paths"])],
        ["gate: votes not the AND of local eligibility", str(g["vote_not_the_and"]),
         zero(g["vote_not_the_and"])],
        ["gate: paths not the vote", str(g["path_not_the_vote"]), zero(g["path_not_the_vote"])],
        ["gate: replays that differ from eager", f"{g['replay_mismatches']} (max abs err "
         f"{fmt(g.get('max_abs_err'))})", zero(g["replay_mismatches"])],
        ["gate: decode step", f"{step}; {s.get('heads')} heads, "
         f"{s.get('max_bs')} slots, seq <= {s.get('max_seq')}; plan {s.get('plan_platform')}"
         f"{' (simulated)' if s.get('simulated_plan') else ''}, decode "
         f"{s.get('decode_mode')}", ""],
        ["gate: rules fired (all ranks)",
         ", ".join(f"{k} {n}" for k, n in g.get("rules", {}).items()), ""],
    ]
    if doc.get("backend") == "nccl":
        rows.append(["distinct GPUs", str(w.get("distinct_gpus")),
                     "pass" if w.get("distinct_gpus") == doc.get("nprocs") else "**FAIL**"])
    return [md_table(["check", "result", "status"], rows)]


def conformance_table(doc: dict[str, Any]) -> list[str]:
    rows = []
    for r in doc.get("conformance", []):
        claims = sum(r.get(k, 0) for k in ("verified", "refuted", "skipped"))
        exit_ = str(r.get("exit_code")) + (" (killed at the deadline)" if r.get("timed_out")
                                           else "")
        rows.append([str(r["rank"]), str(r.get("device_name") or r.get("device")),
                     str(r.get("cuda_visible_devices") or "-"), str(r["heads"]),
                     ", ".join(map(str, r.get("claim_head_counts") or ["-"])), str(claims),
                     f"**{r.get('verified', '-')}**", str(r.get("refuted", "-")),
                     str(r.get("skipped", "-")), exit_, fmt(r.get("wall_s"), ".0f")])
    if not rows:
        return ["The per-rank conformance did not run (`--skip-conformance`)."]
    return [md_table(["rank", "device", "CUDA_VISIBLE_DEVICES", "heads", "claims ran at heads",
                      "claims", "verified", "refuted", "skipped", "exit", "wall s"], rows)]


def checks(doc: dict[str, Any]) -> list[Check]:
    """One check per run: this script's own list of failures must be empty."""
    n = doc.get("nprocs")
    return [evaluate(f"multi-GPU {n} ranks", f"{n} ranks over {doc.get('backend')}: failed "
                     "checks (vote, replay-gate paths, replays vs eager, per-rank conformance)",
                     len(doc.get("failures", [])), "failed checks", "<=", target=0,
                     detail="; ".join(doc.get("failures", [])))]


def _multi_file(f: ResultsFile, page: Page) -> list[str]:
    doc = f.doc
    n, backend = int(doc["nprocs"]), str(doc["backend"])  # load_extras checked both
    date = doc.get("date_utc") or doc.get("date")
    date = f" {date}" if date else ""
    undated = "" if date else "; date not recorded (multi_gpu.py writes none into its summary)"
    w = doc.get("workers", {})
    conf = doc.get("conformance", [])
    walls = [f"vote + gate workers {fmt(w.get('wall_s'), '.0f')} s"] + \
        ([f"conformance {fmt(conf[0].get('wall_s'), '.0f')} s"] if conf else [])
    expr = _conformance_k(doc)
    claims = sorted({sum(r.get(k, 0) for k in ("verified", "refuted", "skipped"))
                     for r in conf})
    heads = sorted({r["heads"] for r in conf})
    share = f" (DeepSeek-V3's 128 split over TP={n})" if heads == [128 // n] else ""
    on = (f"{n} GPUs with {backend.upper()}, one rank per GPU" if doc.get("device") == "cuda"
          else f"{n} ranks over {backend} on a {doc.get('device')}")
    multicast = ", ".join(f"{k}={v}" for k, v in doc.get("multicast_env", {}).items())
    conf_txt = ("" if not conf else
                f"  The per-rank tensor-parallel conformance ran at "
                f"{' / '.join(map(str, heads))} heads{share}, every rank at once on its own "
                "device, "
                + (f"**only the `-k {shlex.quote(expr)}` subset**: " if expr else
                   "the whole suite: ")
                + f"{' / '.join(str(c) for c in claims)} claims per rank.")
    out = [f"### {n} ranks, {backend}", "",
           f"*Measured*{date} on {_multi_devices(doc)}{undated}.  \n"
           f"*Command:* `{_multi_command(doc)}`; {', '.join(walls)}; data: "
           f"`{rel(f.path, page.root)}`.", "",
           f"Ran on {on}{'; ' + multicast if multicast else ''}.{conf_txt}", ""]
    out += checks_table(doc) + [""] + conformance_table(doc) + [""]
    return out + page.check_lines([c.to_dict() for c in checks(doc)], doc) + [""]


def render(files: list[ResultsFile], page: Page) -> list[str]:
    """The issue-9 section: each summary's checks and per-rank conformance."""
    lines = [f"## {TITLE}", ""]
    if not files:
        return lines + [f"Not measured yet. Run `{COMMAND}` on an N-GPU machine (N in "
                        f"{', '.join(map(str, SIZES))}) and bring back "
                        "`$OUT/tpN/summary.json` as "
                        "`benchmarks/results/multi/h200-xN-summary.json`.", ""]
    lines += [("`benchmarks/multi_gpu.py` (see [multi_gpu.md](multi_gpu.md)): every rank "
               "votes on random local eligibility (all results must be the AND), runs a "
               "replay-gate decode step whose path (graph replay or eager) follows the vote "
               "(all ranks must run the same path; replays must match eager), and runs "
               "`attnreg conformance` at its tensor-parallel share of the heads."), ""]
    for f in files:
        lines += _multi_file(f, page)
    done = {f.doc.get("nprocs") for f in files if f.doc.get("backend") == "nccl"}
    missing = [f"{n} GPUs ({UNMEASURED_WHY.get(n, 'no summary file yet')})"
               for n in SIZES if n not in done]
    if missing:
        lines += [f"Not measured with NCCL: {'; '.join(missing)}.", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
