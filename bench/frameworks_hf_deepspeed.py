"""The HF Trainer's and DeepSpeed's own checkpointing, side by side with
rallypoint.trainer.transformers and rallypoint.trainer.deepspeed.

One process (world size 1) trains an MLP of ``--mib`` MiB of parameters with AdamW (the
checkpoint is about 3x that: weights and two moments), saving after every step, one
warm-up and ``--repeat`` timed, through each of:

HF Trainer (a callback's ``on_step_end``, where the Trainer saves), on the CPU (gloo) or,
with ``--device cuda``, on the one GPU the Trainer picks itself (NCCL); in float32 or,
with ``--bf16``, in bfloat16 throughout (the model cast before the Trainer gets it, so
the weights, AdamW's moments and the checkpoint are bfloat16, as in most training on
GPUs today; and ``bf16=True``, the Trainer's own bf16 setting, which it takes on the CPU
too):

1. ``Trainer._save_checkpoint``: the ``checkpoint-N`` folder (safetensors, ``torch.save``
   of optimizer, scheduler and RNG, ``trainer_state.json``), synchronous. The Trainer has
   no asynchronous save of its own;
2. ``RallypointTrainer._save_checkpoint``: one version, staged, then uploaded to this
   node's memory tier in the background.

DeepSpeed ZeRO-2 alone (``DS_ACCELERATOR=cpu``, set before DeepSpeed is imported, so
float32 on the CPU only: with ``--device cuda`` or ``--bf16`` these are skipped, and a
line says so):

3. ``engine.save_checkpoint`` through ``TorchCheckpointEngine`` (the default): synchronous;
4. through ``DecoupledCheckpointEngine`` (``"checkpoint": {"writer": {"type":
   "python", "decoupled": true, "data_parallel": "replica"}}``): the files go to a writer
   process; the next ``engine.step()`` waits for it to finish (the commit), so its
   blocked time is the save call plus that wait, both shown;
5. through ``FastCheckpointEngine`` (``"writer": {"type": "fast"}``).

4 and 5 are tried and, where they fail here, the reason is printed: on 0.19.8 with
ZeRO-2 on CPU the decoupled engine cannot pass ZeRO's fp32 partitions (which require
grad) through its ``torch.multiprocessing`` queue, and the fast writer needs an
accelerator device.
6. ``rallypoint.trainer.deepspeed.install``: one version, as 2.

Blocked is how long the save keeps training waiting; each save is drained before the
next (not timed). Restore is the time from nothing in memory to model and optimizer
loaded: the framework's loader of its files on local disk (the page cache warm: they were
just written) against the integration's load of the version the coordinator names, read
from the node's memory tier (``/dev/shm``, every item's checksum verified). Medians;
ratios are printed. On a GPU the timers start and stop with the GPU idle
(``torch.cuda.synchronize()``), so a save is not charged for training work still queued,
and a restore is done only once its copies to the GPU are.

A fast restore is worth nothing unless it brings back what was saved: for the HF Trainer
a SHA-256 of the model's and the optimizer's tensors (dtype, shape, bytes) taken at the
last save must match the same digest after every restore, of each variant ("restore
hash-equal"); the script fails if Rallypoint's does not.

Usage: python bench/frameworks_hf_deepspeed.py [--mib 64] [--repeat 5]
    [--device cpu|cuda] [--bf16] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
for name in ("DeepSpeed", "deepspeed", "transformers", "accelerate", "torch.distributed"):
    logging.getLogger(name).setLevel(logging.ERROR)

import torch  # noqa: E402
import transformers  # noqa: E402
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
from torch import nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from rallypoint.trainer import SavePolicy  # noqa: E402
from rallypoint.trainer._pack import unpack  # noqa: E402
from rallypoint.trainer.transformers import RallypointTrainer  # noqa: E402


class MLP(nn.Module):
    def __init__(self, mib: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net = layers(mib, dtype).to(dtype)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        loss = self.net(x.to(next(self.parameters()).dtype)).pow(2).mean()
        return {"loss": loss}


# --- the HF Trainer ---------------------------------------------------------------------


class Measure(TrainerCallback, Timings):
    """Saves after every step, and restores at the end of training (still set up)."""

    def __init__(self, repeat: int, device: str) -> None:
        Timings.__init__(self, repeat, device)
        self.trainer: Trainer | None = None

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a restore must bring back: the model's and the optimizer's state dicts."""
        trainer = self.trainer
        assert trainer is not None and trainer.optimizer is not None
        model = trainer.accelerator.unwrap_model(trainer.model)
        return model.state_dict(), trainer.optimizer.state_dict()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        output = trainer.args.output_dir
        assert output is not None  # TrainingArguments defaults it
        shutil.rmtree(output, ignore_errors=True)  # one checkpoint on disk

        def drain() -> None:  # what a save left running: not timed
            if isinstance(trainer, RallypointTrainer):
                trainer.checkpoints.wait()

        self.save(
            state.global_step,
            state.global_step == state.max_steps,
            lambda: trainer._save_checkpoint(trainer.model_wrapped, None),
            drain,
            self.state,
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        # The only checkpoint-N left: each save removes the one before.
        assert trainer.args.output_dir is not None
        folder = os.path.join(trainer.args.output_dir, f"checkpoint-{state.global_step}")

        def restore() -> None:
            if isinstance(trainer, RallypointTrainer):
                named = name_the_last_version(trainer.checkpoints)
                assert named.step == state.global_step, named
                scratch = trainer._restore()  # the version: trainer state and RNG files
                assert scratch is not None and trainer.restored is not None
                assert trainer.restored.bytes_from["memory"] > 0, trainer.restored
                assert trainer.restored.version == named.version, trainer.restored
                trainer._load_from_checkpoint(scratch)  # the model
                assert trainer.optimizer is not None and trainer.lr_scheduler is not None
                trainer.optimizer.load_state_dict(unpack(trainer.restored.state["optimizer"]))
                trainer.lr_scheduler.load_state_dict(unpack(trainer.restored.state["scheduler"]))
                trainer._load_rng_state(scratch)
            else:  # what train(resume_from_checkpoint=folder) loads
                trainer._load_from_checkpoint(folder)
                trainer._load_optimizer_and_scheduler(folder)
                trainer._load_rng_state(folder)

        self.restores(state.global_step, restore, self.state)


def run_trainer(rallypoint: bool, args: argparse.Namespace, work: Path, client: Any) -> Measure:
    torch.manual_seed(0)
    measure = Measure(args.repeat, args.device)
    training = TrainingArguments(
        output_dir=str(work / ("hf-rp" if rallypoint else "hf")),
        use_cpu=args.device == "cpu",  # else the Trainer takes the GPU itself
        bf16=args.bf16,
        max_steps=args.repeat + 1,
        save_strategy="no",  # the callback saves
        per_device_train_batch_size=4,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        optim="adamw_torch",
    )
    data = [{"x": torch.randn(WIDTH)} for _ in range(8)]
    model = MLP(args.mib, dtype_of(args))
    kwargs: dict[str, Any] = {"model": model, "args": training, "train_dataset": data}
    kwargs["callbacks"] = [measure]
    trainer = (
        RallypointTrainer(
            **kwargs,
            rallypoint_client=client,
            checkpoint_policy=SavePolicy(persist_every=1000, progress=False),
            watch_preemption=False,
        )
        if rallypoint
        else Trainer(**kwargs)
    )
    measure.trainer = trainer
    trainer.train()
    if isinstance(trainer, RallypointTrainer):
        trainer.checkpoints.close()
    return measure


# --- DeepSpeed alone ----------------------------------------------------------------------


class Result:
    def __init__(self) -> None:
        self.blocked: list[float] = []
        self.commit: list[float] = []
        self.restored: list[float] = []
        self.error: str | None = None


def run_deepspeed(variant: str, args: argparse.Namespace, work: Path, client: Any) -> Result:
    # Imported here: a GPU run skips DeepSpeed, and a machine may not have it.
    import deepspeed

    import rallypoint.trainer.deepspeed as rp_deepspeed

    result = Result()
    torch.manual_seed(0)
    model = MLP(args.mib)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    if variant == "decoupled":
        # "replica": without it 0.19.8 reads a dp_rank its UniversalParallelInfo lacks.
        writer = {"type": "python", "decoupled": True, "data_parallel": "replica"}
        config["checkpoint"] = {"writer": writer}
    elif variant == "fast":
        config["checkpoint"] = {"writer": {"type": "fast", "data_parallel": "replica"}}
    try:
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    except Exception as exc:  # a writer that cannot run here: say why, go on
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return result
    ours = None
    if variant == "rallypoint":
        ours = rp_deepspeed.install(
            engine, client, policy=SavePolicy(persist_every=1000, progress=False)
        )
    save_dir = str(work / f"ds-{variant}")
    x = torch.randn(4, WIDTH)
    try:
        for step in range(args.repeat + 1):
            loss = engine(x)["loss"]
            engine.backward(loss)
            engine.step()
            shutil.rmtree(save_dir, ignore_errors=True)  # one checkpoint on disk
            start = time.perf_counter()
            engine.save_checkpoint(save_dir)
            blocked = time.perf_counter() - start
            start = time.perf_counter()
            if variant == "decoupled":
                # What the next engine.step() does first: wait for the writer process.
                engine._commit_decoupled_checkpoint()
            elif ours is not None:
                ours.wait()  # drained, not timed
            commit = time.perf_counter() - start
            if step:
                result.blocked.append(blocked)
                result.commit.append(commit if variant == "decoupled" else 0.0)
        for i in range(args.repeat + 1):
            start = time.perf_counter()
            if ours is not None:
                name_the_last_version(ours.checkpoints)
                ours.restored = None  # read again, from the memory tier
                load_path, _ = rp_deepspeed.load_checkpoint(engine)
                assert ours.restored is not None and ours.restored.bytes_from["memory"] > 0
            else:
                load_path, _ = engine.load_checkpoint(save_dir)
            assert load_path is not None
            if i:
                result.restored.append(time.perf_counter() - start)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        if ours is not None:
            ours.close()
        elif engine.checkpoint_engine.is_decoupled():
            engine.checkpoint_engine.cleanup()
    return result


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:>9.1f} ms" if values else f"{'-':>12}"


