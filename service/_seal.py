"""When a round seals and when a generation ends: the rules, in one place.

Each rule is a function of what storage said and the time, with no storage and no clock
of its own, so that a rule reads (and is tested) as a rule. :class:`~._rendezvous.
Rendezvous` reads the rows, calls these, and writes what they decide, each write an
ETag compare-and-swap. What makes it ask:

- a join: :meth:`~._rendezvous.Rendezvous.register` ends a running generation that a
  newcomer or a returning member joins (:func:`join_ends`), and pokes the driver;
- a tick (:meth:`~._rendezvous.Rendezvous.tick`): seals an open round
  (:func:`alive`, :func:`ranked`, :func:`seal_waits`), or ends a generation with a silent
  member or one whose heartbeat connection was cut (:func:`silent`). The driver
  (``_driver.py``) ticks when a join pokes it, and otherwise when the last tick said
  something could change, at least every ``max_tick``;
- a departure: a node's leave or the operator's removal ends its generation
  (:meth:`~._rendezvous.Rendezvous.leave`, ``remove``); a quarantine with ``restart``
  does too (``_checkpoints.py``);
- a join to a full generation parks the newcomer as a standby instead (:func:`parks`)
  while the job has room for one: it ends nothing, waits with no join timeout
  (:func:`parked`), holds copies of the files of the slots it would take
  (:func:`keeper`), and the next round's seal gives it the rank of the member that was
  lost (:func:`standing_by`, :func:`slotted`);
- a hot join to a generation with room (:func:`warms`) parks the newcomer too, its
  workers starting meanwhile; the wait that says they are ready to train ends the
  generation (:func:`ready_ends`), so the members never wait for a process start, and
  its round, already gathered, seals without a last call (:func:`seal_waits`);
- a member that leaves because its workers finished ends its generation, and the
  standbys parked beside it are released (:func:`released`), not sealed alone;
- a heartbeat: :func:`verdict` tells a member whether its generation still runs (one
  told to restart still counts as alive while its agent stops its workers:
  :func:`restarting`, so the next round waits for it as :func:`seal_waits` says); a
  member's held heartbeat cut (its process gone, or only its connection) counts after
  the reconnect window, or at once where another member's collective failed beside it
  (:func:`corroborated`); with such a report, a member that has not beaten again within
  the window of its last held heartbeat's answer counts as cut too (the driver's
  ``released``: one that died between two held heartbeats cut nothing);
- a rank that cannot load the checkpoint its generation named (``_checkpoints.py``,
  ``load_failed``) ends the generation; the job counts such ends in a row
  (:func:`load_streak`), and a round does not seal a third generation that would only
  fail the same way (:func:`load_blocked`): it waits for a world of another size, and its
  nodes' joins time out with the reason if none comes;
- a node quarantined (by the operator, or for being lost too often: :func:`losses`,
  :func:`lost_too_often`) is refused at its join and never sealed (:func:`admitted`);
- a job that takes only some world sizes (its spec's ``world_sizes``, or those a worker
  reported when its world could not split the global batch: :func:`learned`, which ends
  the generation, :func:`size_refused`) seals the largest of them its nodes make
  (:func:`sizes`, :func:`world_for`), or none (:func:`size_blocked`); a newcomer that,
  with the nodes already waiting, makes no larger size parks beside the running
  generation instead of ending it (:func:`waits_for_size`, :func:`grows`; a hot join's
  ready too, :func:`ready_ends`), waits with no join timeout (:func:`parked`), and is
  sealed when a member is lost or enough newcomers make a larger size
  (:func:`parked_reason` says which it waits for).

How waiting requests learn of a change (the driver's snapshot and its change future, the
long-polls of ``routers/jobs.py``) is the driver's: see ``_driver.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from rallypoint.client.models import FINISHED, CheckpointPointer, LoadFailure, QuarantinedNode

from ._records import Generation, Job, Node
from .errors import JobFull, StaleGeneration

__all__ = [
    "LOAD_FAILURES_BEFORE_BLOCK",
    "RESTART_GRACE",
    "admitted",
    "alive",
    "blocked_reason",
    "corroborated",
    "end_reason",
    "grows",
    "held_back",
    "join_ends",
    "keeper",
    "learned",
    "load_blocked",
    "load_streak",
    "losses",
    "lost_too_often",
    "parked",
    "parked_reason",
    "parks",
    "ranked",
    "ready_ends",
    "released",
    "restarting",
    "seal_waits",
    "silent",
    "size_blocked",
    "size_refused",
    "sizes",
    "slotted",
    "standing_by",
    "verdict",
    "waits_for_size",
    "warms",
    "world_for",
]

#: Generations in a row that failed to load the same version at the same world size,
#: after which a round of that size does not seal with that version: two, because the
#: first may be bad luck (a node that ran out of memory) and the second shows a rule.
LOAD_FAILURES_BEFORE_BLOCK = 2


def admitted(nodes: Iterable[Node], quarantined: Iterable[QuarantinedNode]) -> list[Node]:
    """The nodes a round may seal: not quarantined (a join read the job's list a moment
    before a quarantine wrote it, so the seal checks again)."""
    out = {q.node_id for q in quarantined}
    return [n for n in nodes if n.node_id not in out]


def losses(
    recent: Mapping[str, Sequence[float]], node_id: str | None, now: float, window: float
) -> dict[str, tuple[float, ...]]:
    """The job's node losses within ``window`` seconds of ``now``, with ``node_id``'s at
    ``now`` if a loss (a dropped heartbeat connection, missed heartbeats) ends a
    generation; older ones dropped, so the record stays small."""
    kept = {n: tuple(t for t in times if now - t < window) for n, times in recent.items()}
    if node_id is not None:
        kept[node_id] = (*kept.get(node_id, ()), now)
    return {n: times for n, times in kept.items() if times}


def lost_too_often(times: Sequence[float], limit: int | None) -> bool:
    """Whether a node lost ``limit`` times within the window is quarantined (None: no
    node ever is for losses)."""
    return limit is not None and len(times) >= limit


def join_ends(job: Job, running: Generation, node_id: str) -> str:
    """Why a join ends the running generation: a newcomer wants in, or a member came
    back (its process restarted), and either way the next generation must include it.
    (A newcomer that :func:`parks` ends nothing: the caller asks that first.)

    Raises:
        JobFull: A newcomer, and the generation already has ``max_nodes`` members (and
            the job as many standbys as its spec allows).
    """
    if node_id in running.ranks:
        return f"member {node_id} re-joined"
    if len(running.members) >= job.spec.max_nodes:
        standbys = f" and {job.spec.standbys} standbys" if job.spec.standbys else ""
        raise JobFull(
            f"job {job.job_id!r} runs with max_nodes={job.spec.max_nodes} members{standbys}"
        )
    return f"node {node_id} joined"


def parks(job: Job, running: Generation, node_id: str, standbys: int) -> bool:
    """Whether a node that joins a running generation parks as a standby rather than
    end it: a newcomer (a member that re-joins restarted, and must be let back in), the
    generation full (``max_nodes`` members, so it could only be refused), and fewer
    than ``spec.standbys`` parked already (``standbys``). Parking costs the members
    nothing: they never hear of it."""
    return (
        node_id not in running.ranks
        and len(running.members) >= job.spec.max_nodes
        and standbys < job.spec.standbys
    )


def warms(job: Job, running: Generation, node_id: str, warm: bool) -> bool:
    """Whether a node that joins a running generation parks to warm up rather than end
    it: a hot join (``warm``: its workers start while it parks, and say when they wait
    to train), a newcomer, and room for it (fewer than ``max_nodes`` members). The
    members never wait for its process start: :func:`ready_ends` ends the generation
    once the newcomer is ready."""
    return warm and node_id not in running.ranks and len(running.members) < job.spec.max_nodes


def ready_ends(
    job: Job, running: Generation, node_id: str, round: int, waiting: int = 1
) -> str | None:
    """Why a node whose workers say they wait to train (a wait with ``ready``) ends the
    running generation: it parked for the next round by a hot join (:func:`warms`), is
    no member, the generation has room for it, and (a job that takes only some sizes)
    the ``waiting`` nodes parked for the round, it among them, make a larger size the job
    takes (:func:`grows`). None otherwise: a standby beside a full generation waits for
    a lost slot, one beside a world no newcomer grows waits for a size, and a node whose
    round is open or sealed has nothing to end."""
    if not parked(job, round) or round != job.round:
        return None
    if not warms(job, running, node_id, warm=True):
        return None
    return f"node {node_id} joined" if grows(job, len(running.members), waiting) else None


def sizes(job: Job) -> tuple[int, ...] | None:
    """The world sizes, in nodes, a round of the job may seal: those its spec declares
    (``world_sizes``) that its workers did not rule out (:attr:`~._records.Job.
    learned_sizes`), from ``min_nodes`` to ``max_nodes``, ascending; None: any (neither
    says). Empty: none at all (the job waits for good, and its status says why)."""
    declared, learned = job.spec.world_sizes, job.learned_sizes
    if declared is None and learned is None:
        return None
    spec = job.spec
    allowed = set(range(spec.min_nodes, spec.max_nodes + 1))
    for given in (declared, learned):
        if given is not None:
            allowed.intersection_update(given)
    return tuple(sorted(allowed))


def world_for(job: Job, available: int) -> int | None:
    """The world a round of ``available`` live nodes seals: the largest size the job
    takes (:func:`sizes`) not above them nor ``max_nodes``; the nodes beyond it wait.
    None: they make none (the round does not seal; :func:`size_blocked` says why)."""
    top = min(available, job.spec.max_nodes)
    allowed = sizes(job)
    if allowed is None:
        return top if top >= job.spec.min_nodes else None
    return max((s for s in allowed if s <= top), default=None)


def grows(job: Job, members: int, waiting: int) -> bool:
    """Whether a running generation of ``members`` nodes, with ``waiting`` newcomers
    parked beside it (the one asking included), makes a larger world the job takes, so
    that ending it for them pays. Always, for a job that takes any size (a newcomer
    beyond ``max_nodes`` is refused or parks by the other rules)."""
    allowed = sizes(job)
    return allowed is None or any(members < s <= members + waiting for s in allowed)


def waits_for_size(job: Job, running: Generation, node_id: str, waiting: int) -> bool:
    """Whether a node that joins a running generation parks rather than end it,
    because the job takes only some world sizes and the newcomer, with the ``waiting``
    nodes already parked beside the generation (not counting it), makes no larger one
    (:func:`grows`): ending the generation would only seal the same world again. It
    waits as a standby does, with no join timeout (:func:`parked`): a member's loss or
    enough newcomers to make a larger size take it in. A member that re-joins (its
    process restarted) ends the generation as usual.

    Raises:
        JobFull: As many nodes wait already as the job has places for beyond its
            members (``max_nodes`` and ``standbys`` in all).
    """
    if sizes(job) is None or node_id in running.ranks:
        return False
    members = len(running.members)
    if grows(job, members, waiting + 1):
        return False
    if members + waiting >= job.spec.max_nodes + job.spec.standbys:
        raise JobFull(
            f"job {job.job_id!r} runs {members} nodes with {waiting} waiting for a world "
            f"size it takes ({_listed(sizes(job) or ())}), max_nodes={job.spec.max_nodes}"
        )
    return True


def learned(job: Job, reported: Iterable[int], world_size: int) -> tuple[int, ...]:
    """The world sizes a job keeps from a worker's report that its generation of
    ``world_size`` nodes cannot train (a ``WorldSizeError``): those it names from
    ``min_nodes`` to ``max_nodes``, less ``world_size`` itself, whatever the arithmetic
    said (nodes that run different numbers of processes make the division by one of
    them wrong), so that a report never seals the same world again. It replaces what an
    earlier report taught: the newest report is of the script that runs now."""
    spec = job.spec
    return tuple(
        sorted({s for s in reported if spec.min_nodes <= s <= spec.max_nodes} - {world_size})
    )


def size_refused(job: Job, world_size: int, rank: int, reason: str) -> str:
    """Why a generation ends on a worker's report of the sizes it can take (``job`` as
    it is with them learned): the rank, its error's first line and the sizes now."""
    allowed = sizes(job)
    takes = (
        f"the job takes worlds of {_listed(allowed)} nodes"
        if allowed
        else f"the job takes no world from {job.spec.min_nodes} to {job.spec.max_nodes} nodes"
    )
    said = f": {reason}" if reason else ""
    return f"rank {rank} cannot train a world of {world_size} nodes{said}; {takes}"


