"""Fitting a cost profile's terms and finding its crossover (attnreg.profiling)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from attnreg.graph_policy import replay
from attnreg.graph_policy.cost_profile import TERM_FEATURES, TERMS, CostProfile, PrefillShape
from attnreg.profiling import (
    batch_record,
    bucket_for,
    crossover_extend,
    fit_profile_terms,
    fit_term,
    shape_of_record,
)

from ._helpers import HEADS, profile

# -- fitting ----------------------------------------------------------------------------

def _synthetic(term: str, coefficients: dict[str, float], noise: float = 0.0,
               seed: int = 0) -> list[tuple[dict[str, float], float]]:
    rng = random.Random(seed)
    samples = []
    for b in (1, 4):
        for prefix in (0, 4096, 16384):
            for extend in (128, 512, 2048, 4096):
                f = PrefillShape.uniform(b, prefix, extend, HEADS).features()
                y = sum(c * f[k] for k, c in coefficients.items())
                samples.append((f, y * (1.0 + noise * rng.uniform(-1, 1))))
    return samples


@pytest.mark.parametrize("term, truth", [
    ("absorbed_attention", {"one": 12.0, "head_pairs": 3.5e-7, "head_q_tokens": 2e-4,
                            "kv_tokens": 1e-3}),
    ("mha_attention", {"one": 8.0, "head_pairs": 1.1e-7, "head_q_tokens": 0.0,
                       "head_kv_tokens": 4e-5}),
    ("decompress", {"one": 20.0, "head_kv_tokens": 1.2e-4, "kv_tokens": 0.0}),
    ("eager_host", {"one": 150.0, "sequences": 4.0}),
])
def test_fit_recovers_known_coefficients(term: str, truth: dict[str, float]) -> None:
    fit = fit_term(_synthetic(term, truth), TERM_FEATURES[term])
    for feature, value in truth.items():
        assert fit.coefficients[feature] == pytest.approx(value, rel=1e-6, abs=1e-12), feature
    assert fit.max_abs_relative_residual < 1e-9
    assert fit.summary()["points"] == 24


def test_fit_keeps_coefficients_non_negative_and_is_close_under_noise() -> None:
    truth = {"one": 30.0, "head_pairs": 2e-7, "head_q_tokens": 0.0, "kv_tokens": 0.0}
    fit = fit_term(_synthetic("absorbed_attention", truth, noise=0.05, seed=3),
                   TERM_FEATURES["absorbed_attention"])
    assert all(c >= 0 for c in fit.coefficients.values())
    assert fit.coefficients["head_pairs"] == pytest.approx(2e-7, rel=0.1)
    assert fit.max_abs_relative_residual < 0.15


def test_fit_clamps_a_feature_that_would_go_negative() -> None:
    # Times that fall with kv_tokens: unconstrained least squares gives a negative slope.
    samples = [({"one": 1.0, "kv_tokens": float(k)}, 100.0 - 0.001 * k)
               for k in (0, 1000, 5000, 20000)]
    fit = fit_term(samples, ("one", "kv_tokens"))
    assert fit.coefficients["kv_tokens"] == 0.0
    assert fit.coefficients["one"] > 0


def test_fit_is_deterministic() -> None:
    samples = _synthetic("mha_attention", {"one": 5.0, "head_pairs": 1e-7}, noise=0.1, seed=9)
    fits = {tuple(fit_term(samples, TERM_FEATURES["mha_attention"]).coefficients.items())
            for _ in range(3)}
    assert len(fits) == 1


@pytest.mark.parametrize("samples, features, message", [
    ([], ("one",), "without measurements"),
    ([({"one": 1.0}, 1.0)], ("flops",), "unknown features"),
    ([({"one": 1.0}, -1.0)], ("one",), "not a finite non-negative time"),
    ([({"one": 1.0}, 1.0)], ("one", "q_tokens"), "lacks the features"),
    ([({"q_tokens": 0.0}, 1.0)], ("q_tokens",), "every feature is zero"),
])
def test_fit_refuses_bad_input(samples: Any, features: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_term(samples, features)


# -- crossover --------------------------------------------------------------------------

def _brute_force(profile: CostProfile, prefix: int, max_extend: int,
                 buckets: tuple[int, ...]) -> int:
    """The largest E with the graph winning for every extend in 1..E."""
    for e in range(1, max_extend + 1):
        padded = next((b for b in buckets if b >= e), e)
        shape = PrefillShape.uniform(1, prefix, e, HEADS)
        if not profile.compare(shape, graph_tokens=padded).graph_wins:
            return e - 1
    return max_extend


BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)


@pytest.mark.parametrize("prefix", [0, 4096, 32768])
@pytest.mark.parametrize("layer", [{"one": 0.0}, {"one": 20.0, "q_tokens": 0.02}])
def test_crossover_matches_a_brute_force_scan(prefix: int, layer: dict[str, float]) -> None:
    p = profile(layer_gpu=layer)
    point = crossover_extend(p, heads=HEADS, prefix=prefix, max_extend=4096, buckets=BUCKETS)
    assert point.max_graph_extend == _brute_force(p, prefix, 4096, BUCKETS)
    assert 0 < point.max_graph_extend < 4096  # the profile really crosses over here


def test_crossover_of_the_default_synthetic_profile_by_hand() -> None:
    # graph = 1.28e-4 * pairs, eager = max(100, 3.84e-5 * pairs): the graph wins while
    # pairs < 781250, i.e. E (E + 1) / 2 < 781250 at prefix 0: E <= 1249.
    point = crossover_extend(profile(), heads=HEADS, prefix=0, max_extend=8192)
    assert point.max_graph_extend == 1249
    assert point.describe() == ("absorbed graph for extend <= 1249 tokens at prefix 0, "
                                "eager MHA above")


def test_crossover_extremes_are_described() -> None:
    never = profile(eager_host={"one": 0.0})  # eager is always cheaper
    point = crossover_extend(never, heads=HEADS, prefix=0, max_extend=512)
    assert point.max_graph_extend == 0
    assert point.describe() == "eager MHA for every extend length at prefix 0"
    always = profile(eager_host={"one": 1e9})
    point = crossover_extend(always, heads=HEADS, prefix=4096, max_extend=512)
    assert point.max_graph_extend == 512
    assert point.describe() == "absorbed graph for every extend <= 512 tokens at prefix 4096"


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 4096, 4097])
def test_crossover_pads_tokens_as_the_replay_gate_does(tokens: int) -> None:
    # graph_policy keeps a private copy for the gate (it cannot import profiling): the two
    # must agree, or the crossover would describe padding the gate does not do.
    assert bucket_for(tokens, BUCKETS) == replay._bucket(tokens, BUCKETS)
    assert bucket_for(tokens, BUCKETS) == next((b for b in BUCKETS if b >= tokens), None)


# -- calibration records ----------------------------------------------------------------

def test_fit_profile_terms_fits_each_term_and_annotates_its_records() -> None:
    shapes = [PrefillShape.uniform(b, p, e, HEADS) for b in (1, 2) for p in (0, 512)
              for e in (16, 64)]
    records: list[dict[str, Any]] = []
    for s in shapes:
        for term in TERMS:
            if term != "graph_host":
                records.append({"term": term, "batch": batch_record(s),
                                "us": 10.0 + s.features()["q_tokens"]})
    records.append({"term": "layer_gpu", "batch": batch_record(shapes[0]),
                    "skipped": "time budget used up"})
    terms, missing = fit_profile_terms(records)
    assert missing == ["graph_host"] and set(terms) == set(TERMS) - {"graph_host"}
    assert terms["layer_gpu"]["coefficients_us"] == pytest.approx({"one": 10.0,
                                                                    "q_tokens": 1.0})
    assert terms["layer_gpu"]["features"] == list(TERM_FEATURES["layer_gpu"])
    timed = [r for r in records if "us" in r]
    assert all("predicted_us" in r and "relative_residual" in r for r in timed)
    assert "predicted_us" not in records[-1]


def test_batch_records_round_trip() -> None:
    shape = PrefillShape((0, 7), (3, 5), heads=4)
    assert shape_of_record(batch_record(shape)) == shape
