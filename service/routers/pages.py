"""The status page: ``GET /`` lists jobs, ``GET /jobs/{job_id}`` shows one (its health:
the hang limit, stragglers, each member's progress and score, the hangs), and
``GET /jobs/{job_id}/hangs/{generation}`` one hang's report with its stacks.

Server-rendered HTML with inline CSS and a dozen lines of inline script that re-fetch the
page every two seconds (a ``<meta refresh>`` does it where scripts are off): nothing is
fetched from elsewhere, so it works on a cluster without internet access. A job's page
opens with its timeline, an inline SVG drawn by :mod:`.._timeline` (refreshed with the
rest); ``GET /jobs/{job_id}/timeline.svg`` serves the drawing alone. Every page carries a
Content-Security-Policy that allows only its own inline style and script (by a nonce
made for each response) and requests to this coordinator.

When the coordinator has a token, a browser signs in once through the form at ``/login``,
which keeps the token in an HttpOnly cookie; ``Authorization: Bearer`` works as well. A
job's ``reader`` (or ``trainer``) token shows that job only.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from html import escape
from typing import Annotated
from urllib.parse import parse_qs

import anyio.to_thread
from fastapi import APIRouter, Cookie, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from rallypoint.client.models import (
    CheckpointInfo,
    CheckpointPointer,
    HangReport,
    Health,
    JobStatus,
    JobSummary,
    MemberStatus,
    Timeline,
)
from rallypoint.times import utc

from .. import _timeline
from .._tokens import Principal, Tokens, presented
from ..deps import CheckpointsDep, GenerationNumber, JobId, RdzvDep, ViewsDep
from ..errors import Forbidden, RequestError, Unauthorized
from .jobs import read_timeline

__all__ = ["router"]

router = APIRouter(tags=["status page"], include_in_schema=False)

COOKIE = "rallypoint_token"
REFRESH_S = 2

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse}td,th{padding:.2em .9em;text-align:left;border-bottom:1px solid #ddd}
th{font-weight:600}.alive{color:#080}.late{color:#b60}.dead,.error{color:#c00}.left{color:#888}
.muted{color:#777}code{font-size:.95em}
.badge{display:inline-block;padding:0 .45em;margin-right:.3em;border-radius:.7em;font-size:.85em}
.badge.durable{background:#d4f0d4}.badge.memory{background:#fde9b0}.badge.pending{background:#eee}
.badge.pointer{background:#dde6f7}.badge.quarantined{background:#f6c6c6;color:#900}
.badge.straggler{background:#f3e0a6;color:#6d4c00}
tr.quarantined td{color:#888}
#timeline svg{max-width:100%;height:auto;display:block}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12.5px;line-height:1.35}
"""
# Re-fetches the page and swaps <main>: no flicker, scroll position kept.
_SCRIPT = f"""
setInterval(async () => {{
  try {{
    const r = await fetch(location.href, {{cache: "no-store"}});
    if (!r.ok) return;
    const next = new DOMParser().parseFromString(await r.text(), "text/html");
    document.querySelector("main").replaceWith(next.querySelector("main"));
  }} catch (e) {{}}
}}, {REFRESH_S * 1000});
"""


def _policy(nonce: str) -> str:
    """The pages' Content-Security-Policy: their own inline style and script (by
    ``nonce``), requests to this coordinator (the refresh), and nothing else; no frames
    of them elsewhere."""
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
        "frame-ancestors 'none'"
    )


def _page(title: str, main: str, status: int = 200, refresh: bool = True) -> HTMLResponse:
    nonce = secrets.token_urlsafe(16)
    head = (
        f"<noscript><meta http-equiv='refresh' content='{REFRESH_S}'></noscript>" if refresh else ""
    )
    script = f"<script nonce='{nonce}'>{_SCRIPT}</script>" if refresh else ""
    body = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title>{head}<style nonce='{nonce}'>{_STYLE}</style></head>"
        f"<body><main>{main}</main>{script}</body></html>"
    )
    headers = {"Cache-Control": "no-store", "Content-Security-Policy": _policy(nonce)}
    return HTMLResponse(body, status_code=status, headers=headers)


