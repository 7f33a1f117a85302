"""``ejk cache`` and ``ejk bench --out`` under faults: a clear reason and a non-zero exit, never
a traceback, a false success or a renamed user file."""

from __future__ import annotations

import pytest

from ejk_attention.cli import main
from ejk_executor import CacheWarning

_DEEP = b"[" * 1000 + b"]" * 1000


def test_cache_commands_survive_a_deeply_nested_file(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "configs-v1.json").write_bytes(b'{"format": 1, "entries": {}, "x": %s}' % _DEEP)
    with pytest.warns(CacheWarning, match="is damaged"):
        assert main(["cache", "--cache-dir", str(cache_dir), "clear"]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0
