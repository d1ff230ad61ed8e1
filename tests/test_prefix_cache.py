"""The prefix cache (serving/prefix_cache.py, scheduler.share_prefix): a request whose
beginning was computed already gets, bit for bit, the tokens and logits it gets alone, in
both decoders, greedy and sampled, under eviction and at the window's edge; the choices of
one prompt compute it once; the cache stays within its budget; the server reports it."""
import dataclasses
import os

import numpy as np
import pytest

import batching
import kv_cache
import sampling
import speculative
import utils
from conftest import make_model_dir
from kernels import layout, rowwise
from serving import prefix_cache, scheduler

needs_numba = pytest.mark.skipif(rowwise.KERNEL != "numba", reason="exact sharing needs the numba kernels")


@pytest.fixture(scope="module")
def tiny_kernel(tmp_path_factory):
    """The tiny GPT-2 (n_ctx 64) in the row kernel's layout, as the commands run it."""
    d = str(tmp_path_factory.mktemp("tiny"))
    make_model_dir(os.path.join(d, "124M"), "tiny-openai")
    _, hparams, params = utils.load_model_dir(os.path.join(d, "124M"))
    return layout.decode_layout(layout.plain_layout(params), rowwise.KERNEL), hparams


def block_bytes(model):
    """One block's keys and values of one model."""
    return 2 * model[1]["n_layer"] * model[1]["n_embd"] * prefix_cache.BLOCK * 4


def decoders(model):
    return {"autoregressive": scheduler.autoregressive(model),
            "speculative": scheduler.speculative_decoder(model, speculative.model_drafter(model))}  # the tiny model drafts for itself


def served(reqs, decoder, prefix, max_batch=4):
    """{index: (tokens, [logits of each token], cached_tokens)} of one continuous-batching run."""
    logits, out = {}, {}
    reqs = [dataclasses.replace(r, wants_logits=True) for r in reqs]  # the callback reads their logits
    for e in scheduler.serve(reqs, decoder, max_batch=max_batch, prefix=prefix):
        assert e.kind != "error", e.error
        if e.kind == "token":
            logits.setdefault(e.index, []).append(np.array(e.logits))
        elif e.kind == "finished":
            out[e.index] = (e.tokens, logits.pop(e.index), e.metrics["cached_tokens"])
    return out


def shared_prefix_requests(n, seed, temperature, n_ctx=64):
    """n requests over a few random templates: each a template's first L tokens (L random,
    some past the window) then up to 5 tokens of its own; a few repeat a prompt exactly."""
    rng = np.random.default_rng(seed)
    templates = [rng.integers(0, 1000, 80).tolist() for _ in range(4)]
    settings = sampling.SamplingSettings(temperature=temperature, top_k=50 if temperature else 0)
    reqs = []
    for i in range(n):
        if reqs and rng.random() < 0.15:
            prompt = reqs[-1].prompt  # the same prompt again: n > 1 choices
        else:
            L = int(rng.choice([rng.integers(1, 48), rng.integers(48, n_ctx + 12)]))
            prompt = tuple(templates[rng.integers(4)][:L] + rng.integers(0, 1000, rng.integers(0, 6)).tolist())
        reqs.append(batching.Request(prompt, int(rng.integers(1, 10)), settings, seed=int(rng.integers(1 << 30)),
                                     arrival_s=float(rng.random() * 0.05)))
    return reqs


@needs_numba
@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefixes_change_not_a_bit(tiny_kernel, decoder, temperature):
    """60 randomized requests a case (240 in all), served with a large cache, with one so
    small that it evicts all the time, and with none (the same prompt in flight still
    shares): every request's tokens and logits bitwise what it gets served alone."""
    reqs = shared_prefix_requests(60, seed=len(decoder) + int(temperature), temperature=temperature)
    dec = decoders(tiny_kernel)[decoder]
    alone = {i: served([r], dec, prefix_cache.new_prefix_cache(0))[0] for i, r in enumerate(reqs)}
    block = block_bytes(tiny_kernel) * len(dec[1])  # the draft model's keys too
    for budget in (1 << 30, 3 * block, 0):
        prefix = prefix_cache.new_prefix_cache(budget)
        got = served(reqs, dec, prefix)
        for i, (tokens, logits, cached) in got.items():
            assert tokens == alone[i][0], (budget, i)
            assert all(np.array_equal(a, b) for a, b in zip(logits, alone[i][1])), (budget, i)
            assert cached < len(reqs[i].prompt)
            assert cached == 0 or len(reqs[i].prompt) <= tiny_kernel[1]["n_ctx"]  # never across a moved window
        assert prefix["hits"] == sum(c for _, _, c in got.values()) and (prefix["hits"] > 0 or budget == 0)
        assert prefix["queries"] == sum(len(r.prompt) for r in reqs)
        assert prefix["bytes"] == len(prefix["blocks"]) * block <= budget
        assert sum(a.nbytes for a in (prefix["pool"] or {}).values()) <= budget  # all the memory it ever holds
        if budget == 3 * block:
            assert len(prefix["blocks"]) <= 3


