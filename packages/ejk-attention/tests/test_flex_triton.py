"""The ``triton`` flex backend (``ejk_kernels_gpu``'s flex kernels, in Triton's interpreter
here) against the ``xla`` backend on float32-upcast inputs (itself checked against a dense
definition in test_flex.py): values, lse and gradients (q, k, v and a float capture), for
the common masks and score_mods; refusals and the fall-through."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flex_attention,
    or_masks,
    prefix_lm_mask,
    sliding_window_mask,
)
from ejk_sequtils import attention_tolerance

# Not importorskip: triton must not be imported before the kernels switch its interpreter on.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@pytest.fixture(autouse=True)
def _flex_kernels_only(monkeypatch):
    """Every call here runs the flex kernels: ejk's own masks without a score_mod would
    otherwise go to the built-in kernels (that route: test_flex_builtin.py)."""
    from ejk_attention import _backends

    monkeypatch.setattr(_backends.BACKENDS["triton"].flex, "builtin", None)


# Pairwise-distinct sizes; T and S are not multiples of the 16-row blocks. One kv head for
# three query heads keeps the interpreter's grids small (ejk-kernels-gpu's tests/test_flex.py
# runs the kernels with several kv heads and per-head tables).
B, T, S, N, K, H = 2, 37, 45, 3, 1, 16
BLOCK = 16


def _qkv(dtype=jnp.float32, *, t=T, s=S, kv_heads=K, head_dim=H, hv=H, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, t, N, head_dim), (B, s, kv_heads, head_dim), (B, s, kv_heads, hv))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def _tol(dtype, quantity):
    from ejk_kernels_gpu.build._triton import arithmetic_dtype

    return attention_tolerance(dtype, quantity, computed_in=arithmetic_dtype(dtype))


def _close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), rtol=tol, atol=tol,
        err_msg=what,
    )  # fmt: skip


def _run(impl, q, k, v, make_score, block_mask, param, d_out):
    """``(out, lse, (dq, dk, dv, d_param))`` of one call on ``impl``."""

    def loss(q, k, v, param):
        score_mod = None if make_score is None else make_score(param)
        out, lse = flex_attention(
            q, k, v, score_mod, block_mask, return_lse=True, implementation=impl
        )
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + 0.1 * jnp.sum(finite), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, param)
    return out, lse, grads


def check(q, k, v, make_score=None, block_mask=None, param=None):
    """The triton backend's values, lse and gradients against xla's on float32 inputs."""
    dtype = q.dtype
    param = jnp.zeros(()) if param is None else param
    d_out = jnp.asarray(
        np.random.default_rng(7).standard_normal((*q.shape[:3], v.shape[3])), jnp.float32
    )
    out, lse, grads = _run("triton", q, k, v, make_score, block_mask, param, d_out)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse, want_grads = _run("xla", *f32, make_score, block_mask, param, d_out)
    assert out.shape == want_out.shape and out.dtype == dtype
    _close(out, want_out, _tol(dtype, "out"), "out")
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    _close(np.asarray(lse)[finite], np.asarray(want_lse)[finite], _tol(dtype, "lse"), "lse")
    for name, got, want in zip(("dq", "dk", "dv", "dparam"), grads, want_grads, strict=True):
        assert got.dtype == (param.dtype if name == "dparam" else dtype)
        _close(got, want, _tol(dtype, "grad"), name)
    return out, grads


def _mask(mask_mod, b=B, n=None, t=T, s=S, block=BLOCK):
    return create_block_mask(mask_mod, b, n, t, s, block_size=block)


def _doc_ids(t=T, seed=3):
    """Sorted document ids per batch row, with a padding (-1) run at the start of row 1."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, 3, (B, t)), axis=1)
    ids[1, :5] = -1
    return jnp.asarray(ids, jnp.int32)


def _alibi(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

    return alibi


def _soft_cap(score, b, h, q_idx, kv_idx):
    return 2.0 * jnp.tanh(score / 2.0)


def _rel_bias(table):
    """A T5-style learnable bias ``table[h, clip(kv - q, -8, 8) + 8]``."""

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, jnp.clip(kv_idx - q_idx, -8, 8) + 8]

    return rel


