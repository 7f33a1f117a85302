"""Ahead-of-time sm_90 builds of the flex kernels, without a GPU.

``python -m ejk_kernels_gpu.aot.flex`` translates a few representative mods (none, causal,
documents over captured ids, a sliding window, ALiBi over captured slopes, a learnable
relative-position table, a soft cap, and a mix of literals, integer division and prefix
lengths), compiles the forward, dq and dk/dv kernels with them
for ``GPUTarget("cuda", 90, 32)`` at the default 128 x 128 blocks and prints one JSON line
per build: shared memory and register spills (ptxas). This proves the generated functions
compile as constexpr arguments of the kernels, not only in the interpreter. It must run
where Triton's interpreter is off, so the tests start it as a subprocess.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..flex._config import FlexConfig, bwd_heuristic, fwd_heuristic
from ..flex._launch import FlexCall
from ..flex._plan import plan_mods
from .flash import compile_sm90, report_build

__all__ = ["MODS", "compile_flex", "main"]

_TRITON_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_POINTERS = {
    "q_ptr": "data", "k_ptr": "data", "v_ptr": "data", "o_ptr": "data", "do_ptr": "data",
    "dq_ptr": "data", "dk_ptr": "data", "dv_ptr": "data", "lse_ptr": "fp32",
    "delta_ptr": "fp32", "ints_ptr": "i32", "floats_ptr": "fp32", "pnum_ptr": "i32",
    "pidx_ptr": "i32", "fnum_ptr": "i32", "fidx_ptr": "i32",
}  # fmt: skip
_BATCH, _SEQ, _HEADS, _KV_HEADS = 2, 4096, 16, 8
_KERNELS = ("flex_fwd_kernel", "flex_dq_kernel", "flex_dkdv_kernel")


def _mods() -> dict[str, tuple[Callable[..., Any] | None, Callable[..., Any] | None]]:
    """``{name: (score_mod, mask_mod)}``, capturing arrays of the builds' shapes."""
    ids = jnp.zeros((_BATCH, _SEQ), jnp.int32)
    slopes = jnp.ones((_HEADS,), jnp.float32)
    table = jnp.zeros((_HEADS, 257), jnp.float32)
    lengths = jnp.zeros((_BATCH,), jnp.int32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def documents(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 1024)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, jnp.clip(kv_idx - q_idx, -128, 128) + 128]

    def soft_cap(score, b, h, q_idx, kv_idx):
        return 30.0 * jnp.tanh(score / 30.0)

    def prefix(b, h, q_idx, kv_idx):  # a literal True combined, as and_masks/or_masks do
        return (jnp.bool_(True) & (q_idx >= kv_idx)) | (kv_idx < lengths[b])

    def chunked(score, b, h, q_idx, kv_idx):  # integer division, rem, a -inf literal
        near = (q_idx // 64 == kv_idx // 64) | ((q_idx - kv_idx) % 7 == 0)
        return jnp.where(near, score, jnp.where(kv_idx > q_idx, -jnp.inf, score - 1.0))

    return {
        "plain": (None, None),
        "causal": (None, causal),
        "documents": (None, documents),
        "window": (None, window),
        "alibi": (alibi, causal),
        "relative": (relative, causal),
        "softcap": (soft_cap, None),
        "mixed": (chunked, prefix),
    }


MODS = tuple(_mods())


def compile_flex(
    mods: str,
    kernel: str,
    *,
    head_dim: int,
    dtype: str = "bfloat16",
    block: int = 128,
    config: FlexConfig | None = None,
) -> dict[str, Any]:
    """Compile ``kernel`` (one of the three flex kernels) with the mods ``mods`` for sm_90
    with ``config`` (default: the kernel's heuristic) and report its resources."""
    from ..kernels import _all

    if _all.INTERPRET:
        raise RuntimeError("compile_flex needs TRITON_INTERPRET unset (run it in a subprocess)")
    score_mod, mask_mod = _mods()[mods]
    plan, _ = plan_mods(score_mod, mask_mod)
    heuristic = fwd_heuristic if kernel == "flex_fwd_kernel" else bwd_heuristic
    cfg = config or heuristic((block, block), head_dim, jnp.dtype(dtype).itemsize)
    call = FlexCall(plan, head_dim**-0.5, (block, block), (1, 1), cfg, cfg)
    q = jax.ShapeDtypeStruct((_BATCH, _SEQ, _HEADS, head_dim), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((_BATCH, _SEQ, _KV_HEADS, head_dim), jnp.dtype(dtype))
    keys_resident = kernel == "flex_dkdv_kernel"
    consts = dict(call.constexprs(q, k, k, cfg, keys_resident), INTERPRET=False)
    fn = getattr(_all, kernel)
    consts.update({n: f for n, f in plan.loaded_functions().items() if n in fn.arg_names})
    built = compile_sm90(
        fn, _POINTERS, {"data": _TRITON_DTYPE[dtype]}, consts, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    config = dict(block=block, block_q=cfg.block_q, block_k=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    return dict(config=config, **built)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mods", default=",".join(MODS))
    parser.add_argument("--kernels", default=",".join(_KERNELS))
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--config", default="", help="block_q,block_k,num_warps,num_stages")
    args = parser.parse_args(argv)
    config = None
    if args.config:
        fields = ("block_q", "block_k", "num_warps", "num_stages")
        config = FlexConfig(**dict(zip(fields, map(int, args.config.split(",")), strict=True)))
    failed = 0
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        for mods in args.mods.split(","):
            for kernel in args.kernels.split(","):
                row: dict[str, Any] = dict(
                    mods=mods, kernel=kernel, head_dim=head_dim, dtype=args.dtype
                )
                failed += report_build(
                    row,
                    functools.partial(
                        compile_flex,
                        mods,
                        kernel,
                        head_dim=head_dim,
                        dtype=args.dtype,
                        block=args.block,
                        config=config,
                    ),
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
