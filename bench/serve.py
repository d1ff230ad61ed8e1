"""`--only serving` and `--only http`: many requests at once, and over HTTP.

serving: static against continuous batching (scheduler.py) on one workload of mixed
lengths, all requests at once and as a Poisson stream, and the kernel against the NumPy
fallback under continuous batching. http: the same workload through the server
(serving/server.py) over loopback against scheduler.serve in this process, what HTTP
adds to one request's first token, and normal clients beside stalled readers and idle
connections. The clients run in a process of their own, as real clients do.
"""
import json
import threading
import time

import numpy as np

import batching
import speculative
import utils
from bench.common import GREEDY, TOKENIZER_DIR, prompt_ids, rss_mb, settle
from bench.rows import kernel_layouts
from kernels import rowwise
from serving import scheduler


def serving_workload(n, seed, prompt_len=(16, 64), new_tokens=(8, 256)):
    """n greedy requests: prompts of 16-64 tokens, and output lengths spread log-uniformly
    over 8-256 tokens (many short answers, a few long ones), seeded."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(new_tokens[0]), np.log(new_tokens[1])
    return [batching.Request(tuple(prompt_ids(int(rng.integers(*prompt_len)), seed=seed * 1000 + i)),
                             int(np.exp(rng.uniform(lo, hi))), GREEDY, seed=i) for i in range(n)]


def serve_once(reqs, model, max_batch, static):
    finished = [e for e in scheduler.serve(reqs, scheduler.autoregressive(model), max_batch, static=static)
                if e.kind == "finished"]
    return scheduler.summarize(finished), [e.metrics for e in finished]


def bench_serving(model, args, size):
    """Static vs continuous batching on one workload, all requests at once and as a
    Poisson stream at 70% of the capacity continuous batching measured at once; and, where
    the numba kernel runs, continuous batching at once on the NumPy fallback too."""
    reqs = serving_workload(args.n_requests, seed=0)
    fallback = kernel_layouts(model)["numpy"] if rowwise.KERNEL == "numba" else None
    rows = []
    for max_batch in args.max_batches:
        at_once = {}
        for static in (True, False):
            at_once[static] = serve_once(reqs, model, max_batch, static)
            rows.append({"size": size, "max_batch": max_batch, "arrivals": "all at once",
                         "policy": "static" if static else "continuous", **at_once[static][0],
                         "timeline": at_once[static][1]})
        if fallback:  # the same run on the NumPy fallback's layout (the code before the kernel), right after
            settle()
            summary = serve_once(reqs, fallback, max_batch, False)[0]
            rows.append({"size": size, "max_batch": max_batch, "arrivals": "all at once",
                         "policy": "continuous, NumPy fallback", **summary, "timeline": []})
            print(f"  serving {size} max_batch {max_batch}: kernel / fallback throughput "
                  f"{at_once[False][0]['tokens_per_s'] / summary['tokens_per_s']:.2f}x", flush=True)
        rate = 0.7 * len(reqs) / at_once[False][0]["seconds"]  # requests/s
        gaps = np.random.default_rng(1).exponential(1 / rate, len(reqs))
        stream = [batching.Request(r.prompt, r.max_new_tokens, r.settings, r.seed, arrival_s=float(t))
                  for r, t in zip(reqs, np.cumsum(gaps) - gaps[0])]
        for static in (True, False):
            summary, timeline = serve_once(stream, model, max_batch, static)
            rows.append({"size": size, "max_batch": max_batch, "arrivals": f"Poisson {rate:.2f}/s (70%)",
                         "policy": "static" if static else "continuous", **summary, "timeline": timeline})
        print(f"  serving {size} max_batch {max_batch}: continuous / static throughput "
              f"{at_once[False][0]['tokens_per_s'] / at_once[True][0]['tokens_per_s']:.2f}x at once; "
              f"p95 TTFT static / continuous {rows[-2]['ttft_s_p95'] / rows[-1]['ttft_s_p95']:.1f}x on the stream",
              flush=True)
    return rows


def bench_http(model, args, size):
    """The serving workload (all at once, continuous batching) through server.py over
    loopback HTTP, one streaming client thread per request, against scheduler.serve in
    this process, in turns: what the HTTP path adds to throughput and time to first token."""
    from serving import server  # only this section needs it
    encoder = utils.load_encoder(TOKENIZER_DIR)
    max_batch = args.max_batches[0]
    reqs = serving_workload(args.n_requests, seed=0)
    flags = ["--target_model_size", size if size in utils.MODEL_SIZES else "124M", "--max_batch", str(max_batch),
             "--port", "0",
             "--max_queue", str(len(reqs) + 8), "--max_model_len", str(10 ** 7)]  # + the 8 stalled streams
    httpd, engine = server.start(server.parse_args(flags), loaded=(encoder, model, None))
    port = httpd.address[1]
    rows = []
    try:
        for rep in range(args.reps):
            summary, _ = serve_once(reqs, model, max_batch, static=False)
            rows.append({"path": "in-process serve()", "rep": rep, "tokens_per_s": summary["tokens_per_s"],
                         "ttft_s_p50": summary["ttft_s_p50"], "ttft_s_p95": summary["ttft_s_p95"]})
            before = engine["metrics"]["num_preemptions_total"]
            rows.append({"path": "HTTP (server.py)", "rep": rep, **http_clients(reqs, port)})
            rows[-1]["preemptions"] = engine["metrics"]["num_preemptions_total"] - before
            print(f"  HTTP / in-process: throughput {rows[-1]['tokens_per_s'] / rows[-2]['tokens_per_s']:.3f}x, "
                  f"p50 TTFT {1e3 * (rows[-1]['ttft_s_p50'] - rows[-2]['ttft_s_p50']):+.1f} ms", flush=True)
        lone = reqs[0]
        for rep in range(5 * args.reps):  # one request on an idle server: what HTTP adds to its first token
            summary, _ = serve_once([lone], model, max_batch, static=False)
            rows.append({"path": "in-process serve(), one request", "rep": rep, **summary})
            rows.append({"path": "HTTP (server.py), one request", "rep": rep,
                         **http_clients([lone], port)})
        latency = http_pool(http_latency, port, list(lone.prompt))  # kept-alive /health; the openai client
        alone = [serve_once([batching.Request(lone.prompt, 1, lone.settings, lone.seed)], model, max_batch,
                            static=False)[0]["ttft_s_p50"] for _ in range(len(latency["openai_s"]))]
        latency["engine_s_p50"] = float(np.median(alone))
        print(f"  kept-alive GET /health p50 {1e3 * latency['health_s_p50']:.2f} ms; openai client, 1 token: "
              f"{1e3 * latency['openai_s_p50']:.1f} ms, the engine alone {1e3 * latency['engine_s_p50']:.1f} ms",
              flush=True)
        hostile = []
        few = [(list(r.prompt), r.max_new_tokens, r.seed) for r in reqs[:max_batch]]
        for rep in range(args.reps):  # 8 normal clients alone, then beside stalled readers and idle connections
            for others in (False, True):
                rss_before, before = rss_mb(), engine["metrics"]["num_preemptions_total"]
                hostile.append({"rep": rep, "hostile": others, **http_pool(http_beside_hostile, few, port, others),
                                "rss_before_mb": rss_before,
                                "preemptions": engine["metrics"]["num_preemptions_total"] - before})
                deadline = time.monotonic() + 30  # the stalled readers are cut off (--write_timeout_s) and freed
                while (engine["running"] or engine["outboxes"]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                hostile[-1]["rss_after_mb"] = rss_mb()
            print(f"  8 clients beside 8 stalled readers + 200 idle connections: throughput "
                  f"{hostile[-1]['tokens_per_s'] / hostile[-2]['tokens_per_s']:.3f}x alone; stalled readers cut "
                  f"off after {hostile[-1]['stalled_held_s']:.1f} s; server RSS {hostile[-1]['rss_before_mb']:.0f} "
                  f"-> {hostile[-1]['rss_after_mb']:.0f} MB", flush=True)
    finally:
        server.stop(httpd, engine)
    return {"size": size, "max_batch": max_batch, "n_requests": len(reqs), "runs": rows, "latency": latency,
            "hostile": hostile, "fairness": bench_fairness(encoder, model, args, size)}


def bench_fairness(encoder, model, args, size):
    """Issue #57's fairness run, in turns: two fast clients alone, then beside 8 slow
    readers (http_fast_beside_slow), against a speculative server with max_batch 4 whose
    draft is the model's first block."""
    from serving import server
    params, hparams = model
    draft = (dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1))
    flags = ["--target_model_size", size if size in utils.MODEL_SIZES else "124M", "--mode", "speculative",
             "--K", "3", "--max_batch", "4", "--write_timeout_s", "10", "--port", "0", "--max_model_len", "100000"]
    httpd, engine = server.start(server.parse_args(flags), loaded=(encoder, model, speculative.model_drafter(draft)))
    (seconds, lead_s), runs = ((3.0, 1.0) if args.quick else (30.0, 5.0)), []
    try:
        for rep in range(args.reps):
            for slow in (False, True):
                before = engine["metrics"]["num_preemptions_total"]
                runs.append({"rep": rep, **http_pool(http_fast_beside_slow, httpd.address[1], slow, seconds, 8, lead_s),
                             "preemptions": engine["metrics"]["num_preemptions_total"] - before})
                deadline = time.monotonic() + 60  # the slow readers' requests end before the next turn
                while (engine["running"] or engine["outboxes"] or engine["paused"]) and time.monotonic() < deadline:
                    time.sleep(0.1)
            alone, beside = runs[-2:]
            print(f"  2 fast clients beside 8 slow readers: {beside['tokens_per_s'] / alone['tokens_per_s']:.2f}x "
                  f"their tokens/s alone, slowest request {beside['latency_s_max'] / alone['latency_s_max']:.2f}x",
                  flush=True)
    finally:
        server.stop(httpd, engine)
    return {"seconds": seconds, "runs": runs}


