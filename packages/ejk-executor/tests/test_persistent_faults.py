"""The persistent cache under hostile conditions: no fault fails a call or loses a confirmed write."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import msgspec
import pytest

from ejk_config import FwdParams
from ejk_executor import CacheWarning, ConfigSelectorChain, Executor, PersistentCache

_DEEP = b"[" * 100_000 + b"]" * 100_000  # past every Python's recursion limit (3.12 parses 1000)


def _ab():
    return jnp.ones((8, 4)), jnp.ones((4, 3))


def test_deeply_nested_file_gives_a_warning_and_the_heuristic(tmp_path, mat_kernel, kernels):
    path = tmp_path / "c.json"
    path.write_bytes(b'{"format": 1, "entries": {"k": {"type": "x", "cfg": %s}}}' % _DEEP)
    persistent = PersistentCache(path, types=(kernels["MatCfg"],))
    ex = Executor(ConfigSelectorChain(persistent=persistent))
    a, b = _ab()
    with pytest.warns(CacheWarning, match="is damaged"):
        out = jax.jit(lambda a, b: ex(mat_kernel, a, b))(a, b)
    assert out.shape == (8, 3)
    assert ex.choose(mat_kernel, a, b).source == "memory"  # the heuristic's, kept in memory


def test_any_failure_of_the_persistent_cache_becomes_a_warning(tmp_path, mat_kernel, monkeypatch):
    persistent = PersistentCache(tmp_path)

    def broken(key, default=None):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(persistent, "get", broken)
    ex = Executor(ConfigSelectorChain(persistent=persistent))
    a, b = _ab()
    with pytest.warns(CacheWarning, match="disk on fire"):
        assert ex.choose(mat_kernel, a, b).source == "heuristic"


def _make(kind, path):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:  # one byte over the documented 64 MB limit (sparse: no disk used)
        with open(path, "wb") as f:
            f.truncate(64 * 2**20 + 1)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "oversize"])
def test_a_fifo_device_or_huge_file_is_never_read_nor_replaced(tmp_path, kind):
    path = tmp_path / "c.json"
    _make(kind, path)
    before = os.lstat(path)
    cache = PersistentCache(path)
    done = {}

    def work():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            done["got"] = cache.get("k")
            cache.put("k", FwdParams(num_warps=2))
        done["warnings"] = [str(w.message) for w in record]

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive() and kind == "fifo":  # release the reader blocked in open()
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert not worker.is_alive(), f"the cache hung on a {kind}"
    assert done["got"] is None and cache.memory_only
    (message,) = done["warnings"]
    assert "leaving it alone" in message and str(path) in message
    assert (
        "larger than the limit" if kind == "oversize" else f"not a regular file: '{path}'"
    ) in message
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_size) == (
        before.st_ino,
        before.st_mode,
        before.st_size,
    )
    assert cache.get("k") == FwdParams(num_warps=2)  # kept in memory


def test_clear_counts_what_the_file_holds_and_leaves_what_it_cannot_read(tmp_path):
    path = tmp_path / "c.json"
    a, b = PersistentCache(path), PersistentCache(path)
    a.put("k1", FwdParams())
    b.put("k2", FwdParams(num_warps=8))  # written since a's last read
    assert a.clear() == 2 and not path.exists() and a.keys() == []
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    cache = PersistentCache(fifo)
    with pytest.warns(CacheWarning, match="leaving it alone"):
        assert cache.clear() == 0
    assert cache.memory_only and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _drop_root_override():
    """The argv prefix that runs a command as root without the file-permission override."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed: cannot drop root's permission override")
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP?)")
    return prefix


_UNREADABLE = textwrap.dedent(
    """
    import sys, warnings
    from ejk_config import FwdParams
    from ejk_executor import PersistentCache
    cache = PersistentCache(sys.argv[1])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cache.get("k0") is None
        cache.put("new", FwdParams(num_warps=8))
    assert cache.memory_only and cache.get("new") == FwdParams(num_warps=8)
    print([str(w.message) for w in record])
    """
)


def test_an_unreadable_file_is_left_alone(tmp_path):
    prefix = _drop_root_override()
    path = tmp_path / "c.json"
    owner = PersistentCache(path)
    for i in range(5):
        owner.put(f"k{i}", FwdParams(num_stages=i + 1))
    before = path.read_bytes()
    path.chmod(0)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)  # another user's file, as in the report
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", _UNREADABLE, str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "leaving it alone" in proc.stdout and "Permission denied" in proc.stdout
    assert path.read_bytes() == before  # all 5 entries kept


def test_a_reader_moves_aside_only_the_damaged_bytes_it_read(tmp_path, monkeypatch):
    """A writer replaces a damaged file between a reader's read and its move aside: the
    reader must not move the writer's valid file (and its confirmed entry) away."""
    path = tmp_path / "c.json"
    path.write_bytes(b"damaged")
    reader, writer = PersistentCache(path), PersistentCache(path)
    decode = msgspec.json.decode
    raced = []

    def decode_then_race(data, **kw):
        if data == b"damaged" and not raced:
            raced.append(True)
            writer.put("confirmed", FwdParams(num_warps=8))  # finds the damage too, rewrites
        return decode(data, **kw)

    monkeypatch.setattr(msgspec.json, "decode", decode_then_race)
    with pytest.warns(CacheWarning, match="is damaged"):
        reader.get("other")
    monkeypatch.undo()
    assert raced
    assert PersistentCache(path).get("confirmed") == FwdParams(num_warps=8)
    assert reader.get("confirmed") == FwdParams(num_warps=8)
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.read_bytes() == b"damaged"


