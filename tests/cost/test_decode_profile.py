"""The decode profile format: versioned, validated by the project's JSON loader, every
problem one DecodeProfileError naming the file; round trip through save / load."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from attnreg.graph_policy.decode_profile import (
    DecodeProfile,
    DecodeProfileError,
    load_decode_profile,
    save_decode_profile,
)

GOOD: dict[str, Any] = {
    "schema": "attnreg.decode_profile", "schema_version": 1, "platform": "cuda:sm90",
    "heads": 16, "kv_dtype": "fp8_e4m3", "page_size": 64, "device": "H200", "dry_run": False,
    "entries": [{"backend": "triton", "bucket": 1,
                 "points": [{"kv_len": 32768, "us": 30.1, "samples_us": [30.0, 30.2]},
                            {"kv_len": 4096, "us": 9.0}]},
                {"backend": "flashmla", "bucket": 1, "points": [{"kv_len": 32768, "us": 49.9}]}],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node: Any = data
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return data


def test_a_good_profile_round_trips_and_keeps_what_it_does_not_read(tmp_path: Path):
    path = save_decode_profile(GOOD, tmp_path / "d.json")
    profile = load_decode_profile(path)
    assert profile.backends == ("triton", "flashmla") and profile.page_size == 64
    assert profile.entry("triton", 1).points == ((4096, 9.0), (32768, 30.1))  # type: ignore[union-attr]
    assert profile.to_dict()["entries"][0]["points"][0]["samples_us"] == [30.0, 30.2]
    assert profile.ratio(1, "triton", "flashmla") == pytest.approx(30.1 / 49.9)
    assert profile.mismatch("cuda:sm90", 16, "fp8_e4m3", 64) == ""
    assert "page size 64 (the plan's is 1)" in profile.mismatch("cuda:sm90", 16, "fp8_e4m3", 1)
    assert profile.profile_id == DecodeProfile.from_dict(json.loads(path.read_text())).profile_id


@pytest.mark.parametrize(("path", "value", "problem"), [
    ("schema", "attnreg.cost_profile", "schema"),
    ("schema_version", 0, "schema_version"),
    ("heads", 0, "heads"),
    ("kv_dtype", "int4", "kv_dtype"),
    ("platform", "quantum:x1", "platform"),
    ("page_size", KeyError, "page_size"),
    ("entries", [], "no entries"),
    ("entries.0.bucket", 0, "bucket"),
    ("entries.0.points", [], "no points"),
    ("entries.0.points.1.kv_len", 32768, "repeat"),
    ("entries.0.points.0.us", 0, "us"),
    ("entries.1.backend", "triton", "listed twice"),
])
def test_every_malformed_field_is_one_error_naming_the_file(path, value, problem, tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(_with(path, value)))
    with pytest.raises(DecodeProfileError, match=str(f)) as info:
        load_decode_profile(f)
    assert problem in str(info.value)


def test_a_newer_version_asks_for_an_upgrade_and_non_json_is_refused(tmp_path: Path):
    with pytest.raises(DecodeProfileError, match="newer than this attnreg reads"):
        DecodeProfile.from_dict(_with("schema_version", 2))
    # a version of 5,000 digits is named short, not str()'d (which raises past 4,300)
    with pytest.raises(DecodeProfileError, match="a number of about 5001 digits"):
        DecodeProfile.from_dict(_with("schema_version", 10 ** 5000))
    f = tmp_path / "x.json"
    f.write_text("{not json")
    with pytest.raises(DecodeProfileError, match="x.json"):
        load_decode_profile(f)
    with pytest.raises(DecodeProfileError, match="no such file"):
        load_decode_profile(tmp_path / "missing.json")
    with pytest.raises(DecodeProfileError):
        save_decode_profile(_with("heads", -1), tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()
