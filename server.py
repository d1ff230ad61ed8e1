"""An OpenAI-compatible HTTP server: /v1/completions on the continuous-batching scheduler.

    python server.py --target_model_size 355M --mode speculative --max_batch 8
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gpt2-medium", "prompt": "Alan Turing theorized", "max_tokens": 20, "stream": true}'

Every engine people run (vLLM, llama.cpp's server, TGI) speaks the OpenAI API, so every
client does too: the official `openai` package, curl, LangChain. The server is three parts:
- one engine thread runs scheduler.serving over a queue: HTTP handlers put requests (and
  cancellations) in, and the engine hands each event to the handler that waits for it;
- handlers (one thread per connection, the standard library's ThreadingHTTPServer) turn a
  JSON body into batching.Requests, one per prompt and choice, and the engine's tokens
  into text: whole, or as Server-Sent Events while they come;
- /v1/models, /health and /metrics (Prometheus text) say what runs and how it goes.

The request's fields mean what they mean in the OpenAI completions API as vLLM serves it
(https://platform.openai.com/docs/api-reference/completions, https://docs.vllm.ai), with
vLLM's extras top_k, min_p, repetition_penalty and ignore_eos. A request's text is what
main.py prints for the same prompt, settings and seed: choice i of prompt j samples with
seed + j * n + i from its own random stream, whoever else the server is answering.
"""
import argparse
import codecs
import dataclasses
import json
import queue
import secrets
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import batching
import gpt2
import main
import sampling
import scheduler
import speculative
import utils

# the name each size is served under: the names its checkpoints carry on Hugging Face
MODEL_NAMES = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
MAX_N = 16  # choices per prompt
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # histogram buckets


class BadRequest(Exception):
    """A request the API refuses: HTTP status, message, and the field at fault (OpenAI's error body)."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def parse_args(argv=None):
    ap = main.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    main.add_decoder_flags(ap, modes=("autoregressive", "speculative"), default="autoregressive")
    ap.add_argument("--max_batch", type=int, default=8, help="requests decoded at once (continuous batching)")
    ap.add_argument("--max_queue", type=int, default=256, help="requests waiting for a row; more get 503")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines too")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api_key", help="if set, requests must send 'Authorization: Bearer KEY'")
    main.add_model_flags(ap)
    return ap.parse_args(argv)


# --- the engine: one thread that owns the models, the batch and the scheduler ---

def new_engine(args):
    """The engine's state before its models load: /health answers 503 until "decoder" is set."""
    return {"args": args, "inbox": queue.Queue(), "outboxes": {}, "lock": threading.Lock(), "next_index": 0,
            "stats": batching.Stats(), "metrics": new_metrics(), "waiting": set(), "running": set(),
            "logprobs": set(),  # requests whose tokens keep their logits row (for logprobs)
            "decoder": None, "encoder": None, "hparams": None, "model": MODEL_NAMES[args.target_model_size]}


def load(engine, loaded=None):
    """Load the models (downloading what is missing) and build the decoder the engine runs.
    loaded: (encoder, target, drafter) already in memory (the benchmark's random models)."""
    args = engine["args"]
    encoder, target, drafter = loaded or main.load_models(args)
    if args.mode == "speculative":
        config = speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                               draft_vocab=args.draft_vocab)
        decoder = scheduler.speculative_decoder(target, drafter, config)
    else:
        decoder = scheduler.autoregressive(target)
    engine["encoder"], engine["hparams"], engine["decoder"] = encoder, target[1], decoder


def run_engine(engine):
    """The engine thread: serve whatever the handlers submit until told to stop."""
    step, models = engine["decoder"]
    stopped = []

    def intake(now, idle):  # scheduler.serving's intake: block on the inbox only while nothing runs
        items = [engine["inbox"].get()] if idle and not stopped else []
        while True:
            try:
                items.append(engine["inbox"].get_nowait())
            except queue.Empty:
                break
        stopped.extend(item for item in items if item[0] == "stop")
        return ([(i, r) for kind, i, r in items if kind == "request"],
                [i for kind, i, _ in items if kind == "cancel"], bool(stopped))

    n_ctx = engine["hparams"]["n_ctx"]
    last_token_at = {}
    for e in scheduler.serving(intake, step, models, engine["args"].max_batch, n_ctx, stats=engine["stats"]):
        now = time.perf_counter()
        with engine["lock"]:
            box = engine["outboxes"].get(e.index)  # None once its handler has let it go
            if e.kind == "token":
                engine["metrics"]["generation_tokens_total"] += 1
                if e.index in last_token_at:
                    observe(engine["metrics"]["inter_token_latency_seconds"], now - last_token_at[e.index])
                last_token_at[e.index] = now
                if box:
                    engine["waiting"].discard(e.index)
                    engine["running"].add(e.index)
                # a view would keep the whole step's logits alive while a slow client reads: copy one row, or none
                e = dataclasses.replace(e, logits=e.logits.copy() if e.index in engine["logprobs"] else None)
            else:
                last_token_at.pop(e.index, None)
                if e.kind == "finished":
                    for name, key in (("time_to_first_token_seconds", "ttft_s"), ("request_queue_time_seconds",
                                      "queue_s"), ("e2e_request_latency_seconds", "e2e_s")):
                        observe(engine["metrics"][name], e.metrics[key])
        if box:
            box.put(e)


