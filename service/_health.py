"""Progress, hangs and stragglers: the rules, in one place.

Liveness is not progress: a rank can be alive and stuck (a hung collective, a frozen
GPU, a deadlocked loader) or alive and slow (a throttled GPU, a noisy neighbour), and
either holds every other rank with it. Each node's heartbeat carries its processes'
progress (:class:`~rallypoint.client.models.RankProgress`: the step, how long since it
last showed progress, its step interval and its own step time), and these rules judge
it. Like :mod:`._seal`, each is a function of what storage said and the time, with no
storage and no clock of its own; :class:`~._rendezvous.Rendezvous` reads the beats and
writes what they decide. What makes it ask:

- a tick of a running generation (:meth:`~._rendezvous.Rendezvous.tick`, after
  :func:`._seal.silent`): :func:`hung` names a rank whose progress stopped for longer
  than its bound (:func:`hang_limit` while it trains, ``phase_limit`` in a long phase),
  and the generation ends for it (:class:`Hang` says why); its node hangs once more
  (:func:`hangs`, :func:`hung_too_often`: quarantined at :data:`HANGS_BEFORE_QUARANTINE`);
- the seal of the round after a hang: :func:`sits_out` leaves the hung node out where
  the others can train without it;
- a beat whose progress shows a rank past the limit (``routers/jobs``): the driver
  ticks at once rather than at its next pass (:func:`overdue`);
- a tick that reads the members' progress (:func:`reads_progress`: when a beat asked,
  a hang waits for beats, the limit is not known, or every :data:`PROGRESS_EVERY`
  seconds; other ticks read only the beats' stamps), in a new straggler window
  (:func:`window_of`): :func:`scores` rates each
  rank's own step time against the fastest's, :func:`next_window` counts the windows in
  a row each stays under the threshold, and :func:`stragglers` names those past
  :data:`~rallypoint.client.models.STRAGGLER_WINDOWS`; :func:`straggler_action` says
  whether the job's policy replaces or drops one now;
- a generation's end (:meth:`~._rendezvous.Rendezvous.end_generation`):
  :func:`stalled` counts the generations in a row that made no progress (no new
  version, no step past the best before), and past :data:`STALLS_BEFORE_BLOCK` a round
  does not seal (:func:`stall_blocked`): the job stops restarting rather than loop.

No false ends: a loaded machine or a slow storage is not a hang. The limit grows with
the job's own step intervals, the long phases (start-up and the first step, a save, a
load, an evaluation) are bounded apart by ``phase_limit``, and what a rank reports is
measured on its node (``idle``), so a beat that reaches the coordinator late (a storage
outage, a replica's loss) does not age it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rallypoint.client.models import (
    HANG_FACTOR,
    HANG_FLOOR,
    STRAGGLER_WINDOW,
    STRAGGLER_WINDOWS,
    JobSpec,
    Phase,
    RankProgress,
    Straggler,
    hang_reason,
)

__all__ = [
    "HANGS_BEFORE_QUARANTINE",
    "MAX_WATCHED",
    "PROGRESS_EVERY",
    "STALLS_BEFORE_BLOCK",
    "Hang",
    "Heard",
    "LimitSource",
    "Window",
    "hang_limit",
    "hangs",
    "hung",
    "hung_too_often",
    "next_window",
    "overdue",
    "reads_progress",
    "scores",
    "sits_out",
    "stall_blocked",
    "stalled",
    "straggler_action",
    "stragglers",
    "window_of",
]

#: The ranks under the straggler threshold whose streaks the job's record keeps, the
#: slowest first: the record is one table row, and Azure takes 64 KiB a property (256
#: entries of the longest ids fit). More under it at once is the fastest rank that is the
#: outlier, not these.
MAX_WATCHED = 256

#: Hangs of one node within the coordinator's hang window that quarantine it: one may
#: be bad luck (a driver's hiccup), a second within the hour is the machine.
HANGS_BEFORE_QUARANTINE = 2
#: Generations in a row without progress after which a round does not seal: the job
#: stops restarting, and says why (three, so that a hang, its restart that failed to
#: load, and one more try all get their chance).
STALLS_BEFORE_BLOCK = 3

LimitSource = Literal["set", "learned", "floor", "off", "warming"]
#: How soon a tick looks again while a hang waits for a member's beat.
_RECHECK_S = 0.1
#: Seconds after which a replica's tick reads its members' progress though nothing
#: asked it to (:func:`reads_progress`).
PROGRESS_EVERY = 2.0


@dataclass(frozen=True)
class Heard:
    """What a node's last heartbeat said of its processes.

    Attributes:
        node_id: The node.
        at: When the beat arrived (the rendezvous clock).
        generation: The generation it beat for.
        progress: Its processes' progress (empty: it reported none).
    """

    node_id: str
    at: float
    generation: int
    progress: tuple[RankProgress, ...] = ()


@dataclass(frozen=True)
class Hang:
    """A rank that made no progress past its bound."""

    node_id: str
    rank: int
    phase: Phase
    step: int
    idle: float
    limit: float

    @property
    def reason(self) -> str:
        """How the generation's end reads (``rank 2 on node n3 hung: ...``)."""
        return hang_reason(self.rank, self.node_id, self.phase, self.step, self.idle, self.limit)


