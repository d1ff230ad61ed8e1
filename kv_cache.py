"""The KV cache: decode one token per model pass instead of re-reading the prefix.

In causal attention the keys and values of a token never change once computed,
because a token only attends to tokens before it. So we keep them: prefill the
prompt once, then each step computes k, v for the new tokens only and appends
them. Per token the model then reads its weights once and the cache once,
instead of recomputing every earlier position.

Layout: every layer owns a preallocated pair `k`, `v` of shape
[B, n_head, n_slots, d_head] (a static cache: no reallocation, no concatenation
of the history). Every row sits left-aligned at slot 0 with its own
`lengths[b]`, so a token's position id is simply its slot index. Rows of
different lengths (a batch of prompts, or speculative decoding where each row
accepts a different number of drafts) then need nothing more than one causal
mask per row: the query at slot t sees keys at slots <= t, which hides both the
future and any stale slots past the row's length. This plays the role of left
padding with position ids and an attention mask, and it also lets every row
advance or roll back by its own amount. This file owns every index calculation:
which tokens a pass runs, where their keys go, what attention reads, rollback,
and moving rows.

The window: GPT-2 learned position embeddings for n_ctx positions only.
A window that slides one token at a time would shift every cached key's
position, so each new token would cost a full prefill. Instead the window
restarts: once a text outgrows it, the model sees only the last n_ctx // 2
tokens, and the window grows again from there until it is full. `window_start`
says where the window begins for a text of n tokens. It depends on n alone, so
the cached and uncached passes, plain and speculative decoding, and every row
of a batch see exactly the same tokens: they agree at any length. Speculative
decoding verifies drafts only up to the next restart (`room`), so one target
pass never straddles two windows.

The pass: `next_logits` brings every text of a batch up to date in one call of
gpt2.gpt2, with a `Pass` that says where each token sits, where its keys and values go,
how each layer attends (`attend`: each query over its own row's keys) and which tokens
need logits. Every decoder's every step is made of such passes.

Across requests: a prefix's keys and values are the same for every text that begins
with it, so a server computes them once (serving/prefix_cache.py).

On a first read: init_cache, window_start, room, pending_inputs, Pass and begin_pass,
append, attend, next_logits, advance, rollback. The rest serves later sections: a long
prompt's pass (prefill_alone), chunked prefill's riders (ride_along), beam search's
gather_rows, and the rows a server moves, saves and copies (section 7).
"""
import functools
import itertools
from dataclasses import dataclass

import numpy as np

import gpt2
from kernels import cuda_graphs, cuda_ops, layout, rowwise


