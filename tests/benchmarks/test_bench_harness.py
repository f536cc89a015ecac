"""The benchmark harness: section selection, failure isolation, JSON, a CPU dry run.

No figure is measured here: the dry run uses tiny shapes and the Triton
interpreter only to prove the code path a device call will take.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness
from benchmarks._harness import (
    RunContext,
    Section,
    SkipSection,
    run_sections,
    select_sections,
)


def test_select_all_in_run_order():
    sections, named = select_sections(None)
    assert [s.id for s in sections] == [s.id for s in _harness.SECTIONS]
    assert named == set()


def test_select_only_adds_what_a_section_reads():
    sections, named = select_sections("p2")
    assert [s.id for s in sections] == ["ceilings", "P2"]
    assert named == {"P2"}


def test_select_skip_and_unknown():
    sections, _ = select_sections("P1,P3", skip="ceilings")
    assert [s.id for s in sections] == ["P1", "P3"]
    with pytest.raises(ValueError, match="unknown section"):
        select_sections("P9")


@dataclass(frozen=True)
class FakeSection(Section):
    fn: Any = None

    def load(self):  # type: ignore[override]
        return self.fn


def _ok(ctx, data):
    data["value"] = 1


def _boom(ctx, data):
    data["rows"] = [{"partial": True}]
    raise RuntimeError("kernel exploded")


def _skip(ctx, data):
    raise SkipSection("no flashinfer here")


def _ctx(tmp_path: Path, **kw) -> RunContext:
    return RunContext(out_dir=tmp_path, dry_run=True, command="test", **kw)


def test_a_failing_section_does_not_lose_the_others(tmp_path):
    secs = [FakeSection("A", "a", "x:y", fn=_ok), FakeSection("B", "b", "x:y", fn=_boom),
            FakeSection("C", "c", "x:y", fn=_skip), FakeSection("D", "d", "x:y", fn=_ok)]
    doc = run_sections(_ctx(tmp_path), secs, set())
    status = {k: v["status"] for k, v in doc["sections"].items()}
    assert status == {"A": "ok", "B": "error", "C": "skipped", "D": "ok"}
    assert "kernel exploded" in doc["sections"]["B"]["error"]
    assert doc["sections"]["B"]["data"]["rows"] == [{"partial": True}]
    assert doc["sections"]["C"]["reason"] == "no flashinfer here"
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["sections"]["D"]["data"] == {"value": 1}
    assert on_disk["schema"] == _harness.SCHEMA
    for key in ("command", "date_utc", "device", "versions", "python"):
        assert key in on_disk["meta"]


def test_time_budget_skips_what_would_start_late(tmp_path):
    doc = run_sections(_ctx(tmp_path, time_budget_s=-1.0),
                       [FakeSection("A", "a", "x:y", fn=_ok)], set())
    assert doc["sections"]["A"]["status"] == "skipped"
    assert "time budget" in doc["sections"]["A"]["reason"]


def test_device_sections_need_cuda_or_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(RunContext, "cuda", property(lambda self: False))
    ctx = RunContext(out_dir=tmp_path, dry_run=False, command="test")
    doc = run_sections(ctx, [FakeSection("A", "a", "x:y", fn=_ok)], set())
    assert doc["sections"]["A"]["status"] == "skipped"
    assert "CUDA" in doc["sections"]["A"]["reason"]


def test_host_section_runs_on_a_gpu_machine_only_when_named(tmp_path, monkeypatch):
    monkeypatch.setattr(RunContext, "cuda", property(lambda self: True))
    host = FakeSection("H", "h", "x:y", where="host", results="cpu-h.json", fn=_ok)
    doc = run_sections(_ctx(tmp_path), [host], set())
    assert doc["sections"]["H"]["status"] == "skipped"
    assert "benchmarks/results/cpu-h.json" in doc["sections"]["H"]["reason"]
    assert host.host_command == ("python -m benchmarks --only H --out bench-out/h && "
                                 "cp bench-out/h/results.json benchmarks/results/cpu-h.json")
    doc = run_sections(_ctx(tmp_path), [host], {"H"})
    assert doc["sections"]["H"]["status"] == "ok"


def test_cpu_timer_reports_a_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(RunContext, "cuda", property(lambda self: False))
    calls = []
    t = _ctx(tmp_path).time(lambda: calls.append(1))
    assert len(calls) == 4  # one warm-up + three timed
    assert t["min_us"] <= t["median_us"] <= t["max_us"] and t["n"] == 3
    assert "dry run" in t["method"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


#: On a GPU machine the benchmark itself is the end-to-end run (and a dry run there would
#: JIT-compile real flashinfer kernels); these stand in for it on CPU machines.
cpu_only = pytest.mark.skipif(_has_cuda(), reason="CPU stand-in for the device run")


@cpu_only
def test_dry_run_p1_end_to_end(tmp_path):
    """The decode section through the registry on tiny shapes (Triton interpreter on CPU)."""
    from benchmarks.__main__ import main

    rc = main(["--dry-run", "--only", "P1", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, doc
    assert [*doc["sections"]] == ["ceilings", "P1"]
    p1 = doc["sections"]["P1"]
    assert p1["status"] == "ok", p1
    assert doc["meta"]["dry_run"] is True
    for row in p1["data"]["rows"]:
        res = row["results"]["triton"]
        assert res["correct"], res  # checked against the float32 reference before timing
        assert res["us"] > 0 and res["GBps"] > 0
    assert p1["data"]["checks"][0]["id"] == "P1"


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """tests/backends_lib's CPU stand-in for flashinfer, on a simulated sm90 platform."""
    import importlib.machinery

    tests_dir = str(ROOT / "tests")
    if tests_dir not in sys.path:
        monkeypatch.syspath_prepend(tests_dir)
    from backends_lib.fakes import install_fake_flashinfer

    calls = install_fake_flashinfer(monkeypatch, version="0.6")
    for name in ("flashinfer", "flashinfer.mla", "flashinfer.prefill", "flashinfer.decode"):
        # the registry asks importlib.util.find_spec whether flashinfer is importable
        monkeypatch.setattr(sys.modules[name], "__spec__",
                            importlib.machinery.ModuleSpec(name, None), raising=False)
    monkeypatch.setenv("ATTNREG_PLATFORM", "cuda:sm90")
    return calls


