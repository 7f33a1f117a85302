"""Ring attention and batch/head-sharded calls on every local device, checked and timed.

Checks values and gradients of `ring_attention` (inside shard_map, sequence over all
devices) and of `flash_attention(mesh=, in_specs=)` against the unsharded float32
reference, then times the ring against one device running the whole sequence.
Prints a table and writes JSON to ``--out``.

    python packages/ejk-attention/benchmarks/multi_device_check.py [--small] [--out DIR]

On CPU, ``--small`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_attention import flash_attention, reference_attention, ring_attention
from ejk_attention._bench import median_ms


def _rel(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _inputs(b, t, n, k, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, t, n, h), (b, t, k, h), (b, t, k, h))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _grads(fn, q, k, v, w):
    return jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))
    )(q, k, v)


# Pass thresholds on the relative (Frobenius) error against the float32 reference, per
# input dtype: every row must meet them, or the run exits 1.
MAX_REL_ERR = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def _verdict(row: dict) -> dict:
    """``row`` with ``passed``: every ``*_rel_err`` within its dtype's threshold."""
    limit = MAX_REL_ERR[row["dtype"]]
    errors = {k: v for k, v in row.items() if k.endswith("_rel_err")}
    return {**row, "max_rel_err_allowed": limit, "passed": all(e <= limit for e in errors.values())}


def _errors(fn, q, k, v, kw, seed):
    """Relative errors of ``fn``'s output and of its gradients against the float32 reference."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = reference_attention(*f32, **kw)
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(want.shape), jnp.float32)
    errors = {"out_rel_err": _rel(fn(q, k, v), want)}
    got = _grads(fn, q, k, v, w)
    ref = _grads(lambda q, k, v: reference_attention(q, k, v, **kw), *f32, w)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        errors[f"{name}_rel_err"] = _rel(g, r)
    return errors


def _timings(name, fn, args):
    """``{name}_fwd_ms`` and ``{name}_fwd_bwd_ms`` of a jitted ``fn``."""
    grad = jax.jit(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return {
        f"{name}_fwd_ms": median_ms(fn, args, warmup=0, iters=10),
        f"{name}_fwd_bwd_ms": median_ms(grad, args, warmup=0, iters=10),
    }


def check_ring(mesh, shape, dtype, kw, time_it):
    b, t, n, k, h = shape
    q, k_, v = _inputs(b, t, n, k, h, dtype)
    seq = P(None, "sp")
    ring = jax.jit(
        jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, axis_name="sp", **kw),
            mesh=mesh,
            in_specs=(seq, seq, seq),
            out_specs=seq,
        )
    )
    row = {
        "check": "ring",
        "shape": shape,
        "dtype": str(jnp.dtype(dtype)),
        **{k: str(x) for k, x in kw.items()},
        **_errors(ring, q, k_, v, kw, seed=1),
    }
    if time_it:
        single = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw))
        row.update(_timings("ring", ring, (q, k_, v)))
        row.update(_timings("one_device_flash", single, (q, k_, v)))
    return row


def check_sharded(mesh, shape, dtype, spec, implementation):
    b, t, n, k, h = shape
    q, k_, v = _inputs(b, t, n, k, h, dtype, seed=2)
    kw = {"causal": True}
    fn = jax.jit(
        lambda q, k, v: flash_attention(
            q, k, v, mesh=mesh, in_specs=spec, implementation=implementation, **kw
        )
    )
    return {
        "check": f"sharded {spec}",
        "implementation": implementation,
        "shape": shape,
        "dtype": str(jnp.dtype(dtype)),
        **_errors(fn, q, k_, v, kw, seed=3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--out", default="multi-device-out")
    args = parser.parse_args()
    devices = jax.devices()
    d = len(devices)
    mesh = Mesh(np.array(devices), ("sp",))
    print(f"{d} x {devices[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    big = not args.small
    ring_shape = (1, 8192, 16, 4, 128) if big else (1, 16 * d, 4, 2, 16)
    dtypes = (jnp.bfloat16, jnp.float32) if big else (jnp.float32,)
    rows = []
    for dtype in dtypes:
        for kw in (
            {"causal": True},
            {"sliding_window": (1024, 0) if big else (5, 0), "causal": True},
            {},
        ):
            with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
                rows.append(
                    _verdict(
                        check_ring(
                            mesh, ring_shape, dtype, kw, time_it=big and dtype == jnp.bfloat16
                        )
                    )
                )
            print(json.dumps(rows[-1]))
    sharded_shape = (2 * d, 2048, 8 * d, 2 * d, 128) if big else (2 * d, 24, 2 * d, d, 16)
    impls = ("triton", "xla") if jax.default_backend() == "gpu" else ("xla",)
    for impl in impls:
        for spec in (P("sp"), P(None, None, "sp")):
            dtype = jnp.bfloat16 if big else jnp.float32
            rows.append(_verdict(check_sharded(mesh, sharded_shape, dtype, spec, impl)))
            print(json.dumps(rows[-1], default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    machine = {"devices": d, "kind": devices[0].device_kind, "jax": jax.__version__}
    passed = all(row["passed"] for row in rows)
    (out / "multi_device.json").write_text(
        json.dumps(
            {"machine": machine, "commit": commit, "passed": passed, "rows": rows},
            indent=2,
            default=str,
        )
    )
    failed = [row["check"] for row in rows if not row["passed"]]
    print("PASS" if passed else f"FAIL: {failed}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
