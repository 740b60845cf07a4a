"""``rallypoint jobs``, ``rallypoint status`` and ``rallypoint checkpoints``: a job's
membership, health and checkpoints from a running coordinator, as tables or JSON;
``rallypoint jobs show JOB --timeline``: its history, one line per event; ``rallypoint
jobs hangs JOB [GENERATION]``: its hangs, one with its stacks; and ``rallypoint
checkpoints quarantine|unquarantine JOB VERSION`` for the operator (``jobs unblock`` is
``_admin``'s).

They need only the client (httpx and pydantic), so they run from any laptop.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, TextIO, TypeVar

from pydantic import BaseModel

from rallypoint.client import (
    TOKEN_ENV,
    URL_ENV,
    CheckpointInfo,
    CheckpointPointer,
    ElasticClient,
    HangReport,
    JobStatus,
    JobSummary,
    MemberStatus,
    RallypointError,
    RetryPolicy,
    Timeline,
)
from rallypoint.times import span, utc

__all__ = ["add_commands", "ask", "client_for", "connection_options"]

_T = TypeVar("_T")

# A person is waiting: fail within seconds when the coordinator is down.
_RETRY = RetryPolicy(deadline=timedelta(seconds=5))
# ElasticClient wants a node id; these commands never act as a node.
_NODE = "rallypoint-cli"


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO) -> None:
    cells = [list(header), *(["-" if c is None else str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


def _pointer(pointer: CheckpointPointer | None) -> str:
    if pointer is None:
        return "none"
    tier = "" if pointer.durable else ", in memory"
    return f"v{pointer.version} (step {pointer.step}, generation {pointer.generation}{tier})"


def client_for(args: argparse.Namespace, job: str = "-") -> ElasticClient:
    if not args.url:
        print(f"rallypoint {args.command}: give --url or set {URL_ENV}", file=sys.stderr)
        raise SystemExit(2)
    return ElasticClient(
        args.url,
        job,
        _NODE,
        args.token,
        retry=_RETRY,
        timeout=timedelta(seconds=10),
        transport=args.transport,
        endpoint_key=args.endpoint_key,
    )


def ask(
    args: argparse.Namespace, job: str, command: str, call: Callable[[ElasticClient], _T]
) -> _T | None:
    """Makes a one-shot command's call with a client for ``job``.

    Returns:
        What ``call`` returned, or None where the client raised: then it printed
        ``rallypoint COMMAND: why`` on stderr, and the command exits 1.
    """
    with client_for(args, job) as client:
        try:
            return call(client)
        except RallypointError as exc:
            print(f"rallypoint {command}: {exc}", file=sys.stderr)
            return None


def print_jobs(jobs: Sequence[JobSummary], out: TextIO) -> None:
    rows = [
        (
            j.job_id,
            f"{j.spec.min_nodes}:{j.spec.max_nodes}",
            j.generation,
            "blocked" if j.blocked else j.status,
            j.world_size,
            "-"
            if j.checkpoint is None
            else f"v{j.checkpoint.version} step {j.checkpoint.step}"
            + ("" if j.checkpoint.durable else " (memory)"),
            utc(j.created_at, zone=False),
        )
        for j in jobs
    ]
    _table(["JOB", "NODES", "GENERATION", "STATUS", "WORLD", "CHECKPOINT", "CREATED"], rows, out)


def _sizes(sizes: Sequence[int]) -> str:
    return "/".join(map(str, sizes)) or "none"


def _score(member: MemberStatus) -> str | None:
    """A member's straggler score (its slowest process's), marked if it is one."""
    if member.score is None:
        return "straggler" if member.straggler else None
    return f"{member.score:.2f}" + (" straggler" if member.straggler else "")


def _health(status: JobStatus) -> str:
    """The health line: the hang limit and where it comes from, the stragglers named
    now, the hangs so far and the generations in a row without progress."""
    h = status.health
    assert h is not None
    named = ", ".join(f"{s.node_id} (rank {s.rank}, score {s.score:.2f})" for s in h.stragglers)
    return (
        f"health: hang limit {h.limit()}, phase limit {h.phase_limit:g}s; "
        f"stragglers: {named or 'none'}; hangs so far: {h.hangs}"
        + (f" (rallypoint jobs hangs {status.job_id})" if h.hangs else "")
        + (f"; generations without progress: {h.stalled}" if h.stalled else "")
    )


def print_status(status: JobStatus, out: TextIO) -> None:
    spec = status.spec
    latest = status.checkpoint
    out.write(
        f"job {status.job_id}: generation {status.generation} {status.status}, "
        f"world size {status.world_size} (nodes {spec.min_nodes}:{spec.max_nodes}, "
        + ("" if status.world_sizes is None else f"sizes {_sizes(status.world_sizes)}, ")
        + f"heartbeat timeout {spec.heartbeat_timeout.total_seconds():g}s)\n"
        f"latest checkpoint: {_pointer(latest)}\n"
    )
    if latest is not None and not latest.durable:
        out.write(f"newest durable: {_pointer(status.durable)}\n")
    if status.stale():
        out.write(
            f"as of {utc(status.as_of)} ({status.age:.0f} s ago): the coordinator has not "
            "read storage since\n"
        )
    if status.health is not None:
        out.write(_health(status) + "\n")
    if status.blocked:
        out.write(f"{status.blocked}\n")
    elif status.load_failure is not None:
        f = status.load_failure
        out.write(f"last load failure: v{f.version} at world {f.world_size}: {f.reason}\n")
    out.write("\nmembers\n")
    members = sorted(status.members, key=lambda m: m.rank)
    _table(
        ["RANK", "NODE", "ADDRESS", "HEARTBEAT", "STATE", "STEP", "PHASE", "IDLE", "SCORE"],
        [
            (m.rank, m.node_id, m.addr, _age(m.heartbeat_age), m.state, *m.shown(), _score(m))
            for m in members
        ],
        out,
    )
    if status.health is not None and status.health.stragglers:
        out.write("\nstragglers\n")
        _table(
            ["NODE", "RANK", "SCORE", "WINDOWS", "SINCE"],
            [
                (s.node_id, s.rank, f"{s.score:.2f}", s.windows, utc(s.since, zone=False))
                for s in status.health.stragglers
            ],
            out,
        )
    if status.quarantined_nodes:
        out.write("\nquarantined (not admitted)\n")
        _table(
            ["NODE", "SINCE", "BY", "WHY"],
            [
                (q.node_id, utc(q.at, zone=False), q.by, q.reason or None)
                for q in status.quarantined_nodes
            ],
            out,
        )
    if status.waiting:
        out.write("\nwaiting\n")
        _table(
            ["NODE", "ADDRESS", "ROUND", "WAITING", "HEARTBEAT", "AS", "WHY"],
            [
                (
                    w.node_id,
                    w.addr,
                    w.round,
                    _age(w.waiting_for),
                    _age(w.heartbeat_age),
                    "standby" if w.standby else "joiner",
                    w.reason,
                )
                for w in status.waiting
            ],
            out,
        )
    out.write("\ngenerations\n")
    _table(
        ["GEN", "WORLD", "SEALED", "ENDED", "WHY"],
        [
            (
                g.generation,
                g.world_size,
                utc(g.sealed_at, zone=False),
                utc(g.ended_at, zone=False),
                g.ended_reason,
            )
            for g in sorted(status.history, key=lambda g: g.generation, reverse=True)
        ],
        out,
    )


def print_timeline(timeline: Timeline, out: TextIO) -> None:
    """The job's history, one line per event in time order: generations sealed (world
    size, the version resumed from) and ended (the cause in brackets, then the recorded
    reason), versions committed (tier, pointers, marks; ``collected`` once deleted) and
    marked bad. Each line has the UTC time and the seconds since the first event."""
    t = timeline
    spec = t.spec
    out.write(
        f"job {t.job_id}: generation {t.generation} {t.status}, world size {t.world_size} "
        f"(nodes {spec.min_nodes}:{spec.max_nodes})\n"
        f"latest checkpoint: {_pointer(t.checkpoint)}; newest durable: {_pointer(t.durable)}\n"
    )
    events: list[tuple[float, int, str]] = []
    for g in t.generations:
        source = "scratch" if g.checkpoint is None else f"v{g.checkpoint.version}"
        events.append(
            (
                g.sealed_at,
                0,
                f"generation {g.generation} sealed: world size {g.world_size}, "
                f"resumed from {source}",
            )
        )
        if g.ended_at is not None:
            events.append(
                (g.ended_at, 1, f"generation {g.generation} ended [{g.cause}]: {g.ended_reason}")
            )
    for v in t.versions:
        name = f"checkpoint v{v.version} step {v.step} (generation {v.generation})"
        if v.committed_at is None:
            events.append((v.created_at, 2, f"{name} begun: pending"))
        else:
            tags = [
                ("durable" if v.durability == "durable" else "memory"),
                *(["latest"] if v.latest else []),
                *(["newest durable"] if v.latest_durable else []),
                *(["quarantined"] if v.quarantined else []),
                *(["unrecoverable"] if v.unrecoverable else []),
                *(["collected"] if v.collected else []),
            ]
            events.append((v.committed_at, 2, f"{name} committed: {', '.join(tags)}"))
        if v.quarantined_at is not None:
            events.append((v.quarantined_at, 3, f"checkpoint v{v.version} quarantined"))
        if v.unrecoverable_at is not None:
            events.append((v.unrecoverable_at, 3, f"checkpoint v{v.version} unrecoverable"))
    if not events:
        out.write("\nno generation sealed and no checkpoint yet\n")
        return
    events.sort()
    start = events[0][0]
    day = utc(start, "%Y-%m-%d", zone=False)
    out.write(f"\nsince {day} (UTC)\n")
    _table(
        ["TIME", "SINCE", "EVENT"],
        [
            (
                utc(at, "%H:%M:%S", zone=False),
                "+" + span(at - start),
                text,
            )
            for at, _, text in events
        ],
        out,
    )


def print_hangs(reports: Sequence[HangReport], out: TextIO) -> None:
    """One row per hang the job keeps a report of (the last 20), oldest first: the
    generation it ended, the node and rank, what the rank did and at which step, how
    long it showed no progress against its limit, when it was found, and what became
    of its stacks (``rallypoint jobs hangs JOB GENERATION`` prints them)."""
    if not reports:
        out.write("no hangs\n")
        return
    _table(
        ["GEN", "NODE", "RANK", "PHASE", "STEP", "IDLE", "LIMIT", "FOUND", "STACKS"],
        [
            (
                h.generation,
                h.node_id,
                h.rank,
                h.phase,
                h.step,
                f"{h.idle:.1f}s",
                f"{h.limit:.1f}s",
                utc(h.at, zone=False),
                h.stacks_state(),
            )
            for h in reports
        ],
        out,
    )


def print_hang(report: HangReport, out: TextIO) -> None:
    """One hang: why its generation ended, when, the process and the tool its stacks
    were taken with, then the stacks as the tool wrote them (or why there are none)."""
    h = report
    out.write(
        f"generation {h.generation} ended: {h.reason}\n"
        f"found: {utc(h.at)}\n"
        f"process: {'-' if h.pid is None else h.pid} (rank {h.rank} on node {h.node_id})\n"
    )
    if h.stacks is not None:
        out.write(f"stacks, taken by {h.taken_by or 'its agent'}:\n\n{h.stacks.rstrip()}\n")
        if h.stacks_error:
            out.write(f"\n(before that: {h.stacks_error})\n")
    elif h.stacks_error is not None:
        out.write(f"no stacks: the process could not give them: {h.stacks_error}\n")
    else:
        out.write(
            "no stacks yet: the node's agent sends them once it has stopped the process "
            "(never, if the node went down with it)\n"
        )


def _pointers(v: CheckpointInfo) -> str | None:
    names = [
        *(["latest"] if v.latest else []),
        *(["durable"] if v.latest_durable else []),
        *(["best"] if v.best_place == 1 else []),
        *([f"best#{v.best_place}"] if v.best_place is not None and v.best_place > 1 else []),
    ]
    return ",".join(names) or None


def _metrics(v: CheckpointInfo) -> str | None:
    return " ".join(f"{k}={value:.6g}" for k, value in sorted(v.metrics.items())) or None


def print_checkpoints(versions: Sequence[CheckpointInfo], out: TextIO) -> None:
    """One row per version; POINTER marks the job's ``latest``, its newest ``durable``
    version (what it falls back to if the memory copies of newer ones go) and its
    ``best`` (``best#2``... for the others its ``keep_best`` rule keeps); STATE says
    QUARANTINED for a version an operator marked bad and UNRECOVERABLE for one a rank
    could not load, and a line under the table says when and why. METRICS, when any
    version carries some."""
    with_metrics = any(v.metrics for v in versions)
    rows = [
        (
            v.version,
            v.step,
            v.generation,
            "QUARANTINED" if v.quarantined else "UNRECOVERABLE" if v.unrecoverable else v.state,
            v.durability,
            f"{v.reported}/{v.world_size}",
            _pointers(v),
            utc(v.created_at, zone=False),
            utc(v.committed_at, zone=False),
            *([_metrics(v)] if with_metrics else []),
        )
        for v in versions
    ]
    header = ["VERSION", "STEP", "GEN", "STATE", "DURABILITY", "RANKS", "POINTER"]
    extra = ["METRICS"] if with_metrics else []
    _table([*header, "CREATED", "COMMITTED", *extra], rows, out)
    for v in versions:
        for mark in v.marks():
            out.write(f"v{v.version} {mark}\n")


def _show(args: argparse.Namespace, fetch: Callable[[], str]) -> int:
    """Prints once, or with ``--watch`` again whenever the answer changes."""
    shown = None
    while True:
        try:
            text = fetch()
        except RallypointError as exc:
            print(f"rallypoint {args.command}: {exc}", file=sys.stderr)
            if not args.watch:
                return 1
            text = f"(coordinator unreachable: {exc})\n"
        if text != shown:
            if args.watch and not args.json and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
            sys.stdout.write(text)
            sys.stdout.flush()
            shown = text
        if not args.watch:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _render(
    args: argparse.Namespace, value: BaseModel | list[Any], printer: Callable[..., None]
) -> str:
    if args.json:
        if isinstance(value, list):
            return json.dumps([v.model_dump(mode="json") for v in value]) + "\n"
        return value.model_dump_json() + "\n"
    out = io.StringIO()
    printer(value, out)
    if args.watch:
        out.write(f"\n({utc(time.time())}; every {args.interval:g}s, Ctrl-C stops)\n")
    return out.getvalue()


def _jobs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # ``jobs`` lists; ``jobs show JOB`` is one job's status, ``--timeline`` its history;
    # ``jobs hangs JOB [GENERATION]`` its hangs, or one with its stacks; ``jobs unblock
    # JOB`` lets a blocked job restart (the admin token).
    words = args.words
    if args.timeline and words[:1] != ["show"]:
        parser.error("--timeline goes with show JOB")
    if not words:
        with client_for(args) as client:
            return _show(args, lambda: _render(args, client.jobs(), print_jobs))
    if len(words) in (2, 3) and words[0] == "hangs":
        return _hangs(args, parser, words[1], words[2] if len(words) == 3 else None)
    if len(words) == 2 and words[0] == "unblock":
        if args.watch:
            parser.error("--watch does not go with unblock")
        # An admin command: ``_admin`` adds it to this parser (it imports this module).
        act: Callable[[argparse.Namespace, str], int] = args.unblock
        return act(args, words[1])
    if len(words) != 2 or words[0] != "show":
        parser.error("give nothing (every job), show JOB, hangs JOB [GENERATION] or unblock JOB")
    with client_for(args, words[1]) as client:
        if args.timeline:
            return _show(args, lambda: _render(args, client.timeline(), print_timeline))
        return _show(args, lambda: _render(args, client.membership(), print_status))


def _hangs(
    args: argparse.Namespace, parser: argparse.ArgumentParser, job: str, generation: str | None
) -> int:
    """The job's hang reports, or with ``generation`` the one that ended it, stacks
    included."""
    if generation is None:
        with client_for(args, job) as client:
            return _show(args, lambda: _render(args, client.hangs(), print_hangs))
    if not generation.isdigit() or int(generation) < 1:
        parser.error(f"GENERATION must be a generation number, not {generation!r}")
    with client_for(args, job) as client:
        return _show(args, lambda: _render(args, client.hang(int(generation)), print_hang))


def _status(args: argparse.Namespace) -> int:
    with client_for(args, args.job) as client:
        return _show(args, lambda: _render(args, client.membership(), print_status))


_ACTIONS = ("quarantine", "unquarantine", "recover")


def _checkpoints(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # ``checkpoints JOB`` lists; ``checkpoints quarantine|unquarantine JOB VERSION`` acts
    # (a job may be named "quarantine": with one word it is a job).
    words = args.words
    if words and words[0] == "export" and len(words) in (2, 3):
        return _export(args, parser, words[1], words[2] if len(words) == 3 else "latest")
    if any(getattr(args, name) is not None for name in _EXPORT_OPTIONS):
        parser.error("--out, --format, --dtype, --only and --max-shard-size go with export")
    if len(words) == 3 and words[0] in _ACTIONS:
        action, job, version = words
        if not version.isdigit() or int(version) < 1:
            parser.error(f"VERSION must be a version number, not {version!r}")
        if args.watch:
            parser.error(f"--watch does not go with {action}")
        return _quarantine(args, action, job, int(version))
    if len(words) != 1:
        parser.error(
            "give JOB, or quarantine|unquarantine|recover JOB VERSION, or export JOB [VERSION]"
        )
    if args.reason is not None or args.restart:
        parser.error("--reason and --restart go with quarantine JOB VERSION")
    with client_for(args, words[0]) as client:
        return _show(args, lambda: _render(args, client.checkpoints(), print_checkpoints))


_EXPORT_OPTIONS = ("out", "format", "dtype", "only", "max_shard_size")


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser, job: str, which: str) -> int:
    """Writes a version's tensors to ``--out`` (see :func:`rallypoint.trainer.export`)."""
    if which not in ("latest", "best") and not (which.isdigit() and int(which) >= 1):
        parser.error(f"VERSION must be a version number, latest or best, not {which!r}")
    if args.out is None:
        parser.error("export needs --out PATH")
    if args.watch:
        parser.error("--watch does not go with export")
    try:
        from rallypoint.trainer import RallypointTrainerError, export
    except ImportError as exc:  # the trainer extra (torch) is not installed
        print(f"rallypoint checkpoints export: needs rallypoint[trainer]: {exc}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {
        "format": args.format or "safetensors",
        "dtype": args.dtype or "keep",
    }
    if args.only is not None:
        options["only"] = args.only
    if args.max_shard_size is not None:
        options["max_shard_size"] = args.max_shard_size << 20
    with client_for(args, job) as client:
        try:
            named: int | Literal["latest", "best"] = (
                int(which) if which.isdigit() else "best" if which == "best" else "latest"
            )
            done = export(client, args.out, named, **options)
        except (RallypointError, RallypointTrainerError) as exc:
            print(f"rallypoint checkpoints export: {exc}", file=sys.stderr)
            return 1
    if args.json:
        sys.stdout.write(
            json.dumps({**dataclasses.asdict(done), "files": [str(f) for f in done.files]}) + "\n"
        )
        return 0
    print(
        f"v{done.version} (step {done.step}): {done.tensors} tensors, "
        f"{done.bytes / (1 << 20):,.1f} MiB in {done.seconds:.1f} s -> "
        + ", ".join(str(f) for f in done.files)
    )
    return 0


def _quarantine(args: argparse.Namespace, action: str, job: str, version: int) -> int:
    """Quarantines, unquarantines or recovers (clears the ``unrecoverable`` mark of)
    ``version`` and says where the latest pointer is."""
    if action != "quarantine" and (args.reason is not None or args.restart):
        print("rallypoint checkpoints: --reason and --restart go with quarantine", file=sys.stderr)
        return 2

    def act(client: ElasticClient) -> tuple[CheckpointInfo, CheckpointPointer | None]:
        if action == "quarantine":
            info = client.quarantine(version, args.reason or "", restart=args.restart)
        elif action == "unquarantine":
            info = client.unquarantine(version)
        else:
            info = client.recover(version)
        return info, client.membership().checkpoint

    done = ask(args, job, f"checkpoints {action}", act)
    if done is None:
        return 1
    info, latest = done
    if args.json:
        sys.stdout.write(info.model_dump_json() + "\n")
        return 0
    if action == "recover":
        state = "unrecoverable still" if info.unrecoverable else "not marked unrecoverable"
    else:
        state = "quarantined" if info.quarantined else "not quarantined"
    ended = "; the running generation was ended" if args.restart else ""
    print(f"v{info.version} (step {info.step}) is {state}{ended}; latest: {_pointer(latest)}")
    return 0


def connection_options() -> argparse.ArgumentParser:
    """The options of every command that calls a coordinator (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=os.environ.get(URL_ENV), help=f"the coordinator [{URL_ENV}]"
    )
    common.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV) or None, help=f"its token [{TOKEN_ENV}]"
    )
    common.add_argument(
        "--transport",
        choices=["rest", "envelope"],
        default=None,
        help="envelope for an AzureML endpoint's scoring URI [RALLYPOINT_TRANSPORT, rest]",
    )
    common.add_argument(
        "--endpoint-key",
        default=os.environ.get("RALLYPOINT_ENDPOINT_KEY") or None,
        help="the AzureML endpoint's key [RALLYPOINT_ENDPOINT_KEY]",
    )
    common.add_argument("--json", action="store_true", help="JSON instead of a table")
    return common


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``jobs``, ``status`` and ``checkpoints`` to the ``rallypoint`` command."""
    common = connection_options()
    common.add_argument("--watch", action="store_true", help="print again whenever it changes")
    common.add_argument(
        "--interval", type=float, default=1.0, help="seconds between --watch polls [1]"
    )
    jobs = commands.add_parser(
        "jobs",
        parents=[common],
        help="the coordinator's jobs; show one, its timeline or its hangs; unblock one",
        usage="rallypoint jobs [options]\n"
        "       rallypoint jobs [options] show JOB [--timeline]\n"
        "       rallypoint jobs [options] hangs JOB [GENERATION]\n"
        "       rallypoint jobs [options] unblock JOB",
        description="Lists the jobs. show JOB prints one job as status JOB does; with "
        "--timeline, its history instead: each generation sealed and ended (and why), each "
        "checkpoint committed (tier, pointers) and marked bad, with times. hangs JOB lists "
        "the ranks found hung (the last 20: node, rank, phase, step, how long without "
        "progress against the limit, and whether their stacks came); hangs JOB GENERATION "
        "prints the one that ended that generation with its process's stacks. unblock JOB "
        "(the admin token) lets a job that stopped restarting restart again: one whose "
        "generations made no progress several times in a row, or whose world size kept "
        "failing to load its checkpoint.",
    )
    jobs.add_argument(
        "words",
        nargs="*",
        metavar="ACTION JOB",
        help="show JOB, hangs JOB [GENERATION] or unblock JOB",
    )
    jobs.add_argument("--timeline", action="store_true", help="show JOB: its history")
    jobs.set_defaults(run=lambda args: _jobs(args, jobs))
    status = commands.add_parser(
        "status",
        parents=[common],
        help="a job's members, waiting nodes, generations and latest checkpoint",
        description="A job's generation and latest checkpoint; its health (the hang limit "
        "and where it comes from: set on the job, learned from its step times, the floor, "
        "or warming while too few steps; the stragglers; the hangs so far); why it is "
        "blocked, if it is; its members with their progress (STEP, PHASE: what their "
        "processes do, IDLE: the longest a process showed no progress when the node last "
        "beat, SCORE: the slowest process's own step time against the fastest rank's, 1.0 "
        "the fastest, marked straggler once it stayed under the job's threshold); "
        "quarantined and waiting nodes; generations and why each ended.",
    )
    status.add_argument("job", help="the job id")
    status.set_defaults(run=_status)
    checkpoints = commands.add_parser(
        "checkpoints",
        parents=[common],
        help="a job's checkpoint versions; quarantine or unquarantine one",
        usage="rallypoint checkpoints [options] JOB\n"
        "       rallypoint checkpoints [options] quarantine JOB VERSION [--reason R] "
        "[--restart]\n"
        "       rallypoint checkpoints [options] unquarantine JOB VERSION\n"
        "       rallypoint checkpoints [options] recover JOB VERSION\n"
        "       rallypoint checkpoints [options] export JOB [VERSION|latest|best] --out PATH "
        "[--format safetensors|hf|torch] [--dtype keep|bf16|fp16|fp32] [--only PREFIX]",
        description="Lists a job's versions. quarantine (the admin token) marks a "
        "committed version bad: no generation resumes from it, and if it was the latest "
        "the pointer moves back to the newest good version; unquarantine undoes it. "
        "recover (the admin token) clears the unrecoverable mark a rank's failed restore "
        "left, once its copies are back. "
        "export writes a committed version's tensors, consolidated into full tensors, to "
        "one safetensors file, a Hugging Face folder (hf) or a torch.save file (a reader "
        "token may export).",
    )
    checkpoints.add_argument(
        "words", nargs="+", metavar="JOB", help="the job id (after the action, if any)"
    )
    checkpoints.add_argument("--reason", help="quarantine: why, shown beside the version")
    checkpoints.add_argument(
        "--restart",
        action="store_true",
        help="quarantine: end the running generation, so every rank reloads now "
        "(else the next generation is the first to skip the version)",
    )
    checkpoints.add_argument("--out", help="export: the file (a folder with --format hf)")
    checkpoints.add_argument(
        "--format", choices=["safetensors", "hf", "torch"], help="export: [safetensors]"
    )
    checkpoints.add_argument(
        "--dtype", choices=["keep", "bf16", "fp16", "fp32"], help="export: cast floats [keep]"
    )
    checkpoints.add_argument(
        "--only", help="export: only tensors whose name starts with this (e.g. model.)"
    )
    checkpoints.add_argument(
        "--max-shard-size", type=int, metavar="MIB", help="export --format hf: MiB per shard [5120]"
    )
    checkpoints.set_defaults(run=lambda args: _checkpoints(args, checkpoints))
