"""A CPU install without Triton: it comes only with the cuda extra, and nothing a CPU user
runs by default needs it (issue 63, item 2)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from packaging.requirements import Requirement

from ejk_attention import flash_attention, paged_attention, reference_attention

GPU_ONLY = ("triton", "jax-triton")


@pytest.mark.parametrize("dist", ["ejk-kernels-gpu", "ejk-attention"])
def test_triton_comes_only_with_the_cuda_extra(dist):
    for text in importlib.metadata.requires(dist) or []:
        req = Requirement(text)
        if req.name in GPU_ONLY:
            assert req.marker is not None and req.marker.evaluate({"extra": "cuda"}), text
            assert not req.marker.evaluate({"extra": ""}), f"{dist} requires {text} by default"


@pytest.fixture
def no_triton(monkeypatch):
    """This process as a CPU install without Triton sees it."""
    from ejk_attention import _backend

    real = _backend.installed
    monkeypatch.setattr(_backend, "installed", lambda name: name != "triton" and real(name))


@pytest.mark.usefixtures("no_triton")
def test_without_triton_the_triton_backend_says_what_to_install():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(3))
    with pytest.raises(NotImplementedError, match=r"Triton is not installed.*cuda extra"):
        flash_attention(q, k, v, implementation="triton")
    out = flash_attention(q, k, v, implementation=("triton", "xla"))  # falls through
    np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=2e-5, atol=2e-5)
    pages = jnp.zeros((4, 4, 2, 16), jnp.float32)
    table, lens = jnp.zeros((1, 2), jnp.int32), jnp.array([3], jnp.int32)
    with pytest.raises(NotImplementedError, match=r"Triton is not installed.*cuda extra"):
        paged_attention(q[:, :1], pages, pages, table, lens, implementation="triton")


@pytest.mark.usefixtures("no_triton")
def test_ejk_info_without_triton_names_the_extra(capsys, monkeypatch):
    from ejk_attention.cli import main

    monkeypatch.setenv("COLUMNS", "300")
    assert main(["info"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ triton ")]
    # The packages table's row (its version), then the backends table's.
    assert len(rows) == 2 and "Triton not installed: the cuda extra" in rows[1], rows


def test_the_readme_commands_run_on_cpu_without_triton(tmp_path):
    """`ejk bench` (its defaults) and `ejk info` in a process where `import triton` fails."""
    script = (
        "import sys; sys.modules['triton'] = None; sys.modules['jax_triton'] = None\n"
        "from ejk_attention.cli import main\n"
        f"code = main(['bench', '--shape', '1,32,48,4,2,16,causal', '--iters', '1', "
        f"'--warmup', '0', '--quiet', '--out', {str(tmp_path)!r}])\n"
        "assert code == 0, code\n"
        "assert main(['info']) == 0\n"
        "assert 'triton' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "bench.json").exists()