@needs_numba
def test_a_finished_text_is_kept_for_the_next_turn(tiny_kernel):
    """A conversation sends its transcript again with a new turn: the whole earlier text
    (prompt and answer) comes from the cache, in whole blocks."""
    dec = decoders(tiny_kernel)["autoregressive"]
    prefix = prefix_cache.new_prefix_cache(1 << 30)
    first = batching.Request(tuple(range(100, 120)), 20, sampling.SamplingSettings(temperature=0.0), seed=1)
    answer = served([first], dec, prefix)[0][0]
    turn = batching.Request(first.prompt + tuple(answer) + (7, 8, 9), 5, first.settings, seed=2)
    tokens, logits, cached = served([turn], dec, prefix)[0]
    assert cached == 32  # of its 43 tokens: the 39 the first request's row held, in whole blocks
    alone = served([turn], dec, prefix_cache.new_prefix_cache(0))[0]
    assert tokens == alone[0] and all(np.array_equal(a, b) for a, b in zip(logits, alone[1]))


def count_computed_tokens(monkeypatch):
    """A list that grows by the tokens each model pass computes (kv_cache.begin_pass's n_new)."""
    computed = []
    begin = kv_cache.begin_pass

    def counting(cache, n_new, *args, **kwargs):
        computed.append(int(np.sum(n_new)))
        return begin(cache, n_new, *args, **kwargs)
    monkeypatch.setattr(kv_cache, "begin_pass", counting)
    return computed


def numpy_layout(model):
    """The same model as the NumPy fallback lays it out (no kernel loops: not exact to share)."""
    params, hparams = model
    return layout.decode_layout(layout.plain_layout(params), "numpy"), hparams


@pytest.mark.parametrize("budget", [1 << 30, 0])
@pytest.mark.parametrize("fallback", [False, True])
def test_the_choices_of_one_prompt_compute_it_once(tiny_kernel, monkeypatch, budget, fallback):
    """n = 4 choices of a 40-token prompt, 3 new tokens each: the prompt runs through the model
    once (then each other choice only its last token), with the cache or without, with the
    kernels or the NumPy fallback; and each choice is what it is alone."""
    prompt = tuple(range(300, 340))
    reqs = [batching.Request(prompt, 3, sampling.SamplingSettings(temperature=1.0), seed=s) for s in range(4)]
    dec = decoders(numpy_layout(tiny_kernel) if fallback else tiny_kernel)["autoregressive"]
    alone = [served([r], dec, prefix_cache.new_prefix_cache(0))[0][0] for r in reqs]
    computed = count_computed_tokens(monkeypatch)
    got = served(reqs, dec, prefix_cache.new_prefix_cache(budget))
    # the prompt once (all but its last token alone, then that), the 3 other choices' last tokens
    # together, then 2 steps of 4 rows
    assert computed == [39, 1, 3, 4, 4]
    assert [got[i][0] for i in range(4)] == alone
    assert [got[i][2] for i in range(4)] == [0, 39, 39, 39]


@needs_numba
def test_the_cache_stays_within_its_budget_as_it_fills(tiny_kernel):
    """Many different prompts through a cache of 5 blocks: never above it at any point, the
    least recently used chains' ends go first, and a chain found again is still exact."""
    dec = decoders(tiny_kernel)["autoregressive"]
    block = block_bytes(tiny_kernel)
    prefix = prefix_cache.new_prefix_cache(5 * block)
    rng = np.random.default_rng(7)
    reqs = [batching.Request(tuple(rng.integers(0, 1000, 40).tolist()), 2, sampling.SamplingSettings(temperature=0.0),
                             seed=i) for i in range(12)]
    for r in reqs:
        served([r], dec, prefix)
        assert prefix["bytes"] <= 5 * block and len(prefix["blocks"]) <= 5
        ids = [blk["id"] for blk in prefix["blocks"].values()]
        for blk in prefix["blocks"].values():  # a kept block's predecessor is kept too, and more recent
            parent = blk["key"][0]
            assert parent == 0 or parent in ids[ids.index(blk["id"]):]
    assert len(prefix["blocks"]) == 5  # 12 prompts of 2 blocks each went through: most were evicted
    again = batching.Request(reqs[-1].prompt + (3,), 4, reqs[-1].settings, seed=99)
    tokens, logits, cached = served([again], dec, prefix)[0]
    alone = served([again], dec, prefix_cache.new_prefix_cache(0))[0]
    assert cached == 32 and tokens == alone[0] and all(np.array_equal(a, b) for a, b in zip(logits, alone[1]))


def test_no_cache_where_a_prefix_would_round_differently(tiny_kernel):
    """The NumPy fallback computes a prompt in one product, rounded by its length: requests that
    share only a beginning compute it each (bitwise what they get alone), and nothing is kept."""
    dec = decoders(numpy_layout(tiny_kernel))["autoregressive"]
    base = tuple(range(400, 440))
    reqs = [batching.Request(base[:30 + i] + (i,), 3, sampling.SamplingSettings(temperature=0.0), seed=i)
            for i in range(4)]
    prefix = prefix_cache.new_prefix_cache(1 << 30)
    got = served(reqs, dec, prefix)
    assert all(c == 0 for _, _, c in got.values()) and not prefix["blocks"]
    for i, r in enumerate(reqs):
        alone = served([r], dec, prefix_cache.new_prefix_cache(0))[0]
        assert got[i][0] == alone[0] and all(np.array_equal(a, b) for a, b in zip(got[i][1], alone[1]))
