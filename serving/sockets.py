"""What a socket needs that a web framework does not set, for clients one cannot trust:
uvicorn's HTTP/1.1 protocol with a connection limit, deadlines to read a request and to
take a response, and an ASGI middleware that checks the API key and bounds the body
before the app sees a request.
"""
import asyncio
import hmac
import socket
import struct
import sys
import time

try:
    import fcntl
    import resource
except ImportError:  # Windows
    fcntl = resource = None
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.engine import LAG_CHECK_S, end_all
from serving.openai_api import ApiError

# where Linux's struct tcp_info keeps the milliseconds since the peer's last ACK (u32), the bytes
# it has acknowledged (u64) and the receive window it advertised last (u32, Linux 5.4 on)
TCPI_LAST_ACK_RECV, TCPI_BYTES_ACKED, TCPI_SND_WND = 56, 120, 228
SIOCOUTQ, SIOCOUTQNSD = 0x5411, 0x894B  # ioctls: bytes of a socket's send queue not yet acknowledged / not yet sent
ETHERNET_MSS = 1460  # bytes of a TCP segment's data on Ethernet's 1500-byte frames
PROBE_S = 1  # while a client is behind, TCP asks its window this often (keepalive probes)
UNREAD_BYTES = 16 * 1024  # a stream is written while its client has less unread (see Connection.behind)
SEND_BUFFER = 16 * 1024  # bytes of response asyncio, and twice that the kernel, hold for a client not reading
RESERVED = 2  # connections past max_connections that may ask /health and /metrics, and nothing else
# a refused connection reads what its client still sends for up to LINGER_S (and LINGER_BYTES),
# LINGERING of them at once: past that, a refused connection is closed at once (its files are needed)
LINGER_S, LINGER_BYTES, LINGERING = 1.0, 1 << 16, 32
FILES_TO_SPARE = 64  # open files besides the connections: the listener, checkpoints, pipes, numba's cache
BACKLOG = 2048  # connections the kernel holds for accept(), and asyncio accepts at one wakeup (uvicorn's backlog)
BUSY_BODY = b'{"error": {"message": "too many connections; retry later", "type": "server_busy", "param": null, "code": 503}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY))


def envelope(e):
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def error_response(e, close=False):
    headers = {"Connection": "close"} if close else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"  # the scheme it asks for (RFC 9110 requires the header)
    return JSONResponse(envelope(e), status_code=e.status, headers=headers)


def key_refusal(scope, key):
    """None if the request may pass: no key set, /health (load balancers ask it without
    one), or 'Authorization: Bearer KEY' (the scheme in any case, RFC 9110); else the 401.
    Bytes are compared in constant time, whatever the header holds."""
    if key is None or scope["path"] == "/health":
        return None
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), key.encode()):
        return ApiError("a valid API key is needed: 'Authorization: Bearer KEY'", status=401,
                        kind="authentication_error")
    return None


