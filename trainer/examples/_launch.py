"""How the torchrun examples start: the command-line options they share, and the process
group of a worker that torchrun restarts on every membership change."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _image_size(value: str) -> int:
    size = int(value)
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"{value} is not a multiple of 4 from 4 up")
    return size


def arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every torchrun example takes: how long it trains
    (``--steps``, ``--step-time``, ``--step-time-file``), how often it saves
    (``--checkpoint-every``, ``--persist-every``) and where its events go (``--events``).
    Each example adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument(
        "--persist-every",
        type=int,
        default=1,
        help="every Nth checkpoint goes to blob storage; the rest stay in nodes' memory",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="extra s per step")
    parser.add_argument(
        "--step-time-file",
        help="once this file exists, the number in it replaces --step-time (read at each "
        "step): a test paces a run while it acts on it, then lets it finish sooner",
    )
    parser.add_argument("--events", help="append JSON lines of what happened to this file")
    parser.add_argument(
        "--hang-file",
        help="once this file holds this process's pid, its main thread sleeps for good at "
        "its next step while its other threads run (a Python-level hang, for tests)",
    )
    return parser


def add_image_size(parser: argparse.ArgumentParser) -> None:
    """``--image-size``, for the examples that train the small CNN on synthetic images."""
    parser.add_argument(
        "--image-size",
        type=_image_size,
        default=32,
        help="side of the synthetic images (CIFAR's 32); 16 makes a step 3.6x cheaper on a CPU",
    )


def start_process_group() -> torch.device:
    """Builds this worker's process group from torchrun's environment (NCCL on CUDA, gloo
    on CPU); the device it trains on."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)  # several ranks share a CPU machine's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda" if cuda else "cpu")


def pause(args: argparse.Namespace) -> None:
    """Waits the extra time of a step: ``--step-time``, or the number in
    ``--step-time-file`` once that file exists (read at every step). Hangs for good once
    ``--hang-file`` names this process."""
    seconds = args.step_time
    if args.step_time_file:
        with contextlib.suppress(OSError, ValueError):
            seconds = float(Path(args.step_time_file).read_text())
    if seconds > 0:
        time.sleep(seconds)
    hang = getattr(args, "hang_file", None)
    if hang:
        with contextlib.suppress(OSError, ValueError):
            if int(Path(hang).read_text()) == os.getpid():
                while True:  # the main thread only: the process's other threads run on
                    time.sleep(3600)
