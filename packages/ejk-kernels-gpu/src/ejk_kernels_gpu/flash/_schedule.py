"""The order in which the Gluon kernels' programs start.

A program owns one block of one (batch, head): a forward or dq program a block of query
rows, walking key blocks; a dk/dv program a block of keys of one (batch, kv head),
walking query blocks. Programs differ in work: causal ones by their block's place in the
sequence, with documents by its place in its document, and in context parallelism's
all-gather call most keys are seen by no row of the device's. The GPU starts programs
in the order of their index (the persistent forward: the order its programs take tiles
from its counter). In the grid's own order a (batch, head)'s programs run together (they
read the same keys or queries: the L2 serves them), and the last group's heaviest
programs start last: the kernel waits for them. A model of the order on 132 SMs
(`tests/test_schedule.py`): one device's dk/dv call at n = 4 with 16 documents takes 1.29x
the balanced time; forwards with each head's heaviest first 1.03x (that device's, T =
32768; causal B4 T4096 N32) to 1.07x (B8 T2048 N16).

`tile_order` keeps the groups in order but takes them in blocks, each block's programs
heaviest first: a block holds about as many programs with work as the GPU runs at once
(groups of programs that run together, as before; the model gives 1.00-1.02x), so the
last ones to start are light. The steps each program takes come from its block table
(`table_steps`) or, for calls without one, from causal alone (`causal_steps`). A kernel
reads its tiles from the order (`kernels.gluon._forward._tile`,
`kernels.gluon._backward.program_tile`) only where that is faster (`CallOptions.ordered_tiles`,
docs/performance-history.md#flash_schedulepy): the L2 and the
persistent forward's counter make the model's gains real for some calls only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..build._triton import multiprocessors
from ._tables import dummy

__all__ = ["Walk", "causal_steps", "forward_order", "launch_order", "table_steps", "tile_order"]


class Walk(NamedTuple):
    """How a kernel's programs cover a call: ``programs`` blocks of ``own_block`` (query
    rows if ``rows_own``, else keys), each walking ``walked`` keys (or rows) in steps of
    ``walked_block``."""

    programs: int
    own_block: int
    walked: int
    walked_block: int
    rows_own: bool

    @classmethod
    def of_rows(cls, rows: int, keys: int, cfg: Any) -> Walk:
        """Forward and dq programs: ``cfg.block_q`` query rows each, ``cfg.block_k`` keys a
        step."""
        return cls(-(-rows // cfg.block_q), cfg.block_q, keys, cfg.block_k, True)

    @classmethod
    def of_keys(cls, keys: int, rows: int, cfg: Any) -> Walk:
        """dk/dv programs (``cfg`` a `flash._config.FlashBackwardConfig`): ``cfg.block_keys``
        resident keys each, ``cfg.block_queries`` query rows a step."""
        return cls(-(-keys // cfg.block_keys), cfg.block_keys, rows, cfg.block_queries, False)


def _xp(x: Any):
    """jnp for values only known when the call runs, else NumPy (the order is then a
    constant of the compiled call)."""
    return jnp if isinstance(x, jax.core.Tracer) else np


def table_steps(table: Any, block: int) -> Any:
    """Blocks each program of a block table walks: ``[programs]``, or ``[B, programs]``
    with segment ids (`flash._tables.range_tables`: entry ``[lo, full_lo, full_hi, hi)`` in rows
    or keys; the kernels walk blocks ``lo // block`` to ``cdiv(hi, block)``)."""
    xp = _xp(table)
    table = xp.asarray(table)
    lo, hi = table[..., 0], table[..., 3]
    return xp.where(hi > lo, -(-hi // block) - lo // block, 0).astype(np.int32)


def causal_steps(walk: Walk, *, causal: bool) -> np.ndarray:
    """Blocks each program of ``walk`` takes in a call without a block table; causal on
    indices as the kernels' own ranges: a query block walks the key blocks up to its last
    row, a key block the query blocks from the one holding its first key."""
    walked_blocks = -(-walk.walked // walk.walked_block)
    start = np.arange(walk.programs) * walk.own_block
    if not causal:
        return np.full(walk.programs, walked_blocks, np.int32)
    if walk.rows_own:
        last = np.minimum(start + walk.own_block, walk.walked)
        return (-(-last // walk.walked_block)).astype(np.int32)
    first = np.minimum(start // walk.walked_block, walked_blocks)
    return (walked_blocks - first).astype(np.int32)


def tile_order(steps: Any, groups: int, multiprocessors: int) -> Any:
    """int32 ``[groups * programs]``: program ``i`` of the grid (its linear index, blocks
    fastest) runs tile ``order[i] = group * programs + block``.

    Args:
        steps: each program's work, ``[programs]`` (every group alike) or ``[B,
            programs]`` (per batch row; group ``g`` is batch row ``g // (groups // B)``).
        groups: the (batch, head) pairs, batch-major.
        multiprocessors: programs the GPU runs at once (one a multiprocessor).

    Returns:
        A permutation of the tiles; NumPy where ``steps`` is known when the call is traced
        (a constant of the compiled call), else jnp.
    """
    xp = _xp(steps)
    steps = xp.asarray(steps)
    programs = steps.shape[-1]
    rows = steps.shape[0] if steps.ndim == 2 else 1
    steps = xp.broadcast_to(steps.reshape(rows, 1, programs), (rows, groups // rows, programs))
    steps = steps.reshape(groups, programs).astype(np.int32)
    busy = xp.maximum(xp.sum(steps > 0), 1)
    # Groups a block: the power of two nearest above multiprocessors / busy programs a group.
    wanted = xp.maximum(multiprocessors * groups / busy, 1.0)
    block = (2 ** xp.ceil(xp.log2(wanted))).astype(np.int32)
    group = xp.arange(groups, dtype=np.int32)[:, None]
    most = xp.max(steps)
    key = (group // block) * (most + 1) + (most - steps)  # heaviest first within a block
    if xp is np:
        return np.argsort(key.reshape(-1), kind="stable").astype(np.int32)
    return jnp.argsort(key.reshape(-1), stable=True).astype(jnp.int32)


def forward_order(groups: int, n_m: int, rows_major: int, causal: bool = True) -> np.ndarray:
    """The tiles the persistent Gluon forward's counter hands out, in order, as ``group *
    n_m + query block`` (the definition its producer follows, `kernels.gluon._forward._tile`
    and `_rows_major`): the grid's order (each group's ``n_m`` blocks, causal ones the last
    first), then the last ``rows_major`` groups (``ROWS_MAJOR``, `flash._constexprs.rows_major`; 0:
    none) one query block of each at a time."""
    place = np.arange(groups * n_m)
    first = (groups - rows_major) * n_m
    m, g = np.divmod(place - first, max(rows_major, 1))
    group = np.where(place < first, place // n_m, groups - rows_major + g)
    m = np.where(place < first, place % n_m, m)
    return group * n_m + (n_m - 1 - m if causal else m)


def launch_order(
    table: Any, walk: Walk, *, ordered: bool, tabled: bool, causal: bool, groups: int
) -> Any:
    """The tile order a Gluon kernel's launch passes where it takes one (``ordered``, the
    kernel's ``ORDERED``: `flash._select.CallOptions.ordered_tiles`), else a placeholder:
    `tile_order` of the block table's steps (``tabled``: segment ids or positions, sorted
    when the call runs) or of `causal_steps` (a constant of the call), for ``groups``
    (batch-major) of ``walk``'s programs."""
    if not ordered:
        return dummy()
    if tabled:
        steps = table_steps(table, walk.walked_block)
    else:
        steps = causal_steps(walk, causal=causal)
    return jnp.asarray(tile_order(steps, groups, multiprocessors()))
