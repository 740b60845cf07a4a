"""Comparing what two runs of a job ended with: the latest version's model, exported
through the coordinator as a user would (``rallypoint.trainer.export``), and the largest
relative difference between two such models.

A run through a world-size change trains the same samples in the same steps as the
uninterrupted run, but sums each step's gradient in another order (another split into
ranks, per-device batches and accumulation steps), so its parameters differ from the
uninterrupted run's by rounding only; the elastic tests report that difference.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from rallypoint.cli.processes import Coordinator
from rallypoint.client import ElasticClient
from rallypoint.trainer import export

__all__ = ["final_model", "largest_relative_difference"]


def final_model(
    coordinator: Coordinator, job: str, out: Path, only: str | None
) -> tuple[int, dict[str, torch.Tensor]]:
    """The step of the job's latest version and its tensors whose names start with
    ``only`` (the model's, not the optimizer's; None: all, as for a DeepSpeed version,
    whose export is the consolidated model alone), read by a node that never joins."""
    reader = ElasticClient(coordinator.url, job, "reader")
    with warnings.catch_warnings():
        # DCP's note that it reads in one process: this reader is one, on purpose.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        done = export(reader, out / f"{job}.safetensors", "latest", only=only, progress=False)
    return done.step, load_file(done.files[0])


def largest_relative_difference(
    run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], eps: float = 1e-12
) -> float:
    """``max |a - b| / max(|b|, eps)`` over each tensor, the largest over all tensors:
    how far ``run`` ended from ``reference``, relative to each tensor's scale (an
    element-wise ratio would blow up where a reference value is near zero)."""
    assert run.keys() == reference.keys(), run.keys() ^ reference.keys()
    worst = 0.0
    for name, b in reference.items():
        a, b = run[name].double(), b.double()
        assert a.shape == b.shape, name
        scale = max(float(b.abs().max()), eps)
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst
