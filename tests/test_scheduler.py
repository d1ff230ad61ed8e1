"""Continuous batching: every request's text is what it would be alone, whoever shares
its batch and whenever it joins; rows are reused; bad requests fail alone."""
import dataclasses
import threading
import tracemalloc

import numpy as np
import pytest

import batching
import sampling
import speculative
from kernels import rowwise
from serving import prefix_cache, scheduler

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
    target, draft = models[0], speculative.model_drafter(models[1])
    return {"autoregressive": (scheduler.autoregressive(target), lambda r: batching.generate([r], target)[0][0]),
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
    want = batching.generate(reqs, target)[0]
    for static in (False, True):
        for decoder, _ in decoders(models).values():
            _, finished = served(reqs, decoder, max_batch=3, static=static)
            assert [finished[i].tokens for i in range(12)] == want


def test_one_row_reused_many_times_gives_fresh_results(models):
    target, _ = models
    reqs = mixed_requests(8, SAMPLED, seed=4)
    _, finished = served(reqs, scheduler.autoregressive(target), max_batch=1)
    assert [finished[i].tokens for i in range(8)] == [batching.generate([r], target)[0][0] for r in reqs]


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
    full = batching.generate([batching.Request(prompt, 20, GREEDY)], target)[0][0]
    eos = full[4]
    reqs = [batching.Request(prompt, 20, GREEDY, eos_id=eos), batching.Request(prompt, 3, GREEDY),
            batching.Request(prompt, 20, GREEDY)]
    events, finished = served(reqs, scheduler.autoregressive(target), max_batch=2)
    assert finished[0].tokens == full[:full.index(eos) + 1] and finished[1].tokens == full[:3]
    assert finished[2].tokens == full
    order = [e.index for e in events if e.kind == "finished"]
    assert order.index(2) > order.index(1)  # request 2 waited for a free row


def finishes_within(seconds, fn):
    """fn() in a thread of its own: its result or its exception, or a failure if it hangs."""
    outcome = []

    def run():
        try:
            outcome.append((True, fn()))
        except Exception as e:
            outcome.append((False, e))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        pytest.fail(f"still running after {seconds} s: a hang")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def bad_requests():
    """Every field wrong in every way a caller can get it wrong, each with the field its error names."""
    r = batching.Request((464, 2068), 5, GREEDY)
    nan, inf = float("nan"), float("inf")
    return [(dataclasses.replace(r, prompt="The quick"), "prompt"), (dataclasses.replace(r, prompt=()), "prompt"),
            (dataclasses.replace(r, prompt=(2068.5,)), "prompt"), (dataclasses.replace(r, prompt=(50257,)), "prompt"),
            (dataclasses.replace(r, prompt=(-1,)), "prompt"), (dataclasses.replace(r, prompt=((1, 2),)), "prompt"),
            (dataclasses.replace(r, prompt=np.array([[464, 2068]])), "prompt"),
            (dataclasses.replace(r, prompt=None), "prompt"),
            (dataclasses.replace(r, max_new_tokens=None), "max_new_tokens"),
            (dataclasses.replace(r, max_new_tokens=2.5), "max_new_tokens"),
            (dataclasses.replace(r, max_new_tokens=0), "max_new_tokens"),
            (dataclasses.replace(r, max_new_tokens=True), "max_new_tokens"),
            (dataclasses.replace(r, seed=None), "seed"), (dataclasses.replace(r, seed=-1), "seed"),
            (dataclasses.replace(r, seed=1.5), "seed"), (dataclasses.replace(r, settings=None), "settings"),
            (dataclasses.replace(r, eos_id=-1), "eos_id"), (dataclasses.replace(r, eos_id=2.0), "eos_id"),
            (dataclasses.replace(r, arrival_s=nan), "arrival_s"), (dataclasses.replace(r, arrival_s=inf), "arrival_s"),
            (dataclasses.replace(r, arrival_s=-1.0), "arrival_s"),
            (dataclasses.replace(r, arrival_s="soon"), "arrival_s"),
            ({"prompt": (464,), "max_new_tokens": 5}, "request")]


@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
def test_each_bad_request_gets_one_error_and_the_good_ones_their_solo_text(models, decoder):
    """Bad requests among good ones: an error event naming the field for each, at once;
    the good ones (a NumPy prompt among them) finish with the text they get alone."""
    serve_with, alone = decoders(models)[decoder]
    good = mixed_requests(4, SAMPLED, seed=3) + [batching.Request(np.array([464, 2068]), 6, SAMPLED, seed=9)]
    reqs, fields = [], {}  # bad and good alternate, then the rest of the bad ones
    for i, (r, field) in enumerate(bad_requests()):
        fields[len(reqs)] = field
        reqs += [r] + good[i:i + 1]
    events, finished = finishes_within(60, lambda: served(reqs, serve_with, max_batch=3))
    errors = {e.index: e.error for e in events if e.kind == "error"}
    assert sorted(errors) == sorted(fields) and sorted(finished) == [1, 3, 5, 7, 9]
    assert all(errors[i].startswith(field) for i, field in fields.items())
    assert [finished[i].tokens for i in (1, 3, 5, 7)] == [alone(r) for r in good[:4]]
    assert finished[9].tokens == alone(dataclasses.replace(good[4], prompt=(464, 2068)))


def test_library_arguments_are_checked_when_serve_is_called(models):
    target, _ = models
    reqs = mixed_requests(2, GREEDY)
    for kw, field in (({"max_batch": 0}, "max_batch"), ({"max_batch": -1}, "max_batch"),
                      ({"max_batch": 2.5}, "max_batch"), ({"max_batch": None}, "max_batch"),
                      ({"max_len": 0}, "max_len"), ({"max_len": "64"}, "max_len")):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            finishes_within(10, lambda: scheduler.serve(reqs, scheduler.autoregressive(target), **kw))


def test_long_prompts_slide_the_window_as_alone_unless_max_len_is_smaller(models):
    """A request longer than the 64-token window is served as generate serves it (the
    window slides); only a max_len below the window refuses what does not fit in it."""
    target, _ = models
    reqs = mixed_requests(3, GREEDY)
    reqs[1] = batching.Request(tuple(range(100, 180)), 10, GREEDY)  # 80 + 10 tokens > the 64-token window
    for decoder, alone in decoders(models).values():
        _, finished = served(reqs, decoder, max_batch=2)
        assert [finished[i].tokens for i in range(3)] == [alone(r) for r in reqs]
    events, finished = served(reqs, scheduler.autoregressive(target), max_len=61)
    errors = {e.index: e.error for e in events if e.kind == "error"}
    assert sorted(errors) == [1] and "max_len 61" in errors[1] and sorted(finished) == [0, 2]


def test_a_long_run_keeps_its_bookkeeping_flat():
    """200k steps of a stub decoder (no model: it emits token 1): the Stats, the finished
    requests and the scheduler's own state weigh the same at step 200k as at step 10k."""
    hparams = {"n_vocab": 8, "n_ctx": 64, "n_layer": 1, "n_head": 1, "n_embd": 2}
    models = {"target": ({"wte": np.zeros((8, 2), np.float32), "wpe": np.zeros((64, 2), np.float32)}, hparams)}
    seen = {}

    def step(batch):
        for b in range(len(batch.seqs)):
            batching.emit(batch, b, [1])
        batch.stats.step_done()
        if batch.stats.n_steps in (10_000, 200_000):
            sizes = {name: len(value) for name, value in vars(batch.stats).items() if hasattr(value, "__len__")}
            seen[batch.stats.n_steps] = sizes, tracemalloc.get_traced_memory()[0]

    reqs = [batching.Request((1,), 199, GREEDY) for _ in range(1010)]  # 199 steps each, one row at a time
    tracemalloc.start()
    try:
        n_finished = sum(e.kind == "finished" for e in scheduler.serve(reqs, (step, models), max_batch=1))
    finally:
        tracemalloc.stop()
    assert n_finished == len(reqs) and sorted(seen) == [10_000, 200_000]
    (sizes_early, bytes_early), (sizes_late, bytes_late) = seen[10_000], seen[200_000]
    assert sizes_early == sizes_late and max(sizes_late.values()) <= batching.RECENT_STEPS
    assert bytes_late - bytes_early < 256 << 10  # the old per-step lists grew by ~30 bytes a step: 5.7 MB here


def test_summary_of_a_run(models):
    target, _ = models
    _, finished = served(mixed_requests(6, GREEDY), scheduler.autoregressive(target), max_batch=2)
    s = scheduler.summarize(list(finished.values()))
    assert s["requests"] == 6 and s["tokens"] == sum(len(e.tokens) for e in finished.values())
    assert s["tokens_per_s"] > 0 and s["ttft_s_p50"] <= s["ttft_s_p95"] and s["e2e_s_p95"] <= s["seconds"] + 1e-9


def lagging_intake(reqs, lags, cancel_at=None):
    """from_list's intake with clients that lag: lags {i: (calls, backed_up)}: request i's client
    lags at the intake's calls in calls, its tokens backed up or not; cancel_at: {call: [indices
    whose clients leave then]}."""
    arrive, calls = scheduler.from_list(reqs, range(len(reqs))), iter(range(10 ** 6))

    def intake(now, idle):
        arrived, _, closed, _ = arrive(now, idle)
        n = next(calls)
        return arrived, (cancel_at or {}).get(n, ()), closed, {i: backed_up for i, (when, backed_up) in lags.items()
                                                                if n in when}
    return intake


def serve_lagging(models, decoder, reqs, lags, max_batch, cancel_at=None, prefix=None):
    step, cached = decoders(models)[decoder][0]
    events = list(scheduler.loop(lagging_intake(reqs, lags, cancel_at), step, cached, max_batch,
                                    models[0][1]["n_ctx"], prefix=prefix))
    return events, {e.index: e for e in events if e.kind == "finished"}


@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
def test_a_lagging_client_gives_its_row_to_a_waiting_request_and_resumes_with_the_same_text(models, decoder):
    """Requests 0 and 1 lag from the 3rd step to the 20th while 4 others wait for the 2 rows:
    both are paused, the waiting requests decode in their rows, then they resume; every text
    is its text alone, bit for bit (sampled, with penalties: the counts and the random
    stream travel with the paused request, the keys and values are copied, not recomputed)."""
    reqs = [dataclasses.replace(r, max_new_tokens=30) for r in mixed_requests(6, SAMPLED, seed=7)]
    events, finished = serve_lagging(models, decoder, reqs, {0: (range(3, 20), False), 1: (range(3, 20), False)},
                                      max_batch=2)
    assert sorted(finished) == list(range(6))
    assert all(finished[i].tokens == decoders(models)[decoder][1](r) for i, r in enumerate(reqs))
    kinds = [(e.kind, e.index) for e in events]
    for i in (0, 1):
        paused, resumed = kinds.index(("paused", i)), kinds.index(("resumed", i))
        others = {e.index for e in events[paused:resumed] if e.kind == "token"}
        assert i not in others and others & {2, 3, 4, 5}  # its row decoded for others meanwhile


@pytest.mark.parametrize("decoder, prefix_mib", [("autoregressive", 0), ("speculative", 0), ("autoregressive", 4)])
def test_past_max_batch_a_paused_request_keeps_only_its_text_and_a_paused_request_can_be_cancelled(models, decoder,
                                                                                                   prefix_mib):
    """Requests 0-3 lag from the 2nd call to the 60th with 2 rows and 4 others waiting: 0 and 1
    are paused with their keys and values; 2 and 3 then lag in their rows and are paused too,
    keeping only their texts (their keys and values are computed again when they resume),
    where the kernels make a token's keys the same bits whatever the pass; with the NumPy
    fallback they keep their rows (at most max_batch are paused). With a prefix cache, what
    it keeps of a paused text is copied back on resume, not computed. Request 0's client
    leaves while it is paused: it finishes with the tokens it had, and never resumes. Every
    other text is its text alone, bit for bit."""
    reqs = [dataclasses.replace(r, max_new_tokens=12) for r in mixed_requests(6, SAMPLED, seed=8)]
    lags = {i: (range(2, 60), False) for i in range(4)}
    prefix = prefix_cache.new_prefix_cache(prefix_mib << 20) if prefix_mib else None
    events, finished = serve_lagging(models, decoder, reqs, lags, max_batch=2, cancel_at={30: [0]}, prefix=prefix)
    paused, most = set(), 0
    for e in events:
        paused = paused | {e.index} if e.kind == "paused" else paused - {e.index}
        most = max(most, len(paused))
    recompute = all(rowwise.row_ops_for(model) is not None for model in models)
    assert most == (4 if recompute else 2)
    assert {e.index for e in events if e.kind == "paused"} == ({0, 1, 2, 3} if recompute else {0, 1})
    kinds = [(e.kind, e.index) for e in events]
    assert ("resumed", 0) not in kinds and ("resumed", 1) in kinds
    alone = [decoders(models)[decoder][1](r) for r in reqs]
    assert finished[0].tokens == alone[0][:len(finished[0].tokens)] and len(finished[0].tokens) < 12
    assert all(finished[i].tokens == alone[i] for i in range(1, 6))
    if prefix is not None and recompute:  # the texts paused without their keys and values were kept
        assert prefix["blocks"]


@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
def test_a_lagging_row_keeps_its_row_while_nobody_waits_unless_its_tokens_back_up(models, decoder):
    """Two requests, two rows, nobody waiting: request 0's client lags from the 3rd call to
    the 12th without its tokens backing up, and keeps its row (no pause); request 1's client
    lags as long with its tokens backed up, and is paused though nobody waits, then resumes.
    Both texts are their texts alone, bit for bit."""
    reqs = [dataclasses.replace(r, max_new_tokens=24) for r in mixed_requests(2, SAMPLED, seed=9)]
    events, finished = serve_lagging(models, decoder, reqs, {0: (range(3, 12), False), 1: (range(3, 12), True)},
                                     max_batch=2)
    kinds = [(e.kind, e.index) for e in events]
    assert ("paused", 0) not in kinds and ("paused", 1) in kinds and ("resumed", 1) in kinds
    paused, resumed = kinds.index(("paused", 1)), kinds.index(("resumed", 1))
    assert {e.index for e in events[paused:resumed] if e.kind == "token"} == {0}
    assert all(finished[i].tokens == decoders(models)[decoder][1](r) for i, r in enumerate(reqs))
