"""The backward pass: launches the dq and dk/dv kernels (ordinary, or Gluon's on Hopper) and
reduces bias and sink gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from ..build._jax_triton_fix import scratch_bytes
from ..build._triton import by_name, hopper_gpu, kernels, launch
from ._config import FlashBackwardConfig, FlashConfig, ordinary_config, ordinary_dq_config
from ._constexprs import dq_by_tma, gluon_dkdv_constexprs, gluon_dq_constexprs, kernel_constexprs
from ._forward_launch import check_kv_pair
from ._schedule import Walk, launch_order
from ._select import CallOptions, can_run_gluon_dkdv, gluon_dkdv_wide, runnable_config
from ._tables import Tables, dummy

__all__ = ["backward"]


def _shared_inputs(q, k, v, d_out, stats, tables: Tables, ranges) -> dict:
    """The inputs every backward kernel takes, by argument name: q, k, v, dO, the rows'
    statistics (lse and delta), the masking tables and the kernel's block table."""
    lse, delta = stats
    return dict(
        q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=d_out, lse_ptr=lse, delta_ptr=delta, **tables.masking(),
        ranges_ptr=ranges,
    )  # fmt: skip


def _ordinary_inputs(q, k, v, bias, d_out, stats, tables: Tables, ranges) -> dict:
    """The inputs of the ordinary dq and dk/dv kernels: `_shared_inputs`, the bias (or a
    placeholder) and the dropout seed."""
    bias_in = dummy(q.dtype) if bias is None else bias
    shared = _shared_inputs(q, k, v, d_out, stats, tables, ranges)
    return dict(shared, bias_ptr=bias_in, seed_ptr=tables.seed)


