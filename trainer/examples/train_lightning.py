"""A CIFAR-10-style Lightning script on Rallypoint, launched by torchrun with the rallypoint
backend: Lightning runs the loop and ``ModelCheckpoint`` decides when to save; the
strategy resumes from the coordinator's version and saves through its tiers::

    torchrun --rdzv-backend=rallypoint --rdzv-endpoint=http://127.0.0.1:8080 \\
        --rdzv-id=lit --nnodes=1:4 --nproc-per-node=2 --max-restarts=100 \\
        trainer/examples/train_lightning.py --strategy ddp

``--strategy model-parallel`` shards the same network with FSDP2 (``fully_shard`` in
``configure_model``) under ``RallypointModelParallelStrategy``. The data is synthetic
(random 32x32x3 images around a pattern per class): nothing is downloaded. Each item
carries its index, which ``--log-samples`` writes down for every batch a rank trains: the
tests count from it which samples of each epoch were trained, and how often.

The loader is a plain ``DataLoader(..., shuffle=True)``: the strategy replaces its
sampler with an ``ElasticSampler`` and keeps the global batch (``--batch-size`` x
``--accumulate`` x the first generation's ranks) at every world size. ``--own-sampler``
writes the loader as the docs had users write it before the strategy kept the data
position: an ``ElasticSampler`` of the script's own (``use_distributed_sampler=False``),
its state saved in ``on_save_checkpoint``, loaded in ``on_load_checkpoint`` and advanced
after each optimizer step; the strategy takes it over. ``--validate-first`` runs
``validate()`` on a few batches before ``fit()``, as a script that checks its model
first does: that builds the process group too.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
from typing import Any

import lightning as L
import torch
import xxhash
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, Subset

from rallypoint.trainer import ElasticSampler, SavePolicy
from rallypoint.trainer.examples._events import events
from rallypoint.trainer.examples._launch import add_image_size, arguments, pause
from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar
from rallypoint.trainer.lightning import RallypointDDPStrategy, RallypointModelParallelStrategy


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Images and labels, each item with its own index."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.images[i], self.labels[i], i


class Classifier(L.LightningModule):
    def __init__(
        self, lr: float, shard: bool, schedule: bool = False, image_size: int = 32
    ) -> None:
        super().__init__()
        self.model = SmallCNN(image_size=image_size)
        self.lr, self.shard, self.schedule = lr, shard, schedule

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):
                return  # sharded already: validate() ran before fit()

            assert self.device_mesh is not None  # set by ModelParallelStrategy
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.features:
                if isinstance(layer, nn.Conv2d):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], index: int
    ) -> torch.Tensor:
        x, y, _ = batch
        loss: torch.Tensor = nn.functional.cross_entropy(self.model(x), y)
        return loss

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], index: int
    ) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.model(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        if not self.schedule:
            return optimizer
        # Lightning sets up the training loader here, before a resume restores the loops.
        steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, self.lr, total_steps=steps)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def digest(state: Any) -> str:
    """One xxh3 over every tensor's full value (a collective for DTensors), in key order."""
    h = xxhash.xxh3_64()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            h.update(path.encode())
            h.update(full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}")

    walk(state, "")
    return h.hexdigest()


def local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard of it."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [local(v) for v in value]
    return value


def saves_back(state: Any) -> bool:
    """Whether ``torch.save`` of ``state`` loads back equal: what a user's own backup of a
    resumed run does with the restored tensors."""
    mine = local(state)
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    buffer.seek(0)
    return digest(torch.load(buffer, weights_only=False)) == digest(mine)


