"""The flex kernels compile ahead of time for Hopper (sm_90) on this CPU machine with
translated mods as constexpr arguments, fit shared memory and spill no registers (ptxas),
at the heuristics' tiles over 128 x 128 blocks.

The compile runs in a subprocess: this test process has Triton's interpreter on.
"""

from __future__ import annotations

import pytest

from ejk_kernels_gpu.aot.flex import MODS

pytestmark = pytest.mark.triton_build  # built by Triton in a subprocess: the same on every jax


def test_flex_builds_compile_for_hopper_without_spills(aot_rows):
    """Masks over captured ids, a gathered float table, a tanh and integer arithmetic with
    literals as score_mods, head_dim 128."""
    rows = aot_rows("flex", "--head-dims", "128", "--mods", "documents,relative,softcap,mixed")
    assert len(rows) == 12
    # The table gather reads through flex_load, outside the software pipeline: no tile-sized
    # shared buffer of gathered values beside k and v (it added 32 KB to the forward).
    shared = {(r["mods"], r["kernel"]): r["shared"] for r in rows}
    for kernel in ("flex_fwd_kernel", "flex_dq_kernel", "flex_dkdv_kernel"):
        assert shared["relative", kernel] <= shared["softcap", kernel], kernel


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", ["64", "128", "256"])
def test_every_flex_build_compiles(aot_rows, head_dim, dtype):
    """Every representative mod, every kernel, at the heuristics' tiles for the dtype."""
    rows = aot_rows("flex", "--head-dims", head_dim, "--dtype", dtype)
    assert {r["mods"] for r in rows} == set(MODS)
