import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_config import abstractify, device_fingerprint, device_kind, get_device_platform


def test_platform_names_on_this_machine():
    dev = jax.devices()[0]
    family = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}[dev.platform]
    assert device_kind() == family == device_kind(dev)
    assert get_device_platform() == {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}[family]


def test_fingerprint_has_kind_version_and_count():
    devices = jax.devices()
    fp = device_fingerprint()
    platform, kind, _version, count = fp.split("|")
    assert platform == devices[0].platform
    assert kind == devices[0].device_kind
    assert count == f"n={len(devices)}"
    assert device_fingerprint(devices[0]).endswith("n=1")
    with pytest.raises(TypeError, match="devices must be jax Devices"):
        device_fingerprint(["cpu"])  # type: ignore[list-item]


def test_no_subprocess_on_the_hot_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("subprocess started")

    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    device_fingerprint(jax.devices()[0])
    device_kind()
    get_device_platform()


def test_abstractify_arrays_tracers_and_other_leaves():
    tree = {"x": jnp.zeros((2, 3), jnp.bfloat16), "y": np.ones(4, np.int32), "s": 1.5, "n": None}
    out = abstractify(tree)
    assert out["x"] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    assert out["y"] == jax.ShapeDtypeStruct((4,), np.int32)
    assert out["s"] == 1.5 and out["n"] is None

    seen = []

    @jax.jit
    def f(a):
        seen.append(abstractify(a))
        return a

    f(jnp.ones((5,), jnp.float32))
    assert seen[0] == jax.ShapeDtypeStruct((5,), jnp.float32)


def test_import_has_no_side_effects(tmp_path):
    code = (
        "import os, jax; before = dict(jax.config.values); import ejk_config; "
        "assert dict(jax.config.values) == before; print(sorted(os.listdir('.')))"
    )
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
