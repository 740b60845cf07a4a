"""The model leaves the job (issue 34): ``export`` and ``rallypoint checkpoints export``
write a committed version's tensors, consolidated into full tensors, to safetensors, a
Hugging Face folder or a torch file, equal to what was saved; an FSDP2 job saved at
world 4 (2 torchrun agents x 2 processes) comes out whole; a packed (HF Trainer) state
comes out under its own names; memory stays bounded; what is not a good committed
version is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from safetensors.torch import load_file

from rallypoint.cli.processes import Cluster
from rallypoint.client import ElasticClient, UnknownCheckpoint
from rallypoint.trainer import CheckpointError, export
from rallypoint.trainer._pack import pack

from ..._support import cli, managers
from ...conftest import Start


def trained() -> tuple[torch.nn.Sequential, torch.optim.Adam]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 33)).sum().backward()
    optimizer.step()
    return model, optimizer


def flat(value: Any, name: str = "") -> dict[str, torch.Tensor]:
    """A nested state's tensors by their dot-joined path, as DCP flattens it."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    out: dict[str, torch.Tensor] = {}
    if not isinstance(value, (dict, list, tuple)):
        return out  # a number, a string: not a tensor, not exported
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, v in items:
        out.update(flat(v, f"{name}.{k}" if name else str(k)))
    return out


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_version_exports_equal_to_what_was_saved(start: Start, tmp_path: Path) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    model, optimizer = trained()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "half": torch.randn(4, dtype=torch.bfloat16),
    }
    m.save(state, 7, blocking=True)
    m.close()
    want = flat(state)
    exporter = ElasticClient(url, "job", "exporter")  # not a member: any reader

    done = export(exporter, tmp_path / "all.safetensors", progress=False)
    assert (done.version, done.step, done.tensors) == (1, 7, len(want))
    equal(load_file(tmp_path / "all.safetensors"), want)
    with safetensors.safe_open(tmp_path / "all.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "rallypoint_version": "1", "step": "7"}

    export(exporter, tmp_path / "all.pt", 1, format="torch", progress=False)
    equal(torch.load(tmp_path / "all.pt", weights_only=True), want)

    # The model alone, in bf16: floating tensors cast, the rest as they were.
    export(exporter, tmp_path / "m.safetensors", only="model.", dtype="bf16", progress=False)
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(k for k in want if k.startswith("model."))
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert torch.equal(got["model.0.weight"], want["model.0.weight"].to(torch.bfloat16))

    # A Hugging Face folder: the framework's own names, sharded past the limit.
    done = export(
        exporter, tmp_path / "hf", format="hf", only="model.", max_shard_size=1500, progress=False
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) == len(done.files) - 1 > 1
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        loaded.update(load_file(tmp_path / "hf" / shard))
    fresh = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    fresh.load_state_dict(loaded)  # strict: every name the model's own
    equal(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_a_packed_state_exports_under_its_own_names(start: Start, tmp_path: Path) -> None:
    """The HF Trainer saves its model's state_dict packed (a pickled skeleton and t0,
    t1, ...): exported, the tensors carry the state_dict's names."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    model, optimizer = trained()
    m.save({"model": pack(model.state_dict()), "optimizer": pack(optimizer.state_dict())}, 3)
    m.wait()
    m.close()
    exporter = ElasticClient(url, "job", "exporter")
    export(exporter, tmp_path / "hf", format="hf", only="model.", progress=False)
    equal(load_file(tmp_path / "hf" / "model.safetensors"), model.state_dict())
    export(exporter, tmp_path / "all.safetensors", progress=False)
    got = load_file(tmp_path / "all.safetensors")
    assert torch.equal(
        got["optimizer.state.0.exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


FSDP2 = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from rallypoint.client import ElasticClient
from rallypoint.trainer import CheckpointManager

client = ElasticClient.from_env()
client.join()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.ReLU(), torch.nn.Linear(64, 11))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(2):
    model(torch.randn(4, 37)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
m = CheckpointManager(client, progress=False)
m.save({"model": get_model_state_dict(model)}, 4, blocking=True)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if dist.get_rank() == 0:
    torch.save(full, sys.argv[1])
m.close()
dist.destroy_process_group()
"""


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_an_fsdp2_job_of_two_nodes_of_two_processes_exports_whole(
    start: Start, tmp_path: Path
) -> None:
    """An FSDP2 job saved at world 4 (2 torchrun agents x 2 processes), exported on one
    process that is no member: equal to the gathered full state, tensor for tensor."""
    url = start().url
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2)
    full_file = tmp_path / "full.pt"
    cluster = Cluster(
        url, "fsdp2", tmp_path, nnodes="2:2", nproc=2, script=[str(script), str(full_file)]
    )
    try:
        cluster.start("a", "b")
        codes = cluster.wait(timeout=200)
    finally:
        cluster.stop()
    assert codes == {"a": 0, "b": 0}, codes
    full = torch.load(full_file, weights_only=True)
    exporter = ElasticClient(url, "fsdp2", "exporter")
    done = export(exporter, tmp_path / "s.safetensors", progress=False)
    assert done.step == 4
    equal(load_file(tmp_path / "s.safetensors"), {f"model.{k}": v for k, v in full.items()})


PEAK = r"""
import json, sys
from rallypoint.client import ElasticClient
from rallypoint.trainer import export
url, out, buffer = sys.argv[1:4]
def hwm():  # this process's own peak: ru_maxrss keeps the parent's across fork and exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
done = export(ElasticClient(url, "big", "exporter"), out, buffer=int(buffer), progress=False)
print(json.dumps({"grew": hwm() - before, "bytes": done.bytes}))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_an_export_holds_a_bounded_part_of_the_state(start: Start, tmp_path: Path) -> None:
    """A 128 MiB state, exported with an 8 MiB buffer in a fresh process: its peak
    memory grows by far less than the state (the groups of at most 8 MiB, and what
    torch and the reader allocate beside them)."""
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.client.job_id  # noqa: B018
    state = {f"w{i}": torch.full((1 << 19,), float(i)) for i in range(64)}  # 64 x 2 MiB
    m.save(state, 1, blocking=True)
    m.close()
    del state
    # The job is "job": re-export it under the name the script asks for.
    script = PEAK.replace('"big"', '"job"')
    run = subprocess.run(
        [sys.executable, "-c", script, url, str(tmp_path / "big.safetensors"), str(8 << 20)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["bytes"] == 128 << 20
    assert figures["grew"] < 48 << 20, figures
    assert (tmp_path / "big.safetensors").stat().st_size > 128 << 20


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local"], indirect=True)
def test_what_is_not_a_good_committed_version_is_refused(start: Start, tmp_path: Path) -> None:
    url = start().url
    (m,) = managers(url, ["a"], 1, 1)
    m.save({"w": torch.ones(2)}, 1, blocking=True)
    m.save({"w": torch.ones(2)}, 2, blocking=True)
    client = m.client
    client.quarantine(2, "diverged")
    pending = client.begin_checkpoint(3, ["data.distcp"]).version
    exporter = ElasticClient(url, "job", "exporter")
    with pytest.raises(CheckpointError, match="v2 is quarantined: diverged"):
        export(exporter, tmp_path / "x.safetensors", 2, progress=False)
    with pytest.raises(CheckpointError, match=f"v{pending} is pending, not committed"):
        export(exporter, tmp_path / "x.safetensors", pending, progress=False)
    with pytest.raises(UnknownCheckpoint):
        export(exporter, tmp_path / "x.safetensors", 99, progress=False)
    with pytest.raises(CheckpointError, match=r"holds no tensor starting with 'model\.'"):
        export(exporter, tmp_path / "x.safetensors", 1, only="model.", progress=False)
    assert not (tmp_path / "x.safetensors").exists()
    # The command: the same refusal, exit 1; and an export, with --json.
    refused = cli("checkpoints", "export", "job", "2", "--out", str(tmp_path / "x"), "--url", url)
    assert refused.returncode == 1 and "v2 is quarantined: diverged" in refused.stderr
    done = cli(
        "checkpoints", "export", "job", "latest", "--out", str(tmp_path / "y.safetensors"),
        "--url", url, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"] == 1  # the latest moved back from v2
    assert torch.equal(load_file(tmp_path / "y.safetensors")["w"], torch.ones(2))
