"""The ``ejk`` command: ``info``, ``bench``, ``tune`` and ``cache``.

``main(argv)`` is the console script; it returns the exit status (0 on success,
1 when a benchmark check fails or a cache key is missing, 2 on bad usage), so
tests call it directly.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

DEFAULT_SHAPES = ("1,1024,1024,8,2,64,causal", "4,256,256,8,8,64")
PACKAGES = (
    "jax",
    "jaxlib",
    "triton",
    "jax-triton",
    "ejk-attention",
    "ejk-config",
    "ejk-executor",
    "ejk-kernels-gpu",
    "ejk-kernels-tpu",
    "ejk-sequtils",
)


def _console() -> Any:
    from rich.console import Console

    return Console(file=sys.stdout, width=140, highlight=False)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ejk info


def _info(args: argparse.Namespace) -> int:
    import jax
    from rich.table import Table

    from ._backends import default_order
    from ._tuned import open_cache

    console = _console()
    versions = Table(title="packages")
    versions.add_column("package")
    versions.add_column("version")
    for dist in PACKAGES:
        versions.add_row(dist, _version(dist))
    console.print(versions)

    devices = Table(title=f"devices (default backend: {jax.default_backend()})")
    for col in ("id", "platform", "kind"):
        devices.add_column(col)
    for d in jax.devices():
        devices.add_row(str(d.id), d.platform, d.device_kind)
    console.print(devices)
    try:
        from ejk_config import device_fingerprint

        console.print(f"fingerprint: {device_fingerprint()}")
    except ImportError as err:  # pragma: no cover - ejk-config is a dependency
        console.print(f"fingerprint: unavailable ({err})")
    order = default_order(jax.default_backend())
    backends = Table(title="backends")
    for col in ("implementation", "here"):
        backends.add_column(col)
    for name, where in _backends_here(jax.default_backend()).items():
        backends.add_row(name, where)
    console.print(backends)
    console.print(f"implementation=None tries: {', '.join(order)}")
    console.print(f"config cache: {open_cache(args.cache_dir, fresh=True).path}")
    if args.json:
        payload = {
            "packages": {d: _version(d) for d in PACKAGES},
            "backend": jax.default_backend(),
            "devices": [
                {"id": d.id, "platform": d.platform, "kind": d.device_kind} for d in jax.devices()
            ],
            "default_order": list(order),
            "backends": _backends_here(jax.default_backend()),
        }
        console.print_json(json.dumps(payload))
    return 0


def _backends_here(platform: str) -> dict[str, str]:
    """Each backend and how it runs on ``platform`` (or why it does not)."""

    def importable(module: str) -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return False
        return True

    gpu, tpu = platform in ("gpu", "cuda", "rocm"), platform == "tpu"
    return {
        "xla": "reference_attention (dense, float32)",
        "triton": (
            "not installed (ejk-kernels-gpu)"
            if not importable("ejk_kernels_gpu")
            else "compiled kernels"
            if gpu
            else "Triton interpreter (slow; tests only)"
        ),
        "cudnn": "jax.nn cuDNN flash attention" if gpu else "needs an NVIDIA GPU",
        "pallas": (
            "not installed (ejk-kernels-tpu)"
            if not importable("ejk_kernels_tpu")
            else "compiled kernels"
            if tpu
            else "Pallas TPU interpreter (slow; tests only)"
        ),
    }


# ejk bench / ejk tune


def _cases(args: argparse.Namespace) -> list[Any]:
    from ._bench import parse_case

    return [parse_case(s, args.dtype) for s in (args.shape or DEFAULT_SHAPES)]


def _progress(args: argparse.Namespace, desc: str) -> Any:
    from tqdm import tqdm

    return lambda jobs: tqdm(jobs, desc=desc, disable=args.quiet, file=sys.stderr, leave=False)


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _results_table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in ("case", "implementation", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "max |err|"):
        left = col in ("case", "implementation")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    table.add_column("status", overflow="fold")
    for r in rows:
        status = r["status"]
        if status == "refused":  # the backend's own reason, past the facade's preamble
            status = f"refused: {r['reason'].split(': ', 2)[-1][:80]}"
        table.add_row(
            r["case"],
            r["implementation"],
            _fmt(r.get("fwd_ms")),
            _fmt(r.get("fwd_bwd_ms")),
            _fmt(r.get("fwd_tflops"), ".4f"),
            _fmt(r.get("max_abs_err"), ".2e"),
            status,
        )
    return table


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars of median time per case and implementation (matplotlib's Agg canvas;
    no pyplot, so no global backend is switched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timed = [r for r in rows if r.get("fwd_ms") is not None]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    panels = [("fwd_ms", "forward")] + (
        [("fwd_bwd_ms", "forward + backward")] if any("fwd_bwd_ms" in r for r in timed) else []
    )
    fig = Figure(figsize=(4 + 2.5 * len(cases), 3.5 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    width = 0.8 / max(len(impls), 1)
    for p, (field, name) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, p + 1)
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for c, case in enumerate(cases):
                for r in timed:
                    if r["case"] == case and r["implementation"] == impl and field in r:
                        xs.append(c + (i - (len(impls) - 1) / 2) * width)
                        ys.append(r[field])
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks(range(len(cases)), cases, fontsize=7)
        ax.set_ylabel("median ms")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def _machine() -> dict[str, Any]:
    import jax

    try:
        from ejk_config import device_fingerprint

        fingerprint = device_fingerprint()
    except ImportError:  # pragma: no cover
        fingerprint = None
    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "fingerprint": fingerprint,
        "packages": {d: _version(d) for d in PACKAGES},
    }


def _bench(args: argparse.Namespace) -> int:
    from ._bench import bench_implementations, run_all

    cases = _cases(args)
    impls = tuple(args.impl or bench_implementations())
    rows = run_all(
        cases,
        impls,
        progress=_progress(args, "bench"),
        backward=not args.forward_only,
        warmup=args.warmup,
        iters=args.iters,
    )
    console = _console()
    console.print(
        _results_table(rows, "ejk bench (median of timed calls; checked vs the reference)")
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"machine": _machine(), "results": rows}, indent=2))
    written = [out / "bench.json"]
    if not args.no_plot:
        _plot(rows, out / "bench.png")
        written.append(out / "bench.png")
    console.print("wrote " + ", ".join(str(p) for p in written))
    bad = [r for r in rows if r["status"] == "mismatch"]
    for r in bad:
        console.print(
            f"[red]MISMATCH[/red] {r['implementation']} on {r['case']}: max |err| {r['max_abs_err']:.3e}"
        )
    return 1 if bad else 0


def _tune(args: argparse.Namespace) -> int:
    import jax

    from ejk_config import device_fingerprint

    from ._bench import BASELINE, request_for, run_all
    from ._tuned import BackendChoice, backend_key, open_cache

    cases = _cases(args)
    if args.impl:
        impls = tuple(args.impl)
    else:
        from ._bench import bench_implementations

        impls = tuple(i for i in bench_implementations() if i != BASELINE)
    rows = run_all(
        cases,
        impls,
        progress=_progress(args, "tune"),
        backward=True,
        warmup=args.warmup,
        iters=args.iters,
    )
    cache = open_cache(args.cache_dir, fresh=True)
    fingerprint = device_fingerprint()
    console = _console()
    console.print(_results_table(rows, "ejk tune"))
    for case in cases:
        ok = [r for r in rows if r["case"] == case.label and r["status"] == "ok"]
        if not ok:
            console.print(f"no implementation passed its check on {case.label}; nothing stored")
            continue
        best = min(ok, key=lambda r: r["fwd_bwd_ms"])
        key = backend_key(request_for(case), fingerprint)
        cache.put(key, BackendChoice(best["implementation"], round(best["fwd_bwd_ms"], 4)))
        console.print(
            f"{case.label}: {best['implementation']} ({best['fwd_bwd_ms']:.2f} ms fwd+bwd)"
        )
    if args.kernels or (
        args.kernels is None and jax.default_backend() == "gpu" and "triton" in impls
    ):
        _tune_kernel_configs(args, cases, cache, console)
    console.print(f"stored in {cache.path}")
    return 0


def _tune_kernel_configs(
    args: argparse.Namespace, cases: list[Any], cache: Any, console: Any
) -> None:
    """Autotune the Triton forward and backward configs of each case into ``cache``.

    The invocations are the facade's own (`TritonBackend.invocations`), so the keys
    stored are the ones `flash_attention` looks up.
    """
    from ejk_executor import AutotunePolicy, ConfigSelectorChain
    from ejk_sequtils import validate_attention

    from ._backends import BACKENDS
    from ._bench import inputs_for

    policy = AutotunePolicy(
        on_miss="autotune",
        num_warmup=args.warmup,
        num_iters=args.iters,
        max_candidates=args.max_candidates,
    )
    chooser = ConfigSelectorChain(persistent=cache, policy=policy)
    for case in _progress(args, "tune triton configs")(cases):
        request = validate_attention(*inputs_for(case), causal=case.causal)
        for part, inv in BACKENDS["triton"].invocations(request).items():
            cfg = chooser.tune(inv, policy)
            console.print(f"{case.label}: triton {part} config {cfg}")


# ejk cache


def _describe(cfg: Any) -> str:
    if cfg is None:
        return "(its config class is not installed here)"
    try:
        import msgspec

        return msgspec.json.encode(cfg).decode()
    except (ImportError, TypeError):  # pragma: no cover
        return repr(cfg)


def _cache(args: argparse.Namespace) -> int:
    from ._tuned import cache_types, open_cache

    console = _console()
    cache = open_cache(args.cache_dir, fresh=True)
    if args.action == "list":
        keys = sorted(cache.keys())
        for key in keys:
            cfg = cache.get(key)
            console.print(
                f"{key}  ->  {type(cfg).__name__ if cfg is not None else '?'}", soft_wrap=True
            )
        console.print(f"{len(keys)} entries in {cache.path}")
        return 0
    if args.action == "show":
        if args.key not in cache.keys():
            console.print(f"no entry {args.key!r} in {cache.path}", soft_wrap=True)
            return 1
        console.print(_describe(cache.get(args.key)), soft_wrap=True)
        return 0
    if args.action == "clear":
        n = len(cache)
        if cache.path.exists():
            cache.path.unlink()
        open_cache(args.cache_dir, fresh=True)  # forget what this process had read
        console.print(f"removed {n} entries from {cache.path}")
        return 0
    from ejk_executor import PersistentCache

    if args.action == "export":
        src, dst = cache, PersistentCache(Path(args.path), types=cache_types())
    else:  # import
        if not Path(args.path).exists():
            console.print(f"no such file: {args.path}")
            return 1
        src, dst = PersistentCache(Path(args.path), types=cache_types()), cache
    copied = skipped = 0
    for key in src.keys():
        cfg = src.get(key)
        if cfg is None:
            skipped += 1  # a config class this installation does not have
            continue
        dst.put(key, cfg)
        copied += 1
    console.print(
        f"{args.action}ed {copied} entries into {dst.path}"
        + (f" ({skipped} skipped: unknown config class)" if skipped else "")
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ejk", description="ejk attention kernels: info, benchmarks, tuning, caches."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="devices, fingerprint, backends and versions")
    info.add_argument("--json", action="store_true", help="also print the facts as JSON")
    info.add_argument(
        "--cache-dir", default=None, help="config cache location (default: ejk_executor's)"
    )
    info.set_defaults(run=_info)

    for name, run, help_text in (
        (
            "bench",
            _bench,
            "time implementations, check them against the reference, write JSON + PNG",
        ),
        (
            "tune",
            _tune,
            "time the backends per shape and store the fastest in the persistent cache",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--shape",
            action="append",
            help="B,T,S,N,K,H[,causal] (repeatable); default: " + " ".join(DEFAULT_SHAPES),
        )
        p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
        p.add_argument(
            "--impl",
            action="append",
            help="xla, triton, pallas, cudnn, jax-nn (repeatable); default: the platform's",
        )
        p.add_argument("--iters", type=int, default=5, help="timed calls per measurement (median)")
        p.add_argument("--warmup", type=int, default=1, help="untimed calls after compiling")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(run=run)
        if name == "bench":
            p.add_argument(
                "--out", default="bench-out", help="directory for bench.json and bench.png"
            )
            p.add_argument(
                "--forward-only", action="store_true", help="skip the forward+backward timing"
            )
            p.add_argument("--no-plot", action="store_true", help="write the JSON only")
        else:
            p.add_argument(
                "--cache-dir", default=None, help="config cache location (default: ejk_executor's)"
            )
            p.add_argument(
                "--kernels",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="also autotune the Triton forward config per shape (default: on GPU)",
            )
            p.add_argument(
                "--max-candidates",
                type=int,
                default=None,
                help="configs tried per shape (default: all)",
            )

    cache = sub.add_parser("cache", help="inspect and move the persistent config cache")
    cache.add_argument(
        "--cache-dir", default=None, help="config cache location (default: ejk_executor's)"
    )
    actions = cache.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every key and its config class")
    actions.add_parser("show", help="one entry's config as JSON").add_argument("key")
    actions.add_parser("clear", help="delete the cache file")
    actions.add_parser("export", help="copy every entry into another cache file").add_argument(
        "path"
    )
    actions.add_parser(
        "import", help="merge entries of another cache file into this one"
    ).add_argument("path")
    cache.set_defaults(run=_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ejk`` with ``argv`` (default: the command line); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    for field in ("iters", "warmup"):
        if getattr(args, field, 1) < (1 if field == "iters" else 0):
            parser.error(f"--{field} must be {'>= 1' if field == 'iters' else '>= 0'}")
    try:
        return args.run(args)
    except ValueError as err:  # a bad --shape or similar: a usage error, not a traceback
        print(f"ejk {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
