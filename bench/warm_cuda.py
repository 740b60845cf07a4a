"""Whether the warm worker server may preload a framework, on a GPU (CI has none: run by
hand, on a machine with one).

``rallypoint run`` forks workers from a server that imported torch once
(``trainer/agent/_launch.py``, ``WARM_MODULES``). A forked child cannot use CUDA if its
parent initialized it ("Cannot re-initialize CUDA in forked subprocess"), so a module may
be preloaded only if importing it leaves CUDA alone. For each preload set this prints:

- in a fresh interpreter that imports the set: whether CUDA is initialized after the
  imports, how many OS threads the process has (a fork copies only the calling one), and
  the imports' CPU seconds;
- in a worker forked from a ``forkserver`` with the set preloaded, as the agent starts
  them: whether it initializes CUDA and runs a matrix product (and, for Lightning, a
  two-step ``Trainer.fit`` on the GPU), and the CPU seconds the worker spent importing
  the framework (near 0 when the server preloaded it).

It also prints which of torch's device queries, called in a parent before a plain
``fork``, leave CUDA usable in the child: what an agent may ask before it forks.

Usage: python bench/warm_cuda.py [--device cuda|cpu]   (cpu: the imports' figures only)
       [--sets base,lightning,transformers] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last, as in the other benches
from bench._smoke import parse

#: What a worker of each set imports at its start (what its script would); the server
#: preloads these on top of ``WARM_MODULES``.
FRAMEWORK = {
    "base": [],
    "lightning": ["lightning.pytorch", "rallypoint.trainer.lightning"],
    "transformers": ["transformers", "rallypoint.trainer.transformers"],
}


def _preloads(kind: str) -> str:
    """What the warm server imports for ``kind``, comma-separated: the agent's own list,
    then the framework's. Asked in the parent (it imports torch), and handed to the
    fresh interpreters that measure the imports."""
    from rallypoint.trainer.agent import warm_modules

    return ",".join(warm_modules({"RALLYPOINT_WARM_MODULES": ",".join(FRAMEWORK[kind])}))


def _imports(modules: str) -> dict[str, Any]:
    """In this (fresh) interpreter: imports ``modules`` (comma-separated); CUDA's state
    and threads after."""
    import importlib

    started = time.process_time()
    for name in modules.split(","):
        importlib.import_module(name)
    import torch

    return {
        "cpu_s": round(time.process_time() - started, 2),
        "cuda_initialized": torch.cuda.is_initialized(),
        "os_threads": len(os.listdir("/proc/self/task")),
    }


def _worker(kind: str, device: str, out: Any) -> None:
    """A worker forked from the server: imports its framework, then uses the GPU."""
    import importlib

    import torch

    result: dict[str, Any] = {"inherited_cuda": torch.cuda.is_initialized()}
    try:
        started = time.process_time()
        for name in FRAMEWORK[kind]:
            importlib.import_module(name)
        result["framework_import_cpu_s"] = round(time.process_time() - started, 3)
        x = torch.randn(1024, 1024, device=device)
        result["matmul_sum"] = float((x @ x).sum().item())
        if kind == "lightning":
            result["lightning_fit"] = _fit(device)
        result["ok"] = True
    except Exception as exc:  # the finding, not a failure of the bench
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    out.put(result)


def _fit(device: str) -> str:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss: torch.Tensor = torch.nn.functional.mse_loss(self.layer(x), y)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    return f"global_step={trainer.global_step}"


def _forked(kind: str, device: str, modules: str) -> dict[str, Any]:
    """A forkserver with ``modules`` (comma-separated) preloaded, and one worker of
    ``kind`` from it."""
    context = multiprocessing.get_context("forkserver")
    multiprocessing.set_forkserver_preload(modules.split(","))
    out = context.Queue()
    started = time.monotonic()
    process = context.Process(target=_worker, args=(kind, device, out))
    process.start()
    result: dict[str, Any] = out.get(timeout=120)
    process.join(60)
    result["exitcode"] = process.exitcode
    result["server_and_worker_s"] = round(time.monotonic() - started, 1)
    return result


def _fork_after(query: str, device: str) -> dict[str, Any]:
    """A parent that calls ``query`` (a torch.cuda function), then a plain fork whose
    child runs a matrix product on the GPU."""
    import torch

    answer = getattr(torch.cuda, query)()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            x = torch.randn(256, 256, device=device)
            message = f"ok {float((x @ x).sum().item()):.1f}"
        except Exception as exc:
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        os.write(write, message.encode()[:500])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child = f.read()
    os.waitpid(pid, 0)
    return {"parent_answer": answer, "child": child}


def _fresh(function: str, *args: str) -> dict[str, Any]:
    """Runs ``function(*args)`` of this file in a fresh interpreter; its JSON result."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import warm_cuda as w; "
        f"print('RESULT ' + json.dumps(w.{function}(*{args!r})))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=400, check=False
    )
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return parsed
    return {"failed": run.returncode, "stderr": run.stderr[-800:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--sets", default=",".join(FRAMEWORK), help="preload sets measured")
    # Lightning's set is the one with a path of its own (a Trainer.fit in the worker).
    args = parse(parser, {"device": "cpu", "sets": "base,lightning"})
    preloads = {kind: _preloads(kind) for kind in args.sets.split(",")}
    results = []
    for kind, modules in preloads.items():
        results.append(_fresh("_imports", modules))
        print(f"{kind:12} imports: {json.dumps(results[-1])}", flush=True)
    for kind, modules in preloads.items():
        results.append(_fresh("_forked", kind, args.device, modules))
        print(f"{kind:12} forked:  {json.dumps(results[-1])}", flush=True)
    if args.device == "cuda":
        for query in ("device_count", "is_available"):
            results.append(_fresh("_fork_after", query, args.device))
            print(f"fork after torch.cuda.{query}(): {json.dumps(results[-1])}", flush=True)
    # A finding (a worker that cannot use CUDA) is printed; a process that died is the
    # bench's own failure.
    if any("failed" in result for result in results):
        sys.exit("a measuring process failed")


if __name__ == "__main__":
    main()
