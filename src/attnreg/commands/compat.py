"""``attnreg compat``: the graph plan for a platform, model, backends and config.

Prints the plan as a table and the numbered decision trace (or ``--json``:
``GraphPlan.to_dict()`` plus ``simulated``/``assume_installed``).  Exit codes:
0 a plan; 2 a policy error (a locked mode breaks a hard rule, no backend fits)
with every reason and what to do on stderr (with ``--json``, also
``{"error": "graph_policy", "platform", "reasons", "hint"}`` on stdout), or
bad input (an unknown backend name, a value outside what an option allows, a
cuda platform without an arch): one line naming the option, the value and
what is allowed, no traceback unless ``--traceback``.

JSON keys (``schema_version`` 1): ``platform``, ``model``, ``features``,
``config``, ``engine``, ``phases.{prefill,decode}.{mode, default_mode, locked,
backend, backend_choice, pinned_method, fallbacks[{to, cost, reason}],
split_kv, capture_memory_bytes, captured[{forward_mode, batch_sizes,
num_tokens, max_requests, query_len, max_seq_len}], bucket_backends[{bucket,
backend, rule, reason, ratio}]}`` (``bucket_backends`` is empty unless
``--decode-profile`` gave decode buckets their own backends),
``capture_memory_bytes``, ``capture_budget{bytes, source,
device_memory_bytes, fraction, note}``, ``speculative[{forward_mode, how,
backend, query_len, message}]``, ``decisions[{rule, severity, source, phase,
before, after, message}]``, and
``phases.prefill.crossover``: null without a cost profile, else ``{profile,
applies, note, heads, batch_size, buckets, points[{prefix, batch_size, heads,
max_extend, max_graph_extend, text}]}`` (where the replay gate's cost model
switches from the absorbed graph to eager MHA; ``points`` is empty when the
profile is for another backend, platform or KV dtype).

Cost profile: ``--cost-profile PATH``, else the profile shipped with attnreg
for the prefill backend, platform and KV dtype, if there is one.  Decode
profile: ``--decode-profile PATH`` only (none is shipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from attnreg.graph_policy import (
    MODEL_PRESETS,
    BackendChoice,
    EngineFacts,
    GraphConfig,
    GraphPlan,
    ModelFacts,
    ReplayGate,
    ServerFeatures,
    resolve,
)
from attnreg.graph_policy.config import (
    DEFAULT_CAPTURE_BUDGET_FRACTION,
    DEFAULT_DECODE_BATCH_SIZES,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_PREFILL_MAX_REQUESTS,
    DEFAULT_PREFILL_NUM_TOKENS,
)
from attnreg.graph_policy.features import FEATURE_HELP
from attnreg.profiling.crossover import CROSSOVER_PREFIXES, crossover_extend
from attnreg.registry import KNOWN_DEVICES, AttnregError, DType, GraphPolicyError, Platform
from attnreg.registry.platform import detect_device_memory, known_device

from ._common import (
    add_output_arguments,
    add_plugin_argument,
    add_registry_arguments,
    emit_json,
    parse_platform,
    registry_from,
    table,
    width_of,
    wrap,
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


def _positive_int(what: str) -> Any:
    """An argparse type: an int >= 1, refused with ``what`` it counts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1 or str(value) != text.strip().lstrip("+"):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected a positive "
                                             f"integer ({what})")
        return value
    parse.__name__ = "positive integer"
    return parse


def _int_list(what: str) -> Any:
    """An argparse type: comma-separated positive ints, strictly increasing."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1 or list(values) != sorted(set(values)):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not allowed: expected increasing positive integers separated by "
                f"commas ({what}), e.g. 1,2,4,8")
        return values
    parse.__name__ = "list"
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected a fraction from 0 "
                                         "to 1 (0 turns the default budget off)")
    return value


def _size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected a size above 0, "
                                         "e.g. 80GB")
    return value


def _modes(phase: str, allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> frozenset[str]:
        values = frozenset(v.strip() for v in text.split(",") if v.strip())
        unknown = sorted(values - set(allowed))
        if not values or unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not allowed: expected {phase} graph modes separated by commas, "
                f"from {', '.join(allowed)}")
        return values
    parse.__name__ = "modes"
    return parse


def _flag(feature: str) -> str:
    return "--enable-lora" if feature == "lora" else "--" + feature.replace("_", "-")


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Bad input is one line on stderr and exit 2 (argparse would print the usage too)."""
    prog = parser.prog

    def error(message: str) -> Any:
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


