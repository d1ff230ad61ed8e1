"""Sequences in flight: the bookkeeping that plain and speculative decoding share.

A `Request` says what to generate: prompt, how many new tokens at most, how to
sample, and the seed of its own random stream. While it is being answered it is
a `Sequence` (its text so far, its random generator, when each token came), and
the sequences decoded together form a `Batch`. Row b of a batch is row b of each
KV cache and of the penalty counts.

Each row draws its random numbers from its own generator, in an order that
depends on that row alone. So a request's text depends only on its prompt,
settings and seed: never on which requests share the batch, or when they joined
it. That is what lets rows leave as they finish and new requests take their
place (continuous batching, serving/scheduler.py) without changing anyone's text.

Rows stay packed at the front of the caches: when a row finishes, the last row
moves into its place (one row's cache is copied), so every pass reads rows
0..B-1 as plain array views, with no gathering of scattered rows.

Plain autoregressive decoding closes the file: one pass of the model per new token for
every row (`autoregressive_step`), until each request has its tokens (`generate`).
"""
import collections
import time
from dataclasses import dataclass, field

import numpy as np

import kv_cache
import sampling
from kernels import cuda_decode_loop


@dataclass(frozen=True)
class Request:
    prompt: tuple  # token ids
    max_new_tokens: int
    settings: sampling.SamplingSettings = sampling.SamplingSettings()
    seed: int = 0  # this request's own random stream: same seed, same text
    eos_id: int = None  # stop after this token (GPT-2's <|endoftext|> is 50256); None: never early
    arrival_s: float = 0.0  # serving: when the request arrives, in seconds after the start
    # the callback reads the logits each of its tokens was drawn after (a server's logprobs): on
    # a GPU its batch's steps then keep every pass's (without, none leave the device)
    wants_logits: bool = False


def requests(prompts, max_new_tokens, settings=sampling.SamplingSettings(), seed=0, eos_id=None):
    """One request per prompt; prompt i samples with seed + i."""
    return [Request(tuple(p), max_new_tokens, settings, seed + i, eos_id) for i, p in enumerate(prompts)]


def check_request(r, n_vocab):
    """A request the model can answer, or a ValueError that names the wrong field and says
    what it should be. Every way in (generate, serve, main.py, the server) asks this before
    a request takes a row, so one bad request is refused alone and never breaks a step."""
    if not isinstance(r, Request):
        raise ValueError(f"request must be a batching.Request, got {type(r).__name__}")
    if isinstance(r.prompt, (str, bytes)) or not isinstance(r.prompt, (tuple, list, np.ndarray)):
        raise ValueError(f"prompt must be a sequence of token ids (encode text first), got {type(r.prompt).__name__}")
    if len(r.prompt) == 0:
        raise ValueError(f"prompt is empty: start it with <|endoftext|> (token {n_vocab - 1}) for unconditional text")
    if not all(sampling.is_int(t) and 0 <= t < n_vocab for t in r.prompt):
        raise ValueError(f"prompt must hold integer token ids in [0, {n_vocab})")
    if not sampling.is_int(r.max_new_tokens) or r.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
    if not isinstance(r.settings, sampling.SamplingSettings):
        raise ValueError(f"settings must be a sampling.SamplingSettings, got {type(r.settings).__name__}")
    if not sampling.is_int(r.seed) or r.seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {r.seed!r}")
    if r.eos_id is not None and not (sampling.is_int(r.eos_id) and 0 <= r.eos_id < n_vocab):
        raise ValueError(f"eos_id must be None or a token id in [0, {n_vocab}), got {r.eos_id!r}")
    if not sampling.is_real(r.arrival_s) or not 0 <= r.arrival_s < float("inf"):
        raise ValueError(f"arrival_s must be a finite number of seconds >= 0, got {r.arrival_s!r}")


