"""Every kernel compiles ahead of time for Hopper (sm_90) on this CPU machine and fits shared memory.

The compile runs in a subprocess: this test process has Triton's interpreter on
(the conformance tests need it), and interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ejk_kernels_gpu.aot.flash import GLUON_SPILL_BYTES, TABLE_BUILDS
from ejk_kernels_gpu.flash._config import SHARED_MEMORY_LIMIT

pytestmark = pytest.mark.triton_build  # built by Triton in a subprocess: the same on every jax


def _compile(*args: str, code: str = "") -> list[dict]:
    """Run ``python -m ejk_kernels_gpu.aot.flash args`` (or ``python -c code``); its rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = ["-c", code] if code else ["-m", "ejk_kernels_gpu.aot.flash", *args]
    proc = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    for row in rows:
        assert "error" not in row, row
        assert row["shared"] <= SHARED_MEMORY_LIMIT, row
        assert row["wgmma"], f"no wgmma in the PTX of {row}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return rows


def _compile_16_bit(*args):
    """`_compile` once with bf16 inputs and once with fp16: both rows' lists."""
    return [row for dtype in ("bfloat16", "float16") for row in _compile(*args, "--dtype", dtype)]


def test_heuristic_configs_compile_for_hopper_with_every_feature():
    rows = _compile("--head-dims", "64", "--variants", "all", "--space", "heuristic")
    assert {r["kernel"] for r in rows} == {"fwd_kernel", "dq_kernel", "dkdv_kernel"}


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", ["64", "96", "128", "256"])
def test_whole_search_space_compiles_for_hopper(head_dim):
    _compile("--head-dims", head_dim, "--variants", "plain,causal", "--space", "full")
    _compile("--head-dims", head_dim, "--variants", "all", "--space", "heuristic")


# One config of the tuning space that the heuristics do not pick: the largest ordinary
# forward and dk/dv tiles (the ones likeliest to overflow) for head_dim 128 with every
# feature. The autotuner may pick any config of the space; the slow test builds them all.
_OFF_HEURISTIC = """
import sys
from ejk_kernels_gpu.aot import flash as aot
from ejk_kernels_gpu.flash import _select as c

h, failed = 128, 0
tiles = lambda x: (x.block_keys, x.block_queries) if hasattr(x, "block_keys") else (x.block_q, x.block_k)
size = lambda x: (tiles(x)[0] * tiles(x)[1] * (x.num_stages or 1), x.num_warps or 0)
for name, space, heuristic in (
    ("fwd_kernel", c.fwd_search_space(h, 2, True, gluon=False), c.fwd_heuristic(h, 2, True, gluon=False)),
    ("dkdv_kernel", c.bwd_search_space(h, 2, True), c.bwd_heuristic(h, 2, True)),
):
    off = [x for x in space if x != heuristic and not (x.gluon or x.warp_specialize)]
    failed += aot._report(name, max(off, key=size), h, "bfloat16", "all")
sys.exit(1 if failed else 0)
"""


def test_a_tuned_config_off_the_heuristic_compiles_for_hopper():
    rows = _compile(code=_OFF_HEURISTIC)
    assert [r["kernel"] for r in rows] == ["fwd_kernel", "dkdv_kernel"], rows
    assert all(r["fits"] for r in rows), rows


def test_dkdv_kernel_compiles_both_ways_of_computing_dq_for_hopper():
    """head_dim 128, every feature: the heuristic (dq by TMA reduces) and its dq-kernel twin."""
    rows = _compile(
        "--head-dims", "128", "--variants", "all", "--space", "heuristic", "--kernels", "dkdv_kernel"
    )  # fmt: skip
    assert {r["config"]["atomic_dq"] for r in rows} == {False, True}
    assert all(r["fits"] for r in rows)


def test_the_soft_cap_and_head_dim_256_backward_builds_compile_for_hopper():
    """The backward heuristic's soft-cap build (p computed once: dq by atomic adds, also
    with grouped heads) and its head_dim 256 build (64x64 tiles, 8 warps) fit sm_90."""
    rows = _compile(
        "--head-dims", "128,256", "--variants", "softcap", "--space", "heuristic",
        "--kernels", "dkdv_kernel",
    )  # fmt: skip
    ordinary = [r for r in rows if not r["config"]["gluon"]]  # (the Gluon builds: below)
    heuristic = {
        r["head_dim"]: r["config"]
        for r in ordinary
        if r["config"]["atomic_dq"] or r["head_dim"] == 256
    }
    assert heuristic[128]["block_k"] == 32 and heuristic[128]["atomic_dq"], rows
    assert (heuristic[256]["block_q"], heuristic[256]["block_k"], heuristic[256]["num_warps"]) == (
        64,
        64,
        8,
    )
    assert all(r["fits"] for r in rows), rows


