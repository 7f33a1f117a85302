"""What an eager call of each public entry point costs next to a jitted jax.nn call.

Prints the median microseconds of single calls (the result waited for) of eager
``flash_attention``, ``dot_product_attention``, ``paged_attention`` and
``ragged_paged_attention``, of jitted ``jax.nn.dot_product_attention`` (its xla path) and
of the jitted entry points (what the compiled program itself costs), on a tiny shape, timed in interleaved rounds of back-to-back
calls; exits 1 when an eager entry point costs more than twice jitted jax.nn. The paged
calls put the same keys in pages of 8 tokens (``kv_lens = S``; the T queries are the last
T tokens, bottom-right causal, so ``--causal`` is their only mode). On a CPU the single-call
times of a tiny shape are bimodal (a call either finds XLA's worker threads awake or wakes
them), so the 10th and 90th percentiles are printed too.

    uv run python packages/ejk-attention/benchmarks/eager_overhead.py [--shape 1,16,16,2,1,16]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejk_attention import (
    dot_product_attention,
    flash_attention,
    paged_attention,
    ragged_paged_attention,
)

LIMIT = 2.0  # an eager entry point may cost at most this many jitted jax.nn calls
BASELINE = "jitted jax.nn"
PAGE = 8  # tokens per page of the paged calls


def _contenders(b, t, s, n, k, h, causal):
    """name -> a call returning arrays; eager ones are named "eager ..."."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32) for _ in range(2)]
    pages_per_seq = -(-s // PAGE)
    padded = [jnp.pad(x, ((0, 0), (0, pages_per_seq * PAGE - s), (0, 0), (0, 0))) for x in kv]
    k_pages, v_pages = (x.reshape(b * pages_per_seq, PAGE, k, h) for x in padded)
    table = jnp.arange(b * pages_per_seq, dtype=jnp.int32).reshape(b, pages_per_seq)
    kv_lens = jnp.full((b,), s, jnp.int32)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    q_packed = q.reshape(b * t, n, h)
    jnn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        )
    )
    ejk = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal))
    paged = jax.jit(paged_attention)
    ragged = jax.jit(ragged_paged_attention)
    return {
        "eager flash_attention": lambda: flash_attention(q, *kv, causal=causal),
        "eager dot_product_attention": lambda: dot_product_attention(q, *kv, is_causal=causal),
        "eager paged_attention": lambda: paged_attention(q, k_pages, v_pages, table, kv_lens),
        "eager ragged_paged_attention": lambda: ragged_paged_attention(
            q_packed, k_pages, v_pages, table, kv_lens, cu_q_lens
        ),
        BASELINE: lambda: jnn(q, *kv),
        "jitted flash_attention": lambda: ejk(q, *kv),
        "jitted paged_attention": lambda: paged(q, k_pages, v_pages, table, kv_lens),
        "jitted ragged_paged_attention": lambda: ragged(
            q_packed, k_pages, v_pages, table, kv_lens, cu_q_lens
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,16,16,2,1,16", help="B,T,S,N,K,H (default tiny)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50, help="calls per round and contender")
    args = parser.parse_args(argv)
    b, t, s, n, k, h = map(int, args.shape.split(","))
    contenders = _contenders(b, t, s, n, k, h, args.causal)
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
    causal = " causal" if args.causal else ""
    print(f"shape B,T,S,N,K,H = {args.shape}{causal}, float32, {jax.devices()[0]}")
    for name, value in us.items():
        p10, p90 = np.percentile(times[name], [10, 90])
        print(
            f"  {name:29s} {value:8.1f} us/call  ({value / us[BASELINE]:5.2f}x {BASELINE})"
            f"  p10 {p10:7.1f}  p90 {p90:7.1f}"
        )
    over = {
        name: us[name] / us[BASELINE]
        for name in us
        if name.startswith("eager") and us[name] / us[BASELINE] > LIMIT
    }
    for name, ratio in over.items():
        print(f"FAIL: {name} costs {ratio:.2f}x {BASELINE} (limit {LIMIT}x)")
    if not over:
        print(f"ok: every eager entry point within {LIMIT}x {BASELINE}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
