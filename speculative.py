"""Speculative decoding: a cheap drafter guesses, the target model checks in one pass.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding" (https://arxiv.org/abs/2211.17192); Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"
(https://arxiv.org/abs/2302.01318).

Decoding one token with a large model costs a pass over all its weights, and a
pass over K+1 tokens costs little more (the weights are read once either way).
So each step:

1. the draft proposes K tokens d_1..d_K, sampled one at a time from its own
   distributions q_1..q_K (a small model with its KV cache; or prompt lookup,
   which copies what followed an earlier occurrence of the last few tokens);
2. the target scores all K+1 positions in ONE pass, giving p_1..p_{K+1};
3. d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), left to right;
4. at the first rejection, position i is resampled from the residual
   norm(max(0, p_i - q_i)); if all K pass, a bonus token comes from p_{K+1}.

This is rejection sampling, so every emitted token is distributed exactly as if
sampled from p alone: P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y),
p(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(q(x), p(x)) +
max(0, p(x) - q(x)) = p(x). Both caches are rolled back to the accepted length.
Each step emits n+1 tokens (n accepted, 1 from the target), for one target pass.

p and q come from sampling.py with the same settings, so penalties, top-k/p and
temperature are honoured exactly; temperature 0 makes p and q one-hot and the
output is the target's own greedy text, token for token.
"""
import time

import numpy as np

import gpt2
import kv_cache
import sampling


def check_same_vocabulary(target_hparams, draft_hparams):
    if target_hparams["n_vocab"] != draft_hparams["n_vocab"]:
        raise ValueError(f"draft and target vocabularies differ ({draft_hparams['n_vocab']} vs "
                         f"{target_hparams['n_vocab']} tokens): speculative decoding needs the same tokenizer")


def counts_along_drafts(counts, drafts, n_positions):
    """counts [B, n_vocab] -> [B, n_positions, n_vocab]: position i also counts d_1..d_i,
    since a penalty at position i must see the drafted text before it."""
    B, V = counts.shape
    out = np.repeat(counts[:, None], n_positions, axis=1)  # [B, n_positions, n_vocab]
    for i in range(min(drafts.shape[1], n_positions - 1)):
        out[np.arange(B), i + 1:, drafts[:, i]] += 1
    return out


def verify(p, q, drafts, k, rng):
    """Accept/reject K drafted tokens per row, then draw one more from the target.

    p [B, K+1, n_vocab]: target distributions; p[:, i] is for the token after d_1..d_i.
    q [B, K, n_vocab]: draft distributions the drafts were sampled from.
    drafts [B, K], k [B]: row b drafted k[b] <= K real tokens.
    Returns (n [B] accepted drafts, token [B] the target's own next token).
    """
    B, K = drafts.shape
    q, drafts, k = (np.asarray(a, like=p) for a in (q, drafts, k))  # to p's device (NumPy: no copy)
    rows = np.arange(B, like=p)
    u = np.asarray(rng.random((B, K)), like=p)  # [B, K]
    i = np.arange(K, like=p)
    p_d = p[rows[:, None], i, drafts]  # [B, K]: p_i(d_i)
    q_d = q[rows[:, None], i, drafts]  # [B, K]: q_i(d_i)
    accept = (u * q_d < p_d) & (i < k[:, None])  # u < p/q without dividing by q = 0
    n = np.cumprod(accept, axis=1).sum(axis=1)  # [B]: accepted before the first rejection
    p_n = p[rows, n]  # [B, n_vocab]
    q_n = np.where((n < k)[:, None], q[rows, np.minimum(n, K - 1)] if K else 0.0, 0.0)
    residual = np.maximum(p_n - q_n, 0.0)  # [B, n_vocab]: equals p_n where all drafts passed
    mass = residual.sum(axis=-1, keepdims=True)
    residual = np.where(mass > 0, residual, p_n)  # p == q up to rounding: rejection had ~0 chance
    return n, sampling.sample(residual, rng)


def prompt_lookup_draft(seq, K, max_ngram=3):
    """Prompt lookup decoding (Saxena 2023): find the last n-gram of seq earlier in
    seq (longest n first, latest match) and propose the up to K tokens after it."""
    arr = np.asarray(seq)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [len-n, n]
        hits = np.nonzero((windows == arr[-n:]).all(axis=1))[0]
        if hits.size:
            start = hits[-1] + n
            return arr[start:start + K].tolist()
    return []


