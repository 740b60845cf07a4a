"""How often ending a gloo generation mid-step leaves a live rank blocked, by how the
ranks stop: as a worker regrouping in place stopped before (``leave``), and as it stops
now (``agree``).

Three processes (``--ranks``) train a small DDP model on gloo, round after round; each round ends at
a time every rank knows (the same seed), seen by each rank's watcher thread up to 10 ms
apart, as workers see their agent's board.

- ``leave`` (before): a rank leaves at its next step boundary once its watcher saw the
  end, and the watcher shuts down the process's gloo connections at once
  (``_regroup._shut_gloo``), so that ranks inside a collective get an error instead of
  waiting for the ones that left.
- ``agree`` (now): every step ends with :meth:`Generation.check`, an all-reduce of the
  ranks' "ended" flags, so all ranks leave at the same step; each shuts its
  connections once out of the block.

A rank is *stalled* when it needs more than a second after the end to leave: it waits
for the group's timeout (``--timeout``). Under ``leave`` the stalled rank's gloo thread
waits in the ring all-reduce's ``UnboundBuffer::waitSend`` (gdb): a send that gloo had
begun writing on a connection that then closed is not failed, and waits the whole
timeout.

    .venv/bin/python bench/gloo_end.py --rounds 60 [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last, as in the other benches
from bench._smoke import parse
from rallypoint.cli.processes import free_port

RANKS = 3  # the default of --ranks

# One rank: rounds of training, each ended at a shared time; one JSON line per round.
_RANK = r"""
import json, random, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from rallypoint.client.models import Assignment
from rallypoint.trainer import Generation, GenerationEnded
from rallypoint.trainer._regroup import _shut_gloo
rank, world, rounds, port, mode, timeout, seed, base = sys.argv[1:9]
rank, world, rounds, port, timeout, seed = map(int, (rank, world, rounds, port, timeout, seed))
for round_ in range(rounds):
    store = port + round_
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    assignment = Assignment(job_id="bench", node_id=f"n{rank}", generation=round_ + 1,
                            rank=rank, world_size=world, master_addr="127.0.0.1",
                            master_port=store)
    ended = threading.Event()
    generation = Generation(assignment, rank, world, 0, False, ended, detect=timeout,
                            agree=mode == "agree")
    torch.manual_seed(round_)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.time() + float(base) + random.Random(seed + round_).random() * 0.5
    seen = end + random.Random((seed + round_) * 100 + rank).random() * 0.01
    def watch():
        time.sleep(max(0.0, seen - time.time()))
        generation.reason = "the bench ended it"
        ended.set()
        if mode == "leave":
            _shut_gloo()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    how = "check"
    steps, began = 0, time.perf_counter()
    try:
        while True:
            model(torch.randn(64, 256)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            generation.check()
            steps += 1
    except GenerationEnded:
        pass
    except Exception as exc:  # a collective a peer left
        ended.wait(timeout)
        how = str(exc).splitlines()[0][-80:]
    left = time.time() - seen
    step_ms = 1000 * (time.perf_counter() - began) / max(steps, 1)
    watcher.join()
    if mode == "agree":
        _shut_gloo()
    del model, optimizer
    dist.destroy_process_group()
    print(json.dumps({"round": round_, "rank": rank, "left_s": round(left, 3), "how": how,
                      "step_ms": round(step_ms, 3)}), flush=True)
"""


def run(mode: str, args: argparse.Namespace, port: int, folder: Path) -> list[dict[str, Any]]:
    """One mode's rounds: the ranks' lines."""
    rounds, timeout = args.rounds, args.timeout
    script = folder / "rank.py"
    script.write_text(_RANK)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                str(args.ranks),
                str(rounds),
                str(port),
                mode,
                str(timeout),
                str(args.seed),
                str(args.train_s),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(args.ranks)
    ]
    lines: list[dict[str, Any]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=rounds * (timeout + 10) + 120)
        lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--timeout", type=int, default=10, help="the group's timeout, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--port", type=int, help="round r's store listens at PORT + r (default: a free port on)"
    )
    parser.add_argument("--only", choices=("leave", "agree"), help="one way to stop")
    parser.add_argument(
        "--train-s", type=float, default=0.3, help="each round trains this long, and up to 0.5 s"
    )
    parser.add_argument("--ranks", type=int, default=RANKS)
    args = parse(parser, {"rounds": 1, "timeout": 3, "train_s": 0.1, "ranks": 2})
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(("leave", "agree")):
            if args.only not in (None, mode):
                continue
            started = time.monotonic()
            port = args.port + i * 1000 if args.port else free_port()
            lines = run(mode, args, port, Path(tmp))
            if len(lines) != args.rounds * args.ranks:
                sys.exit(f"{mode}: {len(lines)} of {args.rounds * args.ranks} rank ends reported")
            stalled = [x for x in lines if x["left_s"] > 1.0]
            ends = sorted(x["left_s"] for x in lines)
            # A step with its check, the ranks' steps until the end (no stalled ranks).
            steps = sorted(x["step_ms"] for x in lines if x not in stalled)
            results[mode] = {
                "rank_ends": len(lines),
                "stalled": len(stalled),
                "stalled_rounds": sorted({x["round"] for x in stalled}),
                "median_left_s": ends[len(ends) // 2] if ends else None,
                "median_step_ms": steps[len(steps) // 2] if steps else None,
                "wall_s": round(time.monotonic() - started, 1),
            }
            print(mode, json.dumps(results[mode]), flush=True)
        if len(results) == 2 and all(r["median_step_ms"] for r in results.values()):
            ratio = results["agree"]["median_step_ms"] / results["leave"]["median_step_ms"]
            print(f"a step with the agreed check: {ratio:.3f}x one without", flush=True)


if __name__ == "__main__":
    main()
