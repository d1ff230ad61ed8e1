"""The KV cache: cached == uncached, batched == solo, rollback, and the window that restarts."""
import numpy as np
import pytest

import batching
import gpt2
import kv_cache
import sampling
from kernels import layout

GREEDY = sampling.SamplingSettings(temperature=0.0)
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262],
           [36235], [818, 257, 1402, 3420, 11, 612, 373]]


def new_cache(hparams, B, n_slots=None):
    return kv_cache.init_cache(hparams, B, n_slots or hparams["n_ctx"], like=np.zeros(1, np.float32))


def last_logits(model, cache, texts):
    return kv_cache.next_logits(model, cache, texts)[:, 0]  # [B, n_vocab]


def test_cached_logits_equal_uncached_at_every_step_of_40_greedy_tokens(tiny):
    _, hparams, params = tiny
    model = (params, hparams)
    seq = list(PROMPTS[1])
    cache = new_cache(hparams, 1)
    for _ in range(40):
        assert kv_cache.pending_inputs(cache, [seq], hparams["n_ctx"])[0].shape[1] == (1 if len(seq) > 11 else 11)
        cached = last_logits(model, cache, [seq])[0]  # only the tokens the cache has not seen run
        uncached = gpt2.gpt2(np.array([seq]), **params, n_head=2)[0, -1]
        np.testing.assert_allclose(cached, uncached, atol=1e-4, rtol=0)
        seq.append(int(np.argmax(uncached)))
    assert cache["lengths"][0] == len(seq) - 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_greedy_equals_solo_greedy_for_prompts_of_different_lengths(tiny, use_cache):
    _, hparams, params = tiny
    model = (params, hparams)
    solo = [batching.generate(batching.requests([p], 25, GREEDY), model, use_cache)[0][0] for p in PROMPTS]
    batched, stats = batching.generate(batching.requests(PROMPTS, 25, GREEDY), model, use_cache)
    assert batched == solo
    assert stats.n_tokens == 25 * len(PROMPTS)


def test_batched_logits_equal_solo_logits(tiny):
    _, hparams, params = tiny
    cache = new_cache(hparams, len(PROMPTS))
    batched = last_logits((params, hparams), cache, PROMPTS)  # [B, n_vocab]
    for b, p in enumerate(PROMPTS):
        np.testing.assert_allclose(batched[b], gpt2.gpt2(np.array([p]), **params, n_head=2)[0, -1], atol=1e-4)
    assert cache["lengths"].tolist() == [len(p) for p in PROMPTS]


def test_rows_that_finish_leave_the_batch_and_the_rest_are_unchanged(tiny):
    """EOS ends rows at different steps; the last rows move into their places in the cache."""
    _, hparams, params = tiny
    model = (params, hparams)
    solo = [batching.generate(batching.requests([p], 12, GREEDY), model)[0][0] for p in PROMPTS]
    eos = solo[0][2]  # row 0 ends at its third token; others may meet it too
    want = [s[:s.index(eos) + 1] if eos in s else s for s in solo]
    out, _ = batching.generate(batching.requests(PROMPTS, 12, GREEDY, eos_id=eos), model)
    assert out == want and len(out[0]) < 12 and max(map(len, out)) == 12


def test_rollback_then_reextend_equals_never_extended(tiny):
    _, hparams, params = tiny
    model = (params, hparams)
    prefix, junk, real = PROMPTS[1], [50, 60, 70], [383, 2068]
    cache = new_cache(hparams, 1)
    last_logits(model, cache, [prefix + junk])
    kv_cache.rollback(cache, [len(prefix)])
    after = kv_cache.next_logits(model, cache, [prefix + real], n_logits=2)
    fresh = new_cache(hparams, 1)
    want = kv_cache.next_logits(model, fresh, [prefix + real], n_logits=2)
    np.testing.assert_allclose(after, want, atol=1e-5)
    assert cache["lengths"][0] == fresh["lengths"][0] == len(prefix) + len(real)


