"""Lightning's own checkpointing, side by side with rallypoint.trainer.lightning.

One process trains an MLP of ``--mib`` MiB of parameters with Adam (the checkpoint is
about 3x that: weights and two moments) under Lightning 2.6, on the CPU or one GPU
(``--device cuda``: ``accelerator="gpu", devices=1``), in float32 or, with ``--bf16``,
in bfloat16 throughout (``precision="bf16-true"``: parameters and Adam's moments, so
the checkpoint is bfloat16 too, as in most training on GPUs today), saving after
every step (a callback's ``on_train_batch_end``, where ``ModelCheckpoint`` saves), one
warm-up and ``--repeat`` timed, through each of:

1. ``trainer.save_checkpoint(path)`` with Lightning's default ``TorchCheckpointIO``
   (``torch.save`` to a local file): the synchronous anchor;
2. the same with ``plugins=[AsyncCheckpointIO()]``: Lightning's async option (it clones
   every tensor on the training thread, then ``torch.save`` in a thread);
3. ``RallypointDDPStrategy``: ``ModelCheckpoint``'s save path through
   ``CheckpointManager`` (staged into reused buffers, then DCP through the coordinator
   to this node's memory tier in the background).

Blocked is how long ``save_checkpoint`` keeps training waiting; each save is drained
before the next (not timed). Restore, at the end of training (``on_train_end``), is the
time from nothing in memory to the model and optimizer loaded: Lightning's
``strategy.load_checkpoint`` of its file (the page cache warm: it was just written)
plus ``load_state_dict``, against the integration's ``load_checkpoint`` of the version
the coordinator names, read from the node's memory tier (``/dev/shm``, every item's
checksum verified), plus the same ``load_state_dict``. Medians; ratios are printed.
On a GPU the timers start and stop with the GPU idle (``torch.cuda.synchronize()``), so
a save is not charged for training work still queued, and a restore is done only once
its copies to the GPU are.

A fast restore is worth nothing unless it brings back what was saved: a SHA-256 of the
model's and the optimizer's tensors (dtype, shape, bytes) taken at the last save must
match the same digest after every restore, of each variant ("restore hash-equal"); the
script fails if Rallypoint's does not.

Usage: python bench/frameworks_lightning.py [--mib 128] [--repeat 5] [--device cpu|cuda]
    [--bf16] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from _frameworks import (  # noqa: E402
    WIDTH,
    Timings,
    checkpoint_mib,
    command_line,
    coordinator,
    described,
    dtype_of,
    layers,
    name_the_last_version,
)
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from rallypoint.trainer import SavePolicy  # noqa: E402
from rallypoint.trainer.lightning import RallypointDDPStrategy  # noqa: E402


class MLP(L.LightningModule):
    def __init__(self, mib: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.net = layers(mib, dtype)  # Lightning casts it (precision="bf16-true")

    def training_step(self, batch: tuple[torch.Tensor], index: int) -> torch.Tensor:
        out: torch.Tensor = self.net(batch[0]).pow(2).mean()
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Measure(L.Callback, Timings):
    """Saves after every step, and restores at the end of training, while the trainer is
    still set up."""

    def __init__(
        self,
        name: str,
        work: Path,
        repeat: int,
        device: str,
        drain: Callable[[L.Trainer], None],
        restore: Callable[[L.Trainer, str], None],
    ) -> None:
        Timings.__init__(self, repeat, device)
        self.name, self.work = name, work
        self.drain, self.restore = drain, restore
        self.path: str | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.path is not None and os.path.exists(self.path):
            os.remove(self.path)  # keeps the disk's use to one checkpoint at a time
        path = self.path = str(self.work / f"{self.name}-{trainer.global_step}.ckpt")
        self.save(
            trainer.global_step,
            trainer.global_step == trainer.max_steps,
            lambda: trainer.save_checkpoint(path),
            lambda: self.drain(trainer),
            lambda: tensors(trainer),
        )

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        path = self.path
        assert path is not None
        self.restores(
            trainer.global_step, lambda: self.restore(trainer, path), lambda: tensors(trainer)
        )
        if os.path.exists(path):
            os.remove(path)


def tensors(trainer: L.Trainer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What a restore must bring back: the model's and the optimizers' state dicts."""
    return trainer.lightning_module.state_dict(), [o.state_dict() for o in trainer.optimizers]