def guard(app, key, max_bytes, read_timeout_s):
    """ASGI middleware: refuse a request without the API key (401, before anything else is
    looked at: an unknown path, a body's size), then read the whole body before the app
    sees it, refusing one larger than max_bytes (413, declared or chunked, once the rest is read
    and dropped for up to LINGER_S) or slower than read_timeout_s (408). One whose body is
    still arriving when the server stops gets its 503 then (the same way), not uvicorn's
    plain-text 500 when the drain time runs out."""
    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        refusal = key_refusal(scope, key)
        if scope["state"]["connection"].reserved and scope["path"] not in ("/health", "/metrics"):
            refusal = ApiError("too many connections; retry later", status=503, kind="server_busy")
        if refusal:
            return await error_response(refusal, close=True)(scope, receive, send)
        connection = scope["state"]["connection"]
        declared = dict(scope["headers"]).get(b"content-length")  # h11 has already refused a malformed one
        body, more, deadline = b"", True, time.monotonic() + read_timeout_s
        too_large = declared is not None and int(declared) > max_bytes  # then not read at all
        while more and not too_large and not connection.stopping:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                e = ApiError(f"the request body did not arrive within {read_timeout_s} s", status=408)
                return await error_response(e, close=True)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more, too_large = message.get("more_body", False), len(body) > max_bytes
        if more or too_large:  # too large, or the server stopping: what is left is read and dropped for up to
            # LINGER_S first, so that the client (which would get a TCP reset for bytes it sends after the
            # close) reads the answer: nginx's lingering close
            linger_until = time.monotonic() + LINGER_S
            while more and time.monotonic() < linger_until:
                try:
                    message = await asyncio.wait_for(receive(), linger_until - time.monotonic())
                except asyncio.TimeoutError:
                    break
                if message["type"] == "http.disconnect":
                    return
                more = message.get("more_body", False)
            e = (ApiError(f"the request body is larger than this server's --max_body_bytes {max_bytes}", status=413)
                 if too_large else ApiError("the server is shutting down", status=503, kind="server_busy"))
            return await error_response(e, close=True)(scope, receive, send)
        replayed = False

        async def replay():  # the body once, then what the connection says next (a disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await app(scope, replay, send)
    return guarded


class Listener(socket.socket):
    """The listening socket, which hands asyncio a connection only while the process has
    a file for it (max_connections + RESERVED + LINGERING open at most). asyncio accepts every
    waiting connection (up to BACKLOG) at a wakeup before any protocol sees one; where accept()
    then fails for want of files, asyncio logs and schedules a retry for each failure of the
    burst, each of which arms the listener again: thousands of accepts and tracebacks a second
    (CPython's BaseSelectorEventLoop._accept_connection). So the limit is kept here, where a
    connection is accepted: one past it is answered 503 and closed at once."""

    def accept(self):
        while True:
            conn, address = super().accept()  # BlockingIOError once none wait: asyncio's burst ends
            if self.open < self.room:
                self.open += 1  # one less at its protocol's connection_lost
                return conn, address
            conn.setblocking(False)
            try:
                conn.send(BUSY)  # a fresh socket's empty buffer takes it whole
            except OSError:  # the client already left
                pass
            conn.close()


def listener(host, port, max_connections):
    """A Listener on host:port for max_connections (see connection_protocol)."""
    with socket.create_server((host, port), backlog=BACKLOG) as plain:
        sock = Listener(fileno=plain.detach())
    sock.room, sock.open = max_connections + RESERVED + LINGERING, 0
    segments_as_on_ethernet(sock)
    return sock