def test_rows_roll_back_by_different_amounts(tiny):
    """Speculative decoding's batched case: each row keeps its own number of tokens."""
    _, hparams, params = tiny
    model = (params, hparams)
    a, b = PROMPTS[0], PROMPTS[3][:4]
    cache = new_cache(hparams, 2)
    last_logits(model, cache, [a + [1, 2, 3], b + [4, 5, 6]])
    kv_cache.rollback(cache, [5, 4])  # row 0 keeps one extra token, row 1 none
    nxt = last_logits(model, cache, [a + [1, 7], b + [8]])
    np.testing.assert_allclose(nxt[0], gpt2.gpt2(np.array([a + [1, 7]]), **params, n_head=2)[0, -1], atol=1e-4)
    np.testing.assert_allclose(nxt[1], gpt2.gpt2(np.array([b + [8]]), **params, n_head=2)[0, -1], atol=1e-4)


def test_move_row_and_rows_view(tiny):
    _, hparams, params = tiny
    model = (params, hparams)
    cache = new_cache(hparams, 3)
    last_logits(model, cache, PROMPTS[:3])
    kv_cache.move_row(cache, 2, 0)  # row 0 leaves, the last row takes its place
    two = kv_cache.rows(cache, 0, 2)
    nxt = last_logits(model, two, [PROMPTS[2] + [9], PROMPTS[1] + [9]])
    for row, p in zip(nxt, (PROMPTS[2], PROMPTS[1])):
        np.testing.assert_allclose(row, gpt2.gpt2(np.array([p + [9]]), **params, n_head=2)[0, -1], atol=1e-4)
    assert cache["lengths"][:2].tolist() == [len(PROMPTS[2]) + 1, len(PROMPTS[1]) + 1]  # the view wrote through