def init_cache(hparams, B, n_slots, like):
    """An empty static cache for B rows of n_slots tokens, with like's dtype and device. Every
    page is touched now (np.zeros would leave the OS to map each at a step's first write, a
    stall midway through serving). (Not np.full(like=): CuPy 14's full takes no device=None.)"""
    check_room(hparams, B, n_slots, like)
    n_head = hparams["n_head"]
    shape = (B, n_head, n_slots, hparams["n_embd"] // n_head)  # [B, n_head, n_slots, d_head]
    layers = [{"k": np.empty(shape, like.dtype, like=like), "v": np.empty(shape, like.dtype, like=like)}
              for _ in range(hparams["n_layer"])]
    for layer in layers:
        layer["k"].fill(0)
        layer["v"].fill(0)
    return {"layers": layers,
            "lengths": np.zeros(B, dtype=np.int64),  # tokens cached per row (on the host: tiny)
            "starts": np.zeros(B, dtype=np.int64),   # index in the text of each row's slot 0
            "graphs": {},  # a GPU's steps recorded over this cache (kernels/cuda_graphs.py)
            "views": {}}  # its rows as caches of their own, made once (`rows`)


def check_room(hparams, B, n_slots, like):
    """init_cache touches every page: a cache past the memory it would live in is refused first."""
    need = 2 * hparams["n_layer"] * B * n_slots * hparams["n_embd"] * np.dtype(like.dtype).itemsize
    layout.check_memory(need, f"the keys and values of {B} rows of {n_slots} tokens", like,
                        "ask for fewer rows (--max_batch, --num_beams, prompts a run)")


def cache_nbytes(cache):
    """2 * n_layer * B * n_slots * n_embd * itemsize."""
    return sum(layer["k"].nbytes + layer["v"].nbytes for layer in cache["layers"])


def window_start(n, n_ctx):
    """Index of the first token the model sees of a text of n tokens.

    Up to n_ctx tokens it sees them all. Past that the window restarts from the last
    keep = n_ctx // 2 tokens and grows one token per token, up to n_ctx, then restarts
    again: restarts fall every n_ctx + 1 - keep tokens, the first at n = n_ctx + 1."""
    keep = max(n_ctx // 2, 1)
    if n <= n_ctx:
        return 0
    return n - keep - (n - n_ctx - 1) % (n_ctx + 1 - keep)


def room(n, n_ctx):
    """How many tokens can follow a text of n tokens before its window restarts."""
    return n_ctx - (n - window_start(n, n_ctx))


def pending_inputs(cache, texts, n_ctx):
    """The tokens of each text that this pass must run, as a right-padded [B, T] batch
    with n_new[b] real tokens per row: without a cache, the whole window; with one, only
    what the cache has not seen, after restarting any row whose window has moved."""
    if cache is None:
        return pad_right([t[window_start(len(t), n_ctx):] for t in texts])
    for b, text in enumerate(texts):
        start = window_start(len(text), n_ctx)
        if start != cache["starts"][b]:  # the window restarted, or a rollback went back across a restart
            cache["starts"][b], cache["lengths"][b] = start, 0
    return pad_right([t[cache["starts"][b] + cache["lengths"][b]:] for b, t in enumerate(texts)])


def pad_right(rows, pad=0):
    """Lists of token ids of different lengths -> [B, T] int array and n_new [B]."""
    n_new = np.array([len(r) for r in rows], dtype=np.int64)
    inputs = np.full((len(rows), max(int(n_new.max()), 1)), pad, dtype=np.int64)  # [B, T]
    for b, r in enumerate(rows):
        inputs[b, :len(r)] = r
    return inputs, n_new


@dataclass
class Pass:
    """What one model pass needs to know besides its tokens (begin_pass builds it): gpt2.gpt2
    reads positions, attends, layer_norm, transformer_block and logits_at; attend reads the rest."""
    positions: np.ndarray  # [B, T] ([1, N] packed): each token's position, which is also its slot in the cache
    mask: np.ndarray  # [B, 1, T, S]: 0 where a query may see a key, -inf where it may not (None with loops)
    groups: list  # [(S, rows)]: the rows whose texts are S tokens long attend over S keys
    logits_at: np.ndarray  # [B, n]: which of each row's T tokens need logits (packed: which of the N; None: all)
    n_new: np.ndarray  # [B]: each row's real tokens (the rest of its T is padding)
    cache: dict = None  # where the keys and values go and come from (None: no cache)
    where: object = None  # where each real token's keys and values go (write_slots)
    S: int = 0  # the slots attention reads
    layer_norm: object = gpt2.layer_norm  # the layer norm of this pass: gpt2's, or the kernels' loop
    transformer_block: object = gpt2.transformer_block  # gpt2's, or a GPU's (cuda_ops's: norm and tails in products)
    attention: object = None  # the kernels' attention loop attention(q, k, v, positions), or None: attend's NumPy
    attends: object = None  # attend(q, k, v) of each layer, for gpt2.mha (one per cached layer; else repeated)
    parts: list = None  # a packed pass (ride_along): [(Pass, first token, B, T)] of the passes it packs


def begin_pass(cache, n_new, T, n_logits, like, loops=None):
    """The Pass over inputs [B, T] (row b: n_new[b] real tokens): each token's position,
    the causal mask, where each layer stores its keys and values (with a cache), and which
    positions need logits: row b's last n_logits[b] real tokens, the rest of its
    n_logits.max() entries repeating its last token (n_logits 0: none, the pass only
    caches). loops: the kernels' (layer_norm, attention, transformer_block) (kernel_ops), or None.

    A worked example: a verify pass for two rows, row 0 with 5 tokens cached and 3 new
    (2 drafts + its last token), row 1 with 2 cached and 1 new; logits at 3 and 1 tokens.
    T = 3, S = max(5 + 3, 2 + 1) = 8 slots to read.
        positions  [[5, 6, 7], [2, 3, 4]]    row 1's slots 3 and 4 are padding
        mask[1]    query 0 (slot 2) sees slots 0-2; slots 3-7 are -inf
        logits_at  [[0, 1, 2], [0, 0, 0]]    row 1 repeats its one real token
        groups     [(3, rows 1:2), (8, rows 0:1)]   row 1 attends over 3 keys, row 0 over 8
        where      (row, token, slot) = (0,0,5) (0,1,6) (0,2,7) (1,0,2): real tokens only"""
    B = len(n_new)
    start = cache["lengths"] if cache is not None else np.zeros(B, dtype=np.int64)
    slots = start[:, None] + np.arange(T)  # [B, T]: a token's position is its slot
    S = int((start + n_new).max()) if cache is not None else T  # slots attention reads
    mask = None
    if loops is None:  # the kernels' attention reads positions instead
        after = np.arange(S)[None, None, :] > slots[:, :, None]  # [B, T, S]: keys after the query
        mask = np.where(after, np.float32(-np.inf), np.float32(0.0))[:, None]  # [B, 1, T, S]
        mask = np.asarray(mask, like=like)  # built on the host, used where the weights are
    n_logits = np.broadcast_to(n_logits, (B,))  # [B]
    at = n_new[:, None] - n_logits[:, None] + np.arange(n_logits.max())  # [B, n_logits.max()]
    state = Pass(
        # a padding token's slot may lie past the cache (and wpe): kept at the last slot read, its output unused
        positions=np.minimum(slots, max(S, 1) - 1), mask=mask, groups=row_groups(start + n_new),
        logits_at=np.clip(at, 0, (n_new - 1).clip(0)[:, None]), n_new=n_new, cache=cache,
        where=write_slots(start, n_new, T) if cache is not None else None, S=S)
    if loops is not None:
        state.layer_norm, state.attention, state.transformer_block = loops
    if cache is None:  # every layer attends the same way, storing nothing
        state.attends = itertools.repeat(functools.partial(attend, state, None))
    else:
        state.attends = [functools.partial(attend, state, layer) for layer in cache["layers"]]
    return state


def kernel_ops(model):
    """The kernels' (layer_norm, attention, transformer_block) that every pass of this model runs,
    where its layout has them: the CPU's row kernel (rowwise.row_ops_for) or a GPU's own
    (cuda_ops.pass_ops). With them a token's keys, values and logits come out the same bits
    whatever else its pass holds, which chunked prefill and the prefix cache rely on. None
    elsewhere: gpt2.py's functions and `attend`'s masks."""
    loops = rowwise.row_ops_for(model)
    return (*loops, gpt2.transformer_block) if loops is not None else cuda_ops.pass_ops(model)


def row_groups(lengths):
    """[(S, rows)]: the rows whose texts are S tokens long, for each S; rows is a slice
    when they are neighbours (a view), else an index array."""
    groups = []
    for S in np.unique(lengths):
        rows = np.nonzero(lengths == S)[0]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        groups.append((int(S), slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows))
    return groups


def write_slots(lengths, n_new, T):
    """Where this pass's real tokens go: a slice when every row appends T tokens at the
    same slots (the common case: views, no index arrays), else (row, token, slot) triples."""
    if (n_new == T).all() and (lengths == lengths[0]).all():
        return slice(int(lengths[0]), int(lengths[0]) + T)
    b_idx, t_idx = np.nonzero(np.arange(T)[None, :] < n_new[:, None])  # [n_real] each: real tokens only
    return b_idx, t_idx, lengths[b_idx] + t_idx


def append(state, layer, k, v):
    """Store the Pass state's k, v [B, n_head, T, d_head] in one layer's cache and return every
    row's keys and values [B, n_head, S, d_head]; the mask hides slots past a row's length."""
    where, S = state.where, state.S
    if isinstance(where, slice):
        layer["k"][:, :, where] = k
        layer["v"][:, :, where] = v
    else:
        b_idx, t_idx, slots = where
        # indexing [b, :, slot] puts the indexed axis first: [n_real, n_head, d_head]
        layer["k"][b_idx, :, slots] = k[b_idx, :, t_idx]
        layer["v"][b_idx, :, slots] = v[b_idx, :, t_idx]
    return layer["k"][:, :, :S], layer["v"][:, :, :S]  # [B, n_head, S, d_head]


def attend(state, layer, q, k, v):
    """gpt2.mha's attention in a Pass: store k, v [B, n_head, T, d_head] in this layer's
    cache (if any), then each query attends over its own row's keys up to itself. Each
    query is its own product ([1, d_head] @ [d_head, S]), in a group of rows of its own
    length S, so its sums never depend on which rows or how many queries share the pass:
    a row comes out bitwise as it would alone. With the kernels, one loop does it all."""
    if layer is not None:
        k, v = append(state, layer, k, v)  # [B, n_head, S, d_head]
    if state.attention is not None:
        return state.attention(q, k, v, state.positions)  # [B, n_head, T, d_head]
    out = np.empty_like(q)  # [B, n_head, T, d_head]
    for S, group in state.groups:
        q1 = q[group][..., None, :]  # [b, n_head, T, 1, d_head]: one query at a time
        k1, v1 = k[group, :, None, :S], v[group, :, None, :S]  # [b, n_head, 1, S, d_head]
        out[group] = gpt2.attention(q1, k1, v1, state.mask[group][..., None, :S])[..., 0, :]  # [b, n_head, T, d_head]
    return out


# A row's tokens that need no logits (all of a prompt except its last token, a window refilled
# after a restart) run in a pass of the row's own when there are more than this: its
# product over many tokens costs less per token than a pass over few, and it keeps the
# batch's pass's T (every row's padding) short.
ALONE_ABOVE = 8


def next_logits(model, cache, texts, n_logits=1, riders=()):
    """Bring every text up to date with gpt2.gpt2: with a cache, only the tokens it has not
    seen (a row's long run of tokens that need no logits first in passes of its own:
    prefill_alone), then one pass over all rows; without, the whole window again. Returns
    logits [B, n, n_vocab] at each row's last n_logits[b] tokens, n = the largest n_logits
    (a row with fewer repeats its last). On the CPU every row comes out bitwise as it would
    alone (the weights' kernels and `attend`), whatever shares the pass; rowwise.kernel_pass
    holds BLAS to one thread while numba's threads run the kernels. riders: chunks of other
    rows' prompts that this pass caches too (ride_along)."""
    params, hparams = model
    with rowwise.kernel_pass(params):
        if cache is not None:
            inputs, n_new = prefill_alone(model, cache, texts, n_logits)  # [B, T]
        else:
            inputs, n_new = pending_inputs(cache, texts, hparams["n_ctx"])  # [B, T]: the whole window
        # GPU only (--backend cupy, GPT2_GPU_KERNELS=1): a static step, replayed as a CUDA graph
        if cuda_graphs.fits(model, cache, inputs, riders):
            logits = cuda_graphs.step(model, cache, inputs, n_new, n_logits)  # [B, n, n_vocab]
            cache["lengths"] += n_new  # (advance's work: the step stored the keys and values)
            return logits
        state = begin_pass(cache, n_new, inputs.shape[1], n_logits, like=params["wpe"], loops=kernel_ops(model))
        if riders:
            inputs, state = ride_along(model, riders, inputs, state)  # [1, B*T + the riders' tokens]
        logits = gpt2.gpt2(inputs, **params, n_head=hparams["n_head"], state=state)  # [B, n, n_vocab]
        if cache is not None:
            advance(state)
        return logits


def prefill_alone(model, cache, texts, n_logits):
    """Cache each row's tokens that need no logits in a pass of the row's own, where
    there are more than ALONE_ABOVE of them; the batch's pass then runs only the rest. With
    the kernels' loops a token's keys and values come out the same bits whichever pass
    computes them (what serving/prefix_cache.py relies on). Returns what is left pending:
    pending_inputs's inputs [B, T] and n_new [B]."""
    inputs, n_new = pending_inputs(cache, texts, model[1]["n_ctx"])  # [B, T]
    m = n_new - np.broadcast_to(n_logits, n_new.shape)  # [B]: tokens before the first that needs logits
    alone = np.nonzero(m > ALONE_ABOVE)[0]
    for b in alone:
        cache_tokens(model, rows(cache, b, b + 1), texts[b], int(m[b]))
    return pending_inputs(cache, texts, model[1]["n_ctx"]) if len(alone) else (inputs, n_new)


def uncached(cache, text, n_ctx):
    """How many tokens of the text's window a one-row cache does not hold yet."""
    start = window_start(len(text), n_ctx)
    return len(text) - start - (int(cache["lengths"][0]) if cache["starts"][0] == start else 0)


def cache_tokens(model, cache, text, n):
    """Cache the next n tokens of a text's window in a one-row cache (rows(cache, b, b + 1)),
    in a pass of its own that computes no logits (prefill_alone's pass)."""
    cache_riders(model, [(cache, text, n)])


def cache_riders(model, riders):
    """The riders' chunks (ride_along) in one pass of their own, computing no logits."""
    params, hparams = model
    with rowwise.kernel_pass(params):
        inputs, state = ride_along(model, riders)  # [1, the riders' tokens]
        gpt2.gpt2(inputs, **params, n_head=hparams["n_head"], state=state)  # [1, 0, n_vocab]: no logits
        advance(state)


def ride_along(model, riders, inputs=None, state=None):
    """Pack chunks of other rows' texts into one pass with the batch's (inputs [B, T] and its
    Pass state; None: the chunks alone). riders: [(a one-row cache (rows(cache, b, b + 1)),
    its text, n)]: cache the next n tokens of the text's window (window_start: the whole
    text's, whatever part of it is cached so far), computing no logits. This is how a server
    spreads a long prompt over its steps (chunked prefill, serving/scheduler.py): the chunks
    ride in the step's pass, so the weights are read once for both.

    Packed, not padded: the pass runs inputs [1, N], every row's tokens one after another
    (the batch's B*T first), since layer norm, the MLP and every product treat each token
    alone; only attention needs to know whose token is whose: each part attends as its own
    Pass would (attend_packed). With the kernels a token's outputs do not depend on the
    tokens beside it, so each part comes out the same bits as in a pass of its own."""
    params, hparams = model
    loops = kernel_ops(model)
    parts, tokens = [], []
    if state is not None:
        parts.append((state, 0) + inputs.shape)
        tokens.append(inputs.reshape(-1))  # [B*T]
    for cache, text, n in riders:
        ids, _ = pending_inputs(cache, [text], hparams["n_ctx"])  # [1, >= n]: restarts the row if its window moved
        first = sum(B * T for _, _, B, T in parts)
        parts.append((begin_pass(cache, np.array([n]), n, 0, like=params["wpe"], loops=loops), first, 1, n))
        tokens.append(ids[0, :n])  # [n]
    logits_at = np.zeros((1, 0), np.int64)  # [1, 0]: the chunks need no logits
    if state is not None:
        B, T = inputs.shape
        logits_at = state.logits_at + T * np.arange(B)[:, None]  # [B, n]: the batch's, counted along N
    packed = Pass(positions=np.concatenate([p.positions.reshape(-1) for p, _, _, _ in parts])[None],  # [1, N]
                  mask=None, groups=[], logits_at=logits_at, n_new=None, parts=parts,  # logits_at [B, n]: in N
                  layer_norm=parts[0][0].layer_norm, transformer_block=parts[0][0].transformer_block)
    packed.attends = [functools.partial(attend_packed, packed, i) for i in range(hparams["n_layer"])]
    return np.concatenate(tokens)[None], packed  # [1, N]


def attend_packed(packed, i, q, k, v):
    """Layer i's attention in a packed pass: q, k, v [1, n_head, N, d_head], each part's
    tokens unpacked to its own [B, n_head, T, d_head] and attended as its Pass attends."""
    out = np.empty_like(q)  # [1, n_head, N, d_head]
    H, D = q.shape[1], q.shape[3]
    for state, first, B, T in packed.parts:
        span = slice(first, first + B * T)
        q1, k1, v1 = (x[0, :, span].reshape(H, B, T, D).transpose(1, 0, 2, 3) for x in (q, k, v))  # [B, H, T, D]
        out[0, :, span] = state.attends[i](q1, k1, v1).transpose(1, 0, 2, 3).reshape(H, B * T, D)  # [H, B*T, D]
    return out


def advance(state):
    """After the Pass state: each row now holds its n_new more tokens (each part of a packed pass)."""
    if state.parts is None:
        state.cache["lengths"] += state.n_new
    for part in state.parts or ():
        advance(part[0])


def rollback(cache, n_valid):
    """Keep only the first n_valid[b] tokens of each row's text: rejected drafts are
    simply overwritten by the next pass, so nothing is erased."""
    keep = np.maximum(np.asarray(n_valid) - cache["starts"], 0)
    np.minimum(cache["lengths"], keep, out=cache["lengths"])


def rows(cache, lo, hi):
    """Rows lo..hi-1 as a cache of their own (views: what a pass writes lands here too). Only
    views starting at row 0 (the batch's own steps) share the cache's recorded GPU steps: a
    pass over later rows (a joining request's prompt) is a one-off, run eagerly. The views of
    the first rows and of a single row are made once and kept: a step asks for them, and on a
    GPU a view is a call into CuPy (2 a layer: 96 a step of 1558M)."""
    kept = cache.get("views", {}) if lo == 0 or hi == lo + 1 else {}
    if (lo, hi) not in kept:
        kept[lo, hi] = {"layers": [{"k": layer["k"][lo:hi], "v": layer["v"][lo:hi]} for layer in cache["layers"]],
                        "lengths": cache["lengths"][lo:hi], "starts": cache["starts"][lo:hi],
                        "graphs": cache.get("graphs") if lo == 0 else None, "views": {}}
    return kept[lo, hi]


def gather_rows(cache, idx, same=0):
    """Row r becomes what row idx[r] was, for r < len(idx): beam search keeps its best beams
    by gathering their keys and values, never by recomputing them. same: the slots below it
    already hold the same keys and values in r and idx[r] (the beams of one prompt share its
    prefill), so only the slots from there on are copied."""
    idx = np.asarray(idx)
    moved = np.flatnonzero(idx != np.arange(len(idx)))  # rows that keep their own beam copy nothing
    src = idx[moved]
    if len(moved):
        used = int(cache["lengths"][src].max())  # slots past a row's length are never read
        for layer in cache["layers"]:
            layer["k"][moved, :, same:used] = layer["k"][src, :, same:used]  # the gather copies first,
            layer["v"][moved, :, same:used] = layer["v"][src, :, same:used]  # so rows may read each other
    cache["lengths"][moved], cache["starts"][moved] = cache["lengths"][src], cache["starts"][src]


def clear_row(cache, b):
    """Row b starts a new text: nothing cached (old keys are hidden by the mask)."""
    cache["lengths"][b] = cache["starts"][b] = 0


def save_row(cache, b):
    """A copy of row b as it stands (the keys and values of its cached tokens only), for
    a request that gives up its row for a while (serving/scheduler.py pauses it) and comes back."""
    n = int(cache["lengths"][b])
    return {"layers": [{name: layer[name][b, :, :n].copy() for name in ("k", "v")} for layer in cache["layers"]],
            "length": n, "start": int(cache["starts"][b])}  # [n_head, n, d_head] per layer and name


def restore_row(cache, b, saved):
    """Row b becomes, bit for bit, the row that save_row copied."""
    n = saved["length"]
    for layer, kept in zip(cache["layers"], saved["layers"]):
        for name in ("k", "v"):
            layer[name][b, :, :n] = kept[name]
    cache["lengths"][b], cache["starts"][b] = n, saved["start"]


def copy_prefix(cache, src, dst, n):
    """Row dst starts as the first n tokens of row src's text, which the two share: their
    keys and values are copied, never recomputed (serving/scheduler.py shares prefixes)."""
    for layer in cache["layers"]:
        layer["k"][dst, :, :n] = layer["k"][src, :, :n]
        layer["v"][dst, :, :n] = layer["v"][src, :, :n]
    cache["lengths"][dst], cache["starts"][dst] = n, 0


def move_row(cache, src, dst):
    """Copy row src into row dst (one row's keys and values), so the rows stay packed."""
    for layer in cache["layers"]:
        n = int(cache["lengths"][src])
        layer["k"][dst, :, :n] = layer["k"][src, :, :n]
        layer["v"][dst, :, :n] = layer["v"][src, :, :n]
    cache["lengths"][dst], cache["starts"][dst] = cache["lengths"][src], cache["starts"][src]
