"""Two launch details jax-triton 0.3.1 gets wrong for Hopper kernels, fixed at compile time.

1. Global scratch. Triton appends two hidden pointer parameters to every kernel
   (global scratch, profile scratch); kernels that build TMA descriptors on the
   device (`tl.make_tensor_descriptor`) write them into the global scratch, one
   slot per program. jaxlib passes null for both, so such a kernel faults. A
   kernel that needs scratch therefore takes it as its last explicit pointer
   argument (an output buffer of `scratch_bytes(grid)` bytes) and the PTX is
   rewritten so the hidden global-scratch parameter is read from that argument.
2. Thread count. A warp-specialised kernel (`tl.range(..., warp_specialize=True)`)
   runs more warps than it was compiled with (producer plus consumer warpgroups);
   the PTX says how many in ``.reqntid``, while jax-triton launches ``num_warps``.

`install()` wraps jax-triton's compile step and its kernel constructor; it changes
only kernels named in `SCRATCH_KERNELS` (fix 1) and kernels whose PTX asks for a
thread count other than the one jax-triton would launch (fix 2), which would not
run correctly otherwise. Both fixes check the PTX they rewrite and raise if it is
not shaped as expected, so a future jax-triton or Triton fails loudly, not wrongly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

__all__ = ["SCRATCH_KERNELS", "SCRATCH_PER_PROGRAM", "install", "scratch_bytes"]

# Bytes of global scratch one program may use: four 128-byte TMA descriptors and
# the warp-specialisation barriers fit (the AOT tests check every config against it).
SCRATCH_PER_PROGRAM = 2048
# Kernels whose last explicit pointer argument is their global scratch (a benchmark's
# own kernel may add its name).
SCRATCH_KERNELS: set[str] = {"fwd_kernel", "dq_kernel", "dkdv_kernel"}


def scratch_bytes(grid: tuple[int, ...]) -> int:
    """Size of the scratch buffer for a launch grid."""
    return SCRATCH_PER_PROGRAM * math.prod(grid)


def _param_indices(ptx: str, name: str) -> list[int]:
    return [int(i) for i in re.findall(rf"\.param [^\n]*?\b{re.escape(name)}_param_(\d+)\b", ptx)]


def redirect_scratch(ptx: str, name: str) -> str:
    """PTX in which the hidden global-scratch parameter reads the last explicit argument.

    Triton's parameter list ends with (..., scratch argument, global scratch,
    profile scratch); every load of the global-scratch parameter is pointed at
    the argument before it.
    """
    params = _param_indices(ptx, name)
    if len(params) < 3 or params != list(range(len(params))):
        raise RuntimeError(f"unexpected parameter list in the PTX of {name}: {params}")
    hidden, mine = params[-2], params[-3]
    loads = rf"\[{re.escape(name)}_param_{hidden}\]"
    if not re.search(loads, ptx):
        return ptx  # the kernel makes no use of global scratch
    return re.sub(loads, f"[{name}_param_{mine}]", ptx)


def threads_required(ptx: str) -> int | None:
    found = re.findall(r"\.reqntid (\d+)", ptx)
    return int(found[0]) if found else None


class _KernelLib:
    """jaxlib's triton kernel module with a `TritonKernel` that launches what the PTX asks."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def TritonKernel(self, name, num_warps, num_ctas, shared, binary, *rest):
        threads = threads_required(binary) if isinstance(binary, str) else None
        if threads is not None and threads % 32 == 0:
            num_warps = threads // 32
        return self._lib.TritonKernel(name, num_warps, num_ctas, shared, binary, *rest)


@functools.cache
def install() -> None:
    """Apply both fixes to jax-triton's `triton_call` (idempotent)."""
    from jax_triton import triton_lib

    compile_ttir = triton_lib.compile_ttir_inplace

    def compile_fixed(*args: Any, **kwargs: Any) -> Any:
        result = compile_ttir(*args, **kwargs)
        if result.name in SCRATCH_KERNELS and isinstance(result.binary, str):
            result = dataclasses.replace(
                result, binary=redirect_scratch(result.binary, result.name)
            )
        return result

    triton_lib.compile_ttir_inplace = compile_fixed
    triton_lib.triton_kernel_call_lib = _KernelLib(triton_lib.triton_kernel_call_lib)
