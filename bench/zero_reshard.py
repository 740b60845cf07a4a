"""ZeRO resumed at another data-parallel world size through DeepSpeed's universal
checkpoint (the path ``rallypoint.trainer.deepspeed`` takes), side by side with the
anchor: DeepSpeed's own load at the world size that saved.

An MLP of ``--mib`` MiB of float32 parameters trains 2 steps with AdamW under ZeRO
``--stage`` on ``--src`` processes (``torchrun --standalone``, CPU, gloo,
``DS_ACCELERATOR=cpu``), which save with DeepSpeed's default ``TorchCheckpointEngine``
to local disk. Then, each timed:

1. anchor: ``--src`` processes ``engine.load_checkpoint`` it (DeepSpeed's rigid load);
2. convert: ``ds_to_universal`` in one process with one worker, as Rallypoint's
   converting rank runs it (it is handed the old ranks' files the same way);
3. reshard load: ``--dst`` processes ``engine.load_checkpoint`` the universal folder
   with ``"checkpoint": {"load_universal": true}``.

Load times are the slowest rank's ``engine.load_checkpoint`` (files on local disk,
page cache warm). Bytes are the saved folder's and the universal folder's. Every load
is checked: the gathered full fp32 parameters and Adam moments equal those saved.
Rallypoint's own extra, reading every old rank's partitions from the version, is not in
here (``reshard_seconds`` in the e2e test's events has it, for its tiny model).

Usage: DS_ACCELERATOR=cpu python bench/zero_reshard.py [--stage 3] [--mib 32]
[--src 3] [--dst 2] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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

TAG = "bench"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(args: argparse.Namespace) -> None:
    """One rank of a torchrun run: save, load or load-universal; rank 0 writes the
    result to ``--out``."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import xxhash
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    width = 1024
    layers = max(1, round(args.mib * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    if args.role == "load-universal":
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def digest() -> str:
        h = xxhash.xxh3_64()
        for _, p in engine.module.named_parameters():
            for t in (
                safe_get_full_fp32_param(p),
                safe_get_full_optimizer_state(p, "exp_avg"),
                safe_get_full_optimizer_state(p, "exp_avg_sq"),
            ):
                h.update(t.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()

    seconds = 0.0
    if args.role == "save":
        for _ in range(2):
            x = torch.randn(2, width)
            engine.backward(torch.nn.functional.mse_loss(engine(x), x))
            engine.step()
        engine.save_checkpoint(args.dir, tag=TAG)
    else:
        dist.barrier()
        started = time.perf_counter()
        tag = TAG if args.role == "load" else f"{TAG}_universal"
        engine.load_checkpoint(args.dir, tag=tag)
        seconds = time.perf_counter() - started
    times: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(times, seconds)
    # DeepSpeed's rigid ZeRO-1/2 load leaves the parameters' links to their Adam moments
    # unset until the next step: safe_get_full_optimizer_state fails there.
    full = None if args.role == "load" and args.stage < 3 else digest()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"seconds": max(times), "digest": full}))
    dist.destroy_process_group()


def run(role: str, nproc: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out = folder / f"{role}-{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--role",
        role,
        "--stage",
        str(args.stage),
        "--mib",
        str(args.mib),
        "--dir",
        str(folder),
        "--out",
        str(out),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode:
        sys.exit(f"{role} on {nproc} processes failed:\n{done.stderr.decode()[-20000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def convert(folder: Path) -> float:
    from deepspeed.checkpoint import ds_to_universal

    options = argparse.Namespace(
        input_folder=str(folder / TAG),
        output_folder=str(folder / f"{TAG}_universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    started = time.perf_counter()
    report = io.StringIO()
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
        ds_to_universal.main(options)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--mib", type=float, default=32)
    parser.add_argument("--src", type=int, default=3)
    parser.add_argument("--dst", type=int, default=2)
    parser.add_argument("--role", choices=("save", "load", "load-universal"))
    parser.add_argument("--dir")
    parser.add_argument("--out")
    args = parse(parser, {"mib": 1, "src": 2, "dst": 1})
    if args.role:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="zero-reshard-") as tmp:
        folder = Path(tmp)
        saved = run("save", args.src, args, folder)
        anchor = run("load", args.src, args, folder)
        converting = convert(folder)
        resharded = run("load-universal", args.dst, args, folder)
        saved_bytes = folder_bytes(folder / TAG)
        universal_bytes = folder_bytes(folder / f"{TAG}_universal")
    total = converting + resharded["seconds"]
    print(
        f"ZeRO-{args.stage}, {args.mib:g} MiB of fp32 parameters, AdamW, "
        f"{args.src} -> {args.dst} processes"
    )
    print(f"  saved folder            {saved_bytes / 2**20:9.1f} MiB")
    print(
        f"  universal folder        {universal_bytes / 2**20:9.1f} MiB"
        f"  ({universal_bytes / saved_bytes:.2f}x)"
    )
    print(f"  anchor load at {args.src}       {anchor['seconds']:9.3f} s")
    print(f"  convert                 {converting:9.3f} s")
    print(f"  universal load at {args.dst}    {resharded['seconds']:9.3f} s")
    print(
        f"  convert + load          {total:9.3f} s  ({total / anchor['seconds']:.2f}x the anchor)"
    )
    same = saved["digest"] == resharded["digest"] and anchor["digest"] in (None, saved["digest"])
    print(f"  full parameters and moments equal to those saved: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
