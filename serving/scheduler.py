"""Continuous batching: serve a stream of requests, rows join as others finish.

Requests differ wildly in length. Static batching fills a batch and runs it until
its longest request is done: finished rows sit idle and new requests wait.
Continuous batching (Orca, Yu et al., OSDI 2022,
https://www.usenix.org/conference/osdi22/presentation/yu; vLLM, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180) schedules per iteration instead: a finished
request leaves at once, and a waiting one takes its row at the next iteration.

`loop` keeps up to max_batch rows in flight in one fixed set of KV-cache rows
(batching.py). Requests that arrive take the free rows, and each iteration is one step
of the decoder for every row whose prompt is computed, with the next chunks of the
prompts still being computed riding in its pass (chunked prefill, Sarathi-Serve,
Agrawal et al. OSDI 2024, https://arxiv.org/abs/2403.02310): at most
max_prefill_tokens tokens an iteration, so a long prompt never stalls the streams in
flight. Without a budget (or where chunks could change a bit) an iteration either
prefills the rows that just joined, in a pass of their own that also gives each its
first token, or decodes every row. Then finished rows leave (the last rows move into
their places). A joining row's
cache starts with the longest beginning of its prompt already computed, copied from
a row in flight or the prefix cache (share_prefix, prefix_cache.py), or empty; no
other row's cache is touched.

A server adds preemption: a row whose client is not taking its tokens gives its row to
a waiting request (or, when too many of its tokens wait unsent, gives it up anyway) and is
paused, its cached keys and values copied aside, then resumes where it stood once the
client has caught up (vLLM swaps or recomputes a
preempted request's cache when memory runs short; here rows run short).

Both decoders run this way: a decoder is its step function (plain or
speculative) and the models it keeps caches for. Every request samples from its
own random stream, so its text is the same whoever shares the batch, and
`static=True` gives the static baseline: admit requests only into an empty batch.
"""
import collections
import itertools
import time
from dataclasses import dataclass

import numpy as np

import batching
import kv_cache
import sampling
import speculative
from serving import chunking, prefix_cache


@dataclass
class Event:
    kind: str  # "token", "finished", "error", or "paused" / "resumed" (preemption)
    index: int  # which request: its place in the list given to serve
    token: int = None  # "token": the new token (accepted: whether it was an accepted draft)
    accepted: bool = False
    tokens: list = None  # "finished": every new token, and the request's timings (None: cancelled
    metrics: dict = None  # before its first token)
    error: str = None  # "error": why the request was refused (the others go on)
    logits: object = None  # "token": the target's logits [n_vocab] it was drawn after (a view of the step's)
    cached_tokens: int = 0  # "token": prompt tokens its request copied from a shared prefix (share_prefix)


def autoregressive(model):
    """The plain decoder as the scheduler runs it: (step, the models it caches)."""
    return (lambda batch: batching.autoregressive_step(batch, model)), {"target": model}


def speculative_decoder(target, drafter, config=speculative.SpeculativeConfig()):
    """Draft-verify decoding as the scheduler runs it (a speculative.Drafter, as in speculative_generate)."""
    draft = speculative.draft_of(drafter)
    speculative.check(config, target[1], draft and draft[1])
    config = speculative.resolve(config, target, draft)
    models = {"target": target, "draft": draft} if draft else {"target": target}
    return (lambda batch: speculative.speculative_step(batch, target, drafter, config)), models


def serve(requests, decoder, max_batch=8, max_len=None, static=False, prefix=None, max_prefill_tokens=None,
          stats=None):
    """Answer requests (batching.Request, each with its arrival_s) as they arrive, with
    at most max_batch in flight; yields Events as tokens come and requests finish.
    max_len: the most tokens (prompt + new) a row holds; at the window (the default)
    every request fits, a longer text restarting its window as in every other path.
    prefix: a prefix cache (prefix_cache.new_prefix_cache) to keep computed beginnings in.
    max_prefill_tokens: chunked prefill's budget per iteration; None: prompts run whole.
    stats: a batching.Stats to count in (its itl_ms: the gaps between steps, what a stream sees).
    A request that cannot be served gets an "error" event at once; the others go on. max_batch,
    max_len and max_prefill_tokens are checked here, before the first event is asked for."""
    step, models = decoder
    max_len = check_limits(models["target"][1], max_batch, max_len)
    chunking.check_budget(max_prefill_tokens, max_batch)
    problems = [refusal(r, models["target"][1], max_len) for r in requests]
    errors = [Event("error", i, error=problem) for i, problem in enumerate(problems) if problem]
    good = sorted((i for i, problem in enumerate(problems) if not problem), key=lambda i: requests[i].arrival_s)
    return itertools.chain(errors, loop(from_list(requests, good), step, models, max_batch, max_len, static,
                                        stats=stats, prefix=prefix, max_prefill_tokens=max_prefill_tokens))


