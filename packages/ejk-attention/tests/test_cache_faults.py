"""Faults of the config cache and of the CLI's files: a call never fails because of what the
cache holds; ``ejk cache`` and ``ejk bench --out`` give a reason and a non-zero exit, never a
traceback, a false success or a renamed user file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import threading
import time

import filelock
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention
from ejk_attention._backends import BACKENDS, TritonBackend
from ejk_attention._tuned import BackendChoice, backend_key, open_cache
from ejk_attention.cli import main
from ejk_config import device_fingerprint
from ejk_executor import CacheWarning, PersistentCache
from ejk_kernels_gpu import FlashConfig
from ejk_sequtils import validate_attention, validate_paged_attention


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any case is run: the output folder is checked first."""
    from ejk_attention import _bench

    def refuse(*args, **kwargs):
        raise AssertionError("a case ran before the output folder was checked")

    monkeypatch.setattr(_bench, "run_all", refuse)


_DEEP = b"[" * 100_000 + b"]" * 100_000  # past every Python's recursion limit (3.12 parses 1000)


def test_cache_commands_survive_a_deeply_nested_file(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "configs-v1.json").write_bytes(b'{"format": 1, "entries": {}, "x": %s}' % _DEEP)
    with pytest.warns(CacheWarning, match="is damaged"):
        assert main(["cache", "--cache-dir", str(cache_dir), "clear"]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0


def _qkv(t):
    """q, k, v of a shape no other test uses (the executor's memory cache is per process)."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t + 8, 2, 16)), jnp.float32)
    return q, k, k


def _forward_key(q, k, v):
    return BACKENDS["triton"].invocations(validate_attention(q, k, v))["forward"].call_key


@pytest.mark.parametrize(("block_q", "t"), [(2**20, 20), (2**40, 21), (2**64, 22)])
def test_a_crafted_kernel_config_on_disk_gives_the_heuristic(block_q, t):
    q, k, v = _qkv(t)
    key = _forward_key(q, k, v)
    open_cache().put(key, FlashConfig(block_q=block_q))
    with pytest.warns(
        CacheWarning,
        match=r"not in its search space for this call \(ejk_kernels_gpu\.flash_attention_fwd\); choosing",
    ):
        out = flash_attention(q, k, v, implementation="triton")
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=2e-5)
    assert key not in open_cache().keys()


def _paged_inputs(seed):
    """A paged call (2 sequences, table of 3 pages of 8) of a shape no other test uses."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((6, 8, 2, 16)), jnp.float32)
    table = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    return q, pages, -pages, table, jnp.asarray([17, 9 + seed % 8], jnp.int32)


def _crafted_paged_config(implementation):
    if implementation == "triton":
        from ejk_kernels_gpu import PagedConfig

        return PagedConfig(block_m=2**40, block_kv=2**20, num_splits=2**30)
    from ejk_kernels_tpu import RaggedPagedConfig

    return RaggedPagedConfig(block_q=2**40, pages_per_block=2**20)


def test_a_backward_config_stored_by_the_old_code_stays_on_disk_and_is_a_miss():
    """A cache written before `ejk_kernels_gpu.FlashBackwardConfig`: its backward entries
    hold `FlashConfig`s under the keys of the backward kernel's version 2. The call runs
    with the heuristic's backward config, warns of nothing, and the entry stays."""
    import jax

    from ejk_executor import Invocation
    from ejk_kernels_gpu import FlashAttentionBackward

    q, k, v = _qkv(24)
    request = validate_attention(q, k, v, causal=True)
    new = BACKENDS["triton"].invocations(request)["backward"]
    old = Invocation.make(FlashAttentionBackward(version="2"), new.args, new.kwargs)
    assert old.call_key != new.call_key
    stored = FlashConfig(block_q=16, block_k=16, num_stages=1, atomic_dq=True)
    open_cache().put(old.call_key, stored)
    before = open_cache().path.read_bytes()

    def loss(implementation, q, k, v):
        return flash_attention(q, k, v, causal=True, implementation=implementation).sum()

    got = jax.grad(lambda *a: loss("triton", *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5)
    assert open_cache().path.read_bytes() == before
    assert open_cache(fresh=True).get(old.call_key) == stored


@pytest.mark.parametrize(
    ("implementation", "kernel"),
    [("triton", "ejk_kernels_gpu.paged_attention"), ("pallas", "ejk_kernels_tpu.paged_attention")],
)
def test_a_crafted_paged_config_on_disk_gives_the_heuristic(implementation, kernel):
    from ejk_attention import paged_attention
    from ejk_attention._backends import paged_backends

    paged = paged_backends()
    args = _paged_inputs(len(implementation))
    request = validate_paged_attention(*args)
    key = paged[implementation].invocations(request)["forward"].call_key
    crafted = _crafted_paged_config(implementation)
    open_cache().register(type(crafted))
    open_cache().put(key, crafted)
    with pytest.warns(
        CacheWarning, match=rf"not in its search space for this call \({kernel}\); choosing"
    ):
        out = paged_attention(*args, implementation=implementation)
    want = paged_attention(*args, implementation="xla")
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    assert key not in open_cache().keys()


def test_a_crafted_block_sparse_config_on_disk_gives_the_heuristic():
    from ejk_kernels_tpu import BlockSparseConfig

    q, k, v = _qkv(37)
    key = BACKENDS["pallas"].invocations(validate_attention(q, k, v))["forward"].call_key
    open_cache().put(key, BlockSparseConfig(block_q=2**40, block_kv_dkv=2**20))
    with pytest.warns(
        CacheWarning,
        match=r"not in its search space for this call \(ejk_kernels_tpu\.blocksparse_attention\)",
    ):
        out = flash_attention(q, k, v, implementation="pallas")
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=2e-5)
    assert key not in open_cache().keys()


def test_a_cached_kernel_config_that_fails_at_launch_is_dropped(monkeypatch):
    q, k, v = _qkv(29)
    request = validate_attention(q, k, v)
    fragile = BACKENDS["triton"].config_space(request)[-1]
    assert fragile != BACKENDS["triton"].heuristic_config(request)
    key = _forward_key(q, k, v)
    open_cache().put(key, fragile)
    run = TritonBackend.run

    def run_or_fail(self, request, config, bwd_config):
        if config == fragile:
            raise RuntimeError("out of resources: shared memory")
        return run(self, request, config, bwd_config)

    monkeypatch.setattr(TritonBackend, "run", run_or_fail)
    with pytest.warns(CacheWarning, match="failed at launch.*out of resources"):
        out = flash_attention(q, k, v, implementation="triton")
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=2e-5)
    assert key not in open_cache().keys()