def _dkdv(opts: CallOptions, q, k, v, bias, d_out, stats, tables: Tables,
          cfg: FlashBackwardConfig, consts: dict, ws: bool) -> tuple[Array, Array, Array, Array | None]:  # fmt: skip
    """(dk, dv, the logits' gradient (with a bias), dq sum or None (atomic dq)) from the
    ordinary (or warp-specialised) dk/dv kernel."""
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    kv_shape = (*k.shape[:3], head_dim)  # (k may be k and v as one array, ``KV_PAIR``)
    dbias_shape = (batch, heads, q_len, kv_len) if bias is not None else (1,)
    grid = (-(-kv_len // cfg.block_keys), batch * kv_heads)
    tma = dq_by_tma(cfg, q.shape[3], hopper_gpu())
    scratch = jax.ShapeDtypeStruct((scratch_bytes(grid) if tma or ws else 1,), jnp.uint8)
    kernel = kernels().dkdv_kernel
    inputs, outputs, where = by_name(
        kernel,
        inputs=_ordinary_inputs(q, k, v, bias, d_out, stats, tables, tables.dkdv_ranges),
        outputs=dict(
            dk_ptr=jax.ShapeDtypeStruct(kv_shape, k.dtype),
            dv_ptr=jax.ShapeDtypeStruct(kv_shape, v.dtype),
            dbias_ptr=jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
            dq_acc_ptr=jax.ShapeDtypeStruct(q.shape if cfg.atomic_dq else (1,), jnp.float32),
            scratch_ptr=scratch,  # TMA descriptors (see _jax_triton_fix); unused otherwise
        ),
        # Skipped blocks leave the logits gradient untouched, and every key block adds
        # into dq: both must start at zero.
        zeroed=(*(("dbias_ptr",) if bias is not None else ()),
                *(("dq_acc_ptr",) if cfg.atomic_dq else ())),
    )  # fmt: skip
    dk, dv, dlogits, dq_sum, _ = launch(
        kernel, grid, inputs, outputs, dict(consts, DQ_ATOMIC=cfg.atomic_dq, DQ_TMA=tma),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **where,
    )  # fmt: skip
    return dk, dv, dlogits, dq_sum if cfg.atomic_dq else None


def _gluon_dkdv(
    opts: CallOptions,
    q,
    k,
    v,
    d_out,
    stats,
    tables: Tables,
    cfg: FlashBackwardConfig,
    joint: bool,
    kv_pair: bool,
) -> tuple[Array, Array | None, Array | None]:
    """(dk, dv, dq sum or None) from the Gluon dk/dv kernel (`can_run_gluon_dkdv` holds);
    with ``cfg.atomic_dq`` it adds the unscaled dq into a float32 buffer by TMA reduces.
    ``joint``: (dk and dv side by side ``[B, S, K, 2H]``, None, dq sum or None)."""
    batch, kv_len, kv_heads = k.shape[0], k.shape[1], k.shape[2]
    grid = (-(-kv_len // cfg.block_keys), batch * kv_heads)
    wide = gluon_dkdv_wide(q.shape[3])
    consts = gluon_dkdv_constexprs(opts, q, k, cfg, joint=joint, kv_pair=kv_pair)
    kv_shape = (*k.shape[:3], q.shape[3])  # (k may be k and v as one array, ``KV_PAIR``)
    dk_shape = (*k.shape[:3], 2 * q.shape[3]) if joint else kv_shape
    walk = Walk.of_keys(kv_len, q.shape[1], cfg)
    order = launch_order(tables.dkdv_ranges, walk, ordered=consts["ORDERED"], tabled=opts.tabled(),
                         causal=opts.causal, groups=grid[1])  # fmt: skip
    kernel = kernels().gluon_dkdv_wide_kernel if wide else kernels().gluon_dkdv_kernel
    inputs, outputs, where = by_name(
        kernel,
        inputs=dict(_shared_inputs(q, k, v, d_out, stats, tables, tables.dkdv_ranges), order_ptr=order),
        outputs=dict(
            dk_ptr=jax.ShapeDtypeStruct(dk_shape, k.dtype),
            dv_ptr=jax.ShapeDtypeStruct((1,) if joint else kv_shape, v.dtype),  # joint: unused
            dq_acc_ptr=jax.ShapeDtypeStruct(q.shape if cfg.atomic_dq else (1,), jnp.float32),
            scratch_ptr=jax.ShapeDtypeStruct((scratch_bytes(grid),), jnp.uint8),  # TMA descriptors
        ),
        zeroed=("dq_acc_ptr",) if cfg.atomic_dq else (),
    )  # fmt: skip
    dk, dv, dq_sum, _ = launch(
        kernel, grid, inputs, outputs, consts, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **where,
    )  # fmt: skip
    return dk, None if joint else dv, dq_sum if cfg.atomic_dq else None


def _gluon_dq(
    opts: CallOptions, q, k, v, d_out, stats, tables: Tables, cfg: FlashConfig, kv_pair: bool
) -> Array:
    """dq from the Gluon dq kernel (``cfg.block_q`` query rows a program, ``cfg.block_k`` keys
    a step; with a window,
    packing or segment ids it walks the dq block table, built for the same tiles)."""
    batch, q_len, heads = q.shape[:3]
    grid = (-(-q_len // cfg.block_q), batch * heads)
    consts = gluon_dq_constexprs(opts, q, k, cfg, kv_pair=kv_pair)
    walk = Walk.of_rows(q_len, k.shape[1], cfg)
    order = launch_order(tables.dq_ranges, walk, ordered=consts["ORDERED"], tabled=opts.tabled(),
                         causal=opts.causal, groups=grid[1])  # fmt: skip
    kernel = kernels().gluon_dq_kernel
    inputs, outputs, where = by_name(
        kernel,
        inputs=dict(
            _shared_inputs(q, k, v, d_out, stats, tables, tables.dq_ranges), order_ptr=order
        ),
        outputs=dict(
            dq_ptr=jax.ShapeDtypeStruct(q.shape, q.dtype),
            scratch_ptr=jax.ShapeDtypeStruct((scratch_bytes(grid),), jnp.uint8),  # TMA descriptors
        ),
    )
    dq, _ = launch(
        kernel, grid, inputs, outputs, consts, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **where,
    )  # fmt: skip
    return dq


def backward(
    opts: CallOptions,
    q,
    k,
    v,
    bias,
    sinks,
    tables: Tables,
    out,
    rows,
    d_out,
    d_lse=None,
    *,
    joint_dkdv: bool = False,
    kv_pair: bool = False,
) -> tuple[Array | None, ...]:
    """Gradients ``(dq, dk, dv, dbias, dsinks)`` of one attention call (None where no input).

    ``joint_dkdv``: dk and dv side by side in one array ``[B, S, K, 2H]`` (in place of dk;
    dv None), as the Gluon dk/dv kernel writes them (``JOINT``; the other kernels' are
    concatenated): one collective can then take both without a copy. ``kv_pair``: ``k``
    and ``v`` are one ``[B, S, K, 2H]`` array (`check_kv_pair`); dk and dv come as usual.

    ``rows``: the forward's (see `flash._forward_launch.forward`): the lse ``[B, N, T]``, or with
    a bias the row max and log row sum ``[B, N, 2, T]``, lse = their sum.
    ``d_lse``: cotangent of the returned lse. Since d lse_i / d s_ij = P_ij, it enters
    as ``dS = P ∘ (dP - (delta - d_lse))``: the kernels just see a shifted delta.
    """
    if kv_pair:
        check_kv_pair(q, k, v)
    batch, q_len, heads, head_dim = q.shape
    kv_len = k.shape[1]
    bwd = opts.bwd_cfg
    gluon = can_run_gluon_dkdv(opts, bias, q, kv_len, bwd)
    if bwd.gluon:  # dq (and dk/dv where the Gluon kernel cannot run): the ordinary kernels
        # with the same tiles, which the block tables were built for (`call_options` gives
        # calls that cannot run it the heuristic's config instead)
        side = opts.side_inputs(bias)
        kinds = ("dq",) if gluon else ("dq", "dkdv")
        bwd = ordinary_config(bwd, head_dim, q.dtype.itemsize, side, kinds)
    cfg, ws = runnable_config(opts, bwd, bias, q, kv_len, bwd.block_keys, ("dq", "dkdv"))
    d_out = d_out.astype(q.dtype)
    # lse = shift + log_l: the row max and log row sum with a bias, else the lse and 0.
    shift, log_l = (rows[:, :, 0], rows[:, :, 1]) if bias is not None else (rows, 0.0)
    # delta_i = rowsum(dO ∘ O) (FlashAttention-2, Alg. 2, line 4); [B, N, T] like lse.
    # A product and a row sum, which XLA fuses into one pass over out and d_out (an einsum
    # took 3x the time of its bytes; docs/performance-history.md#flash_backward_launchpy).
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
    delta = delta.transpose(0, 2, 1)
    if d_lse is not None:
        # Rows without mass (lse = -inf) have P = 0 everywhere: their d_lse cannot matter.
        delta = delta - jnp.where(jnp.isfinite(shift), d_lse.astype(jnp.float32), 0.0)
    consts = kernel_constexprs(opts, q, k, bias, sinks is not None, kv_pair=kv_pair)
    del consts["HAS_SINKS"]
    # The warp-specialised build reads lse and delta through TMA as rows of a length that
    # keeps every row 16-byte aligned, zero-padded (see dq_kernel).
    lse_t = -(-q_len // 128) * 128 if ws else q_len
    consts.update(WS=ws, LSE_T=lse_t)
    pad = ((0, 0), (0, 0), (0, lse_t - q_len))
    stats = (jnp.pad(rows, pad), jnp.pad(delta, pad)) if ws else (rows, delta)
    # The Triton kernels name their tiles BLOCK_M (query rows) and BLOCK_N (keys): keys
    # resident in dk/dv, queries resident in dq (FlashAttention-2's two backward loops).
    dkdv_consts = dict(consts, BLOCK_M=cfg.block_queries, BLOCK_N=cfg.block_keys)
    if gluon:
        dk, dv, dq_sum = _gluon_dkdv(
            opts, q, k, v, d_out, stats, tables, opts.bwd_cfg, joint_dkdv, kv_pair
        )
        dlogits = None
    else:
        dk, dv, dlogits, dq_sum = _dkdv(opts, q, k, v, bias, d_out, stats, tables, cfg,
                                        dkdv_consts, ws)  # fmt: skip
        if joint_dkdv:
            dk, dv = jnp.concatenate([dk, dv], axis=-1), None
    beside = opts.dq_beside(head_dim) if gluon else None
    if dq_sum is not None:
        dq = (dq_sum * opts.scale).astype(q.dtype)
    elif beside is not None and beside.gluon:
        dq = _gluon_dq(opts, q, k, v, d_out, stats, tables, beside, kv_pair)
    else:  # the ordinary dq kernel: with the backward config's tiles, or those beside it
        dq_cfg = beside or ordinary_dq_config(cfg)
        dq_consts = dict(consts, BLOCK_M=dq_cfg.block_q, BLOCK_N=dq_cfg.block_k)
        dq_grid = (-(-q_len // dq_cfg.block_q), batch * heads)
        kernel = kernels().dq_kernel
        inputs, outputs, where = by_name(
            kernel,
            inputs=_ordinary_inputs(q, k, v, bias, d_out, stats, tables, tables.dq_ranges),
            outputs=dict(
                dq_ptr=jax.ShapeDtypeStruct(q.shape, q.dtype),
                scratch_ptr=jax.ShapeDtypeStruct((scratch_bytes(dq_grid) if ws else 1,), jnp.uint8),
            ),
        )  # fmt: skip
        dq, _ = launch(
            kernel, dq_grid, inputs, outputs, dq_consts, num_warps=dq_cfg.num_warps,
            num_stages=dq_cfg.num_stages, **where,
        )  # fmt: skip
    dbias = None
    if bias is not None:
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
        dbias = jnp.sum(dlogits, axis=axes, keepdims=True).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        # The sink is a key with no value: its logit gradient is -p_sink * delta, summed
        # over batch and rows (its lse is finite: the sink alone gives it mass). Taken as
        # exp((sink - m) - log l), as the kernels take P (see `kernels.triton._common`).
        p_sink = jnp.exp((sinks.astype(jnp.float32)[None, :, None] - shift) - log_l)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq, dk, dv, dbias, dsinks
