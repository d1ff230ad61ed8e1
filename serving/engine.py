"""The engine: one thread that owns the models, the batch and the scheduler, and hands
each request's events to the event loop that answers it.

Handlers submit requests (and cancellations) into the engine's inbox; scheduler.loop
runs them; each event goes to the asyncio queue of the request it belongs to. Between
the two, the one rule for a client that lags (PAUSE_RULE): its events may wait in memory,
up to EVENTS_PER_ROW per row; past that, or when a request needs its row, the engine
pauses its requests (scheduler.preempt) until the client has caught up. /metrics reads
the engine's counters (Prometheus's text format).
"""
import asyncio
import queue
import sys
import threading
import time

import batching
import kv_cache
import speculative
from cli import flags, loading
from serving import openai_api, prefix_cache, scheduler
from serving.openai_api import ApiError

# the name each size is served under: the names its checkpoints carry on Hugging Face
MODEL_NAMES = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1558M": "gpt2-xl"}
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # histogram buckets
# events waiting per row for a lagging client before its requests are paused; past
# HARD_EVENTS_PER_ROW (only reached while max_batch streams are paused already) it is cancelled
EVENTS_PER_ROW, HARD_EVENTS_PER_ROW = 256, 4096
# the one rule for a client that lags, as --help states it
PAUSE_RULE = ("a stream is written at its client's pace (while it has less unread than 16 KiB or an eighth "
              "of its TCP window, whichever is larger, and at most half of it); a stream whose client lags keeps "
              "its rows while no request waits for one; it is paused (its rows freed, its text kept) when one "
              f"does or when {EVENTS_PER_ROW} of its events per row wait unsent, and resumes where it stood, into "
              "the next free row ahead of waiting requests, once the client has caught up; a client that reads "
              "none of its response for --write_timeout_s (as its TCP window tells, asked every second) is cut "
              "off then if its window is full, else its window is filled (a slow reader's reads may not show "
              "before) and it is cut off if it reads none for --write_timeout_s more (and, while max_batch "
              f"streams are paused already, a stream with {HARD_EVENTS_PER_ROW} events per row unsent is "
              "cancelled)")
# A stream's client lags while it is behind (sockets.py: Connection.behind); a lagging stream
# is looked at again every LAG_CHECK_S seconds
LAG_CHECK_S = 0.05


def new_engine(args):
    """The engine's state before its models load: /health answers 503 until "decoder" is set."""
    return {"args": args, "inbox": queue.Queue(), "outboxes": {}, "lock": threading.Lock(), "next_index": 0,
            "stats": batching.Stats(), "metrics": new_metrics(), "waiting": set(), "running": set(), "paused": set(),
            "logprobs": {},  # index -> how many top tokens its token events report (for logprobs)
            "lagging": {},  # index -> whether its events back up, of the requests whose clients lag
            "prefix_cache": prefix_cache.new_prefix_cache(args.prefix_cache_mib << 20),
            "stopping": False, "failed": None, "decoder": None, "encoder": None, "hparams": None,
            "model": MODEL_NAMES[args.target_model_size]}


def log_to_stderr(line):
    print(line, file=sys.stderr)


def load(engine, loaded=None):
    """Load the models (downloading what is missing) and build the decoder the engine runs.
    loaded: (encoder, target, drafter) already in memory (the benchmark's random models)."""
    args = engine["args"]
    formats = [args.dtype] + ([flags.draft_dtype(args)] if loading.separate_draft(args) else [])
    with loading.compile_ahead(args, [(dtype, loading.EVERY_TILE) for dtype in ([] if loaded else formats)]):
        encoder, target, drafter = loaded or loading.load_models(args, log_to_stderr)
    for model in (target, drafter.model) if drafter and drafter.model else (target,):
        loading.warm(model, loading.EVERY_TILE)  # no request waits for a compile
    if args.mode == "speculative":
        config = speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                               draft_vocab=args.draft_vocab)
        decoder = scheduler.speculative_decoder(target, drafter, config)
    else:
        decoder = scheduler.autoregressive(target)
    for params, hparams in decoder[1].values():  # the caches serve_requests makes: refused now, not in its thread
        kv_cache.check_room(hparams, args.max_batch, hparams["n_ctx"], like=params["wpe"])
    engine["encoder"], engine["hparams"], engine["decoder"] = encoder, target[1], decoder
    engine["max_model_len"] = args.max_model_len or target[1]["n_ctx"]