def size_blocked(job: Job, available: int | None = None) -> str | None:
    """Why a round does not seal for the world sizes the job takes (None: they do not
    hold it back): it takes none at all, or none that ``available`` live nodes make
    (None: not counted). What ``status`` shows as ``blocked``, and a join's timeout."""
    allowed = sizes(job)
    if allowed is None:
        return None
    spec = job.spec
    if not allowed:
        return (
            f"waiting: the job takes no world from {spec.min_nodes} to {spec.max_nodes} "
            f"nodes (its spec: {_listed(spec.world_sizes or ())}; its workers: "
            f"{_listed(job.learned_sizes or ())})"
        )
    if available is not None and available >= 1 and world_for(job, available) is None:
        return (
            f"waiting: {available} node(s) make no world size the job takes "
            f"({_listed(allowed)} nodes)"
        )
    return None


def parked_reason(job: Job, members: int, waiting: int) -> str:
    """Why the ``waiting`` live nodes parked beside a running generation of ``members``
    nodes wait, for ``status``: a full generation's standbys wait for a lost member,
    those of a world no newcomer grows for a size (:func:`grows`), a hot join for its
    workers to be ready."""
    if members >= job.spec.max_nodes:
        return (
            f"standby: the generation has max_nodes={job.spec.max_nodes} members; "
            "it takes a lost member's place"
        )
    if not grows(job, members, waiting):
        return (
            f"standby: {members} members and {waiting} waiting make no larger world size "
            f"the job takes ({_listed(sizes(job) or ())} nodes); it takes a lost member's "
            "place, or goes in with enough newcomers for one"
        )
    return "hot join: the generation ends for it once its workers wait to train"


