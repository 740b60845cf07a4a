"""A stand-in for Azure's Scheduled Events endpoint (IMDS), on loopback.

Azure's metadata service exists only inside Azure VMs; the demo and the tests send
preemption notices through this instead. It serves the documented JSON
(https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events): ``GET
/metadata/scheduledevents`` with ``Metadata: true`` lists events, ``POST`` with
``{"StartRequests": [{"EventId": ...}]}`` acknowledges them.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeImds"]


class FakeImds:
    """Scheduled Events for made-up VMs, served from a thread.

    Attributes:
        url: The base URL (``RALLYPOINT_IMDS_URL``).
        acknowledged: Event ids acknowledged so far, in order.
        polls: How many event polls it answered.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._events: list[dict[str, Any]] = []
        self._incarnation = 1
        self._lock = threading.Lock()
        self.acknowledged: list[str] = []
        self.polls = 0
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FakeImds:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeImds:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def schedule(self, vm_name: str, kind: str = "Preempt", in_seconds: float = 30) -> str:
        """Announces an event for ``vm_name``; returns its id."""
        event_id = str(uuid.uuid4())
        with self._lock:
            self._events.append(
                {
                    "EventId": event_id,
                    "EventType": kind,
                    "ResourceType": "VirtualMachine",
                    "Resources": [vm_name],
                    "EventStatus": "Scheduled",
                    "NotBefore": email.utils.formatdate(time.time() + in_seconds, usegmt=True),
                    "Description": "Virtual machine is being preempted.",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            self._incarnation += 1
        return event_id

    def _document(self) -> bytes:
        with self._lock:
            self.polls += 1
            body = {"DocumentIncarnation": self._incarnation, "Events": list(self._events)}
        return json.dumps(body).encode()

    def _start(self, body: bytes) -> int:
        try:
            requests = json.loads(body)["StartRequests"]
            ids = [str(r["EventId"]) for r in requests]
        except (ValueError, KeyError, TypeError):
            return 400
        with self._lock:
            known = {e["EventId"] for e in self._events}
            if not set(ids) <= known:
                return 400
            self.acknowledged.extend(ids)
            for event in self._events:
                if event["EventId"] in ids:
                    event["EventStatus"] = "Started"
            self._incarnation += 1
        return 200

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(
                self, status: int, body: bytes = b"", kind: str = "application/json"
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _checked(self) -> bool:
                # IMDS refuses requests without the header (so no proxy forwards them).
                if self.headers.get("Metadata") != "true":
                    self._reply(400, b'{"error": "Bad request. Required metadata header"}')
                    return False
                return True

            def do_GET(self) -> None:
                if not self._checked():
                    return
                if self.path.startswith("/metadata/scheduledevents"):
                    self._reply(200, imds._document())
                else:
                    self._reply(404, b'{"error": "Not found"}')

            def do_POST(self) -> None:
                if not self._checked():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if not self.path.startswith("/metadata/scheduledevents"):
                    self._reply(404, b'{"error": "Not found"}')
                    return
                self._reply(imds._start(body))

        return Handler
