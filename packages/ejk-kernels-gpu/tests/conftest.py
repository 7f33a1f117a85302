"""Shared inputs for the conformance tests: small pairwise-distinct shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ejk_sequtils import assert_allclose, attention_tolerance


def close(actual, expected, dtype, quantity: str, name: str = "") -> None:
    """``actual`` within the one tolerance table (`ejk_sequtils.attention_tolerance`) of
    ``expected``, the float32 reference's result for inputs of ``dtype``, at the precision
    the kernels compute in here (`build._triton.arithmetic_dtype`: bfloat16 interpreted runs in
    float32)."""
    from ejk_kernels_gpu.build._triton import arithmetic_dtype

    tol = attention_tolerance(dtype, quantity, computed_in=arithmetic_dtype(dtype))
    assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=name or quantity)


def make_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype):
    import jax.numpy as jnp

    q = rng.standard_normal((batch, q_len, heads, head_dim))
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.fixture(name="make_inputs")
def make_inputs_fixture():
    return make_inputs


@pytest.fixture(name="close")
def close_fixture():
    return close


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Calls that exercise the Hopper builds' edges: (causal, q_len, kv_len, kv_heads, sinks) with
# query lengths off the 128-row tiles (TMA zero fill, clipped stores), longer than the keys,
# and grouped kv heads (descriptor strides).
HOPPER_EDGE_CASES = [
    (False, 256, 256, 4, False),
    (True, 256, 256, 4, False),
    (True, 200, 256, 2, True),
    (True, 384, 128, 1, False),
]


@pytest.fixture(name="edge", params=HOPPER_EDGE_CASES, ids=lambda c: "-".join(map(str, c)))
def edge_fixture(request):
    """One of `HOPPER_EDGE_CASES`."""
    return request.param


@pytest.fixture(name="on_hopper")
def on_hopper_fixture(monkeypatch):
    """Pretend to be on Hopper and watch `flash._forward_launch.launch` and
    `flash._backward_launch.launch`. Returns ``watch(hook)``: ``hook(name, grid, inputs, outs,
    consts, kwargs)`` sees every launch (``name``: the kernel's) and may return outputs that
    stand in for it (None: the launch runs as usual)."""
    from ejk_kernels_gpu.flash import _backward_launch, _forward_launch, _select

    monkeypatch.setattr(_select, "hopper_gpu", lambda: True)

    def watch(hook):
        for module in (_forward_launch, _backward_launch):

            def spy(kernel, grid, inputs, outs, consts, _launch=module.launch, **kwargs):
                stand_in = hook(kernel.__name__, grid, inputs, outs, consts, kwargs)
                if stand_in is not None:
                    return stand_in
                return _launch(kernel, grid, inputs, outs, consts, **kwargs)

            monkeypatch.setattr(module, "launch", spy)

    return watch


def scratch_ptx(name: str) -> str:
    """A minimal PTX entry ``name``: four pointer parameters (the last but two explicit one,
    2, is read as Triton's hidden global scratch would be), 384 threads."""
    params = ",\n".join(f"\t.param .u64 .ptr .global .align 1 {name}_param_{i}" for i in range(4))
    return (
        f".visible .entry {name}(\n{params}\n)\n.reqntid 384\n{{\n"
        f"\tld.param.b64 \t%rd4, [{name}_param_2];\n"
        f"\tld.param.b64 \t%rd5, [{name}_param_0];\n}}\n"
    )


@pytest.fixture(name="scratch_ptx")
def scratch_ptx_fixture():
    return scratch_ptx


def aot_rows(module: str, *args: str) -> list[dict]:
    """The JSON rows of ``python -m ejk_kernels_gpu.aot.<module> *args``, run in a subprocess
    with Triton's interpreter off; asserts every build compiled, within shared memory and
    without spills."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", f"ejk_kernels_gpu.aot.{module}", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    bad = [r for r in rows if "error" in r or not r["fits"] or r["spill_stores"] != 0]
    assert rows and not bad and proc.returncode == 0, (bad, proc.stderr[-3000:])
    return rows


@pytest.fixture(name="aot_rows")
def aot_rows_fixture():
    return aot_rows
