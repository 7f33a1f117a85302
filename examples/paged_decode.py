"""Decode a few steps of a tiny attention layer through a paged KV cache.

A randomly initialised one-layer "model" (embedding, q/k/v/o projections, tied output)
prefills three prompts of different lengths in one ragged call, then decodes greedily in a
``jax.jit``-ted step that appends each new token's keys and values to a `PagedKVCache` and
attends over it with `paged_attention`. Every attention output, prefill and decode, is
checked against `reference_attention` over the sequence's keys and values laid out densely,
computed inside the same jitted step: each step compiles once, as a server's would.

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


def init_params(seed: int) -> Params:
    """Random weights, scaled so activations stay O(1) (drawn by NumPy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    shapes = [
        (VOCAB, D_MODEL),
        (D_MODEL, HEADS * HEAD_DIM),
        (D_MODEL, KV_HEADS * HEAD_DIM),
        (D_MODEL, KV_HEADS * HEAD_DIM),
        (HEADS * HEAD_DIM, D_MODEL),
    ]
    return Params(
        *(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for s in shapes)
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


def dense_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array, query_pos: jax.Array
) -> jax.Array:
    """`reference_attention` over each sequence's keys laid out densely: ``k, v [B, L, K, H]``
    hold sequence b's keys at positions ``< lens[b]`` (the rest is ignored), and query
    ``q[b, t]`` at position ``query_pos[b, t]`` sees the keys up to its own (causal)."""
    key_pos = jnp.arange(k.shape[1])
    visible = (key_pos < lens[:, None, None]) & (key_pos <= query_pos[..., None])  # [B, T, L]
    return reference_attention(q, k, v, mask=visible[:, None])


def main(num_steps: int = 4, prompt_lens: tuple[int, ...] = (5, 9, 3), seed: int = 0) -> None:
    """Prefill ``prompt_lens`` prompts, decode ``num_steps`` tokens, check every step.

    The prefill and the decode step are each one jitted function, compiled once; each also
    computes the dense reference (over a fixed-size copy of every sequence's keys and
    values), so the check costs one comparison per step, not a compilation.

    Raises:
        AssertionError: an attention output differs from the dense reference.
    """
    rng = np.random.default_rng(seed)
    params = init_params(seed)
    batch = len(prompt_lens)
    slots = np.arange(batch, dtype=np.int32) * 2  # any slots of the cache
    tol = attention_tolerance(jnp.float32, "out")
    longest = max(prompt_lens)

    # Prefill: prompts right-padded to [B, L]; each writes its own length into the cache,
    # and the queries go packed (ragged) so no padding row is computed.
    prompts = np.zeros((batch, longest), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, VOCAB, n)
    seq = np.repeat(np.arange(batch), prompt_lens)
    pos = np.concatenate([np.arange(n) for n in prompt_lens])
    cu_q_lens = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)
    lens = np.asarray(prompt_lens, np.int32)

    @jax.jit
    def prefill(params: Params, prompts: jax.Array):
        cache = PagedKVCache.create(
            num_pages=32,
            page_size=4,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            max_seqs=2 * batch,
            pages_per_seq=8,
        )
        q, k, v = project(params, prompts)
        cache = cache.append(k, v, slots, lens)
        table, kv_lens = cache.lookup(slots)
        out = ragged_paged_attention(
            q[seq, pos], cache.k_pages, cache.v_pages, table, kv_lens, cu_q_lens
        )
        # The dense truth: every sequence's keys and values, room for the decoded ones too.
        dense = jnp.zeros((2, batch, longest + num_steps, KV_HEADS, HEAD_DIM), jnp.float32)
        dense = dense.at[:, :, :longest].set(jnp.stack([k, v]))
        every = jnp.broadcast_to(jnp.arange(longest), prompts.shape)
        expected = dense_reference(q, *dense[:, :, :longest], lens, every)[seq, pos]
        tokens = next_tokens(params, out[np.cumsum(prompt_lens) - 1])
        return cache, dense, out, expected, tokens

    cache, dense, out, expected, tokens = prefill(params, prompts)
    assert_allclose(out, expected, rtol=tol, atol=tol, err_msg="prefill")

    # Donating the cache lets XLA write the new tokens into the pages in place.
    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def decode_step(params: Params, cache: PagedKVCache, dense: jax.Array, tokens: jax.Array):
        q, k, v = project(params, tokens[:, None])
        lens = cache.lookup(slots)[1]  # before this token: the new token's position
        cache = cache.append(k, v, slots)
        table, kv_lens = cache.lookup(slots)
        out = paged_attention(q, cache.k_pages, cache.v_pages, table, kv_lens)
        dense = dense.at[:, np.arange(batch), lens].set(jnp.stack([k[:, 0], v[:, 0]]))
        expected = dense_reference(q, *dense, kv_lens, lens[:, None])
        tokens = next_tokens(params, out[:, 0])
        return cache, dense, out, expected, tokens, cache.overflow.any(), kv_lens

    for step in range(num_steps):
        cache, dense, out, expected, tokens, overflow, kv_lens = decode_step(
            params, cache, dense, tokens
        )
        assert not overflow, "the cache ran out of pages"
        assert_allclose(out, expected, rtol=tol, atol=tol, err_msg=f"step {step}")
        print(
            f"step {step}: tokens {np.asarray(tokens).tolist()}, lengths {np.asarray(kv_lens).tolist()}"
        )
    num_free = jax.jit(lambda cache: cache.release(slots).num_free)(cache)
    assert int(num_free) == cache.k_pages.shape[0], "released pages went missing"
    print(f"{num_steps} decode steps match the dense reference")


# e4m3 keeps 3 mantissa bits: a token's values round by up to 2**-4 (about 2.5 % RMS) on
# k and on v, so the outputs move by a few percent (here 1.8-2.9 % over seeds 0-2).
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
    batch = len(prompt_lens)
    slots = np.arange(batch, dtype=np.int32)
    prompts = np.zeros((batch, max(prompt_lens)), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, VOCAB, n)
    lens = np.asarray(prompt_lens, np.int32)

    @jax.jit
    def prefill(params: Params, prompts: jax.Array):
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        caches = [
            PagedKVCache.create(num_pages=32, page_size=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                max_seqs=batch, pages_per_seq=8, dtype=dtype)
            for dtype in (jnp.bfloat16, jnp.float8_e4m3fn)
        ]  # fmt: skip
        _, k, v = project(params, prompts)
        return params, [cache.append(k, v, slots, lens) for cache in caches]

    @jax.jit
    def step(params: Params, caches: list[PagedKVCache], tokens: jax.Array):
        q, k, v = project(params, tokens[:, None])
        caches = [cache.append(k, v, slots) for cache in caches]
        out_bf16, out_fp8 = (cache.attend(q, slots).astype(jnp.float32) for cache in caches)
        error = jnp.linalg.norm(out_fp8 - out_bf16) / jnp.linalg.norm(out_bf16)
        return caches, error, next_tokens(params, out_bf16[:, 0].astype(jnp.bfloat16))

    params, caches = prefill(init_params(seed), prompts)
    tokens = prompts[np.arange(batch), lens - 1]
    worst = 0.0
    for i in range(num_steps):
        caches, error, tokens = step(params, caches, tokens)
        assert error <= FP8_TOLERANCE, f"step {i}: FP8 relative error {float(error):.4f}"
        worst = max(worst, float(error))
    print(f"FP8 cache: {num_steps} decode steps within {worst:.2%} of the bfloat16 cache")
    return worst


if __name__ == "__main__":
    main()
    fp8_against_bf16()
