"""A job's timeline: its history as one model, and that model drawn as SVG.

Pure functions of what storage said and the time, with no storage and no clock of their
own (as :mod:`._seal`), so each rule reads, and is tested, as a rule:

- :func:`cause`: what ended a generation, in one word, from the reason the coordinator
  recorded (:mod:`._seal`, :meth:`~._rendezvous.Rendezvous.leave` and ``remove``,
  :mod:`._checkpoints` write them);
- :func:`timeline`: the generations (the last :data:`TIMELINE_GENERATIONS`), the
  versions kept and those collected lately, the pointers, as the wire's
  :class:`~rallypoint.client.models.Timeline`;
- :func:`svg`: that drawn for the status page: world size over time with one bar per
  generation, a marker per restart coloured by its cause, a mark per checkpoint by
  tier, the latest and durable pointers, quarantined and unrecoverable versions. Hover
  text is SVG ``<title>``; the drawing references nothing outside itself (no script, no
  font, no image), so it works on a cluster without internet access. Every element a
  test or a person may look for has a class and ``data-*`` attributes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from html import escape
from typing import Literal, Protocol

from rallypoint.client.models import (
    TIMELINE_GENERATIONS,
    CheckpointInfo,
    CheckpointPointer,
    GenerationInfo,
    JobSummary,
    Timeline,
    TimelineCause,
    TimelineGeneration,
    TimelineVersion,
)
from rallypoint.times import span, utc

__all__ = ["CAUSE_COLOURS", "HEIGHT", "WIDTH", "Recorded", "as_entry", "cause", "svg", "timeline"]

# The reasons' first words, as the coordinator writes them (node ids have no spaces).
_CAUSES: tuple[tuple[re.Pattern[str], TimelineCause], ...] = (
    (re.compile(r"node \S+ (dropped its heartbeat connection|missed heartbeats)"), "lost"),
    (re.compile(r"node \S+ left: preempted\b"), "preempted"),
    (re.compile(r"node \S+ left\b"), "left"),
    # The job's straggler policy took it out (replace, drop): a quarantine of its own.
    (re.compile(r"node \S+ quarantined: straggler\b"), "straggler"),
    # The operator took it out: removed, or quarantined (never admitted again).
    (re.compile(r"node \S+ (removed|quarantined)\b"), "removed"),
    (re.compile(r"node \S+ joined\b"), "joined"),
    (re.compile(r"member \S+ re-joined\b"), "rejoined"),
    (re.compile(r"checkpoint v\d+ quarantined\b"), "quarantined"),
    (re.compile(r"checkpoint v\d+ unrecoverable\b"), "unrecoverable"),
    (re.compile(r"rank \d+ could not load v\d+:"), "load_failed"),
    (re.compile(r"rank \d+ on node \S+ hung\b"), "hung"),
    (re.compile(r"rank \d+ cannot train a world of \d+ nodes\b"), "world_size"),
)

#: The restart markers' colours, by cause (the legend says which is which).
CAUSE_COLOURS: dict[TimelineCause, str] = {
    "lost": "#c62828",
    "hung": "#d84315",
    "straggler": "#827717",
    "preempted": "#ef6c00",
    "left": "#757575",
    "removed": "#5d4037",
    "joined": "#2e7d32",
    "rejoined": "#6a1b9a",
    "quarantined": "#ad1457",
    "unrecoverable": "#4e342e",
    "load_failed": "#f9a825",
    "world_size": "#00838f",
    "other": "#455a64",
}
_WORDS: dict[TimelineCause, str] = {
    "lost": "node lost",
    "hung": "rank hung",
    "straggler": "straggler replaced",
    "preempted": "preemption notice",
    "left": "node left",
    "removed": "node removed",
    "joined": "node joined",
    "rejoined": "member restarted",
    "quarantined": "quarantine",
    "unrecoverable": "unrecoverable checkpoint",
    "load_failed": "load failed",
    "world_size": "world size refused",
    "other": "other",
}

#: The drawing's size in user units (it scales to the page's width; a legend of more
#: than two rows adds to its height).
WIDTH = 960
HEIGHT = 272
_LEFT, _RIGHT = 44, 16
_WORLD_TOP, _WORLD_BOTTOM = 34, 140  # the world-size lane
_MARKER_Y = 24  # restart markers, above it
_CKPT_Y = 190  # checkpoint marks; pointers above them
_MARK_GAP = 12  # the least distance between two checkpoint marks
_AXIS_Y = 210
_LEGEND_Y, _LEGEND_ROW = 244, 18
_DURABLE, _MEMORY, _PENDING, _POINTER, _BAD = "#2e7d32", "#f9a825", "#9e9e9e", "#1565c0", "#c62828"
# Tick spacings a person reads easily, in seconds.
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)
_DAY = 86400


def cause(reason: str | None) -> TimelineCause | None:
    """What ended a generation, in one word, from its ``ended_reason``; None for none.

    A generation that ended after a member's heartbeat connection was cut names the cut
    first ("node b dropped its heartbeat connection (then: member a re-joined)"), so a
    kill reads as the node lost, not as the survivor's re-join it caused.
    """
    if reason is None:
        return None
    for pattern, found in _CAUSES:
        if pattern.match(reason):
            return found
    return "other"


class Recorded(Protocol):
    """What the timeline shows of a version: a kept one's record, or a collected one's."""

    @property
    def version(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def created_at(self) -> float: ...
    @property
    def committed_at(self) -> float | None: ...
    @property
    def durability(self) -> Literal["pending", "memory", "durable"]: ...
    @property
    def quarantined(self) -> bool: ...
    @property
    def quarantined_at(self) -> float | None: ...
    @property
    def unrecoverable(self) -> bool: ...
    @property
    def unrecoverable_at(self) -> float | None: ...


def as_entry(v: Recorded, collected_at: float | None = None) -> TimelineVersion:
    """A version as the timeline shows it; collected at ``collected_at`` if given."""
    return TimelineVersion(
        version=v.version,
        step=v.step,
        generation=v.generation,
        created_at=v.created_at,
        committed_at=v.committed_at,
        durability=v.durability,
        quarantined=v.quarantined,
        quarantined_at=v.quarantined_at,
        unrecoverable=v.unrecoverable,
        unrecoverable_at=v.unrecoverable_at,
        collected=collected_at is not None,
        collected_at=collected_at,
    )


def timeline(
    job: JobSummary,
    generations: Iterable[GenerationInfo],
    kept: Iterable[CheckpointInfo],
    collected: Iterable[TimelineVersion],
    now: float,
) -> Timeline:
    """A job's timeline from what storage holds.

    Args:
        job: The job (its spec, creation and pointers).
        generations: Its generations; the last :data:`TIMELINE_GENERATIONS` are kept.
        kept: The versions not collected (any order).
        collected: Versions collected lately, as the log remembers them; one still kept
            (a collection under way) is taken from ``kept``.
        now: The coordinator's clock: the right edge, and the end of a running
            generation.
    """
    gens = sorted(generations, key=lambda g: g.generation)[-TIMELINE_GENERATIONS:]
    versions: dict[int, TimelineVersion] = {v.version: v for v in collected}
    for v in kept:
        versions[v.version] = as_entry(v)
    # The pointers as ``job`` has them, which ``kept`` may have read a moment apart from.
    latest = job.checkpoint.version if job.checkpoint else None
    durable = job.durable.version if job.durable else None
    for number, entry in versions.items():
        if number in (latest, durable):
            versions[number] = entry.model_copy(
                update={"latest": number == latest, "latest_durable": number == durable}
            )
    return Timeline(
        job_id=job.job_id,
        spec=job.spec,
        created_at=job.created_at,
        now=now,
        generation=job.generation,
        status=job.status,
        world_size=job.world_size,
        checkpoint=job.checkpoint,
        durable=job.durable,
        generations=[
            TimelineGeneration(
                generation=g.generation,
                world_size=g.world_size,
                sealed_at=g.sealed_at,
                ended_at=g.ended_at,
                ended_reason=g.ended_reason,
                cause=None if g.ended_at is None else cause(g.ended_reason) or "other",
                checkpoint=g.checkpoint,
            )
            for g in gens
        ],
        versions=[versions[n] for n in sorted(versions)],
    )


# --- drawing ------------------------------------------------------------------------------


def _clock(epoch: float, shown: float) -> str:
    """A tick's label on an axis that shows ``shown`` seconds."""
    return utc(epoch, "%H:%M:%S" if shown < _DAY else "%m-%d %H:%M", zone=False)


