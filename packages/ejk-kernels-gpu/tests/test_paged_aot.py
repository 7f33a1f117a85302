"""The paged kernel's heuristic builds compile ahead of time for Hopper (sm_90) on this CPU
machine, fit shared memory and spill no registers (ptxas).

The compile runs in a subprocess: this test process has Triton's interpreter on.
"""

from __future__ import annotations

import pytest

from ejk_kernels_gpu.aot.paged import BUILDS

pytestmark = pytest.mark.triton_build  # built by Triton in a subprocess: the same on every jax


def test_paged_builds_compile_for_hopper_without_spills(aot_rows):
    """Decode and prefill tiles, with and without window / soft cap / sinks, head_dim 128."""
    rows = aot_rows("paged", "--head-dims", "128")
    assert {r["build"] for r in rows} == {b[0] for b in BUILDS}
    assert {r["config"]["num_splits"] > 1 for r in rows} == {False, True}


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", ["64", "96", "256"])
def test_paged_builds_compile_for_other_head_dims(aot_rows, head_dim):
    aot_rows("paged", "--head-dims", head_dim)
    aot_rows("paged", "--head-dims", head_dim, "--dtype", "float16")
