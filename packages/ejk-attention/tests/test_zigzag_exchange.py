"""The zigzag layout reached inside a ``shard_map`` (`to_zigzag_local`) matches laying out
the global array (`ejk_sequtils.to_zigzag`), both ways, with gradients, for 1 to 8 shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_attention._shard_map import shard_map_compat
from ejk_attention._zigzag_exchange import from_zigzag_local, to_zigzag_local
from ejk_sequtils import from_zigzag, to_zigzag


def _mapped(fn, n, axis, ndim):
    if jax.device_count() < n:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    spec = P(*([None] * axis + ["sp"] + [None] * (ndim - axis - 1)))
    local = lambda x: fn(x, axis_name="sp", shards=n, axis=axis)
    return jax.jit(shard_map_compat(local, mesh=mesh, in_specs=(spec,), out_specs=spec))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape, axis", [((2, 48, 3), 1), ((2, 3, 48), 2), ((48,), 0)])
def test_local_exchange_is_the_global_layout(n, shape, axis):
    t = 2 * n * 3
    shape = tuple(t if i == axis else d for i, d in enumerate(shape))
    x = jnp.asarray(np.random.default_rng(n).standard_normal(shape), jnp.float32)
    there = _mapped(to_zigzag_local, n, axis, x.ndim)
    back = _mapped(from_zigzag_local, n, axis, x.ndim)
    np.testing.assert_array_equal(there(x), to_zigzag(x, n, axis=axis))
    np.testing.assert_array_equal(back(to_zigzag(x, n, axis=axis)), x)
    # Gradients: the transpose of the exchange is the inverse layout.
    w = jnp.asarray(np.random.default_rng(n + 1).standard_normal(shape), jnp.float32)
    (grad,) = jax.vjp(there, x)[1](w)
    np.testing.assert_array_equal(grad, from_zigzag(w, n, axis=axis))
