"""Coordinator settings: ``RALLYPOINT_*`` environment variables, overridden by CLI flags."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .storage import DEFAULT_STORAGE

__all__ = ["Settings"]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the coordinator reads at start-up.

    Precedence: CLI flags, then ``RALLYPOINT_*`` variables, then these defaults.
    """

    model_config = SettingsConfigDict(env_prefix="RALLYPOINT_", frozen=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    storage: str = DEFAULT_STORAGE
    storage_prefix: str = "rp"
    token: str | None = None
    insecure: bool = False
    #: One log line per request; off by default, as every node heartbeats every second.
    access_log: bool = False
    #: ``text`` lines, or ``json``: one object per line, for log collectors.
    log_format: Literal["text", "json"] = "text"
    #: Committed checkpoint versions kept per job (the latest is kept regardless).
    checkpoint_keep: int = Field(3, ge=1)
    #: A node lost this many times (its heartbeat connection dropped, or it missed
    #: heartbeats) within ``node_loss_window`` seconds is quarantined in its job: never
    #: admitted again until an operator clears it. 0: never (the default: a spot fleet
    #: loses good machines too; set it where a flaky machine costs more than its seat).
    node_losses: int = Field(0, ge=0, le=1000)
    node_loss_window: float = Field(3600.0, gt=0, le=30 * 86400)
    #: A node whose rank hangs twice within this many seconds is quarantined in its job
    #: (a standby takes its place if the job has one): one hang may be a driver's
    #: hiccup, a second within the hour is the machine.
    hang_window: float = Field(3600.0, gt=0, le=30 * 86400)
    #: Seconds a checkpoint version may stay unfinished before it is garbage-collected.
    checkpoint_timeout: float = Field(3600.0, gt=0, le=7 * 86400)
    #: Seconds an upload URL is valid (trainers renew theirs during long uploads): a
    #: URL cannot be recalled on Azure once handed out, so minutes, at most an hour.
    write_url_ttl: float = Field(300.0, ge=1, le=3600)
    #: Seconds a read URL (or a peer read grant) is valid: a restore must finish in it.
    read_url_ttl: float = Field(3600.0, ge=1, le=7 * 86400)
    #: Seconds of storage outage this replica rides out: it answers heartbeats from its
    #: last view of each job and stays ready. Past it, it reports unready and answers
    #: 503 (see docs/OPERATIONS.md, "Storage outages").
    storage_grace: float = Field(60.0, gt=0, le=3600)
    #: Seconds a node whose held heartbeat or held join was cut (its process died, or a
    #: proxy cut it) has to beat again before its generation ends or its round leaves
    #: it out: the floor of a node loss's detection. The replica adds its last storage
    #: pass's duration (a beat through another replica waits for one). Lower detects
    #: sooner; a live node's reconnection must beat within it.
    heartbeat_reconnect: float = Field(0.25, gt=0, le=30)

    @field_validator("storage")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        kind, _, rest = value.partition(":")
        if kind not in ("local", "azure") or (kind == "azure" and rest):
            raise ValueError("storage must be 'local:PATH' or 'azure'")
        return value

    @model_validator(mode="after")
    def _no_open_doors(self) -> Settings:
        # Anyone who can reach the port could rewrite membership: refuse that by default.
        if not self.token and not self.insecure and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without a token: set RALLYPOINT_TOKEN "
                "(--token), or pass --insecure if the network is trusted"
            )
        return self
