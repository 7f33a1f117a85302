"""benchmarks/bench_decode.py imports and its helpers work on the CPU, so it does not rot
between GPU sessions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu.build import _triton as _triton
from ejk_sequtils import dequantize_kv, gather_pages

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(name="bench_decode")
def bench_decode_fixture(monkeypatch):
    _triton.kernels()  # Triton's backend (the interpreter here) before the script imports triton
    monkeypatch.syspath_prepend(str(BENCH))
    yield importlib.import_module("bench_decode")
    for name in [
        n for n, m in sys.modules.items() if str(BENCH) in str(getattr(m, "__file__", ""))
    ]:
        del sys.modules[name]


def test_shuffled_pages_hold_the_contiguous_cache(bench_decode):
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((3, 64, 2, 8)), jnp.float32)
    kp, vp, table = bench_decode.paged_cache(rng, k, 2 * k, 16)
    lens = jnp.full((3,), 64, jnp.int32)
    assert not np.array_equal(np.asarray(table).ravel(), np.arange(12))  # shuffled
    np.testing.assert_array_equal(gather_pages(kp, table, lens), k)
    np.testing.assert_array_equal(gather_pages(vp, table, lens), 2 * k)


def test_interleaved_times_every_variant_and_drops_failures(bench_decode):
    def broken(x):
        raise ValueError("no")

    timed = bench_decode.interleaved(
        {"ok": (jax.jit(lambda x: x + 1), (jnp.ones(4),)), "broken": (broken, (jnp.ones(4),))}, 2
    )
    assert set(timed) == {"ok"} and timed["ok"][1] <= timed["ok"][0]


def test_fp8_cache_and_its_bytes(bench_decode):
    """The FP8 cache holds the pools quantised per token and kv head; it reads one byte per
    element plus a float32 scale per token and kv head (bf16: two bytes per element)."""
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((3, 16, 2, 8)), jnp.float32)
    kq, vq, scales = bench_decode.fp8_cache(k, 2 * k)
    assert kq.dtype == vq.dtype == jnp.float8_e4m3fn
    back = dequantize_kv(vq, scales["v_scales"])
    np.testing.assert_allclose(back, 2 * k, rtol=2.0**-4, atol=1e-6)
    assert bench_decode.kv_bytes(2, 64, 8, 128, fp8=False) == 2 * 2 * 64 * 8 * 128 * 2
    assert bench_decode.kv_bytes(2, 64, 8, 128, fp8=True) == 2 * 2 * 64 * 8 * (128 + 4)


def test_fp8_error_is_e4m3_rounding_for_zero_mean_inputs(bench_decode):
    """`--fp8-error`: zero-mean inputs give the few percent e4m3's rounding of k and v
    explains (about 2.5 % RMS each), the bf16-drawn ones more."""
    rows = {r["drawn_in"]: r["rel_err_vs_bf16"] for r in bench_decode.fp8_error(lengths=(2048,))}
    assert 0.025 < rows["float32"] < 0.05
    assert rows["bfloat16"] > rows["float32"]


def test_fa4_decode_script_times_the_same_shapes(bench_decode):
    """bench_decode_fa4.py (a PyTorch process, not importable here) repeats DECODE_SHAPES:
    read from its source, they must be bench_decode's, the issue's B1 rows included."""
    import ast

    source = (Path(bench_decode.__file__).parent / "bench_decode_fa4.py").read_text()
    assigned = next(
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "DECODE_SHAPES"
    )
    assert ast.literal_eval(assigned) == bench_decode.DECODE_SHAPES
    assert {(1, 8192), (1, 32768), (1, 131072)} <= {
        (b, s) for b, s, *_ in bench_decode.DECODE_SHAPES
    }