_PREFILL_MODES = ("disabled", "breakable", "tc_piecewise")
_DECODE_MODES = ("disabled", "full")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _one_line_errors(parser)
    devices = ", ".join(KNOWN_DEVICES)
    parser.add_argument("--platform", default=None,
                        help="platform to plan for (cuda:sm90, cuda:sm100, rocm:gfx942, cpu, "
                             f"or a GPU name: {devices}); default: detect.  A given "
                             "platform is simulated: optional libraries are assumed installed. "
                             "cuda and rocm need an arch")
    model = parser.add_argument_group("model facts (a preset, then overrides)")
    model.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                       help="start from a preset's facts")
    model.add_argument("--attention", choices=("mla", "mha"), default=None,
                       help="attention kind: mla (latent KV) or mha (default: the preset's, "
                            "else mla)")
    model.add_argument("--kv-dtype", choices=[d.value for d in DType], default=None,
                       help="dtype of the KV pool (default: the preset's, else bf16)")
    model.add_argument("--act-dtype", choices=[d.value for d in DType], default=None,
                       help="dtype of activations, the query (default: the preset's, else "
                            "bf16)")
    model.add_argument("--num-heads", type=_positive_int("attention heads on one rank"),
                       default=None, metavar="N", help="attention heads on one rank")
    model.add_argument("--multimodal", action=argparse.BooleanOptionalAction, default=None,
                       help="the model is multimodal (a policy input for piecewise prefill)")
    model.add_argument("--piecewise-validated", action=argparse.BooleanOptionalAction,
                       default=None, help="tc_piecewise prefill validated for the model")
    model.add_argument("--dsa-sparse", action=argparse.BooleanOptionalAction, default=None,
                       help="DSA model: prefill runs absorbed MLA only (no MHA companion); "
                            "--no-dsa-sparse also drops a preset's sparse top-k")
    model.add_argument("--sparse-top-k", type=_positive_int("top-k tokens per query token"), default=None,
                       metavar="K",
                       help="attention is sparse with top-k K: only backends that declare "
                            "sparse MLA kernels accepting K serve it (implies --dsa-sparse)")
    model.add_argument("--capture-pool-bytes", type=parse_size, default=None, metavar="SIZE",
                       help="graph-pool memory of the model's captured prefill graphs")
    model.add_argument("--decode-capture-pool-bytes", type=parse_size, default=None,
                       metavar="SIZE",
                       help="graph-pool memory of the model's captured decode graphs")
    engine = parser.add_argument_group("engine facts")
    engine.add_argument("--page-size", type=_positive_int("tokens per KV-pool page"),
                        default=None, metavar="N",
                        help="tokens per KV-pool page; backends that do not declare it are "
                             "skipped (default: not checked)")
    engine.add_argument("--max-context", type=_positive_int("tokens of the longest sequence"),
                        default=None, metavar="N",
                        help="longest sequence the engine serves; graphs are captured for it "
                             f"(default {DEFAULT_MAX_SEQ_LEN})")
    engine.add_argument("--max-running-requests",
                        type=_positive_int("requests in one batch"), default=None, metavar="N",
                        help="most requests in one batch: larger decode buckets are not "
                             "captured")
    engine.add_argument("--kv-pool-size", type=_size, default=None, metavar="SIZE",
                        help="the engine's whole KV pool (counts where a capture fallback "
                             "converts the pool)")
    engine.add_argument("--device-memory", type=_size, default=None, metavar="SIZE",
                        help="memory of one device (default: detected, or the known size of "
                             "the --platform GPU); the default capture budget is a fraction "
                             "of it")
    engine.add_argument("--speculative-decoding", type=_positive_int("draft tokens per verify"),
                        nargs="?", const=0, default=None, metavar="N",
                        help="speculative decoding with N draft tokens per target-verify "
                             "batch (no N: on, number unknown)")
    engine.add_argument("--engine-prefill-modes", type=_modes("prefill", _PREFILL_MODES),
                        default=None, metavar="MODES",
                        help="prefill graph modes the host engine has, comma-separated "
                             "(default: all)")
    engine.add_argument("--engine-decode-modes", type=_modes("decode", _DECODE_MODES),
                        default=None, metavar="MODES",
                        help="decode graph modes the host engine has (default: all)")
    backends = parser.add_argument_group("backends (default: the best declared for the need)")
    backends.add_argument("--backend", default=None, metavar="NAME",
                          help="one backend for both phases")
    backends.add_argument("--prefill-backend", default=None, metavar="NAME",
                          help="backend for prefill (overrides --backend there)")
    backends.add_argument("--decode-backend", default=None, metavar="NAME",
                          help="backend for decode (overrides --backend there)")
    graphs = parser.add_argument_group("graph modes and capture sizes (a given mode is locked)")
    graphs.add_argument("--prefill-graph", choices=_PREFILL_MODES, default=None,
                        help="prefill graph mode, locked: a hard rule against it is an error "
                             "(default: the policy chooses)")
    graphs.add_argument("--decode-graph", choices=_DECODE_MODES, default=None,
                        help="decode graph mode, locked (default: the policy chooses)")
    graphs.add_argument("--capture-memory-budget", type=parse_size, default=None,
                        metavar="SIZE", help="soft budget for all capture memory (replaces the "
                                             "default budget)")
    graphs.add_argument("--capture-budget-fraction", type=_fraction, default=None,
                        metavar="F", help="the default budget as a fraction of the device "
                                          f"memory (default {DEFAULT_CAPTURE_BUDGET_FRACTION})")
    default_sizes = ",".join(map(str, DEFAULT_DECODE_BATCH_SIZES))
    graphs.add_argument("--decode-batch-sizes", type=_int_list("decode batch buckets"),
                        default=None, metavar="LIST",
                        help=f"decode batch buckets to capture (default {default_sizes})")
    graphs.add_argument("--prefill-tokens", type=_int_list("prefill token buckets"),
                        default=None, metavar="LIST",
                        help="prefill token buckets to capture (default "
                             f"{','.join(map(str, DEFAULT_PREFILL_NUM_TOKENS))})")
    graphs.add_argument("--prefill-max-requests",
                        type=_positive_int("requests in one captured prefill batch"),
                        default=None, metavar="N",
                        help=f"requests in one captured prefill batch (default "
                             f"{DEFAULT_PREFILL_MAX_REQUESTS})")
    feats = parser.add_argument_group("server features")
    for name, help_text in FEATURE_HELP.items():
        if name == "speculative_decoding":
            continue  # --speculative-decoding [N], above
        feats.add_argument(_flag(name), dest=f"feature_{name}", action="store_true",
                           help=help_text)
    cost = parser.add_argument_group("cost model (per-batch prefill replay)")
    cost.add_argument("--cost-profile", default=None, metavar="PATH",
                      help="cost profile JSON (from `attnreg calibrate`); default: the "
                           "profile shipped for the prefill backend and platform, if any")
    cost.add_argument("--decode-profile", default=None, metavar="PATH",
                      help="decode profile JSON (from `attnreg calibrate --decode`): each "
                           "decode bucket may then be captured with the backend measured "
                           "fastest there, among those declaring the same pool (needs "
                           "--page-size); default: one decode backend")
    add_registry_arguments(parser)
    add_plugin_argument(parser)
    add_output_arguments(parser)
    parser.add_argument("--traceback", action="store_true",
                        help="show the Python traceback of an error")


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


