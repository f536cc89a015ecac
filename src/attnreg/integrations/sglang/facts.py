"""Read a resolving sglang ``ServerArgs`` into the facts attnreg's policy reads.

Everything comes from sglang's own accessors at resolution time: the
platform from ``get_platform()`` (so sglang's platform overrides apply),
the model from ``model_config_of()``, the attention backends from
``attention_backends_of(resolved_view(...))``, the graph config and its
locked keys from ``cuda_graph_config`` and ``_cuda_graph_config_locked``,
and the graph modes the host accepts from ``ALLOWED_BACKENDS_PER_PHASE``.

A fact attnreg cannot represent (a non-MLA model, a KV dtype attnreg does
not declare, a decode mode attnreg does not model) is not guessed: it is
named in :attr:`SglangFacts.gaps` and the bridge leaves the decision to
sglang's own rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang.srt.arg_groups.overrides import (
    attention_backends_of,
    model_config_of,
    resolved_view,
    resolving_view,
)
from sglang.srt.model_executor.cuda_graph_config import ALLOWED_BACKENDS_PER_PHASE
from sglang.srt.runtime_context import get_platform

from attnreg.graph_policy import (
    AttentionKind,
    EngineFacts,
    GraphConfig,
    ModelFacts,
    ServerFeatures,
)
from attnreg.registry import AttnregError, BackendRegistry, get_registry
from attnreg.registry.capabilities import (
    VALID_GRAPH_MODES,
    Capabilities,
    DType,
    GraphMode,
    Phase,
)
from attnreg.registry.platform import Platform, Vendor

from .names import (
    BackendMapping,
    DeclarationLookup,
    graph_mode_from_sglang,
    kv_dtype_from_sglang,
    map_phase,
)

__all__ = [
    "SglangFacts",
    "bridge_registry",
    "declaration_lookup",
    "host_modes",
    "read_facts",
    "read_platform",
    "rocm_arch",
]

_PHASES = (Phase.PREFILL, Phase.DECODE)


@dataclass(frozen=True)
class SglangFacts:
    """What attnreg knows about one sglang server at the attention-backend step.

    ``model`` and ``config`` are None when a gap prevents them; ``gaps`` says
    why, one line each.  ``engine`` is attnreg's :class:`EngineFacts` (page
    size, context, running requests, draft tokens, the host's graph modes);
    ``host_modes`` is every mode sglang accepts per phase, attnreg's or not.
    ``sglang_modes`` is each phase's mode as sglang's resolution holds it
    now; ``locked`` the phases whose mode the user set.
    """

    platform: Platform
    backends: dict[Phase, BackendMapping]
    model: ModelFacts | None
    config: GraphConfig | None
    features: ServerFeatures
    engine: EngineFacts
    host_modes: dict[Phase, frozenset[GraphMode]]
    sglang_modes: dict[Phase, GraphMode]
    locked: frozenset[Phase]
    backends_by_user: frozenset[Phase] = frozenset()
    architecture: str = ""
    #: Phases whose ``--dsa-<phase>-backend`` the user named (sglang's raw input).
    dsa_backends_by_user: frozenset[Phase] = frozenset()
    gaps: tuple[str, ...] = field(default=())
    phase_gaps: dict[Phase, tuple[str, ...]] = field(default_factory=dict)

    @property
    def decidable(self) -> bool:
        """True when attnreg can decide at least one phase (no server-wide gap, and
        not every phase has a gap of its own)."""
        return not self.gaps and any(not self.phase_gaps.get(p) for p in _PHASES)

    @property
    def decidable_phases(self) -> frozenset[Phase]:
        """The phases attnreg can decide (the others go to sglang's rules alone)."""
        if self.gaps:
            return frozenset()
        return frozenset(p for p in _PHASES if not self.phase_gaps.get(p))

    @property
    def all_gaps(self) -> tuple[str, ...]:
        """Every gap, the server's first, then each phase's."""
        return self.gaps + tuple(g for p in _PHASES for g in self.phase_gaps.get(p, ()))


#: The kernel driver's topology (amdgpu/KFD): one directory per node, whose
#: ``properties`` list ``gfx_target_version`` (90402 = gfx942).  Read without
#: touching the HIP runtime, as sglang reads the CUDA sm through NVML before
#: CUDA is initialised (``utils.common.get_device_sm``).
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


def _gfx_from_target_version(version: int) -> str:
    """``90402`` -> ``gfx942``, ``90010`` -> ``gfx90a`` (major, minor, stepping in hex)."""
    major, rest = divmod(version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


def rocm_arch() -> str:
    """The first AMD GPU's architecture (``gfx942``), or "" when it cannot be read.

    sglang's platform has no arch fact for HIP (its kernels read
    ``torch.cuda.get_device_properties(0).gcnArchName``).  This reads torch's
    name when torch already initialised the device, else the KFD topology
    (:data:`KFD_NODES`), so resolution never initialises HIP in the launcher.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "hip", None) \
            and torch.cuda.is_initialized():
        return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0].lower()
    try:
        nodes = sorted(KFD_NODES.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0)
    except OSError:
        return ""
    for node in nodes:
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and value.strip().isdigit() and int(value) > 0:
                return _gfx_from_target_version(int(value))  # CPU nodes report 0
    return ""


def read_platform() -> Platform:
    """The platform as sglang sees it now (``get_platform()``, overrides included);
    on ROCm with the arch from :func:`rocm_arch`."""
    plat = get_platform()
    if plat.is_cuda:
        sm = int(plat.device_sm or 0)
        return Platform(Vendor.CUDA, f"sm{sm}" if sm else "")
    if plat.is_hip:
        return Platform(Vendor.ROCM, rocm_arch())
    if plat.is_npu:
        return Platform(Vendor.NPU)
    if plat.is_xpu:
        return Platform(Vendor.XPU)
    return Platform(Vendor.CPU)


def bridge_registry() -> BackendRegistry:
    """The attnreg registry the bridge maps sglang's backends with and plans with: the
    process-wide one (built-ins and every ``attnreg.backends`` entry point, so the
    ``flashmla`` mapping needs the attnreg-flashmla plugin installed)."""
    return get_registry()


def declaration_lookup(platform: Platform,
                       registry: BackendRegistry | None = None) -> DeclarationLookup:
    """attnreg declarations on ``platform`` by name, for :func:`.names.map_phase`: the
    declaration, or why there is none (not registered, its plugin failed)."""
    reg = registry if registry is not None else bridge_registry()
    cache: dict[str, Capabilities | str] = {}

    def lookup(name: str) -> Capabilities | str:
        if name not in cache:
            if name not in reg.specs:
                err = next((e for e in reg.errors if e.backend == name), None)
                cache[name] = (f"its plugin failed to load ({err})" if err is not None else
                               f"no attnreg backend {name!r} is registered")
            else:
                try:
                    cache[name] = reg.declaration(name, platform)
                except AttnregError as exc:
                    cache[name] = f"its declaration on {platform} failed ({exc})"
        return cache[name]

    return lookup


def host_modes() -> dict[Phase, frozenset[GraphMode]]:
    """The graph modes this sglang accepts per phase (``ALLOWED_BACKENDS_PER_PHASE``).

    sglang 0.5.23 lists full/breakable/disabled for both phases (tc_piecewise
    was removed in 0.5.22); a release that lists tc_piecewise gets it here.
    """
    out: dict[Phase, frozenset[GraphMode]] = {}
    for phase in _PHASES:
        allowed = ALLOWED_BACKENDS_PER_PHASE.get(phase.value, ())
        out[phase] = frozenset(graph_mode_from_sglang(b) for b in allowed)
    return out


def _dtype_of(torch_dtype: Any) -> DType | None:
    name = str(torch_dtype).replace("torch.", "")
    return {"bfloat16": DType.BF16, "float16": DType.FP16, "float32": DType.FP32}.get(name)


def _attention_tp_size(cfg: Any) -> int:
    tp = int(cfg.tp_size or 1)
    if cfg.enable_dp_attention and cfg.dp_size:
        return max(1, tp // int(cfg.dp_size))
    return tp


def _index_topk(hf_config: Any) -> int | None:
    """The DSA indexer's top-k (``index_topk`` of the checkpoint's config), or None."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        value = getattr(cfg, "index_topk", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _read_model(server_args: Any, cfg: Any, gaps: list[str]) -> tuple[ModelFacts | None, str]:
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa

    mc = model_config_of(server_args)
    arch = (mc.hf_config.architectures or ["?"])[0]
    if mc.attention_arch != AttentionArch.MLA:
        gaps.append(f"{arch} is not an MLA model (attention_arch={mc.attention_arch}); "
                    "attnreg declares MLA attention backends only")
        return None, arch
    act = _dtype_of(mc.dtype)
    if act is None:
        gaps.append(f"model dtype {mc.dtype} is not one attnreg declares")
        return None, arch
    kv = kv_dtype_from_sglang(cfg.kv_cache_dtype, act)
    if kv is None:
        gaps.append(f"--kv-cache-dtype {cfg.kv_cache_dtype}: attnreg declares KV pools of "
                    f"{', '.join(d.value for d in (DType.BF16, DType.FP16, DType.FP8_E4M3))} "
                    "only")
        return None, arch
    facts = ModelFacts(
        attention=AttentionKind.MLA,
        kv_dtype=kv,
        num_heads=mc.get_num_attention_heads(_attention_tp_size(cfg)),
        act_dtype=act,
        dsa_sparse=bool(is_deepseek_dsa(mc.hf_config)),
        # "attention is sparse with top-k K": only declared sparse kernels may serve it
        sparse_top_k=_index_topk(mc.hf_config) if is_deepseek_dsa(mc.hf_config) else None,
        multimodal=bool(mc.is_multimodal),
        # sglang's allowlist of multimodal archs validated under piecewise prefill.
        piecewise_validated=bool(mc.is_multimodal
                                 and getattr(mc, "is_multimodal_piecewise_cuda_graph_supported",
                                             False)),
        label=arch,
    )
    return facts, arch


def _read_features(server_args: Any, cfg: Any) -> ServerFeatures:
    from sglang.srt.layers.cp.bcg import supports_prefill_cp_bcg

    view = resolved_view(server_args)
    cp = int(view.attn_cp_size or 1) > 1
    return ServerFeatures(
        lora=bool(cfg.enable_lora),
        dp_attention=bool(cfg.enable_dp_attention),
        pipeline_parallel=int(cfg.pp_size or 1) > 1,
        speculative_decoding=cfg.speculative_algorithm is not None,
        torch_compile=bool(cfg.enable_torch_compile),
        # sglang's breakable CP path: CP without it cannot replay its all_gather.
        context_parallel=cp and not supports_prefill_cp_bcg(server_args),
        decode_context_parallel=int(cfg.dcp_size or 1) > 1,
        two_batch_overlap=bool(cfg.enable_two_batch_overlap),
        moe_a2a=str(view.moe_a2a_backend or "none") != "none",
        hierarchical_cache=bool(cfg.enable_hierarchical_cache),
        deterministic_inference=bool(cfg.enable_deterministic_inference),
        pd_disaggregation=str(cfg.disaggregation_mode or "null") != "null",
        symmetric_memory=bool(cfg.enable_symm_mem),
        expert_recorder=(cfg.expert_distribution_recorder_mode is not None
                         or bool(cfg.enable_eplb)),
        memory_saver=bool(cfg.enable_memory_saver),
    )


def _buckets(values: Any) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values})) if values else ()