def _a(**attrs: object) -> str:
    """Attributes, escaped; ``data_x`` becomes ``data-x``; None leaves one out."""
    return "".join(
        f' {name.rstrip("_").replace("_", "-")}="{escape(_num(value))}"'
        for name, value in attrs.items()
        if value is not None
    )


def _num(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return str(value)


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def _pointer_text(name: str, p: CheckpointPointer | None) -> str:
    if p is None:
        return f"{name}: none"
    return f"{name}: v{p.version} (step {p.step}, generation {p.generation})"


class _Scale:
    """Time to x: from the first thing drawn to ``now``."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.t1 = max(t1, t0 + 1.0)  # a job seconds old still gets a readable axis

    @property
    def span(self) -> float:
        return self.t1 - self.t0

    def x(self, t: float) -> float:
        t = min(max(t, self.t0), self.t1)
        return _LEFT + (t - self.t0) / self.span * (WIDTH - _LEFT - _RIGHT)


def _start(t: Timeline) -> float:
    """Where the drawing starts: the job's creation, unless older generations were left
    out (then the first one shown)."""
    if t.generations and t.generations[0].generation > 1:
        return t.generations[0].sealed_at
    return min([t.created_at, *(g.sealed_at for g in t.generations)])


def _generations(t: Timeline, scale: _Scale, top: int) -> list[str]:
    """A bar per generation, as high as its world size; the outline of world size over
    time across them (zero between generations, while a round gathers)."""
    lane = _WORLD_BOTTOM - _WORLD_TOP
    out: list[str] = []
    outline = [f"M{scale.x(scale.t0):.1f},{_WORLD_BOTTOM}"]
    for g in t.generations:
        end = t.now if g.ended_at is None else g.ended_at
        x0, x1 = scale.x(g.sealed_at), scale.x(end)
        height = lane * g.world_size / top
        y = _WORLD_BOTTOM - height
        running = g.ended_at is None
        resumed = "from scratch" if g.checkpoint is None else f"from v{g.checkpoint.version}"
        ended = (
            "running"
            if running
            else f"ended {utc(end)} ({_WORDS[g.cause or 'other']}): {g.ended_reason or '-'}"
        )
        hover = (
            f"generation {g.generation}: world size {g.world_size}, sealed "
            f"{utc(g.sealed_at)}, {span(end - g.sealed_at)}, resumed {resumed}; {ended}"
        )
        fill = "#5b8fd9" if running else ("#8fb3e8" if g.generation % 2 else "#a7c4ee")
        label = (
            f"<text{_a(x=(x0 + x1) / 2, y=y + 13, text_anchor='middle', fill='#123')}>"
            f"g{g.generation}</text>"
            if x1 - x0 >= 26 and height >= 16
            else ""
        )
        out.append(
            f"<g{_a(class_='generation running' if running else 'generation')}"
            f"{_a(data_generation=g.generation, data_world_size=g.world_size)}"
            f"{_a(data_cause=g.cause, data_sealed_at=g.sealed_at, data_ended_at=g.ended_at)}>"
            f"{_title(hover)}"
            f"<rect{_a(x=x0, y=y, width=max(x1 - x0, 1.5), height=height, fill=fill)}/>"
            f"{label}</g>"
        )
        outline.append(
            f"L{x0:.1f},{_WORLD_BOTTOM}L{x0:.1f},{y:.1f}L{x1:.1f},{y:.1f}L{x1:.1f},{_WORLD_BOTTOM}"
        )
    out.append(
        f"<path{_a(class_='world-size', d=''.join(outline), fill='none', stroke='#1f4e99')}"
        f"{_a(stroke_width=1.5)}/>"
    )
    return out


def _restarts(t: Timeline, scale: _Scale) -> list[str]:
    """A marker where each generation ended, coloured by its cause, with a dashed line
    down through the world-size lane."""
    out = []
    for g in t.generations:
        if g.ended_at is None:
            continue
        kind: TimelineCause = g.cause or "other"
        x = scale.x(g.ended_at)
        colour = CAUSE_COLOURS[kind]
        hover = f"restart ({_WORDS[kind]}) at {utc(g.ended_at)}: {g.ended_reason or '-'}"
        y = _MARKER_Y
        out.append(
            f"<g{_a(class_='restart', data_cause=kind, data_generation=g.generation)}>"
            f"{_title(hover)}"
            f"<line{_a(x1=x, y1=y, x2=x, y2=_WORLD_BOTTOM, stroke=colour)}"
            f"{_a(stroke_dasharray='3 2')}/>"
            f"<path{_a(d=f'M{x - 5:.1f},{y - 8}L{x + 5:.1f},{y - 8}L{x:.1f},{y}Z', fill=colour)}/>"
            "</g>"
        )
    return out


def _mark(v: TimelineVersion, x: float, y: float) -> str:
    """A version's shape: a filled square if durable, an amber dot if in memory only, a
    hollow dot while pending; crossed out if quarantined or unrecoverable."""
    if v.durability == "durable":
        shape = f"<rect{_a(x=x - 4.5, y=y - 4.5, width=9, height=9, fill=_DURABLE)}/>"
    elif v.durability == "memory":
        shape = f"<circle{_a(cx=x, cy=y, r=5, fill=_MEMORY, stroke='#8d6e00')}/>"
    else:
        shape = f"<circle{_a(cx=x, cy=y, r=4.5, fill='#fff', stroke=_PENDING, stroke_width=1.5)}/>"
    if v.quarantined or v.unrecoverable:
        a, b = f"{x - 6:.1f}", f"{x + 6:.1f}"
        d = f"M{a},{y - 6:.1f}L{b},{y + 6:.1f}M{a},{y + 6:.1f}L{b},{y - 6:.1f}"
        shape += f"<path{_a(class_='bad', d=d, stroke=_BAD, stroke_width=2)}/>"
    return shape


def _places(t: Timeline, scale: _Scale) -> dict[int, float]:
    """Where each version's mark goes: at its commit (its start while pending), but at
    least :data:`_MARK_GAP` right of the one before, so that versions saved moments
    apart stay apart (their hover text has the exact times). Versions from before the
    generations shown have none."""
    places: dict[int, float] = {}
    last = -math.inf
    timed = sorted(
        (v.committed_at if v.committed_at is not None else v.created_at, v.version)
        for v in t.versions
    )
    for at, number in timed:
        if at >= scale.t0:
            last = places[number] = max(scale.x(at), last + _MARK_GAP)
    return places


def _checkpoints(t: Timeline, places: dict[int, float]) -> list[str]:
    out = []
    for v in t.versions:
        if v.version not in places:
            continue  # before the generations shown
        x = places[v.version]
        classes = ["checkpoint", v.durability]
        classes += [name for name, on in (("collected", v.collected),) if on]
        classes += [name for name, on in (("quarantined", v.quarantined),) if on]
        classes += [name for name, on in (("unrecoverable", v.unrecoverable),) if on]
        notes = [
            "pending"
            if v.committed_at is None
            else f"committed {utc(v.committed_at)}, "
            + ("durable" if v.durability == "durable" else "in memory only")
        ]
        if v.quarantined:
            notes.append(
                "quarantined" + ("" if v.quarantined_at is None else f" {utc(v.quarantined_at)}")
            )
        if v.unrecoverable:
            notes.append(
                "unrecoverable"
                + ("" if v.unrecoverable_at is None else f" since {utc(v.unrecoverable_at)}")
            )
        if v.latest:
            notes.append("the latest")
        if v.latest_durable:
            notes.append("the newest durable")
        if v.collected:
            notes.append(
                "collected" + ("" if v.collected_at is None else f" {utc(v.collected_at)}")
            )
        hover = f"v{v.version}: step {v.step}, generation {v.generation}; " + "; ".join(notes)
        out.append(
            f"<g{_a(class_=' '.join(classes), data_version=v.version, data_step=v.step)}"
            f"{_a(data_generation=v.generation, data_tier=v.durability)}"
            f"{_a(opacity='0.45' if v.collected else None)}>"
            f"{_title(hover)}{_mark(v, x, _CKPT_Y)}</g>"
        )
    return out


def _pointers(t: Timeline, places: dict[int, float]) -> list[str]:
    """A flag over the version each pointer names: filled for the latest, hollow for the
    newest durable (side by side when both name one)."""
    out = []
    same = (
        t.checkpoint is not None
        and t.durable is not None
        and t.checkpoint.version == t.durable.version
    )
    for name, p, fill, shift in (
        ("latest", t.checkpoint, _POINTER, -5.5 if same else 0.0),
        ("durable", t.durable, "#fff", 5.5 if same else 0.0),
    ):
        if p is None:
            continue
        if p.version not in places:
            continue
        x, y = places[p.version] + shift, _CKPT_Y - 9
        words = "latest" if name == "latest" else "newest durable"
        out.append(
            f"<g{_a(class_=f'pointer {name}', data_version=p.version)}>"
            f"{_title(_pointer_text(words, p))}"
            f"<path{_a(d=f'M{x - 4.5:.1f},{y - 9:.1f}L{x + 4.5:.1f},{y - 9:.1f}L{x:.1f},{y:.1f}Z')}"
            f"{_a(fill=fill, stroke=_POINTER, stroke_width=1.5)}/></g>"
        )
    return out


def _axis(scale: _Scale) -> list[str]:
    """The time axis, with ticks at round clock times (UTC)."""
    shown = scale.span
    step = next((s for s in _STEPS if shown / s <= 8), None)
    if step is None:
        step = _DAY * max(1, math.ceil(shown / _DAY / 8))
    first = math.ceil(scale.t0 / step) * step
    out = [
        f"<line{_a(x1=_LEFT, y1=_AXIS_Y, x2=WIDTH - _RIGHT, y2=_AXIS_Y, stroke='#999')}/>",
        f"<text{_a(x=WIDTH - _RIGHT, y=_AXIS_Y + 15, text_anchor='end', fill='#777')}>UTC</text>",
    ]
    tick = first
    while tick <= scale.t1:
        x = scale.x(tick)
        if x > WIDTH - _RIGHT - 50:
            break  # its label would run into "UTC" or off the edge
        out.append(
            f"<g class='tick'><line{_a(x1=x, y1=_AXIS_Y, x2=x, y2=_AXIS_Y + 4, stroke='#999')}/>"
            f"<text{_a(x=x, y=_AXIS_Y + 15, text_anchor='middle', fill='#555')}>"
            f"{escape(_clock(tick, shown))}</text></g>"
        )
        tick += step
    return out


def _world_axis(top: int) -> list[str]:
    out = [f"<text{_a(x=_LEFT, y=12, fill='#555')}>world size, generations and restarts</text>"]
    for value in sorted({0, top, top // 2} if top >= 4 else {0, top}):
        y = _WORLD_BOTTOM - (_WORLD_BOTTOM - _WORLD_TOP) * value / top
        out.append(
            f"<text{_a(x=_LEFT - 6, y=y + 4, text_anchor='end', fill='#555')}>{value}</text>"
            f"<line{_a(x1=_LEFT - 3, y1=y, x2=WIDTH - _RIGHT, y2=y, stroke='#eee')}/>"
        )
    out.append(f"<text{_a(x=_LEFT, y=_CKPT_Y - 24, fill='#555')}>checkpoints</text>")
    return out


def _legend(t: Timeline) -> tuple[list[str], int]:
    """What the shapes and colours mean: every tier and pointer, and the causes of the
    restarts drawn (a hang, a straggler replaced: every cause that ended a generation
    shown); and the rows it takes, which the drawing grows by where there are more than
    two."""
    causes = dict.fromkeys(g.cause or "other" for g in t.generations if g.ended_at is not None)
    y = _LEGEND_Y
    items: list[tuple[str, str]] = [
        (f"<rect{_a(y=y - 8, width=12, height=9, fill='#8fb3e8')}/>", "generation"),
        *(
            (f"<path{_a(d=f'M0,{y - 8}L10,{y - 8}L5,{y}Z', fill=CAUSE_COLOURS[c])}/>", _WORDS[c])
            for c in causes
        ),
        (f"<rect{_a(y=y - 8, width=9, height=9, fill=_DURABLE)}/>", "durable"),
        (f"<circle{_a(cx=5, cy=y - 4, r=5, fill=_MEMORY, stroke='#8d6e00')}/>", "memory only"),
        (
            f"<circle{_a(cx=5, cy=y - 4, r=4.5, fill='#fff', stroke=_PENDING, stroke_width=1.5)}/>",
            "pending",
        ),
        (
            f"<path{_a(d=f'M0,{y - 9}L10,{y + 1}M0,{y + 1}L10,{y - 9}', stroke=_BAD)}"
            f"{_a(stroke_width=2)}/>",
            "quarantined / unrecoverable",
        ),
        (f"<path{_a(d=f'M0,{y - 9}L10,{y - 9}L5,{y}Z', fill=_POINTER)}/>", "latest"),
        (
            f"<path{_a(d=f'M0,{y - 9}L10,{y - 9}L5,{y}Z', fill='#fff', stroke=_POINTER)}/>",
            "newest durable",
        ),
    ]
    out = ["<g class='legend'>"]
    x, dy, rows = float(_LEFT), 0, 1
    for shape, text in items:
        width = 24 + 6.3 * len(text)  # about that of 11 px system-ui text
        if x + width > WIDTH - _RIGHT:  # on to the next row
            x, dy, rows = float(_LEFT), dy + _LEGEND_ROW, rows + 1
        out.append(
            f"<g{_a(transform=f'translate({x:.1f},{dy})')}>{shape}"
            f"<text{_a(x=15, y=y, fill='#555')}>{escape(text)}</text></g>"
        )
        x += width
    out.append("</g>")
    return out, rows


def svg(t: Timeline, *, standalone: bool = False) -> str:
    """The timeline as an SVG element (a whole document with ``standalone``).

    Classes and data attributes: ``g.generation`` (``data-generation``,
    ``data-world-size``, ``data-cause`` once ended; ``running`` while it runs),
    ``path.world-size``, ``g.restart`` (``data-cause``, ``data-generation``: the one it
    ended), ``g.checkpoint`` (``data-version``, ``data-tier``: ``durable``, ``memory``
    or ``pending``; classes ``collected``, ``quarantined``, ``unrecoverable``), and
    ``g.pointer.latest`` / ``g.pointer.durable`` (``data-version``).
    """
    scale = _Scale(_start(t), t.now)
    top = max([t.spec.max_nodes, *(g.world_size for g in t.generations)])
    body: list[str] = [_title(f"Timeline of job {t.job_id}, {utc(t.now)}")]
    body += _world_axis(top)
    body += _generations(t, scale, top)
    body += _restarts(t, scale)
    places = _places(t, scale)
    body += _checkpoints(t, places)
    body += _pointers(t, places)
    body += _axis(scale)
    legend, rows = _legend(t)
    body += legend
    # Room for a legend of more than two rows (a job that ended for many causes).
    height = HEIGHT + max(0, rows - 2) * _LEGEND_ROW
    if not t.generations:
        body.append(
            f"<text{_a(x=WIDTH / 2, y=(_WORLD_TOP + _WORLD_BOTTOM) / 2, text_anchor='middle')}"
            f"{_a(fill='#777')}>no generation sealed yet</text>"
        )
    head = (
        f"<svg{_a(xmlns='http://www.w3.org/2000/svg') if standalone else ''}"
        f"{_a(class_='timeline', id='timeline-svg', viewBox=f'0 0 {WIDTH} {height}')}"
        f"{_a(width=WIDTH, height=height, role='img', data_job=t.job_id, data_now=t.now)}"
        f"{_a(font_family='system-ui, sans-serif', font_size=11)}>"
    )
    return head + "".join(body) + "</svg>"
