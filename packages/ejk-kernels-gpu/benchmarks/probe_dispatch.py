"""Where the round-to-round spread of ejk's forward time comes from: host dispatch or the GPU.

Times the same calls two ways, round by round, on one bench_flash shape: ``reps`` jitted
calls from a Python loop (as bench_flash does), and ``reps`` calls inside one jitted
``fori_loop`` (one dispatch). If only the first varies, the spread is the host's.

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/probe_dispatch.py [--shape 1] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from bench_flash import SHAPES

from ejk_kernels_gpu import flash_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    B, T, N, K, H, causal = SHAPES[args.shape]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H), jnp.bfloat16)
    fns = {
        "ejk": lambda q, k, v: flash_attention(q, k, v, causal=causal),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        ),
    }
    timed = {}
    for name, fn in fns.items():

        def looped(q, k, v, fn=fn):
            body = lambda i, c: c + fn(q, k, v)[0, 0, 0, 0].astype(jnp.float32)
            return jax.lax.fori_loop(0, args.reps, body, jnp.float32(0))

        timed[name + " host-loop"] = (jax.jit(fn), 1)
        timed[name + " in-jit"] = (jax.jit(looped), args.reps)
    for f, _ in timed.values():
        jax.block_until_ready(f(q, k, v))
    per = {key: [] for key in timed}
    for _ in range(args.rounds):
        for key, (f, inner) in timed.items():
            start = time.perf_counter()
            for _ in range(args.reps // inner):
                out = f(q, k, v)
            jax.block_until_ready(out)
            per[key].append((time.perf_counter() - start) / args.reps * 1e3)
    for key, times in per.items():
        s = sorted(times)
        print(f"{key:<16} median {s[len(s) // 2]:.3f} best {s[0]:.3f} worst {s[-1]:.3f} ms  "
              + " ".join(f"{t:.2f}" for t in times))  # fmt: skip


if __name__ == "__main__":
    main()