def _attnreg_modes(phase: Phase, modes: frozenset[GraphMode]) -> frozenset[GraphMode]:
    """The host's modes attnreg has a name for in ``phase`` (sglang's ``full`` prefill
    and ``breakable`` decode have none: a server using them is a gap)."""
    return frozenset(m for m in modes if m is GraphMode.DISABLED or m in VALID_GRAPH_MODES[phase])


def _read_engine(server_args: Any, cfg: Any,
                 host: dict[Phase, frozenset[GraphMode]]) -> EngineFacts:
    """attnreg's engine facts.  Not passed: the KV pool size (sglang sizes the pool
    in the model runner, after resolution) and the device memory (the policy
    then budgets with the smallest known device of the architecture)."""
    mc = model_config_of(server_args)
    context = getattr(mc, "context_len", None)
    return EngineFacts(
        page_size=cfg.page_size,
        max_context_len=int(context) if context else EngineFacts().max_context_len,
        max_running_requests=cfg.max_running_requests,
        num_draft_tokens=int(cfg.speculative_num_draft_tokens or 0)
        if cfg.speculative_algorithm is not None else 0,
        prefill_graph_modes=_attnreg_modes(Phase.PREFILL, host[Phase.PREFILL]),
        decode_graph_modes=_attnreg_modes(Phase.DECODE, host[Phase.DECODE]),
    )


