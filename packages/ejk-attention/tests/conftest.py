"""Test setup: 8 host CPU devices for the sharded and ring tests.

XLA reads the flag when its CPU backend starts, so it is set here, before any
test touches a device. Only the tests do this; the package never sets flags.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _private_config_cache(tmp_path_factory):
    """Point ejk's persistent cache at a fresh directory: no test reads or writes ~/.cache/ejk."""
    old = os.environ.get("EJK_CACHE_DIR")
    os.environ["EJK_CACHE_DIR"] = str(tmp_path_factory.mktemp("ejk-cache"))
    yield
    if old is None:
        os.environ.pop("EJK_CACHE_DIR", None)
    else:
        os.environ["EJK_CACHE_DIR"] = old


@pytest.fixture
def pallas_calls(monkeypatch):
    """The facade's pallas backend replaced by xla that records each call's q shape (in this list)."""
    from ejk_attention import _backends

    calls = []

    class Recording(_backends.Backend):
        name = "pallas"

        def run(self, request, config, bwd_config):
            calls.append(request.q.shape)
            return _backends.BACKENDS["xla"].run(request, config, bwd_config)

    monkeypatch.setitem(_backends.BACKENDS, "pallas", Recording())
    return calls


@pytest.fixture
def no_shape_checks():
    """Switch jaxtyping's runtime checks off for one test: tests of a function's own
    validation see the message a user (who runs without the checks) sees."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _equations(sub)


@pytest.fixture
def jaxpr_equations():
    """``f(jaxpr)``: an iterator over every equation of a jaxpr, nested ones (shard_map,
    cond branches, custom VJPs) included."""
    return _equations