def submit(engine, reqs, logprobs=False):
    """Hand requests to the engine: (the queue their events arrive on, their indices).
    logprobs: their token events carry the target's logits row."""
    box = queue.Queue()
    with engine["lock"]:
        if len(engine["waiting"]) + len(reqs) > engine["args"].max_queue:
            raise BadRequest(f"the server has {len(engine['waiting'])} requests waiting (--max_queue "
                             f"{engine['args'].max_queue}); retry later", status=503, kind="server_busy")
        indices = list(range(engine["next_index"], engine["next_index"] + len(reqs)))
        engine["next_index"] += len(reqs)
        for i, r in zip(indices, reqs):
            engine["outboxes"][i] = box
            engine["waiting"].add(i)
            if logprobs:
                engine["logprobs"].add(i)
            engine["metrics"]["prompt_tokens_total"] += len(r.prompt)
    arrival = time.perf_counter() - engine["stats"].start
    for i, r in zip(indices, reqs):
        engine["inbox"].put(("request", i, batching.Request(**{**vars(r), "arrival_s": arrival})))
    return box, indices


def release(engine, indices):
    """The handler is done with these requests: stop any still decoding or waiting, forget them."""
    with engine["lock"]:
        for i in indices:
            engine["outboxes"].pop(i, None)
            for known in (engine["waiting"], engine["running"], engine["logprobs"]):
                known.discard(i)
    for i in indices:
        engine["inbox"].put(("cancel", i, None))


# --- a completions request: JSON in, batching.Requests out, tokens back to text ---

def parse_completion(body, engine):
    """(the batching.Requests, one per prompt and choice, and what the response needs)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model", engine["model"])
    if model != engine["model"]:
        raise BadRequest(f"The model `{model}` does not exist. This server serves `{engine['model']}`.",
                         "model", status=404, kind="NotFoundError")
    n_vocab, encoder = engine["hparams"]["n_vocab"], engine["encoder"]
    prompts = read_prompts(body.get("prompt"), encoder, n_vocab)
    n = field(body, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]")
    max_tokens = field(body, "max_tokens", int, 16, lambda v: v >= 1, "an integer >= 1")
    logprobs = field(body, "logprobs", int, None, lambda v: 0 <= v <= 5, "an integer in [0, 5]")
    echo = field(body, "echo", bool, False)
    if logprobs is not None and echo:
        raise BadRequest("echo with logprobs would need the prompt's logprobs, which this server does not compute: "
                         "leave out one of them", "logprobs")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of at most 4 non-empty strings", "stop")
    top_k = field(body, "top_k", int, 0, lambda v: v >= -1, "an integer >= 0 (0 or -1 = off)")
    try:
        settings = sampling.SamplingSettings(
            temperature=field(body, "temperature", float, 1.0), top_k=max(top_k, 0),
            top_p=field(body, "top_p", float, 1.0), min_p=field(body, "min_p", float, 0.0),
            presence_penalty=field(body, "presence_penalty", float, 0.0),
            frequency_penalty=field(body, "frequency_penalty", float, 0.0),
            repetition_penalty=field(body, "repetition_penalty", float, 1.0))
    except sampling.BadSetting as e:
        raise BadRequest(f"{e.name} {e.problem}", e.name)
    seed = field(body, "seed", int, None, lambda v: v >= 0, "an integer >= 0")
    seed = secrets.randbelow(2 ** 63) if seed is None else seed
    eos = None if field(body, "ignore_eos", bool, False) else encoder.eot_token
    reqs = [batching.Request(tuple(p), max_tokens, settings, seed + j * n + i, eos)
            for j, p in enumerate(prompts) for i in range(n)]
    for r in reqs:
        problem = scheduler.refusal(r, engine["hparams"], engine["hparams"]["n_ctx"])
        if problem:
            raise BadRequest(problem, "prompt")
    return reqs, {"prompts": [prompts[k // n] for k in range(len(reqs))], "stop": stop, "eos": eos,
                  "prompt_tokens": sum(len(p) for p in prompts),  # once per prompt, whatever n (as OpenAI)
                  "echo": echo, "logprobs": logprobs, "stream": field(body, "stream", bool, False),
                  "usage": bool((body.get("stream_options") or {}).get("include_usage"))}


def field(body, name, kind, default, ok=lambda v: True, allowed=None):
    """body[name] (or default if absent or null), checked to be of its kind and allowed."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and sampling.is_real(value):
        value = float(value)
    if type(value) is not kind or not ok(value):
        raise BadRequest(f"{name} must be {allowed or ('a number' if kind is float else kind.__name__)}, "
                         f"got {json.dumps(value)}", name)
    return value


