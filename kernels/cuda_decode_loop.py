"""Decoding's passes and their draws as one CUDA graph: each token drawn on the device and
read by the next pass there, without the host in between.

Without this module, speculative.draft_with_model drafts a pass at a time: the draft model's
pass (on a GPU a recorded step, cuda_graphs.py), the distribution q_i, a draw from it, and the
drawn ids back to the host, which makes the next pass's input from them. So in every speculative step the
host waits for the GPU K times, and the GPU waits K times for the host's Python. For a draft
10x smaller than its target, a draft token's cost (c in cost_model.py) is then more the
host's than the GPU's. Here the K passes and their draws are one recorded graph:

- pass 0 reads each row's pending tokens (its last token; two after a catch-up pass); pass
  i > 0 reads the tokens draw i - 1 wrote, in the buffer the draw writes them to;
- every position is known before the loop: row b's token of pass i goes to slot lengths[b] +
  n_new[b] + i - 1, and a row that has drafted its k[b] tokens is padding (position -1) after
  the pass that reads its last;
- so are every row's draws u [K, B] (batching.uniforms: a row's generator gives the same
  numbers k at a time as one at a time), and its sampling settings: data the graph reads
  (cuda_sampling.distribution_rows), so that rows of any settings share one graph;
- q_i goes into a buffer [K, B, n_vocab] on the device, where the verification reads it.

A speculative step's drafts are then one copy in (the inputs, draws and settings), one
replay, and one copy out (the drafted ids). Plain decoding's step is the same loop with
K = 1 (`step`): the pass and its draw in one replay, where the draw (a dozen calls into CuPy
sampled, four greedy) would follow it from the host. The passes and kernels are those run a
pass at a time, so the tokens and q are the same bits (tests/test_cuda_graphs.py). Penalties
and n-gram bans read the host's counts and texts: a batch with a row that has them runs a
pass at a time.
"""
import numpy as np

import kv_cache
import sampling
from kernels import cuda_graphs, cuda_sampling

GREEDY = sampling.SamplingSettings(temperature=0.0)  # the padding rows': the cheapest to draw


def draft(model, cache, texts, k, settings, draws, riders=()):
    """speculative.draft_with_model's drafts from one replay: k[b] tokens for texts[b] and q
    [B, K, n_vocab] (K = max k; a view of the graph's buffer, which its next replay writes
    over); None where the loop cannot be recorded (then it runs a pass at a time)."""
    ran = run_loop(model, cache, texts, k, settings, draws, riders)
    if ran is None:
        return None
    drafted, q, _ = ran
    return [drafted[b, :kb].tolist() for b, kb in enumerate(k)], q.transpose(1, 0, 2)[:len(texts)]


def step(model, cache, texts, settings, draws, riders=()):
    """batching.autoregressive_step's next token of each text, and the logits [B, n_vocab] it
    was drawn from (a copy), from one replay of the loop with K = 1: a pass and its draw;
    None where the loop cannot be recorded (then the step runs as on the CPU)."""
    ran = run_loop(model, cache, texts, [1] * len(texts), settings, draws, riders)
    if ran is None:
        return None
    drafted, _, logits = ran
    return drafted[:, 0].tolist(), logits[:len(texts)].copy()


def run_loop(model, cache, texts, k, settings, draws, riders):
    """The loop over texts drafting k[b] tokens for row b: (the drafted ids [B, K] on the host,
    and the graph's buffers q [K, B', n_vocab] and the last pass's logits [B', n_vocab]),
    the cache advanced as K passes a pass at a time would; or None where it cannot be
    recorded: a row's settings reading its counts or text (penalties, an n-gram ban), riders,
    a model or cache without static steps, no drafts, drafts past this model's window (a
    draft whose n_ctx is the target's or larger never has them), or a pass 0 too long for a
    static step. settings: each row's; draws(): each row's k[b] uniforms [B, K], called only
    when the loop runs."""
    params, hparams = model
    B, K = len(texts), max(k)
    # the draws on the device: our sampling kernels chosen, or NumPy (the stand-in; the CPU's
    # layout is refused by fits)
    draws_here = isinstance(params["wpe"], np.ndarray) or cuda_sampling.takes(params["wpe"])
    if not (K and draws_here and not any(s.uses_counts or s.no_repeat_ngram_size for s in settings)
            and all(kb <= kv_cache.room(len(text), hparams["n_ctx"]) for kb, text in zip(k, texts))
            and cuda_graphs.fits(model, cache, np.zeros((B, 1)), riders)):  # (a step of B rows, one token each)
        return None
    kv_cache.prefill_alone(model, cache, texts, 1)  # as the first pass a pass at a time does
    inputs, n_new = kv_cache.pending_inputs(cache, texts, hparams["n_ctx"])  # [B, T]
    if not cuda_graphs.fits(model, cache, inputs):
        return None  # too many tokens for a static step (a restarted window): a pass at a time
    k, T, Bp = np.asarray(k), inputs.shape[1], cuda_graphs.bucket(B)
    loop = static_loop(model, cache, Bp, T, K)
    loop["layers"] = cache["layers"]  # (the rows of this step: cuda_graphs.step says why a view serves)
    loop["settings"] = list(settings) + [GREEDY] * (Bp - B)  # [B']
    u = np.ones((K, Bp))  # [K, B']
    u[:, :B] = draws().T
    numbers = np.array([cuda_sampling.kernel_settings(s, hparams["n_vocab"]) for s in loop["settings"]])  # [B', 5]
    cuda_graphs.copy_in(loop["inputs"], flat_inputs(cache["lengths"], inputs, n_new, k, u, numbers))
    logits = cuda_graphs.run(loop)  # [B', n_vocab]
    tokens = loop["tokens"]  # [K, B']
    drafted = (tokens if isinstance(tokens, np.ndarray) else tokens.get())[:, :B].T  # [B, K]: the one copy out
    cuda_sampling.checked(drafted[np.arange(K) < k[:, None]])  # a row that was not a distribution: -1
    cache["lengths"] += n_new + np.minimum(k, K - 1)  # pass 0's tokens, then each draft read after it
    return drafted, loop["q"], logits