@dataclass
class Sequence:
    request: Request
    index: int  # where the request stands in the caller's list: results come back in that order
    tokens: list  # the text so far: the prompt, then each generated token
    rng: np.random.Generator
    times: list = field(default_factory=list)  # time.perf_counter() when each new token was emitted
    accepted: int = 0  # speculative decoding: drafts accepted
    rejected: int = 0  # speculative decoding: steps that rejected a draft
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens whose keys and values were copied, not computed (a shared prefix)

    @property
    def generated(self):
        return self.tokens[len(self.request.prompt):]

    @property
    def n_generated(self):
        return len(self.tokens) - len(self.request.prompt)


# Latency percentiles read the gaps between the RECENT_STEPS latest steps: a server runs for
# days, and its bookkeeping must cost the same and weigh the same at step 10 and step 10^7.
RECENT_STEPS = 4096


@dataclass
class Stats:
    """What a decode did and how long it took: counters, running sums and a window of
    recent steps, so it stays the same size however long it runs. The speculative
    counters stay 0 for plain decoding."""
    start: float = field(default_factory=time.perf_counter)
    n_steps: int = 0
    first_step_at: float = 0.0  # time.perf_counter() when the first step ended (the prefill) ...
    first_step_tokens: int = 0  # ... and the tokens it had emitted
    prefill_waiting: int = 0  # serving: prompt tokens not yet computed (waiting, or being prefilled in chunks)
    last_step_at: float = 0.0
    step_gaps_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_STEPS))
    n_tokens: int = 0
    kv_cache_bytes: int = 0  # as allocated
    target_passes: int = 0
    row_passes: int = 0  # target passes summed over rows
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # row-steps that rejected a draft
    draft_s: float = 0.0  # seconds spent drafting, over every step ...
    verify_s: float = 0.0  # ... and scoring and verifying
    first_draft_s: float = 0.0  # ... of which the first step's (the prefill)
    first_verify_s: float = 0.0
    proposed_at: list = field(default_factory=list)  # [i]: drafts proposed at draft position i (i < K_max)
    accepted_at: list = field(default_factory=list)

    def step_done(self, n=1):
        """A step of the decoder ended, n tokens a row long (plain decoding's on a GPU: several):
        the time since the last step is kept for the latencies as n equal gaps between tokens
        (emit counts the tokens)."""
        now = time.perf_counter()
        if self.n_steps == 0:
            self.first_step_at, self.first_step_tokens = now, self.n_tokens
        else:
            self.step_gaps_s.extend([(now - self.last_step_at) / n] * n)
        self.last_step_at = now
        self.n_steps += 1

    def speculative_step_done(self, k, n, draft_s, verify_s):
        """A draft-verify step ended: k [B] drafts verified, n [B] accepted, and its two phases' times."""
        self.step_done()
        self.target_passes += 1
        self.row_passes += len(k)
        self.draft_s += draft_s
        self.verify_s += verify_s
        if self.n_steps == 1:  # the prefill's step, which the benchmark leaves out of a step's cost
            self.first_draft_s, self.first_verify_s = draft_s, verify_s
        self.drafted += int(k.sum())
        self.accepted += sum(n)
        for kb, nb in zip(k, n):
            self.proposed_at += [0] * (kb - len(self.proposed_at))
            self.accepted_at += [0] * (kb - len(self.accepted_at))
            for i in range(kb):
                self.proposed_at[i] += 1
                self.accepted_at[i] += i < nb

    @property
    def decode_tokens_per_s(self):
        """Tokens/s after the first step (the prefill), which may emit several tokens."""
        span = self.last_step_at - self.first_step_at
        return (self.n_tokens - self.first_step_tokens) / span if self.n_steps > 1 and span > 0 else 0.0

    @property
    def seconds(self):
        return self.last_step_at - self.start if self.n_steps else 0.0

    @property
    def ttft_s(self):
        return self.first_step_at - self.start if self.n_steps else 0.0

    @property
    def tokens_per_s(self):
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    def itl_ms(self, q):
        """Inter-token latency: the q-th percentile of the time between the latest steps, in ms."""
        return float(np.percentile(self.step_gaps_s, q) * 1e3) if self.step_gaps_s else 0.0

    @property
    def acceptance_rate(self):
        """Drafts accepted of drafts made. Not the papers' alpha (cost_model.estimate_alpha): the
        drafts after a row's first rejection are never tested, and count here as not accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self):
        """Tokens each row gained per target pass (1 for plain decoding)."""
        return self.n_tokens / self.row_passes if self.row_passes else 0.0

    @property
    def acceptance_by_position(self):
        return [round(a / p, 3) for a, p in zip(self.accepted_at, self.proposed_at) if p]


@dataclass
class Batch:
    seqs: list  # the rows in flight, in cache-row order
    counts: np.ndarray  # [max_rows, n_vocab] occurrences of each token in each row's text
    prompt_counts: np.ndarray  # [max_rows, n_vocab] occurrences in each row's prompt
    caches: dict  # model name ("target", "draft") -> KV cache with max_rows rows; empty without caches
    stats: Stats
    # callback(seq, token, accepted, logits) sees each token as it is emitted; logits: the row's [n_vocab]
    # that the token was drawn after where its request wants_logits, else None
    callback: object = None
    done: list = field(default_factory=list)  # finished sequences
    # model name -> chunks of other rows' prompts that the step's first pass of that model caches
    # too (kv_cache.ride_along: chunked prefill, serving/scheduler.py); a pass takes them
    riders: dict = field(default_factory=dict)


def new_batch(models, max_rows, n_slots, use_cache=True, callback=None, stats=None):
    """An empty batch with room for max_rows rows of up to n_slots cached tokens each.
    models: name -> (params, hparams) of every model whose cache the decoder needs.
    stats: a Stats to count in (a server reads it while the batch runs); default a new one."""
    n_vocab = next(iter(models.values()))[1]["n_vocab"]
    caches = {name: kv_cache.init_cache(hparams, max_rows, min(hparams["n_ctx"], n_slots), like=params["wpe"])
              for name, (params, hparams) in models.items()} if use_cache else {}
    stats = stats or Stats()
    stats.kv_cache_bytes = sum(kv_cache.cache_nbytes(c) for c in caches.values())
    zeros = np.zeros((max_rows, n_vocab), dtype=np.int32)
    return Batch([], zeros, zeros.copy(), caches, stats, callback)


def cache_slots(reqs, extra=0):
    """Slots a cache needs for these requests: the longest prompt plus its new tokens."""
    return max(len(r.prompt) + r.max_new_tokens for r in reqs) + extra


def join(batch, request, index):
    """A request starts: it takes the next free row of the batch."""
    b = len(batch.seqs)
    batch.seqs.append(Sequence(request, index, [int(t) for t in request.prompt],
                               np.random.default_rng(request.seed)))
    counts = sampling.token_counts([request.prompt], batch.counts.shape[1])[0]  # [n_vocab]
    batch.counts[b] = batch.prompt_counts[b] = counts
    for cache in batch.caches.values():
        kv_cache.clear_row(cache, b)


def emit(batch, b, tokens, n_accepted=0, logits=None):
    """Append tokens to row b's text (the first n_accepted of them were accepted drafts),
    stopping exactly at max_new_tokens or at EOS. logits [B, len(tokens), n_vocab]: the batch's
    logits, row b's that each token was drawn after, for the callback where the row's request
    wants_logits (a server's logprobs; on a GPU a row's view is a call into CuPy)."""
    seq = batch.seqs[b]
    r = seq.request
    logits = logits if r.wants_logits else None
    tokens = tokens[:r.max_new_tokens - seq.n_generated]
    if r.eos_id in tokens:
        tokens = tokens[:tokens.index(r.eos_id) + 1]  # EOS ends the row right there
    now = time.perf_counter()
    for j, token in enumerate(tokens):
        seq.tokens.append(token)
        seq.times.append(now)
        batch.counts[b, token] += 1
        if batch.callback:
            batch.callback(seq, token, j < n_accepted, None if logits is None else logits[b, j])
    batch.stats.n_tokens += len(tokens)
    seq.finished = seq.n_generated == r.max_new_tokens or tokens[-1] == r.eos_id


def leave(batch):
    """Finished rows leave the batch."""
    for b in reversed(range(len(batch.seqs))):
        if batch.seqs[b].finished:
            batch.done.append(batch.seqs[b])
            remove(batch, b)


def remove(batch, b):
    """Row b leaves; the last row moves into its place, so the rows stay packed."""
    move(batch, len(batch.seqs) - 1, b)
    batch.seqs.pop()


def move(batch, src, dst):
    """Copy row src into row dst (its sequence, counts and cached keys and values); src stays as it was."""
    if src != dst:
        batch.seqs[dst] = batch.seqs[src]
        batch.counts[dst], batch.prompt_counts[dst] = batch.counts[src], batch.prompt_counts[src]
        for cache in batch.caches.values():
            kv_cache.move_row(cache, src, dst)


def run(requests, models, step, use_cache=True, callback=None):
    """Decode requests as one batch: every request takes a row, then step(batch) until
    every row has finished (finished rows leave as they go). Returns (each request's new
    tokens, Stats). models: name -> (params, hparams) of every model step keeps a cache for."""
    for r in requests:
        check_request(r, models["target"][1]["n_vocab"])
    batch = new_batch(models, len(requests), cache_slots(requests), use_cache, callback)
    for i, r in enumerate(requests):
        join(batch, r, i)
    batch.stats.start = time.perf_counter()
    while batch.seqs:
        step(batch)
        leave(batch)
    return results(batch), batch.stats


def results(batch):
    """Each request's new tokens, in the order the requests were given."""
    return [seq.generated for seq in sorted(batch.done, key=lambda s: s.index)]


