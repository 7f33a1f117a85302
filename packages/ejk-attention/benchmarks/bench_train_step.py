"""One training step of a small GQA decoder-only transformer, tokens/s per attention library.

The step is what a user's training loop runs: embedding, ``LAYERS`` pre-norm blocks (RMSNorm,
GQA attention, a GELU MLP), the next-token cross-entropy, its gradients and an AdamW update
(optax), in one ``jax.jit``, bf16 activations over float32 parameters. Only the attention
call differs between contenders, all in one process on the same parameters and tokens,
timed in interleaved rounds (ejk-kernels-gpu's ``_timing``):

- ``causal``: one sequence of ``T`` tokens; ejk (``ejk_attention.flash_attention``,
  ``causal=True``), fa4-jax (``flash_attn``) and cuDNN (``jax.nn``);
- ``documents``: the same ``T`` tokens as 16 packed documents; ejk by segment ids and by
  ``cu_seqlens``, fa4-jax by ``flash_attn_varlen`` (cuDNN through ``jax.nn`` takes packed
  documents only as a dense ``T x T`` mask, which is not a contender at this length).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``; fa4-jax as
``../shared/gpu/README.md`` says):
    python3 packages/ejk-attention/benchmarks/bench_train_step.py [--seq 32768] [--rounds 5]
        [--json out.json --commit SHA]
    (--tiny: a tiny model and sequence, to check the script on a CPU.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax  # in the GPU image; on a CPU: uv run --with optax

_KERNEL_BENCHMARKS = Path(__file__).resolve().parents[2] / "ejk-kernels-gpu" / "benchmarks"
sys.path.insert(0, str(_KERNEL_BENCHMARKS))

import _fa4  # noqa: E402
from _timing import contender, time_rounds  # noqa: E402

import ejk_attention  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    """The transformer's sizes."""

    vocab: int = 8192
    width: int = 2048
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    mlp: int = 8192


TINY = Model(vocab=64, width=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64)


