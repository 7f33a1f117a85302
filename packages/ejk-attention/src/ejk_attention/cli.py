"""The ``ejk`` command: ``info``, ``bench``, ``tune`` and ``cache``.

``main(argv)`` is the console script; it returns the exit status, so tests call it
directly: 0 on success; 1 when a benchmark check fails, nothing was benchmarked or
stored, or a cache key is missing; 2 on bad usage (argparse's error of the subcommand,
raised before any work starts).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ejk_config import device_fingerprint
from ejk_executor import AutotunePolicy, ConfigSelectorChain, PersistentCache, write_atomic
from ejk_sequtils import validate_attention

from ._backends import (
    BACKENDS,
    IMPLEMENTATIONS,
    Backend,
    default_order,
    paged_backends,
    platform_of,
)
from ._bench import (
    BASELINE,
    BENCH_IMPLEMENTATIONS,
    bench_implementations,
    inputs_for,
    parse_case,
    request_for,
    run_all,
    tflops,
)
from ._cli_info import PACKAGES, info, package_version
from ._tuned import BackendChoice, backend_key, cache_types, open_cache, paged_case, paged_request

__all__ = ["main"]

DEFAULT_SHAPES = ("1,1024,1024,8,2,64,causal", "4,256,256,8,8,64")
# `ejk tune --op paged`: decode steps (T = 1) of one long and of many shorter sequences.
DEFAULT_PAGED_SHAPES = ("1,1,8192,32,8,128", "32,1,4096,32,8,128")
DEFAULT_PAGE_SIZE = 64
# The options of `ejk tune --op paged` only (the cache's layout).
PAGED_OPTIONS = ("page_size", "pages_per_seq", "num_pages", "ragged")


def _console() -> Any:
    """A rich console on stdout as wide as the terminal (``COLUMNS``, else 80 when piped).

    Tables fold their cells to fit that width; a line of text is never broken by rich
    (soft wrap), so a path or a cache key printed alone stays whole for copying.
    """
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def _info(args: argparse.Namespace) -> int:
    return info(args, _console())


# ejk bench / ejk tune


def _cases(args: argparse.Namespace) -> list[Any]:
    return [parse_case(s, args.dtype) for s in (args.shape or DEFAULT_SHAPES)]


def _progress(args: argparse.Namespace, desc: str) -> Any:
    from tqdm import tqdm

    return lambda jobs: tqdm(jobs, desc=desc, disable=args.quiet, file=sys.stderr, leave=False)


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _reason(row: dict[str, Any]) -> str:
    """A refused row's reason: the backend's own words, past the facade's preamble."""
    return row["reason"].split(": ", 2)[-1][:80]


def _fail(command: str, reason: str) -> int:
    """Say in one line why the command did nothing; the exit status 1."""
    print(f"ejk {command}: error: {reason}", file=sys.stderr)
    return 1


# The results table's columns, and those dropped first when it is wider than the terminal
# (bench.json and the plot keep them).
_RESULT_COLUMNS = ("case", "implementation", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "max |err|")
_DROPPABLE = ("fwd TFLOP/s",)


def _results_table(rows: list[dict[str, Any]], title: str, console: Any) -> Any:
    """The rows as a table that fits ``console``: `_DROPPABLE` columns go first, then the
    case and status cells fold over lines; a figure is never cut."""
    from rich.measure import Measurement

    table = _table_of(rows, title, _RESULT_COLUMNS)
    unbounded = console.options.update(width=10_000)  # the table's natural width, not clamped
    if Measurement.get(console, unbounded, table).maximum > console.width:
        kept = tuple(c for c in _RESULT_COLUMNS if c not in _DROPPABLE)
        table = _table_of(rows, title, kept)
        table.caption = f"{', '.join(_DROPPABLE)}: in bench.json (the terminal is too narrow)"
    return table