def test_gather_rows_is_a_gather_of_every_row_it_keeps(tiny):
    """Beam search keeps beams with gather_rows, which copies only the rows that change and
    only the slots in use: the rows' caches must read as if each row were copied whole,
    including rows that swap, take their own place, or feed two others."""
    _, hparams, params = tiny
    model = (params, hparams)
    texts = [PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    for idx in ([1, 0, 2, 2], [3, 3, 0, 1], [0, 1, 2, 3], [2, 2, 2]):
        cache = new_cache(hparams, 4)
        last_logits(model, cache, texts)
        kv_cache.gather_rows(cache, np.array(idx))
        kept = [texts[i] + [9] for i in idx]
        nxt = last_logits(model, kv_cache.rows(cache, 0, len(idx)), kept)
        assert cache["lengths"][:len(idx)].tolist() == [len(t) for t in kept]
        for row, text in zip(nxt, kept):
            np.testing.assert_allclose(row, gpt2.gpt2(np.array([text]), **params, n_head=2)[0, -1], atol=1e-4)


def test_gather_rows_past_a_shared_prefix_copies_the_rest(tiny):
    """Beams of one prompt share its prefill: gather_rows(same=n) copies only the slots from n
    on, and the rows read as whole copies; a row's own slots below n are left as they were."""
    _, hparams, params = tiny
    model = (params, hparams)
    prefix = PROMPTS[0]
    texts = [prefix + [5, 6, 7], prefix + [8], prefix + [9, 10], prefix + [11, 12, 13, 14]]
    for idx in ([1, 0, 3, 3], [2, 2, 2, 0]):
        cache = new_cache(hparams, 4)
        last_logits(model, cache, texts)
        before = cache["layers"][0]["k"].copy()
        kv_cache.gather_rows(cache, np.array(idx), same=len(prefix))
        np.testing.assert_array_equal(cache["layers"][0]["k"][:, :, :len(prefix)], before[:, :, :len(prefix)])
        kept = [texts[i] + [3] for i in idx]
        nxt = last_logits(model, cache, kept)
        for row, text in zip(nxt, kept):
            np.testing.assert_allclose(row, gpt2.gpt2(np.array([text]), **params, n_head=2)[0, -1], atol=1e-4)


def test_a_saved_row_comes_back_bit_for_bit_in_another_row(tiny):
    """A paused request keeps a copy of its row (save_row) and later takes whatever row is
    free (restore_row): its next logits are bitwise those it would have had without the pause."""
    _, hparams, params = tiny
    model = (params, hparams)
    cache = new_cache(hparams, 3)
    last_logits(model, cache, PROMPTS[:3])
    saved = kv_cache.save_row(cache, 1)
    want = last_logits(model, kv_cache.rows(cache, 1, 2), [PROMPTS[1] + [9]])
    last_logits(model, cache, [PROMPTS[3], PROMPTS[3], PROMPTS[0] + [5]])  # every row overwritten
    kv_cache.restore_row(cache, 2, saved)
    assert cache["lengths"][2] == len(PROMPTS[1]) and saved["layers"][0]["k"].shape[1] == len(PROMPTS[1])
    np.testing.assert_array_equal(last_logits(model, kv_cache.rows(cache, 2, 3), [PROMPTS[1] + [9]]), want)


def test_cache_bytes_formula(tiny):
    _, h, _ = tiny
    cache = new_cache(h, 3)
    assert kv_cache.cache_nbytes(cache) == 2 * h["n_layer"] * 3 * h["n_ctx"] * h["n_embd"] * 4


def test_window_start_restarts_from_the_last_half_and_grows_back():
    n_ctx, keep = 64, 32
    starts = [kv_cache.window_start(n, n_ctx) for n in range(1, 400)]
    assert starts[:64] == [0] * 64  # the whole text while it fits
    assert kv_cache.window_start(65, n_ctx) == 65 - keep  # the first restart keeps the last half
    lengths = [n - kv_cache.window_start(n, n_ctx) for n in range(65, 400)]
    assert min(lengths) == keep and max(lengths) == n_ctx
    assert all(b == a + 1 or (a == n_ctx and b == keep) for a, b in zip(lengths, lengths[1:]))
    assert all(kv_cache.room(n, n_ctx) == n_ctx - (n - kv_cache.window_start(n, n_ctx)) for n in range(1, 400))
    assert [kv_cache.room(n, n_ctx) for n in (1, 63, 64, 65)] == [63, 1, 0, 32]


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_past_the_context_window_is_the_same_with_and_without_cache(tiny, use_cache):
    """n_ctx is 64: 200 new tokens restart the window several times. Both paths follow
    kv_cache.window_start, so they agree at every length, and each token's logits are
    the model's on exactly that window."""
    _, hparams, params = tiny
    model = (params, hparams)
    prompts = [PROMPTS[1], list(range(1000, 1070))]  # the second starts longer than the window
    out, _ = batching.generate(batching.requests(prompts, 200, GREEDY), model, use_cache)
    assert [len(o) for o in out] == [200, 200]
    for prompt, o in zip(prompts, out):
        text = prompt + o
        for n in (64, 65, 96, 97, 98, 130, len(text) - 1):
            if n < len(prompt):
                continue
            window = text[kv_cache.window_start(n, 64):n]
            assert len(window) <= 64 and text[n] == int(np.argmax(gpt2.gpt2(np.array([window]), **params,
                                                                              n_head=2)[0, -1]))
    assert out == batching.generate(batching.requests(prompts, 200, GREEDY), model, not use_cache)[0]


def test_pending_inputs_restart_a_row_whose_window_moved(tiny):
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
    _, stats = batching.generate(batching.requests(PROMPTS, 5, GREEDY), (params, h))
    slots = max(map(len, PROMPTS)) + 5  # sized to the longest row, not to n_ctx
    assert stats.kv_cache_bytes == 2 * h["n_layer"] * len(PROMPTS) * slots * h["n_embd"] * 4
    assert batching.generate(batching.requests(PROMPTS, 5, GREEDY), (params, h), use_cache=False)[1].kv_cache_bytes == 0


def test_a_cache_larger_than_the_memory_is_refused_before_a_page_is_touched(tiny, monkeypatch):
    """init_cache writes every page: past the memory the OS would kill the process midway."""
    _, hparams, params = tiny
    row = 2 * hparams["n_layer"] * 64 * hparams["n_embd"] * 4  # a row of 64 slots, float32
    monkeypatch.setattr(layout, "memory", lambda on_gpu=False: ("this machine's", 10 * row))
    assert kv_cache.cache_nbytes(kv_cache.init_cache(hparams, 10, 64, like=params["wpe"])) == 10 * row
    with pytest.raises(ValueError, match=r"the keys and values of 11 rows of 64 tokens take .* GiB, more than "
                                         r"this machine's memory .*--max_batch, --num_beams"):
        kv_cache.init_cache(hparams, 11, 64, like=params["wpe"])
    monkeypatch.setattr(layout, "memory", lambda on_gpu=False: ("this machine's", None))  # the OS says nothing
    kv_cache.init_cache(hparams, 11, 64, like=params["wpe"])
