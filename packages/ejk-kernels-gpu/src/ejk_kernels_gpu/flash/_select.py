"""Which build and which config a flash-attention call gets: the decision tables.

A call is decided in this order (`flash._api.attention`, `call_options`):

1. `routes_to_decode`: few query rows per kv group over many keys run the split-KV
   kernel (`flash._decode`, `kernels.triton._paged`); no flash forward config.
2. The forward config: the one given, else the first rule of `FORWARD_RULES` that holds.
3. The backward config: the one given (a Gluon one the call cannot run: the rules
   instead), else the first rule of `BACKWARD_RULES` that holds.
4. Beside a Gluon dk/dv config, the dq kernel's config: the first rule of `DQ_RULES`.
5. At launch, `runnable_config`: the build a config names where the call can take it
   (`can_warp_specialize`, `can_run_gluon`, `can_run_gluon_dkdv`), else its ordinary
   twin with the same tiles (`flash._config.ordinary_config`).

The builds a config names (the forward's and the dq kernel's: `FlashConfig`, ``block_q``
query rows resident, ``block_k`` keys a step; the backward's: `FlashBackwardConfig`,
``block_keys`` resident in the dk/dv kernel, ``block_queries`` query rows a step):

=================================  =====================================  ================================
build                              kernel                                 config
=================================  =====================================  ================================
ordinary Triton (FlashAttention-2)  `kernels.triton._forward`, `_backward`  any config (no flag)
warp-specialised Triton            the same, ``WS``                       ``warp_specialize=True``
Gluon forward, 2 consumers         `kernels.gluon._forward`                ``gluon``, ``block_q`` 128
Gluon forward, 3 consumers         `kernels.gluon._forward`                ``gluon``, ``block_q`` 192
Gluon dk/dv, dq inside             `kernels.gluon._backward`               ``gluon``, 128, ``atomic_dq``
Gluon dk/dv, dq beside             `kernels.gluon._backward` + dq kernel   ``gluon``, 128 (`DQ_RULES`)
head_dim 256, columns split        `kernels.gluon._backward_wide`          ``gluon``, ``block_keys`` 64
decode split-KV                    `kernels.triton._paged`                 `paged.PagedConfig`
=================================  =====================================  ================================

Each rule gives its reason in a line and the figure behind it: a section of
``docs/performance.md`` (the current figures) or of ``docs/performance-history.md`` (the
runs that chose it). The Gluon forward's program variants (persistent, own output buffer,
tile order, fixed shift) follow from the call in `flash._constexprs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from ejk_sequtils import AttentionRequest

from ..build._triton import hopper_gpu
from ._config import (
    Cfg,
    FlashBackwardConfig,
    FlashConfig,
    candidates,
    gluon_fits,
    head_block,
    ordinary_config,
    ordinary_dq_config,
)

__all__ = [
    "BACKWARD_RULES",
    "DQ_RULES",
    "FORWARD_RULES",
    "GLUON_BWD_CONFIGS",
    "GLUON_DQ_64",
    "GLUON_DQ_256",
    "GLUON_DQ_CONFIG",
    "GLUON_DQ_THREE",
    "THREE_CONSUMERS",
    "WS_BWD_CONFIGS",
    "BackwardCall",
    "CallOptions",
    "ForwardCall",
    "Rule",
    "bwd_heuristic",
    "bwd_search_space",
    "call_options",
    "can_run_gluon",
    "can_run_gluon_dkdv",
    "can_warp_specialize",
    "dq_beside",
    "fwd_heuristic",
    "fwd_search_space",
    "gluon_dkdv_tiles",
    "gluon_dkdv_wide",
    "offer_gluon",
    "offer_warp_specialize",
    "routes_to_decode",
    "runnable_config",
    "short_causal",
]

# Where the figures are.
HEADLINE = "docs/performance.md#headline-shapes"
FEATURES = "docs/performance.md#training-features"
DECODING = "docs/performance.md#decoding"
CONFIG_RUNS = "docs/performance-history.md#flash_configpy"
OPTIONS_RUNS = "docs/performance-history.md#flash_optionspy"
BWD_SWEEP = "packages/ejk-kernels-gpu/benchmarks/results/2026-11-25-h100-bwd-sweep-capfold.json"
BWD_TABLES = (
    "packages/ejk-kernels-gpu/benchmarks/results/2026-11-25-h100-gluon-bwd-tables-draft.json"
)


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
    bwd_cfg: FlashBackwardConfig
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
        """The config of the dq kernel beside this call's Gluon dk/dv config (`dq_beside`),
        one answer for the launch and for the dq block table built for its tiles
        (`flash._tables.range_tables`)."""
        return dq_beside(self.bwd_cfg, head_dim, self.soft_cap > 0.0, tabled=self.tabled())

    def dq_config(self, head_dim: int) -> FlashConfig:
        """The config of this call's dq kernel where one runs: the one beside a Gluon dk/dv
        config (`dq_beside`), else the ordinary dq kernel's with the backward config's
        tiles (`flash._config.ordinary_dq_config`)."""
        return self.dq_beside(head_dim) or ordinary_dq_config(self.bwd_cfg)

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


# ---- 1. The decode route ------------------------------------------------------------------

# Where the split-KV kernel serves a flash_attention call: at most this many query rows
# per kv group, at least this many keys (the flash forward there has a few hundred programs
# walking every key, each kv head's keys read G times; DECODING).
MAX_DECODE_ROWS = 64
MIN_DECODE_KEYS = 1024


def routes_to_decode(request: AttentionRequest, config: FlashConfig | None = None) -> bool:
    """Whether the split-KV kernel serves a validated request (`flash._decode`): no explicit
    forward config, no bias, segment ids, packing, dropout, window or lse; unmasked, or causal
    with one query (top-left causal: it sees key 0 alone); ``T·G <= MAX_DECODE_ROWS`` and
    ``S >= MIN_DECODE_KEYS``."""
    batch, q_len, kv_len, heads, kv_heads, _ = request.shape
    return (
        config is None
        and request.bias is None
        and request.segment_ids is None
        and request.cu_seqlens_q is None
        and request.dropout_rate == 0.0
        and request.sliding_window is None
        and not request.return_lse
        and (not request.causal or q_len == 1)
        and batch > 0
        and 0 < q_len * (heads // kv_heads) <= MAX_DECODE_ROWS
        and kv_len >= MIN_DECODE_KEYS
    )


# ---- The rules -----------------------------------------------------------------------------

Call = TypeVar("Call")
# What a rule picks: a forward or dq kernel config, or a backward one.
Config = FlashConfig | FlashBackwardConfig


@dataclasses.dataclass(frozen=True)
class Rule(Generic[Call]):
    """One row of a decision table: when it holds for a call, the call gets ``pick``.

    Attributes:
        name: the build and config, in words.
        when: whether the rule holds for the call's facts.
        pick: the config (None: no kernel of this kind), or a function of the facts
            giving it (read when asked, so a module constant it names can change).
        reason: why, in one line.
        figure: where the figure behind it is.
    """

    name: str
    when: Callable[[Call], bool]
    pick: Config | Callable[[Call], Config | None] | None
    reason: str
    figure: str

    def config(self, call: Call) -> Any:
        return self.pick(call) if callable(self.pick) else self.pick


def first_rule(rules: tuple[Rule[Call], ...], call: Call) -> Rule[Call]:
    """The first rule of ``rules`` that holds for ``call`` (the last one always does)."""
    return next(rule for rule in rules if rule.when(call))


# ---- 2. The forward config ------------------------------------------------------------------

# The warp-specialised forward (AOT-checked for sm_90: shared memory and global scratch).
WS_FWD = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, warp_specialize=True)
# The Gluon forward: three ring slots for long loops, two (with the output's own buffer,
# `flash._constexprs.gluon_obuf`) for short ones; head_dim 256: 64-key tiles, two slots.
GLUON_FWD = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True)
GLUON_FWD_SHORT = msgspec.structs.replace(GLUON_FWD, num_stages=2)
GLUON_FWD_256 = FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, gluon=True)
# The Gluon forward's three-consumer tile: 192 query rows, 64 a consumer.
THREE_CONSUMERS = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)


@dataclasses.dataclass(frozen=True)
class ForwardCall:
    """What the forward rules read of a call (`fwd_heuristic`'s arguments)."""

    head_dim: int
    itemsize: int
    side_inputs: bool  # a bias, segment ids, packed offsets or dropout: their tiles need room
    warp_specialize: bool  # the call can take the warp-specialised loop (`offer_warp_specialize`)
    gluon: bool  # the call can take the Gluon forward (`offer_gluon`)
    short_loops: bool  # masks beyond causal, a soft cap, or causal over few keys
    windowed: bool  # a sliding window
    soft_cap: bool
    tabled: bool  # masks beyond causal: a window, packing, segment ids

    def takes_gluon(self) -> bool:
        """16-bit, offered, and a head_dim where the Gluon forward is the faster build: 128
        and 256, and 64 without a sliding window (the ordinary kernel is faster there)."""
        dims = (128, 256) if self.windowed else (64, 128, 256)
        return self.gluon and self.itemsize == 2 and self.head_dim in dims


FORWARD_RULES: tuple[Rule[ForwardCall], ...] = (
    Rule(
        "Gluon, three consumers",
        lambda c: c.takes_gluon() and c.soft_cap and not c.tabled and c.head_dim in (64, 128),
        THREE_CONSUMERS,
        "a soft cap's forward is bound by its tanh: a third softmax runs while two consumers "
        "wait on matmuls (with a block table its build spills)",
        FEATURES,
    ),
    Rule(
        "Gluon, two slots, the output's own buffer",
        lambda c: c.takes_gluon() and c.head_dim == 128 and c.short_loops,
        GLUON_FWD_SHORT,
        "short loops: q is released after a tile's last q·kᵀ, the next tile's q loads during "
        "the epilogue (slower unmasked and over long loops)",
        OPTIONS_RUNS,
    ),
    Rule(
        "Gluon, three slots",
        lambda c: c.takes_gluon() and c.head_dim in (64, 128),
        GLUON_FWD,
        "FlashAttention-3's pipeline: faster than the Triton builds at head_dim 64 and 128",
        HEADLINE,
    ),
    Rule(
        "Gluon, head_dim 256",
        lambda c: c.takes_gluon() and c.head_dim == 256,
        GLUON_FWD_256,
        "64-key tiles and two slots: its float32 accumulator alone is 128 registers a thread",
        FEATURES,
    ),
    Rule(
        "warp-specialised Triton",
        lambda c: c.warp_specialize and c.itemsize == 2 and c.head_dim == 128,
        WS_FWD,
        "where the Gluon forward is not offered: causal calls 10-20 % faster than the "
        "ordinary kernel",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, head_dim <= 64",
        lambda c: c.head_dim <= 64,
        FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),
        "the ordinary kernel's pick of the bf16 sweeps at small head_dims",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, 128x128 tiles",
        lambda c: c.head_dim <= 128 and not c.side_inputs and c.itemsize <= 2,
        FlashConfig(block_q=128, block_k=128, num_warps=8, num_stages=3),
        "the best ordinary forward measured; 224 KiB of shared memory: only without "
        "side-input tiles",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, head_dim <= 128",
        lambda c: c.head_dim <= 128,
        FlashConfig(block_q=128, block_k=64, num_warps=8, num_stages=3),
        "with side-input tiles or float32, 128 keys a step do not fit shared memory",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, head_dim > 128",
        lambda c: True,
        FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=2),
        "wide rows (head_dim 256): the tiles that fit shared memory with side inputs",
        CONFIG_RUNS,
    ),
)


