"""With the plugin installed, `attnreg backends` and `attnreg compat` see FlashMLA and plan with it.

Simulated platforms (``--platform cuda:sm90``) assume optional libraries are
installed, so these run on a CPU machine without ``sgl-flash-mla``.
"""

from __future__ import annotations

import json

import pytest
from attnreg.registry import DType, ForwardMethod, Phase

from attnreg_flashmla.declaration import BACKEND_NAME, HEAD_COUNTS


def _json(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _supports(cli, option: str) -> bool:
    """Whether this attnreg's `compat` takes ``option`` (engine facts are arriving in the policy)."""
    return option in cli("compat", "--help").stdout


def test_backends_lists_it_with_its_plugin_on_sm90(cli):
    data = _json(cli("backends", "--platform", "cuda:sm90", "--json"))
    (entry,) = [b for b in data["backends"] if b["name"] == BACKEND_NAME]
    assert (entry["plugin"], entry["distribution"]) == ("flashmla", "attnreg-flashmla")
    assert entry["available"] is True
    bf16, fp8, fp8_q = entry["capabilities"]["kernels"]
    assert bf16["page_sizes"] == [64] and bf16["head_counts"] == list(HEAD_COUNTS)
    assert (fp8["kv_dtypes"], fp8["q_compute_dtype"]) == (["fp8_e4m3"], "fp8_e4m3")
    assert (fp8_q["q_dtypes"], fp8_q["q_compute_dtype"]) == (["fp8_e4m3"], None)
    assert not data["errors"]


def test_backends_says_why_not_on_blackwell(cli):
    data = _json(cli("backends", "--platform", "cuda:sm100", "--json"))
    (entry,) = [b for b in data["backends"] if b["name"] == BACKEND_NAME]
    assert entry["available"] is False
    assert "legacy sm90 kernels" in entry["unavailable_reason"]


def test_compat_plans_full_decode_with_host_planned_split_kv(cli):
    args = ["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
            "--decode-backend", BACKEND_NAME, "--prefill-backend", "flashinfer_mla", "--json"]
    if _supports(cli, "--page-size"):
        args += ["--page-size", "64"]
    decode = _json(cli(*args))["phases"]["decode"]
    assert (decode["backend"], decode["mode"]) == (BACKEND_NAME, "full")
    assert decode["pinned_method"] == ForwardMethod.MLA.value
    assert decode["split_kv"] == "host_planned"
    assert decode["capture_memory_bytes"] > 0


def test_compat_default_decode_on_sm90_is_flashmla_for_a_model_it_serves(cli):
    args = ["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3", "--json"]
    if _supports(cli, "--page-size"):
        args += ["--page-size", "64"]
    data = _json(cli(*args))
    assert data["phases"]["decode"]["backend"] == BACKEND_NAME
    # it serves no prefill: another backend is chosen there
    assert data["phases"]["prefill"]["backend"] != BACKEND_NAME


def test_compat_skips_it_for_a_head_count_it_was_not_run_with(cli):
    assert 24 not in HEAD_COUNTS
    args = ["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3", "--num-heads", "24"]
    data = _json(cli(*args, "--json"))
    assert data["phases"]["decode"]["backend"] != BACKEND_NAME
    locked = cli(*args, "--decode-backend", BACKEND_NAME)
    assert locked.returncode == 2
    assert "24 heads not in" in locked.stderr


def test_compat_refuses_it_for_prefill_with_the_reason(cli):
    proc = cli("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
               "--backend", BACKEND_NAME)
    assert proc.returncode == 2
    assert f"{BACKEND_NAME} has no prefill kernel on cuda:sm90" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compat_refuses_it_on_blackwell(cli):
    proc = cli("compat", "--platform", "cuda:sm100", "--model", "deepseek-v3",
               "--decode-backend", BACKEND_NAME)
    assert proc.returncode == 2
    assert "legacy sm90 kernels" in proc.stderr


def test_compat_with_an_fp8_pool_follows_the_declaration(registry, cli):
    caps = registry.declaration(BACKEND_NAME, "cuda:sm90")
    fp8 = any(DType.FP8_E4M3 in k.kv_dtypes for k in caps.kernels_for("mla", Phase.DECODE))
    proc = cli("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
               "--kv-dtype", "fp8_e4m3", "--decode-backend", BACKEND_NAME,
               "--prefill-backend", "triton")
    if fp8:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2
        assert "kv dtype fp8_e4m3 not in" in proc.stderr


@pytest.mark.parametrize("page_size,chosen", [(64, True), (1, False), (16, False)])
def test_selection_follows_the_engine_page_size(cli, page_size, chosen):
    if not _supports(cli, "--page-size"):
        pytest.skip("this attnreg's policy takes no page size yet (issue 18 adds --page-size)")
    data = _json(cli("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
                     "--page-size", str(page_size), "--json"))
    assert (data["phases"]["decode"]["backend"] == BACKEND_NAME) is chosen
    if not chosen:
        locked = cli("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
                     "--page-size", str(page_size), "--decode-backend", BACKEND_NAME)
        assert locked.returncode == 2
        assert f"page size {page_size} not in [64]" in locked.stderr


def test_with_speculative_decoding_verify_replays_its_decode_graphs_and_draft_extend_is_unserved(
        cli):
    if not _supports(cli, "--speculative-decoding"):
        pytest.skip("this attnreg's policy takes no --speculative-decoding")
    data = _json(cli("compat", "--platform", "cuda:sm90", "--model", "deepseek-v3",
                     "--page-size", "64", "--speculative-decoding", "4", "--json"))
    assert data["phases"]["decode"]["backend"] == BACKEND_NAME
    spec = {s["forward_mode"]: s for s in data["speculative"]}
    assert (spec["target_verify"]["how"], spec["target_verify"]["backend"]) \
        == ("graph", BACKEND_NAME)
    assert spec["target_verify"]["query_len"] == 4
    # ragged accepted lengths: the engine runs draft-extend batches on another backend
    assert spec["draft_extend"]["how"] == "unserved"
    assert "does not declare draft_extend" in spec["draft_extend"]["message"]