def hang_limit(
    spec: JobSpec, heard: Iterable[Heard], last: float | None = None
) -> tuple[float | None, LimitSource]:
    """The job's hang limit for training steps, in seconds, and where it comes from.

    ``spec.hang_limit`` if set (0: hangs are not judged, ``off``); else
    :data:`~rallypoint.client.models.HANG_FACTOR` times the largest 95th percentile step
    interval a rank reported, at least :data:`~rallypoint.client.models.HANG_FLOOR`.
    While no rank reports an interval (too few steps: a generation that just began),
    the limit learned ``last``, if any: a rank that hangs in a generation's first steps
    is found as soon as in its hundredth. None (``warming``) before the job's first:
    only ``phase_limit`` bounds it then.
    """
    if spec.hang_limit is not None:
        fixed = spec.hang_limit.total_seconds()
        return (None, "off") if fixed == 0 else (fixed, "set")
    intervals = [p.interval for h in heard for p in h.progress if p.interval is not None]
    if not intervals:
        if last is not None:
            return last, "learned" if last > HANG_FLOOR else "floor"
        return None, "warming"
    learned = HANG_FACTOR * max(intervals)
    return (learned, "learned") if learned > HANG_FLOOR else (HANG_FLOOR, "floor")


def _bound(spec: JobSpec, phase: Phase, limit: float | None) -> float | None:
    """The seconds a rank in ``phase`` may show no progress (None: not judged)."""
    if spec.hang_limit is not None and spec.hang_limit.total_seconds() == 0:
        return None
    if phase == "train" and limit is not None:
        return limit
    return spec.phase_limit.total_seconds()


def _stuck(p: RankProgress) -> float:
    """The seconds a rank showed no progress while it could have: its ``idle`` less the
    time its process waited for a CPU (a rank that other work on its machine starves is
    slow, not stuck; a stopped or sleeping process waits for none)."""
    return p.idle - min(p.starved or 0.0, p.idle)


