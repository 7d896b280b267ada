"""Keep the mutants of the decisions: a cosmic-ray filter for ``nox -s mutants``.

Every mutant of ``_core/_scheduler.py`` is kept; of the policies, only those
inside the functions that choose victims (``victims`` and what it calls to
cover a shortfall), since the rest of a policy keeps its order, which the
policies' own tests check. Operators that swap an arithmetic operator for a
bitwise one (``a - b`` to ``a ^ b``) or a power are left out too: on byte
counts they fail at once or mean nothing, and would only pad the score; so
is "``*`` to ``/``" on a signature's bare ``*``, which changes nothing.

    python tests/mutation/decisions.py skip SESSION.sqlite    # after ``cosmic-ray init``
    python tests/mutation/decisions.py score SESSION.sqlite   # after ``cosmic-ray exec``

``score`` prints the share of the mutants run that the tests killed (a
mutant that hung past cosmic-ray's timeout counts as killed, and is listed:
a hang is a test that did not fail) and every survivor's diff, and fails
under ``--fail-under`` percent (90).
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

#: The functions of ``_policies`` that choose victims.
VICTIM_CHOICE = frozenset(
    {"victims", "_lowest", "_take_covering", "_cheapest_cover", "cover", "_covers"}
)

#: Operator swaps left out (cosmic-ray's names).
PADDING = re.compile(
    r"ReplaceBinaryOperator_\w+_(BitAnd|BitOr|BitXor|LShift|RShift|Pow|Mod|FloorDiv|MatMult)$"
    r"|ReplaceBinaryOperator_(BitAnd|BitOr|BitXor|LShift|RShift|Pow|Mod|MatMult)_\w+$"
)


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def in_arithmetic(path: Path, line: int, column: int) -> bool:
    """Whether ``(line, column)`` lies in an arithmetic expression, not on the bare
    ``*`` of a signature (which cosmic-ray mutates as if it multiplied)."""
    return any(
        isinstance(node, ast.BinOp)
        and (node.lineno, node.col_offset) <= (line, column)
        and (line, column) <= (node.end_lineno or node.lineno, node.end_col_offset or 0)
        for node in ast.walk(tree(path))
    )


@cache
def spans(path: Path) -> list[tuple[int, int]]:
    """The line spans of the victim-choosing functions of ``path``."""
    return [
        (node.lineno, node.end_lineno or node.lineno)
        for node in ast.walk(tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in VICTIM_CHOICE
    ]


def kept(module: Path, operator: str, line: int, column: int) -> bool:
    if PADDING.search(operator):
        return False
    if "ReplaceBinaryOperator_" in operator and not in_arithmetic(module, line, column):
        return False
    if "_policies" not in module.parts:
        return True
    return any(start <= line <= end for start, end in spans(module))


SKIPPED = WorkResult(
    worker_outcome=WorkerOutcome.SKIPPED, output=None, test_outcome=None, diff=None
)


def skip(session: str) -> int:
    skipped = 0
    with use_db(session, WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            if not all(kept(m.module_path, m.operator_name, *m.start_pos) for m in item.mutations):
                db.set_result(
                    item.job_id,
                    WorkResult(
                        worker_outcome=WorkerOutcome.SKIPPED,
                        output=None,
                        test_outcome=None,
                        diff=None,
                    ),
                )
                skipped += 1
        left = db.num_work_items - db.num_results
    print(f"skipped {skipped} mutants; {left} to run")
    return 0


def score(session: str, fail_under: float = 90.0) -> int:
    killed = hung = 0
    survivors: list[str] = []
    with use_db(session, WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome is WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome is TestOutcome.SURVIVED:
                where = " ".join(
                    f"{m.module_path}:{m.start_pos[0]} {m.operator_name}" for m in item.mutations
                )
                survivors.append(f"{item.job_id}: {where}\n{result.diff}")
            else:
                killed += 1
                if result.output == "timeout":  # (cosmic-ray's word for it)
                    hung += 1
        pending = db.num_work_items - db.num_results
    total = killed + len(survivors)
    rate = 100.0 * killed / total if total else 0.0
    print("\n".join(survivors))
    left = f"{hung} by the timeout; {pending} not run"
    print(f"killed {killed} of {total} mutants: {rate:.1f}% ({left})")
    return 0 if rate >= fail_under and not pending else 1


def main(argv: list[str]) -> int:
    match argv:
        case ["skip", session]:
            return skip(session)
        case ["score", session]:
            return score(session)
        case ["score", session, "--fail-under", percent]:
            return score(session, float(percent))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
