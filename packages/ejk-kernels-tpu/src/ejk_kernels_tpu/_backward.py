"""The backward kernels: dq (q blocks outer) and dk/dv (kv blocks outer), FlashAttention-2 Alg. 2.

Both recompute ``P = exp(S - lse)`` from the forward's lse (which already holds the sink; S
under the soft cap or flex score_mod, as the forward has it: `tile_scores`),
and use ``dS = P * (dP - D)`` with ``D = rowsum(dO * O) - dlse`` computed outside. The dkv
kernel works on transposed tiles (``S^T = K Q^T``, rows = keys) so every product is a
plain or ``A B^T`` matmul, and folds the query heads of a GQA group into its reduction axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import (
    NN_DIMS,
    NT_DIMS,
    Static,
    by_block_kind,
    div,
    dot,
    dropout_scale,
    launch,
    mask_row,
    mod_inputs,
    partial_visibility,
    q_major_inputs,
    rem,
    smem_inputs,
    split_refs,
    tile_inputs,
    tile_scores,
    visibility,
)
from ._mask_info import MaskInfo

__all__ = ["dkv", "dq"]


def _probs_and_dscores(r, st: Static, masked: bool, transposed: bool, origin: tuple):
    """The dropped weights ``P * Z`` and ``dS`` of one tile (transposed for dkv), f32, pre-scale.

    ``origin`` = (batch, query head, first row, first column) of the tile, for dropout's
    keep mask Z and the mask function's positions (rows are keys when ``transposed``).
    With dropout, ``O = (P * Z) V``, so ``dP = (dO V^T) * Z`` and D is unchanged.
    """
    if transposed:
        s, slope = tile_scores(st, r, r["k"][...], r["q"][...], origin, True, slope=True)
        partial = partial_visibility(st, r, origin, s.shape, True) if masked else None
        visible = visibility(partial, r.get("kv_seg"), r.get("q_seg"))
        dp = dot(r["v"][...], r["do"][...], NT_DIMS)
    else:
        s, slope = tile_scores(st, r, r["q"][...], r["k"][...], origin, False, slope=True)
        partial = partial_visibility(st, r, origin, s.shape, False) if masked else None
        visible = visibility(partial, r.get("q_seg"), r.get("kv_seg"))
        dp = dot(r["do"][...], r["v"][...], NT_DIMS)
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    # lse is +inf on rows that see nothing, so their P is exactly 0.
    p = jnp.exp(s - r["lse"][...])
    p_used = p
    if st.has_dropout:
        z = dropout_scale(st, r["seed"], *origin, p.shape, transposed)
        dp = dp * z
        p_used = p * z
    ds = p * (dp - r["di"][...])
    if slope is not None:
        # dS of the raw score (the soft cap's or score_mod's chain rule). A score_mod's
        # slope may be inf or NaN where the mask hides the score: P = 0 there, and so is dS.
        ds = ds * slope if st.score_mod is None else jnp.where(p > 0, ds * slope, 0.0)
    return p_used, ds


def _dq_kernel(dn_ref, bm_ref, mn_ref, *refs, st: Static, names: list[str], table_rows: int):
    del mn_ref
    r = split_refs(refs, names)
    h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        r["acc"][...] = jnp.zeros(r["acc"].shape, jnp.float32)

    def step(masked: bool):
        block_q, block_kv = st.dq
        kv_block = dn_ref[mask_row(pl.program_id(0), h, st, table_rows), i, j].astype(jnp.int32)
        origin = (pl.program_id(0), h, i * block_q, kv_block * block_kv)
        _, ds = _probs_and_dscores(r, st, masked, False, origin)
        k = r["k"][...]
        r["acc"][...] += dot(ds.astype(k.dtype), k, NN_DIMS)

    kind = bm_ref[mask_row(pl.program_id(0), h, st, table_rows), i, j].astype(jnp.int32)
    by_block_kind(kind, step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        r["dq"][...] = (r["acc"][...] * st.scale).astype(r["dq"].dtype)


def dq(
    q, k, v, do, lse, di, q_seg, kv_seg, seed, info: MaskInfo, st: Static, features=()
) -> jax.Array:
    """dq ``[B, N, Tp, H]`` in kernel layout.

    Args:
        q, do: ``[B, N, Tp, H]``; k, v: ``[B, K, Sp, H]``.
        lse, di: f32 ``[B, N, Tp, 1]`` (lse +inf on empty rows; di = rowsum(dO*O) - dlse).
        q_seg, kv_seg: int32 ``[B, Tp, 1]``, ``[B, 1, Sp]`` or None.
        seed: int32 ``[5]`` dropout key (`dropout_scale`) or None.
        info: `process_mask` tables for ``st.dq`` blocks.
        features: the flex mods' features (`ModMask.feature_arrays`, then `ModScore`'s), or none.
    """
    batch, heads, q_len, head_dim = q.shape
    block_q = st.dq[0]
    grid = (batch, heads, q_len // block_q, info.block_mask.shape[2])
    rows = {"q": (q, head_dim), "do": (do, head_dim), "lse": (lse, 1), "di": (di, 1)}
    inputs = q_major_inputs(st, info, st.dq, head_dim, rows, k, v, q_seg, kv_seg, features)
    inputs = smem_inputs(*inputs, st, seed=seed)
    out_spec = pl.BlockSpec((None, None, block_q, head_dim), inputs[1][0].index_map)
    (dq,) = launch(
        _dq_kernel,
        "ejk_blocksparse_dq",
        st,
        info,
        grid,
        inputs,
        outputs={"dq": (out_spec, jax.ShapeDtypeStruct(q.shape, q.dtype))},
        scratch={"acc": pltpu.VMEM((block_q, head_dim), jnp.float32)},
    )
    return dq


def _dkv_kernel(
    dn_ref, bm_ref, mn_ref, *refs, st: Static, names: list[str], table_rows: int, q_steps: int
):
    del mn_ref
    r = split_refs(refs, names)
    kh, j, step_id = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    h = kh * st.group + div(step_id, q_steps)
    i = rem(step_id, q_steps)  # the step in the table row; its q block is data_next

    @pl.when(step_id == 0)
    def _init():
        r["dk_acc"][...] = jnp.zeros(r["dk_acc"].shape, jnp.float32)
        r["dv_acc"][...] = jnp.zeros(r["dv_acc"].shape, jnp.float32)

    def step(masked: bool):
        block_q, block_kv = st.dkv
        q_block = dn_ref[mask_row(pl.program_id(0), h, st, table_rows), i, j].astype(jnp.int32)
        origin = (pl.program_id(0), h, j * block_kv, q_block * block_q)
        p, ds = _probs_and_dscores(r, st, masked, True, origin)
        q, do = r["q"][...], r["do"][...]
        r["dv_acc"][...] += dot(p.astype(do.dtype), do, NN_DIMS)
        r["dk_acc"][...] += dot(ds.astype(q.dtype), q, NN_DIMS)

    kind = bm_ref[mask_row(pl.program_id(0), h, st, table_rows), i, j].astype(jnp.int32)
    by_block_kind(kind, step)

    @pl.when(step_id == pl.num_programs(3) - 1)
    def _finish():
        r["dk"][...] = (r["dk_acc"][...] * st.scale).astype(r["dk"].dtype)
        r["dv"][...] = r["dv_acc"][...].astype(r["dv"].dtype)


def dkv(
    q,
    k,
    v,
    do,
    lse_row,
    di_row,
    q_seg_row,
    kv_seg_col,
    seed,
    info: MaskInfo,
    st: Static,
    features=(),
):
    """dk, dv ``[B, K, Sp, H]`` in kernel layout, summed over each GQA group's query heads.

    Args:
        q, do: ``[B, N, Tp, H]``; k, v: ``[B, K, Sp, H]``.
        lse_row, di_row: f32 ``[B, N, 1, Tp]`` (as in `dq`, laid out as rows).
        q_seg_row, kv_seg_col: int32 ``[B, 1, Tp]``, ``[B, Sp, 1]`` or None.
        seed: int32 ``[5]`` dropout key (`dropout_scale`) or None.
        info: `process_mask_dkv` tables for ``st.dkv`` blocks (``[rows, q_steps, kv_blocks]``).
        features: the flex mods' features (`ModMask.feature_arrays`, then `ModScore`'s), or none.
    """
    batch, _, _, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    block_q, block_kv = st.dkv
    q_steps = info.block_mask.shape[1]  # q blocks walked per kv block (fewer if shrunk)
    group, rows = st.group, info.block_mask.shape[0]
    # The reduction axis walks (query head of the group, q block) pairs.
    grid = (batch, kv_heads, kv_len // block_kv, group * q_steps)

    def q_block(b, kh, j, s, dn):
        h = kh * group + div(s, q_steps)
        return h, dn[mask_row(b, h, st, rows), rem(s, q_steps), j].astype(jnp.int32)

    def q_map(b, kh, j, s, dn, bm, mn):
        h, i = q_block(b, kh, j, s, dn)
        return b, h, i, 0

    def row_map(b, kh, j, s, dn, bm, mn):
        h, i = q_block(b, kh, j, s, dn)
        return b, h, 0, i

    def kv_map(b, kh, j, s, dn, bm, mn):
        return b, kh, j, 0

    def tile_map(b, kh, j, s, dn, bm, mn):
        h = kh * group + div(s, q_steps)
        return mn[mask_row(b, h, st, rows), rem(s, q_steps), j].astype(jnp.int32), 0, 0

    names = ["q", "do", "lse", "di", "k", "v"]
    in_specs = [
        pl.BlockSpec((None, None, block_q, head_dim), q_map),
        pl.BlockSpec((None, None, block_q, head_dim), q_map),
        pl.BlockSpec((None, None, 1, block_q), row_map),
        pl.BlockSpec((None, None, 1, block_q), row_map),
        pl.BlockSpec((None, None, block_kv, head_dim), kv_map),
        pl.BlockSpec((None, None, block_kv, head_dim), kv_map),
    ]
    args = [q, do, lse_row, di_row, k, v]
    if st.has_segments:
        names += ["q_seg", "kv_seg"]
        in_specs += [
            pl.BlockSpec(
                (None, 1, block_q),
                lambda b, kh, j, s, dn, bm, mn: (b, 0, q_block(b, kh, j, s, dn)[1]),
            ),
            pl.BlockSpec((None, block_kv, 1), lambda b, kh, j, s, dn, bm, mn: (b, j, 0)),
        ]
        args += [q_seg_row, kv_seg_col]
    extra = tile_inputs(info, pl.BlockSpec((None, block_kv, block_q), tile_map))
    locate = lambda b, kh, j, s, dn, bm, mn: (b, *q_block(b, kh, j, s, dn), j)
    mods = mod_inputs(st, features, st.dkv, True, locate)
    names, in_specs, args = (
        x + y + z for x, y, z in zip((names, in_specs, args), extra, mods, strict=True)
    )
    out_spec = pl.BlockSpec((None, None, block_kv, head_dim), kv_map)
    dk, dv = launch(
        _dkv_kernel,
        "ejk_blocksparse_dkv",
        st,
        info,
        grid,
        smem_inputs(names, in_specs, args, st, seed=seed),
        outputs={
            "dk": (out_spec, jax.ShapeDtypeStruct(k.shape, k.dtype)),
            "dv": (out_spec, jax.ShapeDtypeStruct(v.shape, v.dtype)),
        },
        scratch={
            "dk_acc": pltpu.VMEM((block_kv, head_dim), jnp.float32),
            "dv_acc": pltpu.VMEM((block_kv, head_dim), jnp.float32),
        },
        q_steps=q_steps,
    )
    return dk, dv
