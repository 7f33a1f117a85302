"""The kernels' compile-time arguments, by name, for a call's `flash._select.CallOptions`.

`kernel_constexprs` (the Triton kernels), `gluon_constexprs` (the Gluon forward, with its
program variants: persistent, the output's own buffer, tile order, rows-major groups, fixed
shift), `gluon_dkdv_constexprs` and `gluon_dq_constexprs` (the Gluon backward), and
`dq_by_tma` (the dk/dv kernel's atomic dq by TMA reduces).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ejk_sequtils import dropout_threshold

from ..build._limits import LOG2E
from ..build._triton import multiprocessors
from ._config import (
    SHARED_MEMORY_LIMIT,
    FlashBackwardConfig,
    FlashConfig,
    gluon_forward_shared,
    head_block,
)
from ._select import CallOptions, gluon_dkdv_wide

__all__ = [
    "dq_by_tma",
    "gluon_constexprs",
    "gluon_dkdv_constexprs",
    "gluon_dq_constexprs",
    "gluon_grid",
    "gluon_obuf",
    "gluon_persistent",
    "kernel_constexprs",
    "rows_major",
]


def _gluon_bwd_constexprs(opts: CallOptions, q: Any, k: Any, kv_pair: bool) -> dict:
    """The constexpr arguments the Gluon dk/dv and dq kernels share (all but the tiles);
    ``kv_pair``: ``k`` is k and v as one ``[B, S, K, 2H]`` array (``KV_PAIR``)."""
    batch, q_len, heads, head_dim = q.shape
    left, right = opts.window if opts.window is not None else (-1, -1)
    return dict(
        WINDOW_LEFT=left, WINDOW_RIGHT=right, VARLEN=opts.varlen, HAS_SEG=opts.has_seg,
        SEQ_IDS=opts.compares_seq_ids(),
        B=batch, T=q_len, S=k.shape[1], N=heads, G=heads // k.shape[2], H=head_dim,
        SCALE=float(opts.scale), QK=float(opts.scale * LOG2E), SOFT_CAP=float(opts.soft_cap),
        CAP_IN=float(opts.scale / opts.soft_cap) if opts.soft_cap > 0.0 else 0.0,
        CAP_OUT=float(opts.soft_cap * LOG2E), CAUSAL=opts.causal, KV_PAIR=kv_pair,
    )  # fmt: skip


def gluon_dkdv_constexprs(
    opts: CallOptions,
    q: Any,
    k: Any,
    cfg: FlashBackwardConfig,
    *,
    joint: bool = False,
    kv_pair: bool = False,
) -> dict:
    """The constexpr arguments of `kernels.gluon._backward.gluon_dkdv_kernel`: ``block_keys``
    resident keys (BN), ``block_queries`` query rows a step (BM), dq too with ``atomic_dq``;
    ``joint``: dk and dv side by side in one output (``JOINT``); ``kv_pair``: k and v read
    from one array (``KV_PAIR``)."""
    tiles = dict(BM=cfg.block_queries, BN=cfg.block_keys, STAGES=cfg.num_stages, DQ=cfg.atomic_dq)
    # The wide kernel counts as one head a program: its causal calls were not measured
    # with an order (segment ids or positions take one there too).
    grouped = q.shape[2] > k.shape[2] and not gluon_dkdv_wide(q.shape[3])
    ordered = opts.ordered_tiles("dkdv", grouped=grouped)
    return dict(_gluon_bwd_constexprs(opts, q, k, kv_pair), **tiles, ORDERED=ordered, JOINT=joint)


def gluon_dq_constexprs(
    opts: CallOptions, q: Any, k: Any, cfg: FlashConfig, *, kv_pair: bool = False
) -> dict:
    """The constexpr arguments of `kernels.gluon._backward.gluon_dq_kernel`: ``block_q``
    resident query rows (BM), ``block_k`` keys a step (BN)."""
    tiles = dict(BM=cfg.block_q, BN=cfg.block_k, STAGES=cfg.num_stages)
    ordered = opts.ordered_tiles("dq")
    return dict(_gluon_bwd_constexprs(opts, q, k, kv_pair), **tiles, ORDERED=ordered)


def dq_by_tma(cfg: FlashBackwardConfig, head_dim: int, hopper: bool) -> bool:
    """Whether the dk/dv kernel adds its dq tiles as TMA reduces (``DQ_TMA``).

    Atomic dq on Hopper, with whole-tile rows: a power-of-two head_dim, so a tile of the
    ``[T, N·H]`` descriptor never reaches into the next head's columns.
    """
    return cfg.atomic_dq and hopper and head_block(head_dim) == head_dim


def kernel_constexprs(
    opts: CallOptions, q: Any, k: Any, bias: Any, has_sinks: bool, kv_pair: bool = False
):
    """The constexpr arguments the Triton kernels share (each launch adds its tiles);
    ``kv_pair``: ``k`` is k and v as one ``[B, S, K, 2H]`` array (``KV_PAIR``)."""
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if bias is None:
        bias_sb = bias_sn = 0
    else:
        bias_sb = bias.shape[1] * q_len * kv_len if bias.shape[0] == batch else 0
        bias_sn = q_len * kv_len if bias.shape[1] == heads else 0
    left, right = opts.window if opts.window is not None else (-1, -1)
    plain = bias is None and opts.soft_cap == 0.0 and opts.scale > 0.0
    return dict(
        T=q_len,
        S=kv_len,
        N=heads,
        G=heads // kv_heads,
        H=head_dim,
        BIAS_SB=bias_sb,
        BIAS_SN=bias_sn,
        SCALE=float(opts.scale),
        SOFT_CAP=float(opts.soft_cap),
        HAS_BIAS=bias is not None,
        HAS_SINKS=has_sinks,
        VARLEN=opts.varlen,
        SEQ_IDS=opts.compares_seq_ids(),
        HAS_SEG=opts.has_seg,
        CAUSAL=opts.causal,
        WINDOW_LEFT=left,
        WINDOW_RIGHT=right,
        DROPOUT_THRESHOLD=dropout_threshold(opts.dropout_rate),
        DROPOUT_SCALE=float(1.0 / (1.0 - opts.dropout_rate)),
        # See _kernel_common: the plain case folds log2(e) into the scale of q·kᵀ.
        LOG2_FACTOR=opts.scale * LOG2E if plain else LOG2E,
        BLOCK_D=head_block(head_dim),
        KV_PAIR=kv_pair,
    )


def gluon_constexprs(
    opts: CallOptions,
    q: Any,
    k: Any,
    has_sinks: bool,
    cfg: FlashConfig,
    resume: bool = False,
    kv_pair: bool = False,
):
    """The constexpr arguments of `kernels.gluon._forward.gluon_fwd_kernel` (``resume``: the
    rows continue a previous call's output and lse, ``RESUME``; ``kv_pair``: ``k`` is k and
    v as one ``[B, S, K, 2H]`` array, ``KV_PAIR``)."""
    _, q_len, heads, head_dim = q.shape
    kv_len = k.shape[1]
    left, right = opts.window if opts.window is not None else (-1, -1)
    cap = opts.soft_cap
    persistent = gluon_persistent(opts, q.shape, kv_len, cfg)
    masked = (
        opts.causal or opts.window is not None or opts.has_seg or opts.varlen
        or kv_len % cfg.block_k != 0
    )  # fmt: skip
    return dict(
        B=q.shape[0], T=q_len, S=kv_len, N=heads, G=heads // k.shape[2], H=head_dim,
        QK=float(opts.scale * LOG2E), SOFT_CAP=float(cap),
        CAP_IN=float(opts.scale / cap) if cap > 0.0 else 0.0,
        CAP_OUT=float(cap * LOG2E), CAUSAL=opts.causal, WINDOW_LEFT=left, WINDOW_RIGHT=right,
        VARLEN=opts.varlen, SEQ_IDS=opts.compares_seq_ids(), HAS_SEG=opts.has_seg,
        MASKED=masked, HAS_SINKS=has_sinks,
        BM=cfg.block_q, BN=cfg.block_k, STAGES=cfg.num_stages,
        PERSISTENT=persistent, OBUF=gluon_obuf(cfg, head_dim, persistent=persistent),
        ORDERED=opts.ordered_tiles("fwd", persistent=persistent),
        ROWS_MAJOR=rows_major(opts, q.shape, cfg, persistent=persistent),
        # (a resumed row's shift starts at its lse, which no first block may lower)
        FIXED_SHIFT=fixed_shift(opts, q.dtype) and not resume, RESUME=resume, KV_PAIR=kv_pair,
    )  # fmt: skip


# The largest soft cap in log2 units (cap · log2 e, a cap of 55.4) whose softmax the Gluon
# forward runs with a fixed shift (`kernels.gluon._forward._softmax`).
FIXED_SHIFT_CAP_OUT = 80.0


def fixed_shift(opts: CallOptions, dtype: Any) -> bool:
    """Whether the Gluon forward fixes each row's shift after a tile's first key block
    (``FIXED_SHIFT``): a soft cap of at most ``FIXED_SHIFT_CAP_OUT / log2 e`` bounds the
    logits, so p stays within 2^76 (bf16's range is float32's); fp16's is too narrow. It
    drops the max per score and the rescaling of o (docs/performance-history.md#flash_optionspy).
    Not with packed sequences and segment ids at once, whose build then spills twice the
    registers."""
    capped = 0.0 < opts.soft_cap * LOG2E <= FIXED_SHIFT_CAP_OUT
    packed_segments = opts.compares_seq_ids() and opts.has_seg
    return capped and not packed_segments and jnp.dtype(dtype) == jnp.bfloat16


def gluon_obuf(cfg: FlashConfig, head_dim: int, *, persistent: bool) -> bool:
    """Whether the Gluon forward's output leaves through a buffer of its own (``OBUF``):
    persistent programs whose q, o and k/v ring fit shared memory (head_dim 64; 128 with two
    ring slots). A consumer then releases q after its tile's last q·kᵀ, so the next tile's q
    loads during the epilogue, and waits for its output store a tile later: faster with short
    loops (masks beyond causal, soft caps), slower unmasked and causal over long ones, which
    keep three slots (`flash._select.FORWARD_RULES`); outputs bitwise equal (see
    docs/performance-history.md#flash_optionspy)."""
    shared = gluon_forward_shared(cfg, head_dim, own_output=True)
    return persistent and shared <= SHARED_MEMORY_LIMIT


def gluon_persistent(
    opts: CallOptions, q_shape: tuple[int, ...], kv_len: int, cfg: FlashConfig
) -> bool:
    """Whether the Gluon forward runs one program per SM over all tiles (each tile's first
    copies then overlap the previous tile's epilogue; faster wherever it runs, see
    docs/performance-history.md#flash_optionspy).

    Its descriptors span every (batch, head), so rows past T or S would be another one's:
    whole key tiles only, and query rows on whole consumers' rows (`GLUON_CONSUMER_ROWS`:
    where T is off the tile, the consumers whose rows of a last tile lie past T compute
    nothing, `kernels.gluon._forward._release_tile`); and head_dim 128 at most (256 keeps
    one program a tile). Programs take tiles from a counter (`kernels.gluon._forward.
    _producer`), so tiles of unequal work (causal, windows, documents of any lengths)
    balance.
    """
    _, q_len, _, head_dim = q_shape
    whole_rows = q_len % GLUON_CONSUMER_ROWS == 0
    return whole_rows and kv_len % cfg.block_k == 0 and head_dim <= 128


# A Gluon forward consumer warpgroup's query rows (a tile holds block_q / 64 consumers).
GLUON_CONSUMER_ROWS = 64


def rows_major(opts: CallOptions, q_shape: tuple[int, ...], cfg: FlashConfig, *,
               persistent: bool) -> int:  # fmt: skip
    """How many (batch, head) groups, the last ones, the persistent Gluon forward takes one
    query block of each at a time, the last blocks first (``ROWS_MAJOR``), instead of each
    group's blocks together; 0: none. In the grid's own order the last groups' heaviest
    tiles start late and a program can be left with one while the others have ended.

    - Causal calls with segment ids or packed sequences of at most `ROWS_MAJOR_WAVES` tiles
      a multiprocessor: every group. A document's tiles run together across heads,
      heaviest first, and the last tiles handed out are the first document's lightest (about
      a tile's time); longer calls keep the grid's order, where this one is no faster (see
      docs/performance-history.md#flash_optionspy).
    - Causal calls without a table of at most `TAIL_BLOCKS` query blocks: the last groups
      that hold `TAIL_WAVES` multiprocessors' worth of tiles of the heaviest's size, so that
      the heaviest start early enough; the rest keep the grid's order (the programs at work
      share k and v in L2)."""
    if not (persistent and opts.causal) or opts.ordered_tiles("fwd", persistent=persistent):
        return 0
    batch, q_len, heads, _ = q_shape
    if opts.has_seg or opts.varlen:
        short = gluon_tiles(q_shape, cfg) <= ROWS_MAJOR_WAVES * multiprocessors()
        return batch * heads if short else 0
    blocks = -(-q_len // cfg.block_q)
    if opts.tabled() or blocks > TAIL_BLOCKS:
        return 0
    return min(batch * heads, -(-TAIL_WAVES * multiprocessors() // blocks))


# Tiles a multiprocessor up to which `rows_major` takes every group rows-major (documents).
ROWS_MAJOR_WAVES = 24
# Causal calls without a table: query blocks a group up to which `rows_major` takes the last
# groups rows-major, and how many multiprocessors' worth of heaviest tiles those hold. (64
# blocks of 128 rows: where T = S, the same calls as `SHORT_CAUSAL_KEYS`, which counts keys;
# the two were measured on such calls only and part ways where T and S differ.)
TAIL_BLOCKS = 64
TAIL_WAVES = 4


def gluon_tiles(q_shape: tuple[int, ...], cfg: FlashConfig) -> int:
    """The Gluon forward's tiles: a query block of one (batch, head) each."""
    batch, q_len, heads, _ = q_shape
    return -(-q_len // cfg.block_q) * batch * heads


def gluon_grid(q_shape: tuple[int, ...], cfg: FlashConfig, *, persistent: bool) -> tuple[int]:
    """The Gluon forward's one-dimensional grid: one program a tile (`gluon_tiles`), or
    with ``persistent`` at most one per SM."""
    tiles = gluon_tiles(q_shape, cfg)
    return (min(tiles, multiprocessors()) if persistent else tiles,)
