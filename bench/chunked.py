"""`--only chunked`: chunked prefill (scheduler.loop's max_prefill_tokens) against
prompts run whole, in turns.

The workload (issue 59's): --chunked_streams streams (21) decode short prompts (16 tokens,
--chunked_stream_tokens new tokens each, 256), 7 at a time (when one ends the next
starts), while --chunked_long_prompts long prompts (--chunked_long_len tokens, 1000, and
16 new tokens each) arrive at seeded Poisson times, on average every LONG_EVERY prefills
of one such prompt (measured first on this machine, so the load is the same share of the
CPU whatever its speed). Every turn does the same work, so tokens/s compare. Plain
decoding, greedy, max_batch 8. Three turns: "whole" (every prompt in one pass, the streams waiting for it), "chunked"
(--chunked_budgets, each in its turn), and "quiet" (the streams alone: no long prompts),
whose inter-token latency is what a stream sees with nobody else's prompt in its way.
"""
import time

import numpy as np

import batching
import kv_cache
from bench.common import GREEDY, settle
from serving import scheduler

STREAMS, STREAM_PROMPT, LONG_TOKENS, LONG_EVERY = 7, 16, 16, 2.5


def prefill_seconds(model, n):
    """Seconds of one n-token prompt's prefill alone (its cache-only pass; the best of 2)."""
    params, hparams = model
    text = list(range(n))
    times = []
    for _ in range(2):
        cache = kv_cache.init_cache(hparams, 1, n, like=params["wpe"])
        start = time.perf_counter()
        kv_cache.cache_tokens(model, cache, text, n - 1)
        times.append(time.perf_counter() - start)
    return min(times)


def run_turn(model, long_at, max_prefill_tokens, seed, long_len, stream_tokens, n_streams):
    """One turn of the workload: n_streams streams, 7 at a time, while long prompts arrive at
    times long_at (s after the start). Returns the streams' gaps between tokens (s), the long
    prompts' first-token times (s), every generated token, and the seconds it took."""
    rng = np.random.default_rng(seed)
    reqs, kinds, sent = {}, {}, [0]
    active, arrived_long, start = [0], [0], time.perf_counter()

    def new(kind, prompt_len, n_new, arrival_s):
        i = len(reqs)
        reqs[i] = batching.Request(tuple(rng.integers(0, 50000, prompt_len).tolist()), n_new, GREEDY, seed=i,
                                   arrival_s=arrival_s)
        kinds[i] = kind
        return i, reqs[i]

    def intake(now, idle):  # scheduler.loop's: a stream that ends is followed by the next, 7 in flight
        if idle and sent[0] == n_streams and arrived_long[0] < len(long_at):  # nothing runs: wait for the next
            time.sleep(max(0.0, long_at[arrived_long[0]] - (time.perf_counter() - start)))
        arrivals = []
        while arrived_long[0] < len(long_at) and long_at[arrived_long[0]] <= time.perf_counter() - start:
            # its client sent it then: a prompt run whole keeps the loop from reading it until it ends,
            # and that wait is part of the prompt's time to first token
            arrivals.append(new("long", long_len, LONG_TOKENS, long_at[arrived_long[0]]))
            arrived_long[0] += 1
        while sent[0] < n_streams and active[0] < STREAMS:
            arrivals.append(new("stream", STREAM_PROMPT, stream_tokens, time.perf_counter() - start))
            active[0] += 1
            sent[0] += 1
        return arrivals, (), sent[0] == n_streams and arrived_long[0] == len(long_at), {}

    last, gaps, ttft, tokens = {}, [], [], 0
    for e in scheduler.loop(intake, scheduler.autoregressive(model)[0], {"target": model}, STREAMS + 1,
                               model[1]["n_ctx"], max_prefill_tokens=max_prefill_tokens):
        now = time.perf_counter()
        if e.kind == "token":
            tokens += 1
            if kinds[e.index] == "stream" and e.index in last:
                gaps.append(now - last[e.index])
            elif kinds[e.index] == "long" and e.index not in last:
                ttft.append(now - start - reqs[e.index].arrival_s)
            last[e.index] = now
        elif e.kind == "finished" and kinds[e.index] == "stream":
            active[0] -= 1
    return gaps, ttft, tokens, time.perf_counter() - start


def bench_chunked(model, args, size):
    """Each way in turns, args.reps times: the streams' inter-token latency p50 / p99 (ms), the
    long prompts' time to first token (median, s), tokens/s; with each way's ratios over
    "whole" in the same rep, and p99 over the quiet turn's p50."""
    prefill_s = prefill_seconds(model, args.chunked_long_len)
    n_long = args.chunked_long_prompts
    rng = np.random.default_rng(0)
    long_at = np.cumsum(rng.exponential(LONG_EVERY * prefill_s, n_long)).tolist()
    ways = {"whole": None, **{f"chunked {n}": n for n in args.chunked_budgets}, "quiet": None}
    runs = {way: [] for way in ways}
    for rep in range(args.reps):
        for way, budget in ways.items():
            settle()
            gaps, ttft, tokens, seconds = run_turn(model, [] if way == "quiet" else long_at, budget, rep,
                                                   args.chunked_long_len, args.chunked_stream_tokens,
                                                   args.chunked_streams)
            runs[way].append({"itl_ms_p50": 1e3 * float(np.percentile(gaps, 50)),
                              "itl_ms_p99": 1e3 * float(np.percentile(gaps, 99)), "itl_ms_max": 1e3 * max(gaps),
                              "ttft_s": float(np.median(ttft)) if ttft else None,
                              "ttft_s_max": max(ttft) if ttft else None, "tokens_per_s": tokens / seconds})
            print(f"  chunked prefill {size} rep {rep} {way}: {runs[way][-1]}", flush=True)
    rows = []
    for way, budget in ways.items():
        r = runs[way]
        row = {"size": size, "way": way, "budget": budget, "reps": r,
               **{key: float(np.median([x[key] for x in r]))
                  for key in ("itl_ms_p50", "itl_ms_p99", "itl_ms_max", "tokens_per_s")}}
        row["p99_over_quiet_p50"] = float(np.median([x["itl_ms_p99"] / q["itl_ms_p50"]
                                                     for x, q in zip(r, runs["quiet"])]))
        if way != "quiet":
            row["ttft_s"] = float(np.median([x["ttft_s"] for x in r]))
            row["ttft_over_whole"] = [x["ttft_s"] / w["ttft_s"] for x, w in zip(r, runs["whole"])]
            row["tokens_per_s_over_whole"] = [x["tokens_per_s"] / w["tokens_per_s"] for x, w in zip(r, runs["whole"])]
        rows.append(row)
    return {"size": size, "prefill_s": prefill_s, "long_at_s": long_at, "long_len": args.chunked_long_len,
            "stream_tokens": args.chunked_stream_tokens, "rows": rows}
