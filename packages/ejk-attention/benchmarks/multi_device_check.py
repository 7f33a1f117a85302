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
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_attention import flash_attention, reference_attention, ring_attention


def _rel(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _ms(fn, *args, iters=10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def _inputs(b, t, n, k, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, t, n, h), (b, t, k, h), (b, t, k, h))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _grads(fn, q, k, v, w):
    return jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))
    )(q, k, v)


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
    f32 = [x.astype(jnp.float32) for x in (q, k_, v)]
    want = reference_attention(*f32, **kw)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape), jnp.float32)
    row = {
        "check": "ring",
        "shape": shape,
        "dtype": str(jnp.dtype(dtype)),
        **{k: str(x) for k, x in kw.items()},
    }
    row["out_rel_err"] = _rel(ring(q, k_, v), want)
    got = _grads(ring, q, k_, v, w)
    ref = _grads(lambda q, k, v: reference_attention(q, k, v, **kw), *f32, w)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        row[f"{name}_rel_err"] = _rel(g, r)
    if time_it:
        single = jax.jit(lambda q, k, v: flash_attention(q, k, v, **kw))
        row["ring_fwd_ms"] = _ms(ring, q, k_, v)
        row["ring_fwd_bwd_ms"] = _ms(
            jax.jit(jax.grad(lambda *a: ring(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))),
            q,
            k_,
            v,
        )
        row["one_device_flash_fwd_ms"] = _ms(single, q, k_, v)
        row["one_device_flash_fwd_bwd_ms"] = _ms(
            jax.jit(jax.grad(lambda *a: single(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))),
            q,
            k_,
            v,
        )
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
    f32 = [x.astype(jnp.float32) for x in (q, k_, v)]
    want = reference_attention(*f32, **kw)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(want.shape), jnp.float32)
    row = {
        "check": f"sharded {spec}",
        "implementation": implementation,
        "shape": shape,
        "dtype": str(jnp.dtype(dtype)),
    }
    row["out_rel_err"] = _rel(fn(q, k_, v), want)
    got = _grads(fn, q, k_, v, w)
    ref = _grads(lambda q, k, v: reference_attention(q, k, v, **kw), *f32, w)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        row[f"{name}_rel_err"] = _rel(g, r)
    return row


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
                    check_ring(mesh, ring_shape, dtype, kw, time_it=big and dtype == jnp.bfloat16)
                )
            print(json.dumps(rows[-1]))
    sharded_shape = (2 * d, 2048, 8 * d, 2 * d, 128) if big else (2 * d, 24, 2 * d, d, 16)
    impls = ("triton", "xla") if jax.default_backend() == "gpu" else ("xla",)
    for impl in impls:
        for spec in (P("sp"), P(None, None, "sp")):
            rows.append(
                check_sharded(mesh, sharded_shape, jnp.bfloat16 if big else jnp.float32, spec, impl)
            )
            print(json.dumps(rows[-1], default=str))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {"devices": d, "kind": devices[0].device_kind, "jax": jax.__version__}
    (out / "multi_device.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=2, default=str)
    )


if __name__ == "__main__":
    main()
