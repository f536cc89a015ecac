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


def test_the_reference_covers_every_sequence_and_a_wrong_last_one_is_caught() -> None:
    q, cache, table, seq_lens, out = tuning.make_inputs(6, 24, 16, device="cpu")
    out.fill_(float("nan"))
    mla_decode(q, cache, table, seq_lens, out, sm_scale=0.1, max_splits=1, workspace=None)
    ref = tuning.reference(q, cache, table, seq_lens, 0.1)
    assert ref.shape[0] == 6
    assert tuning.max_abs_error(out, ref) < 2e-2
    # a kernel wrong only in its last program: one head row of the last sequence
    out[5, 3] = out[5, 3] * 2
    assert tuning.max_abs_error(out, ref) > 0.1
    # a row no program wrote stays NaN and never passes
    out[5, 3] = float("nan")
    assert tuning.max_abs_error(out, ref) == float("inf")


def test_the_worst_sequence_not_the_whole_tensor_decides_a_timed_paths_error() -> None:
    from attnreg.profiling import rel_error
    from benchmarks._backends import worst_row_rel_error

    ref = torch.randn(128, 16, 512)
    out = ref.clone()
    out[127] += 0.1 * torch.randn(16, 512)    # one sequence 10% off
    # the whole tensor's norm hides it under a 2e-2 tolerance; the worst row does not
    assert rel_error(torch, out, ref) < 2e-2
    assert worst_row_rel_error(torch, out, ref) > 5e-2
    out[0, 0, 0] = float("inf")
    assert worst_row_rel_error(torch, out, ref) == float("inf")
