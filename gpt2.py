"""GPT-2's forward pass in NumPy: the whole model, as picoGPT writes it.

GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf)
is a decoder-only transformer: token + position embeddings, n_layer pre-norm
blocks of causal multi-head attention and a GELU MLP, a final layer norm, and
an output head tied to the token embedding. The functions below are the whole
model; they follow picoGPT (https://github.com/jaymody/picoGPT), extended to a
batch [B, T] of rows of different lengths, and to a KV cache: given a pass's state
(kv_cache.py), `gpt2` runs only the tokens it is given while each attention layer
reads the earlier ones' keys and values from the cache. Every decoder's every pass is
a call of `gpt2`; picoGPT's `generate`, the loop around it, is batching.generate.

Activations keep the weights' dtype (float32 on the CPU): a float64 scalar such
as np.sqrt(d) would silently promote them to float64, and NumPy would then widen
each float32 weight matrix they meet to float64, a copy for every product; so
constants are Python floats, which NumPy keeps at the array's precision
(tests/test_gpt2.py).

Hardware (skip on a first read). Nothing here says which hardware runs it: the arrays
do. An array type can take over NumPy's functions and operators (its protocols
`__array_function__` and `__array_ufunc__`, NEPs 18 and 13). CuPy's arrays do, so with
the weights on a GPU every step runs there. On
a CPU each weight matrix is laid out at load as a `Matrix` (README section 4; weights.py),
whose `x @ w` runs a compiled loop (NumPy hands `x @ w` to `w.__rmatmul__`), and wte as an
`Embedding`, whose `wte[tokens]` and `wte.T` read that one stored matrix. float16 appears
only with CuPy.

A cached pass may also bring its own layer_norm and transformer_block, the same math in
fewer, larger steps (on a CPU a compiled layer norm, in gpt2's own block; on a GPU a block
whose every product, one GPU call, also does the layer norm before it and the bias, GELU
and residual after it), and gpt2 calls whichever it holds. Index arrays are made with
like=x, on x's device, so a recorded GPU step copies nothing from the host.
"""
import numpy as np


def gelu(x):
    """GELU, tanh approximation (what GPT-2 was trained with)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def softmax(x):
    """exp(x) / sum(exp(x)) over the last axis (its max subtracted first, so exp cannot overflow)."""
    exp_x = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return exp_x / np.sum(exp_x, axis=-1, keepdims=True)


def layer_norm(x, g, b, eps=1e-5):
    """g * (x - mean) / sqrt(variance + eps) + b over the last axis."""
    n = x.shape[-1]
    h = x.astype(np.float32, copy=False)  # float16 activations: statistics in float32 (float32: no copy)
    h = h - h.sum(axis=-1, keepdims=True) / n  # x - mean
    variance = (h * h).sum(axis=-1, keepdims=True) / n
    return (g * (h / np.sqrt(variance + eps)) + b).astype(x.dtype, copy=False)


def linear(x, w, b):
    """[..., n_in] @ [n_in, n_out] + [n_out] -> [..., n_out] (w: an array, or a matrix
    laid out at load, which multiplies itself: see the module's docstring)."""
    return x @ w + b


def ffn(x, c_fc, c_proj):
    """The MLP: gelu(x @ c_fc) @ c_proj, 4 * n_embd wide inside."""
    return linear(gelu(linear(x, **c_fc)), **c_proj)  # [B, T, n_embd]


def attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d_head) + mask) v, with mask 0 (see) or -inf (hide):
    q [..., T, d_head], k, v [..., S, d_head] -> [..., T, d_head]."""
    scores = q @ k.swapaxes(-1, -2) * (1.0 / float(np.sqrt(q.shape[-1]))) + mask  # [..., T, S]
    # the mask is float32, so a float16 model's scores (and its softmax) become float32 here
    return softmax(scores).astype(v.dtype, copy=False) @ v  # [..., T, d_head]


def causal_mask(T, like):
    """[T, T]: query t sees keys 0..t."""
    return np.triu(np.full_like(like, -np.inf, dtype=np.float32, shape=(T, T)), k=1)


def mha(x, c_attn, c_proj, n_head, attend=None):
    """Causal multi-head self-attention over x [B, T, n_embd]. attend(q, k, v): with a
    cache, stores this pass's keys and values and attends each query over its own row's
    cached ones (kv_cache.py); without, the T tokens attend among themselves."""
    B, T, n_embd = x.shape
    qkv = linear(x, **c_attn)  # [B, T, 3*n_embd]
    qkv = qkv.reshape(B, T, 3, n_head, n_embd // n_head).transpose(2, 0, 3, 1, 4)  # [3, B, n_head, T, d_head]
    q, k, v = qkv[0], qkv[1], qkv[2]  # [B, n_head, T, d_head]
    if attend is None:
        out = attention(q, k, v, causal_mask(T, like=x))  # [B, n_head, T, d_head]
    else:
        out = attend(q, k, v)  # [B, n_head, T, d_head]
    out = out.transpose(0, 2, 1, 3).reshape(B, T, n_embd)  # [B, T, n_embd]: the heads side by side
    return linear(out, **c_proj)  # [B, T, n_embd]


def transformer_block(x, mlp, attn, ln_1, ln_2, n_head, attend=None, norm=layer_norm):
    """A pre-norm block: x + attention, then x + MLP, each on a normalized x. norm: the
    layer norm a pass runs (gpt2's own, or the same function as a compiled loop)."""
    x = x + mha(norm(x, **ln_1), **attn, n_head=n_head, attend=attend)  # [B, T, n_embd]
    x = x + ffn(norm(x, **ln_2), **mlp)  # [B, T, n_embd]
    return x


def gpt2(inputs, wte, wpe, blocks, ln_f, n_head, state=None):
    """Logits of a batch of token ids inputs [B, T]: [B, T, n_vocab] at every position, as
    picoGPT (state None: gpt2(np.array([ids]), **params, n_head=hparams["n_head"])); with
    state, [B, n, n_vocab] at only the n positions of each row in state.logits_at [B, n]
    (the 50257-wide head is the largest product of a step; None: at all T). state, a
    kv_cache.Pass (section 3), also holds each token's position, each layer's attend, and
    the layer norm and transformer_block the pass runs."""
    if state is None:  # picoGPT: the whole text, no cache
        assert inputs.shape[1] <= len(wpe), "at most n_ctx tokens without a cache (kv_cache.py: its window)"
        positions, attends = np.arange(inputs.shape[1]), [None] * len(blocks)  # [T]
        norm, run_block = layer_norm, transformer_block
    else:  # a pass over the cache (kv_cache.py)
        positions, attends = state.positions, state.attends  # [B, T]
        norm, run_block = state.layer_norm, state.transformer_block
    x = wte[inputs] + wpe[positions]  # [B, T, n_embd]
    for block, attend in zip(blocks, attends):
        x = run_block(x, **block, n_head=n_head, attend=attend, norm=norm)  # [B, T, n_embd]
    if state is not None and state.logits_at is not None:
        x = x[np.arange(x.shape[0], like=x)[:, None], state.logits_at]  # [B, n, n_embd]: only where logits are needed
    return norm(x, **ln_f) @ wte.T  # [B, T or n, n_vocab]: the head is the token embedding again
