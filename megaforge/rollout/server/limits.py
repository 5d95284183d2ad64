"""Resource bounds of the embedded engine server (:mod:`megaforge.rollout.server`).

* Work per request is bounded by the model's context ``C`` (:func:`megaforge.rollout.context_limit`),
  as SGLang bounds it: a prompt of ``>= C`` tokens, or ``prompt + max_new_tokens > C``, is HTTP 400. A
  text prompt is refused before it is tokenized when it is longer than :func:`max_text_bytes`
  (``C x`` the longest token's bytes ``x 4``: a text that long cannot be fewer than C tokens, with room
  for normalisers that shorten text), and it is tokenized off the event loop.
* Connections (:class:`ConnectionGuard`): the open-file soft limit is raised to the hard one at
  start (:func:`raise_open_file_limit`); at most ``max_connections`` are open (default: the open-file
  limit less a reserve for the model's files and for one burst of accepts, :data:`ACCEPT_BACKLOG`); at
  the limit the oldest connection with no request in progress is closed to make room, and when every
  connection has one the new connection gets a 503.
  A connection that sends no complete request head within ``--idle-timeout`` seconds of connecting or
  of its last answer is closed (aiohttp's keep-alive timer, armed at connect), and a request body
  must arrive within ``--body-timeout`` seconds. At most ``--max-body-readers`` requests (default a
  quarter of ``max_connections``) read their bodies at once; another gets a 503 before its body is
  read, so connections trickling bodies hold at most that many slots and the rest (``/health``, the
  requests whose bodies have arrived) keep theirs.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time

log = logging.getLogger("megaforge.engine_server")
ACCEPT_BACKLOG = 128  # listen backlog, and the most connections asyncio accepts in one burst
FD_RESERVE = 256  # descriptors kept for model files, the log, weight-update groups and one accept burst
TEXT_BYTES_MARGIN = 4


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` decodes to (an upper bound of the text one token
    covers; a partial-byte token decodes to U+FFFD, 3 bytes, which only loosens the bound)."""
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    return max([len(t.encode("utf-8")) for t in texts] + [1])


def max_text_bytes(context: int, token_bytes: int) -> int:
    """Longest text (UTF-8 bytes) that may still be fewer than ``context`` tokens (see the module docstring)."""
    return context * token_bytes * TEXT_BYTES_MARGIN


def raise_open_file_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one; (old soft, new soft)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, new, e)
            return soft, soft
    return soft, max(new, soft)


def default_max_connections(requested: int) -> int:
    """``requested`` (0: no explicit limit) bounded by the open-file soft limit less :data:`FD_RESERVE`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(16, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else 1 << 20
    return min(requested, room) if requested > 0 else room


_BUSY_ANSWER = (b'{"error": {"message": "too many connections: every connection of this server has a request in '
                b'progress"}}')


class _Refuse(asyncio.Protocol):
    """Answers 503 and closes: the connection limit is reached and no connection is idle."""

    def connection_made(self, transport):
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                        b"Content-Length: " + str(len(_BUSY_ANSWER)).encode() + b"\r\n\r\n" + _BUSY_ANSWER)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's request handler behind a proxy that tells the guard when the connection opens and
    closes (counted from creation, so that a burst of accepts is counted before they connect)."""

    def __init__(self, inner, guard: "ConnectionGuard"):
        self.inner, self.guard, self.transport, self.created = inner, guard, None, time.monotonic()

    def connection_made(self, transport):
        self.transport = transport
        self.inner.connection_made(transport)
        self.guard.trim()

    def connection_lost(self, exc):
        self.guard.live.pop(self, None)
        self.inner.connection_lost(exc)

    def data_received(self, data):
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def idle(self) -> bool:
        t = self.transport
        return t is not None and not t.is_closing() and self.inner not in self.guard.busy


class ConnectionGuard:
    """Protocol factory around aiohttp's ``web.Server`` that bounds open connections (module docstring).
    :meth:`begin` / :meth:`end` mark a connection's request in progress (called by the app's middleware
    with ``request.protocol``)."""

    def __init__(self, server, max_connections: int):
        self.server, self.max_connections = server, max_connections
        self.live: dict[_Counted, None] = {}  # open (or opening) connections, oldest first
        self.busy: dict = {}  # aiohttp handler -> requests in progress
        self.evicted = 0
        self.refused = 0

    def open_connections(self) -> int:
        return len(self.live)

    def begin(self, handler) -> None:
        self.busy[handler] = self.busy.get(handler, 0) + 1

    def end(self, handler) -> None:
        left = self.busy.get(handler, 0) - 1
        if left > 0:
            self.busy[handler] = left
        else:
            self.busy.pop(handler, None)

    def __call__(self):
        now = time.monotonic()
        for p in [p for p in self.live if p.transport is None and now - p.created > 10.0]:
            self.live.pop(p, None)  # created, never connected (the accept failed)
        if len(self.busy) >= self.max_connections:  # every slot has a request in progress
            self.refused += 1
            return _Refuse()
        proto = _Counted(self.server(), self)
        self.live[proto] = None
        return proto

    def trim(self) -> None:
        """Close the oldest idle connections while more than ``max_connections`` are open. Called as a
        connection opens: a burst of accepts (at most the listen backlog) is admitted, then trimmed."""
        while len(self.live) > self.max_connections:
            idle = next((p for p in self.live if p.idle()), None)
            if idle is None:
                return
            self.live.pop(idle, None)
            idle.inner.force_close()
            self.evicted += 1
            if self.evicted in (1, 10, 100) or self.evicted % 1000 == 0:
                log.warning("connection limit %d reached: closed the oldest idle connection (%d so far)",
                            self.max_connections, self.evicted)
