"""The DDP example under PyTorch Lightning, launched by torchrun with the rallypoint backend.

Lightning runs the loop; a callback does what ``train_ddp.py`` does by hand: resume from
the checkpoint the coordinator named, save asynchronously with ``CheckpointManager``,
and on a preemption notice stop every rank at the same step with an emergency
checkpoint::

    torchrun --rdzv-backend=rallypoint --rdzv-endpoint=http://127.0.0.1:8080 \\
        --rdzv-id=lit --nnodes=1:4 --max-restarts=100 trainer/examples/train_lightning.py

Lightning's own checkpointing and distributed sampler are off: the checkpoint and the
data position are Rallypoint's, so a restart at another world size resumes exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any, cast

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager, ElasticSampler, PreemptionWatcher
from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar


class Classifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = SmallCNN()
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = nn.functional.cross_entropy(self.model(x), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


class Batches(Sampler[list[int]]):
    """Endless batches from an ElasticSampler, rolling over epochs. Lightning calls
    ``set_epoch`` on samplers it finds; this one keeps its sampler to itself, so the
    restored position is not reset to epoch 0."""

    def __init__(self, sampler: ElasticSampler, batch_size: int) -> None:
        self._elastic = sampler
        self._batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            for batch in torch.split(torch.tensor(list(self._elastic)), self._batch_size):
                if len(batch) == self._batch_size:
                    yield batch.tolist()
            self._elastic.set_epoch(self._elastic.epoch + 1)


class Rallypoint(L.Callback):
    """Checkpoints through the coordinator and stops cleanly on a preemption notice."""

    def __init__(
        self,
        client: ElasticClient,
        checkpoints: CheckpointManager,
        sampler: ElasticSampler,
        start: int,
        every: int,
        event: Any,
    ) -> None:
        self.client, self.checkpoints, self.sampler = client, checkpoints, sampler
        self.start, self.every, self.event = start, every, event
        self.restore: dict[str, Any] | None = None
        self.watcher = PreemptionWatcher(client)
        self.saved = -1
        self.loss = float("nan")

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.restore is not None:
            trainer.optimizers[0].load_state_dict(self.restore)
        self.watcher.start()

    def state(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any]:
        return {
            "model": cast(Classifier, module).model.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict(),
            "sampler": self.sampler.state_dict(),
        }

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step = self.start + trainer.global_step - 1  # global_step counts this step already
        self.sampler.advance()
        self.loss = round(float(outputs["loss"]), 4)
        if trainer.global_rank == 0:
            self.event("step", step=step, loss=self.loss)
        if step % self.every == 0:
            self.checkpoints.save(self.state(trainer, module), step)
            self.saved = step
        if self.watcher.should_stop():
            if self.saved != step:
                self.checkpoints.save(
                    self.state(trainer, module), step, blocking=True, persist=True
                )
            info = self.checkpoints.wait()
            self.event("emergency", step=step, version=info.version if info else None)
            self.watcher.finish()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.checkpoints.wait()
        self.watcher.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--events", help="append JSON lines of what happened to this file")
    args = parser.parse_args()

    client = ElasticClient.from_env()
    a = client.join()  # the agent's assignment
    torch.set_num_threads(1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = a.rank * local_world + int(os.environ.get("LOCAL_RANK", "0"))
    world = a.world_size * local_world

    def event(kind: str, **fields: object) -> None:
        if args.events:
            line = {"t": time.time(), "event": kind, "generation": a.generation}
            line.update(rank=rank, world_size=world, **fields)
            with open(args.events, "a") as f:
                f.write(json.dumps(line) + "\n")

    images, labels = synthetic_cifar(args.samples, 0)
    module = Classifier(args.lr)
    sampler = ElasticSampler(args.samples, rank=rank, world_size=world, batch_size=args.batch_size)
    checkpoints = CheckpointManager(client, progress=False)
    start, optimizer_state = 0, None
    if (restored := checkpoints.load_latest()) is not None:
        module.model.load_state_dict(restored.state["model"])
        sampler.load_state_dict(restored.state["sampler"])
        optimizer_state = restored.state["optimizer"]
        start = restored.step + 1
    event("resumed", version=restored.version if restored else None, step=start)
    callback = Rallypoint(client, checkpoints, sampler, start, args.checkpoint_every, event)
    callback.restore = optimizer_state

    trainer = L.Trainer(
        accelerator="cpu",
        devices=local_world,
        num_nodes=a.world_size,
        strategy="ddp",
        max_steps=max(0, args.steps - start),
        callbacks=[callback],
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    data = DataLoader(
        TensorDataset(images, labels), batch_sampler=Batches(sampler, args.batch_size)
    )
    trainer.fit(module, data)
    event("finished", step=args.steps, loss=None)


if __name__ == "__main__":
    main()
