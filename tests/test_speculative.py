"""Speculative decoding: exact greedy text at any length, exact distributions, stopping rules."""
import itertools

import numpy as np
import pytest

import batching
import cost_model
import gpt2
import kv_cache
import sampling
import speculative

GREEDY = sampling.SamplingSettings(temperature=0.0)
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262], [36235]]
N_CTX = 64  # the tiny model's window


def spec(prompts, target, draft, n, K=4, settings=GREEDY, seed=0, eos_id=None, use_cache=True, **config):
    """draft: a draft model, or a speculative.Drafter."""
    reqs = batching.requests(prompts, n, settings, seed, eos_id)
    drafter = draft if isinstance(draft, speculative.Drafter) else speculative.model_drafter(draft)
    return speculative.speculative_generate(reqs, target, drafter, speculative.SpeculativeConfig(K=K, **config),
                                            use_cache)


def plain(prompts, model, n, settings=GREEDY, seed=0, use_cache=True):
    return batching.generate(batching.requests(prompts, n, settings, seed), model, use_cache)[0]


def first_tokens(prompt, target, draft, n, K, settings, rows=2000, chunk=250):
    """The first n tokens generated for `rows` requests of one prompt, each with its own
    seed, in batches of `chunk` rows (p and q hold K+1 full distributions per row)."""
    out, accepted = [], 0
    for seed in range(0, rows, chunk):
        o, stats = spec([prompt] * chunk, target, draft, n, K, settings, seed=seed)
        out += o
        accepted += stats.accepted
    return out, accepted


def smaller_window(model, n_ctx):
    params, hparams = model
    return dict(params, wpe=params["wpe"][:n_ctx]), dict(hparams, n_ctx=n_ctx)


@pytest.fixture(scope="module")
def models(tiny):
    """target: the tiny GPT-2; draft: its first layer alone (a layer-skip draft that
    agrees with the target often but not always, so both branches get exercised)."""
    _, hparams, params = tiny
    draft = (dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1))
    return (params, hparams), draft


@pytest.fixture(scope="module")
def greedy_reference(models):
    target, _ = models
    return [plain([p], target, 30)[0] for p in PROMPTS]


@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_speculative_equals_greedy_batched_and_solo(models, greedy_reference, K, use_cache):
    target, draft = models
    batched, stats = spec(PROMPTS, target, draft, 30, K, use_cache=use_cache)
    assert batched == greedy_reference
    assert 0 < stats.acceptance_rate < 1  # the draft really was rejected sometimes
    for p, want in zip(PROMPTS, greedy_reference):
        assert spec([p], target, draft, 30, K, use_cache=use_cache)[0][0] == want


@pytest.fixture(scope="module")
def edge_prompts():
    """Prompts that end 0..9 tokens before the window's edge, on it, past it, and that
    start longer than it, so that K = 1..8 drafts meet a restart in every phase
    (45 new tokens cross one from each: restarts fall at 65, 98, 131, 164, ...)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 50000, n).tolist() for n in [N_CTX - j for j in range(10)] + [65, 66, 80, 150]]


@pytest.fixture(scope="module")
def edge_reference(models, edge_prompts):
    target, _ = models
    return plain(edge_prompts, target, 45)


@pytest.mark.parametrize("K", range(1, 9))
def test_greedy_speculative_equals_greedy_across_the_window_edge(models, edge_prompts, edge_reference, K):
    """45 tokens from each prompt cross at least one window restart. Drafts stop at the
    restart, so every target pass sees what plain decoding sees: the same text, token
    for token, batched, with a draft that is the target, a weaker one, one with a
    smaller window, prompt lookup, and adaptive K."""
    target, draft = models
    drafters = {"draft == target": target, "layer skip": draft, "draft window 24": smaller_window(draft, 24),
                "prompt lookup": speculative.PROMPT_LOOKUP}
    for name, drafter in drafters.items():
        assert spec(edge_prompts, target, drafter, 45, K)[0] == edge_reference, name
    assert spec(edge_prompts, target, draft, 45, K, adaptive=True, K_max=max(K, 6))[0] == edge_reference
    assert spec(edge_prompts[::4], target, target, 45, K, use_cache=False)[0] == edge_reference[::4]


@pytest.mark.parametrize("j", [0, 1, 2, 5, 9])
def test_greedy_speculative_equals_greedy_near_the_edge_solo(models, edge_prompts, edge_reference, j):
    target, draft = models
    for K in (1, 4, 8):
        assert spec([edge_prompts[j]], target, draft, 45, K)[0][0] == edge_reference[j]


DRAFT_WITH_MODEL = speculative.draft_with_model


def drafts_per_step(monkeypatch):
    """A list that gets each step's most drafts of a row (what the draft model proposed)."""
    trace = []

    def recording(batch, model, k, vocab=0):
        drafts, q = DRAFT_WITH_MODEL(batch, model, k, vocab)
        trace.append(max(map(len, drafts)))
        return drafts, q
    monkeypatch.setattr(speculative, "draft_with_model", recording)
    return trace