class Events(L.Callback):
    """Appends what happened to a JSON-lines file (the tests' ``judge`` reads it)."""

    def __init__(
        self, path: str | None, digests: bool, pace: argparse.Namespace, samples: bool
    ) -> None:
        self.digests, self.pace = digests, pace
        self.samples = samples
        self.step = 0
        self.final: str | None = None  # the digest when training ended
        self.path = path
        self._label()
        self.loss = float("nan")

    def _label(self) -> None:
        """Labels the events with the process's rank, world and generation as torchrun's
        variables say. Read again at ``setup``: a newcomer's worker starts while its node
        parks (a hot join), with placeholders that the strategy's ``join()`` replaces."""
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        generation = int(os.environ.get("RALLYPOINT_GENERATION", "0"))
        self.event = events(self.path, generation=generation, rank=self.rank, world_size=self.world)

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._label()

    def state_digest(self, trainer: L.Trainer) -> str:
        strategy = trainer.strategy
        model = strategy.lightning_module_state_dict()
        optimizers = [strategy.optimizer_state(o) for o in trainer.optimizers]
        return digest({"state_dict": model, "optimizer_states": optimizers})

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        restored = getattr(trainer.strategy, "restored", None)
        plan = getattr(trainer.strategy, "batch_plan", None)
        self.event(
            "resumed",
            plan=dataclasses.asdict(plan) if plan is not None else None,
            batches=trainer.num_training_batches,
            version=restored.version if restored else None,
            step=trainer.global_step,  # the next step to run
            saved_by=restored.world_size if restored else None,
            bytes_from=restored.bytes_from if restored else None,
            digest=self.state_digest(trainer) if self.digests else None,
            saves_back=saves_back(
                {
                    "model": module.state_dict(),
                    "optimizers": [o.state_dict() for o in trainer.optimizers],
                }
            )
            if self.digests and restored
            else None,
        )

    def on_save_checkpoint(
        self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.digests:  # every rank: gathering a DTensor is a collective
            value = digest(
                {k: checkpoint[k] for k in ("state_dict", "optimizer_states") if k in checkpoint}
            )
            if self.rank == 0:
                self.event("saving", step=checkpoint["global_step"], digest=value)

    def on_train_batch_start(
        self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int
    ) -> None:
        self.step = trainer.global_step  # the optimizer step this batch goes into

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        loss = float(outputs["loss"])
        self.loss = round(loss, 4)
        if self.samples:
            self.event(
                "batch",
                step=self.step,
                epoch=trainer.current_epoch,
                batch=i,
                indices=batch[2].tolist(),
                accumulation=trainer.accumulate_grad_batches,
                loss=loss.hex(),  # exact, for bit-for-bit comparisons
            )
        pause(self.pace)  # paces a tiny model so that a test can act mid-run
        if self.rank == 0:
            self.event("step", step=trainer.global_step - 1, loss=self.loss)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.digests:  # every rank: gathering a DTensor is a collective
            self.final = self.state_digest(trainer)

    def on_exception(
        self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException
    ) -> None:
        preemption = getattr(trainer.strategy, "preemption", None)
        if preemption is not None and preemption.emergency is not None:
            self.event("emergency", step=trainer.global_step - 1, version=preemption.emergency)


class OwnSampler(L.Callback):
    """A script's own data position, kept by hand: its :class:`ElasticSampler` saved with
    every checkpoint, loaded back, and advanced past every optimizer step's batches."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.sampler.set_epoch(trainer.current_epoch)

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        accumulation = trainer.accumulate_grad_batches
        if (i + 1) % accumulation == 0:
            self.sampler.advance(accumulation)

    def on_save_checkpoint(
        self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["sampler"] = self.sampler.state_dict()

    def on_load_checkpoint(
        self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if "sampler" in checkpoint:
            self.sampler.load_state_dict(checkpoint["sampler"])


def main() -> None:
    parser = arguments(__doc__.split("\n")[0])
    add_image_size(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--strategy", choices=("ddp", "model-parallel"), default="ddp")
    parser.add_argument("--checkpoint-dir", help="ModelCheckpoint's dirpath")
    parser.add_argument("--ckpt-path", help="passed to fit(); the coordinator's version wins")
    parser.add_argument("--digests", action="store_true", help="hash the state at saves/loads")
    parser.add_argument("--log-samples", action="store_true", help="log each batch's indices")
    parser.add_argument("--epochs", type=int, default=-1, help="max_epochs (-1: --steps alone)")
    parser.add_argument(
        "--schedule", action="store_true", help="OneCycleLR over estimated_stepping_batches"
    )
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--num-workers", type=int, default=0, help="the DataLoader's")
    parser.add_argument(
        "--no-elastic-data", action="store_true", help="keep Lightning's DistributedSampler"
    )
    parser.add_argument(
        "--validate-first",
        action="store_true",
        help="validate() on a few batches before fit(): it builds the process group",
    )
    parser.add_argument(
        "--own-sampler",
        action="store_true",
        help="an ElasticSampler of the script's own, saved and loaded in its hooks",
    )
    parser.add_argument(
        "--keep-per-device-batch",
        action="store_true",
        help="keep --batch-size and --accumulate at every world size (not the global batch)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    policy = SavePolicy(persist_every=args.persist_every, progress=False)
    strategy: L.pytorch.strategies.Strategy
    elastic, keep = not args.no_elastic_data, not args.keep_per_device_batch
    if args.strategy == "ddp":
        strategy = RallypointDDPStrategy(
            policy=policy, elastic_data=elastic, keep_global_batch=keep
        )
    else:
        strategy = RallypointModelParallelStrategy(
            policy=policy, elastic_data=elastic, keep_global_batch=keep
        )
    events = Events(args.events, args.digests, args, args.log_samples)
    images, labels = synthetic_cifar(args.samples, 0, args.image_size)
    dataset = Indexed(images, labels)
    own: list[L.Callback] = []
    sampler: ElasticSampler | None = None
    if args.own_sampler:
        sampler = ElasticSampler(
            dataset,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            batch_size=args.batch_size,
            seed=5,
        )
        own.append(OwnSampler(sampler))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=sampler is None,
        callbacks=[
            events,
            *own,
            ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                save_last=True,
            ),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,  # not a process start every epoch
    )
    module = Classifier(args.lr, args.strategy == "model-parallel", args.schedule, args.image_size)
    if args.validate_first:
        few = Subset(dataset, range(4 * args.batch_size))
        trainer.validate(module, DataLoader(few, batch_size=args.batch_size), verbose=False)
    trainer.fit(module, loader, ckpt_path=args.ckpt_path)
    events.event("finished", step=trainer.global_step, loss=events.loss, digest=events.final)


if __name__ == "__main__":
    main()
