"""Elastic DDP training of a small CNN on synthetic CIFAR-shaped data, under torchrun.

Every (re)start asks the coordinator for rank, world size and the checkpoint to resume
from; checkpoints are saved asynchronously; a preemption notice (Azure Scheduled Events or
SIGTERM) stops every rank at the same step with an emergency checkpoint, so no step is
lost. Run it with the rallypoint backend::

    rallypoint serve --storage local:/tmp/rallypoint &
    torchrun --rdzv-backend=rallypoint --rdzv-endpoint=http://127.0.0.1:8080 \\
        --rdzv-id=cnn --nnodes=1:4 --max-restarts=100 trainer/examples/train_ddp.py

With ``--in-place`` the workers keep their processes when the membership changes: the
loop runs once per generation (``CheckpointManager.generations``), and only the workers
of a node that died or joins start anew.

The data is made here, from a seed (a noisy random pattern per class), so the loss has
somewhere to go and nothing is downloaded. Each item carries its index, which
``--log-items`` writes down, with the rank's exact loss, for every optimizer step a rank
trains.

The ``ElasticSampler`` keeps the position in the epoch at any world size. By default each
rank trains ``--batch-size`` per step, so the global batch follows the world. With
``--global-batch N`` it stays N at every world size: ``plan_batch`` splits it into a
per-rank micro-batch (``--batch-size`` or the largest smaller one that fits) and
accumulation steps, the epoch's tail too short for a whole step is skipped, and a world
size that does not divide N is refused before training, naming those that do. Through
3 -> 2 -> 3 nodes every item of each epoch is trained once, apart from the steps a
restart rolled back, and the run ends after as many optimizer steps as an uninterrupted
one (``tests/e2e/test_train_ddp_elastic.py``). ``--save-last`` saves the last step too, so
the trained model is a version (``rallypoint checkpoints export JOB latest``).

A resume is exact: with a replacement node (the same world size), a run through a node
SIGKILL ends bit-identical to an uninterrupted one, dropout included
(``tests/e2e/test_torchrun.py::test_a_resume_is_bit_identical_to_an_uninterrupted_run``). Two
lines make it so: each rank saves its RNG in ``rank_state`` and sets it back, and the
``DataLoader`` has a generator of its own, so making its iterator after the restore draws
nothing from the RNG just restored.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from rallypoint.client import ElasticClient
from rallypoint.trainer import (
    BatchPlan,
    CheckpointManager,
    ElasticSampler,
    PreemptionWatcher,
    plan_batch,
)

# One optimizer step's batches on one rank: (images, labels, indices), one per
# accumulation step.
Step = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def process_started() -> float | None:
    """When this process started (Linux), to tell process start-up from the rest."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def synthetic_cifar(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-shaped images and labels a small CNN can learn, the same on every rank:
    each class has a fixed random pattern, and each image is its class's under noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = 0.5 * patterns[labels] + torch.randn(samples, 3, 32, 32, generator=g)
    return images, labels


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.dropout = nn.Dropout(dropout)  # no parameters: the state dict is the same
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.dropout(self.features(x).flatten(1)))
        return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="per rank (with --global-batch: at most)"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        help="samples per optimizer step at every world size (accumulation makes it up)",
    )
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0, help="before the head")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument(
        "--persist-every",
        type=int,
        default=1,
        help="every Nth checkpoint goes to blob storage; the rest stay in nodes' memory",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="extra s per step")
    parser.add_argument(
        "--if-busy",
        choices=("wait", "skip"),
        default="wait",
        help="a checkpoint due while the last one still uploads: wait for it, or skip",
    )
    parser.add_argument("--events", help="append JSON lines of what happened to this file")
    parser.add_argument(
        "--log-items", action="store_true", help="log the items each rank trains at each step"
    )
    parser.add_argument(
        "--save-last", action="store_true", help="save the last step too (the trained model)"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="keep this process across membership changes (regroup in place)",
    )
    args = parser.parse_args()
    if args.in_place:
        main_in_place(args)
        return

    client = ElasticClient.from_env()
    assignment = client.join()  # under torchrun: the agent's assignment, no new round
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")

    def event(kind: str, **fields: object) -> None:
        if args.events:
            line = {"t": time.time(), "event": kind, "generation": assignment.generation}
            line.update(rank=rank, world_size=world, **fields)
            with open(args.events, "a") as f:  # one short append per line: atomic
                f.write(json.dumps(line) + "\n")

    torch.manual_seed(args.seed)
    dataset = indexed(*synthetic_cifar(args.samples, args.seed))
    model = SmallCNN(args.dropout).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoints = CheckpointManager(
        client, progress=False, persist_every=args.persist_every, if_busy=args.if_busy
    )
    # A world that cannot split the global batch is reported as a failed load: after two
    # such generations the job waits for another size instead of restarting.
    with checkpoints.loading():
        plan = batch_plan(args, rank, world)
    sampler = ElasticSampler(
        args.samples, rank=rank, world_size=world, seed=args.seed, batch_size=plan.micro_batch
    )
    loader = data_loader(dataset, sampler, plan.micro_batch)

    step = 0
    # What fails while loading is reported: a load that cannot succeed at this world
    # size ends the generation with its reason instead of restarting forever.
    with checkpoints.resuming() as restored:
        if restored is not None:
            step = restore(restored, model, optimizer, sampler)
    event(
        "resumed",
        version=restored.version if restored else None,
        step=step,
        pointer=assignment.checkpoint.version if assignment.checkpoint else None,
        started=process_started(),
        pid=os.getpid(),
        bytes_from=restored.bytes_from if restored else None,
        plan=dataclasses.asdict(plan),
    )

    def state() -> dict[str, object]:
        return snapshot(model, optimizer, sampler)

    saved = step - 1  # the version restored, if any
    loss = torch.tensor(float("nan"))
    with PreemptionWatcher(client) as watcher:
        for batches in optimizer_steps(loader, sampler, plan, whole=args.global_batch is not None):
            if step >= args.steps:
                break
            loss = train_step(ddp, optimizer, sampler, batches, device, args.step_time)
            if args.log_items:
                event(
                    "items",
                    step=step,
                    epoch=sampler.epoch,
                    indices=items(batches),
                    loss=float(loss.item()).hex(),
                )
            if rank == 0:
                event("step", step=step, loss=round(loss.item(), 4))
            if step % args.checkpoint_every == 0:
                # async: blocks only for the copy
                checkpoints.save(state(), step, rank_state=rank_state())
                saved = step
            if watcher.should_stop():
                if saved != step:
                    checkpoints.save(
                        state(), step, rank_state=rank_state(), blocking=True, persist=True
                    )
                info = checkpoints.wait()
                event("emergency", step=step, version=info.version if info else None)
                watcher.finish()  # leaves (the notified node) or awaits the restart
            step += 1
    if args.save_last and saved != step - 1:
        checkpoints.save(state(), step - 1, rank_state=rank_state(), blocking=True, persist=True)
    checkpoints.wait()
    event("finished", step=step, loss=round(loss.item(), 4), digest=digest(model, optimizer))
    checkpoints.close()
    dist.destroy_process_group()


