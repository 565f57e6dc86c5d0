"""The app's HTTP API toggle: serves the running engine (the chats' L2, L3 and statistics) on loopback.

`ServerController` lives in the GUI thread and owns at most one `server.ServerHandle`. Starting imports FastAPI
and uvicorn (the first time) and waits for uvicorn to listen, so it runs in a short-lived helper thread and
reports back through a queued signal; stopping is quick (uvicorn polls its exit flag every 0.1 s) and runs in
the caller's thread, so `shutdown()` can stop everything before the engine thread is joined.

A start superseded before it finishes (toggled off, another model, window closing) is stopped as soon as it
has started: at most one server answers at a time, and never one the user has switched off.
"""
from __future__ import annotations

import itertools
import logging
import threading

from PySide6.QtCore import QObject, Signal, Slot

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def _start(engine, host: str, port: int):
    from larql_desktop.api.server import start_server   # FastAPI/uvicorn are imported only when the user turns serving on

    return start_server(engine, host, port)


class ServerController(QObject):
    """Start/stop one HTTP API server over an engine. `changed` fires (in the GUI thread) whenever `url`,
    `starting` or `error` changes; `error` is the latest failure to start ("" after a success)."""

    changed = Signal()
    _done = Signal(int)   # a start attempt finished (its token); emitted from the helper thread

    def __init__(self, starter=_start, host: str = HOST, parent: QObject | None = None):
        super().__init__(parent)
        self._starter = starter
        self.host = host
        self.handle = None              # ServerHandle of the running server
        self.engine = None              # the engine it serves
        self.error = ""
        self._tokens = itertools.count(1)
        self._pending: int | None = None   # the start the controller still wants
        self._lock = threading.Lock()
        self._results: dict[int, tuple] = {}   # token -> (handle or None, error, engine)
        self._threads: dict[int, threading.Thread] = {}
        self._done.connect(self._on_done)

    # --- state ---

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle is not None else None

    @property
    def starting(self) -> bool:
        return self._pending is not None

    @property
    def running(self) -> bool:
        return self.handle is not None

    # --- control ---

    def start(self, engine, port: int) -> None:
        """(Re)start serving `engine` on `port` (0: any free port). Stops the current server first."""
        self._stop_current()
        token = next(self._tokens)
        self._pending = token
        self.error = ""
        thread = threading.Thread(target=self._run, args=(token, engine, port), name="larql-api-start", daemon=True)
        with self._lock:
            self._threads[token] = thread
        thread.start()
        self.changed.emit()

    def stop(self) -> None:
        """Stop serving (and drop any start in flight). Quick; safe to call at any time."""
        self._pending = None
        self._stop_current()
        self._reap(wait=False)
        self.changed.emit()

    def shutdown(self, timeout: float = 20.0) -> None:
        """Stop the server and wait for every start in flight to finish and be stopped (before the app exits)."""
        self._pending = None
        self._stop_current()
        self._reap(wait=True, timeout=timeout)

    # --- internals ---

    def _run(self, token: int, engine, port: int) -> None:
        try:
            handle, error = self._starter(engine, self.host, port), ""
        except (OSError, ValueError, RuntimeError) as exc:
            handle, error = None, str(exc) or type(exc).__name__
        except Exception as exc:   # a bug: keep the traceback, report the rest
            log.exception("starting the HTTP API failed")
            handle, error = None, f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._results[token] = (handle, error, engine)
        self._done.emit(token)

    @Slot(int)
    def _on_done(self, token: int) -> None:
        with self._lock:
            result = self._results.pop(token, None)
            self._threads.pop(token, None)
        if result is None:   # already reaped by stop()/shutdown()
            return
        handle, error, engine = result
        if token != self._pending:   # superseded while starting
            if handle is not None:
                handle.stop()
            return
        self._pending = None
        if handle is not None:
            self.handle, self.engine, self.error = handle, engine, ""
            log.info("HTTP API serving on %s", handle.url)
        else:
            self.error = error
            log.info("HTTP API did not start: %s", error)
        self.changed.emit()

    def _stop_current(self) -> None:
        handle, self.handle, self.engine = self.handle, None, None
        if handle is not None:
            handle.stop()
            log.info("HTTP API on %s stopped", handle.url)

    def _reap(self, wait: bool, timeout: float = 20.0) -> None:
        """Stop servers from superseded starts that have finished (with `wait`, wait for the rest first)."""
        with self._lock:
            threads = list(self._threads.items())
        for token, thread in threads:
            if wait:
                thread.join(timeout)
            if not thread.is_alive():
                with self._lock:
                    self._threads.pop(token, None)
                    result = self._results.pop(token, None)
                if result is not None and result[0] is not None:
                    result[0].stop()
