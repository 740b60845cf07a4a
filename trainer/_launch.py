"""``rallypoint run``: torchrun with the rallypoint backend and defaults from the
environment, for launchers that cannot pass flags (AzureML commands, Kubernetes pods).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["DEFAULT_MAX_RESTARTS", "RUN_ENV", "torchrun_argv"]

#: Workers that fail in a collective when a peer dies count as restarts in torchrun;
#: membership changes the plugin reports do not. Room for many of the former.
DEFAULT_MAX_RESTARTS = 100
#: The variables ``rallypoint run`` reads (besides AzureML's and torchrun's ``PET_*``).
RUN_ENV = (
    "RALLYPOINT_URL",
    "RALLYPOINT_JOB",
    "RALLYPOINT_NNODES",
    "RALLYPOINT_MIN_NODES",
    "RALLYPOINT_NPROC_PER_NODE",
    "RALLYPOINT_MAX_RESTARTS",
    "RALLYPOINT_RDZV_CONF",
)


def _given(args: Sequence[str]) -> set[str]:
    """The torchrun options in ``args`` (before the script), normalized."""
    given: set[str] = set()
    for arg in args:
        if not arg.startswith("-"):
            break  # the training script: what follows is its own
        given.add(arg.lstrip("-").split("=", 1)[0].replace("_", "-"))
    return given


def torchrun_argv(args: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's arguments: ``args`` plus every default they and ``PET_*`` leave open.

    ========================  =============================================================
    ``--rdzv-backend``        ``rallypoint``
    ``--rdzv-endpoint``       ``RALLYPOINT_URL``
    ``--rdzv-id``             ``RALLYPOINT_JOB``, else AzureML's ``AZUREML_RUN_ID``
    ``--nnodes``              ``RALLYPOINT_NNODES`` (``MIN:MAX``), else
                              ``RALLYPOINT_MIN_NODES`` (1) to AzureML's
                              ``AZUREML_NODE_COUNT``
    ``--nproc-per-node``      ``RALLYPOINT_NPROC_PER_NODE``, else ``gpu`` with CUDA, else 1
    ``--max-restarts``        ``RALLYPOINT_MAX_RESTARTS``, else 100
    ``--rdzv-conf``           ``RALLYPOINT_RDZV_CONF``
    ========================  =============================================================

    Kubernetes' PyTorchJob sets ``PET_*`` variables, which torchrun reads itself: those
    are left to it.

    Raises:
        ValueError: No coordinator URL or job id from any source.
    """
    env = os.environ if environ is None else environ
    given = _given(args)
    defaults: dict[str, str | None] = {
        "rdzv-backend": "rallypoint",
        "rdzv-endpoint": env.get("RALLYPOINT_URL"),
        "rdzv-id": env.get("RALLYPOINT_JOB") or env.get("AZUREML_RUN_ID"),
        "nnodes": env.get("RALLYPOINT_NNODES")
        or (
            f"{env.get('RALLYPOINT_MIN_NODES', '1')}:{env['AZUREML_NODE_COUNT']}"
            if "AZUREML_NODE_COUNT" in env
            else None
        ),
        "nproc-per-node": env.get("RALLYPOINT_NPROC_PER_NODE") or _gpus_or_one(),
        "max-restarts": env.get("RALLYPOINT_MAX_RESTARTS") or str(DEFAULT_MAX_RESTARTS),
        "rdzv-conf": env.get("RALLYPOINT_RDZV_CONF"),
    }
    extra: list[str] = []
    for name, value in defaults.items():
        pet = "PET_" + name.upper().replace("-", "_")
        if name in given or pet in env or value is None:
            continue
        extra.append(f"--{name}={value}")
    out = extra + list(args)
    final = _given(out) | {k for k in defaults if "PET_" + k.upper().replace("-", "_") in env}
    for name, source in (("rdzv-endpoint", "RALLYPOINT_URL"), ("rdzv-id", "RALLYPOINT_JOB")):
        if name not in final:
            raise ValueError(f"set {source} or pass --{name}")
    return out


def _gpus_or_one() -> str:
    try:
        import torch
    except ImportError:
        return "1"
    return "gpu" if torch.cuda.is_available() else "1"


def run(args: Sequence[str]) -> int:
    """Runs torchrun with :func:`torchrun_argv`; returns its exit status."""
    try:
        argv = torchrun_argv(args)
    except ValueError as exc:
        print(f"rallypoint run: {exc}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    print("rallypoint run: torchrun " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        torchrun(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except ChildFailedError:
        return 1  # torchrun reported which worker failed, and how
    return 0
