"""`BlockMask`: a mask_mod with its per-block tables, and `create_block_mask` that builds them.

The ``[B, N, T, S]`` visibility a mask_mod defines is cut into blocks of
``block_size = (q_block, kv_block)``. Each block is *empty* (no element visible: kernels
never visit it), *full* (every element visible: kernels skip the mask_mod there) or
*partial* (kernels apply the mask_mod per element). ejk's own mods are classified from
their definitions (`_block_kinds`); what that leaves undecided, and a user's own
function, is evaluated blockwise: each step evaluates the mask_mod over a few blocks and
reduces them, so a mask of T = 128k is never held as ``T x S`` booleans.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Bool, Float, Int

from ejk_sequtils import cdiv

from ._block_kinds import Blocks, analytic_kinds, block_kinds_of, refine_unknown
from ._evaluate import check_mask_mod, mask_grid
from ._mods import check_captures

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockIndices", "BlockMask", "create_block_mask"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_DEFAULT_BLOCK = 128
# Mask elements evaluated per step while building the tables (a few MiB of booleans).
_MAX_ELEMENTS = 1 << 22


class BlockIndices(NamedTuple):
    """The visited blocks of each row of blocks, FlexAttention's layout (partial and full apart).

    For each ``[b, h, row]``: ``partial_indices[..., :partial_num]`` are the partial blocks
    in ascending order, ``full_indices[..., :full_num]`` the full ones; entries past the
    counts name the other blocks and are not to be read.
    """

    partial_num: Int[Array, "B N R"]
    partial_indices: Int[Array, "B N R C"]
    full_num: Int[Array, "B N R"]
    full_indices: Int[Array, "B N R C"]


def _split_mod(mod: Any) -> tuple[list[Any], Any]:
    """``(leaves, static)``: a mod as pytree data and the static rest.

    A pytree whose leaves are all arrays or numbers (ejk's mods, `jax.tree_util.Partial`s)
    keeps them as leaves, so they may be traced; any other callable (a closure) is static
    whole, and hashes by identity.
    """
    leaves, treedef = jax.tree_util.tree_flatten(mod)
    if all(isinstance(x, jax.Array | np.ndarray | np.generic | numbers.Number) for x in leaves):
        return leaves, ("pytree", treedef)
    return [], ("static", mod)


def _join_mod(static: Any, leaves: list[Any]) -> Any:
    kind, value = static
    return jax.tree_util.tree_unflatten(value, leaves) if kind == "pytree" else value


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """A mask_mod and its block tables: which ``(q_block, kv_block)`` pairs kernels visit.

    Built by `create_block_mask`. A pytree: the tables (and arrays an ejk mod captures)
    are its leaves, so it is built inside ``jax.jit`` from traced ids, passed in and out
    of jitted functions, and reused by every layer of a model.

    Attributes:
        kinds: int8 ``[B', N', Tb, Sb]``: `EMPTY` (0), `PARTIAL` (1) or `FULL` (2) per
            block, ``B' = 1`` when built with ``B=None`` (``N'`` likewise), ``Tb = ceil(T /
            q_block)``, ``Sb = ceil(S / kv_block)``.
        mask_mod: the ``mask_mod(b, h, q_idx, kv_idx) -> bool`` the tables summarise.
        shape: ``(B, N, T, S)`` as given (``B``/``N`` None: one mask for every batch row/head).
        block_size: ``(q_block, kv_block)``.
    """

    def __init__(
        self,
        kinds: Any,
        mask_mod: Any,
        shape: tuple[int | None, int | None, int, int],
        block_size: tuple[int, int],
    ):
        # No checks: JAX rebuilds pytrees with placeholder leaves.
        self.kinds = kinds
        self.mask_mod = mask_mod
        self.shape = shape
        self.block_size = block_size

    def tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        leaves, static = _split_mod(self.mask_mod)
        return (self.kinds, leaves), (static, self.shape, self.block_size)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> BlockMask:
        static, shape, block_size = aux
        kinds, leaves = children
        return cls(kinds, _join_mod(static, list(leaves)), shape, block_size)

    def __repr__(self) -> str:
        return f"BlockMask(shape={self.shape}, block_size={self.block_size}, mask_mod={self.mask_mod!r})"

    def visited(self) -> Bool[Array, "B N Tb Sb"]:
        """bool ``[B', N', Tb, Sb]``: the blocks a kernel visits (partial or full)."""
        return self.kinds != EMPTY

    def density(self) -> Float[Array, ""]:
        """The fraction of blocks visited (partial or full), a float32 scalar."""
        return jnp.mean(self.visited(), dtype=jnp.float32)

    def sparsity(self) -> Float[Array, ""]:
        """The fraction of blocks skipped (empty), a float32 scalar: ``1 - density()``.

        PyTorch's ``BlockMask.sparsity()`` gives the same as a percentage.
        """
        return 1.0 - self.density()

    def kv_blocks(self) -> BlockIndices:
        """Per query block row, the kv blocks to visit (the forward's loop)."""
        return _indices(self.kinds)

    def q_blocks(self) -> BlockIndices:
        """Per kv block column, the query blocks to visit (a dk/dv backward's loop)."""
        return _indices(jnp.swapaxes(self.kinds, -1, -2))


def _indices(kinds: Int[Array, "B N R C"]) -> BlockIndices:
    """Counts and ascending indices of the partial and the full blocks along the last axis."""
    parts = []
    for kind in (PARTIAL, FULL):
        hit = kinds == kind
        num = jnp.sum(hit, axis=-1, dtype=jnp.int32)
        # A stable sort of "not hit" puts the hits first, in ascending block order.
        order = jnp.argsort(~hit, axis=-1, stable=True).astype(jnp.int32)
        parts += [num, order]
    return BlockIndices(*parts)


def _block_size(block_size: Any) -> tuple[int, int]:
    if block_size is None:
        return _DEFAULT_BLOCK, _DEFAULT_BLOCK
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    ok = isinstance(pair, tuple | list) and len(pair) == 2
    ok = ok and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair)
    if not ok or min(pair) <= 0:
        raise ValueError(
            f"create_block_mask: block_size must be a positive int or (q_block, kv_block), "
            f"got block_size={block_size!r}"
        )
    return int(pair[0]), int(pair[1])


