"""``rallypoint run``: torchrun with the rallypoint backend and defaults from the
environment, for launchers that cannot pass flags (AzureML commands, Kubernetes pods).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import NoReturn

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "RUN_ENV",
    "WARM_ENV",
    "WARM_MODULES",
    "WORKER_ENV_FILE",
    "run",
    "torchrun_argv",
]

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
    "RALLYPOINT_WARM_START",
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


#: Modules the worker-starting server imports once, so that workers started after a
#: membership change do not import torch again (seconds per worker). DDP's constructor
#: imports ``torch._dynamo`` (and sympy with it): 1.8-2.3 s of CPU per worker here.
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "rallypoint.trainer",
)
#: ``0`` turns the warm start off: workers are then fresh interpreters, as torchrun's own.
WARM_ENV = "RALLYPOINT_WARM_START"
#: Where the agent's plugin writes the ``RALLYPOINT_*`` variables of the generation it
#: joined: a warm worker's environment is the server's, from before that generation.
WORKER_ENV_FILE = "RALLYPOINT_WORKER_ENV"


def _worker(module: bool, target: str, *args: str) -> None:
    """A worker: runs the training script (or ``-m`` module) as ``__main__``, as the
    interpreter torchrun would start does, in a process forked from the warm server."""
    source = os.environ.get(WORKER_ENV_FILE)
    if source:
        with open(source) as f:
            exported = f.read()
        if exported:  # empty under another rendezvous backend: nothing to take
            os.environ.update(json.loads(exported))
    sys.argv = [target, *args]
    # torch counts a function worker done only when it returns a value: a worker that
    # ends with exit status 0 any other way leaves the agent waiting forever. So
    # sys.exit(0) returns, and so does os._exit(0) from the main thread (as
    # PreemptionWatcher.finish ends a preempted worker). Nothing is lost by unwinding:
    # the process still ends in os._exit, after multiprocessing has sent the result.
    real_exit = os._exit
    main = threading.main_thread()

    def exit_returns(status: int) -> NoReturn:
        if status == 0 and threading.current_thread() is main:
            raise SystemExit(0)
        real_exit(status)

    os._exit = exit_returns
    try:
        if module:
            sys.path.insert(0, os.getcwd())  # as `python -m` puts it first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        os._exit = real_exit


def run(args: Sequence[str]) -> int:
    """Runs torchrun with :func:`torchrun_argv`; returns its exit status.

    Workers start warm: torchrun's agent starts them by forking a server process that
    imported torch once (``forkserver`` with :data:`WARM_MODULES` preloaded), instead of
    a new interpreter that imports torch at every restart. Each worker is still a fresh
    process that runs the script as ``__main__``; the server never touches a GPU, so
    CUDA initializes in the worker as usual. ``RALLYPOINT_WARM_START=0``, ``--no-python``
    or ``--start-method`` give torchrun's own behaviour.
    """
    try:
        argv = torchrun_argv(args)
    except ValueError as exc:
        print(f"rallypoint run: {exc}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    print("rallypoint run: torchrun " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        if _warm(argv):
            _launch_warm(argv)
        else:
            torchrun(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except ChildFailedError:
        return 1  # torchrun reported which worker failed, and how
    return 0


def _warm(argv: Sequence[str]) -> bool:
    given = _given(argv)
    return (
        os.environ.get(WARM_ENV, "1") != "0"
        and not {"no-python", "start-method", "standalone", "run-path"} & given
    )


def _launch_warm(argv: Sequence[str]) -> None:
    """What ``torch.distributed.run.run`` does, with :func:`_worker` as the entrypoint
    (a function, as torchrun's own ``--run-path`` uses) and a warm ``forkserver``."""
    import multiprocessing

    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    torch.multiprocessing._set_thread_name("pt_elastic")  # as torchrun names its agent
    parsed = get_args_parser().parse_args(list(argv))
    parsed.start_method = "forkserver"
    if parsed.master_port is None:
        parsed.master_port = 29500  # as torchrun's run() sets it (static backend only)
    config, _, _ = config_from_args(parsed)
    multiprocessing.set_forkserver_preload(list(WARM_MODULES))
    with tempfile.NamedTemporaryFile(prefix="rallypoint-worker-env-", suffix=".json") as state:
        os.environ[WORKER_ENV_FILE] = state.name  # before the server starts: it inherits it
        elastic_launch(config=config, entrypoint=_worker)(
            bool(parsed.module), parsed.training_script, *parsed.training_script_args
        )
