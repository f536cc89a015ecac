"""The `sparse` section (issue 32): its dry run on a CPU against the FlashMLA plugin's CPU
stand-in (tiny shapes, graphs replayed eagerly; nothing measured), its skips, its reference
and its arithmetic on made-up times.  The times below are test inputs, not measurements; the
lead runs the section on the H200 (`python -m benchmarks --only sparse --out bench-out/sparse
--no-render`)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from benchmarks import sparse_decode  # noqa: E402
from benchmarks._harness import RunContext, SkipSection  # noqa: E402
from benchmarks._report import Page, Plotter  # noqa: E402


def _has_cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def _plugin_installed() -> bool:
    try:
        importlib.metadata.distribution("attnreg-flashmla")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(_has_cuda(), reason="CPU stand-in for the device run")
@pytest.mark.skipif(not _plugin_installed(), reason="attnreg-flashmla is not installed")
def test_the_dry_run_runs_every_path_on_the_stand_in_and_measures_nothing(tmp_path,
                                                                          monkeypatch):
    from benchmarks.__main__ import main

    # the plugin through its entry point, as on the device (and no other plugin)
    monkeypatch.delenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("ATTNREG_PLUGINS", "flashmla")
    before = sys.modules.get("flash_mla")
    rc = main(["--dry-run", "--only", "sparse", "--out", str(tmp_path), "--no-jit-cache",
               "--no-render"])
    assert sys.modules.get("flash_mla") is before, "the stand-in is the section's only"
    doc = json.loads((tmp_path / "results.json").read_text())
    rec = doc["sections"]["sparse"]
    assert rc == 0 and rec["status"] == "ok", rec
    data = rec["data"]
    assert doc["meta"]["dry_run"] and "stand-in" in data["library"]
    assert data["top_k"] == sparse_decode.DRY_TOP_K and data["platform"] == "cuda:sm90"
    (row,) = data["rows"]
    assert (row["B"], row["L"], row["H"]) == sparse_decode.DRY_SHAPES[0]
    timed = {label: row["sparse"][label] for label in sparse_decode.SPARSE_LABELS}
    timed.update({f"{k} {d}": row["dense"][d][k] for d in sparse_decode.DTYPES
                  for k in (sparse_decode.PLUGIN, sparse_decode.RAW_DENSE)})
    for label, res in timed.items():
        assert res.get("correct") and res["us"] > 0, (label, res)
    assert "Triton interpreter" in row["dense"]["bf16"]["triton p64"]["skipped"]
    assert "flashinfer_mla p64" in row["dense"]["bf16"]
    # no shape of a dry run reaches L >= 8192: the one check is not measured, and says why
    (check,) = data["checks"]
    assert check["id"] == "sparse.vs_dense_bf16" and check["status"] == "not measured"
    assert "no shape of this run has L >= 8192" in check["detail"]
    text = "\n".join(sparse_decode.render(data, Page(Plotter(tmp_path, enabled=False), "img")))
    assert "**Sparse decode, top-k rows per sequence (us)**" in text
    assert "stand-in" in text and "`triton p64`: the Triton interpreter" in text


def test_without_cuda_or_the_stand_in_the_section_is_skipped_with_the_reason(tmp_path,
                                                                             monkeypatch):
    ctx = RunContext(out_dir=tmp_path, dry_run=True)
    monkeypatch.setattr(RunContext, "cuda", property(lambda self: False))
    monkeypatch.setattr(sparse_decode, "STAND_IN", tmp_path / "absent.py")
    with pytest.raises(SkipSection, match="no CUDA device and no CPU stand-in"):
        sparse_decode.run(ctx, {})


def test_with_cuda_and_no_flash_mla_the_section_is_skipped_with_the_reason(tmp_path,
                                                                           monkeypatch):
    ctx = RunContext(out_dir=tmp_path)
    monkeypatch.setattr(RunContext, "cuda", property(lambda self: True))
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    with pytest.raises(SkipSection, match="flash_mla is not importable.*sgl-flash-mla"):
        sparse_decode.run(ctx, {})


def test_a_kernel_that_ignores_its_indices_is_marked_wrong(tmp_path):
    """Dense attention over every token is off the sparse reference by far more than the
    tolerance: the check before timing tells a kernel that ignores indices from a right one."""
    import torch

    from attnreg.profiling import random_pool, rel_error
    from attnreg.runtime import MLAConfig, decode_batch
    from benchmarks._backends import reference_decode

    ctx = RunContext(out_dir=tmp_path, dry_run=True)
    B, L, H, top_k = 2, 256, 4, 64
    cfg = MLAConfig(num_heads=H, page_size=64, kv_dtype="bf16", device="cpu",
                    max_context_len=L)
    pool = random_pool(torch, cfg, B * L, seed=1)
    batch = decode_batch(pool, [L] * B, shuffle=3)
    q = torch.randn(B, H, 576).bfloat16()
    idx = sparse_decode.topk_indices(ctx, batch, L, top_k, seed=2)
    assert idx.dtype == torch.int32 and idx.shape == (B, top_k)
    for b in range(B):  # distinct slots of the sequence's own pages
        pages = set(batch.page_table[b].tolist())
        assert len(set(idx[b].tolist())) == top_k
        assert {s // 64 for s in idx[b].tolist()} <= pages
    sparse_ref = sparse_decode.reference_sparse(ctx, q, pool, idx, cfg.softmax_scale)
    dense = reference_decode(ctx, q, pool, batch.page_table, [L] * B, cfg.softmax_scale)
    err = rel_error(torch, dense, sparse_ref)
    assert err > 10 * sparse_decode.MAX_REL_ERR["bf16"]
    res = sparse_decode._check_and_time(ctx, dense, sparse_ref, "bf16", lambda: None)
    assert not res["correct"] and "us" not in res and "not timed" in res["error"]
    # a top-k wider than the sequence pads with -1
    wide = sparse_decode.topk_indices(ctx, batch, L, L + 64, seed=2)
    assert bool((wide[:, L:] == -1).all()) and bool((wide[:, :L] >= 0).all())


def _res(us: float | None) -> dict[str, Any]:
    return {"us": us, "rel_err": 1e-3, "correct": True} if us else {"skipped": "x"}


def _row(B: int, L: int, H: int, sparse: dict[str, float | None],
         bf16: dict[str, float | None], fp8: dict[str, float | None] | None = None
         ) -> dict[str, Any]:
    return {"B": B, "L": L, "H": H, "top_k": 2048,
            "kv_rows": {"dense": B * L, "sparse": B * min(2048, L)},
            "sparse": {k: _res(v) for k, v in sparse.items()},
            "dense": {"bf16": {k: _res(v) for k, v in bf16.items()},
                      "fp8_e4m3": {k: _res(v) for k, v in (fp8 or {}).items()}}}


P, RAW = sparse_decode.PLUGIN, sparse_decode.RAW_DENSE
S8, R8 = sparse_decode.SPARSE_FP8, sparse_decode.RAW_SPARSE_FP8


def test_ratios_and_the_check_from_made_up_times():
    rows = [
        # L < 8192: reported, outside the check (sparse is slower here and that is allowed)
        _row(128, 4096, 128, {S8: 200.0, R8: 190.0}, {P: 150.0, RAW: 148.0}),
        _row(16, 8192, 64, {S8: 35.0, R8: 33.0}, {P: 66.0, RAW: 64.0, "triton p64": 70.0},
             {P: 50.0}),
        _row(1, 32768, 128, {S8: 20.0, R8: 19.0}, {P: 30.0, RAW: 28.0, "triton p64": 25.0}),
    ]
    r = sparse_decode.ratios(rows[1])
    assert r["fastest dense bf16 / sparse fp8"] == pytest.approx(64.0 / 35.0)
    assert r["plugin dense bf16 / sparse fp8"] == pytest.approx(66.0 / 35.0)
    assert r["plugin dense fp8 / sparse fp8"] == pytest.approx(50.0 / 35.0)
    assert r["raw dense bf16 / raw sparse fp8"] == pytest.approx(64.0 / 33.0)
    assert r["plugin / raw sparse fp8"] == pytest.approx(35.0 / 33.0)
    assert r["plugin dense bf16 / sparse bf16"] is None
    assert sparse_decode.fastest_dense(rows[2], "bf16") == ("triton p64", 25.0)
    (check,) = sparse_decode.checks({"rows": rows, "top_k": 2048})
    assert check.measured == pytest.approx(25.0 / 20.0)  # the worst shape in range
    assert check.status == "target met" and "(1, 32768, 128)" in check.detail
    assert "triton p64 bf16" in check.detail
    rows[2]["dense"]["bf16"]["triton p64"] = _res(19.0)
    (check,) = sparse_decode.checks({"rows": rows})
    assert check.measured == pytest.approx(19.0 / 20.0) and check.status == "missed"
    # a shape in range without a sparse time: not measured, and which one
    rows[1]["sparse"][S8] = {"error": "RuntimeError: x"}
    (check,) = sparse_decode.checks({"rows": rows})
    assert check.status == "not measured" and "(16, 8192, 64)" in check.detail
    rows[1] = {"B": 16, "L": 8192, "H": 64, "error": "OutOfMemoryError: y"}
    (check,) = sparse_decode.checks({"rows": rows})
    assert check.status == "not measured"


def test_render_shows_each_table_and_why_a_cell_is_empty(tmp_path):
    rows = [_row(16, 8192, 64, {S8: 35.0, R8: 33.0}, {P: 66.0, RAW: 64.0}),
            {"B": 64, "L": 8192, "H": 128, "skipped": "time budget used up"}]
    rows[0]["dense"]["bf16"]["flashinfer_mla p64"] = {"not_declared": "no fa3 here"}
    data = {"rows": rows, "top_k": 2048, "page_size": 64, "timing": "t", "library": "lib"}
    text = "\n".join(sparse_decode.render(data, Page(Plotter(tmp_path, enabled=False), "img")))
    assert "| 16, 8192, 64 | 35.0 | 33.0 | - | - |" in text
    assert "| 16, 8192, 64 | 4.0 | 1.83 | 1.89 |" in text  # rows read, fastest, plugin
    assert "`flashinfer_mla p64`: no fa3 here" in text
    assert "(64, 8192, 128): time budget used up" in text


def test_the_page_says_how_to_measure_the_section_when_it_never_ran(tmp_path):
    from benchmarks import render

    text = render.render_files([], tmp_path / "b.md", tmp_path / "img", plots=False,
                               results_dir=tmp_path / "none",
                               notes=tmp_path / "none.md").read_text()
    part = text.split("## sparse: ")[1].split("\n## ")[0]
    assert "Not measured yet. Run on the H200" in part
    assert "`python -m benchmarks --only sparse --out bench-out/sparse --no-render`" in part
    assert Path(sparse_decode.STAND_IN).is_file(), "the dry run's stand-in moved"