def cache(batch, name):
    """The rows in flight of one model's cache (None when decoding without a cache)."""
    return kv_cache.rows(batch.caches[name], 0, len(batch.seqs)) if name in batch.caches else None


def rows(batch, lo, hi):
    """Rows lo..hi-1 as a batch of their own (views: what a step does to it lands in batch),
    so that rows that just joined can be prefilled in a pass of their own."""
    caches = {name: kv_cache.rows(c, lo, hi) for name, c in batch.caches.items()}
    return Batch(batch.seqs[lo:hi], batch.counts[lo:hi], batch.prompt_counts[lo:hi], caches, batch.stats,
                 batch.callback)


def wants_logits(batch):
    """Whether a callback reads the logits of some row's tokens (Request.wants_logits)."""
    return batch.callback is not None and any(seq.request.wants_logits for seq in batch.seqs)


def penalized(batch):
    """Whether any row's settings read the penalty counts."""
    return any(seq.request.settings.uses_counts for seq in batch.seqs)


def token_ids(batch, extra=None):
    """Each row's token ids, followed by extra[b] (speculative drafts) if given."""
    return [s.tokens + (extra[b] if extra else []) for b, s in enumerate(batch.seqs)]


def distributions(batch, logits, counts=None, drafts=None):
    """Each row's distribution [B, ..., n_vocab] under its own request's settings (rows
    that share settings share one call); counts default to each row's text so far.
    drafts[b]: tokens drafted after row b's text, which the n-gram ban must see too."""
    B = len(batch.seqs)
    if any(seq.request.settings.no_repeat_ngram_size for seq in batch.seqs):
        logits = ban_repeated_ngrams(batch, logits, drafts)
    counts = batch.counts[:B] if counts is None else counts
    prompt_counts = batch.prompt_counts[:B][(slice(None),) + (None,) * (logits.ndim - 2)]  # [B, 1.., n_vocab]
    groups = {}
    for b, seq in enumerate(batch.seqs):
        groups.setdefault(seq.request.settings, []).append(b)
    if len(groups) == 1:
        return sampling.probabilities(logits, counts, next(iter(groups)), prompt_counts)
    p = np.empty(logits.shape, dtype=np.float32, like=logits)
    for s, members in groups.items():  # the rows that share one request's settings
        p[members] = sampling.probabilities(logits[members], counts[members], s, prompt_counts[members])
    return p


