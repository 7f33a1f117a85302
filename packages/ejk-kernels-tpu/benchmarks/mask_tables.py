"""What the mask costs a call, with the mask function and with stored tiles (no TPU needed).

For each mask at T = S = 32k and 128k (B=1, N=8, K=2, H=128, bf16, the heuristic config):
bytes the three kernels (forward, dq, dkv) move from HBM to resolve partial blocks, counted
from the block tables as Pallas' pipeline issues the copies (a block is copied when its
index differs from the previous grid step's), the HBM those inputs occupy, the tables'
SMEM bytes, the mask preprocessing time (the three kernels' tables), and the deviceless
Mosaic compile time of forward + backward for a v5e topology, tables already built (needs
libtpu).

Run: python benchmarks/mask_tables.py [--lengths 32768 131072] [--no-compile]
"""

from __future__ import annotations

import argparse
import os
import re
import time

# libtpu (deviceless compiles only) takes a machine-wide lock unless several processes may
# load it (as tests/conftest.py). Set before a JAX backend starts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np

from ejk_kernels_tpu import (
    CausalMask,
    ChunkedCausalMask,
    LocalMask,
    block_sparse_heuristic,
    blocksparse_attention,
)
from ejk_kernels_tpu._mask_info import _classify, _process
from ejk_kernels_tpu._masks import stored_tiles

B, N, K, H = 1, 8, 2, 128
DTYPE = jnp.bfloat16


def _masks(n: int) -> dict:
    return {
        "causal": CausalMask((n, n)),
        "local(1024, 0)": LocalMask((n, n), window_size=(1024, 0)),
        "chunked(8192)": ChunkedCausalMask((n, n), chunk_size=8192),
        r"causal & local(4096, 0) \| chunked(2048)": (
            CausalMask((n, n)) & LocalMask((n, n), window_size=(4096, 0))
        )
        | ChunkedCausalMask((n, n), chunk_size=2048),
    }


def _copies(index: np.ndarray, walked_axis: int) -> int:
    """Copies a pipelined input issues over one head's grid: steps whose block index
    differs from the previous step's (grid order: outer blocks, then the walked axis)."""
    steps = np.moveaxis(index[0], walked_axis - 1, -1).reshape(-1)
    return 1 + int((steps[1:] != steps[:-1]).sum())


def _mask_traffic(mask, block: tuple[int, int], is_dkv: bool, use_function: bool) -> dict:
    """HBM bytes one kernel moves for its mask per (batch, head), and what it keeps in HBM/SMEM."""
    target = mask if use_function else stored_tiles(mask)
    kwargs = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1, shrink_grid=True)
    info, fn = _process(target, block, is_dkv=is_dkv, **kwargs)
    block_q, block_kv = block
    walked = 1 if is_dkv else 2  # the tables' walked axis
    if fn is not None or info.partial_mask_blocks is None:
        # The mask function is evaluated on grid positions: no mask input at all.
        moved = stored = 0
    else:
        # A tile is copied when mask_next changes between steps (int8 [block_q, block_kv]).
        moved = _copies(np.asarray(info.mask_next), walked) * block_q * block_kv
        stored = info.partial_mask_blocks.shape[0] * block_q * block_kv
    smem = sum(np.asarray(a).nbytes for a in info[:3] if a is not None)
    return {"moved": moved, "stored": stored, "smem": smem}


def _compile_seconds(mask, n: int, use_function: bool) -> str:
    """Seconds to lower and compile, or the compiler's reason (such as an SMEM overflow)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((B, n, N, H), DTYPE, sharding=sh)
    kv = jax.ShapeDtypeStruct((B, n, K, H), DTYPE, sharding=sh)

    def loss(q, k, v):
        out = blocksparse_attention(q, k, v, mask, interpret=False, mask_function=use_function)
        return out.astype(jnp.float32).sum()

    # The tables are cached from the byte count (same masks and blocks): this is the
    # lowering and Mosaic compile of the three kernels alone.
    t0 = time.perf_counter()
    try:
        jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    except Exception as err:  # a compile that does not fit is a figure too
        found = re.search(r"Ran out of memory in memory space \w+[^\n\\]*", str(err))
        return f"fails: {found.group(0).strip()}" if found else f"fails: {type(err).__name__}"
    return f"{time.perf_counter() - t0:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    print(
        "| T=S | mask | path | mask bytes moved per head, fwd+dq+dkv | mask inputs in HBM "
        "| SMEM tables | preprocess s | v5e fwd+bwd compile s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        cfg = block_sparse_heuristic(n, n, H, jnp.dtype(DTYPE).itemsize)
        blocks = (
            ((cfg.block_q, cfg.block_kv), False),
            ((cfg.block_q_dq, cfg.block_kv_dq), False),
            ((cfg.block_q_dkv, cfg.block_kv_dkv), True),
        )
        for name, mask in _masks(n).items():
            for use_function in (True, False):
                _classify.cache_clear()
                t0 = time.perf_counter()
                rows = [_mask_traffic(mask, b, d, use_function) for b, d in blocks]
                prep = time.perf_counter() - t0
                total = {key: sum(r[key] for r in rows) for key in rows[0]}
                comp = "-" if args.no_compile else _compile_seconds(mask, n, use_function)
                path = "mask function" if use_function else "stored tiles"
                print(
                    f"| {n} | {name} | {path} | {total['moved'] / 2**20:.2f} MiB "
                    f"| {total['stored'] / 2**10:.0f} KiB | {total['smem'] / 2**10:.0f} KiB "
                    f"| {prep:.1f} | {comp} |",
                    flush=True,
                )
    print(f"\nconfig at the last T: {cfg}; jax {jax.__version__}")


if __name__ == "__main__":
    main()