def _listed(sizes: Iterable[int], limit: int = 12) -> str:
    shown = list(sizes)
    text = ", ".join(map(str, shown[:limit])) or "none"
    return text + (f", ... ({len(shown)} in all)" if len(shown) > limit else "")


def parked(job: Job, round: int) -> bool:
    """Whether a node registered for ``round`` waits as a standby: its round is the one
    after a generation that runs. It waits as long as that generation does, so the join
    timeout does not run against it (a standby that timed out would leave the job with
    none at the moment it needs one)."""
    return job.status == "sealed" and round > job.generation


def released(job: Job, round: int, joined_at: float) -> bool:
    """Whether a node registered for ``round`` is a standby to let go: it parked beside
    the generation that ended last (it registered for this open round before that end),
    and a member ended that generation by leaving because its workers finished training
    (reason :data:`~rallypoint.client.models.FINISHED`). The job is done: sealing the
    standby would start a run of its own, and leaving it waiting would end its agent in
    a join timeout (a failed pod). A node that registers after the end (a new run under
    the same job id) waits and seals as usual."""
    end = job.last_end
    return (
        job.status == "open"
        and round == job.round
        and joined_at < job.changed_at
        and end is not None
        and end[0] == job.generation
        and end[1].endswith(f" left: {FINISHED}")
    )


