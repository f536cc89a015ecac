"""Cost profiles: features, predictions, validation, files (what startup reads)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from attnreg.graph_policy import cost_profile as cp
from attnreg.graph_policy.cost_profile import (
    FEATURES,
    CostProfile,
    CostProfileError,
    PrefillShape,
    find_shipped_profile,
    load_profile,
    save_profile,
    shipped_profile_paths,
)

from ._helpers import EAGER_HOST_US, HEADS, mutated, profile, profile_dict


def test_features_count_causal_pairs_and_tokens() -> None:
    shape = PrefillShape((4, 0), (3, 2), heads=2)
    # sequence 1: queries see 5, 6, 7 keys; sequence 2: 1, 2 keys
    assert shape.pairs == 5 + 6 + 7 + 1 + 2
    f = shape.features()
    assert f == {"one": 1.0, "sequences": 2.0, "q_tokens": 5.0, "kv_tokens": 9.0,
                 "head_q_tokens": 10.0, "head_kv_tokens": 18.0, "head_pairs": 42.0}
    assert set(f) == set(FEATURES)


def test_shape_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="prefix_lens has 1 entries, extend_lens 2"):
        PrefillShape((0,), (1, 2), heads=1)
    with pytest.raises(ValueError, match="heads"):
        PrefillShape((0,), (1,), heads=0)


def test_predictions_follow_the_documented_formulas() -> None:
    p = profile(layer_gpu={"one": 7.0, "q_tokens": 0.5}, decompress={"kv_tokens": 0.25},
                graph_host={"one": 3.0})
    shape = PrefillShape.uniform(1, prefix=10, extend=4, heads=HEADS)
    pairs = 4 * 10 + 4 * 5 // 2
    absorbed = 1e-6 * HEADS * pairs
    mha = 3e-7 * HEADS * pairs
    layer, layer_padded = 7.0 + 0.5 * 4, 7.0 + 0.5 * 64
    assert p.predict_graph_absorbed(shape, graph_tokens=64) == pytest.approx(
        max(3.0, layer_padded + absorbed))
    assert p.predict_eager_mha(shape) == pytest.approx(
        max(EAGER_HOST_US, layer + mha + 0.25 * 14))
    cmp = p.compare(shape, graph_tokens=64)
    assert cmp.graph_us == p.predict_graph_absorbed(shape, graph_tokens=64)
    assert cmp.eager_us == p.predict_eager_mha(shape)
    assert dict(cmp.breakdown)["layer_gpu_graph"] == pytest.approx(layer_padded)


def test_ties_are_not_wins_for_the_graph() -> None:
    tie = profile(absorbed_attention={"one": 0.0}, mha_attention={"one": 0.0},
                  eager_host={"one": 0.0}, layer_gpu={"one": 5.0})
    shape = PrefillShape.uniform(1, 0, 8, HEADS)
    cmp = tie.compare(shape)
    assert cmp.graph_us == cmp.eager_us == 5.0 and not cmp.graph_wins
    # Differences below a nanosecond are ties too (compared after rounding).
    sub_ns = profile(absorbed_attention={"one": 0.0}, mha_attention={"one": 0.0},
                     eager_host={"one": 0.0}, layer_gpu={"one": 5.0},
                     decompress={"one": 0.0004})
    assert not sub_ns.compare(shape).graph_wins
    two_ns = profile(absorbed_attention={"one": 0.0}, mha_attention={"one": 0.0},
                     eager_host={"one": 0.0}, layer_gpu={"one": 5.0},
                     decompress={"one": 0.002})
    assert two_ns.compare(shape).graph_wins


def test_matches_backend_platform_and_kv_dtype() -> None:
    p = profile()
    assert p.matches("triton", "cuda:sm90", "bf16")
    assert p.matches("triton", "cuda:sm90a", "BF16")  # sm90a is the sm90 family
    assert not p.matches("flashinfer_mla", "cuda:sm90", "bf16")
    assert not p.matches("triton", "cuda:sm100", "bf16")
    assert not p.matches("triton", "cuda:sm90", "fp8_e4m3")


@pytest.mark.parametrize("change, problem", [
    (lambda d: d.update(schema="something.else"), "at `schema`: 'something.else' is not one of attnreg.cost_profile"),
    (lambda d: d.update(schema_version=0), "at `schema_version`: 0 is below the minimum 1"),
    (lambda d: d.update(backend=""), "at `backend`: expected a non-empty string"),
    (lambda d: d.update(platform="quantum:q1"), "at `platform`: unknown platform vendor"),
    (lambda d: d.update(kv_dtype="int4"), "at `kv_dtype`: 'int4' is not one of"),
    (lambda d: d.pop("terms"), "at `terms`: missing"),
    (lambda d: d["terms"].pop("decompress"), "at `terms.decompress`: missing"),
    (lambda d: d["terms"].update(extra={"coefficients_us": {"one": 1}}),
     "at `terms`: unknown terms ['extra']"),
    (lambda d: d["terms"]["layer_gpu"].update(coefficients_us={}),
     "at `terms.layer_gpu.coefficients_us`: expected a non-empty object"),
    (lambda d: d["terms"]["layer_gpu"].update(coefficients_us={"flops": 1.0}),
     "at `terms.layer_gpu.coefficients_us`: unknown key 'flops'"),
    (lambda d: d["terms"]["layer_gpu"].update(coefficients_us={"one": -1.0}),
     "at `terms.layer_gpu.coefficients_us.one`: -1.0 is below the minimum 0"),
    (lambda d: d["terms"]["layer_gpu"].update(coefficients_us={"one": "fast"}),
     "at `terms.layer_gpu.coefficients_us.one`: expected a number, got a string"),
    (lambda d: d["terms"]["layer_gpu"].update(coefficients_us={"one": math.inf}),
     "not a finite number"),
    (lambda d: d.update(calibration={"heads": 0}), "at `calibration.heads`: 0 is below the minimum 1"),
])
def test_malformed_profiles_name_the_source_and_the_problem(change: Any, problem: str) -> None:
    with pytest.raises(CostProfileError) as exc:
        CostProfile.from_dict(mutated(change), source="bad.json")
    message = str(exc.value)
    assert message.startswith("cost profile bad.json: ")
    assert problem in message
    assert "attnreg calibrate" in message  # what to do


def test_the_first_problems_are_listed_at_once() -> None:
    def two(d: dict[str, Any]) -> None:
        d.update(backend=3, kv_dtype="int4")

    with pytest.raises(CostProfileError) as exc:
        CostProfile.from_dict(mutated(two), source="x")
    assert "at `backend`" in str(exc.value) and "at `kv_dtype`" in str(exc.value)


def test_a_newer_schema_version_asks_for_an_upgrade() -> None:
    with pytest.raises(CostProfileError, match="newer than this attnreg reads.*upgrade attnreg"):
        CostProfile.from_dict(mutated(lambda d: d.update(schema_version=2)), source="new.json")


def test_malformed_files_raise_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(CostProfileError, match=f"cost profile {missing}: no such file"):
        load_profile(missing)
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": "attnreg.cost_profile",\n  "terms": [}')
    with pytest.raises(CostProfileError, match=f"{broken}: is not valid JSON .* line 2"):
        load_profile(broken)
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    with pytest.raises(CostProfileError, match=r"expected an object, got a list \(\[1, 2\]\)"):
        load_profile(not_object)


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    data = profile_dict()
    data["measurements"] = [{"term": "layer_gpu", "us": 1.0}]
    path = save_profile(data, tmp_path / "sub" / "p.json")
    loaded = load_profile(path)
    assert loaded.source == str(path)
    assert loaded.terms == profile().terms
    assert loaded.data["measurements"] == data["measurements"]  # kept, not interpreted
    again = save_profile(loaded, tmp_path / "again.json")
    assert json.loads(again.read_text())["terms"] == json.loads(path.read_text())["terms"]


def test_save_refuses_an_invalid_profile(tmp_path: Path) -> None:
    with pytest.raises(CostProfileError):
        save_profile(mutated(lambda d: d.update(kv_dtype="int4")), tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


# -- shipped profiles -------------------------------------------------------------------

def test_shipped_lookup_finds_the_matching_file(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    save_profile(profile_dict(backend="other"), tmp_path / "a-other.json")
    save_profile(profile_dict(), tmp_path / "b-h200-triton.json")
    second = profile_dict()
    second["device"] = "second"
    save_profile(second, tmp_path / "c-h100-triton.json")
    monkeypatch.setattr(cp, "shipped_profile_dir", lambda: tmp_path)
    found = find_shipped_profile("triton", "cuda:sm90", "bf16")
    assert found is not None and found.source.endswith("b-h200-triton.json")  # first by name
    assert find_shipped_profile("triton", "cuda:sm100") is None
    assert find_shipped_profile("nobody", "cuda:sm90") is None


def test_a_malformed_shipped_profile_is_an_error(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.json").write_text("{}")
    monkeypatch.setattr(cp, "shipped_profile_dir", lambda: tmp_path)
    with pytest.raises(CostProfileError, match="bad.json"):
        find_shipped_profile("triton", "cuda:sm90")


def test_shipped_profile_dir_is_the_package_data_dir() -> None:
    d = cp.shipped_profile_dir()
    assert d.parts[-3:] == ("attnreg", "data", "profiles")


@pytest.mark.parametrize("path", shipped_profile_paths(), ids=lambda p: p.name)
def test_every_shipped_profile_is_valid_and_measured(path: Path) -> None:
    loaded = load_profile(path)
    assert not loaded.dry_run, f"{path.name} is a dry-run profile: never ship one"
    assert loaded.data.get("checks", {}).get("passed") is True, path.name