def _stale(status: JobStatus) -> str:
    """A line that says the page shows an old view (storage has not answered since)."""
    if not status.stale():
        return ""
    return (
        f"<p id='stale' class='error'>This is the job as of {utc(status.as_of)}, "
        f"{status.age:.0f} s ago: this coordinator has not read storage since.</p>"
    )


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ago"


class _Html(str):
    """A table cell that is markup already (built here from escaped parts)."""


def _cell(value: object) -> str:
    return value if isinstance(value, _Html) else escape(str(value))


def _badges(*names: tuple[str, str]) -> _Html:
    """Badges of (text, class), e.g. a version's durability and the pointers at it."""
    return _Html(
        "".join(f"<span class='badge {escape(c)}'>{escape(text)}</span>" for text, c in names)
    )


def _marked(version: CheckpointInfo) -> str:
    """When and why an operator quarantined the version, or a rank found it could not
    load it; "-" if neither."""
    return "; ".join(version.marks()) or "-"


def _pointer(pointer: CheckpointPointer | None) -> str:
    if pointer is None:
        return "none"
    tier = "" if pointer.durable else ", in memory only"
    return f"v{pointer.version} (step {pointer.step}, generation {pointer.generation}{tier})"


def _table(
    name: str, header: Sequence[str], rows: Iterable[Sequence[object]], classes: Iterable[str] = ()
) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    classes = list(classes)
    body = "".join(
        f"<tr class='{escape(classes[i]) if i < len(classes) else ''}'>"
        + "".join(f"<td>{_cell(c)}</td>" for c in row)
        + "</tr>"
        for i, row in enumerate(rows)
    )
    if not body:
        body = f"<tr><td colspan='{len(header)}' class='muted'>none</td></tr>"
    return f"<table id='{name}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


async def _viewer(request: Request, cookie: str | None) -> Principal | None:
    """Who is looking: by the request's token, else the sign-in cookie's (the admin
    token, or a job's ``reader`` or ``trainer`` token, which see that job only)."""
    tokens: Tokens = request.app.state.tokens
    return await tokens.principal(presented(request.headers) or cookie)


def _login_form(message: str = "", status: int = 401) -> HTMLResponse:
    note = f"<p class='error' id='token-error'>{escape(message)}</p>" if message else ""
    form = (
        "<h1>Rallypoint</h1><p>This coordinator needs its token.</p>"
        f"{note}<form method='post' action='/login'>"
        "<input type='password' name='token' id='token' autocomplete='current-password' "
        "placeholder='token' required> <button type='submit'>Sign in</button></form>"
    )
    return _page("Rallypoint: sign in", form, status, refresh=False)


def _score(member: MemberStatus) -> _Html:
    """A member's straggler score (its slowest process's), with a badge if it is one."""
    score = "-" if member.score is None else f"{member.score:.2f}"
    badge = _badges(("straggler", "straggler")) if member.straggler else ""
    return _Html(f"{escape(score)} {badge}".strip())


def _health(health: Health | None) -> str:
    """The job's health line: the hang limit and where it comes from, the phase limit,
    the stragglers named now, the hangs so far, the generations without progress."""
    if health is None:
        return ""
    named = ", ".join(
        f"{s.node_id} (rank {s.rank}, score {s.score:.2f})" for s in health.stragglers
    )
    parts = [
        f"hang limit <b>{escape(health.limit())}</b>",
        f"phase limit {health.phase_limit:g} s",
        f"stragglers: {escape(named or 'none')}",
        f"hangs so far: <b>{health.hangs}</b>",
        *([f"generations without progress: {health.stalled}"] if health.stalled else []),
    ]
    return f"<p id='health'>{'; '.join(parts)}</p>"