def fwd_heuristic(
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    warp_specialize: bool = False,
    gluon: bool | None = None,
    short_loops: bool = False,
    windowed: bool = False,
    soft_cap: bool = False,
    tabled: bool = False,
) -> FlashConfig:
    """A good forward config without timing: the first of `FORWARD_RULES` that holds.

    ``gluon``: the call can take the Gluon forward on this GPU (`offer_gluon`; None: whenever
    it can take the warp-specialised loop). ``warp_specialize``: the call can take the
    warp-specialised loop. ``short_loops``: the call's masks go beyond causal (a window,
    packing, segment ids), it has a soft cap, or it is causal over few keys
    (`short_causal`). ``windowed``: it has a sliding window. ``soft_cap``: it has one.
    ``tabled``: its masks go beyond causal (a window, packing, segment ids).
    """
    call = ForwardCall(
        head_dim=head_dim, itemsize=itemsize, side_inputs=side_inputs,
        warp_specialize=warp_specialize,
        gluon=warp_specialize if gluon is None else gluon,
        short_loops=short_loops, windowed=windowed, soft_cap=soft_cap, tabled=tabled,
    )  # fmt: skip
    return first_rule(FORWARD_RULES, call).config(call)


# ---- 3. The backward config -----------------------------------------------------------------

