"""``attnreg compat``: the graph plan for a platform, model, backends and config.

Prints the plan as a table and the numbered decision trace (or ``--json``:
``GraphPlan.to_dict()`` plus ``simulated``/``assume_installed``).  Exit codes:
0 a plan; 2 a policy error (a locked mode breaks a hard rule, no backend fits)
with every reason and what to do on stderr (with ``--json``, also
``{"error": "graph_policy", "platform", "reasons", "hint"}`` on stdout), or
bad input such as an unknown backend name.

JSON keys (``schema_version`` 1): ``platform``, ``model``, ``features``,
``config``, ``phases.{prefill,decode}.{mode, default_mode, locked, backend,
backend_choice, pinned_method, fallbacks[{to, cost, reason}], split_kv,
capture_memory_bytes}``, ``capture_memory_bytes``, ``decisions[{rule,
severity, source, phase, before, after, message}]``, and
``phases.prefill.crossover``: null without a cost profile, else ``{profile,
applies, note, heads, batch_size, buckets, points[{prefix, batch_size, heads,
max_extend, max_graph_extend, text}]}`` (where the replay gate's cost model
switches from the absorbed graph to eager MHA; ``points`` is empty when the
profile is for another backend, platform or KV dtype).

Cost profile: ``--cost-profile PATH``, else the profile shipped with attnreg
for the prefill backend, platform and KV dtype, if there is one.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any

from attnreg.graph_policy import (
    MODEL_PRESETS,
    BackendChoice,
    GraphConfig,
    GraphPlan,
    ModelFacts,
    ReplayGate,
    ServerFeatures,
    resolve,
)
from attnreg.graph_policy.features import FEATURE_HELP
from attnreg.profiling.crossover import CROSSOVER_PREFIXES, crossover_extend
from attnreg.registry import DType, GraphPolicyError

from ._common import (
    add_json_argument,
    add_plugin_argument,
    add_registry_arguments,
    parse_platform,
    print_json,
    registry_from,
    table,
)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2,
          "mib": 1024 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1e9"`` or a plain int."""
    m = _SIZE_RE.match(text.lower())
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read size {text!r}; write e.g. 8GiB, 512MiB, 2GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _flag(feature: str) -> str:
    return "--enable-lora" if feature == "lora" else "--" + feature.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", default=None,
                        help="platform to plan for (cuda:sm90, cuda:sm100, rocm:gfx942, cpu); "
                             "default: detect.  A given platform is simulated: optional "
                             "libraries are assumed installed")
    model = parser.add_argument_group("model facts (a preset, then overrides)")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                       help="start from a preset's facts")
    model.add_argument("--attention", choices=("mla", "mha"), default=None)
    model.add_argument("--kv-dtype", choices=[d.value for d in DType], default=None)
    model.add_argument("--act-dtype", choices=[d.value for d in DType], default=None)
    model.add_argument("--num-heads", type=int, default=None,
                       help="attention heads on one rank")
    model.add_argument("--multimodal", action=argparse.BooleanOptionalAction, default=None)
    model.add_argument("--piecewise-validated", action=argparse.BooleanOptionalAction,
                       default=None, help="tc_piecewise prefill validated for the model")
    model.add_argument("--dsa-sparse", action=argparse.BooleanOptionalAction, default=None)
    model.add_argument("--capture-pool-bytes", type=parse_size, default=None, metavar="SIZE",
                       help="graph-pool memory of the model's captured prefill graphs")
    model.add_argument("--decode-capture-pool-bytes", type=parse_size, default=None,
                       metavar="SIZE")
    backends = parser.add_argument_group("backends (default: best declared priority)")
    backends.add_argument("--backend", default=None, help="one backend for both phases")
    backends.add_argument("--prefill-backend", default=None)
    backends.add_argument("--decode-backend", default=None)
    graphs = parser.add_argument_group("graph modes (a given mode is locked)")
    graphs.add_argument("--prefill-graph", choices=("disabled", "breakable", "tc_piecewise"),
                        default=None)
    graphs.add_argument("--decode-graph", choices=("disabled", "full"), default=None)
    graphs.add_argument("--capture-memory-budget", type=parse_size, default=None,
                        metavar="SIZE", help="soft budget for all capture memory")
    feats = parser.add_argument_group("server features")
    for name, help_text in FEATURE_HELP.items():
        feats.add_argument(_flag(name), dest=f"feature_{name}", action="store_true",
                           help=help_text)
    cost = parser.add_argument_group("cost model (per-batch prefill replay)")
    cost.add_argument("--cost-profile", default=None, metavar="PATH",
                      help="cost profile JSON (from `attnreg calibrate`); default: the "
                           "profile shipped for the prefill backend and platform, if any")
    add_registry_arguments(parser)
    add_plugin_argument(parser)
    add_json_argument(parser)


