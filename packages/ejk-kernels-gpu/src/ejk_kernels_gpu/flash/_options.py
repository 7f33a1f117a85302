"""The static options of one call: which build each kernel runs and its constexpr arguments.

`CallOptions` holds what a validated request fixes at trace time (scale, masks, dropout
rate, the forward and backward configs); the policy functions decide which calls may
take the Hopper builds (warp-specialised loops, the Gluon forward); `kernel_constexprs`
and `gluon_constexprs` are the kernels' compile-time arguments, by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ejk_sequtils import AttentionRequest, dropout_threshold

from ..build._limits import LOG2E
from ..build._triton import hopper_gpu, multiprocessors
from ._config import (
    SHARED_MEMORY_LIMIT,
    FlashConfig,
    bwd_heuristic,
    dq_beside,
    fwd_heuristic,
    gluon_fits,
    gluon_forward_shared,
    head_block,
    ordinary_config,
)

__all__ = [
    "CallOptions",
    "call_options",
    "can_run_gluon",
    "can_warp_specialize",
    "dq_by_tma",
    "gluon_constexprs",
    "gluon_grid",
    "gluon_persistent",
    "kernel_constexprs",
    "offer_gluon",
    "offer_warp_specialize",
    "runnable_config",
]


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """Every static option of one call (hashable: the custom_vjp's non-differentiable part)."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float
    dropout_rate: float
    has_seg: bool
    varlen: bool  # masks on per-token positions (`flash._tables.Tables`' q_pos, k_pos)
    fwd_cfg: FlashConfig
    bwd_cfg: FlashConfig
    # With varlen: compare sequence ids too (packed sequences); False: positions alone
    # (context-parallel blocks, `context._blocks`: every token is in one sequence).
    seq_ids: bool = True

    def fully_visible(self) -> bool:
        """Whether every query sees every key (nothing masks a block; bias aside)."""
        return not (
            self.causal or self.window is not None or self.has_seg or self.varlen
        ) and self.dropout_rate == 0.0 and self.soft_cap == 0.0  # fmt: skip

    def compares_seq_ids(self) -> bool:
        """Whether the kernels load and compare sequence ids (``SEQ_IDS``): packed
        sequences; context-parallel blocks (``seq_ids`` off) compare positions alone."""
        return self.varlen and self.seq_ids

    def side_inputs(self, bias: Any) -> bool:
        """Whether tiles of side inputs (bias, segment ids, packed offsets, dropout) need
        shared memory too: the heuristics and `ordinary_config` leave room for them."""
        return bias is not None or self.has_seg or self.varlen or self.dropout_rate > 0.0

    def tabled(self) -> bool:
        """Whether the call's masks go beyond causal (a window, packed sequences, segment
        ids): the Gluon backward then walks the dk/dv block table."""
        return self.window is not None or self.has_seg or self.varlen

    def dq_beside(self, head_dim: int) -> FlashConfig | None:
        """The config of the dq kernel beside this call's Gluon dk/dv config
        (`flash._config.dq_beside`), one answer for the launch and for the dq block table built
        for its tiles (`flash._tables.range_tables`)."""
        return dq_beside(self.bwd_cfg, head_dim, self.soft_cap > 0.0, tabled=self.tabled())

    def ordered_tiles(
        self, kernel: str, *, grouped: bool = False, persistent: bool = False
    ) -> bool:
        """Whether a Gluon kernel's programs take their tiles from an order the launch
        passes (``ORDERED``, `flash._schedule.launch_order`) instead of the grid's own (causal
        forward and dq programs: each head's heaviest first), where that is faster (see
        docs/performance-history.md#flash_optionspy): ``"dkdv"`` with segment ids or
        positions (the programs' work follows the data) and, causal without a table, where a
        program walks ``grouped`` heads; ``"dq"`` and the forward (``"fwd"``, one program a
        tile, not ``persistent``) causal without a table; the forward of a context-parallel
        call, causal on positions alone (`context._blocks`: a device's rows against the whole
        gathered sequence, tiles from a few blocks to the whole sequence long). Elsewhere it
        is level or slower (windows, one head a dk/dv program, persistent forwards of one
        sequence), or its sort when the call runs costs more than it gains (forwards with
        segment ids)."""
        plain = self.causal and not self.tabled()
        if kernel == "dkdv":
            return self.has_seg or self.varlen or (plain and grouped)
        if kernel == "fwd":
            return (plain and not persistent) or self.causal_positions()
        return plain

    def causal_positions(self) -> bool:
        """Whether the call is causal on per-token positions alone: no sequence or segment
        ids, no window (context-parallel blocks, `context._blocks`)."""
        alone = not (self.seq_ids or self.has_seg) and self.window is None
        return self.causal and self.varlen and alone

    def ws_masks(self) -> bool:
        """Whether the warp-specialised loop can do this call's masking: none, or causal alone."""
        return self.fully_visible() or (
            self.causal and dataclasses.replace(self, causal=False).fully_visible()
        )


# Causal calls with at most this many keys take the short-loop forward config: their tiles
# walk 1 to 64 key blocks, and a tile's fixed cost weighs (`short_causal`).
SHORT_CAUSAL_KEYS = 8192


def short_causal(opts: CallOptions, kv_len: int) -> bool:
    """Whether a causal call's tiles are short enough for the forward's two-slot config with
    its own output buffer (`flash._config.fwd_heuristic`'s ``short_loops``): faster there
    than three slots, which longer tiles keep (docs/performance-history.md#flash_optionspy)."""
    return opts.causal and kv_len <= SHORT_CAUSAL_KEYS


def check_bwd_config(bwd_config: FlashConfig | None) -> None:
    """Refuse a backward config no backward kernel runs (ValueError naming it): Gluon
    configs other than 64 query rows a step, and the forward's three-consumer tile."""
    if bwd_config is None:
        return
    if bwd_config.gluon and bwd_config.block_k != 64:
        raise ValueError(
            "bwd_config.gluon: the Gluon dk/dv kernel steps over 64 query rows "
            f"(block_k=64), got {bwd_config!r}"
        )
    if bwd_config.block_q == 192:
        raise ValueError(
            "bwd_config.block_q=192 is the Gluon forward's three-consumer tile; the backward "
            f"kernels own 64 or 128 rows (block_q a power of two), got {bwd_config!r}"
        )


def call_options(
    request: AttentionRequest, config: FlashConfig | None, bwd_config: FlashConfig | None
) -> CallOptions:
    """The `CallOptions` of a validated request; a config left None is the heuristic's."""
    check_bwd_config(bwd_config)
    _, _, kv_len, heads, kv_heads, head_dim = request.shape
    itemsize = request.q.dtype.itemsize
    opts = CallOptions(
        scale=float(request.softmax_scale),
        causal=request.causal,
        window=request.sliding_window,
        soft_cap=0.0 if request.logits_soft_cap is None else float(request.logits_soft_cap),
        dropout_rate=float(request.dropout_rate),
        has_seg=request.segment_ids is not None,
        varlen=request.cu_seqlens_q is not None,
        fwd_cfg=config or FlashConfig(),  # both replaced below when None
        bwd_cfg=bwd_config or FlashConfig(),
    )
    ws = offer_warp_specialize(opts.ws_masks(), request.bias, kv_len, head_dim)
    gluon = offer_gluon(
        itemsize=itemsize, bias=request.bias, dropout_rate=opts.dropout_rate, scale=opts.scale
    )
    side_inputs = opts.side_inputs(request.bias)
    if config is None:
        fwd = fwd_heuristic(
            head_dim, itemsize, side_inputs, warp_specialize=ws, gluon=gluon,
            short_loops=opts.tabled() or opts.soft_cap > 0.0 or short_causal(opts, kv_len),
            windowed=opts.window is not None, soft_cap=opts.soft_cap > 0.0, tabled=opts.tabled(),
        )  # fmt: skip
        opts = dataclasses.replace(opts, fwd_cfg=fwd)
    gluon_bwd = can_run_gluon_dkdv(
        opts, request.bias, request.q, kv_len, gluon_dkdv_tiles(head_dim)
    )
    # The heuristic's backward, or its pick where a Gluon config was asked for and the
    # Gluon dk/dv kernel cannot run it (its ordinary twin may not fit, at head_dim 256).
    asked = bwd_config is not None and bwd_config.gluon
    if bwd_config is None or (
        asked and not can_run_gluon_dkdv(opts, request.bias, request.q, kv_len, bwd_config)
    ):
        group = heads // kv_heads
        cap = opts.soft_cap > 0.0
        bwd = bwd_heuristic(
            head_dim, itemsize, side_inputs, group, soft_cap=cap, gluon=gluon_bwd,
            tables=opts.tabled(),
        )  # fmt: skip
        opts = dataclasses.replace(opts, bwd_cfg=bwd)
    return opts


def can_warp_specialize(
    masks_ok: bool, bias: Any, kv_len: int, head_dim: int, block_k: int
) -> bool:
    """Whether a call may run the warp-specialised TMA loops (see `FlashConfig`).

    ``masks_ok``: its masking is none or causal alone (`CallOptions.ws_masks`). The loop
    has no bounds masks, so every key block must be full (and there must be one); TMA needs
    16-byte aligned rows (power-of-two head_dim).
    """
    return (
        masks_ok
        and bias is None
        and kv_len > 0
        and kv_len % block_k == 0
        and head_dim == head_block(head_dim)
        and hopper_gpu()
    )


def offer_warp_specialize(masks_ok: bool, bias: Any, kv_len: int, head_dim: int) -> bool:
    """Whether the heuristics and the tuning space offer a call the warp-specialised builds
    (forward and backward): ``masks_ok`` (nothing masked, or causal alone) and the call can
    take them with the 128-key tiles of their configs (`can_warp_specialize`)."""
    return can_warp_specialize(masks_ok, bias, kv_len, head_dim, 128)


def offer_gluon(*, itemsize: int, bias: Any, dropout_rate: float, scale: float) -> bool:
    """Whether the heuristics and the tuning space offer a call the Gluon forward (on
    Hopper): 16-bit inputs, a positive scale, no bias and no dropout. Every mask, the soft
    cap and sinks run in it; `can_run_gluon` checks the rest per config."""
    return itemsize == 2 and bias is None and dropout_rate == 0.0 and scale > 0.0 and hopper_gpu()


def can_run_gluon(opts: CallOptions, bias: Any, q: Any, kv_len: int, cfg: FlashConfig) -> bool:
    """Whether a call may run the Gluon forward (`kernels.gluon._forward`) with ``cfg``:
    what `offer_gluon` asks, tiles that fit the head_dim (`gluon_fits`), and at least one
    query and one key (TMA descriptors of empty tensors are refused)."""
    return (
        offer_gluon(
            itemsize=q.dtype.itemsize, bias=bias, dropout_rate=opts.dropout_rate, scale=opts.scale
        )
        and gluon_fits(cfg, q.shape[3])
        and q.shape[1] > 0
        and kv_len > 0
    )


# The Gluon dk/dv kernel's tiles (`can_run_gluon_dkdv` asks nothing else of a config),
# and the head_dim 256 one's (`kernels.gluon._backward_wide`: 64 resident keys).
GLUON_DKDV = FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, gluon=True)
GLUON_DKDV_256 = FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=2, gluon=True)


