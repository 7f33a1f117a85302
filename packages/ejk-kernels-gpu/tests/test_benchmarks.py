"""The GPU benchmark scripts import and run on the CPU (interpreter), so they do not rot
between GPU sessions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from ejk_kernels_gpu.build import _triton as _triton

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(name="bench_path")
def bench_path_fixture(monkeypatch):
    _triton.kernels()  # Triton's backend (the interpreter here) before a script imports triton
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import each other by name
    yield
    for name in [
        n for n, m in sys.modules.items() if str(BENCH) in str(getattr(m, "__file__", ""))
    ]:
        del sys.modules[name]


@pytest.mark.parametrize("name", ["bench_flash", "gpu_conformance"])
def test_benchmark_scripts_import(bench_path, name):
    importlib.import_module(name)


def test_bench_shape_times_each_variant_in_interleaved_rounds(bench_path, monkeypatch):
    bench_flash = importlib.import_module("bench_flash")
    timing = importlib.import_module("_timing")
    calls = []
    once = timing.seconds_per_call
    monkeypatch.setattr(
        timing, "seconds_per_call", lambda f, *a, reps=10: calls.append(f) or once(f, *a, reps=1)
    )
    variants = [("ejk", None, None, None), ("xla", None, None, None), ("pallas", None, None, "x")]
    rows = bench_flash.bench_shape((1, 32, 2, 1, 16, True), variants, with_bwd=False, rounds=2)
    assert [r["impl"] for r in rows] == ["ejk", "xla"]  # no Pallas GPU attention for GQA
    assert len(calls) == 4 and calls[0] is calls[2] and calls[1] is calls[3] != calls[0]
    for row in rows:
        assert row["fwd_best_ms"] <= row["fwd_ms"] and row["fwd_tflops"] > 0


def test_conformance_records_the_builds_and_fails_a_silent_fallback(bench_path):
    import jax.numpy as jnp
    import numpy as np

    conf = importlib.import_module("gpu_conformance")
    rng = np.random.default_rng(0)
    row = conf._case(rng, "tiny", 1, 16, 16, 2, 1, 16, conf.ORD, False, dtype=jnp.float32, causal=True)  # fmt: skip
    assert row["builds"] == {
        "fwd": "ordinary", "bwd": "ordinary", "atomic_dq": False, "dq_tma": False,
        "gluon_fwd": None,
    }  # fmt: skip
    assert row["passed"] and row["deterministic"] and row["builds_ok"]
    # On Hopper a case about the Gluon / warp-specialised builds fails when another ran,
    # and a case about the ordinary kernels fails when a special build ran.
    assert conf._builds_ok({"fwd": "gluon", "bwd": "atomic"}, conf.GW, hopper=True)
    assert not conf._builds_ok({"fwd": "ordinary", "bwd": "atomic"}, conf.GW, hopper=True)
    assert not conf._builds_ok({"fwd": "gluon", "bwd": "ws"}, conf.GW, hopper=True)
    assert conf._builds_ok({"fwd": "ws", "bwd": "ws"}, conf.WW, hopper=True)
    assert not conf._builds_ok({"fwd": "ws", "bwd": "ordinary"}, conf.WW, hopper=True)
    assert not conf._builds_ok({"fwd": "ws", "bwd": "ordinary"}, conf.ORD, hopper=True)
    assert conf._builds_ok({"fwd": "ordinary", "bwd": "atomic"}, conf.ORD, hopper=True)
    # A case about the Gluon forward's tile fails when another tile ran.
    three = {"fwd": "gluon", "bwd": "gluon", "gluon_fwd": {"rows": 192, "persistent": True}}
    assert conf._builds_ok(three, conf.G3, hopper=True)
    assert not conf._builds_ok(three, conf.G2, hopper=True)
    # Off Hopper every case expects the ordinary kernels.
    assert conf._builds_ok({"fwd": "ordinary", "bwd": "ordinary"}, conf.WW, hopper=False)


def test_feature_rows_run_and_count_visible_pairs(bench_path):
    features = importlib.import_module("bench_features")
    assert features._causal_pairs(4) == 10 and features._causal_pairs(4, left=1) == 7
    flops, entries = features.documents(docs=2, length=16, n=2, h=16)
    assert flops == 4 * 2 * 16 * 2 * features._causal_pairs(16)
    import jax.numpy as jnp
    import numpy as np

    outs = [
        fn(*(x.astype(jnp.float32) for x in args[:3]), *side[0] if side else ())
        for row, fn, args, *side in entries[:3]
    ]
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)  # segment ids == cu_seqlens
    np.testing.assert_allclose(outs[0].reshape(outs[2].shape), outs[2], atol=1e-5)  # == batch


@pytest.fixture(name="no_tokamax")
def no_tokamax_fixture(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises


@pytest.fixture(name="one_rep")
def one_rep_fixture(bench_path, monkeypatch):
    """Time each call once (the CPU interpreter is slow)."""
    timing = importlib.import_module("_timing")
    once = timing.seconds_per_call
    monkeypatch.setattr(timing, "seconds_per_call", lambda f, *a, reps=10: once(f, *a, reps=1))


def test_feature_bench_runs_tiny_rows_and_says_tokamax_is_unavailable(
    bench_path, one_rep, no_tokamax, monkeypatch, tmp_path
):
    import json

    features = importlib.import_module("bench_features")
    out = tmp_path / "rows.json"
    argv = ["bench_features.py", "--tiny", "--rounds", "1", "--no-bwd", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert features.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["row"] for r in rows} == set(features.ROWS)
    for r in rows:
        if r["impl"] == "ejk":
            assert r["fwd_ms"] > 0 and "error" not in r, r
        if r["impl"] == "tokamax":
            assert r["skipped"].startswith("tokamax unavailable") and "fwd_ms" not in r, r
    tokamax_rows = [(r["row"], r.get("as")) for r in rows if r["impl"] == "tokamax"]
    assert tokamax_rows == [
        ("documents", "k_start ranges"),
        ("documents", "padded batch"),
        ("window", None),
        ("softcap", None),
        ("head256", None),
        ("head64", None),
    ]
    (softcap_cudnn,) = [r for r in rows if r["row"] == "softcap" and r["impl"] == "cudnn"]
    assert "no logits soft cap" in softcap_cudnn["skipped"]
    targets = json.loads(out.read_text())["targets"]  # each row's, read where both ran
    assert {t["row"] for t in targets} == set(features.ROWS)
    ejk_only = {"documents", "softcap"}  # rows whose targets compare ejk with itself
    for t in targets:
        if t["phase"] == "fwdbwd":  # --no-bwd
            assert t["met"] is None and t["missing"] == "ours", t
        elif t["row"] not in ejk_only or "tokamax" in t["target"]:  # no cuDNN, no tokamax
            assert t["met"] is None and t["missing"] == "theirs", t
        else:
            assert isinstance(t["met"], bool) and t["ratio"] > 0, t


def test_flash_bench_row_says_tokamax_is_unavailable(bench_path, one_rep, no_tokamax):
    bench_flash = importlib.import_module("bench_flash")
    variants = [("ejk", None, None, None), ("tokamax", None, None, None)]
    rows = bench_flash.bench_shape((1, 32, 2, 1, 16, True), variants, with_bwd=False, rounds=1)
    assert [r["impl"] for r in rows] == ["ejk", "tokamax"]
    assert rows[0]["fwd_ms"] > 0
    assert rows[1]["skipped"].startswith("tokamax unavailable") and "fwd_ms" not in rows[1]
    assert rows[1]["tokamax_call"] == {"is_causal": True}
    none = bench_flash.bench_shape((1, 32, 2, 1, 16, True), variants[1:], False, 1, ())
    assert none == []  # --tokamax none


def _fake_tokamax(refused: str):
    """A stand-in for tokamax whose ``refused`` implementation raises NotImplementedError
    and the others compute ejk's reference attention with the converted arguments."""
    from types import SimpleNamespace

    from ejk_sequtils import reference_attention

    def dot_product_attention(q, k, v, *, implementation, is_causal, **kw):
        if implementation == refused:
            raise NotImplementedError(f"{implementation} refuses")
        window = kw.get("local_window_size")
        return reference_attention(q, k, v, causal=is_causal, sliding_window=window,
                                   logits_soft_cap=kw.get("logits_soft_cap"))  # fmt: skip

    return SimpleNamespace(dot_product_attention=dot_product_attention)


