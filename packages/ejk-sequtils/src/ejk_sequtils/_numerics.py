"""Small numerical helpers: stable log-sum-exp, safe division, chunking, gradient dtype casts."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from ._checks import check_positive_int

# Public functions take jax or NumPy arrays alike.
AnyArray = Array | np.ndarray

Axis = int | tuple[int, ...] | None


def log_sum_exp(
    x: Float[AnyArray, "..."], axis: Axis = None, keepdims: bool = False
) -> Float[Array, "..."]:
    """Numerically stable ``log(sum(exp(x)))`` along ``axis``.

    Large inputs do not overflow (the maximum is subtracted first). A slice that is
    all ``-inf`` (a fully masked attention row) gives ``-inf`` with zero gradients,
    never NaN; ``+inf`` gives ``+inf`` and NaN propagates.

    Args:
        x: floating array of any shape.
        axis: axis or axes to reduce; None reduces all.
        keepdims: keep the reduced axes with size 1.

    Returns:
        the reduced array, in the dtype of ``x``.
    """
    x = jnp.asarray(x)
    x_max = jnp.max(x, axis=axis, keepdims=True)
    # An infinite maximum (all -inf, or some +inf) would give inf - inf = NaN below.
    x_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(x_max), x_max, 0))
    total = jnp.sum(jnp.exp(x - x_max), axis=axis, keepdims=keepdims)
    empty = total == 0
    # log(0) is -inf, and its gradient 1/0 times exp(-inf) = 0 would be NaN: take the log
    # of 1 there instead, so the gradient through the discarded branch is exactly zero.
    lse = jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1, total)))
    if not keepdims:
        x_max = jnp.squeeze(x_max, axis=axis)
    return (lse + x_max).astype(x.dtype)


def safe_divide(
    numerator: Shaped[AnyArray, "..."] | float | int,
    denominator: Shaped[AnyArray, "..."] | float | int,
    min_denominator: float | int = 1e-10,
) -> Float[Array, "..."]:
    """``numerator / denominator`` with the denominator's magnitude kept at least ``min_denominator``.

    A denominator with ``|d| < min_denominator`` is replaced by ``±min_denominator`` with
    its sign (0 counts as positive), so a zero denominator gives a large finite value
    instead of inf/NaN and negative denominators keep their sign.

    Args:
        numerator: array, broadcastable with ``denominator``.
        denominator: array.
        min_denominator: the smallest magnitude used, > 0.

    Returns:
        the quotient, of the broadcast shape.
    """
    if not min_denominator > 0:
        raise ValueError(f"min_denominator must be > 0, got {min_denominator=}")
    denominator = jnp.asarray(denominator)
    small = jnp.abs(denominator) < min_denominator
    clamped = jnp.where(denominator < 0, -min_denominator, min_denominator).astype(
        denominator.dtype
    )
    return jnp.asarray(numerator) / jnp.where(small, clamped, denominator)


def identity_dtype_convert(dtype) -> Callable[[Array], Array]:
    """An identity function whose backward pass casts the cotangent to ``dtype``.

    Mixed precision: the forward pass keeps its input as it is, gradients flowing back
    through it arrive in ``dtype`` (e.g. float32 gradients for a bfloat16 tensor).

    Args:
        dtype: the dtype gradients are cast to.

    Returns:
        ``f(x) -> x`` with that custom VJP; usable under ``jax.jit``.
    """
    dtype = jnp.dtype(dtype)

    @jax.custom_vjp
    def identity(x):
        return x

    def forward(x):
        return x, None

    def backward(_, g):
        return (g.astype(dtype),)

    identity.defvjp(forward, backward)
    return identity


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array with {ndim} axes")
    return axis % ndim


def chunk_array(
    arr: Shaped[AnyArray, "..."],
    chunk_size: int,
    axis: int = 0,
    pad_value: float | int | bool = 0.0,
) -> Shaped[Array, "..."]:
    """Split ``axis`` into ``[num_chunks, chunk_size]``, padding its end with ``pad_value``.

    ``chunk_array(jnp.arange(10), 4)`` is ``[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]``.

    Args:
        arr: array with L entries along ``axis``.
        chunk_size: positive chunk length.
        axis: the axis to split (negative counts from the end).
        pad_value: value of the padding entries.

    Returns:
        ``arr`` with ``axis`` replaced by ``[⌈L / chunk_size⌉, chunk_size]``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    arr = jnp.asarray(arr)
    axis = _normalize_axis(axis, arr.ndim)
    length = arr.shape[axis]
    num_chunks = -(-length // chunk_size)
    pad = [(0, 0)] * arr.ndim
    pad[axis] = (0, num_chunks * chunk_size - length)
    arr = jnp.pad(arr, pad, constant_values=jnp.asarray(pad_value, arr.dtype))
    return arr.reshape(*arr.shape[:axis], num_chunks, chunk_size, *arr.shape[axis + 1 :])


def unchunk_array(
    arr: Shaped[AnyArray, "..."], original_length: int, axis: int = 0
) -> Shaped[Array, "..."]:
    """Undo `chunk_array`: merge axes ``axis`` and ``axis + 1`` and drop the padding.

    Args:
        arr: chunked array, ``[num_chunks, chunk_size]`` at ``axis``.
        original_length: the length before chunking, at most ``num_chunks * chunk_size``.
        axis: the axis given to `chunk_array` (negative counts from the end of the
            unchunked shape, so the same value round-trips).

    Returns:
        ``arr`` with those two axes merged into one of length ``original_length``.
    """
    arr = jnp.asarray(arr)
    if arr.ndim < 2:
        raise ValueError(
            f"arr must have a chunk axis and a chunk-size axis, got arr.shape={arr.shape}"
        )
    axis = _normalize_axis(axis, arr.ndim - 1)
    capacity = arr.shape[axis] * arr.shape[axis + 1]
    if isinstance(original_length, bool) or not isinstance(original_length, int):
        raise TypeError(f"original_length must be an int, got {original_length!r}")
    if not 0 <= original_length <= capacity:
        raise ValueError(
            f"original_length={original_length} must be in [0, {capacity}] for chunks of shape "
            f"{arr.shape[axis : axis + 2]}"
        )
    merged = arr.reshape(*arr.shape[:axis], capacity, *arr.shape[axis + 2 :])
    return jax.lax.slice_in_dim(merged, 0, original_length, axis=axis)