# The Gluon dk/dv kernel: 128 resident keys, 64 query rows a step, two q/dO slots (three:
# _3); dq beside it, or inside it (``atomic_dq``, TMA reduces of dq).
GLUON_BWD = FlashBackwardConfig(
    block_keys=128, block_queries=64, num_warps=4, num_stages=2, gluon=True
)
GLUON_BWD_3 = msgspec.structs.replace(GLUON_BWD, num_stages=3)
GLUON_BWD_DQ = msgspec.structs.replace(GLUON_BWD, num_stages=3, atomic_dq=True)
# head_dim 256 (`kernels.gluon._backward_wide`): 64 resident keys, the consumers splitting dK's
# and dV's columns; two slots (three do not fit shared memory), the Gluon dq kernel beside.
GLUON_BWD_256 = FlashBackwardConfig(
    block_keys=64, block_queries=64, num_warps=4, num_stages=2, gluon=True
)
# The ordinary backward at head_dim 64; its dq kernel's tiles (64 query rows, 32 keys a
# step) are also the dq kernel beside the Gluon dk/dv kernel there without a soft cap
# (`ORDINARY_DQ_64`, `DQ_RULES`).
ORDINARY_BWD_64 = FlashBackwardConfig(block_keys=64, block_queries=32, num_warps=4, num_stages=3)


