"""An OpenAI-compatible HTTP server: /v1/completions on the continuous-batching scheduler.

    python server.py --target_model_size 355M --mode speculative --max_batch 8
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gpt2-medium", "prompt": "Alan Turing theorized", "max_tokens": 20, "stream": true}'

Every engine people run (vLLM, llama.cpp's server, TGI) speaks the OpenAI API, so every
client does too: the official `openai` package, curl, LangChain. The server is three parts:
- one engine thread runs scheduler.loop over a queue: requests (and cancellations) go
  in, and each event goes to the asyncio queue of the request it belongs to;
- FastAPI on uvicorn (what vLLM's OpenAI server runs on) turns a JSON body into
  batching.Requests (openai_api.py says what a body may hold), and the engine's tokens into
  text: whole, or as Server-Sent Events while they come;
- /v1/models, /health and /metrics (Prometheus text) say what runs and how it goes.

Between a socket and the engine, every resource a client can hold is bounded, so
that no slow or hostile client can hurt the others: the connections (--max_connections
open at once, the next gets 503), the time to send a request (--read_timeout_s), the body
(--max_body_bytes, 413), the tokens (--max_model_len) and the events waiting for a client.
A stream is written at its client's pace, and a client that lags keeps its text (one rule,
engine.PAUSE_RULE): its requests keep their rows while nobody needs them, are paused and
resumed bit for bit when someone does or when too many events wait for it, and it is cut
off once it has read none of its response for --write_timeout_s with its window full, or
for twice that if its window was open (filled between the two: a slow reader's reads may
not show before).
SIGTERM (what docker, systemd and Kubernetes send) and Ctrl-C both drain: every request in
flight ends with an error event (or a JSON error), then the process exits 0. If the engine
fails, every request gets a 500 naming why, /health says 503, and the process exits 1 (for
a supervisor to restart it).
"""
import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import sampling
import speculative
import utils
from cli import flags
from serving import engine as engines
from serving import openai_api, scheduler, sockets
from serving.openai_api import ApiError


def parse_args(argv=None):
    ap = flags.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_decoder_flags(ap, modes=("autoregressive", "speculative"), default="autoregressive")
    ap.add_argument("--max_batch", type=int, default=8, help="requests decoded at once (continuous batching)")
    ap.add_argument("--max_queue", type=int, default=256, help="requests waiting for a row; more get 503")
    flags.add_prefix_cache_flag(ap)
    flags.add_prefill_flag(ap)
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
                    help="how long a client may take none of its response; until then it loses nothing: "
                         + engines.PAUSE_RULE.replace("%", "%%"))
    ap.add_argument("--drain_s", type=float, default=10.0,
                    help="on SIGTERM or Ctrl-C, how long requests in flight get to take their last event")
    flags.add_model_flags(ap)
    return ap.parse_args(argv)


# --- a request's life on the event loop: events in, text out ---

async def grown(engine, box, how, choices):
    """Each choice as an event grows it, until all have finished; an error event (the
    engine's, a client too slow, the server stopping) raises ApiError, a client gone returns."""
    where = dict(zip(box["indices"], choices))
    while not all(c["finish_reason"] for c in choices):
        e, logprobs = await box["events"].get()
        engines.backlog(engine, box)
        if e.kind == "gone":
            return
        if e.kind == "error":
            status = 503 if engine["stopping"] else 500
            raise ApiError(e.error, status=status, kind="server_error")
        choice = where[e.index]
        if openai_api.grow(choice, e, engine["encoder"], how, logprobs):
            engines.release(engine, [e.index])
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
    """OpenAI's usage; a prompt's cached tokens are those none of its choices computed."""
    completion_tokens = sum(len(c["tokens"]) for c in choices)
    n = len(choices) // max(len(how["prompt_ids"]), 1)
    cached = sum(min(c.get("cached_tokens", 0) for c in choices[k:k + n]) for k in range(0, len(choices), n))
    return openai_api.Usage(prompt_tokens=how["prompt_tokens"], completion_tokens=completion_tokens,
                            total_tokens=how["prompt_tokens"] + completion_tokens,
                            prompt_tokens_details=openai_api.PromptTokensDetails(cached_tokens=cached))


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
                await box["connection"].paced()  # meanwhile its events wait here, and may pause it
                yield sse(chunk.model_dump_json(exclude={"usage"}))
        if how["usage"]:
            yield sse(openai_api.Completion(**head, choices=[], usage=usage(how, choices)).model_dump_json())
    except ApiError as e:
        yield sse(json.dumps(sockets.envelope(e)))
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


# --- HTTP: the routes ---

