"""Timing passes on the machine at hand: what main.py's advice on K and the benchmark
measure. Only the commands use this; a decision inside a decoder never reads a clock (the
same seed must give the same text), so the decoders take fixed costs (cost_model.py).
"""
import time

import numpy as np

import cost_model
import kv_cache
import speculative
from kernels import cuda_decode_loop, cuda_graphs, rowwise


def pass_seconds(model, context, T=1, reps=3, n_logits=None):
    """Seconds of one cached pass over T new tokens after `context` cached tokens (the
    best of reps), with logits at the last n_logits of them (default: all T): T = 1 is
    a decode step, T = K+1 a verification. Values do not change the time, so the text is
    0, 1, 2, ... and the cached keys and values ones."""
    text, cache = timed_text(model, context, T)
    # the first pass is a warm-up; on a GPU's static step the second too: it records the graph the rest replay
    warm = 2 if cuda_graphs.fits(model, cache, np.empty((1, T))) else 1
    times = []
    for _ in range(reps + warm):
        cache["lengths"][:] = context  # as if context tokens were cached (their values do not change the time)
        start = time.perf_counter()
        logits = kv_cache.next_logits(model, cache, [text], n_logits=n_logits or T)
        float(logits[0, 0, 0])  # waits for a GPU too
        times.append(time.perf_counter() - start)
    return min(times[warm:])


def draft_seconds(model, context, K=4, reps=3):
    """Seconds of one draft token (the best of reps) where a draft's K passes and draws are one
    recorded graph (a GPU's kernels, cuda_decode_loop.py): a K-token draft's over K. None
    elsewhere: there a draft token is a pass (pass_seconds)."""
    text, cache = timed_text(model, context, K)
    text, greedy, times = text[:context + 1], [cuda_decode_loop.GREEDY], []
    for _ in range(reps + 2):  # two warm-ups: the second records the graph the rest replay
        cache["lengths"][:] = context
        start = time.perf_counter()
        if cuda_decode_loop.draft(model, cache, [text], [K], greedy, lambda: np.ones((1, K))) is None:
            return None
        times.append(time.perf_counter() - start)  # (the drafted ids came back to the host: the GPU is done)
    return min(times[2:]) / K


def step_seconds(model, context, reps=3):
    """Seconds of one decode step (a token a row) as plain decoding runs it (the best of reps):
    where passes and their draws are one recorded graph (a GPU's kernels, cuda_decode_loop.step),
    a replay of STEPS tokens and the ids out, over STEPS (a step whose callback reads each token's
    logits, a server's logprobs, also copies them out of a graph that keeps them); elsewhere a pass
    (pass_seconds), the draw the host's."""
    return draft_seconds(model, context, cuda_decode_loop.STEPS, reps) or pass_seconds(model, context, reps=reps)


def verify_seconds(model, context, K=4, reps=3, one_hot=False):
    """Seconds of one verification of K drafts (the best of reps) where the target's pass, p
    and the tests are one recorded graph (a GPU's kernels, cuda_decode_loop.verify): its
    replay and n and the token out. None elsewhere: there it is a pass over K + 1 tokens
    (pass_seconds), the tests the host's. one_hot: drafts drawn without a q (prompt lookup,
    the benchmark's controlled drafter), whose graph copies no q in."""
    params, hparams = model
    text, cache = timed_text(model, context, K + 1)
    drafts, greedy, times = np.array([text[context + 1:]]), [cuda_decode_loop.GREEDY], []  # [1, K]
    q = None if one_hot else np.zeros((1, K, hparams["n_vocab"]), np.float32, like=params["wpe"])  # [1, K, n_vocab]
    if q is not None:
        q.fill(1 / hparams["n_vocab"])  # (not np.full(like=): kv_cache.init_cache says why)
    for _ in range(reps + 2):  # two warm-ups: the second records the graph the rest replay
        cache["lengths"][:] = context
        start = time.perf_counter()
        if cuda_decode_loop.verify(model, cache, [text], q, drafts, [K], np.ones((1, K)), np.ones(1), greedy,
                                   speculative.verify, want_logits=False) is None:
            return None
        times.append(time.perf_counter() - start)  # (n and the token came back to the host: the GPU is done)
    return min(times[2:])


