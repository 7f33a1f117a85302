"""The flash-attention configs: `FlashConfig` (the forward's, and the dq kernel's) and
`FlashBackwardConfig` (the backward's), what fits Hopper's shared memory, the candidate
tiles and the ordinary twin of a Hopper build's config. Which config a call gets is decided
in `flash._select`.

Configs hold block sizes, warps and pipelining stages only; every semantic
option (causal, window, scale, soft cap, dropout) is a kernel argument, so
tuning never changes what is computed (beyond float summation order).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, TypeVar

import msgspec

from ..build._limits import SHARED_MEMORY_LIMIT, head_block

__all__ = [
    "SHARED_MEMORY_LIMIT",
    "FlashBackwardConfig",
    "FlashConfig",
    "as_backward_config",
    "candidates",
    "fits_shared_memory",
    "gluon_fits",
    "gluon_forward_shared",
    "head_block",
    "ordinary_config",
    "ordinary_dq_config",
]


class FlashConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tile sizes and launch options of the flash-attention forward (and of the dq kernel).

    Each program keeps ``block_q`` query rows resident and streams ``block_k`` keys through
    its loop. The backward's dk/dv kernel, which keeps keys resident, has a config of its
    own (`FlashBackwardConfig`); the dq kernel beside it is shaped as the forward (queries
    resident, keys streamed) and takes a `FlashConfig` (`flash._select.dq_beside`,
    `ordinary_dq_config`).

    Attributes:
        block_q: query rows of a program (the resident tile); a power of two, >= 16
            (192: the Gluon forward's three consumers).
        block_k: keys a loop step (the streamed tile); a power of two, >= 16.
        num_warps: warps per program (power of two); with ``warp_specialize``, warps
            per warpgroup (the program runs three warpgroups).
        num_stages: software-pipelining depth of the loop (>= 1).
        warp_specialize: Hopper (sm_90) only: move every tile through TMA descriptors in
            one warp-specialised loop (Triton makes one producer and two consumer
            warpgroups, each owning half of the query tile). Taken by calls where every
            key block is fully visible or causal is the only mask (no window, segment ids,
            packing, bias, dropout or soft cap; key length a multiple of ``block_k``, > 0;
            head_dim a power of two); any other call runs the ordinary kernel with the same
            tiles (see `ordinary_config`). The forward rules pick it (head_dim 128, 16-bit
            inputs) where the Gluon forward is not taken (`flash._select.FORWARD_RULES`).
        gluon: Hopper (sm_90) only: run the forward written in Gluon
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
            taking tiles from a counter (`flash._constexprs.gluon_persistent`). As a dq
            kernel's config (`flash._select.DQ_RULES`): the Gluon dq kernel
            (`kernels.gluon._backward.gluon_dq_kernel`; ``block_k`` 32 at head_dim 256).
        atomic_dq: deprecated, no meaning for the forward (which ignores it): read only when
            a `FlashConfig` is passed as ``bwd_config`` (converted, with a
            DeprecationWarning, by `FlashBackwardConfig.from_flash_config`). Set
            `FlashBackwardConfig.atomic_dq` instead.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    warp_specialize: bool = False
    atomic_dq: bool = False
    gluon: bool = False

    def __post_init__(self) -> None:
        _check_bools(self, ("warp_specialize", "atomic_dq", "gluon"))
        _check_builds(self)
        if self.gluon and (
            self.block_q not in (64, 128, 192)
            or self.num_warps != 4
            or self.block_k not in (32, 64, 128)
        ):
            raise ValueError(
                "FlashConfig.gluon runs 128-row query tiles (192: the forward's three "
                "consumers; 64: the deprecated backward spelling, 64 resident keys of the "
                "head_dim 256 kernel) with 4 warps per warpgroup and 32 (the head_dim 256 dq "
                "kernel), 64 or 128 keys a step: "
                f"block_q 64, 128 or 192, num_warps=4, block_k 32, 64 or 128, got {self!r}"
            )
        # (block_q 192: the Gluon forward's three consumers)
        three = self.gluon and self.block_q == 192
        _check_numbers(self, ("block_q", "block_k"), exempt="block_q" if three else None)


class FlashBackwardConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tile sizes and launch options of the flash-attention backward.

    FlashAttention-2's backward (Alg. 2) runs two loops: the dk/dv kernel keeps a block of
    keys (and values) resident and streams the query rows past them; dq comes from that
    kernel (``atomic_dq``) or from a dq kernel that keeps queries resident, shaped as the
    forward, whose config is a `FlashConfig`: beside a Gluon config the one
    `flash._select.dq_beside` picks, else the ordinary dq kernel with this config's tile
    shapes (`ordinary_dq_config`: ``block_keys`` query rows resident, ``block_queries``
    keys a step).

    Attributes:
        block_keys: keys a dk/dv program keeps resident (its dk and dv rows); a power of
            two, >= 16. Gluon: 128, or 64 (head_dim 256, `kernels.gluon._backward_wide`:
            the consumers split dK's and dV's columns).
        block_queries: query rows (of q and dO) a dk/dv program streams a loop step; a
            power of two, >= 16. Gluon: 64.
        num_warps: warps per program (power of two); with ``warp_specialize`` or
            ``gluon``, warps per warpgroup (Gluon: 4).
        num_stages: software-pipelining depth of the loop (>= 1); Gluon: 2 or 3 slots of
            the q/dO ring.
        warp_specialize: Hopper (sm_90) only: the warp-specialised TMA loops in the dk/dv
            and dq kernels (one producer and two consumer warpgroups, each owning half of
            the resident tile), dq by its own kernel. Taken by calls where every key block
            is fully visible or causal is the only mask (no window, segment ids, packing,
            bias, dropout or soft cap; key length a multiple of ``block_keys``, > 0;
            head_dim a power of two); any other call runs the ordinary kernels with the
            same tiles (`ordinary_config`). Only by explicit config
            (`flash._select.WS_BWD_CONFIGS`; docs/performance-history.md#step-7-2026-11-23):
            its dk/dv kernel has a race (`flash._select.bwd_heuristic`).
        gluon: Hopper (sm_90) only: run the dk/dv kernel written in Gluon
            (`kernels.gluon._backward`: 128 resident keys, 64 per consumer warpgroup, 64
            query rows a step) and beside it the dq kernel `flash._select.DQ_RULES` picks
            (the Gluon one, or the ordinary one). Taken by calls with 16-bit inputs,
            head_dim 64 or 128 (256 with 64 resident keys), a positive scale, no bias or
            dropout, and query rows on whole 64-row steps
            (`flash._select.can_run_gluon_dkdv`); every mask (windows, packed sequences and
            segment ids through the dk/dv block table), soft cap and sinks run in it; any
            other call runs the rules' backward (`flash._select.call_options`). The backward
            rules pick it at head_dim 128, 256, and 64 with groups or a soft cap
            (`flash._select.BACKWARD_RULES`).
        atomic_dq: the dk/dv kernel also computes dq (``dS·K``, FlashAttention-2, Alg. 2,
            line 21) and adds it into a float32 buffer with atomic adds, so no separate dq
            kernel recomputes ``q·kᵀ`` and ``dO·vᵀ`` (5 matmuls per tile pair instead of
            7). On a GPU the order of those adds varies from run to run, so dq is not
            bitwise reproducible (dk, dv and the forward still are).
    """

    block_keys: int = 64
    block_queries: int = 64
    num_warps: int = 4
    num_stages: int = 2
    warp_specialize: bool = False
    gluon: bool = False
    atomic_dq: bool = False

    def __post_init__(self) -> None:
        _check_bools(self, ("warp_specialize", "gluon", "atomic_dq"))
        _check_builds(self)
        if self.gluon and (
            self.block_keys not in (64, 128) or self.block_queries != 64 or self.num_warps != 4
        ):
            raise ValueError(
                "FlashBackwardConfig.gluon runs 128 resident keys (64: the head_dim 256 "
                "kernel) and 64 query rows a step with 4 warps per warpgroup: block_keys 64 "
                f"or 128, block_queries=64, num_warps=4, got {self!r}"
            )
        _check_numbers(self, ("block_keys", "block_queries"))

    @classmethod
    def from_flash_config(cls, cfg: FlashConfig) -> FlashBackwardConfig:
        """The backward config a `FlashConfig` passed as ``bwd_config`` stood for (the
        spelling before this type), field by field: ``block_q`` (then the dk/dv kernel's
        resident keys) is ``block_keys``, ``block_k`` (its query rows a step)
        ``block_queries``; the rest keep their names."""
        return cls(
            block_keys=cfg.block_q, block_queries=cfg.block_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, warp_specialize=cfg.warp_specialize, gluon=cfg.gluon,
            atomic_dq=cfg.atomic_dq,
        )  # fmt: skip


