"""The app's HTTP API toggle, as the GUI thread sees it: what the engine worker reports about its server.

The server runs on the engine the worker owns (the worker starts it with the `serve` function main() gave it,
restarts it on every model load and stops it when the engine thread ends), so the GUI thread never holds the engine.
`ServerController` only sends StartServer/StopServer and mirrors the ServerState answers.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

from larql_desktop.qt.protocol import ServerState, StartServer, StopServer


class ServerController(QObject):
    """`changed` fires whenever `url`, `starting` or `error` changes; `error` is the latest failure to start."""

    changed = Signal()

    def __init__(self, client, parent: QObject | None = None):
        super().__init__(parent)
        self.client = client
        self.url: str | None = None
        self.error = ""
        self._pending: int | None = None    # the StartServer the controller still waits an answer for
        client.server_state.connect(self._on_server_state)

    @property
    def starting(self) -> bool:
        """A start is under way (without a model the worker waits for one: that is not starting yet)."""
        return self._pending is not None and self.client.model is not None

    @property
    def running(self) -> bool:
        return self.url is not None

    @property
    def available(self) -> bool:
        return self.client.can_serve

    def start(self, port: int) -> None:
        """Serve the loaded model (or the next one to load) on `port` (0: any free port)."""
        request = StartServer(self.client.next_request_id(), port)
        self._pending, self.error = request.request_id, ""
        self.client.submit(request)
        self.changed.emit()

    def stop(self) -> None:
        self._pending, self.url = None, None
        if self.client.is_running():
            self.client.submit(StopServer(self.client.next_request_id()))
        self.changed.emit()

    def shutdown(self) -> None:
        """Forget the server: the worker stops it when the engine thread ends (EngineClient.shutdown)."""
        self._pending, self.url = None, None

    @Slot(object)
    def _on_server_state(self, event: ServerState) -> None:
        # Answers arrive in request order, so the last one describes the worker's server.
        self.url, self.error = event.url, event.error
        if event.request_id == self._pending:
            self._pending = None
        self.changed.emit()