def hung(
    spec: JobSpec,
    generation: int,
    members: Iterable[str],
    heard: Mapping[str, Heard],
    limit: float | None,
    trained: bool = True,
) -> tuple[Hang | None, float]:
    """The hung rank of the running ``generation``, if one is.

    A rank is past its bound when its node says it showed no progress for longer (its
    ``idle``, measured on its node up to its beat: nothing is guessed of what it did
    since, so a beat that arrives late proves nothing). Once one is, every rank that
    waits for it in a collective soon is too. They say so (``waiting``: their gradients
    are ready for the all-reduce, or they are in one of the trainer's own collectives);
    the hung rank does not, unless it stopped inside a collective: then its process's
    state, which its node reads from the kernel, tells it apart (``stopped`` by a signal
    or a tracer, ``blocked`` in a driver's call), where its peers' sleep in the wait.
    So the rule waits until every member has beaten since the first rank passed its
    bound (their nodes beat at once when theirs do: :func:`overdue`), and names, among
    the ranks past their bound: one whose process cannot run (stopped, blocked), which
    no peer's report can excuse (a peer may wait in a collective the reporter does not
    see, such as a framework's own metric sync, and stopped stepping first); else one
    that does not wait; the one whose progress stopped first if several (or none: a
    collective itself that hangs).
    A member that does not beat again is left to :func:`._seal.silent`: its node, not
    one of its peers, is lost. A rank whose peers all finished and exited holds nobody:
    it is on its way out, not hung.

    A rank's no progress counts without the time its process waited for a CPU
    (``starved``, its node's kernel's count): a machine whose CPUs other work keeps busy
    slows it, and it holds its peers as a long phase does while that keeps it within
    its bound.

    A rank still in ``start`` is judged only once the job is known to step: some rank
    of it trained, in this generation or an earlier one (``trained``). A loop whose
    optimizer is none the reporter hooks never leaves ``start``, and must not be ended
    for it. And while a rank is in a long phase within its bound (a first step that
    compiles, an evaluation, a save), the ranks that train are not judged against the
    hang limit: they wait for it.

    Args:
        spec: The job's (``hang_limit``, ``phase_limit``).
        generation: The running generation.
        members: Its members' node ids.
        heard: Each node's last beat.
        limit: :func:`hang_limit`'s.
        trained: Whether a rank of the job trained in an earlier generation.

    Returns:
        The hung rank (None: none, or not known yet), and the seconds until this may
        next change without a beat (``math.inf``: only a beat can change it).
    """
    ids = list(members)
    current = {n: heard[n] for n in ids if n in heard and heard[n].generation == generation}
    # At every tick of a healthy job no rank is anywhere near a bound: one pass of plain
    # comparisons over the ranks says so (a rank within its bound by ``idle`` is within
    # it by its stuck time too), rather than the rule's calls for each rank (a tick of
    # 1,024 nodes of 8 ranks judges 8,192).
    bounds = [
        b for b in (_bound(spec, "train", limit), _bound(spec, "eval", limit)) if b is not None
    ]
    least = min(bounds, default=None)
    if least is None or all(p.idle <= least for b in current.values() for p in b.progress):
        return None, math.inf
    if len(ids) > 1 and sum(len(b.progress) for b in current.values()) <= 1:
        # One rank left of several: the others finished and exited, and this one is on
        # its way out (a last save, its exit). A hang holds peers that wait for it.
        return None, math.inf
    trained = trained or any(p.phase != "start" for b in current.values() for p in b.progress)
    # (its last progress, the rank, whether it waits, whether its process may run)
    over: list[tuple[float, Hang, bool, bool]] = []
    crossed = math.inf
    # A rank in a long phase within its bound (a first step that compiles, an
    # evaluation that rank 0 runs alone) holds its peers: past the hang limit, they wait
    # for it. So does a rank past it only for the time it waited for a CPU. Only a rank
    # past its own bound is judged then.
    held = any(
        (bound := _bound(spec, p.phase, limit)) is not None
        and _stuck(p) <= bound
        and (p.phase != "train" or p.idle > bound)
        for b in current.values()
        for p in b.progress
    )
    for beat in current.values():
        for p in beat.progress:
            if (p.phase == "start" and not trained) or (p.phase == "train" and held):
                continue
            bound = _bound(spec, p.phase, limit)
            if bound is None or _stuck(p) <= bound:
                continue
            last = beat.at - _stuck(p)
            crossed = min(crossed, last + bound)
            hang = Hang(beat.node_id, p.rank, p.phase, p.step, p.idle, bound)
            over.append((last, hang, p.waiting, p.process in ("sleeping", "running", None)))
    if not over:
        return None, math.inf
    if any(n not in current or current[n].at < crossed for n in ids):
        return None, _RECHECK_S  # a member has not said yet where it stands
    return min(over, key=lambda o: (o[3], o[2], o[0], o[1].node_id, o[1].rank))[1], 0.0


def reads_progress(
    urgent: bool, last_read: float | None, now: float, source: LimitSource, rechecking: bool
) -> bool:
    """Whether a tick of a running generation reads its members' progress, or only their
    beats' stamps. A tick comes every half second, and 1,024 nodes' progress is a
    megabyte of rows to read and parse; what it serves mostly comes through the beats.
    It reads it when:

    - ``urgent``: a beat through this replica showed a rank past its bound
      (:func:`overdue`: the hang rule judges now);
    - ``rechecking``: its last read found a rank past its bound and waits for its
      peers' beats (:func:`hung`'s recheck);
    - the limit is not known here yet (``warming``; a replica that just started, a job's
      first steps): the beats' check needs it;
    - ``last_read`` is :data:`PROGRESS_EVERY` old, or none: the limit learned again,
      the straggler window scored (its windows are longer), and a backstop for a beat
      the check missed (one that came before the limit was learned).
    """
    return (
        urgent
        or rechecking
        or source == "warming"
        or last_read is None
        or now - last_read >= PROGRESS_EVERY
    )