# A config of either pass (`ordinary_config` gives back the type it takes).
Cfg = TypeVar("Cfg", FlashConfig, FlashBackwardConfig)


def _check_bools(cfg: Any, names: tuple[str, ...]) -> None:
    """TypeError naming the first of ``names`` (fields of ``cfg``) that is not a bool."""
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            owner = type(cfg).__name__
            raise TypeError(f"{owner}.{name} must be a bool, got {getattr(cfg, name)!r}")


def _check_builds(cfg: Any) -> None:
    """The checks of a config's build flags: Gluon is a build of its own (not with
    ``warp_specialize``) with 2 or 3 ring slots; the warp-specialised backward computes dq
    in its own kernel (not with ``atomic_dq``). ValueError naming the fields."""
    owner = type(cfg).__name__
    if cfg.gluon and cfg.warp_specialize:
        raise ValueError(
            f"{owner}.gluon is a build of its own: it cannot be combined with "
            f"warp_specialize, got {cfg!r}"
        )
    if cfg.gluon and cfg.num_stages not in (2, 3):
        raise ValueError(f"{owner}.gluon takes num_stages 2 or 3 (ring slots), got {cfg!r}")
    if cfg.warp_specialize and cfg.atomic_dq:  # (FlashConfig: the deprecated backward spelling)
        raise ValueError(
            f"{owner}.warp_specialize and atomic_dq cannot both be set: the "
            "warp-specialised backward computes dq in its own kernel"
        )


