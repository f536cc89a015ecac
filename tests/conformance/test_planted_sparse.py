"""The sparse (DSA) claims catch each planted sparse defect and verify a correct control.

One ``attnreg conformance --plugin planted.sparse --device cpu -k sparse`` run: the
control's sparse claims (eager against the float64 oracle, index refusals, decode FULL
and prefill BREAKABLE graphs through the graph session) are all verified; the defect
that ignores the indices and the one that reads index -1 are refuted, eagerly and in
the graphs, while the runtime's index refusal (the base class's) still holds for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")
pytest.importorskip("triton")

P = "bf16-bf16/p16/h2/576x512"
DEFECTS = ("planted_dsa_ignores_indices", "planted_dsa_reads_invalid")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    tmp = Path(tmp_path_factory.mktemp("sparse"))
    code, out, data = conformance(
        tmp, "--plugin", "planted.sparse", "--device", "cpu", "-k", "sparse",
        "--backend", "dsa_control", *[a for d in DEFECTS for a in ("--backend", d)],
        timeout=900)
    assert data is not None, out
    assert code == 1, out   # refuted claims exit 1
    return data


def test_the_control_verifies_every_sparse_claim(report: dict) -> None:  # type: ignore[type-arg]
    ours = {c["id"]: c["status"] for c in report["claims"] if c["backend"] == "dsa_control"}
    assert ours and set(ours.values()) == {"verified"}, ours
    assert f"dsa_control/capture/decode/full/sparse_replay/mla/{P}" in ours
    assert f"dsa_control/capture/prefill/breakable/sparse_replay/mla/{P}" in ours


@pytest.mark.parametrize("defect, eager_why", [
    ("planted_dsa_ignores_indices", "top-k 16 of 40 and 23 tokens"),
    ("planted_dsa_reads_invalid", "-1 scattered"),
])
def test_each_defect_is_refuted_eagerly_and_in_graphs(report: dict, defect: str,  # type: ignore[type-arg]
                                                      eager_why: str) -> None:
    refuted = by_status(report, "refuted")
    for phase in ("decode", "prefill"):
        msg = refuted[f"{defect}/eager/{phase}/mla/sparse/{P}"]
        assert "differs from the float64 oracle" in msg
    assert eager_why in refuted[f"{defect}/eager/decode/mla/sparse/{P}"]
    assert f"{defect}/capture/decode/full/sparse_replay/mla/{P}" in refuted
    assert f"{defect}/capture/prefill/breakable/sparse_replay/mla/{P}" in refuted
    verified = by_status(report, "verified")
    assert f"{defect}/refusal/decode/mla/sparse_index/sparse_index" in verified
