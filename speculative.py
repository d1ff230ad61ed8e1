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
max(0, p(x) - q(x)) = p(x), since 1 - sum_y min(q(y), p(y)) = sum_y max(0, p(y) - q(y))
(both distributions sum to 1). With n of the K drafts accepted, each step emits n+1 tokens
(the n, then 1 from the target) for one target pass. Every cache (the target's, and the
draft model's if one drafts) is rolled back to all of the accepted text except its last
token, which is the next pass's input. After a step that accepted all K, the draft's cache
lacks d_K (it proposed d_K, never read it) and the bonus token: its next pass reads both
(the catch-up pass).

Near the end of GPT-2's window (kv_cache.py) a row drafts only as many tokens as
fit before its window restarts (`kv_cache.room`), so every p_i is computed on
exactly the tokens plain decoding would see: the two decoders agree at any length.

p and q come from sampling.py with the same settings, so penalties, top-k/p and
temperature are honoured exactly; temperature 0 makes p and q one-hot and the
output is the target's own greedy text, token for token.
"""
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

import batching
import cost_model
import kv_cache
import sampling
from kernels import cuda_decode_loop, cuda_sampling


def verify(p, q, d, k, u, v):
    """Accept/reject K drafted tokens per row, then draw one more from the target. The
    names are Leviathan et al.'s (Chen et al. swap them): p is the target's, q the draft's (not
    attention's query: nor are u and v its keys and values), k counts drafts.

    p [B, K+1, n_vocab]: target distributions; p[:, i] is for the token after d_1..d_i.
    q [B, K, n_vocab]: draft distributions the drafts were sampled from (None: one-hot at the
      drafts, a deterministic drafter's).
    d [B, K], k [B]: the drafts d_1..d_K, right-padded: row b drafted k[b] <= K real tokens.
    u [B, K], v [B]: uniform draws in (0, 1] for the acceptance tests (Leviathan et al.'s r,
      their K being gamma) and the last token.
    Returns (n [B] accepted drafts, token [B] the target's own next token).
    """
    if cuda_sampling.takes(p):  # a GPU's kernels of our own: the same n and token in two launches
        return cuda_sampling.verify(p, q, d, k, u, v)
    q = one_hot(d, k, p.shape[-1]) if q is None else q
    B, K = d.shape
    q, d, k, u = (np.asarray(a, like=p) for a in (q, d, k, u))  # to p's device (NumPy: no copy)
    rows = np.arange(B, like=p)  # [B]
    i = np.arange(K, like=p)  # [K]
    p_d = p[rows[:, None], i, d]  # [B, K]: p_{i+1}(d_{i+1}), i counting from 0
    q_d = q[rows[:, None], i, d]  # [B, K]: q_{i+1}(d_{i+1})
    # [B, K]: u < p/q without dividing by q = 0 (Algorithm 1 tests r <= p/q; a tie has chance 0, and
    # < refuses a token that p and q both give 0)
    accept = (u * q_d < p_d) & (i < k[:, None])
    n = np.cumprod(accept, axis=1).sum(axis=1)  # [B]: accepted before the first rejection
    p_n = p[rows, n]  # [B, n_vocab]: p_{n+1}, at the first rejection or the bonus
    q_n = np.where((n < k)[:, None], q[rows, np.minimum(n, K - 1)] if K else 0.0, 0.0)  # [B, n_vocab]
    residual = np.maximum(p_n - q_n, 0.0)  # [B, n_vocab]: equals p_n where all drafts passed
    mass = residual.sum(axis=-1, keepdims=True)  # [B, 1]
    residual = np.where(mass > 0, residual, p_n)  # p == q up to rounding: rejection had ~0 chance
    return n, sampling.sample(residual, v)  # sample scales u by the row's sum: norm() needs no division


def speculative_step(batch, target, drafter, config):
    """One round of the papers' loop for every row of the batch."""
    allowed = [n_drafts(seq, config, target[1]["n_ctx"]) for seq in batch.seqs]  # drafts each row may verify
    t0 = time.perf_counter()
    drafts, q = drafter.propose(batch, allowed, config.draft_vocab)  # 1. d_1..d_k, sampled from q_1..q_k
    k = np.array([len(d) for d in drafts])  # [B]
    t1 = time.perf_counter()
    K = int(k.max())  # (q [B, K, n_vocab], or None: one-hot at the drafts)
    d = kv_cache.pad_right(drafts)[0][:, :K]  # [B, K]: the drafts, right-padded
    u = batching.uniforms(batch, k)[:, :K]  # [B, K]: one draw per draft, to accept or reject it
    v = batching.uniforms(batch, 1)[:, 0]  # [B]: one draw for the token from p_{n+1} or the residual
    logits, n, token = verify_with_target(batch, target, drafts, q, d, k, u, v)  # 2-4. p from ONE pass; n, 1 token
    t2 = time.perf_counter()
    for b, seq in enumerate(batch.seqs):  # 5. emit; each row remembers how its drafts fared
        batching.emit(batch, b, drafts[b][:n[b]] + [token[b]], n[b], logits)
        seq.accepted, seq.rejected = seq.accepted + n[b], seq.rejected + (n[b] < k[b])
        batch.stats.rejected += n[b] < k[b]
    for name in batch.caches:  # 6. every cache forgets the rejected drafts (and the last token: the next pass's input)
        kv_cache.rollback(batching.cache(batch, name), [len(seq.tokens) - 1 for seq in batch.seqs])
    batch.stats.speculative_step_done(k, n, t1 - t0, t2 - t1)


def speculative_generate(requests, target, drafter, config=None, use_cache=True, callback=None):
    """Draft-verify decoding for a batch of requests (batching.requests).

    target: (params, hparams). drafter: a Drafter: model_drafter(model) for a small model,
      PROMPT_LOOKUP, or one of your own. callback(seq, token, accepted, logits) sees each
      token as it comes. config: SpeculativeConfig (None: its defaults).
    Returns (each request's new tokens, batching.Stats).
    """
    config = config or SpeculativeConfig()
    draft = draft_of(drafter)
    check(config, target[1], draft and draft[1])
    config = resolve(config, target, draft)
    models = {"target": target, "draft": draft} if draft else {"target": target}
    return batching.run(requests, models, lambda batch: speculative_step(batch, target, drafter, config), use_cache,
                        callback)


# --- the two passes: the drafts (a draft model, or prompt lookup), then the target's scores ---

def n_drafts(seq, config, n_ctx):
    """How many drafts a row verifies this step: its K, but never past its last token
    (max_new_tokens - 1 drafts + 1 target token) nor across its window's restart."""
    K = adaptive_K(seq, config) if config.adaptive else config.K
    left = seq.request.max_new_tokens - seq.n_generated - 1
    return max(0, min(K, left, kv_cache.room(len(seq.tokens), n_ctx)))


@dataclass(frozen=True)
class Drafter:
    """What proposes a step's drafts. propose(batch, k, vocab) -> (drafts, q): up to k[b]
    drafts for row b, and the distributions q [B, max k, n_vocab] they were sampled from
    (None: one-hot at the drafts, draft_deterministic's; vocab: SpeculativeConfig.draft_vocab).
    model: the draft model whose KV cache the batch keeps beside the target's (None: a drafter
    without one, such as prompt lookup)."""
    propose: Callable
    model: tuple = None


def model_drafter(model):
    """The papers' drafter: a small model (params, hparams), one pass per draft token."""
    return Drafter(lambda batch, k, vocab: draft_with_model(batch, model, k, vocab), model)


def draft_of(drafter):
    """The drafter's model (None: it has none), or a TypeError saying what a drafter is."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a speculative.Drafter (model_drafter(model) for a draft model, "
                        f"PROMPT_LOOKUP), got {type(drafter).__name__}")
    return drafter.model


def draft_with_model(batch, model, k, vocab=0):
    """k[b] tokens for row b from the draft model, one pass per token (rows that have
    drafted enough ride along, and their outputs are ignored), sampled from q with
    each row's own settings and history; over a vocabulary subset if vocab > 0."""
    B, K = len(batch.seqs), max(k)
    if not vocab:  # on a GPU's kernels, the K passes and their draws as one CUDA graph (None elsewhere)
        looped = cuda_decode_loop.draft(model, batching.cache(batch, "draft"), batching.token_ids(batch), k,
                                       [seq.request.settings for seq in batch.seqs],
                                       lambda: batching.uniforms(batch, k), batch.riders.get("draft", ()))
        if looped is not None:
            batch.stats.draft_passes += K
            return looped
    drafts = [[] for _ in range(B)]
    q = np.zeros((B, K, model[1]["n_vocab"]), dtype=np.float32, like=model[0]["wpe"])  # [B, K, n_vocab]
    counts = batch.counts[:B].copy() if batching.penalized(batch) else None  # penalties see the drafts too
    for i in range(K):
        texts = batching.token_ids(batch, drafts)
        logits = kv_cache.next_logits(vocab_subset(model, texts, vocab), batching.cache(batch, "draft"),
                                      texts, riders=batch.riders.pop("draft", ()))[:, 0]  # [B, n_vocab]
        q[:, i] = batching.distributions(batch, logits, counts, drafts)  # [B, n_vocab]
        drafting = [int(kb > i) for kb in k]  # [B]: 1 where row b still drafts
        tokens = sampling.sample(q[:, i], batching.uniforms(batch, drafting)[:, 0]).tolist()  # [B]
        for b in np.nonzero(drafting)[0]:
            drafts[b].append(tokens[b])
            if counts is not None:
                counts[b, tokens[b]] += 1
    batch.stats.draft_passes += K
    return drafts, q


def vocab_subset(model, texts, N):
    """The model with its head over the first N token ids and the texts' (VocabSubset);
    N = 0: the model itself."""
    if not N:
        return model
    params, hparams = model
    return dict(params, wte=VocabSubset(params["wte"], N, texts)), hparams


class VocabSubset:
    """A draft's wte with a cheaper head: wte[tokens] as ever, but wte.T gives logits only
    for the first N token ids and the tokens already in each row's text; -inf (q = 0) for
    the rest. Speculative sampling stays exact for any q: a token the draft cannot propose
    still comes from the residual max(0, p - q) = p there.

    Why the first N ids: GPT-2's BPE numbers its tokens in the order it learned its merges,
    most frequent pair first, so those are mostly common words (the 256 single bytes among
    them are not). A proxy for frequency, cheap, and the same for every text."""

    def __init__(self, wte, N, texts):
        self.wte, self.N, self.texts, self.T = wte, N, texts, VocabSubsetHead(self)

    def __getitem__(self, tokens):
        return self.wte[tokens]  # [..., n_embd]


class VocabSubsetHead:
    """x @ VocabSubset.T: x [B, n, n_embd] -> logits [B, n, n_vocab]."""
    __array_ufunc__ = None  # NumPy hands x @ head to __rmatmul__

    def __init__(self, subset):
        self.subset = subset

    def __rmatmul__(self, x):
        wte, N = self.subset.wte, self.subset.N
        logits = np.full_like(x, -np.inf, dtype=np.float32, shape=(*x.shape[:2], wte.shape[0]))  # [B, n, n_vocab]
        logits[..., :N] = x @ wte[:N].T  # [B, n, N]: reads the weights of the first N tokens only
        for b, text in enumerate(self.subset.texts):
            text = np.asarray(text)  # [len]
            extra = np.asarray(np.unique(text[text >= N]), like=x)  # [n_extra]: the text's rarer tokens
            if extra.size and x.shape[1]:
                logits[b][:, extra] = x[b] @ wte[extra].T  # [n, n_extra]
        return logits


def draft_deterministic(batch, propose_fn, k):
    """Drafts from a deterministic drafter such as prompt lookup: q is one-hot at each
    draft, so d_i is accepted with probability p_i(d_i). Its q is None: the verification
    makes the one-hot where it runs (one_hot; a GPU's recorded one, in its kernel), rather
    than [B, K, n_vocab] mostly zeros being made here and copied there."""
    return [propose_fn(seq.tokens, kb)[:kb] if kb else [] for seq, kb in zip(batch.seqs, k)], None


def one_hot(drafts, k, n_vocab):
    """A deterministic drafter's q [B, K, n_vocab]: q_i = 1 at d_i, for row b's first k[b]."""
    B, K = drafts.shape
    q = np.zeros((B, K, n_vocab), dtype=np.float32)  # [B, K, n_vocab]
    b, i = np.nonzero(np.arange(K) < np.reshape(k, (B, 1)))  # each row's drafts
    q[b, i, drafts[b, i]] = 1.0
    return q


def prompt_lookup_draft(text, K, max_ngram=3):
    """Prompt lookup decoding (Saxena 2023): find the last n-gram of text earlier in
    text (longest n first) and propose the up to K tokens after it: after the latest match
    that K tokens follow, else after the earliest (in repeating text the latest match ends
    just before the text does, with little after it)."""
    arr = np.asarray(text)  # [len]
    for size in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], size)  # [len-size, size]
        starts = np.nonzero((windows == arr[-size:]).all(axis=1))[0] + size  # [n_hits]: what follows each match
        if starts.size:
            followed = starts[starts + K <= len(arr)]  # [n]: the matches K tokens follow
            start = followed[-1] if followed.size else starts[0]
            return arr[start:start + K].tolist()
    return []


PROMPT_LOOKUP = Drafter(lambda batch, k, vocab: draft_deterministic(batch, prompt_lookup_draft, k))


def verify_with_target(batch, model, drafts, q, d, k, u, v):
    """Steps 2-4: the target's logits [B, K+1, n_vocab] after each prefix of every row's
    drafts, from ONE pass, its p_1..p_{k+1}, and `verify`'s n and token (lists: only these
    leave a GPU). On a GPU's kernels the pass, p and the verification are one CUDA graph
    (cuda_decode_loop.verify; None elsewhere), and the logits None if no callback reads them
    (batching.wants_logits)."""
    looped = cuda_decode_loop.verify(model, batching.cache(batch, "target"), batching.token_ids(batch, drafts), q, d,
                                     k, u, v, [seq.request.settings for seq in batch.seqs], verify,
                                     batch.riders.get("target", ()), want_logits=batching.wants_logits(batch))
    if looped is not None:
        return looped
    logits, p = score_with_target(batch, model, drafts)
    n, token = verify(p, q, d, k, u, v)
    return logits, n.tolist(), token.tolist()


def score_with_target(batch, model, drafts):
    """The target's logits and distributions p [B, K+1, n_vocab] after each prefix of every
    row's drafts (row b: its first k[b]+1 entries), all from ONE forward pass."""
    n_logits = np.array([len(d) + 1 for d in drafts])  # [B]
    logits = kv_cache.next_logits(model, batching.cache(batch, "target"), batching.token_ids(batch, drafts), n_logits,
                                  riders=batch.riders.pop("target", ()))
    counts = None
    if batching.penalized(batch):
        counts = counts_along_drafts(batch.counts[:len(drafts)], drafts, logits.shape[1])  # [B, K+1, n_vocab]
    return logits, batching.distributions(batch, logits, counts, drafts)  # [B, K+1, n_vocab] twice


def counts_along_drafts(counts, drafts, n_positions):
    """counts [B, n_vocab] -> [B, n_positions, n_vocab]: position i also counts d_1..d_i,
    since a penalty at position i must see the drafted text before it."""
    out = np.repeat(counts[:, None], n_positions, axis=1)  # [B, n_positions, n_vocab]
    for b, d in enumerate(drafts):
        for i, token in enumerate(d[:n_positions - 1]):
            out[b, i + 1:, token] += 1
    return out


# --- settings: how many drafts, and from what ---

@dataclass(frozen=True)
class SpeculativeConfig:
    K: int = 4  # drafts per target pass (the papers' gamma)
    adaptive: bool = False  # before each step, each row picks its K from its own acceptance so far
    K_max: int = None  # the largest K adaptive K picks; None: max(K, 7)
    costs: cost_model.Costs = None  # for adaptive K; None: estimated from the models' sizes and formats (default_costs)
    draft_vocab: int = 0  # the draft's head: the first N token ids, roughly the most frequent, + the text's; 0: all


def check(config, target_hparams=None, draft_hparams=None):
    """K, K_max and the draft's vocabulary, or a sampling.BadSetting naming the one that is wrong."""
    if config.K < 1:
        raise sampling.BadSetting("K", f"must be >= 1, got {config.K}")
    if config.adaptive and config.K_max is not None and config.K_max < config.K:
        raise sampling.BadSetting("K_max", f"must be >= K, got {config.K_max} < {config.K}")
    if config.draft_vocab < 0:
        raise sampling.BadSetting("draft_vocab", f"must be >= 0 (0 = the whole vocabulary), got {config.draft_vocab}")
    if target_hparams is not None and config.draft_vocab > target_hparams["n_vocab"]:
        raise sampling.BadSetting("draft_vocab", f"must be at most the vocabulary's {target_hparams['n_vocab']} "
                                  f"tokens (0 = all of them), got {config.draft_vocab}")
    if draft_hparams is not None and draft_hparams["n_vocab"] != target_hparams["n_vocab"]:
        raise sampling.BadSetting("draft", f"vocabulary ({draft_hparams['n_vocab']} tokens) differs from the "
                                  f"target's ({target_hparams['n_vocab']}): speculative decoding needs one tokenizer")


def resolve(config, target, draft):
    """config with its defaults filled in: K_max = max(K, 7), costs from the models' sizes."""
    return replace(config, K_max=config.K_max or max(config.K, 7),
                   costs=config.costs or cost_model.default_costs(target, draft, config.draft_vocab))


def adaptive_K(seq, config):
    """A row's K from its own history: alpha estimated from its drafts so far (with one
    optimistic success to start), then best_K on the fixed costs."""
    if seq.accepted + seq.rejected == 0:
        return config.K  # no history yet
    return cost_model.best_K(cost_model.estimate_alpha(seq.accepted + 1, seq.rejected), config.costs, config.K_max)
