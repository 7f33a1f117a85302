"""FlashAttention-4 (PyTorch, `flash_attn.cute`) decoding, the anchor of issue 66's targets.

Runs in its own process (PyTorch), in the same device call as `bench_decode.py` (JAX), on
the same shapes: contiguous decode (T = 1) over `bench_decode.DECODE_SHAPES` with FA4's own
split heuristic (``num_splits=0``), and paged decode over pages of 64 tokens in shuffled
order (``page_table``). GB/s counts the bytes of k and v a call must read, as
`bench_decode.kv_bytes` does. Outputs are checked against PyTorch's SDPA on the same inputs.

Timing: CUDA events around 20 calls, rounds interleaved between the contenders; the median
round gives ms per call.

Usage (GPU machine, FA4's wheels installed as ``../shared/gpu/README.md`` says):
    python3 packages/ejk-kernels-gpu/benchmarks/bench_decode_fa4.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _torch_timing import time_interleaved

# (B, S, N, K, H): bench_decode.DECODE_SHAPES (repeated: this process does not import JAX).
# The B1 rows at 8k and 32k after the first three (indices stay those of older runs).
DECODE_SHAPES = [(32, 8192, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128),
                 (1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128)]  # fmt: skip
PAGE = 64
CALLS = 20


def bench_shape(shape, rounds: int) -> list[dict]:
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

    B, S, N, K, H = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q, k, v = (
        torch.randn(size, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        for size in [(B, 1, N, H), (B, S, K, H), (B, S, K, H)]
    )
    per = S // PAGE
    order = torch.randperm(B * per, generator=gen, device="cuda")
    table = order.reshape(B, per).to(torch.int32).contiguous()
    inverse = torch.argsort(order)
    k_pages = k.reshape(B * per, PAGE, K, H)[inverse].contiguous()
    v_pages = v.reshape(B * per, PAGE, K, H)[inverse].contiguous()
    seqused = torch.full((B,), S, device="cuda", dtype=torch.int32)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    fns = {
        "fa4 contiguous": lambda: flash_attn_func(q, k, v, num_splits=0),
        "fa4 paged": lambda: flash_attn_varlen_func(
            q, k_pages, v_pages, page_table=table, seqused_k=seqused, num_splits=0
        ),
    }
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    rows, working = [], {}
    for name, fn in fns.items():
        try:
            out = first(fn()).float()
            err = float((out - expect.float()).norm() / expect.float().norm())
            working[name] = fn
            rows.append(dict(impl=name, rel_err_vs_sdpa=err))
        except Exception as exc:  # report each contender
            rows.append(dict(impl=name, error=f"{type(exc).__name__}: {str(exc)[:400]}"))
    timed = time_interleaved(working, rounds, CALLS)
    nbytes = 2 * B * S * K * H * 2
    for row in rows:
        if row["impl"] in timed:
            med, best = timed[row["impl"]]
            row |= dict(ms=med, best_ms=best, gbps=nbytes / (med * 1e-3) / 1e9)
        row |= dict(bench="decode", B=B, S=S, N=N, K=K, H=H)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default="")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    import flash_attn

    rows = []
    for shape in DECODE_SHAPES:
        try:
            rows += bench_shape(shape, args.rounds)
        except Exception as exc:
            rows.append(dict(shape=shape, error=f"{type(exc).__name__}: {str(exc)[:400]}"))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        info = dict(
            script="bench_decode_fa4.py", commit=args.commit, device=torch.cuda.get_device_name(),
            versions=dict(torch=torch.__version__, flash_attn=getattr(flash_attn, "__version__", "")),
        )  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