def ban_repeated_ngrams(batch, logits, drafts=None):
    """logits with -inf at each token that would repeat an n-gram of its row's text. For
    logits [B, P, n_vocab] (a verify pass) position i's text ends with the first i drafts;
    for [B, n_vocab], with all of them (the text a draft model continues)."""
    logits = logits.copy()
    for b, seq in enumerate(batch.seqs):
        n, extra = int(seq.request.settings.no_repeat_ngram_size), drafts[b] if drafts else []
        if not n:
            continue
        for i in range(logits.shape[1]) if logits.ndim == 3 else [None]:
            text = seq.tokens + (extra if i is None else extra[:i])
            banned = sampling.banned_tokens(text, n)
            if banned:
                (logits[b] if i is None else logits[b, i])[banned] = -np.inf
    return logits


def uniforms(batch, n):
    """[B, max(n)] draws from U(0, 1]: row b takes n[b] from its own generator (an int n:
    the same for every row); the entries past n[b] are 1 and never read."""
    n = np.broadcast_to(n, (len(batch.seqs),))
    u = np.ones((len(batch.seqs), max(int(n.max()), 1)))  # [B, max(n)]
    for b, seq in enumerate(batch.seqs):
        u[b, :n[b]] = 1.0 - seq.rng.random(n[b])
    return u


