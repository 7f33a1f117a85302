"""Import-level checks: the public names resolve and importing has no side effects."""

import importlib


def test_all_names_resolve():
    """Every public name is a class or function of this package that the README's API section
    documents, and every name that section lists in backticks at a line's start is public."""
    import inspect
    import pathlib
    import re

    module = importlib.import_module("ejk_kernels_gpu")
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    api = readme[readme.index("## API") :]
    for name in module.__all__:
        obj = getattr(module, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("ejk_kernels_gpu."), (name, obj.__module__)
        assert f"`{name}" in api, f"{name} is not in the README's API section"
    listed = set(re.findall(r"^(?:- |\| )`([A-Za-z_]+)[`(]", api, flags=re.M))
    assert listed <= set(module.__all__), listed - set(module.__all__)


def test_import_has_no_side_effects_and_a_clear_error_without_interpreter():
    """Importing sets nothing; a call after triton was imported without the interpreter says why."""
    import os
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "import ejk_kernels_gpu\n"
        "assert 'TRITON_INTERPRET' not in os.environ and 'triton' not in sys.modules\n"
        "import triton, jax.numpy as jnp\n"
        "x = jnp.zeros((1, 4, 1, 16))\n"
        "try:\n"
        "    ejk_kernels_gpu.flash_attention(x, x, x)\n"
        "except RuntimeError as err:\n"
        "    assert 'TRITON_INTERPRET' in str(err), err\n"
        "    print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "OK", proc.stderr[-2000:]
