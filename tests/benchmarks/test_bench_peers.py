"""The `peers` section (issue 31): the dry run on a CPU (triton in the interpreter, raw peers
skipped with the reason) and its arithmetic on made-up times (wrapper / raw, bf16 / FP8, the
per-bucket plan and its checks).  The times below are test inputs, not measurements."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from benchmarks import decode_peers  # noqa: E402
from benchmarks._report import Page, Plotter  # noqa: E402


def test_the_dry_run_times_attnreg_through_the_session_and_skips_raw_peers(tmp_path: Path):
    from benchmarks.__main__ import main

    rc = main(["--dry-run", "--only", "peers", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    rec = doc["sections"]["peers"]
    assert rc == 0 and rec["status"] == "ok", rec
    data = rec["data"]
    assert set(data["raw_skipped"]) == {"raw fa3 p1", "raw fa3 p64", "raw FlashMLA"}
    assert all("no CUDA device" in why for why in data["raw_skipped"].values())
    for row in data["rows"]:  # the overhead rows: each skipped with its raw call's reason
        mine = {k for k, (_, _, only) in decode_peers.OVERHEAD.items()
                if only in (None, row["dtype"])}
        assert mine and mine <= set(row["results"]), row["results"].keys()
        assert all("no CUDA device" in row["results"][k]["skipped"] for k in mine)
    assert data["overhead"] == []
    assert {(r["B"], r["L"], r["H"], r["dtype"]) for r in data["rows"]} == {
        (*s, d) for s in decode_peers.DRY_SHAPES for d in decode_peers.DTYPES}
    for row in data["rows"]:
        for label in ("triton p1", "triton p64"):
            res = row["results"][label]
            assert res["correct"] and res["us"] > 0, res
    assert [c["id"] for c in data["checks"]] == [
        "peers.wrapper", "peers.fp8_speedup", "peers.fp8_never_slower",
        "peers.planned_vs_raw", "peers.planned_vs_fastest"]
    text = "\n".join(decode_peers.render(data, Page(Plotter(tmp_path, enabled=False), "img")))
    assert "**bf16 KV**" in text and "raw FlashMLA not run here (no CUDA device" in text


def _res(us: float | None) -> dict[str, Any]:
    return {"us": us, "rel_err": 1e-3, "correct": True} if us else {"skipped": "x"}


def _row(shape: tuple[int, int, int], dtype: str, **times: float) -> dict[str, Any]:
    names = {"fa3_p1": "raw fa3 p1", "fa3_p64": "raw fa3 p64", "fm": "raw FlashMLA",
             "t64": "triton p64", "fi1": "flashinfer_mla p1", "fi64": "flashinfer_mla p64",
             "plugin": "flashmla plugin", "t1": "triton p1",
             "fm_round": "raw FlashMLA + q rounding", "plugin_q8": "flashmla plugin, fp8 q"}
    return {"B": shape[0], "L": shape[1], "H": shape[2], "dtype": dtype,
            "results": {names[k]: _res(v) for k, v in times.items()}}


def test_ratios_plan_and_checks_from_made_up_times():
    a, b = (1, 32768, 16), (128, 4096, 16)
    rows = [
        _row(a, "bf16", fa3_p1=54.0, fa3_p64=53.0, fm=50.0, t64=30.0, fi64=55.0, plugin=52.0),
        _row(b, "bf16", fa3_p1=166.0, fa3_p64=156.0, fm=165.0, t64=163.0, fi64=160.0,
             plugin=167.0),
        _row(b, "fp8_e4m3", fm=120.0, t64=120.0, plugin=130.0, fm_round=128.0,
             plugin_q8=121.0),
    ]
    plan = decode_peers.planned(None, rows, "bf16", "cuda:sm90")
    chosen = {(x["B"], x["L"]): x["backend"] for x in plan["rows"]}
    # page 64, bf16, 16 heads: the phase's backend is flashinfer_mla here (plugins are not
    # autoloaded in tests); triton is 0.545x it at B=1 and 1.019x at B=128 (kept)
    assert chosen == {(1, 32768): "triton", (128, 4096): "flashinfer_mla"}
    assert plan["best_raw"] == "raw FlashMLA"  # sqrt(50 * 165) < sqrt(53 * 156)
    data = {"rows": rows, "planned": {"bf16": plan}}
    checks = {c.id: c for c in decode_peers.checks(data)}
    # each wrapper beside the raw call given the same inputs: the fp8 plugin's bf16-q row
    # beside the raw call that rounds q in the graph too, its fp8-q row beside the raw call
    wrap = dict(decode_peers._ratios(data)["wrapper"])
    assert wrap["flashmla plugin / raw FlashMLA + q rounding at (128, 4096, 16) fp8_e4m3"] \
        == pytest.approx(130.0 / 128.0)
    assert wrap["flashmla plugin, fp8 q / raw FlashMLA at (128, 4096, 16) fp8_e4m3"] \
        == pytest.approx(121.0 / 120.0)
    assert checks["peers.wrapper"].measured == pytest.approx(52.0 / 50.0)  # the worst
    assert checks["peers.wrapper"].detail == \
        "flashmla plugin / raw FlashMLA at (1, 32768, 16) bf16"
    assert checks["peers.wrapper"].status == "missed"
    assert checks["peers.fp8_speedup"].measured == pytest.approx(167.0 / 130.0)  # the plugin
    assert checks["peers.fp8_speedup"].status == "target met"
    planned_geo = (30.0 * 160.0) ** 0.5
    assert checks["peers.planned_vs_raw"].measured == pytest.approx(
        planned_geo / (50.0 * 165.0) ** 0.5)
    assert checks["peers.planned_vs_fastest"].measured == pytest.approx(1.0)


def test_overhead_rows_sit_beside_their_raw_call_and_the_wrapper_of_it():
    shape = (8, 1024, 128)
    row = _row(shape, "bf16", fa3_p1=24.3, fi1=30.5)
    row["results"]["raw fa3 p1 + zeroing x2"] = _res(29.0)
    row["results"]["raw fa3 p1 contiguous q"] = _res(24.1)
    got = {x["row"]: x for x in decode_peers.overhead({"rows": [row]})}
    assert set(got) == {"raw fa3 p1 + zeroing x2", "raw fa3 p1 contiguous q"}
    z = got["raw fa3 p1 + zeroing x2"]
    assert z["raw"] == "raw fa3 p1" and z["wrapper_us"] == 30.5
    assert z["added_us"] == pytest.approx(4.7)
    text = "\n".join(decode_peers._render_overhead({"rows": [row]}))
    assert "raw fa3 p1 + zeroing x2" in text and "+4.7" in text
    assert all(label.startswith(base) for label, (base, _, _) in decode_peers.OVERHEAD.items())


# ---- what a replay kept past its pool's captures holds --------------------------------
# The section times every peer of a pool after all of them are captured (interleaved).  A
# device graph keeps addresses, not tensors, so each replay must hold what its graph
# reads; the recorder below, like a CUDA graph, does not hold the captured function.

class _AddressOnlyRecorder:
    def begin(self) -> None:
        return None

    def end(self, handle: Any, exc: BaseException | None = None) -> Any:
        class Graph:
            def replay(self) -> None:
                pass
        return Graph()

    @staticmethod
    def eager() -> Any:
        import contextlib
        return contextlib.nullcontext()


def test_a_raw_peers_replay_holds_its_call_until_it_is_timed(monkeypatch):
    import gc
    import types
    import weakref

    import torch

    from attnreg import runtime

    class RawCall:  # what flashinfer's wrapper, workspace and output stand for
        def __call__(self) -> Any:
            return torch.ones(2, 4)

    calls: list[weakref.ref] = []

    def make(ctx: Any, pool: Any, batch: Any, q: Any, scale: float, **opts: Any) -> RawCall:
        call = RawCall()
        calls.append(weakref.ref(call))
        return call

    real = runtime.GraphRunner
    monkeypatch.setattr(runtime, "GraphRunner",
                        lambda device: real(device, recorder=_AddressOnlyRecorder()))
    monkeypatch.setitem(decode_peers.RAW_CALLS, decode_peers.FA3_P1, make)
    ctx = types.SimpleNamespace(torch=torch, device="cpu", cuda=False)
    res, replay = decode_peers._raw(ctx, decode_peers.FA3_P1, None, None, None,
                                    torch.ones(2, 4), "bf16", 1.0)
    assert res["correct"] and replay is not None
    gc.collect()
    assert calls[0]() is not None, "the raw call was collected before its replay was timed"
    replay()
    del replay
    gc.collect()
    assert calls[0]() is None  # the replay was what held it


def test_a_raw_kernel_whose_jit_build_failed_is_not_built_again_at_a_later_shape(
        monkeypatch, tmp_path: Path):
    from benchmarks._harness import RunContext

    calls: dict[str, int] = {}

    def failing(base: str, message: str) -> Any:
        def make(*args: Any, **opts: Any) -> Any:
            calls[base] = calls.get(base, 0) + 1
            raise RuntimeError(message)
        return make

    monkeypatch.setitem(decode_peers.RAW_CALLS, decode_peers.FA3_P1,
                        failing(decode_peers.FA3_P1, "Ninja build failed. Ninja output: x"))
    monkeypatch.setitem(decode_peers.RAW_CALLS, decode_peers.FLASHMLA_RAW,
                        failing(decode_peers.FLASHMLA_RAW, "CUDA out of memory"))
    ctx = RunContext(tmp_path, dry_run=True)
    reasons = dict.fromkeys(decode_peers.RAW_PAGES, "")
    reasons[decode_peers.FA3_P64] = "not here"
    failures: dict[tuple[str, str], str] = {}
    rows = [decode_peers.measure_shape(ctx, shape, "bf16", reasons, [], {}, failures)
            for shape in ((1, 16, 2), (2, 16, 2))]
    # fa3 p1 and its overhead rows share one module: built once, at the first shape
    fa3_rows = [k for k, (base, _, only) in decode_peers.OVERHEAD.items()
                if base == decode_peers.FA3_P1 and only in (None, "bf16")]
    assert calls[decode_peers.FA3_P1] == 1
    assert failures == {(decode_peers.FA3_P1, "bf16"): rows[0]["results"]["raw fa3 p1"]["error"]}
    for label in [decode_peers.FA3_P1, *fa3_rows]:
        err = rows[1]["results"][label]["error"]
        assert "Ninja build failed" in err and "earlier shape" in err, label
    # any other error is tried again at every shape
    assert calls[decode_peers.FLASHMLA_RAW] == 2
    assert "earlier shape" not in rows[1]["results"][decode_peers.FLASHMLA_RAW]["error"]