def http_pool(fn, *fn_args):
    """fn in a process of its own, as real clients are: in this one, client threads would
    take turns with the server's engine for Python's interpreter lock."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, fn_args)


def http_latency(port, prompt, n=200):
    """Kept-alive GET /health (one connection), and the official openai client's 1-token
    completions (it keeps its connection alive too): seconds per call, median."""
    import http.client
    import openai
    conn, health = http.client.HTTPConnection("127.0.0.1", port), []
    for _ in range(n):
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        health.append(time.perf_counter() - start)
    client, calls = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), []
    for i in range(n // 4):
        start = time.perf_counter()
        client.completions.create(model="gpt2", prompt=prompt, max_tokens=1, seed=i, temperature=0)
        calls.append(time.perf_counter() - start)
    return {"health_s_p50": float(np.median(health[n // 10:])), "openai_s_p50": float(np.median(calls[2:])),
            "openai_s": calls[2:]}


def http_beside_hostile(reqs, port, hostile):
    """http_run, with (hostile) 8 streams that are never read and 200 connections that send
    nothing opened first; the stalled streams are held until the server cuts them off (then
    "stalled_held_s", how long the last was held: its rows decoded for nobody that long)."""
    import select
    import socket
    held, started = [], time.perf_counter()
    if hostile:
        body = json.dumps({"prompt": [464], "max_tokens": 10 ** 6, "ignore_eos": True, "stream": True}).encode()
        for _ in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            held.append(sock)
        held += [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        result = http_run(reqs, port)
        if hostile:  # wait (without reading) until the server has reset each stalled stream
            poll = select.poll()
            for sock in held[:8]:
                poll.register(sock, select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0))
            cut = set()
            while len(cut) < 8 and time.perf_counter() - started < 300:
                cut |= {fd for fd, _ in poll.poll(100)}
            result["stalled_held_s"] = time.perf_counter() - started
        return result
    finally:
        for sock in held:
            sock.close()


def http_fast_beside_slow(port, slow, seconds=40.0, n_slow=8, lead_s=5.0):
    """Two fast clients streaming 100-token completions back to back for `seconds`, alone
    or (slow) beside n_slow readers started lead_s earlier, each streaming 1,500 tokens
    through a 4 KiB receive buffer and pausing 2-8 s after every 20 KB (issue #57): the
    fast clients' tokens/s and their requests' latency p50 and max."""
    import random
    import socket
    stop_at = time.perf_counter() + seconds + (lead_s if slow else 0.0)

    def slow_reader(k):
        rng = random.Random(k)
        body = json.dumps({"prompt": "A slow reader", "max_tokens": 1500, "seed": k, "temperature": 0.9,
                           "logprobs": 2, "ignore_eos": True, "stream": True}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(60)
            try:
                sock.connect(("127.0.0.1", port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                got = 0
                while time.perf_counter() < stop_at and (part := sock.recv(4096)):
                    got += len(part)
                    if got >= 20_000:
                        got = 0
                        time.sleep(rng.uniform(2.0, 8.0))
            except OSError:
                pass

    latencies = []

    def fast(k):
        import http.client
        i = 0
        while time.perf_counter() < stop_at:
            conn, started = http.client.HTTPConnection("127.0.0.1", port, timeout=120), time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": "A fast reader", "max_tokens": 100, "seed": 1000 * k + i, "temperature": 0.9,
                "ignore_eos": True, "stream": True}))
            for _ in conn.getresponse():
                pass
            conn.close()
            latencies.append(time.perf_counter() - started)
            i += 1
    slow_threads = [threading.Thread(target=slow_reader, args=(k,), daemon=True) for k in range(n_slow if slow else 0)]
    for t in slow_threads:
        t.start()
    if slow:
        time.sleep(lead_s)
    start = time.perf_counter()
    fast_threads = [threading.Thread(target=fast, args=(k,)) for k in range(2)]
    for t in fast_threads:
        t.start()
    for t in fast_threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {"slow_readers": n_slow if slow else 0, "requests": len(latencies),
            "tokens_per_s": 100 * len(latencies) / elapsed, "latency_s_p50": float(np.median(latencies)),
            "latency_s_max": float(max(latencies))}


def http_clients(reqs, port):
    return http_pool(http_run, [(list(r.prompt), r.max_new_tokens, r.seed) for r in reqs], port)


def http_run(reqs, port):
    """Every request (prompt, max_tokens, seed) as a streaming POST, sent in order from one
    thread (so the server admits them in the order serve() does) and read on one thread
    each: tokens/s over the run, TTFT percentiles."""
    import http.client
    ttft, tokens = [None] * len(reqs), [0] * len(reqs)
    start = time.perf_counter()
    conns = []
    for prompt, max_tokens, seed in reqs:
        conns.append(http.client.HTTPConnection("127.0.0.1", port, timeout=600))
        conns[-1].request("POST", "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))

    def read(k):
        for line in conns[k].getresponse():
            if line.startswith(b"data: {") and ttft[k] is None:
                ttft[k] = time.perf_counter() - start
            if line.startswith(b"data: {") and b'"usage"' in line:
                tokens[k] = json.loads(line[6:])["usage"]["completion_tokens"]
        conns[k].close()
    threads = [threading.Thread(target=read, args=(k,)) for k in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(tokens) / seconds, "ttft_s_p50": float(np.percentile(ttft, 50)),
            "ttft_s_p95": float(np.percentile(ttft, 95)), "tokens": sum(tokens)}
