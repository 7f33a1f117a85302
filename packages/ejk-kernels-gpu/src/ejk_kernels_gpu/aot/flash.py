"""Ahead-of-time compilation of the kernels for a Hopper GPU, without a GPU.

``python -m ejk_kernels_gpu.aot.flash`` compiles every kernel for every config of its
search space for ``GPUTarget("cuda", 90, 32)`` (ptxas ships with triton) and
prints one JSON line per build with its shared memory. It must run in a process
where Triton's interpreter is off, so the tests start it as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import msgspec

from ..build._jax_triton_fix import (
    SCRATCH_PER_PROGRAM,
    compile_gluon,
    source_signature,
    threads_required,
)
from ..flash._config import (
    SHARED_MEMORY_LIMIT,
    FlashBackwardConfig,
    FlashConfig,
    fits_shared_memory,
    ordinary_config,
    ordinary_dq_config,
)
from ..flash._constexprs import (
    dq_by_tma,
    gluon_constexprs,
    gluon_dkdv_constexprs,
    gluon_dq_constexprs,
    kernel_constexprs,
)
from ..flash._select import (
    GLUON_BWD_CONFIGS,
    WS_BWD_CONFIGS,
    CallOptions,
    bwd_heuristic,
    bwd_search_space,
    dq_beside,
    fwd_heuristic,
    fwd_search_space,
)

__all__ = ["compile_kernel", "compile_sm90", "main", "report_build", "spill_stores"]

_TRITON_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# Pointer arguments by name: which element type each one has ("data" = the input dtype).
_POINTER_TYPES = {
    "q_ptr": "data", "k_ptr": "data", "v_ptr": "data", "bias_ptr": "data", "o_ptr": "data",
    "prev_o_ptr": "data", "prev_lse_ptr": "fp32",
    "do_ptr": "data", "dq_ptr": "data", "dk_ptr": "data", "dv_ptr": "data",
    "sinks_ptr": "fp32", "lse_ptr": "fp32", "delta_ptr": "fp32", "dbias_ptr": "fp32",
    "dq_acc_ptr": "fp32", "counter_ptr": "i32", "counter_in_ptr": "i32",
    "scratch_ptr": "u8", "qsid_ptr": "i32", "ksid_ptr": "i32", "qpos_ptr": "i32", "kpos_ptr": "i32",
    "qseg_ptr": "i32", "kseg_ptr": "i32", "ranges_ptr": "i32", "order_ptr": "i32", "seed_ptr": "u32",
}  # fmt: skip

# Features switched on for the compile: the heaviest variant (every mask branch) and the plain one;
# "masks": every mask the Gluon forward takes (no bias or dropout), "tail": keys off the tile.
VARIANTS = {
    "plain": dict(causal=False),
    "causal": dict(causal=True, sinks=True),
    "masks": dict(
        causal=True, window=(64, 0), soft_cap=30.0, has_seg=True, varlen=True, sinks=True
    ),
    "softcap": dict(causal=True, soft_cap=30.0),
    # a soft cap with a block table (the three-consumer tile in the tuning space)
    "capped_documents": dict(causal=True, has_seg=True, soft_cap=30.0),
    "window": dict(causal=True, window=(1024, 0)),
    "documents": dict(causal=True, has_seg=True),
    "packed": dict(causal=True, window=(64, 0), varlen=True),
    # context parallelism's one call (`context._blocks`): global positions, no sequence ids
    "relative": dict(causal=True, has_seg=True, varlen=True, seq_ids=False),
    # all-gather's forward over the other devices' keys, resuming the own block's rows
    "resume": dict(causal=True, has_seg=True, varlen=True, seq_ids=False, resume=True),
    # all-gather's keys and values gathered as one array (``KV_PAIR``), forward and backward
    "pair": dict(causal=True, has_seg=True, varlen=True, seq_ids=False, kv_pair=True, joint=True),
    # all-gather's backward: dk and dv side by side in one output (``JOINT``)
    "joint": dict(causal=True, has_seg=True, varlen=True, seq_ids=False, joint=True),
    "tail": dict(causal=False, kv_len=4000),
    # one block of 64 queries (half a Gluon forward tile) and one of 128 keys (the dk/dv
    # kernel's resident block, its grouped causal programs in a given order)
    "one_block": dict(causal=True, q_len=64, kv_len=128),
    "all": dict(
        causal=True, window=(64, 0), soft_cap=30.0, dropout_rate=0.1, has_seg=True, varlen=True,
        bias=True, sinks=True,
    ),
}  # fmt: skip


# A build's config: the forward's and the dq kernel's a `FlashConfig`, the dk/dv kernel's a
# `FlashBackwardConfig`.
Config = FlashConfig | FlashBackwardConfig


def _constexprs(kernel: str, cfg: Config, head_dim: int, dtype: str, variant: str):
    feats = dict(VARIANTS[variant])
    bias = feats.pop("bias", False)
    sinks = feats.pop("sinks", False)
    kv_len = feats.pop("kv_len", 4096)
    seq = feats.pop("q_len", 4096)
    joint = feats.pop("joint", False)
    resume = feats.pop("resume", False)
    pair = feats.pop("kv_pair", False)
    opts = CallOptions(
        scale=head_dim**-0.5,
        causal=feats.get("causal", False),
        window=feats.get("window"),
        soft_cap=feats.get("soft_cap", 0.0),
        dropout_rate=feats.get("dropout_rate", 0.0),
        has_seg=feats.get("has_seg", False),
        varlen=feats.get("varlen", False),
        seq_ids=feats.get("seq_ids", True),
        fwd_cfg=cfg if isinstance(cfg, FlashConfig) else FlashConfig(),
        bwd_cfg=cfg if isinstance(cfg, FlashBackwardConfig) else FlashBackwardConfig(),
    )
    batch, heads, kv_heads = 2, 16, 8
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.dtype(dtype))
    b = jax.ShapeDtypeStruct((batch, heads, seq, kv_len), jnp.dtype(dtype)) if bias else None
    if cfg.gluon and kernel == "dkdv_kernel":  # the Gluon dk/dv kernel (its own arguments)
        return dict(
            gluon_dkdv_constexprs(opts, q, k, cfg, joint=joint, kv_pair=pair), INTERPRET=False
        )
    if cfg.gluon and kernel == "dq_kernel":  # the Gluon dq kernel beside it
        return dict(gluon_dq_constexprs(opts, q, k, cfg, kv_pair=pair), INTERPRET=False)
    if cfg.gluon:  # the Gluon forward (its own arguments)
        consts = gluon_constexprs(opts, q, k, sinks, cfg, resume=resume, kv_pair=pair)
        return dict(consts, INTERPRET=False)
    consts = kernel_constexprs(opts, q, k, b, sinks, kv_pair=pair)
    # The warp-specialised build reads lse rows padded to a multiple of 128 (see backward).
    consts.update(INTERPRET=False, WS=cfg.warp_specialize, LSE_T=-(-seq // 128) * 128)
    if isinstance(cfg, FlashBackwardConfig):  # dk/dv: keys resident, queries streamed
        consts.update(
            BLOCK_M=cfg.block_queries, BLOCK_N=cfg.block_keys, DQ_ATOMIC=cfg.atomic_dq,
            DQ_TMA=dq_by_tma(cfg, head_dim, hopper=True),  # the build sm_90 runs
        )  # fmt: skip
    else:
        consts.update(BLOCK_M=cfg.block_q, BLOCK_N=cfg.block_k, RESUME=resume)
    return consts


def compile_kernel(
    kernel: str,
    cfg: Config,
    head_dim: int,
    dtype: str = "bfloat16",
    variant: str = "plain",
    spills: bool = False,
) -> dict[str, Any]:
    """Compile one kernel for sm_90 and report its resources.

    ``spills``: also run ptxas on the PTX for its spill count (`spill_stores`), and count
    in the SASS the swaps of 16-bit halves (`half_swaps`) and the 64-bit shifts that
    unpack a packed mask (`mask_unpacks`).

    ``cfg``: a `FlashConfig` for ``fwd_kernel`` and ``dq_kernel``, a `FlashBackwardConfig`
    for ``dkdv_kernel``.

    Returns:
        dict with the kernel, config (`config_row`), shared memory bytes, scratch, threads,
        spills, seconds.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    from ..kernels import _all as module

    if module.INTERPRET:
        raise RuntimeError("compile_kernel needs TRITON_INTERPRET unset (run it in a subprocess)")
    if isinstance(cfg, FlashBackwardConfig) != (kernel == "dkdv_kernel"):
        wanted = "FlashBackwardConfig" if kernel == "dkdv_kernel" else "FlashConfig"
        raise TypeError(f"{kernel} takes a {wanted}, got {cfg!r}")
    consts = _constexprs(kernel, cfg, head_dim, dtype, variant)
    if kernel == "fwd_kernel" and cfg.gluon:
        kernel = "gluon_fwd_kernel"
    if kernel == "dkdv_kernel" and cfg.gluon:
        kernel = "gluon_dkdv_wide_kernel" if head_dim == 256 else "gluon_dkdv_kernel"
    if kernel == "dq_kernel" and cfg.gluon:
        kernel = "gluon_dq_kernel"
    by_name = {
        "fwd_kernel": module.fwd_kernel,
        "gluon_fwd_kernel": module.gluon_fwd_kernel,
        "dq_kernel": module.dq_kernel,
        "dkdv_kernel": module.dkdv_kernel,
        "gluon_dkdv_kernel": module.gluon_dkdv_kernel,
        "gluon_dkdv_wide_kernel": module.gluon_dkdv_wide_kernel,
        "gluon_dq_kernel": module.gluon_dq_kernel,
    }
    fn = by_name[kernel]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    data = _TRITON_DTYPE[dtype]
    kinds = {name: _POINTER_TYPES[name] for name in fn.arg_names if name not in consts}
    pointers = {name: "*" + (data if k == "data" else k) for name, k in kinds.items()}
    start = time.perf_counter()
    if cfg.gluon:
        compiled = compile_gluon(fn, pointers, consts, cfg.num_warps)
    else:
        signature, attrs = source_signature(fn, pointers, consts)
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        )
    meta = compiled.metadata
    scratch = int(getattr(meta, "global_scratch_size", 0) or 0)
    return dict(
        kernel=kernel,
        variant=variant,
        head_dim=head_dim,
        dtype=dtype,
        config=config_row(cfg),
        shared=int(meta.shared),
        # Global scratch (TMA descriptors) comes from a buffer of SCRATCH_PER_PROGRAM per program.
        scratch=scratch,
        warps=int(meta.num_warps),
        fits=int(meta.shared) <= SHARED_MEMORY_LIMIT and scratch <= SCRATCH_PER_PROGRAM,
        # Hopper's warpgroup matrix instructions (Triton emits them for sm_90 tl.dot).
        wgmma="wgmma" in compiled.asm["ptx"],
        # Threads the PTX requires: 384 for a warp-specialised build (three warpgroups).
        threads=threads_required(compiled.asm["ptx"]),
        spill_stores=spill_stores(compiled.asm["ptx"]) if spills else None,
        **(sass_counts(compiled.asm["cubin"]) if spills else dict.fromkeys(_SASS_COUNTS)),
        # fp32 divisions in the PTX (each a MUFU reciprocal and more, where Triton lowers
        # one per element: the Gluon forward divides once a row, `_consume_tile`).
        divisions=len(
            re.findall(r"\bdiv\.(?:full|rn|approx)(?:\.ftz)?\.f32\b", compiled.asm["ptx"])
        ),
        seconds=round(time.perf_counter() - start, 2),
    )


