"""server.py through the official `openai` client and raw HTTP, on 127.0.0.1 with the tiny
GPT-2: texts equal main.py's, streams add up to the whole text, stop strings never leak,
bad requests get OpenAI's error body, a client that leaves frees its rows."""
import gc
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import openai
import pytest

import gpt2
import main
from conftest import ROOT
from cli import flags
from kernels import rowwise
from serving import engine as engines, server

PROMPTS = ["Alan Turing theorized that", "The quick brown fox", "In a shocking finding, scientists"]


def start(models_dir, *flags):
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--port", "0", *flags])
    httpd, engine = server.start(args)
    return httpd, engine, f"http://127.0.0.1:{httpd.address[1]}"


@pytest.fixture(scope="module", params=["autoregressive", "speculative"])
def running(request, models_dir):
    """A server per decoder (the tiny model drafts for itself in speculative mode)."""
    httpd, engine, url = start(models_dir, "--mode", request.param, "--draft_model_size", "355M", "--K", "3",
                               "--max_model_len", "1000000")
    yield request.param, engine, url
    server.stop(httpd, engine)


def client(url, key="unused"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def post(url, path, body, headers=None):
    """(status, parsed JSON) of a raw POST."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body if isinstance(body, (bytes, str)) else json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def get(url, path):
    """(status, body text) of a raw GET."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read().decode()


def test_texts_are_what_main_prints_for_the_same_prompt_settings_and_seed(running, models_dir):
    mode, _, url = running
    want = main.run(main.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--draft_model_size",
                                     "355M", "--K", "3", "--mode", mode, "--n_tokens_to_generate", "12",
                                     "--temperature", "0.8", "--top_p", "0.9", "--seed", "5", "--ignore_eos",
                                     *[x for p in PROMPTS for x in ("--prompt", p)]]))[mode]["texts"]
    got = client(url).completions.create(model="gpt2", prompt=PROMPTS, max_tokens=12, temperature=0.8, top_p=0.9,
                                         seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2] and [c.text for c in got.choices] == want
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == 36 and got.usage.prompt_tokens == sum(len(main.tokenize(
        running[1]["encoder"], [p], 64)[0]) for p in PROMPTS)


def test_a_stream_adds_up_to_the_whole_text_and_ends_with_usage(running):
    _, _, url = running
    kw = dict(model="gpt2", prompt=PROMPTS[:2], max_tokens=10, n=2, seed=7, temperature=1.0)
    whole = client(url).completions.create(**kw)
    parts, usage = {}, None
    for chunk in client(url).completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c.text)
    assert {i: "".join(p) for i, p in parts.items()} == {c.index: c.text for c in whole.choices}
    assert sorted(parts) == [0, 1, 2, 3] and usage == whole.usage and usage.completion_tokens == 40
    again = client(url).completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]  # same seed, same choices
    assert whole.choices[0].text != whole.choices[1].text  # choice i samples from its own stream


