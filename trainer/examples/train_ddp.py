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
import hashlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from rallypoint.client import STANDBY_ROUND_ENV, Assignment, ElasticClient
from rallypoint.trainer import (
    BatchPlan,
    CheckpointManager,
    ElasticSampler,
    Generation,
    PreemptionWatcher,
    Restored,
    phase,
    plan_batch,
)
from rallypoint.trainer.examples._events import Event, events, process_started, resources
from rallypoint.trainer.examples._launch import (
    add_image_size,
    arguments,
    pause,
    start_process_group,
)

# One optimizer step's batches on one rank: (images, labels, indices), one per
# accumulation step.
Step = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def synthetic_cifar(samples: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-shaped images (``size`` a side) and labels a small CNN can learn, the same on
    every rank: each class has a fixed random pattern, and each image is its class's
    under noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, size, size, generator=g)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = 0.5 * patterns[labels] + torch.randn(samples, 3, size, size, generator=g)
    return images, labels


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0, image_size: int = 32) -> None:
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
        self.head = nn.Linear(32 * (image_size // 4) ** 2, 10)  # after two 2x pools

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.dropout(self.features(x).flatten(1)))
        return logits


def main() -> None:
    parser = arguments(__doc__.split("\n")[0])
    add_image_size(parser)
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
    parser.add_argument(
        "--if-busy",
        choices=("wait", "skip"),
        default="wait",
        help="a checkpoint due while the last one still uploads: wait for it, or skip",
    )
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
    parser.add_argument(
        "--eval-every", type=int, default=0, help="steps between evaluations (0: none)"
    )
    parser.add_argument(
        "--eval-seconds",
        type=float,
        default=1.0,
        help="how long each evaluation runs forward passes over the data (every rank)",
    )
    parser.add_argument(
        "--first-step-extra",
        type=float,
        default=0.0,
        help="extra seconds in each process's first step, as a first step that compiles",
    )
    args = parser.parse_args()
    if args.in_place:
        main_in_place(args)
        return

    client = ElasticClient.from_env()
    assignment = client.join()  # under torchrun: the agent's assignment, no new round
    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    event = events(args.events, generation=assignment.generation, rank=rank, world_size=world)

    torch.manual_seed(args.seed)
    dataset = indexed(*synthetic_cifar(args.samples, args.seed, args.image_size))
    model = SmallCNN(args.dropout, args.image_size).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    checkpoints = CheckpointManager(
        client, progress=False, persist_every=args.persist_every, if_busy=args.if_busy
    )
    loop = Loop(args, optimizer, checkpoints, dataset, device)
    loop.regroup(ddp, rank, world, event)

    # What fails while loading is reported: a load that cannot succeed at this world
    # size ends the generation with its reason instead of restarting forever.
    with checkpoints.resuming() as restored:
        loop.resume(restored)
    event("resumed", **loop.resumed(restored, assignment))

    with PreemptionWatcher(client) as watcher:
        loop.run(watcher)  # a notice ends this process, with an emergency checkpoint
    loop.finish()
    dist.destroy_process_group()


def main_in_place(args: argparse.Namespace) -> None:
    """The same training, regrouping in place: the model, the optimizer and this process
    outlive each generation; the process group, DDP and the sampler are the
    generation's."""
    client = ElasticClient.from_env()
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(args.seed)
    dataset = indexed(*synthetic_cifar(args.samples, args.seed, args.image_size))
    model = SmallCNN(args.dropout, args.image_size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Under torchrun: the agent's assignment. A hot standby's worker (hot_standby=1)
    # or a hot join's (a node that joins a running job) waits here, its model built,
    # until its node goes in.
    if os.environ.get(STANDBY_ROUND_ENV):
        standing_by = events(args.events, generation=0, rank=-1, world_size=0)
        standing_by("standing_by", pid=os.getpid(), node=client.node_id)
    client.join()
    checkpoints = CheckpointManager(
        client,
        progress=False,
        persist_every=args.persist_every,
        if_busy=args.if_busy,
        fence=[model, optimizer],
    )
    loop = Loop(args, optimizer, checkpoints, dataset, device)
    for generation in checkpoints.generations():
        rank, world = generation.rank, generation.world_size
        if cuda:
            torch.cuda.set_device(generation.local_rank)
        event = events(args.events, generation=generation.number, rank=rank, world_size=world)
        # On this generation's process group.
        loop.regroup(DistributedDataParallel(model), rank, world, event)
        restored = checkpoints.load_latest()  # in place: memory, then peers
        loop.resume(restored)
        restored_at = time.time()
        event(
            "resumed",
            **loop.resumed(restored, generation.assignment),
            in_place=generation.regrouped,
            regroup={**generation.timings, "restored": restored_at},
            resources=resources(),
        )
        # A membership change ends the block quietly (GenerationEnded, or a collective
        # failed because a peer went), and the loop goes on in the next generation.
        with generation, PreemptionWatcher(client) as watcher:
            loop.run(watcher, generation)
        if loop.step >= args.steps:
            break
    loop.finish()
    dist.destroy_process_group()


class Loop:
    """The training loop, and where it is: the step to run next, the last step saved and
    the last loss. In place, one loop outlives the generations; each gives it its DDP
    model and sampler (:meth:`regroup`) and its version to resume from (:meth:`resume`).

    Args:
        args: The command line.
        optimizer: The optimizer of the model that :meth:`regroup`'s DDP wraps.
        checkpoints: What saves and loads.
        dataset: The whole dataset, with each item's index.
        device: Where the model is.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        optimizer: torch.optim.Optimizer,
        checkpoints: CheckpointManager,
        dataset: TensorDataset,
        device: torch.device,
    ) -> None:
        self.args, self.optimizer, self.checkpoints = args, optimizer, checkpoints
        self.dataset, self.device = dataset, device
        self.step = 0
        self.stepped = False  # this process trained a step (its first is its compile's)
        self.saved = -1
        self.loss = torch.tensor(float("nan"))

    def regroup(self, ddp: DistributedDataParallel, rank: int, world: int, event: Event) -> None:
        """Takes a generation's DDP model, rank and world size: the per-rank batch, the
        sampler and the loader follow from them."""
        self.ddp, self.model, self.rank, self.event = ddp, ddp.module, rank, event
        # A world that cannot split the global batch is reported with the sizes that can
        # (WorldSizeError, in loading()): the coordinator seals only those from then on.
        with self.checkpoints.loading():
            self.plan = batch_plan(self.args, rank, world)
        self.sampler = ElasticSampler(
            self.args.samples,
            rank=rank,
            world_size=world,
            seed=self.args.seed,
            batch_size=self.plan.micro_batch,
        )
        self.loader = data_loader(self.dataset, self.sampler, self.plan.micro_batch)

    def resume(self, restored: Restored | None) -> None:
        """Loads ``restored`` into the model, the optimizer, the sampler and this rank's
        RNG, to run the step after it; without one, the loop starts at step 0."""
        self.step = 0
        if restored is not None:
            self.step = restore(restored, self.model, self.optimizer, self.sampler)
        self.saved = self.step - 1  # the version restored, if any

    def resumed(self, restored: Restored | None, assignment: Assignment) -> dict[str, object]:
        """The ``resumed`` event's fields: what was restored, from where, and the plan."""
        return {
            "version": restored.version if restored else None,
            "step": self.step,
            "pointer": assignment.checkpoint.version if assignment.checkpoint else None,
            "started": process_started(),
            "pid": os.getpid(),
            "bytes_from": restored.bytes_from if restored else None,
            "plan": dataclasses.asdict(self.plan),
        }

    def run(self, watcher: PreemptionWatcher, generation: Generation | None = None) -> None:
        """Trains up to ``--steps``, saving every ``--checkpoint-every`` steps (and the
        last with ``--save-last``). On a preemption notice every rank stops at the same
        step with an emergency checkpoint: the notified node leaves, and the others
        await the restart or, in place (``generation``), the generation's end."""
        args = self.args
        whole = args.global_batch is not None
        for batches in optimizer_steps(self.loader, self.sampler, self.plan, whole=whole):
            if self.step >= args.steps:
                break
            if not self.stepped and args.first_step_extra:
                time.sleep(args.first_step_extra)  # as a compile would, before its step
            self.loss = train_step(self.ddp, self.optimizer, self.sampler, batches, self.device)
            self.stepped = True
            pause(args)
            if args.eval_every and self.step % args.eval_every == 0:
                self.evaluate()
            if args.log_items:
                self.event(
                    "items",
                    step=self.step,
                    epoch=self.sampler.epoch,
                    indices=items(batches),
                    loss=float(self.loss.item()).hex(),
                )
            if self.rank == 0:
                self.event("step", step=self.step, loss=round(self.loss.item(), 4))
            stop = watcher.should_stop()  # a collective: every rank stops at the same step
            if self.step % args.checkpoint_every == 0 or stop:
                # Async (blocks only for the copy); on a notice, to storage and complete
                # before the node goes. Asked before the routine save: a notice at a
                # checkpoint step left that version in memory only, and a second version
                # of the same step never becomes latest.
                self.save(self.step, now=stop)
            if stop:
                info = self.checkpoints.wait()
                self.event("emergency", step=self.step, version=info.version if info else None)
                if generation is None or watcher.notice is not None:
                    watcher.finish()  # leaves (the notified node) or awaits the restart
                # A survivor in place: the notified node's ranks wait in finish()'s
                # barrier for every rank, then leave, which ends the generation.
                dist.barrier()
                while not generation.ended:
                    time.sleep(0.01)
                return
            if generation is not None:
                generation.check()
            self.step += 1
        if args.save_last and self.saved != self.step - 1:  # the loop ran to --steps
            self.save(self.step - 1, now=True)

    def evaluate(self) -> None:
        """Forward passes over the data for ``--eval-seconds``, on every rank, marked as
        an evaluation: its time counts against the job's ``phase_limit``, not its hang
        limit."""
        started = time.monotonic()
        with phase("eval"), torch.no_grad():
            batches = 0
            while time.monotonic() - started < self.args.eval_seconds:
                for x, _, _ in self.loader:
                    self.model(x.to(self.device))
                    batches += 1
                    if time.monotonic() - started >= self.args.eval_seconds:
                        break
        self.event("evaluated", step=self.step, batches=batches)

    def save(self, step: int, *, now: bool = False) -> None:
        """Saves the state after ``step`` asynchronously, or ``now``: to storage whatever
        ``--persist-every`` says, and complete when this returns."""
        state = snapshot(self.model, self.optimizer, self.sampler)
        self.checkpoints.save(state, step, rank_state=rank_state(), blocking=now, persist=now)
        self.saved = step

    def finish(self) -> None:
        """Waits for the last save, writes the ``finished`` event (the trained state's
        digest with it) and closes the checkpoint manager."""
        self.checkpoints.wait()
        digested = digest(self.model, self.optimizer)
        self.event("finished", step=self.step, loss=round(self.loss.item(), 4), digest=digested)
        self.checkpoints.close()


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


if __name__ == "__main__":
    main()