def _hangs(job_id: str, reports: Sequence[HangReport]) -> str:
    """The hangs the job keeps reports of, newest first, each linking to its report."""
    if not reports:
        return ""
    rows = [
        (
            _Html(f"<a href='/jobs/{escape(job_id)}/hangs/{h.generation}'>{h.generation}</a>"),
            h.node_id,
            h.rank,
            h.phase,
            h.step,
            f"{h.idle:.1f} s",
            f"{h.limit:.1f} s",
            utc(h.at),
            h.stacks_state(),
        )
        for h in reversed(reports)
    ]
    header = ["generation", "node", "rank", "phase", "step", "no progress for", "limit"]
    return (
        "<h2>Hangs</h2>"
        + _table("hangs", [*header, "found", "stacks"], rows)
        + "<p class='muted'>The generation links to the hang's report, with the stacks of "
        "the hung process's threads.</p>"
    )


def _job_row(job: JobSummary) -> tuple[object, ...]:
    latest = job.checkpoint
    return (
        f"{job.spec.min_nodes}:{job.spec.max_nodes}",
        job.generation,
        job.status,
        job.world_size,
        "-"
        if latest is None
        else f"v{latest.version} step {latest.step}" + ("" if latest.durable else " (memory)"),
    )


Token = Annotated[str | None, Cookie(alias=COOKIE)]


@router.post("/login")
async def login(request: Request) -> Response:
    """Checks the form's token and keeps it in an HttpOnly, SameSite=Strict cookie."""
    # The one form field, parsed here: no multipart parser dependency for one login.
    form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0]
    tokens: Tokens = request.app.state.tokens
    if not token or await tokens.principal(token) is None:
        return _login_form("That is not a valid token of this coordinator.")
    reply = RedirectResponse("/", status_code=303)
    reply.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return reply