def flat_inputs(lengths, inputs, n_new, k, u, settings):
    """The loop's inputs as one int64 buffer (`static_loop` views it): pass 0's ids and
    positions [B', T] and the token it needs logits at [B'], each later pass's positions
    [K - 1, B'] (rows past B, tokens past n_new[b] and passes past a row's last draft: -1),
    then the draws u [K, B'] and each row's settings [B', 5] (cuda_sampling.kernel_settings),
    float64 both, as their bits."""
    (B, T), (K, Bp) = inputs.shape, u.shape
    ids, positions = np.zeros((Bp, T), np.int64), np.full((Bp, T), -1)  # [B', T] each
    ids[:B] = inputs
    positions[:B] = np.where(np.arange(T) < n_new[:, None], lengths[:, None] + np.arange(T), -1)
    at = np.zeros(Bp, np.int64)  # [B']: each row's last real token of pass 0
    at[:B] = np.maximum(n_new - 1, 0)
    i = np.arange(1, K)  # [K - 1]: pass i reads draft i
    later = np.full((K - 1, Bp), -1)  # [K - 1, B']
    later[:, :B] = np.where(i[:, None] <= k, lengths + n_new + i[:, None] - 1, -1)
    return np.concatenate([ids.ravel(), positions.ravel(), at, later.ravel(), u.ravel().view(np.int64),
                           settings.ravel().view(np.int64)])


def static_loop(model, cache, Bp, T, K):
    """The loop for B' rows, T tokens in pass 0 and K passes, made at first use
    (cuda_graphs.run records and replays it): {"inputs" (flat_inputs), "q" [K, B', n_vocab],
    "tokens" [K, B'] (the drafted ids), "forward" (writes q and tokens, returns the last
    pass's logits [B', n_vocab]), "layers" and "settings" (run_loop sets them), ...}."""
    params, hparams = model
    key = ("decode loop", id(params), cuda_graphs.pointer(cache["layers"][0]["k"]), Bp, T, K)
    if key not in cache["graphs"]:
        wpe = params["wpe"]
        buffer = np.zeros(2 * Bp * T + 2 * Bp * K + 5 * Bp, np.int64, like=wpe)  # flat_inputs
        ids, positions = buffer[:Bp * T].reshape(Bp, T), buffer[Bp * T:2 * Bp * T].reshape(Bp, T)  # [B', T] each
        at = buffer[2 * Bp * T:2 * Bp * T + Bp].reshape(Bp, 1)  # [B', 1]
        later = buffer[2 * Bp * T + Bp:2 * Bp * T + Bp * K].reshape(K - 1, Bp, 1)  # [K - 1, B', 1]
        u = buffer[2 * Bp * T + Bp * K:2 * Bp * T + 2 * Bp * K].view(np.float64).reshape(K, Bp)  # [K, B']
        settings = buffer[2 * Bp * T + 2 * Bp * K:].view(np.float64).reshape(Bp, 5)  # [B', 5]
        first = np.zeros((Bp, 1), np.int64, like=wpe)  # [B', 1]: a later pass's one token
        every_token, rows = np.broadcast_to(np.arange(T, like=wpe), (Bp, T)), np.arange(Bp, like=wpe)[:, None]
        q = np.zeros((K, Bp, hparams["n_vocab"]), np.float32, like=wpe)  # [K, B', n_vocab]
        tokens = np.zeros((K, Bp), np.int64, like=wpe)  # [K, B']: draft i + 1 of each row in row i
        loop = cache["graphs"][key] = {"inputs": buffer, "q": q, "tokens": tokens, "layers": cache["layers"],
                                       "settings": None, "uses": 0, "replay": None, "output": None, "graph": None,
                                       "params": params}

        def forward():
            for i in range(K):
                if i == 0:  # logits at every token, then each row's last: a pass at a time computes all T,
                    # and the stand-in's BLAS gives other bits for fewer rows (our kernels do not)
                    logits = cuda_graphs.pass_over(model, loop["layers"], ids, positions, every_token)  # [B', T, V]
                    logits = (logits[rows, at] if T > 1 else logits)[:, 0]  # [B', n_vocab]
                else:
                    logits = cuda_graphs.pass_over(model, loop["layers"], tokens[i - 1][:, None], later[i - 1],
                                                   first)[:, 0]  # [B', n_vocab]
                draw(logits, settings, loop["settings"], u[i], q[i], tokens[i])
            return logits
        loop["forward"] = forward
    return cache["graphs"][key]


def draw(logits, settings, row_settings, u, q, tokens):
    """q = the distribution of logits [B, n_vocab], row b under its settings (on the device:
    `settings` [B, 5], cuda_sampling.kernel_settings), and tokens [B] = a draw from it at u,
    without the host: our kernels into the buffers given. The stand-in: sampling.py under
    row_settings [B] (SamplingSettings), the rows that share settings in one call, as
    batching.distributions groups them."""
    if isinstance(logits, np.ndarray):
        for s in dict.fromkeys(row_settings):
            rows = [b for b, x in enumerate(row_settings) if x == s]
            q[rows] = sampling.probabilities(logits[rows], None, s)
        tokens[...] = sampling.sample(q, u)
    else:
        cuda_sampling.distribution_rows(logits, settings, q)
        cuda_sampling.draw(q, u, tokens)
