"""Beam search: keep the N likeliest partial texts, not just one.

Greedy decoding keeps the single likeliest next token, so a likely text that starts with a
less likely token is never found. Beam search keeps num_beams hypotheses per prompt. Each
step extends every beam by every token, scores each continuation by its summed log
probability, and keeps the best: the likeliest 2N continuations of all N beams are looked
at, those that end (EOS, or the length limit) become finished hypotheses, and the best N
that go on are the next beams. A finished hypothesis scores sum(log p) / length^length_penalty
(> 0 favours longer texts, < 0 shorter ones). Search stops when no running beam can still
beat the worst of the N best finished ones (`early_stopping` decides how that is judged),
or at the length limit. The result: the N best finished
hypotheses, best first.

This follows Hugging Face transformers' `_beam_search` (generation/utils.py, v5.23) step
for step, including its processors acting on log probabilities, so the same model gives
the same token ids and scores (tests/test_beam_search.py against fixtures made by
tests/fixtures/make_beam_fixtures.py).

On the KV cache, the beams of a prompt are rows of one cache: the prompt is prefilled once,
its row is copied to its N beams, each step runs one pass over all B * N rows (a multi-row
pass: kernels/rowwise.py), and keeping beams is a gather of cache rows, never a recomputation.
"""
from dataclasses import dataclass

import numpy as np

import kv_cache
import sampling
from kernels import layout

NEG = -1.0e9  # transformers' "never pick this": a score so low it loses to every real one


@dataclass(frozen=True)
class BeamSettings:
    num_beams: int = 4
    length_penalty: float = 1.0  # finished score = sum(log p) / generated_length ** length_penalty
    early_stopping: object = False  # True: stop once N hypotheses are done; False: a heuristic; "never": exact
    num_return_sequences: int = 1
    no_repeat_ngram_size: int = 0  # > 0: no n-gram of this size appears twice in a text
    repetition_penalty: float = 1.0  # transformers' rule, applied to the log probabilities


def check(s):
    """Settings beam search can run, or a sampling.BadSetting naming the one that is wrong."""
    if not isinstance(s.num_beams, int) or s.num_beams < 1:
        raise sampling.BadSetting("num_beams", f"must be an integer >= 1, got {s.num_beams}")
    if not 1 <= s.num_return_sequences <= s.num_beams:
        raise sampling.BadSetting("num_return_sequences", f"must be in [1, num_beams = {s.num_beams}], "
                                  f"got {s.num_return_sequences}")
    if s.early_stopping not in (True, False, "never"):
        raise sampling.BadSetting("early_stopping", f"must be True, False or never, got {s.early_stopping}")
    if s.no_repeat_ngram_size < 0:
        raise sampling.BadSetting("no_repeat_ngram_size", f"must be >= 0, got {s.no_repeat_ngram_size}")
    if not np.isfinite(s.length_penalty):
        raise sampling.BadSetting("length_penalty", f"must be a finite number, got {s.length_penalty}")
    if not 0.01 <= s.repetition_penalty <= 100:
        raise sampling.BadSetting("repetition_penalty", f"must be in [0.01, 100], got {s.repetition_penalty}")


