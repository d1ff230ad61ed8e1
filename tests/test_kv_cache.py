"""The KV cache: cached == uncached, batched == solo, rollback, and the context window."""
import numpy as np
import pytest

import gpt2
import kv_cache
import sampling

GREEDY = sampling.SamplingSettings(temperature=0.0)
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262],
           [36235], [818, 257, 1402, 3420, 11, 612, 373]]


def new_cache(hparams, B, n_slots=None):
    return kv_cache.init_cache(hparams["n_layer"], hparams["n_head"], n_slots or hparams["n_ctx"],
                               hparams["n_embd"], B)


def test_cached_logits_equal_uncached_at_every_step_of_40_greedy_tokens(tiny):
    _, hparams, params = tiny
    seq = list(PROMPTS[1])
    cache = new_cache(hparams, 1)
    inputs, n_new = kv_cache.pending_inputs(cache, [seq], hparams["n_ctx"])
    for _ in range(40):
        cached = gpt2.gpt2(inputs, **params, n_head=2, cache=cache, n_new=n_new)[0]
        uncached = gpt2.gpt2(np.array([seq]), **params, n_head=2)[0]
        np.testing.assert_allclose(cached, uncached, atol=1e-4, rtol=0)
        seq.append(int(np.argmax(uncached)))
        inputs, n_new = kv_cache.pending_inputs(cache, [seq], hparams["n_ctx"])
        assert inputs.shape == (1, 1)  # only the new token goes through the model
    assert cache["lengths"][0] == len(seq) - 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_greedy_equals_solo_greedy_for_prompts_of_different_lengths(tiny, use_cache):
    _, hparams, params = tiny
    solo = [gpt2.generate([p], params, hparams, 25, GREEDY, np.random.default_rng(0), use_cache=use_cache)[0][0]
            for p in PROMPTS]
    batched, stats = gpt2.generate(PROMPTS, params, hparams, 25, GREEDY, np.random.default_rng(0),
                                   use_cache=use_cache)
    assert batched == solo
    assert stats["n_tokens"] == 25 * len(PROMPTS)


def test_batched_logits_equal_solo_logits(tiny):
    _, hparams, params = tiny
    inputs, n_new = kv_cache.pad_right(PROMPTS)
    cache = new_cache(hparams, len(PROMPTS))
    batched = gpt2.gpt2(inputs, **params, n_head=2, cache=cache, n_new=n_new)  # [B, n_vocab]
    for b, p in enumerate(PROMPTS):
        np.testing.assert_allclose(batched[b], gpt2.gpt2(np.array([p]), **params, n_head=2)[0], atol=1e-4)
    assert cache["lengths"].tolist() == [len(p) for p in PROMPTS]


def test_rows_that_finish_leave_the_batch_and_the_rest_are_unchanged(tiny):
    _, hparams, params = tiny
    solo = [gpt2.generate([p], params, hparams, 12, GREEDY, np.random.default_rng(0))[0][0] for p in PROMPTS]
    eos = solo[0][2]  # row 0 ends at its third token; others may meet it too
    want = [s[:s.index(eos) + 1] if eos in s else s for s in solo]
    out, _ = gpt2.generate(PROMPTS, params, hparams, 12, GREEDY, np.random.default_rng(0), eos_id=eos)
    assert out == want


def test_rollback_then_reextend_equals_never_extended(tiny):
    _, hparams, params = tiny
    prefix, junk, real = PROMPTS[1], [50, 60, 70], [383, 2068]
    cache = new_cache(hparams, 1)
    gpt2.gpt2(np.array([prefix]), **params, n_head=2, cache=cache)
    gpt2.gpt2(np.array([junk]), **params, n_head=2, cache=cache)
    kv_cache.rollback(cache, np.array([len(prefix)]))
    after = gpt2.gpt2(np.array([real]), **params, n_head=2, cache=cache, all_logits=True)
    fresh = new_cache(hparams, 1)
    gpt2.gpt2(np.array([prefix]), **params, n_head=2, cache=fresh)
    want = gpt2.gpt2(np.array([real]), **params, n_head=2, cache=fresh, all_logits=True)
    np.testing.assert_allclose(after, want, atol=1e-5)
    assert cache["lengths"][0] == fresh["lengths"][0] == len(prefix) + len(real)


def test_rows_roll_back_by_different_amounts(tiny):
    """Speculative decoding's batched case: each row keeps its own number of tokens."""
    _, hparams, params = tiny
    cache = new_cache(hparams, 2)
    gpt2.gpt2(np.array([PROMPTS[0], PROMPTS[3][:4]]), **params, n_head=2, cache=cache)
    gpt2.gpt2(np.array([[1, 2, 3], [4, 5, 6]]), **params, n_head=2, cache=cache)
    kv_cache.rollback(cache, np.array([5, 4]))  # row 0 keeps one extra token, row 1 none
    nxt = gpt2.gpt2(np.array([[7], [8]]), **params, n_head=2, cache=cache)
    np.testing.assert_allclose(nxt[0], gpt2.gpt2(np.array([PROMPTS[0] + [1, 7]]), **params, n_head=2)[0], atol=1e-4)
    np.testing.assert_allclose(nxt[1], gpt2.gpt2(np.array([PROMPTS[3][:4] + [8]]), **params, n_head=2)[0], atol=1e-4)


def test_cache_bytes_formula(tiny):
    _, h, _ = tiny
    cache = new_cache(h, 3)
    assert kv_cache.cache_nbytes(cache) == 2 * h["n_layer"] * 3 * h["n_ctx"] * h["n_embd"] * 4


def test_generation_past_the_context_window(tiny):
    """n_ctx is 64: 200 new tokens need the sliding window with and without the cache.
    Up to the window edge both are exact and agree; after it they may differ."""
    _, hparams, params = tiny
    prompt = PROMPTS[1]
    n_ctx = hparams["n_ctx"]
    with_cache, _ = gpt2.generate([prompt], params, hparams, 200, GREEDY, np.random.default_rng(0))
    no_cache, _ = gpt2.generate([prompt], params, hparams, 200, GREEDY, np.random.default_rng(0), use_cache=False)
    assert len(with_cache[0]) == len(no_cache[0]) == 200
    edge = n_ctx - len(prompt) + 1  # tokens generated while the whole text still fits
    assert with_cache[0][:edge] == no_cache[0][:edge]


def test_window_restart_keeps_the_last_half(tiny):
    _, hparams, _ = tiny
    cache = new_cache(hparams, 1)
    seq = list(range(100, 164))  # 64 tokens: a full window
    cache["lengths"][0] = 63  # all but the last are cached
    inputs, n_new = kv_cache.pending_inputs(cache, [seq], 64)
    assert n_new.tolist() == [1]
    seq.append(999)
    inputs, n_new = kv_cache.pending_inputs(cache, [seq], 64)
    assert inputs[0].tolist() == seq[-32:] and cache["lengths"][0] == 0 and cache["starts"][0] == 65 - 32


def test_generate_reports_the_cache_it_allocated(tiny):
    _, h, params = tiny
    _, stats = gpt2.generate(PROMPTS, params, h, 5, GREEDY, np.random.default_rng(0))
    slots = max(map(len, PROMPTS)) + 5  # sized to the longest row, not to n_ctx
    assert stats["kv_cache_bytes"] == 2 * h["n_layer"] * len(PROMPTS) * slots * h["n_embd"] * 4
    assert gpt2.generate(PROMPTS, params, h, 5, GREEDY, np.random.default_rng(0),
                         use_cache=False)[1]["kv_cache_bytes"] == 0
