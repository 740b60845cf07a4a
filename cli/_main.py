"""The ``rallypoint`` command: its parser, and ``serve``, ``run`` and ``demo``; the
inspection and token commands are in ``_inspect`` and ``_admin``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import rallypoint

if TYPE_CHECKING:
    from rallypoint.service.settings import Settings

__all__ = ["main", "serve_settings"]


def _settings(args: argparse.Namespace) -> Settings:
    from rallypoint.service.settings import Settings

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "storage": args.storage,
            "token": args.token,
            "insecure": args.insecure or None,
            "access_log": args.access_log or None,
            "log_format": args.log_format,
        }.items()
        if v is not None
    }
    return Settings(**overrides)


def serve_settings(args: Sequence[str]) -> Settings:
    """The settings ``rallypoint serve ARGS`` runs with: its flags over ``RALLYPOINT_*``.

    Raises:
        SystemExit: A flag the parser refuses (it printed why).
        pydantic.ValidationError: Settings it refuses, e.g. a public address without a
            token.
    """
    return _settings(_parser().parse_args(["serve", *args]))


def _missing(command: str, what: str, extra: str, exc: ImportError) -> int:
    """Says which extra ``rallypoint COMMAND`` needs; returns the exit status (2)."""
    print(
        f"rallypoint {command} needs {what}: pip install 'rallypoint[{extra}]' ({exc})",
        file=sys.stderr,
    )
    return 2


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401

        from rallypoint.service.app import serve
    except ImportError as exc:
        return _missing("serve", "the service extra", "service", exc)
    from pydantic import ValidationError

    try:
        settings = _settings(args)
    except ValidationError as exc:
        for error in exc.errors():
            print(f"rallypoint serve: {error['msg']}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        from rallypoint.trainer import run
    except ImportError as exc:
        return _missing("run", "the trainer extra", "trainer", exc)
    # The package's warnings on stderr whatever else configures logging (Python's
    # last-resort handler shows them only while no handler exists anywhere): the node's
    # account of what it waits for, e.g. a coordinator it cannot reach.
    # torchrun's LOGLEVEL (INFO, DEBUG) shows the agent's own lines too: when a
    # generation was sealed, joined, ended and why.
    level = logging.getLevelName(os.environ.get("LOGLEVEL", "WARNING").upper())
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(level if isinstance(level, int) else logging.WARNING)
    logger = logging.getLogger("rallypoint")
    logger.addHandler(stderr)
    if isinstance(level, int) and level < logging.WARNING:
        logger.setLevel(level)
    return run(args.torchrun_args)


def _demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return _missing("demo", "everything", "all", exc)
    from ._demo import main as demo

    return demo(args.demo_args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rallypoint", description="Rendezvous and checkpoint coordinator for elastic training."
    )
    parser.add_argument("--version", action="version", version=rallypoint.__version__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the coordinator (needs rallypoint[service])")
    serve.add_argument("--host", help="address to listen on [RALLYPOINT_HOST, 127.0.0.1]")
    serve.add_argument("--port", type=int, help="port [RALLYPOINT_PORT, 8080]")
    serve.add_argument(
        "--storage",
        help="local:PATH or azure [RALLYPOINT_STORAGE, local:.rallypoint]",
    )
    serve.add_argument("--token", help="bearer token required under /v1 [RALLYPOINT_TOKEN]")
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback address without a token [RALLYPOINT_INSECURE]",
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log every request [RALLYPOINT_ACCESS_LOG, off]",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="json: one object per line, for log collectors [RALLYPOINT_LOG_FORMAT, text]",
    )
    serve.set_defaults(run=_serve)

    run = commands.add_parser(
        "run",
        help="torchrun with --rdzv-backend=rallypoint and defaults from the environment",
        description="torchrun [OPTIONS] SCRIPT [ARGS], with the options left out filled "
        "from RALLYPOINT_URL, RALLYPOINT_JOB, RALLYPOINT_NNODES, RALLYPOINT_NPROC_PER_NODE, "
        "RALLYPOINT_MAX_RESTARTS, RALLYPOINT_RDZV_CONF and AzureML's variables. A flag wins "
        "over RALLYPOINT_*, which wins over torchrun's own PET_* variables (Kubernetes); a "
        "plain count in PET_NNODES (Kubeflow Trainer) is the most nodes, from "
        "RALLYPOINT_MIN_NODES (1).",
    )
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun's arguments")
    run.set_defaults(run=_run)

    demo = commands.add_parser(
        "demo",
        help="elastic training through a SIGKILL, a rejoin and a preemption, on this machine",
        add_help=False,
    )
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(run=_demo)

    from ._admin import add_commands as add_admin_commands
    from ._inspect import add_commands

    add_commands(commands)
    add_admin_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        # torchrun's options are its own: argparse must not try to read them.
        return _run(argparse.Namespace(torchrun_args=argv[1:]))
    if argv[:1] == ["demo"]:
        return _demo(argparse.Namespace(demo_args=argv[1:]))
    args = _parser().parse_args(argv)
    return int(args.run(args))
