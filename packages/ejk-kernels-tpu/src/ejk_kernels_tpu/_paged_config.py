"""Performance knobs of the ragged paged attention kernel: config, VMEM estimate, heuristic,
search space.

`RaggedPagedConfig` holds block sizes only; what a call computes (scale, window, soft cap,
sinks) is an argument, so a config changes nothing but the float summation order.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np

from ._config import VMEM_BUDGET

__all__ = [
    "RaggedPagedConfig",
    "effective_block_q",
    "fits_paged_vmem",
    "paged_vmem_bytes",
    "ragged_paged_heuristic",
    "ragged_paged_search_space",
]

_BLOCK_Q = (8, 16, 32, 64, 128)
_PAGES_PER_BLOCK = (1, 2, 4, 8, 16, 32, 64)
_TARGET_KEYS = 512  # keys per kv block the heuristic aims for (one DMA wave of pages)
_MIN_KEYS = 256  # the heuristic shrinks the query block before going below this many keys
_MAX_ROWS = 512  # query rows (tokens x heads of a kv group) the heuristic holds per block


class RaggedPagedConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Block sizes of the ragged paged attention kernel (performance knobs only).

    Attributes:
        block_q: query tokens per grid step (a power of two >= 8). A step holds the
            ``block_q`` consecutive query rows of the flattened batch (rows of several
            sequences when they are short: decode steps) for every head; bf16 and f16
            blocks hold at least 16 rows (their sublane packing), see `effective_block_q`.
        pages_per_block: pages copied and computed on together (one kv block of
            ``pages_per_block * page_size`` keys); the next block's pages are copied
            while the current one is computed.
    """

    block_q: int = 16
    pages_per_block: int = 4

    def __post_init__(self) -> None:
        for name in ("block_q", "pages_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"RaggedPagedConfig.{name} must be an int, got {name}={value!r}")
            if value <= 0:
                raise ValueError(f"RaggedPagedConfig.{name} must be positive, got {name}={value}")
        if self.block_q < 8 or self.block_q & (self.block_q - 1):
            raise ValueError(
                f"RaggedPagedConfig.block_q must be a power of two >= 8 (the sublane tile), "
                f"got block_q={self.block_q}"
            )


def effective_block_q(block_q: int, itemsize: int) -> int:
    """The query block the kernel uses: ``block_q``, at least one packed sublane tile
    (8 rows of 32-bit, 16 of 16-bit elements)."""
    return max(block_q, 8 * max(1, 4 // itemsize))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def paged_vmem_bytes(
    config: RaggedPagedConfig,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    itemsize: int,
) -> int:
    """A generous estimate of the kernel's VMEM use for ``config``.

    Double-buffered query and output blocks (every head), two slots of k and v pages
    (kv heads padded to the sublane tile), the f32 accumulators, and the f32 score
    temporaries of one kv head.
    """
    bq = effective_block_q(config.block_q, itemsize)
    lanes = _round_up(head_dim, 128)
    sublane = 8 * max(1, 4 // itemsize)
    q_block = heads * bq * lanes * itemsize
    keys = config.pages_per_block * page_size
    kv_slots = 2 * 2 * keys * _round_up(kv_heads, sublane) * lanes * itemsize
    rows = heads * bq
    scratch = rows * lanes * 4 + 2 * rows * 128 * 4  # acc, and m, l padded to 128 lanes
    group_rows = (heads // max(kv_heads, 1)) * bq
    temps = 3 * group_rows * _round_up(keys, 128) * 4 + 2 * keys * lanes * 4
    return 2 * 2 * q_block + kv_slots + scratch + temps


def fits_paged_vmem(config: RaggedPagedConfig, **sizes: int) -> bool:
    """Whether ``config`` fits the VMEM budget (`paged_vmem_bytes`, same keyword arguments)."""
    return paged_vmem_bytes(config, **sizes) <= VMEM_BUDGET


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def ragged_paged_heuristic(
    *,
    batch: int,
    q_rows: int,
    ragged: bool,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    itemsize: int,
) -> RaggedPagedConfig:
    """A config that fits VMEM, chosen without timing (no TPU timing has been possible).

    Query block: the tokens per sequence (T, or the mean ``total_q / B`` in the ragged form,
    where the longest sequence is unknown when tracing) rounded up to a power of two, so a
    decode batch packs several sequences in one block and a prefill chunk fills it; at most
    `_MAX_ROWS` rows of a kv group. Pages per block: about `_TARGET_KEYS` keys, at most the
    table's width. Until the estimate fits the budget: fewer pages down to `_MIN_KEYS` keys,
    then smaller query blocks, then fewer pages.

    Args:
        batch: B, sequences.
        q_rows: T, or total_q in the ragged form.
        ragged: whether the call is in the ragged form.
        heads, kv_heads, head_dim: N, K, H.
        page_size: tokens per page; pages_per_seq: columns of the page table.
        itemsize: bytes per element of q.
    """
    tokens = -(-q_rows // max(batch, 1)) if ragged else q_rows
    group = heads // max(kv_heads, 1)
    most = max(8, _MAX_ROWS // max(group, 1))
    block_q = min(128, max(8, _pow2_at_least(tokens)), 1 << (most.bit_length() - 1))
    pages = max(1, min(pages_per_seq, _TARGET_KEYS // max(page_size, 1)))
    pages = 1 << (pages.bit_length() - 1)
    sizes = dict(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, itemsize=itemsize
    )
    config = RaggedPagedConfig(block_q=block_q, pages_per_block=pages)
    while not fits_paged_vmem(config, **sizes):
        if config.pages_per_block > 1 and config.pages_per_block * page_size > _MIN_KEYS:
            config = msgspec.structs.replace(config, pages_per_block=config.pages_per_block // 2)
        elif config.block_q > 8:
            config = msgspec.structs.replace(config, block_q=config.block_q // 2)
        elif config.pages_per_block > 1:
            config = msgspec.structs.replace(config, pages_per_block=config.pages_per_block // 2)
        else:
            break  # the smallest config: the kernel is tried anyway
    return config


def ragged_paged_search_space(
    *,
    q_rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    itemsize: int,
) -> list[RaggedPagedConfig]:
    """Configs worth timing: query blocks up to the (padded) rows, pages per block up to the
    table's width, pruned by `fits_paged_vmem`."""
    q_cap = max(8, _pow2_at_least(q_rows))
    page_cap = max(1, _pow2_at_least(pages_per_seq))
    sizes = dict(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, itemsize=itemsize
    )
    space = []
    for block_q, pages in itertools.product(_BLOCK_Q, _PAGES_PER_BLOCK):
        if block_q > q_cap or pages > page_cap:
            continue
        config = RaggedPagedConfig(block_q=block_q, pages_per_block=pages)
        if fits_paged_vmem(config, **sizes):
            space.append(config)
    return space