def check_limits(hparams, max_batch, max_len):
    """max_len (None: the window) as the loop uses it, or a ValueError naming what is wrong."""
    if not sampling.is_int(max_batch) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if max_len is not None and (not sampling.is_int(max_len) or max_len < 1):
        raise ValueError(f"max_len must be None (the window) or an integer >= 1, got {max_len!r}")
    return min(max_len or hparams["n_ctx"], hparams["n_ctx"])


def from_list(requests, order):
    """loop's intake for a list of requests known in advance: those in order (sorted by
    arrival_s) arrive at their times; while nothing runs, it sleeps until the next."""
    waiting = collections.deque(order)

    def intake(now, idle):
        if idle and waiting:
            time.sleep(max(0.0, requests[waiting[0]].arrival_s - now))
            now = requests[waiting[0]].arrival_s
        arrived = []
        while waiting and requests[waiting[0]].arrival_s <= now:
            i = waiting.popleft()
            arrived.append((i, requests[i]))
        return arrived, (), not waiting, {}
    return intake


def loop(intake, step, models, max_batch, max_len, static=False, stats=None, prefix=None,
         max_prefill_tokens=None):
    """Serving's loop: take in what has arrived, admit it into free rows, run one step, let finished
    rows leave. intake(now, idle) -> (arrivals [(index, request)], indices cancelled, whether
    no more will come, lagging {index: whether its tokens back up} of the requests whose
    clients lag); idle: nothing runs or can resume and nothing waits, so intake may block
    until something comes. Requests come checked (refusal).
    stats: a batching.Stats to keep the run's counts in. prefix: the prefix cache a joining
    request's prompt is looked up in (share_prefix), and prompts and finished texts are kept in;
    None: every request computes its whole prompt.

    Preemption: a row whose client lags (it is not taking its tokens: a server knows, a list
    never lags) gives its row to a waiting request, or gives it up anyway if its tokens back
    up, and is paused with all it needs to go on (pause). Once its client has caught
    up it resumes into the next free row, ahead of requests still waiting (it came before
    them, as vLLM resumes what it preempted first), its text bit for bit what it would have been.
    The first max_batch paused keep a copy of their keys and values (so they never hold more
    memory than the batch's own caches); beyond them a paused request keeps only its text, and
    its keys and values are computed again when it resumes, as vLLM's "recompute" preemption
    does: only where they come out in the same bits whatever the pass (same_bits, below), so with
    the NumPy fallback at most max_batch are paused.

    Chunked prefill (max_prefill_tokens, checked by chunking.check_budget): a joining request
    no longer runs its whole prompt while every stream waits. Each iteration computes at most
    max_prefill_tokens tokens, each decoding row counting one: what the decoding rows leave
    goes to the prompts still being prefilled, the fewest tokens left first, each prompt's
    next chunk riding in the step's pass (kv_cache.ride_along, every model's cache), as vLLM's
    scheduler fills max_num_batched_tokens; a prompt cached but for its last token joins the
    decoding rows and gets its first token in the next step. The rows still being prefilled
    are the batch's last (filling, serving/chunking.py). Only where keys come out the same
    bits whatever the pass (same_bits): elsewhere, and with None, prompts run whole."""
    chunking.check_budget(max_prefill_tokens, max_batch)  # below the rows, a prompt would wait forever for a token
    events = []
    batch = batching.new_batch(models, max_batch, max_len, stats=stats,
                               callback=lambda seq, token, accepted, logits: events.append(
                                   Event("token", seq.index, token, accepted, logits=logits,
                                         cached_tokens=seq.cached_tokens)))
    start = batch.stats.start
    waiting, joined, paused, closed, lagging = collections.deque(), {}, {}, False, {}
    sharing = prefix is not None and bool(batch.caches) and not static
    # every token's keys come out in the same bits whatever the pass (the kernels' loops), so a
    # paused request may drop them and compute them again (preempt)
    same_bits = bool(batch.caches) and all(kv_cache.kernel_ops(model) is not None for model in models.values())
    # and rows share any common beginning (prefix_cache.py); else, and with no memory for a
    # cache, only the same prompt
    any_beginning = sharing and prefix["budget"] > 0 and same_bits
    chunked = max_prefill_tokens is not None and same_bits and not static
    filling = set()  # chunked: the indices of the rows whose prompts are still being prefilled (the last rows)
    if sharing and prefix.setdefault("models", models) is not models:
        raise ValueError("a prefix cache holds one decoder's keys and values: give each decoder its own")
    while True:
        ready = [i for i in paused if i not in lagging]
        arrived, cancelled, closed, lagging = intake(time.perf_counter() - start,
                                                     idle=not (waiting or batch.seqs or ready))
        waiting.extend(arrived)
        for i in set(cancelled):  # a client that left: its row finishes now, or it never starts
            waiting = collections.deque((j, r) for j, r in waiting if j != i)
            for seq in batch.seqs:
                seq.finished |= seq.index == i
            if i in paused:
                batch.done.append(paused.pop(i)["seq"])
        if not static:
            yield from preempt(batch, paused, lagging, len(waiting), max_batch, same_bits,
                               prefix if any_beginning else None, filling)
        n_before = len(batch.seqs)
        while len(batch.seqs) < max_batch and not (static and n_before):
            i = next((i for i in paused if i not in lagging), None)
            if i is not None:  # a client that caught up: its request goes on where it stopped
                kept = paused.pop(i)
                resume(batch, kept, filling if chunked else None)
                if kept["caches"] is None and any_beginning:  # what the prefix cache kept of its text
                    prefix_cache.reuse(prefix, kept["seq"].tokens, batch.caches, len(batch.seqs) - 1)
                yield Event("resumed", i)
            elif waiting:
                # a request that begins as a prompt being computed waits for it, and copies what they
                # share; with chunked prefill (many iterations) the requests after it go ahead meanwhile
                first_new = len(batch.seqs) - len(filling) if chunked else n_before
                j = next((j for j, (_, r) in enumerate(waiting)
                          if not (sharing and shares_with(r, batch, first_new, any_beginning))), None)
                if j is None or j and not chunked:
                    break
                i, request = waiting[j]
                del waiting[j]
                batching.join(batch, request, i)
                joined[i] = time.perf_counter()
                if chunked:
                    filling.add(i)
                if sharing:
                    share_prefix(batch, len(batch.seqs) - 1, prefix, any_beginning)
            else:
                break
        if closed and not (waiting or batch.seqs or paused):
            return
        if chunked:
            chunking.demote(batch, models, filling)  # texts whose window restarts: it is prefilled again, in chunks
            chunking.promote(batch, models, filling)  # prompts computed already (copied, a token long): this step
            n_dec = len(batch.seqs) - len(filling)  # each counts one token of the budget
            riders = chunking.prefill_chunks(batch, models, filling, max_prefill_tokens - n_dec)
            if n_dec and not any(seq.finished for seq in batch.seqs[:n_dec]):
                decoding = batching.rows(batch, 0, n_dec)
                decoding.riders = riders  # the chunks ride in the step's passes (each model's first)
                step(decoding)
            for name, chunks in riders.items():  # those no pass of the step took (a pass pops its model's)
                if chunks:
                    kv_cache.cache_riders(models[name], chunks)
            prefilled = chunking.promote(batch, models, filling)  # their first tokens come in the next step
            for seq in prefilled if any_beginning else ():
                prefix_cache.store(prefix, seq.tokens, batch.caches, batch.seqs.index(seq))
        elif len(batch.seqs) > n_before:
            step(batching.rows(batch, n_before, len(batch.seqs)))  # prefill: the new rows alone
            for b in range(n_before, len(batch.seqs)) if any_beginning else ():
                prefix_cache.store(prefix, batch.seqs[b].tokens, batch.caches, b)
        elif batch.seqs and not any(seq.finished for seq in batch.seqs):
            step(batch)  # decode: every row one step
        batch.stats.prefill_waiting = chunking.prefill_waiting(batch, models, waiting, filling)
        yield from events
        events.clear()
        for b, seq in enumerate(batch.seqs) if any_beginning else ():
            if seq.finished:  # its whole text, for a conversation that sends it back with a new turn
                prefix_cache.store(prefix, seq.tokens, batch.caches, b)
        chunking.leave(batch, filling)
        for seq in batch.done:  # a finished request takes its tokens and timings with it (none: cancelled first)
            joined_at = joined.pop(seq.index)
            yield Event("finished", seq.index, tokens=seq.generated,
                        metrics=metrics(seq, start, joined_at) if seq.times else None)
        batch.done.clear()


