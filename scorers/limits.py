"""What bounds the reward server's connections in time and its requests' bodies in memory
(scorers/server.py), under uvicorn's h11 protocol:

- **a deadline for every request head**: a connection must send a whole request head (the request
  line and headers) within `header_timeout` seconds of opening, or of its previous answer when it
  is kept alive, however it trickles its bytes; else it is answered 408 and closed. The deadline
  is not moved by bytes that arrive, so a peer sending a byte a second is closed like a silent one;
- **room for the requests that count**: at most `max_connections` connections are open. One more
  closes the connection that has waited longest without a request in progress (silent, sending its
  head, or left open after its answer, e.g. a refused body still arriving), so idle and trickling
  peers, which need no token to open a connection, cannot keep an authorised request out. A
  connection whose bytes wait unread in its socket (a client that sent its head at once, not yet
  seen by a busy event loop) is passed over. If every connection has a request in progress (or
  bytes waiting), the new one is answered 503 and its client tries again;
- **bodies in memory at once** (`ByteBudget`): a request takes the bytes its body declares (the
  server's limit for a chunked one) before its body is read, and gives them back once answered;
  one that waits too long is answered 503. The body's own deadline (`--body-timeout`) and the
  token, checked on the head before any of this, are in server.py.

The protocol is uvicorn's own (`H11Protocol`) with these checks added where a connection opens,
receives bytes, finishes an answer and closes.
"""

import asyncio
import collections
import json
import logging
import math
import struct
import time

try:  # how many bytes wait in a socket, unread (Linux, macOS)
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None

from uvicorn.protocols.http.h11_impl import H11Protocol


GRACE = 1.0       # seconds a closed connection may take to send its last answer before it is cut
NOTE_EVERY = 10.0  # seconds between two log lines of one kind (a flood of peers: one line, counted)


def raw_answer(transport, status, reason):
    """Write a whole HTTP answer {"error": reason} with `status` outside h11 (a connection without a
    request in progress) and close the connection, cut after GRACE s if the peer does not read."""
    body = json.dumps({"error": reason}).encode()
    phrase = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
    transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (status, phrase, len(body), body))
    close(transport)


def close(transport):
    """Close `transport` once its buffered bytes are sent; cut it after GRACE s at the latest."""
    transport.close()
    asyncio.get_running_loop().call_later(GRACE, transport.abort)


class Guard:
    """The open connections of one server and its limits on them (see the module's docstring).

    max_connections: connections open at once; header_timeout: seconds for a request head.
    """

    def __init__(self, max_connections, header_timeout):
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.open = set()                       # every connection (a protocol object)
        self.idle = collections.OrderedDict()   # those without a request in progress, longest first
        self.log = logging.getLogger("uvicorn.error")
        self.notes = {}  # kind -> (time of its last line, lines left out since)

    def note(self, kind, line, level=logging.INFO):
        """Log `line`, or count it if a line of its `kind` was logged less than NOTE_EVERY s ago."""
        now = time.monotonic()
        last, left_out = self.notes.get(kind, (-math.inf, 0))
        if now - last < NOTE_EVERY:
            self.notes[kind] = (last, left_out + 1)
            return
        self.notes[kind] = (now, 0)
        more = f" (and {left_out} more such in {now - last:.0f} s)" if left_out else ""
        self.log.log(level, line + more)

    def admit(self, conn):
        """A new connection: room is made for it, or it is answered 503. True if admitted."""
        if len(self.open) >= self.max_connections:
            victim = next((c for c in self.idle if not unread(c)), None)
            if victim is None:
                full = f"{self.max_connections} connections have a request in progress"
                self.note("busy", f"refused a connection from {conn.peer}: all {full} "
                                  "(--max-connections)", logging.WARNING)
                raw_answer(conn.transport, 503, f"busy: all {full} (--max-connections); try again")
                return False
            self.gone(victim)
            self.note("room", f"closed the connection from {victim.peer}, without a request in "
                              f"progress, to make room (--max-connections {self.max_connections})")
            victim.transport.abort()
        self.open.add(conn)
        self.wait_for_head(conn)
        return True

    def wait_for_head(self, conn):
        """`conn` has no request in progress: it may be closed to make room, and must send a
        head in time."""
        self.idle[conn] = None
        self.idle.move_to_end(conn)
        conn.arm_deadline(self.header_timeout)

    def serving(self, conn):
        """`conn` has sent a whole request head: it keeps its place until the answer is sent."""
        self.idle.pop(conn, None)
        conn.cancel_deadline()

    def gone(self, conn):
        self.open.discard(conn)
        self.idle.pop(conn, None)
        conn.cancel_deadline()


