"""Ahead-of-time sm_90 builds of the paged kernel, without a GPU.

``python -m ejk_kernels_gpu.aot.paged`` compiles the paged kernel for
``GPUTarget("cuda", 90, 32)`` for each build a call can take (decode and prefill tiles,
one split and several, pages larger and smaller than the key block, every feature or
none, fp8 pages with per-token or scalar scales) and prints one JSON line per build: shared memory, register spills (ptxas). It
must run where Triton's interpreter is off, so the tests start it as a subprocess.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp

from ..paged._config import PagedConfig, paged_heuristic, tile_shape
from ..paged._launch import PagedCall, paged_constexprs
from .flash import compile_sm90, report_build

__all__ = ["BUILDS", "compile_paged", "main"]

_TRITON_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_POINTERS = {
    "q_ptr": "data", "k_ptr": "pages", "v_ptr": "pages", "k_scales_ptr": "fp32",
    "v_scales_ptr": "fp32", "page_table_ptr": "i32",
    "tiles_ptr": "i32", "sinks_ptr": "fp32", "o_ptr": "out", "lse_ptr": "fp32",
}  # fmt: skip

# (name, batch, q_len, page, features, kv_scales): the heuristic's config for each, at
# N=32, K=8; kv_scales as the kernel's KV_SCALES (0: pages in q's dtype; fp8 pages with
# 1: scalar scales, 2: per-token scales).
BUILDS = [
    ("decode", 32, 1, 64, False, 0),
    ("decode-features", 32, 1, 16, True, 0),
    ("long-decode", 1, 1, 256, False, 0),
    ("prefill", 8, 512, 64, False, 0),
    ("prefill-features", 8, 512, 128, True, 0),
    ("decode-fp8", 32, 1, 64, False, 2),
    ("decode-features-fp8-scalar", 32, 1, 16, True, 1),
    ("prefill-fp8", 8, 512, 64, False, 2),
]


def compile_paged(
    cfg: PagedConfig,
    *,
    head_dim: int,
    q_len: int,
    page: int,
    features: bool,
    dtype: str = "bfloat16",
    kv_scales: int = 0,
) -> dict[str, Any]:
    """Compile the paged kernel for sm_90 with ``cfg`` and report its resources (fp8
    pages with ``kv_scales`` 1 or 2)."""
    from ..kernels import _all
    from ..kernels.triton import _paged as module

    if _all.INTERPRET:
        raise RuntimeError("compile_paged needs TRITON_INTERPRET unset (run it in a subprocess)")
    heads, kv_heads, batch, pages_per_seq = 32, 8, 8, 64
    call = PagedCall(
        scale=head_dim**-0.5,
        causal=True,
        window=(1024, 0) if features else None,
        soft_cap=30.0 if features else 0.0,
        config=cfg,
        tile=tile_shape(cfg, heads // kv_heads, q_len),
    )
    q = jax.ShapeDtypeStruct((batch * q_len, heads, head_dim), jnp.dtype(dtype))
    pages_dtype = jnp.dtype(jnp.float8_e4m3fn) if kv_scales else q.dtype
    pages = jax.ShapeDtypeStruct((batch * pages_per_seq, page, kv_heads, head_dim), pages_dtype)
    table = jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32)
    consts = paged_constexprs(call, q, pages, table, features, kv_scales)
    consts = dict(consts, INTERPRET=False)
    data = _TRITON_DTYPE[dtype]
    out = data if cfg.num_splits == 1 else "fp32"
    kinds = {"data": data, "out": out, "pages": "fp8e4nv" if kv_scales else data}
    fn = module.paged_kernel
    built = compile_sm90(
        fn, _POINTERS, kinds, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
    return dict(
        config=dict(
            block_m=cfg.block_m, block_kv=cfg.block_kv, num_splits=cfg.num_splits,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
        rows=call.tile.rows,
        **built,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--builds", default=",".join(b[0] for b in BUILDS))
    args = parser.parse_args(argv)
    wanted = set(args.builds.split(","))
    failed = 0
    itemsize = jnp.dtype(args.dtype).itemsize
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        for name, batch, q_len, page, features, kv_scales in (b for b in BUILDS if b[0] in wanted):
            cfg = paged_heuristic(
                batch=batch, q_len=q_len, ragged=False, heads=32, kv_heads=8,
                head_dim=head_dim, capacity=64 * page, itemsize=itemsize,
                kv_itemsize=1 if kv_scales else itemsize,
            )  # fmt: skip
            row: dict[str, Any] = dict(
                build=name, head_dim=head_dim, dtype=args.dtype, kv_scales=kv_scales
            )
            failed += report_build(
                row,
                functools.partial(
                    compile_paged,
                    cfg,
                    head_dim=head_dim,
                    q_len=q_len,
                    page=page,
                    features=features,
                    dtype=args.dtype,
                    kv_scales=kv_scales,
                ),
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
