"""Errors a benchmark records name no machine's paths (committed results are read by anyone)."""

from __future__ import annotations

from benchmarks._harness import error_text


def test_absolute_paths_are_cut_to_their_last_part():
    exc = RuntimeError("Ninja build failed. Ninja output:\nninja: Entering directory "
                       "`/root/.cache/flashinfer/0.6.13/90a/cached_ops/batch_mla_e4m3'\n"
                       "[1/2]  /usr/local/cuda/bin/nvcc --generate-dependencies")
    text = error_text(exc)
    assert text.startswith("RuntimeError: Ninja build failed.")
    assert "/root" not in text and "/usr/local" not in text
    assert ".../batch_mla_e4m3" in text and ".../nvcc --generate" in text


def test_other_text_is_kept_and_the_limit_applies():
    exc = ValueError("kv dtype fp8_e4m3 not in ['bf16']: 1/2 of the rows, a/b")
    assert error_text(exc) == "ValueError: kv dtype fp8_e4m3 not in ['bf16']: 1/2 of the rows, a/b"
    assert error_text(exc, 12) == "ValueError: "
