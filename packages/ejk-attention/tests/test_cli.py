"""The ``ejk`` command end to end, through ``main([...])`` on tiny shapes."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import flash_attention
from ejk_attention.cli import main

TINY = ["--shape", "1,32,48,4,2,16,causal", "--iters", "1", "--warmup", "0", "--quiet"]


def test_info(capsys):
    assert main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert (
        "ejk-attention" in out and "fingerprint:" in out and "implementation=None tries: xla" in out
    )


def test_bench_writes_json_and_png_and_reports_refusals(tmp_path, capsys):
    out_dir = tmp_path / "bench-out"
    code = main(
        [
            "bench",
            *TINY,
            "--impl",
            "xla",
            "--impl",
            "cudnn",
            "--impl",
            "jax-nn",
            "--out",
            str(out_dir),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "B1 T32 S48 N4 K2 H16 float32 causal" in table and "refused" in table
    data = json.loads((out_dir / "bench.json").read_text())
    rows = {r["implementation"]: r for r in data["results"]}
    assert rows["xla"]["status"] == "ok" and rows["jax-nn"]["status"] == "ok"
    assert rows["xla"]["fwd_ms"] > 0 and rows["xla"]["fwd_bwd_ms"] > 0
    assert rows["cudnn"]["status"] == "refused" and "NVIDIA GPU" in rows["cudnn"]["reason"]
    assert data["machine"]["backend"] == "cpu"
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_defaults_to_bench_out_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *TINY, "--forward-only", "--no-plot"]) == 0
    rows = json.loads((tmp_path / "bench-out" / "bench.json").read_text())["results"]
    assert [r["implementation"] for r in rows] == ["xla", "jax-nn"]
    assert "fwd_bwd_ms" not in rows[0]


def test_bench_fails_on_a_mismatch(tmp_path, monkeypatch):
    from ejk_attention import _backends

    class Wrong(_backends.XlaBackend):
        def run(self, request, config, bwd_config):
            return request.q * 2

    monkeypatch.setitem(_backends.BACKENDS, "xla", Wrong())
    assert main(["bench", *TINY, "--impl", "xla", "--forward-only", "--out", str(tmp_path)]) == 1


def test_bad_shape_is_a_usage_error(capsys):
    assert main(["bench", "--shape", "1,2,3", "--quiet"]) == 2
    assert "shape must be 'B,T,S,N,K,H[,causal]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--iters", "0"])


def test_tune_then_cache_commands(tmp_path, capsys, monkeypatch):
    cache_dir = tmp_path / "cache"
    assert (
        main(["tune", *TINY, "--impl", "xla", "--impl", "cudnn", "--cache-dir", str(cache_dir)])
        == 0
    )
    assert "B1 T32 S48 N4 K2 H16 float32 causal: xla" in capsys.readouterr().out

    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0
    listing = capsys.readouterr().out
    assert "1 entries" in listing and "BackendChoice" in listing
    key = next(line.split("  ->  ")[0] for line in listing.splitlines() if "  ->  " in line)
    assert "B1T32S48N4K2H16Hv16|causal" in key

    assert main(["cache", "--cache-dir", str(cache_dir), "show", key]) == 0
    assert '"implementation":"xla"' in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(cache_dir), "show", "nope"]) == 1

    exported = tmp_path / "exported.json"
    assert main(["cache", "--cache-dir", str(cache_dir), "export", str(exported)]) == 0
    assert key in json.loads(exported.read_text())["entries"]
    assert main(["cache", "--cache-dir", str(cache_dir), "clear"]) == 0
    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0
    assert "0 entries" in capsys.readouterr().out.splitlines()[-1]
    assert main(["cache", "--cache-dir", str(cache_dir), "import", str(exported)]) == 0
    assert main(["cache", "--cache-dir", str(cache_dir), "list"]) == 0
    assert "1 entries" in capsys.readouterr().out


def test_implementation_none_tries_the_tuned_backend_first(pallas_calls):
    from ejk_attention._bench import parse_case, request_for
    from ejk_attention._tuned import BackendChoice, backend_key, open_cache
    from ejk_config import device_fingerprint

    case = parse_case("1,32,48,4,2,16,causal")
    open_cache().put(
        backend_key(request_for(case), device_fingerprint()), BackendChoice("pallas", 1.0)
    )
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 32, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 48, 2, 16)), jnp.float32)
    flash_attention(q, k, k, causal=True)
    assert pallas_calls == [(1, 32, 4, 16)]
    flash_attention(q, k, k)  # another key (not causal): the platform order, xla
    assert len(pallas_calls) == 1


def test_tune_kernel_configs_through_the_executor(capsys):
    from ejk_attention._backends import BACKENDS, kernel_executor
    from ejk_attention._bench import inputs_for, parse_case
    from ejk_sequtils import validate_attention

    args = ["tune", "--shape", "1,16,16,2,1,16", "--iters", "1", "--warmup", "0", "--quiet"]
    args += ["--impl", "xla", "--kernels", "--max-candidates", "2"]  # the default cache dir
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "triton forward config FlashConfig(" in out
    assert "triton backward config FlashConfig(" in out
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "FlashConfig" in listing and "BackendChoice" in listing
    # The facade's executor finds the tuned config under the key it builds itself.
    case = parse_case("1,16,16,2,1,16")
    request = validate_attention(*inputs_for(case), causal=case.causal)
    # Both the forward and the backward config: the facade's triton backend runs with them.
    for inv in BACKENDS["triton"].invocations(request).values():
        chosen = kernel_executor().chooser.lookup(inv)
        assert chosen is not None and chosen.source == "persistent", inv.kernel.name
        assert type(chosen.cfg).__name__ == "FlashConfig"
