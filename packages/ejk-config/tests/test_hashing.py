import dataclasses
import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ejk_config import BwdParams, FwdParams, get_safe_hash_int, hash_fn, short_hash, stable_json

# ---------------------------------------------------------------- pinned collisions


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (FwdParams(q_blocksize=12, kv_blocksize=864), FwdParams(q_blocksize=128, kv_blocksize=64)),
        (FwdParams(q_blocksize=64), FwdParams(kv_blocksize=64)),
        (FwdParams(num_warps=4), BwdParams(num_warps=4)),
        ({"a": None}, {}),
        (1, "1"),
        (1, 1.0),
        (1, True),
        (0.0, -0.0),
        ((1, 2), [1, 2]),
        ({1: "x"}, {"1": "x"}),
        (frozenset({1, 2}), (1, 2)),
        ("a,b", ("a", "b")),
        (b"ab", "ab"),
        (None, "None"),
        (jnp.float32, jnp.bfloat16),
        (np.float32(1), 1.0),
        (jnp.zeros((2, 3)), jnp.zeros((3, 2))),
        (jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32)),
        (functools.partial(math.pow, 2), functools.partial(math.pow, 3)),
        (functools.partial(math.pow, 2), math.pow),
        (math.sin, math.cos),
    ],
)
def test_different_values_have_different_keys(a, b):
    assert stable_json(a) != stable_json(b)
    assert short_hash(a) != short_hash(b)
    assert get_safe_hash_int(a) != get_safe_hash_int(b)


def test_arrays_are_keyed_by_shape_and_dtype_only():
    assert short_hash(jnp.zeros((2, 3))) == short_hash(np.ones((2, 3), np.float32))
    assert short_hash(jax.ShapeDtypeStruct((2, 3), jnp.float32)) == short_hash(jnp.ones((2, 3)))


def test_functions_never_keyed_by_address():
    def make(scale):
        return lambda x: x * scale

    f, g, h = make(2), make(2), make(3)
    assert f is not g
    assert stable_json(f) == stable_json(g)
    assert stable_json(f) != stable_json(h)  # closure value is a bound argument
    assert stable_json(lambda x: x + 1) != stable_json(lambda x: x - 1)
    assert "0x" not in stable_json([f, math.sin, functools.partial(math.pow, 2)])


def test_partial_keyword_arguments_and_enums():
    assert short_hash(functools.partial(sorted, reverse=True)) != short_hash(
        functools.partial(sorted, reverse=False)
    )


def test_dataclass_and_named_tuple_include_class():
    @dataclasses.dataclass(frozen=True)
    class A:
        x: int = 1

    @dataclasses.dataclass(frozen=True)
    class B:
        x: int = 1

    assert stable_json(A()) != stable_json(B())
    assert stable_json(jax.sharding.PartitionSpec("data")) != stable_json(("data",))


def test_unkeyable_values_are_rejected_with_their_type():
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"cannot key a value of type .*Opaque"):
        stable_json({"x": Opaque()})

    class Keyed:
        def __init__(self, n):
            self.n = n

        def __ejk_stable_key__(self):
            return {"n": self.n}

    assert stable_json(Keyed(1)) == stable_json(Keyed(1)) != stable_json(Keyed(2))
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(TypeError, match="self-referencing"):
        stable_json(cyclic)


def test_hash_fn_is_usable_as_dunder_hash():
    class Cfg(msgspec.Struct, frozen=True):
        a: int = 1
        __hash__ = hash_fn

    assert hash(Cfg()) == hash(Cfg()) != hash(Cfg(a=2))
    assert 0 <= hash_fn(Cfg()) < 2**63
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        get_safe_hash_int(1, algorithm="nope")
    with pytest.raises(ValueError, match="length must be an int in"):
        short_hash(1, length=0)


# ---------------------------------------------------------------- collision hunt


def _same(a, b) -> bool:
    """Equal values of equal types, all the way down (what stable_json must distinguish)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, frozenset):
        return len(a) == len(b) and all(any(_same(x, y) for y in b) for x in a)
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(_same(k, k2) and _same(v, v2) for k2, v2 in b.items()) for k, v in a.items()
        )
    return a == b


_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=3) | st.sampled_from([FwdParams(q_blocksize=16), BwdParams(num_warps=2)])
)  # fmt: skip
_keys = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=2)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(_keys, inner, max_size=3)
        | st.frozensets(_keys, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(_values, _values)
def test_collision_hunt(a, b):
    assert (stable_json(a) == stable_json(b)) == _same(a, b)
    if not _same(a, b):
        assert short_hash(a, 64) != short_hash(b, 64)


@settings(max_examples=100, deadline=None)
@given(_values)
def test_stable_json_is_idempotent_on_equal_copies(a):
    assert stable_json(a) == stable_json(a)


# ---------------------------------------------------------------- across processes

_PROBE = """
import functools, math
from ejk_config import FwdParams, stable_json
value = {
    "set": {"alpha", "beta", "gamma", "delta", "epsilon"},
    "frozen": frozenset({("x", 1), ("y", 2), ("z", 3)}),
    frozenset({"k1", "k2"}): [1.5, None, True],
    "cfg": FwdParams(q_blocksize=64, num_warps=4),
    "fn": functools.partial(math.pow, 2),
    "builtin": sorted,
}
print(stable_json(value))
"""


def test_same_text_in_every_process_and_hash_seed():
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
        )
        outs.add(run.stdout)
    assert len(outs) == 1
