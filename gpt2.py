"""GPT-2's forward pass in NumPy, and plain autoregressive decoding.

GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf)
is a decoder-only transformer: token + position embeddings, n_layer pre-norm
blocks of causal multi-head attention and a GELU MLP, a final layer norm, and
an output head tied to the token embedding. The functions below are the whole
model; they follow picoGPT (https://github.com/jaymody/picoGPT), extended to a
batch [B, T], a KV cache (kv_cache.py) and logits only where they are needed.

Activations keep the weights' dtype (float32 on the CPU): a float64 scalar such
as np.sqrt(d) would silently promote them to float64 and halve the speed, so
constants are Python floats, which NumPy keeps at the array's precision.

The same code runs on a GPU with CuPy (kernels/layout.py: to_backend): NumPy's functions hand
CuPy arrays to CuPy (the __array_ufunc__ / __array_function__ protocols, NEP 13
and 18), and arrays made from nothing take `like=` an array that exists (NEP 35).
So the weights' location decides where every step runs. Host and device meet
only at small index arrays and the chosen token ids.

These NumPy functions are the model, and with `--kernel numpy` they are all that runs.
Where the CPU's kernels take over, they do through one door, kernels/rowwise.py: the
matrix products (`rowwise.matmul`), and in a pass marked fused, layer norm and attention
(`rowwise.layer_norm`, `rowwise.attention`): the same math, each row summed in a fixed order.
"""


import numpy as np

import batching
import kv_cache
import sampling
from kernels import rowwise


