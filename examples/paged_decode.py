"""Decode a few steps of a tiny attention layer through a paged KV cache.

A randomly initialised one-layer "model" (embedding, q/k/v/o projections, tied output)
prefills three prompts of different lengths in one ragged call, then decodes greedily in a
``jax.jit``-ted step that appends each new token's keys and values to a `PagedKVCache` and
attends over it with `paged_attention`. Every attention output, prefill and decode, is
checked against `reference_attention` over the sequence's keys and values laid out densely.

Then the same decode runs through an FP8 cache (``dtype=jnp.float8_e4m3fn``: pages in e4m3,
a float32 scale per token and kv head) beside a bfloat16 one, fed the same tokens, and the
FP8 attention outputs are checked against the bfloat16 cache's (`fp8_against_bf16`).

Run: ``uv run python examples/paged_decode.py`` (CPU is fine).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ejk_attention import (
    PagedKVCache,
    paged_attention,
    ragged_paged_attention,
    reference_attention,
)
from ejk_sequtils import assert_allclose, attention_tolerance

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 50, 32, 4, 2, 8


class Params(NamedTuple):
    embed: jax.Array  # [VOCAB, D]
    wq: jax.Array  # [D, N * H]
    wk: jax.Array  # [D, K * H]
    wv: jax.Array  # [D, K * H]
    wo: jax.Array  # [N * H, D]


def init_params(key: jax.Array) -> Params:
    """Random weights, scaled so activations stay O(1)."""
    ks = jax.random.split(key, 5)
    shapes = [
        (VOCAB, D_MODEL),
        (D_MODEL, HEADS * HEAD_DIM),
        (D_MODEL, KV_HEADS * HEAD_DIM),
        (D_MODEL, KV_HEADS * HEAD_DIM),
        (HEADS * HEAD_DIM, D_MODEL),
    ]
    return Params(
        *(jax.random.normal(k, s) / np.sqrt(s[0]) for k, s in zip(ks, shapes, strict=True))
    )


def project(params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``tokens [B, T]`` -> ``q [B, T, N, H]``, ``k, v [B, T, K, H]``."""
    x = params.embed[tokens]
    b, t = tokens.shape
    q = (x @ params.wq).reshape(b, t, HEADS, HEAD_DIM)
    k = (x @ params.wk).reshape(b, t, KV_HEADS, HEAD_DIM)
    v = (x @ params.wv).reshape(b, t, KV_HEADS, HEAD_DIM)
    return q, k, v


def next_tokens(params: Params, attn: jax.Array) -> jax.Array:
    """Greedy next token from the attention output of each sequence's last query ``[B, N, H]``."""
    h = attn.reshape(attn.shape[0], -1) @ params.wo
    return jnp.argmax(h @ params.embed.T, axis=-1).astype(jnp.int32)


