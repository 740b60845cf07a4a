"""What limiting glibc's malloc arenas (``MALLOC_ARENA_MAX``, which ``rallypoint run``
sets to ``MALLOC_ARENAS`` in its workers) costs a CPU training step: the anchor is
glibc's default (up to 8 arenas a core).

Each run is a fresh process: a small CNN trains with AdamW on one batch, while a
thread allocates and frees buffers as a worker's heartbeat and I/O threads do, so that
the training thread and it share an arena under the limit. The two settings run
alternately, ``--runs`` times each; the medians and their ratio are printed.

    .venv/bin/python bench/malloc_arenas.py --runs 5 [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rallypoint.trainer.agent import MALLOC_ARENAS

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last, as in the other benches
from bench._smoke import parse

CODE = r"""
import sys, threading, time, torch
STEPS = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
)
optimizer = torch.optim.AdamW(model.parameters())
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
stop = threading.Event()
def chatter():
    while not stop.is_set():
        kept = [bytes(2048) for _ in range(50)]
        time.sleep(0.001)
helper = threading.Thread(target=chatter)
helper.start()
def step():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
for _ in range(5):
    step()
started = time.perf_counter()
for _ in range(STEPS):
    step()
print((time.perf_counter() - started) / STEPS * 1e3)
stop.set()
helper.join()
"""


def one(arenas: int | None, steps: int) -> float:
    """Milliseconds a step, in a fresh process with ``MALLOC_ARENA_MAX=arenas`` (none:
    glibc's default)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    if arenas is not None:
        env["MALLOC_ARENA_MAX"] = str(arenas)
    out = subprocess.run(
        [sys.executable, "-c", CODE, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes for each setting")
    parser.add_argument("--steps", type=int, default=150, help="timed steps a process")
    args = parse(parser, {"runs": 1, "steps": 1})
    default: list[float] = []
    limited: list[float] = []
    for _ in range(args.runs):
        default.append(one(None, args.steps))
        limited.append(one(MALLOC_ARENAS, args.steps))
    for name, times in (("glibc default", default), (f"MALLOC_ARENA_MAX={MALLOC_ARENAS}", limited)):
        print(f"{name:>20}: median {statistics.median(times):.2f} ms/step, "
              f"{min(times):.2f}-{max(times):.2f} over {len(times)} runs")  # fmt: skip
    ratio = statistics.median(limited) / statistics.median(default)
    print(f"{'ratio':>20}: {ratio:.3f} (limited / default)")


if __name__ == "__main__":
    main()