def check_window(n_ctx, prompts, max_new_tokens):
    """Every beam stays inside the window, or a sampling.BadSetting saying why it must."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > n_ctx:
        raise sampling.BadSetting("max_new_tokens", f"{max_new_tokens} is too many: beam search keeps every beam "
                                  f"inside GPT-2's {n_ctx}-token window (the window's restart would re-prefill "
                                  f"every beam each time), and a prompt plus its new tokens needs {longest}; "
                                  "generate fewer tokens or shorten the prompt")


# [B*N, V]-sized arrays a step holds at once, in float32's 4 bytes: the logits, their log
# probabilities, the candidates' sums, and their ranking (argpartition's negated copy, its int64 indices)
STEP_COPIES = 8


def check_memory(n_rows, n_vocab, like):
    """A sampling.BadSetting where a step's scores for n_rows beams are more than the memory
    they live in: the OS would kill the search midway, without a word of why."""
    try:
        layout.check_memory(STEP_COPIES * 4 * n_rows * n_vocab, f"asks for {n_rows} beams in all, whose scores "
                            f"({n_vocab} each, {STEP_COPIES} copies a step)", like, "ask for fewer beams or prompts")
    except ValueError as e:
        raise sampling.BadSetting("num_beams", str(e))


def beam_search(prompts, model, max_new_tokens, settings=BeamSettings(), eos_id=None, trace=None):
    """For each prompt (token ids), its num_return_sequences best hypotheses, best first, as
    (new tokens, score). model: (params, hparams). eos_id: the token that ends a hypothesis.
    trace: a list to append each step's beams to (img/make_beam_tree.py draws them)."""
    params, hparams = model
    check(settings)
    check_window(hparams["n_ctx"], prompts, max_new_tokens)
    B, N, V = len(prompts), settings.num_beams, hparams["n_vocab"]
    check_memory(B * N, V, params["wpe"])
    cache = kv_cache.init_cache(hparams, B * N, max(len(p) for p in prompts) + max_new_tokens, like=params["wpe"])
    first = on_host(kv_cache.next_logits(model, kv_cache.rows(cache, 0, B), [list(p) for p in prompts])[:, 0])  # [B, V]
    kv_cache.gather_rows(cache, np.repeat(np.arange(B), N))  # every beam starts from its prompt's prefill
    texts = [[list(p) for _ in range(N)] for p in prompts]  # [B][N]: each running beam's text
    scores = np.zeros((B, N), np.float32)  # running beams' summed log probs
    scores[:, 1:] = NEG  # the first step extends beam 0 only: the beams are still identical
    finished = [[] for _ in range(B)]  # per prompt: up to N (score, tokens), best first
    open_search = np.ones(B, bool)  # transformers' "is_early_stop_heuristic_unsatisfied"
    logits = np.repeat(first, N, axis=0)  # [B*N, V]
    for step in range(max_new_tokens):
        logp = processed(sampling.log_softmax(logits.astype(np.float32, copy=False)),  # [B*N, V]
                         [t for beams in texts for t in beams], settings)
        total = (logp.reshape(B, N, V) + scores[:, :, None]).reshape(B, N * V)  # [B, N*V]
        top = top_k(total, 2 * N)  # [B, 2N]: the likeliest continuations of all beams
        beam, token = top // V, top % V  # [B, 2N]
        cand_scores = np.take_along_axis(total, top, axis=1)  # [B, 2N]
        ends = (token == eos_id) | (step + 1 == max_new_tokens)  # [B, 2N]: these stop here
        keep_finished(finished, texts, beam, token, cand_scores, ends, open_search, step + 1, prompts, settings)
        nxt = top_k(cand_scores + ends * NEG, N)  # [B, N]: the best that go on
        src = np.take_along_axis(beam, nxt, axis=1)  # [B, N]: the beam each comes from
        scores = np.take_along_axis(cand_scores + ends * NEG, nxt, axis=1).astype(np.float32)
        new_tokens = np.take_along_axis(token, nxt, axis=1)
        texts = [[texts[b][src[b, j]] + [int(new_tokens[b, j])] for j in range(N)] for b in range(B)]
        if trace is not None:  # per prompt: where each beam came from, its new token and score
            trace.append({"src": src.tolist(), "tokens": new_tokens.tolist(), "scores": scores.tolist(),
                          "finished": [[(score, len(tokens)) for score, tokens in hyps] for hyps in finished]})
        open_search &= can_improve(scores, finished, step + 1, max_new_tokens, settings)
        if stop(open_search, finished, ends, settings, N):
            break
        kv_cache.gather_rows(cache, (np.arange(B)[:, None] * N + src).ravel(),  # keep the chosen beams' caches
                             same=min(len(p) for p in prompts))  # past the prompts, which every beam shares
        logits = on_host(kv_cache.next_logits(model, cache, [t for beams in texts for t in beams])[:, 0])  # [B*N, V]
    return [[(tokens[len(p):], score) for score, tokens in hyps[:settings.num_return_sequences]]
            for p, hyps in zip(prompts, finished)]


def on_host(logits):
    """Logits as a NumPy array: the search's bookkeeping over a few rows runs on the host (from a
    GPU, one copy a step)."""
    return logits.get() if hasattr(logits, "get") else logits


def processed(logp, texts, s):
    """transformers' processors for beam search, in its order, on log probabilities."""
    if s.repetition_penalty != 1.0:
        for r, text in enumerate(texts):
            seen = np.unique(text)
            logp[r, seen] = np.where(logp[r, seen] < 0, logp[r, seen] * s.repetition_penalty,
                                     logp[r, seen] / s.repetition_penalty)
    if s.no_repeat_ngram_size:
        for r, text in enumerate(texts):
            logp[r, sampling.banned_tokens(text, s.no_repeat_ngram_size)] = -np.inf
    return logp


def top_k(x, k):
    """Indices of the k largest entries of each row, largest first (ties: the lower index)."""
    part = np.argpartition(-x, k - 1, axis=1)[:, :k]  # [B, k], unordered
    vals = np.take_along_axis(x, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)  # by value, then by index
    return np.take_along_axis(part, order, axis=1)


def keep_finished(finished, texts, beam, token, cand_scores, ends, open_search, length, prompts, s):
    """The continuations among the first N that end here become hypotheses, scored
    sum(log p) / length ** length_penalty; each prompt keeps its N best. None are added
    once a prompt can no longer improve, or (early_stopping=True) once it holds N."""
    N = s.num_beams
    for b in range(len(prompts)):
        if not open_search[b] or (len(finished[b]) == N and s.early_stopping is True):
            continue
        for c in np.nonzero(ends[b, :N])[0]:
            score = float(cand_scores[b, c]) / length ** s.length_penalty
            if score > -np.inf:  # a banned token's -inf never beats an empty slot
                finished[b].append((score, texts[b][beam[b, c]] + [int(token[b, c])]))
        finished[b].sort(key=lambda h: -h[0])
        del finished[b][N:]


def can_improve(scores, finished, length, max_new_tokens, s):
    """Whether a running beam could still beat the worst kept hypothesis of its prompt."""
    best_length = max_new_tokens if s.early_stopping == "never" and s.length_penalty > 0 else length
    best_running = scores[:, 0] / best_length ** s.length_penalty  # [B]
    N = s.num_beams
    worst = np.array([hyps[-1][0] if len(hyps) == N else NEG for hyps in finished])
    return best_running > worst


def stop(open_search, finished, ends, s, N):
    """transformers' end of search: no prompt can improve, or (early_stopping=True) every
    prompt has N hypotheses, or every continuation just ended."""
    done = all(len(h) == N for h in finished) and s.early_stopping is True
    return not open_search.any() or done or ends.all()
