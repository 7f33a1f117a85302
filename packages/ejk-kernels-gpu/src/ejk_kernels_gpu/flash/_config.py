"""Performance knobs of the flash-attention kernels: config struct, heuristic, search space.

Configs hold block sizes, warps and pipelining stages only; every semantic
option (causal, window, scale, soft cap, dropout) is a kernel argument, so
tuning never changes what is computed (beyond float summation order).
"""

from __future__ import annotations

import itertools

import msgspec

from ..build._limits import SHARED_MEMORY_LIMIT, head_block

__all__ = [
    "GLUON_DQ_64",
    "GLUON_DQ_256",
    "GLUON_DQ_CONFIG",
    "GLUON_DQ_THREE",
    "SHARED_MEMORY_LIMIT",
    "FlashConfig",
    "bwd_heuristic",
    "bwd_search_space",
    "dq_beside",
    "fits_shared_memory",
    "fwd_heuristic",
    "fwd_search_space",
    "gluon_fits",
    "gluon_forward_shared",
    "head_block",
    "ordinary_config",
]


class FlashConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tile sizes and launch options of one flash-attention kernel.

    Each program keeps one tile resident and streams the other through its loop:
    queries are resident in the forward and dq kernels, keys in the dk/dv kernel.

    Attributes:
        block_q: rows of the resident tile: queries (forward, dq) or keys (dk/dv);
            a power of two, >= 16.
        block_k: rows of the streamed tile per loop step: keys (forward, dq) or
            queries (dk/dv); a power of two, >= 16.
        num_warps: warps per program (power of two); with ``warp_specialize``, warps
            per warpgroup (the program runs three warpgroups).
        num_stages: software-pipelining depth of the loop (>= 1).
        warp_specialize: Hopper (sm_90) only: move every tile through TMA descriptors in
            one warp-specialised loop per kernel (Triton makes one producer and two
            consumer warpgroups, each owning half of the resident tile; a backward config
            then runs no atomic dq). Taken by calls where every key block is fully visible
            or causal is the only mask (no window, segment ids, packing, bias, dropout
            or soft cap; key length a multiple of ``block_k``, > 0; head_dim a power of
            two); any other call runs the ordinary kernel with the same tiles (see
            `ordinary_config`). The forward heuristic picks it (head_dim 128, 16-bit inputs)
            where the Gluon forward is not taken; the backward only by explicit config
            (`WS_BWD_CONFIGS`; docs/performance-history.md#step-7-2026-11-23).
        gluon: Hopper (sm_90) only. Forward: run the forward written in Gluon
            (`kernels.gluon._forward`: FlashAttention-3's intra-warpgroup pipeline, one producer
            warp and two consumer warpgroups; ``block_q`` 128, ``num_warps`` 4 per warpgroup,
            ``block_k`` 128 or 64, ``num_stages`` slots in each of the k and v rings).
            Taken by calls with 16-bit inputs, a positive scale, no bias or dropout and
            tiles that fit (`gluon_fits`: head_dim 64 and 128 with either key tile, 256
            with 64 keys and two slots); every mask, soft cap and sinks run in it. Any other
            call runs the ordinary kernel with the same tiles (`ordinary_config`). The
            forward heuristic picks it wherever it can run at head_dim 128 and 256, and at
            64 for calls without a sliding window (`_GLUON_HEURISTIC_HEAD_DIMS`; figures:
            docs/performance.md#headline-shapes). Where its tiles are whole
            (head_dim <= 128) it runs persistent, one program per SM taking tiles from a
            counter (`flash._options.gluon_persistent`).
            Backward: run the dk/dv kernel written in Gluon (`kernels.gluon._backward`:
            128 resident keys, 64 per consumer warpgroup, ``block_k`` = 64 query rows a
            step, ``num_stages`` slots of the q/dO ring) and the dq kernel written in
            Gluon (`GLUON_DQ_CONFIG`; or the ordinary one: `dq_beside`,
            `ordinary_config`). Taken by calls with 16-bit inputs, head_dim 64 or 128, a
            positive scale, no bias or dropout, and query rows on whole 64-row steps
            (`flash._options.can_run_gluon_dkdv`); every mask (windows, packed sequences and
            segment ids through the dk/dv block table), soft cap and sinks run in it; any
            other call runs the ordinary kernels. The backward heuristic picks it at head_dim
            128, 256, and 64 with groups or a soft cap (`_GLUON_BWD_HEURISTIC_HEAD_DIMS`;
            figures: docs/performance.md#training-features).
        atomic_dq: backward only: the dk/dv kernel also computes dq (``dS·K``, FlashAttention-2,
            Alg. 2, line 21) and adds it into a float32 buffer with atomic adds, so no
            separate dq kernel recomputes ``q·kᵀ`` and ``dO·vᵀ`` (5 matmuls per tile pair
            instead of 7). On a GPU the order of those adds varies from run to run, so dq
            is not bitwise reproducible (dk, dv and the forward still are).
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    warp_specialize: bool = False
    atomic_dq: bool = False
    gluon: bool = False

    def __post_init__(self) -> None:
        for name in ("warp_specialize", "atomic_dq", "gluon"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FlashConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.gluon and self.warp_specialize:
            raise ValueError(
                "FlashConfig.gluon is a build of its own: it cannot be combined with "
                f"warp_specialize, got {self!r}"
            )
        if self.gluon and (
            self.block_q not in (64, 128, 192)
            or self.num_warps != 4
            or self.block_k not in (32, 64, 128)
        ):
            raise ValueError(
                "FlashConfig.gluon runs 128-row query tiles (192: the forward's three "
                "consumers; 64 resident keys: the head_dim 256 backward) with 4 warps per "
                "warpgroup and 32 (the head_dim 256 dq kernel), 64 or 128 keys a step: "
                f"block_q 64, 128 or 192, num_warps=4, block_k 32, 64 or 128, got {self!r}"
            )
        if self.gluon and self.num_stages not in (2, 3):
            raise ValueError(
                f"FlashConfig.gluon takes num_stages 2 or 3 (ring slots), got {self!r}"
            )
        if self.warp_specialize and self.atomic_dq:
            raise ValueError(
                "FlashConfig.warp_specialize and atomic_dq cannot both be set: the "
                "warp-specialised backward computes dq in its own kernel"
            )
        for name in ("block_q", "block_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"FlashConfig.{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"FlashConfig.{name} must be positive, got {name}={value}")
        for name in ("block_q", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1) and not (name == "block_q" and self.gluon and value == 192):
                raise ValueError(
                    f"FlashConfig.{name} must be a power of two (block_q 192: a Gluon "
                    f"config), got {name}={value}"
                )
        for name in ("block_q", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(
                    f"FlashConfig.{name} must be >= 16 (tensor-core tile), "
                    f"got {name}={getattr(self, name)}"
                )


def gluon_fits(cfg: FlashConfig, head_dim: int) -> bool:
    """Whether the Gluon forward runs ``cfg`` at ``head_dim``: 64, 128 or 256, its shared
    memory (q, and ``num_stages`` slots of k and v, 16-bit) within Hopper's, and at most
    128·128 scores-by-columns a step (head_dim 256 takes 64-key tiles: its float32
    accumulator alone is 128 registers a thread)."""
    if not cfg.gluon or head_dim not in (64, 128, 256) or cfg.block_k * head_dim > 128 * 128:
        return False
    if cfg.block_k == 32:  # the head_dim 256 dq kernel's keys a step
        return False
    if cfg.block_q == 192:  # three consumers: 160 registers a thread (`THREE_CONSUMERS`)
        return head_dim <= 128 and cfg.block_k == 64
    if cfg.block_q != 128:  # 64 is the head_dim 256 backward's resident keys
        return False
    return gluon_forward_shared(cfg, head_dim, own_output=False) <= SHARED_MEMORY_LIMIT


def gluon_forward_shared(cfg: FlashConfig, head_dim: int, *, own_output: bool) -> int:
    """Shared-memory bytes of a Gluon forward program with ``cfg``: q (and with
    ``own_output`` the output's buffer, `flash._options.gluon_obuf`), ``num_stages`` slots of k
    and v, 16-bit, and 1 KiB for barriers and alignment."""
    resident = cfg.block_q * (2 if own_output else 1)
    return (resident + 2 * cfg.num_stages * cfg.block_k) * head_dim * 2 + 1024


def _shared_bytes(
    kind: str, cfg: FlashConfig, head_dim: int, itemsize: int, side_inputs: bool
) -> int:
    """An estimate of the shared memory one program of ``kind`` needs.

    Pipelined operands are buffered ``num_stages`` times; the resident tile once.
    fwd: q resident, k and v streamed. dq: q, do resident, k, v streamed.
    dkdv: k, v resident (block_q rows), q and do streamed (block_k rows); with
    ``atomic_dq`` the dS tile also goes through shared memory (the A operand of dS·K),
    and so does the float32 dq tile on its way to the atomic adds.
    Side inputs (bias, segment ids, packed offsets, dropout) add about one float32
    score tile of layout conversions (AOT-measured: 35 KiB at 128x128 in the forward);
    that scratch and the dq tile's are counted as one, plus 4 KiB (AOT-measured at
    128x64x3 with TMA reduces of dq: 209 KiB plain, 214 KiB with every side input).
    With atomic dq, 32 query rows a step and a pipelined loop the build holds a second
    float32 dq-sized tile (AOT-measured at head_dim 128 and 256: 12.5-29 KiB above the
    rest of this estimate; at 64x32x3, head_dim 256, 229 KiB against 200 estimated: past
    the limit), counted once here. The estimate stays below some builds far from the
    limit (128 resident keys at head_dim 128: 168.5 KiB against 156) and, unpipelined, near
    it (128x32x1 atomic at head_dim 256: 224 KiB against 204, which fits).
    """
    d = head_block(head_dim)
    stages = max(cfg.num_stages, 1)
    if kind == "fwd":
        resident, streamed = cfg.block_q * d, 2 * cfg.block_k * d
    elif kind in ("dq", "dkdv"):
        resident, streamed = 2 * cfg.block_q * d, 2 * cfg.block_k * d
    else:
        raise ValueError(f"kind must be 'fwd', 'dq' or 'dkdv', got {kind=}")
    extra = cfg.block_q * cfg.block_k * 4 + 4096 if side_inputs else 0
    if kind == "dkdv" and cfg.atomic_dq:
        resident += cfg.block_q * cfg.block_k
        extra = max(extra, cfg.block_k * d * 4) + 4096
        if stages > 1 and cfg.block_k < 64:
            extra += cfg.block_k * d * 4
    return (resident + stages * streamed) * itemsize + extra


def fits_shared_memory(
    kind: str, cfg: FlashConfig, head_dim: int, itemsize: int = 2, side_inputs: bool = True
) -> bool:
    """The search-space predicate: whether ``cfg`` fits Hopper's shared memory for ``kind``.

    ``side_inputs``: whether the call has a bias, segment ids, packed offsets or dropout
    (their tiles need room too); True is the safe default.
    """
    return _shared_bytes(kind, cfg, head_dim, itemsize, side_inputs) <= SHARED_MEMORY_LIMIT


# The candidate axes: forward tiles are tall in q (the resident side), backward tiles square-ish.
_FWD_AXES = dict(block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
_BWD_AXES = dict(
    block_q=(64, 128),
    block_k=(32, 64),
    num_warps=(4, 8),
    num_stages=(1, 2, 3),
    atomic_dq=(False, True),
)


def _space(
    kinds: tuple[str, ...], axes: dict, head_dim: int, itemsize: int, side_inputs: bool
) -> tuple[FlashConfig, ...]:
    names = tuple(axes)
    cands = (
        FlashConfig(**dict(zip(names, values, strict=True)))
        for values in itertools.product(*axes.values())
    )
    return tuple(
        c
        for c in cands
        if all(fits_shared_memory(k, c, head_dim, itemsize, side_inputs) for k in kinds)
    )


# Warp-specialised configs (AOT-checked for sm_90: shared memory and global scratch).
_WS_CONFIGS = {
    128: (FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, warp_specialize=True),),
}
# The Gluon forward: three ring slots for long loops, two (with the output's own buffer) for
# short ones (`fwd_heuristic`'s ``short_loops``); head_dim 256: 64-key tiles, two slots
# (`gluon_fits`). Why: docs/performance-history.md#flash_configpy.
_GLUON_CONFIGS = {
    64: (
        FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True),
        FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, gluon=True),
    ),
    128: (
        FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True),
        FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, gluon=True),
    ),
    256: (FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, gluon=True),),
}
# The Gluon forward's three-consumer tile for soft caps (192 query rows, 64 a consumer): a
# cap's forward is MUFU-bound, and a third softmax runs while two wait on matmuls; see
# docs/performance-history.md#flash_configpy.
THREE_CONSUMERS = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)
# Where the forward heuristic takes it: faster than the ordinary kernel everywhere but under
# a sliding window at head_dim 64, where the ordinary kernel stays; see
# docs/performance-history.md#flash_configpy.
_GLUON_HEURISTIC_HEAD_DIMS = (64, 128, 256)
# Where it takes `THREE_CONSUMERS` for soft cap calls without a block table.
_THREE_CONSUMER_HEAD_DIMS = (64, 128)
_GLUON_WINDOW_HEAD_DIMS = (128, 256)

