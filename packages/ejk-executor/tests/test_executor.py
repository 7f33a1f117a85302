"""Selection order, key separation, dispatch, custom backward and jit behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_config import get_device_platform
from ejk_executor import (
    AutotunePolicy,
    ConfigCache,
    ConfigNotFoundError,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    PersistentCache,
    default_key_builder_with_sharding,
    overlay_cache,
    policy_override,
)


def _ab(n=8, m=4, dtype=jnp.float32):
    a = jnp.arange(n * m, dtype=dtype).reshape(n, m) / 10
    b = jnp.ones((m, 3), dtype)
    return a, b


def test_chain_order(tmp_path, mat_kernel, kernels):
    MatCfg = kernels["MatCfg"]
    a, b = _ab()
    persistent = PersistentCache(tmp_path, types=(MatCfg,))
    chain = ConfigSelectorChain(cache=ConfigCache(), persistent=persistent)
    inv = Invocation.make(mat_kernel, (a, b), {})
    key = inv.call_key

    # 5. nothing cached: the heuristic (kept in memory only)
    assert chain.choose(inv) == (MatCfg(16), "heuristic")
    assert key in chain.cache and key not in persistent
    # 4. persistent beats the heuristic, and a hit is copied to memory
    chain.cache.clear()
    persistent.put(key, MatCfg(5))
    assert chain.choose(inv) == (MatCfg(5), "persistent")
    assert chain.cache.get(key) == MatCfg(5)
    # 3. memory beats persistent
    chain.cache.put(key, MatCfg(3))
    assert chain.choose(inv) == (MatCfg(3), "memory")
    # 2. overlay beats memory; the innermost overlay wins
    with overlay_cache({key: MatCfg(2)}):
        assert chain.choose(inv) == (MatCfg(2), "overlay")
        with overlay_cache(ConfigCache({key: MatCfg(7)})):
            assert chain.choose(inv) == (MatCfg(7), "overlay")
        # 1. the explicit cfg beats everything
        assert chain.choose(inv, MatCfg(1)) == (MatCfg(1), "explicit")
    assert chain.choose(inv) == (MatCfg(3), "memory")
    assert mat_kernel.heuristic_calls == 1


def test_policy_error_and_override(mat_kernel):
    a, b = _ab()
    chain = ConfigSelectorChain(policy=AutotunePolicy(on_miss="error"))
    inv = Invocation.make(mat_kernel, (a, b), {})
    with pytest.raises(ConfigNotFoundError, match="on_miss='error'"):
        chain.choose(inv)
    with policy_override(autotune=False):
        assert chain.choose(inv).source == "heuristic"
    with pytest.raises(ValueError, match="on_miss must be one of"):
        AutotunePolicy(on_miss="sometimes")
    with pytest.raises(TypeError, match="unknown fields"):
        with policy_override(num_iterations=3):
            pass


def test_keys_separate_everything_that_matters(mat_kernel, kernels):
    a, b = _ab()

    def key(*args, kernel=mat_kernel, device_fp="cpu|x|n=1", **kwargs):
        return default_key_builder_with_sharding(kernel, args, kwargs, device_fp=device_fp)

    base = key(a, b)
    assert base == key(a + 1, b * 2)  # values never matter
    assert base == key(jax.ShapeDtypeStruct(a.shape, a.dtype), np.ones((4, 3), np.float32))
    others = [
        key(*_ab(n=16)),  # shape
        key(*_ab(dtype=jnp.float16)),  # dtype
        key(a, b, scale=2.0),  # static kwarg
        key(a, b, scale=2),  # the same value, another type
        key(a, b, device_fp="gpu|H100|n=1"),  # device
        key(a, b, kernel=kernels["MatKernel"](version="2")),  # kernel version
        key(a, b, kernel=kernels["MatKernel"](name="other")),  # kernel name
        key(b.T, a.T),  # argument order
    ]
    assert len({base, *others}) == len(others) + 1
    assert base.startswith("toy_matmul/1/") and "0x" not in base


def test_executor_runs_the_chosen_config(mat_kernel, kernels):
    MatCfg = kernels["MatCfg"]
    a, b = _ab()
    ex = Executor(ConfigSelectorChain())
    np.testing.assert_allclose(ex(mat_kernel, a, b, scale=2.0), (a @ b) * 2.0, rtol=1e-6)
    assert ex.choose(mat_kernel, a, b, scale=2.0) == (MatCfg(16), "memory")
    # an explicit config is used as is and leaves the caches alone
    np.testing.assert_allclose(ex(mat_kernel, a, b, cfg=MatCfg(1, extra=1)), a @ b, rtol=1e-6)
    assert len(ex.chooser.cache) == 1


def test_eager_fast_path_sees_cache_changes(mat_kernel):
    a, b = _ab()
    ex = Executor()
    for _ in range(3):
        ex(mat_kernel, a, b)
    assert mat_kernel.heuristic_calls == 1
    assert mat_kernel.run_calls == 1  # traced once, then the jitted body is reused
    ex.chooser.cache.clear()
    ex(mat_kernel, a, b)
    assert mat_kernel.heuristic_calls == 2
    ex(mat_kernel, *_ab(n=16))  # a new shape is a new selection
    assert mat_kernel.heuristic_calls == 3


def test_platform_method_wins():
    class K(Kernel):
        name = "dispatch"

        def run(self, x, *, cfg):
            return x + 1

        def run_xla(self, x, *, cfg):
            return x + 2

        def run_triton(self, x, *, cfg):
            return x + 3

        def heuristic_cfg(self, inv):
            return 0

    # "pallas" has no method of its own here: run is the fallback
    expected = {"xla": 2.0, "triton": 3.0, "pallas": 1.0}[get_device_platform()]
    assert float(Executor()(K(), jnp.zeros(()))) == expected


def test_inside_jit_selects_at_trace_time(mat_kernel):
    a, b = _ab()
    ex = Executor()
    f = jax.jit(lambda a, b: ex(mat_kernel, a, b, scale=3.0))
    np.testing.assert_allclose(f(a, b), (a @ b) * 3.0, rtol=1e-6)
    f(a + 1, b)
    assert mat_kernel.heuristic_calls == 1
    # the key under jit equals the eager key: eager calls reuse the choice
    ex(mat_kernel, a, b, scale=3.0)
    assert mat_kernel.heuristic_calls == 1


def test_custom_backward_through_jax_grad(sinmul_kernel):
    a = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    b = jnp.linspace(0.5, 2.0, 12).reshape(3, 4)
    mask = jnp.arange(12).reshape(3, 4) % 3 != 0
    ex = Executor()

    def loss(a, b):
        return (ex(sinmul_kernel, a, b, mask=mask) ** 2).sum()

    def ref(a, b):
        return (jnp.where(mask, jnp.sin(a) * b, 0.0) ** 2).sum()

    for fn in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        ga, gb = fn(a, b)
        ra, rb = jax.grad(ref, argnums=(0, 1))(a, b)
        np.testing.assert_allclose(ga, ra, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gb, rb, rtol=1e-5, atol=1e-6)
    assert sinmul_kernel.backward_calls >= 1


def test_custom_backward_rejects_float_kwargs_and_bad_grads(sinmul_kernel):
    a = jnp.ones((2, 2))
    with pytest.raises(TypeError, match="must be passed positionally"):
        Executor()(sinmul_kernel, a, a, mask=jnp.ones((2, 2)))

    class Bad(type(sinmul_kernel)):
        name = "bad_backward"

        def backward(self, residuals, dout, *, cfg, mask=None):
            return (dout,)

    with pytest.raises(TypeError, match="one gradient per positional argument"):
        jax.grad(lambda x: Executor()(Bad(), x, a).sum())(a)


def test_partial_custom_backward_is_an_error():
    class Half(Kernel):
        name = "half"

        def run(self, x, *, cfg):
            return x

        def forward_with_residuals(self, x, *, cfg):
            return x, ()

        def heuristic_cfg(self, inv):
            return 0

    with pytest.raises(TypeError, match="backward is missing"):
        Executor()(Half(), jnp.ones(2))


def test_kernel_validation():
    with pytest.raises(ValueError, match="non-empty str name"):
        Kernel()
    with pytest.raises(TypeError, match=r"kernel must be an ejk_executor\.Kernel"):
        Executor()(lambda x: x, jnp.ones(2))
    with pytest.raises(TypeError, match="chooser must be a ConfigSelectorChain"):
        Executor(ConfigCache())


def test_fast_path_keeps_keys_apart(mat_kernel, kernels):
    """Repeated eager calls that differ only in a static value, its type, a tuple
    static or the argument order never share a memoised choice."""

    class K(kernels["MatKernel"]):
        name = "statics"

        def run(self, a, b, *, cfg, scale=1.0, window=(1, 1)):
            return (a @ b) * scale * window[0]

    k = K()
    ex = Executor()
    a, b = _ab()
    for _ in range(2):
        np.testing.assert_allclose(ex(k, a, b, scale=2.0), (a @ b) * 2, rtol=1e-6)
        np.testing.assert_allclose(ex(k, a, b, scale=3.0), (a @ b) * 3, rtol=1e-6)
        np.testing.assert_allclose(ex(k, a, b, scale=3.0, window=(2, 1)), (a @ b) * 6, rtol=1e-6)
        assert ex(k, a, b, scale=2).dtype == jnp.float32
        np.testing.assert_allclose(ex(k, b.T, a.T), b.T @ a.T, rtol=1e-6)
    assert k.heuristic_calls == 5
    assert len(ex.chooser.cache) == 5


def test_memory_cache_threads_and_thread_local_overlays(kernels):
    import threading

    from ejk_executor._cache import active_overlays

    MatCfg = kernels["MatCfg"]
    cache = ConfigCache()
    barrier = threading.Barrier(4)
    seen = {}

    def work(t):
        for i in range(200):
            cache.put(f"{t}-{i}", MatCfg(i + 1))
        with overlay_cache({"k": MatCfg(t + 1)}):
            barrier.wait()  # every thread is inside its own overlay now
            seen[t] = [o.get("k") for o in active_overlays()]
            barrier.wait()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 800 and cache.get("3-199") == MatCfg(200)
    assert seen == {t: [MatCfg(t + 1)] for t in range(4)}  # overlays are thread-local
    assert active_overlays() == ()
    with pytest.raises(ValueError, match="cannot cache cfg=None"):
        cache.put("x", None)


def test_fast_path_with_value_static_objects(kernels):
    """A static argument of a class with ``__ejk_stable_key__`` (a mask, say) is memoised
    by value: equal masks share a choice, different ones do not."""

    class Mask:
        def __init__(self, window):
            self.window = window

        def __eq__(self, other):
            return type(other) is Mask and other.window == self.window

        def __hash__(self):
            return hash(("Mask", self.window))

        def __ejk_stable_key__(self):
            return ["Mask", self.window]

    class K(kernels["MatKernel"]):
        name = "masked"

        def run(self, a, b, *, cfg, mask):
            self.run_calls += 1  # counts traces: the jitted body is reused after that
            return (a @ b) * mask.window

    k = K()
    ex = Executor()
    a, b = _ab()
    for _ in range(3):
        np.testing.assert_allclose(ex(k, a, b, mask=Mask(2)), (a @ b) * 2, rtol=1e-6)
        np.testing.assert_allclose(ex(k, a, b, mask=Mask(3)), (a @ b) * 3, rtol=1e-6)
    assert k.heuristic_calls == 2 and k.run_calls == 2


def test_custom_backward_with_integer_positional_arg():
    """An integer array passed positionally gets no cotangent, even if backward returns one."""

    class Shift(Kernel):
        name = "shift"

        def run(self, x, ids, *, cfg):
            return x * ids.astype(x.dtype)

        def forward_with_residuals(self, x, ids, *, cfg):
            return self.run(x, ids, cfg=cfg), ids

        def backward(self, ids, dout, *, cfg):
            return dout * ids.astype(dout.dtype), jnp.zeros_like(ids)

        def heuristic_cfg(self, inv):
            return 0

    x = jnp.arange(4.0)
    ids = jnp.array([0, 1, 2, 3], jnp.int32)
    g = jax.jit(jax.grad(lambda x: Executor()(Shift(), x, ids).sum()))(x)
    np.testing.assert_allclose(g, [0.0, 1.0, 2.0, 3.0])


class _Scale:
    """A static argument left out of the cache key on purpose (its stable key is constant),
    as ejk's flex kernels leave out the translated mods; equality follows the value."""

    def __init__(self, value):
        self.value = value

    def __ejk_stable_key__(self):
        return ["scale"]

    def __eq__(self, other):
        return isinstance(other, _Scale) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


class _Scaled(Kernel):
    name = "test.scaled"

    def run(self, x, *, scale, cfg):
        return x * scale.value

    def heuristic_cfg(self, inv):
        return 1

    def compiled_apart(self, inv):
        return inv.kwargs["scale"]


@pytest.mark.parametrize("inside_jit", [False, True])
def test_compiled_apart_keeps_bodies_apart_under_one_key(inside_jit):
    """Calls differing only in a static argument the key leaves out share the config but
    each runs its own body."""
    executor = Executor()
    x = jnp.ones(3)
    call = lambda s: executor(_Scaled(), x, scale=_Scale(s))
    if inside_jit:
        call = lambda s, _call=call: jax.jit(lambda: _call(s))()
    keys = {executor.invocation(_Scaled(), x, scale=_Scale(s)).call_key for s in (2.0, 3.0)}
    assert len(keys) == 1
    np.testing.assert_array_equal(call(2.0), 2.0 * x)
    np.testing.assert_array_equal(call(3.0), 3.0 * x)
