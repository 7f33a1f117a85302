"""Launching a kernel from JAX: pointer arguments by name (`build._triton.by_name`)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

from ejk_kernels_gpu.build._triton import by_name


def test_launch_arguments_by_name():
    """`build._triton.by_name` puts a launch's pointers in the kernel's order, from its
    signature, and gives ``zeroed`` and ``aliases`` by position; names that are not the
    kernel's leading arguments (inputs first) are refused, naming them."""
    kernel = types.SimpleNamespace(
        __name__="k", arg_names=["a_ptr", "b_ptr", "prev_ptr", "o_ptr", "n_ptr", "BLOCK"]
    )
    shape, other = (jax.ShapeDtypeStruct((n,), jnp.float32) for n in (1, 2))
    inputs, outputs, where = by_name(
        kernel, inputs=dict(prev_ptr=3, a_ptr=1, b_ptr=2), outputs=dict(n_ptr=shape, o_ptr=other),
        zeroed=("n_ptr",), aliases={"prev_ptr": "o_ptr"},
    )  # fmt: skip
    assert inputs == (1, 2, 3) and outputs == (other, shape)
    assert where == dict(zeroed=(False, True), aliases={2: 0})
    with pytest.raises(ValueError, match=r"takes the pointers \('a_ptr', 'b_ptr'\)"):
        by_name(kernel, inputs=dict(a_ptr=1, o_ptr=2), outputs=dict(b_ptr=shape))
    with pytest.raises(ValueError, match="zeroed \\('a_ptr',\\)"):
        by_name(kernel, inputs=dict(a_ptr=1), outputs=dict(b_ptr=shape), zeroed=("a_ptr",))