def connection_protocol(listener, max_connections, read_timeout_s, write_timeout_s):
    """uvicorn's HTTP/1.1 protocol (h11) with what it lacks for clients one cannot trust:
    - no Nagle delay: headers and body leave in two writes, and Nagle's algorithm would hold
      the second until the client ACKs the first, which it delays by 40 ms;
    - a fixed send buffer: the kernel would grow it to megabytes for a client that does not
      read: minutes of a stream's tokens (~250 bytes each) before its stall would show;
    - a connection limit at accept time: past max_connections (and RESERVED more for /health
      and /metrics, so that a liveness probe is answered when the server is busiest) a
      connection is answered 503 and closed. Closed as nginx's lingering close does: what
      its client sent is read and dropped until it closes, for LINGER_S at most (a close with
      unread bytes would be a TCP reset, and the client would lose the 503); LINGERING of them
      at once, and past those the listener refuses at once, so the process never runs out of
      files (Listener);
    - a request's headers must arrive within read_timeout_s of the connection being free
      for one (a new connection that sends nothing, a slowloris trickling headers);
    - a stream is written at its client's pace (`paced`), and a client must read some of its
      response within each write_timeout_s while it is behind (a stalled reader);
    - a complete request followed by a half-close (shutdown(SHUT_WR), `nc -N`) is answered,
      then the connection closes (asyncio would close it at the client's FIN); but a request
      that writes nothing until it is done (a completion not streamed) takes a half-close
      as its client leaving, as nginx and Go's net/http do: TCP cannot tell the two apart
      until the server writes, and a client that left must free its rows at once.
    A client over a deadline is cut off; uvicorn then tells its request that it hung up.

    What a client has read, the server sees only through its TCP window: the window's right
    edge (bytes acknowledged + the window advertised) moves on exactly as the client reads.
    But once a client's kernel holds more than half its buffer unread, Linux advertises a
    zero window until a sixteenth of its buffer is free (silly-window avoidance, RFC 1122),
    and the kernel grows that buffer to hundreds of KiB for a slow reader: a steady reader
    of a few KB/s then shows no progress for tens of seconds. So a stream is written only
    while its client holds less than half its largest window unread: its window never
    closes, and keepalive probes (every PROBE_S while nothing else is sent) fetch the
    window's edge, so every read shows within a second. Not always: a kernel that promised a
    window on memory it then spends on many small segments (ours: a token each) moves the
    edge again only once that memory is free, and Linux caps the window (rcv_ssthresh) below
    the room a client has. So when a client shows no read for write_timeout_s while the server
    holds its stream back and its window is open, the server writes into that window until it
    is full (`filling`; meanwhile its edge moves as its kernel packs small segments, read or
    not): from there every read shows; a client that then reads nothing for another
    write_timeout_s is cut off. A client being filled is watched until a read shows, even
    while nothing waits unsent: a kernel whose client reads nothing may go on taking a KiB
    at a time (Linux grows a buffer that small segments crowd, up to tcp_rmem's largest).
    What TCP cannot tell: a stream made more slowly than such a kernel takes it (many rows
    sharing the engine) never backs up, and its client looks like a reader until that
    buffer is full (32 MiB from Linux 6.16); --max_model_len bounds what it holds a row for.
    An edge carried on by the server's own bytes (the window the same) is not taken for a read."""
    lingering = set()

    class Connection(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.header_deadline = self.write_deadline = self.on_half_close = None
            self.half_closed, self.window, self.first_edge, self.refused = False, 0, 0, False
            self.filling = False  # written into its open window whatever its pace, until a read shows
            self.held = False  # the server holds events back for this client (its stream backed up: engine.backlog)
            self.stopping = False  # the server stops: a body still arriving is not waited for (guard)
            self.reserved = len(self.connections) > max_connections
            if len(self.connections) > max_connections + RESERVED:
                self.refuse()
                return
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            if hasattr(socket, "TCP_KEEPIDLE"):  # answered by the client's kernel, with its window
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, PROBE_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, PROBE_S)
            transport.set_write_buffer_limits(high=SEND_BUFFER)
            self.app_state = {**self.app_state, "connection": self}  # each request's scope["state"]
            self.expect_headers()

        def refuse(self):
            self.refused, self.dropped = True, 0
            self.transport.write(BUSY)
            if len(lingering) >= LINGERING:
                return self.transport.close()
            try:
                self.transport.write_eof()
            except OSError:  # its client left before it was accepted, and our 503 met its reset
                return self.transport.abort()
            lingering.add(self)
            self.header_deadline = self.loop.call_later(LINGER_S, self.transport.abort)

        def data_received(self, data):
            if not self.refused:
                return super().data_received(data)
            self.dropped += len(data)
            if self.dropped > LINGER_BYTES:
                self.transport.abort()

        def eof_received(self):
            if self.refused:
                return None  # its client has sent all it will: asyncio closes the connection
            if self.cycle is None or self.cycle.response_complete or self.cycle.more_body:
                return None  # no request, or half of one: asyncio closes the connection
            self.half_closed = True
            if self.on_half_close:  # a request that counts a half-close as its client leaving
                self.on_half_close()
                return None
            self.cycle.keep_alive = False  # answer, then close
            return True

        def shutdown(self):
            """(uvicorn, as the server stops) A request still sending its body is woken to be
            answered 503 (guard); the rest is as uvicorn does: an idle connection closes, a
            request's response is the connection's last."""
            self.stopping = True
            if self.cycle is not None and self.cycle.more_body:
                self.cycle.message_event.set()  # its receive() returns what came, with more_body still set
            super().shutdown()

        def expect_headers(self):
            self.header_deadline = self.loop.call_later(read_timeout_s, self.headers_overdue)

        def headers_overdue(self):
            if self.cycle is None or self.cycle.response_complete:  # still no whole request
                self.transport.abort()

        def on_response_complete(self):
            super().on_response_complete()
            self.header_deadline.cancel()
            if self.reserved:  # it answered a probe; the next probe takes a connection anew
                self.transport.close()
            self.expect_headers()

        def pause_writing(self):
            super().pause_writing()
            self.watch_writes()

        def behind(self):
            """Whether the client has more of its response unread than UNREAD_BYTES or an eighth
            of its receive window, whichever is larger, or than half of it: what this process
            and its kernel hold (sent or not), and what fills the client's window (its largest
            window less the one it advertises now).
            The largest window is taken only once the window's edge has moved past where it
            stood when data began to flow: a kernel's first windows assume less memory per
            byte than our segments then take, and an edge once advertised never moves back,
            so until then the windows say nothing of what the client holds. Until then, and
            where the kernel does not tell the window, and while its window is being filled
            (check_writes): whether any of the response waits unsent."""
            window = peer_window(self.transport)
            if window is not None and window[0] > 4 * ETHERNET_MSS:  # data has flowed: a few segments
                edge = window[0] + window[1]
                self.first_edge = self.first_edge or edge
                if edge > self.first_edge + ETHERNET_MSS:
                    self.window = max(self.window, window[1])
            if not self.window or self.filling or window is None:  # (None: also once it is closed)
                return self.transport.get_write_buffer_size() + queued(self.transport, SIOCOUTQNSD) > 0
            unread = self.transport.get_write_buffer_size() + queued(self.transport, SIOCOUTQ) + self.window - window[1]
            return unread > min(self.window // 2, max(UNREAD_BYTES, self.window // 8))

        async def paced(self):
            """(a stream, before each write) Wait while the client is behind; meanwhile it
            must read something within each write_timeout_s."""
            while not self.transport.is_closing() and self.behind():
                self.watch_writes()
                await asyncio.sleep(LAG_CHECK_S)

        def watch_writes(self):
            """While the client is behind, or its events are held back, cut it off once it has
            read nothing for write_timeout_s: the right edge of its window has not moved, as its
            kernel said after that time (a probe asks within PROBE_S; PROBE_S past it at most);
            where the kernel does not say the window: nothing acknowledged while the buffers stay full.
            When that happens while the server holds the stream back and the window is open, its
            reads may not have shown: the window is filled first, and the deadline starts again."""
            if self.write_deadline is None:
                self.seen = bytes_taken(self.transport)[:2]  # (the edge, the window) as last looked at
                self.taken, self.taken_at = self.seen[0], self.loop.time()  # the edge at the last read, when
                self.write_deadline = self.loop.call_later(LAG_CHECK_S, self.check_writes)

        def check_writes(self):
            self.write_deadline = None
            if self.transport.is_closing():
                return
            (edge, advertised, heard_s_ago), now = bytes_taken(self.transport), self.loop.time()
            if edge is not None:
                if advertised is not None and advertised == self.seen[1]:
                    self.taken += edge - self.seen[0]  # an edge carried on by our own bytes: the window at its cap
                self.seen = edge, advertised
                if self.filling and advertised >= ETHERNET_MSS:  # the deadline starts once the window is full
                    self.taken, self.taken_at = edge, now
                elif edge - self.taken >= (ETHERNET_MSS if advertised is not None else 1):  # the window's rounding aside
                    self.taken, self.taken_at, self.filling = edge, now, False  # a read
            overdue = now - self.taken_at - write_timeout_s  # seconds past the deadline
            if overdue >= 0 and (heard_s_ago is None or heard_s_ago <= overdue or overdue >= PROBE_S):
                # bytes its window would not take (sent and not yet acknowledged is no sign: a
                # delayed ACK holds an event's bytes there for up to 40 ms after each write)
                unsent = self.transport.get_write_buffer_size() + queued(self.transport, SIOCOUTQNSD)
                if self.filling or advertised is None or unsent or advertised < ETHERNET_MSS:
                    return self.reset()
                self.filling, self.taken_at = True, now
            if self.filling or self.flow.write_paused or self.held or self.behind():  # filling: until a read shows
                self.write_deadline = self.loop.call_later(LAG_CHECK_S, self.check_writes)

        def reset(self):
            """Cut the connection off with a TCP reset: a plain close would queue a FIN behind
            the bytes the client is not reading, and the kernel would keep trying to send them."""
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
            self.transport.abort()

        def connection_lost(self, exc):
            listener.open -= 1
            lingering.discard(self)
            for deadline in (self.header_deadline, self.write_deadline):
                if deadline:
                    deadline.cancel()
            super().connection_lost(exc)
    return Connection


def segments_as_on_ethernet(listener):
    """Segments of at most ETHERNET_MSS bytes on every connection the listener accepts, also
    over loopback (whose 64 KiB segments would make a client's kernel free its buffer, and
    so move its window, only in 64 KiB steps: a slow reader would look stalled for seconds)."""
    if hasattr(socket, "TCP_MAXSEG"):
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, ETHERNET_MSS)


