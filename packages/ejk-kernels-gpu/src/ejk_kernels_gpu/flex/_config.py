"""`FlexConfig`: the tiles and launch options of the flex kernels, and their heuristics.

The block lists name blocks of the `BlockMask`'s size; a kernel's tiles divide them (a
listed block is walked a tile at a time), so a mask built once with 128 x 128 blocks serves
backward kernels whose registers hold 64-row tiles.
"""

from __future__ import annotations

import itertools

import msgspec

from ..build._limits import SHARED_MEMORY_LIMIT, head_block

__all__ = [
    "FlexConfig",
    "bwd_heuristic",
    "bwd_search_space",
    "check_tiles",
    "fwd_heuristic",
    "fwd_search_space",
]


def _power_of_two(value: object, low: int, high: int) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and low <= value <= high and value & (value - 1) == 0  # type: ignore[operator]


class FlexConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tiles and launch options of the flex kernels (one config for the forward, one for both
    backward kernels).

    Attributes:
        block_q: rows of the resident tile: queries (forward, dq) or keys (dk/dv); a power
            of two in [16, 256] dividing the block mask's block along that axis.
        block_k: rows of the streamed tile: keys (forward, dq) or queries (dk/dv); likewise.
        num_warps: warps per program, a power of two in [1, 16].
        num_stages: software-pipelining depth of the loops, >= 1.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not _power_of_two(value, 16, 256):
                raise ValueError(f"FlexConfig: {name} must be a power of two in [16, 256], got {value!r}")  # fmt: skip
        if not _power_of_two(self.num_warps, 1, 16):
            raise ValueError(f"FlexConfig: num_warps must be a power of two in [1, 16], got {self.num_warps!r}")  # fmt: skip
        s = self.num_stages
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"FlexConfig: num_stages must be an int >= 1, got {s!r}")


# (head_dim bound, 16-bit tiles, 32-bit tiles): (block_q, block_k, num_warps), the first row
# whose bound holds; sm_90 builds (`aot.flex`) of every representative mod fit shared memory
# and spill nothing with them.
_FWD_TILES = (
    (64, (128, 128, 8), (128, 64, 8)),
    (128, (128, 64, 8), (64, 64, 8)),
    (256, (64, 64, 8), (64, 32, 8)),
)
_BWD_TILES = (
    (64, (64, 32, 4), (64, 32, 4)),
    (128, (64, 32, 4), (32, 32, 4)),
    (256, (32, 32, 4), (16, 16, 4)),
)


def _pick(rows: tuple, block_size: tuple[int, int], head_dim: int, itemsize: int,
          both: bool) -> FlexConfig:  # fmt: skip
    tiles = next(row for row in rows if head_dim <= row[0])
    block_q, block_k, warps = tiles[1] if itemsize <= 2 else tiles[2]
    if both:  # the backward's tiles divide both block sides (dq and dk/dv swap them)
        block_q, block_k = min(block_q, *block_size), min(block_k, *block_size)
    else:
        block_q, block_k = min(block_q, block_size[0]), min(block_k, block_size[1])
    return FlexConfig(block_q=block_q, block_k=block_k, num_warps=warps)


def fwd_heuristic(block_size: tuple[int, int], head_dim: int, itemsize: int = 2) -> FlexConfig:
    """The forward's tiles (`_FWD_TILES`): 128 query rows by 64 keys with eight warps at
    head_dim 128 in 16 bits; smaller at 256 and in float32 (shared memory). Smaller blocks:
    theirs."""
    return _pick(_FWD_TILES, block_size, head_dim, itemsize, both=False)


def bwd_heuristic(block_size: tuple[int, int], head_dim: int, itemsize: int = 2) -> FlexConfig:
    """The backward's tiles (`_BWD_TILES`): 64 resident rows by 32 streamed ones, four
    warps, at head_dim 128 in 16 bits (the dk/dv kernel's resident k, v, dk and dv stay in
    registers); smaller at 256 and in float32. Smaller blocks: theirs."""
    return _pick(_BWD_TILES, block_size, head_dim, itemsize, both=True)


def check_tiles(config: FlexConfig, block_size: tuple[int, int], role: str) -> None:
    """``config``'s tiles divide the mask's blocks (``role``: "forward" or "backward").

    Raises:
        ValueError: a tile that does not divide its block, naming both.
    """
    q_block, kv_block = block_size
    pairs = [("block_q", config.block_q, q_block), ("block_k", config.block_k, kv_block)]
    if role == "backward":  # the dk/dv kernel: resident keys, streamed queries
        pairs += [("block_q", config.block_q, kv_block), ("block_k", config.block_k, q_block)]
    argument = "config" if role == "forward" else "bwd_config"
    for name, tile, block in pairs:
        if block % tile:
            raise ValueError(
                f"{argument}: the {role} FlexConfig's {name}={tile} must divide the block "
                f"mask's blocks {block_size} (the kernels walk each listed block a tile at a "
                f"time), got {argument}={config!r}"
            )


# The tiles, warps and stages the autotuner times (``ejk tune``), where they divide the blocks
# and their pipelined tiles fit shared memory.
_SPACE_TILES = (16, 32, 64, 128)
_SPACE_WARPS = (4, 8)
_SPACE_STAGES = (1, 2, 3)


def _space(heuristic: FlexConfig, sides: tuple[int, int], head_dim: int,
           itemsize: int) -> list[FlexConfig]:  # fmt: skip
    """The heuristic's config first, then every `_SPACE_TILES` pair whose tiles divide
    ``sides`` (the blocks they walk) and whose streamed tiles, ``num_stages`` deep and
    ``head_dim`` wide for both operands (k and v; q and dO in the dk/dv kernel), fit
    `SHARED_MEMORY_LIMIT` (an estimate that keeps the candidates that can build; one that
    does not is skipped by the autotuner)."""
    width = 2 * head_block(head_dim) * itemsize
    out = [heuristic]
    grid = itertools.product(_SPACE_TILES, _SPACE_TILES, _SPACE_WARPS, _SPACE_STAGES)
    for block_q, block_k, warps, stages in grid:
        if (
            sides[0] % block_q
            or sides[1] % block_k
            or stages * block_k * width > SHARED_MEMORY_LIMIT
        ):
            continue
        cfg = FlexConfig(block_q=block_q, block_k=block_k, num_warps=warps, num_stages=stages)
        if cfg != heuristic:
            out.append(cfg)
    return out


def fwd_search_space(block_size: tuple[int, int], head_dim: int, itemsize: int = 2) -> list[FlexConfig]:  # fmt: skip
    """The forward's candidates: `fwd_heuristic`, then tiles dividing the blocks (`_space`)."""
    return _space(fwd_heuristic(block_size, head_dim, itemsize), block_size, head_dim, itemsize)


def bwd_search_space(block_size: tuple[int, int], head_dim: int, itemsize: int = 2) -> list[FlexConfig]:  # fmt: skip
    """The backward's candidates: `bwd_heuristic`, then tiles dividing both block sides (the
    dq and dk/dv kernels swap them; `_space`)."""
    side = min(block_size)
    return _space(bwd_heuristic(block_size, head_dim, itemsize), (side, side), head_dim, itemsize)