@dataclasses.dataclass(frozen=True)
class BackwardCall:
    """What the backward rules read of a call (`bwd_heuristic`'s arguments)."""

    head_dim: int
    itemsize: int
    side_inputs: bool
    group: int  # query heads per kv head
    soft_cap: bool
    gluon: bool  # the call can take the Gluon dk/dv kernel (`can_run_gluon_dkdv`)
    tables: bool  # masks beyond causal: a window, packing, segment ids

    def gluon16(self, *dims: int) -> bool:
        return self.gluon and self.itemsize == 2 and self.head_dim in dims


BACKWARD_RULES: tuple[Rule[BackwardCall], ...] = (
    Rule(
        "Gluon dk/dv, head_dim 64, dq beside",
        lambda c: c.gluon16(64) and (c.group > 1 or c.soft_cap),
        GLUON_BWD,
        "with groups or a soft cap faster than the ordinary backward (MHA without a cap the "
        "ordinary backward is as fast)",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dk/dv, head_dim 256, columns split, dq beside",
        lambda c: c.gluon16(256),
        GLUON_BWD_256,
        "its one config: 64 resident keys fit with two slots only",
        FEATURES,
    ),
    Rule(
        "Gluon dk/dv, block table, soft cap: two slots, dq beside",
        lambda c: c.gluon16(128) and c.tables and c.soft_cap,
        GLUON_BWD,
        "with a soft cap three slots spill registers in the loop",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dk/dv, block table: three slots, dq beside",
        lambda c: c.gluon16(128) and c.tables,
        GLUON_BWD_3,
        "faster than two slots, and than dq inside (whose builds spill with a table)",
        BWD_TABLES,
    ),
    Rule(
        "Gluon dk/dv, dq inside",
        lambda c: c.gluon16(128) and c.group == 1 and not c.soft_cap,
        GLUON_BWD_DQ,
        "MHA without a cap: dq from the dk/dv kernel (5 matmuls a tile pair, not 7) is faster",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dk/dv, dq beside",
        lambda c: c.gluon16(128),
        GLUON_BWD,
        "with groups or a soft cap dq inside is slower than a dq kernel beside",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, head_dim <= 64",
        lambda c: c.head_dim <= 64,
        ORDINARY_BWD_64,
        "the fastest ordinary backward tiles measured at small head_dims",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, atomic dq, soft cap",
        lambda c: c.head_dim <= 128 and c.itemsize <= 2 and c.soft_cap,
        FlashBackwardConfig(
            block_keys=128, block_queries=32, num_warps=8, num_stages=3, atomic_dq=True
        ),
        "each kernel that recomputes p pays a tanh per score: computing p once wins, groups too",
        BWD_SWEEP,
    ),
    Rule(
        "ordinary, atomic dq, MHA",
        lambda c: c.head_dim <= 128 and c.itemsize <= 2 and c.group == 1,
        FlashBackwardConfig(
            block_keys=128, block_queries=64, num_warps=8, num_stages=3, atomic_dq=True
        ),
        "MHA 16-bit: dq by atomic adds saves the dq kernel's two recomputed matmuls",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, dq kernel, head_dim <= 128",
        lambda c: c.head_dim <= 128,
        FlashBackwardConfig(block_keys=64, block_queries=64, num_warps=4, num_stages=2),
        "with groups atomic dq is level and 8-warp 128-row tiles slower; a dq kernel keeps dq "
        "reproducible bit for bit",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary, head_dim > 128, 16-bit",
        lambda c: c.itemsize <= 2,
        FlashBackwardConfig(block_keys=64, block_queries=64, num_warps=8, num_stages=2),
        "faster than 32x32 tiles with 4 warps at head_dim 256",
        BWD_SWEEP,
    ),
    Rule(
        "ordinary, head_dim > 128, float32",
        lambda c: True,
        FlashBackwardConfig(block_keys=32, block_queries=32, num_warps=4, num_stages=2),
        "float32 tiles of wide head_dims fit only small",
        CONFIG_RUNS,
    ),
)