def gluon_dkdv_wide(head_dim: int) -> bool:
    """Whether a call of ``head_dim`` takes the wide Gluon dk/dv kernel
    (`kernels.gluon._backward_wide`: 64 resident keys, the consumers split dK's and dV's columns,
    one head a program)."""
    return head_dim == 256


def gluon_dkdv_tiles(head_dim: int) -> FlashConfig:
    """The Gluon dk/dv tiles a call of ``head_dim`` would take (`can_run_gluon_dkdv`)."""
    return GLUON_DKDV_256 if gluon_dkdv_wide(head_dim) else GLUON_DKDV


def can_run_gluon_dkdv(opts: CallOptions, bias: Any, q: Any, kv_len: int, cfg: FlashConfig) -> bool:
    """Whether a backward may run the Gluon dk/dv kernel (`kernels.gluon._backward`) with
    ``cfg`` (a Gluon config: 128 resident keys, 64-row query steps; or 64 resident keys at
    head_dim 256): what `offer_gluon` asks, head_dim 64 or 128 (128 with dq in it,
    ``atomic_dq``: each consumer takes half of dq's columns) or 256, and query rows on
    whole steps (one descriptor spans every (batch, head) of q and dO). Every mask runs in
    it (beyond causal through the dk/dv block table, built for these tiles), a soft cap
    and sinks (they live in the lse)."""
    head_dim = q.shape[3]
    if cfg.block_q == 64:  # the head_dim 256 kernel (`kernels.gluon._backward_wide`), dq beside
        tiles = gluon_dkdv_wide(head_dim) and not cfg.atomic_dq
    else:
        tiles = cfg.block_q == 128 and head_dim in ((128,) if cfg.atomic_dq else (64, 128))
    return (
        cfg.gluon
        and tiles
        and cfg.block_k == 64
        and offer_gluon(
            itemsize=q.dtype.itemsize, bias=bias, dropout_rate=opts.dropout_rate, scale=opts.scale
        )
        and q.shape[1] > 0
        and q.shape[1] % cfg.block_k == 0
        and kv_len > 0
    )


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
    cfg: FlashConfig,
    *,
    joint: bool = False,
    kv_pair: bool = False,
) -> dict:
    """The constexpr arguments of `kernels.gluon._backward.gluon_dkdv_kernel`: ``block_q``
    resident keys (BN), ``block_k`` query rows a step (BM), dq too with ``atomic_dq``;
    ``joint``: dk and dv side by side in one output (``JOINT``); ``kv_pair``: k and v read
    from one array (``KV_PAIR``)."""
    tiles = dict(BM=cfg.block_k, BN=cfg.block_q, STAGES=cfg.num_stages, DQ=cfg.atomic_dq)
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


def runnable_config(
    opts: CallOptions,
    cfg: FlashConfig,
    bias: Any,
    q: Any,
    kv_len: int,
    block: int,
    kinds: tuple[str, ...],
) -> tuple[FlashConfig, bool]:
    """(config, special) a launch runs: ``cfg`` where the call can take its warp-specialised
    or Gluon build (``special``), else its ordinary twin (`ordinary_config`) for ``kinds``.
    ``block``: the streamed key tile (forward) or the resident one (backward)."""
    head_dim = q.shape[3]
    if cfg.gluon:
        special = can_run_gluon(opts, bias, q, kv_len, cfg)
    else:
        masks = opts.ws_masks()
        special = cfg.warp_specialize and can_warp_specialize(masks, bias, kv_len, head_dim, block)
    if not special:
        cfg = ordinary_config(cfg, head_dim, q.dtype.itemsize, opts.side_inputs(bias), kinds)
    return cfg, special


def dq_by_tma(cfg: FlashConfig, head_dim: int, hopper: bool) -> bool:
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
    keep three slots (`flash._config.fwd_heuristic`); outputs bitwise equal (see
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
