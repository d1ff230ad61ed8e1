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
replay, and one copy out (the drafted ids). Its verification is a graph too (`verify`): the
target's pass over the drafts, p under each row's settings, and speculative.verify's tests
and draw (cuda_sampling.accept), with q copied in on the device and only n and the token
copied out, where after the pass they would be a dozen calls more. Plain decoding's step is
the same loop (`step`): STEPS passes and draws in one replay, the tokens of STEPS plain steps,
where the draw (a dozen calls into CuPy sampled, four greedy) would follow each pass from the
host, and the host's Python each draw. The passes and kernels are those run a pass at a
time, so the tokens, q, p and n are the same bits (tests/test_cuda_graphs.py). Penalties
and n-gram bans read the host's counts and texts: a batch with a row that has them runs a
pass at a time.
"""
import numpy as np

import kv_cache
import sampling
from kernels import cuda_graphs, cuda_sampling

GREEDY = sampling.SamplingSettings(temperature=0.0)  # the padding rows': the cheapest to draw
# tokens a row a plain step makes in one replay: the host's share of a token (its Python, and 3
# calls into CuPy) falls to 1 / STEPS; a row that ends early (EOS, a stop a server finds) wastes
# at most STEPS - 1 passes, and a request waits at most one replay of STEPS tokens for its turn
# to join. Where a callback reads each token's logits (a server's logprobs), the loop also keeps
# every pass's: one more launch a pass, in a graph of its own
STEPS = 4


def draft(model, cache, texts, k, settings, draws, riders=()):
    """speculative.draft_with_model's drafts from one replay: k[b] tokens for texts[b] and q
    [B, K, n_vocab] (K = max k; a view of the graph's buffer, which its next replay writes
    over); None where the loop cannot be recorded (then it runs a pass at a time)."""
    ran = run_loop(model, cache, texts, k, settings, draws, riders)
    if ran is None:
        return None
    drafted, q, _ = ran
    return [drafted[b, :kb].tolist() for b, kb in enumerate(k)], q.transpose(1, 0, 2)[:len(texts)]


def step(model, cache, texts, settings, draws, riders=(), want_logits=True, most=None):
    """batching.autoregressive_step's next tokens of each text from one replay of the loop: a
    pass and its draw, k[b] times for row b: STEPS, or fewer where the row may make fewer
    tokens (most[b]; default 1) or its window has fewer free slots.
    Returns (each row's k[b] tokens, the logits [B, max k, n_vocab] each was drawn from: a
    copy, None unless want_logits (batching.wants_logits: a callback reads them; on a GPU the
    copy is two calls into CuPy); row b's past k[b] are padding), or None where the loop
    cannot be recorded (then the step runs as on the CPU). draws(k): each row's k[b]
    uniforms [B, max k]."""
    if not recordable(model, cache, settings, riders):  # first: the CPU's every step stops here, no window read
        return None
    n_ctx = model[1]["n_ctx"]
    k = [1 if most is None else max(1, min(STEPS, m, kv_cache.room(len(text), n_ctx)))
         for text, m in zip(texts, most or [1] * len(texts))]
    ran = run_loop(model, cache, texts, k, settings, lambda: draws(k), riders, keep_logits=want_logits)
    if ran is None:
        return None
    drafted, _, logits = ran
    # a row of fewer than K tokens had its last read (cached) by the loop's next pass, as a draft
    # wants; plain decoding's next step reads it, as after a step of one token
    kv_cache.rollback(cache, [len(text) + kb - 1 for text, kb in zip(texts, k)])
    return [drafted[b, :kb].tolist() for b, kb in enumerate(k)], logits[:len(texts)].copy() if want_logits else None


def verify(model, cache, texts, q, drafts, k, u, v, settings, accept, riders=(), want_logits=True):
    """speculative.verify_with_target's steps from one replay: the target's pass over texts
    (row b ending in its k[b] drafts, drafts [B, K], drawn from the draft's q [B, K, n_vocab];
    None: one-hot at the drafts, which the graph's kernel reads so, and nothing is copied in),
    its distributions p [B, K+1, n_vocab] under each row's settings, and the tests and the
    draw of `accept` (speculative.verify) at u [B, K] and v [B]: on the device its kernels,
    cuda_sampling.accept; the stand-in runs `accept` itself. Returns (logits [B, K+1, n_vocab]
    (a copy; None unless want_logits), n [B], token [B] as lists), the cache advanced over
    the texts as kv_cache.next_logits advances it; or None where the graph cannot be recorded
    (as for run_loop, and a q of another shape: then the verification runs as on the CPU)."""
    params, hparams = model
    (B, K), n_vocab = drafts.shape, hparams["n_vocab"]
    if not (K and (q is None or q.shape == (B, K, n_vocab)) and recordable(model, cache, settings, riders)):
        return None
    inputs, n_new = static_inputs(model, cache, texts, np.asarray(k) + 1)  # [B, T]
    if inputs is None:
        return None
    T, Bp = inputs.shape[1], cuda_graphs.bucket(B)
    g = static_verification(model, cache, Bp, T, K, one_hot=q is None)
    g["layers"], g["settings"], g["accept"] = cache["layers"], list(settings) + [GREEDY] * (Bp - B), accept
    numbers = np.array([cuda_sampling.kernel_settings(s, n_vocab) for s in g["settings"]])  # [B', 5]
    padded = [np.concatenate([a, np.full((Bp - B, *a.shape[1:]), fill, a.dtype)])  # [B', ...]: k = 0, u = v = 1
              for a, fill in ((drafts, 0), (np.asarray(k), 0), (u, 1.0), (v, 1.0))]
    at = np.zeros((Bp, K + 1), np.int64)  # [B', K+1]: the tokens to take logits at in each row
    at[:B] = cuda_graphs.logits_at(n_new, np.asarray(k) + 1, K + 1)
    cuda_graphs.copy_in(g["inputs"], np.concatenate([
        np.concatenate([inputs, np.zeros((Bp - B, T), np.int64)]).ravel(),
        pass_positions(cache["lengths"], inputs, n_new, Bp).ravel(),
        (at + T * np.arange(Bp)[:, None]).ravel(),  # counted along the B' x T tokens
        cuda_sampling.verify_draws(*padded).ravel().view(np.int64),
        np.repeat(numbers[:, None], K + 1, axis=1).ravel().view(np.int64)]))
    if q is not None:
        cuda_graphs.copy_in(g["q"][:B], q)
    logits = cuda_graphs.run(g)  # [B', K+1, n_vocab]
    out = g["out"]
    n, token = (out if isinstance(out, np.ndarray) else out.get())[:, :B]  # [B] each: the one copy out
    cuda_sampling.checked(token)
    cache["lengths"] += n_new  # (the pass stored its keys and values)
    return logits[:B].copy() if want_logits else None, n.tolist(), token.tolist()


def run_loop(model, cache, texts, k, settings, draws, riders, keep_logits=False):
    """The loop over texts drafting k[b] tokens for row b: (the drafted ids [B, K] on the host,
    and the graph's buffers q [K, B', n_vocab] and the last pass's logits [B', n_vocab], or
    with keep_logits every pass's [B', K, n_vocab]: the graph of static_loop's that keeps
    them), the cache advanced as K passes a pass at a time would; or None where it cannot be
    recorded: a row's settings reading its counts or text (penalties, an n-gram ban), riders,
    a model or cache without static steps, no drafts, drafts past this model's window (a
    draft whose n_ctx is the target's or larger never has them), or a pass 0 too long for a
    static step. settings: each row's; draws(): each row's k[b] uniforms [B, K], called only
    when the loop runs."""
    params, hparams = model
    B, K = len(texts), max(k)
    if not (K and recordable(model, cache, settings, riders)
            and all(kb <= kv_cache.room(len(text), hparams["n_ctx"]) for kb, text in zip(k, texts))):
        return None
    inputs, n_new = static_inputs(model, cache, texts, 1)  # [B, T]
    if inputs is None:
        return None
    k, T, Bp = np.asarray(k), inputs.shape[1], cuda_graphs.bucket(B)
    loop = static_loop(model, cache, Bp, T, K, keep_logits)
    loop["layers"] = cache["layers"]  # (the rows of this step: cuda_graphs.step says why a view serves)
    loop["settings"] = list(settings) + [GREEDY] * (Bp - B)  # [B']
    u = np.ones((K, Bp))  # [K, B']
    u[:, :B] = draws().T
    numbers = np.array([cuda_sampling.kernel_settings(s, hparams["n_vocab"]) for s in loop["settings"]])  # [B', 5]
    cuda_graphs.copy_in(loop["inputs"], flat_inputs(cache["lengths"], inputs, n_new, k, u, numbers))
    logits = cuda_graphs.run(loop)  # [B', n_vocab], or [B', K, n_vocab] kept
    tokens = loop["tokens"]  # [K, B']
    drafted = (tokens if isinstance(tokens, np.ndarray) else tokens.get())[:, :B].T  # [B, K]: the one copy out
    cuda_sampling.checked(drafted[np.arange(K) < k[:, None]])  # a row that was not a distribution: -1
    cache["lengths"] += n_new + np.minimum(k, K - 1)  # pass 0's tokens, then each draft read after it
    return drafted, loop["q"], logits


def recordable(model, cache, settings, riders):
    """Whether a pass of these rows and its draws may be recorded: static steps for this model
    and cache (cuda_graphs.fits, for B rows of one token), the draws on the device (our
    sampling kernels chosen, or NumPy: the stand-in; the CPU's layout is refused by fits), no
    riders, and no row's settings reading its counts or text (penalties, an n-gram ban)."""
    wpe = model[0]["wpe"]
    return ((isinstance(wpe, np.ndarray) or cuda_sampling.takes(wpe))
            and not any(s.uses_counts or s.no_repeat_ngram_size for s in settings)
            and cuda_graphs.fits(model, cache, np.zeros((len(settings), 1)), riders))


def static_inputs(model, cache, texts, n_logits):
    """The pass's inputs [B, T] and n_new [B] (kv_cache.next_logits's, after the same prefill
    of long runs), or (None, None) where they are too many for a static step (a restarted
    window): then the caller runs as on the CPU."""
    inputs, n_new = kv_cache.prefill_alone(model, cache, texts, n_logits)  # [B, T]
    return (inputs, n_new) if cuda_graphs.fits(model, cache, inputs) else (None, None)


def pass_positions(lengths, inputs, n_new, Bp):
    """Each token's position in a static step of B' rows over inputs [B, T] (row b: n_new[b]
    real tokens from slot lengths[b] on): [B', T], -1 for padding."""
    B, T = inputs.shape
    positions = np.full((Bp, T), -1)  # [B', T]
    positions[:B] = np.where(np.arange(T) < n_new[:, None], lengths[:, None] + np.arange(T), -1)
    return positions


def flat_inputs(lengths, inputs, n_new, k, u, settings):
    """The loop's inputs as one int64 buffer (`static_loop` views it): pass 0's ids and
    positions [B', T] and the token it needs logits at [B'] (counted along its B' x T tokens),
    each later pass's positions [K - 1, B'] (rows past B, tokens past n_new[b] and passes past
    a row's last draft: -1), then the draws u [K, B'] and each row's settings [B', 5]
    (cuda_sampling.kernel_settings), float64 both, as their bits."""
    (B, T), (K, Bp) = inputs.shape, u.shape
    ids = np.zeros((Bp, T), np.int64)  # [B', T]
    ids[:B] = inputs
    positions = pass_positions(lengths, inputs, n_new, Bp)  # [B', T]
    at = np.arange(Bp) * T  # [B']: each row's last real token of pass 0, counted along the B' x T tokens
    at[:B] += np.maximum(n_new - 1, 0)
    i = np.arange(1, K)  # [K - 1]: pass i reads draft i
    later = np.full((K - 1, Bp), -1)  # [K - 1, B']
    later[:, :B] = np.where(i[:, None] <= k, lengths + n_new + i[:, None] - 1, -1)
    return np.concatenate([ids.ravel(), positions.ravel(), at, later.ravel(), u.ravel().view(np.int64),
                           settings.ravel().view(np.int64)])


def static_loop(model, cache, Bp, T, K, keep_logits=False):
    """The loop for B' rows, T tokens in pass 0 and K passes, made at first use
    (cuda_graphs.run records and replays it): {"inputs" (flat_inputs), "q" [K, B', n_vocab],
    "tokens" [K, B'] (the drafted ids), "forward" (writes q and tokens, returns the last
    pass's logits [B', n_vocab], or with keep_logits every pass's [B', K, n_vocab], a buffer
    of this graph's), "layers" and "settings" (run_loop sets them), ...}."""
    params, hparams = model
    key = ("decode loop", id(params), cuda_graphs.pointer(cache["layers"][0]["k"]), Bp, T, K, keep_logits)
    if key not in cache["graphs"]:
        wpe = params["wpe"]
        buffer = np.zeros(2 * Bp * T + 2 * Bp * K + 5 * Bp, np.int64, like=wpe)  # flat_inputs
        ids, positions = buffer[:Bp * T].reshape(Bp, T), buffer[Bp * T:2 * Bp * T].reshape(Bp, T)  # [B', T] each
        at = buffer[2 * Bp * T:2 * Bp * T + Bp].reshape(Bp, 1)  # [B', 1]
        later = buffer[2 * Bp * T + Bp:2 * Bp * T + Bp * K].reshape(K - 1, Bp, 1)  # [K - 1, B', 1]
        u = buffer[2 * Bp * T + Bp * K:2 * Bp * T + 2 * Bp * K].view(np.float64).reshape(K, Bp)  # [K, B']
        settings = buffer[2 * Bp * T + 2 * Bp * K:].view(np.float64).reshape(Bp, 5)  # [B', 5]
        q = np.zeros((K, Bp, hparams["n_vocab"]), np.float32, like=wpe)  # [K, B', n_vocab]
        tokens = np.zeros((K, Bp), np.int64, like=wpe)  # [K, B']: draft i + 1 of each row in row i
        kept = np.zeros((Bp, K, hparams["n_vocab"]), wpe.dtype, like=wpe) if keep_logits else None  # [B', K, V]
        loop = cache["graphs"][key] = {"inputs": buffer, "q": q, "tokens": tokens, "layers": cache["layers"],
                                       "settings": None, "uses": 0, "replay": None, "output": None, "graph": None,
                                       "params": params}

        def forward():
            for i in range(K):
                if i == 0:  # logits at every token, then each row's last: a pass at a time computes all T,
                    # and the stand-in's BLAS gives other bits for fewer rows (our kernels do not)
                    logits = cuda_graphs.pass_over(model, loop["layers"], ids, positions, None)  # [B', T, V]
                    logits = (logits.reshape(Bp * T, -1)[at] if T > 1 else logits)[:, 0]  # [B', n_vocab]: one take
                else:
                    logits = cuda_graphs.pass_over(model, loop["layers"], tokens[i - 1][:, None], later[i - 1],
                                                   None)[:, 0]  # [B', n_vocab]
                draw(logits, settings, loop["settings"], u[i], q[i], tokens[i])
                if kept is not None:
                    kept[:, i] = logits  # [B', n_vocab]: one copy
            return logits if kept is None else kept
        loop["forward"] = forward
    return cache["graphs"][key]


def static_verification(model, cache, Bp, T, K, one_hot=False):
    """The verification of K drafts for B' rows, T tokens a row in the target's pass, made at
    first use (cuda_graphs.run records and replays it): {"inputs" (`verify` fills it: ids and
    positions [B', T], the tokens to take logits at [B', K+1] (counted along the B' x T),
    cuda_sampling.verify_draws [B', 2K+2] and each row's settings [B', K+1, 5], float64 both,
    as their bits), "q" [B', K, n_vocab] (None if one_hot: one-hot at the drafts), "out"
    [2, B'] (n, token), "forward" (returns the logits [B', K+1, n_vocab]), ...}."""
    params, hparams = model
    key = ("verification", id(params), cuda_graphs.pointer(cache["layers"][0]["k"]), Bp, T, K, one_hot)
    if key not in cache["graphs"]:
        wpe, P, n_vocab = params["wpe"], K + 1, hparams["n_vocab"]
        sizes = np.cumsum([0, Bp * T, Bp * T, Bp * P, Bp * (2 * K + 2), Bp * P * 5])
        buffer = np.zeros(sizes[-1], np.int64, like=wpe)
        ids, positions, at = (buffer[sizes[i]:sizes[i + 1]].reshape(Bp, -1) for i in range(3))  # [B', T|T|K+1]
        draws = buffer[sizes[3]:sizes[4]].view(np.float64).reshape(Bp, 2 * K + 2)  # [B', 2K+2]
        settings = buffer[sizes[4]:].view(np.float64).reshape(Bp, P, 5)  # [B', K+1, 5]
        p = np.zeros((Bp, P, n_vocab), np.float32, like=wpe)  # [B', K+1, n_vocab]
        q = None if one_hot else np.zeros((Bp, K, n_vocab), np.float32, like=wpe)  # [B', K, n_vocab]
        g = cache["graphs"][key] = {"inputs": buffer, "q": q,
                                    "out": np.zeros((2, Bp), np.int64, like=wpe), "layers": cache["layers"],
                                    "settings": None, "accept": None, "uses": 0, "replay": None, "output": None,
                                    "graph": None, "params": params}

        def forward():
            # logits at every token, then the K+1 wanted: as a pass at a time (cuda_graphs.step)
            logits = cuda_graphs.pass_over(model, g["layers"], ids, positions, None)  # [B', T, n_vocab]
            logits = logits.reshape(Bp * T, n_vocab)[at]  # [B', K+1, n_vocab]: one take
            distributions(logits, settings, g["settings"], p)
            if isinstance(logits, np.ndarray):  # the stand-in: speculative.verify on its arrays
                drafts, k = draws[:, :K].astype(np.int64), draws[:, 2 * K].astype(np.int64)  # [B', K], [B']
                g["out"][...] = g["accept"](p, g["q"], drafts, k, draws[:, K:2 * K], draws[:, -1])  # u, v
            else:
                cuda_sampling.accept(p, g["q"], draws, g["out"])
            return logits
        g["forward"] = forward
    return cache["graphs"][key]


def draw(logits, settings, row_settings, u, q, tokens):
    """q = the distribution of logits [B, n_vocab], row b under its settings, and tokens [B] =
    a draw from it at u, without the host: our kernels into the buffers given. The stand-in:
    sampling.sample."""
    distributions(logits, settings, row_settings, q)
    if isinstance(logits, np.ndarray):
        tokens[...] = sampling.sample(q, u)
    else:
        cuda_sampling.draw(q, u, tokens)


def distributions(logits, settings, row_settings, out):
    """out = the distribution of logits [B, ..., n_vocab], row b under its settings: on the
    device one launch reading `settings` [B, ..., 5] (cuda_sampling.kernel_settings); the
    stand-in: sampling.py under row_settings [B] (SamplingSettings), the rows that share
    settings in one call, as batching.distributions groups them."""
    if isinstance(logits, np.ndarray):
        for s in dict.fromkeys(row_settings):
            rows = [b for b, x in enumerate(row_settings) if x == s]
            out[rows] = sampling.probabilities(logits[rows], None, s)
    else:
        n_vocab = logits.shape[-1]
        cuda_sampling.distribution_rows(logits.reshape(-1, n_vocab), settings.reshape(-1, 5), out.reshape(-1, n_vocab))