def render_crossover(cross: dict[str, Any] | None, width: int | None = None) -> str:
    """The human form of :func:`crossover` ("" without a profile)."""
    if cross is None:
        return ""
    lines = ["", "", "cost model (prefill replay, per layer):", *wrap(f"  {cross['note']}",
                                                                       width, "    ")]
    if cross["points"]:
        lines += wrap(f"  {cross['batch_size']} sequence, {cross['heads']} heads, token "
                      f"buckets up to {cross['buckets'][-1]}"
                      + ("" if cross["applies"] else " (not applied to this plan)") + ":",
                      width, "    ")
        for p in cross["points"]:
            lines += wrap(f"    {p['text']}", width, "      ")
    return "\n".join(lines)


def _model_from(args: argparse.Namespace) -> ModelFacts:
    base = MODEL_PRESETS[args.model] if args.model else ModelFacts()
    if args.dsa_sparse is False:
        base = dataclasses.replace(base, sparse_top_k=None)
    return base.with_overrides(sparse_top_k=args.sparse_top_k,
        attention=args.attention, kv_dtype=args.kv_dtype, act_dtype=args.act_dtype,
        num_heads=args.num_heads, multimodal=args.multimodal,
        piecewise_validated=args.piecewise_validated, dsa_sparse=args.dsa_sparse,
        prefill_capture_pool_bytes=args.capture_pool_bytes,
        decode_capture_pool_bytes=args.decode_capture_pool_bytes)


