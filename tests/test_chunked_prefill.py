"""Chunked prefill (scheduler.loop's max_prefill_tokens): a prompt spread over
iterations changes no bit of any text or logprob, and no iteration computes more than
its budget."""
import dataclasses

import numpy as np
import pytest

import batching
import kv_cache
import speculative
from cli import flags
from kernels import layout, rowwise
from serving import chunking, prefix_cache, scheduler
from test_scheduler import GREEDY, SAMPLED, lagging_intake, models  # noqa: F401 (models: the fixture)


def chunks_or_skip(models):
    if rowwise.row_ops_for(models[0]) is None:
        pytest.skip("the NumPy fallback runs prompts whole (test_the_fallback_runs_prompts_whole)")


def decoder(models, name):
    target, draft = models
    if name == "autoregressive":
        return scheduler.autoregressive(target)
    return scheduler.speculative_decoder(target, speculative.model_drafter(draft), speculative.SpeculativeConfig(K=3))


def random_requests(n, seed, n_ctx):
    """Prompts of 1 to 2.5 windows (the tiny model's is 64 tokens), some beginning alike
    (the prefix cache's blocks), greedy or sampled, arriving over a few iterations."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 50000, 2 * n_ctx).tolist()
    reqs = []
    for i in range(n):
        length = int(rng.integers(1, int(2.5 * n_ctx)))
        head = int(rng.integers(0, length + 1)) if rng.random() < 0.5 else 0
        prompt = shared[:head] + rng.integers(0, 50000, length - head).tolist()
        reqs.append(batching.Request(tuple(prompt[:length]), int(rng.integers(1, 24)),
                                     GREEDY if rng.random() < 0.5 else SAMPLED, seed=i,
                                     arrival_s=float(rng.uniform(0, 0.02))))
    return reqs


def run(reqs, dec, **kw):
    """{index: (new tokens, the logits each was drawn after)}."""
    events = list(scheduler.serve([dataclasses.replace(r, wants_logits=True) for r in reqs], dec, **kw))
    logits = {}
    for e in events:
        if e.kind == "token":
            logits.setdefault(e.index, []).append(np.array(e.logits))
    return {e.index: (e.tokens, logits[e.index]) for e in events if e.kind == "finished"}


def same(a, b):
    return a.keys() == b.keys() and all(a[i][0] == b[i][0] and len(a[i][1]) == len(b[i][1])
                                        and all(np.array_equal(x, y) for x, y in zip(a[i][1], b[i][1])) for i in a)


@pytest.mark.parametrize("name", ["autoregressive", "speculative"])
@pytest.mark.parametrize("prefix_mib", [None, 0.06], ids=["no prefix cache", "a prefix cache that evicts"])
def test_chunked_is_bitwise_unchunked_over_random_requests(models, name, prefix_mib, monkeypatch):
    """220 requests a run, 880 in all: prompts past the window's edge, shared beginnings (and a
    prefix cache too small for them, so blocks are evicted), greedy and sampled; budgets from
    the smallest allowed (max_batch) up. Every token and every logits row is the same bits as
    with prompts run whole; and prompts were really spread over several chunks."""
    chunks_or_skip(models)
    dec, n_ctx = decoder(models, name), models[0][1]["n_ctx"]
    passes = riding(monkeypatch)
    for seed, (n, budget) in enumerate([(110, 4), (55, 7), (55, 23)]):
        reqs = random_requests(n, seed, n_ctx)
        whole = run(reqs, dec, max_batch=4)
        prefix = None if prefix_mib is None else prefix_cache.new_prefix_cache(int(prefix_mib * (1 << 20)))
        passes.clear()
        chunked = run(reqs, dec, max_batch=4, prefix=prefix, max_prefill_tokens=budget)
        assert same(chunked, whole) and len(chunked) == len(reqs)
        assert max(map(sum, passes)) <= budget and sum(map(len, passes)) > 2 * len(reqs)
        if prefix is not None:
            assert prefix["hits"] and prefix["next_id"] - 1 > len(prefix["blocks"])  # blocks were evicted


def riding(monkeypatch):
    """[the tokens of each chunk in a pass] for every pass that chunks ride in, from now on."""
    passes, ride_along = [], kv_cache.ride_along

    def counted(model, riders, *args):
        passes.append([n for _, _, n in riders])
        return ride_along(model, riders, *args)
    monkeypatch.setattr(kv_cache, "ride_along", counted)
    return passes


def test_an_iteration_never_computes_more_than_its_budget(models, monkeypatch):
    """Each iteration's chunks add up to at most the budget less one token per decoding row,
    the prompt with the fewest tokens left first (ties: the oldest), and ride in the step's
    pass; every prompt longer than the budget is spread over iterations; texts past the
    window, whose window restarts as they decode, are computed again in chunks too."""
    chunks_or_skip(models)
    seen, prefill_chunks = [], chunking.prefill_chunks

    def planned(batch, models, filling, budget):
        decoding = len(batch.seqs) - len(filling)
        left = {batch.seqs[b].index: max(chunking.still_to_prefill(batch, models, b).values())
                for b in range(decoding, len(batch.seqs))}
        riders = prefill_chunks(batch, models, filling, budget)
        seen.append((decoding, budget, riders.get("target", []), min(left, key=lambda i: (left[i], i), default=None)))
        return riders
    monkeypatch.setattr(chunking, "prefill_chunks", planned)
    passes = riding(monkeypatch)
    lengths = [60, 60, 5, 60, 20, 60, 3, 60]
    reqs = [batching.Request(tuple(range(100 + i, 100 + i + n)), 20 + 40 * (i == 1), SAMPLED, seed=i,
                             arrival_s=0.01 * i) for i, n in enumerate(lengths)]
    got = run(reqs, decoder(models, "autoregressive"), max_batch=3, max_prefill_tokens=16)
    assert max(map(sum, passes)) <= 16 and len(passes) >= sum(n - 1 for n in lengths) // 16
    assert all(got[i][0] == batching.generate([r], models[0])[0][0] for i, r in enumerate(reqs))
    assert all(decoding + budget == 16 for decoding, budget, _, _ in seen)
    assert all(sum(n for _, _, n in riders) <= budget for _, budget, riders, _ in seen)
    assert sum(1 for _, _, riders, _ in seen if riders) >= sum(n - 1 for n in lengths) // 16
    for _, _, riders, first in seen:
        if riders:
            assert riders[0][1][:len(reqs[first].prompt)] == list(reqs[first].prompt)
    restarted = [riders for _, _, riders, _ in seen if any(len(text) > 64 for _, text, _ in riders)]
    assert restarted  # request 1's text outgrew the window of 64 while it decoded


def test_the_fallback_runs_prompts_whole(models, monkeypatch):
    """With gpt2.py's NumPy layer norm and attention (the fallback), a prompt computed in
    chunks would round differently: the budget is ignored and no chunk runs."""
    target = (layout.plain_layout(models[0][0]), models[0][1])
    calls = []
    monkeypatch.setattr(chunking, "prefill_chunks", lambda *a: calls.append(a) or {})
    reqs = random_requests(6, 0, target[1]["n_ctx"])
    got = run(reqs, scheduler.autoregressive(target), max_batch=2, max_prefill_tokens=2)
    assert not calls and same(got, run(reqs, scheduler.autoregressive(target), max_batch=2))


def test_chunked_prefill_composes_with_preemption(models):
    """A lagging request is paused (keeping its keys and values, and past max_batch only its
    text, which is then prefilled again in chunks) while long prompts are chunked: every text
    is its text alone."""
    chunks_or_skip(models)
    reqs = [dataclasses.replace(r, max_new_tokens=12) for r in random_requests(6, 3, 64)]
    dec = decoder(models, "autoregressive")
    lags = {i: (range(2, 40), False) for i in range(4)}
    events = list(scheduler.loop(lagging_intake(reqs, lags), *dec, 2, 64, max_prefill_tokens=5))
    finished = {e.index: e.tokens for e in events if e.kind == "finished"}
    assert len({e.index for e in events if e.kind == "paused"}) > 2  # past max_batch 2: one kept only its text
    assert all(finished[i] == batching.generate([r], models[0])[0][0] for i, r in enumerate(reqs))


def test_the_prompt_tokens_waiting_are_counted(models):
    """stats.prefill_waiting (/metrics: gpt2_prefill_tokens_waiting): prompt tokens of the requests
    waiting for a row and of the rows still being prefilled, as each iteration ends."""
    reqs = [batching.Request(tuple(range(200 * i, 200 * i + 60)), 3, GREEDY, seed=i) for i in range(3)]
    stats, seen = batching.Stats(), {}
    for e in scheduler.serve(reqs, decoder(models, "autoregressive"), max_batch=1, max_prefill_tokens=8,
                             stats=stats):
        seen.setdefault((e.kind, e.index), stats.prefill_waiting)
    assert seen[("token", 0)] == 120 and seen[("token", 1)] == 60 and seen[("token", 2)] == 0


def test_a_prompt_cancelled_while_prefilled_is_no_longer_counted_as_waiting(models):
    """The gauge counted a cancelled row's prompt until the next request came (a client's
    cancel storm left it at hundreds of tokens, with nothing running)."""
    chunks_or_skip(models)
    arrive, calls, stats = scheduler.from_list([batching.Request(tuple(range(60)), 5, GREEDY)], [0]), iter(range(99)), \
        batching.Stats()

    def intake(now, idle):
        arrived, _, closed, _ = arrive(now, idle)
        return arrived, [0] if next(calls) == 2 else [], closed, {}
    events = list(scheduler.loop(intake, *decoder(models, "autoregressive"), 2, 64, stats=stats, max_prefill_tokens=8))
    assert [e.kind for e in events] == ["finished"] and stats.prefill_waiting == 0


def test_a_request_cancelled_while_its_prompt_is_prefilled_finishes_with_nothing(models):
    """Request 0's client leaves while its 60-token prompt is half computed (budget 8): it
    finishes with no tokens and no timings (it never had a first token), and the others go on,
    their texts as alone."""
    chunks_or_skip(models)
    reqs = [batching.Request(tuple(range(100 * i, 100 * i + 60)), 5, SAMPLED, seed=i) for i in range(3)]
    arrive, calls = scheduler.from_list(reqs, range(3)), iter(range(10 ** 6))

    def intake(now, idle):
        arrived, _, closed, _ = arrive(now, idle)
        return arrived, [0] if next(calls) == 3 else [], closed, {}
    events = list(scheduler.loop(intake, *decoder(models, "autoregressive"), 2, 64, max_prefill_tokens=8))
    finished = {e.index: e for e in events if e.kind == "finished"}
    assert finished[0].tokens == [] and finished[0].metrics is None
    assert not [e for e in events if e.kind == "token" and e.index == 0]
    assert all(finished[i].tokens == batching.generate([reqs[i]], models[0])[0][0] for i in (1, 2))
    assert scheduler.summarize(list(finished.values()))["requests"] == 2


def test_main_serves_more_rows_than_the_default_budget(models_dir, capsys):
    """--max_batch 32 with no --max_prefill_tokens: the budget becomes 32, not an error."""
    import main
    args = main.parse_args(["--models_dir", models_dir, "--max_batch", "32"])
    main.check_args(args)
    assert flags.prefill_budget(args) in (32, None)  # None: the fallback runs prompts whole


def test_on_a_gpu_only_its_own_kernels_chunk_and_share_prefixes_and_chunks_only_when_asked(models_dir, monkeypatch):
    """--backend cupy: CuPy's operations keep prompts whole and no prefix cache (their notes
    say so); GPT2_GPU_KERNELS=1 makes both exact (test_cuda_graphs.py), the prefix cache on,
    chunked prefill only with --max_prefill_tokens (a step with a chunk runs eagerly there)."""
    import main
    for kernels, given, budget in (("0", [], None), ("0", ["--max_prefill_tokens", "16"], None),
                                   ("1", [], None), ("1", ["--max_prefill_tokens", "16"], 16)):
        monkeypatch.setenv(layout.GPU_KERNELS_ENV, kernels)
        args = main.parse_args(["--models_dir", models_dir, "--max_batch", "4", "--backend", "cupy"] + given)
        assert flags.prefill_budget(args) == budget
        assert (flags.chunked_prefill_note(args) is None) == (flags.prefix_cache_note(args) is None) == (kernels == "1")


@pytest.mark.parametrize("budget, max_batch", [(0, 1), (-3, 1), (3, 4), (2.5, 1), ("8", 1)])
def test_a_bad_budget_is_refused(models, budget, max_batch):
    with pytest.raises(ValueError, match="max_prefill_tokens must be an integer >= max_batch"):
        scheduler.serve(random_requests(2, 0, 64), decoder(models, "autoregressive"), max_batch=max_batch,
                        max_prefill_tokens=budget)


def test_the_flag_says_its_least_value():
    class Args:
        max_batch, max_prefill_tokens = 8, 7
    with pytest.raises(ValueError, match=r"--max_prefill_tokens must be >= 8 \(--max_batch"):
        flags.check_prefill(Args)
