"""The order in which the Gluon dk/dv kernel's programs start with segment ids or positions.

A dk/dv program owns a block of keys of one (batch, kv head) and walks the query blocks
its table entry gives, so programs differ in work: with documents by their keys' place
in their document, and keys no query row of the call sees have none (the all-gather call
of context parallelism: most of them). The GPU starts programs in the order of their
index. In the grid's own order, a (batch, kv head)'s programs run together (they read the
same queries: the L2 serves them), and the last group's heaviest programs start last:
the kernel waits for them (a model of the order on 132 SMs: 1.29x the balanced time for
one device's call at n = 4 with 16 documents, `tests/test_schedule.py`). Causal calls
and windows keep the grid's order (not yet measured with this one).

`dkdv_order` keeps the groups in order but takes them in blocks, each block's programs
heaviest first: a block holds about as many programs with work as the GPU runs at once
(groups of programs that run together, as before; the model gives 1.00-1.02x), so the
last ones to start are light.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["dkdv_order"]


def dkdv_order(table: Any, groups: int, query_block: int, multiprocessors: int) -> Any:
    """int32 ``[groups * key blocks]``: program ``i`` of the dk/dv grid (its linear index,
    key blocks fastest) runs tile ``order[i] = group * key blocks + key block``.

    Args:
        table: the dk/dv block table, ``[key blocks, 4]`` or ``[B, key blocks, 4]``
            (`_masks.range_tables`; a program's query rows are ``[lo, hi)``).
        groups: ``B * K``, the grid's second axis (group ``g`` is batch ``g // K``).
        query_block: query rows a step (work is counted in steps).
        multiprocessors: programs the GPU runs at once (one a multiprocessor).

    Returns:
        A permutation of the tiles; NumPy where ``table`` is known when the call is traced
        (a constant of the compiled call), else jnp.
    """
    if not isinstance(table, jax.core.Tracer):
        table = np.asarray(table)
    xp = np if isinstance(table, np.ndarray) else jnp
    nk = table.shape[-2]
    steps = -(-xp.maximum(table[..., 3] - table[..., 0], 0) // query_block)
    per_batch = groups // (table.shape[0] if table.ndim == 3 else 1)
    steps = xp.broadcast_to(steps.reshape(-1, 1, nk), (groups // per_batch, per_batch, nk))
    steps = steps.reshape(groups, nk).astype(np.int32)
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
