"""Time and peak memory of mask_to_segment_ids, segment_ids_to_mask and pack_sequences.

Run from the repository root (CPU):

    python packages/ejk-sequtils/benchmarks/bench_sequtils.py [--sizes 1024 2048 ...] [--repeats 5]

It prints a Markdown table. Timings are the median of ``--repeats`` runs after one warm-up
(compilation excluded), with ``block_until_ready``. Peak memory: for the jitted JAX
functions, XLA's buffer assignment (arguments + outputs + temporaries, from
``compiled.memory_analysis()``); for pack_sequences (NumPy), tracemalloc's peak.
Inputs: packed rows of T tokens holding sequences of random lengths 1..512 (seed 0).
"""

import argparse
import platform
import statistics
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

import ejk_sequtils as es


def _lengths(total: int, rng: np.random.Generator, max_len: int = 512) -> list[int]:
    lengths, left = [], total
    while left:
        n = int(min(left, rng.integers(1, max_len + 1)))
        lengths.append(n)
        left -= n
    return lengths


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up / compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _xla_peak(fn, *args) -> int:
    stats = fn.lower(*args).compile().memory_analysis()
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def bench_jax(name: str, fn, arg, repeats: int) -> tuple[str, float, int]:
    jitted = jax.jit(fn)
    return name, _time(jitted, arg, repeats=repeats), _xla_peak(jitted, arg)


def bench_pack(sequences, row_length: int, repeats: int) -> tuple[float, int]:
    es.pack_sequences(sequences, row_length)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        es.pack_sequences(sequences, row_length)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    es.pack_sequences(sequences, row_length)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--pack-sizes", type=int, nargs="+", default=[1 << 20])
    parser.add_argument("--row-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}"
    )
    print()
    print("| function | tokens T | time (ms) | peak memory (MiB) |")
    print("|---|---:|---:|---:|")
    for total in args.sizes:
        lengths = _lengths(total, rng)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        segment_ids = jnp.asarray(es.cu_seqlens_to_segment_ids(cu))[None]  # [1, T]
        mask = es.segment_ids_to_mask(segment_ids)  # [1, T, T]
        rows = [
            bench_jax("segment_ids_to_mask", es.segment_ids_to_mask, segment_ids, args.repeats),
            bench_jax("mask_to_segment_ids", es.mask_to_segment_ids, mask, args.repeats),
            bench_jax("is_segment_representable", es.is_segment_representable, mask, args.repeats),
        ]
        sequences = [rng.integers(0, 50_000, n, dtype=np.int32) for n in lengths]
        pack_time, pack_peak = bench_pack(sequences, args.row_length, args.repeats)
        rows.append((f"pack_sequences (row {args.row_length})", pack_time, pack_peak))
        for name, seconds, peak in rows:
            print(f"| {name} | {total} | {seconds * 1e3:.2f} | {peak / 2**20:.2f} |")
        del mask
    for total in args.pack_sizes:
        lengths = _lengths(total, rng)
        sequences = [rng.integers(0, 50_000, n, dtype=np.int32) for n in lengths]
        pack_time, pack_peak = bench_pack(sequences, args.row_length, max(1, args.repeats // 2))
        print(
            f"| pack_sequences (row {args.row_length}, {len(sequences)} seqs) | {total} | "
            f"{pack_time * 1e3:.2f} | {pack_peak / 2**20:.2f} |"
        )


if __name__ == "__main__":
    main()
