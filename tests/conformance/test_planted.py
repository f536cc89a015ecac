"""The suite catches each planted defect (tests/conformance/planted), with a message that
points at the cause, and refutes nothing else of those backends.

One ``attnreg conformance`` run checks every cpu-visible defect at once (capture-mode
code paths and index-dtype refusals; eager claims are covered by the triton run);
the GPU-only ones (a buffer freed during real capture, split plans frozen at capture)
run on a CUDA device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

P = "bf16-bf16/p16/h2/576x512"
CPU_DEFECTS: dict[str, dict[str, str]] = {
    # (a) absorbed tensors reach a ragged MHA kernel under capture
    "planted_ragged_absorbed": {
        f"capture/prefill/breakable/capture_path/mla/{P}":
            "trtllm ragged attention: unsupported head dims q/k 576/576, v 512",
        f"capture/prefill/breakable/pinning/mla/{P}": "an assertion fired inside the backend",
        f"capture/prefill/breakable/capture_memory/mla/{P}": "unsupported head dims",
        f"capture/prefill/breakable/padded_rows/mla/{P}": "unsupported head dims",
        f"capture/prefill/tc_piecewise/capture_path/mla/{P}":
            "unsupported head dims q/k 576/576",
    },
    # (b) split-KV declared under capture, the kernel asserts on splits > 1
    "planted_split_assert": {
        f"capture/prefill/breakable/capture_path/mla/{P}":
            "no split-KV variant (num_splits=3)",
        f"capture/prefill/breakable/capture_memory/mla/{P}": "no split-KV variant",
        f"capture/prefill/breakable/padded_rows/mla/{P}": "no split-KV variant",
        f"capture/prefill/tc_piecewise/capture_path/mla/{P}": "no split-KV variant",
    },
    # (c) inputs freed under capture by a dispose guarded for tc_piecewise only: every
    # claim that runs the capture-mode path catches it
    "planted_dispose_inputs": {
        f"capture/{where}/{check}/mla/{P}": "released the storage of latent_new"
        for where in ("decode/full", "prefill/breakable")
        for check in ("capture_path", "capture_memory", "padded_rows")
    } | {
        f"capture/prefill/breakable/capture_path/mla/{P}": "seed 000 defect 3",
        f"capture/prefill/breakable/pinning/mla/{P}": "released the storage of latent_new",
        # triton's sparse decode (declared on cpu): the freed latent_new reaches the
        # session's next load of the static inputs (its size is now 0)
        f"capture/decode/full/sparse_replay/mla/{P}": "The size of tensor a (0)",
    },
    # (d) split plan frozen at capture: caught on cpu too, in the capture-mode path
    "planted_frozen_splits": {
        f"capture/decode/full/capture_path/mla/{P}": "long_kv (bs=2, seq_lens=[1101, 41]): "
                                                     "output differs from the float64 oracle",
        f"capture/decode/full/padded_rows/mla/{P}": "output differs from the float64 oracle",
    },
    # (e) int64 lengths accepted and read as int32
    "planted_int64_lengths": {
        "refusal/decode/mla/index_dtype/int64":
            "int64 seq_lens (outside the declaration) was accepted without UnsupportedError "
            "and its output is wrong",
        "refusal/prefill/mha/index_dtype/int64": "was accepted without UnsupportedError",
        "refusal/prefill/mha_chunked_kv/index_dtype/int64":
            "was accepted without UnsupportedError",
    },
    # (f) MLA pinned under breakable, MHA companion runs anyway
    "planted_pin_mismatch": {
        f"capture/prefill/breakable/pinning/mla/{P}":
            "declares mla pinned, but forward_extend(method=mha) ran under "
            "capturing(breakable)",
    },
    # (g) capture memory off the declaration, padding rows not zeroed
    "planted_memory_overdeclared": {
        f"capture/decode/full/capture_memory/mla/{P}": "less than declared",
    },
    "planted_memory_undeclared": {
        f"capture/decode/full/capture_memory/mla/{P}": "8.06 MiB",
        f"capture/prefill/breakable/capture_memory/mla/{P}": "more than declared",
    },
    "planted_padding_rows": {
        f"capture/prefill/breakable/padded_rows/mla/{P}": "padding output rows are not zero",
    },
}
MODULES = ("ragged_absorbed", "split_assert", "dispose", "frozen_splits", "int64_lengths",
           "pin_mismatch", "capture_declared")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planted")
    # capture-mode paths and index-dtype refusals at the default softmax scale; the MHA
    # piecewise path has no defect, and the engine-contract claims (speculative,
    # multi-layer), the configured-scale ones and the large-query ones
    # (test_planted_fp8_q.py) have their own runs
    args = ["--device", "cpu", "-k", "((capture and not /mha/) or index_dtype) and not "
                                     "target_verify and not draft_extend and not multi_layer "
                                     "and not sm_scale and not fp8_large_q"]
    for module in MODULES:
        args += ["--plugin", f"planted.{module}"]
    for name in CPU_DEFECTS:
        args += ["--backend", name]
    return conformance(tmp, *args)


def test_the_run_fails_because_claims_are_refuted(cpu_run):
    code, out, data = cpu_run
    assert code == 1, out
    assert data is not None and data["summary"]["refuted"] > 0
    assert "REFUTED:" in out


@pytest.mark.parametrize("backend", sorted(CPU_DEFECTS))
def test_each_cpu_defect_is_refuted_where_it_is_and_nowhere_else(cpu_run, backend):
    _, out, data = cpu_run
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()
               if cid.startswith(backend + "/")}
    expected = CPU_DEFECTS[backend]
    assert set(refuted) == set(expected), out
    for cid, needle in expected.items():
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"
    verified = [c for c in by_status(data, "verified") if c.startswith(backend + "/")]
    assert verified, "a planted backend must still verify its unbroken claims"


# (g') capture defects that only a claim beyond the base configuration or the plain replay
# list sees: name -> (extra args, -k, the one refuted claim, a needle of its message, claims
# that must verify), ids without the backend's name
_D = "capture/decode/full"
NARROW_DEFECTS: dict[str, tuple[tuple[str, ...], str, str, tuple[str, ...], tuple[str, ...]]] = {
    # relies on its kernel writing zero padding rows, which its wide-head tiling does not:
    # only the padding claim at the widest claimed count (cuda, or --exhaustive) sees it
    "planted_padding_rows_wide": (
        ("--exhaustive",), f"{_D}/padded_rows/mla/bf16-bf16/p16",
        f"{_D}/padded_rows/mla/bf16-bf16/p16/h128/576x512",
        ("padding output rows are not zero",), (f"{_D}/padded_rows/mla/{P}",)),
    # its decode graph's own page table is refreshed in 16-token pages: right at 16 and 64,
    # only the claim at page 1 (cuda, or --exhaustive) sees it
    "planted_page_table_p16": (
        ("--exhaustive",), f"{_D}/padded_rows/mla/bf16-bf16 and /h2/",
        f"{_D}/padded_rows/mla/bf16-bf16/p1/h2/576x512", ("output differs",),
        tuple(f"{_D}/padded_rows/mla/bf16-bf16/p{page}/h2/576x512" for page in (16, 64))),
    # its replay metadata returns early for a batch with no request: every real replay is
    # right, only the decode graph's idle replay (in padded_rows) sees it
    "planted_idle_replay_skipped": (
        (), f"{_D}/ and (padded_rows or capture_path) and not sm_scale",
        f"{_D}/padded_rows/mla/{P}", ("idle_decode (bs=0", "padding output rows are not zero"),
        (f"{_D}/capture_path/mla/{P}", f"{_D}/target_verify/padded_rows/mla/{P}")),
}


@pytest.mark.parametrize("name", sorted(NARROW_DEFECTS))
def test_a_narrow_capture_defect_is_refuted_by_the_one_claim_that_reaches_it(tmp_path, name):
    extra, select, only, needles, fine = NARROW_DEFECTS[name]
    code, out, data = conformance(
        tmp_path, "--device", "cpu", *extra, "--plugin", "planted.capture_declared",
        "--backend", name, "-k", select)
    assert code == 1 and data is not None, out
    refuted = by_status(data, "refuted")
    assert set(refuted) == {f"{name}/{only}"}, out
    for needle in needles:
        assert needle in refuted[f"{name}/{only}"], refuted
    verified = by_status(data, "verified")
    for cid in fine:
        assert f"{name}/{cid}" in verified, out


# (h)-(j) the engine contract: layer_id ignored, drafts not causal, a base-2 LSE
FP8 = "bf16-fp8_e4m3/p16/h2/576x512"
ENGINE_DEFECTS: dict[str, dict[str, str]] = {
    "planted_layer0": {
        f"eager/decode/mla/multi_layer/{FP8}": "layer 1: single_decode (bs=1, seq_lens=[38]): "
                                               "output differs",
        f"capture/decode/full/multi_layer/mla/{FP8}":
            "new tokens were not written to their out_cache_loc slots of layer 0",
    },
    "planted_verify_noncausal": {
        f"eager/decode/mla/target_verify/{P}": "verify_single (bs=1, seq_lens=[45]): output "
                                               "differs",
        f"capture/decode/full/target_verify/capture_path/mla/{P}":
            "warm-up under capture: verify_ragged",
    },
    "planted_lse_base2": {
        f"eager/decode/mla/lse/{P}": "a base-2 LSE would be",
    },
}


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    args = ["--device", "cpu", "--plugin", "planted.engine",
            "-k", "((decode/full/multi_layer or decode/mla/multi_layer) or "
                  "(target_verify and (eager/ or capture_path)) or decode/mla/lse) and not "
                  "fp8_large_q"]
    for name in ENGINE_DEFECTS:
        args += ["--backend", name]
    return conformance(tmp, *args)


@pytest.mark.parametrize("backend", sorted(ENGINE_DEFECTS))
def test_each_engine_contract_defect_is_refuted_where_it_is_and_nowhere_else(engine_run,
                                                                           backend):
    code, out, data = engine_run
    assert code == 1 and data is not None, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()
               if cid.startswith(backend + "/")}
    expected = ENGINE_DEFECTS[backend]
    assert set(refuted) == set(expected), out
    for cid, needle in expected.items():
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"
    verified = [c for c in by_status(data, "verified") if c.startswith(backend + "/")]
    assert len(verified) >= 2, "the same run verifies the claims the defect does not touch"


# (k)-(l) what the base configuration hides: a hard-coded softmax scale, heads beyond 8
SCALED = "bf16-bf16/p16/h2/576x512/sm_scale0.1352"
SCALED_MHA = "bf16-bf16/p16/h2/192x128/sm_scale0.1352"
DIFFERS = "output differs from the float64 oracle"
CONFIG_DEFECTS: dict[str, dict[str, str]] = {
    # every claim run with MLAConfig.sm_scale set, eager and through the capture path
    "planted_fixed_scale": {
        f"eager/decode/mla/{SCALED}": f"ragged_decode (bs=4, seq_lens=[1, 6, 17, 34]): {DIFFERS}",
        f"eager/prefill/mla/{SCALED}": DIFFERS,
        f"eager/prefill/mha/{SCALED_MHA}": DIFFERS,
        f"eager/prefill/mha_chunked_kv/{SCALED_MHA}": DIFFERS,
        f"capture/decode/full/capture_path/mla/{SCALED}": "warm-up under capture: ragged_decode",
        f"capture/prefill/breakable/capture_path/mla/{SCALED}": DIFFERS,
        f"capture/prefill/tc_piecewise/capture_path/mla/{SCALED}": DIFFERS,
        f"capture/prefill/tc_piecewise/capture_path/mha/{SCALED_MHA}": DIFFERS,
    },
    # the cpu run's 16 and 128 (largest declared) head claims
    "planted_heads_block8": {
        "eager/decode/mla/bf16-bf16/p16/h16/576x512": f"ragged_decode (bs=4, seq_lens=[1, 6, "
                                                      f"17, 34]): {DIFFERS}",
        "eager/decode/mla/bf16-bf16/p16/h128/576x512": DIFFERS,
        "eager/prefill/mla/bf16-bf16/p16/h16/576x512": f"short_extend (bs=2, seq_lens=[8, 2]): "
                                                       f"{DIFFERS}",
        "eager/prefill/mla/bf16-bf16/p16/h128/576x512": DIFFERS,
    },
}


@pytest.fixture(scope="module")
def config_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("config")
    # the claims that vary the scale and the head count, and the base configuration's
    # decode claim as the control both defects pass
    args = ["--device", "cpu", "--plugin", "planted.config_facts",
            # fp8_large_q claims have a scale of their own (they refute a fixed scale too)
            "-k", "(planted_fixed_scale and sm_scale and not fp8_large_q) or "
                  "(planted_heads_block8 and "
                  "eager/ and mla/bf16-bf16/p16/ and not sm_scale) or "
                  "eager/decode/mla/bf16-bf16/p16/h2/576x512"]
    for name in CONFIG_DEFECTS:
        args += ["--backend", name]
    return conformance(tmp, *args)


@pytest.mark.parametrize("backend", sorted(CONFIG_DEFECTS))
def test_a_fixed_scale_and_wrong_heads_beyond_8_are_refuted_on_cpu(config_run, backend):
    code, out, data = config_run
    assert code == 1 and data is not None, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()
               if cid.startswith(backend + "/")}
    expected = CONFIG_DEFECTS[backend]
    assert set(refuted) == set(expected), out
    for cid, needle in expected.items():
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"
    # at the default scale and 2 heads both compute what the oracle computes
    assert f"{backend}/eager/decode/mla/bf16-bf16/p16/h2/576x512" in by_status(data, "verified")


GPU_DEFECTS: dict[str, tuple[str, dict[str, str]]] = {
    # (c) a scratch buffer the graph recorded is freed during real capture
    "planted_dispose_in_graph": ("decode and (allocator_churn or no_sync_alloc)", {
        "capture/decode/full/allocator_churn/mla/bf16-bf16/p16/h16/576x512":
            "tensors allocated after capture",
        "capture/decode/full/no_sync_alloc/mla/bf16-bf16/p16/h16/576x512":
            "bytes that were allocated before capture",
    }),
    # (d) split plan frozen at capture, lengths change at replay
    "planted_frozen_splits": ("decode and (split_kv or replay/mla/bf16-bf16/)", {
        "capture/decode/full/split_kv/mla/bf16-bf16/p16/h16/576x512":
            "output differs from the float64 oracle",
        "capture/decode/full/replay/mla/bf16-bf16/p16/h16/576x512":
            "output differs from the float64 oracle",
    }),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", sorted(GPU_DEFECTS))
def test_gpu_defects_are_refuted_under_real_capture(tmp_path, backend):
    keyword, expected = GPU_DEFECTS[backend]
    module = "dispose" if backend == "planted_dispose_in_graph" else "frozen_splits"
    code, out, data = conformance(tmp_path, "--device", "cuda", "--plugin",
                                  f"planted.{module}", "--backend", backend, "-k", keyword)
    assert code == 1, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()}
    for cid, needle in expected.items():
        assert cid in refuted, (cid, sorted(refuted), out[-3000:])
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"


# (d) the same frozen plan on the wide-page split path only (pages >= 64, a plan that
# splits): of the decode graphs' split-KV and replay claims, exactly the split-KV ones at
# page 64 see it (the bf16 page variant and the fp8 whole-page entry, which capture few
# sequences); the replay claims at page 64 capture 256 sequences, one split, and hold
WIDE_PAGES_REFUTED = {
    f"capture/decode/full/split_kv/mla/{pair}/p64/h16/576x512"
    for pair in ("bf16-bf16", "bf16-fp8_e4m3", "fp16-fp8_e4m3")}


@pytest.mark.gpu
def test_a_split_plan_frozen_on_the_wide_page_path_is_refuted_by_its_split_kv_claims(tmp_path):
    backend = "planted_frozen_splits_wide_pages"
    code, out, data = conformance(tmp_path, "--device", "cuda", "--plugin",
                                  "planted.frozen_splits", "--backend", backend,
                                  "-k", "decode/full and (split_kv or replay/)")
    assert code == 1, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()}
    assert set(refuted) == WIDE_PAGES_REFUTED, (sorted(refuted), out[-3000:])
    for cid, msg in refuted.items():
        assert "output differs from the float64 oracle" in msg, f"{cid}: {msg}"
    verified = by_status(data, "verified")
    for held in ("replay/mla/bf16-bf16/p64/h16", "replay/mla/bf16-fp8_e4m3/p64/h16",
                 "split_kv/mla/bf16-bf16/p16/h16"):
        assert f"{backend}/capture/decode/full/{held}/576x512" in verified, sorted(verified)


# (g) FALLBACK declarations against what served the forward (note_served_by), and
# backends with their own eager break inside attention (cpu: the break is a no-op)
FALLBACK_REFUTED = {
    "planted_fallback_mismatch/capture/prefill/tc_piecewise/fallback_served/mla/"
    f"{P}": "declares FALLBACK to reference, but 6 of 6 forwards under capture were served "
            "by planted_fallback_mismatch",
    "planted_native_but_fallback/capture/prefill/tc_piecewise/capture_path/mla/"
    f"{P}": "is declared NATIVE, but 6 of 6 forwards under capture were served by reference",
}


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    args = ["--device", "cpu", "--plugin", "planted.fallback", "--plugin",
            "planted.eager_segment",
            "-k", "((fallback and tc_piecewise and /mla/ and (capture_path or fallback_served)) "
                  "or (eager_ and breakable and /mla/ and capture_path)) and not sm_scale"]
    for name in ("planted_fallback_mismatch", "planted_native_but_fallback",
                 "planted_fallback_honest", "planted_fallback_silent",
                 "planted_eager_attention", "planted_eager_with_block"):
        args += ["--backend", name]
    return conformance(tmp, *args)


def test_a_fallback_that_did_not_run_is_refuted_and_only_that(served_run):
    code, out, data = served_run
    assert code == 1, out
    refuted = by_status(data, "refuted")
    assert set(refuted) == set(FALLBACK_REFUTED), out
    for cid, needle in FALLBACK_REFUTED.items():
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"


def test_an_honest_fallback_verifies_and_an_unreported_one_is_skipped_with_the_fix(served_run):
    _, out, data = served_run
    verified = by_status(data, "verified")
    assert f"planted_fallback_honest/capture/prefill/tc_piecewise/fallback_served/mla/{P}" \
        in verified, out
    skipped = by_status(data, "skipped")
    msg = skipped[f"planted_fallback_silent/capture/prefill/tc_piecewise/fallback_served/mla/{P}"]
    assert "does not report which implementation" in msg and "note_served_by" in msg


def test_own_eager_breaks_are_no_ops_on_the_cpu_capture_path(served_run):
    _, out, data = served_run
    verified = by_status(data, "verified")
    for name in ("planted_eager_attention", "planted_eager_with_block"):
        assert f"{name}/capture/prefill/breakable/capture_path/mla/{P}" in verified, out


@pytest.mark.gpu
def test_a_replayable_own_eager_break_replays_and_a_with_block_is_skipped(tmp_path):
    code, out, data = conformance(
        tmp_path, "--device", "cuda", "--plugin", "planted.eager_segment",
        "--backend", "planted_eager_attention", "--backend", "planted_eager_with_block",
        "-k", "prefill/breakable and (replay/ or allocator_churn)")
    assert data is not None, out
    assert not by_status(data, "refuted"), out
    verified = by_status(data, "verified")
    assert any(c.startswith("planted_eager_attention/capture/prefill/breakable/replay/")
               for c in verified), out
    skipped = by_status(data, "skipped")
    mine = {c: m for c, m in skipped.items() if c.startswith("planted_eager_with_block/")}
    assert mine and all("as a `with` block" in m for m in mine.values()), out


# (m)-(q) silent corruption: another sequence's prefix, another layer, NaN above four
# sequences, an input changed in place, a forward that never returns
#: The per-claim limit of the run of the defects that return: long enough for the slowest
#: claim (the decode capture path in the interpreter took 12.6 s on the 2-core machine
#: under load, so 10 s timed out honest claims).
INTEGRITY_LIMIT = 30
#: The hang's own run: it has no honest claim but the cheap refusal, so its limit only has
#: to cover a claim's set-up before the forward that never returns (each of its three
#: claims waits out the whole limit: at 30 s that was 90 s of make test).
HANG_LIMIT = 10
INTEGRITY_DEFECTS: dict[str, dict[str, str]] = {
    "planted_prefix_overwrite": {
        f"eager/decode/mla/{P}": "ragged_decode, eager: 1 KV rows the step did not own "
                                 "changed: slot",
        f"eager/decode/mla/multi_layer/{FP8}": "(sequence 1's prefix token 0 of ragged_decode)",
        f"capture/decode/full/capture_path/mla/{P}":
            "warm-up under capture: 1 KV rows the step did not own changed",
    },
    "planted_other_layer": {
        f"eager/decode/mla/multi_layer/{FP8}":
            "of layer 1 (another layer (the forward wrote layer 0): sequence 0's new token 0",
    },
    "planted_nan_wide": {
        f"eager/decode/mla/{P}": "NaN in the output where the oracle is finite: 16384 values "
                                 "in 16 of 16 rows, at batch size 16",
        f"capture/decode/full/capture_path/mla/{P}": "NaN in the output where the oracle is "
                                                     "finite",
    },
    "planted_inplace_q": {
        f"eager/decode/mla/{P}": "eager: the forward changed its inputs: q (",
        f"eager/decode/mla/multi_layer/{FP8}": "the forward changed its inputs: q (",
        f"capture/decode/full/capture_path/mla/{P}": "the forward changed its input q",
    },
    "planted_hang": {
        f"eager/decode/mla/{P}": f"timed out after {HANG_LIMIT} s in eager step",
        f"eager/decode/mla/multi_layer/{FP8}": f"timed out after {HANG_LIMIT} s in eager step",
        f"capture/decode/full/capture_path/mla/{P}": f"timed out after {HANG_LIMIT} s in "
                                                     "capture",
    },
}


def _integrity(tmp: Path, backends: list[str], limit: int) -> tuple[int, str, Any]:
    # the base decode claims, eager and through the capture path, the multi-layer eager
    # one, and a cheap refusal as the control each backend verifies (after a hang too)
    args = ["--device", "cpu", "--plugin", "planted.integrity", "--time-limit", str(limit),
            "-k", f"(eager/decode/mla/{P} or eager/decode/mla/multi_layer or "
                  f"capture/decode/full/capture_path/mla/{P} or "
                  "refusal/decode/mla/index_dtype) and not sm_scale"]
    for name in backends:
        args += ["--backend", name]
    return conformance(tmp, *args)


@pytest.fixture(scope="module")
def integrity_run(tmp_path_factory):
    returning = [n for n in INTEGRITY_DEFECTS if n != "planted_hang"]
    return {"returning": _integrity(tmp_path_factory.mktemp("integrity"), returning,
                                    INTEGRITY_LIMIT),
            "planted_hang": _integrity(tmp_path_factory.mktemp("hang"), ["planted_hang"],
                                       HANG_LIMIT)}


@pytest.mark.parametrize("backend", sorted(INTEGRITY_DEFECTS))
def test_each_silent_corruption_is_refuted_naming_its_cause(integrity_run, backend):
    code, out, data = integrity_run.get(backend, integrity_run["returning"])
    assert code == 1 and data is not None, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items()
               if cid.startswith(backend + "/")}
    expected = INTEGRITY_DEFECTS[backend]
    assert set(refuted) == set(expected), out
    for cid, needle in expected.items():
        assert needle in refuted[cid], f"{cid}: {refuted[cid]}"
    # the claim after them still ran: the run goes on after a refutation or a timeout
    assert f"{backend}/refusal/decode/mla/index_dtype/int64" in by_status(data, "verified")


def test_a_hung_claim_ends_within_its_limit_plus_30_s(integrity_run):
    _, out, data = integrity_run["planted_hang"]
    hung = [c for c in data["claims"] if c["backend"] == "planted_hang"
            and "timed out" in c["message"]]
    assert len(hung) == 3, out
    for claim in hung:
        assert claim["duration_s"] <= HANG_LIMIT + 30, claim
