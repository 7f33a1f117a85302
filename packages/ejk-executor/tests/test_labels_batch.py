"""HLO labels round trip, vmap/pmap with one selection, sharding in keys, memory stats."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_executor import (
    Executor,
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    get_memory_usage,
    label,
    labels_to_configs,
    pmap_with_config,
    sharding_fingerprint,
    vmap_with_config,
)


def test_labels_round_trip_from_lowered_text(mat_kernel, kernels):
    MatCfg = kernels["MatCfg"]
    ex = Executor()
    a, b = jnp.ones((8, 4)), jnp.ones((4, 3))

    @jax.jit
    def f(a, b):
        x = ex(mat_kernel, a, b, cfg=MatCfg(32))
        with label("post processing"):
            y = jnp.tanh(ex(mat_kernel, a * 2, b, cfg=MatCfg(64, extra=1)))
        return x + y

    lowered = f.lower(a, b)
    labels = find_labels_in_lowered(lowered)
    configs = labels_to_configs(labels)
    assert {c for c in configs.values() if c is not None} == {MatCfg(32), MatCfg(64, 1)}
    assert configs["ejk.post_processing"] is None  # a plain label names no config
    # the labels also survive compilation (op_name metadata of the optimised HLO)
    compiled_configs = labels_to_configs(find_labels_in_lowered(lowered.compile()))
    assert MatCfg(32) in compiled_configs.values()
    # and an executor call that picks its config labels it too
    heuristic = jax.jit(lambda a, b: ex(mat_kernel, a, b)).lower(a, b)
    assert list(labels_to_configs(find_labels_in_lowered(heuristic)).values()) == [MatCfg(16)]


def test_extract_labels_from_text():
    text = 'op_name="jit(f)/ejk.attn.0123456789abcdef/dot" x ejk.attn.0123456789abcdef y ejk.mask'
    assert extract_labels_from_hlo_text(text) == ["ejk.attn.0123456789abcdef", "ejk.mask"]
    assert extract_labels_from_hlo_text("notejk.x") == []
    with pytest.raises(TypeError, match="text must be a str"):
        extract_labels_from_hlo_text(b"ejk.x")
    with pytest.raises(ValueError, match="label name must be a non-empty str"):
        label("")


def test_vmap_with_config_selects_once_for_the_batch(mat_kernel, kernels):
    a = jnp.arange(5 * 80 * 16, dtype=jnp.float32).reshape(5, 80, 16) / 1000
    b = jnp.ones((16, 8))
    ex = Executor()
    out = vmap_with_config(mat_kernel, in_axes=(0, None), executor=ex)(a, b, scale=0.5)
    np.testing.assert_allclose(out, jnp.einsum("bnk,km->bnm", a, b) * 0.5, rtol=1e-5)
    assert mat_kernel.heuristic_calls == 1
    # the choice was made for one example's shape (80 rows: block 64), not the batch's
    assert ex.choose(mat_kernel, a[0], b, scale=0.5) == (kernels["MatCfg"](64), "memory")
    forced = vmap_with_config(mat_kernel, in_axes=(0, None))(a, b, cfg=kernels["MatCfg"](8))
    np.testing.assert_allclose(forced, jnp.einsum("bnk,km->bnm", a, b), rtol=1e-5)
    with pytest.raises(ValueError, match="in_axes has 3 entries for 2 arguments"):
        vmap_with_config(mat_kernel, in_axes=(0, None, 0))(a, b)


def test_pmap_with_config_on_one_device(mat_kernel, kernels):
    a = jnp.ones((1, 80, 16))
    b = jnp.ones((1, 16, 8))
    ex = Executor()
    out = pmap_with_config(mat_kernel, axis_name="d", executor=ex)(a, b)
    np.testing.assert_allclose(out, jnp.full((1, 80, 8), 16.0))
    assert ex.choose(mat_kernel, a[0], b[0]) == (kernels["MatCfg"](64), "memory")


_MULTI = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ejk_executor import (Executor, Kernel, default_key_builder_with_sharding,
                              pmap_with_config, sharding_fingerprint)

    class K(Kernel):
        name = "k"
        def run(self, x, *, cfg):
            return x * 2
        def heuristic_cfg(self, inv):
            return inv.args[0].shape[0]

    assert jax.device_count() == 8
    k = K()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    x = jnp.ones((8, 4))
    placed = {spec: jax.device_put(x, NamedSharding(mesh, spec))
              for spec in (P("x"), P("y"), P(None, "y"), P())}
    fps = {spec: sharding_fingerprint(v) for spec, v in placed.items()}
    assert len(set(fps.values())) == 4, fps
    assert fps[P()].startswith("replicated"), fps
    assert sharding_fingerprint(x) == "none"
    keys = {default_key_builder_with_sharding(k, (v,), {}) for v in placed.values()}
    keys.add(default_key_builder_with_sharding(k, (x,), {}))
    assert len(keys) == 5
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("x")))
    assert default_key_builder_with_sharding(k, (sds,), {}) == \\
        default_key_builder_with_sharding(k, (placed[P("x")],), {})
    ex = Executor()
    for v in placed.values():
        np.testing.assert_allclose(ex(k, v), 2 * x)
    # autotuning a sharded call times candidates on stand-ins placed the same way
    from ejk_executor import autotune
    class T(K):
        name = "t"
        def config_space(self, inv):
            return [1, 2]
    sds_y = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("y")))
    assert autotune(T(), sds_y, num_iters=1) in (1, 2)
    assert autotune(T(), placed[P("x")], num_iters=1) in (1, 2)
    # pmap: the config is chosen for the per-device shape
    out = pmap_with_config(k, executor=ex)(jnp.ones((8, 3, 5)))
    assert out.shape == (8, 3, 5)
    assert ex.choose(k, jnp.ones((3, 5))).cfg == 3
    print("ok")
    """
)


def test_sharding_and_pmap_on_eight_host_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-c", _MULTI], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_sharding_fingerprint_and_memory_usage():
    assert sharding_fingerprint(jnp.ones(3)) == "none"
    assert sharding_fingerprint(jax.ShapeDtypeStruct((3,), jnp.float32)) == "none"
    with pytest.raises(TypeError, match="expects an array"):
        sharding_fingerprint(3.0)
    usage = get_memory_usage()
    assert isinstance(usage, dict) and all(isinstance(v, int) for v in usage.values())
    with pytest.raises(TypeError, match=r"device must be a jax\.Device"):
        get_memory_usage("cpu")