def bwd_heuristic(
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    group: int = 1,
    soft_cap: bool = False,
    gluon: bool = False,
    tables: bool = False,
) -> FlashBackwardConfig:
    """A good backward config without timing: the first of `BACKWARD_RULES` that holds.

    Never the warp-specialised backward: its dk/dv kernel is not deterministic on an H100
    (dk and dv differ between runs, sometimes NaN), so no call gets it unless its config
    asks for it explicitly (`WS_BWD_CONFIGS`).

    ``group``: query heads per kv head. ``soft_cap``: the call has one. ``gluon``: the call
    can take the Gluon dk/dv kernel (`can_run_gluon_dkdv`). ``tables``: its masks go beyond
    causal (a window, packing, segment ids; `CallOptions.tabled`).
    """
    call = BackwardCall(
        head_dim=head_dim, itemsize=itemsize, side_inputs=side_inputs, group=group,
        soft_cap=soft_cap, gluon=gluon, tables=tables,
    )  # fmt: skip
    return first_rule(BACKWARD_RULES, call).config(call)


# ---- 4. The dq kernel beside a Gluon dk/dv config ----------------------------------------

# The Gluon dq kernel (`kernels.gluon._backward.gluon_dq_kernel`): 128 resident query rows,
# 64 keys a step, three k/v slots (each block's dS·k after the next block's q·kᵀ and dO·vᵀ).
# Its tiles are the Gluon dk/dv configs' (128, 64): the dq block table built for those
# serves it with a window, packing or segment ids. None: the ordinary dq kernel instead.
GLUON_DQ_CONFIG: FlashConfig | None = FlashConfig(
    block_q=128, block_k=64, num_warps=4, num_stages=3, gluon=True
)
# At head_dim 64 (soft cap calls) two slots, unpipelined.
GLUON_DQ_64: FlashConfig | None = msgspec.structs.replace(GLUON_DQ_CONFIG, num_stages=2)
# The ordinary dq kernel at head_dim 64: `ORDINARY_BWD_64`'s tiles.
ORDINARY_DQ_64 = ordinary_dq_config(ORDINARY_BWD_64)
# At head_dim 256 its rows (128 of q and of dO, 256 columns: 128 KiB) leave room for a ring
# of 32-key k/v blocks only, two slots; its float32 dq is 128 registers a consumer.
GLUON_DQ_256: FlashConfig | None = FlashConfig(
    block_q=128, block_k=32, num_warps=4, num_stages=2, gluon=True
)
# Three consumers (192 query rows a program, 64 a consumer, as the forward's
# `THREE_CONSUMERS`), two slots, unpipelined (pipelined, ptxas spills at 160 registers a
# thread); dq bitwise equal to two consumers'. Keyed by (head_dim, soft cap).
_GLUON_DQ_192 = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)
GLUON_DQ_THREE: dict[tuple[int, bool], FlashConfig] = {
    (128, False): _GLUON_DQ_192,
    (128, True): _GLUON_DQ_192,
    (64, True): _GLUON_DQ_192,
}


