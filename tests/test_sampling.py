"""Logits processors against transformers, and sampling checked statistically."""
import numpy as np
import pytest

import sampling
from conftest import fixture_path

REF = dict(np.load(fixture_path("processors-reference.npz")))
COUNTS = sampling.token_counts(REF["history"], REF["logits"].shape[1])


def assert_same_processed(out, ref):
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))  # same tokens removed
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, settings", [
    ("repetition_1_3", sampling.SamplingSettings(repetition_penalty=1.3)),
    ("temperature_0_7", sampling.SamplingSettings(temperature=0.7)),
    ("top_k_20", sampling.SamplingSettings(top_k=20)),
    ("top_p_0_9", sampling.SamplingSettings(top_p=0.9)),
    ("combined_rep1_2_t0_8_k50_p0_95",
     sampling.SamplingSettings(repetition_penalty=1.2, temperature=0.8, top_k=50, top_p=0.95)),
    ("presence_0_5_frequency_0_3", sampling.SamplingSettings(presence_penalty=0.5, frequency_penalty=0.3)),
])
def test_processors_match_transformers(name, settings):
    assert_same_processed(sampling.process_logits(REF["logits"], COUNTS, settings), REF[name])


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04]], np.float32))
    out = sampling.apply_min_p(logits, 0.15)  # threshold 0.075
    assert np.isfinite(out).tolist() == [[True, True, True, False, False]]


def test_cutoffs_at_a_tie_keep_and_remove_what_transformers_does():
    """Exact boundaries, in probabilities a float holds exactly. Top-p removes a token whose
    ascending cumulative sum is <= 1 - top_p (transformers' TopPLogitsWarper): four equal
    logits (0.25 each) at 0.5 keep 2. Min-p removes only those below min_p times the top
    (MinPLogitsWarper): tokens of exactly half the top's probability stay at min_p 0.5."""
    assert np.isfinite(sampling.apply_top_p(np.zeros((1, 4), np.float32), 0.5)).sum() == 2
    halves = np.log(np.array([[1.0, 0.5, 0.5, 0.01]], np.float32))  # exp gives 1, 0.5, 0.5 exactly
    assert np.isfinite(sampling.apply_min_p(halves, 0.5)).tolist() == [[True, True, True, False]]


def test_banned_tokens_are_those_that_would_repeat_an_ngram():
    """transformers' no_repeat_ngram_size: the text's own n-grams, a text of exactly n tokens
    included (5, 5 bans a third 5 at n = 2)."""
    assert sampling.banned_tokens([5, 5], 2) == [5]
    assert sampling.banned_tokens([5], 2) == [] and sampling.banned_tokens([1, 2, 3, 1, 2], 3) == [3]
    assert sorted(sampling.banned_tokens([7, 1, 7, 2, 7], 2)) == [1, 2]


def test_greedy_is_argmax_of_penalized_logits():
    s = sampling.SamplingSettings(temperature=0.0, repetition_penalty=1.3)
    p = sampling.probabilities(REF["logits"], COUNTS, s)
    want = sampling.apply_repetition_penalty(REF["logits"], COUNTS, 1.3).argmax(-1)
    assert (p.argmax(-1) == want).all() and (p.sum(-1) == 1).all() and (p.max(-1) == 1).all()
    assert (sampling.sample(p, np.random.default_rng(0).random(len(p))) == want).all()


@pytest.mark.parametrize("kw, picks", [({}, True), ({"top_k": 5, "top_p": 0.5, "min_p": 0.2}, True),
                                         ({"repetition_penalty": 1.3}, False), ({"presence_penalty": 0.5}, False),
                                         ({"no_repeat_ngram_size": 2}, False)])
