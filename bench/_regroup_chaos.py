"""Regroup in place, as bench/recovery.py measures it: the phase breakdown of one
recovery (from the survivors' ``resumed`` events and the coordinator's history), and the
chaos run (ten kills and ten joins in a row) with its leak check.

Kept apart from recovery.py, which only compares setups: this module reads what the
in-place example reports about itself (``regroup`` timestamps, ``resources``), which the
warm-restart and stock-torchrun setups do not have.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from rallypoint.cli.processes import Cluster, Coordinator, Event, descendants, judge

# The survivors' timestamps, in the order a regroup passes them (``trainer/_regroup.py``):
# the end seen, the old group left, the node's next assignment, the new group, the restore.
PHASES = ("ended", "left", "assigned", "grouped", "restored")


def history(url: str, job: str) -> list[dict[str, Any]]:
    """The job's generations, as the coordinator records them."""
    out: list[dict[str, Any]] = httpx.get(f"{url}/v1/jobs/{job}", timeout=10).json()["history"]
    return out


def regroup(
    events: Sequence[Event], generations: Sequence[dict[str, Any]], started: float, first: Event
) -> dict[str, Any]:
    """What happened between ``started`` (the kill, the worker's kill or the join) and
    ``first``, rank 0's first step at the new world size.

    Returns seconds from ``started`` for each of :data:`PHASES` (the median over the
    workers that came into the new generation in place: one slow survivor shows in the
    first step, not here), the coordinator's end of the old generation and seal of the
    new one, the survivors' pause in steps, who regrouped in place and who was a new
    process, and the bytes each kind read from storage.
    """
    number = first["generation"]
    group = [e for e in events if e["event"] == "resumed" and e["generation"] == number]
    survivors = [e for e in group if e.get("in_place")]
    phases: dict[str, float | None] = {}
    for key in PHASES:
        seen = [e["regroup"][key] - started for e in survivors if key in (e.get("regroup") or {})]
        phases[key] = statistics.median(seen) if seen else None
    phases["first step"] = first["t"] - started
    by_number = {g["generation"]: g for g in generations}
    before = [g for g in by_number if g < number]
    ended = by_number[max(before)].get("ended_at") if before else None
    sealed = by_number.get(number, {}).get("sealed_at")
    # A worker of an earlier generation that is the same process: it kept its pid.
    earlier = {e["pid"] for e in events if e["event"] == "resumed" and e["generation"] < number}
    steps = [e for e in events if e["event"] == "step" and e["t"] < first["t"]]

    def storage(group: Sequence[Event]) -> int:
        return sum((e.get("bytes_from") or {}).get("storage", 0) for e in group)

    fresh = [e for e in group if not e.get("in_place")]
    return {
        "generation": number,
        "phases": phases,
        "coordinator_ended": None if ended is None else ended - started,
        "sealed": None if sealed is None else sealed - started,
        "pause": first["t"] - max(e["t"] for e in steps) if steps else None,
        "in_place": sorted(e["rank"] for e in survivors),
        "same_pids": all(e["pid"] in earlier for e in survivors),
        "new_processes": sorted(e["rank"] for e in fresh),
        "in_place_storage_bytes": storage(survivors),
        "new_storage_bytes": storage(fresh),
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_regroup(report: dict[str, Any]) -> list[str]:
    """The lines bench/recovery.py prints for one in-place recovery."""
    phases = report["phases"]
    steps = ", ".join(f"{key} {_seconds(phases[key])}" for key in [*PHASES, "first step"])
    lines = [
        f"phases (s from the event, median over survivors): {steps}",
        f"coordinator: old generation ended {_seconds(report['coordinator_ended'])}, "
        f"generation {report['generation']} sealed {_seconds(report['sealed'])}; "
        f"rank 0's pause in steps {_seconds(report['pause'])} s",
        f"in place: ranks {report['in_place']} "
        f"({'the same processes' if report['same_pids'] else 'NOT the same processes'}), "
        f"new processes: ranks {report['new_processes']}; bytes from storage: "
        f"{report['in_place_storage_bytes']} in place, {report['new_storage_bytes']} new",
    ]
    return lines


def median_phases(reports: Sequence[dict[str, Any]]) -> str:
    """Each phase's median over several recoveries, for one line."""
    parts = []
    for key in [*PHASES, "first step"]:
        values = [r["phases"][key] for r in reports if r["phases"][key] is not None]
        parts.append(f"{key} {_seconds(statistics.median(values) if values else None)}")
    return ", ".join(parts)


def _step(world: int, after: float, generation: int = -1) -> Callable[[Event], bool]:
    return lambda e: (
        e["event"] == "step"
        and e["world_size"] == world
        and e["t"] > after
        and e["generation"] > generation
    )


def log_lines(logs: Sequence[Path], needle: str) -> list[str]:
    """The lines of ``logs`` that contain ``needle``, each with its file's name."""
    out: list[str] = []
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out.extend(
            f"{path.name}: {line.strip()[:240]}" for line in text.splitlines() if needle in line
        )
    return out


def _worker_pid(cluster: Cluster, node: str) -> int | None:
    """The pid of ``node``'s worker: the agent's descendant that logged a ``resumed``."""
    below = set(descendants(cluster.agents[node].proc.pid))
    pids = [e["pid"] for e in cluster.events() if e["event"] == "resumed" and e["pid"] in below]
    return int(pids[-1]) if pids else None


def chaos(
    workdir: Path,
    limit: float,
    *,
    rounds: int,
    seed: int,
    step_time: float,
    nodes: int = 4,
    warm: int = 30,
) -> dict[str, Any]:
    """Four nodes (``nodes``) regrouping in place, trained to step 30 (``warm``);
    ``rounds`` times a random node other than n0 is SIGKILLed (the clock runs to a step
    at world 3), then a new node joins (to a step at world 4). n0's worker never dies, so
    its ``resources`` across the run are the leak check: a process that regroups must
    not keep the threads, sockets and memory of each group it leaves."""
    coordinator = Coordinator(
        ["--storage", f"local:{workdir / 'storage'}"], log=workdir / "coordinator.log"
    )
    coordinator.start()
    cluster = Cluster(
        coordinator.url,
        "rp-chaos",
        workdir,
        nnodes=f"{nodes - 1}:{nodes}",
        steps=10**6,
        step_time=step_time,
        heartbeat_timeout=3,
        last_call=2,
        checkpoint_every=10,
        persist_every=10,
        memory=workdir / "shm",
        in_place=True,
    )
    rng = random.Random(seed)  # the same victims run after run
    live = [f"n{i}" for i in range(nodes)]
    done: list[dict[str, Any]] = []
    failure = None
    keeper: tuple[int | None, int | None] = (None, None)
    try:
        cluster.start(*live)
        cluster.wait_for(
            lambda e: e["event"] == "step" and e["world_size"] == nodes and e["step"] >= warm,
            timeout=180,
        )
        first_pid = _worker_pid(cluster, "n0")
        for i in range(rounds):
            victim = rng.choice([n for n in live if n != "n0"])
            generation = max(e["generation"] for e in cluster.events())
            killed = time.time()
            cluster.kill(victim)
            live.remove(victim)
            try:
                at3 = cluster.wait_for(_step(nodes - 1, killed, generation), timeout=limit)
            except TimeoutError:
                failure = (
                    f"round {i + 1}: no step at world {nodes - 1} within {limit:.0f} s of "
                    f"{victim}'s kill"
                )
                break
            newcomer = f"r{i + 1}"
            added = time.time()
            cluster.add(newcomer)
            live.append(newcomer)
            try:
                at4 = cluster.wait_for(_step(nodes, added), timeout=limit)
            except TimeoutError:
                failure = (
                    f"round {i + 1}: no step at world {nodes} within {limit:.0f} s of {newcomer}"
                )
                done.append({"victim": victim, "killed": killed, "at3": at3, "newcomer": newcomer})
                break
            done.append(
                {
                    "victim": victim,
                    "killed": killed,
                    "at3": at3,
                    "newcomer": newcomer,
                    "added": added,
                    "at4": at4,
                }
            )
        keeper = (first_pid, _worker_pid(cluster, "n0"))
        generations = history(coordinator.url, cluster.job)
    finally:
        cluster.stop()
        coordinator.stop()
    # The plugin says so when it restarts a node's workers instead of regrouping: a
    # worker that died of its collective before it saw the generation end leaves no
    # re-join in the coordinator's record when the generation had already ended.
    logs = [a.log for a in cluster.agents.values()]
    fallbacks = log_lines(logs, "instead of regrouping in place")
    events = cluster.events()
    for r in done:
        r["kill"] = regroup(events, generations, r["killed"], r["at3"])
        if "at4" in r:
            r["join"] = regroup(events, generations, r["added"], r["at4"])
    return {
        "rounds": done,
        "failure": failure,
        "events": events,
        "history": generations,
        "keeper": keeper,
        "fallbacks": fallbacks,
        "workdir": str(workdir),
    }


def format_chaos(result: dict[str, Any]) -> list[str]:
    """The chaos run's report: per-round times, consistency, fallbacks, n0's resources."""
    events, generations = result["events"], result["history"]
    lines = [f"{'round':>5} {'killed':>7} {'to world 3':>11} {'joined':>7} {'to world 4':>11}"]
    for i, r in enumerate(result["rounds"], 1):
        joined = f"{r['join']['phases']['first step']:.2f} s" if "join" in r else "-"
        lines.append(
            f"{i:>5} {r['victim']:>7} {r['kill']['phases']['first step']:>9.2f} s "
            f"{r['newcomer']:>7} {joined:>11}"
        )
    kills = [r["kill"] for r in result["rounds"]]
    joins = [r["join"] for r in result["rounds"] if "join" in r]
    if kills:
        lines.append(f"kill, median phases (s from the kill): {median_phases(kills)}")
    if joins:
        lines.append(f"join, median phases (s from the add): {median_phases(joins)}")
        pauses = [j["pause"] for j in joins if j["pause"] is not None]
        if pauses:
            lines.append(
                f"join, rank 0's pause in steps: median {statistics.median(pauses):.2f} s, "
                f"max {max(pauses):.2f} s"
            )
    storage = [r["in_place_storage_bytes"] for r in kills + joins]
    lines.append(f"bytes survivors read from storage, all rounds: {sum(storage)}")
    if result["failure"]:
        lines.append(f"STOPPED: {result['failure']} (logs in {result['workdir']})")

    verdict = judge(events, generations)
    lines.append(
        f"generations: {len(generations)}, consistent: {verdict.consistent}, "
        # Sorted, not in generation order: a run that looks as if it lost more and more
        # only lists its restarts from the cheapest up.
        f"steps lost per generation, sorted: {sorted(verdict.steps_lost.values())}"
    )
    lines.extend(f"  problem: {p}" for p in verdict.problems)
    # A fallback: a worker restarted by its agent instead of regrouping, which ends the
    # generation it happened in with its node's re-join (the reason may lead with the
    # killed node's dropped connection, the re-join in parentheses after it).
    rejoined = [g for g in generations if "re-joined" in (g.get("ended_reason") or "")]
    lines.append(f"fallbacks (generations ended by a re-join): {len(rejoined)}")
    lines.extend(f"  generation {g['generation']}: {g['ended_reason']}" for g in rejoined)
    # The same from the workers' side: new processes beyond the one newcomer of a join.
    resumed = [e for e in events if e["event"] == "resumed"]
    numbers = sorted({e["generation"] for e in resumed})
    extra = []
    for before, number in itertools.pairwise(numbers):
        seen = {e["pid"] for e in resumed if e["generation"] <= before}
        group = [e for e in resumed if e["generation"] == number]
        grew = group[0]["world_size"] - next(
            e["world_size"] for e in resumed if e["generation"] == before
        )
        new = [e for e in group if e["pid"] not in seen]
        if len(new) > max(0, grew):
            extra.append(f"generation {number}: {len(new)} new processes, world +{grew}")
    lines.append(f"new worker processes beyond the newcomers: {len(extra)} generations")
    lines.extend(f"  {x}" for x in extra)
    lines.append(f"fallbacks the agents logged: {len(result['fallbacks'])}")
    lines.extend(f"  {x}" for x in result["fallbacks"])

    first_pid, last_pid = result["keeper"]
    same = "the same process" if first_pid == last_pid else f"RESTARTED as {last_pid}"
    lines.append(f"n0's worker (pid {first_pid}, at the end {same}):")
    lines.extend(_resources([e for e in resumed if e["pid"] == first_pid]))
    # If n0's worker fell back to a restart, the process that regrouped most often is
    # the leak check's longest series.
    counts: dict[int, int] = {}
    for e in resumed:
        counts[e["pid"]] = counts.get(e["pid"], 0) + 1
    longest = max(counts, key=lambda pid: counts[pid], default=None)
    if longest is not None and longest != first_pid:
        lines.append(f"the worker that regrouped most (pid {longest}):")
        lines.extend(_resources([e for e in resumed if e["pid"] == longest]))
    return lines


def _resources(mine: Sequence[Event]) -> list[str]:
    """One process's RSS, threads and open files at each of its ``resumed`` events."""
    mine = [e for e in mine if e.get("resources")]
    lines = [f"  {len(mine)} resumed events, generations {[e['generation'] for e in mine]}"]
    if not mine:
        return lines
    keys = (
        "rss_kib", "anon_kib", "file_kib", "shmem_kib", "heap_used_kib", "heap_free_kib",
        "maps", "threads", "fds",
    )  # fmt: skip
    for label, e in (("first", mine[0]), ("last", mine[-1])):
        values = ", ".join(f"{k} {e['resources'].get(k)}" for k in keys)
        lines.append(f"  {label:5} (generation {e['generation']}): {values}")
    for k in keys:
        series = [e["resources"].get(k) for e in mine]
        if None in series:  # a worker of an older example
            continue
        lines.append(
            f"  {k:8} min {min(series)} max {max(series)} across all: "
            + " ".join(str(v) for v in series)
        )
    if len(mine) > 3:
        # The first regroups warm caches up (gloo's, the allocator's); growth after
        # them is what would leak generation after generation.
        grew = mine[-1]["resources"]["rss_kib"] - mine[2]["resources"]["rss_kib"]
        lines.append(
            f"  RSS growth after its second regroup: {grew} KiB over {len(mine) - 3} regroups"
        )
    # The measure: after the first five regroups (mine[0] is the first
    # generation, no regroup yet). By world size too: the chaos alternates 3 and 4, and a
    # world of 4 holds one more peer's connections and buffers.
    later = mine[6:]
    for world in [None, *sorted({e["world_size"] for e in later})]:
        rss = [e["resources"]["rss_kib"] for e in later if world in (None, e["world_size"])]
        if len(rss) > 1:
            where = "all worlds" if world is None else f"world {world}"
            lines.append(
                f"  RSS after the fifth regroup, {where}: {len(rss)} generations, "
                f"{min(rss)}-{max(rss)} KiB (range {max(rss) - min(rss)}), "
                f"first {rss[0]}, last {rss[-1]} (last - first {rss[-1] - rss[0]})"
            )
    return lines
