"""``rallypoint token create|list|revoke``: job-scoped tokens, made with the admin token;
``rallypoint nodes quarantine|unquarantine``: the nodes a job does not admit;
``rallypoint jobs unblock``: a job that stopped restarting restarts again.

Like the inspection commands they need only the client, so they run from any laptop.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import TextIO

from rallypoint.client import ElasticClient, JobSummary, QuarantinedNode, TokenInfo
from rallypoint.times import utc

from ._inspect import _table, ask, connection_options

__all__ = ["add_commands", "parse_duration", "unblock"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``90s``, ``30m``, ``12h`` or ``7d`` (a bare number is seconds).

    Raises:
        argparse.ArgumentTypeError: Anything else, or not positive.
    """
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 12h or 7d")
    return timedelta(seconds=float(match[1]) * _UNITS[match[2] or "s"])


def _print(tokens: Sequence[TokenInfo]) -> None:
    header = ("ID", "JOB", "ROLE", "NAME", "CREATED", "EXPIRES", "REVOKED")
    rows = [
        (
            t.token_id,
            t.job_id,
            t.role,
            t.name,
            utc(t.created_at, zone=False),
            utc(t.expires_at, zone=False),
            utc(t.revoked_at, zone=False),
        )
        for t in tokens
    ]
    _table(header, rows, sys.stdout)


def _create(args: argparse.Namespace) -> int:
    made = ask(
        args,
        args.job,
        "token create",
        lambda c: c.create_token(args.role, expires_in=args.expires, name=args.name),
    )
    if made is None:
        return 1
    if args.json:
        sys.stdout.write(made.model_dump_json() + "\n")
    else:
        # The token alone on stdout, for `export RALLYPOINT_TOKEN=$(rallypoint token ...)`.
        print(made.token)
        expiry = (
            "never expires"
            if made.expires_at is None
            else f"expires {utc(made.expires_at, zone=False)}"
        )
        print(
            f"token {made.token_id}: {made.role} of job {made.job_id}, {expiry}; "
            "it is shown only now",
            file=sys.stderr,
        )
    return 0


def _list(args: argparse.Namespace) -> int:
    tokens = ask(args, args.job or "-", "token list", lambda c: c.tokens(all_jobs=not args.job))
    if tokens is None:
        return 1
    if args.json:
        print(json.dumps([t.model_dump(mode="json") for t in tokens]))
    else:
        _print(tokens)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    info = ask(args, "-", "token revoke", lambda c: c.revoke_token(args.token_id))
    if info is None:
        return 1
    if args.json:
        sys.stdout.write(info.model_dump_json() + "\n")
    else:
        print(f"token {info.token_id} ({info.role} of job {info.job_id}) revoked")
    return 0


def print_quarantined(nodes: Sequence[QuarantinedNode], out: TextIO) -> None:
    """One row per node the job does not admit: since when, by whom, why."""
    rows = [(q.node_id, utc(q.at, zone=False), q.by, q.reason or None) for q in nodes]
    _table(("NODE", "SINCE", "BY", "WHY"), rows, out)


def _nodes(args: argparse.Namespace) -> int:
    action = args.action
    if action == "quarantine":
        done = ask(
            args,
            args.job,
            "nodes quarantine",
            lambda c: c.quarantine_node(args.node, args.reason or ""),
        )
    else:
        done = ask(args, args.job, "nodes unquarantine", lambda c: c.unquarantine_node(args.node))
    if done is None:
        return 1
    if args.json:
        print(json.dumps([q.model_dump(mode="json") for q in done]))
        return 0
    state = "quarantined" if any(q.node_id == args.node for q in done) else "admitted"
    print(f"node {args.node} is {state} in job {args.job}")
    if done:
        print_quarantined(done, sys.stdout)
    return 0


def unblock(args: argparse.Namespace, job: str) -> int:
    """``rallypoint jobs unblock JOB``: lets a job that stopped restarting restart again
    (``DELETE /v1/jobs/{job}/blocked``, the admin token) and says what held it."""

    def act(client: ElasticClient) -> tuple[str | None, JobSummary]:
        return client.membership().blocked, client.unblock()

    done = ask(args, job, "jobs unblock", act)
    if done is None:
        return 1
    before, after = done
    if args.json:
        sys.stdout.write(after.model_dump_json() + "\n")
        return 0
    if before is None:
        print(f"job {job} was not blocked")
    else:
        print(f"job {job} unblocked; it was {before}")
    if after.blocked:
        # What an unblock does not clear: the world sizes its nodes make.
        print(f"job {job} still waits: {after.blocked}")
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``token`` and ``nodes`` to the ``rallypoint`` command, and ``unblock`` to its
    ``jobs`` (which ``_inspect`` adds first)."""
    commands.choices["jobs"].set_defaults(unblock=unblock)
    common = connection_options()
    token = commands.add_parser(
        "token",
        help="job-scoped tokens: create, list, revoke (needs the admin token)",
        description="A trainer token joins one job and acts for its nodes; a reader token "
        "reads it (API GET routes, status page, CLI views). Both are made and revoked with "
        "the coordinator's admin token (--token / RALLYPOINT_TOKEN).",
    )
    actions = token.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", parents=[common], help="make a token for one job")
    create.add_argument("job", help="the job id")
    create.add_argument("--role", choices=["trainer", "reader"], required=True)
    create.add_argument(
        "--expires", type=parse_duration, help="lifetime: 90s, 30m, 12h, 7d [never]"
    )
    create.add_argument("--name", help="a label for people (who or what it is for)")
    create.set_defaults(run=_create)
    listing = actions.add_parser("list", parents=[common], help="scoped tokens (never the tokens)")
    listing.add_argument("job", nargs="?", help="only this job's")
    listing.set_defaults(run=_list)
    revoke = actions.add_parser(
        "revoke", parents=[common], help="revoke a token (every replica, within a second)"
    )
    revoke.add_argument("token_id", help="the token's id (from create or list)")
    revoke.set_defaults(run=_revoke)
    nodes = commands.add_parser(
        "nodes",
        help="keep a node out of a job, or let it back (needs the admin token)",
        description="quarantine: the job refuses the node's joins (node_quarantined) and "
        "no round seals it; if it is a member, its generation ends. The coordinator "
        "quarantines a node itself when it hung twice within an hour (by: hangs), when the "
        "job's straggler policy (replace, drop) takes it out (by: straggler), and when it "
        "was lost RALLYPOINT_NODE_LOSSES times within RALLYPOINT_NODE_LOSS_WINDOW seconds, "
        "where that is set (by: losses). unquarantine admits it again. rallypoint status "
        "JOB lists them.",
    )
    acts = nodes.add_subparsers(dest="action", required=True)
    quarantine = acts.add_parser("quarantine", parents=[common], help="keep a node out")
    quarantine.add_argument("job", help="the job id")
    quarantine.add_argument("node", help="the node id (it need not have joined)")
    quarantine.add_argument("--reason", help="why, shown beside the node")
    quarantine.set_defaults(run=_nodes)
    unquarantine = acts.add_parser("unquarantine", parents=[common], help="let a node back")
    unquarantine.add_argument("job", help="the job id")
    unquarantine.add_argument("node", help="the node id")
    unquarantine.set_defaults(run=_nodes)
