"""Chunked prefill: how a step's token budget is spent on the prompts still being computed.

A server that runs a joining request's whole prompt in one pass stalls every stream in
flight for as long as that pass takes (seconds, for a long prompt on a CPU). Instead each
step computes at most max_prefill_tokens tokens: every decoding row counts one (a
speculative row's drafts ride along uncounted), and what they leave goes to the prompts,
in chunks that ride in the step's own pass (kv_cache.ride_along), as vLLM fills
max_num_batched_tokens and Sarathi-Serve (Agrawal et al., OSDI 2024,
https://arxiv.org/abs/2403.02310) piggybacks prefills on decodes.

The rows whose prompts are still being computed (`filling`) are the batch's last, so
that the decoding rows stay rows 0..n-1 of every cache, the view a step runs on. This
file keeps them there as rows come and go (swap, remove, leave), moves a row across when
its prompt is done (promote) or its window restarts (demote), and says what is left to
compute (still_to_prefill, prefill_waiting). serving/scheduler.py runs it.
"""
import batching
import kv_cache
import sampling


def check_budget(max_prefill_tokens, max_batch):
    """max_prefill_tokens as serving uses it (None: every prompt whole), or a ValueError: at
    least max_batch, so that a prompt being prefilled (it holds a row) always gets a token."""
    if max_prefill_tokens is not None and (not sampling.is_int(max_prefill_tokens)
                                           or max_prefill_tokens < max(max_batch, 1)):
        raise ValueError(f"max_prefill_tokens must be an integer >= max_batch ({max_batch}: each decoding row "
                         f"counts one token of it), got {max_prefill_tokens!r}")
    return max_prefill_tokens


def still_to_prefill(batch, models, b):
    """{model: how many tokens of row b's text its cache still lacks, but its last} (the
    last runs in the step that gives the row its next token; -1: it lacks none)."""
    seq = batch.seqs[b]
    return {name: kv_cache.uncached(kv_cache.rows(cache, b, b + 1), seq.tokens, models[name][1]["n_ctx"]) - 1
            for name, cache in batch.caches.items()}


def prefill_chunks(batch, models, filling, budget):
    """Spend up to budget tokens on the prompts being prefilled (the filling rows), those with
    the fewest tokens left first (then the oldest), so a short prompt never waits behind a
    long one, and a long one gets what the short ones leave. Returns each model's riders
    (kv_cache.ride_along): the chunks, to ride in the step's pass."""
    first = len(batch.seqs) - len(filling)
    todo = {b: still_to_prefill(batch, models, b) for b in range(first, len(batch.seqs))}
    riders = {name: [] for name in batch.caches}
    for b in sorted(todo, key=lambda b: (max(todo[b].values()), batch.seqs[b].index)):
        seq, n = batch.seqs[b], min(max(todo[b].values()), budget)
        if seq.finished or n <= 0:
            continue
        for name, cache in batch.caches.items():
            if min(todo[b][name], n) > 0:
                riders[name].append((kv_cache.rows(cache, b, b + 1), seq.tokens, min(todo[b][name], n)))
        budget -= n
    return {name: chunks for name, chunks in riders.items() if chunks}


def demote(batch, models, filling):
    """The decoding rows whose window has restarted (kv_cache.window_start: its text outgrew it)
    join the filling rows: the window's tokens are computed again, in chunks as a prompt's."""
    for b in reversed(range(len(batch.seqs) - len(filling))):
        seq = batch.seqs[b]
        if any(cache["starts"][b] != kv_cache.window_start(len(seq.tokens), models[name][1]["n_ctx"])
               for name, cache in batch.caches.items()):
            swap(batch, b, len(batch.seqs) - len(filling) - 1)
            filling.add(seq.index)


def promote(batch, models, filling):
    """The filling rows whose texts are now cached but their last token join the decoding
    rows (moved before the filling ones), to get their next token in the next step the
    decoding rows run; returns their sequences."""
    first = len(batch.seqs) - len(filling)
    prefilled = [seq for b, seq in enumerate(batch.seqs) if b >= first and not seq.finished
                 and max(still_to_prefill(batch, models, b).values()) <= 0]
    for seq in sorted(prefilled, key=lambda seq: seq.index):
        swap(batch, batch.seqs.index(seq), len(batch.seqs) - len(filling))
        filling.discard(seq.index)
    return prefilled


def prefill_waiting(batch, models, waiting, filling):
    """Prompt tokens not yet computed: of the requests waiting for a row, and of the rows
    still being prefilled (/metrics: gpt2_prefill_tokens_waiting)."""
    first = len(batch.seqs) - len(filling)
    return (sum(len(request.prompt) for _, request in waiting)
            + sum(still_to_prefill(batch, models, b)["target"] + 1 for b in range(first, len(batch.seqs))
                  if not batch.seqs[b].finished))  # (finished: cancelled, leaving at this iteration's end)


def swap(batch, a, b):
    """Rows a and b trade places (their sequences, counts and cached keys and values)."""
    if a == b:
        return
    batch.seqs[a], batch.seqs[b] = batch.seqs[b], batch.seqs[a]
    for counts in (batch.counts, batch.prompt_counts):
        counts[[a, b]] = counts[[b, a]]
    for cache in batch.caches.values():
        saved = kv_cache.save_row(cache, a)
        kv_cache.move_row(cache, b, a)
        kv_cache.restore_row(cache, b, saved)


def remove(batch, b, filling):
    """Row b leaves, the rows staying packed with the filling ones last: a decoding row's place
    is taken by the last decoding row, whose place the last filling row takes."""
    filling.discard(batch.seqs[b].index)
    n_dec = len(batch.seqs) - len(filling)
    if b < n_dec - 1:
        batching.move(batch, n_dec - 1, b)
        b = n_dec - 1
    batching.remove(batch, b)


def leave(batch, filling):
    """Finished rows leave the batch (batching.leave, keeping the filling rows last)."""
    for b in reversed(range(len(batch.seqs))):
        if batch.seqs[b].finished:
            batch.done.append(batch.seqs[b])
            remove(batch, b, filling)