def sits_out(
    last_hang: tuple[int, str, int] | None, ended: int, waiting: Sequence[str], min_nodes: int
) -> str | None:
    """The node a round seals without although it waits: the one whose rank hung in the
    generation that just ended (``ended``), where the others make ``min_nodes`` without
    it. Its workers start again while the others train; it comes back in as a hot join
    does (its join parks for the next round), so the others never wait for its start."""
    if last_hang is None or last_hang[0] != ended or last_hang[1] not in waiting:
        return None
    return last_hang[1] if len(waiting) - 1 >= min_nodes else None


def overdue(spec: JobSpec, progress: Sequence[RankProgress], limit: float | None) -> bool:
    """Whether a beat's progress shows a rank past its bound: the driver ticks now."""
    for p in progress:
        bound = _bound(spec, p.phase, limit)
        if bound is not None and _stuck(p) > bound:
            return True
    return False


def hangs(
    recent: Mapping[str, Sequence[float]], node_id: str, now: float, window: float
) -> dict[str, tuple[float, ...]]:
    """The job's hangs within ``window`` seconds of ``now``, with ``node_id``'s at
    ``now``; older ones dropped, so the record stays small."""
    kept = {n: tuple(t for t in times if now - t < window) for n, times in recent.items()}
    kept[node_id] = (*kept.get(node_id, ()), now)
    return {n: times for n, times in kept.items() if times}


def hung_too_often(times: Sequence[float]) -> bool:
    """Whether a node that hung at these times (within the window) is quarantined."""
    return len(times) >= HANGS_BEFORE_QUARANTINE


# --- stragglers ----------------------------------------------------------------------


def window_of(now: float) -> int:
    """The straggler window ``now`` falls in (every replica numbers them alike)."""
    return math.floor(now / STRAGGLER_WINDOW)


def scores(
    generation: int, members: Iterable[str], heard: Mapping[str, Heard]
) -> dict[tuple[str, int], float]:
    """Each training rank's relative score: the fastest rank's own step time over its
    own (1.0 for the fastest; NVRx's relative score). Only ranks that train and report
    an own step time are scored, and only with two or more of them.

    Ranks that wait for a slow peer are not scored down: their own time leaves out the
    wait for its gradients, which is where a data-parallel rank waits for the others.
    """
    owns: dict[tuple[str, int], float] = {}
    for node_id in members:
        beat = heard.get(node_id)
        if beat is None or beat.generation != generation:
            continue
        for p in beat.progress:
            if p.phase == "train" and p.own is not None and p.own > 0:
                owns[(node_id, p.rank)] = p.own
    if len(owns) < 2:
        return {}
    fastest = min(owns.values())
    return {key: fastest / own for key, own in owns.items()}


@dataclass(frozen=True)
class Window:
    """What the job keeps of its straggler windows (the ``health`` row).

    Attributes:
        index: The last window scored (:func:`window_of`).
        generation: The generation it scored.
        scores: The score in it of each rank it watches (in ``streaks``).
        streaks: The windows in a row each rank has been under the threshold.
        since: When each straggler was first named (epoch seconds).
    """

    index: int = -1
    generation: int = 0
    scores: Mapping[tuple[str, int], float] = field(default_factory=dict)
    streaks: Mapping[tuple[str, int], int] = field(default_factory=dict)
    since: Mapping[tuple[str, int], float] = field(default_factory=dict)


def next_window(
    last: Window,
    index: int,
    generation: int,
    rated: Mapping[tuple[str, int], float],
    threshold: float,
    now: float,
) -> Window:
    """The windows' record after window ``index`` rated the ranks ``rated``.

    A rank's streak grows by one in each window it is under ``threshold``, and ends in
    one it is not; a new generation starts every streak again (its world, its pace and
    its ranks are new). A window with no rating (the ranks save, load, or have too few
    steps) neither grows nor ends a streak.
    """
    streaks = dict(last.streaks) if last.generation == generation else {}
    since = dict(last.since) if last.generation == generation else {}
    scores = dict(rated) or dict(last.scores)
    if rated:
        under = sorted((score, k) for k, score in rated.items() if score < threshold)
        streaks = {k: streaks.get(k, 0) + 1 for _, k in under[:MAX_WATCHED]}
        for key, n in streaks.items():
            if n >= STRAGGLER_WINDOWS and key not in since:
                since[key] = now
    since = {k: t for k, t in since.items() if k in streaks}
    # The record keeps the ranks it watches, not every rank's score: a job's scores are
    # read from its beats where they are shown (a row of 8,192 ranks' scores was 390 KB,
    # where Azure takes 64 KiB a property).
    return Window(index, generation, {k: scores[k] for k in streaks if k in scores}, streaks, since)


