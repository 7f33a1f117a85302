"""`vmap_with_config` and `pmap_with_config`: one selection for a whole batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._executor import Executor
from ._kernel import Kernel, is_dynamic

__all__ = ["pmap_with_config", "vmap_with_config"]


def _per_example(args: tuple[Any, ...], in_axes: Any) -> tuple[Any, ...]:
    """``args`` as ShapeDtypeStructs with the mapped axis removed (one example's shapes)."""
    axes = in_axes if isinstance(in_axes, tuple | list) else (in_axes,) * len(args)
    if len(axes) != len(args):
        raise ValueError(f"in_axes has {len(axes)} entries for {len(args)} arguments: {in_axes=}")

    def drop(axis: int | None, x: Any) -> Any:
        if not is_dynamic(x):
            return x
        shape = tuple(x.shape)
        if axis is None:
            return jax.ShapeDtypeStruct(shape, x.dtype)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"in_axes entry {axis} is out of range for shape {shape}")
        axis %= len(shape)
        return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1 :], x.dtype)

    out = []
    for axis, arg in zip(axes, args, strict=True):
        if axis is not None and not isinstance(axis, int):
            raise TypeError(f"in_axes entries must be int or None, got {axis!r}")
        out.append(jax.tree_util.tree_map(lambda x, a=axis: drop(a, x), arg))
    return tuple(out)


def _mapped(
    mapper: Callable[..., Any],
    kernel: Kernel[Any, Any],
    in_axes: Any,
    executor: Executor | None,
    map_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be an ejk_executor.Kernel, got {type(kernel).__name__}")
    ex = Executor() if executor is None else executor

    def call(*args: Any, cfg: Any = None, **kwargs: Any) -> Any:
        if cfg is None:
            cfg = ex.choose(kernel, *_per_example(args, in_axes), **kwargs).cfg

        def one(*a: Any) -> Any:
            return ex(kernel, *a, cfg=cfg, **kwargs)

        return mapper(one, in_axes=in_axes, **map_kwargs)(*args)

    return call


def vmap_with_config(
    kernel: Kernel[Any, Any],
    in_axes: int | tuple[int | None, ...] | None = 0,
    out_axes: Any = 0,
    *,
    executor: Executor | None = None,
    axis_name: str | None = None,
) -> Callable[..., Any]:
    """``jax.vmap`` of ``kernel`` with one config chosen for the whole batch.

    The config is chosen once per call from one example's shapes (the mapped axis
    removed) and used for every example. Keyword arguments of the returned
    function are not mapped; ``cfg=`` forces a config.

    Args:
        kernel: the kernel.
        in_axes: as in ``jax.vmap``, one int or None per positional argument (or one for all).
        out_axes: as in ``jax.vmap``.
        executor: the executor (default: a heuristic one).
        axis_name: as in ``jax.vmap``.
    """
    return _mapped(
        jax.vmap, kernel, in_axes, executor, {"out_axes": out_axes, "axis_name": axis_name}
    )


def pmap_with_config(
    kernel: Kernel[Any, Any],
    axis_name: str | None = None,
    in_axes: int | tuple[int | None, ...] | None = 0,
    out_axes: Any = 0,
    *,
    executor: Executor | None = None,
    **pmap_kwargs: Any,
) -> Callable[..., Any]:
    """``jax.pmap`` of ``kernel`` with the config chosen for the per-device shapes.

    Args:
        kernel: the kernel.
        axis_name: as in ``jax.pmap``.
        in_axes: one int or None per positional argument (or one for all).
        out_axes: as in ``jax.pmap``.
        executor: the executor (default: a heuristic one).
        **pmap_kwargs: passed to ``jax.pmap`` (devices, backend, ...).
    """
    return _mapped(
        jax.pmap,
        kernel,
        in_axes,
        executor,
        {"out_axes": out_axes, "axis_name": axis_name, **pmap_kwargs},
    )