def config_row(cfg: Config) -> dict[str, Any]:
    """A build's config as its JSON line gives it, the same for every kernel: ``block_q`` the
    resident rows (query rows; keys of the dk/dv kernel, a `FlashBackwardConfig`'s
    ``block_keys``), ``block_k`` the streamed rows a step (keys; query rows of the dk/dv
    kernel, ``block_queries``), its warps, stages and flags (``atomic_dq``: the dk/dv
    kernel's; False for every other)."""
    backward = isinstance(cfg, FlashBackwardConfig)
    return dict(
        block_q=cfg.block_keys if backward else cfg.block_q,
        block_k=cfg.block_queries if backward else cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        warp_specialize=cfg.warp_specialize,
        atomic_dq=backward and cfg.atomic_dq,
        gluon=cfg.gluon,
    )


# `flash._tables.fused_segment_table`'s builds: (block, inner block) pairs of the Gluon and
# ordinary configs' tiles, with and without the causal forward's rule, masks from a table;
# and context parallelism's, masks from positions (`flash._tables.table_constexprs`' positions):
# rows against keys, and keys against a zigzag device's two chunks of rows.
TABLE_BUILDS = (
    *(
        (block, inner, after_full, None)
        for block, inner in ((128, 128), (128, 64), (64, 128), (64, 64), (128, 32))
        for after_full in (False, True)
    ),
    (128, 128, True, (1, 0, None)),
    (128, 128, False, (2, None, 0)),
)


