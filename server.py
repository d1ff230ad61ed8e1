"""An OpenAI-compatible HTTP server: /v1/completions on the continuous-batching scheduler.

    python server.py --target_model_size 355M --mode speculative --max_batch 8
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gpt2-medium", "prompt": "Alan Turing theorized", "max_tokens": 20, "stream": true}'

Every engine people run (vLLM, llama.cpp's server, TGI) speaks the OpenAI API, so every
client does too: the official `openai` package, curl, LangChain. The server is three parts:
- one engine thread runs scheduler.serving over a queue: requests (and cancellations) go
  in, and each event goes to the asyncio queue of the request it belongs to;
- FastAPI on uvicorn (what vLLM's OpenAI server runs on) turns a JSON body into
  batching.Requests (openai_api.py says what a body may hold), and the engine's tokens into
  text: whole, or as Server-Sent Events while they come;
- /v1/models, /health and /metrics (Prometheus text) say what runs and how it goes.

Between a socket and the engine, every resource a client can hold is bounded, so
that no slow or hostile client can hurt the others: the connections (--max_connections
open at once, the next gets 503), the time to send a request (--read_timeout_s), the body
(--max_body_bytes, 413), the tokens (--max_model_len) and the events waiting for a client.
A client that lags in taking a stream keeps its text (one rule, PAUSE_RULE below): its
requests keep their rows while nobody needs them, are paused and resumed bit for bit when
someone does or when too many events wait for it, and it is cut off only after
--write_timeout_s in which it took none of its response.
SIGTERM (what docker, systemd and Kubernetes send) and Ctrl-C both drain: every request in
flight ends with an error event (or a JSON error), then the process exits 0.
"""
import argparse
import asyncio
import hmac
import json
import os
import queue
import secrets
import signal
import socket
import struct
import sys
import threading
import time

try:
    import fcntl
    import resource
except ImportError:  # Windows
    fcntl = resource = None
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

import batching
import main
import openai_api
import sampling
import scheduler
import speculative
import utils
from openai_api import ApiError

# the name each size is served under: the names its checkpoints carry on Hugging Face
MODEL_NAMES = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # histogram buckets
# events waiting per row for a lagging client before its requests are paused; past
# HARD_EVENTS_PER_ROW (only reached while max_batch streams are paused already) it is cancelled
EVENTS_PER_ROW, HARD_EVENTS_PER_ROW = 1024, 4096
# the one rule for a client that lags, as --help and README section 7 state it
PAUSE_RULE = ("a stream whose client lags keeps its rows while no request waits for one; it is paused "
              f"(its rows freed, its text kept) when one does or when {EVENTS_PER_ROW} of its events per row "
              "wait unsent, and resumes where it stood once the client has caught up; a client that takes "
              "none of its response for --write_timeout_s is cut off")
# A stream's client lags while any of its response waits in the kernel unsent (its receive
# window is full); a lagging stream is looked at again every LAG_CHECK_S seconds
LAG_CHECK_S = 0.05
SIOCOUTQNSD = 0x894B  # Linux's ioctl for the bytes of a socket's send queue not yet sent
TCPI_BYTES_ACKED = 120  # where Linux's struct tcp_info keeps the bytes the peer has acknowledged (u64)
SEND_BUFFER = 16 * 1024  # bytes of response asyncio, and twice that the kernel, hold for a client not reading
FILES_TO_SPARE = 64  # open files besides the connections: the listener, checkpoints, pipes, numba's cache
BUSY_BODY = b'{"error": {"message": "too many connections; retry later", "type": "server_busy", "param": null, "code": 503}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BUSY_BODY), BUSY_BODY))


def parse_args(argv=None):
    ap = main.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    main.add_decoder_flags(ap, modes=("autoregressive", "speculative"), default="autoregressive")
    ap.add_argument("--max_batch", type=int, default=8, help="requests decoded at once (continuous batching)")
    ap.add_argument("--max_queue", type=int, default=256, help="requests waiting for a row; more get 503")
    ap.add_argument("--max_model_len", type=int,
                    help="prompt + max_tokens a request may ask for (default: the model's window, 1024); "
                         "more slides the window, as main.py does")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves other machines too")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api_key", help="if set, every route but /health needs 'Authorization: Bearer KEY'")
    ap.add_argument("--max_connections", type=int, default=1024, help="open connections; a request past it gets 503")
    ap.add_argument("--max_body_bytes", type=int, default=1 << 20, help="a larger request body gets 413")
    ap.add_argument("--keep_alive_s", type=float, default=5.0, help="an idle kept-alive connection is closed")
    ap.add_argument("--read_timeout_s", type=float, default=10.0,
                    help="a request's headers and body must arrive within this, or the connection is closed")
    ap.add_argument("--write_timeout_s", type=float, default=10.0,
                    help="a client that takes none of its response for this long is cut off, its rows freed; "
                         "until then it loses nothing: " + PAUSE_RULE.replace("%", "%%"))
    ap.add_argument("--drain_s", type=float, default=10.0,
                    help="on SIGTERM or Ctrl-C, how long requests in flight get to take their last event")
    main.add_model_flags(ap)
    return ap.parse_args(argv)