def crossover(plan: GraphPlan, cost_profile: str | None = None) -> dict[str, Any] | None:
    """Where the replay gate's cost model switches to eager MHA, per prefix; None without
    a profile.

    ``cost_profile`` is a path, or None for the shipped profile of the plan's
    prefill backend, platform and KV dtype.
    """
    gate = ReplayGate(plan, cost_profile=cost_profile or "auto")
    profile = gate.cost_profile
    if profile is None and cost_profile is None:
        return None
    buckets = list(plan.config.prefill_num_tokens)
    heads = plan.model.num_heads
    points = []
    if profile is not None:
        points = [crossover_extend(profile, heads=heads, prefix=p, max_extend=buckets[-1],
                                   buckets=buckets).to_dict() for p in CROSSOVER_PREFIXES]
    described = None if profile is None else {
        "source": profile.source, "backend": profile.backend,
        "platform": str(profile.platform), "kv_dtype": profile.kv_dtype.value,
        "device": profile.device, "created": profile.created, "dry_run": profile.dry_run,
        "shipped": cost_profile is None}
    return {"profile": described, "applies": gate.uses_cost_model,
            "note": gate.cost_model_note, "heads": heads, "batch_size": 1,
            "buckets": buckets, "points": points}


def render_crossover(cross: dict[str, Any] | None) -> str:
    """The human form of :func:`crossover` ("" without a profile)."""
    if cross is None:
        return ""
    lines = ["", "", "cost model (prefill replay, per layer):", f"  {cross['note']}"]
    if cross["points"]:
        lines.append(f"  {cross['batch_size']} sequence, {cross['heads']} heads, token "
                     f"buckets up to {cross['buckets'][-1]}"
                     + ("" if cross["applies"] else " (not applied to this plan)") + ":")
        lines += [f"    {p['text']}" for p in cross["points"]]
    return "\n".join(lines)


def _model_from(args: argparse.Namespace) -> ModelFacts:
    base = MODEL_PRESETS[args.model] if args.model else ModelFacts()
    return base.with_overrides(
        attention=args.attention, kv_dtype=args.kv_dtype, act_dtype=args.act_dtype,
        num_heads=args.num_heads, multimodal=args.multimodal,
        piecewise_validated=args.piecewise_validated, dsa_sparse=args.dsa_sparse,
        prefill_capture_pool_bytes=args.capture_pool_bytes,
        decode_capture_pool_bytes=args.decode_capture_pool_bytes)


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render(plan: GraphPlan, header: str) -> str:
    """The human form: header, plan table, numbered decision trace."""
    rows = []
    for pp in (plan.prefill, plan.decode):
        fallbacks = ", ".join(f"{f.to} (cost {f.cost.value})" for f in pp.fallbacks) or "-"
        rows.append((pp.phase.value, pp.mode.value, pp.backend,
                     "yes" if pp.locked else "no",
                     pp.pinned_method.value if pp.pinned_method else "-",
                     fallbacks, pp.split_kv.value if pp.split_kv else "-",
                     _fmt_bytes(pp.capture_memory_bytes)))
    lines = [header,
             table(("phase", "mode", "backend", "locked", "pinned", "fallbacks", "split-kv",
                    "capture mem"), rows),
             "", "decisions:"]
    lines += [f"{i:3d}. {d.describe()}" for i, d in enumerate(plan.decisions, 1)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # The trace below already shows every decision; keep the library's
    # warnings from being echoed to stderr by logging's last-resort handler.
    policy_logger = logging.getLogger("attnreg.graph_policy")
    if not any(isinstance(h, logging.NullHandler) for h in policy_logger.handlers):
        policy_logger.addHandler(logging.NullHandler())
    platform, simulated = parse_platform(args.platform)
    model = _model_from(args)
    config = GraphConfig.from_user(prefill=args.prefill_graph, decode=args.decode_graph,
                                   capture_memory_budget_bytes=args.capture_memory_budget)
    features = ServerFeatures(**{name: getattr(args, f"feature_{name}")
                                 for name in FEATURE_HELP})
    backends = BackendChoice(prefill=args.prefill_backend or args.backend,
                             decode=args.decode_backend or args.backend)
    try:
        plan = resolve(platform, model, backends, config, features,
                       registry=registry_from(args), assume_installed=simulated)
    except GraphPolicyError as exc:
        print("attnreg compat: the requested graph configuration cannot run:", file=sys.stderr)
        for reason in exc.reasons:
            print(f"  - {reason}", file=sys.stderr)
        print(exc.hint, file=sys.stderr)
        if args.json:
            print_json({"error": "graph_policy", "platform": str(platform),
                        "reasons": exc.reasons, "hint": exc.hint})
        return 2
    cross = crossover(plan, args.cost_profile)
    if args.json:
        data: dict[str, Any] = plan.to_dict()
        data["phases"]["prefill"]["crossover"] = cross
        data["simulated"] = simulated
        data["assume_installed"] = simulated
        print_json(data)
        return 0
    how = "simulated, optional libraries assumed installed" if simulated else "detected"
    locked = ", ".join(sorted(config.locked)) or "nothing"
    print(render(plan, f"graph plan for {model.label} ({model.attention}, {model.kv_dtype} KV, "
                       f"{model.num_heads} heads) on {platform} ({how}); locked: {locked}")
          + render_crossover(cross))
    return 0


__all__ = ["add_arguments", "crossover", "parse_size", "render", "render_crossover", "run"]
