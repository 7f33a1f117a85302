"""Choosing the Triton backend and launching kernels from JAX.

On a GPU the kernels go through `jax_triton.triton_call` (imported lazily, so
the package imports on CPU-only machines). Without a GPU they run in Triton's
interpreter, called from JAX with `jax.pure_callback` on NumPy buffers. The
interpreter must be switched on (``TRITON_INTERPRET=1``) before the kernels are
decorated, so the kernel modules are imported here, on first use, never at
package import.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np

from ejk_sequtils import varying_like

from . import _jax_triton_fix

__all__ = ["by_name", "gpu_available", "hopper_gpu", "kernels", "launch", "multiprocessors"]


def gpu_available() -> bool:
    """Whether JAX has a CUDA/ROCm GPU backend with at least one device."""
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.cache
def kernels() -> ModuleType:
    """The module holding every `@triton.jit` kernel, imported for the right backend.

    Without a GPU this switches Triton's interpreter on for this process, which
    only works if triton was not imported yet (or was imported with the
    interpreter on already).
    """
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not gpu_available() and not interpret:
        if "triton" in sys.modules:
            raise RuntimeError(
                "ejk_kernels_gpu needs Triton's interpreter on a machine without a GPU, but "
                "triton was imported before with TRITON_INTERPRET unset; set TRITON_INTERPRET=1 "
                "in the environment, or call ejk_kernels_gpu before importing triton"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    from ..kernels import _all  # only now: the interpreter switch comes first

    return _all


def interpreting() -> bool:
    return kernels().INTERPRET


@functools.cache
def hopper_gpu() -> bool:
    """Whether the kernels run compiled on a Hopper (sm_90) GPU."""
    if not gpu_available() or interpreting():
        return False
    capability = getattr(jax.devices("gpu")[0], "compute_capability", "")
    return str(capability).split(".")[0] == "9"


def multiprocessors() -> int:
    """Streaming multiprocessors of the first GPU (132, an H100's, where none is seen)."""
    if not gpu_available():
        return 132
    return int(getattr(jax.devices("gpu")[0], "core_count", 0) or 132)


class _HostBuffer:
    """A NumPy array dressed as the torch tensor Triton's interpreter expects.

    The interpreter reads ``data_ptr()`` and ``dtype`` and copies "device" storage
    to the host and back through a few torch methods; a NumPy array already lives
    on the host, so those copies are identities here.
    """

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype  # str() gives 'float32' etc., which Triton maps to its types

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostBuffer:
        return self

    def cpu(self) -> _HostBuffer:
        return self

    def new_empty(self, *args: Any, **kwargs: Any) -> _HostBuffer:
        return self

    def set_(self, *args: Any) -> _HostBuffer:
        return self

    def copy_(self, other: Any) -> _HostBuffer:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)


_BFLOAT16 = np.dtype(jax.numpy.bfloat16)
# Triton's interpreter patches triton.language while it runs a kernel: two devices' host
# callbacks (a shard_map over several CPU devices) must not interpret at the same time.
_INTERPRETER_LOCK = threading.Lock()


def _interpretable(dtype: np.dtype) -> np.dtype:
    """The dtype a buffer has in the interpreter: Triton's interpreter keeps bfloat16 as raw
    16-bit integers and multiplies those bits (tl.dot) as numbers, so bfloat16 buffers run
    as float32 there (and outputs are rounded back to bfloat16)."""
    return np.dtype(np.float32) if dtype == _BFLOAT16 else dtype


def arithmetic_dtype(dtype: Any) -> np.dtype:
    """The dtype the kernels' arithmetic on ``dtype`` buffers runs in: ``dtype`` compiled,
    float32 for bfloat16 in the interpreter (`_interpretable`). Tests compare at this
    precision (``computed_in`` of `ejk_sequtils.attention_tolerance`)."""
    return _interpretable(np.dtype(dtype)) if kernels().INTERPRET else np.dtype(dtype)


def _interpret_call(
    kernel: Any,
    grid: tuple[int, ...],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    zeroed: Sequence[bool],
    aliases: Mapping[int, int],
    constexprs: Mapping[str, Any],
    *inputs: Any,
) -> tuple[np.ndarray, ...]:
    # pure_callback hands over host arrays (jax or numpy, depending on the jax version).
    arrays = [np.asarray(x) for x in inputs]
    ins = [_HostBuffer(np.ascontiguousarray(x, _interpretable(x.dtype))) for x in arrays]
    outs = [
        (np.zeros if z else np.empty)(s.shape, _interpretable(np.dtype(s.dtype)))
        for s, z in zip(out_shapes, zeroed, strict=True)
    ]
    for i, o in aliases.items():  # an aliased output starts as its input (a copy here)
        outs[o][...] = ins[i].array
    with _INTERPRETER_LOCK:
        kernel[grid](*ins, *(_HostBuffer(o) for o in outs), **constexprs)
    return tuple(
        o.astype(np.dtype(s.dtype), copy=False) for o, s in zip(outs, out_shapes, strict=True)
    )


