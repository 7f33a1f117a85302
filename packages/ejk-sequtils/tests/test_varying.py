"""`varying_like`: results of custom calls typed as varying over their inputs' mesh axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_sequtils import varying_axes, varying_like


@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="jax.shard_map (jax >= 0.7)")
def test_a_callback_result_takes_its_inputs_axes():
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    seen = {}

    def local(x):
        y = jax.pure_callback(np.negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        seen["before"], seen["input"] = varying_axes(y), varying_axes(x)
        z = varying_like(y, x, None)
        seen["after"] = varying_axes(z)
        return z

    fn = jax.shard_map(local, mesh=mesh, in_specs=P("sp"), out_specs=P("sp"))
    out = jax.jit(fn)(jnp.arange(4.0))
    np.testing.assert_array_equal(out, -np.arange(4.0))
    assert seen["input"] == {"sp"} and seen["after"] == {"sp"}
    assert "sp" not in seen["before"]  # what the cast is for


def test_outside_shard_map_nothing_changes():
    x = jnp.ones(3)
    assert varying_axes(x) == set()
    assert varying_like({"a": x}, x)["a"] is x
