"""Import-level checks: the public names resolve and importing has no side effects."""

import importlib
import os
import subprocess
import sys


def test_all_names_resolve():
    module = importlib.import_module("ejk_sequtils")
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert len(set(module.__all__)) == len(module.__all__)  # order: ruff RUF022 (lint)


def test_import_has_no_side_effects(tmp_path):
    """A fresh interpreter imports the package without touching jax config, env or files."""
    code = (
        "import os, jax; before = (dict(os.environ), jax.config.jax_enable_x64); "
        "import ejk_sequtils; "
        "assert (dict(os.environ), jax.config.jax_enable_x64) == before; "
        "import sys; assert 'msgspec' not in sys.modules and 'triton' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert list(tmp_path.iterdir()) == []
