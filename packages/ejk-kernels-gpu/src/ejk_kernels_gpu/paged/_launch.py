"""Launching the split-KV paged kernel: the query-tile table, the launch, the split combine."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..build._limits import LOG2E, head_block
from ..build._triton import by_name, kernels, launch
from ._config import PagedConfig, TileShape

__all__ = [
    "PagedCall",
    "combine_splits",
    "kv_scale_kind",
    "paged_forward",
    "paged_kernels",
    "query_tiles",
    "uniform_tiles",
]


def paged_kernels() -> ModuleType:
    """The module of the paged kernel, imported after the Triton backend is chosen."""
    kernels()  # the interpreter switch, before triton is imported (see `build._triton.kernels`)
    from ..kernels.triton import _paged

    return _paged


@dataclasses.dataclass(frozen=True)
class PagedCall:
    """The static options of one launch (what the kernel computes, and its config)."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float
    config: PagedConfig
    tile: TileShape


def query_tiles(
    q_lens: Int[Array, " B"],
    q_starts: Int[Array, " B"],
    kv_lens: Int[Array, " B"],
    *,
    tokens: int,
    max_tiles: int,
) -> Int[Array, "tiles 5"]:
    """The kernel's tile table: rows ``(seq, first q row, first token, q_len, kv_len)``.

    Sequence ``b`` owns the query rows ``q_starts[b] : q_starts[b] + q_lens[b]`` and gets
    ``cdiv(q_lens[b], tokens)`` tiles of ``tokens`` tokens; ``max_tiles`` (static) must be at
    least their total, and the tiles past it have ``q_len = 0`` (the kernel skips them).
    """
    q_lens = jnp.maximum(q_lens.astype(jnp.int32), 0)
    counts = (q_lens + tokens - 1) // tokens
    ends = jnp.cumsum(counts)
    i = jnp.arange(max_tiles, dtype=jnp.int32)
    # The sequence owning tile i: how many sequences end at or before it (compare_all:
    # one fusion on a GPU, where the default scan is a loop of small kernels).
    owner = jnp.searchsorted(ends, i, side="right", method="compare_all")
    owner = jnp.minimum(owner, q_lens.shape[0] - 1)
    first = ends[owner] - counts[owner]
    used = i < ends[-1]
    return jnp.stack(
        [
            owner.astype(jnp.int32),
            q_starts.astype(jnp.int32)[owner],
            (i - first) * tokens,
            jnp.where(used, q_lens[owner], 0),
            kv_lens.astype(jnp.int32)[owner],
        ],
        axis=1,
    ).astype(jnp.int32)


def uniform_tiles(kv_lens: Int[Array, " B"], *, q_len: int, tokens: int) -> Int[Array, "tiles 5"]:
    """`query_tiles` of the ``[B, T, N, H]`` form (every sequence ``T = q_len`` rows), with
    static owners: no search."""
    batch = kv_lens.shape[0]
    per = -(-q_len // tokens)
    i = jnp.arange(batch * per, dtype=jnp.int32)
    owner = i // per
    return jnp.stack(
        [
            owner,
            owner * q_len,
            (i % per) * tokens,
            jnp.full_like(i, q_len),
            kv_lens.astype(jnp.int32)[owner],
        ],
        axis=1,
    )


def combine_splits(
    o: Float[Array, "splits R N H"],
    lse: Float[Array, "splits R N"],
    sinks: Float[Array, " N"] | None,
) -> Float[Array, "R N H"]:
    """Merge the splits' partial outputs (each normalised by its own row sum) by their
    log-sum-exps (flash-decoding's reduction); a sink adds mass to the denominator only.
    Rows with no mass at all come out 0."""
    m = jnp.max(lse, axis=0)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :])
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lse - m_safe)
    den = jnp.sum(w, axis=0)
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :] - m_safe)
    # A weighted sum (one reduce fusion); as an einsum XLA made it a batched matmul of
    # [1, splits] x [splits, H] per (row, head), measurably slower.
    num = jnp.sum(w[..., None] * o, axis=0)
    return num / jnp.where(den > 0.0, den, 1.0)[..., None]