@cpu_only
def test_dry_run_drives_flashinfer_variants_and_its_direct_baseline(tmp_path, fake_flashinfer):
    """P1's fa3 / fa2 rows and P6's hand-driven flashinfer wrapper, against the fake library."""
    from benchmarks import overhead
    from benchmarks.__main__ import main

    rc = main(["--dry-run", "--only", "P1", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, doc
    p1 = doc["sections"]["P1"]["data"]
    assert p1["variants"] == ["triton", "flashinfer_mla/fa3", "flashinfer_mla/fa2",
                              "triton (page 64)"]
    assert "Blackwell" in p1["skipped_variants"]["trtllm_mla"]
    # the FlashMLA plugin is not loaded here (tests turn plugin autoload off): a row saying why
    assert "flashmla (page 64)" in p1["skipped_variants"]
    for row in p1["rows"]:
        for label in p1["variants"]:
            res = row["results"][label]
            assert res["correct"] and res["mode"] == "graph", (label, res)
    assert {w.backend for w in fake_flashinfer.wrappers} == {"fa3", "fa2"}
    assert any(p["graph"] for p in fake_flashinfer.mla_plans)

    ctx = _ctx(tmp_path)
    row = overhead._measure(ctx, overhead.VARIANTS[1], (2, 32, 16))
    assert row["baseline"] == "kernel_with_plan"
    assert row["max_abs_diff_backend_vs_kernel"] < 0.05
    for path in ("kernel", "kernel_with_plan", "backend", "backend_planned_once"):
        assert row[path]["median_us"] > 0 and row["host_us"][path] > 0


@cpu_only
def test_prefill_times_the_mha_path_of_a_backend_without_absorbed_prefill(tmp_path,
                                                                          monkeypatch):
    """flash_attn_cute on sm90 serves MHA prefill only: its MHA side is still timed.

    Stand-in: triton with its absorbed (MLA) prefill reported as not declared.
    """
    from benchmarks import prefill
    from benchmarks.__main__ import main
    from benchmarks._report import Page, Plotter

    real = prefill.declared_reasons

    def no_absorbed(ctx, v, method, phase, **kw):
        if v.backend == "triton" and method == "mla":
            return ["triton has no mla kernel for prefill here (test stand-in)"]
        return real(ctx, v, method, phase, **kw)

    monkeypatch.setattr(prefill, "declared_reasons", no_absorbed)
    # checked on the last rows only (the reference's fp32 scores would not fit at 32k x 4k)
    monkeypatch.setattr(prefill, "REFERENCE_ROWS", 5)
    rc = main(["--dry-run", "--only", "prefill", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, doc
    data = doc["sections"]["prefill"]["data"]
    res = data["rows"][0]["results"]["triton"]
    assert "absorbed" not in res and res["mha"]["us"] > 0, res
    assert "test stand-in" in res["absorbed_not_declared"]
    assert res["agree"], res["rel_diff_mha_vs_reference"]  # MHA matches the reference's MLA
    assert res["reference_rows"] == 5
    assert "triton" not in data["summary"]  # no absorbed / MHA ratio to summarise
    text = "\n".join(prefill.render(data, Page(Plotter(tmp_path / "img", enabled=False),
                                                 "img")))
    assert "vs reference" in text and "test stand-in" in text


def test_saved_flashinfer_cache_is_never_newer_than_ninja_recorded(tmp_path, monkeypatch):
    """ninja's deps log keeps ns mtimes and calls an object stale when the file is newer:
    the archive must round member times down, never to the nearest microsecond."""
    import os
    import tarfile

    from benchmarks.__main__ import save_flashinfer_jit_cache

    home = tmp_path / "home"
    obj = home / ".cache" / "flashinfer" / "0.6.13" / "90a" / "cached_ops" / "m" / "m.cuda.o"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"\0" * 16)
    recorded_ns = 1795962071913207984  # a time whose microsecond rounds up (…208000)
    os.utime(obj, ns=(recorded_ns, recorded_ns))
    monkeypatch.setattr(Path, "home", lambda: home)
    monkeypatch.setitem(sys.modules, "flashinfer", sys.modules.get("flashinfer", object()))
    archive = save_flashinfer_jit_cache(tmp_path / "out")
    assert archive is not None
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="tar")
    unpacked = tmp_path / "unpacked" / "flashinfer" / obj.relative_to(home / ".cache" /
                                                                      "flashinfer")
    restored = unpacked.stat().st_mtime_ns
    assert restored <= recorded_ns and recorded_ns - restored < 10**9


@cpu_only
def test_p3_lists_a_backend_without_absorbed_paths_as_not_declared(tmp_path, monkeypatch):
    """flash_attn_cute on sm90 has no absorbed decode or extend: "not declared", not an error.

    Stand-in: triton with both its absorbed paths reported as not declared.
    """
    from benchmarks import split_kv
    from benchmarks.__main__ import main

    def nothing_absorbed(ctx, v, method, phase, **kw):
        return ["no absorbed path here (test stand-in)"] if v.backend == "triton" else []

    real_create = split_kv.create_backend

    def create(ctx, v, **kw):
        if v.backend == "triton":  # as flash_attn_cute's graph state refuses on sm90
            raise RuntimeError("built although neither path is declared")
        return real_create(ctx, v, **kw)

    monkeypatch.setattr(split_kv, "declared_reasons", nothing_absorbed)
    monkeypatch.setattr(split_kv, "create_backend", create)
    rc = main(["--dry-run", "--only", "P3", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    doc = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, doc
    for row in doc["sections"]["P3"]["data"]["rows"]:
        for label, res in row["results"].items():
            if label.startswith("triton"):
                assert set(res) == {"decode", "extend"}, res
                assert all("test stand-in" in res[k]["not_declared"] for k in res), res
