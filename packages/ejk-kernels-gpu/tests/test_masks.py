"""The block tables that drive block skipping, checked against the reference visibility.

Every visible (query, key) pair must lie in a visited block; blocks listed as fully
visible must be visible everywhere; and causal/window/packed tables must skip blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import _masks
from ejk_sequtils import visibility_mask

CU_Q = [0, 9, 9, 30, 38]
CU_K = [0, 5, 12, 12, 33]


def _visited(table, length, block, inner, other_len):
    """bool [length, other_len]: pairs a program visits, and pairs it treats as unmasked."""
    seen = np.zeros((length, other_len), bool)
    full = np.zeros((length, other_len), bool)
    for m, (lo, flo, fhi, hi) in enumerate(np.asarray(table)):
        rows = slice(m * block, min((m + 1) * block, length))
        for start in range(int(lo), int(hi), inner):
            seen[rows, start : start + inner] = True
        for start in range(int(flo), int(fhi), inner):
            full[rows, start : start + inner] = True
    return seen, full


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(causal=True),
        dict(sliding_window=(5, 2)),
        dict(causal=True, sliding_window=(7, 7)),
        dict(packed=True),
        dict(packed=True, causal=True, sliding_window=(3, 1)),
    ],
)
def test_block_tables_cover_every_visible_pair(kw):
    kw = dict(kw)
    packed = kw.pop("packed", False)
    q_len, kv_len = (41, 37) if packed else (45, 52)
    window = kw.get("sliding_window")
    cu = (jnp.asarray(CU_Q), jnp.asarray(CU_K)) if packed else None
    vis = np.asarray(
        visibility_mask(
            q_len,
            kv_len,
            **kw,
            cu_seqlens_q=None if cu is None else cu[0],
            cu_seqlens_k=None if cu is None else cu[1],
        )
    )[0, 0]
    packing = None if cu is None else _masks.Packing(cu[0], cu[1], q_len, kv_len)
    causal = kw.get("causal", False)
    skipped = 0
    for of_queries, block, inner in ((True, 16, 8), (False, 8, 16)):
        lo, hi = _masks.ranges(q_len, kv_len, causal, window, packing, of_queries=of_queries)
        table = _masks.block_table(lo, hi, block, inner, exact=True)
        want = vis if of_queries else vis.T
        seen, full = _visited(table, *want.shape[:1], block, inner, want.shape[1])
        assert not np.any(want & ~seen), "a visible pair is skipped"
        assert not np.any(full & ~want), "a block without mask hides a masked pair"
        skipped += int(np.sum(~seen[::block, ::inner]))
    if kw or packed:
        assert skipped > 0, "no block skipped"