def alive(
    registered: Iterable[Node], beats: Mapping[str, float], now: float, since: float, timeout: float
) -> list[Node]:
    """The nodes registered for a round that still count: heard from within ``timeout``
    (their last beat, or ``since``: the end of a silence nobody could hear through, a
    coordinator's start or a storage outage)."""
    return [n for n in registered if now - max(beats.get(n.node_id, -math.inf), since) < timeout]


def ranked(waiting: Iterable[Node], previous: Mapping[str, int]) -> list[Node]:
    """Rank order: the last generation's survivors first, in their old order (stable
    ranks), then newcomers in the order they joined."""
    return sorted(
        waiting, key=lambda n: (previous.get(n.node_id, math.inf), n.joined_at, n.node_id)
    )


def standing_by(ordered: Sequence[Node], previous: Mapping[str, int], since: float) -> list[Node]:
    """The standbys among a round's nodes (in :func:`ranked` order): the newcomers that
    registered for it before ``since``, when the generation they parked beside ended.
    They parked in this order, the order :func:`keeper` deals the slots out in."""
    return [n for n in ordered if n.node_id not in previous and n.joined_at < since]


def keeper(slot: int, parked: Sequence[Node]) -> Node | None:
    """The standby that holds a copy of node rank ``slot``'s checkpoint files, and so
    takes that slot if its member is lost (:func:`slotted`): the standbys, in the order
    they parked, deal the slots out round-robin, each holding every K-th. One standby
    holds them all; K spread a save's copies over K nodes rather than one."""
    return parked[slot % len(parked)] if parked else None


