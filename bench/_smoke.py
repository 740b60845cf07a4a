"""What every bench's smoke mode shares: ``--smoke`` runs the bench's own code paths at
tiny sizes, in seconds, and exits non-zero if any of them fails. Its figures mean
nothing; that it runs does. ``tests/test_benches.py`` runs each bench so, which keeps a
bench from breaking unseen until someone next measures with it.

A bench that needs Azurite takes the one named by ``RALLYPOINT_BENCH_AZURITE`` (a
connection string: the test session's) and starts its own otherwise.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["AZURITE_ENV", "SMOKE_HELP", "azurite", "parse"]

#: The connection string of an Azurite a bench uses instead of starting one.
AZURITE_ENV = "RALLYPOINT_BENCH_AZURITE"
SMOKE_HELP = (
    "the same code paths at tiny sizes, in seconds, failing loudly: what the test suite "
    "runs (tests/test_benches.py); options given as well win over its sizes"
)


def parse(
    parser: argparse.ArgumentParser,
    smoke: Mapping[str, Any],
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """Adds ``--smoke`` to ``parser`` and parses the command line; with ``--smoke``,
    ``smoke`` (option dests to values) replaces the defaults, so an option given on the
    command line still wins."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    unknown = smoke.keys() - vars(args).keys()
    if unknown:  # a renamed option: its smoke size would be set on nothing
        raise ValueError(f"--smoke sets options the bench does not have: {sorted(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


@contextmanager
def azurite() -> Iterator[str]:
    """A connection string: the Azurite of ``RALLYPOINT_BENCH_AZURITE`` if set, else
    one started here for the block (in memory, on free ports)."""
    given = os.environ.get(AZURITE_ENV)
    if given:
        yield given
        return
    from tests._azurite import running_azurite

    with running_azurite() as conn:
        yield conn
