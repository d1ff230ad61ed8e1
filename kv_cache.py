"""The KV cache: decode one token per model pass instead of re-reading the prefix.

In causal attention the keys and values of a token never change once computed,
because a token only attends to tokens before it. So we keep them: prefill the
prompt once, then each step computes k, v for the new token only and appends
them. Per token the model now reads its weights once and the cache once,
instead of recomputing all T earlier positions.

Layout: two preallocated arrays `[n_layer, B, n_head, n_ctx, d_head]` (static
cache: no reallocation, no concatenation of the history). Every row sits
left-aligned at slot 0 with its own `lengths[b]`, so a token's position id is
simply its slot index. Rows of different lengths (a batch of prompts, or
speculative decoding where each row accepts a different number of drafts) need
nothing more than one causal mask per row: query at slot t sees keys at slots
<= t, which hides both the future and any stale slots past the row's length.
This plays the role of left-padding with position ids and an attention mask,
and also lets every row advance or roll back by its own amount.

Context overflow: GPT-2 has learned absolute position embeddings for n_ctx
positions only. Past that we slide a window over the most recent tokens. A
shifted window changes every cached key's position, so the cache must be
rebuilt; doing that every step would cost a full prefill per token. Instead,
when a row's window is full we restart it from its last n_ctx // 2 tokens and
keep appending. Each token then sees between n_ctx/2 and n_ctx tokens of
context: exact up to the window edge, approximate (but cheap) after it. The
uncached path slides the window one token at a time, so the two agree exactly
up to the edge and differ slightly after it.
"""
import numpy as np


def init_cache(n_layer, n_head, n_ctx, n_embd, B, dtype=np.float32, like=None):
    """An empty static cache for B rows, on the device of `like` (the model's weights)."""
    shape = (n_layer, B, n_head, n_ctx, n_embd // n_head)  # [n_layer, B, n_head, n_ctx, d_head]
    return {"k": np.zeros(shape, dtype=dtype, like=like), "v": np.zeros(shape, dtype=dtype, like=like),
            "lengths": np.zeros(B, dtype=np.int64),  # tokens held by each row (host side: tiny)
            "starts": np.zeros(B, dtype=np.int64)}   # sequence index of each row's slot 0


def cache_nbytes(cache):
    """2 * n_layer * B * n_ctx * n_embd * itemsize."""
    return cache["k"].nbytes + cache["v"].nbytes


def write_plan(lengths, n_new, T):
    """Where this pass's new keys/values go, and S, the number of slots attention reads:
    the longest row after this pass (row b has n_new[b] real tokens, then padding)."""
    S = int((lengths + n_new).max())
    if (n_new == T).all() and (lengths == lengths[0]).all():
        return slice(lengths[0], lengths[0] + T), S  # every row appends T tokens at the same slots
    b_idx, t_idx = np.nonzero(np.arange(T)[None, :] < n_new[:, None])  # real tokens only
    return (b_idx, t_idx, lengths[b_idx] + t_idx), S


def append_kv(cache, layer, k, v, plan):
    """Store this pass's k, v [B, n_head, T, d_head] and return every row's keys/values
    [B, n_head, S, d_head]; slots past a row's own length are hidden by the mask."""
    where, S = plan
    if isinstance(where, slice):
        cache["k"][layer, :, :, where] = k
        cache["v"][layer, :, :, where] = v
    else:
        b_idx, t_idx, slots = where
        # indexing [b, :, slot] puts the indexed axis first: [n_valid, n_head, d_head]
        cache["k"][layer, b_idx, :, slots] = k[b_idx, :, t_idx]
        cache["v"][layer, b_idx, :, slots] = v[b_idx, :, t_idx]
    return cache["k"][layer, :, :, :S], cache["v"][layer, :, :, :S]  # [B, n_head, S, d_head]


def rollback(cache, lengths):
    """Forget everything past `lengths` (per row): rejected draft tokens are simply
    overwritten by the next pass, so nothing is erased."""
    cache["lengths"] = np.minimum(cache["lengths"], lengths)


def pending_inputs(cache, seqs, n_ctx):
    """The tokens of each sequence the cache has not seen yet, as a right-padded
    [B, T] batch with n_new[b] real tokens per row. A row whose window would
    overflow is restarted from its last n_ctx // 2 tokens."""
    keep = max(n_ctx // 2, 1)
    for b, seq in enumerate(seqs):
        if len(seq) - cache["starts"][b] > n_ctx:
            cache["starts"][b], cache["lengths"][b] = len(seq) - keep, 0
    pending = [seq[cache["starts"][b] + cache["lengths"][b]:] for b, seq in enumerate(seqs)]
    return pad_right(pending)


def pad_right(rows, pad=0):
    """Lists of token ids of different lengths -> [B, T] int array and n_new [B]."""
    n_new = np.array([len(r) for r in rows], dtype=np.int64)
    inputs = np.full((len(rows), max(int(n_new.max()), 1)), pad, dtype=np.int64)  # [B, T]
    for b, r in enumerate(rows):
        inputs[b, :len(r)] = r
    return inputs, n_new


def keep_rows(cache, rows):
    """Drop finished rows from the batch (a copy of the rows kept, once per finish)."""
    rows = np.asarray(rows, dtype=np.int64)
    for key in ("k", "v"):
        cache[key] = cache[key][:, rows]
    for key in ("lengths", "starts"):
        cache[key] = cache[key][rows]