def make_app(engine):
    """The FastAPI app: the routes, and every error as OpenAI's envelope. A path with a
    slash at its end is unknown (404), not redirected: Starlette's 307 took its host from the
    client's Host header, and sent a client's body on to wherever that said."""
    app = FastAPI(title="speculative-gpt2", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        return sockets.error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return sockets.error_response(ApiError(f"{e.detail}: {request.method} {openai_api.quoted(request.url.path)}",
                                               status=e.status_code, kind=kind))

    @app.api_route("/health", methods=["GET", "HEAD"])  # some health checkers send HEAD
    async def health():
        if engine["failed"]:
            return JSONResponse({"status": "failed", "error": engine["failed"]}, status_code=503)
        ready = engine["decoder"] is not None
        return JSONResponse({"status": "ok" if ready else "loading"}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine["model"], "object": "model", "created": 0,
                                            "owned_by": "openai"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engines.prometheus(engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = openai_api.parse(await request.body())  # JSON, whatever Content-Type says (curl -d says a form)
        if engine["decoder"] is None:
            raise ApiError("the model is still loading; retry when /health says ok", status=503, kind="server_busy")
        reqs, how = openai_api.to_requests(body, engine["model"], engine["encoder"], engine["hparams"],
                                           engine["max_model_len"], engine["args"].max_queue)
        box = engines.submit(engine, reqs, how["logprobs"])
        choices = [openai_api.new_choice(k, p, engine["encoder"], how) for k, p in enumerate(how["prompts"])]
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": engine["model"]}
        if how["stream"]:
            box["connection"] = request.scope["state"]["connection"]  # its socket tells when its client lags
            return EventStream(events(engine, box, how, choices, head),
                               lambda: engines.release(engine, box["indices"]))
        connection = request.scope["state"]["connection"]
        watcher = asyncio.create_task(watch_for_hang_up(request.receive, box, connection))
        try:
            async for _ in grown(engine, box, how, choices):
                pass
        finally:
            watcher.cancel()
            connection.on_half_close = None
            engines.release(engine, box["indices"])
        completion = openai_api.Completion(**head, usage=usage(how, choices),
                                           choices=[choice_out(c, c["text"]) for c in choices])
        return Response(completion.model_dump_json(), media_type="application/json")

    return app


def listen(args, engine):
    """Serve the engine's routes on uvicorn, on a thread of its own: the HTTP server."""
    try:
        listener = sockets.listener(args.host, args.port, args.max_connections)
    except OSError as e:
        raise OSError(f"cannot listen on {args.host}:{args.port} ({os.strerror(e.errno)}): pick another --port or --host")
    app = sockets.guard(make_app(engine), args.api_key, args.max_body_bytes, args.read_timeout_s)
    http = sockets.connection_protocol(listener, args.max_connections, args.read_timeout_s, args.write_timeout_s)
    config = uvicorn.Config(app, http=http, lifespan="off", log_level="warning", access_log=False,
                            backlog=sockets.BACKLOG, timeout_keep_alive=args.keep_alive_s,
                            timeout_graceful_shutdown=args.drain_s)
    httpd = sockets.Server(config, engine)
    httpd.address = listener.getsockname()[:2]
    httpd.thread = threading.Thread(target=httpd.run, kwargs={"sockets": [listener]}, daemon=True)
    httpd.thread.start()
    return httpd


def start(args, loaded=None):
    """Listen at once (/health says 503 while loading), load the models (or take loaded, as
    engine.load does), start the engine. Returns (the HTTP server, serving on its own thread, and the engine)."""
    engine = engines.new_engine(args)
    httpd = listen(args, engine)
    engines.load(engine, loaded)
    threading.Thread(target=engines.run_engine, args=(engine,), daemon=True).start()
    return httpd, engine


def stop(httpd, engine):
    """Stop taking connections; requests in flight end with an error event, then their
    connections close (or are cut off after --drain_s); the engine stops."""
    httpd.should_exit = True
    httpd.thread.join(engine["args"].drain_s + 5)
    engine["inbox"].put(("stop", None, None))


def check(args):
    for name in ("max_batch", "max_queue"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max_model_len must be >= 2 (a prompt token and a new one), got {args.max_model_len}")
    key = args.api_key
    if key is not None and not (key and key == key.strip() and key.isascii() and key.isprintable()):
        # an empty key let 'Bearer ' in; one with spaces at its ends, or not ASCII, no client could send
        raise ValueError("--api_key must be printable ASCII, not empty and without spaces at its ends")
    for name in ("max_connections", "max_body_bytes", "keep_alive_s", "read_timeout_s", "write_timeout_s",
                 "drain_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name} must be > 0, got {getattr(args, name)}")
    sockets.enough_files(args.max_connections)
    flags.check_dtypes(args)
    flags.check_prefix_cache(args)
    flags.check_prefill(args)
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
    for note in (flags.draft_flags_note(args, parse_args([])), flags.prefix_cache_note(args),
                 flags.chunked_prefill_note(args)):
        if note:
            print(note, file=sys.stderr)
    while not stop_asked.wait(1.0) and httpd.thread.is_alive() and not engine["failed"]:
        pass
    print(f"error: {engine['failed']}: stopping" if engine["failed"] else "stopping", file=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the drain and the exit are the answer to one: more would
        signal.signal(sig, signal.SIG_IGN)  # land while Python exits, with its default handlers back (-15)
    stop(httpd, engine)
    return 1 if engine["failed"] else 0


def entry(argv=None):
    try:
        return serve_until_stopped(argv)
    except sampling.BadSetting as e:
        print(f"error: --{flags.FLAG_OF.get(e.name, e.name)} {e.problem}", file=sys.stderr)
        return 2
    except (utils.LoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while loading
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(entry())