def data_loader(
    dataset: TensorDataset, sampler: ElasticSampler, batch_size: int
) -> DataLoader[tuple[torch.Tensor, ...]]:
    """This rank's loader. Its generator is its own: every iterator a DataLoader makes
    draws its workers' base seed from its generator, by default torch's global RNG, and
    an iterator made after a restore would move the RNG that ``rank_state`` restored
    one draw ahead of the uninterrupted run (every dropout mask after it differs)."""
    return DataLoader(dataset, batch_size, sampler=sampler, generator=torch.Generator())


def indexed(images: torch.Tensor, labels: torch.Tensor) -> TensorDataset:
    """The dataset, each item with its index: what a rank trained can be told from it."""
    return TensorDataset(images, labels, torch.arange(len(labels)))


def batch_plan(args: argparse.Namespace, rank: int, world: int) -> BatchPlan:
    """This world's per-rank batch and accumulation steps. With ``--global-batch``, those
    that keep it (``WorldSizeError`` for a world that cannot split it); without, the
    per-rank batch is kept and the global batch follows the world."""
    if args.global_batch is None:
        return BatchPlan(args.batch_size * world, world, args.batch_size, 1)
    plan = plan_batch(args.global_batch, world, micro_batch=args.batch_size)
    if rank == 0:
        print(plan.describe(), flush=True)
    return plan


