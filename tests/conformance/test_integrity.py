"""KV integrity, unchanged inputs, non-finite outputs: what each check catches and names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import DType, ForwardMethod, Phase  # noqa: E402
from attnreg.testing.batches import batch_spec  # noqa: E402
from attnreg.testing.claims import Combo  # noqa: E402
from attnreg.testing.integrity import InputGuard, kv_problems, nonfinite_problem  # noqa: E402
from attnreg.testing.workload import make_config, make_pool, make_workload  # noqa: E402

COMBO = Combo(ForwardMethod.MLA, Phase.DECODE, DType.BF16, DType.BF16, 16, 2, (576, 512))


def _step(layers: int = 1):
    """A suite pool with ragged_decode's prefixes written, one workload per layer."""
    config = make_config(COMBO, "cpu")
    spec = batch_spec("ragged_decode", "cpu")  # prefixes 0, 5, 16, 33
    pool = make_pool(config, [spec], num_layers=layers)
    first = make_workload(config, pool, spec, ForwardMethod.MLA, seed=3)
    works = [first] + [make_workload(config, pool, spec, ForwardMethod.MLA, seed=3 + i,
                                     layer_id=i, pages=first.pages, batch=first.batch)
                       for i in range(1, layers)]
    return pool, works


def _forward(pool, work) -> None:
    """What a correct forward writes: the new rows at out_cache_loc."""
    rows = work.new_rows.to(pool.dtype)
    pool.layer(work.layer_id).buffer.view(pool.num_slots, pool.row_dim)[
        work.batch.out_cache_loc.long()] = rows


def test_a_correct_step_passes_and_the_next_one_is_checked_against_it() -> None:
    pool, (work,) = _step()
    _forward(pool, work)
    assert kv_problems(pool, [work], "eager") == []
    assert kv_problems(pool, [work], "again") == []  # nothing changed since


def _flat(pool, layer=0):
    return pool.layer(layer).buffer.view(pool.num_slots, pool.row_dim)


def test_another_sequences_prefix_is_named() -> None:
    pool, (work,) = _step()
    _forward(pool, work)
    slot = work.pages[1][0] * pool.page_size + 2  # sequence 1 has a 5-token prefix
    _flat(pool)[slot, 7] = 9.0
    (msg,) = kv_problems(pool, [work], "eager")
    assert f"slot {slot} (sequence 1's prefix token 2 of ragged_decode)" in msg


@pytest.mark.parametrize(("where", "needle"), [
    ("free", "a free page"),
    ("padding", "the padding page (page 0)"),
    ("tail", "past its 6 tokens"),
])
def test_free_pages_the_padding_page_and_unused_rows_are_named(where, needle) -> None:
    pool, (work,) = _step()
    _forward(pool, work)
    owned = {p for pages in work.pages for p in pages}
    slot = {"free": max(set(range(1, pool.num_pages)) - owned) * pool.page_size,
            "padding": 3,
            "tail": work.pages[1][0] * pool.page_size + 10}[where]
    _flat(pool)[slot, 0] = 1.0
    (msg,) = kv_problems(pool, [work], "eager")
    assert needle in msg, msg


def test_the_padding_page_may_change_only_in_a_padded_replay() -> None:
    pool, (work,) = _step()
    _forward(pool, work)
    _flat(pool)[pool.padding_slot] = 2.0
    assert kv_problems(pool, [work], "replay", padding=True) == []
    _flat(pool)[pool.padding_slot] = 3.0
    assert "the padding page" in kv_problems(pool, [work], "eager")[0]


def test_writes_beyond_the_pool_land_in_guard_pages_and_are_named() -> None:
    pool, (work,) = _step()
    _forward(pool, work)
    # one row past the last page of layer 0: the guard after it
    storage_row = pool.layer(0).buffer.view(pool.num_slots, pool.row_dim)
    past = storage_row.as_strided((1, pool.row_dim), (pool.row_dim, 1),
                                  storage_row.storage_offset() + pool.num_slots * pool.row_dim)
    past.fill_(5.0)
    (msg,) = kv_problems(pool, [work], "eager")
    assert "beyond the pool's pages: 1 slots past the last page of layer 0" in msg


def test_another_layer_is_named_and_wrong_rows_in_written_slots_too() -> None:
    pool, works = _step(layers=2)
    _forward(pool, works[0])
    _flat(pool, 1)[works[0].batch.out_cache_loc.long()[1]] = 1.5  # layer 1, not written
    problems = kv_problems(pool, [works[0]], "layer 0")
    assert len(problems) == 1
    assert "of layer 1 (another layer (the forward wrote layer 0): sequence 1's new token 0" \
        in problems[0]
    pool2, (work,) = _step()
    _forward(pool2, work)
    _flat(pool2)[work.batch.out_cache_loc.long()[2], 0] = 0.0
    (msg,) = kv_problems(pool2, [work], "eager")
    assert "1/4 new tokens were not written to their out_cache_loc slots" in msg


def test_changed_inputs_are_named() -> None:
    _, (work,) = _step()
    guard = InputGuard([work])
    assert guard.problems("eager") == []
    work.q.mul_(2.0)
    work.batch.seq_lens.add_(1)
    (msg,) = guard.problems("eager")
    assert "changed its inputs: q (" in msg and "batch.seq_lens (" in msg


def test_nan_is_named_as_nan_with_batch_size_and_sequence() -> None:
    spec = batch_spec("ragged_decode", "cpu")
    expected = torch.zeros(4, 2, 8)
    out = expected.clone()
    out[2, 1, 3] = float("nan")
    msg = nonfinite_problem(out, expected, spec)
    assert msg is not None and "NaN in the output where the oracle is finite" in msg
    assert "at batch size 4, sequences [2]" in msg
    out[2, 1, 3] = float("inf")
    assert "+inf" in (nonfinite_problem(out, expected, spec) or "")
    assert nonfinite_problem(expected, expected, spec) is None
