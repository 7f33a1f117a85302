"""Toy kernels shared by the tests, handed out as fixtures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
import pytest

from ejk_executor import Kernel


class MatCfg(msgspec.Struct, frozen=True):
    """block: a harmless knob; extra: matmuls of busy work that do not change the result."""

    block: int = 64
    extra: int = 0


class MatKernel(Kernel[MatCfg, jax.Array]):
    """``a @ b * scale``; counts how often each hook runs."""

    name = "toy_matmul"
    config_type = MatCfg

    def __init__(self, space=None, **kw):
        super().__init__(**kw)
        self.heuristic_calls = 0
        self.run_calls = 0
        self.space = space or [MatCfg(32), MatCfg(64)]

    def run(self, a, b, *, cfg, scale=1.0):
        self.run_calls += 1
        out = (a @ b) * scale
        if cfg.extra:
            # Busy work: a chain of large matmuls whose result is multiplied by zero
            # (XLA does not fold x * 0 for floats, so the work stays in the program).
            big = jnp.ones((256, 256), jnp.float32) + a.sum() * 1e-9

            def step(_, y):
                return jnp.tanh(y @ big)

            busy = jax.lax.fori_loop(0, cfg.extra, step, big)
            out = out + 0.0 * busy[0, 0]
        return out

    def heuristic_cfg(self, inv):
        self.heuristic_calls += 1
        return MatCfg(block=64 if inv.args[0].shape[0] >= 64 else 16)

    def config_space(self, inv):
        return list(self.space)


class SinMulKernel(Kernel[MatCfg, jax.Array]):
    """``sin(a) * b`` (masked where ``mask`` is False) with a hand-written backward."""

    name = "toy_sinmul"
    config_type = MatCfg

    def __init__(self):
        super().__init__()
        self.backward_calls = 0

    def run(self, a, b, *, cfg, mask=None):
        out = jnp.sin(a) * b
        return out if mask is None else jnp.where(mask, out, 0.0)

    def forward_with_residuals(self, a, b, *, cfg, mask=None):
        return self.run(a, b, cfg=cfg, mask=mask), (a, b)

    def backward(self, residuals, dout, *, cfg, mask=None):
        self.backward_calls += 1
        a, b = residuals
        if mask is not None:
            dout = jnp.where(mask, dout, 0.0)
        return (jnp.cos(a) * b * dout, jnp.sin(a) * dout)

    def heuristic_cfg(self, inv):
        return MatCfg()


@pytest.fixture
def mat_kernel():
    return MatKernel()


@pytest.fixture
def sinmul_kernel():
    return SinMulKernel()


@pytest.fixture
def kernels():
    """The toy kernel classes and config class, for tests that build their own."""
    return {"MatCfg": MatCfg, "MatKernel": MatKernel, "SinMulKernel": SinMulKernel}