def read_prompts(prompt, encoder, n_vocab):
    """The API's four prompt forms (a string, strings, token ids, lists of token ids) as token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a string, a list of strings, or token ids", "prompt")
    ids = []
    for p in prompt:
        if isinstance(p, str):
            ids.append(encoder.encode(p, allowed_special={utils.EOT_TOKEN}) or [encoder.eot_token])
        elif isinstance(p, list) and p and all(type(t) is int and 0 <= t < n_vocab for t in p):
            ids.append(p)
        else:
            raise BadRequest(f"each prompt must be a string or a non-empty list of token ids in [0, {n_vocab})",
                             "prompt")
    return ids


def new_choice(index, prompt_ids, encoder, how):
    """A choice as it grows: its tokens, its visible text, what has been streamed of it."""
    text = encoder.decode(prompt_ids) if how["echo"] else ""
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {"index": index, "tokens": [], "text": text, "generated_from": len(text), "sent": 0,
            "logprobs": logprobs if how["logprobs"] is not None else None, "logprobs_sent": 0,
            "utf8": codecs.getincrementaldecoder("utf-8")(errors="replace"), "finish_reason": None}


def grow(choice, event, encoder, how):
    """One event into a choice; True when the choice has just finished."""
    stop, eos = how["stop"], how["eos"]
    if choice["finish_reason"]:
        return False  # tokens the engine made before it saw this choice's cancellation
    if event.kind == "token":
        choice["tokens"].append(event.token)
        if event.token == eos:
            choice["finish_reason"] = "stop"
            return True
        if choice["logprobs"] is not None:
            add_logprobs(choice, event, encoder, how["logprobs"])
        before = len(choice["text"])
        choice["text"] += choice["utf8"].decode(encoder.decode_single_token_bytes(event.token))
        # a new stop string ends after `before`, and never starts inside an echoed prompt
        hits = [at for at in (choice["text"].find(s, max(choice["generated_from"], before - len(s) + 1))
                              for s in stop) if at >= 0]
        if hits:
            choice["text"], choice["finish_reason"] = choice["text"][:min(hits)], "stop"
            return True
        return False
    choice["text"] += choice["utf8"].decode(b"", final=True)
    choice["finish_reason"] = "length"
    return True


def add_logprobs(choice, event, encoder, n_top):
    """The token's log-probability under the target's own distribution (the log-softmax of
    its logits, before temperature, penalties and top-k/p: what vLLM returns by default), with
    the n_top likeliest tokens. Speculative decoding reports the same numbers: they come from
    the target's logits at each position of its verify pass."""
    logits = event.logits.get() if hasattr(event.logits, "get") else event.logits  # CuPy: to the host
    logp = gpt2.log_softmax(np.asarray(logits, dtype=np.float32))  # [n_vocab]
    top = np.argpartition(-logp, n_top)[:n_top] if n_top else []
    top = sorted(top, key=lambda t: -logp[t])
    lp = choice["logprobs"]
    lp["tokens"].append(encoder.decode([event.token]))
    lp["token_logprobs"].append(float(logp[event.token]))
    lp["top_logprobs"].append({encoder.decode([int(t)]): float(logp[t]) for t in top})
    lp["text_offset"].append(len(choice["text"]))  # where this token's text starts


