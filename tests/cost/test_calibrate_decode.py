"""`attnreg calibrate --decode`: the dry run measures through a GraphSession (triton in the
interpreter, tiny shapes) and writes a decode profile the plan can read; bad input exits 2
with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from attnreg.graph_policy.decode_profile import load_decode_profile  # noqa: E402


def _calibrate(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TRITON_INTERPRET="1", ATTNREG_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "attnreg", "calibrate", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_the_dry_run_writes_a_decode_profile_per_backend_bucket_and_kv_length(tmp_path: Path):
    out = tmp_path / "decode.json"
    res = _calibrate("--decode", "--dry-run", "--buckets", "1,2", "--kv-lens", "16",
                     "--page-size", "16", "--max-kv-tokens", "20", "-o", str(out), "--json")
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    assert printed["written_to"] == str(out) and printed["dry_run"] is True
    profile = load_decode_profile(out)
    assert profile.page_size == 16 and profile.heads == 2 and profile.backends == ("triton",)
    # (2, 16) is 32 KV tokens, above --max-kv-tokens 20: not measured
    assert [(e.bucket, [k for k, _ in e.points]) for e in profile.entries] == [(1, [16])]
    assert profile.entries[0].points[0][1] > 0


@pytest.mark.parametrize(("args", "message"), [
    (("--decode",), "no CUDA device"),
    (("--decode", "--dry-run", "--backend", "nosuch"), "nosuch"),
    (("--decode", "--dry-run", "--buckets", "0"), "expected comma-separated integers >= 1"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    res = _calibrate(*args)
    assert res.returncode == 2 and message in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2, res.stderr  # argparse: usage + error
