"""A pytest plugin that keeps the first collected case of each test function.

The ``compat`` nox sessions load it (``-p first_case``): at each end of jax's supported
range they run every test function once, its first parametrized case, so every code path
the suite reaches meets that jax, while the full grids run once, in the default sessions
on the lock's jax. Test classes count apart: ``TestXla::test_case`` and
``TestTriton::test_case`` each keep their first case.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[str] = set()
    kept, dropped = [], []
    for item in items:
        key = item.nodeid.split("[", 1)[0]  # file::[class::]function, without the case id
        if key in seen:
            dropped.append(item)
        else:
            seen.add(key)
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
