"""The sparse (DSA) claims catch each planted sparse defect and verify a correct control.

One ``attnreg conformance --plugin planted.sparse --device cpu -k sparse`` run: the
control's sparse claims (eager against the float64 oracle, index refusals, decode FULL
and prefill BREAKABLE graphs through the graph session) are all verified; the defect
that ignores the indices and the one that reads index -1 are refuted, eagerly and in
the graphs, while the runtime's index refusal (the base class's) still holds for them;
the one that reads ``fp8_ds_mla`` rows with the wrong block's scale is refuted on that
pool format (the control verifies the same claims over it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")
pytest.importorskip("triton")

P = "bf16-bf16/p16/h2/576x512"
P8 = "bf16-fp8_e4m3/p16/h2/576x512"     # fp8_ds_mla rows
DEFECTS = ("planted_dsa_ignores_indices", "planted_dsa_reads_invalid",
           "planted_dsa_wrong_scale_block")


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
    for p in (P, P8):
        assert f"dsa_control/capture/decode/full/sparse_replay/mla/{p}" in ours
        assert f"dsa_control/capture/prefill/breakable/sparse_replay/mla/{p}" in ours
        assert f"dsa_control/eager/prefill/mla/sparse/{p}" in ours
    assert "dsa_control/refusal/decode/mla/sparse_index/sparse_index_fp8_ds_mla" in ours


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


def test_the_wrong_fp8_scale_block_is_refuted_eagerly_and_in_graphs(
        report: dict) -> None:  # type: ignore[type-arg]
    defect = "planted_dsa_wrong_scale_block"
    refuted = by_status(report, "refuted")
    for phase in ("decode", "prefill"):
        msg = refuted[f"{defect}/eager/{phase}/mla/sparse/{P8}"]
        assert "differs from the float64 oracle" in msg
    assert f"{defect}/capture/decode/full/sparse_replay/mla/{P8}" in refuted
    assert f"{defect}/capture/prefill/breakable/sparse_replay/mla/{P8}" in refuted
    verified = by_status(report, "verified")
    assert f"{defect}/refusal/decode/mla/sparse_index/sparse_index_fp8_ds_mla" in verified
    # it declares only fp8_ds_mla rows: no claim over bf16 rows
    assert not [i for i in refuted if i.startswith(defect) and P in i]