# bfloat16's default case is the ALiBi one (a bf16 capture too).
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_causal(dtype):
    check(*_qkv(dtype), block_mask=_mask(causal_mask, b=None, n=None))


def test_documents_with_captured_ids_causal():
    check(*_qkv(t=S), block_mask=_mask(and_masks(causal_mask, document_mask(_doc_ids(S))), t=S))


def test_prefix_lm_with_captured_lengths():
    lengths = jnp.asarray([9, 30], jnp.int32)
    check(*_qkv(), block_mask=_mask(prefix_lm_mask(lengths)))


def test_sliding_window_or_prefix():
    mask = or_masks(sliding_window_mask((5, 3)), prefix_lm_mask(jnp.asarray(4, jnp.int32)))
    check(*_qkv(), block_mask=_mask(mask, b=None))


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", pytest.param("float16", marks=pytest.mark.slow)]
)
def test_alibi_slopes_gradient(dtype):
    """bfloat16 slopes too: a capture of the inputs' dtype (read as float32 in the kernels)."""
    slopes = jnp.linspace(0.05, 0.4, N, dtype=jnp.float32).astype(dtype)
    check(*_qkv(dtype), _alibi, _mask(causal_mask, b=None, n=None), slopes)


def test_soft_cap_score_mod_without_mask():
    check(*_qkv(), lambda _: _soft_cap)


def test_relative_position_table_gradient_with_window():
    table = jnp.asarray(np.random.default_rng(5).standard_normal((N, 17)), jnp.float32)
    mask = and_masks(causal_mask, sliding_window_mask((20, 0)))
    _, grads = check(*_qkv(hv=8), _rel_bias, _mask(mask, b=None), table)
    assert np.abs(np.asarray(grads[3])).max() > 0  # the table does get a gradient


def test_per_head_mask_and_fully_masked_rows():
    """Rows 0-3 of head 1 and the padding rows of the documents see nothing: zeros, zero
    gradients (and the other rows still right)."""
    ids = _doc_ids(S)

    def mask_mod(b, h, q_idx, kv_idx):
        hidden = (h == 1) & (q_idx < 4)
        return document_mask(ids)(b, h, q_idx, kv_idx) & ~hidden

    q, k, v = _qkv(t=S)
    out, grads = check(q, k, v, block_mask=_mask(mask_mod, n=N, t=S))
    assert not np.asarray(out[:, :4, 1]).any() and not np.asarray(out[1, :5]).any()
    assert not np.asarray(grads[0][:, :4, 1]).any() and not np.asarray(grads[0][1, :5]).any()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims_forward(head_dim):
    q, k, v = _qkv(head_dim=head_dim, hv=head_dim, t=20, s=33)
    mask = _mask(causal_mask, b=None, n=None, t=20, s=33)
    out = flex_attention(q, k, v, _soft_cap, mask, implementation="triton")
    want = flex_attention(q, k, v, _soft_cap, mask, implementation="xla")
    _close(out, want, _tol(jnp.float32, "out"), "out")


def test_under_jit_with_traced_ids_and_captures():
    q, k, v = _qkv(t=S)

    @jax.jit
    def run(ids, slopes, q, k, v):
        mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), B, None, S, S,
                                 block_size=BLOCK)  # fmt: skip
        return flex_attention(q, k, v, _alibi(slopes), mask, implementation="triton")

    slopes = jnp.linspace(0.1, 0.3, N, dtype=jnp.float32)
    ids = _doc_ids(S)
    mask = _mask(and_masks(causal_mask, document_mask(ids)), t=S)
    want = flex_attention(q, k, v, _alibi(slopes), mask, implementation="xla")
    _close(run(ids, slopes, q, k, v), want, _tol(jnp.float32, "out"), "out")
    other = _doc_ids(S, seed=11)  # new ids: the same compiled function
    mask = _mask(and_masks(causal_mask, document_mask(other)), t=S)
    want = flex_attention(q, k, v, _alibi(slopes), mask, implementation="xla")
    _close(run(other, slopes, q, k, v), want, _tol(jnp.float32, "out"), "out")