def share_prefix(batch, b, prefix, any_beginning):
    """Row b, just joined, starts from the longest beginning of its prompt already computed:
    in a row in flight (its text so far), or in the prefix cache; only the rest of its prompt
    runs through the models. any_beginning: a token's keys and values are the same bits
    whichever pass computed them (prefix_cache.py says why), so any common beginning is
    copied. Otherwise (the NumPy fallback, or a cache of 0 bytes) only a prompt identical
    to a row's own is copied, all but its last token: its passes would have been that row's,
    bit for bit (the choices of one prompt)."""
    seq, caches = batch.seqs[b], batch.caches
    prompt = seq.request.prompt
    prefix["queries"] += len(prompt)
    if len(prompt) > min(kv["layers"][0]["k"].shape[2] for kv in caches.values()):
        return  # longer than a row: its window starts past token 0 (kv_cache.window_start), as no cached text
    best, source = 0, None
    for r, other in enumerate(batch.seqs[:b]):
        n = (common_length(other.tokens, prompt) if any_beginning
             else len(prompt) * same_prompt(other.request.prompt, prompt))
        n = min(n, len(prompt) - 1, *(int(kv["lengths"][r]) if not kv["starts"][r] else 0 for kv in caches.values()))
        if n > best:
            best, source = n, r
    if any_beginning and len(prefix_cache.longest_prefix(prefix, prompt)) * prefix_cache.BLOCK > best:
        best = prefix_cache.reuse(prefix, prompt, caches, b)
    elif source is not None:
        for kv in caches.values():
            kv_cache.copy_prefix(kv, source, b, best)
    seq.cached_tokens = best
    prefix["hits"] += best