def new_logprobs(choice):
    """The logprobs of the tokens not yet streamed (all of them for a whole response)."""
    lp, k = choice["logprobs"], choice["logprobs_sent"]
    if lp is None:
        return None
    choice["logprobs_sent"] = len(lp["tokens"])
    return {key: values[k:] for key, values in lp.items()}


def ready_text(choice, stop):
    """The text that can be streamed now: all of it once finished, else all but a tail that
    might still grow into a stop string (that must never reach the client)."""
    text = choice["text"]
    if not choice["finish_reason"]:
        for s in stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if s.startswith(text[-k:]):
                    text = text[:-k]
                    break
    new, choice["sent"] = text[choice["sent"]:], max(choice["sent"], len(text))
    return new


# --- metrics, in Prometheus's text format ---

def new_metrics():
    return {"prompt_tokens_total": 0, "generation_tokens_total": 0,
            **{name: {"buckets": [0] * len(SECONDS), "sum": 0.0, "count": 0}
               for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                            "e2e_request_latency_seconds", "request_queue_time_seconds")}}


def observe(histogram, seconds):
    for b, bound in enumerate(SECONDS):
        histogram["buckets"][b] += seconds <= bound
    histogram["sum"] += seconds
    histogram["count"] += 1


def prometheus(engine):
    """/metrics: histograms of latencies, gauges of requests, counters of tokens (and drafts)."""
    with engine["lock"]:
        m, running, waiting = engine["metrics"], len(engine["running"]), len(engine["waiting"])
        stats, spec = engine["stats"], engine["args"].mode == "speculative"
        lines = []
        for name, value in (("num_requests_running", running), ("num_requests_waiting", waiting)):
            lines += [f"# TYPE gpt2_{name} gauge", f"gpt2_{name} {value}"]
        counters = {"prompt_tokens_total": m["prompt_tokens_total"],
                    "generation_tokens_total": m["generation_tokens_total"]}
        if spec:
            counters.update(spec_decode_num_drafts_total=stats.row_passes,
                            spec_decode_num_draft_tokens_total=stats.drafted,
                            spec_decode_num_accepted_tokens_total=stats.accepted)
        for name, value in counters.items():
            lines += [f"# TYPE gpt2_{name} counter", f"gpt2_{name} {value}"]
        for name, h in m.items():
            if isinstance(h, dict):
                lines.append(f"# TYPE gpt2_{name} histogram")
                lines += [f'gpt2_{name}_bucket{{le="{bound}"}} {count}' for bound, count in zip(SECONDS, h["buckets"])]
                lines += [f'gpt2_{name}_bucket{{le="+Inf"}} {h["count"]}', f"gpt2_{name}_sum {h['sum']:.6f}",
                          f"gpt2_{name}_count {h['count']}"]
    return "\n".join(lines) + "\n"


# --- HTTP ---

