"""The suite catches each planted defect (tests/conformance/planted), with a message that
points at the cause, and refutes nothing else of those backends.

One ``attnreg conformance`` run checks every cpu-visible defect at once (capture-mode
code paths and index-dtype refusals; eager claims are covered by the triton run);
the GPU-only ones (a buffer freed during real capture, split plans frozen at capture)
run on a CUDA device.
"""

from __future__ import annotations

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
        f"capture/prefill/tc_piecewise/capture_path/mla/{P}":
            "unsupported head dims q/k 576/576",
    },
    # (b) split-KV declared under capture, the kernel asserts on splits > 1
    "planted_split_assert": {
        f"capture/prefill/breakable/capture_path/mla/{P}":
            "no split-KV variant (num_splits=3)",
        f"capture/prefill/tc_piecewise/capture_path/mla/{P}": "no split-KV variant",
    },
    # (c) inputs freed under capture by a dispose guarded for tc_piecewise only
    "planted_dispose_inputs": {
        f"capture/decode/full/capture_path/mla/{P}": "released the storage of latent_new",
        f"capture/prefill/breakable/capture_path/mla/{P}": "seed 000 defect 3",
        f"capture/prefill/breakable/pinning/mla/{P}": "released the storage of latent_new",
    },
    # (d) split plan frozen at capture: caught on cpu too, in the capture-mode path
    "planted_frozen_splits": {
        f"capture/decode/full/capture_path/mla/{P}": "long_kv (bs=2, seq_lens=[1101, 41]): "
                                                     "output differs from the float32 oracle",
    },
    # (e) int64 lengths accepted and read as int32
    "planted_int64_lengths": {
        "refusal/decode/mla/index_dtype/int64":
            "int64 seq_lens (outside the declaration) was accepted without UnsupportedError "
            "and its output is wrong",
        "refusal/prefill/mha/index_dtype/int64": "was accepted without UnsupportedError",
    },
    # (f) MLA pinned under breakable, MHA companion runs anyway
    "planted_pin_mismatch": {
        f"capture/prefill/breakable/pinning/mla/{P}":
            "declares mla pinned, but forward_extend(method=mha) ran under "
            "capturing(breakable)",
    },
}
MODULES = ("ragged_absorbed", "split_assert", "dispose", "frozen_splits", "int64_lengths",
           "pin_mismatch")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planted")
    # capture-mode paths and index-dtype refusals; the MHA piecewise path has no defect
    args = ["--device", "cpu", "-k", "(capture and not /mha/) or index_dtype"]
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
            "output differs from the float32 oracle",
        "capture/decode/full/replay/mla/bf16-bf16/p16/h16/576x512":
            "output differs from the float32 oracle",
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