def init(model: Model, key: jax.Array) -> dict:
    """Float32 parameters, scaled normal draws."""
    keys = iter(jax.random.split(key, 2 + 6 * model.layers))

    def dense(fan_in: int, *shape: int) -> jax.Array:
        return jax.random.normal(next(keys), (fan_in, *shape), jnp.float32) * fan_in**-0.5

    w, h = model.width, model.head_dim
    blocks = [
        {
            "norm1": jnp.ones((w,)),
            "q": dense(w, model.heads * h),
            "kv": dense(w, 2 * model.kv_heads * h),
            "o": dense(model.heads * h, w),
            "norm2": jnp.ones((w,)),
            "up": dense(w, model.mlp),
            "down": dense(model.mlp, w),
        }
        for _ in range(model.layers)
    ]
    return {"embed": dense(w, model.vocab).T, "blocks": blocks, "norm": jnp.ones((w,))}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def loss_fn(
    params: dict, tokens: jax.Array, attend: Callable, model: Model, side: tuple
) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens [B, T]``; ``attend(q, k, v, *side)``."""
    bf16 = jnp.bfloat16
    b, t = tokens.shape
    x = params["embed"][tokens].astype(bf16)
    for blk in params["blocks"]:
        y = _rms_norm(x, blk["norm1"])
        q = (y @ blk["q"].astype(bf16)).reshape(b, t, model.heads, model.head_dim)
        kv = (y @ blk["kv"].astype(bf16)).reshape(b, t, 2, model.kv_heads, model.head_dim)
        o = attend(q, kv[:, :, 0], kv[:, :, 1], *side).reshape(b, t, -1)
        x = x + o @ blk["o"].astype(bf16)
        y = _rms_norm(x, blk["norm2"])
        x = x + jax.nn.gelu(y @ blk["up"].astype(bf16)) @ blk["down"].astype(bf16)
    logits = (_rms_norm(x, params["norm"]) @ params["embed"].T.astype(bf16)).astype(jnp.float32)
    labels = jnp.roll(tokens, -1, axis=1)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def train_step(attend: Callable, model: Model, optimizer) -> Callable:
    """``step(params, opt_state, tokens, *side) -> (params, opt_state, loss)``."""

    def step(params, opt_state, tokens, *side):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, attend, model, side)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def contenders(documents: int, tiny: bool) -> list[tuple[str, Callable | None, str, str]]:
    """``(name, attend, side input, why not)``: each library's attention for the case."""
    facade = ejk_attention.flash_attention
    if tiny:  # on a CPU the facade picks XLA; the Triton kernels are the ones under test
        import functools

        facade = functools.partial(facade, implementation="triton")
    if not documents:
        fa4, why = _fa4.call(causal=True)
        return [
            ("ejk", lambda q, k, v: facade(q, k, v, causal=True), "", ""),
            ("fa4-jax", fa4, "", why),
            ("cudnn", _cudnn, "", "needs a GPU" if tiny else ""),
        ]
    fa4, why = _fa4.call(causal=True, packed=True)
    return [
        (
            "ejk segment_ids",
            lambda q, k, v, i: facade(q, k, v, causal=True, segment_ids=i),
            "ids",
            "",
        ),
        (
            "ejk cu_seqlens",
            lambda q, k, v, c: facade(q, k, v, causal=True, cu_seqlens_q=c),
            "cu",
            "",
        ),
        ("fa4-jax varlen", fa4, "cu", why),
    ]


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def bench(seq: int, documents: int, rounds: int, tiny: bool) -> list[dict]:
    model = TINY if tiny else Model()
    params = init(model, jax.random.key(0))
    optimizer = optax.adamw(1e-4)
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(1), (1, seq), 0, model.vocab)
    length = seq // max(documents, 1)
    sides = {
        "ids": (jnp.repeat(jnp.arange(max(documents, 1), dtype=jnp.int32), length)[None],),
        "cu": (jnp.arange(max(documents, 1) + 1, dtype=jnp.int32) * length,),
        "": (),
    }
    cases = []
    for name, attend, side, why in contenders(documents, tiny):
        row = {"case": f"{'documents' if documents else 'causal'} T{seq}", "impl": name}
        if why or attend is None:
            print(json.dumps({**row, "skipped": why}), flush=True)
            continue
        step = train_step(attend, model, optimizer)
        # contender() jits the function and appends its cotangent argument: none here.
        cases.append(contender(row, step, (params, opt_state, tokens, None), False, sides[side]))
    rows = time_rounds(cases, rounds, 1.0)
    for r in rows:
        if "fwd_ms" in r:
            r["step_ms"] = r.pop("fwd_ms")
            r["tokens_per_s"] = seq / (r["step_ms"] * 1e-3)
        print(json.dumps(r, default=str), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768, help="tokens in the step (default 32768)")
    parser.add_argument("--documents", type=int, default=16, help="packed documents (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--json", default="", help="write every row, device and versions here")
    parser.add_argument("--commit", default="", help="the commit under test (for the JSON)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a CPU check)")
    args = parser.parse_args(argv)
    seq = 64 if args.tiny else args.seq
    rows = bench(seq, 0, args.rounds, args.tiny) + bench(
        seq, args.documents, args.rounds, args.tiny
    )
    print(f"\n{'case':<18}{'impl':<18}{'step ms':>10}{'tokens/s':>12}")
    for r in rows:
        if "step_ms" in r:
            print(f"{r['case']:<18}{r['impl']:<18}{r['step_ms']:>10.2f}{r['tokens_per_s']:>12.0f}")
        else:
            print(f"{r['case']:<18}{r['impl']:<18}  error: {r.get('error', '')[:80]}")
    if args.json:
        from gpu_conformance import run_info

        info = run_info("bench_train_step.py", args.commit)
        info["script"] = "packages/ejk-attention/benchmarks/bench_train_step.py"
        with open(args.json, "w") as f:
            json.dump({**info, "model": dataclasses.asdict(Model()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
