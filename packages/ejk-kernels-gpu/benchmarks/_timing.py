"""Interleaved timing shared by the benchmarks: compile every contender first, then time
each in turn per round, so a drift of the card's clocks over the run falls on all alike.

A round times a batch of calls back to back, synchronised once at its end: at least
`MIN_REPS` calls, and for short calls as many as fill about `BATCH_SECONDS` (at most
`MAX_REPS`), so that the host's lead before a batch's first kernel and the final
synchronisation (about 0.4 ms on the H200) weigh a few microseconds a call, not 40 as over
ten calls of 0.3 ms (docs/performance.md, "Method and commands")."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

MIN_REPS = 10
BATCH_SECONDS = 0.025
MAX_REPS = 200


def reps_for(seconds: float) -> int:
    """Calls a timed batch runs for a call taking about ``seconds`` (one warm call's wall
    time, which overstates short calls, so their batches run a little under
    `BATCH_SECONDS`)."""
    if not seconds > 0.0:
        return MIN_REPS
    return max(MIN_REPS, min(MAX_REPS, math.ceil(BATCH_SECONDS / seconds)))


def seconds_per_call(fn: Callable[..., Any], *args: Any, reps: int = 10) -> float:
    """Seconds per call over ``reps`` calls (synchronised at the end)."""
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _compiled(fn: Callable[..., Any], args: tuple, with_bwd: bool, side: tuple) -> list:
    """``[(key, jitted, arguments)]`` of ``fn``'s forward (and forward+backward, the
    cotangent being ``args[-1]``), not yet compiled."""
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
    return timed


def _warm(row: dict, timed: list) -> list:
    """Compile and warm each of ``timed``; keep those that run, each with the calls a timed
    batch of it runs (`reps_for` its second call). A failing forward fails the whole
    contender (``row["error"]``); a failing forward+backward alone is noted as
    ``row["fwdbwd_error"]`` and its forward is still timed."""
    kept = []
    for key, f, a in timed:
        try:
            jax.block_until_ready(f(*a))
            start = time.perf_counter()
            jax.block_until_ready(f(*a))
            once = time.perf_counter() - start
        except Exception as exc:  # a baseline may not support a shape (or run out of memory)
            if key == "fwd":
                row["error"] = _error(exc)
                return []
            row[f"{key}_error"] = _error(exc)
            continue
        kept.append((key, f, a, reps_for(once)))
    return kept


def contender(
    row: dict,
    fn: Callable[..., Any] | Mapping[str, Callable[..., Any]] | None,
    args: tuple,
    with_bwd: bool,
    side: tuple = (),
) -> tuple:
    """``(row, timed, times)`` of one contender: its jitted forward (and forward+backward,
    the cotangent being ``args[-1]``), compiled and warmed; a contender that fails to
    compile or run gets ``row["error"]`` and is not timed. ``side``: further arguments of
    ``fn`` (segment ids, offsets) passed as jit arguments, not differentiated.

    ``fn`` may also be ``{name: function}``, implementations of one library tried in order:
    the first whose forward runs is timed and named in ``row["ran"]``, the ones before it
    in ``row["refused"]`` with their errors. ``None`` or ``{}``: nothing to time (the row
    says why, e.g. ``row["skipped"]``)."""
    if not fn:
        if "error" not in row:
            row.setdefault("skipped", "no implementation to time")
        return row, [], {}
    if callable(fn):
        timed = _warm(row, _compiled(fn, args, with_bwd, side))
        return row, timed, {key: [] for key, *_ in timed}
    refused = {}
    for name, candidate in fn.items():
        trial = dict(row)
        timed = _warm(trial, _compiled(candidate, args, with_bwd, side))
        if timed:
            row.clear()
            row.update(trial, ran=name)
            if refused:
                row["refused"] = refused
            return row, timed, {key: [] for key, *_ in timed}
        refused[name] = trial["error"]
    row["error"] = "; ".join(f"{name}: {error}" for name, error in refused.items())
    return row, [], {}


def time_rounds(
    cases: list[tuple], rounds: int, flops: float | Callable[[dict], float], rotate: bool = False
) -> list:
    """Time ``cases`` (from `contender`) in ``rounds`` interleaved rounds; each row gets the
    median ms, TFLOP/s (forward+backward counts 3.5x the forward's FLOPs), best ms, spread
    (max/min - 1) of its rounds and the calls a round timed (``*_reps``). ``rotate``: round
    r starts at case r (mod their count), so no case is always timed first (a probe saw the
    first of two programs with equal HLO read 10 % slower, docs/performance.md "Decoding")."""
    for r in range(rounds):
        start = r % len(cases) if rotate and cases else 0
        for _, timed, per in cases[start:] + cases[:start]:
            for key, f, a, reps in timed:
                per[key].append(seconds_per_call(f, *a, reps=reps))
    rows = []
    for row, timed, per in cases:
        row_flops = flops(row) if callable(flops) else flops
        reps_of = {key: reps for key, _, _, reps in timed}
        for key, times in per.items():
            row[f"{key}_reps"] = reps_of[key]
            row[f"{key}_ms"] = statistics.median(times) * 1e3
            factor = 3.5 if key == "fwdbwd" else 1.0
            row[f"{key}_tflops"] = factor * row_flops / row[f"{key}_ms"] * 1e-9
            row[f"{key}_best_ms"] = min(times) * 1e3
            row[f"{key}_spread"] = max(times) / min(times) - 1.0
        rows.append(row)
    return rows
