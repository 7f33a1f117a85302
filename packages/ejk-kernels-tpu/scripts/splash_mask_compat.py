"""Runs JAX's own splash attention mask tests against `ejk_kernels_tpu` and prints the count.

JAX's test file is not part of ejk (it is JAX's code): take it from the JAX tag that
matches the locked jax, then pass its path::

    git -C <jax checkout> show jax-v0.10.2:tests/pallas/tpu_splash_attention_mask_test.py > /tmp/t.py
    uv pip install --target /tmp/absl-site absl-py       # jax's test utilities import absl
    PYTHONPATH=/tmp/absl-site ../../.venv/bin/python scripts/splash_mask_compat.py /tmp/t.py

The test file is run unmodified: the splash mask modules it imports are replaced by
`splash_names` (ejk objects under splash's names, nothing else). Prints each failing test
with the first line of its error, then ``passed N of M``; ``--json PATH`` also writes them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import splash_names


def _install_names() -> None:
    """Puts `splash_names`' modules where the test imports splash's mask modules from."""
    import jax.experimental.pallas.ops.tpu.splash_attention as package

    for module in (splash_names.mask_lib, splash_names.mask_info_lib):
        sys.modules[module.__name__] = module
        setattr(package, module.__name__.rsplit(".", 1)[1], module)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("splash_mask_test_under_ejk", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="tpu_splash_attention_mask_test.py")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    _install_names()
    from jax._src import test_util as jtu

    module = _load(args.test_file)
    suite = jtu.JaxTestLoader().loadTestsFromModule(module)
    result = unittest.TestResult()
    suite.run(result)
    failed: dict[str, str] = {}
    for test, trace in result.failures + result.errors:
        name = test.id().split(".", 1)[1]
        # A subTest failure is reported per subtest; one failing subtest fails its test.
        name = name.split(" ", 1)[0]
        failed.setdefault(name, _first_line(trace))
    total = result.testsRun
    for name, reason in sorted(failed.items()):
        print(f"FAIL {name}: {reason}")
    print(f"passed {total - len(failed)} of {total} (skipped {len(result.skipped)})")
    if args.json:
        args.json.write_text(json.dumps({"total": total, "failed": failed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
