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
    paths = ["src", "tests", "benchmarks", "docs/examples", "docs/conf.py", "noxfile.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typing(session: nox.Session) -> None:
    session.install("-e", ".[test]", "mypy")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site (Sphinx + MyST, warnings as errors) and run every example in it."""
    session.install("-e", ".[test]")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-E", "-b", "html", "docs", "docs/_build/html"
    )
    session.run("pytest", "-q", "tests/test_docs.py", "tests/test_examples.py")


@nox.session
def torch(session: nox.Session) -> None:
    """Run the PyTorch recipes with real torch.nn modules (too heavy for the default run)."""
    session.install("-e", ".", "torch==2.13.0", "numpy", "pytest", "hypothesis", "trio", "uvloop")
    session.run("python", "docs/examples/torch_plugin.py")
    session.run("python", "docs/examples/torch_tiers.py")
    session.run("pytest", "-q", "tests/shell/test_tiers_torch.py")


@nox.session
def ray(session: nox.Session) -> None:
    """cachebroker.ray on a local Ray cluster: its tests (``-- bench``: and the benchmark)."""
    session.install("-e", ".[test,ray]")
    session.run("pytest", "-q", "-m", "ray", "tests/ray")
    if "bench" in session.posargs:
        session.run("python", "benchmarks/ray_serve.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks against the peers, in one process each."""
    session.install("-e", ".[bench,sim]")
    for script in ("hit_path", "scaling", "contention", "remote", "policies", "replay", "soak"):
        session.run("python", f"benchmarks/{script}.py", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing of the scheduler and the policies' victim choice (cosmic-ray).

    The mutants are run against the core's own tests, with no event loop
    (tests/mutation/cosmic-ray.toml), which must kill at least 90% of them
    (tests/mutation/decisions.py: ``score``). The sources are mutated in
    place, one mutant at a time, and restored: run it on a clean checkout.
    ``-- resume`` goes on with the last session's database.
    """
    session.install("-e", ".[test]", "cosmic-ray>=8.3")
    config, database = "tests/mutation/cosmic-ray.toml", "mutants.sqlite"
    if "resume" not in session.posargs:
        session.run("cosmic-ray", "init", config, database)
        session.run("python", "tests/mutation/decisions.py", "skip", database)
    session.run("cosmic-ray", "exec", config, database, env={"HYPOTHESIS_PROFILE": "mutants"})
    session.run("python", "tests/mutation/decisions.py", "score", database, "--fail-under", "90")
