"""`FlashBackwardConfig`: its validation, the one-to-one map from the `FlashConfig`s that
spelled backward configs before it, and the deprecated spelling's conversion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, bwd_heuristic, flash_attention
from ejk_kernels_gpu.flash import _select
from ejk_kernels_gpu.flash._config import as_backward_config, ordinary_dq_config


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(block_keys=48), ValueError, r"FlashBackwardConfig\.block_keys must be a power of two, got block_keys=48"),
        (dict(block_queries=8), ValueError, r"FlashBackwardConfig\.block_queries must be >= 16 .*block_queries=8"),
        (dict(block_keys=0), ValueError, r"FlashBackwardConfig\.block_keys must be positive, got block_keys=0"),
        (dict(num_warps=3), ValueError, r"FlashBackwardConfig\.num_warps must be a power of two, got num_warps=3"),
        (dict(num_stages=0), ValueError, r"FlashBackwardConfig\.num_stages must be positive, got num_stages=0"),
        (dict(block_keys=64.0), TypeError, r"FlashBackwardConfig\.block_keys must be an int, got 64\.0"),
        (dict(num_warps=True), TypeError, r"FlashBackwardConfig\.num_warps must be an int, got True"),
        (dict(atomic_dq=1), TypeError, r"FlashBackwardConfig\.atomic_dq must be a bool, got 1"),
        (dict(gluon="yes"), TypeError, r"FlashBackwardConfig\.gluon must be a bool, got 'yes'"),
        (dict(warp_specialize=True, atomic_dq=True), ValueError, r"warp_specialize and atomic_dq"),
        (dict(gluon=True, warp_specialize=True), ValueError, r"FlashBackwardConfig\.gluon .*cannot be combined"),
        (dict(gluon=True, block_keys=32), ValueError, r"FlashBackwardConfig\.gluon .*block_keys=32"),
        (dict(gluon=True, block_queries=32), ValueError, r"FlashBackwardConfig\.gluon .*block_queries=32"),
        (dict(gluon=True, num_warps=8), ValueError, r"FlashBackwardConfig\.gluon .*num_warps=8"),
        (dict(gluon=True, num_stages=4), ValueError, r"FlashBackwardConfig\.gluon takes num_stages 2 or 3"),
    ],
)  # fmt: skip
def test_the_backward_config_names_the_field_and_value_it_refuses(kwargs, error, match):
    base = dict(block_keys=128, block_queries=64, num_warps=4, num_stages=2)
    with pytest.raises(error, match=match):
        FlashBackwardConfig(**{**base, **kwargs})


def _legacy(cfg: FlashBackwardConfig) -> FlashConfig:
    """The `FlashConfig` that spelled ``cfg`` before `FlashBackwardConfig`: ``block_q`` the
    dk/dv kernel's resident keys, ``block_k`` its query rows a step."""
    return FlashConfig(
        block_q=cfg.block_keys, block_k=cfg.block_queries, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, warp_specialize=cfg.warp_specialize, gluon=cfg.gluon,
        atomic_dq=cfg.atomic_dq,
    )  # fmt: skip


def _table_configs() -> list[FlashBackwardConfig]:
    """Every backward config the tables hold: the rules' picks, the Gluon and
    warp-specialised configs, and the search spaces and heuristic over their arguments."""
    found = [rule.pick for rule in _select.BACKWARD_RULES]
    found += [_select.GLUON_BWD, _select.GLUON_BWD_3, _select.GLUON_BWD_DQ]
    found += [_select.GLUON_BWD_256, _select.ORDINARY_BWD_64]
    for table in (_select.GLUON_BWD_CONFIGS, _select.WS_BWD_CONFIGS):
        found += [c for configs in table.values() for c in configs]
    flags = (False, True)
    for head_dim in (16, 40, 64, 80, 96, 128, 192, 256):
        for itemsize in (1, 2, 4):
            for side, gluon, cap, tables in np.ndindex(2, 2, 2, 2):
                found += _select.bwd_search_space(
                    head_dim, itemsize, flags[side], flags[gluon], flags[cap], flags[tables]
                )
                for group in (1, 2, 8):
                    found.append(
                        bwd_heuristic(head_dim, itemsize, flags[side], group, soft_cap=flags[cap],
                                      gluon=flags[gluon], tables=flags[tables])
                    )  # fmt: skip
    return list(dict.fromkeys(found))


