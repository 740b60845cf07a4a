"""``rallypoint demo``: elastic training through failures, on this machine.

It starts a coordinator on the embedded local storage and three torchrun agents (CPU,
gloo) running ``trainer/examples/train_ddp.py``, then SIGKILLs one node mid-training,
lets it rejoin, sends another an Azure preemption notice (through a stand-in for the
metadata service), and prints a timeline and whether every rank of every generation
resumed from the same checkpoint. It runs them with :mod:`.processes`, as the
end-to-end tests and ``bench/recovery.py`` do.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from rallypoint.tls import ssl_context

from .processes import Cluster, Coordinator, Event, judge

__all__ = ["main", "timeline"]


def timeline(
    events: Sequence[Event], history: Sequence[dict[str, Any]], marks: Sequence[Event] = ()
) -> Iterator[str]:
    """Readable lines: generations, world sizes, checkpoints, what happened when."""
    t0 = min([e["t"] for e in events] + [m["t"] for m in marks], default=time.time())
    rows: list[tuple[float, str]] = [(m["t"], f"** {m['what']}") for m in marks]
    ended = {g["generation"]: g for g in history}
    seen: set[int] = set()
    for e in events:
        g = e["generation"]
        if e["event"] == "resumed" and g not in seen:
            seen.add(g)
            source = f"checkpoint v{e['version']}" if e["version"] else "scratch"
            rows.append(
                (
                    e["t"],
                    f"generation {g}: world size {e['world_size']}, resumed at step "
                    f"{e['step']} from {source}",
                )
            )
            info = ended.get(g, {})
            if info.get("ended_at"):
                rows.append((info["ended_at"], f"generation {g} ended: {info['ended_reason']}"))
        elif e["event"] == "emergency" and e["rank"] == 0:
            rows.append((e["t"], f"emergency checkpoint v{e['version']} at step {e['step']}"))
        elif e["event"] == "step" and e["step"] % 50 == 0:
            rows.append((e["t"], f"step {e['step']}: loss {e['loss']:.3f}"))
        elif e["event"] == "finished" and e["rank"] == 0:
            rows.append((e["t"], f"finished at step {e['step']}: loss {e['loss']:.3f}"))
    for t, text in sorted(rows):
        yield f"{t - t0:7.1f} s  {text}"


def _history(url: str, job: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{url}/v1/jobs/{job}", timeout=10, verify=ssl_context())
    reply.raise_for_status()
    history: list[dict[str, Any]] = reply.json()["history"]
    return history


def main(argv: Sequence[str] | None = None) -> int:
    from .fake_imds import FakeImds

    parser = argparse.ArgumentParser(prog="rallypoint demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workdir", help="keep logs, events and storage here")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rallypoint-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"[demo] {text}", flush=True)

    marks: list[Event] = []

    def mark(what: str) -> None:
        marks.append({"t": time.time(), "what": what})
        say(what)

    storage = ["--storage", f"local:{workdir / 'storage'}"]
    coordinator = Coordinator(storage, log=workdir / "coordinator.log")
    with FakeImds() as imds:
        coordinator.start()
        say(f"coordinator on {coordinator.url}, storage in {workdir / 'storage'}")
        cluster = Cluster(coordinator.url, "demo", workdir, steps=args.steps, imds_url=imds.url)
        try:
            for node in ("node-a", "node-b", "node-c"):
                cluster.add(node)
            say("3 torchrun agents started (--rdzv-backend=rallypoint, CPU, gloo)")
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 60)
            mark("SIGKILL node-b (agent and worker), mid-training")
            cluster.kill("node-b")
            cluster.wait_for(lambda e: e["event"] == "step" and e["world_size"] == 2)
            mark("node-b comes back")
            cluster.add("node-b")
            cluster.wait_for(
                lambda e: e["event"] == "step" and e["world_size"] == 3 and e["generation"] > 2
            )
            cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 200)
            mark("Azure preemption notice for node-c (Scheduled Events: Preempt)")
            imds.schedule("node-c")
            codes = cluster.wait(timeout=300, step_time=None)  # the notice comes mid-run
            say(f"agents exited: {codes}; preemption acknowledged: {bool(imds.acknowledged)}")
            history = _history(coordinator.url, "demo")
        finally:
            cluster.stop()
            coordinator.stop()
    events = cluster.events()
    print()
    for line in timeline(events, history, marks):
        print(line)
    verdict = judge(events, history)
    print()
    lost = ", ".join(f"generation {g}: {n}" for g, n in sorted(verdict.steps_lost.items()))
    print(f"steps lost at each restart: {lost or 'none'}")
    print(f"logs and events: {workdir}")
    if verdict.consistent:
        print(
            f"OK: every rank of every generation ({len(history)}) resumed from the same "
            "checkpoint, the one the coordinator named"
        )
        return 0
    print("NOT CONSISTENT: " + "; ".join(verdict.problems))
    return 1
