"""benchmarks/bench_flex.py runs on tiny shapes in Triton's interpreter, so it does not rot
between GPU sessions (slow: the interpreter times every contender)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def test_bench_flex_tiny_rows_and_targets(monkeypatch, tmp_path):
    from ejk_kernels_gpu.build import _triton

    _triton.kernels()  # the interpreter before the script imports triton
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_flex")
    timing = importlib.import_module("_timing")
    once = timing.seconds_per_call
    monkeypatch.setattr(timing, "seconds_per_call", lambda f, *a, reps=10: once(f, *a, reps=1))
    out = tmp_path / "flex.json"
    argv = ["--tiny", "--rounds", "1", "--rows", "documents,alibi,mask128k", "--check",
            "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert {(r["row"], r["as"]) for r in result["rows"]} == {
        ("documents", "flex"), ("documents", "flex kernels"), ("documents", "segment_ids"),
        ("documents", "fa4-jax mask_mod"),
        ("alibi", "score_mod"), ("alibi", "none"), ("mask128k", "flex"),
        ("mask128k", "create_block_mask"),
    }  # fmt: skip
    # fa4-jax's row is timed where fa4-jax imports (the GPU machine), else says why not.
    fa4 = [r for r in result["rows"] if r["as"] == "fa4-jax mask_mod"]
    fa4_missing = importlib.util.find_spec("fa4_jax") is None
    assert [("skipped" in r) for r in fa4] == [fa4_missing], fa4
    timed = [r for r in result["rows"] if "skipped" not in r]
    assert len(timed) == 8 - fa4_missing
    assert all("error" not in r and r["fwd_ms"] > 0 for r in timed)
    assert [c.get("passed") for c in result["checks"]] == [
        True,
        True,
        True,
        None,
    ]  # mask128k: skipped
    assert {t["target"] for t in result["targets"] if t["met"] is not None} >= {
        "documents as a mask_mod vs segment ids", "documents as a user's mask_mod vs segment ids",
        "ALiBi score_mod vs none",
        "create_block_mask at T=128k vs one forward+backward",
    }  # fmt: skip
    for name in [
        n for n, m in sys.modules.items() if str(BENCH) in str(getattr(m, "__file__", ""))
    ]:
        del sys.modules[name]
