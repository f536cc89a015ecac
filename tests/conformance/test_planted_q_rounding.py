"""(q) A kernel's q rounding against its declaration: ``planted_q_rounded_undeclared``
rounds q to fp8 where its declaration says q is used as given, ``planted_q_rounding_undone``
declares a rounding its kernels do not do.  The ``q_rounding`` claims at exactly those
configurations are refuted, naming the rounding found; the built-in backends' hold."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")

ROUNDED, UNDONE = "planted_q_rounded_undeclared", "planted_q_rounding_undone"
H2 = "p16/h2/576x512"
#: where triton declares q as given on cpu: 16-bit pools, 17-32 heads over an fp8 pool
#: (decode), and the prefill extend kernel
EXPECTED = {
    ROUNDED: {f"eager/decode/mla/q_rounding/{c}" for c in (
        f"bf16-bf16/{H2}", f"fp16-fp16/{H2}", "bf16-fp8_e4m3/p16/h17/576x512",
        "fp16-fp8_e4m3/p16/h17/576x512")}
    | {f"eager/prefill/mla/q_rounding/{p}/{H2}"
       for p in ("bf16-bf16", "fp16-fp16", "bf16-fp8_e4m3", "fp16-fp8_e4m3")},
    # its 16-bit-pool decode kernels declare the rounding (the extend kernel serves
    # both pools and keeps its declaration)
    UNDONE: {f"eager/decode/mla/q_rounding/{p}/{H2}" for p in ("bf16-bf16", "fp16-fp16")},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q_rounding")
    return conformance(tmp, "--device", "cpu", "--plugin", "planted.q_rounding",
                       "--backend", ROUNDED, "--backend", UNDONE, "--backend", "triton",
                       "--backend", "reference", "-k", "/q_rounding/")


@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_a_rounding_other_than_the_declared_one_is_refuted_where_it_is(run, backend):
    code, out, data = run
    assert code == 1 and data is not None, out
    refuted = {cid.removeprefix(backend + "/"): msg
               for cid, msg in by_status(data, "refuted").items() if cid.startswith(backend)}
    assert set(refuted) == EXPECTED[backend], out
    found = "q rounded to fp8_e4m3" if backend == ROUNDED else "q as given"
    for cid, msg in refuted.items():
        assert msg.startswith(f"the output is nearer the oracle of {found} "), f"{cid}: {msg}"
    # the same backend's other configurations hold (the fp8 ones declaring the rounding)
    held = by_status(data, "verified")
    assert f"{backend}/eager/decode/mla/q_rounding/bf16-fp8_e4m3/{H2}" in held


def test_the_built_in_backends_compute_with_q_as_they_declare(run):
    _, out, data = run
    claims = [c for c in data["claims"] if c["backend"] in ("triton", "reference")]
    assert len(claims) >= 24 and all(c["status"] == "verified" for c in claims), out
