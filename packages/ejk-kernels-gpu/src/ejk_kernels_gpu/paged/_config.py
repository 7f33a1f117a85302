"""Performance knobs of the split-KV paged attention kernel: config, heuristic, search space.

`PagedConfig` holds block sizes, the split count, warps and stages only; what a call
computes (scale, window, soft cap, sinks, causal) is an argument, so tuning changes
nothing but float summation order.
"""

from __future__ import annotations

import itertools

import msgspec

from ..build._limits import SHARED_MEMORY_LIMIT, head_block

__all__ = [
    "SM_COUNT",
    "PagedConfig",
    "TileShape",
    "fits_paged_shared_memory",
    "paged_heuristic",
    "paged_search_space",
    "tile_shape",
]

# Streaming multiprocessors of an H100 SXM: the heuristic splits keys until the grid
# fills them a few times over.
SM_COUNT = 132
_WAVES = 4  # programs per SM the split heuristic aims for (small programs share an SM)
_MIN_SPLIT_KEYS = 512  # a split shorter than this costs more in its partial output than it saves


class PagedConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tile sizes and launch options of the split-KV paged attention kernel.

    Attributes:
        block_m: the most query rows one program holds (a power of two, >= 16). A row is
            one (token, query head) pair of a kv group, so a tile holds
            ``max(1, block_m // G)`` tokens of one sequence (G = query heads per kv head);
            a decode step needs only ``G`` rows and the kernel takes the smallest power of
            two >= 16 that holds them (`tile_shape`).
        block_kv: keys per loop step (a power of two, >= 16); with pages of at least
            ``block_kv`` tokens a block lies in one page, else each row finds its page.
        num_splits: programs each sequence's key range is split over (flash-decoding);
            1 writes the output directly, more add a float32 partial output per split and
            a combine.
        num_warps: warps per program (power of two).
        num_stages: software-pipelining depth of the key loop (>= 1).
    """

    block_m: int = 64
    block_kv: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_kv", "num_splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PagedConfig.{name} must be an int, got {name}={value!r}")
            if value <= 0:
                raise ValueError(f"PagedConfig.{name} must be positive, got {name}={value}")
        for name in ("block_m", "block_kv", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"PagedConfig.{name} must be a power of two, got {name}={value}")
            if name != "num_warps" and value < 16:
                raise ValueError(
                    f"PagedConfig.{name} must be >= 16 (tensor-core tile), got {name}={value}"
                )


class TileShape(msgspec.Struct, frozen=True):
    """How a call's query rows are tiled: ``tokens`` per tile, ``rows`` (BLOCK_M) per program."""

    tokens: int
    rows: int


def tile_shape(cfg: PagedConfig, group: int, max_q_len: int) -> TileShape:
    """The tile of a call with ``group`` query heads per kv head and at most ``max_q_len``
    new tokens per sequence: as many tokens as ``cfg.block_m`` rows hold (at least one),
    in the smallest power-of-two row count >= 16 that holds them."""
    tokens = max(1, min(max(max_q_len, 1), cfg.block_m // group))
    return TileShape(tokens=tokens, rows=max(16, 1 << (tokens * group - 1).bit_length()))


def _shared_bytes(
    cfg: PagedConfig, rows: int, head_dim: int, itemsize: int, kv_itemsize: int
) -> int:
    """Shared memory of one program: the pipelined k and v blocks (in the pages' dtype),
    the query tile once (in q's)."""
    d = head_block(head_dim)
    return rows * d * itemsize + max(cfg.num_stages, 1) * 2 * cfg.block_kv * d * kv_itemsize


def fits_paged_shared_memory(
    cfg: PagedConfig, rows: int, head_dim: int, itemsize: int, kv_itemsize: int | None = None
) -> bool:
    """The search-space predicate: whether ``cfg`` with ``rows`` query rows fits Hopper's
    shared memory (``kv_itemsize``: bytes per element of the pages, default q's)."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    return _shared_bytes(cfg, rows, head_dim, itemsize, kv_itemsize) <= SHARED_MEMORY_LIMIT


def _splits(programs: int, max_keys: int, block_kv: int) -> int:
    """The largest power of two of splits that gives at most about `_WAVES` programs per SM
    (at least one split), each with at least `_MIN_SPLIT_KEYS` keys (and one block).

    Near the best split count measured on each decode shape; fewer programs leave SMs idle
    (docs/performance.md#decoding; docs/performance-history.md#paged_configpy).
    """
    want = -(-(_WAVES * SM_COUNT) // max(programs, 1))
    most = max(1, max_keys // max(_MIN_SPLIT_KEYS, block_kv))
    return 1 << (max(1, min(want, most)).bit_length() - 1)


def paged_heuristic(
    *,
    batch: int,
    q_len: int,
    ragged: bool,
    heads: int,
    kv_heads: int,
    head_dim: int,
    capacity: int,
    itemsize: int = 2,
    kv_itemsize: int | None = None,
) -> PagedConfig:
    """A good config without timing.

    Rows per tile: all of a sequence's (token, head) rows of a kv group up to 64 (faster than
    128-row tiles on a ragged batch of prefill chunks and decode rows; see
    docs/performance-history.md#paged_configpy). In the ragged form the longest
    sequence is not known when tracing: a batch averaging under two tokens per sequence
    (decode) gets 16-row tiles. Splits: `_splits`.

    Args:
        batch: B, sequences.
        q_len: T, or total_q in the ragged form.
        ragged: whether the call is in the ragged form.
        heads, kv_heads, head_dim: N, K, H.
        capacity: the most keys a sequence can have (``pages_per_seq * page_size``).
        itemsize: bytes per element of q.
        kv_itemsize: bytes per element of the pages (1: an FP8 cache); default ``itemsize``.
    """
    group = heads // max(kv_heads, 1)
    if ragged:
        decode = q_len < 2 * max(batch, 1)
        block_m = 16 if decode else 64
        max_q_len = 1 if decode else q_len
    else:
        block_m = 64
        max_q_len = q_len
    cfg = PagedConfig(block_m=block_m, block_kv=64 if head_dim <= 128 else 32, num_stages=3)
    tile = tile_shape(cfg, group, max_q_len)
    if kv_itemsize == 1 and tile.rows <= 16 and head_block(head_dim) == 128:
        # Decoding from FP8 pages: twice the keys a step keep a 16-bit block's bytes in
        # flight (bandwidth-bound). Prefill tiles and head_dim 64 stay: 128 keys spill
        # there (`aot.paged`); head_dim 256 keeps its 32-key blocks (longer ones not built).
        cfg = msgspec.structs.replace(cfg, block_kv=2 * cfg.block_kv)
    tiles = -(-q_len // tile.tokens) + batch if ragged else batch * -(-q_len // tile.tokens)
    splits = _splits(tiles * kv_heads, capacity, cfg.block_kv)
    # The float32 accumulator [rows, head_dim] lives in registers: 8 warps from 128x128 on
    # (4 warps spill there, ptxas; `aot.paged`).
    warps = 8 if tile.rows * head_block(head_dim) >= 128 * 128 else 4
    return msgspec.structs.replace(cfg, num_splits=splits, num_warps=warps)


_AXES = dict(
    block_m=(16, 64, 128),
    block_kv=(32, 64, 128),
    num_warps=(4, 8),
    num_stages=(2, 3, 4),
)
_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def paged_search_space(
    *,
    group: int,
    max_q_len: int,
    max_keys: int,
    head_dim: int,
    itemsize: int = 2,
    kv_itemsize: int | None = None,
) -> tuple[PagedConfig, ...]:
    """Every config worth timing, pruned by `fits_paged_shared_memory` (``kv_itemsize``:
    the pages' bytes per element, default q's): the axes above, the split counts up to one
    split per `_MIN_SPLIT_KEYS` keys."""
    most = max(1, max_keys // _MIN_SPLIT_KEYS)
    splits = tuple(s for s in _SPLITS if s <= most)
    names = (*_AXES, "num_splits")
    cands = (
        PagedConfig(**dict(zip(names, values, strict=True)))
        for values in itertools.product(*_AXES.values(), splits)
    )
    return tuple(
        c
        for c in cands
        if fits_paged_shared_memory(
            c, tile_shape(c, group, max_q_len).rows, head_dim, itemsize, kv_itemsize
        )
    )