def shares_with(request, batch, n_before, any_beginning):
    """Whether a waiting request begins as a row joining now (rows n_before on) goes on to
    compute in this prefill (at least a block of it; without any_beginning, the same prompt):
    it waits until that is computed, and copies it then."""
    prompt = request.prompt
    for b in range(n_before, len(batch.seqs)):
        if any(kv["starts"][b] for kv in batch.caches.values()):
            continue  # a window restarted: no beginning of it is shared (share_prefix)
        other = batch.seqs[b].request.prompt
        held = min(int(kv["lengths"][b]) for kv in batch.caches.values())  # copied or restored already
        if any_beginning:
            shared = min(common_length(other, prompt), len(prompt) - 1)
            if shared - held >= min(prefix_cache.BLOCK, len(prompt) - 1) > 0:
                return True
        elif same_prompt(other, prompt) and held < len(prompt) - 1:
            return True
    return False


def same_prompt(a, b):
    return len(a) == len(b) == common_length(a, b)


def common_length(a, b):
    """How many tokens a and b share from their start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def preempt(batch, paused, lagging, n_waiting, max_batch, recompute, prefix=None, filling=frozenset()):
    """Pause rows whose clients lag: every one whose tokens back up (lagging[index]), and
    others, one for each request waiting for a row still. Each keeps its keys and values
    while fewer than max_batch paused do; past that it keeps none (recompute), or is not
    paused. prefix: a prefix cache that keeps what it can of a text paused without its keys
    and values, so that its resume computes only the rest (as vLLM's freed blocks stay in
    its prefix cache until evicted). filling: the rows still being prefilled, which are not
    paused (they have nothing new to send). Yields a "paused" event for each."""
    lags = [seq for seq in batch.seqs if seq.index in lagging and not seq.finished and seq.index not in filling]
    for seq in sorted(lags, key=lambda seq: not lagging[seq.index]):  # backed up first
        keep_cache = sum(kept["caches"] is not None for kept in paused.values()) < max_batch
        if not (keep_cache or recompute) or not (lagging[seq.index] or n_waiting > 0):
            return
        b = batch.seqs.index(seq)
        if not keep_cache and prefix is not None:
            prefix_cache.store(prefix, seq.tokens, batch.caches, b)
        paused[seq.index] = pause(batch, b, keep_cache, filling)
        n_waiting -= 1
        yield Event("paused", seq.index)


def pause(batch, b, keep_cache, filling):
    """Row b leaves before it has finished, and takes along all it needs to go on exactly
    where it stood: its sequence (text, random stream, timings), its counts, and (keep_cache)
    a copy of its cached keys and values, so that nothing is computed again; without one,
    resume computes them again from its text, the same bits only where a token's keys do not
    depend on the pass that computed them (kv_cache.kernel_ops). filling: as remove's."""
    kept = {"seq": batch.seqs[b], "counts": batch.counts[b].copy(), "prompt_counts": batch.prompt_counts[b].copy(),
            "caches": {name: kv_cache.save_row(cache, b) for name, cache in batch.caches.items()} if keep_cache
            else None}
    chunking.remove(batch, b, filling)
    return kept