# --- plain decoding: a batch of requests, one pass of gpt2 per new token ---

def autoregressive_step(batch, model):
    """Every row gains one token, sampled from the model's next-token distribution (on a GPU
    up to cuda_decode_loop.STEPS tokens: the same tokens, and the same logits)."""
    texts = token_ids(batch)
    settings = [seq.request.settings for seq in batch.seqs]
    most = [seq.request.max_new_tokens - seq.n_generated if seq.n_generated else 1  # a first token comes alone
            for seq in batch.seqs]
    drawn = cuda_decode_loop.step(model, cache(batch, "target"), texts, settings, lambda k: uniforms(batch, k),
                                  batch.riders.get("target", ()), want_logits=wants_logits(batch), most=most)
    if drawn is not None:  # a GPU's kernels: passes and their draws recorded as one CUDA graph
        tokens, logits = drawn  # [B] lists of tokens, [B, max k, n_vocab] (None: no callback reads them)
    else:
        logits = kv_cache.next_logits(model, cache(batch, "target"), texts,
                                      riders=batch.riders.pop("target", ()))[:, 0]  # [B, n_vocab]
        u = uniforms(batch, 1)[:, 0]  # [B]: drawn even when unused, so a row's generator advances a draw a step
        if all(seq.request.settings.picks_argmax for seq in batch.seqs):
            tokens = np.argmax(logits, axis=-1)[:, None].tolist()  # [B, 1]: one launch on a GPU; only ids leave
        else:
            tokens = sampling.sample(distributions(batch, logits), u)[:, None].tolist()  # [B, 1]: only ids leave a GPU
        logits = logits[:, None]  # [B, 1, n_vocab]
    for b, row in enumerate(tokens):
        emit(batch, b, row, logits=logits)
    batch.stats.step_done(max(len(row) for row in tokens))


def generate(requests, model, use_cache=True, callback=None):
    """Autoregressive decoding: one model pass per new token, for a batch of requests
    (`requests`). model: (params, hparams). Rows leave the batch as they finish.
    Returns (each request's new tokens, Stats)."""
    return run(requests, {"target": model}, lambda batch: autoregressive_step(batch, model), use_cache, callback)
