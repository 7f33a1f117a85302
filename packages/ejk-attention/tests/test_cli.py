"""The ``ejk`` command end to end, through ``main([...])`` on tiny shapes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import IMPLEMENTATIONS, flash_attention
from ejk_attention.cli import main

TINY = ["--shape", "1,32,48,4,2,16,causal", "--iters", "1", "--warmup", "0", "--quiet"]


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """A 160-column terminal, so the tests read whole table cells (rich takes the width from
    COLUMNS); test_the_cli_fits_the_terminals_width sets its own."""
    monkeypatch.setenv("COLUMNS", "160")


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure the CLI saves (still saved), to read titles and labels."""
    from matplotlib.figure import Figure

    saved = []
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any case is run: argument errors must come before any work."""
    from ejk_attention import _bench

    def refuse(*args, **kwargs):
        raise AssertionError("a case ran before the arguments were checked")

    monkeypatch.setattr(_bench, "run_all", refuse)


def test_info(capsys):
    assert main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert (
        "ejk-attention" in out and "fingerprint:" in out and "implementation=None tries: xla" in out
    )
    assert (
        f"accelerator: cpu, {jax.device_count()} x cpu" in out
        and "GPU kernel stack (triton, jax-triton):" in out
    )
    payload = json.loads(out[out.index("{") :])
    assert payload["accelerator"]["platform"] == "cpu"
    assert payload["accelerator"]["device_count"] == jax.device_count()
    # The bounds come from the installed ejk packages' metadata: every one requires jax.
    assert {owner for owner, _ in payload["supported"]["jax"]} >= {"ejk-sequtils", "ejk-attention"}


def test_info_warns_about_a_version_outside_the_supported_range(capsys, monkeypatch):
    from ejk_attention import _cli_info

    real = _cli_info.package_version
    monkeypatch.setattr(_cli_info, "package_version", lambda d: "0.1.0" if d == "jax" else real(d))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "warning: jax 0.1.0 is outside ejk-sequtils's supported jax>=" in out


def test_info_lists_each_distinct_bound_once(capsys, monkeypatch):
    """A package's extra repeating a dependency (ejk-kernels-tpu's ``jax[tpu]``) adds no
    second bound of its own; packages declaring the same bound share one entry."""
    from ejk_attention import _cli_info as cli

    assert cli.declared_bounds(
        [("ejk-a", ">=0.10.2"), ("ejk-b", ">=0.6"), ("ejk-c", ">=0.10.2"), ("ejk-c", ">=0.10.2")]
    ) == (">=0.10.2 (ejk-a, ejk-c); >=0.6 (ejk-b)")
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["info"]) == 0
    (jax_row,) = [line for line in capsys.readouterr().out.splitlines() if "│ jax " in line]
    specs = re.findall(r"(?:>=|<=|==|<|>|~=|!=)[0-9][^ ,;]*", jax_row)
    assert specs and len(specs) == len(set(specs)), jax_row
    assert ">=0.6 (ejk-kernels-tpu)" not in jax_row  # the tpu extra's floor is the package's


def test_info_on_a_machine_without_a_gpu_does_not_ask_for_the_gpu_stack(capsys, monkeypatch):
    from ejk_attention import _cli_info

    real = _cli_info.package_version
    monkeypatch.setattr(
        _cli_info, "package_version", lambda d: "not installed" if d == "jax-triton" else real(d)
    )
    assert main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("GPU kernel stack")]
    assert "not needed on cpu" in line and "missing" not in line
    assert "jax-triton" not in " ".join(json.loads(out[out.index("{") :])["warnings"])


def test_supported_ranges_read_every_ejk_package_and_its_extras(monkeypatch):
    from ejk_attention import _cli_info as cli

    fake = [
        ("ejk-a", ["jax>=0.6,<0.7", "numpy>=1"], []),
        (
            "ejk-b",
            ["triton==3.6.0; extra == 'cuda'", "jaxlib<1; sys_platform == 'nowhere'"],
            ["cuda"],
        ),
    ]
    monkeypatch.setattr(cli, "_ejk_distributions", lambda: fake)
    ranges = cli.supported_ranges()
    assert ranges == {
        "jax": [("ejk-a", "<0.7,>=0.6")],
        "jaxlib": [],  # its marker does not hold here
        "triton": [("ejk-b", "==3.6.0")],
        "jax-triton": [],
    }
    versions = {
        "jax": "0.10.2",
        "jaxlib": "0.10.2",
        "triton": "3.6.0",
        "jax-triton": "not installed",
    }
    assert cli.version_warnings(versions, ranges) == [
        "jax 0.10.2 is outside ejk-a's supported jax<0.7,>=0.6"
    ]


def test_bench_writes_json_and_png_and_reports_refusals(tmp_path, capsys, figures):
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
    assert rows["xla"]["fwd_bwd_tflops"] > 0
    assert rows["cudnn"]["status"] == "refused" and "NVIDIA GPU" in rows["cudnn"]["reason"]
    assert data["machine"]["backend"] == "cpu"
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The plot: TFLOP/s of the backends timed, the machine and versions in the title.
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["TFLOP/s", "TFLOP/s"]
    title = fig._suptitle.get_text()
    assert f"cpu x{jax.device_count()} (cpu)" in title and f"jax {jax.__version__}" in title
    assert "ejk-attention" in title
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["xla", "jax-nn"]  # cudnn refused: no empty bar in the legend


@pytest.mark.parametrize("columns", [80, 200])
def test_the_cli_fits_the_terminals_width(columns, tmp_path, capsys, monkeypatch):
    """rich reads the width from the terminal (COLUMNS here): in 80 columns every line of
    `ejk info` and `ejk bench` fits, and no figure is cut ("…"): a table folds instead."""
    from ejk_attention import cli

    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli._console().width == columns
    assert main(["info"]) == 0
    out_dir = tmp_path / "out"
    argv = ["bench", *TINY, "--impl", "xla", "--impl", "cudnn", "--out", str(out_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Tables fit; a plain line (a path, a message) is left whole for the terminal to wrap.
    tables = [line for line in out.splitlines() if line[:1] in set("┏┃┡│└ ")]
    assert tables and max(len(line) for line in tables) <= columns
    assert "…" not in out
    (xla, _) = json.loads((out_dir / "bench.json").read_text())["results"]
    for value in (f"{xla['fwd_ms']:.2f}", f"{xla['fwd_bwd_ms']:.2f}", f"{xla['max_abs_err']:.2e}"):
        assert value in out
    assert "needs an NVIDIA" in out  # the refusal's reason, folded but whole
    # Too narrow for every column: the TFLOP/s one goes (bench.json keeps it), and says so.
    narrow = columns < 120
    assert ("fwd TFLOP/s: in bench.json" in out) == narrow
    assert (f"{xla['fwd_tflops']:.4f}" in out) == (not narrow)


def test_bench_help_describes_the_command_and_its_defaults(capsys):
    assert main(["bench", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Time each implementation on each shape" in help_text  # a description, not only usage
    assert "(default: bench-out)" in help_text


def test_bench_plot_shows_time_and_error_beside_tflops(tmp_path, figures):
    out_dir = tmp_path / "out"
    assert main(["bench", *TINY, "--impl", "xla", "--impl", "jax-nn", "--out", str(out_dir)]) == 0
    rows = json.loads((out_dir / "bench.json").read_text())["results"]
    (fig,) = figures
    labels = [t.get_text() for ax in fig.axes for t in ax.texts]
    for r in rows:  # each bar says its time in ms and its max |err|
        assert f"{r['fwd_ms']:.2f} ms" in " ".join(labels)
        assert f"{r['fwd_bwd_ms']:.2f} ms" in " ".join(labels)
        assert f"err {r['max_abs_err']:.1e}" in " ".join(labels)


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


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "--shape", "1,2,3"],
            "argument --shape: shape must be 'B,T,S,N,K,H[,causal]' with positive ints, "
            "got '1,2,3'",
        ),
        (["bench", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["tune", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["tune", "--max-candidates", "0"], "argument --max-candidates: must be >= 1, got 0"),
        (
            ["bench", "--impl", "xla", "--impl", "foo"],
            "argument --impl: unknown implementation 'foo' "
            "(choose from xla, triton, pallas, cudnn, jax-nn)",
        ),
        (
            ["tune", "--impl", "foo"],
            "argument --impl: unknown implementation 'foo' (choose from xla, triton, pallas, cudnn)",
        ),
        (
            ["tune", "--impl", "jax-nn"],
            "argument --impl: 'jax-nn' is jax.nn's attention, timed by 'ejk bench' as a "
            "baseline; flash_attention cannot use it, so 'ejk tune' does not store it "
            "(choose from xla, triton, pallas, cudnn)",
        ),
        (
            ["bench", "--dtype", "float64"],
            "argument --dtype: invalid choice: 'float64' "
            "(choose from 'float32', 'float16', 'bfloat16')",
        ),
    ],
)
def test_argument_errors_are_the_subcommands_usage_errors_before_any_work(argv, message, capsys):
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ejk {argv[0]} ")  # the subcommand's usage, not ejk's
    assert err.splitlines()[-1] == f"ejk {argv[0]}: error: {message}"


@pytest.mark.usefixtures("no_work")
def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("")
    assert main(["bench", *TINY, "--out", str(file)]) == 2
    assert f"--out {file} is a file, not a directory" in capsys.readouterr().err
    assert main(["tune", *TINY, "--cache-dir", str(file)]) == 2
    assert f"--cache-dir {file} is a file, not a directory" in capsys.readouterr().err


def test_help_errors_tune_and_the_facade_name_the_same_implementations(capsys):
    from ejk_attention._bench import BENCH_IMPLEMENTATIONS

    assert IMPLEMENTATIONS == ("xla", "triton", "pallas", "cudnn")
    assert BENCH_IMPLEMENTATIONS == (*IMPLEMENTATIONS, "jax-nn")
    for command, names in (("bench", BENCH_IMPLEMENTATIONS), ("tune", IMPLEMENTATIONS)):
        assert main([command, "--help"]) == 0
        help_text = " ".join(capsys.readouterr().out.split())
        assert f"--impl IMPL {', '.join(names)} (repeatable)" in help_text


def test_bench_that_benchmarks_nothing_fails_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(["bench", *TINY, "--impl", "cudnn", "--out", str(out_dir)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "ejk bench: error: nothing was benchmarked, every case was refused "
        "(cudnn: cuDNN needs an NVIDIA GPU, this call runs on cpu); wrote nothing"
    ]
    assert "wrote" not in captured.out
    assert not out_dir.exists()  # no bench.json, no empty plot


def test_tune_that_stores_nothing_fails_and_says_so(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    assert main(["tune", *TINY, "--impl", "cudnn", "--cache-dir", str(cache_dir)]) == 1
    captured = capsys.readouterr()
    assert "nothing stored, no implementation passed (cudnn cuDNN needs an NVIDIA GPU" in (
        captured.out
    )
    assert "stored in" not in captured.out and "stored 0" not in captured.out
    assert captured.err.strip() == (
        f"ejk tune: error: nothing stored in {cache_dir / 'configs-v1.json'}: "
        "no implementation passed on any case"
    )
    assert not (cache_dir / "configs-v1.json").exists()


def _run(path: Path, device_kind: str, fwd_ms: dict[str, float]) -> Path:
    """A bench.json as `ejk bench` writes it: one case, ``fwd_ms`` per implementation."""
    case = {"batch": 1, "q_len": 128, "kv_len": 128, "heads": 4, "kv_heads": 4, "head_dim": 64}
    case |= {"causal": False, "dtype": "float32"}
    label = "B1 T128 S128 N4 K4 H64 float32"
    rows = [
        {"case": label, **case, "implementation": impl, "status": "ok", "fwd_ms": ms}
        for impl, ms in fwd_ms.items()
    ]
    machine = {"backend": "gpu", "device_kind": device_kind, "device_count": 1}
    machine["packages"] = {"jax": "0.7.0", "jaxlib": "0.7.0", "ejk-attention": "0.1.0"}
    path.write_text(json.dumps({"machine": machine, "results": rows}))
    return path


def test_bench_compare_prints_ratios_and_draws_both_runs(tmp_path, capsys, figures):
    a = _run(tmp_path / "a.json", "NVIDIA H100", {"xla": 2.0, "triton": 1.0})
    b = _run(tmp_path / "b.json", "NVIDIA H200", {"triton": 0.5, "cudnn": 0.4})
    out_dir = tmp_path / "cmp"
    assert main(["bench", "--compare", str(a), str(b), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    (triton,) = [line for line in out.splitlines() if "triton" in line]
    assert "2.00" in triton  # B's triton took half A's time
    assert "xla" not in out.split("B is faster")[1] and "cudnn" not in out.split("faster")[1]
    assert (out_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    title = fig._suptitle.get_text()
    assert "A: NVIDIA H100 x1 (gpu) | jax 0.7.0" in title and "B: NVIDIA H200 x1 (gpu)" in title
    assert fig.axes[0].get_ylabel() == "TFLOP/s"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["xla (A)", "triton (A)", "triton (B)", "cudnn (B)"]


@pytest.mark.usefixtures("no_work")
def test_bench_compare_refuses_files_it_cannot_compare(tmp_path, capsys):
    a = _run(tmp_path / "a.json", "H100", {"xla": 2.0})
    other = _run(tmp_path / "other.json", "H100", {"triton": 1.0})
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = [
        ([str(a), str(tmp_path / "missing.json")], f"no such file: {tmp_path / 'missing.json'}"),
        ([str(a), str(tmp_path / "bad.json")], "bad.json is not JSON"),
        ([str(a), str(tmp_path / "list.json")], "list.json is not an 'ejk bench' result"),
        ([str(a), str(other)], "share no timed (case, implementation): nothing to compare"),
    ]
    for files, message in cases:
        assert main(["bench", "--compare", *files, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: ejk bench ") and message in err.splitlines()[-1]
    assert main(["bench", "--compare", str(a), str(a), "--shape", "1,2,3,4,4,8"]) == 2
    assert "--compare draws two existing runs; --shape do not apply" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_tune_then_cache_commands(tmp_path, capsys, monkeypatch):
    cache_dir = tmp_path / "cache"
    assert (
        main(["tune", *TINY, "--impl", "xla", "--impl", "cudnn", "--cache-dir", str(cache_dir)])
        == 0
    )
    out = capsys.readouterr().out
    assert "B1 T32 S48 N4 K2 H16 float32 causal: xla" in out
    assert f"stored 1 entries in {cache_dir / 'configs-v1.json'}" in out

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
    assert "triton backward config FlashBackwardConfig(" in out
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "FlashConfig" in listing and "BackendChoice" in listing
    assert "FlashBackwardConfig" in listing
    # The facade's executor finds the tuned config under the key it builds itself.
    case = parse_case("1,16,16,2,1,16")
    request = validate_attention(*inputs_for(case), causal=case.causal)
    # Both the forward and the backward config: the facade's triton backend runs with them.
    types = {"forward": "FlashConfig", "backward": "FlashBackwardConfig"}
    for part, inv in BACKENDS["triton"].invocations(request).items():
        chosen = kernel_executor().chooser.lookup(inv)
        assert chosen is not None and chosen.source == "persistent", inv.kernel.name
        assert type(chosen.cfg).__name__ == types[part]


PAGED = ["tune", "--op", "paged", "--iters", "1", "--warmup", "0", "--quiet"]
SEVEN_PAGES = ["--op", "paged", "--shape", "2,1,100,4,2,16", "--page-size", "16"]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page-size", "16"], "--page-size apply to --op paged only"),
        (["--ragged", "--num-pages", "4"], "--num-pages, --ragged apply to --op paged only"),
        (
            ["--op", "paged", "--impl", "xla"],
            "--impl xla: paged_attention's xla backend has no config to tune",
        ),
        (
            ["--op", "paged", "--no-kernels"],
            "--no-kernels applies to --op flash only: --op paged tunes the --impl backends' configs",
        ),
        (["--op", "paged", "--page-size", "0"], "argument --page-size: must be >= 1, got 0"),
        (
            ["--op", "paged", "--shape", "1,1,64,4,2,16,causal"],
            "--shape 1,1,64,4,2,16,causal: paged attention is always causal (bottom-right): "
            "drop ',causal' from 'B1 T1 S64 N4 K2 H16 float32 causal'",
        ),
        (
            ["--op", "paged", "--shape", "1,8,4,4,2,16"],
            "--shape 1,8,4,4,2,16: S=4 keys per sequence include its T=8 new tokens: need T <= S",
        ),
        (
            [*SEVEN_PAGES, "--pages-per-seq", "6"],
            "--shape 2,1,100,4,2,16: S=100 keys take 7 pages of 16 per sequence, more than "
            "--pages-per-seq 6",
        ),
        (
            [*SEVEN_PAGES, "--num-pages", "13"],
            "--shape 2,1,100,4,2,16: B=2 sequences of S=100 keys take 14 pages of 16, more "
            "than --num-pages 13",
        ),
        (
            ["--op", "paged", "--shape", "1,1,8192,32,8,128", "--shape", "1,1,64,4,2"],
            "argument --shape: shape must be 'B,T,S,N,K,H[,causal]' with positive ints, "
            "got '1,1,64,4,2'",
        ),
    ],
)
def test_tune_paged_argument_errors_come_before_any_work(argv, message, capsys, monkeypatch):
    from ejk_attention import _tuned

    def refuse(*args, **kwargs):
        raise AssertionError("a paged case was built before the arguments were checked")

    monkeypatch.setattr(_tuned, "paged_request", refuse)
    assert main(["tune", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ejk tune ")
    assert err.splitlines()[-1] == f"ejk tune: error: {message}"


@pytest.mark.usefixtures("no_work")
def test_tune_paged_names_the_paged_backends_for_an_impl_paged_attention_lacks(capsys):
    from ejk_attention._backends import paged_backends

    paged = paged_backends()
    assert "cudnn" not in paged
    assert main(["tune", "--op", "paged", "--impl", "cudnn", "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ejk tune: error: --impl cudnn: paged_attention has no cudnn backend "
        f"(it has {', '.join(paged)})"
    )


def test_tune_paged_on_cpu_tunes_nothing_by_default_and_says_so(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    assert main([*PAGED, "--cache-dir", str(cache_dir)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        "ejk tune: error: nothing tuned: on cpu paged_attention runs xla, which has no config "
        "(--impl triton times the Triton paged kernel in Triton's interpreter, for "
        "implementation='triton')"
    )
    assert captured.out == ""
    assert not cache_dir.exists()


def test_tune_paged_stores_nothing_for_a_shape_the_kernel_refuses(tmp_path, capsys):
    cache_dir = tmp_path / "cache"
    shape = ["--shape", "1,1,16,2,1,512", "--page-size", "16"]  # head_dim 512 > 256
    assert main([*PAGED, *shape, "--impl", "triton", "--cache-dir", str(cache_dir)]) == 1
    captured = capsys.readouterr()
    assert "B1 T1 S16 N2 K1 H512 float32 pages 1x16 (1/seq): triton: nothing stored (the " in (
        captured.out
    )
    assert "head_dim <= 256" in captured.out
    assert captured.err.strip() == (
        f"ejk tune: error: nothing stored in {cache_dir / 'configs-v1.json'}: triton served no case"
    )
    assert not (cache_dir / "configs-v1.json").exists()


@pytest.mark.parametrize("ragged", [False, True], ids=["paged", "ragged"])
def test_tune_paged_stores_the_config_the_facade_then_runs_with(ragged, capsys, monkeypatch):
    """A user's jitted decode step over a `PagedKVCache` of the tuned layout runs the
    Triton paged kernel with the stored config: the CLI's key is the facade's."""
    import ejk_kernels_gpu
    from ejk_attention import PagedKVCache, paged_attention, ragged_paged_attention
    from ejk_attention._tuned import open_cache

    form = ["--ragged"] if ragged else []
    layout = ["--shape", "2,1,100,4,2,16", "--page-size", "16", "--num-pages", "20"]
    args = [*PAGED, *layout, *form, "--impl", "triton", "--max-candidates", "2"]  # default cache
    before = set(open_cache(fresh=True).keys())
    assert main(args) == 0
    out = capsys.readouterr().out
    label = "B2 T1 S100 N4 K2 H16 float32 pages 20x16 (7/seq)" + (" ragged" if ragged else "")
    assert f"{label}: triton forward config PagedConfig(" in out and "stored 1 entries" in out
    (key,) = set(open_cache(fresh=True).keys()) - before
    assert key.startswith("ejk_kernels_gpu.paged_attention/")
    stored = open_cache(fresh=True).get(key)
    assert type(stored).__name__ == "PagedConfig"
    # The tuned config is not the heuristic's, so a facade that missed the key would differ.
    heuristic = out.split("(heuristic: ")[1].split(")")[0] + ")"
    assert f"triton forward config {stored} (heuristic: " in out and heuristic != str(stored)
    assert main(["cache", "show", key]) == 0  # the cache commands decode it
    assert '"block_m":' in capsys.readouterr().out

    # The user's side: a cache created with the same layout, a decode step under jit.
    cache = PagedKVCache.create(
        num_pages=20, page_size=16, kv_heads=2, head_dim=16, max_seqs=2, pages_per_seq=7
    )
    table = jnp.arange(14, dtype=jnp.int32).reshape(2, 7)
    kv_lens = jnp.array([100, 37], jnp.int32)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    used = []
    real = ejk_kernels_gpu.paged_attention_request

    def recording(request, config=None):
        used.append(config)
        return real(request, config=config)

    monkeypatch.setattr(ejk_kernels_gpu, "paged_attention_request", recording)
    if ragged:
        step = jax.jit(
            lambda q, k, v, t, lens: ragged_paged_attention(
                q.reshape(2, 4, 16),
                k,
                v,
                t,
                lens,
                jnp.arange(3, dtype=jnp.int32),
                implementation="triton",
            )
        )
    else:
        step = jax.jit(
            lambda q, k, v, t, lens: paged_attention(q, k, v, t, lens, implementation="triton")
        )
    step(q, cache.k_pages, cache.v_pages, table, kv_lens)
    assert used == [stored]


def test_tune_help_describes_the_paged_op(capsys):
    assert main(["tune", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--op {flash,paged}" in help_text
    assert "--op paged: the PagedKVCache's layout" in help_text
    for option in ("--page-size", "--pages-per-seq", "--num-pages", "--ragged"):
        assert option in help_text


def test_tune_paged_on_gpu_tunes_the_triton_config_by_default(tmp_path, capsys, monkeypatch):
    """The default backends are those implementation=None runs with a config: on GPU, triton
    (the platform is faked; the kernel runs in Triton's interpreter on these CPU arrays)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cache_dir = tmp_path / "cache"
    args = [*PAGED, "--shape", "1,1,32,2,1,16", "--page-size", "16", "--max-candidates", "1"]
    assert main([*args, "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "B1 T1 S32 N2 K1 H16 float32 pages 2x16 (2/seq): triton forward config Paged" in out
    assert "xla" not in out  # it has no config: nothing to say about it
    assert f"stored 1 entries in {cache_dir / 'configs-v1.json'}" in out
