"""Figures that need no TPU: mask preprocessing cost, block sparsity, deviceless compile time.

Run: python benchmarks/mask_and_compile.py   (from packages/ejk-kernels-tpu, with libtpu installed)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ejk_kernels_tpu import (
    CausalMask,
    ChunkedCausalMask,
    LocalMask,
    block_sparse_heuristic,
    blocksparse_attention,
    process_mask,
    process_mask_dkv,
    vmem_bytes,
)
from ejk_kernels_tpu._masks import stored_tiles


def mask_rows():
    print(
        "| mask | T=S | block | process_mask s | process_mask_dkv s | blocks computed "
        "| grid steps with shrink_grid | partial tiles stored | SMEM table dtype |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (8192, 32768):
        for name, mask in (
            ("causal", CausalMask((n, n))),
            ("local(1024, 0)", LocalMask((n, n), window_size=(1024, 0))),
            ("chunked(2048)", ChunkedCausalMask((n, n), chunk_size=2048)),
        ):
            block = (512, 512)
            t0 = time.perf_counter()
            info, _ = process_mask(mask, block, shrink_grid=False)
            t1 = time.perf_counter()
            process_mask_dkv(mask, block, shrink_grid=False)
            t2 = time.perf_counter()
            bm = np.asarray(info.block_mask)
            frac = float((bm != 0).mean())
            shrunk = process_mask(mask, block)[0].block_mask.shape[2] / bm.shape[2]
            tiles = process_mask(stored_tiles(mask), block, shrink_grid=False)[0]
            print(
                f"| {name} | {n} | {block} | {t1 - t0:.2f} | {t2 - t1:.2f} | {frac:.1%} | {shrunk:.1%} "
                f"| {tiles.partial_mask_blocks.shape[0]} | {info.data_next.dtype} |"
            )


def compile_rows():
    from jax.experimental import topologies

    print(
        "\n| topology | B,T,N,K,H | dtype | heuristic config (fwd / bwd) | fwd+bwd compile s | VMEM est. fwd/dq/dkv MiB |"
    )
    print("|---|---|---|---|---|---|")
    for topo_name in ("v5e:2x2", "v6e:2x2"):
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topo_name)
        mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        for t, h, dtype in (
            (4096, 128, jnp.bfloat16),
            (8192, 64, jnp.bfloat16),
            (2048, 256, jnp.float32),
        ):
            b, n, kh = 1, 8, 2
            q = jax.ShapeDtypeStruct((b, t, n, h), dtype, sharding=sh)
            kv = jax.ShapeDtypeStruct((b, t, kh, h), dtype, sharding=sh)
            mask = CausalMask((t, t))
            cfg = block_sparse_heuristic(t, t, h, jnp.dtype(dtype).itemsize)

            def loss(q, k, v, mask=mask, cfg=cfg):
                out = blocksparse_attention(q, k, v, mask, config=cfg, interpret=False)
                return out.astype(jnp.float32).sum()

            t0 = time.perf_counter()
            jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
            dt = time.perf_counter() - t0
            item = jnp.dtype(dtype).itemsize
            est = [
                vmem_bytes(cfg.block_q, cfg.block_kv, h, item, "fwd"),
                vmem_bytes(cfg.block_q_dq, cfg.block_kv_dq, h, item, "dq"),
                vmem_bytes(cfg.block_q_dkv, cfg.block_kv_dkv, h, item, "dkv"),
            ]
            print(
                f"| {topo_name} | {b},{t},{n},{kh},{h} | {jnp.dtype(dtype).name} "
                f"| {cfg.block_q}x{cfg.block_kv} / {cfg.block_q_dq}x{cfg.block_kv_dq} "
                f"| {dt:.1f} | {' / '.join(f'{e / 2**20:.1f}' for e in est)} |"
            )


if __name__ == "__main__":
    mask_rows()
    compile_rows()
