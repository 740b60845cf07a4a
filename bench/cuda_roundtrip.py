"""CheckpointManager's round trip of a GPU state, bit for bit (CI has no GPU: run by hand).

One process with a world-1 process group (nccl on CUDA, gloo on the CPU) saves through a
real coordinator on local storage and loads each version back, into tensors of the same
shapes on the GPU (templates filled with other values first) and without templates (the
state as saved, on the CPU), comparing every tensor's bytes, dtype and shape:

- float32, bfloat16, float16, int64, uint8 and bool tensors, a 0-dim one, a transposed
  (non-contiguous) view, an ``nn.Parameter``, a DTensor on a 1-rank mesh, 64 MiB ones,
  and a real model's ``state_dict`` with its Adam state (``step`` on the CPU, int keys);
- the state is changed on the GPU as soon as ``save()`` returns and an optimizer's
  ``step()`` has fenced it, while the copy and the upload run: on CUDA the fence only
  makes the training stream wait for the side stream's copies (the host does not wait
  for the GPU), and the version must hold the values of when ``save()`` was called;
- a second save reuses the staging buffers and must hold the changed values;
- a third is changed by hand right after ``wait_staged()`` (no optimizer step: an update
  no fence sees), and must hold the values of before;
- the first version is loaded again into another layout: the model's and Adam's
  tensors (saved plain) as DTensors sharded on their first dimension over a 1-device
  mesh, the saved (replicated) DTensor sharded on its second, equal by sha256;
- a restored state is ordinary tensors: ``torch.save`` of it and
  ``torch.load(weights_only=True)`` give the same bits back.

It runs twice: without a memory tier, and with one, as a node running the tier does
(CUDA tensors stage into pinned buffers either way; under the tier, the save's writer
writes the tier's file from them). Each pass prints how long ``save()`` held the
caller, how long the first fence waited, and ``wait_staged()``.

Usage: python bench/cuda_roundtrip.py [--device cuda|cpu] [--big-mib 64] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: its rallypoint/ folder must not hide an installed package
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from bench._joined import joined  # noqa: E402
from bench._smoke import parse  # noqa: E402
from rallypoint.trainer import CheckpointManager  # noqa: E402
from rallypoint.trainer.memory import MEMORY_ENV  # noqa: E402
from tests._coordinator import Coordinator  # noqa: E402

MiB = 1 << 20


def make_state(device: str, big_mib: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).to(device)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(32, 64, device=device)).square().sum().backward()
    optim.step()
    mesh = init_device_mesh(device, (1,))
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "dtypes": {
            "f32": torch.randn(1000, 3, device=device),
            "bf16": torch.randn(257, 129, device=device).bfloat16(),
            "f16": torch.randn(4096, device=device).half(),
            "i64": torch.randint(-(2**62), 2**62, (333,), device=device),
            "u8": torch.randint(0, 256, (1, 7, 11), dtype=torch.uint8, device=device),
            "bool": torch.rand(999, device=device) > 0.5,
        },
        "scalar": torch.tensor(3.25, device=device),
        "transposed": torch.randn(300, 17, device=device).t(),
        "param": torch.nn.Parameter(torch.randn(128, 64, device=device)),
        "dtensor": DTensor.from_local(torch.randn(96, 40, device=device), mesh, [Replicate()]),
        "big": [torch.randn(big_mib * MiB // 4, device=device) for _ in range(2)],
        "extra": {"epoch": 3, "name": "cuda", "lr": [0.1, 0.01]},
    }


def tensors(value: Any, path: str = "", local: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of ``value`` by its path, DTensors as their local data (``local``)
    or as they are."""
    if isinstance(value, torch.Tensor):
        return {path: value.to_local() if local and isinstance(value, DTensor) else value}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(tensors(v, f"{path}.{k}" if path else str(k), local))
    return out


