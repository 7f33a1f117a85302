"""The Gluon forward's host side: config checks, which calls take it, its launch contract,
and the jax-triton hook that launches Gluon kernels.

Gluon kernels do not run in Triton's interpreter, so the kernel itself is checked on a
Hopper GPU (benchmarks/gpu_conformance.py, docs/performance.md) and built for sm_90 here
(test_aot.py: its configs and masks, no spills). The tests below pretend to be on Hopper and
stand in for the kernel with a NumPy emulation of its algorithm (`_emulate_gluon`), to check
everything around it: which calls take it, its constexprs, and that the block tables and
mask rules it relies on give the reference's values.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_kernels_gpu.build import _jax_triton_fix
from ejk_kernels_gpu.build._triton import multiprocessors
from ejk_kernels_gpu.flash._config import gluon_fits, ordinary_config
from ejk_kernels_gpu.flash._schedule import forward_order
from ejk_kernels_gpu.flash._select import (
    _GLUON_CONFIGS,
    GLUON_DQ_64,
    THREE_CONSUMERS,
    dq_beside,
    fwd_heuristic,
    fwd_search_space,
)
from ejk_sequtils import random_document_ids, reference_attention

GLUON = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True)
GLUON2 = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, gluon=True)
GLUON256 = FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=2, gluon=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(gluon=1), TypeError, "gluon must be a bool"),
        (dict(gluon=True, warp_specialize=True), ValueError, "cannot be combined"),
        (dict(gluon=True, block_q=32), ValueError, "128-row query tiles"),
        (dict(gluon=True, block_k=16), ValueError, "128-row query tiles"),
        (dict(gluon=True, num_warps=8), ValueError, "128-row query tiles"),
        (dict(gluon=True, num_stages=4), ValueError, "num_stages 2 or 3"),
        (dict(gluon=True, block_q=256), ValueError, "128-row query tiles"),
        (dict(block_q=192), ValueError, "power of two"),  # 192: a Gluon config's only
        (dict(gluon=True, block_q=192, block_k=96), ValueError, "128-row query tiles"),
    ],
)  # fmt: skip
def test_config_rejects_what_the_gluon_build_cannot_run(kwargs, error, match):
    base = dict(block_q=128, block_k=128, num_warps=4, num_stages=2)
    with pytest.raises(error, match=match):
        FlashConfig(**{**base, **kwargs})


def test_the_gluon_build_is_no_backward_config():
    """The Gluon forward's config, passed as a (deprecated) backward one, is no
    `FlashBackwardConfig`: the Gluon dk/dv kernel steps over 64 query rows."""
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"FlashBackwardConfig\.gluon .*block_queries=64"):
        flash_attention(q, q, q, bwd_config=GLUON)


def test_the_three_consumer_tile_is_no_backward_config():
    """Nor is its three-consumer tile: the backward kernels own 64 or 128 keys."""
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"FlashBackwardConfig\.gluon .*block_keys 64 or 128"):
        flash_attention(q, q, q, bwd_config=THREE_CONSUMERS)


def test_soft_cap_calls_take_three_consumers_at_head_dim_128():
    """The heuristic's pick for soft caps without a block table at head_dim 64 and 128; the tuning
    space offers the tile to soft cap calls at 64 and 128, never without a cap."""
    capped = dict(gluon=True, short_loops=True, soft_cap=True)
    assert fwd_heuristic(128, 2, True, **capped) == THREE_CONSUMERS
    assert fwd_heuristic(128, 2, True, gluon=True, short_loops=True) == GLUON2
    assert fwd_heuristic(64, 2, True, **capped) == THREE_CONSUMERS
    assert fwd_heuristic(256, 2, True, **capped) == GLUON256
    assert not fwd_heuristic(128, 4, True, **capped).gluon  # float32
    assert fwd_heuristic(128, 2, True, **capped, windowed=True) == THREE_CONSUMERS
    assert fwd_heuristic(128, 2, True, **capped, tabled=True) == GLUON2
    for head_dim in (64, 128):
        assert THREE_CONSUMERS in fwd_search_space(head_dim, 2, True, gluon=True, soft_cap=True)
        assert THREE_CONSUMERS not in fwd_search_space(head_dim, 2, True, gluon=True)
    assert THREE_CONSUMERS not in fwd_search_space(256, 2, True, gluon=True, soft_cap=True)
    assert THREE_CONSUMERS not in fwd_search_space(128, 2, True, soft_cap=True)  # no Gluon


@pytest.mark.parametrize(
    "kwargs, three",
    [
        (dict(causal=True, logits_soft_cap=50.0), True),
        (dict(logits_soft_cap=30.0), True),
        (dict(causal=True, logits_soft_cap=30.0, dtype=jnp.float16), True),
        (dict(causal=True), False),
        (dict(causal=True, logits_soft_cap=50.0, sliding_window=(256, 0)), False),  # a table
        (dict(causal=True, logits_soft_cap=50.0, segments=True), False),
        (dict(causal=True, logits_soft_cap=50.0, head_dim=64), True),
        (dict(causal=True, logits_soft_cap=50.0, head_dim=256), False),
    ],
)  # fmt: skip
def test_calls_with_a_soft_cap_and_no_table_run_three_consumers(on_hopper, kwargs, three):
    from ejk_kernels_gpu.flash._constexprs import gluon_constexprs
    from ejk_kernels_gpu.flash._select import call_options
    from ejk_sequtils import validate_attention

    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    head_dim = kwargs.pop("head_dim", 128)
    q = jnp.zeros((2, 1088, 8, head_dim), dtype)
    k = jnp.zeros((2, 1152, 8, head_dim), dtype)
    if kwargs.pop("segments", False):
        kwargs["segment_ids"] = (
            jnp.zeros(q.shape[:2], jnp.int32),
            jnp.zeros(k.shape[:2], jnp.int32),
        )
    opts = call_options(validate_attention(q, k, k, **kwargs), None, None)
    assert (opts.fwd_cfg == THREE_CONSUMERS) == three
    consts = gluon_constexprs(opts, q, k, False, opts.fwd_cfg)
    # 1088 rows: off either tile, on whole 64-row consumers' rows (and 1152 keys on either
    # key tile): persistent all the same
    assert consts["PERSISTENT"] == (head_dim <= 128)  # (256: one program a tile)
    assert consts["BM"] == (192 if three else 128)


def test_heuristic_and_space_offer_it_only_when_allowed():
    assert fwd_heuristic(128, 2, False, warp_specialize=True) == GLUON
    assert not fwd_heuristic(128, 2, False).gluon
    assert not fwd_heuristic(128, 4, False, warp_specialize=True).gluon  # float32
    # head_dim 64: the Gluon forward but under a sliding window (slower there, H200)
    assert fwd_heuristic(64, 2, False, gluon=True) == _GLUON_CONFIGS[64][0]
    assert fwd_heuristic(64, 2, True, gluon=True, short_loops=True) == _GLUON_CONFIGS[64][0]
    assert not fwd_heuristic(64, 2, True, gluon=True, windowed=True).gluon
    assert fwd_heuristic(128, 2, True, gluon=True, windowed=True).gluon
    assert {GLUON, GLUON2} <= set(fwd_search_space(64, 2, False, gluon=True))
    assert fwd_heuristic(256, 2, True, gluon=True) == GLUON256
    assert not fwd_heuristic(96, 2, False, gluon=True).gluon
    assert not fwd_heuristic(128, 2, True, warp_specialize=True, gluon=False).gluon
    assert {GLUON, GLUON2} <= set(fwd_search_space(128, 2, False, warp_specialize=True))
    assert {GLUON, GLUON2} <= set(fwd_search_space(128, 2, True, gluon=True))
    assert not any(c.gluon for c in fwd_search_space(128, 2, False))
    assert [c for c in fwd_search_space(256, 2, False, gluon=True) if c.gluon] == [GLUON256]


def test_gluon_fits_the_tiles_to_the_head_dim():
    assert gluon_fits(GLUON, 128) and gluon_fits(GLUON, 64) and gluon_fits(GLUON256, 256)
    assert not gluon_fits(GLUON, 256)  # 128 keys of 256 columns: too many registers
    assert not gluon_fits(GLUON256, 96)  # no tiles for 96
    assert not gluon_fits(FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=3,
                                      gluon=True), 256)  # shared memory  # fmt: skip
    # 64 resident rows: the head_dim 256 backward's keys, no forward tiles
    assert not gluon_fits(FlashConfig(block_q=64, block_k=64, num_warps=4, num_stages=2,
                                      gluon=True), 256)  # fmt: skip
    # 32 keys a step: the head_dim 256 dq kernel's tiles, no forward tiles
    assert not gluon_fits(FlashConfig(block_q=128, block_k=32, num_warps=4, num_stages=2,
                                      gluon=True), 128)  # fmt: skip
    # three consumers: 64 keys a step at head_dim 64 and 128 (128 keys spill at 128)
    assert gluon_fits(THREE_CONSUMERS, 128) and gluon_fits(THREE_CONSUMERS, 64)
    assert not gluon_fits(THREE_CONSUMERS, 256)
    assert not gluon_fits(msgspec.structs.replace(THREE_CONSUMERS, block_k=128), 128)


def test_ordinary_config_keeps_the_tiles():
    twin = FlashConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)
    assert ordinary_config(GLUON, 128, 2, side_inputs=False) == twin
    assert ordinary_config(GLUON2, 128, 2, side_inputs=False) == twin
    # but 128 rows for the three consumers' 192 (the ordinary kernel's tiles: powers of two)
    three = FlashConfig(block_q=128, block_k=64, num_warps=8, num_stages=3)
    assert ordinary_config(THREE_CONSUMERS, 128, 2, side_inputs=False) == three


def _visible(c, b, rows, keys, tabs, lengths, ids=True):
    """The Gluon kernels' mask rule (`kernels.gluon._common.visible`) in NumPy: ``[rows, keys]``,
    True where row sees key (keys past the end, other packed sequences or segments,
    outside causal or the window on positions hidden). ``tabs``: the launch's mask tables
    (q/k sequence ids, q/k positions, q/k segment ids); ``ids`` False: segment ids are
    not compared (the kernel's ``IDS``)."""
    qsid, ksid, qpos, kpos, qseg, kseg = tabs
    q_len, kv_len = lengths
    qr, kk = np.minimum(rows, q_len - 1), np.minimum(keys, kv_len - 1)
    vis = np.broadcast_to((keys < kv_len)[None, :], (len(rows), len(keys))).copy()
    pos_q, pos_k = rows, keys
    if c["SEQ_IDS"]:  # packed sequences; context-parallel blocks compare positions alone
        vis &= (np.where(rows < q_len, qsid[qr], -1)[:, None] ==
                np.where(keys < kv_len, ksid[kk], -2)[None, :])  # fmt: skip
    if c["VARLEN"]:
        pos_q, pos_k = qpos[qr], kpos[kk]
    if c["CAUSAL"]:
        vis &= pos_k[None, :] <= pos_q[:, None]
    if c["WINDOW_LEFT"] >= 0:
        vis &= pos_k[None, :] >= pos_q[:, None] - c["WINDOW_LEFT"]
        vis &= pos_k[None, :] <= pos_q[:, None] + c["WINDOW_RIGHT"]
    if c["HAS_SEG"] and ids:
        qs = np.where(rows < q_len, qseg[b, qr], -1)[:, None]
        vis &= (qs == np.where(keys < kv_len, kseg[b, kk], -1)[None, :]) & (qs >= 0)
    return vis


def _tiles(order, count, consts):
    """The tiles a Gluon kernel's programs take, in order (``(b·N + n)·n_m + query block``):
    with ``ORDERED`` the launch's order, with ``ROWS_MAJOR`` the counter's
    (`flash._schedule.forward_order`); either must be a permutation of them; else the grid's (a
    placeholder order)."""
    if consts["ORDERED"]:
        np.testing.assert_array_equal(np.sort(order), np.arange(count))
        return order
    if consts.get("ROWS_MAJOR"):
        assert not consts["ORDERED"] and consts["PERSISTENT"]
        groups = consts["B"] * consts["N"]
        tiles = forward_order(groups, count // groups, consts["ROWS_MAJOR"], consts["CAUSAL"])
        np.testing.assert_array_equal(np.sort(tiles), np.arange(count))
        return tiles
    assert order.shape == (1,), order.shape
    return range(count)


def _kv_apart(k, v, head_dim, consts):
    """k and v as the kernels read them: with ``KV_PAIR`` the halves of each head's columns
    of the one array passed as both (which must be the same array)."""
    if not consts["KV_PAIR"]:
        return k, v
    np.testing.assert_array_equal(k, v)
    assert k.shape[3] == 2 * head_dim, k.shape
    return k[..., :head_dim], k[..., head_dim:]


def _emulate_gluon(inputs, consts):
    """The Gluon forward's algorithm in NumPy (float32): per query block, the key blocks of
    its table row (unmasked and causal-only calls: the range from its rows) walked as the
    kernel walks them (the first one masked when ``MASKED``, the
    full range unmasked, the rest masked, masked loops compiled out without ``MASKED``),
    each masked block through the kernel's mask rules (causal: those after the full range
    without segment ids). A table that sends a block needing a mask down the unmasked
    path, misses a visible block or leaves other ids after its full range in a causal call,
    gives a wrong answer here. With ``ORDERED`` tiles are taken in the order the launch
    passes (`flash._schedule.launch_order`), which must be a permutation of them. With
    ``FIXED_SHIFT`` (a soft cap) the first block sets each row's shift, floored at
    CAP_OUT - `_SHIFT_ROOM`, and later blocks keep it (no max, no rescaling). With
    ``RESUME`` rows start from the previous (o, lse) (m = lse in log2 units, l = 1), and
    tiles that see no key leave the outputs as the previous call's."""
    from ejk_kernels_gpu.kernels.gluon._forward import _SHIFT_ROOM  # (Triton set up by now)

    q, k, v, sinks, prev_o, prev_lse, qsid, ksid, qpos, kpos, qseg, kseg, ranges, order, _ = (
        np.asarray(x) for x in inputs
    )
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    k, v = _kv_apart(k, v, q.shape[3], consts)
    c = consts
    batch, q_len, heads, head_dim = q.shape
    kv_len, bm, bn = k.shape[1], c["BM"], c["BN"]
    qk, cap = c["QK"], c["SOFT_CAP"]
    out = np.zeros(q.shape, np.float32)
    lse = np.full((batch, heads, q_len), -np.inf, np.float32)
    if c["RESUME"]:  # the outputs are the previous call's buffers
        out, lse = prev_o.astype(np.float32), prev_lse.astype(np.float32)
    n_m = -(-q_len // bm)
    for tile in _tiles(order, batch * heads * n_m, c):
        (b, n), pid = divmod(int(tile) // n_m, heads), int(tile) % n_m
        row0 = pid * bm
        if c["WINDOW_LEFT"] >= 0 or c["VARLEN"] or c["HAS_SEG"]:  # the block table's range
            lo, full_lo, full_hi, hi = ranges[b, pid] if c["HAS_SEG"] else ranges[pid]
            j_lo, jf_lo, jf_hi, j_hi = lo // bn, full_lo // bn, full_hi // bn, -(-hi // bn)
        elif c["CAUSAL"]:  # the kernel's own, from its rows
            j_lo, jf_lo = 0, 0
            j_hi, jf_hi = -(-min(row0 + bm, kv_len) // bn), min((row0 + 1) // bn, kv_len // bn)
        else:
            j_lo, jf_lo, j_hi, jf_hi = 0, 0, -(-kv_len // bn), kv_len // bn
        rows = row0 + np.arange(bm)
        q_rows = np.where((rows < q_len)[:, None], q[b, np.minimum(rows, q_len - 1), n], 0.0)
        sink = float(sinks[n]) * math.log2(math.e) if c["HAS_SINKS"] else None
        m = np.full(bm, -np.inf if sink is None else sink, np.float32)
        l_sum = np.zeros(bm, np.float32) if sink is None else np.ones(bm, np.float32)
        acc = np.zeros((bm, head_dim), np.float32)
        if c["RESUME"]:
            if j_hi <= j_lo:
                continue  # nothing stored
            kept = np.minimum(rows, q_len - 1)
            m = np.where(rows < q_len, prev_lse[b, n, kept], -np.inf) * math.log2(math.e)
            l_sum = np.where(m > -np.inf, 1.0, 0.0).astype(np.float32)
            acc = np.where((rows < q_len)[:, None], prev_o[b, kept, n], 0.0).astype(np.float32)
        # (block, masked, segment ids compared)
        walk = [(j_lo, c["MASKED"], True)] if j_hi > j_lo else []
        if j_hi > j_lo:
            if c["MASKED"]:
                walk += [(j, True, True) for j in range(j_lo + 1, jf_lo)]
            walk += [(j, False, True) for j in range(max(jf_lo, j_lo + 1), jf_hi)]
            if c["MASKED"]:
                after = range(max(jf_hi, j_lo + 1), j_hi)
                walk += [(j, True, not c["CAUSAL"]) for j in after]
        for step, (j, masked, ids) in enumerate(walk):
            keys = j * bn + np.arange(bn)
            kk = np.minimum(keys, kv_len - 1)
            kh = n // c["G"]
            k_blk = np.where((keys < kv_len)[:, None], k[b, kk, kh], 0.0)
            v_blk = np.where((keys < kv_len)[:, None], v[b, kk, kh], 0.0)
            s = q_rows @ k_blk.T
            x = np.tanh(s * c["CAP_IN"]) * c["CAP_OUT"] if cap > 0 else s * qk
            if masked:
                tabs = (qsid, ksid, qpos, kpos, qseg, kseg)
                seen = _visible(c, b, rows, keys, tabs, (q_len, kv_len), ids)
                x = np.where(seen, x, -np.inf)
            if c["FIXED_SHIFT"] and step > 0:
                p = np.exp2(x - m[:, None])
                l_sum = l_sum + p.sum(1)
                acc = acc + p @ v_blk
                continue
            m_new = np.maximum(m, x.max(1))
            if c["FIXED_SHIFT"]:
                m_new = np.maximum(m_new, c["CAP_OUT"] - _SHIFT_ROOM.value)
            m_use = np.where(m_new == -np.inf, 0.0, m_new) if masked else m_new
            p = np.exp2(x - m_use[:, None])
            alpha = np.exp2(m - m_use)
            l_sum = l_sum * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v_blk
            m = m_new
        keep = rows < q_len
        mass = l_sum > 0
        o = acc / np.where(mass, l_sum, 1.0)[:, None]
        out[b, rows[keep], n] = o[keep]
        lse[b, n, rows[keep]] = np.where(
            mass, (m + np.log2(np.where(mass, l_sum, 1.0))) * math.log(2), -np.inf
        )[keep]
    return out, lse


def _emulate_gluon_dkdv(inputs, consts):
    """The Gluon dk/dv kernel's algorithm in NumPy (float32): per program (``BN`` keys of one
    (batch, kv head)), the query blocks `query_blocks` gives it (with a window, packing or
    segment ids the dk/dv table's range, masked outside its full range; causal alone: from
    the first block that reaches its keys, causal on indices), each head of the group, P
    rebuilt from the saved lse (rows without mass: 0; soft-capped logits); dk scaled at the
    end, keys past the end dropped; with ``DQ`` the unscaled ``dS·k`` of every step summed
    into a float32 dq (else a one-element placeholder, as the launch's). With segment ids
    With ``ORDERED`` programs take their tiles from the order input as the kernel does
    (`program_tile`), which must be a permutation of the grid's tiles.
    A range that skips a block some key sees, or a full range that holds a hidden pair,
    gives a wrong gradient here."""
    q, k, v, d_out, lse, delta = (np.asarray(x, np.float32) for x in inputs[:6])
    k, v = _kv_apart(k, v, q.shape[3], consts)
    tabs, ranges = [np.asarray(x) for x in inputs[6:12]], np.asarray(inputs[12])
    order = np.asarray(inputs[13])
    c = consts
    table = c["WINDOW_LEFT"] >= 0 or c["VARLEN"] or c["HAS_SEG"]
    batch, q_len = q.shape[:2]
    kv_len, kv_heads = k.shape[1], k.shape[2]
    bm, bn = c["BM"], c["BN"]
    dk = np.zeros(k.shape, np.float32)
    dv = np.zeros(v.shape, np.float32)
    dq = np.zeros(q.shape if c["DQ"] else (1,), np.float32)
    blocks = -(-kv_len // bn)
    for tile in _tiles(order, batch * kv_heads * blocks, c):
        pid_n, (b, kh) = tile % blocks, divmod(int(tile) // blocks, kv_heads)
        keys = pid_n * bn + np.arange(bn)
        valid = keys < kv_len
        kk = np.minimum(keys, kv_len - 1)
        k_blk = np.where(valid[:, None], k[b, kk, kh], 0.0)
        v_blk = np.where(valid[:, None], v[b, kk, kh], 0.0)
        dk_blk = np.zeros_like(k_blk)
        dv_blk = np.zeros_like(v_blk)
        first = min(pid_n * bn // bm, q_len // bm) if c["CAUSAL"] else 0
        full, end = (0, 0), q_len // bm
        if table:
            lo, full_lo, full_hi, hi = ranges[b, pid_n] if c["HAS_SEG"] else ranges[pid_n]
            first, full, end = lo // bm, (full_lo // bm, full_hi // bm), -(-hi // bm)
        for n, m in itertools.product(range(kh * c["G"], (kh + 1) * c["G"]), range(first, end)):
            rows = m * bm + np.arange(bm)
            lse2 = lse[b, n, rows] * math.log2(math.e)
            lse2 = np.where(lse2 == -np.inf, np.inf, lse2)
            s = k_blk @ q[b, rows, n].T
            slope = 1.0
            if c["SOFT_CAP"] > 0:  # capped logits; dS takes their slope 1 - tanh²
                t = np.tanh(s * c["CAP_IN"])
                p = np.exp2(t * c["CAP_OUT"] - lse2[None, :])
                slope = 1.0 - t * t
            else:
                p = np.exp2(s * c["QK"] - lse2[None, :])
            if table and not full[0] <= m < full[1]:
                p = np.where(_visible(c, b, rows, keys, tabs, (q_len, kv_len)).T, p, 0.0)
            elif not table and c["CAUSAL"]:
                p = np.where(keys[:, None] <= rows[None, :], p, 0.0)
            dv_blk += p @ d_out[b, rows, n]
            ds = p * slope * (v_blk @ d_out[b, rows, n].T - delta[b, n, rows][None, :])
            dk_blk += ds @ q[b, rows, n]
            if c["DQ"]:
                dq[b, rows, n] += ds.T @ k_blk
        dk[b, keys[valid], kh] = dk_blk[valid] * c["SCALE"]
        dv[b, keys[valid], kh] = dv_blk[valid]
    return dk, dv, dq


def _emulate_gluon_dq(inputs, consts):
    """The Gluon dq kernel's algorithm in NumPy (float32): per program (``BM`` query rows of
    one (batch, head)), the key blocks it visits (with a window, packing or segment ids the
    dq table's range, masked outside its full range; else causal up to its last row's key,
    causal on indices and keys past the end masked but in each consumer's blocks wholly
    before its rows), P from the saved lse (soft-capped
    logits, their slope in dS); dq scaled at the end. With ``ORDERED`` programs take their
    tiles from the order input (`program_tile`), a permutation of the grid's tiles."""
    q, k, v, d_out, lse, delta = (np.asarray(x, np.float32) for x in inputs[:6])
    k, v = _kv_apart(k, v, q.shape[3], consts)
    tabs, ranges = [np.asarray(x) for x in inputs[6:12]], np.asarray(inputs[12])
    order = np.asarray(inputs[13])
    c = consts
    table = c["WINDOW_LEFT"] >= 0 or c["VARLEN"] or c["HAS_SEG"]
    batch, q_len, heads, _ = q.shape
    kv_len = k.shape[1]
    bm, bn = c["BM"], c["BN"]
    dq = np.zeros(q.shape, np.float32)
    n_m = -(-q_len // bm)
    for tile in _tiles(order, batch * heads * n_m, c):
        (b, n), pid_m = divmod(int(tile) // n_m, heads), int(tile) % n_m
        rows = pid_m * bm + np.arange(bm)
        valid = rows < q_len
        rr = np.minimum(rows, q_len - 1)
        q_blk = np.where(valid[:, None], q[b, rr, n], 0.0)
        do_blk = np.where(valid[:, None], d_out[b, rr, n], 0.0)
        lse2 = np.where(valid, lse[b, n, rr], np.inf) * math.log2(math.e)
        lse2 = np.where(lse2 == -np.inf, np.inf, lse2)
        dlt = np.where(valid, delta[b, n, rr], 0.0)
        end = -(-min((pid_m + 1) * bm, kv_len) // bn) if c["CAUSAL"] else -(-kv_len // bn)
        first, full = 0, (0, 0)
        if table:
            lo, full_lo, full_hi, hi = ranges[b, pid_m] if c["HAS_SEG"] else ranges[pid_m]
            first, full, end = lo // bn, (full_lo // bn, full_hi // bn), -(-hi // bn)
        acc = np.zeros_like(q_blk)
        for j in range(first, end):
            keys = j * bn + np.arange(bn)
            kk = np.minimum(keys, kv_len - 1)
            k_blk = np.where((keys < kv_len)[:, None], k[b, kk, n // c["G"]], 0.0)
            v_blk = np.where((keys < kv_len)[:, None], v[b, kk, n // c["G"]], 0.0)
            s = q_blk @ k_blk.T
            slope = 1.0
            # A hidden pair's p may overflow to inf (a row whose visible logits sit at -cap
            # against a hidden +cap: 2^144), as in the kernel; the masks below zero it.
            with np.errstate(over="ignore"):
                if c["SOFT_CAP"] > 0:
                    t = np.tanh(s * c["CAP_IN"])
                    p = np.exp2(t * c["CAP_OUT"] - lse2[:, None])
                    slope = 1.0 - t * t
                else:
                    p = np.exp2(s * c["QK"] - lse2[:, None])
            if table and not full[0] <= j < full[1]:
                p = np.where(_visible(c, b, rows, keys, tabs, (q_len, kv_len)), p, 0.0)
            elif not table:
                # Each consumer (64 rows: two a program, three at 192 rows) runs unmasked
                # the blocks wholly before its first row and within the keys (causal), or
                # every block where the keys end on a block (else): the kernel's loop
                # without masks.
                first_row = pid_m * bm + (np.arange(bm) // 64) * 64
                if c["CAUSAL"]:
                    bare = j < np.minimum(np.minimum((first_row + 1) // bn, end), kv_len // bn)
                else:
                    bare = np.full(bm, kv_len % bn == 0)
                seen = (keys < kv_len)[None, :]
                if c["CAUSAL"]:
                    seen = seen & (keys[None, :] <= rows[:, None])
                p = np.where(bare[:, None] | seen, p, 0.0)
            acc += (p * slope * (do_blk @ v_blk.T - dlt[:, None])) @ k_blk
        dq[b, rows[valid], n] = acc[valid] * c["SCALE"]
    return dq


# The Gluon kernels' NumPy stand-ins, by kernel name.
_EMULATIONS = {
    "gluon_fwd_kernel": _emulate_gluon,
    "gluon_dkdv_kernel": _emulate_gluon_dkdv,
    "gluon_dkdv_wide_kernel": _emulate_gluon_dkdv,  # the same algorithm, 64 keys a program
    "gluon_dq_kernel": _emulate_gluon_dq,
}


class _Launches(list):
    """Forward launches seen (the list) and the Gluon dk/dv and dq kernels' (``dkdv``, ``dq``)."""

    dkdv: list
    dq: list


@pytest.fixture(name="gluon_launches")
def gluon_launches_fixture(on_hopper):
    """Pretend to be on Hopper; record each forward launch, and answer the Gluon kernels'
    (forward, dk/dv, dq) with their NumPy emulations (`_emulate_gluon`,
    `_emulate_gluon_dkdv`, `_emulate_gluon_dq`) and an empty scratch buffer; the ordinary
    dq kernel's launches run as usual, recorded in ``ordinary_dq``."""
    seen = _Launches()
    seen.dkdv = []
    seen.dq = []
    seen.ordinary_dq = []

    logs = {
        "gluon_fwd_kernel": seen,
        "gluon_dkdv_kernel": seen.dkdv,
        "gluon_dkdv_wide_kernel": seen.dkdv,
        "gluon_dq_kernel": seen.dq,
    }

    def record(name, grid, inputs, outs, consts, kwargs):
        if name == "fwd_kernel":
            seen.append((name, grid, dict(consts), None, kwargs))
        if name == "dq_kernel":
            seen.ordinary_dq.append((grid, dict(consts), kwargs))
        if name not in _EMULATIONS:
            return None
        entry = (grid, dict(consts), [(o.shape, o.dtype) for o in outs], kwargs)
        logs[name].append((name, *entry) if name == "gluon_fwd_kernel" else entry)
        values = _EMULATIONS[name](inputs, consts)
        *results, scratch = outs
        values = values if isinstance(values, tuple) else (values,)
        # outputs past the emulated ones (the forward's tile counter) and the scratch: zeros
        return (
            *(jnp.asarray(v, o.dtype) for v, o in zip(values, results[: len(values)], strict=True)),
            *(jnp.zeros(out.shape, out.dtype) for out in (*results[len(values) :], scratch)),
        )

    on_hopper(record)
    return seen


def test_unmasked_and_causal_calls_launch_it_by_default(gluon_launches, rng, close, edge):
    """Its launch: grid, constexprs, outputs (lse [B, N, T]); values, lse and gradients of
    the whole call (the backward kernels, interpreted, take the lse it returns)."""
    causal, q_len, kv_len, kv_heads, sinks = edge
    heads = 4
    q = jnp.asarray(rng.standard_normal((2, q_len, heads, 128)), jnp.bfloat16)
    kv = (2, kv_len, kv_heads, 128)
    k, v = (jnp.asarray(rng.standard_normal(kv), jnp.bfloat16) for _ in range(2))
    s = jnp.asarray(rng.standard_normal(heads), jnp.float32) if sinks else None

    def loss(q, k, v):
        out, lse = flash_attention(q, k, v, causal=causal, softmax_sinks=s, return_lse=True)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    [(_, grid, consts, outs, kw)] = gluon_launches
    # One program a tile, or one per SM looping over the tiles when they are whole.
    tiles = -(-q_len // 128) * 2 * heads
    persistent = q_len % 128 == 0 and kv_len % 128 == 0
    assert consts["PERSISTENT"] == persistent
    assert grid == ((min(tiles, multiprocessors()) if persistent else tiles),)
    assert {k: consts[k] for k in ("T", "S", "N", "G", "H", "CAUSAL", "HAS_SINKS")} == dict(
        T=q_len, S=kv_len, N=heads, G=heads // kv_heads, H=128, CAUSAL=causal, HAS_SINKS=sinks
    )
    assert consts["MASKED"] == causal  # the keys fill their 128-key tiles
    # the launch's tile order for one program a tile, causal; persistent ones, the grid's
    assert consts["ORDERED"] == (causal and not persistent)
    assert consts["QK"] == pytest.approx(128**-0.5 * math.log2(math.e))
    # causal calls of up to 8192 keys take two slots (`flash._select.short_causal`), others three
    slots = 2 if causal else 3
    assert (consts["BM"], consts["BN"], consts["STAGES"], kw["num_warps"]) == (128, 128, slots, 4)
    assert outs[:3] == [(q.shape, q.dtype), ((2, heads, q_len), jnp.float32), ((1,), jnp.int32)]
    assert outs[3][0][0] >= _jax_triton_fix.scratch_bytes(grid)  # four TMA descriptors a program

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]

    def ref_loss(q, k, v):
        out, lse = reference_attention(q, k, v, causal=causal, softmax_sinks=s, return_lse=True)
        return jnp.sum(out.astype(jnp.bfloat16).astype(jnp.float32) ** 2) + jnp.sum(lse)

    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(*f32)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        close(got, ref, q.dtype, "grad", name)


# Masked calls the Gluon forward takes: (name, head_dim, q_len, kv_len, kwargs).
MASKED_CALLS = [
    ("window", 128, 384, 384, dict(causal=True, sliding_window=(100, 0))),
    ("window two-sided T!=S", 64, 200, 300, dict(sliding_window=(60, 30))),
    ("soft cap sinks", 128, 256, 256, dict(causal=True, logits_soft_cap=5.0, sinks=True)),
    ("keys off the tile", 128, 130, 200, {}),
    ("documents", 128, 384, 384, dict(causal=True, documents=True)),
    ("documents repeat", 64, 256, 256, dict(documents="repeat")),
    # Causal blocks after the unmasked ones compare positions alone: with documents of
    # whole tiles they run so; where the keys' ids differ from the rows' (cross ids) the
    # table must mask the whole range instead.
    ("documents whole tiles", 128, 384, 384, dict(causal=True, documents="tiles")),
    ("documents cross ids", 128, 384, 384, dict(causal=True, documents="cross")),
    ("packed", 128, 400, 400, dict(causal=True, packed=True)),
    ("head_dim 256 window cap", 256, 256, 256, dict(causal=True, sliding_window=(70, 0), logits_soft_cap=8.0)),
    # bf16 with a cap up to 55: each row's shift fixed after a tile's first block; logits
    # saturated at +-cap, rows whose every logit is -cap (floored shift) among them.
    ("soft cap 50 bf16 fixed shift", 128, 384, 384, dict(causal=True, logits_soft_cap=50.0, dtype=jnp.bfloat16, saturate=True)),
    ("soft cap 20 bf16 window sinks", 128, 384, 384, dict(sliding_window=(150, 20), logits_soft_cap=20.0, dtype=jnp.bfloat16, sinks=True)),
    ("decode row", 128, 1, 300, dict(causal=True)),
    # Three consumers (192-row tiles): the heuristic's with a soft cap and no table, rows off
    # the tile on whole 64-row steps (the last tile's third consumer idle) or off them; asked
    # for with documents and a window.
    ("soft cap three consumers", 128, 320, 320, dict(causal=True, logits_soft_cap=30.0, dtype=jnp.bfloat16)),
    ("soft cap three consumers T!=S", 128, 250, 300, dict(logits_soft_cap=20.0, sinks=True)),
    ("documents soft cap three consumers", 128, 384, 384, dict(causal=True, documents=True, logits_soft_cap=20.0, three=True)),
    ("window three consumers", 128, 448, 448, dict(causal=True, sliding_window=(100, 0), three=True)),
]  # fmt: skip


def _documents_or_packing(rng, kwargs, batch, q_len, max_len):
    """Turn a case's ``packed`` / ``documents`` keywords into the call's side inputs (in
    place): packed sequences of 90, 1, 159 and the rest of ``q_len`` tokens but 3 padding
    ones (batch 1), or documents of 20-``max_len`` tokens with 5 padding rows at the end
    (``"repeat"``: ids that come back in a later run; ``"tiles"``: documents of 256 and 128
    tokens; ``"cross"``: those for the rows, the keys' second document from token 192).
    Returns the batch size."""
    if kwargs.pop("packed", False):
        batch = 1
        cu = jnp.asarray([0, 90, 91, 250, q_len - 3], jnp.int32)  # padding at the end
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    documents = kwargs.pop("documents", False)
    if documents in ("tiles", "cross"):
        split = lambda at: np.repeat(np.int32([[0, 1]]), [at, q_len - at], axis=1).repeat(batch, 0)
        rows = split(256)
        keys = rows if documents == "tiles" else split(192)
        kwargs["segment_ids"] = (jnp.asarray(rows), jnp.asarray(keys))
    elif documents:
        ids = random_document_ids(
            rng, batch, q_len, min_len=20, max_len=max_len, padding=5,
            repeat=documents == "repeat",
        )  # fmt: skip
        kwargs["segment_ids"] = jnp.asarray(ids)
    return batch


@pytest.mark.parametrize("case", MASKED_CALLS, ids=[c[0] for c in MASKED_CALLS])
def test_masked_calls_take_it_with_the_reference_values(gluon_launches, rng, close, case):
    """Windows, soft caps, documents (repeated ids, padding rows that see nothing), packed
    sequences, keys off the tile and head_dim 64/256 run the Gluon forward; the emulated
    kernel, fed the launch's own tables, gives the reference's values, lse and (through the
    interpreted backward) gradients."""
    _, head_dim, q_len, kv_len, kwargs = case
    kwargs = dict(kwargs)
    heads, kv_heads = 4, 2
    # Documents of 20-90 tokens: across the 128-row tiles.
    batch = _documents_or_packing(rng, kwargs, 2, q_len, max_len=90)
    if kwargs.pop("sinks", False):
        kwargs["softmax_sinks"] = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    dtype = kwargs.pop("dtype", jnp.float16)
    q = rng.standard_normal((batch, q_len, heads, head_dim))
    kv = (batch, kv_len, kv_heads, head_dim)
    k, v = (rng.standard_normal(kv) for _ in range(2))
    v_scale = 1.0
    if kwargs.pop("saturate", False):  # logits of tens through the cap, and of -+cap:
        # query heads 2, 3 (kv head 1) see logits of -cap in the first key block (the
        # rows of the first tile: nothing else, their shift the floor) and +cap after it
        # (a shift from the first block alone would make p = 2^(2·cap·log2 e): inf).
        key = k[:, :1, 1].copy()  # [B, 1, H]
        k[:, :, 1] = np.where(np.arange(kv_len)[None, :, None] < 128, -key, key)
        q *= 60 * head_dim**0.5 / np.linalg.norm(q, axis=-1, keepdims=True)
        row = 300 * head_dim**0.5 * key / np.sum(key * key, axis=-1, keepdims=True)
        q[:, :, 2:] = row[:, :, None]  # scale·q·k = -+300, capped to -+50·tanh(6)
        v_scale = 2.0**21  # o sums 2^29 of v at p = 2^room: inf with a room of 100
        v[:, :, 1] = np.abs(v[:, :, 1])
        v *= v_scale
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    # head_dim 64 asks for it (the heuristic leaves windowed calls there to the ordinary kernel).
    config = {"config": GLUON} if head_dim == 64 else {}
    if kwargs.pop("three", False):
        config = {"config": THREE_CONSUMERS}
    tabled = any(n in kwargs for n in ("sliding_window", "segment_ids", "cu_seqlens_q"))
    capped = "logits_soft_cap" in kwargs and not tabled and head_dim in (64, 128) and not config
    rows = 192 if capped or config.get("config") == THREE_CONSUMERS else 128

    def loss(fn, q, k, v):
        extra = config if fn is flash_attention else {}
        out, lse = fn(q, k, v, return_lse=True, **kwargs, **extra)
        live = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(live), (out, lse)

    grads, (out, lse) = jax.grad(lambda *a: loss(flash_attention, *a), (0, 1, 2), has_aux=True)(
        q, k, v
    )
    [(name, _, consts, _, _)] = [launch for launch in gluon_launches if launch[3] is not None]
    assert name == "gluon_fwd_kernel" and consts["H"] == head_dim
    assert consts["FIXED_SHIFT"] == (dtype == jnp.bfloat16)
    assert consts["BM"] == rows
    assert consts["BN"] == (64 if head_dim == 256 or rows == 192 else 128)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_grads, (ref_out, ref_lse) = jax.grad(
        lambda *a: loss(reference_attention, *a), (0, 1, 2), has_aux=True
    )(*f32)
    # (within one ulp of the output's 16-bit type, bf16's 2^-7 wider than fp16's)
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 0.0
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=3e-3 * v_scale, rtol=ulp)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-3)  # -inf where no key
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        # Saturated logits and v of 2^21: gradients of 1e13 whose dS = P·(dP - delta) cancel
        # where a row's softmax is one key (delta from the 16-bit output): compare them in
        # units of each gradient's largest element.
        unit = float(jnp.max(jnp.abs(ref))) if v_scale != 1.0 else 1.0
        close(got.astype(jnp.float32) / unit, ref / unit, dtype, "grad", name)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bias=True),
        dict(dtype=jnp.float32),
        dict(dropout_rate=0.2, dropout_seed=1),
        dict(head_dim=96),
    ],
)  # fmt: skip
def test_other_calls_run_the_ordinary_kernel_correctly(gluon_launches, rng, kwargs):
    """An explicit Gluon config falls back to the ordinary kernel with the same tiles where
    the Gluon forward cannot run: a bias, float32, dropout, a head_dim it has no tiles for."""
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    head_dim = kwargs.pop("head_dim", 128)
    kv_len = kwargs.pop("kv_len", 128)
    q = jnp.asarray(rng.standard_normal((1, 128, 1, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, kv_len, 1, head_dim)), dtype) for _ in range(2))
    if kwargs.pop("bias", False):
        kwargs["bias"] = jnp.asarray(rng.standard_normal((1, 1, 128, kv_len)), dtype)
    got = flash_attention(q, k, v, config=GLUON, **kwargs)
    assert [(name, c["BLOCK_M"], c["BLOCK_N"]) for name, _, c, _, _ in gluon_launches] == [
        ("fwd_kernel", 128, 128)
    ]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"].astype(jnp.float32)
    ref = reference_attention(*f32, **kwargs)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=tol)


class _Fn:
    """A kernel as the hook sees it (hashable, like a JITFunction)."""

    arg_names = ("q_ptr", "o_ptr", "scratch_ptr", "T")

    def __init__(self, gluon: bool):
        self.gluon = gluon

    def is_gluon(self) -> bool:
        return self.gluon


def test_jax_triton_hook_compiles_gluon_kernels_itself(monkeypatch, scratch_ptx):
    """Triton kernels keep jax-triton's path; a Gluon kernel is compiled by `compile_gluon`
    once per signature and handed to jaxlib with its scratch redirected (the thread count
    follows from `_KernelLib`, which `install` puts in front of jaxlib)."""
    made, compiled = [], []

    def original(*args, **kw):
        return "triton path"

    def fake_compile(fn, signature, constexprs, num_warps, capability):
        compiled.append((signature, constexprs, num_warps, capability))
        meta = SimpleNamespace(name="gluon_fwd_kernel", shared=4096)
        return SimpleNamespace(metadata=meta, asm={"ptx": scratch_ptx("gluon_fwd_kernel")})

    lib = SimpleNamespace(
        TritonKernel=lambda *args: made.append(args) or "kernel",
        get_compute_capability=lambda device: 90,
    )
    triton_lib = SimpleNamespace(get_or_create_triton_kernel=original, triton_kernel_call_lib=lib)
    monkeypatch.setattr(_jax_triton_fix, "compile_gluon", fake_compile)
    _jax_triton_fix._install_gluon(triton_lib)
    get = triton_lib.get_or_create_triton_kernel
    kw = dict(num_warps=4, num_stages=3, num_ctas=1, compute_capability=None,
              enable_fp_fusion=True, metaparams=dict(T=128), dump=False)  # fmt: skip
    assert get(None, "cuda", _Fn(False), ["*bf16"], [], **kw) == "triton path"
    gluon = _Fn(True)
    dtypes = ["*bf16", "*bf16", "*u8"]
    first = get(None, "cuda", gluon, dtypes, [], **kw)
    assert get(None, "cuda", gluon, dtypes, [], **kw) is first  # cached
    assert compiled == [(dict(q_ptr="*bf16", o_ptr="*bf16", scratch_ptr="*u8"), dict(T=128), 4, 90)]
    kernel, attrs = first
    assert kernel == "kernel" and set(attrs) == {(0,), (1,), (2,)}
    [(name, warps, _, shared, ptx, *_)] = made
    assert (name, warps, shared) == ("gluon_fwd_kernel", 4, 4096)
    assert "[gluon_fwd_kernel_param_1]" in ptx and "[gluon_fwd_kernel_param_2]" not in ptx


@pytest.mark.parametrize(
    "shape, causal, window, seg, persistent",
    [
        ((4, 4096, 32, 128), False, None, False, True),  # equal tiles
        ((4, 4096, 32, 128), True, None, False, True),  # causal: the tile counter balances
        ((1, 16384, 16, 128), True, None, False, True),
        ((1, 16384, 16, 128), True, (1024, 0), False, True),
        ((1, 16384, 16, 128), True, None, True, True),  # documents of any lengths too
        ((2, 1000, 8, 128), False, None, False, False),  # rows off the 64-row steps
        ((2, 1088, 8, 128), True, None, False, False),  # keys (here T) off the key tile
        ((2, 1024, 8, 256), False, None, False, False),  # head_dim 256 would spill
    ],
)
def test_the_persistent_grid_is_taken_on_whole_tiles(shape, causal, window, seg, persistent):
    from ejk_kernels_gpu.flash._constexprs import gluon_persistent
    from ejk_kernels_gpu.flash._select import CallOptions

    opts = CallOptions(
        scale=0.1, causal=causal, window=window, soft_cap=0.0, dropout_rate=0.0, has_seg=seg,
        varlen=False, fwd_cfg=FlashConfig(), bwd_cfg=FlashBackwardConfig(),
    )  # fmt: skip
    cfg = FlashConfig(block_q=128, block_k=64 if shape[3] == 256 else 128, num_stages=2, gluon=True)
    assert gluon_persistent(opts, shape, shape[1], cfg) == persistent


@pytest.mark.parametrize(
    "shape, causal, seg, varlen, expected",
    [
        ((1, 8192, 32, 128), True, True, False, 32),  # 2048 tiles: 16 a multiprocessor
        ((1, 16384, 16, 128), True, False, True, 16),  # packed sequences too
        ((1, 32768, 32, 128), True, True, False, 0),  # 62 tiles a multiprocessor
        ((1, 8192, 32, 128), False, True, False, 0),  # not causal: tiles alike in order
        ((4, 4096, 32, 128), True, False, False, 17),  # causal alone: 4 x 132 / 32 blocks
        ((1, 8192, 32, 128), True, False, False, 9),  # 4 x 132 / 64
        ((1, 8192, 2, 128), True, False, False, 2),  # every group
        ((1, 16384, 16, 128), True, False, False, 0),  # 128 blocks a group: the grid's order
        ((2, 1000, 8, 128), True, True, False, 0),  # rows off the tile: not persistent
    ],
)
def test_short_causal_calls_take_their_last_tiles_rows_major(shape, causal, seg, varlen, expected):
    """One query block of each (batch, head) at a time, the last blocks first, so that the
    counter's last tiles are light: every group in causal calls with documents or packed
    sequences of at most `ROWS_MAJOR_WAVES` tiles a multiprocessor (132 here); the last
    groups holding `TAIL_WAVES` multiprocessors' worth of the heaviest tiles in causal
    calls without a table of at most `TAIL_BLOCKS` query blocks."""
    from ejk_kernels_gpu.flash import _constexprs
    from ejk_kernels_gpu.flash._constexprs import gluon_persistent, rows_major
    from ejk_kernels_gpu.flash._select import CallOptions

    opts = CallOptions(
        scale=0.1, causal=causal, window=None, soft_cap=0.0, dropout_rate=0.0, has_seg=seg,
        varlen=varlen, fwd_cfg=FlashConfig(), bwd_cfg=FlashBackwardConfig(),
    )  # fmt: skip
    cfg = FlashConfig(block_q=128, block_k=128, num_stages=2, gluon=True)
    persistent = gluon_persistent(opts, shape, shape[1], cfg)
    assert _constexprs.multiprocessors() == 132
    assert rows_major(opts, shape, cfg, persistent=persistent) == expected


def test_a_causal_call_takes_its_last_groups_rows_major_with_the_reference_values(
    gluon_launches, rng
):
    """72 (batch, head) groups of 8 query blocks: the first 6 in the grid's order, the last
    66 (4 x 132 / 8) one query block of each at a time; the tiles stay a permutation and
    the output the reference's."""
    q = jnp.asarray(rng.standard_normal((1, 1024, 72, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, 1024, 8, 128)), jnp.bfloat16) for _ in range(2))
    out = flash_attention(q, k, v, causal=True)
    [(name, _, consts, _, _)] = gluon_launches
    assert name == "gluon_fwd_kernel" and consts["PERSISTENT"] and consts["ROWS_MAJOR"] == 66
    want = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, length, slots",
    [
        (dict(), 1024, 3),
        (dict(causal=True), 1024, 2),
        (dict(causal=True), 8192, 2),
        (dict(causal=True), 16384, 3),
        (dict(causal=True, sliding_window=(300, 0)), 16384, 2),
        (dict(causal=True, logits_soft_cap=30.0), 1024, 2),
        (dict(causal=True, documents=True), 16384, 2),
    ],
    ids=["unmasked", "causal", "causal 8192", "causal 16384", "window", "soft cap", "documents"],
)
def test_calls_with_short_or_heavy_key_loops_give_the_output_a_buffer_of_its_own(
    on_hopper, kwargs, length, slots
):
    """At head_dim 128 the forward heuristic takes two ring slots for windows, soft caps,
    documents and causal calls of up to 8192 keys (its output then gets a buffer of its own,
    ``OBUF``: the next tile's q loads during a tile's epilogue), three otherwise (no room for
    it); head_dim 64 has room with three; one program a tile, or head_dim 256, never."""
    from ejk_kernels_gpu.flash._constexprs import gluon_constexprs, gluon_obuf
    from ejk_kernels_gpu.flash._select import call_options
    from ejk_sequtils import validate_attention

    kwargs = dict(kwargs)
    q = jnp.zeros((1, length, 8, 128), jnp.bfloat16)
    if kwargs.pop("documents", False):
        kwargs["segment_ids"] = jnp.zeros((1, length), jnp.int32)
    request = validate_attention(q, q, q, **kwargs)
    opts = call_options(request, None, None)
    assert opts.fwd_cfg.gluon and opts.fwd_cfg.num_stages == slots
    assert gluon_constexprs(opts, q, q, False, opts.fwd_cfg)["OBUF"] == (slots == 2)
    assert gluon_obuf(GLUON, 64, persistent=True) and gluon_obuf(GLUON2, 128, persistent=True)
    assert not gluon_obuf(GLUON2, 128, persistent=False)
    assert not gluon_obuf(GLUON256, 256, persistent=True)


@pytest.mark.parametrize(
    "kwargs, gluon",
    [
        (dict(causal=True), True),
        ({}, True),
        (dict(causal=True, logits_soft_cap=50.0), True),
        (dict(causal=True, documents=True), True),
        (dict(causal=True, sliding_window=(256, 0)), False),
        (dict(sliding_window=(100, 50), logits_soft_cap=50.0), False),
    ],
    ids=["causal", "unmasked", "soft cap", "documents", "window", "window and cap"],
)
def test_head_dim_64_calls_take_the_gluon_forward_but_under_a_window(on_hopper, kwargs, gluon):
    """At head_dim 64 the forward heuristic takes the Gluon forward (three slots) for every
    call it can run but those with a sliding window, where it measured slower than the
    ordinary kernel (H200, `flash._select.FORWARD_RULES`)."""
    from ejk_kernels_gpu.flash._select import call_options
    from ejk_sequtils import validate_attention

    kwargs = dict(kwargs)
    q = jnp.zeros((2, 1024, 8, 64), jnp.bfloat16)
    if kwargs.pop("documents", False):
        kwargs["segment_ids"] = jnp.zeros((2, 1024), jnp.int32)
    opts = call_options(validate_attention(q, q, q, **kwargs), None, None)
    assert opts.fwd_cfg.gluon == gluon
    # (soft caps without a table: its three-consumer tile, `THREE_CONSUMERS`)
    three = "logits_soft_cap" in kwargs and gluon and "segment_ids" not in kwargs
    expected = THREE_CONSUMERS if three else _GLUON_CONFIGS[64][0]
    assert opts.fwd_cfg == (expected if gluon else fwd_heuristic(64, 2, True))


@pytest.mark.parametrize(
    "kv_heads, kwargs, gluon",
    [
        (2, dict(causal=True), True),
        (2, {}, True),
        (8, dict(causal=True, logits_soft_cap=50.0), True),
        (8, dict(causal=True), False),
        (8, {}, False),
        (8, dict(causal=True, documents=True), False),
        (2, dict(causal=True, documents=True), True),
        (8, dict(causal=True, sliding_window=(256, 0), logits_soft_cap=50.0), True),
    ],
    ids=["gqa causal", "gqa unmasked", "mha soft cap", "mha causal", "mha", "mha docs",
         "gqa docs", "window cap"],
)  # fmt: skip
def test_head_dim_64_backwards_take_the_gluon_dkdv_kernel_with_groups_or_a_soft_cap(
    on_hopper, kv_heads, kwargs, gluon
):
    """At head_dim 64 the backward heuristic takes the Gluon dk/dv kernel (two slots) with
    groups or a soft cap, the ordinary dq kernel beside it without a cap and the Gluon one
    with (three consumers without a block table); MHA without a cap keeps the ordinary
    kernels (H200, `flash._select.BACKWARD_RULES`, `flash._select.DQ_RULES`)."""
    from ejk_kernels_gpu.flash._select import call_options
    from ejk_sequtils import validate_attention

    kwargs = dict(kwargs)
    q = jnp.zeros((2, 1024, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, 1024, kv_heads, 64), jnp.bfloat16)
    if kwargs.pop("documents", False):
        kwargs["segment_ids"] = jnp.zeros((2, 1024), jnp.int32)
    opts = call_options(validate_attention(q, k, k, **kwargs), None, None)
    assert opts.bwd_cfg.gluon == gluon
    if gluon:
        assert opts.bwd_cfg == GLUON_DKDV
        cap = "logits_soft_cap" in kwargs
        dq = FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=3)
        assert dq_beside(opts.bwd_cfg, 64, cap, tabled=True) == (GLUON_DQ_64 if cap else dq)
        # without a table and with a cap its three consumers (`flash._select.GLUON_DQ_THREE`)
        three = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)
        assert dq_beside(opts.bwd_cfg, 64, cap, tabled=False) == (three if cap else dq)


@pytest.mark.parametrize(
    "cap, dtype, packed_segments, fixed",
    [
        (None, jnp.bfloat16, False, False),
        (50.0, jnp.bfloat16, False, True),
        (55.0, jnp.bfloat16, False, True),
        (56.0, jnp.bfloat16, False, False),  # logits past 2^80 in log2 units
        (50.0, jnp.float16, False, False),  # p up to 2^100: past fp16's range
        (50.0, jnp.bfloat16, True, False),  # that build would spill twice as much
    ],
)
def test_soft_caps_up_to_55_in_bf16_fix_each_rows_shift(
    on_hopper, cap, dtype, packed_segments, fixed
):
    """The Gluon forward keeps each row's shift from a tile's first key block on
    (``FIXED_SHIFT``) where the cap bounds the logits within bf16's range."""
    from ejk_kernels_gpu.flash._constexprs import gluon_constexprs
    from ejk_kernels_gpu.flash._select import call_options
    from ejk_sequtils import validate_attention

    q = jnp.zeros((1, 1024, 8, 128), dtype)
    kwargs = {}
    if packed_segments:
        cu = jnp.asarray([0, 500, 1024], jnp.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, segment_ids=jnp.zeros((1, 1024), jnp.int32))
    request = validate_attention(q, q, q, causal=True, logits_soft_cap=cap, **kwargs)
    opts = call_options(request, None, None)
    assert gluon_constexprs(opts, q, q, False, opts.fwd_cfg)["FIXED_SHIFT"] == fixed


GLUON_DKDV = FlashBackwardConfig(
    block_keys=128, block_queries=64, num_warps=4, num_stages=2, gluon=True
)


def test_the_backward_heuristic_and_space_offer_the_gluon_dkdv_kernel_only_when_allowed():
    from ejk_kernels_gpu.flash._select import bwd_heuristic, bwd_search_space

    assert bwd_heuristic(128, 2, False, 4, gluon=True) == GLUON_DKDV
    # MHA without a soft cap: dq in it, three slots; with a cap dq beside it
    with_dq = msgspec.structs.replace(GLUON_DKDV, num_stages=3, atomic_dq=True)
    assert bwd_heuristic(128, 2, False, 1, gluon=True) == with_dq
    assert bwd_heuristic(128, 2, False, 1, soft_cap=True, gluon=True) == GLUON_DKDV
    assert with_dq in bwd_search_space(128, 2, False, gluon=True)
    assert not any(c.atomic_dq and c.gluon for c in bwd_search_space(64, 2, False, gluon=True))
    assert not bwd_heuristic(128, 2, False, 4).gluon
    assert not bwd_heuristic(128, 4, False, 1, gluon=True).gluon  # float32
    # At 64: with groups or a soft cap unless the masks go beyond causal (H200).
    assert not bwd_heuristic(64, 2, False, 1, gluon=True).gluon
    assert bwd_heuristic(64, 2, False, 4, gluon=True) == GLUON_DKDV
    assert bwd_heuristic(64, 2, False, 1, soft_cap=True, gluon=True) == GLUON_DKDV
    assert bwd_heuristic(64, 2, True, 4, gluon=True, tables=True) == GLUON_DKDV
    assert GLUON_DKDV in bwd_search_space(64, 2, False, gluon=True)
    assert GLUON_DKDV in bwd_search_space(128, 2, True, gluon=True)
    # With a soft cap only two slots (three spill in the loop, test_aot.py).
    assert [c for c in bwd_search_space(128, 2, False, gluon=True, soft_cap=True) if c.gluon] == [
        GLUON_DKDV
    ]
    assert not any(c.gluon for c in bwd_search_space(128, 2, False))
    wide = [c for c in bwd_search_space(256, 2, False, gluon=True) if c.gluon]
    assert wide == [GLUON_DKDV_256]  # the column-split kernel, the heuristic's too
    assert bwd_heuristic(256, 2, False, 2, gluon=True) == GLUON_DKDV_256
    assert bwd_heuristic(256, 2, True, 1, soft_cap=True, gluon=True, tables=True) == GLUON_DKDV_256
    # Masks beyond causal: dq beside it (three slots, two with a soft cap), never inside.
    three = msgspec.structs.replace(GLUON_DKDV, num_stages=3)
    assert bwd_heuristic(128, 2, True, 1, gluon=True, tables=True) == three
    assert bwd_heuristic(128, 2, True, 4, gluon=True, tables=True) == three
    assert bwd_heuristic(128, 2, True, 1, soft_cap=True, gluon=True, tables=True) == GLUON_DKDV
    tabled = [c for c in bwd_search_space(128, 2, True, gluon=True, tables=True) if c.gluon]
    assert tabled == [GLUON_DKDV, three]


def _loss_grads(attn, q, k, v, **kwargs):
    def loss(q, k, v):
        out, lse = attn(q, k, v, return_lse=True, **kwargs)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("cap", [None, 5.0], ids=["no cap", "soft cap"])
def test_the_gluon_dkdv_kernel_takes_unmasked_and_causal_backwards(
    gluon_launches, rng, close, edge, cap
):
    """By default on Hopper at head_dim 128, 16-bit, query rows on whole 64-row steps, with
    or without a soft cap: its grid (128-key blocks by batch and kv head), constexprs and
    outputs; the gradients of a loss on the output and the lse (so delta carries the lse's
    cotangent) match the reference through its emulation."""
    causal, q_len, kv_len, kv_heads, sinks = edge
    heads = 4
    q = jnp.asarray(rng.standard_normal((2, q_len, heads, 128)), jnp.bfloat16)
    k, v = (
        jnp.asarray(rng.standard_normal((2, kv_len, kv_heads, 128)), jnp.bfloat16) for _ in range(2)
    )
    s = jnp.asarray(rng.standard_normal(heads), jnp.float32) if sinks else None
    grads = _loss_grads(
        flash_attention, q, k, v, causal=causal, softmax_sinks=s, logits_soft_cap=cap
    )
    # dq: in the dk/dv kernel for MHA without a cap, else from the Gluon dq kernel beside it
    dq_inside = kv_heads == heads and not cap
    if q_len % 64:  # rows off the 64-row steps: the ordinary kernels
        assert gluon_launches.dkdv == gluon_launches.dq == []
    else:
        if dq_inside:
            assert gluon_launches.dq == []
        else:
            [(dq_grid, dq_consts, dq_outs, _)] = gluon_launches.dq
            # without a table three consumers of 64 rows, two slots (`GLUON_DQ_THREE`)
            tiles = (192, 64, 2)
            assert dq_grid == (-(-q_len // tiles[0]), 2 * heads)
            assert (dq_consts["BM"], dq_consts["BN"], dq_consts["STAGES"]) == tiles
            assert dq_outs[0] == (q.shape, q.dtype)
            assert dq_consts["ORDERED"] == causal  # blocks of heads, the heaviest first
        [(grid, consts, outs, kw)] = gluon_launches.dkdv
        assert grid == (-(-kv_len // 128), 2 * kv_heads)
        assert {n: consts[n] for n in ("B", "T", "S", "N", "G", "H", "CAUSAL", "BM", "BN", "STAGES")} == dict(
            B=2, T=q_len, S=kv_len, N=heads, G=heads // kv_heads, H=128, CAUSAL=causal, BM=64, BN=128,
            STAGES=3 if dq_inside else 2,
        )  # fmt: skip
        assert consts["SCALE"] == pytest.approx(128**-0.5)
        assert consts["QK"] == pytest.approx(128**-0.5 * math.log2(math.e))
        assert consts["SOFT_CAP"] == (cap or 0.0)
        if cap:
            assert consts["CAP_IN"] == pytest.approx(128**-0.5 / cap)
            assert consts["CAP_OUT"] == pytest.approx(cap * math.log2(math.e))
        assert consts["DQ"] is dq_inside
        # the launch's order where a program walks grouped heads, causal; else the grid's
        assert consts["ORDERED"] == (causal and kv_heads < heads)
        dq_out = (q.shape if dq_inside else (1,), jnp.float32)
        assert outs[:3] == [(k.shape, k.dtype), (v.shape, v.dtype), dq_out]
        assert outs[3][0][0] >= _jax_triton_fix.scratch_bytes(grid)
        assert kw["num_warps"] == 4
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _loss_grads(
        reference_attention, *f32, causal=causal, softmax_sinks=s, logits_soft_cap=cap
    )
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        close(got, want, q.dtype, "grad", name)


@pytest.mark.parametrize("cap", [None, 5.0], ids=["no cap", "soft cap"])
@pytest.mark.parametrize("causal", [False, True], ids=["unmasked", "causal"])
def test_the_gluon_dkdv_kernel_computes_dq_with_atomic_dq(gluon_launches, rng, close, causal, cap):
    """With ``atomic_dq`` its Gluon config computes dq in the dk/dv kernel (``DQ``: dS·k
    added into a float32 buffer that starts at zero, scaled after): no dq kernel runs, and
    the gradients match the reference through its emulation. At head_dim 64 (where its two
    consumers' halves of dq's columns would split a shared-memory swizzle row) the call
    runs the heuristic's backward instead, correctly: the ordinary kernels (MHA), with a
    soft cap the Gluon dk/dv kernel and the Gluon dq kernel beside it."""
    cfg = msgspec.structs.replace(GLUON_DKDV, atomic_dq=True)
    for head_dim in (128, 64):
        gluon_launches.dkdv.clear()
        q, k, v = (
            jnp.asarray(rng.standard_normal((2, 256, 4, head_dim)), jnp.bfloat16) for _ in range(3)
        )
        kwargs = dict(causal=causal, logits_soft_cap=cap)
        grads = _loss_grads(flash_attention, q, k, v, bwd_config=cfg, **kwargs)
        if head_dim == 128:
            assert gluon_launches.dq == []
            [(grid, consts, outs, _)] = gluon_launches.dkdv
            assert grid == (2, 2 * 4) and consts["DQ"] is True
            assert outs[2] == (q.shape, jnp.float32)
        elif cap:
            [(_, consts, _, _)] = gluon_launches.dkdv
            [_] = gluon_launches.dq
            assert consts["DQ"] is False
        else:
            assert gluon_launches.dkdv == gluon_launches.dq == []
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref = _loss_grads(reference_attention, *f32, **kwargs)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
            close(got, want, q.dtype, "grad", f"{head_dim=} {name}")


def _tabled_inputs(rng, kwargs, heads, kv_heads, head_dim):
    """``(batch, (q, k, v))``: bf16 inputs of 384 rows, the masks' arguments set in
    ``kwargs`` (documents or packing, `_documents_or_packing`)."""
    batch = _documents_or_packing(rng, kwargs, 2, 384, max_len=150)
    shapes = ((batch, 384, heads, head_dim),) + ((batch, 384, kv_heads, head_dim),) * 2
    return batch, tuple(jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes)


TABLED_BACKWARDS = [
    ("window", dict(causal=True, sliding_window=(100, 0))),
    ("two-sided window", dict(sliding_window=(70, 150))),
    ("documents", dict(causal=True, documents="plain")),
    ("repeated ids", dict(documents="repeat")),
    ("packed", dict(causal=True, packed=True)),
    ("documents, soft cap", dict(causal=True, documents="plain", logits_soft_cap=5.0)),
]  # fmt: skip


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), "dq inside"], ids=["MHA", "GQA", "dq inside"])
@pytest.mark.parametrize("case", TABLED_BACKWARDS, ids=[c[0] for c in TABLED_BACKWARDS])
def test_the_gluon_dkdv_kernel_takes_windows_packing_and_documents(
    gluon_launches, rng, close, case, heads
):
    """Windows, packed sequences and documents as segment ids (repeated ids, padding rows
    that see nothing, documents across the 128-key and 64-row tiles) run the Gluon dk/dv
    kernel by default, walking the dk/dv block table (its launch gets the table and the
    mask constexprs), and the Gluon dq kernel beside it, walking the dq block table; asked
    for with dq inside (``atomic_dq``), the dk/dv kernel computes dq too. The gradients,
    through the emulations fed the launches' own tables, match the reference."""
    _, kwargs = case
    kwargs = dict(kwargs)
    dq_inside = heads == "dq inside"
    if dq_inside:
        kwargs["bwd_config"] = msgspec.structs.replace(GLUON_DKDV, atomic_dq=True)
    heads, kv_heads = (4, 4) if dq_inside else heads
    batch, (q, k, v) = _tabled_inputs(rng, kwargs, heads, kv_heads, 128)
    grads = _loss_grads(flash_attention, q, k, v, **kwargs)
    [(grid, consts, _, _)] = gluon_launches.dkdv
    assert grid == (3, batch * kv_heads)
    left, right = kwargs.get("sliding_window", (-1, -1))
    assert (consts["WINDOW_LEFT"], consts["WINDOW_RIGHT"]) == (left, right)
    assert consts["VARLEN"] == consts["SEQ_IDS"] == ("cu_seqlens_q" in kwargs)
    assert consts["HAS_SEG"] == ("segment_ids" in kwargs)
    assert consts["DQ"] == dq_inside
    if dq_inside:
        assert gluon_launches.dq == []
    else:
        [(dq_grid, dq_consts, _, _)] = gluon_launches.dq
        assert dq_grid == (3, batch * heads)
        names = ("WINDOW_LEFT", "VARLEN", "SEQ_IDS", "HAS_SEG")
        assert {n: dq_consts[n] for n in names} == {n: consts[n] for n in names}
    kwargs.pop("bwd_config", None)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _loss_grads(reference_attention, *f32, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        close(got, want, q.dtype, "grad", name)


HEAD_64_BACKWARDS = [
    ("causal", dict(causal=True)),
    ("documents", dict(causal=True, documents="plain")),
    ("two-sided window", dict(sliding_window=(70, 150))),
    ("packed", dict(causal=True, packed=True)),
    ("soft cap", dict(causal=True, logits_soft_cap=5.0)),
]  # fmt: skip


@pytest.mark.parametrize("case", HEAD_64_BACKWARDS, ids=[c[0] for c in HEAD_64_BACKWARDS])
def test_head_dim_64_runs_the_ordinary_dq_kernel_beside_the_gluon_dkdv_kernel(
    gluon_launches, rng, close, case
):
    """At head_dim 64 with groups the Gluon dk/dv kernel runs by default, and beside it
    the ordinary dq kernel with 64x32 tiles, walking a dq block table built for those
    (`flash._select.DQ_RULES`); with a soft cap the Gluon dq kernel. The gradients, through the
    dk/dv kernel's emulation and the interpreted dq kernel, match the reference."""
    _, kwargs = case
    kwargs = dict(kwargs)
    heads, kv_heads = 4, 2
    batch, (q, k, v) = _tabled_inputs(rng, kwargs, heads, kv_heads, 64)
    grads = _loss_grads(flash_attention, q, k, v, **kwargs)
    [(grid, consts, _, _)] = gluon_launches.dkdv
    assert grid == (3, batch * kv_heads) and (consts["BM"], consts["BN"]) == (64, 128)
    if "logits_soft_cap" in kwargs:
        [(dq_grid, dq_consts, _, _)] = gluon_launches.dq
        # (384 rows: two programs of 192, its three consumers, `flash._select.GLUON_DQ_THREE`)
        assert gluon_launches.ordinary_dq == [] and dq_grid == (2, batch * heads)
        assert dq_consts["BM"] == 192
    else:
        [(dq_grid, dq_consts, dq_kw)] = gluon_launches.ordinary_dq
        assert gluon_launches.dq == [] and dq_grid == (6, batch * heads)
        assert (dq_consts["BLOCK_M"], dq_consts["BLOCK_N"]) == (64, 32)
        assert (dq_kw["num_warps"], dq_kw["num_stages"]) == (4, 3)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _loss_grads(reference_attention, *f32, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        close(got, want, q.dtype, "grad", name)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dtype=jnp.float32),
        dict(head_dim=96),
        dict(causal=True, segments=True, q_len=96),
    ],
    ids=["float32", "head_dim 96", "rows off the steps"],
)
def test_other_backwards_run_the_ordinary_kernels(gluon_launches, rng, close, kwargs):
    """The Gluon dk/dv kernels have no float32 or head_dim 96 and need query rows on whole
    64-row steps: such calls (even with their config asked for) run the ordinary kernels,
    correctly."""
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    head_dim = kwargs.pop("head_dim", 128)
    q_len = kwargs.pop("q_len", 128)
    q, k, v = (jnp.asarray(rng.standard_normal((1, q_len, 2, head_dim)), dtype) for _ in range(3))
    if kwargs.pop("segments", False):
        kwargs["segment_ids"] = jnp.asarray(np.repeat([[0, 1]], q_len // 2, axis=1), jnp.int32)
    grads = _loss_grads(flash_attention, q, k, v, bwd_config=GLUON_DKDV, **kwargs)
    assert gluon_launches.dkdv == gluon_launches.dq == []
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _loss_grads(reference_attention, *f32, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        close(got, want, dtype, "grad", name)


@pytest.mark.parametrize("kv_heads, head_dim", [(4, 128), (2, 64)], ids=["mha 128", "gqa 64"])
def test_context_blocks_with_offsets_take_the_gluon_backward(
    gluon_launches, rng, close, kv_heads, head_dim
):
    """A context block call with masks on global positions (the packed path: offsets as
    positions) takes the Gluon dk/dv kernel on the block tables, and beside it the Gluon
    dq kernel (at head_dim 64 the ordinary one, on its own table); the key block's
    gradients from the global output and lse match the reference's share."""
    from ejk_kernels_gpu.context._blocks import BlockMasks, block_backward

    q, w = (jnp.asarray(rng.standard_normal((1, 256, 4, head_dim)), jnp.bfloat16) for _ in range(2))
    k, v = (
        jnp.asarray(rng.standard_normal((1, 256, kv_heads, head_dim)), jnp.bfloat16)
        for _ in range(2)
    )
    kwargs = dict(causal=True, sliding_window=(150, 0))
    masks = BlockMasks(scale=head_dim**-0.5, causal=True, window=(150, 0), relative=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, lse = reference_attention(*f32, return_lse=True, **kwargs)
    # Query rows [128, 256) against keys [0, 128): the window's and causal's edge blocks.
    grads = block_backward(
        masks, q[:, 128:], k[:, :128], v[:, :128], out[:, 128:].astype(jnp.bfloat16),
        lse[:, :, 128:], w[:, 128:], q_offset=128, k_offset=0,
    )  # fmt: skip
    [(_, consts, _, _)] = gluon_launches.dkdv
    assert consts["VARLEN"] and consts["WINDOW_LEFT"] == 150
    beside = gluon_launches.ordinary_dq if head_dim == 64 else gluon_launches.dq
    assert len(beside) == 1 and len(gluon_launches.dq + gluon_launches.ordinary_dq) == 1

    def loss(q_rows, k_blk, v_blk):
        o = reference_attention(
            jnp.concatenate([f32[0][:, :128], q_rows], 1),
            jnp.concatenate([k_blk, f32[1][:, 128:]], 1),
            jnp.concatenate([v_blk, f32[2][:, 128:]], 1),
            **kwargs,
        )
        return jnp.sum(o[:, 128:] * w[:, 128:].astype(jnp.float32))

    # dq of the rows through these keys alone: the other key block's share held fixed is
    # not separable, so compare dk and dv (this block's whole gradient from these rows).
    want = jax.grad(loss, argnums=(1, 2))(f32[0][:, 128:], f32[1][:, :128], f32[2][:, :128])
    for name, got, ref in zip(("dk", "dv"), grads[1:], want, strict=True):
        close(got, ref, q.dtype, "grad", name)


GLUON_DKDV_256 = FlashBackwardConfig(
    block_keys=64, block_queries=64, num_warps=4, num_stages=2, gluon=True
)


@pytest.mark.parametrize(
    "kwargs",
    [dict(causal=True), dict(), dict(causal=True, documents=True), dict(sliding_window=(70, 20))],
    ids=["causal", "unmasked", "documents", "window"],
)
def test_the_head_dim_256_gluon_dkdv_kernel_splits_the_columns(gluon_launches, rng, close, kwargs):
    """At head_dim 256 its config (64 resident keys) runs the column-split Gluon dk/dv
    kernel (`kernels.gluon._backward_wide`; grid of 64-key blocks) with the Gluon dq kernel beside
    it (`GLUON_DQ_256`: 128 query rows a program, 32 keys a step, walking a dq block table
    built for those tiles); the gradients, through their emulations, match the reference. Its config with
    dq inside, or at another head_dim, gives way to the heuristic's backward (this one
    at head_dim 256)."""
    kwargs = dict(kwargs)
    q_len, heads, kv_heads = 320, 4, 2
    batch = _documents_or_packing(rng, kwargs, 2, q_len, max_len=150)
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, 256)), jnp.bfloat16)
    k, v = (
        jnp.asarray(rng.standard_normal((batch, q_len, kv_heads, 256)), jnp.bfloat16)
        for _ in range(2)
    )
    grads = _loss_grads(flash_attention, q, k, v, bwd_config=GLUON_DKDV_256, **kwargs)
    [(grid, consts, outs, _)] = gluon_launches.dkdv
    assert grid == (5, batch * kv_heads) and (consts["BN"], consts["BM"]) == (64, 64)
    assert outs[:2] == [(k.shape, k.dtype), (v.shape, v.dtype)]
    [(dq_grid, dq_consts, dq_outs, _)] = gluon_launches.dq
    assert dq_grid == (3, batch * heads) and dq_outs[0] == (q.shape, q.dtype)
    tiles = tuple(dq_consts[name] for name in ("BM", "BN", "STAGES", "H"))
    assert tiles == (128, 32, 2, 256)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _loss_grads(reference_attention, *f32, **kwargs)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        close(got, want, q.dtype, "grad", name)
    # Asked for where it cannot run, the heuristic's backward runs instead: with dq inside
    # this kernel with dq beside; at head_dim 128 the Gluon dk/dv kernel of 128 keys.
    gluon_launches.dkdv.clear()
    inside = msgspec.structs.replace(GLUON_DKDV_256, atomic_dq=True)
    _loss_grads(flash_attention, q, k, v, bwd_config=inside, **kwargs)
    assert [c["BN"] for _, c, _, _ in gluon_launches.dkdv] == [64]
    gluon_launches.dkdv.clear()
    small = [x[..., :128] for x in (q, k, v)]
    _loss_grads(flash_attention, *small, bwd_config=GLUON_DKDV_256, **kwargs)
    assert [c["BN"] for _, c, _, _ in gluon_launches.dkdv] == [128]


def test_resumed_context_rows_continue_in_the_kernel(gluon_launches, rng):
    """All-gather's own block first (`_context_gathered`): a device's contiguous rows
    against its own keys, then against the other keys resuming those rows (``RESUME``:
    the previous call's outputs passed in, aliased as the outputs); the two calls give the
    reference's rows, documents crossing the blocks' edge included, and the resumed call
    builds without the fixed shift."""
    from ejk_kernels_gpu.context._blocks import BlockMasks, block_forward

    t, a, b = 512, 256, 512  # device 1 of two: rows and own keys [256, 512)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 128)), jnp.bfloat16) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.arange(4), [100, 200, 150, 62])[None], jnp.int32)
    masks = BlockMasks(scale=128**-0.5, causal=True, relative=True, soft_cap=20.0)
    own = block_forward(
        masks, q[:, a:b], k[:, a:b], v[:, a:b], q_offset=a, k_offset=a,
        segment_ids=(seg[:, a:b], seg[:, a:b]),
    )  # fmt: skip
    others = seg.at[:, a:b].set(-1)
    out, lse = block_forward(
        masks, q[:, a:b], k, v, q_offset=a, segment_ids=(seg[:, a:b], others), resume=own
    )
    (_, _, first, _, _), (_, _, resumed, _, kwargs) = gluon_launches
    assert not first["RESUME"] and resumed["RESUME"] and not resumed["FIXED_SHIFT"]
    assert first["FIXED_SHIFT"] and kwargs["aliases"] == {4: 0, 5: 1}  # (prev o, lse) -> (o, lse)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_lse = reference_attention(
        *f32, causal=True, segment_ids=seg, logits_soft_cap=20.0, return_lse=True
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), want[:, a:b], atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse[:, :, a:b], atol=1e-3)


@pytest.mark.parametrize("kv_heads, head_dim", [(4, 128), (2, 64)], ids=["mha 128", "gqa 64"])
def test_keys_and_values_as_one_array_reach_every_gluon_kernel(
    gluon_launches, rng, kv_heads, head_dim
):
    """``kv`` (all-gather's keys and values gathered as one array): the Gluon forward,
    dk/dv and dq kernels (at head_dim 64 the ordinary dq kernel beside) take it with
    ``KV_PAIR`` and give the results of k and v apart."""
    from ejk_kernels_gpu.context._blocks import BlockMasks, block_backward, block_forward

    t = 256
    q, d_out = (
        jnp.asarray(rng.standard_normal((1, t, 4, head_dim)), jnp.bfloat16) for _ in range(2)
    )
    k, v = (
        jnp.asarray(rng.standard_normal((1, t, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2)
    )
    ids = jnp.asarray(np.repeat(np.arange(3), [100, 100, 56])[None], jnp.int32)
    masks = BlockMasks(scale=head_dim**-0.5, causal=True, relative=True)
    kw = dict(q_offset=0, segment_ids=(ids, ids))
    pair = jnp.concatenate([k, v], axis=-1)
    apart = block_forward(masks, q, k, v, **kw)
    joint = block_forward(masks, q, None, None, kv=pair, **kw)
    grads = block_backward(masks, q, k, v, *apart, d_out, **kw)
    grads_pair = block_backward(masks, q, None, None, *apart, d_out, kv=pair, **kw)
    forwards = [consts for _, _, consts, _, _ in gluon_launches]
    assert [c["KV_PAIR"] for c in forwards] == [False, True]
    assert [c["KV_PAIR"] for _, c, _, _ in gluon_launches.dkdv] == [False, True]
    assert [c["KV_PAIR"] for _, c, _, _ in gluon_launches.dq] in ([], [False, True])
    ordinary_dq = [c["KV_PAIR"] for _, c, _ in gluon_launches.ordinary_dq]
    assert ordinary_dq == ([False, True] if head_dim == 64 else [])
    for x, y in zip((*apart, *grads), (*joint, *grads_pair), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("documents", [False, True])
def test_context_rows_against_the_whole_sequence_take_the_tile_order(
    gluon_launches, rng, documents
):
    """A zigzag device's two query chunks against the whole sequence (one call, masks on
    global positions) run the Gluon forward with the reference's values; causal on
    positions alone its tiles come in the launch's order (heaviest first: the late
    chunk's tiles walk the whole sequence, the early one's a few blocks), with documents
    in the grid's (the order's sort would cost more than it gains)."""
    from ejk_kernels_gpu.context._blocks import BlockMasks, block_forward

    t, chunk = 512, 128  # device 0 of two: global chunks 0 and 3
    rows = np.concatenate([np.arange(0, chunk), np.arange(t - chunk, t)])
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 128)), jnp.bfloat16) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.arange(4), [100, 200, 150, 62])[None], jnp.int32)
    ids = (seg[:, rows], seg) if documents else None
    masks = BlockMasks(scale=128**-0.5, causal=True, relative=True)
    out, lse = block_forward(masks, q[:, rows], k, v, q_offset=(0, t - chunk), segment_ids=ids)
    [(name, _, consts, _, _)] = gluon_launches
    assert name == "gluon_fwd_kernel" and consts["VARLEN"] and not consts["SEQ_IDS"]
    assert consts["ORDERED"] == (not documents)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_lse = reference_attention(
        *f32, causal=True, segment_ids=seg if documents else None, return_lse=True
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), want[:, rows], atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse[:, :, rows], atol=1e-3)


def test_forward_takes_its_counter_from_the_table_kernel(gluon_launches, rng, monkeypatch):
    """Where the fused table kernel builds the forward's table (on a GPU: with segment
    ids), the persistent forward takes over the zero it wrote as its counter (aliased, no
    memset). Here the kernel builds a context call's masks
    from positions, and the values stay the reference's."""
    from ejk_kernels_gpu.context._blocks import BlockMasks, block_forward
    from ejk_kernels_gpu.flash import _tables

    monkeypatch.setattr(_tables._triton, "interpreting", lambda: False)  # the fused path
    t, chunk = 512, 128  # device 0 of two: global chunks 0 and 3
    rows = np.concatenate([np.arange(0, chunk), np.arange(t - chunk, t)])
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 128)), jnp.bfloat16) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.arange(4), [100, 200, 150, 62])[None], jnp.int32)
    masks = BlockMasks(scale=128**-0.5, causal=True, relative=True)
    out, lse = block_forward(
        masks, q[:, rows], k, v, q_offset=(0, t - chunk), segment_ids=(seg[:, rows], seg)
    )
    [(_, _, consts, _, kwargs)] = gluon_launches
    assert consts["PERSISTENT"], consts
    assert kwargs["aliases"] == {14: 2} and not kwargs["zeroed"][2], kwargs
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_lse = reference_attention(*f32, causal=True, segment_ids=seg, return_lse=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), want[:, rows], atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse[:, :, rows], atol=1e-3)
