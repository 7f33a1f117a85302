"""Property: two calls get the same key exactly when they agree in everything but values."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ejk_executor import Kernel, default_key_builder_with_sharding


class _K(Kernel):
    name = "prop"

    def run(self, *args, cfg, **kwargs):
        return args


_KERNEL = _K()
_shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
_dtypes = st.sampled_from(["float32", "float16", "bfloat16", "int32", "bool"])
_statics = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(-2, 2, allow_nan=False),
    st.sampled_from(["a", "b", ""]),
)
_arg = st.one_of(
    st.tuples(st.just("array"), _shapes, _dtypes), st.tuples(st.just("static"), _statics)
)
_call = st.tuples(
    st.lists(_arg, max_size=3),
    st.dictionaries(st.sampled_from(["scale", "causal", "window"]), _statics, max_size=2),
)


def _materialise(spec):
    kind, *rest = spec
    if kind == "array":
        shape, dtype = rest
        return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype))
    return rest[0]


def _identity(spec):
    """What the key must depend on: shapes, dtypes and typed static values."""
    kind, *rest = spec
    if kind == "array":
        return ("array", rest[0], rest[1])
    value = rest[0]
    return ("static", type(value).__name__, repr(value))


def _key(call):
    args, kwargs = call
    return default_key_builder_with_sharding(
        _KERNEL,
        tuple(_materialise(a) for a in args),
        {k: v for k, v in kwargs.items()},
        device_fp="cpu|test|n=1",
    )


@settings(max_examples=60, deadline=None)
@given(_call, _call)
def test_keys_equal_iff_calls_agree(c1, c2):
    same = [_identity(a) for a in c1[0]] == [_identity(a) for a in c2[0]] and {
        k: _identity(("static", v)) for k, v in c1[1].items()
    } == {k: _identity(("static", v)) for k, v in c2[1].items()}
    assert (_key(c1) == _key(c2)) == same


@settings(max_examples=30, deadline=None)
@given(_call)
def test_keys_ignore_values(call):
    """Concrete NumPy arrays of the same shapes give the key of their ShapeDtypeStructs."""
    args, kwargs = call
    concrete = tuple(
        np.zeros(a[1], jax.numpy.dtype(a[2])) if a[0] == "array" else a[1] for a in args
    )
    key = default_key_builder_with_sharding(_KERNEL, concrete, kwargs, device_fp="cpu|test|n=1")
    assert key == _key(call)