def test_every_backward_config_of_the_tables_maps_one_to_one_to_its_old_spelling():
    """Each is a `FlashBackwardConfig` whose old `FlashConfig` spelling converts back to it
    (`FlashBackwardConfig.from_flash_config`), and no two share a spelling."""
    configs = _table_configs()
    assert all(isinstance(c, FlashBackwardConfig) for c in configs)
    assert len(configs) > 40
    legacy = [_legacy(c) for c in configs]
    assert len(set(legacy)) == len(configs)
    for old, new in zip(legacy, configs, strict=True):
        assert FlashBackwardConfig.from_flash_config(old) == new


def test_the_dq_kernel_configs_are_forward_shaped():
    """The dq kernel keeps queries resident as the forward does: its configs are
    `FlashConfig`s (`DQ_RULES`), and beside an ordinary backward config it runs that
    config's tiles with queries resident (`ordinary_dq_config`)."""
    picks = [_select.GLUON_DQ_CONFIG, _select.GLUON_DQ_64, _select.GLUON_DQ_256,
             _select.ORDINARY_DQ_64, *_select.GLUON_DQ_THREE.values()]  # fmt: skip
    assert all(isinstance(c, FlashConfig) for c in picks)
    assert _select.ORDINARY_DQ_64 == FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=3)
    assert ordinary_dq_config(_select.ORDINARY_BWD_64) == _select.ORDINARY_DQ_64
    ws = _select.WS_BWD_CONFIGS[128][0]
    assert ordinary_dq_config(ws) == FlashConfig(
        block_q=128, block_k=64, num_warps=4, num_stages=2, warp_specialize=True
    )


def _spy_launches(monkeypatch, *, hopper: bool) -> list:
    """Route the flash launches to a recorder that returns zeros, pretending (or not) to be
    on Hopper; the list it fills with (kernel, grid, constexprs, warps, stages)."""
    from ejk_kernels_gpu.flash import _backward_launch, _forward_launch

    seen: list = []

    def spy(kernel, grid, inputs, outs, consts, **options):
        tiles = sorted((name, repr(value)) for name, value in consts.items())
        seen.append(
            (kernel.__name__, tuple(grid), tiles, options["num_warps"], options["num_stages"])
        )
        return tuple(jnp.zeros(o.shape, o.dtype) for o in outs)

    for module in (_select, _backward_launch):
        monkeypatch.setattr(module, "hopper_gpu", lambda: hopper)
    for module in (_forward_launch, _backward_launch):
        monkeypatch.setattr(module, "launch", spy)
    return seen


def _grad_launches(seen: list, bwd_config, head_dim: int, **kwargs) -> list:
    q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 512, 2, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        out = flash_attention(q, k, v, bwd_config=bwd_config, **kwargs)
        return out.astype(jnp.float32).sum()

    seen.clear()
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    return list(seen)


@pytest.mark.parametrize("hopper", [False, True], ids=["other", "hopper"])
def test_the_old_spelling_of_every_table_config_launches_what_the_new_one_does(monkeypatch, hopper):
    """Each backward config of the tables and its old `FlashConfig` spelling (converted,
    with a DeprecationWarning) give the same kernel launches: kernels, grids, constexprs,
    warps and stages (`test_selection` pins those of the heuristics' picks as they were
    before the new type)."""
    seen = _spy_launches(monkeypatch, hopper=hopper)
    table = [rule.pick for rule in _select.BACKWARD_RULES]
    table += [c for t in (_select.GLUON_BWD_CONFIGS, _select.WS_BWD_CONFIGS)
              for configs in t.values() for c in configs]  # fmt: skip
    for cfg in dict.fromkeys(table):
        head_dim = 256 if cfg.gluon and cfg.block_keys == 64 else 128
        for kwargs in (dict(causal=True), dict(sliding_window=(64, 0), logits_soft_cap=20.0)):
            new = _grad_launches(seen, cfg, head_dim, **kwargs)
            with pytest.warns(DeprecationWarning, match="pass bwd_config=FlashBackwardConfig"):
                old = _grad_launches(seen, _legacy(cfg), head_dim, **kwargs)
            assert new and old == new, (cfg, kwargs)


