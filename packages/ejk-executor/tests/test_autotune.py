"""Autotuning: eager, inside jax.jit (stand-ins, outside the trace), failures, recording."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_executor import (
    AutotunePolicy,
    ConfigSelectorChain,
    Executor,
    Invocation,
    PersistentCache,
    autotune,
    autotune_recorded,
    benchmark,
    clear_invocations,
    get_invocations,
    record_invocation,
    timer,
)

POLICY = AutotunePolicy(on_miss="autotune", num_warmup=1, num_iters=3)


def _ab(n=32):
    return jnp.ones((n, 16), jnp.float32), jnp.ones((16, 8), jnp.float32)


@pytest.fixture(name="timed")
def timed_fixture(monkeypatch):
    """Spy on the tuner's timed calls: ``timed()`` returns the list of runners in the order
    they are timed. Each runner still runs. With ``fail_first``, the first runner timed
    raises from its second timed call on. With ``seconds``, the timings are injected, not
    measured: the k-th distinct runner timed (candidates in order, one tuning after another)
    reports ``seconds[k % len(seconds)][j]`` for its j-th timed call, so no test asserts on
    the machine's speed."""
    from ejk_executor import _tuning

    once = _tuning._once

    def install(fail_first=False, seconds=None):
        calls = []

        def spy(fn, args):
            calls.append(fn)
            if fail_first and fn is calls[0] and calls.count(fn) > 1:
                raise RuntimeError("ran out of memory")
            measured = once(fn, args)
            if seconds is None:
                return measured
            distinct = list(dict.fromkeys(calls))
            return seconds[distinct.index(fn) % len(seconds)][calls.count(fn) - 1]

        monkeypatch.setattr(_tuning, "_once", spy)
        return calls

    return install


# Injected timings (seconds per round) of two candidates where the second is faster by its
# median, while the first has the fastest single round: a tuner that ranks by the minimum,
# or by one round, picks the first.
SECOND_FASTER = ([0.5e-3, 3e-3, 3e-3], [2e-3, 2e-3, 2e-3])


def test_autotune_inside_jit_picks_the_faster_config(tmp_path, kernels, timed):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]
    timed(seconds=SECOND_FASTER)
    slow, fast = MatCfg(32, extra=1), MatCfg(64, extra=0)
    kernel = MatKernel(space=[slow, fast])
    persistent = PersistentCache(tmp_path)
    ex = Executor(ConfigSelectorChain(persistent=persistent, policy=POLICY))
    a, b = _ab()

    def f(a, b):
        return ex(kernel, a, b, scale=2.0)

    jaxpr = jax.make_jaxpr(f)(a, b)  # tuning happens here, at trace time
    key = Invocation.make(kernel, (a, b), {"scale": 2.0}).call_key
    assert ex.chooser.cache.get(key) == fast
    assert PersistentCache(tmp_path, types=(MatCfg,)).get(key) == fast
    # the traced program holds only the winner: no busy-work loop (a scan: static trip count)
    assert "scan" not in str(jaxpr)
    np.testing.assert_allclose(jax.jit(f)(a, b), (a @ b) * 2.0, rtol=1e-6)
    # a second chain with the same persistent file does not tune again
    kernel.space = [MatCfg(1)]  # would be picked if it tuned
    ex2 = Executor(ConfigSelectorChain(persistent=PersistentCache(tmp_path), policy=POLICY))
    assert ex2.choose(kernel, a, b, scale=2.0) == (fast, "persistent")


def test_failing_candidates_are_skipped_and_logged(kernels, caplog):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]

    class Picky(MatKernel):
        name = "picky"

        def run(self, a, b, *, cfg, scale=1.0):
            if cfg.block > 100:
                raise ValueError(f"block={cfg.block} does not fit")
            return super().run(a, b, cfg=cfg, scale=scale)

    kernel = Picky(space=[MatCfg(128), MatCfg(16)])
    a, b = _ab()
    with caplog.at_level(logging.WARNING, logger="ejk_executor"):
        best = jax.jit(lambda a, b: Executor(ConfigSelectorChain(policy=POLICY))(kernel, a, b))
        best(a, b)
    assert "skipping candidate MatCfg(block=128, extra=0)" in caplog.text
    assert "block=128 does not fit" in caplog.text
    kernel.space = [MatCfg(128)]
    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune(kernel, a, b, num_iters=1)


