"""``ejk info``: the accelerator, the installed versions against the ranges the ejk
packages declare, the GPU kernel stack, the backends here and the config cache."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from typing import Any

from ejk_config import device_fingerprint

from ._backends import default_order, triton_missing
from ._tuned import open_cache
from ._xla import XLA_BACKEND

__all__ = [
    "PACKAGES",
    "declared_bounds",
    "info",
    "package_version",
    "supported_ranges",
    "version_warnings",
]

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
# The dependencies whose supported range `ejk info` checks (bounds read from the
# installed ejk packages' metadata, never written here).
RANGED = ("jax", "jaxlib", "triton", "jax-triton")
# What a GPU run of the triton backend imports.
GPU_STACK = ("triton", "jax-triton")


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _ejk_distributions() -> list[tuple[str, list[str], list[str]]]:
    """``(name, Requires-Dist lines, Provides-Extra names)`` of every installed ejk package."""
    found: dict[str, tuple[str, list[str], list[str]]] = {}
    for dist in importlib.metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if name.startswith("ejk-") and name not in found:  # the first on sys.path wins
            extras = dist.metadata.get_all("Provides-Extra") or []
            found[name] = (name, list(dist.requires or []), extras)
    return [found[k] for k in sorted(found)]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def supported_ranges() -> dict[str, list[tuple[str, str]]]:
    """Each of `RANGED` with the ``(ejk package, specifier)`` bounds installed ejk packages declare.

    A requirement behind a marker counts when the marker holds here for the package
    itself or one of its extras (``triton ... ; extra == "cuda"`` bounds triton).
    """
    from packaging.requirements import Requirement

    ranges: dict[str, list[tuple[str, str]]] = {dep: [] for dep in RANGED}
    for name, requires, extras in _ejk_distributions():
        for text in requires:
            req = Requirement(text)
            dep = _canonical(req.name)
            if dep not in ranges or not str(req.specifier):
                continue
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": extra}) for extra in ("", *extras)
            ):
                continue
            ranges[dep].append((name, str(req.specifier)))
    return ranges


def declared_bounds(bounds: list[tuple[str, str]]) -> str:
    """``(ejk package, specifier)`` bounds as text, each distinct specifier once with the
    packages declaring it: ``">=0.10.2 (ejk-attention, ejk-kernels-tpu); >=0.6 (ejk-config)"``."""
    owners: dict[str, list[str]] = {}
    for owner, spec in bounds:
        if owner not in owners.setdefault(spec, []):
            owners[spec].append(owner)
    return "; ".join(f"{spec} ({', '.join(names)})" for spec, names in owners.items())


def version_warnings(
    versions: dict[str, str], ranges: dict[str, list[tuple[str, str]]]
) -> list[str]:
    """One line per installed dependency outside a bound an ejk package declares for it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    lines = []
    for dep, bounds in ranges.items():
        installed = versions.get(dep, "not installed")
        if installed == "not installed":
            continue
        for owner, spec in bounds:
            try:
                inside = SpecifierSet(spec).contains(Version(installed), prereleases=True)
            except InvalidVersion:
                inside = False
            if not inside:
                lines.append(f"{dep} {installed} is outside {owner}'s supported {dep}{spec}")
    return lines


def _accelerator() -> dict[str, Any]:
    """The platform, device kind and count jax found, and its accelerator plugins' versions."""
    import jax

    devices = jax.devices()
    plugins = {}
    for dist in importlib.metadata.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if re.fullmatch(r"jax-(cuda\d+|rocm\d*)-(plugin|pjrt)|libtpu(-nightly)?", name):
            plugins[name] = dist.version
    return {
        "platform": jax.default_backend(),
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),
        "plugins": dict(sorted(plugins.items())),
    }


def _gpu_stack(versions: dict[str, str], platform: str) -> tuple[bool, str]:
    """Whether the GPU kernel stack is complete, and a line saying so. Without a GPU it is
    not needed: what is installed is listed, nothing is called missing."""
    missing = [d for d in GPU_STACK if versions.get(d, "not installed") == "not installed"]
    present = ", ".join(f"{d} {versions[d]}" for d in GPU_STACK if d not in missing)
    if platform != "gpu":
        return not missing, f"not needed on {platform} (installed: {present or 'neither'})"
    if not missing:
        return True, f"present ({present})"
    return False, (
        f"missing {', '.join(missing)}: a GPU run of the triton backend needs "
        f"{' and '.join(GPU_STACK)} (the cuda extra of ejk-attention installs them)"
    )


def info(args: argparse.Namespace, console: Any) -> int:
    """``ejk info``: print the facts about this machine and installation (exit status 0)."""
    import jax
    from rich.table import Table

    accel = _accelerator()
    plugins = ", ".join(f"{k} {v}" for k, v in accel["plugins"].items()) or "none"
    console.print(
        f"accelerator: {accel['platform']}, {accel['device_count']} x {accel['device_kind']}"
        f" (plugins: {plugins})"
    )
    versions = {d: package_version(d) for d in PACKAGES}
    ranges = supported_ranges()
    table = Table(title="packages")
    for col in ("package", "version", "supported (declared by the ejk packages)"):
        table.add_column(col, overflow="fold")
    for dist in PACKAGES:
        bounds = ranges.get(dist)
        declared = (
            declared_bounds(bounds) if bounds else "no bound declared" if bounds is not None else ""
        )
        table.add_row(dist, versions[dist], declared)
    console.print(table)
    warnings = version_warnings(versions, ranges)
    stack_ok, stack = _gpu_stack(versions, accel["platform"])
    console.print(f"GPU kernel stack ({', '.join(GPU_STACK)}): {stack}")
    if not stack_ok and accel["platform"] == "gpu":
        warnings.append(f"this machine has a GPU but the GPU kernel stack is {stack}")
    for line in warnings:
        console.print(f"[yellow]warning:[/yellow] {line}", soft_wrap=True)

    devices = Table(title=f"devices (default backend: {jax.default_backend()})")
    for col in ("id", "platform", "kind"):
        devices.add_column(col)
    for d in jax.devices():
        devices.add_row(str(d.id), d.platform, d.device_kind)
    console.print(devices)
    console.print(f"fingerprint: {device_fingerprint()}")
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
            "accelerator": accel,
            "packages": versions,
            "supported": {dep: [list(b) for b in bounds] for dep, bounds in ranges.items()},
            "warnings": warnings,
            "gpu_stack": {"present": stack_ok, "detail": stack},
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

    gpu, tpu = platform in ("gpu", "cuda", "rocm"), platform == "tpu"
    return {
        "xla": XLA_BACKEND,
        "triton": (
            "Triton not installed: the cuda extra of ejk-attention brings it"
            if triton_missing()
            else "compiled kernels"
            if gpu
            else "Triton interpreter (slow; tests only)"
        ),
        "cudnn": "jax.nn cuDNN flash attention" if gpu else "needs an NVIDIA GPU",
        "pallas": ("compiled kernels" if tpu else "Pallas TPU interpreter (slow; tests only)"),
    }
