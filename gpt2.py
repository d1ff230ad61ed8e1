"""GPT-2's forward pass in NumPy, and plain autoregressive decoding.

GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf)
is a decoder-only transformer: token + position embeddings, n_layer pre-norm
blocks of causal multi-head attention and a GELU MLP, a final layer norm, and
an output head tied to the token embedding. The functions below are the whole
model; they follow picoGPT (https://github.com/jaymody/picoGPT), extended to a
batch [B, T], a KV cache (kv_cache.py) and logits only where they are needed.

Everything stays float32: a float64 scalar such as np.sqrt(d) would silently
promote activations to float64 and halve the speed, so constants are Python
floats, which NumPy keeps at the array's precision.

The same code runs on a GPU with CuPy (utils.to_backend): NumPy's functions hand
CuPy arrays to CuPy (the __array_ufunc__ / __array_function__ protocols, NEP 13
and 18), and arrays made from nothing take `like=` an array that exists (NEP 35).
So the weights' location decides where every step runs. Host and device meet
only at small index arrays and the chosen token ids.
"""

import time

import numpy as np

import kv_cache
import sampling


def gelu(x):
    """GELU, tanh approximation (what GPT-2 was trained with)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# At batch 1 each small op costs microseconds of Python and NumPy overhead, about
# 600 of them per 124M step; the array methods x.sum / x.max skip the np.mean
# wrapper, which saves about 10 us per layer norm (0.25 ms a step).
def softmax(x):
    exp_x = np.exp(x - x.max(axis=-1, keepdims=True))
    return exp_x / exp_x.sum(axis=-1, keepdims=True)


def layer_norm(x, g, b, eps=1e-5):
    n = x.shape[-1]
    h = x.astype(np.float32, copy=False)  # float16 activations: statistics in float32 (float32: no copy)
    h = h - h.sum(axis=-1, keepdims=True) / n  # x - mean
    variance = (h * h).sum(axis=-1, keepdims=True) / n
    return (g * (h / np.sqrt(variance + eps)) + b).astype(x.dtype, copy=False)


# OpenBLAS runs a matmul of 2-7 rows 2-3x slower than of one row, and 8 rows
# cost about 2x one row; so a pass of 2-7 tokens (speculative verification) is
# padded to 8 rows, which is cheaper than the 2-7 rows themselves.
PAD_ROWS_TO = 8


def linear(x, w, b):
    """x @ w + b over the last axis, with the rows of the batch flattened into one matmul."""
    rows = x.reshape(-1, x.shape[-1])  # [B*T, n_in]
    n = rows.shape[0]
    if 1 < n < PAD_ROWS_TO and isinstance(rows, np.ndarray):  # OpenBLAS only; a GPU gains nothing
        rows = np.concatenate([rows, np.zeros((PAD_ROWS_TO - n, rows.shape[1]), rows.dtype)])
    return (rows @ w + b)[:n].reshape(*x.shape[:-1], w.shape[-1])  # [B, T, n_out]


def ffn(x, c_fc, c_proj):
    return linear(gelu(linear(x, **c_fc)), **c_proj)  # [B, T, n_embd] -> [B, T, 4*n_embd] -> [B, T, n_embd]


def attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d_head) + mask) v, with mask 0 (see) or -inf (hide)."""
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    # the mask is float32, so a float16 model's scores (and its softmax) become float32 here
    scores = (q @ k.swapaxes(-1, -2)) * scale + mask  # [B, n_head, T, S]
    return softmax(scores).astype(v.dtype, copy=False) @ v  # [B, n_head, T, d_head]


