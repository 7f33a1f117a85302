"""ejk's ``xla`` backend against ``jax.nn.dot_product_attention`` (xla), forward and forward+backward.

Times each of ``ejk bench``'s default cases (or ``--shape``) jitted, in interleaved rounds
(every round runs every contender once, so load on a shared machine hits all alike), and
prints the medians and ejk's ratio to jax.nn; exits 1 when ejk's forward+backward is
slower than jax.nn's on a case (by more than ``--slack``).

    uv run python packages/ejk-attention/benchmarks/xla_vs_jax_nn.py [--rounds 11]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejk_attention import flash_attention
from ejk_attention._bench import inputs_for, parse_case
from ejk_attention.cli import DEFAULT_SHAPES


def _contenders(causal: bool) -> dict[str, object]:
    attend = {
        "jax.nn": functools.partial(
            jax.nn.dot_product_attention, is_causal=causal, implementation="xla"
        ),
        "ejk xla": functools.partial(flash_attention, causal=causal, implementation="xla"),
    }
    timed = {}
    for name, fn in attend.items():
        timed[(name, "fwd")] = jax.jit(fn)
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
        timed[(name, "fwd+bwd")] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="B,T,S,N,K,H[,causal] (repeatable)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--slack", type=float, default=1.0, help="allowed ejk/jax.nn fwd+bwd ratio")
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"{'case':38s} {'part':8s} {'jax.nn ms':>10s} {'ejk ms':>10s} {'ejk/jax.nn':>10s}")
    slower = []
    for case in (parse_case(s) for s in (args.shape or DEFAULT_SHAPES)):
        q, k, v = inputs_for(case)
        timed = _contenders(case.causal)
        for fn in timed.values():  # compile and warm up, never timed
            jax.block_until_ready(fn(q, k, v))
            jax.block_until_ready(fn(q, k, v))
        times: dict[tuple[str, str], list[float]] = {key: [] for key in timed}
        for _ in range(args.rounds):
            for key, fn in timed.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(q, k, v))
                times[key].append((time.perf_counter() - start) * 1e3)
        for part in ("fwd", "fwd+bwd"):
            base = float(np.median(times[("jax.nn", part)]))
            ours = float(np.median(times[("ejk xla", part)]))
            print(f"{case.label:38s} {part:8s} {base:10.2f} {ours:10.2f} {ours / base:10.2f}")
            if part == "fwd+bwd" and ours > base * args.slack:
                slower.append(case.label)
    if slower:
        print(f"FAIL: ejk's forward+backward is slower than jax.nn's on {', '.join(slower)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