def test_stale_temp_files_of_killed_writers_are_removed_at_the_next_write(tmp_path):
    cache = PersistentCache(tmp_path / "c.json")
    stale, fresh, held = (tmp_path / f"c.json{name}.tmp" for name in ("abc", "def", "ghi"))
    for tmp in (stale, fresh, held):
        tmp.write_bytes(b'{"format": 1, "entr')  # a writer killed mid-write
    old = time.time() - 120
    for tmp in (stale, held):
        os.utime(tmp, (old, old))
    with open(held, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # a live (if slow) writer still holds it
        cache.put("k", FwdParams(num_warps=2))
    assert not stale.exists()
    assert fresh.exists() and held.exists()
    assert PersistentCache(tmp_path / "c.json").get("k") == FwdParams(num_warps=2)


def _stored(tmp_path, kernel, kernels, cfg):
    """A chain whose persistent cache holds ``cfg`` for ``kernel(a, b)`` (as a crafted file would)."""
    persistent = PersistentCache(tmp_path, types=(kernels["MatCfg"],))
    ex = Executor(ConfigSelectorChain(persistent=persistent))
    persistent.put(ex.invocation(kernel, *_ab()).call_key, cfg)
    return ex


def test_a_cached_config_outside_the_kernels_bounds_is_dropped(tmp_path, kernels):
    class Bounded(kernels["MatKernel"]):
        def cached_cfg_problem(self, inv, cfg):
            return None if cfg.block <= 128 else f"block={cfg.block} exceeds 128"

    kernel = Bounded()
    ex = _stored(tmp_path, kernel, kernels, kernels["MatCfg"](block=2**40))
    with pytest.warns(CacheWarning, match=r"block=1099511627776 exceeds 128; choosing another"):
        assert ex.choose(kernel, *_ab()) == (kernels["MatCfg"](block=16), "heuristic")
    assert len(PersistentCache(tmp_path)) == 0  # dropped on disk too


def test_a_kernel_can_accept_from_disk_only_configs_of_its_space(tmp_path, kernels):
    class Spaced(kernels["MatKernel"]):
        cached_cfg_in_space = True

    kernel = Spaced()
    inv = Executor(ConfigSelectorChain()).invocation(kernel, *_ab())
    for cfg in kernel.config_space(inv):
        assert kernel.cached_cfg_problem(inv, cfg) is None
    assert kernels["MatKernel"]().cached_cfg_problem(inv, kernels["MatCfg"](block=2**40)) is None
    ex = _stored(tmp_path, kernel, kernels, kernels["MatCfg"](block=2**40))
    with pytest.warns(
        CacheWarning, match=r"not in its search space for this call \(toy_matmul\); choosing"
    ):
        assert ex.choose(kernel, *_ab()) == (kernels["MatCfg"](block=16), "heuristic")
    assert len(PersistentCache(tmp_path)) == 0
    tuned = kernels["MatCfg"](block=32)  # one of its space, as the autotuner stores
    ex = _stored(tmp_path, kernel, kernels, tuned)
    assert ex.choose(kernel, *_ab()) == (tuned, "persistent")


def test_a_cached_config_that_fails_at_launch_falls_back_to_the_heuristic(tmp_path, kernels):
    class Fragile(kernels["MatKernel"]):
        def run(self, a, b, *, cfg, scale=1.0):
            if cfg.block == 13:
                raise RuntimeError("out of shared memory")
            return super().run(a, b, cfg=cfg, scale=scale)

    kernel = Fragile()
    ex = _stored(tmp_path, kernel, kernels, kernels["MatCfg"](block=13))
    with pytest.warns(CacheWarning, match="failed at launch.*out of shared memory"):
        out = ex(kernel, *_ab())
    assert jnp.allclose(out, _ab()[0] @ _ab()[1])
    assert ex.choose(kernel, *_ab()) == (kernels["MatCfg"](block=16), "memory")
    assert len(PersistentCache(tmp_path)) == 0
    # a failure of a config that did not come from disk is the caller's to see
    with pytest.raises(RuntimeError, match="out of shared memory"):
        ex(kernel, *_ab(), cfg=kernels["MatCfg"](block=13))


def test_a_strict_cache_raises_instead_of_warning_and_never_moves_a_file(tmp_path):
    bad = tmp_path / "user.json"
    bad.write_bytes(b"not json")
    with pytest.raises(ValueError, match=r"user\.json is not a config cache file"):
        PersistentCache(bad, strict=True).keys()
    assert [p.name for p in tmp_path.iterdir()] == ["user.json"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError):
        PersistentCache(blocker / "x.json", strict=True).put("k", FwdParams())