def test_the_gluon_forward_builds_for_hopper_without_spills():
    """Both Gluon configs, unmasked and causal, bf16 and fp16, at head_dim 64 and 128 (the
    heuristic's pick at both): three warpgroups, within shared memory and scratch, and no
    register spills (ptxas), which would serialise its pipelined matmuls."""
    rows = _compile_16_bit(
        "--head-dims", "64,128", "--variants", "plain,causal", "--space", "heuristic",
        "--kernels", "fwd_kernel",
    )  # fmt: skip
    gluon = [r for r in rows if r["config"]["gluon"]]
    built = [(r["variant"], r["head_dim"], r["dtype"], r["config"]["num_stages"]) for r in gluon]
    assert sorted(built) == sorted(
        (variant, head_dim, dtype, stages)
        for variant in ("plain", "causal")
        for head_dim in (64, 128)
        for dtype in ("bfloat16", "float16")
        for stages in (2, 3)
    )
    assert all(r["kernel"] == "gluon_fwd_kernel" for r in gluon)
    assert all(r["threads"] == 384 and r["fits"] and r["spill_stores"] == 0 for r in gluon), gluon
    # The epilogue divides once per row a thread holds (two, in each of two consumers), not
    # once per score (128): a division is a MUFU reciprocal, as costly as an exponential.
    assert all(r["divisions"] <= 4 for r in gluon), [r["divisions"] for r in gluon]
    # Causal builds lay p out for the loops from the first block on (`_as_carried`): no swap
    # of its 16-bit halves in every block (256 at head_dim 128 before, 2026-11-29).
    causal = [r for r in gluon if r["variant"] == "causal"]
    assert all(r["half_swaps"] == 0 for r in causal), [
        (r["dtype"], r["config"]["num_stages"], r["half_swaps"]) for r in causal
    ]


