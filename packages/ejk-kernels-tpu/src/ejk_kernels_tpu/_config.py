"""The block-size config of the block-sparse kernels: struct, VMEM estimate, heuristic, search space.

TPU tiling: a block's last two dims must be multiples of (8, 128) or the whole array
dim. Query blocks are the lane dim of the dkv kernel's ``[1, block_q]`` lse rows and of
its transposed mask tiles, and kv blocks the lane dim of the forward's tiles, so every
block size is a power of two >= 128 (a shorter sequence uses one whole-length block).
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np

__all__ = [
    "BlockSparseConfig",
    "block_sparse_heuristic",
    "block_sparse_search_space",
    "fits_vmem",
    "vmem_bytes",
]

MIN_BLOCK = 128
# The default scoped-VMEM limit of v5e (16 MiB); v6e allows 32 MiB. Leave headroom.
VMEM_BUDGET = 12 * 1024 * 1024
_CANDIDATES = (128, 256, 512, 1024)


class BlockSparseConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Block sizes of the forward, dq and dkv kernels (performance knobs only).

    Attributes:
        block_q, block_kv: forward query / key rows per grid step.
        block_q_dq, block_kv_dq: the dq kernel's.
        block_q_dkv, block_kv_dkv: the dkv kernel's.

    Every field is a power of two >= 128.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 128
    block_q_dkv: int = 128
    block_kv_dkv: int = 128

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"BlockSparseConfig.{name} must be an int, got {value!r}")
            if value < MIN_BLOCK or value & (value - 1):
                raise ValueError(
                    f"BlockSparseConfig.{name} must be a power of two >= {MIN_BLOCK}, "
                    f"got {name}={value}"
                )


def _shared_backward(fwd_q: int, fwd_kv: int, bwd_q: int, bwd_kv: int) -> BlockSparseConfig:
    """A config whose dq and dkv kernels use the same blocks."""
    return BlockSparseConfig(
        block_q=fwd_q,
        block_kv=fwd_kv,
        block_q_dq=bwd_q,
        block_kv_dq=bwd_kv,
        block_q_dkv=bwd_q,
        block_kv_dkv=bwd_kv,
    )


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def effective_block(block: int, length: int) -> int:
    """The block used for a sequence of ``length``: ``block``, or one whole padded block."""
    return min(block, _pow2_at_least(max(length, 32)))


def vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int, kernel: str) -> int:
    """A generous estimate of one kernel's VMEM use (double-buffered blocks + scratch + temps).

    Args:
        block_q, block_kv: the kernel's block sizes.
        head_dim: H.
        itemsize: bytes per element of q/k/v.
        kernel: ``"fwd"``, ``"dq"`` or ``"dkv"``.
    """
    q_tile, kv_tile = block_q * head_dim * itemsize, block_kv * head_dim * itemsize
    scores = block_q * block_kv * 4
    lane_rows = 4 * block_q * 128  # [block_q, 1] f32 blocks are padded to 128 lanes
    mask_tile = block_q * block_kv
    if kernel == "fwd":
        buffers = q_tile + 2 * kv_tile + mask_tile + q_tile + lane_rows  # in + out blocks
        scratch = block_q * head_dim * 4 + 2 * lane_rows
        temps = 3 * scores
    elif kernel == "dq":
        buffers = 2 * q_tile + 2 * kv_tile + mask_tile + 2 * lane_rows + q_tile
        scratch = block_q * head_dim * 4
        temps = 4 * scores
    elif kernel == "dkv":
        buffers = 2 * q_tile + 2 * kv_tile + mask_tile + 2 * 4 * 8 * block_q + 2 * kv_tile
        scratch = 2 * block_kv * head_dim * 4
        temps = 4 * scores
    else:
        raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {kernel!r}")
    return 2 * buffers + scratch + temps


def fits_vmem(config: BlockSparseConfig, head_dim: int, itemsize: int) -> bool:
    """Whether all three kernels of ``config`` fit the VMEM budget."""
    return all(
        vmem_bytes(bq, bkv, head_dim, itemsize, kernel) <= VMEM_BUDGET
        for kernel, (bq, bkv) in (
            ("fwd", (config.block_q, config.block_kv)),
            ("dq", (config.block_q_dq, config.block_kv_dq)),
            ("dkv", (config.block_q_dkv, config.block_kv_dkv)),
        )
    )


def block_sparse_heuristic(
    q_len: int, kv_len: int, head_dim: int, itemsize: int
) -> BlockSparseConfig:
    """A config that fits VMEM: large forward blocks, smaller backward ones, none past the sequence.

    Args:
        q_len, kv_len: T and S.
        head_dim: H.
        itemsize: bytes per element of q/k/v (2 for bf16, 4 for f32).
    """
    q_cap = max(MIN_BLOCK, _pow2_at_least(q_len))
    kv_cap = max(MIN_BLOCK, _pow2_at_least(kv_len))
    fwd_q, fwd_kv = min(512, q_cap), min(512, kv_cap)
    bwd_q, bwd_kv = min(256, q_cap), min(256, kv_cap)
    while True:
        config = _shared_backward(fwd_q, fwd_kv, bwd_q, bwd_kv)
        if fits_vmem(config, head_dim, itemsize) or max(fwd_q, fwd_kv, bwd_q, bwd_kv) == MIN_BLOCK:
            return config
        # Shrink the largest block first.
        if fwd_kv >= fwd_q and fwd_kv > MIN_BLOCK:
            fwd_kv //= 2
        elif fwd_q > MIN_BLOCK:
            fwd_q //= 2
        if bwd_kv >= bwd_q and bwd_kv > MIN_BLOCK:
            bwd_kv //= 2
        elif bwd_q > MIN_BLOCK:
            bwd_q //= 2


def block_sparse_search_space(
    q_len: int, kv_len: int, head_dim: int, itemsize: int
) -> list[BlockSparseConfig]:
    """Configs worth timing: block sizes up to the (padded) sequence, pruned by `fits_vmem`.

    The backward kernels share one (block_q, block_kv) pair here, to keep the space small.
    """
    q_sizes = [b for b in _CANDIDATES if b <= max(MIN_BLOCK, _pow2_at_least(q_len))]
    kv_sizes = [b for b in _CANDIDATES if b <= max(MIN_BLOCK, _pow2_at_least(kv_len))]
    space = []
    for fq, fk, bq, bk in itertools.product(q_sizes, kv_sizes, q_sizes, kv_sizes):
        config = _shared_backward(fq, fk, bq, bk)
        if fits_vmem(config, head_dim, itemsize):
            space.append(config)
    return space
