"""Continuous batching: every request's text is what it would be alone, whoever shares
its batch and whenever it joins; rows are reused; bad requests fail alone."""
import numpy as np
import pytest

import batching
import gpt2
import sampling
import scheduler
import speculative

GREEDY = sampling.SamplingSettings(temperature=0.0)
SAMPLED = sampling.SamplingSettings(temperature=1.0, top_k=40, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def models(tiny):
    _, hparams, params = tiny
    return (params, hparams), (dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1))


def mixed_requests(n, settings, seed=0, arrivals=None):
    """Prompts of 1-20 tokens and 1-40 new tokens, so rows finish at very different times."""
    rng = np.random.default_rng(seed)
    return [batching.Request(tuple(rng.integers(0, 50000, rng.integers(1, 21)).tolist()), int(rng.integers(1, 41)),
                             settings, seed=100 + i, arrival_s=0.0 if arrivals is None else arrivals[i])
            for i in range(n)]


def served(reqs, decoder, **kw):
    events = list(scheduler.serve(reqs, decoder, **kw))
    finished = {e.index: e for e in events if e.kind == "finished"}
    return events, finished


def decoders(models):
    target, draft = models
    return {"autoregressive": (scheduler.autoregressive(target), lambda r: gpt2.generate([r], target)[0][0]),
            "speculative": (scheduler.speculative_decoder(target, draft, speculative.SpeculativeConfig(K=3)),
                            lambda r: speculative.speculative_generate([r], target, draft,
                                                                       speculative.SpeculativeConfig(K=3))[0][0])}


@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_text_is_the_same_as_alone_with_rows_joining_mid_run(models, decoder, settings):
    """24 requests through 4 rows: 20 of them join while others are mid-generation."""
    serve_with, alone = decoders(models)[decoder]
    reqs = mixed_requests(24, settings)
    events, finished = served(reqs, serve_with, max_batch=4)
    assert sorted(finished) == list(range(24))
    assert all(finished[i].tokens == alone(r) for i, r in enumerate(reqs))
    streamed = {i: [e.token for e in events if e.kind == "token" and e.index == i] for i in range(24)}
    assert all(streamed[i] == finished[i].tokens for i in range(24))


def test_greedy_equals_plain_greedy_and_the_static_baseline(models):
    target, _ = models
    reqs = mixed_requests(12, GREEDY)
    want = gpt2.generate(reqs, target)[0]
    for static in (False, True):
        for decoder, _ in decoders(models).values():
            _, finished = served(reqs, decoder, max_batch=3, static=static)
            assert [finished[i].tokens for i in range(12)] == want


def test_one_row_reused_many_times_gives_fresh_results(models):
    target, _ = models
    reqs = mixed_requests(8, SAMPLED, seed=4)
    _, finished = served(reqs, scheduler.autoregressive(target), max_batch=1)
    assert [finished[i].tokens for i in range(8)] == [gpt2.generate([r], target)[0][0] for r in reqs]


def test_requests_arriving_over_time(models):
    """A stream: requests arrive every 5 ms, some while others are running."""
    target, draft = models
    reqs = mixed_requests(10, SAMPLED, seed=2, arrivals=[0.005 * i for i in range(10)])
    serve_with, alone = decoders(models)["speculative"]
    _, finished = served(reqs, serve_with, max_batch=3)
    assert all(finished[i].tokens == alone(r) for i, r in enumerate(reqs))
    for i, e in finished.items():
        m = e.metrics
        assert 0 <= m["queue_s"] <= m["ttft_s"] <= m["e2e_s"] and m["n_tokens"] == len(e.tokens)


def test_eos_and_max_tokens_end_a_row_and_free_it(models):
    target, _ = models
    prompt = (464, 2068, 7586)
    full = gpt2.generate([batching.Request(prompt, 20, GREEDY)], target)[0][0]
    eos = full[4]
    reqs = [batching.Request(prompt, 20, GREEDY, eos_id=eos), batching.Request(prompt, 3, GREEDY),
            batching.Request(prompt, 20, GREEDY)]
    events, finished = served(reqs, scheduler.autoregressive(target), max_batch=2)
    assert finished[0].tokens == full[:full.index(eos) + 1] and finished[1].tokens == full[:3]
    assert finished[2].tokens == full
    order = [e.index for e in events if e.kind == "finished"]
    assert order.index(2) > order.index(1)  # request 2 waited for a free row


def test_bad_requests_get_an_error_and_the_others_go_on(models):
    target, _ = models
    reqs = mixed_requests(5, GREEDY)
    reqs[1] = batching.Request((464,), 0, GREEDY)  # zero new tokens
    reqs[2] = batching.Request(tuple(range(100, 160)), 10, GREEDY)  # 60 + 10 tokens > the 64-token window
    reqs[3] = batching.Request((), 5, GREEDY)  # empty prompt
    for decoder, _ in decoders(models).values():
        events, finished = served(reqs, decoder, max_batch=2)
        errors = {e.index: e.error for e in events if e.kind == "error"}
        assert sorted(errors) == [1, 2, 3] and sorted(finished) == [0, 4]
        assert "max_new_tokens must be >= 1" in errors[1] and "max_len 64" in errors[2] and "empty" in errors[3]
    _, finished = served(reqs[2:3], scheduler.autoregressive(target), max_len=200)
    assert finished[0].tokens == gpt2.generate(reqs[2:3], target)[0][0]  # a longer max_len serves it


def test_summary_of_a_run(models):
    target, _ = models
    _, finished = served(mixed_requests(6, GREEDY), scheduler.autoregressive(target), max_batch=2)
    s = scheduler.summarize(list(finished.values()))
    assert s["requests"] == 6 and s["tokens"] == sum(len(e.tokens) for e in finished.values())
    assert s["tokens_per_s"] > 0 and s["ttft_s_p50"] <= s["ttft_s_p95"] and s["e2e_s_p95"] <= s["seconds"] + 1e-9
