"""The paged kernel's heuristic builds compile ahead of time for Hopper (sm_90) on this CPU
machine, fit shared memory and spill no registers (ptxas).

The compile runs in a subprocess: this test process has Triton's interpreter on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ejk_kernels_gpu.aot.paged import BUILDS

pytestmark = pytest.mark.triton_build  # built by Triton in a subprocess: the same on every jax


def _compile(*args: str) -> list[dict]:
    """The JSON rows of ``python -m ejk_kernels_gpu.aot.paged *args`` (interpreter off);
    every build compiled, within shared memory and without spills."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "ejk_kernels_gpu.aot.paged", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    bad = [r for r in rows if "error" in r or not r["fits"] or r["spill_stores"] != 0]
    assert rows and not bad and proc.returncode == 0, (bad, proc.stderr[-3000:])
    return rows


def test_paged_builds_compile_for_hopper_without_spills():
    """Decode and prefill tiles, with and without window / soft cap / sinks, head_dim 128."""
    rows = _compile("--head-dims", "128")
    assert {r["build"] for r in rows} == {b[0] for b in BUILDS}
    assert {r["config"]["num_splits"] > 1 for r in rows} == {False, True}


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", ["64", "96", "256"])
def test_paged_builds_compile_for_other_head_dims(head_dim):
    _compile("--head-dims", head_dim)
    _compile("--head-dims", head_dim, "--dtype", "float16")
