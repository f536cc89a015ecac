"""benchmarks/triton_decode_tuning.py builds its inputs and times through attnreg's graph
runner: on a cpu (Triton interpreter, tiny shape) the captured call still computes the
decode the float32 reference computes.  No time is asserted."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnreg.backends._triton_kernels import mla_decode  # noqa: E402
from benchmarks import triton_decode_tuning as tuning  # noqa: E402


def test_a_decode_captured_by_graph_of_matches_the_reference() -> None:
    q, cache, table, seq_lens, out = tuning.make_inputs(2, 24, 16, device="cpu")
    out.fill_(float("nan"))
    graph = tuning.graph_of(lambda: mla_decode(q, cache, table, seq_lens, out, sm_scale=0.1,
                                               max_splits=1, workspace=None))
    out.fill_(float("nan"))
    graph.replay()
    ref = tuning.reference(q, cache, table, seq_lens, 0.1)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
