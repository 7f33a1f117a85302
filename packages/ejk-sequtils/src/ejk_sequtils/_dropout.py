"""The dropout keep-mask every ejk backend draws: a counter-based hash of the element's index.

The kernels (Triton, Pallas) compute the same hash in their own languages from the
constants here; their tests compare against `dropout_keep_mask`.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, UInt32

__all__ = [
    "DROPOUT_HASH",
    "dropout_keep_mask",
    "dropout_key",
    "dropout_seed_u32",
    "dropout_threshold",
]

# (golden-ratio multiplier, MurmurHash3 fmix32 multipliers 1 and 2)
DROPOUT_HASH: tuple[int, int, int] = (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35)


def _mix(h: Array, x: Array) -> Array:
    """One round of the counter hash (uint32, wrapping arithmetic)."""
    golden, mur1, mur2 = DROPOUT_HASH
    h = h ^ (x * jnp.uint32(golden))
    h = (h ^ (h >> 16)) * jnp.uint32(mur1)
    h = (h ^ (h >> 13)) * jnp.uint32(mur2)
    return h ^ (h >> 16)


def dropout_seed_u32(seed: int | ArrayLike) -> Array:
    """``seed`` as a uint32 scalar: a Python int (taken mod 2**32), or an int32/uint32 scalar
    array (int32 bits reinterpreted)."""
    if isinstance(seed, bool):
        raise TypeError(f"dropout_seed must be an int or an int32/uint32 scalar, got {seed!r}")
    if isinstance(seed, numbers.Integral):
        return jnp.uint32(int(seed) & 0xFFFFFFFF)
    if isinstance(seed, numbers.Real):
        raise TypeError(f"dropout_seed must be an int or an int32/uint32 scalar, got {seed!r}")
    seed = jnp.asarray(seed)
    if seed.shape != ():
        raise ValueError(f"dropout_seed must be a scalar, got dropout_seed.shape={seed.shape}")
    if seed.dtype == jnp.uint32:
        return seed
    if seed.dtype == jnp.int32:
        return jax.lax.bitcast_convert_type(seed, jnp.uint32)
    raise TypeError(
        f"dropout_seed must be an int or an int32/uint32 scalar, got dropout_seed.dtype={seed.dtype}"
    )


def _offsets_u32(offsets: Any) -> list[Array]:
    """``offsets`` (None, or four ints / int32 scalars) as four uint32 scalars."""
    if offsets is None:
        return [jnp.uint32(0)] * 4
    if not isinstance(offsets, tuple | list) or len(offsets) != 4:
        raise ValueError(
            "dropout offsets must be four indices (batch, head, row, column), got "
            f"offsets={offsets!r}"
        )
    out = []
    for name, x in zip(("batch", "head", "row", "column"), offsets, strict=True):
        x = jnp.asarray(x)
        if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(
                f"the {name} offset of dropout must be an integer scalar, got {x.dtype}{x.shape}"
            )
        out.append(x.astype(jnp.uint32))
    return out


def dropout_key(seed: int | ArrayLike, offsets: Any = None) -> UInt32[Array, 5]:
    """What a kernel reads to draw its part of the keep-mask: uint32 ``[seed, b0, n0, i0, j0]``.

    ``offsets`` ``(b0, n0, i0, j0)`` are the global (batch, query head, row, column) of
    the call's first element (None: all 0). A shard of a sharded call (a batch or head
    slice, a ring step's block) passes its own, so every shard draws exactly its slice
    of the mask the whole call would draw (`dropout_keep_mask` with the same offsets).
    """
    return jnp.stack([dropout_seed_u32(seed), *_offsets_u32(offsets)])


def dropout_threshold(rate: float) -> int:
    """The 24-bit threshold under which a hashed element is dropped."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate=}")
    return round(rate * (1 << 24))


def dropout_keep_mask(
    seed: int | ArrayLike,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    rate: float,
    *,
    offsets: Any = None,
) -> Bool[Array, "B N T S"]:
    """The dropout keep-mask every ejk backend uses, from a counter-based hash.

    ``h = mix(mix(mix(mix(seed, b), n), i), j)`` over uint32 with wrap-around, where
    ``mix(h, x) = fmix32(h ^ (x * 0x9E3779B1))`` (MurmurHash3's finaliser), ``b`` the
    batch index, ``n`` the query head, ``i`` the query row and ``j`` the key column.
    An element is kept when ``(h >> 8) >= round(rate * 2**24)``. The mask does not
    depend on block sizes, so every backend and every tiling drops the same weights.

    Args:
        seed: a Python int or a uint32/int32 scalar array.
        batch, heads, q_len, kv_len: the shape ``[B, N, T, S]`` of the mask.
        rate: the dropout probability in ``[0, 1)``.
        offsets: ``(b0, n0, i0, j0)``, ints or int32 scalars (traced is fine): the mask
            of the indices ``b0 + b``, ``n0 + n``, ``i0 + i``, ``j0 + j``, i.e. the slice
            of a larger call's mask that a shard of it draws. None: zeros.

    Returns:
        bool ``[B, N, T, S]``, True where the probability is kept.
    """
    threshold = dropout_threshold(rate)
    shape = (batch, heads, q_len, kv_len)
    b, n, i, j = (
        jax.lax.broadcasted_iota(jnp.uint32, shape, d) + origin
        for d, origin in enumerate(_offsets_u32(offsets))
    )
    h = _mix(_mix(_mix(_mix(dropout_seed_u32(seed), b), n), i), j)
    return (h >> 8) >= jnp.uint32(threshold)
