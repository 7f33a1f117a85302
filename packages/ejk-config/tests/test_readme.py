"""The README's example runs and gives what its comments and API table state."""

import pathlib
import re

import jax
import pytest

from ejk_config import BwdParams, FwdParams, device_fingerprint, short_hash


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    # "q/kv blocks 64/32, warps and stages kept"
    assert namespace["bwd"] == BwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4, num_stages=2)
    # "override wins where it is set": every other field is the base's.
    assert namespace["tuned"] == FwdParams(
        q_blocksize=128, kv_blocksize=64, num_warps=4, num_stages=3
    )
    # The printed fingerprint: platform, device kind, platform version, device count.
    printed = capsys.readouterr().out.strip()
    assert printed == device_fingerprint()
    platform, kind, _version, count = printed.split("|")
    devices = jax.devices()
    assert (platform, kind, count) == (
        devices[0].platform,
        devices[0].device_kind,
        f"n={len(devices)}",
    )


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("num_warps", 3, ValueError), ("q_blocksize", 0, ValueError), ("num_stages", 2.0, TypeError)],
)
def test_readme_validation_names_the_field(field, value, error):
    """API table: "values validated (positive ints, warps a power of two) with errors naming
    the field"."""
    with pytest.raises(error, match=field):
        FwdParams(**{field: value})


def test_readme_short_hash_length():
    """API table: ``short_hash(obj, length=16)``, a digest of ``stable_json``."""
    assert len(short_hash({"a": 1})) == 16
    assert len(short_hash({"a": 1}, length=8)) == 8
    assert short_hash({"a": 1}).startswith(short_hash({"a": 1}, length=8))