# --- the engine: one thread that owns the models, the batch and the scheduler ---

def new_engine(args):
    """The engine's state before its models load: /health answers 503 until "decoder" is set."""
    return {"args": args, "inbox": queue.Queue(), "outboxes": {}, "lock": threading.Lock(), "next_index": 0,
            "stats": batching.Stats(), "metrics": new_metrics(), "waiting": set(), "running": set(), "paused": set(),
            "logprobs": {},  # index -> how many top tokens its token events report (for logprobs)
            "lagging": {},  # index -> whether its events back up, of the requests whose clients lag
            "stopping": False, "decoder": None, "encoder": None, "hparams": None,
            "model": MODEL_NAMES[args.target_model_size]}


def load(engine, loaded=None):
    """Load the models (downloading what is missing) and build the decoder the engine runs.
    loaded: (encoder, target, drafter) already in memory (the benchmark's random models)."""
    args = engine["args"]
    encoder, target, drafter = loaded or main.load_models(args, lambda line: print(line, file=sys.stderr))
    if args.mode == "speculative":
        config = speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                               draft_vocab=args.draft_vocab)
        decoder = scheduler.speculative_decoder(target, drafter, config)
    else:
        decoder = scheduler.autoregressive(target)
    engine["encoder"], engine["hparams"], engine["decoder"] = encoder, target[1], decoder
    engine["max_model_len"] = args.max_model_len or target[1]["n_ctx"]


def run_engine(engine):
    """The engine thread: serve whatever the handlers submit until told to stop."""
    step, models = engine["decoder"]
    stopped, lagging = [], engine["lagging"]  # as watch_lag and backlog tell it

    def intake(now, idle):  # scheduler.serving's intake: block on the inbox only while nothing runs
        items = [engine["inbox"].get()] if idle and not stopped else []
        while True:
            try:
                items.append(engine["inbox"].get_nowait())
            except queue.Empty:
                break
        stopped.extend(item for item in items if item[0] == "stop")
        for kind, i, state in items:
            if kind == "lag" and any(state):  # (its client lags, its events back up)
                lagging[i] = state[1]
            elif kind in ("lag", "cancel"):
                lagging.pop(i, None)
        return ([(i, r) for kind, i, r in items if kind == "request"],
                [i for kind, i, _ in items if kind == "cancel"], bool(stopped), lagging)

    n_ctx = engine["hparams"]["n_ctx"]
    last_token_at = {}
    for e in scheduler.serving(intake, step, models, engine["args"].max_batch, n_ctx, stats=engine["stats"]):
        now, n_top = time.perf_counter(), None
        with engine["lock"]:
            box = engine["outboxes"].get(e.index)  # None once its handler has let it go
            if e.kind in ("paused", "resumed"):  # preemption: its row went to a waiting request, or came back
                if box:
                    now_paused = e.kind == "paused"
                    engine["paused" if now_paused else "running"].add(e.index)
                    engine["running" if now_paused else "paused"].discard(e.index)
                engine["metrics"]["num_preemptions_total"] += e.kind == "paused"
                continue
            if e.kind == "token":
                engine["metrics"]["generation_tokens_total"] += 1
                if e.index in last_token_at:
                    observe(engine["metrics"]["inter_token_latency_seconds"], now - last_token_at[e.index])
                last_token_at[e.index] = now
                if box:
                    engine["waiting"].discard(e.index)
                    engine["running"].add(e.index)
                n_top = engine["logprobs"].get(e.index)
            else:
                last_token_at.pop(e.index, None)
                if e.kind == "finished":
                    for name, key in (("time_to_first_token_seconds", "ttft_s"), ("request_queue_time_seconds",
                                      "queue_s"), ("e2e_request_latency_seconds", "e2e_s")):
                        observe(engine["metrics"][name], e.metrics[key])
        if box:
            # a view would keep the whole step's logits alive: copy this row, or none; the event
            # loop turns it into logprobs (not this thread: every row's next step waits on it)
            logits = e.logits.copy() if e.kind == "token" and n_top is not None else None
            e.logits = None
            box["loop"].call_soon_threadsafe(deliver, engine, box, e, logits, n_top)