@dataclasses.dataclass(frozen=True)
class DqCall:
    """What the dq rules read: the backward config and the call."""

    bwd: FlashBackwardConfig
    head_dim: int
    soft_cap: bool
    tabled: bool  # masks beyond causal: a window, packing, segment ids


DQ_RULES: tuple[Rule[DqCall], ...] = (
    Rule(
        "none: dq inside the dk/dv kernel, or the ordinary dq kernel with the same tiles",
        lambda c: not c.bwd.gluon or c.bwd.atomic_dq,
        None,
        "a dq kernel beside runs only with the Gluon dk/dv kernel without dq inside",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dq, 32 keys a step (beside the head_dim 256 kernel)",
        lambda c: c.bwd.block_keys == 64,
        lambda c: GLUON_DQ_256,
        "128 rows of q and dO at 256 columns leave room for 32-key k/v slots only",
        FEATURES,
    ),
    Rule(
        "Gluon dq, three consumers",
        lambda c: not c.tabled and (c.head_dim, c.soft_cap) in GLUON_DQ_THREE,
        lambda c: GLUON_DQ_THREE[c.head_dim, c.soft_cap],
        "faster than two consumers without a block table (with one its builds spill)",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dq, head_dim 64, two slots",
        lambda c: c.head_dim == 64 and c.soft_cap,
        lambda c: GLUON_DQ_64,
        "its tanh overlaps the matmuls; the pipelined schedule is slower at this head_dim",
        CONFIG_RUNS,
    ),
    Rule(
        "ordinary dq kernel, head_dim 64",
        lambda c: c.head_dim == 64,
        ORDINARY_DQ_64,
        "without a soft cap faster than the Gluon dq kernel at head_dim 64",
        CONFIG_RUNS,
    ),
    Rule(
        "Gluon dq, three slots",
        lambda c: True,
        lambda c: GLUON_DQ_CONFIG,
        "pipelined: faster than two slots unpipelined",
        CONFIG_RUNS,
    ),
)


def dq_beside(
    bwd: FlashBackwardConfig, head_dim: int, soft_cap: bool, *, tabled: bool = False
) -> FlashConfig | None:
    """The config of the dq kernel that runs beside the Gluon dk/dv config ``bwd`` (a
    `FlashConfig`: queries resident, keys a step): the first of `DQ_RULES` that holds; None
    where dq comes from elsewhere (the dk/dv kernel's ``atomic_dq``, or the ordinary dq
    kernel with ``bwd``'s tiles, `ordinary_dq_config`: not a Gluon config, or
    `GLUON_DQ_CONFIG` set to None). ``tabled``: a window, packing or segment ids. The dq
    block table is built for the tiles of the kernel that runs (`flash._tables.range_tables`)."""
    call = DqCall(bwd=bwd, head_dim=head_dim, soft_cap=soft_cap, tabled=tabled)
    return first_rule(DQ_RULES, call).config(call)


# ---- Search spaces: what the autotuner may pick ---------------------------------------------