def _table_of(rows: list[dict[str, Any]], title: str, columns: tuple[str, ...]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        left = col in ("case", "implementation")
        # Names and figures stay on one line; the case and the status fold where needed.
        table.add_column(
            col,
            justify="left" if left else "right",
            no_wrap=col != "case",
            overflow="fold",
        )
    table.add_column("status", overflow="fold")
    for r in rows:
        status = f"refused: {_reason(r)}" if r["status"] == "refused" else r["status"]
        cells = {
            "case": r["case"],
            "implementation": r["implementation"],
            "fwd ms": _fmt(r.get("fwd_ms")),
            "fwd+bwd ms": _fmt(r.get("fwd_bwd_ms")),
            "fwd TFLOP/s": _fmt(r.get("fwd_tflops"), ".4f"),
            "max |err|": _fmt(r.get("max_abs_err"), ".2e"),
        }
        table.add_row(*(cells[c] for c in columns), status)
    return table


_PANELS = (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))


def _bar_label(row: dict[str, Any], field: str) -> str:
    """What a bar says besides its height: its time, and in the forward panel the row's
    max |err| against the reference (the check covers the forward output only)."""
    text = f"{row[field]:.2f} ms"
    if field == "fwd_ms" and row.get("max_abs_err") is not None:
        text += f"\nerr {row['max_abs_err']:.1e}"
    return text


def _plot(runs: list[tuple[str, list[dict[str, Any]]]], title: str, path: Path | BinaryIO) -> None:
    """Grouped bars of TFLOP/s per case and implementation, one bar per run beside the other;
    each bar is labelled with its time in ms and (forward) its max error.

    Drawn on matplotlib's Agg canvas (no pyplot, so no global backend is switched);
    an implementation keeps its colour across runs, the second run is hatched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    every = [r for _, rows in runs for r in rows]
    cases = list(dict.fromkeys(r["case"] for r in every))
    impls = list(dict.fromkeys(r["implementation"] for r in every))
    panels = [(f, name) for f, name in _PANELS if any(r.get(f) is not None for r in every)]
    series = [
        (i, impl, k, label) for i, impl in enumerate(impls) for k, (label, _) in enumerate(runs)
    ]
    fig = Figure(figsize=(4 + 2.5 * len(cases), 1 + 3.5 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    width = 0.8 / max(len(series), 1)
    for p, (field, name) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, p + 1)
        for j, (i, impl, k, label) in enumerate(series):
            xs, ys, texts = [], [], []
            for c, case in enumerate(cases):
                for r in runs[k][1]:
                    value = tflops(r, field)
                    if r["case"] == case and r["implementation"] == impl and value is not None:
                        xs.append(c + (j - (len(series) - 1) / 2) * width)
                        ys.append(value)
                        texts.append(_bar_label(r, field))
            if not ys:  # nothing timed for this series here: no empty legend entry
                continue
            name_k = impl if len(runs) == 1 else f"{impl} ({label})"
            bars = ax.bar(xs, ys, width, label=name_k, color=f"C{i}", hatch="//" if k else None)
            ax.bar_label(bars, texts, fontsize=6, padding=2)
        ax.margins(y=0.25)  # room above the tallest bar for its label
        ax.set_xticks(range(len(cases)), cases, fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=100, format="png")


def _machine() -> dict[str, Any]:
    import jax

    fingerprint = device_fingerprint()
    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "fingerprint": fingerprint,
        "packages": {d: package_version(d) for d in PACKAGES},
    }


def _machine_title(machine: dict[str, Any]) -> str:
    """``device kind x count (backend) | jax ... jaxlib ... triton ... | ejk-attention ...``."""
    packages = machine.get("packages", {})
    versions = " ".join(
        f"{d} {packages[d]}"
        for d in ("jax", "jaxlib", "triton", "jax-triton", "ejk-attention")
        if packages.get(d, "not installed") != "not installed"
    )
    return (
        f"{machine.get('device_kind', '?')} x{machine.get('device_count', '?')} "
        f"({machine.get('backend', '?')}) | {versions}"
    )


def _bench(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args)

    out = Path(args.out)
    unwritable = _unwritable(out)
    if unwritable:  # found before the run, not after it
        return _fail("bench", f"--out {out}: {unwritable}; nothing was run")
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
        _results_table(rows, "ejk bench (median of timed calls; checked vs the reference)", console)
    )
    if not any(r["status"] != "refused" for r in rows):
        reasons = "; ".join(sorted({f"{r['implementation']}: {_reason(r)}" for r in rows}))
        return _fail(
            "bench", f"nothing was benchmarked, every case was refused ({reasons}); wrote nothing"
        )
    machine = _machine()
    report = json.dumps({"machine": machine, "results": rows}, indent=2).encode()
    files = [("bench.json", lambda f: f.write(report))]
    if not args.no_plot:
        files.append(("bench.png", lambda f: _plot([("", rows)], _machine_title(machine), f)))
    status = _write_all(out, files)
    if status is not None:
        return status
    console.print("wrote " + ", ".join(str(out / name) for name, _ in files))
    bad = [r for r in rows if r["status"] == "mismatch"]
    for r in bad:
        console.print(
            f"[red]MISMATCH[/red] {r['implementation']} on {r['case']}: max |err| {r['max_abs_err']:.3e}"
        )
    return 1 if bad else 0


def _unwritable(out: Path) -> str | None:
    """None if folder ``out`` can hold new files (or be made where it is missing), else why
    not; it creates nothing, so a run that writes nothing leaves no folder behind."""
    import tempfile

    where = out
    while not where.exists() and where.parent != where:
        where = where.parent
    if not where.is_dir():
        return f"cannot write there ({where} is not a folder)"
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        return f"cannot write there ({err.strerror or err})"
    return None


def _write_all(out: Path, files: list[tuple[str, Any]]) -> int | None:
    """Write each ``(name, write(file))`` into ``out`` atomically, in order; None when all
    were written, else say which files are complete and return the exit status (1, or 130
    when interrupted). A previous run's file this run did not replace is removed, so no
    file of one run is left beside another run's."""
    done: list[str] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, write in files:
            write_atomic(out / name, write)
            done.append(name)
    except (OSError, KeyboardInterrupt) as err:
        missing = [name for name, _ in files if name not in done]
        for name in missing:
            (out / name).unlink(missing_ok=True)
        interrupted = isinstance(err, KeyboardInterrupt)
        _fail(
            "bench",
            f"complete in {out}: {', '.join(done) or 'nothing'}; not written "
            f"({'interrupted' if interrupted else err}): {', '.join(missing)}",
        )
        return 130 if interrupted else 1
    return None


