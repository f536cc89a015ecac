"""Rendering results JSON into markdown + plots.

Every number in this file is SYNTHETIC test data, invented to exercise the
renderer; it is written only under pytest's tmp_path, never to docs/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import decode, graphs, overhead, prefill, render
from benchmarks._harness import SCHEMA, SECTIONS
from benchmarks.metrics import decode_bytes, evaluate

SYNTHETIC = "SYNTHETIC"


def _timing(us: float) -> dict[str, Any]:
    return {"median_us": us, "p20_us": us * 0.98, "p80_us": us * 1.02, "min_us": us * 0.95,
            "max_us": us * 1.1, "n": 10, "method": SYNTHETIC}


def _meta(kind: str = "cuda", dry_run: bool = False) -> dict[str, Any]:
    device = ({"kind": "cuda", "name": f"{SYNTHETIC} GPU", "arch": "sm90", "sms": 132}
              if kind == "cuda" else {"kind": "cpu", "name": f"{SYNTHETIC} CPU"})
    return {"command": f"python -m benchmarks ({SYNTHETIC})", "date_utc": "2000-01-01T00:00:00Z",
            "python": "3.12", "versions": {"torch": "0.0", "triton": "0.0"}, "device": device,
            "dry_run": dry_run, "quick": False, "cpu_count": 2}


def synthetic_device_doc() -> dict[str, Any]:
    copy = 4000.0
    labels = ["triton", "flashinfer_mla/fa3", "flashinfer_mla/fa2"]
    rows = []
    for i, shape in enumerate(decode.SHAPES):
        res = {}
        for j, label in enumerate(labels):
            us = 100.0 + 40 * i + 30 * j
            gbps = decode_bytes(*shape) / (us * 1e3)
            res[label] = {"us": us, "GBps": gbps, "copy_share": gbps / copy, "correct": True,
                          "rel_err": 4e-3, "rel_err_eager": 4e-3, "mode": "graph",
                          "timing": _timing(us)}
        res["trtllm_mla"] = {"error": "BackendUnavailableError: Blackwell only"}
        rows.append({"B": shape[0], "L": shape[1], "H": shape[2],
                     "bytes": decode_bytes(*shape), "results": res})
    p1 = {"dtype": "bf16", "page_size": 1, "page_order": "shuffled", "copy_GBps": copy,
          "variants": labels, "skipped_variants": {"trtllm_mla": "Blackwell only"},
          "rows": rows, "timing": SYNTHETIC}
    p1["summary"] = decode.summarize_p1(p1)
    p1["checks"] = [c.to_dict() for c in decode.p1_checks(p1)]
    p2 = decode.p2_from_row(rows[1], copy)
    p2["source"] = SYNTHETIC
    p3_rows = []
    for heads in (128, 16):
        for length in (8192, 32768, 131072):
            r = {"H": heads, "L": length, "results": {
                "triton split-KV": {"decode": {"us": 20.0, "correct": True, "rel_err": 1e-3,
                                               "max_splits": 64},
                                    "extend": {"us": 300.0, "correct": True, "rel_err": 1e-3}},
                "triton one split": {"decode": {"us": 200.0, "correct": True, "rel_err": 1e-3,
                                                "max_splits": 1},
                                     "extend": {"us": 310.0, "correct": True, "rel_err": 1e-3}}}}
            r["decode_speedup"], r["extend_speedup"] = 10.0, 310.0 / 300.0
            p3_rows.append(r)
    p3 = {"batch": 1, "extend_tokens": 16, "heads": [128, 16], "lens": [8192, 32768, 131072],
          "variants": ["triton split-KV", "triton one split"], "rows": p3_rows,
          "target_len": 32768, "timing": SYNTHETIC, "extend_kernel_split_params": []}
    p3["checks"] = [c.to_dict() for c in graphs.p3_checks(p3, 32768)]
    p4_rows = [{"variant": v, "B": b, "eager_us": 3000.0, "graph_us": 1500.0 + b,
                "speedup": 3000.0 / (1500.0 + b), "floor_us": 900.0,
                "graph_vs_eager_rel_err": 0.0} for v in ("triton", "flashinfer_mla")
               for b in (1, 8, 64)]
    p4 = {"shape": {"layers": 8, "hidden": 7168, "q_lora": 1536, "kv_lora": 512, "rope": 64,
                    "nope": 128, "v_dim": 128, "heads": 128}, "seq_len": 2048,
          "weight_bytes": 3_000_000_000, "variants": ["triton", "flashinfer_mla"],
          "rows": p4_rows, "timing": SYNTHETIC}
    p4["checks"] = [c.to_dict() for c in graphs.p4_checks(p4)]
    pf_rows = []
    for p in (0, 4096, 32768):
        for e in (512, 4096):
            pf_rows.append({"prefix": p, "extend": e, "results": {v: {
                "absorbed": {"us": 1000.0 + p / 10}, "mha": {"us": 800.0 + p / 40},
                "absorbed_attention": {"us": 900.0, "TFLOPs": 300.0},
                "mha_attention": {"us": 500.0, "TFLOPs": 400.0},
                "absorbed_over_mha": (1000.0 + p / 10) / (800.0 + p / 40),
                "rel_diff_absorbed_vs_mha": 5e-3, "agree": True}
                for v in ("triton", "flashinfer_mla")}})
    pf = {"batch": 1, "heads": 128, "variants": ["triton", "flashinfer_mla"], "rows": pf_rows,
          "timing": SYNTHETIC}
    pf["summary"] = prefill.summarize(pf)
    p6_rows = [{"variant": "triton", "B": 8, "L": 1024, "H": 128, "baseline": "kernel",
                "kernel": _timing(30.0), "backend": _timing(45.0),
                "backend_planned_once": _timing(40.0), "overhead": 0.5,
                "overhead_planned_once": 1 / 3, "max_splits": 8,
                "host_us": {"kernel": 20.0, "backend": 45.0, "backend_planned_once": 38.0}}]
    p6 = {"variants": ["triton"], "rows": p6_rows, "timing": SYNTHETIC}
    p6["checks"] = [c.to_dict() for c in overhead.p6_checks(p6)]
    ceilings = {"copy": {"bytes_copied": 2**31, "bytes_moved": 2**32, "timing": _timing(1e3),
                         "GBps": copy},
                "gemm_bf16": {"n": 8192, "flops": 2 * 8192 ** 3, "timing": _timing(1500.0),
                              "TFLOPs": 733.0}}

    def ok(data: dict[str, Any]) -> dict[str, Any]:
        return {"title": SYNTHETIC, "status": "ok", "seconds": 1.0, "data": data}

    return {"schema": SCHEMA, "meta": _meta(), "sections": {
        "ceilings": ok(ceilings), "P1": ok(p1), "P2": ok(p2), "P3": ok(p3), "P4": ok(p4),
        "prefill": ok(pf), "P6": ok(p6),
        "P5": {"title": SYNTHETIC, "status": "skipped", "reason": "measured on the CPU machine",
               "data": {}}}}


def synthetic_host_doc() -> dict[str, Any]:
    times = {"python -c pass": [10.0, 11.0, 12.0], "attnreg compat --model deepseek-v3":
             [300.0, 310.0, 320.0]}
    results = {}
    for k, ts in times.items():
        results[k] = {"median_ms": ts[1], "p20_ms": ts[0], "p80_ms": ts[2], "min_ms": ts[0],
                      "max_ms": ts[2], "runs": 3, "times_ms": ts,
                      "above_python_ms": ts[1] - 11.0}
    p5 = {"tool": SYNTHETIC, "results": results,
          "imports": {"command": "attnreg compat", "count": 200, "heavy": [],
                      "attnreg_modules": ["attnreg"]},
          "checks": [evaluate("P5", "compat above python", 299.0, "ms", "<=",
                              goal=150.0).to_dict()]}
    return {"schema": SCHEMA, "meta": _meta("cpu"), "sections": {
        "P5": {"title": SYNTHETIC, "status": "ok", "seconds": 1.0, "data": p5}}}


def _write(tmp_path: Path, name: str, doc: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_every_section_rendered_with_provenance_checks_and_plots(tmp_path):
    dev = _write(tmp_path, "h200.json", synthetic_device_doc())
    host = _write(tmp_path, "cpu-startup.json", synthetic_host_doc())
    md = render.render_files([dev, host], tmp_path / "out" / "benchmarks.md",
                             tmp_path / "out" / "img")
    text = md.read_text()
    for sec in SECTIONS:
        assert f"## {sec.id}: {sec.title}" in text
    assert "Not measured yet" not in text
    # provenance of both files, each section with its own command and device
    assert text.count("*Command:*") == len(SECTIONS)
    assert f"{SYNTHETIC} GPU" in text and f"{SYNTHETIC} CPU" in text
    # P5 came from the host file although the device file has a (skipped) P5
    assert "+299.0" in text
    # ratios against targets, and a reason + next step for each miss
    assert "measured / target =" in text
    assert "**missed**" in text
    n_missed = text.count("→ **missed**")
    assert n_missed >= 3 and text.count("*Why it is missed (from the data):*") == n_missed
    assert text.count("*Next step:*") == n_missed
    # the extend row of P3 has equal times: the reason names the missing split-KV
    assert "has no split-KV" in text
    # plots embedded with a path relative to the page, and written
    images = sorted(p.name for p in (tmp_path / "out" / "img").glob("*.png"))
    assert images == ["p1_decode.png", "p3_split_kv.png", "p4_graphs.png", "p5_startup.png",
                      "p6_overhead.png", "prefill.png"]
    for name in images:
        assert f"](img/{name})" in text


def test_sections_never_measured_say_so(tmp_path):
    host = _write(tmp_path, "cpu-startup.json", synthetic_host_doc())
    text = render.render_files([host], tmp_path / "b.md", tmp_path / "img",
                               plots=False).read_text()
    assert text.count("Not measured yet") == len(SECTIONS) - 1
    assert "python3 -m benchmarks --out $OUT/bench" in text


def test_dry_run_results_never_reach_docs(tmp_path):
    doc = synthetic_device_doc()
    doc["meta"]["dry_run"] = True
    path = _write(tmp_path, "dry.json", doc)
    with pytest.raises(ValueError, match="dry-run"):
        render.render_files([path], tmp_path / "b.md", tmp_path / "img", plots=False)
    text = render.render_files([path], tmp_path / "b.md", tmp_path / "img", plots=False,
                               allow_dry_run=True, preview=True).read_text()
    assert "DRY RUN" in text


def test_an_ok_section_beats_an_earlier_failed_one(tmp_path):
    failed = synthetic_device_doc()
    failed["sections"]["P1"] = {"title": "x", "status": "error", "error": "boom", "data": {}}
    a = render.load([_write(tmp_path, "a.json", failed)])
    b = render.load([_write(tmp_path, "b.json", synthetic_device_doc())])
    chosen = render.choose(a + b)
    assert chosen["P1"][0].path.name == "b.json"
    assert chosen["P2"][0].path.name == "a.json"
    only_failed = render.choose(a)
    assert only_failed["P1"][1]["status"] == "error"


def test_error_section_shows_the_error_and_no_figures(tmp_path):
    doc = synthetic_device_doc()
    doc["sections"]["P4"] = {"title": "x", "status": "error",
                             "error": "RuntimeError: CUDA out of memory", "data": {}}
    text = render.render_files([_write(tmp_path, "a.json", doc)], tmp_path / "b.md",
                               tmp_path / "img", plots=False).read_text()
    p4 = text.split("## P4:")[1].split("## ")[0]
    assert "CUDA out of memory" in p4 and "eager us" not in p4


def test_wrong_schema_is_refused(tmp_path):
    path = _write(tmp_path, "x.json", {"schema": "other", "sections": {}})
    with pytest.raises(ValueError, match="schema"):
        render.load([path])


def test_rows_that_failed_render_with_their_error(tmp_path):
    doc = synthetic_device_doc()
    secs = doc["sections"]
    secs["P1"]["data"]["rows"][0] = {"B": 128, "L": 4096, "H": 128,
                                     "error": "OutOfMemoryError: CUDA out of memory"}
    secs["P3"]["data"]["rows"][1] = {"H": 128, "L": 32768, "error": "RuntimeError: capture"}
    secs["prefill"]["data"]["rows"][0] = {"prefix": 0, "extend": 512, "error": "ValueError: x"}
    secs["P4"]["data"]["rows"].append({"variant": "flash_attn_cute", "error": "Unsupported"})
    secs["P6"]["data"]["rows"].append({"variant": "flashinfer_mla", "B": 1, "L": 2, "H": 3,
                                       "error": "boom"})
    secs["P1"]["data"]["variants"].append("flash_attn_cute")
    for row in secs["P1"]["data"]["rows"][1:]:
        row["results"]["flash_attn_cute"] = {"not_declared": "absorbed qv is Blackwell-only"}
    secs["P3"]["data"]["checks"] = [c.to_dict() for c in graphs.p3_checks(secs["P3"]["data"],
                                                                           32768)]
    text = render.render_files([_write(tmp_path, "a.json", doc)], tmp_path / "b.md",
                               tmp_path / "img").read_text()
    for err in ("CUDA out of memory", "RuntimeError: capture", "ValueError: x", "Unsupported",
                "boom", "Not declared for these requests", "absorbed qv is Blackwell-only"):
        assert err in text
    # the P3 checks at 32k lost their row: not measured, with the reason from the data
    assert "*Why it was not measured:*" in text