def speculative_generate(prompts, target, draft, n_tokens_to_generate, K, settings, rng, use_cache=True,
                         eos_id=None, callback=None, drafter="model", adaptive_K=False, K_max=7):
    """Draft-verify decoding for a batch of prompts.

    target, draft: (params, hparams); draft is used only with drafter="model".
    drafter: "model", "prompt_lookup", or any function (seq, K) -> up to K proposed
      tokens (a deterministic drafter, such as the benchmark's oracle).
    callback(row, token, accepted) sees each token as it is emitted; accepted tells
    whether it was a draft the target accepted (True) or the target's own (False).
    Returns (the new tokens of each row, stats).
    """
    t_params, t_hparams = target
    model_drafter = drafter == "model"
    if model_drafter:
        d_params, d_hparams = draft
        check_same_vocabulary(t_hparams, d_hparams)
    if K < 1 or K >= t_hparams["n_ctx"] // 2:
        raise ValueError(f"K must be between 1 and {t_hparams['n_ctx'] // 2 - 1}, got {K}")
    K_max = max(K, K_max)
    B = len(prompts)
    seqs = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    active = list(range(B))  # rows still generating, in cache order
    counts = sampling.token_counts(prompts if settings.penalize_prompt else [[]] * B, t_hparams["n_vocab"])
    n_slots = max(map(len, seqs)) + n_tokens_to_generate + K_max + 1
    t_cache = gpt2.new_cache(t_params, t_hparams, B, n_slots) if use_cache else None
    d_cache = gpt2.new_cache(d_params, d_hparams, B, n_slots) if use_cache and model_drafter else None
    stats = {"target_passes": 0, "row_passes": 0, "draft_passes": 0, "drafted": 0, "accepted": 0,
             "drafted_steps": 0, "fully_accepted_steps": 0,
             "draft_s": 0.0, "verify_s": 0.0, "proposed_at": np.zeros(K_max, np.int64),
             "accepted_at": np.zeros(K_max, np.int64), "K_trace": []}
    stats["kv_cache_bytes"] = sum(kv_cache.cache_nbytes(c) for c in (t_cache, d_cache) if c is not None)
    start = time.perf_counter()
    token_times = []
    while active:
        remaining = [n_tokens_to_generate - len(out[b]) for b in active]
        K_step = max(0, min(K, max(remaining) - 1))  # never draft past the last token needed
        rows = [seqs[b] for b in active]
        c = counts[active] if settings.uses_counts else None  # only penalties read them

        t0 = time.perf_counter()
        if model_drafter:  # 1. the draft proposes d_1..d_K, sampled from q_1..q_K
            drafts, q = draft_with_model(d_params, d_hparams, d_cache, rows, c, K_step, settings, rng)
            stats["draft_passes"] += K_step
        else:
            propose = prompt_lookup_draft if drafter == "prompt_lookup" else drafter
            drafts, q = draft_deterministic(rows, K_step, t_hparams["n_vocab"], propose)
        k = np.array([len(r) for r in drafts], dtype=np.int64)  # [B]: real drafts per row
        drafts = kv_cache.pad_right(drafts)[0][:, :K_step]  # [B, K_step]
        t1 = time.perf_counter()
        p = score_with_target(t_params, t_hparams, t_cache, rows, drafts, k, c, settings)  # 2. one pass
        n, token = verify(p, q, drafts, k, rng)  # 3-4. accept n drafts, then one token from the target
        n, token = np.array(n.tolist()), np.array(token.tolist())  # [B] each: only these leave a GPU
        t2 = time.perf_counter()
        done = emit(active, seqs, out, counts, drafts, n, token, remaining, n_tokens_to_generate, eos_id, callback)
        record(stats, k, n, K_step, len(active), t1 - t0, t2 - t1)
        token_times.append(time.perf_counter())
        for cache in (t_cache, d_cache):  # keep only what matches the accepted text
            if cache is not None:
                kv_cache.rollback(cache, np.array([len(seqs[b]) - 1 for b in active]) - cache["starts"])
        if adaptive_K:
            K = adapt_K(stats, K_max)
        if done:
            keep = [i for i in range(len(active)) if i not in done]
            active = [active[i] for i in keep]
            for cache in (t_cache, d_cache):
                if cache is not None:
                    kv_cache.keep_rows(cache, keep)
    return out, finish_stats(stats, start, token_times, sum(map(len, out)))


def score_with_target(params, hparams, cache, rows, drafts, k, counts, settings):
    """The target's distributions p [B, K+1, n_vocab] after each prefix of the drafts,
    all from ONE forward pass over (pending tokens + drafts)."""
    K = drafts.shape[1]
    logits, n_new = gpt2.next_logits(params, hparams, cache, [r + d[:kb].tolist() for r, d, kb in zip(rows, drafts, k)],
                                     all_logits=True)  # [B, T, n_vocab]
    positions = n_new[:, None] - 1 - k[:, None] + np.arange(K + 1)  # [B, K+1]: the last k[b]+1 real tokens
    positions = np.minimum(positions, n_new[:, None] - 1)  # rows with fewer drafts: repeat the last
    logits = logits[np.arange(len(rows))[:, None], positions]  # [B, K+1, n_vocab]
    counts = counts_along_drafts(counts, drafts, K + 1) if settings.uses_counts else None
    return sampling.probabilities(logits, counts, settings)  # [B, K+1, n_vocab]


