"""Timing and checking attention backends: the engine behind ``ejk bench`` and ``ejk tune``."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejk_sequtils import reference_attention, validate_attention

from ._backends import IMPLEMENTATIONS, default_order
from ._flash import flash_attention

__all__ = [
    "BASELINE",
    "BENCH_IMPLEMENTATIONS",
    "BenchCase",
    "bench_implementations",
    "inputs_for",
    "median_ms",
    "parse_case",
    "run_case",
    "tflops",
]

# jax's own attention (its xla path), timed beside ejk's backends as a baseline. It is
# not a flash_attention backend, so `ejk tune` never stores it.
BASELINE = "jax-nn"
# What `ejk bench --impl` takes: flash_attention's backends, then the baseline.
BENCH_IMPLEMENTATIONS = (*IMPLEMENTATIONS, BASELINE)
# Largest |out - reference| accepted, by dtype: f32 must agree closely; f16/bf16 round.
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
# GPUs and TPUs run float32 dots at reduced precision by default (TF32: a 10-bit
# mantissa, ~1e-3 relative), as jax.nn's own attention does there.
_ACCELERATOR_F32_TOLERANCE = 1e-2


def tolerance(dtype: str, platform: str) -> float:
    """The accepted max |out - reference| for ``dtype`` outputs on ``platform``."""
    if dtype == "float32" and platform != "cpu":
        return _ACCELERATOR_F32_TOLERANCE
    return TOLERANCE[dtype]


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One attention problem: ``q [B, T, N, H]``, ``k/v [B, S, K, H]``."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    dtype: str = "float32"

    @property
    def label(self) -> str:
        mask = " causal" if self.causal else ""
        return (
            f"B{self.batch} T{self.q_len} S{self.kv_len} N{self.heads} K{self.kv_heads} "
            f"H{self.head_dim} {self.dtype}{mask}"
        )

    def flops(self, backward: bool) -> float:
        """Matmul FLOPs of the dense problem (4·B·N·T·S·H forward, x2.5 with the backward)."""
        f = 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
        if self.causal:
            f /= 2
        return f * (3.5 if backward else 1.0)


def parse_case(text: str, dtype: str = "float32") -> BenchCase:
    """``"B,T,S,N,K,H"`` with an optional ``",causal"``, e.g. ``"1,1024,1024,8,2,64,causal"``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    causal = bool(parts) and parts[-1] == "causal"
    if causal:
        parts = parts[:-1]
    if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be 'B,T,S,N,K,H[,causal]' with positive ints, got {text!r}")
    b, t, s, n, k, h = map(int, parts)
    if n % k:
        raise ValueError(f"shape {text!r}: heads N={n} must be a multiple of kv heads K={k}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {dtype!r}")
    return BenchCase(b, t, s, n, k, h, causal, dtype)


def bench_implementations(platform: str | None = None) -> tuple[str, ...]:
    """The default implementations to time on ``platform``: its backends, then jax.nn."""
    return (*default_order(platform or jax.default_backend()), BASELINE)


def inputs_for(case: BenchCase, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    shapes = (
        (case.batch, case.q_len, case.heads, case.head_dim),
        (case.batch, case.kv_len, case.kv_heads, case.head_dim),
        (case.batch, case.kv_len, case.kv_heads, case.head_dim),
    )
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _attention_fn(implementation: str, causal: bool) -> Callable:
    if implementation == BASELINE:
        return functools.partial(
            jax.nn.dot_product_attention, is_causal=causal, implementation="xla"
        )
    return functools.partial(flash_attention, causal=causal, implementation=implementation)


def median_ms(fn: Callable, args: Sequence[Any], warmup: int, iters: int) -> float:
    """Median wall time of ``fn(*args)`` in ms over ``iters`` runs, after a compile and ``warmup``."""
    jax.block_until_ready(fn(*args))  # compile, never timed
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def run_case(
    case: BenchCase,
    implementation: str,
    *,
    backward: bool = True,
    warmup: int = 1,
    iters: int = 5,
) -> dict[str, Any]:
    """Check one implementation against the reference on ``case``, then time it.

    Returns:
        A JSON-ready row: the case, ``status`` (``"ok"``, ``"mismatch"``, ``"refused"``),
        ``max_abs_err`` vs the float32 reference, ``fwd_ms``/``fwd_bwd_ms`` (medians) and
        ``fwd_tflops``/``fwd_bwd_tflops``; ``reason`` when refused.
    """
    row: dict[str, Any] = {
        "case": case.label,
        **dataclasses.asdict(case),
        "implementation": implementation,
    }
    q, k, v = inputs_for(case)
    attend = _attention_fn(implementation, case.causal)
    fwd = jax.jit(attend)
    try:
        out = jax.block_until_ready(fwd(q, k, v))
    except NotImplementedError as err:
        return {**row, "status": "refused", "reason": str(err)}
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = reference_attention(*f32, causal=case.causal)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
    row["max_abs_err"] = err
    row["tolerance"] = tolerance(case.dtype, out.devices().pop().platform)
    row["status"] = "ok" if err <= row["tolerance"] and math.isfinite(err) else "mismatch"
    row["fwd_ms"] = median_ms(fwd, (q, k, v), warmup, iters)
    row["fwd_tflops"] = case.flops(False) / (row["fwd_ms"] * 1e-3) / 1e12
    if backward:
        grad = jax.jit(
            jax.grad(
                lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)
            )
        )
        row["fwd_bwd_ms"] = median_ms(grad, (q, k, v), warmup, iters)
        row["fwd_bwd_tflops"] = case.flops(True) / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    return row


def tflops(row: dict[str, Any], field: str) -> float | None:
    """A row's TFLOP/s for ``field`` (``"fwd_ms"`` or ``"fwd_bwd_ms"``), None if not timed.

    Computed from the row's case and time, so rows written before ``fwd_bwd_tflops``
    existed give the same figure.
    """
    ms = row.get(field)
    if ms is None or ms <= 0:
        return None
    case = BenchCase(**{f.name: row[f.name] for f in dataclasses.fields(BenchCase)})
    return case.flops(field == "fwd_bwd_ms") / (ms * 1e-3) / 1e12


def run_all(
    cases: Iterable[BenchCase],
    implementations: Sequence[str],
    *,
    progress: Callable[[Iterable], Iterable] = lambda x: x,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """`run_case` over every case and implementation (``progress`` wraps the loop, e.g. tqdm)."""
    jobs = [(c, i) for c in cases for i in implementations]
    return [run_case(c, i, **kwargs) for c, i in progress(jobs)]


def request_for(case: BenchCase) -> Any:
    """The validated request a case makes (for its backend-choice cache key)."""
    q, k, v = (
        jax.ShapeDtypeStruct(s, jnp.dtype(case.dtype))
        for s in (
            (case.batch, case.q_len, case.heads, case.head_dim),
            (case.batch, case.kv_len, case.kv_heads, case.head_dim),
            (case.batch, case.kv_len, case.kv_heads, case.head_dim),
        )
    )
    return validate_attention(*_stand_ins(q, k, v), causal=case.causal)


def _stand_ins(*structs: jax.ShapeDtypeStruct) -> list[np.ndarray]:
    # Zero-stride NumPy views: the right shape and dtype, no memory.
    return [np.broadcast_to(np.zeros((), s.dtype), s.shape) for s in structs]
