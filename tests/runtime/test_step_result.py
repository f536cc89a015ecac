"""``StepResult`` (what ``GraphSession.run`` returns) behaves as the frozen dataclass it was
before its ``__init__`` was written by hand for the host time of a step (issue 26)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

from attnreg.graph_policy import ReplayReason  # noqa: E402
from attnreg.runtime import StepResult  # noqa: E402


def test_a_step_result_is_an_immutable_dataclass():
    ok = ReplayReason("gate.ok", "the batch replays a captured graph")
    res = StepResult([], True, 8, ok)
    assert res.rule == "gate.ok"  # the reason's rule when none is given
    assert StepResult([], False, None, ok, "sync.other_rank_eager").rule == "sync.other_rank_eager"
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.bucket = 16  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del res.reason
    assert [f.name for f in dataclasses.fields(res)] == ["outputs", "replayed", "bucket",
                                                        "reason", "rule"]
    moved = dataclasses.replace(res, bucket=16)
    assert moved.bucket == 16 and res.bucket == 8 and moved != res
    assert res == StepResult([], True, 8, ok, "gate.ok")
    assert dataclasses.asdict(res)["rule"] == "gate.ok"
    assert "bucket=8" in repr(res)
