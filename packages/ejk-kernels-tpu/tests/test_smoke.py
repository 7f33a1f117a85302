"""Import-level checks: the public names resolve and importing has no side effects."""

import importlib


def test_all_names_resolve():
    module = importlib.import_module("ejk_kernels_tpu")
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_readme_examples_run():
    """The README's Python examples run as written (interpret mode on CPU)."""
    import pathlib
    import re

    readme = pathlib.Path(__file__).parents[1] / "README.md"
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", readme.read_text(), re.S):
        exec(block, namespace)