def optimizer_steps(
    loader: DataLoader[tuple[torch.Tensor, ...]],
    sampler: ElasticSampler,
    plan: BatchPlan,
    whole: bool,
) -> Iterator[Step]:
    """This rank's optimizer steps without end, each ``plan.accumulation`` batches: the
    rest of this epoch, then the next. With ``whole`` (the global batch kept), every step
    takes the whole global batch and an epoch's tail too short for one is skipped, so
    each epoch has the same steps at every world size; without, an epoch's last batch
    may be short, as a ``DataLoader``'s is."""
    while True:
        if sampler.remaining < plan.global_batch:
            sampler.set_epoch(sampler.epoch + 1)
        batches: Step = []
        for x, y, i in loader:
            batches.append((x, y, i))
            if len(batches) == plan.accumulation:
                yield batches
                batches = []
                if whole and sampler.remaining < plan.global_batch:
                    break  # the rest is this epoch's tail: the loader would deal it
        if batches and not whole:
            yield batches


def items(batches: Step) -> list[int]:
    """The indices of the items one optimizer step trained on this rank."""
    return [index for _, _, i in batches for index in i.tolist()]


def rank_state() -> dict[str, torch.Tensor]:
    """What is this rank's own: its RNG (dropout draws from it)."""
    return {"rng": torch.get_rng_state()}


def restore(
    restored: Any, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler
) -> int:
    """Loads a restored version into the training state; the step to run next (the
    checkpoint of step s is taken after step s)."""
    model.load_state_dict(restored.state["model"])
    optimizer.load_state_dict(restored.state["optimizer"])
    sampler.load_state_dict(restored.state["sampler"])
    if restored.rank_state is not None:  # None: saved at another world size
        torch.set_rng_state(restored.rank_state["rng"])
    return int(restored.step) + 1


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A hash of the model's and the optimizer's tensors, to tell runs apart bit by bit."""
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), *optimizer.state_dict()["state"].values()]:
        for v in t.values() if isinstance(t, dict) else [t]:
            if isinstance(v, torch.Tensor):
                h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train_step(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    sampler: ElasticSampler,
    batches: Step,
    device: torch.device,
    step_time: float,
) -> torch.Tensor:
    """One optimizer step over this rank's batches, gradients averaged over all of them
    (synchronized across ranks with the last); its loss, the mean over the batches."""
    optimizer.zero_grad()
    loss = torch.zeros((), device=device)
    for n, (x, y, _) in enumerate(batches, 1):
        # Each batch's share of the step's mean; only the last backward all-reduces.
        sync = contextlib.nullcontext() if n == len(batches) else ddp.no_sync()
        with sync:
            part = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)) / len(batches)
            torch.autograd.backward(part)
        loss += part.detach()
    optimizer.step()
    sampler.advance(len(batches))
    if step_time:
        time.sleep(step_time)
    return loss


def snapshot(
    model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler
) -> dict[str, object]:
    """What a checkpoint holds."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
    }


def resources() -> dict[str, int]:
    """This process's resident memory (KiB), threads and open file descriptors (Linux):
    a process that regroups in place must not grow them generation after generation."""
    try:
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return {
            "rss_kib": rss,
            "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")),
        }
    except (OSError, StopIteration, ValueError):
        return {}


