"""What the deploy tests share: the repository's root, the variables the code reads, the
rendezvous configuration keys the plugin takes, and reading the Kubernetes manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rallypoint import client
from rallypoint.service.settings import Settings
from rallypoint.trainer.agent import RUN_ENV

ROOT = Path(__file__).resolve().parent.parent

KNOWN_ENV = (
    {f"RALLYPOINT_{name.upper()}" for name in Settings.model_fields}
    # The client's: each of its public *_ENV names, so that a new one is known here at once.
    | {getattr(client, name) for name in client.__all__ if name.endswith("_ENV")}
    | set(RUN_ENV)
    | {"AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT"}
)

#: The keys the plugin reads from --rdzv-conf (README, "Elastic training with torchrun").
RDZV_CONF = {
    "token",
    "node_id",
    "heartbeat_timeout",
    "heartbeat_interval",
    "last_call",
    "join_timeout",
    "store_timeout",
}


def documents(name: str) -> dict[str, dict[str, Any]]:
    """The documents of one of deploy/kubernetes/'s manifests, by kind."""
    text = (ROOT / "deploy" / "kubernetes" / name).read_text()
    return {d["kind"]: d for d in yaml.safe_load_all(text) if d}


def env_names(container: dict[str, Any]) -> set[str]:
    """The names of the variables a container sets."""
    return {e["name"] for e in container.get("env", [])}