def run_engine(engine):
    """The engine thread: serve whatever the handlers submit until told to stop. If it fails
    (a bug, memory refused), every request in flight or waiting gets an error naming why,
    /health says 503 and server.py exits non-zero: never a server that looks alive while its
    requests hang."""
    try:
        serve_requests(engine)
    except Exception as e:
        fail(engine, f"the engine stopped: {type(e).__name__}: {e}")
        raise  # its traceback to stderr, for whoever reads the log


def fail(engine, message):
    with engine["lock"]:
        engine["failed"] = message
        boxes = {id(box): box for box in engine["outboxes"].values()}.values()
    for box in boxes:
        box["loop"].call_soon_threadsafe(deliver, engine, box, scheduler.Event("error", box["indices"][0],
                                                                                error=message))


def serve_requests(engine):
    step, models = engine["decoder"]
    stopped, lagging = [], engine["lagging"]  # as watch_lag and backlog tell it

    def intake(now, idle):  # scheduler.loop's intake: block on the inbox only while nothing runs
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
    last_token_at, prefix = {}, engine["prefix_cache"]
    args = engine["args"]
    for e in scheduler.loop(intake, step, models, args.max_batch, n_ctx, stats=engine["stats"],
                               prefix=engine["prefix_cache"], max_prefill_tokens=flags.prefill_budget(args)):
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
                for gauge in ("waiting", "running", "paused"):  # it runs no more, whatever is left to send
                    engine[gauge].discard(e.index)
                if e.kind == "finished" and e.metrics:  # None: cancelled before its first token
                    for name, key in (("time_to_first_token_seconds", "ttft_s"), ("request_queue_time_seconds",
                                      "queue_s"), ("e2e_request_latency_seconds", "e2e_s")):
                        observe(engine["metrics"][name], e.metrics[key])
        if prefix["refused"] and not prefix.get("told"):
            prefix["told"] = True
            log_to_stderr(f"warning: no prefix cache from now on: {prefix['refused']}")
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
        if engine["failed"]:
            raise ApiError(engine["failed"], status=503, kind="server_error")
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
        engine["inbox"].put(("request", i, batching.Request(**{**vars(r), "arrival_s": arrival,
                                                                "wants_logits": logprobs is not None})))
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
    if e.kind == "token" and box.get("connection") and not box["lagging"] and box["connection"].behind():
        watch_lag(engine, box)


def backlog(engine, box):
    """(on the event loop, as events come and go) A stream's events back up once
    EVENTS_PER_ROW per row wait: the engine pauses its requests (scheduler.preempt) until
    its handler has sent half of them."""
    waiting, bound = box["events"].qsize(), EVENTS_PER_ROW * box["rows"]
    backed_up = waiting >= bound or box["backed_up"] and waiting > bound // 2
    if backed_up != box["backed_up"]:
        box["backed_up"] = backed_up
        tell_lag(engine, box)
        connection = box.get("connection")
        if connection is not None:  # watched on its window's edge while its events are held back
            connection.held = backed_up
            if backed_up:
                connection.watch_writes()


def tell_lag(engine, box):
    for i in box["indices"]:
        if i in engine["outboxes"]:  # not yet released (and so not yet cancelled)
            engine["inbox"].put(("lag", i, (box["lagging"], box["backed_up"])))


def watch_lag(engine, box):
    """(on the event loop) A stream whose client lags: the engine may pause its requests and
    give their rows to waiting ones (scheduler.preempt) until the client is no longer behind;
    then they resume. Looks every LAG_CHECK_S while it lags; meanwhile its
    connection watches that the client takes something (Connection.watch_writes)."""
    live = [i for i in box["indices"] if i in engine["outboxes"]]  # not yet released
    connection = box["connection"]
    if box["closed"] or not live or connection.transport.is_closing():
        return
    lags = connection.behind()
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
        prefix = engine["prefix_cache"]  # its budget drops to 0 where the OS refuses it memory
        for name, value in (("prefix_cache_bytes", prefix["bytes"]), ("prefix_cache_budget_bytes", prefix["budget"]),
                            ("prefill_tokens_waiting", stats.prefill_waiting)):
            lines += [f"# TYPE gpt2_{name} gauge", f"gpt2_{name} {value}"]
        counters = {name: m[name] for name in ("prompt_tokens_total", "generation_tokens_total",
                                               "num_preemptions_total")}
        # prompt tokens looked up, and copied (from the cache or a row in flight)
        counters.update(prefix_cache_queries_total=prefix["queries"], prefix_cache_hits_total=prefix["hits"])
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
