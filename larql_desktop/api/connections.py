"""Connection limits for the API server, so idle or slow clients cannot starve the others (a slowloris).

uvicorn alone closes a connection only when it has been idle *between* requests (its keep-alive timeout): a
connection that is opened and never sends a request, or sends its headers a byte at a time, stays open for ever,
and its `limit_concurrency` answers every request over the limit with 503, so 64 such connections starved every
other client. Here, instead, in uvicorn's own h11 protocol:

  * a request's headers must be complete within `header_timeout` of the connection opening (or of the previous
    response on a kept-alive connection), however slowly they trickle in, and its body within `body_timeout` of
    the headers; otherwise the connection is closed;
  * idle kept-alive connections close after `keep_alive` seconds, and a connection serves at most
    `max_requests_per_connection` requests;
  * one client address keeps at most `max_waiting_per_client` connections that are waiting for request headers:
    a new connection beyond that closes that client's oldest waiting one, so a client hoarding idle connections
    only ever displaces its own, and a real request (whose headers arrive at once) always gets in;
  * one client address holds at most `max_per_client` connections in all, the server `max_connections`: beyond,
    the oldest waiting connection makes room, or the new one is closed at once (never a 503 for the others).

On loopback every client has the same address, so the per-client caps are the per-server caps there; what keeps
real requests served is that waiting connections make room for new ones and time out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 5.0
    max_waiting_per_client: int = 16
    max_per_client: int = 128
    max_connections: int = 1024
    max_requests_per_connection: int = 10_000
    max_header_bytes: int = 16 * 1024

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout", "keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive")
        if not 1 <= self.max_waiting_per_client <= self.max_per_client <= self.max_connections:
            raise ValueError("connection caps must satisfy 1 <= waiting per client <= per client <= total")


class ConnectionRegistry:
    """Every open connection of one server, by client address, and which of them wait for request headers
    (oldest first). Used from the server's event loop only, so it needs no lock."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self._by_client: dict[str, set] = {}
        self._waiting: OrderedDict = OrderedDict()     # connection -> client address
        self.total = 0
        self.refused = 0      # connections closed at once (over a cap, nothing waiting to make room)
        self.displaced = 0    # waiting connections closed to make room for a new one
        self.timed_out = 0    # connections closed by the header or body timeout

    @staticmethod
    def _client(conn) -> str:
        return conn.client[0] if conn.client else ""

    def _oldest_waiting(self, client: str | None):
        return next((c for c, who in self._waiting.items() if client is None or who == client), None)

    def _displace(self, conn) -> None:
        self.forget(conn)
        self.displaced += 1
        conn.transport.close()

    def admit(self, conn) -> bool:
        """Register a new connection (which starts waiting for its headers); False: close it, it is over a cap."""
        client, lim = self._client(conn), self.limits
        mine = self._by_client.setdefault(client, set())
        if sum(1 for who in self._waiting.values() if who == client) >= lim.max_waiting_per_client:
            self._displace(self._oldest_waiting(client))
        if len(mine) >= lim.max_per_client:
            oldest = self._oldest_waiting(client)
            if oldest is None:
                self.refused += 1
                return False
            self._displace(oldest)
        if self.total >= lim.max_connections:
            oldest = self._oldest_waiting(None)
            if oldest is None:
                self.refused += 1
                return False
            self._displace(oldest)
        mine.add(conn)
        self.total += 1
        self._waiting[conn] = client
        return True

    def set_waiting(self, conn, waiting: bool) -> None:
        client = self._client(conn)
        if conn not in self._by_client.get(client, ()):
            return
        self._waiting.pop(conn, None)
        if waiting:
            self._waiting[conn] = client              # newest waiting last

    def forget(self, conn) -> None:
        client = self._client(conn)
        mine = self._by_client.get(client)
        if mine is not None and conn in mine:
            mine.discard(conn)
            self.total -= 1
            if not mine:
                del self._by_client[client]
        self._waiting.pop(conn, None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


def guarded_protocol(registry: ConnectionRegistry) -> type:
    """An h11 protocol class for uvicorn (Config(http=...)) that applies `registry`'s limits. One class per
    server: the registry is bound to it, not global."""
    limits = registry.limits

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self._body_timer = None
            self._served = 0
            if not registry.admit(self):
                transport.close()
                return
            self._await_headers()

        def connection_lost(self, exc) -> None:
            registry.forget(self)
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            self._after_events(before)

        def on_response_complete(self) -> None:
            before = self.cycle
            self._cancel_timers()
            super().on_response_complete()
            self._served += 1
            if self.transport.is_closing():
                return
            if self._served >= limits.max_requests_per_connection:
                self.transport.close()
                return
            if self.cycle is before:
                self._await_headers()
            else:                                       # a pipelined request was already waiting
                self._after_events(before)

        # --- timers ---
        def _await_headers(self) -> None:
            registry.set_waiting(self, True)
            self._cancel(self._header_timer)
            self._header_timer = self.loop.call_later(limits.header_timeout, self._timed_out, self.cycle)

        def _after_events(self, before) -> None:
            if self.cycle is not before and self.cycle is not None:     # a request's headers are complete
                registry.set_waiting(self, False)
                self._cancel(self._header_timer)
                self._header_timer = None
                if self.conn.their_state is h11.SEND_BODY:
                    self._body_timer = self.loop.call_later(limits.body_timeout, self._body_timed_out)
            if self._body_timer is not None and self.conn.their_state is not h11.SEND_BODY:
                self._cancel(self._body_timer)
                self._body_timer = None

        def _timed_out(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():   # no new request since the timer
                registry.timed_out += 1
                self.transport.close()

        def _body_timed_out(self) -> None:
            self._body_timer = None
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                registry.timed_out += 1
                self.transport.close()

        @staticmethod
        def _cancel(timer) -> None:
            if timer is not None:
                timer.cancel()

        def _cancel_timers(self) -> None:
            self._cancel(self._header_timer)
            self._cancel(self._body_timer)
            self._header_timer = self._body_timer = None

    return GuardedH11Protocol
