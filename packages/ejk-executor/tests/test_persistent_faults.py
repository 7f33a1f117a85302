"""The persistent cache under hostile conditions: no fault fails a call or loses a confirmed write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ejk_executor import CacheWarning, ConfigSelectorChain, Executor, PersistentCache

_DEEP = b"[" * 1000 + b"]" * 1000


def _ab():
    return jnp.ones((8, 4)), jnp.ones((4, 3))


def test_deeply_nested_file_gives_a_warning_and_the_heuristic(tmp_path, mat_kernel, kernels):
    path = tmp_path / "c.json"
    path.write_bytes(b'{"format": 1, "entries": {"k": {"type": "x", "cfg": %s}}}' % _DEEP)
    persistent = PersistentCache(path, types=(kernels["MatCfg"],))
    ex = Executor(ConfigSelectorChain(persistent=persistent))
    a, b = _ab()
    with pytest.warns(CacheWarning, match="is damaged"):
        out = jax.jit(lambda a, b: ex(mat_kernel, a, b))(a, b)
    assert out.shape == (8, 3)
    assert ex.choose(mat_kernel, a, b).source == "memory"  # the heuristic's, kept in memory


def test_any_failure_of_the_persistent_cache_becomes_a_warning(tmp_path, mat_kernel, monkeypatch):
    persistent = PersistentCache(tmp_path)

    def broken(key, default=None):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(persistent, "get", broken)
    ex = Executor(ConfigSelectorChain(persistent=persistent))
    a, b = _ab()
    with pytest.warns(CacheWarning, match="disk on fire"):
        assert ex.choose(mat_kernel, a, b).source == "heuristic"