def test_a_stored_backend_choice_that_fails_gives_the_platforms_order(monkeypatch):
    q, k, v = _qkv(31)
    key = backend_key(validate_attention(q, k, v), device_fingerprint())
    open_cache().put(key, BackendChoice("triton", 1.0))

    def fail(self, request, config, bwd_config):
        raise RuntimeError("triton crashed")

    monkeypatch.setattr(TritonBackend, "run", fail)
    with pytest.warns(CacheWarning, match="dropping the backend choice.*triton crashed"):
        out = flash_attention(q, k, v)
    np.testing.assert_allclose(out, flash_attention(q, k, v, implementation="xla"), atol=0)
    assert key not in open_cache().keys()


def _a_cache_with_entries(tmp_path, n=3):
    cache_dir = tmp_path / "cache"
    cache = PersistentCache(cache_dir, types=(BackendChoice,))
    for i in range(n):
        cache.put(f"key-{i:04d}-" + "x" * 200, BackendChoice("xla", float(i)))
    return cache_dir


def test_cache_clear_takes_the_writers_lock(tmp_path, capsys):
    """A writer holding the lock finishes first: its entry is cleared with the rest, and
    ``clear`` counts it; one that writes after the clear keeps its entry."""
    import msgspec

    from ejk_executor import write_atomic

    cache_dir = _a_cache_with_entries(tmp_path)
    path = cache_dir / "configs-v1.json"
    status = []
    clearing = threading.Thread(
        target=lambda: status.append(main(["cache", "--cache-dir", str(cache_dir), "clear"]))
    )
    with filelock.FileLock(str(path) + ".lock"):  # a writer in the middle of a merge
        clearing.start()
        time.sleep(1.0)
        assert path.exists() and not status, "clear removed the file under a writer's lock"
        data = json.loads(path.read_bytes())
        data["entries"]["late"] = {"type": data["entries"][min(data["entries"])]["type"],
                                   "cfg": {"implementation": "xla", "fwd_bwd_ms": 9.0}}  # fmt: skip
        write_atomic(path, lambda f: f.write(msgspec.json.encode(data)))
    clearing.join(timeout=60)
    assert status == [0]
    assert "removed 4 entries" in capsys.readouterr().out
    assert not path.exists()
    open_cache(cache_dir, fresh=True).put("after", BackendChoice("xla", 1.0))
    assert PersistentCache(cache_dir).keys() == ["after"]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_cache_clear_leaves_a_file_it_cannot_read_and_says_so(tmp_path, capsys, kind):
    """Before: a FIFO was unlinked (exit 0), a directory gave an IsADirectoryError traceback."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (os.mkfifo if kind == "fifo" else os.mkdir)(cache_dir / "configs-v1.json")
    with pytest.warns(CacheWarning, match="not a regular file.*leaving it alone"):
        assert main(["cache", "--cache-dir", str(cache_dir), "clear"]) == 1
    captured = capsys.readouterr()
    assert "removed" not in captured.out
    assert captured.err.startswith("ejk cache clear: error: ") and "left as it is" in captured.err
    mode = os.lstat(cache_dir / "configs-v1.json").st_mode
    assert stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISDIR(mode)


def test_export_to_a_folder_that_cannot_be_written_fails_with_the_reason(tmp_path, capsys):
    cache_dir = _a_cache_with_entries(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "out.json"  # its folder is a file: no write can succeed, even as root
    assert main(["cache", "--cache-dir", str(cache_dir), "export", str(target)]) == 1
    captured = capsys.readouterr()
    assert "exported" not in captured.out
    assert captured.err.startswith("ejk cache export: error: ") and "a-file" in captured.err


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled up; skipped where it cannot be mounted."""
    mount = tmp_path / "full"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a full disk")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    try:
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as f:
            f.write(b"\0" * (64 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_export_to_a_full_disk_fails_with_the_reason(tmp_path, capsys, full_disk):
    cache_dir = _a_cache_with_entries(tmp_path, n=50)
    assert main(["cache", "--cache-dir", str(cache_dir), "export", str(full_disk / "x.json")]) == 1
    captured = capsys.readouterr()
    assert "exported" not in captured.out
    assert "No space left on device" in captured.err
    assert not (full_disk / "x.json").exists()


def test_import_of_a_bad_file_fails_and_leaves_the_file_alone(tmp_path, capsys):
    cache_dir = _a_cache_with_entries(tmp_path)
    bad = tmp_path / "BAD.json"
    bad.write_bytes(b'{"format": 1, "entries": {"k": ')
    assert main(["cache", "--cache-dir", str(cache_dir), "import", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"ejk cache import: error: {bad} is not a config cache file")
    assert bad.read_bytes() == b'{"format": 1, "entries": {"k": '
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BAD.json", "cache"]
    assert len(PersistentCache(cache_dir)) == 3


def test_import_of_a_missing_file_fails_with_the_reason(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["cache", "--cache-dir", str(tmp_path / "cache"), "import", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"ejk cache import: error: no such file: {missing}\n"
    assert "imported" not in captured.out and not missing.exists()


@pytest.mark.parametrize("action", ["import", "export"])
def test_a_file_not_named_json_is_refused_not_taken_for_a_folder(tmp_path, capsys, action):
    """A cache file saved as ``backup.bak`` was read as the folder ``backup.bak/`` holding
    ``configs-v1.json``: ``import`` said "imported 0 entries" and exited 0."""
    cache_dir = _a_cache_with_entries(tmp_path)
    given = tmp_path / "backup.bak"
    shutil.copy(cache_dir / "configs-v1.json", given)
    before = given.read_bytes()
    assert main(["cache", "--cache-dir", str(cache_dir), action, str(given)]) == 1
    captured = capsys.readouterr()
    assert f"{action}ed" not in captured.out
    assert (
        captured.err.startswith(f"ejk cache {action}: error: {given} ") and ".json" in captured.err
    )
    assert given.read_bytes() == before


def test_import_into_a_cache_that_cannot_be_written_fails(tmp_path, capsys):
    exported = tmp_path / "good.json"
    PersistentCache(exported, types=(BackendChoice,)).put("k", BackendChoice("xla"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["cache", "--cache-dir", str(blocker / "cache"), "import", str(exported)]) == 1
    captured = capsys.readouterr()
    assert "imported" not in captured.out and "ejk cache import: error: " in captured.err


TINY = ["--shape", "1,32,48,4,2,16", "--iters", "1", "--warmup", "0", "--quiet", "--impl", "xla"]


@pytest.mark.usefixtures("no_work")
def test_bench_checks_its_output_folder_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", *TINY, "--out", str(blocker / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ejk bench: error: --out {blocker / 'out'}: cannot write there")
    assert err.rstrip().endswith("nothing was run")


@pytest.mark.parametrize(
    ("fault", "status", "why"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 1, "[Errno 28] No space left"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
    ids=["disk-full", "sigint"],
)
def test_bench_never_leaves_a_partial_plot_or_one_of_another_run(
    tmp_path, capsys, monkeypatch, fault, status, why
):
    from ejk_attention import cli

    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.png").write_bytes(b"the previous run's plot")

    def plot_then_fail(runs, title, target):
        (target if hasattr(target, "write") else open(target, "wb")).write(b"\x89PNG partial")
        raise fault

    monkeypatch.setattr(cli, "_plot", plot_then_fail)
    assert main(["bench", *TINY, "--out", str(out)]) == status
    err = capsys.readouterr().err
    assert f"complete in {out}: bench.json; not written ({why}" in err and err.rstrip().endswith(
        "bench.png"
    )
    assert json.loads((out / "bench.json").read_text())["results"]
    assert sorted(p.name for p in out.iterdir()) == ["bench.json"]  # no partial or stale plot


def test_every_backend_config_is_read_back_from_disk(tmp_path):
    """What autotuning stores, a later process reads: every backend's config types are in
    `cache_types` (a FlexConfig or RaggedPagedConfig missing there was written to disk by
    autotuning and read back as no entry), and each round-trips through the file."""
    from ejk_attention._tuned import cache_types
    from ejk_kernels_gpu.flex import FlexConfig
    from ejk_kernels_tpu import RaggedPagedConfig

    declared = {t for backend in BACKENDS.values() for t in backend.config_types}
    assert declared <= set(cache_types()), declared - set(cache_types())
    stored = {f"k{i}": t() for i, t in enumerate(declared)}
    stored["flex"] = FlexConfig(block_q=32, block_k=64, num_warps=8, num_stages=3)
    writer = PersistentCache(tmp_path, types=cache_types())
    for key, cfg in stored.items():
        writer.put(key, cfg)
    reader = PersistentCache(tmp_path, types=cache_types())  # as a fresh process opens it
    assert {key: reader.get(key) for key in stored} == stored
    assert any(isinstance(cfg, RaggedPagedConfig) for cfg in stored.values())