def test_tokamax_row_times_the_first_implementation_that_runs(bench_path, one_rep, monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    from ejk_sequtils import reference_attention

    tokamax = importlib.import_module("_tokamax")
    monkeypatch.setattr(tokamax, "load", lambda: (_fake_tokamax("mosaic"), ""))
    features = importlib.import_module("bench_features")
    flops, entries = features.window(shape=(1, 32, 2, 1, 16), left=4)
    (entry,) = [e for e in entries if e[0]["impl"] == "tokamax"]
    assert entry[0]["tokamax_call"] == {"is_causal": True, "local_window_size": (4, 0)}
    assert list(entry[1]) == ["mosaic", "triton"]
    q, k, v = (x.astype(jnp.float32) for x in entry[2][:3])
    np.testing.assert_allclose(
        entry[1]["triton"](q, k, v),
        reference_attention(q, k, v, causal=True, sliding_window=(4, 0)),
        atol=1e-6,
    )
    timing = importlib.import_module("_timing")
    (row,) = timing.time_rounds([timing.contender(*entry[:3], False)], 1, flops)
    assert row["ran"] == "triton" and "mosaic refuses" in row["refused"]["mosaic"]
    assert row["fwd_ms"] > 0 and "error" not in row
    # --tokamax-each: a row per implementation; the refusing one is an error row.
    each = features.window(shape=(1, 32, 2, 1, 16), left=4, groups=(("mosaic",), ("triton",)))[1]
    cases = [timing.contender(*e[:3], False) for e in each if e[0]["impl"] == "tokamax"]
    mosaic, triton = timing.time_rounds(cases, 1, flops)
    assert "mosaic refuses" in mosaic["error"] and "fwd_ms" not in mosaic
    assert triton["ran"] == "triton" and triton["fwd_ms"] > 0


def test_contender_keeps_the_forward_when_only_the_backward_fails(bench_path, one_rep):
    import jax
    import jax.numpy as jnp

    timing = importlib.import_module("_timing")

    @jax.custom_vjp
    def no_backward(q, k, v):
        return q * 2.0

    def refuse(res, g):
        raise NotImplementedError("no backward here")

    no_backward.defvjp(lambda q, k, v: (q * 2.0, None), refuse)
    args = tuple(jnp.ones((1, 8, 1, 4)) for _ in range(4))
    (row,) = timing.time_rounds([timing.contender({}, no_backward, args, True)], 1, 1.0)
    assert row["fwd_ms"] > 0 and "fwdbwd_ms" not in row
    assert "no backward here" in row["fwdbwd_error"] and "error" not in row


def _tokamax_visible(t, *, is_causal, local_window_size=None, k_start=None, **_):
    """Which keys tokamax shows each query, transcribed from its documentation: ``is_causal``
    keys ``j <= i``; ``local_window_size=(pre, post)`` becomes ``CausalMask(offset=post,
    window_size=pre + post + 1)``: ``j <= i + post`` and ``j > i + post - window_size``;
    ``Mask(k_start=s)``: ``j >= s[i]``."""
    import numpy as np

    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = np.ones((t, t), bool)
    if is_causal:
        visible &= j <= i
    if local_window_size is not None:
        pre, post = local_window_size
        visible &= (j <= i + post) & (j > i + post - (pre + post + 1))
    if k_start is not None:
        visible &= j >= np.asarray(k_start)[:, None]
    return visible


@pytest.mark.parametrize(
    "ejk",
    [
        dict(causal=True),
        dict(causal=True, sliding_window=(5, 0)),
        dict(sliding_window=(3, 7)),
        dict(sliding_window=4),
        dict(causal=True, sliding_window=(2, 2), logits_soft_cap=50),
    ],
)
def test_tokamax_arguments_select_the_keys_ejk_does(bench_path, ejk):
    import numpy as np

    from ejk_sequtils import visibility_mask

    tokamax = importlib.import_module("_tokamax")
    call = tokamax.tokamax_arguments(**ejk)
    assert call.get("logits_soft_cap") == ejk.get("logits_soft_cap")  # same cap·tanh(x/cap)
    np.testing.assert_array_equal(
        _tokamax_visible(24, **call),
        np.asarray(visibility_mask(24, 24, **{k: v for k, v in ejk.items() if k != "logits_soft_cap"}))[0, 0],
    )  # fmt: skip


def test_document_starts_give_the_causal_keys_of_each_document(bench_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ejk_sequtils import visibility_mask

    tokamax = importlib.import_module("_tokamax")
    ids = jnp.asarray([[0, 0, 0, 3, 3, 1, 1, 1, 1, 7], [2, 2, 2, 2, 2, 2, 0, 0, 5, 5]], jnp.int32)
    tokamax.check_runs(ids)
    starts = jax.jit(tokamax.document_starts)(ids)  # traceable: the ids are a jit argument
    np.testing.assert_array_equal(starts[0], [0, 0, 0, 3, 3, 5, 5, 5, 5, 9])
    expected = np.asarray(visibility_mask(10, 10, causal=True, segment_ids=ids))[:, 0]
    for b in range(2):
        got = _tokamax_visible(10, is_causal=True, k_start=starts[b])
        np.testing.assert_array_equal(got, expected[b])
    for bad in ([[0, 0, 1, 1, 0, 0]], [[0, 0, -1, -1, 1, 1]]):  # a repeated run, padding
        with pytest.raises(NotImplementedError, match="tokamax key ranges"):
            tokamax.check_runs(np.asarray(bad))


def test_short_calls_run_longer_batches(bench_path, monkeypatch):
    """A timed batch runs at least ten calls, and enough short ones to fill about
    `_timing.BATCH_SECONDS`, so the host's lead per batch weighs little a call; each row
    says how many (``*_reps``) and its rounds ran that many."""
    import jax.numpy as jnp

    timing = importlib.import_module("_timing")
    assert timing.reps_for(1.0) == timing.MIN_REPS == 10
    assert timing.reps_for(0.0005) == 50  # a 0.5 ms call: 25 ms a batch
    assert timing.reps_for(1e-7) == timing.MAX_REPS
    assert timing.reps_for(0.0) == timing.MIN_REPS
    asked = []
    once = timing.seconds_per_call
    monkeypatch.setattr(
        timing, "seconds_per_call", lambda f, *a, reps=10: asked.append(reps) or once(f, *a, reps=1)
    )
    monkeypatch.setattr(timing, "reps_for", lambda seconds: 37)
    args = tuple(jnp.ones((1, 8, 1, 4)) for _ in range(4))
    (row,) = timing.time_rounds([timing.contender({}, lambda q, k, v: q * 2.0, args, True)], 2, 1.0)
    assert row["fwd_reps"] == row["fwdbwd_reps"] == 37 and asked == [37] * 4


def test_trace_gives_each_calls_span_and_the_wait_between_calls(bench_path, tmp_path):
    """`_trace.summarize_trace` reads a profiler trace: the GPU span over all the calls, the
    kernels' busy time, each call's own span (its first kernel's start to its last one's
    end, without the wait before the next call) and the kernels by name; host lines and the
    GPU's XLA op lines are not kernels."""
    import gzip
    import json

    trace = importlib.import_module("_trace")
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "main"}},
    ]

    def kernel(name, ts, dur, pid=1, tid=7):
        return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}

    # Two calls of (table 10 us, forward 100 us, 5 us apart), 40 us between the calls.
    events = [kernel("table", 0, 10), kernel("fwd", 15, 100), kernel("table", 155, 10)]
    events += [kernel("fwd", 170, 100), kernel("op", 0, 270, tid=8), kernel("host", 0, 500, 2, 1)]
    with gzip.open(tmp_path / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    (gpu,) = trace.summarize_trace(tmp_path, calls=2)["gpus"].values()
    assert gpu["span_ms"] == pytest.approx(0.270) and gpu["compute_busy_ms"] == pytest.approx(0.220)
    assert gpu["call_spans_ms"] == pytest.approx([0.115, 0.115])
    assert gpu["top_kernels_ms"] == pytest.approx({"fwd": 0.2, "table": 0.02})
    assert trace.summarize_trace(tmp_path, calls=3)["gpus"]["/device:GPU:0"]["call_spans_ms"] == []


def test_feature_bench_traces_each_contender_when_asked(bench_path, one_rep, no_tokamax):
    """``trace_calls``: every timed contender gets its GPU span fields (NaN on the CPU,
    whose trace holds no GPU kernel)."""
    import math

    features = importlib.import_module("bench_features")
    rows = features.run(["head64"], 1, with_bwd=False, tiny=True, trace_calls=2)
    (ejk,) = [r for r in rows if r["impl"] == "ejk"]
    assert math.isnan(ejk["fwd_gpu_ms"]) and math.isnan(ejk["fwd_gpu_call_ms"])
    assert ejk["fwd_kernels_ms"] == {} and "fwdbwd_gpu_ms" not in ejk


def test_targets_read_each_ratio_its_way_and_say_what_is_missing(bench_path):
    targets = importlib.import_module("_targets")
    rows = [
        {"row": "documents", "impl": "ejk", "as": "segment_ids", "fwd_ms": 1.2, "fwdbwd_ms": 2.0},
        {"row": "documents", "impl": "ejk", "as": "cu_seqlens", "fwd_ms": 1.0, "fwdbwd_ms": 2.0},
        {"row": "documents", "impl": "ejk", "as": "padded batch", "fwd_ms": 1.0},
        {"row": "window", "impl": "ejk", "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "fwd_gpu_ms": 0.9},
        {"row": "window", "impl": "cudnn", "fwd_ms": 1.5, "fwdbwd_ms": 2.7, "fwd_gpu_ms": 1.8},
        {"row": "window", "impl": "tokamax", "fwd_ms": 1.1, "fwd_gpu_ms": 0.99},
        {"row": "softcap", "impl": "ejk", "soft_cap": 50.0, "fwd_ms": 1.0},
        {"row": "softcap", "impl": "ejk", "soft_cap": None, "fwd_ms": 0.95},
        {"row": "softcap", "impl": "tokamax", "soft_cap": 50.0, "skipped": "tokamax unavailable"},
    ]  # fmt: skip
    got = {(e["row"], e["target"], e["phase"]): e for e in targets.evaluate(rows)}
    assert {row for row, _, _ in got} == {"documents", "window", "softcap"}  # rows present only
    ids = got["documents", "segment ids' speed / cu_seqlens'", "fwd"]
    assert ids["ratio"] == pytest.approx(1.0 / 1.2) and ids["met"] is False  # speed: theirs / ours
    packed = got["documents", "packed time / the padded batch's", "fwd"]
    assert packed["ratio"] == pytest.approx(1.2) and packed["met"] is False  # time: ours / theirs
    missing = got["documents", "packed time / the padded batch's", "fwdbwd"]
    assert missing["met"] is None and missing["missing"] == "theirs"
    best = got["window", "speed / the best of cuDNN and tokamax", "fwd"]
    assert best["ratio"] == pytest.approx(1.1) and best["met"] is True  # the faster of the two
    assert best["gpu_ratio"] == pytest.approx(0.99 / 0.9)
    assert got["window", "speed / cuDNN's", "fwdbwd"]["met"] is False
    cap = got["softcap", "soft cap's speed / no cap's (ejk)", "fwd"]
    assert cap["ratio"] == pytest.approx(0.95) and cap["met"] is True
    assert got["softcap", "speed / tokamax's", "fwd"]["missing"] == "theirs"
    printed = targets.table(targets.evaluate(rows))
    assert "missed" in printed and "not read (theirs missing)" in printed


def test_conformance_shards_merge_into_one_json(bench_path, monkeypatch, tmp_path):
    """``--shards``: case i runs in shard i mod n; the shards' JSONs merge into one, cases in
    index order, and a shard that wrote nothing shows as its cases missing and a failure."""
    import argparse
    import json
    import subprocess

    conf = importlib.import_module("gpu_conformance")
    launched = []

    class FakeShard:
        def __init__(self, command):
            cases = [int(i) for i in command[command.index("--cases") + 1].split(",")]
            launched.append(cases)
            self.cases = cases
            if 4 not in cases:  # the shard holding case 4 is killed before writing
                rows = [{"index": i, "name": f"c{i}", "passed": True} for i in cases]
                out = command[command.index("--json") + 1]
                with open(out, "w") as f:
                    json.dump({"device": "fake", "cases": rows, "argv": command[2:]}, f)

            self.polls = 0

        def poll(self):  # the first shard runs on for one look, the others are done
            self.polls += 1
            return None if launched[0] is self.cases and self.polls == 1 else 0

    sleeps = []

    def sleep(seconds):  # the merged file is written before each wait
        sleeps.append(json.loads(out.read_text())["missing"])

    monkeypatch.setattr(subprocess, "Popen", FakeShard)
    monkeypatch.setattr(conf.time, "sleep", sleep)
    out = tmp_path / "merged.json"
    args = argparse.Namespace(cases="0,1,2,3,4,5", repeat=1, quick=False, shards=3,
                              json=str(out), commit="abc")  # fmt: skip
    assert conf._run_shards(args) == 1
    assert launched == [[0, 3], [1, 4], [2, 5]]
    merged = json.loads(out.read_text())
    assert [r["index"] for r in merged["cases"]] == [0, 2, 3, 5]
    assert merged["missing"] == [1, 4] and merged["device"] == "fake"
    assert [s["cases"] for s in merged["shards"]] == [2, 0, 2]
    assert sleeps == [[1, 4]]


def test_conformance_cases_with_a_large_reference_run_alone_after_the_shards(
    bench_path, monkeypatch, tmp_path
):
    """A case whose float32 reference needs more than `ALONE_BYTES` starts only after every
    shard has ended, in a process of its own; XLA's GEMM autotuning is off for the shards."""
    import argparse
    import json
    import os
    import subprocess

    conf = importlib.import_module("gpu_conformance")
    big = next(i for i in range(len(conf.CASES)) if conf._alone(i))
    assert sum(conf._alone(i) for i in range(len(conf.CASES))) == 1  # T = 8192, N = 32
    running, launched = [], []

    class FakeShard:
        def __init__(self, command):
            cases = [int(i) for i in command[command.index("--cases") + 1].split(",")]
            launched.append((cases, sum(not p.done for p in running)))
            running.append(self)
            self.done = False
            rows = [{"index": i, "name": f"c{i}", "passed": True} for i in cases]
            with open(command[command.index("--json") + 1], "w") as f:
                json.dump({"device": "fake", "cases": rows}, f)

        def poll(self):  # each shard ends at its first look
            self.done = True
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeShard)
    monkeypatch.setattr(conf.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    out = tmp_path / "merged.json"
    args = argparse.Namespace(cases=f"0,{big},1,2", repeat=1, quick=False, shards=2,
                              json=str(out), commit="abc")  # fmt: skip
    conf._without_gemm_autotuning()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0"
    assert conf._run_shards(args) == 0
    assert launched == [([0, 2], 0), ([1], 1), ([big], 0)]
    assert [r["index"] for r in json.loads(out.read_text())["cases"]] == [0, 1, 2, big]


@pytest.mark.parametrize("mods", ["alibi", "relative", "per_head", "softcap"])
def test_conformance_flex_cases_pass_in_the_interpreter(bench_path, mods):
    """The flex cases' check on tiny shapes: the kernels against the dense definition, the
    score_mod's capture differentiated, emptied rows (per_head) matched."""
    import numpy as np

    conf = importlib.import_module("gpu_conformance")
    flex = importlib.import_module("_flex_conformance")
    assert [c[0] for c in flex.FLEX_CASES] == [c[0] for c in conf.FLEX_CASES]
    row = flex.flex_case(np.random.default_rng(0), "tiny", 1, 40, 56, 2, 1, 16, mods, "float32",
                         tol=1e-4)  # fmt: skip
    assert row["passed"], row
    assert ("dparam" in row["errors"]) == (mods in ("alibi", "relative"))


def test_conformance_flex_case_fails_a_wrong_kernel(bench_path, monkeypatch):
    """A flex kernel that drops the score_mod fails its case."""
    import numpy as np

    flex = importlib.import_module("_flex_conformance")
    real = flex.flex_attention
    monkeypatch.setattr(
        flex, "flex_attention", lambda *a, score_mod, **kw: real(*a, score_mod=None, **kw)
    )
    row = flex.flex_case(np.random.default_rng(0), "tiny", 1, 40, 56, 2, 1, 16, "alibi", "float32",
                         tol=1e-4)  # fmt: skip
    assert not row["passed"]
