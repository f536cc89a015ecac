"""triton's sparse decode (declared on cpu, under the Triton interpreter) is proven by its own
claims in every ``make test``: eager claims against the float64 sparse oracle (top-k below,
at and above the sequence, repeated and unsorted slots, -1 entries, padded rows), the refusal
of an out-of-pool index, and a replay through the graph session."""

from __future__ import annotations

import pytest

from ._run import by_status, conformance

pytest.importorskip("torch")
pytest.importorskip("triton")


def test_tritons_sparse_claims_hold_on_cpu(tmp_path):
    code, out, data = conformance(tmp_path, "--device", "cpu", "--backend", "triton",
                                  "-k", "sparse")
    assert code == 0 and data is not None, out
    verified = by_status(data, "verified")
    assert not by_status(data, "refuted"), out
    assert len(verified) == 8, sorted(verified)
    assert any("/capture/decode/full/sparse_replay/" in f"/{cid}" for cid in verified), verified