def submit(engine, reqs, logprobs=None):
    """(on the event loop) Hand requests to the engine; returns their box: the asyncio queue
    their events arrive on, and their indices. logprobs: how many top tokens each token reports."""
    loop = asyncio.get_running_loop()
    box = {"events": asyncio.Queue(), "loop": loop, "rows": len(reqs), "closed": False,
           "lagging": False, "backed_up": False}
    with engine["lock"]:
        if engine["stopping"]:
            raise ApiError("the server is shutting down", status=503, kind="server_busy")
        if len(engine["waiting"]) + len(reqs) > engine["args"].max_queue:
            raise ApiError(f"the server has {len(engine['waiting'])} requests waiting (--max_queue "
                           f"{engine['args'].max_queue}); retry later", status=503, kind="server_busy")
        box["indices"] = list(range(engine["next_index"], engine["next_index"] + len(reqs)))
        engine["next_index"] += len(reqs)
        for i, r in zip(box["indices"], reqs):
            engine["outboxes"][i] = box
            engine["waiting"].add(i)
            if logprobs is not None:
                engine["logprobs"][i] = logprobs
            engine["metrics"]["prompt_tokens_total"] += len(r.prompt)
    arrival = time.perf_counter() - engine["stats"].start
    for i, r in zip(box["indices"], reqs):
        engine["inbox"].put(("request", i, batching.Request(**{**vars(r), "arrival_s": arrival})))
    return box


def release(engine, indices):
    """The handler is done with these requests: stop any still decoding or waiting, forget them."""
    with engine["lock"]:
        for i in indices:
            engine["outboxes"].pop(i, None)
            engine["logprobs"].pop(i, None)
            engine["waiting"].discard(i)
            engine["running"].discard(i)
            engine["paused"].discard(i)
    for i in indices:
        engine["inbox"].put(("cancel", i, None))


def deliver(engine, box, e, logits=None, n_top=None):
    """(on the event loop) An event into its request's queue. A handler takes events as fast
    as they come unless its client's socket is full: then it waits to write, and the events
    pile up, until backlog pauses its requests (HARD_EVENTS_PER_ROW cancels them, a bound
    for memory that only binds while every pause a batch allows is taken)."""
    if box["closed"]:
        return
    if box["events"].qsize() >= HARD_EVENTS_PER_ROW * box["rows"]:
        e = scheduler.Event("error", e.index, error="the client did not read its response; request cancelled")
    if e.kind == "error":
        box["closed"] = True
        release(engine, box["indices"])
    logprobs = None if logits is None or e.kind != "token" else openai_api.token_logprobs(logits, e.token, n_top)
    box["events"].put_nowait((e, logprobs))  # a few numbers wait for a slow client, not a logits row
    backlog(engine, box)
    if e.kind == "token" and box.get("connection") and not box["lagging"] and unsent_bytes(
            box["connection"].transport) > 0:
        watch_lag(engine, box)


def backlog(engine, box):
    """(on the event loop, as events come and go) A stream's events back up once
    EVENTS_PER_ROW per row wait: the engine pauses its requests (scheduler.preempt) until
    its handler has sent half of them."""
    waiting = box["events"].qsize()
    backed_up = waiting >= EVENTS_PER_ROW * box["rows"] or box["backed_up"] and waiting > EVENTS_PER_ROW * box["rows"] // 2
    if backed_up != box["backed_up"]:
        box["backed_up"] = backed_up
        tell_lag(engine, box)


def tell_lag(engine, box):
    for i in box["indices"]:
        if i in engine["outboxes"]:  # not yet released (and so not yet cancelled)
            engine["inbox"].put(("lag", i, (box["lagging"], box["backed_up"])))


def unsent_bytes(transport):
    """Bytes of a response that its client's kernel has not taken yet: none while it reads
    (no Nagle delay, and a token stream is far below any network's rate), and growing once
    its receive window is full. Linux only (SIOCOUTQNSD): elsewhere 0, no client lags, and
    only backlog pauses a slow one."""
    sock = transport.get_extra_info("socket")
    if fcntl is None or not sys.platform.startswith("linux") or sock is None or sock.fileno() < 0:
        return 0
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, bytes(4)))[0]


