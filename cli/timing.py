"""Timing passes on the machine at hand: what main.py's advice on K and the benchmark
measure. Only the commands use this; a decision inside a decoder never reads a clock (the
same seed must give the same text), so the decoders take fixed costs (cost_model.py).
"""
import time

import cost_model
import kv_cache
import speculative


def pass_seconds(model, context, T=1, reps=3, n_logits=None):
    """Seconds of one cached pass over T new tokens after `context` cached tokens (the
    best of reps), with logits at the last n_logits of them (default: all T): T = 1 is
    a decode step, T = K+1 a verification. Values do not change the time, so the text is
    0, 1, 2, ... and the cached keys and values ones."""
    params, hparams = model
    text = [i % hparams["n_vocab"] for i in range(context + T)]
    cache = kv_cache.init_cache(hparams, 1, context + T, like=params["wpe"])
    for layer in cache["layers"]:  # written once: memory never written reads as one shared page of zeros, too fast
        layer["k"][...] = 1
        layer["v"][...] = 1
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        cache["lengths"][:] = context  # as if context tokens were cached (their values do not change the time)
        start = time.perf_counter()
        logits = kv_cache.next_logits(model, cache, [text], n_logits=n_logits or T)
        float(logits[0, 0, 0])  # waits for a GPU too
        times.append(time.perf_counter() - start)
    return min(times[1:])


CONTEXT = 32  # cached tokens before each timed pass of the advice
REPS = 2  # timed passes a cost, the best kept (after a warm-up): a run with advice pays for 10 costs x 3 passes


def measure_costs(target, draft, K_max, draft_vocab=0, context=CONTEXT):
    """Costs measured on this machine: a draft token and verify(K+1) for K = 0..K_max, in
    target decode steps. A few passes of each model; used to advise, never to decide
    (a decision on the clock would change the text from run to run)."""
    step = pass_seconds(target, context, reps=REPS)
    verify = (1.0,) + tuple(pass_seconds(target, context, K + 1, reps=REPS) / step for K in range(1, K_max + 1))
    if draft is None:
        return cost_model.Costs(0.0, verify)
    draft = speculative.vocab_subset(draft, [list(range(context))], draft_vocab)
    draft_step = pass_seconds(draft, context, reps=REPS)
    catch_up = pass_seconds(draft, context, 2, reps=REPS, n_logits=1) / draft_step
    return cost_model.Costs(draft_step / step, verify, catch_up)
