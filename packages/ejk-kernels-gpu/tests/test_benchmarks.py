"""The GPU benchmark scripts import and run on the CPU (interpreter), so they do not rot
between GPU sessions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from ejk_kernels_gpu import _triton

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(name="bench_path")
def bench_path_fixture(monkeypatch):
    _triton.kernels()  # Triton's backend (the interpreter here) before a script imports triton
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import each other by name
    yield
    for name in [
        n for n, m in sys.modules.items() if str(BENCH) in str(getattr(m, "__file__", ""))
    ]:
        del sys.modules[name]


@pytest.mark.parametrize("name", ["bench_flash", "gpu_conformance"])
def test_benchmark_scripts_import(bench_path, name):
    importlib.import_module(name)


def test_bench_shape_times_each_variant_in_interleaved_rounds(bench_path, monkeypatch):
    bench_flash = importlib.import_module("bench_flash")
    timing = importlib.import_module("_timing")
    calls = []
    once = timing.seconds_per_call
    monkeypatch.setattr(
        timing, "seconds_per_call", lambda f, *a, reps=10: calls.append(f) or once(f, *a, reps=1)
    )
    variants = [("ejk", None, None, None), ("xla", None, None, None), ("pallas", None, None, "x")]
    rows = bench_flash.bench_shape((1, 32, 2, 1, 16, True), variants, with_bwd=False, rounds=2)
    assert [r["impl"] for r in rows] == ["ejk", "xla"]  # no Pallas GPU attention for GQA
    assert len(calls) == 4 and calls[0] is calls[2] and calls[1] is calls[3] != calls[0]
    for row in rows:
        assert row["fwd_best_ms"] <= row["fwd_ms"] and row["fwd_tflops"] > 0


def test_conformance_records_the_builds_and_fails_a_silent_fallback(bench_path):
    import jax.numpy as jnp
    import numpy as np

    conf = importlib.import_module("gpu_conformance")
    rng = np.random.default_rng(0)
    row = conf._case(rng, "tiny", 1, 16, 16, 2, 1, 16, conf.ORD, False, dtype=jnp.float32, causal=True)  # fmt: skip
    assert row["builds"] == {"fwd": "ordinary", "bwd": "ordinary"}
    assert row["passed"] and row["deterministic"] and row["builds_ok"]
    # On Hopper a case about the Gluon / warp-specialised builds fails when another ran,
    # and a case about the ordinary kernels fails when a special build ran.
    assert conf._builds_ok({"fwd": "gluon", "bwd": "atomic"}, conf.GW, hopper=True)
    assert not conf._builds_ok({"fwd": "ordinary", "bwd": "atomic"}, conf.GW, hopper=True)
    assert not conf._builds_ok({"fwd": "gluon", "bwd": "ws"}, conf.GW, hopper=True)
    assert conf._builds_ok({"fwd": "ws", "bwd": "ws"}, conf.WW, hopper=True)
    assert not conf._builds_ok({"fwd": "ws", "bwd": "ordinary"}, conf.WW, hopper=True)
    assert not conf._builds_ok({"fwd": "ws", "bwd": "ordinary"}, conf.ORD, hopper=True)
    assert conf._builds_ok({"fwd": "ordinary", "bwd": "atomic"}, conf.ORD, hopper=True)
    # Off Hopper every case expects the ordinary kernels.
    assert conf._builds_ok({"fwd": "ordinary", "bwd": "ordinary"}, conf.WW, hopper=False)


def test_feature_rows_run_and_count_visible_pairs(bench_path):
    features = importlib.import_module("bench_features")
    assert features._causal_pairs(4) == 10 and features._causal_pairs(4, left=1) == 7
    flops, entries = features.documents(docs=2, length=16, n=2, h=16)
    assert flops == 4 * 2 * 16 * 2 * features._causal_pairs(16)
    import jax.numpy as jnp
    import numpy as np

    outs = [
        fn(*(x.astype(jnp.float32) for x in args[:3]), *side[0] if side else ())
        for row, fn, args, *side in entries[:3]
    ]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)  # segment ids == cu_seqlens
    np.testing.assert_allclose(outs[0].reshape(outs[2].shape), outs[2], atol=1e-5)  # == batch
