"""Sessions for the ejk workspace.

The package list comes from the workspace members (``packages/*`` with a
``pyproject.toml``), so adding a package adds its session. Each ``tests-<pkg>``
session installs that package alone, with its own ``test`` dependency group,
from the committed ``uv.lock``: a package that imports something it does not
declare fails its own session.

    uvx nox                      # lint + every package's tests (the default)
    uvx nox -s tests-ejk-config  # one package
    uvx nox -s tests-ejk-config -- -m slow   # extra pytest arguments
    uvx nox -t compat            # the supported-versions matrix (see below)

The default sessions run each package on the lock's jax for Python 3.11 (the newest jax
Python 3.11 gets). The ``compat`` sessions run each package at both ends of what its
bounds allow: ``compat-<pkg>-oldest-jax`` on Python 3.11 with jax (and jaxlib) at the
package's lower bound, and ``compat-<pkg>-newest-jax`` on Python 3.12+ with the newest
jax its bounds admit. A machine without Python 3.12 skips the latter, saying so. The
compat sessions run each test function once, its first parametrized case
(``scripts/nox/first_case.py``): every code path meets both ends of jax's range, while the
full grids run once, in the default sessions. They skip tests marked ``triton_build``
(ahead-of-time Triton builds, whose result depends on Triton, which these sessions keep).

A package whose test group has pytest-xdist runs its tests on every core (at most four
workers); ``-- -n 0`` runs them in one process.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _pyproject(package: str) -> dict:
    """``package``'s pyproject.toml, parsed (``package`` a folder under packages/)."""
    with (ROOT / "packages" / package / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _members() -> list[str]:
    """Names of the workspace members, read from their pyproject files."""
    return [
        _pyproject(p.parent.name)["project"]["name"]
        for p in sorted(ROOT.glob("packages/*/pyproject.toml"))
    ]


PACKAGES = _members()


def _jax_floor(package: str) -> str:
    """The lower bound of ``jax`` in ``package``'s dependencies (``jax>=X`` -> ``X``)."""
    for dep in _pyproject(package)["project"]["dependencies"]:
        found = re.fullmatch(r"jax\s*>=\s*([0-9.]+)(,.*)?", dep.split(";")[0].strip())
        if found:
            return found.group(1)
    raise ValueError(f"{package} declares no 'jax>=X' dependency")


def _python_312_or_newer() -> str | None:
    """A Python >= 3.12 interpreter on this machine (PATH, then pyenv's versions), or None."""
    candidates = [shutil.which(f"python3.{minor}") for minor in (12, 13, 14)]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.1[234]*/bin/python3")))
    for exe in filter(None, candidates):
        probe = subprocess.run(
            [exe, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return exe
    return None


def _sync(session: nox.Session, *args: str) -> None:
    """Install exactly what the lock file says into this session's virtualenv."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


@nox.session(name="lint")
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace; the import layers (import-linter's contracts in
    pyproject.toml); docs/architecture.md's module map against the sources."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # lint-imports reads the sources (it imports nothing): each package's src/ on the path.
    sources = ":".join(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    session.run("lint-imports", env={"PYTHONPATH": sources})
    session.run("python", "scripts/check_architecture.py")


def _requirement(dep: str) -> tuple[str, set[str]]:
    """(normalised name, extras) of a requirement string such as ``"jax[tpu]>=0.6; ..."``."""
    found = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", dep)
    if found is None:
        raise ValueError(f"cannot read the requirement {dep!r}")
    name = re.sub(r"[-_.]+", "-", found.group(1)).lower()
    return name, {e.strip() for e in (found.group(2) or "").split(",") if e.strip()}


def _test_requires(package: str, name: str, extra: str | None = None) -> bool:
    """Whether ``package``'s test group requires ``name`` (with ``extra``, if given)."""
    for dep in _pyproject(package).get("dependency-groups", {}).get("test", []):
        if isinstance(dep, str):
            found, extras = _requirement(dep)
            if found == name and (extra is None or extra in extras):
                return True
    return False


def _has_marker(package: str, marker: str) -> bool:
    """Whether ``package``'s pytest configuration registers ``marker``."""
    options = _pyproject(package).get("tool", {}).get("pytest", {}).get("ini_options", {})
    return any(m.split(":")[0].strip() == marker for m in options.get("markers", []))


def _pytest(session: nox.Session, package: str, *args: str) -> None:
    """pytest in ``package``'s folder: on every core where its test group has pytest-xdist."""
    session.chdir(ROOT / "packages" / package)
    parallel = _test_requires(package, "pytest-xdist")
    workers = ("-n", "auto", "--maxprocesses", "4", "--dist", "worksteal") if parallel else ()
    session.run("python", "-m", "pytest", *workers, *args, *session.posargs)


def _first_case(session: nox.Session, package: str) -> None:
    """pytest with the first-case plugin, without the Triton builds (a compat session's run)."""
    session.env["PYTHONPATH"] = str(ROOT / "scripts" / "nox")
    builds = _has_marker(package, "triton_build")
    marks = "not slow and not triton_build" if builds else "not slow"
    _pytest(session, package, "-p", "first_case", "-m", marks)


def _tests_session(package: str) -> None:
    """Register ``tests-<package>``: that package alone, with its test group."""

    def run_tests(session: nox.Session) -> None:
        _sync(session, "--package", package, "--group", "test")
        _pytest(session, package)

    run_tests.__doc__ = f"{package} alone, with its test group, against the lock file."
    nox.session(name=f"tests-{package}")(run_tests)


def _compat_sessions(package: str) -> None:
    """Register ``compat-<package>-oldest-jax`` and ``compat-<package>-newest-jax``."""

    def oldest(session: nox.Session) -> None:
        floor = _jax_floor(package)
        _sync(session, "--package", package, "--group", "test")
        session.run_install(
            "uv", "pip", "install", "--python", session.virtualenv.location,
            f"jax=={floor}", f"jaxlib=={floor}", external=True,
        )  # fmt: skip
        session.run("python", "-c", "import jax; print('jax', jax.__version__)")
        _first_case(session, package)

    def newest(session: nox.Session) -> None:
        python = _python_312_or_newer()
        if python is None:
            session.skip("no Python >= 3.12 on this machine")
        _sync(session, "--package", package, "--group", "test", "--python", python)
        # A package that tests with libtpu upgrades it with jax: each jax pins its libtpu.
        tpu = _test_requires(package, "jax", extra="tpu")
        jax_req = f"jax{'[tpu]' if tpu else ''}>={_jax_floor(package)}"
        session.run_install(
            "uv", "pip", "install", "--python", session.virtualenv.location, "--upgrade",
            jax_req, "jaxlib", external=True,
        )  # fmt: skip
        session.run("python", "-c", "import jax, sys; print('jax', jax.__version__, sys.version)")
        _first_case(session, package)

    oldest.__doc__ = f"{package} on Python 3.11 with jax at its lower bound."
    newest.__doc__ = f"{package} on Python >= 3.12 with the newest jax its bounds allow."
    nox.session(name=f"compat-{package}-oldest-jax", tags=["compat"], default=False)(oldest)
    nox.session(name=f"compat-{package}-newest-jax", tags=["compat"], default=False)(newest)


for _package in PACKAGES:
    _tests_session(_package)
    _compat_sessions(_package)
