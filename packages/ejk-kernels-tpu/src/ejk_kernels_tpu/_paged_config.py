"""Performance knobs of the ragged paged attention kernel: config, VMEM estimate, heuristic,
search space.

`RaggedPagedConfig` holds block sizes only; what a call computes (scale, window, soft cap,
sinks) is an argument, so a config changes nothing but the float summation order.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax.numpy as jnp
import msgspec
import numpy as np

from ._config import VMEM_BUDGET

__all__ = [
    "PagedShape",
    "RaggedPagedConfig",
    "effective_block_q",
    "fits_paged_vmem",
    "paged_shape",
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


class PagedShape(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes of a paged attention call that its config depends on.

    Attributes:
        batch: B, sequences (rows of the page table).
        q_rows: T, or total_q in the ragged form.
        ragged: whether the call is in the ragged form (``cu_q_lens``).
        heads, kv_heads, head_dim: N, K, H.
        page_size: tokens per page; pages_per_seq: columns of the page table.
        itemsize: bytes per element of q.
        fp8_pages: the pages are ``float8_e4m3fn`` (their copies are budgeted at q's
            itemsize, which pads to as many bytes; per-token scales add their own slots).
    """

    batch: int
    q_rows: int
    ragged: bool
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    itemsize: int
    fp8_pages: bool = False

    @property
    def rows(self) -> int:
        """Query rows of the whole call (``B * T``, or total_q)."""
        return self.q_rows if self.ragged else self.batch * self.q_rows

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // max(self.kv_heads, 1)


def paged_shape(q: Any, k_pages: Any, page_table: Any, *, ragged: bool) -> PagedShape:
    """The `PagedShape` of a call from its arrays (or their abstract shapes): q ``[B, T, N, H]``
    (``[total_q, N, H]`` when ``ragged``), k_pages ``[P, page_size, K, H]``, page_table
    ``[B, pages_per_seq]``."""
    _, page_size, kv_heads, head_dim = k_pages.shape
    return PagedShape(
        batch=int(page_table.shape[0]),
        q_rows=int(q.shape[0] if ragged else q.shape[1]),
        ragged=ragged,
        heads=int(q.shape[-2]),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        page_size=int(page_size),
        pages_per_seq=int(page_table.shape[1]),
        itemsize=int(np.dtype(q.dtype).itemsize),
        fp8_pages=np.dtype(k_pages.dtype) == np.dtype(jnp.float8_e4m3fn),
    )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def paged_vmem_bytes(config: RaggedPagedConfig, shape: PagedShape) -> int:
    """A generous estimate of the kernel's VMEM use for ``config`` on a call of ``shape``.

    Double-buffered query and output blocks (every head), two slots of k and v pages
    (kv heads padded to the sublane tile), with fp8 pages two slots of their f32 scales
    (kv heads padded to the lanes), the f32 accumulators, and the f32 score temporaries of
    one kv head.
    """
    bq = effective_block_q(config.block_q, shape.itemsize)
    lanes = _round_up(shape.head_dim, 128)
    sublane = 8 * max(1, 4 // shape.itemsize)
    q_block = shape.heads * bq * lanes * shape.itemsize
    keys = config.pages_per_block * shape.page_size
    kv_slots = 2 * 2 * keys * _round_up(shape.kv_heads, sublane) * lanes * shape.itemsize
    if shape.fp8_pages:
        pages = config.pages_per_block * _round_up(shape.page_size, 8)
        kv_slots += 2 * 2 * pages * _round_up(shape.kv_heads, 128) * 4
    rows = shape.heads * bq
    scratch = rows * lanes * 4 + 2 * rows * 128 * 4  # acc, and m, l padded to 128 lanes
    temps = 3 * shape.group * bq * _round_up(keys, 128) * 4 + 2 * keys * lanes * 4
    return 2 * 2 * q_block + kv_slots + scratch + temps


def fits_paged_vmem(config: RaggedPagedConfig, shape: PagedShape) -> bool:
    """Whether ``config`` fits the VMEM budget on a call of ``shape`` (`paged_vmem_bytes`)."""
    return paged_vmem_bytes(config, shape) <= VMEM_BUDGET


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def ragged_paged_heuristic(shape: PagedShape) -> RaggedPagedConfig:
    """A config that fits VMEM, chosen without timing (no TPU timing has been possible).

    Query block: the tokens per sequence (T, or the mean ``total_q / B`` in the ragged form,
    where the longest sequence is unknown when tracing) rounded up to a power of two, so a
    decode batch packs several sequences in one block and a prefill chunk fills it; at most
    `_MAX_ROWS` rows of a kv group. Pages per block: about `_TARGET_KEYS` keys, at most the
    table's width. Until the estimate fits the budget: fewer pages down to `_MIN_KEYS` keys,
    then smaller query blocks, then fewer pages.
    """
    tokens = -(-shape.q_rows // max(shape.batch, 1)) if shape.ragged else shape.q_rows
    most = max(8, _MAX_ROWS // max(shape.group, 1))
    block_q = min(128, max(8, _pow2_at_least(tokens)), 1 << (most.bit_length() - 1))
    pages = max(1, min(shape.pages_per_seq, _TARGET_KEYS // max(shape.page_size, 1)))
    config = RaggedPagedConfig(block_q=block_q, pages_per_block=1 << (pages.bit_length() - 1))
    while not fits_paged_vmem(config, shape):
        pages = config.pages_per_block
        if pages > 1 and pages * shape.page_size > _MIN_KEYS:
            config = msgspec.structs.replace(config, pages_per_block=pages // 2)
        elif config.block_q > 8:
            config = msgspec.structs.replace(config, block_q=config.block_q // 2)
        elif pages > 1:
            config = msgspec.structs.replace(config, pages_per_block=pages // 2)
        else:
            break  # the smallest config: the kernel is tried anyway
    return config


def ragged_paged_search_space(shape: PagedShape) -> list[RaggedPagedConfig]:
    """Configs worth timing: query blocks up to the call's (padded) rows, pages per block
    up to the table's width, pruned by `fits_paged_vmem`."""
    q_cap = max(8, _pow2_at_least(shape.rows))
    page_cap = max(1, _pow2_at_least(shape.pages_per_seq))
    space = []
    for block_q, pages in itertools.product(_BLOCK_Q, _PAGES_PER_BLOCK):
        if block_q > q_cap or pages > page_cap:
            continue
        config = RaggedPagedConfig(block_q=block_q, pages_per_block=pages)
        if fits_paged_vmem(config, shape):
            space.append(config)
    return space
