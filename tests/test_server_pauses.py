"""server.py and clients that pause, count connections, or half-close (issue #46): each
test reproduces a defect of the server before it (a 3 s pause cancelled a stream,
--max_connections N served N-1, a half-closed request got no answer) and fails there."""
import http.client
import json
import sys
import threading
import time

import pytest

from serving import server, sockets
from test_server_limits import connect, error_of, exchange, request, wait_until

WRITE_TIMEOUT_S = 2.0
BODY = {"prompt": "Alan Turing", "max_tokens": 3000, "seed": 1, "temperature": 0.9, "ignore_eos": True}


def start(models_dir, *flags):
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--port", "0",
                              "--max_model_len", "10000000", *flags])
    return server.start(args)


@pytest.fixture(scope="module", params=["autoregressive", "speculative"])
def one_row(request, models_dir):
    """A server of one row per decoder, its write timeout short enough to reach in a test."""
    httpd, engine = start(models_dir, "--mode", request.param, "--draft_model_size", "355M", "--K", "3",
                          "--max_batch", "1", "--write_timeout_s", str(WRITE_TIMEOUT_S))
    yield httpd, engine
    server.stop(httpd, engine)


def completion_text(httpd, body):
    status, got = exchange(httpd, request(body, headers=""), timeout=60)
    assert status == 200
    return json.loads(got.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]


def pausing_stream(httpd, body, pause_s, events_before=5, during_pause=None):
    """A stream read over a slow link (a 2 KiB receive window) by a client that takes
    events_before events, pauses pause_s seconds (calling during_pause, if given, at its
    start), then reads on. Returns (its text, how it ended: "done", "error: ..." or "reset")."""
    conn = http.client.HTTPConnection("127.0.0.1", httpd.address[1], timeout=60)
    conn.sock = connect(httpd, rcvbuf=2048)
    conn.sock.settimeout(60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response, texts, n = conn.getresponse(), [], 0
    try:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                return "".join(texts), "done"
            event = json.loads(line[6:])
            if "error" in event:
                return "".join(texts), "error: " + event["error"]["message"]
            texts.append(event["choices"][0]["text"])
            n += 1
            if n == events_before:
                if during_pause:
                    during_pause()
                time.sleep(pause_s)
    except (ConnectionResetError, http.client.IncompleteRead):
        return "".join(texts), "reset"
    finally:
        conn.close()
    return "".join(texts), "closed without [DONE]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lag and progress are told by Linux's socket")
@pytest.mark.parametrize("full", [False, True], ids=["idle", "full"])
@pytest.mark.parametrize("pause", [0.7, 1.75], ids=["under", "over"])
def test_a_pause_under_the_write_timeout_keeps_the_text_and_one_over_it_is_cut_off(one_row, full, pause):
    """A reader pauses 0.7x or 1.75x --write_timeout_s: under, it gets its whole text, the
    text it gets alone; over, its connection is reset and its row freed. Idle: nobody
    waits for the row; full: a request arrives during the pause and is answered meanwhile
    (the stream is paused for it). The server before cancelled every pause over 1 s."""
    httpd, engine = one_row
    alone = completion_text(httpd, BODY)
    other = {}

    def ask_another():  # a request that needs the stream's only row
        def ask():
            other["text"] = completion_text(httpd, {"prompt": "y", "max_tokens": 3, "seed": 2})
        other["thread"] = threading.Thread(target=ask)
        other["thread"].start()
    preemptions = engine["metrics"]["num_preemptions_total"]
    text, ended = pausing_stream(httpd, BODY, pause * WRITE_TIMEOUT_S, during_pause=ask_another if full else None)
    if pause < 1:
        assert ended == "done" and text == alone
    else:
        assert ended == "reset" and alone.startswith(text) and len(text) < len(alone)
    if full:
        other["thread"].join(60)
        assert len(other["text"]) > 0 and engine["metrics"]["num_preemptions_total"] > preemptions
    assert wait_until(lambda: not engine["outboxes"] and not engine["paused"] and not engine["running"], 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lag and progress are told by Linux's socket")
def test_a_reader_that_keeps_taking_a_little_is_never_cut_off(one_row):
    """Progress is what the client takes, not whether the buffers drain: a reader that takes
    1 KiB every 0.5 s for 2.5x --write_timeout_s (its buffers full all along) keeps its
    stream, then reads on to its whole text."""
    httpd, engine = one_row
    alone = completion_text(httpd, BODY)
    sock = connect(httpd, rcvbuf=2048)
    sock.sendall(request({**BODY, "stream": True}, headers=""))
    got, slow_until = b"", time.monotonic() + 2.5 * WRITE_TIMEOUT_S
    while time.monotonic() < slow_until:
        got += sock.recv(1024)
        time.sleep(0.5)
    while part := sock.recv(65536):
        got += part
    sock.close()
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in dechunked(got).split(b"\n")
             if line.startswith(b"data: {")]
    assert "".join(texts) == alone


def dechunked(response):
    """The body of an HTTP/1.1 response in chunked transfer coding."""
    rest, body = response.split(b"\r\n\r\n", 1)[1], b""
    while rest:
        size, rest = rest.split(b"\r\n", 1)
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]
    return body


