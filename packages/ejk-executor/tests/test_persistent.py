"""PersistentCache: round trips, defaults, damage, unwritable locations, many writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import msgspec
import pytest

from ejk_config import BwdParams, FwdParams
from ejk_executor import CacheWarning, PersistentCache, default_cache_dir


class Unregistered(msgspec.Struct, frozen=True):
    x: int = 1


def test_round_trip_between_instances(tmp_path):
    path = tmp_path / "sub" / "cache.json"
    a = PersistentCache(path)
    assert not path.parent.exists()  # nothing is created before the first put
    a.put("k1", FwdParams(q_blocksize=64, num_warps=4))
    a.put("k2", BwdParams(kv_blocksize=32))
    b = PersistentCache(path)
    assert b.get("k1") == FwdParams(q_blocksize=64, num_warps=4)
    assert b.get("k2") == BwdParams(kv_blocksize=32)
    assert "k1" in b and "nope" not in b and b.get("nope", 7) == 7
    assert len(b) == 2
    # another process's later write is seen on a miss
    a.put("k3", FwdParams(num_stages=2))
    assert b.get("k3") == FwdParams(num_stages=2)
    on_disk = json.loads(path.read_bytes())  # JSON, not pickle
    assert on_disk["format"] == 1 and sorted(on_disk["entries"]) == ["k1", "k2", "k3"]
    assert sorted(b.keys()) == ["k1", "k2", "k3"]
    b.clear()
    assert not path.exists() and len(b) == 0 and b.get("k1") is None
    assert PersistentCache(path).get("k1") is None


def test_a_removal_by_another_instance_is_not_undone_by_its_next_write(tmp_path):
    """A key discarded (or a file cleared) by one process stays gone: another process that
    had read it must not write it back with its own next entry."""
    path = tmp_path / "cache.json"
    a, b = PersistentCache(path), PersistentCache(path)
    a.put("bad", FwdParams(q_blocksize=64))
    a.put("kept", FwdParams(num_warps=8))
    assert b.get("bad") == FwdParams(q_blocksize=64)  # b has read both
    a.discard("bad")
    assert "bad" not in b.keys() and b.get("bad") is None
    b.put("new", FwdParams(num_stages=3))
    assert sorted(PersistentCache(path).keys()) == ["kept", "new"]
    a.clear()
    b.put("after", FwdParams(num_stages=2))
    assert PersistentCache(path).keys() == ["after"]


def test_entries_held_in_memory_return_after_the_file_is_damaged(tmp_path):
    path = tmp_path / "cache.json"
    a = PersistentCache(path)
    a.put("k1", FwdParams(q_blocksize=64))
    path.write_bytes(b"not json")
    with pytest.warns(CacheWarning, match="is damaged"):
        assert a.get("missing") is None
    a.put("k2", FwdParams(num_warps=8))
    assert sorted(PersistentCache(path).keys()) == ["k1", "k2"]


def test_directory_path_and_defaults(tmp_path, monkeypatch):
    cache = PersistentCache(tmp_path / "dir")
    assert cache.path == tmp_path / "dir" / "configs-v1.json"
    monkeypatch.setenv("EJK_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("EJK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "ejk"
    assert PersistentCache().path == tmp_path / "xdg" / "ejk" / "configs-v1.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ejk"
    assert not (tmp_path / "home").exists()


def test_unknown_type_fails_at_put(tmp_path):
    cache = PersistentCache(tmp_path)
    with pytest.raises(TypeError, match=r"cannot store a config of type .*Unregistered"):
        cache.put("k", Unregistered())
    with pytest.raises(TypeError, match="cache keys are str"):
        cache.put(3, FwdParams())
    cache.register(Unregistered)
    cache.put("k", Unregistered(5))
    assert PersistentCache(tmp_path, types=(Unregistered,)).get("k") == Unregistered(5)
    # a process that does not know the class sees a miss, not an error
    assert PersistentCache(tmp_path).get("k") is None


# nested deeper than msgspec's recursion limit: RecursionError, not a DecodeError
_DEEP = b"[" * 100_000 + b"]" * 100_000  # past every Python's recursion limit (3.12 parses 1000)


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b'{"format": 1, "entries": {"k": {"type": "x", "cf',
        b"\x00\xff garbage",
        b'{"format": 99, "entries": {}}',
        b'{"format": 1, "entries": {"k": {"type": "x", "cfg": %s}}}' % _DEEP,
        b'{"format": 1, "entries": {}, "extra": %s}' % _DEEP,
    ],
    ids=["empty", "truncated", "binary", "future-format", "deep-entry", "deep-extra"],
)
def test_damaged_file_is_moved_aside_once(tmp_path, damage):
    good = PersistentCache(tmp_path)
    good.put("k", FwdParams(num_warps=2))
    good.path.write_bytes(damage)
    cache = PersistentCache(tmp_path)
    with pytest.warns(CacheWarning, match="is damaged") as record:
        assert cache.get("k") is None
        assert cache.get("other") is None
    assert len(record) == 1
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == damage
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put("k", FwdParams(num_warps=8))  # the cache goes on, empty then refilled
    assert PersistentCache(tmp_path).get("k") == FwdParams(num_warps=8)


def test_unwritable_location_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = PersistentCache(blocker / "cache")  # its parent is a file: mkdir fails, even as root
    with pytest.warns(CacheWarning, match="memory only") as record:
        cache.put("k", FwdParams(num_warps=2))
        cache.put("k2", FwdParams(num_warps=4))
    assert len(record) == 1
    assert cache.memory_only
    assert cache.get("k") == FwdParams(num_warps=2) and cache.get("k2") == FwdParams(num_warps=4)


def test_threads_share_one_cache(tmp_path):
    cache = PersistentCache(tmp_path)

    def work(t):
        for i in range(20):
            cache.put(f"t{t}-{i}", FwdParams(num_stages=i + 1))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = PersistentCache(tmp_path)
    assert len(fresh) == 80
    assert all(
        fresh.get(f"t{t}-{i}") == FwdParams(num_stages=i + 1) for t in range(4) for i in range(20)
    )


_WORKER = textwrap.dedent(
    """
    import sys, time, pathlib
    from ejk_config import FwdParams
    from ejk_executor._persistent import PersistentCache
    path, worker, n, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4])
    cache = PersistentCache(path)
    while not go.exists():
        time.sleep(0.005)
    for i in range(n):
        cache.put(f"w{worker}-{i}", FwdParams(num_stages=worker * 1000 + i + 1))
    """
)


def test_many_processes_lose_nothing(tmp_path):
    """4 processes write 50 entries each into one file at the same time; all 200 survive."""
    workers, per_worker = 4, 50
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                str(tmp_path / "c.json"),
                str(w),
                str(per_worker),
                str(go),
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        for w in range(workers)
    ]
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    cache = PersistentCache(tmp_path / "c.json")
    assert len(cache) == workers * per_worker
    for w in range(workers):
        for i in range(per_worker):
            assert cache.get(f"w{w}-{i}") == FwdParams(num_stages=w * 1000 + i + 1)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_import_has_no_side_effects(tmp_path):
    """Importing ejk_executor creates no file and changes no jax setting."""
    home = tmp_path / "home"
    home.mkdir()
    code = textwrap.dedent(
        """
        import jax

        def snapshot():
            out = dict(jax.config.values)
            for name in dir(jax.config):
                if name.startswith("jax_"):
                    try:
                        out[name] = repr(getattr(jax.config, name))
                    except AttributeError:
                        pass
            return out

        before = snapshot()
        import ejk_executor
        after = snapshot()
        changed = {k for k in before if before[k] != after[k]}
        assert not changed, changed
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "EJK_CACHE_DIR")}
    env["HOME"] = str(home)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path)
    assert list(home.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