def handler_for(engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive; streams are sent chunked

        def log_message(self, *args):  # one line per request is noise at a few hundred requests a second
            pass

        def do_GET(self):
            if self.path == "/health":
                ready = engine["decoder"] is not None
                self.send_json(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": engine["model"], "object": "model",
                                                                   "created": 0, "owned_by": "openai"}]})
            elif self.path == "/metrics":
                self.send_body(200, prometheus(engine).encode(), "text/plain; version=0.0.4")
            else:
                self.send_error_json(BadRequest(f"no such endpoint: GET {self.path}", status=404,
                                                kind="NotFoundError"))

        def do_POST(self):
            try:
                body = self.read_json()
                if self.path != "/v1/completions":
                    raise BadRequest(f"no such endpoint: POST {self.path}", status=404, kind="NotFoundError")
                if engine["decoder"] is None:
                    raise BadRequest("the model is still loading; retry when /health says ok", status=503,
                                     kind="server_busy")
                reqs, how = parse_completion(body, engine)
                box, indices = submit(engine, reqs, how["logprobs"] is not None)
            except BadRequest as e:
                return self.send_error_json(e)
            try:
                self.complete(box, indices, how)
            except OSError:  # the client went away mid-write
                self.close_connection = True
            finally:
                release(engine, indices)

        def read_json(self):
            key = engine["args"].api_key
            if key and not secrets.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                raise BadRequest("a valid API key is needed: 'Authorization: Bearer KEY'", status=401,
                                 kind="authentication_error")
            try:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not JSON: {e}")

        def complete(self, box, indices, how):
            encoder = engine["encoder"]
            choices = [new_choice(k, p, encoder, how) for k, p in enumerate(how["prompts"])]
            where = dict(zip(indices, choices))
            head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                    "model": engine["model"]}
            if how["stream"]:
                self.start_stream()
            look_at = time.monotonic() + 0.5
            while not all(c["finish_reason"] for c in choices):
                try:
                    e = box.get(timeout=0.5)
                except queue.Empty:
                    e = None
                if time.monotonic() > look_at:  # a client that left frees its rows (a stream notices at its next write)
                    if self.client_gone():
                        return
                    look_at = time.monotonic() + 0.5
                if e is None:
                    continue
                if e.kind == "error":
                    if how["stream"]:
                        return self.end_stream([{"error": {"message": e.error, "type": "server_error"}}])
                    return self.send_error_json(BadRequest(e.error, status=500, kind="server_error"))
                choice = where[e.index]
                if grow(choice, e, encoder, how):
                    release(engine, [e.index])
                if how["stream"]:
                    text = ready_text(choice, how["stop"])
                    if text or choice["finish_reason"]:
                        self.send_event({**head, "choices": [
                            {"index": choice["index"], "text": text, "logprobs": new_logprobs(choice),
                             "finish_reason": choice["finish_reason"]}]})
            completion_tokens = sum(len(c["tokens"]) for c in choices)
            usage = {"prompt_tokens": how["prompt_tokens"], "completion_tokens": completion_tokens,
                     "total_tokens": how["prompt_tokens"] + completion_tokens}
            if how["stream"]:
                return self.end_stream([{**head, "choices": [], "usage": usage}] if how["usage"] else [])
            self.send_json(200, {**head, "usage": usage, "choices": [
                {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]}
                for c in choices]})

        def client_gone(self):
            """Whether the client closed its end (a readable socket with nothing to read)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
            except OSError:
                return True

        def send_json(self, status, obj):
            self.send_body(status, json.dumps(obj).encode(), "application/json")

        def send_error_json(self, e):
            self.send_json(e.status, {"error": {"message": e.message, "type": e.kind, "param": e.param,
                                                "code": e.status}})

        def send_body(self, status, data, content_type):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def start_stream(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def send_event(self, obj):
            self.send_chunk(f"data: {json.dumps(obj)}\n\n".encode())

        def send_chunk(self, data):
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def end_stream(self, last):
            for obj in last:
                self.send_event(obj)
            self.send_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
    return Handler


class Listener(ThreadingHTTPServer):
    request_queue_size = 1024  # connections the kernel holds until accepted (5 by default: a burst gets resets)
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that hung up is routine (its rows are already freed); anything else is printed."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def start(args, loaded=None):
    """Listen at once (/health says 503 while loading), load the models (or take loaded, as
    load does), start the engine. Returns (the HTTP server, serving on its own thread, and the engine)."""
    engine = new_engine(args)
    httpd = Listener((args.host, args.port), handler_for(engine))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    load(engine, loaded)
    threading.Thread(target=run_engine, args=(engine,), daemon=True).start()
    return httpd, engine


def stop(httpd, engine):
    """Stop taking connections; requests in flight end with an error event."""
    httpd.shutdown()
    with engine["lock"]:
        boxes = list(engine["outboxes"].items())
    for i, box in boxes:
        box.put(scheduler.Event("error", i, error="the server is shutting down"))
    engine["inbox"].put(("stop", None, None))
    deadline = time.monotonic() + 5.0
    while engine["outboxes"] and time.monotonic() < deadline:  # each handler writes its error, then releases
        time.sleep(0.01)
    httpd.server_close()


def check(args):
    if args.max_batch < 1 or args.max_queue < 1:
        raise ValueError("--max_batch and --max_queue must be >= 1")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.dtype != "float32" and args.backend == "numpy":
        raise ValueError(f"--dtype {args.dtype} needs --backend cupy; use --dtype float32")
    speculative.check(speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                                    draft_vocab=args.draft_vocab))


def serve_until_interrupted(argv=None):
    args = parse_args(argv)
    check(args)
    httpd, engine = start(args)
    host, port = httpd.server_address[:2]
    print(f"serving {engine['model']} ({args.mode}) at http://{host}:{port}/v1 - Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping", file=sys.stderr)
    finally:
        stop(httpd, engine)


def entry(argv=None):
    try:
        serve_until_interrupted(argv)
    except sampling.BadSetting as e:
        print(f"error: --{main.FLAG_OF.get(e.name, e.name)} {e.problem}", file=sys.stderr)
        return 2
    except (utils.LoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while loading
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(entry())
