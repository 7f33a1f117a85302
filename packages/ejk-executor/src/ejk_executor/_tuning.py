"""Timing: `benchmark`, `timer`, `autotune`, and the concrete stand-ins used when tuning
a call made inside `jax.jit`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._kernel import Invocation, Kernel, is_dynamic

__all__ = [
    "Timer",
    "autotune",
    "benchmark",
    "get_memory_usage",
    "make_body",
    "standin",
    "timer",
    "tune_invocation",
]

logger = logging.getLogger("ejk_executor")


@dataclasses.dataclass
class Timer:
    """Elapsed wall time of a `timer` block; ``seconds`` is set when the block ends."""

    name: str | None = None
    seconds: float = float("nan")

    @property
    def ms(self) -> float:
        """The elapsed time in milliseconds."""
        return self.seconds * 1e3


@contextlib.contextmanager
def timer(name: str | None = None) -> Iterator[Timer]:
    """Time a block: ``with timer("step") as t: ...`` then ``t.ms``; logged at debug level."""
    t = Timer(name)
    start = time.perf_counter()
    try:
        yield t
    finally:
        t.seconds = time.perf_counter() - start
        logger.debug("timer %s: %.3f ms", name or "", t.ms)


def _check_counts(num_warmup: int, num_iters: int) -> None:
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"num_iters must be a positive int, got {num_iters=!r}")
    if not isinstance(num_warmup, int) or num_warmup < 0:
        raise ValueError(f"num_warmup must be a non-negative int, got {num_warmup=!r}")


def _once(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def benchmark(
    fn: Callable[..., Any], *args: Any, num_warmup: int = 2, num_iters: int = 10, **kwargs: Any
) -> float:
    """The median wall time of ``fn(*args, **kwargs)`` in milliseconds, waiting for results.

    Args:
        fn: the function to time (jitted or not).
        num_warmup: untimed calls first (compilation, caches).
        num_iters: timed calls; the median is returned.
    """
    _check_counts(num_warmup, num_iters)
    for _ in range(num_warmup):
        jax.block_until_ready(fn(*args, **kwargs))
    times = [_once(functools.partial(fn, **kwargs), args) for _ in range(num_iters)]
    return statistics.median(times) * 1e3


def standin(leaf: Any, rng: np.random.Generator) -> Any:
    """A concrete array for an argument leaf: the leaf itself when it is a concrete
    array, else random values (floats: normal; ints: small non-negative; bools:
    True) of its shape and dtype, placed with its sharding when known."""
    if not is_dynamic(leaf):
        return leaf
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
        return leaf
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        value = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    elif jnp.issubdtype(dtype, jnp.complexfloating):
        value = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    elif dtype == np.bool_:
        value = np.ones(shape, dtype)
    else:
        value = rng.integers(0, 2, size=shape).astype(dtype)
    sharding = None
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
    return jax.device_put(value, sharding)


def split_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[Any], list[int]]:
    """(treedef of (args, kwargs), all leaves, positions of the dynamic ones)."""
    leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    dyn_index = [i for i, x in enumerate(leaves) if is_dynamic(x)]
    return treedef, leaves, dyn_index


def make_body(
    kernel: Kernel[Any, Any],
    cfg: Any,
    platform: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    differentiable: bool = True,
) -> Callable[..., Any]:
    """A function of the dynamic leaves of ``(args, kwargs)`` running ``kernel`` with
    ``cfg`` on ``platform``, with the kernel's custom backward attached if it has one."""
    treedef, leaves, dyn_index = split_leaves(args, kwargs)
    template = list(leaves)
    for i in dyn_index:
        template[i] = None  # keep no array alive in the closure
    run = kernel.method("run", platform)
    if run is None:
        raise NotImplementedError(f"kernel {kernel.name!r} has no run method for {platform!r}")

    def rebuild(dyn: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        full = list(template)
        for i, x in zip(dyn_index, dyn, strict=True):
            full[i] = x
        return treedef.unflatten(full)

    def body(*dyn: Any) -> Any:
        a, kw = rebuild(dyn)
        return run(*a, cfg=cfg, **kw)

    if not differentiable or not kernel.has_custom_backward(platform):
        return body
    inexact = [jnp.issubdtype(leaves[i].dtype, jnp.inexact) for i in dyn_index]
    return _with_custom_backward(
        kernel, cfg, platform, args, kwargs, body, rebuild, dyn_index, inexact
    )


def _with_custom_backward(
    kernel: Kernel[Any, Any],
    cfg: Any,
    platform: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    body: Callable[..., Any],
    rebuild: Callable[[Sequence[Any]], tuple[tuple[Any, ...], dict[str, Any]]],
    dyn_index: list[int],
    inexact: list[bool],
) -> Callable[..., Any]:
    """``body`` as a ``jax.custom_vjp`` whose rules are the kernel's
    ``forward_with_residuals`` and ``backward``; integer and boolean inputs get no
    cotangent (None), whatever ``backward`` returns for them."""
    fwd = kernel.method("forward_with_residuals", platform)
    bwd = kernel.method("backward", platform)
    arg_defs = [jax.tree_util.tree_structure(a) for a in args]
    n_arg_leaves = sum(d.num_leaves for d in arg_defs)
    for name, value in kwargs.items():
        for leaf in jax.tree_util.tree_leaves(value):
            if is_dynamic(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise TypeError(
                    f"kernel {kernel.name!r} has a custom backward, so floating-point arrays "
                    f"must be passed positionally; got keyword argument {name}= of dtype "
                    f"{np.dtype(leaf.dtype).name}"
                )

    f = jax.custom_vjp(body)

    def f_fwd(*dyn: Any) -> Any:
        a, kw = rebuild(dyn)
        out, residuals = fwd(*a, cfg=cfg, **kw)
        return out, (residuals, dyn)

    def f_bwd(saved: Any, dout: Any) -> tuple[Any, ...]:
        residuals, dyn = saved
        _, kw = rebuild(dyn)
        grads = bwd(residuals, dout, cfg=cfg, **kw)
        if not isinstance(grads, tuple | list) or len(grads) != len(arg_defs):
            raise TypeError(
                f"kernel {kernel.name!r}: backward must return a tuple with one gradient per "
                f"positional argument ({len(arg_defs)}), got {type(grads).__name__}"
                + (f" of length {len(grads)}" if isinstance(grads, tuple | list) else "")
            )
        flat: list[Any] = []
        for d, g in zip(arg_defs, grads, strict=True):
            flat.extend([None] * d.num_leaves if g is None else d.flatten_up_to(g))
        return tuple(
            flat[i] if i < n_arg_leaves and differentiable else None
            for i, differentiable in zip(dyn_index, inexact, strict=True)
        )

    f.defvjp(f_fwd, f_bwd)
    return f


def tune_invocation(
    inv: Invocation[Any, Any],
    candidates: Sequence[Any],
    *,
    num_warmup: int = 1,
    num_iters: int = 5,
) -> tuple[Any, dict[int, float]]:
    """Compile and time ``inv``'s kernel for each candidate config on concrete inputs.

    Works when ``inv`` holds tracers (a call inside ``jax.jit``) or ShapeDtypeStructs
    (a recorded call): the inputs are then random stand-ins of the same shapes and
    dtypes, and everything happens outside the caller's trace. A candidate that
    fails to build or run is skipped and its reason logged.

    Every candidate is compiled and warmed up first; then each of ``num_iters`` rounds
    times every candidate once, in turn. An accelerator slows down as it warms up (an
    H100 by 6-11 % over its first rounds of attention kernels): timed one after another,
    the first candidates would have the cool card; interleaved, all share its drift.

    Returns:
        (the fastest config, {candidate index: median ms} for those that ran).

    Raises:
        RuntimeError: if every candidate failed.
    """
    if not candidates:
        raise ValueError(f"no candidate configs to tune {inv.call_key}")
    _check_counts(num_warmup, num_iters)
    reasons: list[str] = []

    def skip(cfg: Any, e: Exception) -> None:
        reason = f"{type(e).__name__}: {e}"
        reasons.append(f"{cfg!r}: {reason}")
        logger.warning("autotune %s: skipping candidate %r (%s)", inv.call_key, cfg, reason)

    with jax.ensure_compile_time_eval():
        rng = np.random.default_rng(0)
        args, kwargs = jax.tree_util.tree_map(
            lambda x: standin(x, rng), (inv.args, dict(inv.kwargs))
        )
        _, leaves, dyn_index = split_leaves(args, kwargs)
        dyn = [leaves[i] for i in dyn_index]
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in dyn]
        runners: dict[int, Callable[..., Any]] = {}
        for index, cfg in enumerate(candidates):
            try:
                body = make_body(inv.kernel, cfg, inv.platform, args, kwargs, differentiable=False)
                compiled = jax.jit(body).lower(*abstract).compile()
                for _ in range(num_warmup):
                    jax.block_until_ready(compiled(*dyn))
                runners[index] = compiled
            except Exception as e:
                skip(cfg, e)
        samples: dict[int, list[float]] = {index: [] for index in runners}
        for _ in range(num_iters):
            for index in list(runners):
                try:
                    samples[index].append(_once(runners[index], dyn))
                except Exception as e:  # e.g. out of memory beside the other candidates
                    skip(candidates[index], e)
                    del runners[index], samples[index]
    if not samples:
        raise RuntimeError(
            f"autotune {inv.call_key}: every candidate failed:\n  " + "\n  ".join(reasons)
        )
    times = {index: statistics.median(ts) * 1e3 for index, ts in samples.items()}
    best = min(times, key=times.__getitem__)
    logger.info(
        "autotune %s: chose %r (%.4f ms) among %d candidates",
        inv.call_key,
        candidates[best],
        times[best],
        len(candidates),
    )
    return candidates[best], times


def autotune(
    kernel: Kernel[Any, Any],
    *args: Any,
    configs: Sequence[Any] | None = None,
    num_warmup: int = 1,
    num_iters: int = 5,
    **kwargs: Any,
) -> Any:
    """The fastest config for ``kernel(*args, **kwargs)`` among ``configs``
    (default: ``kernel.config_space``). Args may be arrays, tracers or ShapeDtypeStructs.
    The result is not cached; the executor's chain caches what it tunes."""
    inv = Invocation.make(kernel, args, kwargs)
    candidates = list(kernel.config_space(inv) if configs is None else configs)
    return tune_invocation(inv, candidates, num_warmup=num_warmup, num_iters=num_iters)[0]


def get_memory_usage(device: jax.Device | None = None) -> dict[str, int]:
    """The runtime's memory statistics of ``device`` (default: the first device), e.g.
    ``bytes_in_use`` and ``peak_bytes_in_use``; empty where the backend reports none (CPU)."""
    if device is None:
        device = jax.devices()[0]
    elif not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device or None, got {device!r}")
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    return {k: int(v) for k, v in (stats or {}).items() if isinstance(v, int | float)}