def resume(batch, kept, filling=None):
    """A paused sequence takes the next free row, as it stood when it was paused (its keys
    and values copied back, or, where it kept none, nothing cached: its next pass runs its text).
    filling: with chunked prefill, the rows being prefilled, which stay last: a row that kept
    its keys goes before them, one that kept none joins them (its text is prefilled again)."""
    b = len(batch.seqs)
    batch.seqs.append(kept["seq"])
    batch.counts[b], batch.prompt_counts[b] = kept["counts"], kept["prompt_counts"]
    for name, cache in batch.caches.items():
        if kept["caches"] is None:
            kv_cache.clear_row(cache, b)
        else:
            kv_cache.restore_row(cache, b, kept["caches"][name])
    if filling is not None and kept["caches"] is None:
        filling.add(kept["seq"].index)
    elif filling:
        chunking.swap(batch, b, b - len(filling))


def refusal(request, hparams, max_len):
    """Why this request cannot be served (None if it can)."""
    try:
        batching.check_request(request, hparams["n_vocab"])
    except ValueError as e:
        return str(e)
    need = len(request.prompt) + request.max_new_tokens
    if need > max_len < hparams["n_ctx"]:
        return (f"the request needs {need} tokens (prompt + new), more than this server's max_len {max_len} "
                f"(at max_len {hparams['n_ctx']}, the window, any length is served)")
    return None


def metrics(seq, start, joined):
    """One request's timings: queue, TTFT and end to end in seconds after it arrived, ITL in
    ms, joined_at_s and finished_at_s in seconds after the run's start."""
    arrival = start + seq.request.arrival_s
    gaps = np.diff(seq.times) * 1e3
    return {"queue_s": joined - arrival, "ttft_s": seq.times[0] - arrival, "e2e_s": seq.times[-1] - arrival,
            "itl_ms_p50": float(np.percentile(gaps, 50)) if gaps.size else 0.0,
            "itl_ms_p95": float(np.percentile(gaps, 95)) if gaps.size else 0.0,
            "n_tokens": len(seq.times), "joined_at_s": joined - start, "finished_at_s": seq.times[-1] - start,
            "cached_tokens": seq.cached_tokens}


def summarize(finished):
    """Aggregate of the finished events of one run: tokens/s, and TTFT, ITL and end-to-end
    latency at p50 and p95 over requests."""
    m = [e.metrics for e in finished if e.metrics]
    if not m:
        return {"requests": 0, "tokens": 0, "tokens_per_s": 0.0}
    span = max(x["finished_at_s"] for x in m)
    out = {"requests": len(m), "tokens": sum(x["n_tokens"] for x in m), "seconds": span}
    out["tokens_per_s"] = out["tokens"] / span if span > 0 else 0.0
    for key in ("queue_s", "ttft_s", "e2e_s", "itl_ms_p50"):
        values = [x[key] for x in m]
        out[f"{key}_p50"], out[f"{key}_p95"] = float(np.percentile(values, 50)), float(np.percentile(values, 95))
    return out