def mha(x, c_attn, c_proj, n_head, mask, cache=None, layer=0, plan=None):
    B, T, n_embd = x.shape
    qkv = linear(x, **c_attn)  # [B, T, 3*n_embd]
    qkv = qkv.reshape(B, T, 3, n_head, n_embd // n_head).transpose(2, 0, 3, 1, 4)  # [3, B, n_head, T, d_head]
    q, k, v = qkv[0], qkv[1], qkv[2]  # [B, n_head, T, d_head]
    if cache is not None:
        k, v = kv_cache.append_kv(cache, layer, k, v, plan)  # [B, n_head, S, d_head]
    out = attention(q, k, v, mask)  # [B, n_head, T, d_head]
    out = out.transpose(0, 2, 1, 3).reshape(B, T, n_embd)  # [B, T, n_embd]
    return linear(out, **c_proj)


def transformer_block(x, mlp, attn, ln_1, ln_2, n_head, mask, cache=None, layer=0, plan=None):
    x = x + mha(layer_norm(x, **ln_1), **attn, n_head=n_head, mask=mask, cache=cache, layer=layer, plan=plan)
    x = x + ffn(layer_norm(x, **ln_2), **mlp)
    return x  # [B, T, n_embd]


def gpt2(inputs, wte, wpe, blocks, ln_f, n_head, cache=None, n_new=None, all_logits=False):
    """Logits for a batch of token ids.

    inputs [B, T]: row b holds n_new[b] real tokens (default T), then padding.
    cache: if given, these tokens continue each row's cached prefix, their keys and
      values are stored, and each row's length grows by n_new[b].
    Returns logits [B, n_vocab] at each row's last real token, or [B, T, n_vocab]
    at every position with all_logits (speculative verification needs them all).
    The 50257-wide head is the single largest matmul, so it runs only where needed.
    """
    B, T = inputs.shape
    n_new = np.full(B, T) if n_new is None else np.asarray(n_new)
    start = np.zeros(B, dtype=np.int64) if cache is None else cache["lengths"]
    positions = start[:, None] + np.arange(T)  # [B, T]: a token's position is its slot
    plan = kv_cache.write_plan(start, n_new, T) if cache is not None else None
    S = plan[1] if cache is not None else T  # keys: the cached prefix and these tokens
    # query at position t may see keys at positions <= t; this also hides stale slots
    hidden = np.arange(S)[None, None, :] > positions[:, :, None]  # [B, T, S]
    mask = np.where(hidden, np.float32(-np.inf), np.float32(0.0))[:, None]  # [B, 1, T, S]
    mask = np.asarray(mask, like=wte)  # built on the host, used where the weights are (NumPy: no copy)
    x = wte[inputs] + wpe[np.minimum(positions, wpe.shape[0] - 1)]  # [B, T, n_embd]
    for layer, block in enumerate(blocks):
        x = transformer_block(x, **block, n_head=n_head, mask=mask, cache=cache, layer=layer, plan=plan)
    if cache is not None:
        cache["lengths"] = cache["lengths"] + n_new
    if not all_logits:
        x = x[np.arange(B), n_new - 1][:, None]  # [B, 1, n_embd]: each row's last real token
    x = layer_norm(x, **ln_f)
    logits = linear(x, wte.T, 0.0)  # [B, T or 1, n_vocab]
    return logits if all_logits else logits[:, 0]


def next_logits(params, hparams, cache, seqs, all_logits=False):
    """One model pass that brings each row up to date: with a cache, only the tokens
    it has not seen (inside the sliding window); without, the whole window again.
    Returns (logits, n_new): [B, n_vocab], or [B, T, n_vocab] with all_logits, where
    row b's real positions are the first n_new[b]."""
    if cache is not None:
        inputs, n_new = kv_cache.pending_inputs(cache, seqs, hparams["n_ctx"])  # [B, T]
    else:
        inputs, n_new = kv_cache.pad_right([s[-hparams["n_ctx"]:] for s in seqs])  # [B, T]
    logits = gpt2(inputs, **params, n_head=hparams["n_head"], cache=cache, n_new=n_new, all_logits=all_logits)
    return logits, n_new


def new_cache(params, hparams, B, n_tokens):
    """A static cache just big enough for n_tokens per row (never more than n_ctx)."""
    return kv_cache.init_cache(hparams["n_layer"], hparams["n_head"], min(hparams["n_ctx"], n_tokens),
                               hparams["n_embd"], B, dtype=params["wte"].dtype, like=params["wte"])


def generate(prompts, params, hparams, n_tokens_to_generate, settings, rng, use_cache=True,
             eos_id=None, callback=None):
    """Autoregressive decoding: one model pass per new token, for a batch of prompts.

    prompts: lists of token ids, any lengths. Each row stops at eos_id (if given) or
    after n_tokens_to_generate tokens; finished rows leave the batch, which ends
    when every row has ended. callback(row, token) sees each token as it comes.
    Returns (the new tokens of each row, stats).
    """
    seqs = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    active = list(range(len(prompts)))  # rows still generating, in cache order
    counts = sampling.token_counts(prompts if settings.penalize_prompt else [[]] * len(prompts),
                                   hparams["n_vocab"])
    cache = new_cache(params, hparams, len(seqs), max(map(len, seqs)) + n_tokens_to_generate) if use_cache else None
    cache_bytes = kv_cache.cache_nbytes(cache) if use_cache else 0  # as allocated, before rows finish
    start = time.perf_counter()
    token_times = []
    for _ in range(n_tokens_to_generate):
        logits, _ = next_logits(params, hparams, cache, [seqs[b] for b in active])  # [B, n_vocab]
        row_counts = counts[active] if settings.uses_counts else None  # only penalties read them
        probs = sampling.probabilities(logits, row_counts, settings)  # [B, n_vocab]
        tokens = sampling.sample(probs, rng)  # [B]
        token_times.append(time.perf_counter())
        for b, token in zip(active, tokens.tolist()):
            seqs[b].append(token)
            out[b].append(token)
            counts[b, token] += 1
            if callback:
                callback(b, token)
        done = [i for i, b in enumerate(active) if eos_id is not None and out[b][-1] == eos_id]
        if done:
            keep = [i for i in range(len(active)) if i not in done]
            active = [active[i] for i in keep]
            if cache is not None:
                kv_cache.keep_rows(cache, keep)
        if not active:
            break
    stats = decode_stats(start, token_times, sum(map(len, out)))
    stats["kv_cache_bytes"] = cache_bytes
    return out, stats


def decode_stats(start, token_times, n_tokens):
    """Time to first token, inter-token latencies and throughput of one decode."""
    total = token_times[-1] - start if token_times else 0.0
    gaps = np.diff(token_times) if len(token_times) > 1 else np.zeros(0)
    return {"n_tokens": n_tokens, "seconds": total,
            "ttft_s": token_times[0] - start if token_times else 0.0,
            "itl_ms_median": float(np.median(gaps) * 1e3) if gaps.size else 0.0,
            "itl_ms_p90": float(np.percentile(gaps, 90) * 1e3) if gaps.size else 0.0,
            "tokens_per_s": n_tokens / total if total > 0 else 0.0}