def _size(value: Any, name: str, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        what = "an int >= 0" + (" or None" if optional else "")
        raise ValueError(f"create_block_mask: {name} must be {what}, got {name}={value!r}")
    return int(value)


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    N: int | None,
    T: int,
    S: int,
    *,
    block_size: int | tuple[int, int] | None = None,
) -> BlockMask:
    """The `BlockMask` of ``mask_mod`` over ``[B, N, T, S]``: which blocks are empty, partial or full.

    Works eagerly and under ``jax.jit`` (with traced arrays captured by the mask_mod); build
    it once per batch and pass it to every layer's `flex_attention`.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on int32 scalars, True where the
            query may see the key (``h`` is the query head); it may capture arrays.
        B: batch size, or None when the mask is the same for every batch row (the tables
            are then built for ``b = 0`` and broadcast).
        N: query heads, or None when the mask is the same for every head (``h = 0``).
        T: query length.
        S: key length.
        block_size: ``q_block = kv_block``, or ``(q_block, kv_block)``; default 128, the
            kernels' tile.

    Returns:
        the `BlockMask`, its ``kinds`` of shape ``[B or 1, N or 1, ceil(T / q_block),
        ceil(S / kv_block)]``.

    Raises:
        ValueError, TypeError: a bad size or block size, a mask_mod that fails on int32
            scalars or returns anything but a bool scalar, a captured array that does not fit
            (the message names the argument or the mod).
    """
    batch = _size(B, "B", optional=True)
    heads = _size(N, "N", optional=True)
    q_len = _size(T, "T", optional=False)
    kv_len = _size(S, "S", optional=False)
    blocks = _block_size(block_size)
    check_mask_mod(mask_mod, "create_block_mask")
    check_captures(mask_mod, "create_block_mask", batch, q_len, kv_len)
    shape = (batch, heads, q_len, kv_len)
    leaves, static = _split_mod(mask_mod)
    # ejk's mods are data: one compiled builder serves new ids every batch. A closure is
    # static; compiling it per closure would keep each one's arrays in the jit cache.
    build = _build_kinds_jit if static[0] == "pytree" else _build_kinds
    kinds = build(leaves, static, shape, blocks, _MAX_ELEMENTS)
    return BlockMask(kinds, mask_mod, shape, blocks)


def _build_kinds(
    leaves: list[Any],
    static: Any,
    shape: tuple[int | None, int | None, int, int],
    blocks: tuple[int, int],
    max_elements: int,
) -> Int[Array, "B N Tb Sb"]:
    """int8 ``[B', N', Tb, Sb]`` block kinds: from ejk's mods' definitions where they decide
    (`_block_kinds`), element by element for the rest."""
    mask_mod = _join_mod(static, leaves)
    batch, heads, q_len, kv_len = shape
    nb, nh = batch or 1, heads or 1
    tb, sb = cdiv(q_len, blocks[0]), cdiv(kv_len, blocks[1])
    if nb * nh * tb * sb == 0:
        return jnp.zeros((nb, nh, tb, sb), jnp.int8)
    grid = Blocks.of(q_len, kv_len, *blocks)
    kinds = analytic_kinds(mask_mod, grid, opaque=(nb, nh))
    if kinds is None:  # a user's function alone: every element
        return _dense_kinds(mask_mod, (nb, nh, tb, sb), blocks, q_len, kv_len, max_elements)
    kinds = refine_unknown(kinds, mask_mod, grid, max_elements)
    return jnp.broadcast_to(kinds, (nb, nh, tb, sb))


def _dense_kinds(
    mask_mod: Any,
    shape: tuple[int, int, int, int],
    blocks: tuple[int, int],
    q_len: int,
    kv_len: int,
    max_elements: int,
) -> Int[Array, "B N Tb Sb"]:
    """Block kinds from every element, one row of blocks of one ``(b, h)`` per map step."""
    nb, nh, tb, sb = shape
    q_block, kv_block = blocks
    # Indices past the end (the last, short blocks) evaluate the mod at the last position,
    # so captured arrays are read in bounds, and are left out of the reductions.
    kv_pos = jnp.arange(sb * kv_block, dtype=jnp.int32)
    kv_in = (kv_pos < kv_len).reshape(sb, kv_block)
    kv_pos = jnp.minimum(kv_pos, kv_len - 1)

    def row_kinds(row: Any) -> Any:
        b, rest = jnp.divmod(row, nh * tb)
        h, i = jnp.divmod(rest, tb)
        q_pos = i * q_block + jnp.arange(q_block, dtype=jnp.int32)
        q_in = q_pos < q_len
        visible = mask_grid(mask_mod, b[None], h[None], jnp.minimum(q_pos, q_len - 1), kv_pos)
        visible = visible.reshape(q_block, sb, kv_block)
        return block_kinds_of(visible, q_in[:, None, None] & kv_in[None], axis=(0, 2))

    rows = nb * nh * tb
    per_step = max(1, min(rows, max_elements // (q_block * sb * kv_block)))
    kinds = jax.lax.map(row_kinds, jnp.arange(rows, dtype=jnp.int32), batch_size=per_step)
    return kinds.reshape(nb, nh, tb, sb)


_build_kinds_jit = jax.jit(_build_kinds, static_argnums=(1, 2, 3, 4))
