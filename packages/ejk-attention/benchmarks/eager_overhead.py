"""What an eager `flash_attention` call costs next to a jitted one and a jitted jax.nn call.

Prints the median microseconds of single calls (the result waited for) of eager ejk, jitted
``jax.nn.dot_product_attention`` (its xla path) and jitted ejk on a tiny shape, timed in
interleaved rounds of back-to-back calls; exits 1 when eager ejk costs more than twice jitted jax.nn.
On a CPU the single-call times of a tiny shape are bimodal (a call either finds XLA's
worker threads awake or wakes them), so the 10th and 90th percentiles are printed too.

    uv run python packages/ejk-attention/benchmarks/eager_overhead.py [--shape 1,16,16,2,1,16]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejk_attention import flash_attention

LIMIT = 2.0  # eager ejk may cost at most this many jitted jax.nn calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,16,16,2,1,16", help="B,T,S,N,K,H (default tiny)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50, help="calls per round and contender")
    args = parser.parse_args(argv)
    b, t, s, n, k, h = map(int, args.shape.split(","))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32) for _ in range(2)]
    causal = args.causal
    jnn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        )
    )
    ejk = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal))
    contenders = {
        "eager ejk": lambda: flash_attention(q, *kv, causal=causal),
        "jitted jax.nn": lambda: jnn(q, *kv),
        "jitted ejk": lambda: ejk(q, *kv),
    }
    for fn in contenders.values():  # compile, never timed
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):  # interleaved: load on the machine hits every contender alike
        for name, fn in contenders.items():
            for _ in range(args.calls):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times[name].append((time.perf_counter() - start) * 1e6)
    us = {name: float(np.median(t)) for name, t in times.items()}
    print(
        f"shape B,T,S,N,K,H = {args.shape}{' causal' if causal else ''}, float32, {jax.devices()[0]}"
    )
    for name, value in us.items():
        p10, p90 = np.percentile(times[name], [10, 90])
        print(
            f"  {name:14s} {value:8.1f} us/call  ({value / us['jitted jax.nn']:.2f}x jitted jax.nn)"
            f"  p10 {p10:6.1f}  p90 {p90:6.1f}"
        )
    ratio = us["eager ejk"] / us["jitted jax.nn"]
    if ratio > LIMIT:
        print(f"FAIL: eager ejk costs {ratio:.2f}x jitted jax.nn (limit {LIMIT}x)")
        return 1
    print(f"ok: eager ejk costs {ratio:.2f}x jitted jax.nn (limit {LIMIT}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