def _threads(row: dict) -> int:
    """A Gluon forward build's threads: a warpgroup per 64 rows of its tile, and the producer's."""
    return 128 * (row["config"]["block_q"] // 64 + 1)


def test_the_three_consumer_gluon_forward_builds_for_hopper():
    """The soft cap's three-consumer tile (192 rows, 64 keys a step; `flash._select.THREE_CONSUMERS`)
    at head_dim 64 and 128, bf16 and fp16, causal (the heuristic's) and with segment ids
    (the tuning space's): four warpgroups, 160 registers a consumer thread and no spill
    without a table (one value reloaded with one: `aot.flash.GLUON_SPILL_BYTES`). The build
    for 4096 rows, off its tile, runs persistent (its last tile's third consumer idle,
    `_release_tile`): its output has a buffer of its own."""
    rows = _compile_16_bit(
        "--head-dims", "64,128", "--variants", "softcap,capped_documents", "--space",
        "heuristic", "--kernels", "fwd_kernel",
    )  # fmt: skip
    three = [r for r in rows if r["config"]["gluon"] and r["config"]["block_q"] == 192]
    built = {(r["variant"], r["head_dim"], r["dtype"]) for r in three}
    assert built == {
        (variant, head_dim, dtype)
        for variant in ("softcap", "capped_documents")
        for head_dim in (64, 128)
        for dtype in ("bfloat16", "float16")
    }
    assert all(r["threads"] == 512 and r["fits"] for r in three), three
    assert all(r["spill_stores"] == 0 for r in three if r["variant"] == "softcap"), three
    allowed = GLUON_SPILL_BYTES["gluon_fwd_kernel", False]
    assert all(r["spill_stores"] <= allowed for r in three), three
    # q, its output's buffer and two slots of 64 keys: 160 KiB at head_dim 128
    assert all(r["shared"] > 160 * 1024 for r in three if r["head_dim"] == 128), three


def test_the_gluon_forward_builds_every_mask_for_hopper_within_its_spill_allowance():
    """The Gluon forward's masked builds (window, soft cap, documents as segment ids, keys
    off the tile; packed sequences and context parallelism's global positions with
    documents, alone and resuming a previous call's rows, at head_dim 128) at head_dim 64,
    128 and 256: three
    warpgroups, within shared memory, no register spills beyond the one value the
    persistent builds with per-block masks reload (`aot.flash.GLUON_SPILL_BYTES`; the unmasked
    and causal builds above spill nothing). (Every mask at once, and packed sequences at
    head_dim 256, spill a few dozen bytes: not offered here as clean.)"""
    rows = _compile(
        "--head-dims", "64,128,256", "--variants", "window,softcap,documents,tail",
        "--space", "heuristic", "--kernels", "fwd_kernel",
    )  # fmt: skip
    rows += _compile(
        "--head-dims", "128", "--variants", "packed,relative,resume", "--space", "heuristic",
        "--kernels", "fwd_kernel",
    )  # fmt: skip
    gluon = [r for r in rows if r["config"]["gluon"]]
    built = {(r["variant"], r["head_dim"]) for r in gluon}
    assert built == {(v, h) for v in ("window", "softcap", "documents", "tail") for h in (64, 128, 256)} | {("packed", 128), ("relative", 128), ("resume", 128)}  # fmt: skip
    assert all(r["threads"] == _threads(r) and r["fits"] for r in gluon), gluon
    allowed = GLUON_SPILL_BYTES["gluon_fwd_kernel", False]
    assert all(r["spill_stores"] <= allowed for r in gluon), gluon
    assert all(r["spill_stores"] == 0 for r in gluon if r["variant"] in ("softcap", "tail")), gluon
    # Masked blocks compare positions relative to the block (`_block_relative`): no 64-bit
    # mask packed and unpacked (124 SHF.R.U64 with segment ids, 62 with a window, at head_dim
    # 64 and 128 before, 2026-12-01).
    assert all(r["mask_unpacks"] == 0 for r in gluon), [
        (r["variant"], r["head_dim"], r["mask_unpacks"]) for r in gluon if r["mask_unpacks"]
    ]
    # With a block table p crosses from the masked loop into the unmasked one laid out for
    # the latter (`_as_carried`): no swap of its 16-bit halves in every block (384 at head_dim
    # 128 before, the unmasked loop 528 SASS instructions a block against 483).
    # Packed sequences and context parallelism's global positions carry it so from the first
    # block (384 swaps at head_dim 128 before, 2026-11-29).
    tabled = [r for r in gluon if r["variant"] in ("window", "documents", "packed", "relative", "resume")]  # fmt: skip
    assert len(tabled) >= 9 and all(r["half_swaps"] == 0 for r in tabled), [
        (r["variant"], r["head_dim"], r["config"]["num_stages"], r["half_swaps"]) for r in tabled
    ]


def test_one_block_calls_build_for_hopper():
    """64 queries (half a Gluon forward tile) against 128 keys (one resident block of the
    dk/dv kernel, its grouped causal programs in a launch order), head_dim 64 and 128: the
    Gluon forward and dk/dv kernels build. With the block index a constant 0 both folded
    whole-tile masks and Triton 3.6's LLVM lowering aborted (an `idx < size()` assertion,
    first seen on an H100 in test_gpu_kernels' "causal T>S gqa", 128 keys)."""
    rows = _compile("--head-dims", "64,128", "--variants", "one_block", "--space", "heuristic")
    built = {(r["kernel"], r["head_dim"]) for r in rows}
    assert {(k, h) for k in ("gluon_fwd_kernel", "gluon_dkdv_kernel") for h in (64, 128)} <= built


def test_the_gluon_backward_kernels_build_for_hopper():
    """The Gluon dk/dv kernel (both ring depths, two with a soft cap; at head_dim 128 also
    computing dq) and the dq kernel beside it, unmasked, causal and with a soft cap, head_dim
    64 and 128, bf16 and fp16: the Gluon one with three consumers, but at head_dim 64
    without a cap the ordinary one with 64x32 tiles (`flash._select.DQ_RULES`). Three warpgroups
    (four in the dq kernel), within shared memory and scratch; the Gluon dq kernel spills
    nothing, the dk/dv kernel at most the bytes `aot.flash.GLUON_SPILL_BYTES` allows."""
    rows = _compile_16_bit(
        "--head-dims", "64,128", "--variants", "plain,causal,softcap", "--space", "heuristic",
        "--kernels", "dq_kernel,dkdv_kernel",
    )  # fmt: skip
    variants = ("plain", "causal", "softcap")
    gluon_dq = [r for r in rows if r["kernel"] == "gluon_dq_kernel"]
    assert {(r["variant"], r["head_dim"], r["dtype"]) for r in gluon_dq} == {
        (variant, head_dim, dtype)
        for variant in variants
        for head_dim in (64, 128)
        for dtype in ("bfloat16", "float16")
        if head_dim == 128 or variant == "softcap"
    }
    assert all(r["fits"] and r["spill_stores"] == 0 for r in gluon_dq)
    # Without a block table its three consumers (`flash._select.GLUON_DQ_THREE`: 192 rows, two
    # slots, four warpgroups)
    tiles = {(r["config"]["block_q"], r["config"]["num_stages"], r["threads"]) for r in gluon_dq}
    assert tiles == {(192, 2, 512)}
    tiles = ("block_q", "block_k", "num_warps", "num_stages")
    dq_64 = {
        tuple(r["config"][t] for t in tiles)
        for r in rows
        if r["kernel"] == "dq_kernel" and r["head_dim"] == 64
    }
    assert (64, 32, 4, 3) in dq_64
    assert all(r["fits"] for r in rows if r["kernel"] == "dq_kernel")
    gluon = [r for r in rows if r["kernel"] == "gluon_dkdv_kernel"]
    built = {
        (r["variant"], r["head_dim"], r["dtype"], r["config"]["num_stages"], r["config"]["atomic_dq"])
        for r in gluon
    }  # fmt: skip
    assert built == {
        (variant, head_dim, dtype, stages, with_dq)
        for variant in variants
        for head_dim in (64, 128)
        for dtype in ("bfloat16", "float16")
        for stages in ((2,) if variant == "softcap" else (2, 3))
        for with_dq in ((False, True) if head_dim == 128 and variant != "softcap" else (False,))
    }
    assert all(r["threads"] == 384 and r["fits"] for r in gluon), gluon


def test_the_gluon_backward_kernels_build_every_mask_for_hopper():
    """The Gluon dk/dv kernel (two and three slots) with windows, documents as segment ids,
    packed sequences and context parallelism's global positions with documents (the block
    tables' paths) at head_dim 64 and 128, and the Gluon dq kernel beside it at 128
    (pipelined, three slots; at 64 the ordinary one, `flash._select.DQ_RULES`): three
    warpgroups, within shared memory; the dq kernel spills nothing, the dk/dv kernel at
    most its allowance (`aot.flash.GLUON_SPILL_BYTES`)."""
    rows = _compile(
        "--head-dims", "64,128", "--variants", "window,documents,packed,relative",
        "--space", "heuristic",
        "--kernels", "dq_kernel,dkdv_kernel",
    )  # fmt: skip
    gluon = [r for r in rows if r["config"]["gluon"]]
    built = {(r["kernel"], r["variant"], r["head_dim"], r["config"]["num_stages"]) for r in gluon}
    variants = ("window", "documents", "packed", "relative")
    assert built == {
        (kernel, variant, head_dim, stages)
        for variant in variants
        for head_dim in (64, 128)
        for kernel, stages in (("gluon_dq_kernel", 3), ("gluon_dkdv_kernel", 2), ("gluon_dkdv_kernel", 3))
        if head_dim == 128 or kernel != "gluon_dq_kernel"
    }  # fmt: skip
    assert not any(r["config"]["atomic_dq"] for r in gluon)  # not offered with these masks
    assert all(r["threads"] == 384 and r["fits"] for r in gluon), gluon
    allowed = GLUON_SPILL_BYTES["gluon_dkdv_kernel", False]
    assert all(r["spill_stores"] <= allowed for r in gluon), gluon
    assert all(r["spill_stores"] == 0 for r in gluon if r["kernel"] == "gluon_dq_kernel"), gluon


def test_the_gluon_dkdv_kernel_builds_dk_and_dv_side_by_side_for_hopper():
    """All-gather's backward build (``JOINT``: dk and dv in one output, for one
    reduce-scatter) compiles as the build with two outputs does: the same shared memory
    and spills, both ring depths, head_dim 64 and 128."""
    rows = _compile(
        "--head-dims", "64,128", "--variants", "relative,joint", "--space", "heuristic",
        "--kernels", "dkdv_kernel",
    )  # fmt: skip
    gluon = {
        (r["variant"], r["head_dim"], r["config"]["num_stages"]): r
        for r in rows
        if r["kernel"] == "gluon_dkdv_kernel"
    }
    assert {key[1:] for key in gluon if key[0] == "joint"} == {
        (h, s) for h in (64, 128) for s in (2, 3)
    }
    for (variant, head_dim, stages), row in gluon.items():
        if variant == "joint":
            apart = gluon["relative", head_dim, stages]
            assert (row["shared"], row["spill_stores"]) == (apart["shared"], apart["spill_stores"])


def test_the_head_dim_256_gluon_backward_kernels_build_for_hopper():
    """The column-split Gluon dk/dv kernel (`kernels.gluon._backward_wide`) and the Gluon dq kernel
    beside it (32 keys a step) unmasked, causal, with a window, segment ids and a soft cap:
    three warpgroups, within shared memory and scratch; the dk/dv kernel within its spill
    allowance (none unmasked, causal or windowed), the dq kernel without spills."""
    variants = {"plain", "causal", "window", "documents", "softcap"}
    rows = _compile(
        "--head-dims", "256", "--variants", ",".join(sorted(variants)),
        "--space", "heuristic", "--kernels", "dkdv_kernel,dq_kernel",
    )  # fmt: skip
    dq = [r for r in rows if r["kernel"] == "gluon_dq_kernel"]
    assert {r["variant"] for r in dq} == variants
    assert {(r["config"]["block_q"], r["config"]["block_k"]) for r in dq} == {(128, 32)}
    assert all(r["threads"] == 384 and r["fits"] and r["spill_stores"] == 0 for r in dq), dq
    wide = [r for r in rows if r["kernel"] == "gluon_dkdv_wide_kernel"]
    assert {r["variant"] for r in wide} == variants
    assert all(r["threads"] == 384 and r["fits"] for r in wide), wide
    allowed = GLUON_SPILL_BYTES["gluon_dkdv_wide_kernel", False]
    assert all(r["spill_stores"] <= allowed for r in wide), wide
    assert all(
        r["spill_stores"] == 0 for r in wide if r["variant"] in ("plain", "causal", "window")
    )


def test_causal_calls_get_a_warp_specialised_forward_build_for_hopper():
    """The warp-specialised config compiles for causal calls into three warpgroups (a mask
    Triton could not specialise would fall back silently to one, `.reqntid 128`)."""
    rows = _compile(
        "--head-dims", "128", "--variants", "plain,causal", "--space", "heuristic", "--kernels", "fwd_kernel"
    )  # fmt: skip
    ws = [r for r in rows if r["config"]["warp_specialize"]]
    assert {r["variant"] for r in ws} == {"plain", "causal"}
    assert all(r["threads"] == 384 and r["fits"] for r in ws), ws


def test_warp_specialised_backward_builds_for_hopper():
    """The warp-specialised dq and dk/dv builds (unmasked and causal, grouped heads) compile
    into three warpgroups and fit shared memory and their global scratch."""
    rows = _compile(
        "--head-dims", "128", "--variants", "plain,causal", "--space", "heuristic",
        "--kernels", "dq_kernel,dkdv_kernel",
    )  # fmt: skip
    ws = [r for r in rows if r["config"]["warp_specialize"]]
    assert {(r["kernel"], r["variant"]) for r in ws} == {
        (kernel, variant)
        for kernel in ("dq_kernel", "dkdv_kernel")
        for variant in ("plain", "causal")
    }
    assert all(r["threads"] == 384 and r["fits"] for r in ws), ws


def test_segment_table_kernel_compiles_for_hopper_without_spills():
    """`flash._tables.fused_segment_table`'s builds (`aot.flash.TABLE_BUILDS`): no wgmma, no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "ejk_kernels_gpu.aot.flash", "--kernels", "segment_table"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(TABLE_BUILDS), proc.stderr[-3000:]
    bad = [row for row in rows if "error" in row or row["spill_stores"] != 0]
    assert not bad and proc.returncode == 0, (bad, proc.stderr[-3000:])