def _engine_from(args: argparse.Namespace, simulated: bool) -> EngineFacts:
    memory = args.device_memory
    if memory is None and not simulated:
        memory = detect_device_memory()
    return EngineFacts(
        page_size=args.page_size,
        max_context_len=args.max_context or DEFAULT_MAX_SEQ_LEN,
        max_running_requests=args.max_running_requests,
        kv_pool_bytes=args.kv_pool_size or 0,
        device_memory_bytes=memory,
        num_draft_tokens=args.speculative_decoding or 0,
        prefill_graph_modes=args.engine_prefill_modes,  # type: ignore[arg-type]
        decode_graph_modes=args.engine_decode_modes)  # type: ignore[arg-type]


def _config_from(args: argparse.Namespace) -> GraphConfig:
    sizes: dict[str, object] = {}
    if args.decode_batch_sizes is not None:
        sizes["decode_batch_sizes"] = args.decode_batch_sizes
    if args.prefill_tokens is not None:
        sizes["prefill_num_tokens"] = args.prefill_tokens
    if args.prefill_max_requests is not None:
        sizes["prefill_max_requests"] = args.prefill_max_requests
    if args.capture_budget_fraction is not None:
        sizes["capture_budget_fraction"] = args.capture_budget_fraction
    return GraphConfig.from_user(prefill=args.prefill_graph, decode=args.decode_graph,
                                 capture_memory_budget_bytes=args.capture_memory_budget,
                                 **sizes)


def _input_error(option: str, value: object, allowed: str) -> int:
    print(f"attnreg compat: error: argument {option}: {value!r} is not allowed: {allowed}",
          file=sys.stderr)
    return 2


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render(plan: GraphPlan, header: str, width: int | None = None) -> str:
    """The human form: header, plan table, capture budget, numbered decision trace.

    Lines longer than ``width`` wrap, a decision's continuation lines indented
    under its text (None: no wrapping).
    """
    rows = []
    for pp in (plan.prefill, plan.decode):
        fallbacks = ", ".join(f"{f.to} (cost {f.cost.value})" for f in pp.fallbacks) or "-"
        rows.append((pp.phase.value, pp.mode.value, pp.backend,
                     "yes" if pp.locked else "no",
                     pp.pinned_method.value if pp.pinned_method else "-",
                     fallbacks, pp.split_kv.value if pp.split_kv else "-",
                     _fmt_bytes(pp.capture_memory_bytes)))
    lines = [*wrap(header, width, "  "),
             table(("phase", "mode", "backend", "locked", "pinned", "fallbacks", "split-kv",
                    "capture mem"), rows, wrap_columns=("backend", "fallbacks"), width=width)]
    if plan.decode.bucket_backends:
        lines += ["", "decode buckets (from the decode profile):",
                  table(("bucket", "backend", f"time / {plan.decode.backend}", "why"),
                        [(b.bucket, b.backend, "-" if b.ratio is None else f"{b.ratio:.3f}",
                          b.reason) for b in plan.decode.bucket_backends],
                        wrap_columns=("why",), width=width)]
    budget = plan.capture_budget
    if budget is not None:
        limit = "none" if budget.bytes is None else _fmt_bytes(budget.bytes)
        lines += wrap(f"capture memory {_fmt_bytes(plan.capture_memory_bytes)}, budget "
                      f"{limit} ({budget.note})", width, "  ")
    lines += ["", "decisions:"]
    for i, d in enumerate(plan.decisions, 1):
        lines += wrap(f"{i:3d}. {d.describe()}", width, "     ")
    return "\n".join(lines)


