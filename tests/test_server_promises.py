"""The promises issue #57 found the server breaking, each as a test that failed before: a
steady slow reader was cut off, a prefix cache the OS refused killed the engine silently,
a long stop string slowed every stream, resumed slow readers went ahead of new requests,
the running gauge counted finished requests, and errors quoted whatever a client sent."""
import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from kernels import rowwise
from serving import openai_api, prefix_cache, scheduler, server
from test_server_limits import error_of, exchange, request, wait_until
from test_server_pauses import completion_text, dechunked

WRITE_TIMEOUT_S = 4.0
BODY = {"prompt": "A steady slow consumer", "max_tokens": 2000, "seed": 3, "temperature": 0.9, "ignore_eos": True}
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="what a client read is told by Linux's socket")


def start(models_dir, *flags):
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--port", "0",
                              "--max_model_len", "10000000", *flags])
    return server.start(args)


@pytest.fixture(scope="module")
def paced(models_dir):
    httpd, engine = start(models_dir, "--max_batch", "2", "--write_timeout_s", str(WRITE_TIMEOUT_S))
    yield httpd, engine
    server.stop(httpd, engine)


def big_buffer_stream(httpd, body, read_s, bytes_per_read, every_s=0.05):
    """A stream read by a client with a 256 KiB receive buffer: bytes_per_read every every_s
    for read_s seconds, then as fast as it comes. Returns (its texts, "done" or "reset", the
    seconds until it ended)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", httpd.address[1]))
    sock.sendall(request({**body, "stream": True}, headers=""))
    got, started = b"", time.monotonic()
    try:
        while time.monotonic() - started < read_s:
            got += sock.recv(bytes_per_read) if bytes_per_read else b""
            time.sleep(every_s)
        while part := sock.recv(65536):
            got += part
        ended = "done"
    except ConnectionResetError:
        ended = "reset"
    finally:
        sock.close()
    seconds = time.monotonic() - started
    if ended == "reset":
        return None, ended, seconds
    lines = dechunked(got).split(b"\n")
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith(b"data: {")]
    return texts, ("done" if b"data: [DONE]" in lines else "no [DONE]"), seconds


@LINUX
def test_a_steady_reader_with_a_large_buffer_gets_its_whole_stream(models_dir):
    """5 KB/s for 25 s, --write_timeout_s 10 (the default): the server before filled the
    client's large buffer, whose window then stayed closed for longer than the timeout while
    it read, and cut it off."""
    httpd, engine = start(models_dir, "--max_batch", "2", "--write_timeout_s", "10")
    try:
        alone = completion_text(httpd, BODY)
        texts, ended, _ = big_buffer_stream(httpd, BODY, 25, 256)
        assert ended == "done" and "".join(texts) == alone
    finally:
        server.stop(httpd, engine)


@LINUX
@pytest.mark.parametrize("rcvbuf", [256 * 1024, None])
def test_a_reader_that_stops_is_still_cut_off_within_twice_the_timeout(paced, rcvbuf):
    """A client that reads nothing (its large buffer takes what it can) is cut off: after
    --write_timeout_s without a read its window is filled (a slow reader's reads may not show
    before), then after another, as its kernel says within a probe (PROBE_S). With the
    kernel's own buffer (None), Linux goes on taking a KiB at a time from a client that reads
    nothing (it grows a buffer that small segments crowd, up to tcp_rmem's largest: 32 MiB
    from Linux 6.16): while its window was being filled, the watch on it ended whenever
    nothing waited unsent and began again from zero, so it was never cut off."""
    httpd, engine = paced
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", httpd.address[1]))
    sock.sendall(request({**BODY, "max_tokens": 10 ** 6, "stream": True}, headers=""))  # more than its buffer takes
    assert wait_until(lambda: engine["running"], 10)
    port = sock.getsockname()[1]
    connection = next(c for c in httpd.server_state.connections if c.transport.get_extra_info("peername")[1] == port)
    # the first timeout starts once its kernel has taken what it takes and it falls behind (seconds of the stream)
    assert wait_until(lambda: connection.write_deadline is not None, 6 * WRITE_TIMEOUT_S)
    started = time.monotonic()
    assert wait_until(lambda: not httpd.server_state.connections, 6 * WRITE_TIMEOUT_S)
    # twice the timeout, the probes that confirm each, and the engine's time to fill its window (~2 s here)
    assert 2 * WRITE_TIMEOUT_S <= time.monotonic() - started < 4 * WRITE_TIMEOUT_S
    with pytest.raises(ConnectionResetError):
        while sock.recv(65536):
            pass
    sock.close()
    assert wait_until(lambda: not engine["outboxes"] and not engine["paused"] and not engine["running"], 10)


def test_a_prefix_cache_larger_than_the_machine_is_refused_in_one_line(models_dir):
    mib = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20) + 1024
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "server.py"), "--models_dir", models_dir,
                           "--target_model_size", "124M", "--port", "0", "--prefix_cache_mib", str(mib)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--prefix_cache_mib" in proc.stderr


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="the NumPy fallback stores nothing in the prefix cache "
                    "(its keys differ by pass), so it never asks the OS for the pool")
def test_a_prefix_cache_the_os_refuses_is_turned_off_and_every_request_answered(models_dir, monkeypatch):
    """The server before lost its engine thread to mmap's ENOMEM: every request hung while
    /health said ok."""
    def refused(shape, dtype):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(prefix_cache, "in_large_pages", refused)
    httpd, engine = start(models_dir, "--max_batch", "2")
    try:
        for k in range(3):
            status, got = exchange(httpd, request({"prompt": list(range(100, 140)), "max_tokens": 5, "seed": k},
                                                  headers=""), timeout=30)
            assert status == 200
        metrics = exchange(httpd, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")[1].decode()
        assert "gpt2_prefix_cache_budget_bytes 0\n" in metrics and engine["prefix_cache"]["refused"]
    finally:
        server.stop(httpd, engine)


FAILING_ENGINE = """
import sys
sys.path.insert(0, {root!r})
import batching
from serving import server
step = batching.autoregressive_step
def failing(batch, model):
    if any(len(seq.generated) >= 3 for seq in batch.seqs):
        raise RuntimeError("a bug in the step")
    return step(batch, model)
