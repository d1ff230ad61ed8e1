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
    import resource
except ImportError:  # Windows
    resource = None
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.engine import LAG_CHECK_S, end_all, unsent_bytes
from serving.openai_api import ApiError

TCPI_BYTES_ACKED = 120  # where Linux's struct tcp_info keeps the bytes the peer has acknowledged (u64)
SEND_BUFFER = 16 * 1024  # bytes of response asyncio, and twice that the kernel, hold for a client not reading
FILES_TO_SPARE = 64  # open files besides the connections: the listener, checkpoints, pipes, numba's cache
BUSY_BODY = b'{"error": {"message": "too many connections; retry later", "type": "server_busy", "param": null, "code": 503}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY))


def envelope(e):
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def error_response(e, close=False):
    return JSONResponse(envelope(e), status_code=e.status, headers={"Connection": "close"} if close else None)


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
    sees it, refusing one larger than max_bytes (413, declared or chunked) or slower than
    read_timeout_s (408)."""
    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        refusal = key_refusal(scope, key)
        if refusal:
            return await error_response(refusal, close=True)(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")  # h11 has already refused a malformed one
        body, more, deadline = b"", True, time.monotonic() + read_timeout_s
        too_large = declared is not None and int(declared) > max_bytes  # then not read at all
        while more and not too_large:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                e = ApiError(f"the request body did not arrive within {read_timeout_s} s", status=408)
                return await error_response(e, close=True)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more, too_large = message.get("more_body", False), len(body) > max_bytes
        if too_large:
            e = ApiError(f"the request body is larger than this server's --max_body_bytes {max_bytes}", status=413)
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


def connection_protocol(max_connections, read_timeout_s, write_timeout_s):
    """uvicorn's HTTP/1.1 protocol (h11) with what it lacks for clients one cannot trust:
    - no Nagle delay: headers and body leave in two writes, and Nagle's algorithm would hold
      the second until the client ACKs the first, which it delays by 40 ms;
    - a fixed send buffer: the kernel would grow it to megabytes for a client that does not
      read: minutes of a stream's tokens (~250 bytes each) before its stall would show;
    - a connection limit at accept time: past max_connections a connection is answered 503
      and closed at once, so the process never runs out of files (where asyncio's accept
      loop would spin, logging);
    - a request's headers must arrive within read_timeout_s of the connection being free
      for one (a new connection that sends nothing, a slowloris trickling headers);
    - a client must take some of its response within each write_timeout_s while the socket's
      buffers are full (a stalled reader), as the kernel counts what it acknowledged;
    - a complete request followed by a half-close (shutdown(SHUT_WR), `nc -N`) is answered,
      then the connection closes (asyncio would close it at the client's FIN); but a request
      that writes nothing until it is done (a completion not streamed) takes a half-close
      as its client leaving, as nginx and Go's net/http do: TCP cannot tell the two apart
      until the server writes, and a client that left must free its rows at once.
    A client over a deadline is cut off; uvicorn then tells its request that it hung up."""
    class Connection(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.header_deadline = self.write_deadline = self.on_half_close = None
            self.half_closed = False
            if len(self.connections) > max_connections:
                transport.write(BUSY)
                transport.close()
                return
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            transport.set_write_buffer_limits(high=SEND_BUFFER)
            self.app_state = {**self.app_state, "connection": self}  # each request's scope["state"]
            self.expect_headers()

        def expect_headers(self):
            self.header_deadline = self.loop.call_later(read_timeout_s, self.headers_overdue)

        def headers_overdue(self):
            if self.cycle is None or self.cycle.response_complete:  # still no whole request
                self.transport.abort()

        def on_response_complete(self):
            super().on_response_complete()
            self.header_deadline.cancel()
            self.expect_headers()

        def eof_received(self):
            if self.cycle is None or self.cycle.response_complete or self.cycle.more_body:
                return None  # no request, or half of one: asyncio closes the connection
            self.half_closed = True
            if self.on_half_close:  # a request that counts a half-close as its client leaving
                self.on_half_close()
                return None
            self.cycle.keep_alive = False  # answer, then close
            return True

        def pause_writing(self):
            super().pause_writing()
            self.watch_writes()

        def watch_writes(self):
            """While some of the response waits (in asyncio's buffer or the kernel's), cut the
            client off once it has taken nothing for write_timeout_s (where the kernel does not
            say what it took: once its buffers stay full that long)."""
            if self.write_deadline is None:
                self.taken, self.taken_at = bytes_taken(self.transport), self.loop.time()
                self.write_deadline = self.loop.call_later(LAG_CHECK_S, self.check_writes)

        def check_writes(self):
            self.write_deadline = None
            if self.transport.is_closing():
                return
            taken, now = bytes_taken(self.transport), self.loop.time()
            if taken != self.taken:
                self.taken, self.taken_at = taken, now
            if now - self.taken_at >= write_timeout_s:
                self.reset()
            elif self.flow.write_paused or unsent_bytes(self.transport) > 0:
                self.write_deadline = self.loop.call_later(LAG_CHECK_S, self.check_writes)

        def reset(self):
            """Cut the connection off with a TCP reset: a plain close would queue a FIN behind
            the bytes the client is not reading, and the kernel would keep trying to send them."""
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
            self.transport.abort()

        def connection_lost(self, exc):
            for deadline in (self.header_deadline, self.write_deadline):
                if deadline:
                    deadline.cancel()
            super().connection_lost(exc)
    return Connection


def bytes_taken(transport):
    """The bytes of response a connection's client has taken (its kernel acknowledged them;
    once its receive window is full, only reading opens it): Linux's tcp_info. None elsewhere."""
    sock = transport.get_extra_info("socket")
    if not sys.platform.startswith("linux") or sock is None or sock.fileno() < 0:
        return None
    return struct.unpack_from("Q", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), TCPI_BYTES_ACKED)[0]


def enough_files(max_connections):
    """Raise this process's open-file limit to what max_connections needs (a socket each, and
    some to spare for the checkpoints and the listener), or say which flag to lower."""
    if resource is None:  # Windows: no such limit to raise
        return
    need = max_connections + FILES_TO_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max_connections {max_connections} needs {need} open files and this process may "
                             f"open {hard} (ulimit -n): lower --max_connections to {hard - FILES_TO_SPARE} or less")
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


