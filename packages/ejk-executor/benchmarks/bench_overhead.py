"""Executor overhead on a cache hit.

Compares, per call, for a small and a larger matmul kernel:

- ``direct``: the same computation as a plain ``jax.jit`` function;
- ``executor``: ``executor(kernel, a, b)`` eagerly, config in the memory cache
  (the usual fast path: the call's key is memoised);
- ``executor-keyed``: the same, but with the key recomputed every call (an
  empty ``overlay_cache`` is active, which disables the memo): the cost of
  building the Invocation and its key;
- ``jit(executor)``: ``jax.jit(lambda a, b: executor(kernel, a, b))``;
  the executor runs at trace time only, so this should equal ``direct``.

It also checks that the compiled programs of ``direct`` and ``jit(executor)``
have the same HLO instructions (the executor vanishes from the program).

Run: ``python packages/ejk-executor/benchmarks/bench_overhead.py [--iters N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import msgspec

from ejk_executor import ConfigCache, ConfigSelectorChain, Executor, Kernel, overlay_cache


class Cfg(msgspec.Struct, frozen=True):
    block: int = 64


class MatMul(Kernel[Cfg, jax.Array]):
    name = "bench_matmul"
    config_type = Cfg

    def run(self, a, b, *, cfg):
        return a @ b

    def heuristic_cfg(self, inv):
        return Cfg()


def one_round(fn, args, iters: int, sync: bool) -> float:
    """Mean wall time per call of ``iters`` calls in microseconds: waiting for each
    result (``sync``), or only for the last one (dispatch throughput)."""
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
        if sync:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e6


def measure(variants: dict, args, iters: int, sync: bool, repeats: int = 9) -> dict:
    """Median per-call time of each variant, the variants interleaved round by round
    so that clock and load drift hit them alike."""
    for fn in variants.values():
        jax.block_until_ready(fn(*args))
    samples: dict = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].append(one_round(fn, args, iters, sync))
    return {name: statistics.median(s) for name, s in samples.items()}


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.-]+\s*=\s*\S+\s+([\w-]+)\(", re.M)


def hlo_ops(compiled) -> list[str]:
    """The opcodes of a compiled program's HLO instructions, in order."""
    return _INSTR.findall(compiled.as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 1024])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    kernel = MatMul()
    ex = Executor(ConfigSelectorChain(cache=ConfigCache()))
    direct = jax.jit(lambda a, b: a @ b)
    jitted_ex = jax.jit(lambda a, b: ex(kernel, a, b))

    def keyed(a, b):
        with overlay_cache({}):
            return ex(kernel, a, b)

    device = jax.devices()[0]
    print(f"jax {jax.__version__}, device {device.device_kind} ({device.platform})")
    results = []
    variants = {
        "direct": direct,
        "executor": lambda a, b: ex(kernel, a, b),
        "executor-keyed": keyed,
        "jit(executor)": jitted_ex,
    }
    for n in args.sizes:
        a = jnp.ones((n, n), jnp.float32)
        b = jnp.ones((n, n), jnp.float32)
        same = hlo_ops(direct.lower(a, b).compile()) == hlo_ops(jitted_ex.lower(a, b).compile())
        for sync in (False, True):
            row = {"n": n, "mode": "sync" if sync else "async", "same_hlo_ops": same}
            row.update(measure(variants, (a, b), args.iters, sync))
            results.append(row)
            print(
                f"n={n:5d} {row['mode']:5s} direct {row['direct']:7.1f} us | executor "
                f"{row['executor']:7.1f} (+{row['executor'] - row['direct']:.1f}) | keyed "
                f"{row['executor-keyed']:7.1f} (+{row['executor-keyed'] - row['direct']:.1f}) | "
                f"jit(executor) {row['jit(executor)']:7.1f} | same compiled ops: {same}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"jax": jax.__version__, "device": device.device_kind, "rows": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
