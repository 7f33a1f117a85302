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
    against the dense reference computed in the same jitted step."""
    _load("paged_decode").main(num_steps=2, prompt_lens=(3, 6))
    assert "2 decode steps match the dense reference" in capsys.readouterr().out


def _compiles(run) -> int:
    """How many XLA compilations ``run()`` makes."""
    import jax

    count = 0

    def listen(event: str, duration: float, **kwargs) -> None:
        nonlocal count
        count += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count


def test_paged_decode_compiles_its_decode_step_once(capsys):
    """Decoding and its reference check run under jit: more steps, no more compilations
    (fresh prompt lengths each run, so no run reuses another's compilations)."""
    module = _load("paged_decode")
    two = _compiles(lambda: module.main(num_steps=2, prompt_lens=(3, 6)))
    six = _compiles(lambda: module.main(num_steps=6, prompt_lens=(4, 7)))
    # The prefill, the decode step, the release and a few of jax's own: not one per step.
    assert six <= two and six <= 10, f"{two} compilations for 2 steps, {six} for 6"
    assert "6 decode steps match the dense reference" in capsys.readouterr().out


def test_paged_decode_fp8_against_bf16(capsys):
    """The example's FP8 cache beside a bfloat16 one: outputs within its tolerance."""
    module = _load("paged_decode")
    worst = module.fp8_against_bf16(num_steps=2, prompt_lens=(3, 6))
    assert 0.0 < worst <= module.FP8_TOLERANCE
    assert "FP8 cache: 2 decode steps within" in capsys.readouterr().out
