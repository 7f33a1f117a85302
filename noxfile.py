"""Sessions for the ejk workspace.

The package list comes from the workspace members (``packages/*`` with a
``pyproject.toml``), so adding a package adds its session. Each ``tests-<pkg>``
session installs that package alone, with its own ``test`` dependency group,
from the committed ``uv.lock``: a package that imports something it does not
declare fails its own session.

    uvx nox                      # lint + every package's tests (the default)
    uvx nox -s tests-ejk-config  # one package
    uvx nox -s tests-ejk-config -- -m slow   # extra pytest arguments
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _members() -> list[str]:
    """Names of the workspace members, read from their pyproject files."""
    names = []
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        with pyproject.open("rb") as f:
            names.append(tomllib.load(f)["project"]["name"])
    return names


PACKAGES = _members()


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
    """ruff over the whole workspace."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _tests_session(package: str) -> None:
    """Register ``tests-<package>``: that package alone, with its test group."""

    def run_tests(session: nox.Session) -> None:
        _sync(session, "--package", package, "--group", "test")
        session.chdir(ROOT / "packages" / package)
        session.run("python", "-m", "pytest", *session.posargs)

    run_tests.__doc__ = f"{package} alone, with its test group, against the lock file."
    nox.session(name=f"tests-{package}")(run_tests)


for _package in PACKAGES:
    _tests_session(_package)
