"""Elastic training without torchrun: the script joins the job itself.

Each process is one node. It asks the coordinator for its rank, the world size, the
master address and the checkpoint to resume from, builds its process group from that,
and exits with ``RESTART_EXIT_CODE`` (75) when the membership changes, so whatever
supervises it (AzureML, a Kubernetes restart policy, a shell loop) starts it again::

    export RALLYPOINT_URL=http://coordinator:8080 RALLYPOINT_JOB=cnn
    while true; do
        python trainer/examples/train_join.py --nodes 1:4 && break
        [ $? -eq 75 ] || exit 1        # a real failure: stop
    done

Model, data and checkpointing are those of ``train_ddp.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

from rallypoint.client import ElasticClient, HeartbeatReply, JobSpec

#: The exit status for "restart me": rallypoint.trainer.RESTART_EXIT_CODE, spelled out so
#: this module needs no torch before it joined.
RESTART_EXIT_CODE = 75


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="1:4", help="MIN:MAX nodes of the job")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=10)
    parser.add_argument("--addr", help="how other nodes reach this one (default: host name)")
    parser.add_argument("--events", help="append JSON lines of what happened to this file")
    args = parser.parse_args()
    low, _, high = args.nodes.partition(":")

    client = ElasticClient.from_env()
    spec = JobSpec(
        min_nodes=int(low),
        max_nodes=int(high or low),
        last_call=timedelta(seconds=2),
        heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
    )
    # Join and heartbeat before importing torch (seconds on a small machine): the others
    # wait for this node in the seal, and a slow rejoin would look like a departure.
    a = client.join(addr=args.addr, spec=spec)

    def restart(reply: HeartbeatReply) -> None:
        # The generation ended (a node joined, died or left). Steps since the last
        # checkpoint are lost either way; exiting now beats hanging in a collective.
        print(f"membership changed (generation {reply.generation}); restarting", flush=True)
        os._exit(RESTART_EXIT_CODE)

    beats = client.heartbeats(on_restart=restart)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from rallypoint.trainer import CheckpointManager, ElasticSampler
    from rallypoint.trainer.examples._events import events
    from rallypoint.trainer.examples.train_ddp import SmallCNN, synthetic_cifar

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master_addr}:{a.master_port}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=60),
    )

    event = events(args.events, generation=a.generation, rank=a.rank, world_size=a.world_size)

    images, labels = synthetic_cifar(args.samples, 0)
    model = SmallCNN()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = ElasticSampler(
        args.samples, rank=a.rank, world_size=a.world_size, batch_size=args.batch_size
    )
    checkpoints = CheckpointManager(client, progress=False)
    step = 0
    if (restored := checkpoints.load_latest()) is not None:
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
        sampler.load_state_dict(restored.state["sampler"])
        step = restored.step + 1
    event("resumed", version=restored.version if restored else None, step=step)

    loss = torch.tensor(float("nan"))

    def state() -> dict[str, object]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "sampler": sampler.state_dict(),
        }

    while step < args.steps:
        if sampler.remaining < args.batch_size * a.world_size:
            sampler.set_epoch(sampler.epoch + 1)
        index = torch.tensor(list(sampler)[: args.batch_size])
        loss = nn.functional.cross_entropy(ddp(images[index]), labels[index])
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        sampler.advance()
        time.sleep(args.step_time)
        if a.rank == 0:
            event("step", step=step, loss=round(loss.item(), 4))
        if step % args.checkpoint_every == 0 or step == args.steps - 1:
            checkpoints.save(state(), step)
        step += 1
    checkpoints.wait()
    event("finished", step=step, loss=round(loss.item(), 4))
    # Finishing must not look like a departure: once every rank is done, all stop
    # heartbeating, and only then do they leave (the first leave ends the generation,
    # which a rank still heartbeating would take for a restart).
    dist.barrier()
    beats.stop()
    dist.barrier()
    client.leave("finished", fenced=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