# The Gluon dk/dv kernel: 128 resident keys, 64 query rows a step, two q/dO slots (three:
# level); at head_dim 128 with MHA it computes dq itself (``atomic_dq``), faster than a dq
# kernel beside it, slower with groups or a soft cap; see
# docs/performance-history.md#flash_configpy.
_GLUON_BWD = FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, gluon=True)
_GLUON_BWD_3 = msgspec.structs.replace(_GLUON_BWD, num_stages=3)
# head_dim 256 (`kernels.gluon._backward_wide`): 64 resident keys, the consumers splitting dK's and
# dV's columns; two slots (three do not fit shared memory), the Gluon dq kernel beside it
# (`GLUON_DQ_256`).
_GLUON_BWD_256 = FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=2, gluon=True)
_GLUON_BWD_DQ = msgspec.structs.replace(_GLUON_BWD, num_stages=3, atomic_dq=True)
GLUON_BWD_CONFIGS = {
    64: (_GLUON_BWD, _GLUON_BWD_3),
    128: (
        _GLUON_BWD,
        _GLUON_BWD_3,
        msgspec.structs.replace(_GLUON_BWD, atomic_dq=True),
        _GLUON_BWD_DQ,
    ),
    256: (_GLUON_BWD_256,),
}
# The Gluon dq kernel beside the Gluon dk/dv kernel (`kernels.gluon._backward.
# gluon_dq_kernel`): 128 resident query rows, 64 keys a step; or None for the ordinary dq
# kernel with the dk/dv config's tiles. Three k/v slots: the pipelined schedule (each
# block's dS·k after the next block's q·kᵀ and dO·vᵀ), faster than two unpipelined; see
# docs/performance-history.md#flash_configpy.
# Its tiles are the Gluon dk/dv configs' (128, 64): the dq block table built for those
# serves it with a window, packing or segment ids.
GLUON_DQ_CONFIG: FlashConfig | None = FlashConfig(
    block_q=128, block_k=64, num_warps=4, num_stages=3, gluon=True
)
# At head_dim 64 (soft cap calls, below) two slots, unpipelined: the pipelined schedule is
# slower there; docs/performance-history.md#flash_configpy.
GLUON_DQ_64: FlashConfig | None = msgspec.structs.replace(GLUON_DQ_CONFIG, num_stages=2)
# At head_dim 256 its rows (128 of q and of dO, 256 columns: 128 KiB) leave room for a ring
# of 32-key k/v blocks only, two slots (three fit, 224 KiB, and are no faster: see
# docs/performance-history.md#flash_configpy); its float32 dq is 128 registers a consumer,
# as the forward's accumulator at this head_dim.
GLUON_DQ_256: FlashConfig | None = FlashConfig(
    block_q=128, block_k=32, num_warps=4, num_stages=2, gluon=True
)
# At head_dim 64 without a soft cap the ordinary dq kernel, with the backward heuristic's tiles
# there, runs beside the Gluon dk/dv kernel: faster than the Gluon dq kernel, which wins only
# with a cap (its tanh overlaps the matmuls); see
# docs/performance-history.md#flash_configpy.
_ORDINARY_BWD_64 = FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=3)