def emit(path: str | None, kind: str, **fields: object) -> None:
    """Appends one event line to ``path`` (one short append per line: atomic)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "event": kind, **fields}) + "\n")


def main_in_place(args: argparse.Namespace) -> None:
    """The same training, regrouping in place: the model, the optimizer and this process
    outlive each generation; the process group, DDP and the sampler are the
    generation's."""
    client = ElasticClient.from_env()
    client.join()  # under torchrun: the agent's assignment
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(args.seed)
    dataset = indexed(*synthetic_cifar(args.samples, args.seed))
    model = SmallCNN(args.dropout).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoints = CheckpointManager(
        client,
        progress=False,
        persist_every=args.persist_every,
        if_busy=args.if_busy,
        fence=[model, optimizer],
    )
    step = 0
    loss = torch.tensor(float("nan"))
    for generation in checkpoints.generations():
        rank, world = generation.rank, generation.world_size
        if cuda:
            torch.cuda.set_device(generation.local_rank)
        event = functools.partial(
            emit, args.events, generation=generation.number, rank=rank, world_size=world
        )

        ddp = DistributedDataParallel(model)  # on this generation's process group
        with checkpoints.loading():
            plan = batch_plan(args, rank, world)
        sampler = ElasticSampler(
            args.samples, rank=rank, world_size=world, seed=args.seed, batch_size=plan.micro_batch
        )
        loader = data_loader(dataset, sampler, plan.micro_batch)
        step = 0
        restored = checkpoints.load_latest()
        if restored is not None:
            step = restore(restored, model, optimizer, sampler)
        restored_at = time.time()
        event(
            "resumed",
            version=restored.version if restored else None,
            step=step,
            pointer=generation.assignment.checkpoint.version
            if generation.assignment.checkpoint
            else None,
            started=process_started(),
            pid=os.getpid(),
            bytes_from=restored.bytes_from if restored else None,
            in_place=generation.regrouped,
            regroup={**generation.timings, "restored": restored_at},
            resources=resources(),
            plan=dataclasses.asdict(plan),
        )
        saved = step - 1  # the version restored, if any
        whole = args.global_batch is not None
        with generation, PreemptionWatcher(client) as watcher:
            for batches in optimizer_steps(loader, sampler, plan, whole=whole):
                if step >= args.steps:
                    break
                loss = train_step(ddp, optimizer, sampler, batches, device, args.step_time)
                if args.log_items:
                    event(
                        "items",
                        step=step,
                        epoch=sampler.epoch,
                        indices=items(batches),
                        loss=float(loss.item()).hex(),
                    )
                if rank == 0:
                    event("step", step=step, loss=round(loss.item(), 4))
                if step % args.checkpoint_every == 0:
                    state = snapshot(model, optimizer, sampler)
                    checkpoints.save(state, step, rank_state=rank_state())
                    saved = step
                if watcher.should_stop():
                    if saved != step:
                        state = snapshot(model, optimizer, sampler)
                        checkpoints.save(
                            state, step, rank_state=rank_state(), blocking=True, persist=True
                        )
                    info = checkpoints.wait()
                    event("emergency", step=step, version=info.version if info else None)
                    if watcher.notice is not None:
                        watcher.finish()  # this node leaves: the others regroup
                    while True:  # a survivor: the departure ends the generation
                        generation.check()
                        time.sleep(0.01)
                generation.check()
                step += 1
            if args.save_last and saved != step - 1:  # the loop ran to --steps
                state = snapshot(model, optimizer, sampler)
                checkpoints.save(
                    state, step - 1, rank_state=rank_state(), blocking=True, persist=True
                )
        if step >= args.steps:
            break
    checkpoints.wait()
    emit(
        args.events,
        "finished",
        generation=generation.number,
        rank=generation.rank,
        world_size=generation.world_size,
        step=step,
        loss=round(loss.item(), 4),
        digest=digest(model, optimizer),
    )
    checkpoints.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
