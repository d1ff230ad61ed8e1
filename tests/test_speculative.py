"""Speculative decoding: exact greedy text, exact distributions, stopping rules."""
import numpy as np
import pytest

import gpt2
import sampling
import speculative

GREEDY = sampling.SamplingSettings(temperature=0.0)
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262], [36235]]


@pytest.fixture(scope="module")
def models(tiny):
    """target: the tiny GPT-2; draft: its first layer alone (a layer-skip draft that
    agrees with the target often but not always, so both branches get exercised)."""
    _, hparams, params = tiny
    draft = (dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1))
    return (params, hparams), draft


@pytest.fixture(scope="module")
def greedy_reference(models):
    (params, hparams), _ = models
    return [gpt2.generate([p], params, hparams, 30, GREEDY, np.random.default_rng(0))[0][0] for p in PROMPTS]


@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_speculative_equals_greedy_batched_and_solo(models, greedy_reference, K, use_cache):
    target, draft = models
    batched, stats = speculative.speculative_generate(PROMPTS, target, draft, 30, K, GREEDY,
                                                      np.random.default_rng(0), use_cache=use_cache)
    assert batched == greedy_reference
    assert 0 < stats["acceptance_rate"] < 1  # the draft really was rejected sometimes
    for p, want in zip(PROMPTS, greedy_reference):
        solo, _ = speculative.speculative_generate([p], target, draft, 30, K, GREEDY, np.random.default_rng(0),
                                                   use_cache=use_cache)
        assert solo[0] == want