def _load_run(path: str) -> dict[str, Any]:
    """A ``bench.json`` written by ``ejk bench``; ValueError (one line) when it is not one."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        run = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    if not (
        isinstance(run, dict)
        and isinstance(run.get("machine"), dict)
        and isinstance(run.get("results"), list)
        and all(
            isinstance(r, dict) and {"case", "implementation"} <= r.keys() for r in run["results"]
        )
    ):
        raise ValueError(f"{path} is not an 'ejk bench' result (a machine and a list of results)")
    return run


def _timed(run: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["case"], r["implementation"]): r for r in run["results"] if r.get("fwd_ms")}


def _compare_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Both runs of ``--compare``, checked: ValueError (one line) when they cannot be compared."""
    runs = [_load_run(p) for p in paths]
    if not _timed(runs[0]).keys() & _timed(runs[1]).keys():
        raise ValueError(
            f"{paths[0]} and {paths[1]} share no timed (case, implementation): nothing to compare"
        )
    return runs


def _ratio_table(runs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    a, b = (_timed(r) for r in runs)
    table = Table(title="TFLOP/s of B over A (> 1: B is faster)")
    for col in ("case", "implementation"):
        table.add_column(col, overflow="fold")
    for _, name in _PANELS:
        for col in (f"A {name}", f"B {name}", "B/A"):
            table.add_column(col, justify="right", overflow="fold")
    for key in [k for k in a if k in b]:
        cells = []
        for field, _ in _PANELS:
            ta, tb = tflops(a[key], field), tflops(b[key], field)
            ratio = tb / ta if ta and tb else None
            cells += [_fmt(ta, ".4f"), _fmt(tb, ".4f"), _fmt(ratio, ".2f")]
        table.add_row(*key, *cells)
    return table


def _compare(args: argparse.Namespace) -> int:
    runs = _compare_runs(args.compare)  # checked before this runs (main); cheap to read again
    console = _console()
    for tag, path, run in zip("AB", args.compare, runs, strict=True):
        console.print(f"{tag}: {path}: {_machine_title(run['machine'])}", soft_wrap=True)
    console.print(_ratio_table(runs))
    if args.no_plot:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = "\n".join(
        f"{tag}: {_machine_title(run['machine'])}" for tag, run in zip("AB", runs, strict=True)
    )
    _plot(
        [(tag, run["results"]) for tag, run in zip("AB", runs, strict=True)],
        title,
        out / "compare.png",
    )
    console.print(f"wrote {out / 'compare.png'}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    if args.op == "paged":
        return _tune_paged(args)
    import jax

    cases = _cases(args)
    # Only flash_attention's backends: a stored choice is one implementation=None runs.
    impls = tuple(args.impl or default_order(jax.default_backend()))
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
    console.print(_results_table(rows, "ejk tune", console))
    keys = []
    for case in cases:
        mine = [r for r in rows if r["case"] == case.label]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            why = ", ".join(
                f"{r['implementation']} {_reason(r) if r['status'] == 'refused' else r['status']}"
                for r in mine
            )
            console.print(f"{case.label}: nothing stored, no implementation passed ({why})")
            continue
        best = min(ok, key=lambda r: r["fwd_bwd_ms"])
        key = backend_key(request_for(case), fingerprint)
        cache.put(key, BackendChoice(best["implementation"], round(best["fwd_bwd_ms"], 4)))
        keys.append(key)
        console.print(
            f"{case.label}: {best['implementation']} ({best['fwd_bwd_ms']:.2f} ms fwd+bwd)"
        )
    if args.kernels or (
        args.kernels is None and jax.default_backend() == "gpu" and "triton" in impls
    ):
        keys += _tune_kernel_configs(args, cases, cache, console)
    return _stored(args, cache, keys, console, "no implementation passed on any case")


def _stored(args: argparse.Namespace, cache: Any, keys: list[str], console: Any, why: str) -> int:
    """The end of ``ejk tune``: exit 1 with ``why`` when nothing was stored, or when an
    entry is not in the cache file; else say how many entries were stored, exit 0."""
    if not keys:
        return _fail("tune", f"nothing stored in {cache.path}: {why}")
    # The cache turns memory-only when it cannot write: believe the file, not the object.
    missing = set(keys) - set(open_cache(args.cache_dir, fresh=True).keys())
    if missing:
        return _fail("tune", f"{len(missing)} of {len(keys)} entries did not reach {cache.path}")
    console.print(f"stored {len(keys)} entries in {cache.path}")
    return 0


def _tune_kernel_configs(
    args: argparse.Namespace, cases: list[Any], cache: Any, console: Any
) -> list[str]:
    """Autotune the Triton forward and backward configs of each case into ``cache``.

    The invocations are the facade's own (`TritonBackend.invocations`), so the keys
    stored are the ones `flash_attention` looks up. Returns those keys.
    """

    chooser = _autotuner(args, cache)
    keys = []
    for case in _progress(args, "tune triton configs")(cases):
        request = validate_attention(*inputs_for(case), causal=case.causal)
        for part, inv in BACKENDS["triton"].invocations(request).items():
            cfg = chooser.tune(inv)
            keys.append(inv.call_key)
            console.print(f"{case.label}: triton {part} config {cfg}")
    return keys


def _autotuner(args: argparse.Namespace, cache: Any) -> Any:
    """An `ejk_executor.ConfigSelectorChain` that times ``--max-candidates`` configs
    (``--warmup``, ``--iters``) and stores the fastest in ``cache``."""
    policy = AutotunePolicy(
        on_miss="autotune",
        num_warmup=args.warmup,
        num_iters=args.iters,
        max_candidates=args.max_candidates,
    )
    return ConfigSelectorChain(persistent=cache, policy=policy)


def _tune_paged(args: argparse.Namespace) -> int:
    """``ejk tune --op paged``: autotune the configs of paged attention's backends per case.

    The backends are ``--impl``'s, else those ``implementation=None`` runs on this
    platform that have a config (triton on GPU). `paged_attention` reads no backend
    choice, so only configs are stored, under the keys of the invocations the facade's
    backends build for the case. Off GPU ``--impl triton`` times the Triton paged
    kernel in Triton's interpreter, as ``--impl triton`` does for flash.
    """
    import jax

    platform = jax.default_backend()
    paged = paged_backends()
    runs = [n for n in default_order(platform) if n in paged]
    names = args.impl or [n for n in runs if _has_configs(paged[n])]
    if not names:
        return _fail(
            "tune",
            f"nothing tuned: on {platform} paged_attention runs {', '.join(runs)}, which has "
            "no config (--impl triton times the Triton paged kernel in Triton's interpreter, "
            "for implementation='triton')",
        )
    cache = open_cache(args.cache_dir, fresh=True)
    chooser = _autotuner(args, cache)
    console = _console()
    keys = []
    for case in _progress(args, "tune paged configs")(args.paged_cases):
        request = paged_request(case)
        for name in names:
            backend = paged[name]
            reason = backend.supported(request, platform_of(request))
            invocations = {} if reason else backend.invocations(request)
            if not invocations:
                reason = reason or "its kernel package has no executor kernel to tune"
                console.print(f"{case.label}: {name}: nothing stored ({reason})", soft_wrap=True)
            for part, inv in invocations.items():
                cfg = chooser.tune(inv)
                keys.append(inv.call_key)
                heuristic = inv.kernel.heuristic_cfg(inv)
                console.print(
                    f"{case.label}: {name} {part} config {cfg} (heuristic: {heuristic})",
                    soft_wrap=True,
                )
    return _stored(args, cache, keys, console, f"{', '.join(names)} served no case")


def _has_configs(backend: Any) -> bool:
    """Whether ``backend`` runs with executor configs (it builds invocations)."""
    return type(backend).invocations is not Backend.invocations


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
        n = cache.clear()  # under the writers' file lock
        if cache.memory_only:  # the file could not be read or removed: the warning says why
            return _fail("cache clear", f"{cache.path} was left as it is (see the warning)")
        open_cache(args.cache_dir, fresh=True)  # forget what this process had read
        console.print(f"removed {n} entries from {cache.path}")
        return 0
    if args.action == "import" and not Path(args.path).exists():
        return _fail("cache import", f"no such file: {args.path}")
    given = Path(args.path)
    if given.exists() and not given.is_dir() and given.suffix != ".json":
        # PersistentCache would take it for a folder holding configs-v1.json
        return _fail(f"cache {args.action}", f"{args.path} is not named *.json (nor a folder)")
    try:
        copied, skipped, dst = _copy_entries(args, cache, cache_types())
    except (OSError, ValueError) as err:  # the user's file is reported, never moved or renamed
        return _fail(f"cache {args.action}", str(err))
    console.print(
        f"{args.action}ed {copied} entries into {dst.path}"
        + (f" ({skipped} skipped: unknown config class)" if skipped else "")
    )
    return 0


def _copy_entries(args: argparse.Namespace, cache: Any, types: tuple[type, ...]) -> Any:
    """``ejk cache export``/``import``: copy every entry, ``(copied, skipped, destination)``.

    Every file involved is opened strict: one that cannot be read or written raises
    (OSError, ValueError) instead of warning, and a damaged one is never moved aside.
    """
    given = PersistentCache(Path(args.path), types=types, strict=True)
    if args.action == "export":
        src, dst = cache, given
    else:
        src, dst = given, PersistentCache(cache.path, types=types, strict=True)
    copied = skipped = 0
    for key in src.keys():
        cfg = src.get(key)
        if cfg is None:
            skipped += 1  # a config class this installation does not have
            continue
        dst.put(key, cfg)
        copied += 1
    return copied, skipped, dst


def _at_least(low: int) -> Any:
    """An argparse ``type``: an int >= ``low`` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _shape(text: str) -> str:
    """An argparse ``type``: a ``--shape`` that `parse_case` takes (kept as text for ``--dtype``)."""
    try:
        parse_case(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _implementation(accepted: tuple[str, ...]) -> Any:
    """An argparse ``type``: one of ``accepted``; the error lists exactly those."""

    def parse(text: str) -> str:
        if text in accepted:
            return text
        choose = f"choose from {', '.join(accepted)}"
        if text == BASELINE:  # only tune refuses it: flash_attention cannot run it
            raise argparse.ArgumentTypeError(
                f"{BASELINE!r} is jax.nn's attention, timed by 'ejk bench' as a baseline; "
                f"flash_attention cannot use it, so 'ejk tune' does not store it ({choose})"
            )
        raise argparse.ArgumentTypeError(f"unknown implementation {text!r} ({choose})")

    return parse


def _not_a_file(path: str | None, option: str) -> str | None:
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        return f"{option} {path} is a file, not a directory"
    return None


def _check(args: argparse.Namespace) -> None:
    """What argparse cannot check alone, before any work: argparse's error of the subcommand."""
    error = args.command_parser.error
    problem = _not_a_file(getattr(args, "cache_dir", None), "--cache-dir")
    if args.command == "bench":
        problem = problem or _not_a_file(args.out, "--out")
        if args.compare:
            given = _given(args, ("shape", "impl", "dtype", "iters", "warmup", "forward_only"))
            if given:
                problem = (
                    f"--compare draws two existing runs; {', '.join(given)} do not apply to it"
                )
            else:
                try:
                    _compare_runs(args.compare)
                except ValueError as err:
                    problem = str(err)
    if args.command == "tune":
        problem = problem or _tune_problem(args)
    if problem:
        error(problem)
    for name, default in (("dtype", "float32"), ("iters", 5), ("warmup", 1)):
        if getattr(args, name, default) is None:
            setattr(args, name, default)


def _given(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The options among ``names`` given on the command line, as ``--option``."""
    return [
        f"--{name.replace('_', '-')}" for name in names if getattr(args, name) not in (None, False)
    ]


def _tune_problem(args: argparse.Namespace) -> str | None:
    """Why the ``ejk tune`` options do not fit together, or None."""
    if args.op == "flash":
        given = _given(args, PAGED_OPTIONS)
        return f"{', '.join(given)} apply to --op paged only" if given else None

    paged = paged_backends()
    if args.kernels is not None:
        given = "--kernels" if args.kernels else "--no-kernels"
        return f"{given} applies to --op flash only: --op paged tunes the --impl backends' configs"
    for name in args.impl or ():
        if name not in paged:
            return (
                f"--impl {name}: paged_attention has no {name} backend (it has {', '.join(paged)})"
            )
        if not _has_configs(paged[name]):
            return f"--impl {name}: paged_attention's {name} backend has no config to tune"
    try:
        args.paged_cases = _paged_cases(args)
    except ValueError as err:
        return str(err)
    return None


def _paged_cases(args: argparse.Namespace) -> list[Any]:
    """``--op paged``'s `PagedCase` per ``--shape``; ValueError naming a shape no cache holds."""
    cases = []
    for text in args.shape or DEFAULT_PAGED_SHAPES:
        try:
            cases.append(
                paged_case(
                    parse_case(text, args.dtype or "float32"),
                    page_size=args.page_size or DEFAULT_PAGE_SIZE,
                    pages_per_seq=args.pages_per_seq,
                    num_pages=args.num_pages,
                    ragged=args.ragged,
                )
            )
        except ValueError as err:
            raise ValueError(f"--shape {text}: {err}") from None
    return cases


_DESCRIPTIONS = {
    "bench": "Time each implementation on each shape (the median of --iters jitted calls, "
    "forward and forward+backward), check its output against the float32 reference, print a "
    "table and write bench.json and bench.png (TFLOP/s per case; each bar says its time in ms "
    "and its max error) into --out. Exit 1 when an output does not match. --compare draws two "
    "earlier runs instead.",
    "tune": "Time flash_attention's backends per shape and store the fastest in the "
    "persistent config cache, which implementation=None then reads; --op paged autotunes "
    "paged attention's kernel configs instead.",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ejk", description="ejk attention kernels: info, benchmarks, tuning, caches."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info", help="accelerator, versions against the supported range, backends, cache"
    )
    info.add_argument("--json", action="store_true", help="also print the facts as JSON")
    info.add_argument(
        "--cache-dir", default=None, help="config cache location (default: ejk_executor's)"
    )
    info.set_defaults(run=_info, command_parser=info)

    for name, run, accepted, help_text in (
        (
            "bench",
            _bench,
            BENCH_IMPLEMENTATIONS,
            "time implementations, check them against the reference, write JSON + a TFLOP/s plot",
        ),
        (
            "tune",
            _tune,
            IMPLEMENTATIONS,
            "time the backends per shape and store the fastest in the persistent cache "
            "(--op paged: paged attention's autotuned kernel configs)",
        ),
    ):
        p = sub.add_parser(name, help=help_text, description=_DESCRIPTIONS[name])
        paged_shapes = (
            "; --op paged: B,T,S,N,K,H, S each sequence's keys with its T new ones, "
            "default: " + " ".join(DEFAULT_PAGED_SHAPES)
        )
        p.add_argument(
            "--shape",
            action="append",
            type=_shape,
            help="B,T,S,N,K,H[,causal] (repeatable); default: "
            + " ".join(DEFAULT_SHAPES)
            + (paged_shapes if name == "tune" else ""),
        )
        p.add_argument(
            "--dtype",
            default=None,
            choices=("float32", "float16", "bfloat16"),
            help="default: float32",
        )
        p.add_argument(
            "--impl",
            action="append",
            type=_implementation(accepted),
            metavar="IMPL",
            help=f"{', '.join(accepted)} (repeatable); default: the platform's"
            + (f", then {BASELINE}" if BASELINE in accepted else "")
            + ("; --op paged: the backends whose configs are tuned" if name == "tune" else ""),
        )
        p.add_argument(
            "--iters",
            type=_at_least(1),
            default=None,
            help="timed calls per measurement (median; default 5)",
        )
        p.add_argument(
            "--warmup",
            type=_at_least(0),
            default=None,
            help="untimed calls after compiling (default 1)",
        )
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(run=run, command_parser=p)
        if name == "bench":
            p.add_argument(
                "--out",
                default="bench-out",
                help="directory for bench.json and bench.png (or compare.png) "
                "(default: %(default)s)",
            )
            p.add_argument(
                "--forward-only", action="store_true", help="skip the forward+backward timing"
            )
            p.add_argument("--no-plot", action="store_true", help="write the JSON only")
            p.add_argument(
                "--compare",
                nargs=2,
                metavar=("A.json", "B.json"),
                help="no timing: print B's TFLOP/s over A's per case and draw both (compare.png)",
            )
        else:
            p.add_argument(
                "--cache-dir", default=None, help="config cache location (default: ejk_executor's)"
            )
            p.add_argument(
                "--op",
                choices=("flash", "paged"),
                default="flash",
                help="flash: flash_attention's backend and Triton configs; paged: the "
                "configs of paged_attention's backends (--impl; default: the platform's with "
                "a config, triton on GPU), or ragged_paged_attention's with --ragged, on a "
                "cache of the layout given (default: flash)",
            )
            p.add_argument(
                "--kernels",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="also autotune the Triton forward and backward configs per shape "
                "(default: on GPU; --op flash only)",
            )
            p.add_argument(
                "--max-candidates",
                type=_at_least(1),
                default=None,
                help="configs tried per shape (default: all)",
            )
            paged = p.add_argument_group(
                "--op paged: the PagedKVCache's layout (the config is stored for this layout)"
            )
            for option, text in (
                ("--page-size", f"tokens per page (default {DEFAULT_PAGE_SIZE})"),
                ("--pages-per-seq", "pages of a page-table row (default: the fewest for S keys)"),
                ("--num-pages", "pages in the pool (default: B x pages per sequence)"),
            ):
                paged.add_argument(option, type=_at_least(1), default=None, help=text)
            paged.add_argument(
                "--ragged",
                action="store_true",
                help="ragged_paged_attention's call: the B x T queries packed, with cu_q_lens",
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
    cache.set_defaults(run=_cache, command_parser=cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ejk`` with ``argv`` (default: the command line); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
        _check(args)
    except SystemExit as done:  # a usage error (2) or --help (0), already printed
        return done.code if isinstance(done.code, int) else 2
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