def test_candidates_are_timed_in_interleaved_rounds(kernels, timed):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]
    calls = timed()
    autotune(MatKernel(space=[MatCfg(8), MatCfg(16), MatCfg(32)]), *_ab(), num_iters=3)
    first, second, third = calls[:3]
    assert len({first, second, third}) == 3
    assert calls == [first, second, third] * 3


def test_a_candidate_failing_while_timed_is_skipped(kernels, timed, caplog):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]
    calls = timed(fail_first=True)
    with caplog.at_level(logging.WARNING, logger="ejk_executor"):
        best = autotune(MatKernel(space=[MatCfg(8), MatCfg(16)]), *_ab(), num_iters=3)
    assert best == MatCfg(16)
    first, second = calls[:2]
    assert calls == [first, second, first, second, second]  # dropped after it failed
    assert "skipping candidate MatCfg(block=8, extra=0) (RuntimeError: ran out of memory)" in (
        caplog.text
    )


def test_autotune_function_on_abstract_args(kernels, timed):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]
    timed(seconds=SECOND_FASTER)
    kernel = MatKernel(space=[MatCfg(8), MatCfg(16)])
    sds = (jax.ShapeDtypeStruct((32, 16), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32))
    assert autotune(kernel, *sds, num_iters=3) == MatCfg(16)
    assert autotune(kernel, *sds, configs=[MatCfg(3)], num_iters=1) == MatCfg(3)


def test_record_then_autotune_recorded(kernels, timed):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]
    timed(seconds=SECOND_FASTER)
    kernel = MatKernel(space=[MatCfg(8), MatCfg(16)])
    clear_invocations()
    ex = Executor(record=True)
    jax.jit(lambda a, b: ex(kernel, a, b))(*_ab(32))
    ex(kernel, *_ab(48))
    ex(kernel, *_ab(48))
    invs = get_invocations()
    assert len(invs) == 2
    for inv in invs:  # abstract only: no arrays, no tracers
        assert inv.is_abstract
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in inv.args)
    chain = ConfigSelectorChain(policy=POLICY)
    results = autotune_recorded(chain=chain)
    assert set(results) == {inv.call_key for inv in invs}
    assert all(cfg == MatCfg(16) for cfg in results.values())
    assert Executor(chain).choose(kernel, *_ab(48)).source == "memory"
    clear_invocations()
    assert get_invocations() == []


def test_record_invocation_is_thread_safe(mat_kernel):
    clear_invocations()
    invs = [Invocation.make(mat_kernel, _ab(n), {}) for n in range(1, 41)]

    def work():
        for inv in invs:
            record_invocation(mat_kernel, inv)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [i.call_key for i in get_invocations()] == [i.call_key for i in invs]
    with pytest.raises(ValueError, match="not of kernel"):
        record_invocation(object(), invs[0])
    clear_invocations()


def test_benchmark_and_timer():
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((16, 16))
    assert benchmark(f, x, num_warmup=1, num_iters=3) > 0
    with pytest.raises(ValueError, match="num_iters must be a positive int"):
        benchmark(f, x, num_iters=0)
    with timer("t") as t:
        f(x).block_until_ready()
    assert t.ms > 0 and t.seconds == t.ms / 1e3


def test_concurrent_misses_tune_once(kernels):
    MatCfg, MatKernel = kernels["MatCfg"], kernels["MatKernel"]

    class Counted(MatKernel):
        name = "counted"
        spaces = 0

        def config_space(self, inv):
            type(self).spaces += 1
            return super().config_space(inv)

    kernel = Counted(space=[MatCfg(8), MatCfg(16)])
    ex = Executor(ConfigSelectorChain(policy=POLICY))
    a, b = _ab()
    barrier = threading.Barrier(4)
    results = []

    def work():
        barrier.wait()
        results.append(ex.choose(kernel, a, b).cfg)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counted.spaces == 1
    assert len(set(results)) == 1