def watch_lag(engine, box):
    """(on the event loop) A stream whose client lags: the engine may pause its requests and
    give their rows to waiting ones (scheduler.preempt) until the client has taken everything
    sent to it; then they resume. Looks every LAG_CHECK_S while it lags; meanwhile its
    connection watches that the client takes something (Connection.watch_writes)."""
    live = [i for i in box["indices"] if i in engine["outboxes"]]  # not yet released
    connection = box["connection"]
    if box["closed"] or not live or connection.transport.is_closing():
        return
    lags = unsent_bytes(connection.transport) > 0
    if lags != box["lagging"]:
        box["lagging"] = lags
        tell_lag(engine, box)
    if lags:
        connection.watch_writes()
        box["loop"].call_later(LAG_CHECK_S, watch_lag, engine, box)


def end_all(engine, message):
    """(on the event loop) Every request in flight gets an error event; no new ones are taken."""
    with engine["lock"]:
        engine["stopping"] = True
        boxes = {id(box): box for box in engine["outboxes"].values()}.values()
    for box in boxes:
        deliver(engine, box, scheduler.Event("error", box["indices"][0], error=message))


# --- a request's life on the event loop: events in, text out ---

async def grown(engine, box, how, choices):
    """Each choice as an event grows it, until all have finished; an error event (the
    engine's, a client too slow, the server stopping) raises ApiError, a client gone returns."""
    where = dict(zip(box["indices"], choices))
    while not all(c["finish_reason"] for c in choices):
        e, logprobs = await box["events"].get()
        backlog(engine, box)
        if e.kind == "gone":
            return
        if e.kind == "error":
            status = 503 if engine["stopping"] else 500
            raise ApiError(e.error, status=status, kind="server_error")
        choice = where[e.index]
        if openai_api.grow(choice, e, engine["encoder"], how, logprobs):
            release(engine, [e.index])
        yield choice


async def watch_for_hang_up(receive, box, connection):
    """Tell the request's loop when its client goes away (a closed or half-closed
    connection, or one cut off for not reading), so that its rows are freed at once, not at
    its next write."""
    def gone():
        if connection.half_closed:
            connection.transport.close()  # so that nothing is written: the client has left
        box["events"].put_nowait((scheduler.Event("gone", -1), None))
    connection.on_half_close = gone
    if connection.half_closed:
        return gone()
    while (await receive())["type"] != "http.disconnect":
        pass
    gone()


def usage(how, choices):
    completion_tokens = sum(len(c["tokens"]) for c in choices)
    return openai_api.Usage(prompt_tokens=how["prompt_tokens"], completion_tokens=completion_tokens,
                            total_tokens=how["prompt_tokens"] + completion_tokens)


def choice_out(choice, text):
    return openai_api.Choice(index=choice["index"], text=text, logprobs=openai_api.new_logprobs(choice),
                             finish_reason=choice["finish_reason"])


async def events(engine, box, how, choices, head):
    """The Server-Sent Events of a stream: each choice's new text as it comes (never a part
    that might become a stop string), the usage if asked for, then [DONE]."""
    try:
        async for choice in grown(engine, box, how, choices):
            text = openai_api.ready_text(choice, how["stop"])
            if text or choice["finish_reason"]:
                chunk = openai_api.Completion(**head, choices=[choice_out(choice, text)])
                yield sse(chunk.model_dump_json(exclude={"usage"}))
        if how["usage"]:
            yield sse(openai_api.Completion(**head, choices=[], usage=usage(how, choices)).model_dump_json())
    except ApiError as e:
        yield sse(json.dumps(envelope(e)))
    yield sse("[DONE]")


def sse(data):
    return f"data: {data}\n\n".encode()


class EventStream(StreamingResponse):
    """Server-Sent Events whose end, however it comes (done, client gone or cut off, server
    stopping), frees the request's rows."""

    def __init__(self, body, finish):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.finish = finish

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.finish()


# --- metrics, in Prometheus's text format ---

