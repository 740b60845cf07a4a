"""Exporting a version to one file: ``rallypoint.trainer.export`` side by side with DCP's
own consolidation, on the same state, in one run.

A state of ``--mib`` MiB in 64 float32 tensors is saved once through a CheckpointManager
(a coordinator on local storage, the version in storage) and once with DCP's
``FileSystemWriter``. Then, each in a fresh process, median of ``--repeat``:

1. ours: ``export(..., format="safetensors")`` of the version (every item checked against
   its checksum, the file streamed a ``--buffer`` of tensors at a time);
2. ``dcp_to_torch_save`` (``torch.distributed.checkpoint.format_utils``) of the DCP folder
   to one ``torch.save`` file: DCP's own consolidation;
3. ``dcp.load(no_dist=True)`` of the DCP folder into full tensors, then
   ``safetensors.torch.save_file``: the way to safetensors with the library's writer.

For each: MiB/s (state bytes over wall time) and the process's peak memory growth over
the run, as a multiple of the state's size.

    python bench/export.py [--mib 512] [--buffer-mib 64] [--repeat 3] [--smoke]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # the tests' coordinator, last
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _frameworks import ROOT, coordinator, measuring, parsed

# Each measurement in a fresh process, so that its peak memory is its own.
_PROBE = r"""
import json, sys, time
kind, source, out, buffer = sys.argv[1:5]
def hwm():  # this process's own peak: ru_maxrss keeps the parent's across fork and exec
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from rallypoint.client import ElasticClient
from rallypoint.trainer import export
torch.set_num_threads(1)
before = hwm()  # the modules are in: what follows is the conversion's
start = time.perf_counter()
if kind == "ours":
    url, job = source.split("#")
    export(ElasticClient(url, job, "exporter"), out, buffer=int(buffer), progress=False)
elif kind == "dcp_to_torch_save":
    dcp_to_torch_save(source, out)
else:
    meta = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(source), no_dist=True)
    save_file(state, out)
seconds = time.perf_counter() - start
grew = hwm() - before
print(json.dumps({"seconds": seconds, "grew": grew}))
"""


def probe(kind: str, source: str, out: Path, buffer: int) -> dict[str, float]:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, kind, source, str(out), str(buffer)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(run.stdout.strip().splitlines()[-1])
    out.unlink()
    return result


def main() -> None:
    parser = measuring(__doc__, mib=512, repeat=3)
    parser.add_argument("--buffer-mib", type=int, default=64)
    args = parsed(parser, {"buffer_mib": 1})
    import torch.distributed.checkpoint as dcp

    from rallypoint.trainer import CheckpointManager

    size = args.mib << 20
    state = {f"layer{i}": torch.randn(size // 64 // 4) for i in range(64)}
    with coordinator("export") as (work, clients):
        manager = CheckpointManager(clients["export"], progress=False)
        manager.save(state, 1, blocking=True, persist=True)
        manager.close()
        folder = work / "dcp"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
        del state
        url = clients["export"].url
        runs = {
            "export (ours), safetensors": ("ours", f"{url}#export", "x.safetensors"),
            "dcp_to_torch_save": ("dcp_to_torch_save", str(folder), "x.pt"),
            "dcp.load + safetensors save_file": ("load_save_file", str(folder), "y.safetensors"),
        }
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        with tempfile.TemporaryDirectory(dir=ROOT / "build") as scratch:
            for _ in range(args.repeat):  # interleaved: each round measures all three
                for name, (kind, source, out) in runs.items():
                    figures[name].append(
                        probe(kind, source, Path(scratch) / out, args.buffer_mib << 20)
                    )
    print(f"export of {args.mib} MiB in 64 tensors, median of {args.repeat}, fresh processes:")
    base = statistics.median(f["seconds"] for f in figures["export (ours), safetensors"])
    for name, runs_of in figures.items():
        seconds = statistics.median(f["seconds"] for f in runs_of)
        grew = statistics.median(f["grew"] for f in runs_of)
        print(
            f"  {name:<36} {args.mib / seconds:>8,.0f} MiB/s  x{seconds / base:.2f} time  "
            f"peak +{grew / size:.2f}x the state"
        )


if __name__ == "__main__":
    main()