@router.get("/", response_class=HTMLResponse)
async def jobs_page(rdzv: RdzvDep, request: Request, cookie: Token = None) -> HTMLResponse:
    """Every job the viewer's token covers, linking to its page."""
    viewer = await _viewer(request, cookie)
    if viewer is None:
        return _login_form()
    jobs: list[JobSummary] = [
        rdzv.summary(j)
        for j in await anyio.to_thread.run_sync(rdzv.list_jobs)
        if viewer.may("read", j.job_id)
    ]
    rows = "".join(
        f"<tr><td><a href='/jobs/{escape(j.job_id)}'>{escape(j.job_id)}</a></td>"
        + "".join(f"<td>{escape(str(c))}</td>" for c in _job_row(j))
        + "</tr>"
        for j in jobs
    )
    rows = rows or "<tr><td colspan='6' class='muted'>no jobs yet</td></tr>"
    main = (
        "<h1>Rallypoint: jobs</h1><table id='jobs'><thead><tr><th>job</th><th>nodes</th>"
        "<th>generation</th><th>status</th><th>world size</th><th>latest checkpoint</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
        f"<p class='muted'>updated {utc(rdzv.clock())}</p>"
    )
    return _page("Rallypoint: jobs", main)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(
    job_id: JobId,
    rdzv: RdzvDep,
    views: ViewsDep,
    request: Request,
    cookie: Token = None,
) -> HTMLResponse:
    """A job's members, waiting nodes, generations and checkpoint versions."""
    viewer = await _viewer(request, cookie)
    if viewer is None:
        return _login_form()
    if not viewer.may("read", job_id):
        return _login_form(f"This token does not cover job {job_id}.", 403)
    try:
        # This replica's view, as the JSON status's (read about once a second for all
        # viewers; the last one while storage does not answer).
        status, shown = await views.page(job_id)
    except RequestError as exc:
        main = f"<h1>Job {escape(job_id)}</h1><p class='error'>{escape(exc.message)}</p>"
        return _page(f"Rallypoint: {job_id}", main, exc.status)
    versions, collected, hangs = shown.versions, shown.collected, shown.hangs
    now = rdzv.clock()
    spec = status.spec
    latest = status.checkpoint
    members = sorted(status.members, key=lambda m: m.rank)
    summary = (
        f"<p id='summary'>generation <b>{status.generation}</b> {escape(status.status)}, "
        f"world size <b>{status.world_size}</b> (nodes {spec.min_nodes}:{spec.max_nodes}, "
        f"heartbeat timeout {spec.heartbeat_timeout.total_seconds():g} s); latest checkpoint: "
        f"{escape(_pointer(latest))}"
        + (
            f"; newest durable: {escape(_pointer(status.durable))}"
            if latest is not None and not latest.durable
            else ""
        )
        + "</p>"
        + _health(status.health)
        + (f"<p id='blocked' class='error'>{escape(status.blocked)}</p>" if status.blocked else "")
        + _stale(status)
    )
    drawn = _timeline.svg(_timeline.timeline(status, status.history, versions, collected, now))
    main = (
        f"<p><a href='/'>all jobs</a></p><h1>Job {escape(job_id)}</h1>{summary}"
        f"<h2>Timeline</h2><div id='timeline'>{drawn}</div>"
        "<p class='muted'>Hover over a generation, restart or checkpoint for details; "
        f"<a href='/jobs/{escape(job_id)}/timeline.svg'>the drawing alone</a>.</p>"
        "<h2>Members</h2>"
        + _table(
            "members",
            ["rank", "node", "address", "heartbeat", "state", "step", "phase", "idle", "score"],
            [
                (m.rank, m.node_id, m.addr, _age(m.heartbeat_age), m.state, *m.shown(), _score(m))
                for m in members
            ],
            [m.state + (" straggler" if m.straggler else "") for m in members],
        )
        + "<h2>Waiting</h2>"
        + _table(
            "waiting",
            ["node", "address", "round", "waiting", "heartbeat", "as"],
            [
                (
                    w.node_id,
                    w.addr,
                    w.round,
                    f"{w.waiting_for:.1f} s",
                    _age(w.heartbeat_age),
                    "standby" if w.standby else "joiner",
                )
                for w in status.waiting
            ],
            ["standby" if w.standby else "joiner" for w in status.waiting],
        )
        + (
            "<h2>Quarantined nodes</h2>"
            + _table(
                "quarantined-nodes",
                ["node", "since", "by", "why"],
                [(q.node_id, utc(q.at), q.by, q.reason or "-") for q in status.quarantined_nodes],
            )
            if status.quarantined_nodes
            else ""
        )
        + _hangs(job_id, hangs)
        + "<h2>Generations</h2>"
        + _table(
            "generations",
            ["generation", "world size", "sealed", "ended", "why it ended"],
            [
                (
                    g.generation,
                    g.world_size,
                    utc(g.sealed_at),
                    utc(g.ended_at),
                    g.ended_reason or ("running" if g.ended_at is None else "-"),
                )
                for g in sorted(status.history, key=lambda g: g.generation, reverse=True)
            ],
        )
        + "<h2>Checkpoints</h2>"
        + _table(
            "checkpoints",
            [
                "version",
                "step",
                "generation",
                "state",
                "durability",
                "ranks reported",
                "committed",
                "metrics",
                "marked bad",
            ],
            [
                (
                    v.version,
                    v.step,
                    v.generation,
                    v.state,
                    _badges(
                        (v.durability, v.durability),
                        *([("quarantined", "quarantined")] if v.quarantined else []),
                        *([("unrecoverable", "quarantined")] if v.unrecoverable else []),
                        *([("latest", "pointer latest")] if v.latest else []),
                        *([("newest durable", "pointer fallback")] if v.latest_durable else []),
                        *([("best", "pointer best")] if v.best_place == 1 else []),
                        *(
                            [(f"best #{v.best_place}", "pointer best")]
                            if v.best_place is not None and v.best_place > 1
                            else []
                        ),
                    ),
                    f"{v.reported}/{v.world_size}",
                    utc(v.committed_at),
                    " ".join(f"{k}={x:.6g}" for k, x in sorted(v.metrics.items())) or "-",
                    _marked(v),
                )
                for v in reversed(versions)
            ],
            [
                ("quarantined " if v.quarantined else "")
                + ("unrecoverable " if v.unrecoverable else "")
                + v.durability
                for v in reversed(versions)
            ],
        )
        + f"<p class='muted'>as of {utc(status.as_of or now)}</p>"
    )
    return _page(f"Rallypoint: {job_id}", main)