def test_a_flash_config_as_bwd_config_is_converted_with_a_deprecation_warning(rng, make_inputs):
    """For one release a `FlashConfig` passed as ``bwd_config`` keeps working: converted
    field by field, with a DeprecationWarning giving the new spelling; the gradients are
    those of the new spelling, bit for bit."""
    q, k, v = make_inputs(rng, 1, 32, 48, 2, 1, 16, "float32")
    cfg = FlashConfig(block_q=16, block_k=16)
    old = FlashConfig(block_q=32, block_k=16, num_warps=2, num_stages=1, atomic_dq=True)
    new = FlashBackwardConfig(
        block_keys=32, block_queries=16, num_warps=2, num_stages=1, atomic_dq=True
    )

    def grads(bwd):
        def loss(q, k, v):
            return flash_attention(q, k, v, causal=True, config=cfg, bwd_config=bwd).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    want = grads(new)
    spelling = (
        r"pass bwd_config=FlashBackwardConfig\(block_keys=32, block_queries=16, num_warps=2, "
        r"num_stages=1, warp_specialize=False, gluon=False, atomic_dq=True\)"
    )
    with pytest.warns(DeprecationWarning, match=spelling):
        got = grads(old)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_bwd_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"bwd_config must be a FlashBackwardConfig or None"):
        as_backward_config({"block_keys": 64})
    q = jnp.zeros((1, 16, 1, 16), jnp.float32)
    with pytest.raises(TypeError, match="bwd_config"):  # (here the tests' type checks say so)
        flash_attention(q, q, q, bwd_config={"block_keys": 64})


def test_a_backward_entry_written_by_the_old_code_is_a_miss_left_on_disk(
    tmp_path, rng, make_inputs
):
    """Before `FlashBackwardConfig` the backward kernel (version 2) stored `FlashConfig`s in
    the persistent cache. Its keys are not the new kernel's (version 3): such an entry is
    a miss (the heuristic's config, no warning), and the user's file is left as it was."""
    from ejk_executor import ConfigCache, ConfigSelectorChain, Invocation, PersistentCache
    from ejk_kernels_gpu import FlashAttentionBackward

    q, k, v = make_inputs(rng, 1, 20, 24, 2, 1, 16, "float32")
    old = Invocation.make(FlashAttentionBackward(version="2"), (q, k, v, q), {"causal": True})
    new = Invocation.make(FlashAttentionBackward(), (q, k, v, q), {"causal": True})
    assert old.call_key != new.call_key
    # As the old code wrote it: {"type": "...:FlashConfig", "cfg": {"block_q": ..., ...}}
    stored = FlashConfig(block_q=16, block_k=16, atomic_dq=True)
    types = (FlashConfig, FlashBackwardConfig)  # both decodable, as in the facade's cache
    PersistentCache(tmp_path, types=types).put(old.call_key, stored)
    path = tmp_path / "configs-v1.json"
    before = path.read_bytes()
    assert b"ejk_kernels_gpu.flash._config:FlashConfig" in before and b'"block_q":16' in before
    chain = ConfigSelectorChain(
        cache=ConfigCache(), persistent=PersistentCache(tmp_path, types=types)
    )
    chosen = chain.choose(new)
    assert chosen.source == "heuristic"
    assert isinstance(chosen.cfg, FlashBackwardConfig)
    assert path.read_bytes() == before
    assert PersistentCache(tmp_path, types=types).get(old.call_key) == stored