def main(num_steps: int = 4, prompt_lens: tuple[int, ...] = (5, 9, 3), seed: int = 0) -> None:
    """Prefill ``prompt_lens`` prompts, decode ``num_steps`` tokens, check every step.

    Raises:
        AssertionError: an attention output differs from the dense reference.
    """
    rng = np.random.default_rng(seed)
    params = init_params(jax.random.key(seed))
    batch = len(prompt_lens)
    slots = jnp.arange(batch, dtype=jnp.int32) * 2  # any slots of the cache
    cache = PagedKVCache.create(
        num_pages=32,
        page_size=4,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_seqs=2 * batch,
        pages_per_seq=8,
    )
    tol = attention_tolerance(jnp.float32, "out")

    # Prefill: prompts right-padded to [B, L]; each writes its own length into the cache,
    # and the queries go packed (ragged) so no padding row is computed.
    longest = max(prompt_lens)
    prompts = np.zeros((batch, longest), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, VOCAB, n)
    q, k, v = project(params, jnp.asarray(prompts))
    cache = cache.append(k, v, slots, jnp.asarray(prompt_lens, jnp.int32))
    seq = np.repeat(np.arange(batch), prompt_lens)
    pos = np.concatenate([np.arange(n) for n in prompt_lens])
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(prompt_lens)]), jnp.int32)
    table, kv_lens = cache.lookup(slots)
    out = ragged_paged_attention(
        q[seq, pos], cache.k_pages, cache.v_pages, table, kv_lens, cu_q_lens
    )
    history = [(k[b, :n], v[b, :n]) for b, n in enumerate(prompt_lens)]  # the dense truth
    for b, n in enumerate(prompt_lens):
        expected = reference_attention(
            q[b : b + 1, :n], *(x[None] for x in history[b]), causal=True
        )
        assert_allclose(out[seq == b], expected[0], rtol=tol, atol=tol, err_msg=f"prefill {b}")
    last_rows = np.cumsum(prompt_lens) - 1
    tokens = next_tokens(params, out[last_rows])

    # Donating the cache lets XLA write the new tokens into the pages in place.
    @functools.partial(jax.jit, donate_argnums=0)
    def decode_step(cache: PagedKVCache, tokens: jax.Array):
        q, k, v = project(params, tokens[:, None])
        cache = cache.append(k, v, slots)
        table, kv_lens = cache.lookup(slots)
        out = paged_attention(q, cache.k_pages, cache.v_pages, table, kv_lens)
        return cache, out, k, v

    for step in range(num_steps):
        cache, out, k, v = decode_step(cache, tokens)
        assert not cache.overflow.any(), "the cache ran out of pages"
        for b in range(batch):
            history[b] = (
                jnp.concatenate([history[b][0], k[b]]),
                jnp.concatenate([history[b][1], v[b]]),
            )
            q_b = project(params, tokens[b : b + 1, None])[0]
            # One query at the last position sees every key: no mask.
            expected = reference_attention(q_b, *(x[None] for x in history[b]))
            assert_allclose(
                out[b], expected[0], rtol=tol, atol=tol, err_msg=f"step {step}, sequence {b}"
            )
        tokens = next_tokens(params, out[:, 0])
        print(
            f"step {step}: tokens {np.asarray(tokens).tolist()}, lengths {np.asarray(cache.kv_lens).tolist()}"
        )
    cache = cache.release(slots)
    assert int(cache.num_free) == cache.k_pages.shape[0], "released pages went missing"
    print(f"{num_steps} decode steps match the dense reference")


# e4m3 keeps 3 mantissa bits: a token's values round by up to 2**-4 (about 2.5 % RMS) on
# k and on v, so the outputs move by a few percent (here 1.9-2.4 % over seeds 0-2).
FP8_TOLERANCE = 0.04


def fp8_against_bf16(
    num_steps: int = 4, prompt_lens: tuple[int, ...] = (5, 9, 3), seed: int = 0
) -> float:
    """Prefill and decode through a bfloat16 cache and an FP8 cache side by side (the same
    tokens, chosen by the bfloat16 run); every attention output of the FP8 cache must be
    within `FP8_TOLERANCE` (relative, Frobenius norm) of the bfloat16 cache's.

    Returns:
        The largest relative error seen.

    Raises:
        AssertionError: an FP8 output is further than `FP8_TOLERANCE` from the bfloat16 one.
    """
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(jax.random.key(seed)))
    batch = len(prompt_lens)
    slots = jnp.arange(batch, dtype=jnp.int32)
    caches = [
        PagedKVCache.create(num_pages=32, page_size=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                            max_seqs=batch, pages_per_seq=8, dtype=dtype)
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn)
    ]  # fmt: skip
    prompts = np.zeros((batch, max(prompt_lens)), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, VOCAB, n)
    _, k, v = project(params, jnp.asarray(prompts))
    lens = jnp.asarray(prompt_lens, jnp.int32)
    caches = [cache.append(k, v, slots, lens) for cache in caches]

    @jax.jit
    def step(caches: list[PagedKVCache], tokens: jax.Array):
        q, k, v = project(params, tokens[:, None])
        caches = [cache.append(k, v, slots) for cache in caches]
        return caches, [cache.attend(q, slots) for cache in caches]

    tokens = jnp.asarray(prompts[np.arange(batch), np.asarray(prompt_lens) - 1])
    worst = 0.0
    for i in range(num_steps):
        caches, (out_bf16, out_fp8) = step(caches, tokens)
        ref = np.asarray(out_bf16, np.float32)
        error = float(np.linalg.norm(np.asarray(out_fp8, np.float32) - ref) / np.linalg.norm(ref))
        assert error <= FP8_TOLERANCE, f"step {i}: FP8 relative error {error:.4f}"
        worst = max(worst, error)
        tokens = next_tokens(params, out_bf16[:, 0])
    print(f"FP8 cache: {num_steps} decode steps within {worst:.2%} of the bfloat16 cache")
    return worst


if __name__ == "__main__":
    main()
    fp8_against_bf16()
