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


def test_greedy_is_argmax_of_penalized_logits():
    s = sampling.SamplingSettings(temperature=0.0, repetition_penalty=1.3)
    p = sampling.probabilities(REF["logits"], COUNTS, s)
    want = sampling.apply_repetition_penalty(REF["logits"], COUNTS, 1.3).argmax(-1)
    assert (p.argmax(-1) == want).all() and (p.sum(-1) == 1).all() and (p.max(-1) == 1).all()
    assert (sampling.sample(p, np.random.default_rng(0)) == want).all()


def test_sampling_frequencies_match_probabilities():
    """Chi-square goodness of fit: with N draws over k categories, the statistic has mean
    k-1 and variance 2(k-1); 6 standard deviations above the mean fails with
    probability far below 1e-6 when the sampler is right, and a sampler that is wrong
    by a few percent in any category pushes it far past."""
    rng = np.random.default_rng(1234)
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01, 0.0], np.float32)
    N, B = 200_000, 8
    draws = np.concatenate([sampling.sample(np.tile(probs, (B, 1)), rng) for _ in range(N // B)])
    observed = np.bincount(draws, minlength=probs.size)
    assert observed[-1] == 0  # zero-probability token never drawn
    k = 7
    expected = N * probs[:k]
    chi2 = ((observed[:k] - expected) ** 2 / expected).sum()
    assert chi2 < (k - 1) + 6 * np.sqrt(2 * (k - 1)), chi2
    biased = expected * np.array([1.02, 0.98, 1, 1, 1, 1, 1])  # a 2% error must be caught
    assert ((biased - expected) ** 2 / expected).sum() > (k - 1) + 6 * np.sqrt(2 * (k - 1))


def test_same_seed_same_tokens_different_seed_different_tokens():
    p = sampling.softmax(REF["logits"])
    a = [sampling.sample(p, np.random.default_rng(7)) for _ in range(2)]
    b = sampling.sample(np.repeat(p, 8, axis=0), np.random.default_rng(8))
    c = sampling.sample(np.repeat(p, 8, axis=0), np.random.default_rng(7))
    assert (a[0] == a[1]).all() and (b != c).any()


@pytest.mark.parametrize("kw, flag", [
    ({"temperature": -1}, "--temperature"), ({"top_k": -1}, "--top_k"), ({"top_k": 2.5}, "--top_k"),
    ({"top_p": 0}, "--top_p"), ({"top_p": 1.5}, "--top_p"), ({"min_p": 1}, "--min_p"),
    ({"repetition_penalty": 0}, "--repetition_penalty"), ({"presence_penalty": float("nan")}, "--presence_penalty"),
    ({"frequency_penalty": float("inf")}, "--frequency_penalty"),
])
def test_validation_names_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        sampling.validate(sampling.SamplingSettings(**kw))
