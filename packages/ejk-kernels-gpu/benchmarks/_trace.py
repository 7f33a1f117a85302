"""GPU time from a profiler trace, shared by the benchmarks: the span of a batch of calls on
the GPU (its first kernel's start to its last one's end), each call's own span, the time
kernels ran, the kernels that took longest, and how much of the collectives' time other
kernels covered (``jax.profiler.trace`` writes the ``*.trace.json.gz`` read here)."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

_TOP_KERNELS = 15


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _covered(start, end, union) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def _call_spans(kernels, calls: int | None) -> list[float]:
    """Each call's span in ms, its first kernel's start to its last one's end, for a trace of
    ``calls`` calls of one jitted function one after the other: every call runs the same
    kernels, so in order of start the first ``len(kernels) // calls`` are the first call's,
    and so on. ``kernels``: ``(start, end, name)`` in us. Empty without ``calls``, or where
    the kernels do not divide into calls of the same kernels in the same order (kernels of
    two calls interleaved). Unlike the span over all the calls it leaves out the GPU's wait
    between two calls."""
    if not calls or not kernels or len(kernels) % calls:
        return []
    ordered = sorted(kernels)
    size = len(ordered) // calls
    groups = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    names = [name for _, _, name in groups[0]]
    if any([name for _, _, name in g] != names for g in groups):
        return []
    return [(max(b for _, b, _ in g) - g[0][0]) / 1e3 for g in groups]


def summarize_trace(trace_dir: Path, calls: int | None = None) -> dict:
    """How much of each GPU's communication ran while its compute kernels ran.

    Reads the ``*.trace.json.gz`` that ``jax.profiler.trace`` writes. Per GPU: the time its
    NCCL kernels (the ring's ``ppermute``, the all-gather's collectives) took, the part of
    it covered by other kernels on that GPU (hidden), the kernels' busy time, the kernels
    that took the most time (summed by name), and with ``calls`` (the trace holds that many
    calls of one jitted function, one after the other) each call's span (`_call_spans`).
    """
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        return {"error": f"no *.trace.json.gz under {trace_dir}"}
    with gzip.open(files[-1], "rb") as fp:
        events = json.load(fp)["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    # Kernels sit on the GPU's "Stream #..." lines; its "XLA Ops"/"XLA Modules" lines span
    # the same time again (a collective's op would cover its own kernel), so they are left out.
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    per_gpu: dict[str, dict[str, list]] = {}
    named: dict[str, list] = {}  # per GPU, every kernel's (start, end, name)
    kernel_ms: dict[str, dict[str, float]] = {}  # per GPU, per kernel name
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or "GPU" not in name or "dur" not in e:
            continue
        if not threads.get((e["pid"], e.get("tid")), "Stream").startswith("Stream"):
            continue
        kind = "comm" if "nccl" in e["name"].lower() else "compute"
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        per_gpu.setdefault(name, {"comm": [], "compute": []})[kind].append(span)
        named.setdefault(name, []).append((*span, e["name"]))
        totals = kernel_ms.setdefault(name, {})
        totals[e["name"][:80]] = totals.get(e["name"][:80], 0.0) + float(e["dur"]) / 1e3
    summary = {
        "file": files[-1].name,
        "lines": sorted({t for (pid, _), t in threads.items() if "GPU" in names.get(pid, "")}),
        "gpus": {},
    }
    for gpu, spans in sorted(per_gpu.items()):
        compute = _union(spans["compute"])
        comm = _union(spans["comm"])
        comm_us = sum(b - a for a, b in comm)
        hidden_us = sum(_covered(a, b, compute) for a, b in comm)
        summary["gpus"][gpu] = {
            "comm_kernels": len(spans["comm"]),
            "comm_ms": comm_us / 1e3,
            "hidden_ms": hidden_us / 1e3,
            "hidden_fraction": hidden_us / comm_us if comm_us else None,
            "compute_busy_ms": sum(b - a for a, b in compute) / 1e3,
            "span_ms": (max(b for _, b in compute + comm) - min(a for a, _ in compute + comm)) / 1e3
            if compute or comm
            else 0.0,
            "top_kernels_ms": dict(
                sorted(kernel_ms[gpu].items(), key=lambda kv: -kv[1])[:_TOP_KERNELS]
            ),
            "call_spans_ms": _call_spans(named[gpu], calls),
        }
    return summary


def gpu_span_ms(fn, args: tuple, calls: int) -> tuple[float, float, dict[str, float], float]:
    """(span, busy, kernels, call span) in ms per call of ``calls`` calls of ``fn`` run back
    to back under a profiler trace: the first kernel's start to the last one's end on the
    GPU, the time kernels ran, the kernels that took longest, by name, and the median of each
    call's own span, without the wait between calls (`summarize_trace`)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as where:
        with jax.profiler.trace(where):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        summary = summarize_trace(Path(where), calls)
    gpus = summary.get("gpus") or {}
    if not gpus:  # (no GPU kernels in the trace: a CPU run)
        return float("nan"), float("nan"), {}, float("nan")
    gpu = gpus[min(gpus)]
    kernels = {name: ms / calls for name, ms in gpu["top_kernels_ms"].items()}
    own = gpu["call_spans_ms"]
    call = float("nan")
    if len(own) == calls:
        call = float(np.median(own))
    else:  # (kernels that do not divide into the calls: `_call_spans`)
        print(f"gpu_span_ms: no call spans ({len(own)} for {calls} calls)", flush=True)
    return gpu["span_ms"] / calls, gpu["compute_busy_ms"] / calls, kernels, call
