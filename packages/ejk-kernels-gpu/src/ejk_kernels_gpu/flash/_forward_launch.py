"""The forward pass: launches the forward kernel (Triton, or the Gluon one on Hopper)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from ..build._jax_triton_fix import scratch_bytes
from ..build._triton import by_name, kernels, launch
from ._config import FlashConfig, ordinary_config
from ._constexprs import gluon_constexprs, gluon_grid, kernel_constexprs
from ._schedule import Walk, launch_order
from ._select import CallOptions, runnable_config
from ._tables import Tables, dummy

__all__ = ["check_kv_pair", "forward"]


def _gluon_forward(
    opts: CallOptions,
    q,
    k,
    v,
    sinks,
    tables: Tables,
    cfg: FlashConfig,
    resume: Resume,
    kv_pair: bool,
) -> tuple[Array, Array]:
    """(out, lse) from the Gluon forward (`can_run_gluon` holds)."""
    batch, q_len, heads, _ = q.shape
    consts = gluon_constexprs(
        opts, q, k, sinks is not None, cfg, resume=resume is not None, kv_pair=kv_pair
    )
    grid = gluon_grid(q.shape, cfg, persistent=consts["PERSISTENT"])
    # The counter of the persistent programs: the table kernel's zero where it built the
    # forward's table (taken over, `Tables.fwd_counter`), else zeroed by a memset.
    counter = tables.fwd_counter
    walk = Walk.of_rows(q_len, k.shape[1], cfg)
    order = launch_order(tables.fwd_ranges, walk, ordered=consts["ORDERED"], tabled=opts.tabled(),
                         causal=opts.causal, groups=batch * heads)  # fmt: skip
    kernel = kernels().gluon_fwd_kernel
    prev_o, prev_lse = _previous(resume, q)
    inputs, outputs, where = by_name(
        kernel,
        inputs=dict(
            q_ptr=q, k_ptr=k, v_ptr=v, sinks_ptr=dummy(jnp.float32) if sinks is None else sinks,
            prev_o_ptr=prev_o, prev_lse_ptr=prev_lse, **tables.masking(),
            ranges_ptr=tables.fwd_ranges, order_ptr=order,
            counter_in_ptr=dummy() if counter is None else counter,
        ),
        outputs=dict(
            o_ptr=jax.ShapeDtypeStruct(q.shape, q.dtype),
            lse_ptr=jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
            counter_ptr=jax.ShapeDtypeStruct((1,), jnp.int32),  # the persistent programs' place
            scratch_ptr=jax.ShapeDtypeStruct((scratch_bytes(grid),), jnp.uint8),  # TMA descriptors
        ),
        zeroed=("counter_ptr",) if consts["PERSISTENT"] and counter is None else (),
        # (o, lse) start as the previous; the counter as the table kernel's zero
        aliases=({} if resume is None else {"prev_o_ptr": "o_ptr", "prev_lse_ptr": "lse_ptr"})
        | ({} if counter is None else {"counter_in_ptr": "counter_ptr"}),
    )  # fmt: skip
    out, lse, _, _ = launch(
        kernel, grid, inputs, outputs, consts, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **where,
    )  # fmt: skip
    return out, lse


Resume = tuple[Array, Array] | None


def _previous(resume: Resume, q) -> tuple[Array, Array]:
    """The kernels' ``prev_o_ptr`` and ``prev_lse_ptr`` arguments: ``resume``'s (o, lse)
    (they become the outputs' buffers), or placeholders."""
    if resume is None:
        return dummy(q.dtype), dummy(jnp.float32)
    out, lse = resume
    batch, q_len, heads, _ = q.shape
    if out.shape != q.shape or lse.shape != (batch, heads, q_len):
        raise ValueError(
            f"resume=(out, lse) must have shapes {q.shape} and {(batch, heads, q_len)} (the "
            f"rows' previous output and lse), got {out.shape} and {lse.shape}"
        )
    return out.astype(q.dtype), lse.astype(jnp.float32)


def check_kv_pair(q, k, v) -> None:
    """``k`` and ``v`` as one array for the kernels' ``KV_PAIR``: the same ``[B, S, K, 2H]``
    array (each head's k columns, then its v columns), H being q's."""
    want = 2 * q.shape[3]
    if k is not v or k.ndim != 4 or k.shape[3] != want:
        raise ValueError(
            f"kv_pair=True takes k and v as one [B, S, K, {want}] array passed as both, got "
            f"k {k.shape} and v {v.shape}{'' if k is v else ' (two arrays)'}"
        )


def forward(
    opts: CallOptions,
    q,
    k,
    v,
    bias,
    sinks,
    tables: Tables,
    resume: Resume = None,
    kv_pair: bool = False,
) -> tuple[Array, Array, Array]:
    """``(out [B, T, N, H], lse [B, N, T], rows)`` of one call (the lse in natural units).

    ``rows``: what the backward kernels rebuild the probabilities from, the lse itself or,
    with a bias, ``[B, N, 2, T]``: the row max and the log row sum apart (a row max of
    -1e30 would round the log row sum out of their sum, see `kernels.triton._common`).

    ``resume``: ``(out, lse)`` of a previous call of the same rows over other keys (no
    bias or sinks): the rows continue from it, and the result is theirs over both calls'
    keys; rows that see no key here keep it, and their blocks of rows are not rewritten
    (the outputs take its buffers).

    ``kv_pair``: ``k`` and ``v`` are one ``[B, S, K, 2H]`` array (`check_kv_pair`; as
    all-gather moves keys and values, in one collective).
    """
    if kv_pair:
        check_kv_pair(q, k, v)
    batch, q_len, heads, _ = q.shape
    fwd = opts.fwd_cfg
    if resume is not None and (bias is not None or sinks is not None):
        raise ValueError("resume= continues rows without a bias or sinks (add sinks after)")
    cfg, ws = runnable_config(opts, fwd, bias, q, k.shape[1], fwd.block_k, ("fwd",))
    if cfg.gluon:
        out, lse = _gluon_forward(opts, q, k, v, sinks, tables, cfg, resume, kv_pair)
        return out, lse, lse
    if ws and resume is not None:  # the warp-specialised loop's epilogue has no resume
        cfg, ws = ordinary_config(cfg, q.shape[3], q.dtype.itemsize, opts.side_inputs(bias)), False
    consts = kernel_constexprs(opts, q, k, bias, sinks is not None, kv_pair=kv_pair)
    grid = (-(-q_len // cfg.block_q), batch * heads)
    kernel = kernels().fwd_kernel
    prev_o, prev_lse = _previous(resume, q)
    # The warp-specialised build stores each lse 16 times (a TMA tile, see _forward_kernel).
    # With a bias: the rows (m, log l) of each (batch, head); lse = m + log l.
    rows_shape = (batch, heads, *((2,) if bias is not None else ()), q_len, *((16,) if ws else ()))
    inputs, outputs, where = by_name(
        kernel,
        inputs=dict(
            q_ptr=q, k_ptr=k, v_ptr=v, bias_ptr=dummy(q.dtype) if bias is None else bias,
            sinks_ptr=dummy(jnp.float32) if sinks is None else sinks,
            prev_o_ptr=prev_o, prev_lse_ptr=prev_lse, **tables.masking(),
            ranges_ptr=tables.fwd_ranges, seed_ptr=tables.seed,
        ),
        outputs=dict(
            o_ptr=jax.ShapeDtypeStruct(q.shape, q.dtype),
            lse_ptr=jax.ShapeDtypeStruct(rows_shape, jnp.float32),
            # Global scratch for the TMA descriptors (see _jax_triton_fix); unused otherwise.
            scratch_ptr=jax.ShapeDtypeStruct((scratch_bytes(grid) if ws else 1,), jnp.uint8),
        ),
        # (o, lse) start as the previous
        aliases={} if resume is None else {"prev_o_ptr": "o_ptr", "prev_lse_ptr": "lse_ptr"},
    )  # fmt: skip
    out, rows, _ = launch(
        kernel, grid, inputs, outputs,
        dict(consts, BLOCK_M=cfg.block_q, BLOCK_N=cfg.block_k, WS=ws, RESUME=resume is not None),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **where,
    )  # fmt: skip
    if bias is not None:
        return out, rows[:, :, 0] + rows[:, :, 1], rows
    lse = rows[..., 0] if ws else rows
    return out, lse, lse