def deepspeed_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return "absent"


def main() -> None:
    args = command_line(__doc__, mib=64, optimizer="AdamW")
    os.environ.setdefault("MASTER_PORT", "29519")  # the test suite's run picks a free one
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0"})
    os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    # DeepSpeed's checkpoint writers read the machine count its own launcher exports.
    os.environ.update({"CROSS_SIZE": "1", "CROSS_RANK": "0"})
    # DeepSpeed took its CPU accelerator at import (DS_ACCELERATOR), before the options.
    skip: list[str] = []
    if args.device == "cuda":
        skip.append("--device cuda")
    if args.bf16:
        skip.append("--bf16")
    # One job each: a version becomes latest only if its step is newer.
    jobs = ("bench-hf",) if skip else ("bench-hf", "bench-deepspeed")
    with coordinator(*jobs) as (work, clients):
        hf = {
            "sync": run_trainer(False, args, work, clients["bench-hf"]),
            "rallypoint": run_trainer(True, args, work, clients["bench-hf"]),
        }
        ds = {
            variant: run_deepspeed(variant, args, work, clients["bench-deepspeed"])
            for variant in (() if skip else ("torch", "decoupled", "fast", "rallypoint"))
        }
    dtype = dtype_of(args)
    size = checkpoint_mib(MLP(args.mib, dtype), dtype)
    print(
        f"transformers {transformers.__version__}, deepspeed {deepspeed_version()}, "
        f"torch {torch.__version__}, {described(args)}, checkpoint ~{size} MiB "
        f"(weights + AdamW), median of {args.repeat} after a warm-up"
    )
    print(f"{'':<52}{'blocked per save':>17}{'restore':>12}")
    rows = [
        ("HF Trainer._save_checkpoint (sync)", hf["sync"].blocked, hf["sync"].restored),
        ("RallypointTrainer (memory tier)", hf["rallypoint"].blocked, hf["rallypoint"].restored),
    ]
    for label, blocked, restored in rows:
        print(f"{label:<56}{ms(blocked)}{ms(restored)}")
    for key, label in (("sync", rows[0][0]), ("rallypoint", rows[1][0])):
        print(f"{label}: restore hash-equal: {'yes' if all(hf[key].equal) else 'no'}")
    if skip:
        print(
            f"DeepSpeed variants skipped ({' and '.join(skip)}): this script runs DeepSpeed "
            "in float32 on its CPU accelerator only (DS_ACCELERATOR=cpu, set at import)"
        )
    labels = {
        "torch": "DeepSpeed TorchCheckpointEngine (sync)",
        "decoupled": "DeepSpeed DecoupledCheckpointEngine: save call",
        "fast": "DeepSpeed FastCheckpointEngine",
        "rallypoint": "rallypoint.trainer.deepspeed (memory tier)",
    }
    for key, label in labels.items():
        r = ds.get(key)
        if r is None:
            continue
        if r.error:
            print(f"{label:<56}  did not run: {r.error}")
            continue
        print(f"{label:<56}{ms(r.blocked)}{ms(r.restored)}")
        if key == "decoupled":
            total = [b + c for b, c in zip(r.blocked, r.commit, strict=True)]
            print(f"{'  + its commit at the next step (writer drained)':<56}{ms(r.commit)}")
            print(f"{'  = blocked per save':<56}{ms(total)}")
            r.blocked = total

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(a) / statistics.median(b)

    h = hf["rallypoint"]
    print(f"HF: blocked {ratio(h.blocked, hf['sync'].blocked):.3f}x the sync save (goal <= 0.2x)")
    print(f"HF: restore {ratio(hf['sync'].restored, h.restored):.2f}x faster (goal >= 2x)")
    r = ds.get("rallypoint")
    if r is not None and not r.error:
        print(
            f"DS: blocked {ratio(r.blocked, ds['torch'].blocked):.3f}x TorchCheckpointEngine "
            "(goal <= 0.2x)"
        )
        for key in ("decoupled", "fast"):
            if not ds[key].error:
                print(f"DS: blocked {ratio(r.blocked, ds[key].blocked):.3f}x {key} (goal <= 1.0x)")
        print(
            f"DS: restore {ratio(ds['torch'].restored, r.restored):.2f}x faster than "
            "TorchCheckpointEngine from local disk (goal >= 2x)"
        )
    if not all(h.equal):
        sys.exit("RallypointTrainer's restore did not bring back the last save's tensors")


if __name__ == "__main__":
    main()
