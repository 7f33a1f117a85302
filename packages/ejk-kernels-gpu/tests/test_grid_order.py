"""The launch order of the kernels' programs (`kernels.triton._common.grid_order`), in Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest

from ejk_kernels_gpu.build import _triton as _triton

_triton.kernels()  # chooses Triton's backend (here the interpreter) before triton imports
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ejk_kernels_gpu.kernels.triton._common import GRID_GROUP, grid_order  # noqa: E402


@triton.jit
def _probe(out_ptr, HEAVY_LAST: tl.constexpr):
    block, row = grid_order(HEAVY_LAST)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + 2 * pid, block)
    tl.store(out_ptr + 2 * pid + 1, row)


def _orders(blocks: int, rows: int, heavy_last: bool) -> np.ndarray:
    """[launch index] -> (block, row) that grid_order gives each program."""
    out = np.full((blocks * rows, 2), -1, np.int32)
    _probe[(blocks, rows)](_triton._HostBuffer(out), HEAVY_LAST=heavy_last)
    return out


@pytest.mark.parametrize(("blocks", "rows"), [(5, 4), (3, 10), (1, 1), (4, 3)])
@pytest.mark.parametrize("heavy_last", [True, False])
def test_every_program_gets_its_own_block_heaviest_first_by_groups(blocks, rows, heavy_last):
    got = _orders(blocks, rows, heavy_last)
    assert sorted(map(tuple, got)) == [(b, r) for b in range(blocks) for r in range(rows)]
    heavy = blocks - 1 if heavy_last else 0
    step = -1 if heavy_last else 1
    group = int(GRID_GROUP)
    want = [
        (heavy + step * i, g + j)
        for g in range(0, rows, group)
        for i in range(blocks)
        for j in range(min(group, rows - g))
    ]
    assert list(map(tuple, got)) == want