def slotted(
    chosen: Sequence[Node],
    previous: Mapping[str, int],
    size: int | None = None,
    parked: Sequence[Node] = (),
) -> list[Node]:
    """The first ``size`` (default: all) of the chosen nodes (in :func:`ranked` order)
    in rank order: a survivor keeps its old rank wherever the new world has it, those
    whose rank is gone fill the free ranks first, then the newcomers, each free rank
    going to its :func:`keeper` among the ``parked`` standbys if it is here, else to the
    newcomers in :func:`ranked` order. So a replacement takes a lost member's rank (a
    standby the one whose files it holds), and every other member keeps its own: its
    files of the version are in its own memory tier, and a ZeRO or tensor-parallel
    layout is the same rank for rank. (Compacting the survivors instead moved every
    member above the lost one down a rank.)"""
    world = len(chosen) if size is None else min(size, len(chosen))
    slots: list[Node | None] = [None] * world
    movers: list[Node] = []
    newcomers: list[Node] = []
    for node in chosen:
        old = previous.get(node.node_id)
        if old is not None and old < world and slots[old] is None:
            slots[old] = node
        else:
            (newcomers if old is None else movers).append(node)
    free = [r for r, node in enumerate(slots) if node is None]
    for r, node in zip(free, movers, strict=False):
        slots[r] = node
    for r in free[len(movers) :]:
        held = keeper(r, parked)
        pick = held if held is not None and held in newcomers else newcomers[0]
        newcomers.remove(pick)
        slots[r] = pick
    return [node for node in slots if node is not None]


def seal_waits(
    job: Job,
    waiting: Sequence[Node],
    previous: Mapping[str, int],
    beats: Mapping[str, float],
    gone: set[str],
    now: float,
) -> list[float]:
    """When a round short of ``max_nodes`` (with at least ``min_nodes`` alive) may seal:
    the times it waits for; none: now.

    ``last_call`` gathers newcomers, so a round with one that registered since the last
    generation ended (or the first round) waits for it; newcomers that parked beside
    that generation (standbys, hot joins) were gathered while it ran. A round after
    a restart also waits for every member of the last generation that is neither
    back, nor ``gone`` (left), nor silent past the heartbeat timeout: it is restarting,
    and sealing without it would only end the next generation when it comes back (a
    process that restarts slower than ``last_call`` would otherwise cost a restart
    each time). A round of survivors only seals at once.
    """
    spec = job.spec
    back = {n.node_id for n in waiting}
    waits: list[float] = []
    # Newcomers that parked beside the generation (standbys, hot joins: registered
    # before it ended) are gathered already; only one that came since calls for more.
    called = any(n.node_id not in previous and n.joined_at >= job.changed_at for n in waiting)
    if not previous or called:
        quorum_at = sorted(n.joined_at for n in waiting)[spec.min_nodes - 1]
        deadline = quorum_at + spec.last_call.total_seconds()
        if now < deadline:
            waits.append(deadline)
    timeout = spec.heartbeat_timeout.total_seconds()
    expiries = (beats.get(n, -math.inf) + timeout for n in previous.keys() - back - gone)
    waits.extend(t for t in expiries if t > now)
    return waits


def silent(
    job: Job,
    running: Generation,
    beats: Mapping[str, float],
    cut: set[str],
    since: float,
    now: float,
) -> tuple[str | None, float, str | None]:
    """Whether a running generation ends for a member's silence.

    Args:
        beats: Each node's last beat.
        cut: Nodes whose heartbeat connection was cut and that did not beat since.
        since: When every member's clock starts at the latest: the seal (a member was
            alive to be chosen), this coordinator's start, or the end of the last storage
            outage it saw. Neither kills a job for heartbeats nobody could deliver.

    Returns:
        Why it ends (None: it runs on), the seconds until this can next change, and the
        member that was lost (a loss counts towards :func:`lost_too_often`).
    """
    members = running.members
    dropped = [m.node_id for m in members if m.node_id in cut]
    if dropped:
        return f"node {dropped[0]} dropped its heartbeat connection", 0.0, dropped[0]
    timeout = job.spec.heartbeat_timeout.total_seconds()
    last = {m.node_id: max(beats.get(m.node_id, 0.0), since) for m in members}
    late = sorted((t, n) for n, t in last.items() if now - t >= timeout)
    if late:
        t, node_id = late[0]
        return f"node {node_id} missed heartbeats for {now - t:.1f} s", 0.0, node_id
    return None, min(last.values()) + timeout - now, None