def new_metrics():
    return {"prompt_tokens_total": 0, "generation_tokens_total": 0, "num_preemptions_total": 0,
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
        m, stats, spec = engine["metrics"], engine["stats"], engine["args"].mode == "speculative"
        lines = []
        for name in ("running", "waiting", "paused"):
            lines += [f"# TYPE gpt2_num_requests_{name} gauge", f"gpt2_num_requests_{name} {len(engine[name])}"]
        counters = {name: m[name] for name in ("prompt_tokens_total", "generation_tokens_total",
                                               "num_preemptions_total")}
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


# --- HTTP: the routes ---

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


def make_app(engine):
    """The FastAPI app: the routes, and every error as OpenAI's envelope."""
    app = FastAPI(title="speculative-gpt2", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(f"{e.detail}: {request.method} {request.url.path}", status=e.status_code,
                                       kind=kind))

    @app.api_route("/health", methods=["GET", "HEAD"])  # some health checkers send HEAD
    async def health():
        ready = engine["decoder"] is not None
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine["model"], "object": "model", "created": 0,
                                            "owned_by": "openai"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = openai_api.parse(await request.body())  # JSON, whatever Content-Type says (curl -d says a form)
        if engine["decoder"] is None:
            raise ApiError("the model is still loading; retry when /health says ok", status=503, kind="server_busy")
        reqs, how = openai_api.to_requests(body, engine["model"], engine["encoder"], engine["hparams"],
                                           engine["max_model_len"], engine["args"].max_queue)
        box = submit(engine, reqs, how["logprobs"])
        choices = [openai_api.new_choice(k, p, engine["encoder"], how) for k, p in enumerate(how["prompts"])]
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": engine["model"]}
        if how["stream"]:
            box["connection"] = request.scope["state"]["connection"]  # its socket tells when its client lags
            return EventStream(events(engine, box, how, choices, head), lambda: release(engine, box["indices"]))
        connection = request.scope["state"]["connection"]
        watcher = asyncio.create_task(watch_for_hang_up(request.receive, box, connection))
        try:
            async for _ in grown(engine, box, how, choices):
                pass
        finally:
            watcher.cancel()
            connection.on_half_close = None
            release(engine, box["indices"])
        completion = openai_api.Completion(**head, usage=usage(how, choices),
                                           choices=[choice_out(c, c["text"]) for c in choices])
        return Response(completion.model_dump_json(), media_type="application/json")

    return app


# --- HTTP: the limits a socket needs that a web framework does not set ---

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


def listen(args, engine):
    """Serve the engine's routes on uvicorn, on a thread of its own: the HTTP server."""
    try:
        listener = socket.create_server((args.host, args.port), backlog=2048)
    except OSError as e:
        raise OSError(f"cannot listen on {args.host}:{args.port} ({os.strerror(e.errno)}): pick another --port or --host")
    app = guard(make_app(engine), args.api_key, args.max_body_bytes, args.read_timeout_s)
    config = uvicorn.Config(app, http=connection_protocol(args.max_connections, args.read_timeout_s, args.write_timeout_s),
                            lifespan="off", log_level="warning", access_log=False,  # connections: Connection
                            timeout_keep_alive=args.keep_alive_s,
                            timeout_graceful_shutdown=args.drain_s)
    httpd = Server(config, engine)
    httpd.address = listener.getsockname()[:2]
    httpd.thread = threading.Thread(target=httpd.run, kwargs={"sockets": [listener]}, daemon=True)
    httpd.thread.start()
    return httpd


def start(args, loaded=None):
    """Listen at once (/health says 503 while loading), load the models (or take loaded, as
    load does), start the engine. Returns (the HTTP server, serving on its own thread, and the engine)."""
    engine = new_engine(args)
    httpd = listen(args, engine)
    load(engine, loaded)
    threading.Thread(target=run_engine, args=(engine,), daemon=True).start()
    return httpd, engine


def stop(httpd, engine):
    """Stop taking connections; requests in flight end with an error event, then their
    connections close (or are cut off after --drain_s); the engine stops."""
    httpd.should_exit = True
    httpd.thread.join(engine["args"].drain_s + 5)
    engine["inbox"].put(("stop", None, None))


def check(args):
    if args.max_batch < 1 or args.max_queue < 1:
        raise ValueError("--max_batch and --max_queue must be >= 1")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max_model_len must be >= 2 (a prompt token and a new one), got {args.max_model_len}")
    for name in ("max_connections", "max_body_bytes", "keep_alive_s", "read_timeout_s", "write_timeout_s",
                 "drain_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} must be > 0, got {getattr(args, name)}")
    enough_files(args.max_connections)
    main.check_dtypes(args)
    speculative.check(speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                                    draft_vocab=args.draft_vocab))


def serve_until_stopped(argv=None):
    args = parse_args(argv)
    check(args)
    httpd, engine = start(args)
    host, port = httpd.address
    stop_asked = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_asked.set())
    print(f"serving {engine['model']} ({args.mode}) at http://{host}:{port}/v1 - Ctrl-C stops", flush=True)
    while not stop_asked.wait(1.0) and httpd.thread.is_alive():
        pass
    print("stopping", file=sys.stderr)
    stop(httpd, engine)


def entry(argv=None):
    try:
        serve_until_stopped(argv)
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
