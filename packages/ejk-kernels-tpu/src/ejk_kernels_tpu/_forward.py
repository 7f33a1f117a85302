"""The forward kernel: block-sparse online-softmax attention (FlashAttention-2, Alg. 1).

Grid ``(B, N, q_blocks, kv_steps)``; the kv axis is the sequential reduction. The block
tables (`MaskInfo`) are scalar-prefetched: each step looks up whether its block is empty
(skipped), partial (mask tile applied) or full, and which kv block its index map fetches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import (
    NN_DIMS,
    Static,
    by_block_kind,
    dot,
    dropout_scale,
    launch,
    mask_row,
    partial_visibility,
    q_major_inputs,
    smem_inputs,
    split_refs,
    tile_scores,
    visibility,
)
from ._mask_info import MaskInfo

__all__ = ["forward"]


def _kernel(dn_ref, bm_ref, mn_ref, *refs, st: Static, names: list[str], table_rows: int):
    del mn_ref  # used by the index maps only
    r = split_refs(refs, names)
    h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    row = mask_row(pl.program_id(0), h, st, table_rows)
    m_scr, l_scr, acc_scr = r["m"], r["l"], r["acc"]

    @pl.when(j == 0)
    def _init():
        if st.has_sinks:
            # The sink is one more logit of every row, seen from the start (m = sink, l = 1).
            m_scr[...] = jnp.full(m_scr.shape, r["sinks"][h], jnp.float32)
            l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)
        else:
            m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(masked: bool):
        block_q, block_kv = st.fwd
        col0 = dn_ref[row, i, j].astype(jnp.int32) * block_kv  # the step's block (grids shrink)
        origin = (pl.program_id(0), h, i * block_q, col0)
        s, _ = tile_scores(st, r, r["q"][...], r["k"][...], origin, False, slope=False)
        partial = partial_visibility(st, r, origin, s.shape, False) if masked else None
        visible = visibility(partial, r.get("q_seg"), r.get("kv_seg"))
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_prev, l_prev = m_scr[...], l_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp() gives 0, not NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if st.has_dropout:
            # Dropout acts on the normalised weights: l keeps the full sum, the values get
            # the dropped, rescaled weights (1 / l is applied at the end).
            p = p * dropout_scale(st, r["seed"], *origin, p.shape, False)
        v = r["v"][...]
        pv = dot(p.astype(v.dtype), v, NN_DIMS)
        acc_scr[...] = alpha * acc_scr[...] + pv
        m_scr[...] = m_new

    kind = bm_ref[row, i, j].astype(jnp.int32)
    by_block_kind(kind, step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        denom = l_scr[...]
        has_mass = denom > 0
        safe = jnp.where(has_mass, denom, 1.0)
        inv = jnp.where(has_mass, 1.0 / safe, 0.0)
        r["o"][...] = (acc_scr[...] * inv).astype(r["o"].dtype)
        r["lse"][...] = jnp.where(has_mass, m_scr[...] + jnp.log(safe), -jnp.inf)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    sinks: jax.Array | None,
    seed: jax.Array | None,
    info: MaskInfo,
    st: Static,
    features: tuple[jax.Array, ...] = (),
) -> tuple[jax.Array, jax.Array]:
    """Attention output ``[B, N, Tp, H]`` and lse ``[B, N, Tp, 1]`` (f32) in kernel layout.

    Args:
        q: ``[B, N, Tp, H]``; k, v: ``[B, K, Sp, H]``.
        q_seg: int32 ``[B, Tp, 1]``; kv_seg: int32 ``[B, 1, Sp]`` (or both None).
        sinks: f32 ``[N]`` or None.
        seed: int32 ``[5]`` dropout key (`dropout_scale`), or None without dropout.
        info: `process_mask` tables of ``st.mask`` for ``st.fwd`` blocks.
        st: the call's static options.
        features: the flex mods' features (`ModMask.feature_arrays`, then `ModScore`'s), or none.
    """
    batch, heads, q_len, head_dim = q.shape
    block_q = st.fwd[0]
    # The kv axis walks the table's steps: fewer than S // block_kv when the grid shrank.
    grid = (batch, heads, q_len // block_q, info.block_mask.shape[2])
    inputs = q_major_inputs(
        st, info, st.fwd, head_dim, {"q": (q, head_dim)}, k, v, q_seg, kv_seg, features
    )
    inputs = smem_inputs(*inputs, st, sinks=sinks, seed=seed)
    q_map = inputs[1][0].index_map
    f32 = jnp.float32
    o, lse = launch(
        _kernel,
        "ejk_blocksparse_fwd",
        st,
        info,
        grid,
        inputs,
        outputs={
            "o": (
                pl.BlockSpec((None, None, block_q, head_dim), q_map),
                jax.ShapeDtypeStruct(q.shape, q.dtype),
            ),
            "lse": (
                pl.BlockSpec((None, None, block_q, 1), q_map),
                jax.ShapeDtypeStruct((batch, heads, q_len, 1), f32),
            ),
        },
        scratch={
            "m": pltpu.VMEM((block_q, 1), f32),
            "l": pltpu.VMEM((block_q, 1), f32),
            "acc": pltpu.VMEM((block_q, head_dim), f32),
        },
    )
    return o, lse
