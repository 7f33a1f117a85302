"""One conformance suite, table-driven: every kernel backend against the definition.

Each backend is a subclass of `Conformance` naming the features it refuses; every case
of `CASES` runs on each (values, lse and the gradients of every input that carries a
value), so a new backend gets every case for free. A backend that lacks a feature must
refuse it with NotImplementedError, never compute something else.

``xla`` is the reference itself (tested against a float64 loop in ejk-sequtils), so it
is not compared with itself here. triton runs in Triton's interpreter, pallas in Pallas'
TPU interpreter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention
from ejk_sequtils import attention_tolerance, reference_attention

B, T, S, N, K, H = 2, 19, 23, 4, 2, 16
FLT_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Case:
    """One request: its sizes, its keyword arguments (built from a seeded rng) and the
    features it uses (a backend lacking one of them must refuse)."""

    features: frozenset[str]
    sizes: tuple[int, int, int] = (B, T, S)  # (batch, q_len, kv_len)
    build: object = None  # rng, b, t, s -> kwargs

    def kwargs(self) -> dict:
        b, t, s = self.sizes
        return {} if self.build is None else self.build(np.random.default_rng(1), b, t, s)


def _ids(rng, b, n):
    return jnp.asarray(np.sort(rng.integers(-1, 3, (b, n)), 1), jnp.int32)


def _combined(rng, b, t, s):
    return {
        "causal": True,
        "sliding_window": (5, 3),
        "logits_soft_cap": 4.0,
        "softmax_sinks": jnp.linspace(-1.0, 1.0, N),
        "segment_ids": (_ids(rng, b, t), _ids(rng, b, s)),
        "softmax_scale": 0.37,
    }


def _padding_ids(rng, b, t, s):
    """0 is a segment, -1 and -2 are padding; whole rows see nothing."""
    q_ids = np.zeros((b, t), np.int32)
    q_ids[:, :4] = -1
    q_ids[:, 10:] = 1
    kv_ids = np.zeros((b, s), np.int32)
    kv_ids[:, 7:] = -2
    kv_ids[1, 12:] = 1
    return {"segment_ids": (jnp.asarray(q_ids), jnp.asarray(kv_ids))}


def _bias_with(value):
    def build(rng, b, t, s):
        bias = rng.standard_normal((1, N, t, s)).astype(np.float32)
        bias[:, :, 3] = value  # a whole row
        bias[:, 1, 5:9, ::3] = value  # scattered entries
        return {"bias": jnp.asarray(bias), "causal": True}

    return build


def _packed(rng, b, t, s):
    return {"cu_seqlens_q": jnp.array([0, 6, 6, 13], jnp.int32), "causal": True}


def _packed_segments(rng, b, t, s):
    ids = jnp.asarray(np.r_[np.zeros(4), np.ones(5), -np.ones(2), np.zeros(5)][None], jnp.int32)
    return {"cu_seqlens_q": jnp.array([0, 6, 6, 13], jnp.int32), "segment_ids": ids}


CASES = {
    "combined": Case(
        frozenset({"causal", "window", "softcap", "sinks", "segments"}), build=_combined
    ),
    "padding_ids": Case(frozenset({"segments"}), build=_padding_ids),
    "neg_inf_bias": Case(frozenset({"bias"}), build=_bias_with(-np.inf)),
    "flt_max_bias": Case(frozenset({"bias"}), build=_bias_with(-FLT_MAX)),
    "huge_negative_bias": Case(frozenset({"bias"}), build=_bias_with(-1e30)),
    "empty_packed_sequence": Case(frozenset({"packed"}), (1, 16, 16), _packed),
    "packed_and_segments": Case(
        frozenset({"packed", "segments", "packed+segments"}), (1, 16, 16), _packed_segments
    ),
    "many_sinks": Case(
        frozenset({"sinks"}),
        build=lambda rng, b, t, s: {"softmax_sinks": jnp.asarray(rng.standard_normal((N, 3)))},
    ),
    "dropout": Case(
        frozenset({"dropout"}),
        build=lambda rng, b, t, s: {"dropout_rate": 0.2, "dropout_seed": jnp.uint32(0xDEADBEEF)},
    ),
    "empty_batch": Case(frozenset(), (0, T, S), lambda rng, b, t, s: {"causal": True}),
    "empty_queries": Case(frozenset(), (B, 0, S), lambda rng, b, t, s: {"causal": True}),
    "empty_keys": Case(
        frozenset({"sinks"}),
        (B, T, 0),
        lambda rng, b, t, s: {"softmax_sinks": jnp.linspace(-1.0, 1.0, N)},
    ),
}


def _inputs(b, t, s, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    shapes = ((b, t, N, H), (b, s, K, H), (b, s, K, H))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def _empty_outcome(q, kw):
    """What a call with an empty axis gives, written out rather than asked of the reference
    (which the pallas backend returns for such calls): ``out`` zeros of q's shape and dtype;
    ``lse`` the sink where a head has one (no key: the sink is the only mass), else -inf."""
    b, t, n, _ = q.shape
    sinks = kw.get("softmax_sinks")
    logit = -jnp.inf if sinks is None else jnp.asarray(sinks, jnp.float32)[None, :, None]
    return jnp.zeros(q.shape, q.dtype), jnp.broadcast_to(logit, (b, n, t)).astype(jnp.float32)


def _differentiable(kw):
    """Names and values of the keyword arguments that carry a gradient (bias, sinks)."""
    return {name: kw[name] for name in ("bias", "softmax_sinks") if name in kw}


class Conformance:
    """The suite; a subclass per backend sets ``implementation`` and ``lacks``."""

    implementation: str = ""
    lacks: frozenset[str] = frozenset()
    known_bugs: frozenset[str] = frozenset()  # cases expected to fail (strict xfail)

    @pytest.mark.parametrize("name", list(CASES))
    def test_case(self, name, request):
        if name in self.known_bugs:
            request.applymarker(pytest.mark.xfail(strict=True, reason="known bug, see class"))
        case = CASES[name]
        q, k, v = _inputs(*case.sizes)
        kw = case.kwargs()
        if case.features & self.lacks:
            with pytest.raises(NotImplementedError, match=f"'{self.implementation}' cannot serve"):
                flash_attention(q, k, v, implementation=self.implementation, **kw)
            return
        tol = lambda what: attention_tolerance(q.dtype, what)
        out, lse = flash_attention(
            q, k, v, return_lse=True, implementation=self.implementation, **kw
        )
        empty = 0 in case.sizes
        if empty:
            want, want_lse = _empty_outcome(q, kw)
        else:
            want, want_lse = reference_attention(q, k, v, return_lse=True, **kw)
        assert out.shape == want.shape and out.dtype == want.dtype
        assert lse.shape == want_lse.shape and lse.dtype == jnp.float32
        np.testing.assert_allclose(out, want, rtol=tol("out"), atol=tol("out"))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        finite = np.isfinite(np.asarray(want_lse))
        np.testing.assert_allclose(
            np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=tol("lse"), atol=tol("lse")
        )
        again = flash_attention(q, k, v, implementation=self.implementation, **kw)
        np.testing.assert_array_equal(again, out)  # deterministic

        w = jnp.asarray(np.random.default_rng(5).standard_normal(want.shape), jnp.float32)
        extra = _differentiable(kw)
        fixed = {key: value for key, value in kw.items() if key not in extra}

        def loss(fn, **more):
            def f(q, k, v, extra):
                return jnp.sum(fn(q, k, v, **fixed, **extra, **more) * w)

            return f

        argnums = (0, 1, 2, 3)
        got = jax.grad(loss(flash_attention, implementation=self.implementation), argnums)(
            q, k, v, extra
        )
        if empty:  # out is zeros whatever the inputs: every gradient is zero
            ref = jax.tree.map(jnp.zeros_like, (q, k, v, extra))
        else:
            ref = jax.grad(loss(reference_attention), argnums)(q, k, v, extra)
        flat_got, _ = jax.tree.flatten(got)
        flat_ref, _ = jax.tree.flatten(ref)
        labels = ["dq", "dk", "dv", *(f"d{n}" for n in sorted(extra))]
        for label, g, r in zip(labels, flat_got, flat_ref, strict=True):
            assert not np.any(np.isnan(np.asarray(g))), label
            np.testing.assert_allclose(
                g, r, rtol=tol("grad"), atol=tol("grad"), err_msg=f"{name}: {label}"
            )


class TestTriton(Conformance):
    implementation = "triton"


class TestPallas(Conformance):
    implementation = "pallas"
    lacks = frozenset({"bias", "packed+segments"})


def test_segment_ids_and_cu_seqlens_combine_in_the_definition():
    """cu_seqlens with segment_ids: a token sees keys of its own sequence *and* segment."""
    q, k, v = _inputs(1, 16, 16)
    kw = _packed_segments(None, 1, 16, 16)
    both = reference_attention(q, k, v, **kw)
    cu_only = reference_attention(q, k, v, cu_seqlens_q=kw["cu_seqlens_q"])
    assert not np.allclose(both, cu_only)