def test_drafts_stop_at_the_window_restart(models, monkeypatch):
    """Prompts 2 and 0 tokens short of the edge: the first step verifies only the drafts
    that fit in the full window, and the next starts in the restarted window."""
    target, _ = models
    for short, want in ((2, [2, 6]), (0, [0, 6])):
        prompt = list(range(1000, 1000 + N_CTX - short))
        trace = drafts_per_step(monkeypatch)
        out, stats = spec([prompt], target, target, 20, K=6)
        assert kv_cache.room(len(prompt), N_CTX) == short and trace[:2] == want
        assert out == plain([prompt], target, 20)


def test_huge_K_and_K_max_run_and_stay_exact(models, edge_prompts, edge_reference, monkeypatch):
    target, draft = models
    trace = drafts_per_step(monkeypatch)
    out, stats = spec(edge_prompts, target, target, 45, K=500, adaptive=True, K_max=1000)
    assert out == edge_reference and max(trace) <= N_CTX - 1
    out, _ = spec(edge_prompts[:4], target, smaller_window(draft, 8), 45, K=100)
    assert out == edge_reference[:4]


def test_draft_equal_to_target_accepts_everything(models, greedy_reference):
    target, _ = models
    for K in (1, 3, 8):
        out, stats = spec(PROMPTS, target, target, 30, K)
        assert out == greedy_reference and stats.acceptance_rate == 1.0 and stats.rejected == 0
        passes = -(-30 // (K + 1))  # every pass emits K accepted + 1 bonus, the last one what is left
        assert stats.tokens_per_target_pass == 30 / passes and stats.target_passes == passes
    rejected = []  # what adaptive K reads of each row: no step of a perfect draft rejected one
    speculative.speculative_generate(batching.requests(PROMPTS, 30, GREEDY), target, speculative.model_drafter(target),
                                     speculative.SpeculativeConfig(K=3),
                                     callback=lambda seq, *_: rejected.append(seq.rejected))
    assert len(rejected) == 3 * 30 and not any(rejected)


@pytest.mark.parametrize("use_cache", [True, False])
def test_prompt_lookup_greedy_equals_greedy(models, greedy_reference, use_cache):
    target, _ = models
    out, stats = spec(PROMPTS, target, speculative.PROMPT_LOOKUP, 30, use_cache=use_cache)
    assert out == greedy_reference and stats.draft_passes == 0 and stats.drafted > 0


def test_expected_tokens_and_best_K_follow_the_paper():
    assert cost_model.expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert cost_model.expected_tokens(1.0, 4) == 5
    flat = cost_model.Costs(draft=0.36, verify=(1.0,) + (2.0,) * 8)  # c = 0.36, verification 2 steps
    assert cost_model.best_K(0.8, flat, 7) == 4
    assert cost_model.best_K(0.95, flat, 7) == 7
    assert cost_model.best_K(0.1, flat, 7) == 1
    assert cost_model.best_K(0.3, cost_model.Costs(0.0, flat.verify), 7) == 7  # free drafts never hurt
    rising = cost_model.Costs(draft=0.1, verify=(1.0, 1.1, 1.2, 5.0, 5.0, 5.0))
    assert cost_model.best_K(0.99, rising, 5) == 2  # a verification that costs more per K caps K


def test_default_costs_follow_the_weights_read_per_step(models):
    target, draft = models
    c = cost_model.default_costs(target, draft).draft
    h = target[1]
    assert c == pytest.approx((12 * 16 ** 2 + h["n_vocab"] * 16) / (24 * 16 ** 2 + h["n_vocab"] * 16))
    c_subset = cost_model.default_costs(target, draft, draft_vocab=8000).draft
    assert c_subset == pytest.approx((12 * 16 ** 2 + 8000 * 16) / (24 * 16 ** 2 + h["n_vocab"] * 16))
    assert cost_model.default_costs(target, None).draft == 0.0
    sizes = [{"n_layer": L, "n_embd": E, "n_vocab": 50257} for L, E in ((12, 768), (24, 1024), (48, 1600))]
    assert cost_model.step_parameters(sizes[0]) / cost_model.step_parameters(sizes[1]) == pytest.approx(0.35, abs=0.01)
    assert cost_model.step_parameters(sizes[0]) / cost_model.step_parameters(sizes[2]) == pytest.approx(0.08, abs=0.01)


def test_adaptive_K_grows_for_a_perfect_draft_and_shrinks_for_a_useless_one(models, greedy_reference, monkeypatch):
    target, _ = models
    params, hparams = target
    cheap = cost_model.Costs(draft=0.1, verify=(1.0,) + (2.0,) * 8)  # drafts that cost little, flat verification
    trace = drafts_per_step(monkeypatch)
    out, stats = spec(PROMPTS[:1], target, target, 30, K=2, adaptive=True, K_max=6, costs=cheap)
    assert out[0] == greedy_reference[0] and trace[-2] == 6  # the last step drafts only what is left
    contrary = (dict(params, ln_f=dict(params["ln_f"], g=-params["ln_f"]["g"])), hparams)  # drafts the argmin
    trace = drafts_per_step(monkeypatch)
    out, stats = spec(PROMPTS, target, contrary, 30, K=4, adaptive=True)
    assert out == greedy_reference and stats.acceptance_rate < 0.1
    assert trace[0] == 4 and set(trace[3:-1]) == {1}  # the last step has 1 token left


def test_adaptive_K_never_reads_the_clock(models, monkeypatch):
    """Same seed, same text with adaptive K, however long the draft and verify steps
    take: K comes from each row's acceptance and fixed costs only."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.0, top_k=20)
    runs, traces = [], []
    for tick in (1e-6, 5.0):  # a fast machine, then one where drafting looks ruinous
        clock = itertools.count(0.0, tick)
        monkeypatch.setattr(speculative.time, "perf_counter", lambda: next(clock))
        traces.append(drafts_per_step(monkeypatch))
        runs.append(spec(PROMPTS, target, draft, 40, K=3, settings=s, seed=11, adaptive=True))
    (a, _), (b, _) = runs
    assert a == b and traces[0] == traces[1] and len(set(traces[0])) > 1


def test_adaptive_K_is_exact_with_a_real_draft(models, greedy_reference):
    target, draft = models
    assert spec(PROMPTS, target, draft, 30, K=6, adaptive=True)[0] == greedy_reference


def test_prompt_lookup_draft_copies_what_followed_the_last_ngram():
    assert speculative.prompt_lookup_draft([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert speculative.prompt_lookup_draft([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9, 2, 3]
    assert speculative.prompt_lookup_draft([7, 1, 8, 1, 9, 1], 2) == [9, 1]  # latest match wins
    assert speculative.prompt_lookup_draft([7, 1, 8, 1, 9, 1], 3) == [8, 1, 9]  # ... that K tokens follow
    assert speculative.prompt_lookup_draft([7] * 20, 4) == [7] * 4  # repeating text: not the match at its end
    assert speculative.prompt_lookup_draft([5, 6, 5], 4) == [6, 5]  # none with K after: the longest continuation
    assert speculative.prompt_lookup_draft([1, 9, 1, 8, 1], 10) == [9, 1, 8, 1]  # ... after the earliest match
    assert speculative.prompt_lookup_draft([1, 2, 3, 9, 3, 7, 1, 2, 3], 2) == [9, 3]  # the longest n-gram first
    assert speculative.prompt_lookup_draft([1, 2, 3], 4) == []


def chi_square_ok(observed, p, n):
    """Goodness of fit over the categories with expected count >= 5 (the rest pooled):
    fail only above mean + 6 standard deviations of the chi-square statistic."""
    expected = n * p
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = keep.sum() - 1
    return chi2 < dof + 6 * np.sqrt(2 * dof), chi2, dof


PQ_PAIRS = {
    "q close to p": ([0.3, 0.25, 0.2, 0.15, 0.1], [0.25, 0.25, 0.25, 0.15, 0.1]),
    "q puts mass where p has none": ([0.5, 0.5, 0.0, 0.0, 0.0], [0.1, 0.1, 0.4, 0.4, 0.0]),
    "p has mass where q has none": ([0.2, 0.2, 0.2, 0.2, 0.2], [0.5, 0.5, 0.0, 0.0, 0.0]),
    "q one-hot (a deterministic drafter)": ([0.1, 0.6, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("name", PQ_PAIRS)
def test_verify_emits_tokens_distributed_as_p(name):
    """Many independent trials at once (one per batch row): draft d ~ q, verify, and
    record the first emitted token (d if accepted, else the residual sample)."""
    p1, q1 = (np.array(x, np.float32) for x in PQ_PAIRS[name])
    N, V = 200_000, p1.size
    rng = np.random.default_rng(42)
    q = np.tile(q1, (N, 1))[:, None]  # [N, 1, V]
    d = sampling.sample(q[:, 0], 1.0 - rng.random(N))[:, None]  # [N, 1]
    p = np.tile(p1, (N, 2, 1))  # [N, 2, V]
    n, token = speculative.verify(p, q, d, np.ones(N, np.int64), 1.0 - rng.random((N, 1)), 1.0 - rng.random(N))
    first = np.where(n == 1, d[:, 0], token)
    ok, chi2, dof = chi_square_ok(np.bincount(first, minlength=V), p1.astype(np.float64), N)
    assert ok, (chi2, dof)
    assert np.bincount(first, minlength=V)[p1 == 0].sum() == 0  # never a token p rules out
    acceptance = (n == 1).mean()
    want = np.minimum(p1, q1).sum()  # the papers' expected acceptance rate, 1 - TV(p, q)
    assert abs(acceptance - want) < 6 * np.sqrt(want * (1 - want) / N) + 1e-9


def test_verify_emits_every_position_distributed_as_its_p():
    """K = 3 drafts with their own p_i and q_i at each position (p not depending on the
    prefix, a case the theorem covers), rows drafting k = 1, 2 or 3: the token a row emits at
    position j, wherever it has one (n >= j), is distributed as p_j: an accepted draft, the
    residual of the first rejection (its own position's q), or the bonus from p_k after all
    k; a row never accepts more than its k; P(n >= j) is the product of the papers' rates."""
    P = np.array([[0.3, 0.25, 0.2, 0.15, 0.1], [0.5, 0.5, 0.0, 0.0, 0.0],
                  [0.1, 0.6, 0.1, 0.1, 0.1], [0.0, 0.1, 0.2, 0.3, 0.4]], np.float32)  # p_0..p_3 [K+1, V]
    Q = np.array([[0.25, 0.25, 0.25, 0.15, 0.1], [0.1, 0.1, 0.4, 0.4, 0.0],
                  [0.0, 0.0, 1.0, 0.0, 0.0]], np.float32)  # q_0..q_2 [K, V]
    (K, V), N = Q.shape, 300_000
    rng = np.random.default_rng(7)
    k = rng.integers(1, K + 1, N)  # [N]
    q, p = np.tile(Q, (N, 1, 1)), np.tile(P, (N, 1, 1))  # [N, K, V], [N, K+1, V]
    d = np.stack([sampling.sample(q[:, i], 1.0 - rng.random(N)) for i in range(K)], axis=1)  # [N, K]
    n, token = speculative.verify(p, q, d, k, 1.0 - rng.random((N, K)), 1.0 - rng.random(N))
    assert (n <= k).all()
    emitted = np.where(np.arange(K + 1) < n[:, None], np.pad(d, ((0, 0), (0, 1))), token[:, None])  # [N, K+1]
    for j in range(K + 1):
        at = n >= j  # the rows that emit a token at position j
        counts = np.bincount(emitted[at, j], minlength=V)
        ok, chi2, dof = chi_square_ok(counts, P[j].astype(np.float64), int(at.sum()))
        assert ok and counts[P[j] == 0].sum() == 0, (j, chi2, dof)
    rate = np.minimum(P[:K], Q).sum(axis=1)  # [K]: 1 - TV(p_i, q_i)
    rows = k == K  # the rows that drafted all K
    for j in range(1, K + 1):
        want = np.prod(rate[:j])
        assert abs((n[rows] >= j).mean() - want) < 6 * np.sqrt(want * (1 - want) / rows.sum()), j


def test_verify_catches_a_wrong_residual():
    """The statistical test has teeth: drawing the replacement from p instead of the
    residual norm(max(0, p - q)) skews the output, and the test sees it."""
    p1, q1 = (np.array(x, np.float32) for x in PQ_PAIRS["q close to p"])
    N = 200_000
    rng = np.random.default_rng(3)
    d = sampling.sample(np.tile(q1, (N, 1)), 1.0 - rng.random(N))
    accept = rng.random(N) * q1[d] < p1[d]
    wrong = np.where(accept, d, sampling.sample(np.tile(p1, (N, 1)), 1.0 - rng.random(N)))
    assert not chi_square_ok(np.bincount(wrong, minlength=5), p1.astype(np.float64), N)[0]


def test_first_token_of_a_real_model_is_distributed_as_target_sampling(models):
    """End to end: the tiny GPT-2 as target, its one-layer self as draft, K=2, top-k 8
    at temperature 1.3. Over many requests of one prompt, each with its own seed, the
    first generated token must follow the target's own processed distribution p."""
    target, draft = models
    (params, hparams) = target
    s = sampling.SamplingSettings(temperature=1.3, top_k=8)
    prompt = PROMPTS[1]
    p = sampling.probabilities(gpt2.gpt2(np.array([prompt]), **params, n_head=2)[:, -1], None, s)[0]
    out, accepted = first_tokens(prompt, target, draft, 3, 2, s)
    assert 0 < accepted
    ok, chi2, dof = chi_square_ok(np.bincount([o[0] for o in out], minlength=p.size), p.astype(np.float64), len(out))
    assert ok, (chi2, dof)


@pytest.mark.parametrize("N", [1000, 20000])
def test_vocabulary_subset_draft_is_exact_greedy(models, greedy_reference, edge_prompts, edge_reference, N):
    target, draft = models
    out, stats = spec(PROMPTS, target, draft, 30, K=4, draft_vocab=N)
    assert out == greedy_reference and stats.accepted > 0
    outside = [t for o, p in zip(out, PROMPTS) for t in o if t >= N and t not in p]
    assert N > 20000 or outside  # target tokens the draft could never propose still come out
    assert spec(edge_prompts, target, target, 45, K=3, draft_vocab=N)[0] == edge_reference


def test_vocabulary_subset_head_covers_the_subset_and_the_text(models):
    target, _ = models
    params, hparams = target
    x = np.random.default_rng(0).standard_normal((2, 1, 16)).astype(np.float32)
    texts = [[5, 40000, 40000, 123, 100], [7]]  # (100: the first token past the subset's 100)
    logits = x @ speculative.VocabSubset(params["wte"], 100, texts).T  # [2, 1, n_vocab]
    full = x @ params["wte"].T
    finite = np.isfinite(logits[:, 0])
    assert finite[0].sum() == 103 and finite[0, [40000, 123, 100]].all() and finite[1].sum() == 100
    np.testing.assert_allclose(logits[finite[:, None]], full[finite[:, None]], rtol=1e-5, atol=1e-5)


def test_vocabulary_subset_draft_samples_as_the_target(models):
    """Chi-square of the first token with a draft whose subset holds half of the tokens
    p allows: the rest of p's mass lies outside it, and the residual must supply it."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.3, top_k=8)
    prompt = PROMPTS[1]
    p = sampling.probabilities(gpt2.gpt2(np.array([prompt]), **target[0], n_head=2)[:, -1], None, s)[0]
    N = int(np.median(np.nonzero(p)[0])) + 1
    assert 0.1 < p[N:].sum() < 0.9 and not set(np.nonzero(p)[0][4:]) & set(prompt)
    out = []
    for seed in range(0, 2000, 250):
        out += spec([prompt] * 250, target, draft, 2, K=1, settings=s, seed=seed, draft_vocab=N)[0]
    ok, chi2, dof = chi_square_ok(np.bincount([o[0] for o in out], minlength=p.size), p.astype(np.float64), len(out))
    assert ok, (chi2, dof)


def two_token_distribution(model, prompt, s):
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt x1) [n_vocab, n_vocab] (sparse: top-k), each
    p computed by a plain pass over the window that plain decoding sees at that length."""
    params, hparams = model

    def p_next(text):
        window = text[kv_cache.window_start(len(text), hparams["n_ctx"]):]
        logits = gpt2.gpt2(np.array([window]), **params, n_head=hparams["n_head"])[:, -1]
        return sampling.probabilities(logits, None, s)[0].astype(np.float64)
    p1 = p_next(prompt)
    return {x1: p1[x1] * p_next(prompt + [x1]) for x1 in np.nonzero(p1)[0]}


@pytest.mark.parametrize("length, n_tokens", [(N_CTX - 2, 5), (N_CTX, 3)])
def test_two_tokens_near_the_window_edge_follow_the_target(models, length, n_tokens):
    """Chi-square over the joint distribution of the first two generated tokens, for a
    prompt that ends 2 tokens before the edge (both tokens come from one verification
    pass, which may verify only 2 of the K=4 drafts) and one that ends on it (the second
    token is drafted in the restarted window). One-layer draft, top-k 6, temperature 1.5.
    Before drafts were capped at the restart, every sample fell outside the support."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.5, top_k=6)
    prompt = np.random.default_rng(length).integers(0, 50000, length).tolist()
    joint = two_token_distribution(target, prompt, s)
    out, accepted = first_tokens(prompt, target, draft, n_tokens, 4, s)
    assert accepted > 0
    cells = [(x1, x2) for x1, p2 in joint.items() for x2 in np.nonzero(p2)[0]]
    index = {c: i for i, c in enumerate(cells)}
    observed = np.bincount([index[tuple(o[:2])] for o in out], minlength=len(cells))
    ok, chi2, dof = chi_square_ok(observed, np.array([joint[x1][x2] for x1, x2 in cells]), len(out))
    assert ok, (chi2, dof)


def test_sampled_text_is_the_same_alone_or_in_any_batch(models):
    """Each request draws from its own generator: its text depends on its prompt,
    settings and seed only, not on its neighbours (both decoders)."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.0, top_p=0.9)
    prompts = PROMPTS + [PROMPTS[0]]  # the same prompt twice: seeds differ (seed + i)
    together = spec(prompts, target, draft, 25, K=3, settings=s, seed=5)[0]
    for i, p in enumerate(prompts):
        assert spec([p], target, draft, 25, K=3, settings=s, seed=5 + i)[0][0] == together[i]
    assert together[0] != together[3]
    plain_together = plain(prompts, target, 25, s, seed=5)
    assert [plain([p], target, 25, s, seed=5 + i)[0] for i, p in enumerate(prompts)] == plain_together


def test_each_row_keeps_every_token_it_accepted(models, monkeypatch):
    """After a step each row's target cache holds its whole text but the last token (the next
    pass's input): a row is not rolled back to the shortest (which would recompute tokens)."""
    target, draft = models
    step, held = speculative.speculative_step, []

    def checked(batch, *args):
        step(batch, *args)
        kv = batching.cache(batch, "target")
        held.append([(int(kv["starts"][b] + kv["lengths"][b]), len(seq.tokens) - 1)
                     for b, seq in enumerate(batch.seqs)])
    monkeypatch.setattr(speculative, "speculative_step", checked)
    out, _ = spec(PROMPTS, target, draft, 20, K=4)
    assert out == plain(PROMPTS, target, 20) and all(have == want for rows in held for have, want in rows)
    assert any(len({want for _, want in rows}) == len(rows) for rows in held)  # rows of unequal texts among them


def test_penalties_see_the_drafted_text(models):
    """With a frequency penalty the target's p at draft position i must count d_1..d_i:
    greedy speculative then still equals greedy plain decoding under the same penalty."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5,
                                  repetition_penalty=1.5)
    want = plain(PROMPTS, target, 25, s)
    assert spec(PROMPTS, target, draft, 25, K=4, settings=s)[0] == want
    assert spec(PROMPTS, target, speculative.PROMPT_LOOKUP, 25, K=4, settings=s)[0] == want
    out, stats = spec(PROMPTS, target, target, 25, K=4, settings=s)  # q counts its own drafts as p does: all taken
    assert out == want and stats.acceptance_rate == 1.0 and stats.rejected == 0


def test_requests_with_different_settings_share_a_batch(models):
    target, draft = models
    hot = sampling.SamplingSettings(temperature=1.2, top_k=30, frequency_penalty=1.0)
    reqs = [batching.Request(tuple(PROMPTS[0]), 20, GREEDY), batching.Request(tuple(PROMPTS[1]), 20, hot, seed=3),
            batching.Request(tuple(PROMPTS[2]), 20, GREEDY)]
    config = speculative.SpeculativeConfig(K=3)
    drafter = speculative.model_drafter(draft)
    together = speculative.speculative_generate(reqs, target, drafter, config)[0]
    assert together == [speculative.speculative_generate([r], target, drafter, config)[0][0] for r in reqs]
    assert together[0] == plain([PROMPTS[0]], target, 20)[0]


def test_counts_along_drafts():
    counts = np.zeros((1, 6), np.int32)
    c = speculative.counts_along_drafts(counts, [[2, 2, 5]], 4)
    assert c[0].tolist() == [[0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 2, 0, 0, 1]]


def test_eos_inside_an_accepted_run_stops_right_there(models, greedy_reference):
    target, _ = models
    want = greedy_reference[1]
    eos = want[5]  # pretend the 6th token is end-of-text: it arrives inside a run of accepted drafts
    cut = want[:want.index(eos) + 1]
    out, stats = spec([PROMPTS[1]], target, target, 30, K=8, eos_id=eos)
    assert out[0] == cut and stats.target_passes == 1


@pytest.mark.parametrize("n_tokens, K", [(7, 3), (10, 4), (3, 8), (1, 5), (13, 1)])
def test_max_new_tokens_is_exact_whatever_K(models, greedy_reference, n_tokens, K):
    target, draft = models
    for d in (target, draft):
        assert spec(PROMPTS, target, d, n_tokens, K)[0] == [g[:n_tokens] for g in greedy_reference]


def test_sampled_speculative_is_reproducible_by_seed(models):
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.0, top_p=0.9)
    a, b, c = (spec(PROMPTS, target, draft, 20, K=3, settings=s, seed=seed)[0] for seed in (5, 5, 6))
    assert a == b and a != c


@pytest.mark.parametrize("kw, name", [({"K": 0}, "K"), ({"K": 5, "adaptive": True, "K_max": 4}, "K_max"),
                                      ({"draft_vocab": -1}, "draft_vocab"), ({"draft_vocab": 10**6}, "draft_vocab")])
def test_bad_K_is_refused_by_name(models, kw, name):
    target, draft = models
    with pytest.raises(sampling.BadSetting, match=f"^{name} must") as e:
        spec(PROMPTS, target, draft, 5, **kw)
    assert e.value.name == name


def test_different_vocabularies_are_refused(models):
    target, (dp, dh) = models
    with pytest.raises(sampling.BadSetting, match="needs one tokenizer") as e:
        spec(PROMPTS, target, (dp, dict(dh, n_vocab=50000)), 5, K=2)
    assert e.value.name == "draft"


@pytest.mark.parametrize("n", [0, -1])
def test_no_or_negative_new_tokens_is_an_error_not_a_hang(models, n):
    target, draft = models
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        spec(PROMPTS, target, draft, n, K=2)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        plain(PROMPTS, target, n)


def test_an_empty_prompt_is_an_error_that_says_how_to_start_one(models):
    target, draft = models
    with pytest.raises(ValueError, match="empty: start it with <|endoftext|>"):
        spec([[]], target, draft, 5, K=2)


def test_stats_add_up(models, monkeypatch):
    target, draft = models
    out, s = spec(PROMPTS[:1], target, draft, 30, K=4)
    assert s.n_tokens == 30 == s.accepted + s.target_passes  # each pass adds 1 target token
    assert s.n_steps == s.target_passes == len(s.step_gaps_s) + 1
    trace = drafts_per_step(monkeypatch)
    _, s = spec(PROMPTS[:1], target, target, 30, K=4)  # every draft accepted: 5 tokens a step
    assert s.n_steps == 6 and s.first_step_tokens == 5
    assert s.decode_tokens_per_s == pytest.approx((30 - 5) / (s.last_step_at - s.first_step_at))
    assert s.first_draft_s < s.draft_s and s.first_verify_s < s.verify_s
    assert s.draft_passes == sum(trace) and s.drafted == sum(trace)
    assert len(s.acceptance_by_position) == 4 and s.draft_s > 0 and s.verify_s > 0
    assert s.acceptance_by_position[0] >= s.acceptance_by_position[-1]


def test_a_drafter_that_is_not_one_is_refused_by_what_a_drafter_is(models):
    target, draft = models
    for wrong in (draft, "prompt_lookup"):
        with pytest.raises(TypeError, match="^drafter must be a speculative.Drafter"):
            speculative.speculative_generate(batching.requests(PROMPTS, 3), target, wrong)