@router.get("/jobs/{job_id}/hangs/{generation}", response_class=HTMLResponse)
async def hang_page(
    job_id: JobId,
    generation: GenerationNumber,
    rdzv: RdzvDep,
    request: Request,
    cookie: Token = None,
) -> HTMLResponse:
    """The hang that ended a generation: which rank, on which node, doing what, how long
    without progress against which limit, and the stacks of its process's threads as
    its node's agent took them (or why there are none). It refreshes until they come."""
    viewer = await _viewer(request, cookie)
    if viewer is None:
        return _login_form()
    if not viewer.may("read", job_id):
        return _login_form(f"This token does not cover job {job_id}.", 403)
    title = f"Rallypoint: {job_id}, the hang of generation {generation}"
    back = f"<p><a href='/jobs/{escape(job_id)}'>job {escape(job_id)}</a></p>"
    try:
        h: HangReport = await anyio.to_thread.run_sync(rdzv.hang_report, job_id, generation)
    except RequestError as exc:
        main = f"{back}<h1>Generation {generation}</h1><p class='error'>{escape(exc.message)}</p>"
        return _page(title, main, exc.status, refresh=False)
    facts = _table(
        "hang",
        ["node", "rank", "process", "phase", "step", "no progress for", "limit", "found"],
        [
            (
                h.node_id,
                h.rank,
                "-" if h.pid is None else h.pid,
                h.phase,
                h.step,
                f"{h.idle:.1f} s",
                f"{h.limit:.1f} s",
                utc(h.at),
            )
        ],
    )
    if h.stacks is not None:
        tried = f" Before that: {escape(h.stacks_error)}" if h.stacks_error else ""
        stacks = (
            f"<p id='taken-by'>Taken by <b>{escape(h.taken_by or 'its agent')}</b> before the "
            f"process was stopped.{tried}</p><pre id='stacks'>{escape(h.stacks)}</pre>"
        )
    elif h.stacks_error is not None:
        stacks = (
            "<p id='no-stacks' class='error'>The process could not give its stacks: "
            f"{escape(h.stacks_error)}</p>"
        )
    else:
        stacks = (
            "<p id='no-stacks' class='muted'>Not sent yet: the node's agent sends them once "
            "it has stopped the process (never, if the node went down with it).</p>"
        )
    main = (
        f"{back}<h1>Job {escape(job_id)}: the hang of generation {h.generation}</h1>"
        f"<p id='reason'>{escape(h.reason)}</p>{facts}<h2>Stacks</h2>{stacks}"
        f"<p class='muted'>rallypoint jobs hangs {escape(job_id)} {h.generation} prints the "
        f"same; GET /v1/jobs/{escape(job_id)}/hangs/{h.generation} is the JSON.</p>"
    )
    # Refreshed until the stacks (or why there are none) came.
    return _page(title, main, refresh=h.stacks is None and h.stacks_error is None)


@router.get("/jobs/{job_id}/timeline.svg")
async def timeline_svg(
    job_id: JobId,
    rdzv: RdzvDep,
    checkpoints: CheckpointsDep,
    request: Request,
    cookie: Token = None,
) -> Response:
    """The job's timeline alone, as an SVG document (for a link, or a report).

    Refused as the API refuses, with a ``{"code", "message"}`` body: 401
    ``unauthorized`` without a valid token, 403 ``forbidden`` for one that does not
    cover the job, 404 ``unknown_job``.
    """
    viewer = await _viewer(request, cookie)
    if viewer is None:
        raise Unauthorized("the timeline needs a token (sign in, or 'Authorization: Bearer')")
    if not viewer.may("read", job_id):
        raise Forbidden(
            f"a {viewer.role} token for job {viewer.job_id!r} may not read job {job_id!r}"
        )
    drawn: Timeline = await anyio.to_thread.run_sync(read_timeline, rdzv, checkpoints, job_id)
    return Response(
        _timeline.svg(drawn, standalone=True),
        media_type="image/svg+xml",
        headers={"Cache-Control": "no-store", "Content-Security-Policy": "default-src 'none'"},
    )