def test_max_connections_n_serves_n_then_only_probes_then_refuses_without_a_reset(models_dir):
    """--max_connections 2: two open connections are both served, idle or busy with a
    stream; past them a liveness probe is still answered (/health, /metrics) and a
    completion gets 503 with OpenAI's envelope; past RESERVED more, a connection is refused
    with the 503 whole, however much its client sent first (issue #57: the server before
    refused /health at the limit, and reset 20 of 20 clients that had sent a request)."""
    httpd, engine = start(models_dir, "--max_connections", "2", "--max_batch", "2")
    try:
        first, second = (http.client.HTTPConnection("127.0.0.1", httpd.address[1], timeout=30) for _ in range(2))
        for conn in (first, second):  # both open, idle, kept alive
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}
        for path in ("/health", "/metrics"):
            status, got = exchange(httpd, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 200, got
        status, got = exchange(httpd, request({"prompt": "z", "max_tokens": 3}, headers=""))
        assert status == 503 and error_of(got)["type"] == "server_busy"
        held = [connect(httpd) for _ in range(sockets.RESERVED)]  # half a request each: they stay open
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert wait_until(lambda: len(httpd.server_state.connections) == 2 + sockets.RESERVED, 10)
        for size in (0, 1000, 30000):
            got, reset = refused_exchange(httpd, request({"prompt": "z" * size, "max_tokens": 3}, headers=""))
            assert not reset and got.startswith(b"HTTP/1.1 503") and error_of(got)["type"] == "server_busy"
        for sock in held:
            sock.close()
        first.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 10 ** 5, "ignore_eos": True,
                                                             "stream": True}))  # busy with a stream
        assert wait_until(lambda: engine["running"], 10)
        second.request("POST", "/v1/completions", json.dumps({"prompt": "y", "max_tokens": 3}))
        response = second.getresponse()
        assert response.status == 200 and json.loads(response.read())["choices"]
        first.close()
        second.close()
        assert wait_until(lambda: len(httpd.server_state.connections) == 0, 10)
        status, _ = exchange(httpd, request({"prompt": "z", "max_tokens": 3}, headers=""))
        assert status == 200
    finally:
        server.stop(httpd, engine)


def refused_exchange(httpd, data):
    """Send a whole request, then read to the end: (what came, whether the connection was reset)."""
    sock = connect(httpd)
    got = b""
    try:
        sock.sendall(data)
        while part := sock.recv(65536):
            got += part
        return got, False
    except (ConnectionResetError, BrokenPipeError):
        return got, True
    finally:
        sock.close()


@pytest.fixture(scope="module")
def keyed(models_dir):
    httpd, engine = start(models_dir, "--api_key", "sesame", "--max_body_bytes", "65536")
    yield httpd, engine
    server.stop(httpd, engine)


def half_closed(httpd, data):
    """Send a whole request, shut our side for writing (nc -N), read what comes back."""
    return exchange(httpd, data, half_close=True)[1]


AUTH = "Authorization: Bearer sesame\r\n"


@pytest.mark.parametrize("data, ends", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b'{"status":"ok"}'),
    (request({"prompt": "x", "max_tokens": 5}, path="/v1/models", method="GET", headers=AUTH), b'"gpt2"'),
    (request({"prompt": "x", "max_tokens": 5, "stream": True}, headers=AUTH), b"data: [DONE]\n\n"),
], ids=["GET", "GET with a body", "stream"])
def test_a_request_followed_by_a_half_close_is_answered(keyed, data, ends):
    """The server before read the client's FIN as a hang-up and closed with no answer."""
    got = half_closed(keyed[0], data.replace(b"Connection: close\r\n", b""))
    assert got.startswith(b"HTTP/1.1 200") and ends in got


def test_a_completion_not_streamed_takes_a_half_close_as_its_client_leaving(keyed):
    """TCP cannot tell a half-close from a close until the server writes, and a completion
    not streamed writes nothing until it is done: its rows are freed at once (as for a
    client that closes), as serving/sockets.py says."""
    httpd, engine = keyed
    got = half_closed(httpd, request({"prompt": "x", "max_tokens": 10 ** 5, "ignore_eos": True}, headers=AUTH))
    assert got == b"", got
    assert wait_until(lambda: not engine["running"] and not engine["outboxes"], 10)


def test_half_a_request_then_a_half_close_is_closed(keyed):
    got = half_closed(keyed[0], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH.encode() +
                      b"Content-Length: 100\r\n\r\n{")
    assert not got.startswith(b"HTTP/1.1 200")


def test_head_on_health_is_200_without_a_body(keyed):
    sock = connect(keyed[0])
    sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got = b""
    while part := sock.recv(65536):
        got += part
    sock.close()
    head, body = got.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and body == b""


@pytest.mark.parametrize("data", [
    b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{",
    request({"prompt": "x"}, headers=""),
], ids=["unknown path", "oversized body", "good body"])
def test_without_the_key_every_request_is_401_first(keyed, data):
    status, got = exchange(keyed[0], data)
    assert status == 401 and error_of(got)["type"] == "authentication_error"


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\ud800x", rb"\udc00", rb"x\udfff"])
def test_a_lone_surrogate_escape_is_named(keyed, escape):
    status, got = exchange(keyed[0], request(b'{"prompt": "' + escape + b'"}', headers=AUTH))
    assert status == 400 and "surrogate pair without its other half" in error_of(got)["message"]


def test_a_surrogate_pair_is_text(keyed):
    status, got = exchange(keyed[0], request(rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}', headers=AUTH))
    assert status == 200