_WS_CONFIGS = {128: (WS_FWD,)}
_GLUON_CONFIGS = {64: (GLUON_FWD, GLUON_FWD_SHORT), 128: (GLUON_FWD, GLUON_FWD_SHORT),
                  256: (GLUON_FWD_256,)}  # fmt: skip
GLUON_BWD_CONFIGS = {
    64: (GLUON_BWD, GLUON_BWD_3),
    128: (GLUON_BWD, GLUON_BWD_3, msgspec.structs.replace(GLUON_BWD, atomic_dq=True), GLUON_BWD_DQ),
    256: (GLUON_BWD_256,),
}
# The warp-specialised backward, for explicit configs only (128 resident keys in dk/dv,
# and 128 query rows in the dq kernel with its tiles, 64 per consumer warpgroup; 64
# streamed): its dk/dv kernel has a race (see `bwd_heuristic`), so neither the rules nor
# the tuning space offer it. The AOT build still compiles it.
WS_BWD_CONFIGS = {
    128: (
        FlashBackwardConfig(
            block_keys=128, block_queries=64, num_warps=4, num_stages=2, warp_specialize=True
        ),
    ),
}


def fwd_search_space(
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    warp_specialize: bool = False,
    gluon: bool | None = None,
    soft_cap: bool = False,
) -> tuple[FlashConfig, ...]:
    """Every forward config worth timing for ``head_dim``, pruned by `fits_shared_memory`.

    ``warp_specialize``: the call can take the warp-specialised loop (see `FlashConfig`)
    on this GPU; its configs join the space. ``gluon``: the call can take the Gluon
    forward (`offer_gluon`); None: whenever it can take the warp-specialised loop.
    ``soft_cap``: the call has one: at head_dim 64 and 128 the Gluon forward's three-consumer
    tile joins too (`THREE_CONSUMERS`).
    """
    gluon = warp_specialize if gluon is None else gluon
    space = candidates(("fwd",), head_dim, itemsize, side_inputs)
    if warp_specialize and itemsize == 2:
        space += _WS_CONFIGS.get(head_dim, ())
    if gluon and itemsize == 2:
        space += _GLUON_CONFIGS.get(head_dim, ())
        if soft_cap and gluon_fits(THREE_CONSUMERS, head_dim):
            space += (THREE_CONSUMERS,)
    return space


def bwd_search_space(
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    gluon: bool = False,
    soft_cap: bool = False,
    tables: bool = False,
) -> tuple[FlashBackwardConfig, ...]:
    """Every backward config (the dk/dv kernel's, and the ordinary dq kernel's with its
    tiles, `ordinary_dq_config`) that fits both, and
    with ``gluon`` (the call can take the Gluon dk/dv kernel, `can_run_gluon_dkdv`) its
    configs (`GLUON_BWD_CONFIGS`; with a ``soft_cap`` the two-slot one only: with three
    its sm_90 build spills registers inside its loop; with ``tables``, masks beyond causal,
    none with dq inside: those builds spill and are slower).

    The warp-specialised backward is left out until its dk/dv race is fixed (see
    `bwd_heuristic`).
    """
    space = candidates(("dq", "dkdv"), head_dim, itemsize, side_inputs)
    if gluon and itemsize == 2:
        configs = GLUON_BWD_CONFIGS.get(head_dim, ())
        configs = tuple(c for c in configs if not (tables and c.atomic_dq))
        space += configs[: 1 if soft_cap else None]
    return space


# ---- 5. Which build a config runs: what a call can take ---------------------------------------


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
    """Whether the rules and the tuning space offer a call the warp-specialised builds
    (forward and backward): ``masks_ok`` (nothing masked, or causal alone) and the call can
    take them with the 128-key tiles of their configs (`can_warp_specialize`)."""
    return can_warp_specialize(masks_ok, bias, kv_len, head_dim, 128)


