"""The flash-attention config: `FlashConfig`, what fits Hopper's shared memory, the candidate
tiles and the ordinary twin of a Hopper build's config. Which config a call gets is decided
in `flash._select`.

Configs hold block sizes, warps and pipelining stages only; every semantic
option (causal, window, scale, soft cap, dropout) is a kernel argument, so
tuning never changes what is computed (beyond float summation order).
"""

from __future__ import annotations

import itertools

import msgspec

from ..build._limits import SHARED_MEMORY_LIMIT, head_block

__all__ = [
    "SHARED_MEMORY_LIMIT",
    "FlashConfig",
    "candidates",
    "fits_shared_memory",
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
            `ordinary_config`). The forward rules pick it (head_dim 128, 16-bit inputs)
            where the Gluon forward is not taken (`flash._select.FORWARD_RULES`); the
            backward only by explicit config (`flash._select.WS_BWD_CONFIGS`;
            docs/performance-history.md#step-7-2026-11-23).
        gluon: Hopper (sm_90) only. Forward: run the forward written in Gluon
            (`kernels.gluon._forward`: FlashAttention-3's intra-warpgroup pipeline, one producer
            warp and two consumer warpgroups; ``block_q`` 128, ``num_warps`` 4 per warpgroup,
            ``block_k`` 128 or 64, ``num_stages`` slots in each of the k and v rings).
            Taken by calls with 16-bit inputs, a positive scale, no bias or dropout and
            tiles that fit (`gluon_fits`: head_dim 64 and 128 with either key tile, 256
            with 64 keys and two slots); every mask, soft cap and sinks run in it. Any other
            call runs the ordinary kernel with the same tiles (`ordinary_config`). The
            forward rules pick it wherever it can run at head_dim 128 and 256, and at
            64 for calls without a sliding window (`flash._select.FORWARD_RULES`). Where
            its tiles are whole (head_dim <= 128) it runs persistent, one program per SM
            taking tiles from a counter (`flash._constexprs.gluon_persistent`).
            Backward: run the dk/dv kernel written in Gluon (`kernels.gluon._backward`:
            128 resident keys, 64 per consumer warpgroup, ``block_k`` = 64 query rows a
            step, ``num_stages`` slots of the q/dO ring) and the dq kernel written in
            Gluon (`flash._select.DQ_RULES`; or the ordinary one, `ordinary_config`). Taken by calls with 16-bit inputs, head_dim 64 or 128, a
            positive scale, no bias or dropout, and query rows on whole 64-row steps
            (`flash._select.can_run_gluon_dkdv`); every mask (windows, packed sequences and
            segment ids through the dk/dv block table), soft cap and sinks run in it; any
            other call runs the ordinary kernels. The backward rules pick it at head_dim
            128, 256, and 64 with groups or a soft cap (`flash._select.BACKWARD_RULES`).
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
    if (
        cfg.block_q == 192
    ):  # three consumers: 160 registers a thread (`flash._select.THREE_CONSUMERS`)
        return head_dim <= 128 and cfg.block_k == 64
    if cfg.block_q != 128:  # 64 is the head_dim 256 backward's resident keys
        return False
    return gluon_forward_shared(cfg, head_dim, own_output=False) <= SHARED_MEMORY_LIMIT


def gluon_forward_shared(cfg: FlashConfig, head_dim: int, *, own_output: bool) -> int:
    """Shared-memory bytes of a Gluon forward program with ``cfg``: q (and with
    ``own_output`` the output's buffer, `flash._constexprs.gluon_obuf`), ``num_stages`` slots of k
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
_AXES = {
    "fwd": dict(block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4)),
    "bwd": dict(
        block_q=(64, 128),
        block_k=(32, 64),
        num_warps=(4, 8),
        num_stages=(1, 2, 3),
        atomic_dq=(False, True),
    ),
}


def candidates(
    kinds: tuple[str, ...], head_dim: int, itemsize: int, side_inputs: bool
) -> tuple[FlashConfig, ...]:
    """The ordinary configs of the candidate axes (the forward's for ``("fwd",)``, else the
    backward's) that fit shared memory for every kernel of ``kinds``."""
    axes = _AXES["fwd" if kinds == ("fwd",) else "bwd"]
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