def live_socket(transport):
    sock = transport.get_extra_info("socket")
    return sock if sys.platform.startswith("linux") and sock is not None and sock.fileno() >= 0 else None


def tcp_info(transport):
    sock = live_socket(transport)
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256) if sock else b""


def peer_window(transport):
    """(bytes of response the client's kernel acknowledged, the receive window it advertised
    last), from Linux's tcp_info; None elsewhere, or on a kernel before 5.4."""
    info = tcp_info(transport)
    if len(info) < TCPI_SND_WND + 4:
        return None
    return struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0], struct.unpack_from("I", info, TCPI_SND_WND)[0]


def bytes_taken(transport):
    """(how far the client has read, the window it advertised, seconds since its kernel last
    said so): the right edge of its receive window, which moves on as the client reads; on
    kernels that do not tell the window, the bytes its kernel acknowledged, None and None;
    (None, None, None) without tcp_info."""
    info = tcp_info(transport)
    if len(info) >= TCPI_SND_WND + 4:
        acked, window = struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0], struct.unpack_from("I", info, TCPI_SND_WND)[0]
        return acked + window, window, struct.unpack_from("I", info, TCPI_LAST_ACK_RECV)[0] / 1000
    return (struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0] if len(info) >= TCPI_BYTES_ACKED + 8 else None), None, None


def queued(transport, request):
    """The bytes of a socket's send queue an ioctl counts (SIOCOUTQ: not yet acknowledged,
    SIOCOUTQNSD: not yet sent); 0 where there is no such ioctl."""
    sock = live_socket(transport)
    if sock is None or fcntl is None:
        return 0
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, bytes(4)))[0]


def enough_files(max_connections):
    """Raise this process's open-file limit to what max_connections needs (a socket each, one
    more for each RESERVED and LINGERING connection, and some to spare for the checkpoints and
    the listener), or say which flag to lower."""
    if resource is None:  # Windows: no such limit to raise
        return
    need = max_connections + RESERVED + LINGERING + FILES_TO_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            most = hard - (need - max_connections)
            raise ValueError(f"--max_connections {max_connections} needs {need} open files and this process may "
                             f"open {hard} (ulimit -n): lower --max_connections to {most} or less")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class Server(uvicorn.Server):
    """uvicorn's server, which first ends the engine's requests when asked to stop, so that
    their connections can close within the drain time."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None):
        end_all(self.engine, "the server is shutting down")
        await super().shutdown(sockets)