batching.autoregressive_step = failing
sys.exit(server.entry(["--models_dir", {models!r}, "--target_model_size", "124M", "--port", "0"]))
"""


def test_an_engine_that_fails_answers_every_request_then_the_process_exits_non_zero(models_dir):
    proc = subprocess.Popen([sys.executable, "-c", FAILING_ENGINE.format(root=ROOT, models=models_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split(" at http://127.0.0.1:")[1].split("/")[0])
        httpd = type("Address", (), {"address": ("127.0.0.1", port)})
        status, got = exchange(httpd, request({"prompt": "x", "max_tokens": 20}, headers=""), timeout=30)
        assert status == 500 and "a bug in the step" in error_of(got)["message"]
        status, got = exchange(httpd, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status in (503, None)  # 503 until it has stopped listening
        assert proc.wait(30) == 1
        assert "error: the engine stopped: RuntimeError: a bug in the step" in proc.stderr.read()
    finally:
        proc.kill()


def test_a_stop_string_past_the_limit_is_400_and_one_at_it_works(paced):
    httpd, _ = paced
    too_long = "x" * (openai_api.MAX_STOP_CHARS + 1)
    status, got = exchange(httpd, request({"prompt": "x", "max_tokens": 3, "stop": [too_long]}, headers=""))
    assert status == 400 and error_of(got)["param"] == "stop" and len(error_of(got)["message"]) < 300
    longest = {"prompt": "x", "max_tokens": 50, "stop": ["x" * openai_api.MAX_STOP_CHARS] * 4, "seed": 1,
               "stream": True}
    status, got = exchange(httpd, request(longest, headers=""), timeout=30)
    assert status == 200 and b"data: [DONE]" in got


def test_ready_text_holds_back_exactly_the_tails_that_may_become_a_stop_string():
    """Each event's new text against a brute force over every position: what is sent never
    reaches where a stop string will start, and all before the earliest possible start is sent."""
    rng = random.Random(0)
    for _ in range(3000):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        full = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        choice, sent = {"text": "", "sent": 0, "finish_reason": None, "generated_from": 0}, ""
        for i in range(1, len(full) + 1):
            if any(s in full[:i] for s in stop):
                break
            choice["text"] = full[:i]
            sent += openai_api.ready_text(choice, stop)
            may_start = [p for s in stop for p in range(max(0, i - len(s) + 1), i) if s.startswith(full[p:i])]
            assert sent == full[:min(may_start + [i])]


def test_a_stream_lets_go_of_the_logprobs_it_has_sent(tiny):
    """A streamed choice's logprobs, a KB a token with n_top of them, were kept to the
    stream's end (a hostile client's long stream with n = 8 and logprobs = 5). Streamed
    a chunk a token, what was sent adds up to the whole, and nothing sent is held."""
    encoder = tiny[0]
    how = {"stop": [], "eos": encoder.eot_token, "logprobs": 2, "echo": False}
    tokens = encoder.encode(" the stream lets go of what it has sent")
    streamed, whole = openai_api.new_choice(0, [1], encoder, how), openai_api.new_choice(0, [1], encoder, how)
    sent = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, token in enumerate(tokens):
        for choice in (streamed, whole):
            openai_api.grow(choice, scheduler.Event("token", 0, token=token), encoder, how, (-0.5 * i, [(token, -0.5)]))
        for key, values in openai_api.new_logprobs(streamed).items():
            sent[key] += values
        assert not any(streamed["logprobs"].values())
    assert sent == openai_api.new_logprobs(whole) and len(sent["tokens"]) == len(tokens)


def test_a_piece_of_a_character_is_its_bytes_in_logprobs_as_openai_writes_it(tiny):
    """GPT-2 writes " it’s" as " it", e2 80, 99, "s": each piece of '’' decoded alone was
    '\ufffd', so a token's text said nothing of which it was, and two pieces among a
    position's top_logprobs were one key (a top 3 came back with 2). OpenAI writes such a
    token 'bytes:\\xe2\\x80'; the text itself is whole once its last piece comes."""
    encoder = tiny[0]
    tokens = encoder.encode(" it\u2019s")
    how = {"stop": [], "eos": encoder.eot_token, "logprobs": 3, "echo": False}
    choice = openai_api.new_choice(0, [1], encoder, how)
    for token in tokens:
        top = [(tokens[1], -0.5), (tokens[2], -1.0), (tokens[3], -2.0)]
        openai_api.grow(choice, scheduler.Event("token", 0, token=token), encoder, how, (-1.0, top))
    lp = openai_api.new_logprobs(choice)
    assert lp["tokens"] == [" it", "bytes:\\xe2\\x80", "bytes:\\x99", "s"] and choice["text"] == " it\u2019s"
    assert lp["top_logprobs"][0] == {"bytes:\\xe2\\x80": -0.5, "bytes:\\x99": -1.0, "s": -2.0}
    assert lp["text_offset"] == [0, 3, 3, 4]


def test_an_error_quotes_at_most_a_few_hundred_characters_of_what_was_sent(paced):
    httpd, _ = paced
    status, got = exchange(httpd, request({"model": "m" * 100_000, "prompt": "x"}, headers=""))
    assert status == 404 and len(error_of(got)["message"]) < 400
    status, got = exchange(httpd, f"GET /{'p' * 30_000} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status == 404 and len(error_of(got)["message"]) < 400
    status, got = exchange(httpd, request({"prompt": "x", "k" * 5000: 1}, headers=""))  # a field of its own
    error = error_of(got)
    assert status == 400 and len(error["message"]) < 400 and len(error["param"]) < 400 and len(got) < 2000


def test_the_choices_seeds_wrap_at_2_to_the_64(paced):
    """Choice i samples with (seed + i) mod 2^64, a seed a request may send itself."""
    httpd, _ = paced
    body = {"prompt": "x", "max_tokens": 6, "temperature": 1.0}
    texts = [[c["text"] for c in json.loads(exchange(httpd, request(sent, headers=""))[1].split(b"\r\n\r\n", 1)[1])
              ["choices"]] for sent in ({**body, "n": 2, "seed": 2 ** 64 - 1}, {**body, "seed": 0})]
    assert texts[0][1] == texts[1][0] and len(texts[0]) == 2