@dataclass
class Outcome:
    """What one ``attnreg compat`` run found: its exit status, JSON and text.

    ``data`` is the JSON document (the plan, or the policy error; None after
    bad input, which was reported on stderr); ``text`` the human form ("" when
    the run ended in an error).
    """

    status: int
    data: dict[str, Any] | None = None
    text: str = ""


def plan_outcome(args: argparse.Namespace) -> Outcome:
    """Resolve the plan ``args`` ask for; errors go to stderr, as ``attnreg compat`` prints
    them (``attnreg demo`` calls this per platform)."""
    # The trace below already shows every decision; keep the library's
    # warnings from being echoed to stderr by logging's last-resort handler.
    policy_logger = logging.getLogger("attnreg.graph_policy")
    if not any(isinstance(h, logging.NullHandler) for h in policy_logger.handlers):
        policy_logger.addHandler(logging.NullHandler())
    platform, simulated = parse_platform(args.platform)
    if platform.arch_missing:
        names = [n for n, d in KNOWN_DEVICES.items() if d.vendor is platform.vendor]
        return Outcome(_input_error("--platform", args.platform,
                                    "a plan depends on the architecture; give one of "
                                    f"{', '.join(platform.known_archs())}"
                                    + (f" or a GPU name ({', '.join(names)})" if names
                                       else "")))
    try:
        model = _model_from(args)
        config = _config_from(args)
        engine = _engine_from(args, simulated)
    except ValueError as exc:
        if args.traceback:
            traceback.print_exc()
        print(f"attnreg compat: error: {exc}", file=sys.stderr)
        return Outcome(2)
    features = ServerFeatures(**{name: bool(getattr(args, f"feature_{name}", False))
                                 for name in FEATURE_HELP
                                 if name != "speculative_decoding"},
                              speculative_decoding=args.speculative_decoding is not None)
    backends = BackendChoice(prefill=args.prefill_backend or args.backend,
                             decode=args.decode_backend or args.backend)
    # A GPU name (--platform h200) also says how much memory the device has.
    target: Platform | str = args.platform if simulated and known_device(args.platform) \
        else platform
    try:
        plan = resolve(target, model, backends, config, features, engine,
                       registry=registry_from(args), assume_installed=simulated,
                       decode_profile=getattr(args, "decode_profile", None))
    except GraphPolicyError as exc:
        if args.traceback:
            traceback.print_exc()
        print("attnreg compat: the requested graph configuration cannot run:", file=sys.stderr)
        for reason in exc.reasons:
            print(f"  - {reason}", file=sys.stderr)
        print(exc.hint, file=sys.stderr)
        return Outcome(2, {"error": "graph_policy", "platform": str(platform),
                           "reasons": exc.reasons, "hint": exc.hint})
    except AttnregError as exc:  # an unknown backend name: one line, did-you-mean included
        if args.traceback:
            traceback.print_exc()
        print(f"attnreg compat: error: {exc}", file=sys.stderr)
        return Outcome(2)
    cross = crossover(plan, args.cost_profile)
    data: dict[str, Any] = plan.to_dict()
    data["phases"]["prefill"]["crossover"] = cross
    data["simulated"] = simulated
    data["assume_installed"] = simulated
    how = "simulated, optional libraries assumed installed" if simulated else "detected"
    locked = ", ".join(sorted(config.locked)) or "nothing"
    width = width_of(args)
    text = render(plan, f"graph plan for {model.label} ({model.attention}, {model.kv_dtype} KV, "
                        f"{model.num_heads} heads) on {platform} ({how}); locked: {locked}",
                  width) + render_crossover(cross, width)
    return Outcome(0, data, text)


def run(args: argparse.Namespace) -> int:
    outcome = plan_outcome(args)
    if outcome.data is not None:
        emit_json(args, outcome.data)
    if outcome.text and not args.json:
        print(outcome.text)
    return outcome.status


__all__ = ["Outcome", "add_arguments", "crossover", "parse_size", "plan_outcome", "render",
           "render_crossover", "run"]