def test_stop_strings_end_the_text_before_them_even_in_a_stream(running):
    _, _, url = running
    kw = dict(model="gpt2", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    full = client(url).completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]  # three characters from the middle
    cut = client(url).completions.create(**kw, stop=[stop, "never appears"]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client(url).completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut.text
    echoed = client(url).completions.create(**kw, echo=True).choices[0].text
    assert echoed == PROMPTS[0] + full


def test_logprobs_are_the_targets_own_and_stream_as_they_come(running, tiny):
    """logprobs: the log-softmax of the target's logits at each generated token (checked
    against an uncached forward pass over the whole text), with the 3 likeliest."""
    _, engine, url = running
    encoder, hparams, params = tiny
    kw = dict(model="gpt2", prompt=PROMPTS[1], max_tokens=6, seed=2, logprobs=3, extra_body={"ignore_eos": True})
    whole = client(url).completions.create(**kw).choices[0]
    prompt = encoder.encode(PROMPTS[1])
    ids = engine["encoder"].encode(whole.text)  # the tiny vocabulary round-trips its own text
    logits = gpt2.gpt2(np.array([prompt + ids]), **params, n_head=hparams["n_head"])[0].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))  # [T, n_vocab]
    want = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(ids)]
    assert len(ids) == 6 and np.allclose(whole.logprobs.token_logprobs, want, atol=1e-4)
    assert "".join(whole.logprobs.tokens) == whole.text and whole.logprobs.text_offset[0] == 0
    for i, top in enumerate(whole.logprobs.top_logprobs):
        best = np.sort(logp[len(prompt) - 1 + i])[::-1][:3]
        assert len(top) == 3 and np.allclose(sorted(top.values(), reverse=True), best, atol=1e-4)
    streamed = [c.choices[0].logprobs for c in client(url).completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert sum((lp.token_logprobs for lp in streamed), []) == whole.logprobs.token_logprobs


def test_each_text_is_its_solo_text_with_16_others_beside_it(running):
    _, _, url = running
    alone = [client(url).completions.create(model="gpt2", prompt=PROMPTS[i % 3], max_tokens=8, seed=i).choices[0].text
             for i in range(17)]
    got = [None] * 17

    def ask(i):
        got[i] = "".join(c.choices[0].text for c in client(url).completions.create(
            model="gpt2", prompt=PROMPTS[i % 3], max_tokens=8, seed=i, stream=True))
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(17)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def stream_raw(url, body, leave_after=None):
    """A streaming request over a raw socket: (the texts it got by choice, whether it saw [DONE]);
    leave_after=k hangs up after k events, as a client that goes away mid-stream."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    if response.status != 200:
        response.read()
        return response.status, None
    texts, n_events = {}, 0
    for line in response:
        if line.startswith(b"data: [DONE]"):
            return 200, texts
        if line.startswith(b"data: "):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            n_events += 1
            if n_events == leave_after:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                return "left", texts
    return "cut", texts


def test_load_64_streaming_clients_some_leaving_some_malformed(running):
    """64 streaming clients at once with the serving workload's spread of lengths, every 10th
    hanging up mid-stream, 8 malformed and 4 oversized requests among them: each finished
    text is its solo text, no request is lost or answered twice, no row leaks, and memory
    and threads stay flat."""
    _, engine, url = running
    rng = np.random.default_rng(0)
    bodies = [{"model": "gpt2", "prompt": [int(t) for t in rng.integers(0, 50000, rng.integers(4, 17))],
               "max_tokens": int(np.exp(rng.uniform(np.log(2), np.log(40)))), "seed": i, "ignore_eos": True}
              for i in range(64)]
    bad = [{"prompt": "x", "max_tokens": -1}, {"prompt": [], "seed": 1}, {"prompt": "x", "top_p": 5},
           {"prompt": "x", "model": "nope"}, {"prompt": "x", "n": 0}, {"prompt": "x", "stop": 7},
           {"prompt": [99999]}, {"prompt": "x", "temperature": None, "top_k": -5}]
    solo = [stream_raw(url, b)[1] for b in bodies]
    oversized = 4  # bodies declared past --max_body_bytes, their first bytes sent

    def round_of_load():
        results = [None] * (len(bodies) + len(bad) + oversized)

        def ask(k):
            if k < len(bodies):
                results[k] = stream_raw(url, bodies[k], leave_after=2 if k % 10 == 9 else None)
            elif k < len(bodies) + len(bad):
                results[k] = stream_raw(url, bad[k - len(bodies)])
            else:
                results[k] = too_large(url)
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        deadline = time.monotonic() + 10
        while (engine["running"] or engine["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return results

    tracemalloc.start()
    try:
        round_of_load()
        gc.collect()  # what garbage the collector has not reached yet is not kept memory
        before, threads = tracemalloc.get_traced_memory()[0], threading.active_count()
        results = round_of_load()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert threading.active_count() == threads  # no thread per connection, none left behind
    for k, (status, texts) in enumerate(results[:len(bodies)]):
        if k % 10 == 9:
            assert status == "left" and all(solo[k][0].startswith(t) for t in texts.values())
        else:
            assert status == 200 and texts == solo[k]
    assert all(status in (400, 404) for status, _ in results[len(bodies):len(bodies) + len(bad)])
    assert all(status == 413 for status, _ in results[len(bodies) + len(bad):])
    assert not engine["running"] and not engine["waiting"] and not engine["outboxes"]
    assert after - before < 1 << 20  # a second round leaves no more behind than the first


def too_large(url):
    """A body declared at 10 MB, its first bytes sent: (the status, None)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"x" * 4096)
        return int(sock.recv(100).split()[1]), None


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"), ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"), ({"prompt": "x", "n": 100}, 400, "n"),
    ({"prompt": 123}, 400, "prompt"), ({"prompt": [[]]}, 400, "prompt"), ({"prompt": [70000]}, 400, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"), ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "seed": -1}, 400, "seed"), ({"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": 2, "echo": True}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "model": "gpt2-xl"}, 404, "model"),
])
def test_bad_requests_get_openais_error_body(running, body, status, param):
    got_status, got = post(running[2], "/v1/completions", body)
    assert got_status == status and got["error"]["param"] == param and got["error"]["message"]


