"""Elastic FSDP2 training of a small transformer, under torchrun: sharded parameters and
Adam state, saved and resumed through Rallypoint at any world size.

Every process (``--nproc-per-node`` of them on each node) saves its own shards; on a
restart with fewer or more processes, ``load_latest(state)`` reshards in place into the
new layout. gloo on CPU, NCCL on CUDA::

    rallypoint serve --storage local:/tmp/rallypoint &
    torchrun --rdzv-backend=rallypoint --rdzv-endpoint=http://127.0.0.1:8080 \\
        --rdzv-id=fsdp --nnodes=1:4 --nproc-per-node=2 --max-restarts=100 \\
        trainer/examples/train_fsdp.py

The data is made here from a seed: sequences whose next token is the previous one plus
a fixed stride, so the loss has somewhere to go and nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager, PreemptionWatcher
from rallypoint.trainer.examples._events import events
from rallypoint.trainer.examples._launch import arguments, pause, start_process_group


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def batch(step: int, rank: int, size: int, vocab: int, context: int) -> torch.Tensor:
    """Sequences ``start, start + s, start + 2s, ...`` (mod vocab), different per step
    and rank, the same wherever they are made."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(context + 1)) % vocab


def digests(state: dict[str, Any]) -> dict[str, str]:
    """xxh3 of every tensor's full value (a collective for DTensors), by flattened key."""
    out: dict[str, str] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            data = full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[path] = xxhash.xxh3_64_hexdigest(data.tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}.{k}" if path else str(k))

    walk(state, "")
    return out


def main() -> None:
    parser = arguments(__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument(
        "--digests", action="store_true", help="record every tensor's hash at saves and loads"
    )
    args = parser.parse_args()

    client = ElasticClient.from_env()
    assignment = client.join()  # under torchrun: the agent's assignment, no new round
    device = start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    event = events(args.events, generation=assignment.generation, rank=rank, world_size=world)

    torch.manual_seed(0)  # the same initial weights everywhere, sharded below
    model = TinyTransformer(args.vocab, args.dim, args.layers, 4, args.context).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    checkpoints = CheckpointManager(client, progress=False, persist_every=args.persist_every)

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    step = 0
    # The templates to load into: this run's shards, Adam's state initialized.
    current = state()
    restored = checkpoints.load_latest(current)
    if restored is not None:
        set_state_dict(
            model, optimizer, model_state_dict=current["model"], optim_state_dict=current["optim"]
        )
        if restored.rank_state is not None:  # None for a rank the saving run did not have
            torch.set_rng_state(restored.rank_state["rng"])
        step = restored.step + 1  # the checkpoint of step s is taken after step s
    event(
        "resumed",
        version=restored.version if restored else None,
        step=step,
        pointer=assignment.checkpoint.version if assignment.checkpoint else None,
        saved_by=restored.world_size if restored else None,
        bytes=restored.bytes_from.get("storage") if restored else None,
        digests=digests(state()) if args.digests and restored else None,
    )

    loss = torch.tensor(float("nan"))
    with PreemptionWatcher(client) as watcher:
        while step < args.steps:
            tokens = batch(step, rank, args.batch_size, args.vocab, args.context).to(device)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            optimizer.step()
            pause(args)
            if rank == 0:
                event("step", step=step, loss=round(loss.item(), 4))
            stop = watcher.should_stop()  # a collective: every rank stops at the same step
            if step % args.checkpoint_every == 0 or stop:
                now = state()
                if args.digests:  # before the save: it may be where the process dies
                    event("saving", step=step, digests=digests(now))
                # On a preemption notice the version goes to storage whatever the policy:
                # the notified node's memory goes with it.
                checkpoints.save(now, step, rank_state={"rng": torch.get_rng_state()}, persist=stop)
            if stop:
                info = checkpoints.wait()
                event("emergency", step=step, version=info.version if info else None)
                watcher.finish()  # leaves (the notified node) or awaits the restart
            step += 1
    checkpoints.wait()
    event("finished", step=step, loss=round(loss.item(), 4))
    checkpoints.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
