"""Interleaved timing shared by the benchmarks: compile every contender first, then time
each in turn per round, so a drift of the card's clocks over the run falls on all alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def seconds_per_call(fn: Callable[..., Any], *args: Any, reps: int = 10) -> float:
    """Seconds per call over ``reps`` calls (synchronised at the end)."""
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def contender(
    row: dict, fn: Callable[..., Any], args: tuple, with_bwd: bool, side: tuple = ()
) -> tuple:
    """``(row, timed, times)`` of one contender: its jitted forward (and forward+backward,
    the cotangent being ``args[-1]``), compiled and warmed; a contender that fails to
    compile or run gets ``row["error"]`` and is not timed. ``side``: further arguments of
    ``fn`` (segment ids, offsets) passed as jit arguments, not differentiated."""
    *inputs, d_out = args
    count = len(inputs)
    timed = [("fwd", jax.jit(fn), (*inputs, *side))]
    if with_bwd:

        @jax.jit
        def fwd_bwd(*a):
            xs, rest, cot = a[:count], a[count:-1], a[-1]
            out, vjp = jax.vjp(lambda *x: fn(*x, *rest), *xs)
            return out, vjp(cot)

        timed.append(("fwdbwd", fwd_bwd, (*inputs, *side, d_out)))
    try:
        for _, f, a in timed:
            jax.block_until_ready(f(*a))
            jax.block_until_ready(f(*a))
    except Exception as exc:  # a baseline may not support a shape (or run out of memory)
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        timed = []
    return row, timed, {key: [] for key, _, _ in timed}


def time_rounds(cases: list[tuple], rounds: int, flops: float | Callable[[dict], float]) -> list:
    """Time ``cases`` (from `contender`) in ``rounds`` interleaved rounds; each row gets the
    median ms, TFLOP/s (forward+backward counts 3.5x the forward's FLOPs), best ms and
    spread (max/min - 1) of its rounds."""
    for _ in range(rounds):
        for _, timed, per in cases:
            for key, f, a in timed:
                per[key].append(seconds_per_call(f, *a))
    rows = []
    for row, _, per in cases:
        row_flops = flops(row) if callable(flops) else flops
        for key, times in per.items():
            row[f"{key}_ms"] = statistics.median(times) * 1e3
            factor = 3.5 if key == "fwdbwd" else 1.0
            row[f"{key}_tflops"] = factor * row_flops / row[f"{key}_ms"] * 1e-9
            row[f"{key}_best_ms"] = min(times) * 1e3
            row[f"{key}_spread"] = max(times) / min(times) - 1.0
        rows.append(row)
    return rows