def apply(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """What Lightning does with a loaded checkpoint's tensors."""
    # The last save's: nothing trained after it (Measure.on_train_end).
    assert checkpoint["global_step"] == trainer.global_step, checkpoint["global_step"]
    trainer.lightning_module.load_state_dict(checkpoint["state_dict"])
    for optimizer, state in zip(trainer.optimizers, checkpoint["optimizer_states"], strict=True):
        optimizer.load_state_dict(state)


def lightning_restore(trainer: L.Trainer, path: str) -> None:
    apply(trainer, trainer.strategy.load_checkpoint(path))


def rallypoint_restore(trainer: L.Trainer, path: str) -> None:
    strategy = trainer.strategy
    assert isinstance(strategy, RallypointDDPStrategy)
    named = name_the_last_version(strategy.session.manager)
    assert named.step == trainer.global_step, named
    resume = strategy.session.resume_path()
    assert resume is not None
    apply(trainer, strategy.load_checkpoint(resume))
    restored = strategy.restored
    assert restored is not None and restored.bytes_from["memory"] > 0, restored
    assert restored.version == named.version, restored


def wait_async(trainer: L.Trainer) -> None:
    trainer.strategy.checkpoint_io.teardown()  # waits for the thread; made again next save


def run(name: str, args: argparse.Namespace, work: Path, **trainer_kwargs: Any) -> Measure:
    torch.manual_seed(0)
    module = MLP(args.mib, dtype_of(args))
    rallypoint = name == "rallypoint"
    measure = Measure(
        name,
        work,
        args.repeat,
        args.device,
        drain=(lambda t: t.strategy.checkpoint_io.teardown())
        if rallypoint
        else wait_async
        if name == "async"
        else (lambda t: None),
        restore=rallypoint_restore if rallypoint else lightning_restore,
    )
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-true" if args.bf16 else "32-true",
        max_steps=args.repeat + 1,
        callbacks=[measure],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=str(work),
        **trainer_kwargs,
    )
    data = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=4)
    trainer.fit(module, data)
    return measure


def main() -> None:
    args = command_line(__doc__, mib=128, optimizer="Adam")
    with coordinator("bench-lightning") as (work, clients):
        client = clients["bench-lightning"]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        results = {
            "sync": run("sync", args, work),
            "async": run("async", args, work, plugins=[AsyncCheckpointIO()]),
            # Routine versions stay in memory (the first always goes to storage too).
            "rallypoint": run(
                "rallypoint",
                args,
                work,
                strategy=RallypointDDPStrategy(client, policy=SavePolicy(persist_every=1000)),
            ),
        }
    dtype = dtype_of(args)
    size = checkpoint_mib(MLP(args.mib, dtype), dtype)
    print(
        f"lightning {L.__version__}, torch {torch.__version__}, {described(args)}, "
        f"checkpoint ~{size} MiB (weights + Adam), median of {args.repeat} after a warm-up"
    )
    blocked = {k: statistics.median(m.blocked) for k, m in results.items()}
    restore = {k: statistics.median(m.restored) for k, m in results.items()}
    print(f"{'':<40}{'blocked per save':>18}{'restore':>12}")
    labels = {
        "sync": "trainer.save_checkpoint (TorchCheckpointIO)",
        "async": "AsyncCheckpointIO",
        "rallypoint": "RallypointDDPStrategy (memory tier)",
    }
    for key, label in labels.items():
        print(f"{label:<44}{blocked[key] * 1000:>11.1f} ms{restore[key] * 1000:>9.1f} ms")
    for key, label in labels.items():
        print(f"{label}: restore hash-equal: {'yes' if all(results[key].equal) else 'no'}")
    r = blocked["rallypoint"]
    print(f"blocked: {r / blocked['sync']:.3f}x the sync save (goal <= 0.2x)")
    print(f"blocked: {r / blocked['async']:.3f}x AsyncCheckpointIO (goal <= 1.0x)")
    print(
        f"restore: {restore['sync'] / restore['rallypoint']:.2f}x faster than Lightning's "
        "from local disk (goal >= 2x)"
    )
    if not all(results["rallypoint"].equal):
        sys.exit("Rallypoint's restore did not bring back the last save's tensors")


if __name__ == "__main__":
    main()
