"""Developer sessions: tests per backend and Python, lint, typing, docs, benchmarks."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typing"]
nox.options.reuse_existing_virtualenvs = True

PYTHONS = ["3.11", "3.12", "3.13"]
BACKENDS = ["asyncio", "uvloop", "trio"]


@nox.session(python=PYTHONS)
@nox.parametrize("backend", BACKENDS)
def tests(session: nox.Session, backend: str) -> None:
    """Run the test suite with the async tests on one anyio backend."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs, env={"CACHEBROKER_TEST_BACKENDS": backend})


@nox.session
def nightly(session: nox.Session) -> None:
    """The whole suite with the heavy Hypothesis profile."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs, env={"HYPOTHESIS_PROFILE": "nightly"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")


@nox.session
def typing(session: nox.Session) -> None:
    session.install("-e", ".[test]", "mypy")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Check that every example in the docs runs (the docs are Markdown under docs/)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "tests/test_docs.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks against the peers, in one process each."""
    session.install("-e", ".[bench,sim]")
    for script in ("hit_path", "scaling", "contention", "policies", "replay", "soak"):
        session.run("python", f"benchmarks/{script}.py", *session.posargs)