def test_greedy_without_penalties_is_the_plain_argmax(kw, picks):
    """Where settings.picks_argmax holds, decoding takes np.argmax(logits): the token the whole path
    (probabilities' one-hot, then sample) picks, ties (the first of equal maxima) and
    all -inf rows included."""
    s = sampling.SamplingSettings(temperature=0.0, **kw)
    assert s.picks_argmax == picks
    logits = np.concatenate([REF["logits"], np.full((2, REF["logits"].shape[1]), -np.inf, np.float32)])
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie
    p = sampling.probabilities(logits, np.zeros_like(logits, dtype=np.int64), s)
    picked = sampling.sample(p, 1.0 - np.random.default_rng(0).random(len(p)))
    assert (picked == np.argmax(logits, axis=-1)).all() and picked[0] == 7


def test_sampling_frequencies_match_probabilities():
    """Chi-square goodness of fit: with N draws over k categories, the statistic has mean
    k-1 and variance 2(k-1); 6 standard deviations above the mean fails with
    probability far below 1e-6 when the sampler is right, and a sampler that is wrong
    by a few percent in any category pushes it far past."""
    rng = np.random.default_rng(1234)
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01, 0.0], np.float32)
    N, B = 200_000, 8
    draws = np.concatenate([sampling.sample(np.tile(probs, (B, 1)), 1.0 - rng.random(B)) for _ in range(N // B)])
    observed = np.bincount(draws, minlength=probs.size)
    assert observed[-1] == 0  # zero-probability token never drawn
    k = 7
    expected = N * probs[:k]
    chi2 = ((observed[:k] - expected) ** 2 / expected).sum()
    assert chi2 < (k - 1) + 6 * np.sqrt(2 * (k - 1)), chi2
    biased = expected * np.array([1.02, 0.98, 1, 1, 1, 1, 1])  # a 2% error must be caught
    assert ((biased - expected) ** 2 / expected).sum() > (k - 1) + 6 * np.sqrt(2 * (k - 1))


def test_u_inverts_the_cdf():
    p = np.array([[0.5, 0.0, 0.25, 0.25]] * 5, np.float32)
    u = np.array([1e-9, 0.5, 0.50001, 0.75, 1.0])
    assert sampling.sample(p, u).tolist() == [0, 0, 2, 2, 3]  # a zero-probability token never wins


def test_summing_only_drawable_tokens_picks_the_whole_rows_token():
    """sample() runs its sums over the tokens some row can draw; a full-row inverse CDF
    (float64 running sums over every token) must pick the same token, for batches that
    mix greedy, top-k and full distributions, at u near each row's own boundaries too."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 3000)).astype(np.float32) * 3
    full = sampling.softmax(logits)
    greedy = sampling.probabilities(logits, None, sampling.SamplingSettings(temperature=0.0))
    top_k = sampling.probabilities(logits, None, sampling.SamplingSettings(top_k=40))
    for p in (greedy, top_k, full, np.concatenate([greedy[:2], top_k[2:4], full[4:]])):
        cdf = np.cumsum(p, axis=-1, dtype=np.float64)  # [B, n_vocab]: the whole rows
        boundaries = cdf[np.arange(len(p)), rng.integers(0, p.shape[1], len(p))] / cdf[:, -1]
        for u in [1.0 - rng.random(len(p)) for _ in range(50)] + [boundaries, np.nextafter(boundaries, 2)]:
            u = np.clip(u, np.nextafter(0.0, 1.0), 1.0)  # u in (0, 1], as sample() asks
            want = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=-1), p.shape[1] - 1)
            assert sampling.sample(p, u).tolist() == want.tolist()


def test_sampler_refuses_a_batch_without_mass():
    with pytest.raises(ValueError, match="cannot sample"):
        sampling.sample(np.zeros((2, 5), np.float32), np.array([0.5, 0.5]))


@pytest.mark.parametrize("bad", [[0.5, np.nan, 0.5], [0.5, np.inf, 0.5], [0.0, 0.0, 0.0], [1.5, -0.5, 0.0]])
def test_sampler_refuses_what_is_not_a_distribution(bad):
    p = np.array([[0.2, 0.3, 0.5], bad], np.float32)
    with pytest.raises(ValueError, match="cannot sample"):
        sampling.sample(p, np.array([0.5, 0.5]))


@pytest.mark.parametrize("kw, name", [
    ({"temperature": -1}, "temperature"), ({"temperature": 1e39}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": 1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"), ({"frequency_penalty": 1e39}, "frequency_penalty"),
    ({"presence_penalty": -1e39}, "presence_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"), ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": None}, "top_p"), ({"top_k": "40"}, "top_k"),
    ({"min_p": True}, "min_p"), ({"penalize_prompt": "yes"}, "penalize_prompt"),
])
def test_settings_out_of_range_are_refused_by_name(kw, name):
    with pytest.raises(sampling.BadSetting, match=f"^{name} must") as e:
        sampling.SamplingSettings(**kw)
    assert e.value.name == name


@pytest.mark.parametrize("kw", [
    {"temperature": 1e-45}, {"temperature": 1e-30}, {"temperature": 2e-5}, {"temperature": 1e30},
    {"temperature": float(np.finfo(np.float32).max)},
    {"frequency_penalty": 2.0, "presence_penalty": -2.0, "temperature": 2e-5},
    {"repetition_penalty": 0.01, "temperature": 2e-5}, {"repetition_penalty": 100, "top_p": 1e-30},
    {"min_p": 0.999999, "top_k": 1},
])
def test_extreme_settings_in_range_give_finite_distributions(kw):
    """Every setting at the edge of its range: probabilities stay finite, sum to one,
    and the sampler accepts them (the logits include values of +-1e4, and the counts 1e4)."""
    s = sampling.SamplingSettings(**kw)
    logits = np.concatenate([REF["logits"], np.full((1, 1000), -1e4, np.float32)])
    logits[-1, 7] = 1e4
    counts = np.concatenate([COUNTS, np.full((1, 1000), 10_000, np.int32)])
    p = sampling.probabilities(logits, counts, s)
    assert np.isfinite(p).all() and (p >= 0).all()
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-5)
    sampling.sample(p, np.full(len(p), 0.5))


def test_a_tiny_temperature_is_greedy():
    assert sampling.SamplingSettings(temperature=9e-6).greedy and not sampling.SamplingSettings(temperature=1e-5).greedy
    p = sampling.probabilities(REF["logits"], COUNTS, sampling.SamplingSettings(temperature=1e-45))
    assert (p.argmax(-1) == REF["logits"].argmax(-1)).all() and (p.max(-1) == 1).all()


def test_which_tokens_each_penalty_counts():
    """The repetition penalty sees the prompt (transformers); presence and frequency count
    generated tokens only (OpenAI API, vLLM) unless penalize_prompt."""
    logits = np.zeros((1, 4), np.float32) + np.array([2.0, 2.0, 2.0, -2.0], np.float32)
    prompt = sampling.token_counts([[0]], 4)  # token 0 is in the prompt
    counts = prompt + sampling.token_counts([[1, 1]], 4)  # token 1 was generated twice
    rep = sampling.process_logits(logits, counts, sampling.SamplingSettings(repetition_penalty=2.0), prompt)
    assert rep.tolist() == [[1.0, 1.0, 2.0, -2.0]]
    freq = sampling.SamplingSettings(frequency_penalty=0.5, presence_penalty=0.25)
    assert sampling.process_logits(logits, counts, freq, prompt).tolist() == [[2.0, 0.75, 2.0, -2.0]]
    both = sampling.SamplingSettings(frequency_penalty=0.5, presence_penalty=0.25, penalize_prompt=True)
    assert sampling.process_logits(logits, counts, both, prompt).tolist() == [[1.25, 0.75, 2.0, -2.0]]


def test_same_seed_same_tokens_different_seed_different_tokens():
    p = np.repeat(sampling.softmax(REF["logits"]), 8, axis=0)
    a, b, c = (sampling.sample(p, np.random.default_rng(seed).random(len(p))) for seed in (7, 7, 8))
    assert (a == b).all() and (b != c).any()