def _read_config(server_args: Any, cfg: Any, modes: dict[Phase, GraphMode],
                 locked: frozenset[Phase], gaps: list[str]) -> GraphConfig | None:
    cg = cfg.cuda_graph_config
    sizes: dict[str, object] = {}
    if cg.decode.bs:
        sizes["decode_batch_sizes"] = _buckets(cg.decode.bs)
    if cg.prefill.bs:
        sizes["prefill_num_tokens"] = _buckets(cg.prefill.bs)
    if cg.prefill.full_prefill_max_req:
        sizes["prefill_max_requests"] = int(cg.prefill.full_prefill_max_req)
    try:
        return GraphConfig(prefill_mode=modes[Phase.PREFILL], decode_mode=modes[Phase.DECODE],
                           locked=frozenset(f"{p.value}_mode" for p in locked),
                           **sizes)  # type: ignore[arg-type]
    except ValueError as exc:  # e.g. a breakable decode graph, which attnreg does not model
        gaps.append(f"sglang's graph config has no attnreg equivalent: {exc}")
        return None


def _backends_by_user(server_args: Any) -> frozenset[Phase]:
    """Phases whose attention backend the user named (sglang's raw input)."""
    raw = getattr(server_args, "_raw_input", None) or {}
    base = raw.get("attention_backend")
    return frozenset(p for p in _PHASES if raw.get(f"{p.value}_attention_backend") or base)


