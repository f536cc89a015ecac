"""`attnreg calibrate`: refuses without CUDA, and its CPU dry run writes a valid profile.

The dry run exercises measurement -> fit -> JSON with the reference backend and
tiny shapes; its times are wall clock on a busy CPU and are never asserted on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnreg.cli import main
from attnreg.commands import calibrate
from attnreg.graph_policy.cost_profile import (
    PROFILE_SCHEMA,
    TERM_FEATURES,
    TERMS,
    PrefillShape,
    load_profile,
)
from attnreg.profiling import DRY_LAYER, MLALayer, kv_slots_of, random_pool, rel_error

torch = pytest.importorskip("torch")

#: A smaller grid than the default dry run: every term still gets measurements.
TINY = ["--batch-sizes", "1,2", "--prefixes", "0,8", "--extends", "4", "--layer-tokens", "4,8"]


def test_without_cuda_it_exits_2_with_a_message(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["calibrate", "--backend", "triton", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "no CUDA device" in err and "--dry-run" in err
    assert not (tmp_path / "p.json").exists()


def test_a_real_run_needs_a_backend(capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code = main(["calibrate"])
    assert code == 2 and "pass --backend NAME" in capsys.readouterr().err


def test_bad_grid_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--extends", "0"], ["--heads", "0"], ["--batch-sizes", "0"],
                 ["--prefixes", "a,b"], ["--page-size", "0"]):
        with pytest.raises(SystemExit) as exc:  # argparse refuses it, like --batch-sizes 0
            main(["calibrate", "--dry-run", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument {argv[0]}: " in err, err
        assert len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    out = tmp_path_factory.mktemp("calibrate") / "dry.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(["calibrate", "--dry-run", *TINY, "--out", str(out)])
    return code, out, buf.getvalue()


def test_dry_run_writes_a_schema_valid_profile(dry_run: tuple[int, Path, str]) -> None:
    code, out, _ = dry_run
    assert code == 0
    profile = load_profile(out)  # validates the schema
    assert profile.backend == "reference" and str(profile.platform) == "cpu"
    assert profile.dry_run is True
    data = json.loads(out.read_text())
    assert data["schema"] == PROFILE_SCHEMA and data["schema_version"] == 1
    assert "DRY RUN" in data["note"]
    assert data["checks"]["passed"] is True
    for key in ("device", "created", "versions", "calibration", "measurements"):
        assert data[key], key
    assert data["versions"]["torch"] == torch.__version__


def test_dry_run_fits_every_term_from_its_measurements(dry_run: tuple[int, Path, str]) -> None:
    _, out, _ = dry_run
    data: dict[str, Any] = json.loads(out.read_text())
    measured = [m for m in data["measurements"] if "us" in m and m["term"] in TERMS]
    assert {m["term"] for m in measured} == set(TERMS)
    for term in TERMS:
        entry = data["terms"][term]
        assert set(entry["coefficients_us"]) == set(TERM_FEATURES[term])
        assert entry["fit"]["points"] == sum(1 for m in measured if m["term"] == term)
    # Every fitted measurement carries its prediction, which the stored coefficients give.
    for m in measured:
        coefs = data["terms"][m["term"]]["coefficients_us"]
        b = m["batch"]
        f = PrefillShape(tuple(b["prefix_lens"]), tuple(b["extend_lens"]), b["heads"]).features()
        assert m["predicted_us"] == pytest.approx(sum(c * f[k] for k, c in coefs.items()))
        assert m["relative_residual"] == pytest.approx(
            (m["predicted_us"] - m["us"]) / max(m["us"], 1e-3))


def test_dry_run_summary_names_terms_and_crossover(dry_run: tuple[int, Path, str]) -> None:
    _, out, text = dry_run
    for term in TERMS:
        assert term in text
    assert "crossover (1 sequence, 4 heads" in text and "at prefix 32768" in text
    assert f"written to {out}" in text
    assert "DRY RUN" in text


def test_json_output_is_the_profile(capsys: pytest.CaptureFixture[str],
                                    tmp_path: Path) -> None:
    code = main(["calibrate", "--dry-run", "--batch-sizes", "1", "--prefixes", "0",
                 "--extends", "4", "--layer-tokens", "4", "--json",
                 "--out", str(tmp_path / "p.json")])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["written_to"] == str(tmp_path / "p.json")
    assert data["dry_run"] is True and set(data["terms"]) == set(TERMS)


def test_default_path_is_under_the_user_cache(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = calibrate.default_profile_path("triton", "cuda:sm90", "bf16")
    assert path == tmp_path / "attnreg" / "profiles" / "triton-cuda-sm90-bf16.json"
    dry = calibrate.default_profile_path("reference", "cpu", "bf16", dry_run=True)
    assert dry.name == "reference-cpu-bf16-dry-run.json"


def test_absorbed_and_mha_paths_of_the_layer_agree() -> None:
    """The check calibrate relies on: W_UK/W_UV absorption reproduces the MHA form."""
    from attnreg.registry import get_registry
    from attnreg.runtime import MLAConfig, extend_batch

    heads = 2
    cfg = MLAConfig(num_heads=heads, page_size=1, device="cpu", max_context_len=64)
    backend = get_registry().create("reference", cfg, platform="cpu")
    layer = MLALayer(torch, DRY_LAYER, heads, "cpu", seed=0, max_positions=64)
    pool = random_pool(torch, cfg, 20, seed=1)
    pages = pool.allocate([20])
    batch = extend_batch(pool, [12], [8], pages=pages)
    x = torch.randn(8, DRY_LAYER.hidden, dtype=torch.bfloat16)
    positions = torch.arange(12, 20)
    slots = kv_slots_of(torch, pool, pages, [20])
    out_mha = layer.forward_mha(x, positions, backend, pool, batch, slots)
    out_abs = layer.forward_absorbed(x, positions, backend, pool, batch)
    assert rel_error(torch, out_abs - x, out_mha - x) < 2e-2
    # ... and a wrong weight is caught.
    layer.w_uv = layer.w_uv.flip(0)
    out_bad = layer.forward_absorbed(x, positions, backend, pool, batch)
    assert rel_error(torch, out_bad - x, out_mha - x) > 0.3