def _shifted(score, b, h, q_idx, kv_idx):
    return score + jax.lax.shift_left(q_idx, 1).astype(jnp.float32)


def test_unsupported_primitive_is_refused_and_falls_through(monkeypatch):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="primitive 'shift_left'"):
        flex_attention(q, k, v, _shifted, implementation="triton")
    want = flex_attention(q, k, v, _shifted, implementation="xla")
    got = flex_attention(q, k, v, _shifted, implementation=("triton", "xla"))
    np.testing.assert_array_equal(got, want)
    # implementation=None on a GPU tries triton first: a translatable call runs there, the
    # refused one on xla.
    from ejk_attention import _backends, _flex

    monkeypatch.setattr(_flex, "platform_of", lambda request: "gpu")
    ran = []
    triton = _backends.BACKENDS["triton"].flex
    real = triton.run
    monkeypatch.setattr(triton, "run", lambda *a: ran.append(1) or real(*a))
    np.testing.assert_array_equal(flex_attention(q, k, v, _shifted), want)
    assert not ran
    _close(flex_attention(q, k, v, _soft_cap), flex_attention(q, k, v, _soft_cap,
           implementation="xla"), _tol(jnp.float32, "out"), "out")  # fmt: skip
    assert ran


def test_refusals_name_the_reason():
    q, k, v = _qkv()
    mask = create_block_mask(causal_mask, None, None, T, S, block_size=(8, 16))
    with pytest.raises(NotImplementedError, match="powers of two in \\[16, 256\\], got q_block=8"):
        flex_attention(q, k, v, block_mask=mask, implementation="triton")

    table = jnp.arange(4.0)

    def fill_gather(score, b, h, q_idx, kv_idx):
        return score + table.at[h].get(mode="fill")

    with pytest.raises(NotImplementedError, match="mode='fill'"):
        flex_attention(q, k, v, fill_gather, implementation="triton")

    def whole_table(score, b, h, q_idx, kv_idx):
        return score + jnp.sum(table * q_idx)

    with pytest.raises(NotImplementedError, match="captured array of shape \\(4,\\) is used whole"):
        flex_attention(q, k, v, whole_table, implementation="triton")


def test_bad_mods_raise_before_any_backend():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="mask_mod '<lambda>' must return bool"):
        create_block_mask(lambda b, h, i, j: i - j, None, None, T, S)
    with pytest.raises(ValueError, match="score_mod 'wide' must return one float score"):

        def wide(score, b, h, q_idx, kv_idx):
            return jnp.stack([score, score])

        flex_attention(q, k, v, wide, implementation="triton")


def test_capture_gradient_under_jit():
    """``jax.jit(jax.grad(...))`` of a relative-position table: the table is a tracer the
    score_mod closes over, becoming a kernel argument and getting its cotangent."""
    q, k, v = _qkv(t=20, s=33)
    mask = _mask(causal_mask, b=None, n=None, t=20, s=33)
    table = jnp.asarray(np.random.default_rng(9).standard_normal((N, 17)), jnp.float32)

    def loss(table, impl):
        out = flex_attention(q, k, v, _rel_bias(table), mask, implementation=impl)
        return jnp.sum(jnp.sin(out))

    got = jax.jit(jax.grad(loss), static_argnums=1)(table, "triton")
    want = jax.grad(loss)(table, "xla")
    _close(got, want, _tol(jnp.float32, "grad"), "dtable")


def test_rectangular_blocks_and_runs_repeat_bit_for_bit():
    """Blocks of 32 query rows by 16 keys (the kernels' tiles divide both); two runs equal."""
    q, k, v = _qkv()
    mask = create_block_mask(prefix_lm_mask(jnp.asarray([9, 30], jnp.int32)), B, None, T, S,
                             block_size=(32, 16))  # fmt: skip
    check(q, k, v, block_mask=mask)
    first = flex_attention(q, k, v, _soft_cap, mask, implementation="triton")
    np.testing.assert_array_equal(first, flex_attention(q, k, v, _soft_cap, mask,
                                                        implementation="triton"))  # fmt: skip