def _dsa_backends_by_user(server_args: Any) -> frozenset[Phase]:
    """Phases whose ``--dsa-<phase>-backend`` the user named (sglang's raw input)."""
    raw = getattr(server_args, "_raw_input", None) or {}
    return frozenset(p for p in _PHASES if raw.get(f"dsa_{p.value}_backend"))


def _map_backends(server_args: Any, platform: Platform,
                  model: ModelFacts | None) -> dict[Phase, BackendMapping]:
    """Each phase's sglang backend mapped to the attnreg declaration that describes it."""
    view = resolved_view(server_args)
    names = dict(zip(_PHASES, attention_backends_of(view)))
    mc = model_config_of(server_args)
    rope = getattr(mc, "qk_rope_head_dim", None)
    lookup = declaration_lookup(platform)
    return {phase: map_phase(
        names[phase], phase,
        dsa_backend=getattr(view, f"dsa_{phase.value}_backend", None),
        kv_dtype=model.kv_dtype if model is not None else None,
        sparse_top_k=model.sparse_top_k if model is not None else None,
        rope_dim=int(rope) if isinstance(rope, int) else 64,
        blackwell=platform.vendor is Vendor.CUDA and (platform.sm or 0) >= 100,
        lookup=lookup) for phase in _PHASES}


def read_facts(server_args: Any) -> SglangFacts:
    """Everything attnreg's policy needs, read from a resolving ``ServerArgs``.

    Call it at or after sglang's attention-backend step (the backends are
    None before it).
    """
    cfg = resolving_view(server_args)
    gaps: list[str] = []
    platform = read_platform()
    if platform.arch_missing:
        gaps.append(f"sglang reports {platform} but its architecture could not be read "
                    "(neither torch nor the KFD topology named one)")
    model, arch = _read_model(server_args, cfg, gaps)
    backends = _map_backends(server_args, platform, model)
    # A backend without a declaration is that phase's gap only: the other phase
    # stays attnreg's.
    phase_gaps = {phase: (f"{phase} attention backend {mapping.label}: {mapping.reason}",)
                  for phase, mapping in backends.items() if not mapping.mapped}
    cg = cfg.cuda_graph_config
    modes = {p: graph_mode_from_sglang(getattr(cg, p.value).backend) for p in _PHASES}
    sglang_locked: set[tuple[str, str]] = getattr(server_args, "_cuda_graph_config_locked", set())
    locked = frozenset(p for p in _PHASES if (p.value, "backend") in sglang_locked)
    host = host_modes()
    config = _read_config(server_args, cfg, modes, locked, gaps)
    return SglangFacts(
        platform=platform,
        backends=backends,
        model=model,
        config=config,
        features=_read_features(server_args, cfg),
        engine=_read_engine(server_args, cfg, host),
        host_modes=host,
        sglang_modes=modes,
        locked=locked,
        backends_by_user=_backends_by_user(server_args),
        dsa_backends_by_user=_dsa_backends_by_user(server_args),
        architecture=arch,
        gaps=tuple(gaps),
        phase_gaps=phase_gaps,
    )