def _check_numbers(cfg: Any, tiles: tuple[str, str], exempt: str | None = None) -> None:
    """The checks of a config's numbers: ``tiles`` (its two tile fields), ``num_warps`` and
    ``num_stages`` positive ints; tiles and warps powers of two (but the field ``exempt``);
    tiles >= 16 (a tensor-core tile). ValueError or TypeError naming the field and value."""
    owner = type(cfg).__name__
    for name in (*tiles, "num_warps", "num_stages"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}.{name} must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {name}={value}")
    for name in (*tiles, "num_warps"):
        value = getattr(cfg, name)
        if value & (value - 1) and name != exempt:
            note = " (block_q 192: a Gluon config)" if owner == "FlashConfig" else ""
            raise ValueError(f"{owner}.{name} must be a power of two{note}, got {name}={value}")
    for name in tiles:
        if getattr(cfg, name) < 16:
            raise ValueError(
                f"{owner}.{name} must be >= 16 (tensor-core tile), got {name}={getattr(cfg, name)}"
            )


def as_backward_config(bwd_config: Any, *, stacklevel: int = 3) -> FlashBackwardConfig | None:
    """A ``bwd_config`` argument as the backward's config: a `FlashBackwardConfig` or None
    as it is; a `FlashConfig` (the spelling before `FlashBackwardConfig`, kept for one
    release) converted field by field (`FlashBackwardConfig.from_flash_config`) with a
    DeprecationWarning that gives the new spelling; anything else a TypeError."""
    if bwd_config is None or isinstance(bwd_config, FlashBackwardConfig):
        return bwd_config
    if not isinstance(bwd_config, FlashConfig):
        raise TypeError(f"bwd_config must be a FlashBackwardConfig or None, got {bwd_config!r}")
    new = FlashBackwardConfig.from_flash_config(bwd_config)
    warnings.warn(
        f"bwd_config={bwd_config!r} is deprecated: the backward takes a FlashBackwardConfig "
        f"(block_q was the dk/dv kernel's resident keys, block_k its query rows a step): "
        f"pass bwd_config={new!r}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return new


def ordinary_dq_config(bwd: FlashBackwardConfig) -> FlashConfig:
    """The config of the ordinary dq kernel run with the backward config ``bwd`` (no dq
    inside the dk/dv kernel, no dq kernel of its own beside it): ``bwd``'s tile shapes with
    queries resident, ``bwd.block_keys`` query rows a program and ``bwd.block_queries`` keys
    a step (FlashAttention-2's two backward loops on one tile shape), its warps, stages and
    warp-specialised loop."""
    return FlashConfig(
        block_q=bwd.block_keys, block_k=bwd.block_queries, num_warps=bwd.num_warps,
        num_stages=bwd.num_stages, warp_specialize=bwd.warp_specialize,
    )  # fmt: skip


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


def _tiles(kind: str, cfg: FlashConfig | FlashBackwardConfig) -> tuple[int, int, bool]:
    """(resident rows, streamed rows, atomic dq) of a program of ``kind`` with ``cfg``:
    a `FlashConfig` for the forward and the dq kernel, a `FlashBackwardConfig` for the
    dk/dv kernel and for the ordinary dq kernel it runs with (`ordinary_dq_config`)."""
    if isinstance(cfg, FlashBackwardConfig) and kind in ("dq", "dkdv"):
        return cfg.block_keys, cfg.block_queries, kind == "dkdv" and cfg.atomic_dq
    if isinstance(cfg, FlashConfig) and kind in ("fwd", "dq"):
        return cfg.block_q, cfg.block_k, False
    if kind not in ("fwd", "dq", "dkdv"):
        raise ValueError(f"kind must be 'fwd', 'dq' or 'dkdv', got {kind=}")
    raise TypeError(
        f"a {kind} kernel takes a "
        f"{'FlashConfig' if kind == 'fwd' else 'FlashBackwardConfig'}, got {cfg!r}"
    )


def _shared_bytes(
    kind: str, cfg: FlashConfig | FlashBackwardConfig, head_dim: int, itemsize: int,
    side_inputs: bool,
) -> int:  # fmt: skip
    """An estimate of the shared memory one program of ``kind`` needs.

    Pipelined operands are buffered ``num_stages`` times; the resident tile once.
    fwd: q resident (block_q rows), k and v streamed (block_k). dq: q, do resident, k, v
    streamed. dkdv: k, v resident (block_keys rows), q and do streamed (block_queries
    rows); with ``atomic_dq`` the dS tile also goes through shared memory (the A operand
    of dS·K), and so does the float32 dq tile on its way to the atomic adds.
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
    rows, step, atomic = _tiles(kind, cfg)
    if kind == "fwd":
        resident, streamed = rows * d, 2 * step * d
    else:
        resident, streamed = 2 * rows * d, 2 * step * d
    extra = rows * step * 4 + 4096 if side_inputs else 0
    if atomic:
        resident += rows * step
        extra = max(extra, step * d * 4) + 4096
        if stages > 1 and step < 64:
            extra += step * d * 4
    return (resident + stages * streamed) * itemsize + extra


def fits_shared_memory(
    kind: str,
    cfg: FlashConfig | FlashBackwardConfig,
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
) -> bool:
    """The search-space predicate: whether ``cfg`` fits Hopper's shared memory for ``kind``
    (``"fwd"``: a `FlashConfig`; ``"dkdv"``: a `FlashBackwardConfig`; ``"dq"``: either, the
    dq kernel's own config or the backward config it runs with, `ordinary_dq_config`).

    ``side_inputs``: whether the call has a bias, segment ids, packed offsets or dropout
    (their tiles need room too); True is the safe default.
    """
    return _shared_bytes(kind, cfg, head_dim, itemsize, side_inputs) <= SHARED_MEMORY_LIMIT


# The candidate axes: forward tiles are tall in q (the resident side), backward tiles square-ish.
_FWD_AXES = dict(block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))
_BWD_AXES = dict(
    block_keys=(64, 128),
    block_queries=(32, 64),
    num_warps=(4, 8),
    num_stages=(1, 2, 3),
    atomic_dq=(False, True),
)


def candidates(
    kinds: tuple[str, ...], head_dim: int, itemsize: int, side_inputs: bool
) -> tuple[FlashConfig, ...] | tuple[FlashBackwardConfig, ...]:
    """The ordinary configs of the candidate axes (the forward's `FlashConfig`s for
    ``("fwd",)``, else the backward's `FlashBackwardConfig`s) that fit shared memory for
    every kernel of ``kinds``."""
    forward = kinds == ("fwd",)
    cls, axes = (FlashConfig, _FWD_AXES) if forward else (FlashBackwardConfig, _BWD_AXES)
    names = tuple(axes)
    cands = (
        cls(**dict(zip(names, values, strict=True))) for values in itertools.product(*axes.values())
    )
    return tuple(
        c
        for c in cands
        if all(fits_shared_memory(k, c, head_dim, itemsize, side_inputs) for k in kinds)
    )


def ordinary_config(
    cfg: Cfg,
    head_dim: int,
    itemsize: int = 2,
    side_inputs: bool = True,
    kinds: tuple[str, ...] = ("fwd",),
) -> Cfg:
    """The ordinary-kernel config a warp-specialised or Gluon one (forward or backward)
    stands for where it cannot run.

    Same tiles (but 128 query rows for the Gluon forward's 192: the ordinary kernel's tiles
    are powers of two); its two consumer warpgroups become ``2 * num_warps`` warps, and the
    producer's buffering one more pipeline stage where shared memory allows for every
    kernel of ``kinds`` (forward 128x128 tiles: (128, 128, 8, 3), the best ordinary
    forward config measured; backward 128 keys by 64 query rows: (128, 64, 8, 3)).
    """
    if not (cfg.warp_specialize or cfg.gluon):
        return cfg
    plain = dict(num_warps=2 * cfg.num_warps, warp_specialize=False, gluon=False)
    if isinstance(cfg, FlashConfig):  # (192: the Gluon forward's three consumers)
        plain["block_q"] = min(cfg.block_q, 128)
    base = msgspec.structs.replace(cfg, **plain)
    deeper = msgspec.structs.replace(base, num_stages=min(base.num_stages + 1, 3))
    fits = all(fits_shared_memory(k, deeper, head_dim, itemsize, side_inputs) for k in kinds)
    return deeper if fits else base
