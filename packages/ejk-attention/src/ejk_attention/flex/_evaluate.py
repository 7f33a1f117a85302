"""Running a user's mods: on grids of indices (vmapped), and once on abstract scalars to check them.

A mod is written for one element: ``mask_mod(b, h, q_idx, kv_idx)`` and
``score_mod(score, b, h, q_idx, kv_idx)`` on int32 scalars (and a float32 score). Every
implementation evaluates it over a block of elements by nesting `jax.vmap` over the four
index axes, so the mod never sees an array it was not written for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jaxtyping import Bool, Float, Int

__all__ = ["check_mask_mod", "check_score_mod", "mask_grid", "mod_name", "score_grid"]

_INDEX = jax.ShapeDtypeStruct((), jnp.int32)
_SCORE = jax.ShapeDtypeStruct((), jnp.float32)
_ARGS = "(b, h, q_idx, kv_idx)"


def _over_grid(fn: Callable[..., Any], per_element: int) -> Callable[..., Any]:
    """``fn`` of scalars vmapped over ``(b, h, q_idx, kv_idx)`` vectors: outputs ``[b, h, q, kv]``.

    The first ``per_element`` arguments (the score) carry one value per element.
    """
    for axis in (3, 2, 1, 0):  # innermost first: kv, q, h, b
        index_axes = tuple(0 if i == axis else None for i in range(4))
        fn = jax.vmap(fn, in_axes=(0,) * per_element + index_axes)
    return fn


def mask_grid(
    mask_mod: Callable[..., Any],
    b: Int[Array, " b"],
    h: Int[Array, " h"],
    q_idx: Int[Array, " q"],
    kv_idx: Int[Array, " kv"],
) -> Bool[Array, "b h q kv"]:
    """``mask_mod`` at every combination of the given int32 indices."""
    return _over_grid(mask_mod, 0)(b, h, q_idx, kv_idx)


def score_grid(
    score_mod: Callable[..., Any],
    scores: Float[Array, "b h q kv"],
    b: Int[Array, " b"],
    h: Int[Array, " h"],
    q_idx: Int[Array, " q"],
    kv_idx: Int[Array, " kv"],
) -> Float[Array, "b h q kv"]:
    """``score_mod`` applied to float32 ``scores`` at their indices, in float32."""
    return _over_grid(score_mod, 1)(scores, b, h, q_idx, kv_idx).astype(jnp.float32)


def mod_name(mod: Any) -> str:
    """A mod's name for messages: its function's name (a `Partial`'s inner one)."""
    func = getattr(mod, "func", mod)
    return getattr(func, "__name__", type(func).__name__)


def _abstract_call(mod: Any, role: str, where: str, args: tuple[Any, ...]) -> Any:
    """``mod``'s output shape and dtype for abstract scalar ``args``, or an error naming it."""
    if not callable(mod):
        raise TypeError(f"{where}: {role} must be callable, got {mod!r}")
    try:
        return jax.eval_shape(mod, *args)
    except Exception as err:  # any error of the user's function, reported with its name
        signature = f"(score, {_ARGS[1:]}" if role == "score_mod" else _ARGS
        raise ValueError(
            f"{where}: {role} {mod_name(mod)!r} failed when called on int32 scalars "
            f"{signature} (a captured array of the wrong rank?): {type(err).__name__}: {err}"
        ) from err


def _check_scalar(out: Any, role: str, where: str, mod: Any, want: str) -> None:
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
        got = getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"{where}: {role} {mod_name(mod)!r} must return one {want} per element (a scalar), "
            f"got {got}"
        )


def check_mask_mod(mask_mod: Any, where: str) -> None:
    """``mask_mod(b, h, q_idx, kv_idx)`` on int32 scalars returns a bool scalar.

    Raises:
        TypeError: not callable, or it returns another dtype.
        ValueError: it fails on scalars, or returns another shape.
    """
    out = _abstract_call(mask_mod, "mask_mod", where, (_INDEX,) * 4)
    _check_scalar(out, "mask_mod", where, mask_mod, "bool")
    if out.dtype != jnp.bool_:
        raise TypeError(
            f"{where}: mask_mod {mod_name(mask_mod)!r} must return bool, got {out.dtype} "
            "(compare, e.g. q_idx >= kv_idx)"
        )


def check_score_mod(score_mod: Any, where: str) -> None:
    """``score_mod(score, b, h, q_idx, kv_idx)`` on a float32 and int32 scalars returns a float scalar.

    Raises:
        TypeError: not callable, or it returns a non-floating dtype.
        ValueError: it fails on scalars, or returns another shape.
    """
    out = _abstract_call(score_mod, "score_mod", where, (_SCORE, *(_INDEX,) * 4))
    _check_scalar(out, "score_mod", where, score_mod, "float score")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(
            f"{where}: score_mod {mod_name(score_mod)!r} must return a floating score, "
            f"got {out.dtype}"
        )