def stragglers(window: Window) -> list[Straggler]:
    """The ranks under the threshold for :data:`~rallypoint.client.models.
    STRAGGLER_WINDOWS` windows in a row, slowest first."""
    named = [
        Straggler(
            node_id=node_id,
            rank=rank,
            score=window.scores.get((node_id, rank), 0.0),
            windows=n,
            since=window.since.get((node_id, rank), 0.0),
        )
        for (node_id, rank), n in window.streaks.items()
        if n >= STRAGGLER_WINDOWS
    ]
    return sorted(named, key=lambda s: (s.score, s.node_id, s.rank))


def straggler_action(
    spec: JobSpec,
    straggler: Straggler,
    world: int,
    standbys: int,
    heard_owns: Mapping[str, float],
    allowed: Sequence[int] | None = None,
) -> Literal["replace", "drop"] | None:
    """Whether the job's policy acts on ``straggler`` now (None: it is only reported).

    - ``replace``: with a standby parked beside the generation, the straggler's node is
      quarantined, which ends the generation, and the standby takes its slot (a
      replacement that reads nothing, as standbys do).
    - ``drop``: the node is left out (quarantined) only where the world without it is
      allowed (``min_nodes``, and ``allowed`` sizes if the job has them) and predicted to
      be faster: at a kept global batch, each of the ``world - 1`` nodes left does
      ``world / (world - 1)`` of the work, so the step takes the slowest of them that
      much longer, which must be less than the straggler's own step.

    Args:
        world: The generation's nodes.
        standbys: Standbys parked beside it.
        heard_owns: Each member node's slowest own step time (seconds).
        allowed: The world sizes the job can take (None: any).
    """
    if spec.straggler == "replace":
        return "replace" if standbys > 0 else None
    if spec.straggler != "drop":
        return None
    left = world - 1
    if left < max(1, spec.min_nodes) or (allowed is not None and left not in allowed):
        return None
    mine = heard_owns.get(straggler.node_id)
    others = [own for node, own in heard_owns.items() if node != straggler.node_id]
    if mine is None or not others:
        return None
    return "drop" if max(others) * world / left < mine else None


# --- no loop --------------------------------------------------------------------------


def stalled(
    count: int, best_step: int, ended_step: int | None, committed: bool, fault: bool
) -> tuple[int, int]:
    """The job's generations in a row without progress, and its best step, once a
    generation ends.

    One that reached a step past ``best_step`` (what any rank of it reported) or
    committed a version made progress, and starts the count again. One that made none
    and ended for a fault (a member lost, hung, restarted or unable to load) counts;
    one that ended for growth or a departure (a node joined, left, was removed) is no
    loop, and leaves the count as it was, as does one whose ranks reported no progress
    at all (nodes that do not report: nothing is known of their steps).

    Args:
        count: The generations in a row without progress before this one.
        best_step: The best step any generation reached before (-1: none).
        ended_step: The best step this one's ranks reported (None: none reported).
        committed: Whether a version was committed while it ran.
        fault: Whether it ended for a fault.
    """
    if committed or (ended_step is not None and ended_step > best_step):
        return 0, max(best_step, -1 if ended_step is None else ended_step)
    return (count + 1 if fault and ended_step is not None else count), best_step


def stall_blocked(count: int, reasons: Sequence[str]) -> str | None:
    """Why a round does not seal after ``count`` generations in a row without progress
    (None: it may): what ``status`` shows as ``blocked``."""
    if count < STALLS_BEFORE_BLOCK:
        return None
    last = "; ".join(reasons[-STALLS_BEFORE_BLOCK:])
    return (
        f"blocked: no progress in {count} generations in a row (no new version, no step "
        f"past the best); the last ended: {last}"
    )
