"""Faults of the config cache and of the CLI's files: a call never fails because of what the
cache holds; ``ejk cache`` and ``ejk bench --out`` give a reason and a non-zero exit, never a
traceback, a false success or a renamed user file."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention
from ejk_attention._backends import BACKENDS, TritonBackend
from ejk_attention._tuned import BackendChoice, backend_key, open_cache
from ejk_attention.cli import main
from ejk_config import device_fingerprint
from ejk_executor import CacheWarning
from ejk_kernels_gpu import FlashConfig
from ejk_sequtils import validate_attention

_DEEP = b"[" * 1000 + b"]" * 1000


def test_cache_commands_survive_a_deeply_nested_file(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "configs-v1.json").write_bytes(b'{"format": 1, "entries": {}, "x": %s}' % _DEEP)
    with pytest.warns(CacheWarning, match="is damaged"):
        assert main(["cache", "--cache-dir", str(cache_dir), "clear"]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0


def _qkv(t):
    """q, k, v of a shape no other test uses (the executor's memory cache is per process)."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t + 8, 2, 16)), jnp.float32)
    return q, k, k


def _forward_key(q, k, v):
    return BACKENDS["triton"].invocations(validate_attention(q, k, v))["forward"].call_key


@pytest.mark.parametrize(("block_q", "t"), [(2**20, 20), (2**40, 21), (2**64, 22)])
def test_a_crafted_kernel_config_on_disk_gives_the_heuristic(block_q, t):
    q, k, v = _qkv(t)
    key = _forward_key(q, k, v)
    open_cache().put(key, FlashConfig(block_q=block_q))
    with pytest.warns(
        CacheWarning,
        match=r"not in its search space for this call \(ejk_kernels_gpu\.flash_attention_fwd\); choosing",
    ):
        out = flash_attention(q, k, v, implementation="triton")
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=2e-5)
    assert key not in open_cache().keys()


def test_a_cached_kernel_config_that_fails_at_launch_is_dropped(monkeypatch):
    q, k, v = _qkv(29)
    request = validate_attention(q, k, v)
    fragile = BACKENDS["triton"].config_space(request)[-1]
    assert fragile != BACKENDS["triton"].heuristic_config(request)
    key = _forward_key(q, k, v)
    open_cache().put(key, fragile)
    run = TritonBackend.run

    def run_or_fail(self, request, config, bwd_config):
        if config == fragile:
            raise RuntimeError("out of resources: shared memory")
        return run(self, request, config, bwd_config)

    monkeypatch.setattr(TritonBackend, "run", run_or_fail)
    with pytest.warns(CacheWarning, match="failed at launch.*out of resources"):
        out = flash_attention(q, k, v, implementation="triton")
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=2e-5)
    assert key not in open_cache().keys()


def test_a_stored_backend_choice_that_fails_gives_the_platforms_order(monkeypatch):
    q, k, v = _qkv(31)
    key = backend_key(validate_attention(q, k, v), device_fingerprint())
    open_cache().put(key, BackendChoice("triton", 1.0))

    def fail(self, request, config, bwd_config):
        raise RuntimeError("triton crashed")

    monkeypatch.setattr(TritonBackend, "run", fail)
    with pytest.warns(CacheWarning, match="dropping the backend choice.*triton crashed"):
        out = flash_attention(q, k, v)
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=0)
    assert key not in open_cache().keys()
