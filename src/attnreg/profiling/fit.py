"""Fitting a cost profile's terms to measurements (``attnreg calibrate``).

Each term of :mod:`attnreg.graph_policy.cost_profile` is a non-negative
linear combination of batch features.  :func:`fit_term` fits one term by
least squares with non-negative coefficients, weighted by ``1 / measured``
(relative error, so a 100 us point counts as much as a 100 ms one);
:func:`fit_profile_terms` fits every term from calibration's measurement
records and annotates each record with its prediction.  Startup never fits:
it only reads a profile and predicts (``graph_policy``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attnreg.graph_policy.cost_profile import FEATURES, TERM_FEATURES, TERMS, PrefillShape

__all__ = ["FitResult", "batch_record", "fit_profile_terms", "fit_term", "shape_of_record"]


def batch_record(shape: PrefillShape) -> dict[str, Any]:
    """The ``batch`` object of a measurement record (the profile JSON's format)."""
    return {"prefix_lens": list(shape.prefix_lens), "extend_lens": list(shape.extend_lens),
            "heads": shape.heads}


def shape_of_record(batch: Mapping[str, Any]) -> PrefillShape:
    """The inverse of :func:`batch_record`."""
    return PrefillShape(tuple(batch["prefix_lens"]), tuple(batch["extend_lens"]),
                        batch["heads"])


@dataclass(frozen=True)
class FitResult:
    """A fitted term and how well it fits its measurements.

    ``relative_residuals[i] = (predicted_i - measured_i) / measured_i``.
    """

    coefficients: dict[str, float]
    predicted_us: tuple[float, ...]
    relative_residuals: tuple[float, ...]

    @property
    def points(self) -> int:
        return len(self.predicted_us)

    @property
    def max_abs_relative_residual(self) -> float:
        return max((abs(r) for r in self.relative_residuals), default=0.0)

    @property
    def rms_relative_residual(self) -> float:
        n = len(self.relative_residuals)
        return math.sqrt(sum(r * r for r in self.relative_residuals) / n) if n else 0.0

    def summary(self) -> dict[str, object]:
        return {"points": self.points,
                "max_abs_relative_residual": self.max_abs_relative_residual,
                "rms_relative_residual": self.rms_relative_residual,
                "method": "non-negative least squares, weights 1/measured"}


#: Measured times below this (microseconds) are weighted as if they were this.
_MIN_WEIGHT_US = 1e-3


def fit_term(samples: Iterable[tuple[Mapping[str, float], float]],
             features: Sequence[str]) -> FitResult:
    """Fit ``measured_us ~ sum_f c_f * feature_f`` with every ``c_f >= 0``.

    Least squares on relative errors (each row divided by its measurement).
    The non-negativity constraint is solved exactly by trying every subset of
    features (at most 2^4 here) and keeping the feasible least-squares
    solution with the smallest error; ties go to fewer features, then to the
    order of ``features``, so the fit is deterministic.

    Parameters
    ----------
    samples
        ``(features, measured_us)`` pairs; ``features`` maps every name in
        ``features`` to its value for that measurement.
    features
        The features to fit (names from :data:`FEATURES`).

    Raises
    ------
    ValueError
        No samples, an unknown feature, or a negative / non-finite measurement.
    """
    rows = [(dict(f), float(y)) for f, y in samples]
    if not rows:
        raise ValueError("cannot fit a term without measurements")
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {list(FEATURES)}")
    for feats, y in rows:
        if not math.isfinite(y) or y < 0:
            raise ValueError(f"measurement {y!r} us is not a finite non-negative time")
        missing = [f for f in features if f not in feats]
        if missing:
            raise ValueError(f"a sample lacks the features {missing}")
    weights = [1.0 / max(y, _MIN_WEIGHT_US) for _, y in rows]
    best: tuple[float, int, int, list[float]] | None = None
    subsets = [s for k in range(1, len(features) + 1)
               for s in itertools.combinations(range(len(features)), k)]
    for order, subset in enumerate(subsets):
        cols = [[feats[features[j]] * w for (feats, _), w in zip(rows, weights)] for j in subset]
        target = [y * w for (_, y), w in zip(rows, weights)]
        solution = _least_squares(cols, target)
        if solution is None or any(c < 0 for c in solution):
            continue
        sse = sum((sum(c * col[i] for c, col in zip(solution, cols)) - target[i]) ** 2
                  for i in range(len(rows)))
        coefs = [0.0] * len(features)
        for c, j in zip(solution, subset):
            coefs[j] = c
        # Round the error so that float noise does not decide between equal fits.
        key = (float(f"{sse:.9g}"), len(subset), order, coefs)
        if best is None or key[:3] < best[:3]:
            best = key
    if best is None:  # only possible when every feature column is zero
        raise ValueError(f"no non-negative fit exists for features {list(features)}: every "
                         "feature is zero on every measurement")
    coefs = best[3]
    coefficients = {f: c for f, c in zip(features, coefs)}
    predicted = tuple(sum(coefficients[f] * feats[f] for f in features) for feats, _ in rows)
    residuals = tuple((p - y) / max(y, _MIN_WEIGHT_US) for p, (_, y) in zip(predicted, rows))
    return FitResult(coefficients, predicted, residuals)


def _least_squares(cols: list[list[float]], target: list[float]) -> list[float] | None:
    """Least squares by modified Gram-Schmidt QR; None when the columns are dependent.

    Columns are scaled to unit max-norm first: features span ten orders of
    magnitude (``one`` against ``head_pairs``), which would otherwise lose
    every digit of the small ones.
    """
    n_rows = len(target)
    if len(cols) > n_rows:
        return None
    scales = []
    scaled = []
    for col in cols:
        s = max((abs(v) for v in col), default=0.0)
        if s == 0.0:
            return None
        scales.append(s)
        scaled.append([v / s for v in col])
    q: list[list[float]] = []
    r = [[0.0] * len(cols) for _ in cols]
    for j, col in enumerate(scaled):
        v = list(col)
        norm0 = math.sqrt(sum(x * x for x in v))
        for i, qi in enumerate(q):
            rij = sum(a * b for a, b in zip(qi, v))
            r[i][j] = rij
            v = [a - rij * b for a, b in zip(v, qi)]
        rjj = math.sqrt(sum(x * x for x in v))
        if rjj <= 1e-10 * norm0:
            return None  # dependent columns: another subset covers this fit
        r[j][j] = rjj
        q.append([x / rjj for x in v])
    qty = [sum(a * b for a, b in zip(qi, target)) for qi in q]
    x = [0.0] * len(cols)
    for i in range(len(cols) - 1, -1, -1):
        x[i] = (qty[i] - sum(r[i][k] * x[k] for k in range(i + 1, len(cols)))) / r[i][i]
    return [xi / s for xi, s in zip(x, scales)]


def fit_profile_terms(measurements: Sequence[dict[str, Any]]
                      ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Fit every term from its measurements; annotate each measurement with its prediction.

    Returns the ``terms`` object of the profile and the names of terms that
    had no measurement (fitted as zero, which makes the profile useless: the
    caller refuses it).
    """
    terms: dict[str, dict[str, Any]] = {}
    missing = []
    for term in TERMS:
        rows = [m for m in measurements if m.get("term") == term and "us" in m]
        features = TERM_FEATURES[term]
        if not rows:
            missing.append(term)
            continue
        samples = [(shape_of_record(m["batch"]).features(), float(m["us"])) for m in rows]
        fit = fit_term(samples, features)
        for m, pred, res in zip(rows, fit.predicted_us, fit.relative_residuals):
            m["predicted_us"] = pred
            m["relative_residual"] = res
        terms[term] = {"coefficients_us": fit.coefficients, "features": list(features),
                       "fit": fit.summary()}
    return terms, missing