def offer_gluon(*, itemsize: int, bias: Any, dropout_rate: float, scale: float) -> bool:
    """Whether the rules and the tuning space offer a call the Gluon forward (on
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


def gluon_dkdv_wide(head_dim: int) -> bool:
    """Whether a call of ``head_dim`` takes the wide Gluon dk/dv kernel
    (`kernels.gluon._backward_wide`: 64 resident keys, the consumers split dK's and dV's columns,
    one head a program)."""
    return head_dim == 256


def gluon_dkdv_tiles(head_dim: int) -> FlashBackwardConfig:
    """The Gluon dk/dv tiles a call of ``head_dim`` would take (`can_run_gluon_dkdv` asks
    nothing else of a config)."""
    return GLUON_BWD_256 if gluon_dkdv_wide(head_dim) else GLUON_BWD


def can_run_gluon_dkdv(
    opts: CallOptions, bias: Any, q: Any, kv_len: int, cfg: FlashBackwardConfig
) -> bool:
    """Whether a backward may run the Gluon dk/dv kernel (`kernels.gluon._backward`) with
    ``cfg`` (a Gluon config: 128 resident keys, 64-row query steps; or 64 resident keys at
    head_dim 256): what `offer_gluon` asks, head_dim 64 or 128 (128 with dq in it,
    ``atomic_dq``: each consumer takes half of dq's columns) or 256, and query rows on
    whole steps (one descriptor spans every (batch, head) of q and dO). Every mask runs in
    it (beyond causal through the dk/dv block table, built for these tiles), a soft cap
    and sinks (they live in the lse)."""
    head_dim = q.shape[3]
    if cfg.block_keys == 64:  # the head_dim 256 kernel (`kernels.gluon._backward_wide`), dq beside
        tiles = gluon_dkdv_wide(head_dim) and not cfg.atomic_dq
    else:
        tiles = cfg.block_keys == 128 and head_dim in ((128,) if cfg.atomic_dq else (64, 128))
    return (
        cfg.gluon
        and tiles
        and cfg.block_queries == 64
        and offer_gluon(
            itemsize=q.dtype.itemsize, bias=bias, dropout_rate=opts.dropout_rate, scale=opts.scale
        )
        and q.shape[1] > 0
        and q.shape[1] % cfg.block_queries == 0
        and kv_len > 0
    )


def runnable_config(
    opts: CallOptions,
    cfg: Cfg,
    bias: Any,
    q: Any,
    kv_len: int,
    block: int,
    kinds: tuple[str, ...],
) -> tuple[Cfg, bool]:
    """(config, special) a launch runs: ``cfg`` where the call can take its warp-specialised
    or Gluon build (``special``), else its ordinary twin (`ordinary_config`) for ``kinds``.
    ``block``: the streamed key tile (forward, ``block_k``) or the resident one (backward,
    ``block_keys``)."""
    head_dim = q.shape[3]
    if isinstance(cfg, FlashConfig) and cfg.gluon:
        special = can_run_gluon(opts, bias, q, kv_len, cfg)
    else:
        masks = opts.ws_masks()
        special = cfg.warp_specialize and can_warp_specialize(masks, bias, kv_len, head_dim, block)
    if not special:
        cfg = ordinary_config(cfg, head_dim, q.dtype.itemsize, opts.side_inputs(bias), kinds)
    return cfg, special


# ---- A call's options: the steps above for one request --------------------------------------

# Causal calls with at most this many keys take the short-loop forward config: their tiles
# walk 1 to 64 key blocks, and a tile's fixed cost weighs (`short_causal`).
SHORT_CAUSAL_KEYS = 8192


def short_causal(opts: CallOptions, kv_len: int) -> bool:
    """Whether a causal call's tiles are short enough for the forward's two-slot config with
    its own output buffer (`fwd_heuristic`'s ``short_loops``): faster there than three
    slots, which longer tiles keep (docs/performance-history.md#flash_optionspy)."""
    return opts.causal and kv_len <= SHORT_CAUSAL_KEYS


def call_options(
    request: AttentionRequest, config: FlashConfig | None, bwd_config: FlashBackwardConfig | None
) -> CallOptions:
    """The `CallOptions` of a validated request; a config left None is the rules'."""
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
        bwd_cfg=bwd_config or FlashBackwardConfig(),
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
    # The rules' backward, or their pick where a Gluon config was asked for and the
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
