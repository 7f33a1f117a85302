"""The examples under the repository's ``examples/`` run as written (small settings)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _load(name: str):
    path = EXAMPLES / f"{name}.py"
    if not path.exists():  # an installed package without the repository
        pytest.skip(f"{path} is not here")
    spec = importlib.util.spec_from_file_location(f"ejk_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paged_decode(capsys):
    """Prefill (ragged) and two jitted decode steps through PagedKVCache, each checked
    against the dense reference inside the example."""
    _load("paged_decode").main(num_steps=2, prompt_lens=(3, 6))
    assert "2 decode steps match the dense reference" in capsys.readouterr().out


def test_paged_decode_fp8_against_bf16(capsys):
    """The example's FP8 cache beside a bfloat16 one: outputs within its tolerance."""
    module = _load("paged_decode")
    worst = module.fp8_against_bf16(num_steps=2, prompt_lens=(3, 6))
    assert 0.0 < worst <= module.FP8_TOLERANCE
    assert "FP8 cache: 2 decode steps within" in capsys.readouterr().out