def test_bad_json_and_unknown_paths(running):
    url = running[2]
    assert post(url, "/v1/completions", b"{not json")[0] == 400
    assert post(url, "/v1/chat/completions", {"prompt": "x"})[0] == 404
    # a slash at the end: a 307 whose Location took the Host header's name, empty, not OpenAI's envelope
    status, got = post(url, "/v1/completions/", {"prompt": "x"}, {"Host": "elsewhere.example"})
    assert status == 404 and got["error"]["message"] == "Not Found: POST /v1/completions/"
    assert get(url, "/health/")[0] == 404
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="davinci-002", prompt="x")


def test_models_health_and_metrics(running):
    mode, _, url = running
    assert [m.id for m in client(url).models.list().data] == ["gpt2"]
    client(url).completions.create(model="gpt2", prompt="Hello", max_tokens=5)
    assert get(url, "/health") == (200, '{"status":"ok"}')
    status, text = get(url, "/metrics")
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["gpt2_generation_tokens_total"] >= 5 and values["gpt2_prompt_tokens_total"] >= 1
    assert values['gpt2_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert values["gpt2_e2e_request_latency_seconds_count"] >= 1 and "gpt2_num_requests_running" in values
    assert values["gpt2_prefill_tokens_waiting"] == 0  # nothing waits: every prompt was computed
    if mode == "speculative":
        assert 0 < values["gpt2_spec_decode_num_accepted_tokens_total"] <= values[
            "gpt2_spec_decode_num_draft_tokens_total"]
    else:
        assert "gpt2_spec_decode_num_drafts_total" not in values


def metric_values(url):
    text = get(url, "/metrics")[1]
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def test_prompt_tokens_from_the_prefix_cache_are_reported(running):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field) counts a prompt's tokens that
    none of its choices computed; /metrics counts tokens looked up and found (as vLLM's)."""
    mode, _, url = running
    if rowwise.KERNEL != "numba":
        pytest.skip("the prefix cache needs the numba kernels (without them only one prompt's choices share it)")
    prompt = [int(t) for t in np.random.default_rng(len(mode)).integers(0, 50000, 40)]
    before = metric_values(url)
    first = client(url).completions.create(model="gpt2", prompt=prompt, max_tokens=3, temperature=0)
    again = client(url).completions.create(model="gpt2", prompt=prompt + [5, 6], max_tokens=16, temperature=0, n=3,
                                           extra_body={"ignore_eos": True})
    after = metric_values(url)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # its first 40 tokens' whole blocks
    assert again.usage.prompt_tokens == 42 and len({c.text for c in again.choices}) == 1  # greedy: the same
    assert after["gpt2_prefix_cache_queries_total"] - before["gpt2_prefix_cache_queries_total"] == 40 + 3 * 42
    # each choice finds the first request's 32 tokens in the cache; the 9 more they share are less than a
    # block, not worth a wait for the first choice to compute them (scheduler.shares_with)
    assert after["gpt2_prefix_cache_hits_total"] - before["gpt2_prefix_cache_hits_total"] == 3 * 32
    assert after["gpt2_prefix_cache_bytes"] > 0


def test_a_client_that_leaves_frees_its_rows(running):
    _, engine, url = running
    host, port = url.removeprefix("http://").split(":")
    for stream in (True, False):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 100000, "stream": stream,
                                                            "ignore_eos": True}))
        if stream:
            response = conn.getresponse()
            assert response.fp.readline()  # the first chunk came
        else:
            deadline = time.monotonic() + 10
            while not engine["running"] and time.monotonic() < deadline:
                time.sleep(0.01)
        conn.sock.shutdown(2)
        conn.close()
        deadline = time.monotonic() + 10
        while (engine["running"] or engine["waiting"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine["running"] and not engine["waiting"]
        assert "gpt2_num_requests_running 0\n" in get(url, "/metrics")[1]
    assert client(url).completions.create(model="gpt2", prompt="still here", max_tokens=3).choices[0].text


def test_a_client_that_leaves_while_queued_is_forgotten(models_dir):
    """One row: A decodes, B waits for the row and hangs up; B leaves the queue (and the
    waiting gauge) at once, and A goes on."""
    httpd, engine, url = start(models_dir, "--max_batch", "1", "--max_model_len", "1000000")
    host, port = url.removeprefix("http://").split(":")
    try:
        conns = [http.client.HTTPConnection(host, int(port), timeout=10) for _ in range(2)]
        conns[0].request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 100000, "stream": True,
                                                                "ignore_eos": True}))
        first = conns[0].getresponse()
        assert first.fp.readline()  # A is decoding
        conns[1].request("POST", "/v1/completions", json.dumps({"prompt": "y", "max_tokens": 5}))
        deadline = time.monotonic() + 10
        while len(engine["waiting"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine["waiting"]) == 1 and len(engine["running"]) == 1
        conns[1].sock.shutdown(socket.SHUT_RDWR)
        conns[1].close()
        while engine["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine["waiting"] and len(engine["running"]) == 1 and first.fp.readline()  # A still streams
        assert "gpt2_num_requests_waiting 0\n" in get(url, "/metrics")[1]
        conns[0].sock.shutdown(socket.SHUT_RDWR)
        conns[0].close()
        while engine["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine["running"] and not engine["outboxes"]
    finally:
        server.stop(httpd, engine)


def test_an_api_key_is_asked_for_when_set(models_dir):
    httpd, engine, url = start(models_dir, "--api_key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(model="gpt2", prompt="x", max_tokens=2)
        assert client(url, "sesame").completions.create(model="gpt2", prompt="x", max_tokens=2).choices[0].text
    finally:
        server.stop(httpd, engine)


def test_health_is_503_while_loading(models_dir):
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--port", "0"])
    engine = engines.new_engine(args)
    httpd = server.listen(args, engine)
    url = f"http://127.0.0.1:{httpd.address[1]}"
    try:
        assert post(url, "/v1/completions", {"prompt": "x"})[0] == 503
        assert get(url, "/health") == (503, '{"status":"loading"}')
        engines.load(engine)
        assert get(url, "/health")[0] == 200
    finally:
        server.stop(httpd, engine)


@pytest.mark.parametrize("sig, again", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)])
def test_sigint_and_sigterm_end_requests_in_flight_and_exit_0(models_dir, sig, again):
    """Ctrl-C, and SIGTERM (what docker, systemd and Kubernetes send): a stream in flight gets
    an error event and [DONE], a whole response a JSON error, and the process exits 0. Sent
    again and again while it stops (an impatient supervisor), too: a signal that came while
    Python itself was exiting killed the process (-15)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--models_dir", models_dir,
                             "--target_model_size", "124M", "--port", "0", "--max_model_len", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving gpt2 (autoregressive) at http://127.0.0.1:")
        url = line.split(" at ")[1].split("/v1")[0]
        chunks, whole = [], []
        stream = client(url).completions.create(model="gpt2", prompt="x", max_tokens=100000, stream=True,
                                                extra_body={"ignore_eos": True})
        reader = threading.Thread(target=lambda: chunks.extend(stream.response.iter_lines()))
        reader.start()
        waiter = threading.Thread(target=lambda: whole.append(post(url, "/v1/completions", {
            "prompt": "y", "max_tokens": 100000, "ignore_eos": True})))
        waiter.start()
        time.sleep(1.0)
        started = time.monotonic()
        proc.send_signal(sig)
        while again and proc.poll() is None and time.monotonic() - started < 30:
            time.sleep(0.05)
            proc.send_signal(sig)
        assert proc.wait(30) == 0 and time.monotonic() - started < 15
        reader.join(30)
        waiter.join(30)
        lines = [c for c in chunks if c]
        assert any("shutting down" in c for c in lines) and lines[-1] == "data: [DONE]"
        assert whole[0][0] == 503 and "shutting down" in whole[0][1]["error"]["message"]
    finally:
        proc.kill()


def test_a_request_still_sending_its_body_when_the_server_stops_gets_a_json_503_at_once(models_dir):
    """A client half way through its body as the server stops (a slow uploader, or one
    that sends headers and waits) kept the drain waiting its --drain_s, and was then
    answered uvicorn's plain-text 500 (a traceback logged): now the 503 that every other
    request in flight gets, as JSON, within the LINGER_S that a refusal reads for."""
    httpd, engine, url = start(models_dir, "--read_timeout_s", "60", "--drain_s", "30")
    body = json.dumps({"prompt": "x", "max_tokens": 5}).encode()
    sock = socket.create_connection(("127.0.0.1", httpd.address[1]), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
    time.sleep(0.5)  # its headers read, its body awaited
    stopper = threading.Thread(target=server.stop, args=(httpd, engine))
    started = time.monotonic()
    stopper.start()
    got = b""
    while part := sock.recv(65536):
        got += part
    took = time.monotonic() - started
    stopper.join(60)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower(), got[:300]
    assert json.loads(rest)["error"] == {"message": "the server is shutting down", "type": "server_busy",
                                         "param": None, "code": 503}
    assert took < 5 and not httpd.thread.is_alive()


def test_a_servers_draft_flags_without_mode_speculative_get_a_note():
    """The server's default is autoregressive: `--draft_model_size 124M --K 8` alone drafts nothing."""
    args = server.parse_args(["--draft_model_size", "355M", "--K", "8"])
    note = flags.draft_flags_note(args, server.parse_args([]))
    assert note.startswith("note: --mode autoregressive decodes with the target alone and leaves --draft_model_size, "
                           "--K unused")
    speculative = server.parse_args(["--mode", "speculative", "--K", "8"])
    assert flags.draft_flags_note(speculative, server.parse_args([])) is None
    lookup = server.parse_args(["--mode", "speculative", "--drafter", "prompt_lookup", "--draft_model_size", "774M"])
    assert flags.draft_flags_note(lookup, server.parse_args([])).startswith(
        "note: --drafter prompt_lookup drafts from the text itself and leaves --draft_model_size unused")


@pytest.mark.parametrize("budget", ["0", "-2", "7"])
def test_a_prefill_budget_below_max_batch_is_one_line_before_anything_loads(capsys, tmp_path, budget):
    assert server.entry(["--max_prefill_tokens", budget, "--max_batch", "8", "--models_dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (f"error: --max_prefill_tokens must be >= 8 (--max_batch: each decoding request counts "
                           f"one token of it), got {budget}") and not os.listdir(tmp_path)


@pytest.mark.parametrize("flag", ["--max_batch", "--max_queue"])
def test_a_batch_or_queue_below_one_is_one_line_naming_it_before_anything_loads(capsys, tmp_path, flag):
    assert server.entry([flag, "0", "--models_dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"error: {flag} must be >= 1, got 0" and not os.listdir(tmp_path)


def test_a_negative_prefix_cache_is_one_line_before_anything_loads(capsys, tmp_path):
    assert server.entry(["--prefix_cache_mib", "-1", "--models_dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "error: --prefix_cache_mib must be >= 0 (0 keeps none), got -1" and not os.listdir(tmp_path)


def test_rows_whose_caches_the_memory_cannot_hold_are_refused_as_the_models_load(models_dir, monkeypatch):
    """--max_batch rows of the window's keys and values, past the memory: refused at the start
    (a ValueError, server.py's one line), not in the engine's thread at the first request."""
    from kernels import layout
    monkeypatch.setattr(layout, "memory", lambda on_gpu=False: ("this machine's", 1 << 19))
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--max_batch", "64"])
    with pytest.raises(ValueError, match="the keys and values of 64 rows of 64 tokens take"):
        engines.load(engines.new_engine(args))
    engines.load(engines.new_engine(server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M",
                                                       "--max_batch", "2"])))