def unread(conn):
    """Bytes that have reached `conn`'s socket and wait to be read: a request the event loop has not
    seen yet (a client that sent its head at once), not a silent peer's. 0 if it cannot be told."""
    sock = conn.transport.get_extra_info("socket")
    if fcntl is None or sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0


def guarded_protocol(guard):
    """uvicorn's H11Protocol class with `guard`'s limits, for uvicorn.Config(http=...)."""

    class Guarded(H11Protocol):
        deadline = None
        admitted = False
        peer = "?"

        def connection_made(self, transport):
            super().connection_made(transport)
            self.peer = "%s:%d" % self.client[:2] if self.client else "?"
            self.seen = None  # the request cycle last marked as in progress
            self.admitted = guard.admit(self)

        def data_received(self, data):
            if not self.admitted:
                return  # answered 503 and closing
            super().data_received(data)
            self.check_head()

        def check_head(self):
            """A whole request head has arrived if uvicorn has begun a new request cycle for it."""
            cycle = self.cycle
            if cycle is not None and cycle is not self.seen and not cycle.response_complete \
                    and not self.transport.is_closing():
                self.seen = cycle
                guard.serving(self)

        def on_response_complete(self):
            super().on_response_complete()  # may begin a pipelined request's cycle
            if not self.transport.is_closing() and self.admitted:
                guard.wait_for_head(self)
                self.check_head()

        def connection_lost(self, exc):
            guard.gone(self)
            super().connection_lost(exc)

        def arm_deadline(self, seconds):
            self.cancel_deadline()
            self.deadline = self.loop.call_later(seconds, self.too_slow, seconds)

        def cancel_deadline(self):
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def too_slow(self, seconds):
            self.deadline = None
            if self.transport.is_closing():
                return
            guard.gone(self)
            why = f"no whole request head within {seconds:g} s (--header-timeout)"
            guard.note("head", f"closed the connection from {self.peer}: {why}")
            raw_answer(self.transport, 408, why)

    return Guarded


class ByteBudget:
    """Bytes of request bodies the server holds at once (`total`), handed out first come, first
    served: a large request is not passed over by smaller ones that come after it."""

    def __init__(self, total):
        self.total = self.free = total
        self.waiting = collections.deque()  # (bytes, future) in the order they asked

    async def take(self, size, timeout):
        """Wait at most `timeout` seconds for `size` bytes (≤ total). Returns True once they are
        taken (give them back with `give`), False if the time ran out (nothing taken)."""
        if not self.waiting and size <= self.free:
            self.free -= size
            return True
        granted = asyncio.get_running_loop().create_future()
        self.waiting.append((size, granted))
        try:
            await asyncio.wait([granted], timeout=timeout)
        except BaseException:  # cancelled while waiting: the bytes, if granted meanwhile, go back
            if granted.done() and not granted.cancelled():
                self.give(size)
            granted.cancel()
            self.hand_out()
            raise
        if granted.done():
            return True
        granted.cancel()
        self.hand_out()  # the next in line may fit now that this one no longer waits first
        return False

    def give(self, size):
        """Give back `size` bytes taken."""
        self.free += size
        self.hand_out()

    def hand_out(self):
        """Grant the waiting requests, in order, while the first of them fits."""
        while self.waiting:
            size, granted = self.waiting[0]
            if granted.done():  # gave up waiting
                self.waiting.popleft()
                continue
            if size > self.free:
                return
            self.waiting.popleft()
            self.free -= size
            granted.set_result(True)