def by_name(
    kernel: Any,
    inputs: Mapping[str, Any],
    outputs: Mapping[str, jax.ShapeDtypeStruct],
    *,
    zeroed: Iterable[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> tuple[tuple[Any, ...], tuple[jax.ShapeDtypeStruct, ...], dict[str, Any]]:
    """A launch's pointer arguments given by name, as `launch` takes them by position.

    Args:
        kernel: a kernel of the `kernels` module; its signature (``kernel.arg_names``)
            gives the positions.
        inputs: ``{argument name: array}``, in any order.
        outputs: ``{argument name: shape and dtype}``, in any order.
        zeroed: names of the outputs that must start as zeros.
        aliases: ``{input name: output name}``: that output is that input's buffer.

    Returns:
        ``(inputs, outputs, options)``: the arrays and shapes in the kernel's order, and
        ``zeroed`` and ``aliases`` by position, `launch`'s keywords.

    Raises:
        ValueError: the names are not the kernel's leading arguments, inputs first, or a
            zeroed or aliased name is not one of them.
    """
    names = tuple(kernel.arg_names)
    given = len(inputs) + len(outputs)
    in_names, out_names = names[: len(inputs)], names[len(inputs) : given]
    zeroed, aliases = tuple(zeroed), dict(aliases or {})
    if (
        set(in_names) != set(inputs)
        or set(out_names) != set(outputs)
        or not set(zeroed) <= set(outputs)
        or not set(aliases) <= set(inputs)
        or not set(aliases.values()) <= set(outputs)
    ):
        raise ValueError(
            f"{kernel.__name__} takes the pointers {in_names} then {out_names}, got inputs "
            f"{tuple(inputs)}, outputs {tuple(outputs)}, zeroed {zeroed}, aliases {aliases}"
        )
    options = dict(
        zeroed=tuple(name in zeroed for name in out_names),
        aliases={in_names.index(i): out_names.index(o) for i, o in aliases.items()},
    )
    return (
        tuple(inputs[name] for name in in_names),
        tuple(outputs[name] for name in out_names),
        options,
    )


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    inputs: Sequence[jax.Array],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    constexprs: Mapping[str, Any],
    *,
    num_warps: int,
    num_stages: int,
    zeroed: Sequence[bool] | None = None,
    aliases: Mapping[int, int] | None = None,
) -> tuple[jax.Array, ...]:
    """Run ``kernel`` on ``inputs``; its outputs follow the inputs.

    Args:
        kernel: a kernel of the `kernels` module (a ``triton.jit`` or ``gluon.jit`` function).
        grid: the launch grid.
        inputs: arrays passed as pointers, in the kernel's order (`by_name` gives it from
            names).
        out_shapes: shapes and dtypes of the outputs, passed as pointers after the inputs.
        constexprs: every other kernel argument (all static).
        num_warps, num_stages: launch options (ignored by the interpreter).
        zeroed: per output, whether it must start as zeros (for outputs the kernel
            writes only in part).
        aliases: ``{input index: output index}``: that output is that input's buffer
            (XLA copies the input first where it is still needed), so it starts as it.

    Returns:
        The outputs as jax arrays.
    """
    module = kernels()
    zeroed = tuple(zeroed) if zeroed is not None else (False,) * len(out_shapes)
    aliases = dict(aliases or {})
    constexprs = dict(constexprs, INTERPRET=module.INTERPRET)
    if module.INTERPRET:
        host: Callable[..., tuple[np.ndarray, ...]] = functools.partial(
            _interpret_call, kernel, grid, tuple(out_shapes), zeroed, aliases, dict(constexprs)
        )
        # vmap runs the interpreted kernel once per batch element.
        outs = jax.pure_callback(host, tuple(out_shapes), *inputs, vmap_method="sequential")
        return tuple(varying_like(outs, *inputs))
    try:
        import jax_triton
    except ImportError as err:
        raise NotImplementedError(
            f"ejk_kernels_gpu on a GPU needs jax-triton (pip install 'ejk-kernels-gpu[cuda]'): {err}"
        ) from None
    _jax_triton_fix.install()  # global scratch and warp counts for Hopper kernels
    outs = jax_triton.triton_call(
        *inputs,
        kernel=kernel,
        out_shape=tuple(out_shapes),
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        zeroed_outputs=tuple(i for i, z in enumerate(zeroed) if z),
        input_output_aliases=aliases,
        **constexprs,
    )
    # Inside shard_map the custom call's results are typed as the same on every device:
    # marked like their inputs, or their gradients would be summed over the devices.
    return tuple(varying_like(outs, *inputs))