@pytest.mark.parametrize(("t", "s"), [(48, 37), pytest.param(37, 48, marks=pytest.mark.slow)])
def test_lengths_on_and_off_the_tiles(t, s):
    """Keys (or queries) on whole tiles take no bounds masks; the other side still does."""
    q, k, v = _qkv(t=t, s=s)
    mask = _mask(causal_mask, b=None, n=None, t=t, s=s)
    check(q, k, v, _alibi, mask, jnp.linspace(0.05, 0.4, N, dtype=jnp.float32))


# Configs: the given ones reach the launches, else the executor's (the same chain as the dense
# kernels': memory, the persistent cache `ejk tune` writes, then the heuristic).


def _config_call(t):
    """q, k, v and a causal mask of 16-blocks, of a length no other test uses (the executor's
    memory cache is per process)."""
    q, k, v = _qkv(t=t, s=t)
    return q, k, v, create_block_mask(causal_mask, None, None, t, t, block_size=(16, 16))


def _launched(monkeypatch):
    """The ``(fwd_config, bwd_config)`` of every forward and backward launch, in order."""
    from ejk_kernels_gpu.flex import _vjp

    seen = {"forward": [], "backward": []}
    for part in seen:
        real = getattr(_vjp, part)

        def spy(call, *args, _real=real, _part=part):
            seen[_part].append(call.fwd_config if _part == "forward" else call.bwd_config)
            return _real(call, *args)

        monkeypatch.setattr(_vjp, part, spy)
    return seen


def _grad(q, k, v, mask, **kw):
    return jax.grad(lambda q: flex_attention(q, k, v, _soft_cap, mask, **kw).sum())(q)


def test_config_and_bwd_config_reach_the_kernels(monkeypatch):
    from ejk_attention import _backends
    from ejk_attention.flex._request import validate_flex
    from ejk_kernels_gpu.flex import FlexConfig

    q, k, v, mask = _config_call(33)
    seen = _launched(monkeypatch)
    fwd = FlexConfig(block_q=16, block_k=16, num_warps=2, num_stages=1)
    bwd = FlexConfig(block_q=16, block_k=16, num_warps=1, num_stages=1)
    _grad(q, k, v, mask, implementation="triton", config=fwd, bwd_config=bwd)
    assert seen == {"forward": [fwd], "backward": [bwd]}
    # None: the executor's choice, here each kernel's heuristic.
    request = validate_flex(q, k, v, _soft_cap, mask, softmax_scale=None, return_lse=False)
    backend = _backends.BACKENDS["triton"].flex
    want = (backend.heuristic_config(request), backend.backward_config(request))
    _grad(q, k, v, mask, implementation="triton")
    assert (seen["forward"][1], seen["backward"][1]) == want


def test_bad_configs_name_the_argument():
    from ejk_kernels_gpu import FlashConfig
    from ejk_kernels_gpu.flex import FlexConfig

    q, k, v, mask = _config_call(34)
    with pytest.raises(TypeError, match="bwd_config must be a FlexConfig or None"):
        _grad(q, k, v, mask, implementation="triton", bwd_config=FlashConfig())
    with pytest.raises(TypeError, match="config must be a FlexConfig or None"):
        flex_attention(q, k, v, block_mask=mask, implementation="triton", config=FlashConfig())
    wide = FlexConfig(block_q=32, block_k=16)
    with pytest.raises(ValueError, match="bwd_config: the backward FlexConfig's block_q=32"):
        _grad(q, k, v, mask, implementation="triton", bwd_config=wide)
    with pytest.raises(ValueError, match="config: the forward FlexConfig's block_q=32"):
        flex_attention(q, k, v, block_mask=mask, implementation="triton", config=wide)