# Calls without a block table (no window, packing or segment ids): the Gluon dq kernel's
# three consumers (192 query rows a program, 64 a consumer, as the forward's
# `THREE_CONSUMERS`), two slots, unpipelined (pipelined, ptxas spills at 160 registers a
# thread); faster than two consumers, dq bitwise equal (see
# docs/performance-history.md#flash_configpy). Keyed by (head_dim, soft cap). With a table
# its builds spill, and at head_dim 64 without a cap the ordinary dq kernel runs
# (`dq_beside`).
_GLUON_DQ_192 = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)
GLUON_DQ_THREE: dict[tuple[int, bool], FlashConfig] = {
    (128, False): _GLUON_DQ_192,
    (128, True): _GLUON_DQ_192,
    (64, True): _GLUON_DQ_192,
}


def dq_beside(
    bwd: FlashConfig, head_dim: int, soft_cap: bool, *, tabled: bool = False
) -> FlashConfig | None:
    """The config of the dq kernel that runs beside the Gluon dk/dv config ``bwd``: the
    Gluon dq kernel's (`GLUON_DQ_CONFIG`; its three consumers, `GLUON_DQ_THREE`, without
    a block table, ``tabled``: a window, packing or segment ids; `GLUON_DQ_256` beside the head_dim
    256 kernel's 64 resident keys; `GLUON_DQ_64` at head_dim 64, there without a soft cap
    the ordinary one's with the heuristic's tiles, `_ORDINARY_BWD_64`); or None where dq
    comes from elsewhere: from the dk/dv kernel (``atomic_dq``), or from the ordinary dq
    kernel with ``bwd``'s tiles (not a Gluon config, or, for a call the three consumers do
    not take, `GLUON_DQ_CONFIG` set to None).
    The dq block table is built for the tiles of the kernel that runs
    (`flash._tables.range_tables`)."""
    if not bwd.gluon or bwd.atomic_dq:
        return None
    if bwd.block_q == 64:
        return GLUON_DQ_256
    if not tabled and (head_dim, soft_cap) in GLUON_DQ_THREE:
        return GLUON_DQ_THREE[head_dim, soft_cap]
    if head_dim == 64:
        return GLUON_DQ_64 if soft_cap else _ORDINARY_BWD_64
    return GLUON_DQ_CONFIG