@pytest.mark.parametrize("K", [1, 3, 8])
def test_draft_equal_to_target_accepts_everything(models, greedy_reference, K):
    target, _ = models
    out, stats = speculative.speculative_generate(PROMPTS, target, target, 30, K, GREEDY, np.random.default_rng(0))
    assert out == greedy_reference and stats["acceptance_rate"] == 1.0
    passes = -(-30 // (K + 1))  # every pass emits K accepted + 1 bonus, the last one what is left
    assert stats["tokens_per_target_pass"] == 30 / passes and stats["target_passes"] == passes


@pytest.mark.parametrize("use_cache", [True, False])
def test_prompt_lookup_greedy_equals_greedy(models, greedy_reference, use_cache):
    target, _ = models
    out, stats = speculative.speculative_generate(PROMPTS, target, None, 30, 4, GREEDY, np.random.default_rng(0),
                                                  use_cache=use_cache, drafter="prompt_lookup")
    assert out == greedy_reference and stats["draft_passes"] == 0 and stats["drafted"] > 0


def test_expected_tokens_and_best_K_follow_the_paper():
    assert speculative.expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert speculative.expected_tokens(1.0, 4) == 5
    # c = 0.36 and a verification pass of 2 steps (this CPU, 124M -> 355M): K=4 is best at alpha 0.8
    assert speculative.best_K(0.8, 0.36, 2.0, 7) == 4
    assert speculative.best_K(0.95, 0.36, 2.0, 7) == 7
    assert speculative.best_K(0.1, 0.36, 2.0, 7) == 1
    assert speculative.best_K(0.3, 0.0, 2.0, 7) == 7  # free drafts never hurt when verification is flat


def test_adaptive_K_grows_for_a_perfect_draft_and_shrinks_for_a_useless_one(models, greedy_reference):
    target, _ = models
    params, hparams = target
    out, stats = speculative.speculative_generate(PROMPTS[:1], target, target, 30, 2, GREEDY,
                                                  np.random.default_rng(0), adaptive_K=True, K_max=6)
    assert out[0] == greedy_reference[0] and stats["K_trace"][-2] == 6  # the last step drafts only what is left
    contrary = (dict(params, ln_f=dict(params["ln_f"], g=-params["ln_f"]["g"])), hparams)  # drafts the argmin
    out, stats = speculative.speculative_generate(PROMPTS, target, contrary, 30, 4, GREEDY,
                                                  np.random.default_rng(0), adaptive_K=True)
    assert out == greedy_reference and stats["acceptance_rate"] < 0.1
    assert stats["K_trace"][0] == 4 and set(stats["K_trace"][3:-1]) == {1}  # the last step has 1 token left


def test_adaptive_K_is_exact_with_a_real_draft(models, greedy_reference):
    target, draft = models
    out, stats = speculative.speculative_generate(PROMPTS, target, draft, 30, 6, GREEDY, np.random.default_rng(0),
                                                  adaptive_K=True)
    assert out == greedy_reference


def test_prompt_lookup_draft_copies_what_followed_the_last_ngram():
    assert speculative.prompt_lookup_draft([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert speculative.prompt_lookup_draft([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9, 2, 3]
    assert speculative.prompt_lookup_draft([7, 1, 8, 1, 9, 1], 2) == [9, 1]  # latest match wins
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
    d = sampling.sample(q[:, 0], rng)[:, None]  # [N, 1]
    p = np.tile(p1, (N, 2, 1))  # [N, 2, V]
    n, token = speculative.verify(p, q, d, np.ones(N, np.int64), rng)
    first = np.where(n == 1, d[:, 0], token)
    ok, chi2, dof = chi_square_ok(np.bincount(first, minlength=V), p1.astype(np.float64), N)
    assert ok, (chi2, dof)
    assert np.bincount(first, minlength=V)[p1 == 0].sum() == 0  # never a token p rules out
    acceptance = (n == 1).mean()
    want = np.minimum(p1, q1).sum()  # the papers' expected acceptance rate, 1 - TV(p, q)
    assert abs(acceptance - want) < 6 * np.sqrt(want * (1 - want) / N) + 1e-9


def test_verify_catches_a_wrong_residual():
    """The statistical test has teeth: drawing the replacement from p instead of the
    residual norm(max(0, p - q)) skews the output, and the test sees it."""
    p1, q1 = (np.array(x, np.float32) for x in PQ_PAIRS["q close to p"])
    N = 200_000
    rng = np.random.default_rng(3)
    d = sampling.sample(np.tile(q1, (N, 1)), rng)
    accept = rng.random(N) * q1[d] < p1[d]
    wrong = np.where(accept, d, sampling.sample(np.tile(p1, (N, 1)), rng))
    assert not chi_square_ok(np.bincount(wrong, minlength=5), p1.astype(np.float64), N)[0]


def test_first_token_of_a_real_model_is_distributed_as_target_sampling(models):
    """End to end: the tiny GPT-2 as target, its one-layer self as draft, K=2, top-k 8
    at temperature 1.3. Over many rows of one prompt, the first generated token must
    follow the target's own processed distribution p."""
    target, draft = models
    (params, hparams) = target
    s = sampling.SamplingSettings(temperature=1.3, top_k=8)
    prompt = PROMPTS[1]
    p = sampling.probabilities(gpt2.gpt2(np.array([prompt]), **params, n_head=2), None, s)[0].astype(np.float64)
    firsts, accepted = [], 0
    for seed in range(8):
        out, stats = speculative.speculative_generate([prompt] * 500, target, draft, 3, 2, s,
                                                      np.random.default_rng(seed))
        firsts += [o[0] for o in out]
        accepted += stats["accepted"]
    assert 0 < accepted
    ok, chi2, dof = chi_square_ok(np.bincount(firsts, minlength=p.size), p, len(firsts))
    assert ok, (chi2, dof)


def test_penalties_see_the_drafted_text(models):
    """With a frequency penalty the target's p at draft position i must count d_1..d_i:
    greedy speculative then still equals greedy plain decoding under the same penalty."""
    target, draft = models
    s = sampling.SamplingSettings(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5)
    want = [gpt2.generate([p], target[0], target[1], 25, s, np.random.default_rng(0))[0][0] for p in PROMPTS]
    out, _ = speculative.speculative_generate(PROMPTS, target, draft, 25, 4, s, np.random.default_rng(0))
    assert out == want
    out, _ = speculative.speculative_generate(PROMPTS, target, None, 25, 4, s, np.random.default_rng(0),
                                              drafter="prompt_lookup")
    assert out == want


def test_counts_along_drafts():
    counts = np.zeros((1, 6), np.int32)
    c = speculative.counts_along_drafts(counts, np.array([[2, 2, 5]]), 4)
    assert c[0].tolist() == [[0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 2, 0, 0, 1]]


def test_eos_inside_an_accepted_run_stops_right_there(models, greedy_reference):
    target, _ = models
    want = greedy_reference[1]
    eos = want[5]  # pretend the 6th token is end-of-text: it arrives inside a run of accepted drafts
    cut = want[:want.index(eos) + 1]
    out, stats = speculative.speculative_generate([PROMPTS[1]], target, target, 30, 8, GREEDY,
                                                  np.random.default_rng(0), eos_id=eos)
    assert out[0] == cut and stats["target_passes"] == 1


@pytest.mark.parametrize("n_tokens, K", [(7, 3), (10, 4), (3, 8), (1, 5), (13, 1)])
def test_max_new_tokens_is_exact_whatever_K(models, greedy_reference, n_tokens, K):
    target, draft = models
    for d in (target, draft):
        out, _ = speculative.speculative_generate(PROMPTS, target, d, n_tokens, K, GREEDY, np.random.default_rng(0))
        assert out == [g[:n_tokens] for g in greedy_reference]


def test_sampled_speculative_is_reproducible_by_seed(models):
    target, draft = models
    s = sampling.SamplingSettings(temperature=1.0, top_p=0.9)
    a = speculative.speculative_generate(PROMPTS, target, draft, 20, 3, s, np.random.default_rng(5))[0]
    b = speculative.speculative_generate(PROMPTS, target, draft, 20, 3, s, np.random.default_rng(5))[0]
    c = speculative.speculative_generate(PROMPTS, target, draft, 20, 3, s, np.random.default_rng(6))[0]
    assert a == b and a != c


def test_context_overflow_keeps_going(models):
    target, draft = models
    out, _ = speculative.speculative_generate(PROMPTS, target, draft, 120, 4, GREEDY, np.random.default_rng(0))
    assert [len(o) for o in out] == [120] * 3
    plain, _ = gpt2.generate(PROMPTS, target[0], target[1], 120, GREEDY, np.random.default_rng(0))
    edge = target[1]["n_ctx"] - len(PROMPTS[1]) - 4  # exact until the first window restart
    assert [o[:edge] for o in out] == [o[:edge] for o in plain]


def test_different_vocabularies_are_refused(models):
    target, (dp, dh) = models
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative.speculative_generate(PROMPTS, target, (dp, dict(dh, n_vocab=50000)), 5, 2, GREEDY,
                                         np.random.default_rng(0))


def test_stats_add_up(models):
    target, draft = models
    out, s = speculative.speculative_generate(PROMPTS[:1], target, draft, 30, 4, GREEDY, np.random.default_rng(0))
    assert s["n_tokens"] == 30 == s["accepted"] + s["target_passes"]  # each pass adds one target token
    assert s["draft_passes"] == sum(s["K_trace"]) and s["drafted"] == sum(s["K_trace"])
    assert len(s["acceptance_by_position"]) == 4 and s["draft_s"] > 0 and s["verify_s"] > 0
    assert s["acceptance_by_position"][0] >= s["acceptance_by_position"][-1]
