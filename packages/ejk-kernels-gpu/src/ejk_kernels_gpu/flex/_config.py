"""`FlexConfig`: the launch options of the flex kernels, and their heuristic.

The tiles are the `BlockMask`'s blocks (the tables name blocks of that size), so a config
holds only warps and pipelining stages.
"""

from __future__ import annotations

import msgspec

__all__ = ["FlexConfig", "flex_heuristic"]


class FlexConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Launch options of the flex kernels (forward, dq and dk/dv alike).

    Attributes:
        num_warps: warps per program, a power of two in ``[1, 16]``.
        num_stages: software-pipelining depth of the block loops, ``>= 1``.
    """

    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        w = self.num_warps
        if isinstance(w, bool) or not isinstance(w, int) or w < 1 or w > 16 or w & (w - 1):
            raise ValueError(f"FlexConfig: num_warps must be a power of two in [1, 16], got {w!r}")
        s = self.num_stages
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"FlexConfig: num_stages must be an int >= 1, got {s!r}")


def flex_heuristic(block_size: tuple[int, int], head_dim: int) -> FlexConfig:
    """Four warps for tiles up to 64 x 64 elements (or head_dim <= 64), eight above."""
    small = block_size[0] * block_size[1] <= 64 * 64 or head_dim <= 64
    return FlexConfig(num_warps=4 if small else 8, num_stages=2)
