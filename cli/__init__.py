"""The ``rallypoint`` command, the local demo, and what runs it: coordinator and torchrun
processes (:mod:`.processes`) and a stand-in for Azure's metadata service
(:mod:`.fake_imds`).

Each subcommand imports only the part of the package it needs, so the client-only
install can run the commands that need no coordinator code.
"""

from ._main import main, serve_settings

__all__ = ["main", "serve_settings"]
