"""What Hopper and Triton impose on every kernel of the package: shared memory per block, the
head_dim tile width, and log2(e) (the kernels take exponentials in base 2)."""

from __future__ import annotations

__all__ = ["LOG2E", "SHARED_MEMORY_LIMIT", "head_block"]

# Hopper (sm_90) allows 227 KiB of shared memory per block (opt-in).
SHARED_MEMORY_LIMIT = 227 * 1024

LOG2E = 1.4426950408889634


def head_block(head_dim: int) -> int:
    """The power-of-two tile width that holds ``head_dim`` (at least 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())