def corroborated(
    node_id: str, cut_at: float, faults: Mapping[str, float], reconnect: float
) -> bool:
    """Whether a member's cut heartbeat watch counts at once, before its reconnect window.

    A cut alone may be the network's (a balancer that dropped the connection, a replica
    that went), and a live node reconnects within the window. A collective of the same
    generation that failed on another member is the data plane seeing the same death: a
    connection cut between a node and its coordinator fails no collective between the
    nodes. The death reaches both within milliseconds, in either order (a collective
    fails at once in a transfer, or at the next one, up to a step later).

    Args:
        node_id: The member whose watch was cut.
        cut_at: When the cut was seen.
        faults: When each member of the generation last reported a failed collective.
        reconnect: The reconnect window: a report that old before the cut still counts.

    Returns:
        True if a member other than ``node_id`` reported a failed collective at most
        ``reconnect`` before the cut, or since. The node's own report does not count: it
        shows the node alive.
    """
    return any(at >= cut_at - reconnect for n, at in faults.items() if n != node_id)


def verdict(job: Job, node_id: str, generation: int | None) -> Literal["continue", "restart"]:
    """What a heartbeat is told, given a recent job snapshot: ``restart`` when the
    node's generation is not the job's running one (a member died or left, a node wants
    in); a waiting node (no generation) is kept alive.

    Raises:
        StaleGeneration: The generation is newer than any the job sealed.
    """
    if generation is None:
        return "continue"
    if generation > job.generation:
        raise StaleGeneration(
            f"generation {generation} of job {job.job_id!r} was never sealed "
            f"(latest is {job.generation})"
        )
    if generation < job.generation or job.status != "sealed":
        return "restart"
    return "continue"


#: Seconds after its generation ended during which a member's beats still count, though
#: each is told to restart: torch's agent stops its workers with SIGTERM and gives them
#: 30 s before SIGKILL (``LocalElasticAgent._shutdown``), then joins again.
RESTART_GRACE = 30.0


def restarting(job: Job, generation: int | None, now: float) -> bool:
    """Whether a heartbeat told to restart (:func:`verdict`) still keeps its node alive:
    it is of the job's last generation, which ended at most :data:`RESTART_GRACE` ago,
    and no round sealed since. Its agent is stopping its workers to join again, and the
    round waits for it (:func:`seal_waits`) while it beats, where a node whose workers
    took longer than the heartbeat timeout to stop was left out (its last beat from
    before the end) and its join then ended the generation sealed without it. A node
    that hangs while it stops is waited for :data:`RESTART_GRACE` at most."""
    return (
        generation is not None
        and generation == job.generation
        and job.status != "sealed"
        and now - job.changed_at <= RESTART_GRACE
    )


def end_reason(job: Job, generation: int | None) -> str | None:
    """Why the member's ``generation`` ended, for a heartbeat told to restart: the job
    row keeps the reason of the generation that ended last; a member of an earlier one
    (several ended since) is told none."""
    if generation is None or job.last_end is None or job.last_end[0] != generation:
        return None
    return job.last_end[1]


def load_streak(streak: LoadFailure | None, ended: LoadFailure | None) -> LoadFailure | None:
    """The job's run of load failures once a generation ends (``ended``: its load
    failure; None: it ended for another reason, which breaks the run). A failure of the
    same version at the same world size as the run's extends it; any other starts one."""
    if ended is None:
        return None
    same = streak is not None and (streak.version, streak.world_size) == (
        ended.version,
        ended.world_size,
    )
    return ended.model_copy(update={"count": streak.count + 1 if same and streak else 1})


def load_blocked(
    streak: LoadFailure | None, world_size: int, resume: CheckpointPointer | None
) -> str | None:
    """Why a round of ``world_size`` nodes that would resume from ``resume`` must not
    seal (None: it may): the last :data:`LOAD_FAILURES_BEFORE_BLOCK` generations or more
    failed to load that very version at that very size, so a third would only fail the
    same way and the job would loop. A round of another size, or one that resumes from
    another version, seals as usual."""
    if streak is None or resume is None:
        return None
    if (resume.version, world_size) != (streak.version, streak.world_size):
        return None
    return held_back(streak)


def held_back(streak: LoadFailure | None) -> str | None:
    """Why a round of the run's world size that resumes from its version waits (None:
    the run is too short to hold anything back): what ``status`` shows as ``blocked``."""
    if streak is None or streak.count < LOAD_FAILURES_BEFORE_BLOCK:
        return None
    return blocked_reason(streak)


def blocked_reason(streak: LoadFailure) -> str:
    """How a blocked round reads in ``status``, on the page and in a join's timeout."""
    return (
        f"waiting: v{streak.version} failed to load at world {streak.world_size} in "
        f"{streak.count} generations in a row (rank {streak.rank}: {streak.reason}); "
        f"a world of another size can resume"
    )
