"""Import-level checks: the public names resolve and importing has no side effects."""

import importlib


def test_all_names_resolve():
    module = importlib.import_module("ejk_kernels_tpu")
    for name in module.__all__:
        assert getattr(module, name) is not None, name