def paged_constexprs(
    call: PagedCall, q_rows, k_pages, page_table, has_sinks: bool, kv_scales: int = 0
) -> dict:
    """The kernel's compile-time arguments, by name (``kv_scales``: `kv_scale_kind`)."""
    rows, heads, head_dim = q_rows.shape
    _, page, kv_heads, _ = k_pages.shape
    left, right = call.window if call.window is not None else (-1, -1)
    plain = call.soft_cap == 0.0 and call.scale > 0.0
    return dict(
        ROWS=rows,
        N=heads,
        G=heads // kv_heads,
        H=head_dim,
        PAGES_PER_SEQ=page_table.shape[1],
        PAGE=page,
        ROW_STRIDE=kv_heads * head_dim,
        SCALE=float(call.scale),
        SOFT_CAP=float(call.soft_cap),
        CAUSAL=call.causal,
        WINDOW_LEFT=left,
        WINDOW_RIGHT=right,
        # As in `kernels.triton._common`: the plain case folds log2(e) into the scale.
        LOG2_FACTOR=call.scale * LOG2E if plain else LOG2E,
        KV_SCALES=kv_scales,
        HAS_SINKS=has_sinks,
        NUM_SPLITS=call.config.num_splits,
        TILE_T=call.tile.tokens,
        BLOCK_M=call.tile.rows,
        BLOCK_N=call.config.block_kv,
        BLOCK_D=head_block(head_dim),
    )


def kv_scale_kind(k_scales: Array | None, v_scales: Array | None) -> int:
    """The kernel's ``KV_SCALES``: 0 without scales, 1 when both are scalars, else 2 (per
    token and kv head; a scalar one is then broadcast to the pool's shape)."""
    if k_scales is None:
        return 0
    return 1 if k_scales.ndim == 0 and v_scales.ndim == 0 else 2


def _scales_input(scales: Array | None, kind: int, shape: tuple[int, ...]) -> Array:
    """What the kernel's scale pointer gets: float32 ``shape`` (kind 2), ``[1]`` (kind 1),
    a dummy ``[1]`` (kind 0)."""
    if kind == 0:
        return jnp.zeros((1,), jnp.float32)
    scales = jnp.asarray(scales, jnp.float32)
    return jnp.broadcast_to(scales, shape) if kind == 2 else scales.reshape(1)


def paged_forward(
    call: PagedCall,
    q_rows: Float[Array, "R N H"],
    k_pages: Float[Array, "P page K H"],
    v_pages: Float[Array, "P page K H"],
    page_table: Int[Array, "B pages"],
    tiles: Int[Array, "tiles 5"],
    sinks: Float[Array, " N"] | None,
    k_scales: Float[Array, "P page K"] | Float[Array, ""] | None = None,
    v_scales: Float[Array, "P page K"] | Float[Array, ""] | None = None,
) -> Float[Array, "R N H"]:
    """Attention of the query rows ``q_rows`` over their sequences' pages: one launch of
    the split-KV kernel (grid ``(splits, tiles · K)``), then `combine_splits` when the
    config splits the keys. With fp8 pages, ``k_scales``/``v_scales`` (float32
    ``[P, page, K]`` or scalars) dequantise them in the kernel."""
    rows, heads, head_dim = q_rows.shape
    kv_heads = k_pages.shape[2]
    splits = call.config.num_splits
    grid = (splits, tiles.shape[0] * kv_heads)
    if splits == 1:  # the kernel writes no lse (an unused pointer, see paged_kernel)
        outputs = dict(
            o_ptr=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
            lse_ptr=jax.ShapeDtypeStruct((1,), jnp.float32),
        )
    else:
        outputs = dict(
            o_ptr=jax.ShapeDtypeStruct((splits, rows, heads, head_dim), jnp.float32),
            lse_ptr=jax.ShapeDtypeStruct((splits, rows, heads), jnp.float32),
        )
    sinks_in = jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    kind = kv_scale_kind(k_scales, v_scales)
    kernel = paged_kernels().paged_kernel
    inputs, outputs, where = by_name(
        kernel,
        inputs=dict(
            q_ptr=q_rows, k_ptr=k_pages, v_ptr=v_pages,
            k_scales_ptr=_scales_input(k_scales, kind, k_pages.shape[:3]),
            v_scales_ptr=_scales_input(v_scales, kind, k_pages.shape[:3]),
            page_table_ptr=page_table, tiles_ptr=tiles, sinks_ptr=sinks_in,
        ),
        outputs=outputs,
    )  # fmt: skip
    outs = launch(
        kernel, grid, inputs, outputs,
        paged_constexprs(call, q_rows, k_pages, page_table, sinks is not None, kind),
        num_warps=call.config.num_warps, num_stages=call.config.num_stages, **where,
    )  # fmt: skip
    if splits == 1:
        return outs[0]
    o, lse = outs
    return combine_splits(o, lse, None if sinks is None else sinks.astype(jnp.float32)).astype(
        q_rows.dtype
    )
