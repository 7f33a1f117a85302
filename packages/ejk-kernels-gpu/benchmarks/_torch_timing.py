"""Timing of PyTorch contenders (FA4, FlexAttention) in their own process: CUDA events around
``calls`` calls, rounds interleaved between the contenders, as `_timing` does for JAX."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch


def time_interleaved(
    fns: Mapping[Any, Callable[[], Any]], rounds: int, calls: int
) -> dict[Any, tuple[float, float]]:
    """``{name: (median ms, best ms)}`` per call of each of ``fns``, compiled and warmed
    first, then timed in ``rounds`` interleaved rounds of ``calls`` calls."""
    times: dict = {name: [] for name in fns}
    for fn in fns.values():  # compile and warm up
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}