def mapped(value: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by ``f`` of it (DTensors kept as DTensors)."""
    if isinstance(value, DTensor):
        return DTensor.from_local(f(value.to_local()), value.device_mesh, value.placements)
    if isinstance(value, torch.Tensor):
        return f(value)
    if isinstance(value, dict):
        return {k: mapped(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [mapped(v, f) for v in value]
    if isinstance(value, tuple):
        return tuple(mapped(v, f) for v in value)
    return copy.deepcopy(value)


@torch.no_grad()
def change(t: torch.Tensor) -> torch.Tensor:
    """Changes every element of ``t`` in place (queued on the GPU, not waited for)."""
    if t.dtype == torch.bool:
        return t.logical_not_()
    if t.dtype.is_floating_point:
        return t.mul_(-2).add_(1)
    return t.add_(1)


def sentinel(t: torch.Tensor) -> torch.Tensor:
    """A template for ``t``: same shape, dtype, device and strides, other values."""
    out = torch.empty_like(t)
    if t.dtype == torch.bool:
        return out.copy_(t.logical_not())
    return out.fill_(float("nan") if t.dtype.is_floating_point else 123)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*flat)


def mismatches(
    label: str,
    found: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    problem: Callable[[torch.Tensor, torch.Tensor], str | None],
) -> int:
    """Prints each tensor of ``expected`` that ``found`` lacks or that ``problem`` (of the
    tensor found and the one saved) finds fault with; returns how many there were."""
    bad = 0
    for path, want in expected.items():
        have = found.get(path)
        why = "missing" if have is None else problem(have, want)
        if why is not None:
            print(f"  {label}: {path} {why}")
            bad += 1
    return bad


def compare(label: str, got: Any, expected: dict[str, torch.Tensor], device: str | None) -> int:
    """Prints each mismatch; returns how many there were."""

    def problem(have: torch.Tensor, want: torch.Tensor) -> str | None:
        if device is not None and have.device.type != torch.device(want.device).type:
            return f"on {have.device}, saved from {want.device}"
        if not same_bits(have, want):
            return f"differs ({have.dtype} {tuple(have.shape)})"
        return None

    bad = mismatches(label, tensors(got), expected, problem)
    print(f"{label}: {len(expected) - bad} of {len(expected)} tensors bit for bit")
    return bad


def reloads(label: str, state: Any, expected: dict[str, torch.Tensor]) -> int:
    """``torch.save`` of a restored state, then ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        again = torch.load(buffer, weights_only=True, map_location="cpu")
    except Exception as e:  # the bench reports it as a mismatch
        print(f"{label}: torch.save/torch.load failed: {e!r}")
        return 1
    return compare(f"{label}, through torch.save/load", again, expected, None)


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (a DTensor's whole tensor)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def relayout(
    manager: CheckpointManager,
    version: int,
    expected: dict[str, torch.Tensor],
    device: str,
    big_mib: int,
) -> int:
    """Loads ``version`` into another layout: every tensor of the model and the optimizer
    (saved plain) as a DTensor sharded on its first dimension over a 1-device mesh, and
    the saved DTensor (replicated) sharded on its second; equal by sha256."""
    mesh = init_device_mesh(device, (1,))
    template = mapped(make_state(device, big_mib), sentinel)

    def sharded(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.dim() <= dim or t.device.type != device:
            return t
        return DTensor.from_local(t, mesh, [Shard(dim)])

    template["model"] = {k: sharded(v, 0) for k, v in template["model"].items()}
    template["optim"]["state"] = {
        i: {k: sharded(v, 0) for k, v in s.items()} for i, s in template["optim"]["state"].items()
    }
    local = template["dtensor"].to_local()
    template["dtensor"] = DTensor.from_local(local, mesh, [Shard(1)])
    restored = manager.load(version, template).state
    if device == "cuda":
        torch.cuda.synchronize()
    got = tensors(restored, local=False)
    layouts = sum(isinstance(got.get(path), DTensor) for path in expected)
    bad = mismatches(
        "another layout",
        got,
        expected,
        lambda have, want: None if digest(have) == digest(want) else "differs by sha256",
    )
    print(
        f"v{version} into another layout on {device} ({layouts} DTensors sharded): "
        f"{len(expected) - bad} of {len(expected)} tensors equal by sha256"
    )
    return bad


def one_pass(url: str, device: str, tier: Path | None, big_mib: int) -> int:
    """Saves and loads twice through one manager; returns the mismatches."""
    label = "memory tier" if tier else "no tier"
    client, beats = joined(url, "bench")
    if tier is not None:
        os.environ[MEMORY_ENV] = str(tier)
    try:
        manager = CheckpointManager(client, progress=False)
    finally:
        os.environ.pop(MEMORY_ENV, None)
    bad = 0
    state = make_state(device, big_mib)
    first = {k: v.clone() for k, v in tensors(state).items()}
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    handle = manager.save(state, 1)
    held = time.perf_counter() - started
    assert handle is not None
    # An optimizer's step is the fence a training loop meets: on CUDA it orders the
    # training stream after the copies, and the host goes on.
    started = time.perf_counter()
    torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.0).step()
    fenced = time.perf_counter() - started
    for t in tensors(state).values():  # while the copy and the upload run
        change(t)
    v1 = handle.result().version
    second = {k: v.clone() for k, v in tensors(state).items()}
    assert all(not same_bits(first[k], second[k]) for k in first), "change() missed one"
    v2 = manager.save(state, 2, blocking=True)
    assert v2 is not None
    # By hand: an update no fence sees (an EMA, a copy_ into a parameter) comes after
    # wait_staged(), and the version holds the values from before it.
    handle = manager.save(state, 3)
    assert handle is not None
    waited = manager.wait_staged()
    for t in tensors(state).values():
        change(t)
    v3 = handle.result().version
    print(
        f"{label}: save() held the caller {held * 1e3:.1f} ms, "
        f"the optimizer's step (the fence) {fenced * 1e3:.1f} ms, "
        f"wait_staged() {waited * 1e3:.1f} ms"
    )
    for version, expected in ((v1, first), (v2.result().version, second), (v3, second)):
        template = mapped(state, sentinel)
        restored = manager.load(version, template)
        if device == "cuda":
            torch.cuda.synchronize()
        where = f"{label}: v{version}"
        bad += compare(f"{where} into templates on {device}", restored.state, expected, device)
        as_saved = manager.load(version).state
        bad += compare(f"{where} as saved", as_saved, expected, None)
        bad += reloads(f"{where} into templates", restored.state, expected)
        bad += reloads(f"{where} as saved", as_saved, expected)
    bad += relayout(manager, v1, first, device, big_mib)
    manager.close()
    beats.stop()  # before the coordinator goes
    client.close()
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--big-mib", type=int, default=64, help="each of the two large tensors")
    args = parse(parser, {"device": "cpu", "big_mib": 1})
    device = args.device
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {backend}")
    bad = 0
    for tiered in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            coordinator = Coordinator(["--storage", f"local:{tmp}/storage"], {}).start()
            try:
                tier = Path(tmp) / "tier" if tiered else None
                bad += one_pass(coordinator.url, device, tier, args.big_mib)
            finally:
                coordinator.stop()
    dist.destroy_process_group()
    print("OK" if not bad else f"FAILED: {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
