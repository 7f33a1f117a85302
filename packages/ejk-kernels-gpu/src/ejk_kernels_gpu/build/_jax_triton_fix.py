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

3. Gluon kernels. jax-triton compiles through Triton's front end only; a Gluon kernel
   (`_gluon_forward`) is compiled by ``triton.compile`` from a ``GluonASTSource``
   (`compile_gluon`) and handed to jaxlib like any other, fixes 1 and 2 included.

`install()` wraps jax-triton's compile step and its kernel constructor; it changes
only kernels named in `SCRATCH_KERNELS` (fix 1) and kernels whose PTX asks for a
thread count other than the one jax-triton would launch (fix 2), which would not
run correctly otherwise. Both fixes check the PTX they rewrite and raise if it is
not shaped as expected, and `install` refuses (RuntimeError) any Triton or jax-triton
version but the ones it was written for (`SUPPORTED_VERSIONS`), so a newer one fails
loudly, not wrongly.

Why not jax-triton 0.4.1 (Triton 3.7), which launches kernels with global scratch and
tensor descriptors itself: studied on the CPU
(docs/performance-history.md#build_jax_triton_fixpy), every kernel builds and the interpreter
tests pass, but 0.4.1 still launches a warp-specialised
or Gluon kernel with ``num_warps`` warps while its PTX asks for 384 threads (fix 2 is still
needed), and compiles Gluon kernels through Triton's ordinary passes, which add a
``wgmma.wait_group 0`` to the Gluon main loop and lose its overlap (fix 3 still needed). The
move waits for a jax-triton that launches both as compiled, checked on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import tempfile
from typing import Any

__all__ = [
    "SCRATCH_KERNELS",
    "SCRATCH_PER_PROGRAM",
    "SUPPORTED_VERSIONS",
    "check_versions",
    "compile_gluon",
    "install",
    "scratch_bytes",
    "source_signature",
]

# Bytes of global scratch one program may use: four 128-byte TMA descriptors and
# the warp-specialisation barriers fit (the AOT tests check every config against it).
SCRATCH_PER_PROGRAM = 2048
# Kernels whose last explicit pointer argument is their global scratch (a benchmark's
# own kernel may add its name).
SCRATCH_KERNELS: set[str] = {
    "fwd_kernel",
    "dq_kernel",
    "dkdv_kernel",
    "gluon_fwd_kernel",
    "gluon_dkdv_kernel",
    "gluon_dkdv_wide_kernel",
    "gluon_dq_kernel",
}


# The versions whose launch path and PTX layout these fixes were written against.
SUPPORTED_VERSIONS = {"triton": "3.6.0", "jax_triton": "0.3.1"}


def check_versions() -> None:
    """Raise RuntimeError unless the imported triton and jax_triton are `SUPPORTED_VERSIONS`."""
    import jax_triton
    import triton

    modules = {"triton": triton, "jax_triton": jax_triton}
    found = {
        name: str(getattr(modules[name], "__version__", "unknown")) for name in SUPPORTED_VERSIONS
    }
    if found != SUPPORTED_VERSIONS:
        wanted = ", ".join(f"{n} {v}" for n, v in SUPPORTED_VERSIONS.items())
        got = ", ".join(f"{n} {v}" for n, v in found.items())
        raise RuntimeError(
            f"ejk_kernels_gpu's jax-triton launch fix (_jax_triton_fix) was written for {wanted}, "
            f"found {got}: it rewrites the PTX of Hopper kernels and jax-triton's compile step, "
            "which another version may lay out differently; install those versions "
            "(pip install 'ejk-kernels-gpu[cuda]')"
        )


def scratch_bytes(grid: tuple[int, ...]) -> int:
    """Size of the scratch buffer for a launch grid."""
    return SCRATCH_PER_PROGRAM * math.prod(grid)


def _param_indices(ptx: str, name: str) -> list[int]:
    return [int(i) for i in re.findall(rf"\.param [^\n]*?\b{re.escape(name)}_param_(\d+)\b", ptx)]


def redirect_scratch(ptx: str, name: str) -> str:
    """PTX in which the hidden global-scratch parameter reads the last explicit argument.

    Triton's parameter list ends with (..., scratch argument, global scratch,
    profile scratch); every load of the global-scratch parameter is pointed at
    the argument before it. Refused (RuntimeError): parameters not numbered 0..n-1, or
    fewer than three; any of the last three not a 64-bit global pointer (Triton 3.6's two
    hidden parameters are); a scratch argument the kernel reads itself (it only sizes the
    launch, so a read means the hidden parameters are not the last two).
    """
    params = _param_indices(ptx, name)
    if len(params) < 3 or params != list(range(len(params))):
        raise RuntimeError(f"unexpected parameter list in the PTX of {name}: {params}")
    hidden, mine = params[-2], params[-3]
    for i in params[-3:]:
        if not re.search(
            rf"\.param \.u64 \.ptr \.global[^\n]*\b{re.escape(name)}_param_{i}\b", ptx
        ):
            raise RuntimeError(
                f"parameter {i} of {name} is not a global pointer in its PTX: the last three "
                "must be the scratch argument and Triton's two hidden scratch pointers"
            )
    if re.search(rf"\[{re.escape(name)}_param_{mine}\]", ptx):
        raise RuntimeError(
            f"the PTX of {name} reads parameter {mine}, which should be its unused scratch "
            f"argument (the third last): the hidden parameters are not where expected"
        )
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


def source_signature(
    fn: Any, pointers: dict[str, str], constexprs: dict[str, Any]
) -> tuple[dict[str, str], dict[tuple[int], list]]:
    """(signature, attrs) of a compile source for ``fn``: ``pointers`` maps each pointer
    argument to its Triton type (``"*bf16"``), every other argument of ``fn`` is one of
    the ``constexprs``; pointers are declared 16-byte aligned (jax buffers are)."""
    signature = {n: pointers.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in pointers}
    return signature, attrs


def compile_gluon(
    fn: Any, pointers: dict[str, str], constexprs: dict[str, Any], num_warps: int,
    capability: int = 90,
) -> Any:  # fmt: skip
    """``triton.compile`` of a Gluon kernel for ``sm_<capability>`` (arguments as
    `source_signature` takes them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, attrs = source_signature(fn, pointers, constexprs)
    source = GluonASTSource(fn, signature, dict(constexprs), attrs)
    if not triton.knobs.cache.dir:  # jax-triton empties TRITON_CACHE_DIR when it imports
        triton.knobs.cache.dir = os.path.join(tempfile.gettempdir(), "ejk-gluon-cache")
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps))


def _install_gluon(triton_lib: Any) -> None:
    """Route Gluon kernels of `triton_call` through `compile_gluon` (fix 3)."""
    original = triton_lib.get_or_create_triton_kernel
    cache: dict[Any, Any] = {}

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
        if not getattr(fn, "is_gluon", lambda: False)():
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
        metaparams = kw["metaparams"]
        key = (fn, tuple(arg_dtypes), tuple(sorted(metaparams.items())), kw["num_warps"])
        if key not in cache:
            capability = kw["compute_capability"]
            if capability is None:  # as jax-triton does: device 0's
                capability = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
            pointers = dict(zip(fn.arg_names, arg_dtypes, strict=False))  # arrays come first
            compiled = compile_gluon(fn, pointers, metaparams, kw["num_warps"], capability)
            name = compiled.metadata.name
            ptx = compiled.asm["ptx"]
            if name in SCRATCH_KERNELS:
                ptx = redirect_scratch(ptx, name)
            kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
                name, kw["num_warps"], kw["num_ctas"], compiled.metadata.shared, ptx, "",
                capability,
            )  # fmt: skip
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(arg_dtypes))}
            cache[key] = (kernel, attrs)
        return cache[key]

    triton_lib.get_or_create_triton_kernel = get_or_create


@functools.cache
def install() -> None:
    """Apply the three fixes to jax-triton's `triton_call` (idempotent); RuntimeError on
    versions other than `SUPPORTED_VERSIONS` (`check_versions`)."""
    check_versions()
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
    _install_gluon(triton_lib)
