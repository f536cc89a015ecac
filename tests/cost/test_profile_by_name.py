"""A shipped cost profile is found by its bare file name (docs/policy.md's example)."""

from __future__ import annotations

import pytest

from attnreg.graph_policy.cost_profile import (
    CostProfileError,
    load_profile,
    shipped_profile_paths,
)


def test_a_bare_name_finds_the_shipped_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = shipped_profile_paths()
    assert shipped, "attnreg ships cost profiles"
    profile = load_profile(shipped[0].name)
    assert profile.source == str(shipped[0])


def test_a_file_of_that_name_here_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = shipped_profile_paths()[0].name
    (tmp_path / name).write_text("{}")
    with pytest.raises(CostProfileError, match=f"cost profile {name}: .*"):
        load_profile(name)  # the local (invalid) file, not the shipped one


def test_an_unknown_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CostProfileError, match="no such file; give a path to a profile, or the "
                                               "name of a shipped one") as exc:
        load_profile("h100-nothing.json")
    assert shipped_profile_paths()[0].name in str(exc.value)
    with pytest.raises(CostProfileError, match="no such file"):
        load_profile(tmp_path / "sub" / shipped_profile_paths()[0].name)  # a path: not looked up