def emit(active, seqs, out, counts, drafts, n, token, remaining, n_tokens_to_generate, eos_id, callback):
    """Append each row's accepted drafts and the target's token, honouring
    max_new_tokens and EOS; returns the indices (into active) of rows that ended."""
    done = []
    for i, b in enumerate(active):
        emitted = drafts[i, :n[i]].tolist() + [int(token[i])]
        emitted = emitted[:remaining[i]]  # max_new_tokens is exact
        if eos_id is not None and eos_id in emitted:
            emitted = emitted[:emitted.index(eos_id) + 1]  # EOS ends the row right there
        for j, tok in enumerate(emitted):
            seqs[b].append(tok)
            out[b].append(tok)
            counts[b, tok] += 1
            if callback:
                callback(b, tok, j < n[i])
        if len(out[b]) == n_tokens_to_generate or (eos_id is not None and emitted[-1] == eos_id):
            done.append(i)
    return done


def record(stats, k, n, K_step, n_rows, draft_s, verify_s):
    stats["target_passes"] += 1
    stats["drafted_steps"] += int((k > 0).sum())
    stats["fully_accepted_steps"] += int(((n == k) & (k > 0)).sum())
    stats["row_passes"] += n_rows
    stats["draft_s"] += draft_s
    stats["verify_s"] += verify_s
    stats["drafted"] += int(k.sum())
    stats["accepted"] += int(n.sum())
    np.add.at(stats["proposed_at"], np.concatenate([np.arange(kb) for kb in k]).astype(np.int64), 1)
    np.add.at(stats["accepted_at"], np.concatenate([np.arange(nb) for nb in n]).astype(np.int64), 1)
    stats["K_trace"].append(K_step)


def draft_with_model(params, hparams, cache, rows, counts, K, settings, rng):
    """K tokens per row from the draft model, and the distributions q [B, K, n_vocab]
    they were sampled from (with the same settings and history as the target)."""
    B = len(rows)
    drafts = np.zeros((B, K), dtype=np.int64)
    q = np.zeros((B, K, hparams["n_vocab"]), dtype=np.float32, like=params["wte"])
    counts = counts.copy() if settings.uses_counts else counts
    for i in range(K):
        logits, _ = gpt2.next_logits(params, hparams, cache, [r + drafts[b, :i].tolist() for b, r in enumerate(rows)])
        q[:, i] = sampling.probabilities(logits, counts, settings)  # [B, n_vocab]
        drafts[:, i] = sampling.sample(q[:, i], rng).tolist()  # token ids to the host
        if settings.uses_counts:
            counts[np.arange(B), drafts[:, i]] += 1
    return [d.tolist() for d in drafts], q


def draft_deterministic(rows, K, n_vocab, propose):
    """Drafts from a deterministic drafter such as prompt lookup: q is one-hot at each
    draft, so d_i is accepted with probability p_i(d_i)."""
    drafts = [propose(r, K)[:K] if K else [] for r in rows]
    q = np.zeros((len(rows), K, n_vocab), dtype=np.float32)
    for b, d in enumerate(drafts):
        q[b, np.arange(len(d)), d] = 1.0
    return drafts, q


def expected_tokens(alpha, K):
    """E[tokens per target pass] = (1 - alpha^(K+1)) / (1 - alpha) (Leviathan et al. eq. 1):
    drafts are accepted left to right with probability alpha each, plus one target token."""
    return K + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def best_K(alpha, t_draft, t_verify, K_max):
    """The K with the most expected tokens per second, from the acceptance rate and this
    run's own measured costs: one draft pass t_draft, one verification pass t_verify.
    Verification is taken as the same for every K <= K_max: a pass over K+1 <= 8 tokens
    costs about the same on a CPU (matmuls are padded to 8 rows) and on a GPU."""
    return max(range(1, K_max + 1), key=lambda K: expected_tokens(alpha, K) / (K * t_draft + t_verify))


def adapt_K(stats, K_max):
    """Adaptive K: estimate alpha from the drafts so far (each accepted draft is a success,
    each first rejection a failure: the geometric MLE) and pick best_K on measured costs."""
    rejections = stats["drafted_steps"] - stats["fully_accepted_steps"]
    alpha = (stats["accepted"] + 1) / (stats["accepted"] + rejections + 1)  # +1: start optimistic
    t_draft = stats["draft_s"] / max(stats["draft_passes"], 1)  # 0 for prompt lookup: drafting is free
    t_verify = stats["verify_s"] / stats["target_passes"]
    return best_K(alpha, t_draft, t_verify, K_max)


def finish_stats(stats, start, token_times, n_tokens):
    s = gpt2.decode_stats(start, token_times, n_tokens)
    proposed = stats.pop("proposed_at")
    accepted = stats.pop("accepted_at")
    s.update(stats)
    s["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0
    s["tokens_per_target_pass"] = n_tokens / stats["row_passes"] if stats["row_passes"] else 0.0  # per row
    s["acceptance_by_position"] = [round(float(a / p), 3) for a, p in zip(accepted, proposed) if p]
    return s
