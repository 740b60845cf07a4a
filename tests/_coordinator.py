"""Runs real coordinators (``python -m rallypoint serve``) for the tests:
:class:`rallypoint.cli.processes.Coordinator`, whose log a test does not keep."""

from __future__ import annotations

from rallypoint.cli.processes import Coordinator as _Coordinator

__all__ = ["Coordinator"]


class Coordinator(_Coordinator):
    def stop(self) -> None:
        super().stop()
        self.log.unlink(missing_ok=True)