def compile_table(
    block: int, inner: int, after_full: bool, positions: tuple | None, length: int = 65536
) -> dict[str, Any]:
    """Compile `kernels.triton._segment_table.segment_table_kernel` for sm_90 (``length`` ids a row on both
    axes: by default two whole steps of `flash._tables.CHUNK_ELEMENTS`; ``positions``:
    `flash._tables.table_constexprs`') and report its resources and spills."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..flash._tables import TABLE_WARPS, table_constexprs
    from ..kernels import _all as module

    if module.INTERPRET:
        raise RuntimeError("compile_table needs TRITON_INTERPRET unset (run it in a subprocess)")
    fn = module.segment_table_kernel
    consts = dict(
        table_constexprs(length, length, block, inner, after_full, positions), INTERPRET=False
    )
    pointers = {name: "*i32" for name in fn.arg_names if name not in consts}
    signature, attrs = source_signature(fn, pointers, consts)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=TABLE_WARPS, num_stages=1)
    )
    return dict(
        kernel="segment_table_kernel",
        block=block,
        inner=inner,
        after_full=after_full,
        positions=positions,
        shared=int(compiled.metadata.shared),
        spill_stores=spill_stores(compiled.asm["ptx"]),
    )


def _run_tool(tool: str, data: bytes, name: str, *args: str) -> str | None:
    """The output (stdout, then stderr) of Triton's ``tool`` (``ptxas``, or ``nvdisasm``
    beside it) run with ``args`` on ``data`` written to a temporary folder as ``name`` (the
    tool's own outputs land there too); None if the tool cannot be found."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    path = os.path.join(os.path.dirname(ptxas), tool) if ptxas else ""
    if not os.path.exists(path):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
        done = subprocess.run(
            [path, *args, name], cwd=tmp, capture_output=True, text=True, check=True
        )
    return done.stdout + done.stderr


def compile_sm90(
    fn: Any,
    pointer_kinds: dict[str, str],
    kinds: dict[str, str],
    constexprs: dict[str, Any],
    *,
    num_warps: int,
    num_stages: int,
) -> dict[str, Any]:
    """``triton.compile`` of ``fn`` for sm_90, and its resources: shared memory (``fits``
    Hopper's limit), ptxas' register spills and the seconds it took.

    Args:
        fn: the kernel.
        pointer_kinds: each pointer argument's kind (a Triton element type, or a name that
            ``kinds`` maps to one); every argument of ``fn`` not in ``constexprs`` is one.
        kinds: Triton element types of the kind names (``{"data": "bf16"}``).
        constexprs: every other argument.
        num_warps, num_stages: the launch options.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    pointers = {
        n: "*" + kinds.get(pointer_kinds[n], pointer_kinds[n])
        for n in fn.arg_names
        if n not in constexprs
    }
    signature, attrs = source_signature(fn, pointers, constexprs)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    shared = int(compiled.metadata.shared)
    return dict(
        shared=shared,
        fits=shared <= SHARED_MEMORY_LIMIT,
        spill_stores=spill_stores(compiled.asm["ptx"]),
        seconds=round(time.perf_counter() - start, 2),
    )


def report_build(row: dict[str, Any], build: Callable[[], dict[str, Any]]) -> bool:
    """Add ``build()``'s result to ``row`` and print it as one JSON line; True if the build
    failed, spilled registers or does not fit shared memory (every failure is reported, and
    the run fails after the last build)."""
    try:
        row.update(build())
        if row["spill_stores"]:
            row["error"] = f"ptxas spills {row['spill_stores']} bytes"
    except Exception as exc:  # report every failure, then fail the run
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    print(json.dumps(row), flush=True)
    return "error" in row or not row.get("fits", False)


def spill_stores(ptx: str) -> int | None:
    """Bytes of register spill stores ptxas reports for ``ptx`` (sm_90a); None if Triton's
    ptxas cannot be found."""
    log = _run_tool(
        "ptxas", ptx.encode(), "kernel.ptx", "-v", "--gpu-name=sm_90a", "-o", "kernel.o"
    )
    if log is None:
        return None
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


_SASS_COUNTS = ("half_swaps", "mask_unpacks")


def sass_counts(cubin: bytes) -> dict[str, int | None]:
    """Two counts in the SASS of ``cubin`` (None each if Triton's nvdisasm cannot be found):

    - ``half_swaps``: ``PRMT r, x, 0x5432, x``, a register's two 16-bit halves swapped,
      where ptxas lays a loop-carried 16-bit p out other than its matmul reads it (one a
      register and key block; `kernels.gluon._forward._as_carried`);
    - ``mask_unpacks``: ``SHF.R.U64``, 64-bit funnel shifts, which is how LLVM unpacks a
      thread's 64 compares of a block's positions after packing them into a 64-bit mask
      (which `kernels.gluon._forward._block_relative` keeps it from doing).
    """
    sass = _run_tool("nvdisasm", cubin, "kernel.cubin", "-c")
    if sass is None:
        return dict.fromkeys(_SASS_COUNTS)
    return dict(
        half_swaps=len(re.findall(r"PRMT R\d+, (R\d+), 0x5432, \1\b", sass)),
        mask_unpacks=len(re.findall(r"\bSHF\.R\.U64\b", sass)),
    )


KERNELS = {"fwd": ("fwd_kernel",), "bwd": ("dq_kernel", "dkdv_kernel")}
# Spilled bytes a Gluon build may have (none for the dq kernel), by kernel and whether it
# computes dq (``atomic_dq``): a few prologue and epilogue values (with dq inside, loop
# scalars; with per-block masks, a loop-invariant value) that ptxas keeps in local memory;
# those builds are faster than the ones without all the same. Every mask and the soft cap
# at once spills ~800 bytes: not offered here as clean. Per build:
# docs/performance-history.md#aotflashpy.
GLUON_SPILL_BYTES = {
    ("gluon_fwd_kernel", False): 48,
    ("gluon_dkdv_kernel", False): 128,
    ("gluon_dkdv_kernel", True): 320,
    # head_dim 256 (column split): none unmasked, causal or windowed; 16-28 bytes with
    # segment ids or a soft cap
    ("gluon_dkdv_wide_kernel", False): 32,
}


def _report(name: str, cfg: Config, head_dim: int, dtype: str, variant: str) -> bool:
    """Compile one kernel, print its JSON line; True if it failed or does not fit (or, for
    a Gluon kernel, spills more registers than it may: `GLUON_SPILL_BYTES`)."""
    try:
        row = compile_kernel(name, cfg, head_dim, dtype, variant, spills=cfg.gluon)
        allowed = GLUON_SPILL_BYTES.get((row["kernel"], row["config"]["atomic_dq"]), 0)
        if (row["spill_stores"] or 0) > allowed:
            row["error"] = f"ptxas spills {row['spill_stores']} bytes"
    except Exception as exc:  # report every failure, then fail the run
        row = dict(kernel=name, variant=variant, head_dim=head_dim, config=str(cfg),
                   error=f"{type(exc).__name__}: {exc}"[:2000])  # fmt: skip
    print(json.dumps(row), flush=True)
    return "error" in row or not row.get("fits", False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants", default="plain,all")
    parser.add_argument("--space", choices=["heuristic", "full"], default="heuristic")
    parser.add_argument(
        "--kernels", default="fwd_kernel,dq_kernel,dkdv_kernel", help="and segment_table"
    )
    args = parser.parse_args(argv)
    wanted = set(args.kernels.split(","))
    failed = 0
    if "segment_table" in wanted:  # `flash._tables.fused_segment_table`: no head dim or dtype
        for build in TABLE_BUILDS:
            try:
                row = compile_table(*build)
                if row["spill_stores"]:
                    row["error"] = f"ptxas spills {row['spill_stores']} bytes"
            except Exception as exc:  # report every failure, then fail the run
                row = dict(kernel="segment_table_kernel", build=build, error=repr(exc)[:2000])
            print(json.dumps(row), flush=True)
            failed += "error" in row
        wanted.discard("segment_table")
    itemsize = jnp.dtype(args.dtype).itemsize
    for head_dim in (int(h) for h in args.head_dims.split(",")):
        for variant in args.variants.split(","):
            side = variant in ("all", "masks")  # variants with segments and packing
            ws = variant in ("plain", "causal")  # masks the warp-specialised loop can do
            gluon = variant != "all"  # the Gluon forward takes no bias or dropout
            cap = "soft_cap" in VARIANTS[variant]
            tables = any(VARIANTS[variant].get(f) for f in ("window", "has_seg", "varlen"))
            for group, names in KERNELS.items():
                if args.space == "full" and group == "fwd":
                    space = fwd_search_space(
                        head_dim, itemsize, side, warp_specialize=ws, gluon=gluon, soft_cap=cap
                    )
                elif args.space == "full":
                    space = bwd_search_space(head_dim, itemsize, side)
                elif group == "fwd":  # the heuristic and every Hopper build the call can take
                    full = fwd_search_space(
                        head_dim, itemsize, side, warp_specialize=ws, gluon=gluon, soft_cap=cap
                    )
                    special = (c for c in full if c.warp_specialize or c.gluon)
                    heuristic = fwd_heuristic(
                        head_dim, itemsize, side, warp_specialize=ws, gluon=gluon,
                        soft_cap=cap, tabled=tables,
                    )  # fmt: skip
                    space = tuple(dict.fromkeys((heuristic, *special)))
                else:  # the heuristic and its twin (both ways of computing dq) where that
                    # fits, and the warp-specialised one where the call could take it
                    cfg = bwd_heuristic(head_dim, itemsize, side, soft_cap=cap)
                    twin = msgspec.structs.replace(cfg, atomic_dq=not cfg.atomic_dq)
                    fits = fits_shared_memory("dkdv", twin, head_dim, itemsize, side)
                    space = (cfg, twin) if fits else (cfg,)
                    if ws and itemsize == 2:  # explicit-config builds (see WS_BWD_CONFIGS)
                        space += WS_BWD_CONFIGS.get(head_dim, ())
                    if gluon and itemsize == 2:  # what Gluon dk/dv takes (no bias or
                        # dropout; with a soft cap two slots only: three spill in the loop)
                        # (masks beyond causal: none with dq inside, see bwd_search_space)
                        gluon_bwd = GLUON_BWD_CONFIGS.get(head_dim, ())
                        gluon_bwd = tuple(c for c in gluon_bwd if not (tables and c.atomic_dq))
                        space += gluon_bwd[:1] if cap else gluon_bwd
                for name in (n for n in names if n in wanted):
                    builds = space
                    if name == "dq_kernel":  # with atomic dq the dk/dv kernel computes dq;
                        # beside a Gluon dk/dv config runs the Gluon dq kernel or the
                        # ordinary one with other tiles (`dq_beside`), or with its tiles
                        # (`ordinary_dq_config`)
                        ordinary = tuple(
                            ordinary_dq_config(c) for c in space if not c.atomic_dq and not c.gluon
                        )
                        beside = tuple(
                            ordinary_dq_config(
                                ordinary_config(c, head_dim, itemsize, side, ("dq",))
                            )
                            for c in space
                            if c.gluon and not c.atomic_dq
                        )
                        beside += tuple(
                            filter(
                                None, (dq_beside(c, head_dim, cap, tabled=tables) for c in space)
                            )
                        )
                        builds = tuple(dict.fromkeys((*ordinary, *beside)))
                    for cfg in builds:
                        failed += _report(name, cfg, head_dim, args.dtype, variant)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
