"""The jax-triton launch fix refuses what it was not written for: PTX laid out otherwise,
and Triton or jax-triton versions other than the ones it knows (checked on CPU with
stand-in modules; `install` runs the check on a GPU before patching anything)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from ejk_kernels_gpu.build import _jax_triton_fix
from ejk_kernels_gpu.build._jax_triton_fix import redirect_scratch


def test_refuses_parameters_out_of_order(scratch_ptx):
    ptx = scratch_ptx("fwd_kernel").replace("fwd_kernel_param_1,", "fwd_kernel_param_7,")
    with pytest.raises(RuntimeError, match="unexpected parameter list"):
        redirect_scratch(ptx, "fwd_kernel")


def test_refuses_too_few_parameters():
    ptx = ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0\n)\n"
    with pytest.raises(RuntimeError, match="unexpected parameter list"):
        redirect_scratch(ptx, "k")


def test_refuses_a_hidden_parameter_that_is_no_pointer(scratch_ptx):
    ptx = scratch_ptx("fwd_kernel").replace(
        ".param .u64 .ptr .global .align 1 fwd_kernel_param_3", ".param .u32 fwd_kernel_param_3"
    )
    with pytest.raises(RuntimeError, match="parameter 3 of fwd_kernel is not a global pointer"):
        redirect_scratch(ptx, "fwd_kernel")


def test_refuses_a_scratch_argument_the_kernel_reads(scratch_ptx):
    """A read of the third-last parameter means it is not the unused scratch argument."""
    ptx = scratch_ptx("fwd_kernel").replace("[fwd_kernel_param_0]", "[fwd_kernel_param_1]")
    with pytest.raises(RuntimeError, match="reads parameter 1"):
        redirect_scratch(ptx, "fwd_kernel")


@pytest.fixture(name="versions")
def versions_fixture(monkeypatch):
    """``set(triton, jax_triton)``: stand-in modules with those ``__version__``s."""

    def set_versions(triton_version: str, jax_triton_version: str) -> None:
        for name, version in (("triton", triton_version), ("jax_triton", jax_triton_version)):
            module = ModuleType(name)
            module.__version__ = version
            monkeypatch.setitem(sys.modules, name, module)

    return set_versions


@pytest.mark.parametrize(
    ("triton", "jax_triton"), [("3.7.0", "0.3.1"), ("3.6.0", "0.3.2"), ("3.5.1", "0.2.0")]
)
def test_install_refuses_other_versions(versions, triton, jax_triton):
    versions(triton, jax_triton)
    with pytest.raises(RuntimeError, match=r"written for triton 3\.6\.0, jax_triton 0\.3\.1"):
        _jax_triton_fix.install.__wrapped__()


def test_the_known_versions_pass(versions):
    versions("3.6.0", "0.3.1")
    _jax_triton_fix.check_versions()


def test_every_kernel_with_a_scratch_argument_is_redirected():
    """A kernel whose last explicit pointer is ``scratch_ptr`` gets its PTX redirected
    (`SCRATCH_KERNELS`): one left out reads its TMA descriptors' scratch from a null
    pointer on the GPU (an illegal address, with no error at compile time)."""
    from ejk_kernels_gpu.kernels import _all as _jit_kernels

    with_scratch = {
        name
        for name, fn in vars(_jit_kernels).items()
        if "scratch_ptr" in getattr(fn, "arg_names", ())
    }
    assert {"gluon_fwd_kernel", "gluon_dkdv_wide_kernel"} <= with_scratch
    assert with_scratch <= _jax_triton_fix.SCRATCH_KERNELS
