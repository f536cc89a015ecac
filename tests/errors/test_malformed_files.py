"""Every loader raises only its documented error type, whatever the file holds (issue 28).

Generated malformed files (bad encodings, deep nesting, huge numbers, wrong types, wrong
shapes, random bytes, valid documents with one value replaced) go to every JSON loader
attnreg has: ``load_profile`` and ``ReplayGate(cost_profile=path)`` (``CostProfileError``),
``Report.read_json`` (``ReportError``), ``read_json`` itself (``JSONFileError``), and the
``from_dict`` of each for already-parsed data.  A loader either accepts the document or
raises its error naming the file; any other exception fails the test.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnreg.graph_policy import GraphConfig, ModelFacts, ReplayGate, resolve
from attnreg.graph_policy.cost_profile import CostProfile, CostProfileError, load_profile
from attnreg.registry.jsonfile import MAX_DEPTH, JSONFileError, read_json
from attnreg.testing.report import Report, ReportError

from .test_cli_errors import valid_profile, valid_report

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_PLAN = None


def _plan() -> Any:
    global _PLAN
    if _PLAN is None:
        _PLAN = resolve("cuda:sm90", ModelFacts(attention="mla", num_heads=16), "triton",
                        GraphConfig.from_user(prefill="breakable"), assume_installed=True)
    return _PLAN


# -- what the files hold ------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)

huge_numbers = st.sampled_from(["1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400",
                                "1" * 5000, "NaN", "Infinity", "-Infinity", "1e-400"])


def _deep(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


deep_nesting = st.builds(_deep, st.sampled_from([MAX_DEPTH + 1, 1000, 100_000]),
                         st.sampled_from(["list", "object"]))


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``doc`` (the root excluded)."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) \
        if isinstance(doc, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


def _replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def _dropped(doc: Any, path: tuple[Any, ...]) -> Any:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return doc


@st.composite
def mutated_documents(draw: st.DrawFn, valid: Callable[[], Any]) -> bytes:
    """A valid document with one value replaced (wrong type, huge number) or one key or
    item dropped (wrong shape)."""
    doc = valid()
    path = draw(st.sampled_from(_paths(doc)))
    how = draw(st.sampled_from(["value", "huge", "drop"]))
    if how == "drop":
        return json.dumps(_dropped(doc, path)).encode()
    if how == "huge":
        marker = "__HUGE__"
        text = json.dumps(_replaced(doc, path, marker))
        return text.replace(f'"{marker}"', draw(huge_numbers)).encode()
    return json.dumps(_replaced(doc, path, draw(json_values))).encode()


def _bad_encoding(body: bytes, junk: bytes) -> bytes:
    return body[: len(body) // 2] + junk + body[len(body) // 2:]


def malformed(valid: Callable[[], Any]) -> st.SearchStrategy[bytes]:
    body = json.dumps(valid()).encode()
    return st.one_of(
        st.binary(max_size=64),
        st.builds(_bad_encoding, st.just(body), st.sampled_from([b"\xff", b"\xc3\x28",
                                                                 b"\xed\xa0\x80", b"\x80"])),
        st.builds(lambda b: b.decode().encode("utf-16"), st.just(body)),
        deep_nesting,
        huge_numbers.map(str.encode),
        json_values.map(lambda v: json.dumps(v).encode()),
        mutated_documents(valid),
        st.just(body[:-1]),  # cut short
    )


#: One directory for every generated file (removed when the test process ends).
_FILES = tempfile.TemporaryDirectory(prefix="attnreg-malformed-")


def _write(content: bytes) -> Path:
    with tempfile.NamedTemporaryFile(dir=_FILES.name, suffix=".json", delete=False) as f:
        f.write(content)
    return Path(f.name)


def _only(error: type[Exception], load: Callable[[Path], Any], content: bytes) -> None:
    path = _write(content)
    try:
        load(path)
    except error as exc:
        assert str(path) in str(exc), exc  # names the file
    # anything else propagates and fails the test, with hypothesis's shrunk example


# -- the loaders --------------------------------------------------------------------------

@SETTINGS
@given(malformed(valid_profile))
def test_load_profile_raises_only_cost_profile_error(content: bytes) -> None:
    _only(CostProfileError, load_profile, content)


@SETTINGS
@given(malformed(valid_profile))
def test_replay_gate_with_a_profile_path_raises_only_cost_profile_error(content: bytes) -> None:
    _only(CostProfileError, lambda p: ReplayGate(_plan(), cost_profile=str(p)), content)


@SETTINGS
@given(malformed(valid_report))
def test_report_read_json_raises_only_report_error(content: bytes) -> None:
    _only(ReportError, Report.read_json, content)


@SETTINGS
@given(malformed(valid_report))
def test_merging_read_reports_raises_only_report_error(content: bytes) -> None:
    good = _write(json.dumps(valid_report()).encode())
    _only(ReportError, lambda p: Report.merge([Report.read_json(good), Report.read_json(p)]),
          content)


@SETTINGS
@given(st.one_of(malformed(valid_profile), malformed(valid_report)))
def test_read_json_raises_only_json_file_error(content: bytes) -> None:
    _only(JSONFileError, read_json, content)


@SETTINGS
@given(json_values)
def test_from_dict_of_any_json_value_raises_only_the_documented_error(value: Any) -> None:
    with pytest.raises(CostProfileError):
        CostProfile.from_dict(value, source="x")
    try:
        Report.from_dict(value, source="x")
    except ReportError:
        pass


@SETTINGS
@given(mutated_documents(valid_profile))
def test_a_profile_that_loads_predicts_finite_times(content: bytes) -> None:
    from attnreg.graph_policy.cost_profile import PrefillShape

    try:
        profile = load_profile(_write(content))
    except CostProfileError:
        return
    cmp = profile.compare(PrefillShape.uniform(2, 16, 8, heads=4), graph_tokens=32)
    assert cmp.graph_us >= 0 and cmp.eager_us >= 0


def test_the_shipped_profiles_and_the_valid_documents_load() -> None:
    load_profile(_write(json.dumps(valid_profile()).encode()))
    assert Report.read_json(_write(json.dumps(valid_report()).encode())).ok


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 2048 + b"{}")
    with pytest.raises(JSONFileError, match="is larger than"):
        read_json(path, max_bytes=1024)