# Where the backward heuristic takes it: head_dim 128, 256 (the column-split kernel,
# `_GLUON_BWD_256`) and 64 only with groups or a soft cap (`bwd_heuristic`: MHA without a cap
# the ordinary backward is as fast); see
# docs/performance-history.md#flash_configpy.
_GLUON_BWD_HEURISTIC_HEAD_DIMS = (128, 256)

# The warp-specialised backward, for explicit configs only (128 resident rows: keys in
# dk/dv, queries in dq, 64 per consumer warpgroup; 64 streamed): its dk/dv kernel has a
# race (see `bwd_heuristic`), so neither the heuristic nor the tuning space offers it.
# The AOT build still compiles it.
WS_BWD_CONFIGS = {
    128: (FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, warp_specialize=True),),
}


def ordinary_config(
    cfg: FlashConfig,
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    kinds: tuple[str, ...] = ("fwd",),
) -> FlashConfig:
    """The ordinary-kernel config a warp-specialised or Gluon one stands for where it
    cannot run.

    Same tiles (but 128 query rows for the Gluon forward's 192: the ordinary kernel's tiles
    are powers of two); its two consumer warpgroups become ``2 * num_warps`` warps, and the
    producer's buffering one more pipeline stage where shared memory allows for every
    kernel of ``kinds`` (forward 128x128 tiles: (128, 128, 8, 3), the best ordinary
    forward config measured; backward 128x64: (128, 64, 8, 3)).
    """
    if not (cfg.warp_specialize or cfg.gluon):
        return cfg
    base = msgspec.structs.replace(
        cfg, num_warps=2 * cfg.num_warps, warp_specialize=False, gluon=False,
        block_q=min(cfg.block_q, 128),  # (192: the Gluon forward's three consumers)
    )  # fmt: skip
    deeper = msgspec.structs.replace(base, num_stages=min(base.num_stages + 1, 3))
    fits = all(fits_shared_memory(k, deeper, head_dim, itemsize, side_inputs) for k in kinds)
    return deeper if fits else base


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
    forward (`flash._options.offer_gluon`); None: whenever it can take the warp-specialised loop.
    ``soft_cap``: the call has one: at head_dim 64 and 128 the Gluon forward's three-consumer
    tile joins too (`THREE_CONSUMERS`).
    """
    gluon = warp_specialize if gluon is None else gluon
    space = _space(("fwd",), _FWD_AXES, head_dim, itemsize, side_inputs)
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
) -> tuple[FlashConfig, ...]:
    """Every backward config (shared by the dq and dk/dv kernels) that fits both, and
    with ``gluon`` (the call can take the Gluon dk/dv kernel, `flash._options.can_run_gluon_dkdv`)
    its configs (`GLUON_BWD_CONFIGS`; with a ``soft_cap`` the two-slot one only: with three
    its sm_90 build spills registers inside its loop; with ``tables``, masks beyond causal,
    none with dq inside: those builds spill and are slower, see `bwd_heuristic`).

    The warp-specialised backward is left out until its dk/dv race is fixed (see
    `bwd_heuristic`).
    """
    space = _space(("dq", "dkdv"), _BWD_AXES, head_dim, itemsize, side_inputs)
    if gluon and itemsize == 2:
        configs = GLUON_BWD_CONFIGS.get(head_dim, ())
        configs = tuple(c for c in configs if not (tables and c.atomic_dq))
        space += configs[: 1 if soft_cap else None]
    return space


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
    """A good forward config without timing (why each branch:
    docs/performance-history.md#flash_configpy).

    ``gluon``: the call can take the Gluon forward on this GPU (`flash._options.offer_gluon`;
    None: whenever it can take the warp-specialised loop): at head_dim 128 and 256 it
    runs it, at 64 unless ``windowed`` (the call has a sliding window; see
    ``_GLUON_HEURISTIC_HEAD_DIMS``) (16-bit; faster than the Triton warp-specialised one).
    ``warp_specialize``: the call can take the warp-specialised loop, taken where Gluon is
    not (faster than the ordinary kernel causal). ``short_loops``: the call's masks go beyond
    causal (a window, packing, segment ids), it has a soft cap, or it is causal over few keys
    (`flash._options.short_causal`): its programs run few key blocks a tile, or heavy ones, and
    at head_dim 128 the Gluon forward's two-slot config gives its output a buffer of its
    own (`flash._options.gluon_obuf`; faster there, slower unmasked). ``soft_cap``:
    the call has a soft cap; without ``tabled`` (masks beyond causal: a window, packing,
    segment ids) at head_dim 64 and 128 it runs the Gluon forward's three consumers
    (`THREE_CONSUMERS`).
    """
    gluon = warp_specialize if gluon is None else gluon
    gluon_dims = _GLUON_WINDOW_HEAD_DIMS if windowed else _GLUON_HEURISTIC_HEAD_DIMS
    if gluon and itemsize == 2 and head_dim in gluon_dims:
        if soft_cap and not tabled and head_dim in _THREE_CONSUMER_HEAD_DIMS:
            return THREE_CONSUMERS
        configs = _GLUON_CONFIGS[head_dim]
        return configs[1] if short_loops and head_dim == 128 else configs[0]
    if warp_specialize and itemsize == 2 and head_dim in _WS_CONFIGS:
        return _WS_CONFIGS[head_dim][0]
    if head_dim <= 64:
        return FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        if not side_inputs and itemsize <= 2:
            # 224 KiB of shared memory: only without side-input tiles.
            return FlashConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)
        return FlashConfig(block_q=128, block_k=64, num_warps=8, num_stages=3)
    return FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)


def bwd_heuristic(
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    group: int = 1,
    soft_cap: bool = False,
    gluon: bool = False,
    tables: bool = False,
) -> FlashConfig:
    """A good backward config without timing (block_q resident, block_k streamed; why each
    branch: docs/performance-history.md#flash_configpy).

    Never the warp-specialised backward: faster at head_dim 128, but its dk/dv kernel is not
    deterministic on an H100 (dk and dv differ between runs, sometimes NaN), so no call gets
    it unless its config asks for it explicitly (`WS_BWD_CONFIGS`).

    ``group`` is the GQA group size (query heads per kv head): the dk/dv kernel unrolls
    its loop over the group, and with groups the 8-warp 128-row tiles are slower.
    dq comes from the dk/dv kernel's atomic adds (`FlashConfig.atomic_dq`) where that is
    faster: MHA, 16-bit, head_dim 65-128. With groups it is level with the dq kernel (which
    keeps dq reproducible bit for bit), and with 64-row key tiles slower (twice the atomic
    traffic). ``soft_cap``: where the Gluon dk/dv kernel cannot run, each kernel that
    recomputes p pays a tanh per score besides the exp, so computing p once (atomic dq) wins
    with groups too: 128x32 tiles, 8 warps, 3 stages; at head_dim 256, 64x64 tiles with 8 warps.
    ``gluon``: the call can take the Gluon dk/dv kernel (`flash._options.can_run_gluon_dkdv`);
    at head_dim 64 it does with groups or a soft cap (two slots, a dq kernel beside:
    `dq_beside`); at head_dim 128 it does (`_GLUON_BWD_HEURISTIC_HEAD_DIMS`), with dq in
    it (three ring slots) for MHA without a soft cap, else beside it (`GLUON_DQ_CONFIG`; see
    `GLUON_BWD_CONFIGS`); at head_dim 256 its column-split kernel (`_GLUON_BWD_256`,
    the Gluon dq kernel beside it, `GLUON_DQ_256`). ``tables``: the call's masks go beyond
    causal (a window, packing, segment ids; `flash._options.CallOptions.tabled`): there dq
    beside it, three slots without a soft cap (faster than two, and than dq inside).
    """
    if gluon and itemsize == 2 and head_dim == 64 and (group > 1 or soft_cap):
        return _GLUON_BWD
    if gluon and itemsize == 2 and head_dim in _GLUON_BWD_HEURISTIC_HEAD_DIMS:
        if head_dim == 256:  # its one config: the Gluon dq kernel beside, two slots
            return _GLUON_BWD_256
        if tables:
            return _GLUON_BWD if soft_cap else _GLUON_BWD_3
        return _GLUON_BWD_DQ if group == 1 and not soft_cap else _GLUON_BWD
    if head_dim <= 64:
        return _ORDINARY_BWD_64
    if head_dim <= 128 and itemsize <= 2 and soft_cap:
        return FlashConfig(block_q=128, block_k=32, num_warps=8, num_stages=3, atomic_dq=True)
    if head_dim <= 128 and itemsize <= 2 and group == 1:
        return FlashConfig(block_q=128, block_k=64, num_warps=8, num_stages=3, atomic_dq=True)
    if head_dim <= 128:
        return FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)
    if itemsize <= 2:
        return FlashConfig(block_q=64, block_k=64, num_warps=8, num_stages=2)
    return FlashConfig(block_q=32, block_k=32, num_warps=4, num_stages=2)
