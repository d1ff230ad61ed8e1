"""Mixed clients for tests/test_server_soak.py, run in a process of their own (in the
server's, client threads would take turns with its engine for Python's interpreter lock):
readers, readers over a slow link that pause, clients that hang up mid-stream, and
completions not streamed, all at once until a deadline."""
import http.client
import json
import random
import socket
import threading
import time


def run(port, bodies, n_clients, seconds, pause_s, seed=0):
    """n_clients threads, each asking one request after another until `seconds` have
    passed. Returns one outcome per request: (body index, what the client did, how it
    ended: "done", "left", "reset" or "error: ...", the text it got)."""
    outcomes, lock, deadline = [], threading.Lock(), time.monotonic() + seconds

    def client(k):
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            b = rng.randrange(len(bodies))
            kind = rng.choices(["read", "pause", "leave", "whole"], weights=[45, 30, 15, 10])[0]
            pause = rng.uniform(*pause_s) if kind == "pause" else 0.0
            result = ask(port, bodies[b], kind, rng.randint(1, 20), pause)
            with lock:
                outcomes.append((b, kind, pause, *result))
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def ask(port, body, kind, n_events, pause):
    """One request: (how it ended, its text)."""
    sock = socket.socket()
    if kind == "pause":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a slow link: its window fills at once
    sock.settimeout(120)
    sock.connect(("127.0.0.1", port))
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.sock = sock
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": kind != "whole"}))
    texts = []
    try:
        response = conn.getresponse()
        if kind == "whole":
            got = json.loads(response.read())
            return ("done", got["choices"][0]["text"]) if "choices" in got else ("error: " + str(got), "")
        for line in response:
            if line.startswith(b"data: [DONE]"):
                return "done", "".join(texts)
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error: " + event["error"]["message"], "".join(texts)
            texts.append(event["choices"][0]["text"])
            if len(texts) == n_events and kind == "leave":
                sock.shutdown(socket.SHUT_RDWR)
                return "left", "".join(texts)
            if len(texts) == n_events and kind == "pause":
                time.sleep(pause)
        return "closed without [DONE]", "".join(texts)
    except (ConnectionError, http.client.HTTPException, socket.timeout) as e:
        return f"reset ({type(e).__name__})", "".join(texts)
    finally:
        conn.close()