def gelu(x):
    """GELU, tanh approximation (what GPT-2 was trained with)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def layer_norm(x, g, b, eps=1e-5):
    """g * (x - mean) / sqrt(variance + eps) + b over the last axis. (x.sum skips np.mean's
    wrapper: at batch 1 each of a step's hundreds of small ops costs microseconds of overhead.)"""
    n = x.shape[-1]
    h = x.astype(np.float32, copy=False)  # float16 activations: statistics in float32 (float32: no copy)
    h = h - h.sum(axis=-1, keepdims=True) / n  # x - mean
    variance = (h * h).sum(axis=-1, keepdims=True) / n
    return (g * (h / np.sqrt(variance + eps)) + b).astype(x.dtype, copy=False)


def linear(x, w, b, shared=False, scale=None):
    """x @ w + b over the last axis, the rows of the batch flattened together. w: a matrix
    [n_in, n_out] or the row kernel's blocks of it (kernels/rowwise.py; b says n_out), in float32,
    bfloat16, int8 or int4 with its scales (kernels/weight_formats.py). shared: the pass serves
    several requests, so each row must come out as it would alone."""
    rows = x.reshape(-1, x.shape[-1])  # [n, n_in]
    n_out = b.shape[-1]
    return (rowwise.matmul(rows, w, shared, n_out, scale) + b).reshape(*x.shape[:-1], n_out)  # [B, T, n_out]


def head_logits(x, wte, lm_head=None, n_vocab=None, shared=False):
    """x @ wte.T: the head is the token embedding again (tied weights), for the first
    n_vocab tokens (default: all). lm_head, where the params have it, is the same matrix
    wte.T stored as the row kernel's blocks, {"w"} (and "scale" for int8 and int4; kernels/layout.py)."""
    n_vocab = n_vocab or wte.shape[0]
    rows = x.reshape(-1, x.shape[-1])  # [n, n_embd]
    if lm_head is None:
        return rowwise.matmul(rows, wte[:n_vocab].T, shared).reshape(*x.shape[:-1], n_vocab)  # [B, n, n_vocab]
    logits = rowwise.matmul(rows, lm_head["w"], shared, n_vocab, lm_head.get("scale"))  # [n, n_vocab]
    return logits.reshape(*x.shape[:-1], n_vocab)  # [B, n, n_vocab]


def embed(inputs, wte, lm_head=None):
    """Token embeddings [B, T, n_embd] of inputs [B, T]: rows of wte, or, with the row
    kernel's layout, the same numbers read from the head's blocks (wte.T), in the head's
    format: a narrow model (bfloat16, int8, int4) keeps one copy of its embedding, the narrow one."""
    if lm_head is None:
        return wte[inputs]  # [B, T, n_embd]
    rows = rowwise.columns(lm_head, inputs.reshape(-1))  # [B*T, n_embd]
    return rows.reshape(*inputs.shape, rows.shape[-1])  # [B, T, n_embd]


def ffn(x, c_fc, c_proj, shared=False):
    """The MLP: gelu(x @ c_fc) @ c_proj, 4 * n_embd wide inside."""
    h = gelu(linear(x, **c_fc, shared=shared))  # [B, T, 4*n_embd]
    return linear(h, **c_proj, shared=shared)  # [B, T, n_embd]


def attention(q, k, v, mask, shared=False):
    """softmax(q k^T / sqrt(d_head) + mask) v, with mask 0 (see) or -inf (hide).
    shared: one matrix-vector product per query, so that no query's sums depend on how
    many queries share the pass (kernels/rowwise.py says why); else one product per head."""
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    # the mask is float32, so a float16 model's scores (and its softmax) become float32 here
    if not shared:
        scores = (q @ k.swapaxes(-1, -2)) * scale + mask  # [B, n_head, T, S]
        return sampling.softmax(scores).astype(v.dtype, copy=False) @ v  # [B, n_head, T, d_head]
    scores = np.matmul(k[:, :, None], q[..., None])[..., 0] * scale + mask  # [B, n_head, T, S]
    p = sampling.softmax(scores).astype(v.dtype, copy=False)  # [B, n_head, T, S]
    return np.matmul(p[..., None, :], v[:, :, None])[..., 0, :]  # [B, n_head, T, d_head]


def mha(x, c_attn, c_proj, n_head, state, layer=None):
    """Causal multi-head self-attention. state: the kv_cache.Pass (positions, mask, which rows
    share a length); layer: this layer's cache, where these keys and values go (or None)."""
    B, T, n_embd = x.shape
    qkv = linear(x, **c_attn, shared=state.shared)  # [B, T, 3*n_embd]
    qkv = qkv.reshape(B, T, 3, n_head, n_embd // n_head).transpose(2, 0, 3, 1, 4)  # [3, B, n_head, T, d_head]
    q, k, v = qkv[0], qkv[1], qkv[2]  # [B, n_head, T, d_head]
    if layer is not None:  # cached: store these keys and values, attend over everything cached
        k, v = kv_cache.append(state, layer, k, v)  # [B, n_head, S, d_head]
    if state.fused:  # the kernels' loop: each query over its own row's keys up to itself
        return linear(rowwise.attention(q, k, v, state.positions), **c_proj, shared=True)
    out = np.empty_like(q)  # [B, n_head, T, d_head]
    for S, rows in state.groups:  # each row attends over its own S keys: a sum's length is the row's own
        out[rows] = attention(q[rows], k[rows, :, :S], v[rows, :, :S], state.mask[rows, ..., :S], state.shared)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, n_embd)  # [B, T, n_embd]
    return linear(out, **c_proj, shared=state.shared)


def transformer_block(x, mlp, attn, ln_1, ln_2, n_head, state, layer=None):
    norm = rowwise.layer_norm if state.fused else layer_norm
    x = x + mha(norm(x, **ln_1), **attn, n_head=n_head, state=state, layer=layer)
    x = x + ffn(norm(x, **ln_2), **mlp, shared=state.shared)
    return x  # [B, T, n_embd]


def final_hidden(inputs, wte, wpe, blocks, ln_f, n_head, state=None, lm_head=None):
    """The transformer without its head (lm_head gives only the embeddings): the final hidden
    states [B, n, n_embd] of a batch of token ids inputs [B, T], at every position
    (without state) or where the kv_cache.Pass state says logits are needed: each row's last few
    real tokens. state also gives the tokens' positions, the mask and the cache."""
    B, T = inputs.shape
    state = state or kv_cache.begin_pass(None, np.full(B, T), T, T, like=wte)
    x = embed(inputs, wte, lm_head) + wpe[np.minimum(state.positions, wpe.shape[0] - 1)]  # [B, T, n_embd]
    layers = state.cache["layers"] if state.cache is not None else [None] * len(blocks)
    for block, layer in zip(blocks, layers):
        x = transformer_block(x, **block, n_head=n_head, state=state, layer=layer)
    if state.cache is not None:
        kv_cache.advance(state)
    x = x[np.arange(B)[:, None], state.logits_at]  # [B, n, n_embd]: only where logits are needed
    return (rowwise.layer_norm if state.fused else layer_norm)(x, **ln_f)


def gpt2(inputs, wte, wpe, blocks, ln_f, n_head, state=None, lm_head=None):
    """Logits [B, T, n_vocab] at every position, as picoGPT (or [B, n, n_vocab] where the Pass
    state says). The 50257-wide head is the largest matmul of a step, so it runs only where
    logits are needed."""
    x = final_hidden(inputs, wte, wpe, blocks, ln_f, n_head, state, lm_head)  # [B, n, n_embd]
    return head_logits(x, wte, lm_head)  # [B, n, n_vocab]


# A row's tokens that need no logits (a prompt but its last token, a window refilled
# after a restart) run in a pass of the row's own when there are more than this: one
# product then costs less than a gemv per token, and its rounding depends on that row alone.
ALONE_ABOVE = 8


def next_logits(model, cache, texts, n_logits=1, head=None):
    """One pass that brings every text up to date: with a cache, only the tokens it
    has not seen; without, the whole window again. Returns logits [B, n, n_vocab] at
    each row's last n_logits[b] tokens (n = the largest n_logits), through head(x)
    if given (a draft's vocabulary subset), else the full tied head. With a cache the
    pass is shared: every row comes out bitwise as it would alone (kernels/rowwise.py)."""
    params, hparams = model
    with rowwise.kernel_pass(params):
        if cache is not None:
            prefill_alone(model, cache, texts, n_logits)
        inputs, n_new = kv_cache.pending_inputs(cache, texts, hparams["n_ctx"])  # [B, T]
        state = kv_cache.begin_pass(cache, n_new, inputs.shape[1], n_logits, like=params["wte"],
                                shared=cache is not None, fused=cache is not None and rowwise.fuses(model))
        x = final_hidden(inputs, **params, n_head=hparams["n_head"], state=state)  # [B, n, n_embd]
        if head:
            return head(x)
        return head_logits(x, params["wte"], params.get("lm_head"), shared=state.shared)  # [B, n, n_vocab]


def prefill_alone(model, cache, texts, n_logits):
    """Cache each row's tokens that need no logits in a pass of the row's own, where
    there are more than ALONE_ABOVE of them; the shared pass then runs only the rest. With
    the kernels it runs layer norm and attention as every cached pass does (per row, per
    query), so a token's keys and values never depend on the pass that computed them
    (what serving/prefix_cache.py relies on)."""
    params, hparams = model
    inputs, n_new = kv_cache.pending_inputs(cache, texts, hparams["n_ctx"])  # [B, T]
    m = n_new - np.broadcast_to(n_logits, n_new.shape)  # [B]: tokens before the first that needs logits
    for b in np.nonzero(m > ALONE_ABOVE)[0]:
        state = kv_cache.begin_pass(kv_cache.rows(cache, b, b + 1), m[b:b + 1], int(m[b]), 1, like=params["wte"],
                                    fused=rowwise.fuses(model))  # as every pass: its keys the same bits
        final_hidden(inputs[b:b + 1, :m[b]], **params, n_head=hparams["n_head"], state=state)  # fills the cache


def autoregressive_step(batch, model):
    """Every row gains one token, sampled from the model's next-token distribution."""
    logits = next_logits(model, batching.cache(batch, "target"), batching.token_ids(batch))[:, 0]  # [B, n_vocab]
    p = batching.distributions(batch, logits)  # [B, n_vocab]
    tokens = sampling.sample(p, batching.uniforms(batch, 1)[:, 0]).tolist()  # [B]: only these leave a GPU
    for b, token in enumerate(tokens):
        batching.emit(batch, b, [token], logits=logits[b:b + 1])
    batch.stats.step_done()


def generate(requests, model, use_cache=True, callback=None):
    """Autoregressive decoding: one model pass per new token, for a batch of requests
    (batching.requests). model: (params, hparams). Rows leave the batch as they finish.
    Returns (each request's new tokens, batching.Stats)."""
    return batching.run(requests, {"target": model}, lambda batch: autoregressive_step(batch, model), use_cache,
                        callback)
