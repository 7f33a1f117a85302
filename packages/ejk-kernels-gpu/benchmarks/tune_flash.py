"""Autotune ejk's flash-attention configs through ejk_executor on the benchmark shapes.

For each shape, times every config of `FlashAttentionForward`'s search space (the
forward alone) and of `FlashAttentionBackward`'s (forward + backward, forward config
fixed to the heuristic) with the executor's tuner, prints each candidate's median ms
next to the heuristic's, then times the tuned pair against cuDNN in the same process
(``bench_flash.bench_shape``).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/tune_flash.py [--shapes 1,2] [--only bwd]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from bench_flash import SHAPES, bench_shape

from ejk_executor import Invocation
from ejk_executor._tuning import tune_invocation  # every candidate's time, not just the best
from ejk_kernels_gpu import FlashAttentionBackward, FlashAttentionForward, FlashConfig


def _tune(kernel, args, kwargs, iters: int, label: str) -> tuple[FlashConfig, FlashConfig]:
    """(best, heuristic) config of ``kernel`` on these inputs; prints every candidate."""
    inv = Invocation.make(kernel, args, kwargs)
    heuristic = kernel.heuristic_cfg(inv)
    candidates = list(kernel.config_space(inv))
    if heuristic not in candidates:
        candidates.append(heuristic)
    best, times = tune_invocation(inv, candidates, num_warmup=2, num_iters=iters)
    for index in sorted(times, key=times.__getitem__):
        cfg = candidates[index]
        mark = " (heuristic)" if cfg == heuristic else ""
        print(f"  {label} {times[index]:8.3f} ms  {cfg}{mark}", flush=True)
    h_ms = times.get(candidates.index(heuristic), float("nan"))
    print(
        json.dumps(
            dict(kind=label, best=str(best), best_ms=min(times.values()), heuristic_ms=h_ms)
        ),
        flush=True,
    )
    return best, heuristic


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    parser.add_argument("--only", choices=["fwd", "bwd", ""], default="")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    print("#", jax.devices(), jax.__version__)
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for shape in shapes:
        B, T, N, K, H, causal = shape
        print(f"# shape (B,T,N,K,H)=({B},{T},{N},{K},{H}) causal={causal}", flush=True)
        keys = jax.random.split(jax.random.key(1), 4)
        q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
        k = jax.random.normal(keys[1], (B, T, K, H), jnp.bfloat16)
        v = jax.random.normal(keys[2], (B, T, K, H), jnp.bfloat16)
        d_out = jax.random.normal(keys[3], (B, T, N, H), jnp.bfloat16)
        fwd = bwd = None
        if args.only != "bwd":
            fwd, _ = _tune(
                FlashAttentionForward(), (q, k, v), dict(causal=causal), args.iters, "fwd"
            )
        if args.only != "fwd":
            bwd, _ = _tune(
                FlashAttentionBackward(), (q, k, v, d_out), dict(causal=causal), args.iters, "f+b"
            )
        bench_shape(shape, [("ejk", fwd, bwd, "tuned"), ("cudnn", None, None, None)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