def test_executor_serves_cached_configs_in_the_space(monkeypatch):
    """A config on disk in the kernel's space is used; one outside it is dropped with a
    CacheWarning and the heuristic runs; calls with other mods on the same shapes share
    the key (configs are performance knobs), never a compiled body."""
    from ejk_attention import _backends
    from ejk_attention._tuned import open_cache
    from ejk_attention.flex._request import validate_flex
    from ejk_executor import CacheWarning
    from ejk_kernels_gpu.flex import FlexConfig

    q, k, v, mask = _config_call(35)
    backend = _backends.BACKENDS["triton"].flex
    request = validate_flex(q, k, v, _soft_cap, mask, softmax_scale=None, return_lse=False)
    invocations = backend.invocations(request)
    other = validate_flex(q, k, v, None, mask, softmax_scale=None, return_lse=False)
    shifted = validate_flex(q, k, v, lambda s, b, h, i, j: s + 1.0, mask, softmax_scale=None,
                            return_lse=False)  # fmt: skip
    assert backend.invocations(shifted)["forward"].call_key == invocations["forward"].call_key
    assert backend.invocations(other)["forward"].call_key != invocations["forward"].call_key
    forward, backward = invocations["forward"], invocations["backward"]
    space = backend.config_space(request)
    assert space[0] == backend.heuristic_config(request) and len(space) > 1
    assert all(16 % c.block_q == 0 and 16 % c.block_k == 0 for c in space)
    tuned = space[-1]
    open_cache().put(forward.call_key, tuned)
    crafted = FlexConfig(block_q=256, block_k=256, num_stages=7)
    open_cache().put(backward.call_key, crafted)
    seen = _launched(monkeypatch)
    with pytest.warns(CacheWarning, match=r"not in its search space for this call \(ejk_kernels_gpu\.flex_attention_bwd\)"):  # fmt: skip
        _grad(q, k, v, mask, implementation="triton")
    assert seen == {"forward": [tuned], "backward": [backend.backward_config(request)]}
    assert backward.call_key not in open_cache().keys()


def test_flex_kernels_tune_and_keep_mods_apart():
    """The executor's flex kernels: autotuning times the space on the call's arrays; run
    through an `Executor`, calls differing only in their mods share the call key but not
    the compiled body."""
    from ejk_executor import AutotunePolicy, ConfigSelectorChain, Executor
    from ejk_kernels_gpu import flex

    q, k, v = _qkv(t=20, s=20)
    outs = []
    executor = Executor(ConfigSelectorChain())
    keys = set()
    for score_mod in (_soft_cap, lambda s, b, h, i, j: s * 0.0):
        plan, consts = flex.plan_mods(score_mod, None)
        kw = dict(mods=flex.PlannedMods(plan), block_size=(32, 32), softmax_scale=0.25)
        args = (q, k, v, list(consts), [], None, None)
        keys.add(executor.invocation(flex.FlexAttentionForward(), *args, **kw).call_key)
        outs.append(executor(flex.FlexAttentionForward(), *args, **kw)[0])
    assert len(keys) == 1
    assert not np.allclose(outs[0], outs[1])
    inv = executor.invocation(flex.FlexAttentionBackward(), q, k, v, q, list(consts), [], None,
                              None, **kw)  # fmt: skip
    policy = AutotunePolicy(on_miss="autotune", num_warmup=0, num_iters=1, max_candidates=2)
    best = executor.chooser.tune(inv, policy)
    assert best in list(inv.kernel.config_space(inv))[:2]
    assert executor.chooser.choose(inv).cfg == best


def test_autotuned_configs_reach_a_later_process():
    """A call run under ``policy_override(on_miss="autotune")`` stores its forward and
    backward FlexConfigs in the persistent cache, and a cache opened afresh (as a later
    process opens it) reads them back as FlexConfigs."""
    from ejk_attention import _backends
    from ejk_attention._tuned import open_cache
    from ejk_attention.flex._request import validate_flex
    from ejk_executor import policy_override
    from ejk_kernels_gpu.flex import FlexConfig

    q, k, v, mask = _config_call(37)
    request = validate_flex(q, k, v, _soft_cap, mask, softmax_scale=None, return_lse=False)
    keys = [inv.call_key for inv in _backends.BACKENDS["triton"].flex.invocations(request).values()]
    with policy_override(on_miss="autotune", max_candidates=2, num_warmup=0, num_iters=1):
        _grad(q, k, v, mask, implementation="triton")
    later = open_cache(fresh=True)
    assert all(isinstance(later.get(key), FlexConfig) for key in keys), keys
