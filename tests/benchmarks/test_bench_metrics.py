"""The arithmetic behind the benchmark figures: bytes, ratios, checks (no timing).

These pin down what the docs derive from measured times, so a wrong byte
count or an inverted ratio fails here instead of being published.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from attnreg.profiling import LayerShape
from benchmarks import decode, graphs, overhead, prefill, split_kv
from benchmarks.metrics import (
    decode_bytes,
    evaluate,
    extend_attention_flops,
    extend_pairs,
    geomean,
)

#: Bytes per shape of /work/shared/bench/h200-mla-decode-peers.json ("MB" * 1e6),
#: computed there independently with the same definition.
PEER_MB = {(128, 4096, 128): 639.63136, (128, 4096, 16): 608.436224,
           (32, 8192, 16): 303.104, (1, 32768, 16): 37.783552, (1, 32768, 128): 38.027264,
           (8, 1024, 128): 11.665408, (64, 2048, 64): 159.90784}


@pytest.mark.parametrize("shape", sorted(PEER_MB))
def test_decode_bytes_count_kv_once_plus_q_and_out(shape):
    assert decode_bytes(*shape) == round(PEER_MB[shape] * 1e6)


def test_decode_bytes_scale_with_element_size():
    b, length, h = 2, 10, 4
    assert decode_bytes(b, length, h, kv_elem_bytes=1) == b * length * 576 + b * h * (576 + 512) * 2


def test_p1_shapes_are_the_issue_shapes():
    assert set(decode.SHAPES) == set(PEER_MB)


def test_extend_pairs_is_causal_count():
    # brute force: query i (0-based) sees prefix + i + 1 keys
    for prefix, extend in ((0, 1), (0, 5), (7, 3), (100, 17)):
        assert extend_pairs(prefix, extend) == sum(prefix + i + 1 for i in range(extend))


def test_extend_flops_ratio_absorbed_over_mha():
    absorbed = extend_attention_flops(4096, 512, 128, 576, 512)
    mha = extend_attention_flops(4096, 512, 128, 192, 128)
    assert absorbed / mha == pytest.approx((576 + 512) / (192 + 128))


def test_deepseek_layer_weights():
    per_layer = LayerShape().weight_bytes(128)
    params = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168)
    assert per_layer == 2 * params
    assert graphs.P4_SHAPE.weight_bytes(graphs.P4_HEADS) * graphs.P4_LAYERS == 2_993_684_480


def test_geomean():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([2.0]) == 2.0
    with pytest.raises(ValueError):
        geomean([])
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])


@pytest.mark.parametrize("measured,status", [(0.9, "goal met"), (1.0, "goal met"),
                                             (1.2, "target met"), (1.3, "missed"),
                                             (None, "not measured"), (math.nan, "not measured")])
def test_evaluate_lower_is_better(measured, status):
    c = evaluate("X", "x", measured, "x", "<=", target=1.25, goal=1.0)
    assert c.status == status


def test_evaluate_higher_is_better_goal_only():
    assert evaluate("X", "x", 0.95, "of copy", ">=", goal=0.9).status == "goal met"
    assert evaluate("X", "x", 0.85, "of copy", ">=", goal=0.9).status == "missed"
    with pytest.raises(ValueError):
        evaluate("X", "x", 1.0, "x", "<=")
    with pytest.raises(ValueError):
        evaluate("X", "x", 1.0, "x", "<", goal=1.0)  # type: ignore[arg-type]


def _row(shape, **us):
    return {"B": shape[0], "L": shape[1], "H": shape[2], "bytes": decode_bytes(*shape),
            "results": {k: {"us": v, "correct": True} for k, v in us.items()}}


def test_p1_ratio_is_triton_over_fa3_geomean_over_shapes_with_both():
    data = {"rows": [_row((1, 2, 16), **{"triton": 200.0, "flashinfer_mla/fa3": 100.0}),
                     _row((1, 4, 16), **{"triton": 50.0, "flashinfer_mla/fa3": 100.0}),
                     _row((1, 8, 16), triton=10.0)]}
    s = decode.summarize_p1(data)
    assert s["triton_over_fa3_geomean"] == pytest.approx(1.0)
    assert (s["shapes_with_both"], s["shapes_total"]) == (2, 3)
    assert [p["best"] for p in s["per_shape"]] == ["flashinfer_mla/fa3", "triton", "triton"]
    check = decode.p1_checks(data)[0]
    assert check.id == "P1" and check.status == "goal met" and "2 of 3" in check.detail


def test_p1_peer_ratio_takes_the_faster_triton_and_the_faster_hopper_peer_per_shape():
    data = {"rows": [
        _row((1, 2, 16), **{"triton": 200.0, "triton (page 64)": 150.0,
                            "flashinfer_mla/fa3": 100.0, "flashmla (page 64)": 120.0}),
        _row((1, 4, 16), **{"triton": 40.0, "flashmla (page 64)": 80.0}),
        _row((1, 8, 16), **{"triton (page 64)": 10.0})]}
    s = decode.summarize_p1(data)
    assert [p["triton_over_best_peer"] for p in s["per_shape"]] == [1.5, 0.5, None]
    assert s["triton_over_best_peer_worst"] == 1.5
    peer = next(c for c in decode.p1_checks(data) if c.id == "P1-peer")
    assert peer.measured == pytest.approx((1.5 * 0.5) ** 0.5)
    assert peer.status == "target met" and "2 of 3" in peer.detail and "1.50x" in peer.detail


def test_p1_wrong_results_are_not_timed_figures():
    row = _row((1, 2, 16), **{"triton": 50.0, "flashinfer_mla/fa3": 100.0})
    row["results"]["triton"]["correct"] = False
    s = decode.summarize_p1({"rows": [row]})
    assert s["triton_over_fa3_geomean"] is None
    assert s["per_shape"][0]["best"] == "flashinfer_mla/fa3"


def test_p2_best_correct_share_of_copy():
    shape = (128, 4096, 16)
    row = _row(shape, **{"triton": 300.0, "flashinfer_mla/fa3": 170.0, "flashinfer_mla/fa2": 100.0})
    row["results"]["flashinfer_mla/fa2"]["correct"] = False  # fastest, but wrong
    copy = 4300.0
    out = decode.p2_from_row(row, copy)
    assert out["best"] == "flashinfer_mla/fa3"
    assert out["best_share"] == pytest.approx(decode_bytes(*shape) / 170e3 / copy)
    assert out["checks"][0]["status"] == "missed"


def test_p3_check_reads_the_target_length_row():
    data = {"heads": [128], "target_len": 32768,
            "rows": [{"H": 128, "L": 32768, "decode_speedup": 5.0, "extend_speedup": 1.0},
                     {"H": 128, "L": 8192, "decode_speedup": 1.5}]}
    checks = {c.id: c for c in split_kv.p3_checks(data)}
    assert checks["P3 decode H=128"].status == "target met"
    assert checks["P3 extend H=128"].status == "missed"


def test_p4_check_per_backend_at_batch_one():
    data = {"variants": ["triton", "flashinfer_mla"],
            "rows": [{"variant": "triton", "B": 1, "speedup": 3.5},
                     {"variant": "triton", "B": 8, "speedup": 1.0},
                     {"variant": "flashinfer_mla", "B": 1, "speedup": 2.0}]}
    checks = {c.id: c.status for c in graphs.p4_checks(data)}
    assert checks == {"P4 triton": "target met", "P4 flashinfer_mla": "missed"}


def test_p4_over_several_runs_is_their_median_with_every_run_kept():
    def run(triton: float) -> dict:
        return {"variants": ["triton"], "rows": [{"variant": "triton", "B": 1,
                                                  "speedup": triton}]}

    runs = [run(6.0), run(2.0), run(2.5)]
    (check,) = graphs.p4_checks(runs[0], runs)
    assert check.measured == 2.5 and check.status == "missed"  # not the best run's 6x
    assert sorted(check.runs) == [2.0, 2.5, 6.0] and "median" in check.what
    (single,) = graphs.p4_checks(runs[0])
    assert single.measured == 6.0 and single.runs == ()


def test_p6_check_takes_the_worst_row():
    data = {"rows": [{"variant": "triton", "B": 1, "L": 2, "H": 3, "overhead": 0.01},
                     {"variant": "triton", "B": 4, "L": 5, "H": 6, "overhead": 0.05},
                     {"variant": "triton", "B": 7, "L": 8, "H": 9, "error": "boom"}]}
    (check,) = overhead.p6_checks(data)
    assert check.measured == 0.05 and check.status == "missed"
    assert "(4, 5, 6)" in check.detail
    better = {"rows": [{"variant": "triton", "B": 1, "L": 2, "H": 3, "overhead": 0.01}]}
    (median,) = overhead.p6_checks(data, [data, better, better])
    assert median.measured == 0.01 and median.status == "goal met"
    assert sorted(median.runs) == [0.01, 0.01, 0.05] and "median" in median.detail


def test_prefill_summary_worst_and_best_ratio():
    data = {"variants": ["triton"], "rows": [
        {"prefix": 0, "extend": 512, "results": {"triton": {"absorbed_over_mha": 1.5}}},
        {"prefix": 4096, "extend": 512, "results": {"triton": {"absorbed_over_mha": 3.0}}},
        {"prefix": 32768, "extend": 512, "results": {"triton": {"error": "x"}}}]}
    s = prefill.summarize(data)["triton"]
    assert s["points"] == 2
    assert (s["worst"]["prefix"], s["worst"]["ratio"]) == (4096, 3.0)
    assert (s["best"]["prefix"], s["best"]["ratio"]) == (0, 1.5)