def timed_text(model, context, n):
    """A text of context + n tokens (0, 1, 2, ...: values do not change the time) and a one-row
    cache with room for it, its keys and values ones."""
    params, hparams = model
    cache = kv_cache.init_cache(hparams, 1, context + n, like=params["wpe"])
    for layer in cache["layers"]:  # written once: memory never written reads as one shared page of zeros, too fast
        layer["k"][...] = 1
        layer["v"][...] = 1
    return [i % hparams["n_vocab"] for i in range(context + n)], cache


CONTEXT = 32  # cached tokens before each timed pass of the advice
REPS = 2  # timed passes a cost, the best kept (after a warm-up): a run with advice pays for 10 costs x 3 passes
TIMED_K = 8  # the most drafts a timed verification holds; past it cost_model.verify_cost extrapolates


def measure_costs(target, draft, K_max, draft_vocab=0, context=CONTEXT, K=4):
    """Costs measured on this machine: a draft token (drafting K at a time) and verify(K+1)
    for K = 0..K_max (at most TIMED_K), in target decode steps. A few passes of each model;
    used to advise, never to decide (a decision on the clock would change the text from run
    to run). Every timed text fits the models' windows: a short one times fewer drafts,
    after less context."""
    n_ctx = min(model[1]["n_ctx"] for model in (target, draft) if model)
    K_max = max(0, min(K_max, TIMED_K, n_ctx - 2))
    context = max(0, min(context, n_ctx - max(K_max, 1) - 1))  # (the draft's catch-up pass: 2 tokens)
    K = max(1, min(K, K_max))
    step = step_seconds(target, context, REPS)
    verify = [1.0] + [(verify_seconds(target, context, K, REPS, one_hot=draft is None)
                       or pass_seconds(target, context, K + 1, reps=REPS)) / step for K in range(1, K_max + 1)]
    # a pass over more tokens is never cheaper than one over fewer: a timing below that (the best of
    # REPS on a busy machine, or a step timed slow) is noise, and the advice would follow it
    verify = tuple(np.maximum.accumulate(verify).tolist())
    if draft is None:
        return cost_model.Costs(0.0, verify)
    draft = speculative.vocab_subset(draft, [list(range(context))], draft_vocab)
    draft_pass = pass_seconds(draft, context, reps=REPS)
    catch_up = pass_seconds(draft, context, 2, reps=REPS, n_logits=1) / draft_pass
    return cost_model.Costs((draft_seconds(draft, context, K, reps=REPS) or draft_pass) / step, verify, catch_up)


def advise_K(stats, target, drafter, config, self_draft=False):
    """After a run: the K that this run's acceptance and costs measured now recommend, and a
    narrower draft where it drafts in float32."""
    if not stats.drafted:
        return
    alpha = cost_model.estimate_alpha(stats.accepted, stats.rejected)
    draft = drafter.model
    costs = measure_costs(target, draft, config.K_max, config.draft_vocab, K=config.K)
    K = cost_model.best_K(alpha, costs, config.K_max)
    speedup = cost_model.speedup(alpha, K, costs)
    print(f"advice: at this run's acceptance (alpha = {alpha:.2f}) and costs measured now (a draft token "
          f"{costs.draft:.2f} of a target step; verifying K+1 tokens {min(costs.verify[1:]):.2f}-"
          f"{max(costs.verify[1:]):.2f} steps), " + (f"K = {K} is expected fastest: {speedup:.2f}x plain decoding"
          if speedup >= 1 else f"plain decoding is expected fastest (K = {K}: {speedup:.2f}x)"))
    if draft and rowwise.in_blocks(draft[0]) and cost_model.weight_bytes(draft) == 4:
        how = "--draft_dtype int8" if self_draft else "the default: leave out --draft_dtype"
        print(f"advice: a draft in int8 ({how}) reads a quarter of its float32 bytes, so each draft "
              "token costs less; the text stays the target's, only the acceptance may change")
