"""Run sglang's real argument resolution on this CPU machine, as sglang's tests do.

* :func:`prepare_imports`: declares the two torchvision op schemas that the
  PyPI torchvision wheel (linked against CUDA torch) needs beside a CPU torch,
  then imports every ``sglang.srt.arg_groups`` module and ``model_config``
  while the platform is still the real one (``fp8_utils`` fails at import
  under a simulated GPU);
* :func:`simulated_gpu`: sglang's ``override_platform`` plus the two probes
  its defaults read directly (``sglang.srt.utils.is_cuda``,
  ``torch.cuda.get_device_capability``);
* :data:`SCENARIOS` and :func:`run_scenario`: the seed scenarios on real
  ``ServerArgs`` objects through ``resolve_once()``.

Run as a script (``python _sglang_env.py MODEL_ROOT``) it prints every
scenario's outcome as JSON: the test compares sglang's own rules (a fresh
process with the plugin off) with the plugin on.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

_PREPARED = False


def prepare_imports() -> None:
    """Make ``import sglang`` work with a CPU torch, and import what a GPU simulation breaks."""
    global _PREPARED
    if _PREPARED:
        return
    import torch

    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        globals()["_TORCHVISION_LIB"] = lib  # the schemas live as long as the library object
    except RuntimeError:
        pass  # a torchvision built for this torch already defines them
    import sglang.srt.arg_groups as arg_groups
    import sglang.srt.configs.model_config  # noqa: F401

    for module in pkgutil.iter_modules(arg_groups.__path__):
        importlib.import_module(f"sglang.srt.arg_groups.{module.name}")
    _PREPARED = True


@contextlib.contextmanager
def simulated_gpu(sm: int) -> Iterator[None]:
    """Make sglang see one CUDA GPU of compute capability ``sm`` (90, 100, ...)."""
    from sglang.srt.runtime_context import override_platform

    major, minor = divmod(sm, 10)
    facts = dict(is_cuda=True, is_hip=False, device_sm=sm, device_capability=(major, minor),
                 is_sm90=sm == 90, is_hopper_with_cuda_12_3=sm == 90,
                 is_sm100=sm in (100, 103), is_sm100_or_sm110=sm in (100, 103, 110),
                 is_blackwell=sm >= 100, has_flashinfer=True)
    with override_platform(**facts), \
            mock.patch("sglang.srt.utils.is_cuda", return_value=True), \
            mock.patch("torch.cuda.get_device_capability", return_value=(major, minor)):
        yield


_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rms_norm_eps": 1e-06, "vocab_size": 129280, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "hidden_act": "silu", "num_nextn_predict_layers": 1, "initializer_range": 0.02,
}

#: A Kimi-K2.6-like checkpoint: sglang's KimiK25 architecture (multimodal,
#: validated under breakable and piecewise prefill) around a DeepSeek-V3 text model.
_KIMI_TEXT = {**_DEEPSEEK_V3, "num_attention_heads": 64, "num_key_value_heads": 64,
              "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1,
              "topk_group": 1, "vocab_size": 163840, "max_position_embeddings": 262144,
              "rope_scaling": {**_DEEPSEEK_V3["rope_scaling"],  # type: ignore[dict-item]
                               "factor": 64}}
_KIMI_K26 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
             "text_config": _KIMI_TEXT,
             "vision_config": {"hidden_size": 1152, "num_attention_heads": 16},
             "media_placeholder_token_id": 163605, "torch_dtype": "bfloat16"}

MODELS: dict[str, dict[str, Any]] = {"deepseek-v3": _DEEPSEEK_V3, "kimi-k2.6": _KIMI_K26}


def write_models(root: Path) -> dict[str, Path]:
    """One directory with a config.json per model (no weights: resolution reads the config)."""
    out = {}
    for name, config in MODELS.items():
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        out[name] = path
    return out


@contextlib.contextmanager
def simulated_rocm(arch_version: int, kfd_root: Path) -> Iterator[None]:
    """Make sglang see one AMD GPU (HIP), whose KFD topology under ``kfd_root`` reports
    ``gfx_target_version`` ``arch_version`` (90402 = gfx942) beside a CPU node.

    sglang's platform has no arch fact for HIP; the bridge reads the topology.
    """
    from sglang.srt.runtime_context import override_platform

    from attnreg.integrations.sglang import facts as bridge_facts

    for node, version in (("0", 0), ("1", arch_version)):
        if node == "1" and not arch_version:
            continue  # a topology with no GPU node: the arch cannot be read
        (kfd_root / node).mkdir(parents=True, exist_ok=True)
        (kfd_root / node / "properties").write_text(
            f"simd_count 304\ngfx_target_version {version}\n")
    facts = dict(is_cuda=False, is_hip=True, device_sm=0, device_capability=(9, 4),
                 is_sm90=False, is_hopper_with_cuda_12_3=False, is_sm100=False,
                 is_sm100_or_sm110=False, is_blackwell=False, has_flashinfer=False)
    with override_platform(**facts), \
            mock.patch("sglang.srt.utils.is_cuda", return_value=False), \
            mock.patch("sglang.srt.utils.is_hip", return_value=True), \
            mock.patch.object(bridge_facts, "KFD_NODES", kfd_root):
        yield


@dataclass(frozen=True)
class Scenario:
    """One server: a model, a simulated GPU and the sglang arguments a user passes.

    ``sm`` is a CUDA compute capability; ``rocm`` (a KFD ``gfx_target_version``,
    90402 = gfx942; 0 for a topology without a GPU node) makes it an AMD GPU instead.
    """

    name: str
    model: str
    sm: int
    args: dict[str, Any] = field(default_factory=dict)
    rocm: int | None = None


SCENARIOS: tuple[Scenario, ...] = (
    # Seed 000/002 on Blackwell: sglang picks trtllm_mla for DeepSeek-V3.
    Scenario("dsv3_trtllm_bf16_b200", "deepseek-v3", 100),
    Scenario("dsv3_trtllm_fp8_b200", "deepseek-v3", 100, {"kv_cache_dtype": "fp8_e4m3"}),
    # Seed 002: Kimi-K2.6 (multimodal, piecewise-validated) with an FP8 pool.
    Scenario("kimi_trtllm_fp8_b200", "kimi-k2.6", 100, {"kv_cache_dtype": "fp8_e4m3"}),
    Scenario("kimi_trtllm_bf16_b200", "kimi-k2.6", 100),
    # An explicit prefill graph beats soft rules (seed 002's first layer).
    Scenario("dsv3_trtllm_fp8_locked_breakable", "deepseek-v3", 100,
             {"kv_cache_dtype": "fp8_e4m3", "cuda_graph_backend_prefill": "breakable"}),
    # A lock on a mode this sglang does not have (removed in 0.5.22).
    Scenario("dsv3_locked_tc_piecewise", "deepseek-v3", 100,
             {"cuda_graph_backend_prefill": "tc_piecewise"}),
    # Hopper: sglang's default MLA backend is fa3, which attnreg does not declare.
    Scenario("dsv3_fa3_h200", "deepseek-v3", 90),
    # Hopper with backends attnreg declares: the breakable prefix rule by backend.
    Scenario("dsv3_triton_h200", "deepseek-v3", 90, {"attention_backend": "triton"}),
    Scenario("dsv3_flashinfer_h200", "deepseek-v3", 90, {"attention_backend": "flashinfer"}),
    # A mapped backend whose attnreg declaration cannot serve a phase here
    # (flash_attn_cute has no sm90 decode kernel): sglang's rules decide.
    Scenario("dsv3_fa4_h200", "deepseek-v3", 90, {"attention_backend": "fa4"}),
    # A feature sglang and attnreg both rule on: pipeline parallelism.
    Scenario("dsv3_triton_h200_pp2", "deepseek-v3", 90,
             {"attention_backend": "triton", "pp_size": 2}),
    # Speculative decoding (MTP, 4 draft tokens): the plan says how verify batches run.
    Scenario("dsv3_triton_h200_mtp4", "deepseek-v3", 90,
             {"attention_backend": "triton", "speculative_algorithm": "NEXTN",
              "speculative_num_steps": 3, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 4}),
    # An sglang rule attnreg has no fact for (which MoE transports were validated).
    Scenario("dsv3_triton_h200_a2a_mooncake", "deepseek-v3", 90,
             {"attention_backend": "triton", "moe_a2a_backend": "mooncake"}),
    # Split backends with a per-phase gap: cutlass_mla has no attnreg declaration.
    Scenario("dsv3_trtllm_prefill_cutlass_decode_b200", "deepseek-v3", 100,
             {"prefill_attention_backend": "trtllm_mla",
              "decode_attention_backend": "cutlass_mla"}),
    # ROCm (MI300X): attnreg's reference is the one declaration that covers rocm.
    # Not compared with sglang's own run: without the plugin attnreg_reference is
    # not one of sglang's backends.
    Scenario("dsv3_reference_mi300x", "deepseek-v3", 0,
             {"attention_backend": "attnreg_reference"}, rocm=90402),
)

SCENARIO_BY_NAME = {s.name: s for s in SCENARIOS}


def run_scenario(scenario: Scenario, models: dict[str, Path],
                 kfd_root: Path | None = None) -> dict[str, Any]:
    """Resolve the scenario's ``ServerArgs``; the outcome as plain data.

    ``{"prefill": mode, "decode": mode, "backends": [...], "sources": [...]}``
    or ``{"error": type, "message": text}`` when startup refuses it.  A ROCm
    scenario needs ``kfd_root``, a directory for its simulated KFD topology.
    """
    prepare_imports()
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view
    from sglang.srt.server_args import ServerArgs

    if scenario.rocm is not None:
        if kfd_root is None:
            raise ValueError(f"{scenario.name} is a ROCm scenario: pass kfd_root")
        platform = simulated_rocm(scenario.rocm, kfd_root)
    else:
        platform = simulated_gpu(scenario.sm)
    with platform:
        try:
            server_args = ServerArgs(model_path=str(models[scenario.model]), device="cuda",
                                     **scenario.args)
            server_args.resolve_once()
        except Exception as exc:  # startup refusing the configuration is an outcome
            return {"error": type(exc).__name__, "message": str(exc)}
        view = resolved_view(server_args)
        cg = view.cuda_graph_config
        graph_sources = [source for source, fields in server_args._resolved_overrides
                         if "cuda_graph_config" in fields]
        return {"prefill": cg.prefill.backend, "decode": cg.decode.backend,
                "backends": list(attention_backends_of(view)), "page_size": view.page_size,
                "sources": graph_sources, "server_args": server_args}


def _main(root: str) -> None:
    os.environ.pop("ATTNREG_SGLANG", None)
    prepare_imports()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the attnreg plugin is installed but off: sglang's own rules
    models = write_models(Path(root))
    out = {}
    for scenario in SCENARIOS:
        if scenario.rocm is not None:
            continue  # its backend exists only with the plugin on
        result = run_scenario(scenario, models)
        result.pop("server_args", None)
        out[scenario.name] = result
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    _main(sys.argv[1])
