"""Beam search against Hugging Face transformers (v5.23, tests/fixtures/beam_search.json, made
by make_beam_fixtures.py): the same token ids and scores on the tiny GPT-2, with all three
prompts searched together in one batch (transformers ran each alone)."""
import json
import os
import sys

import pytest

import batching
import beam_search
import sampling
import speculative
from conftest import ROOT, fixture_path
from kernels import layout

with open(fixture_path("beam_search.json")) as f:
    FIXTURES = json.load(f)


@pytest.fixture(scope="module")
def model(tiny):
    _, hparams, params = tiny
    return params, hparams


@pytest.mark.parametrize("case", FIXTURES["cases"], ids=[c["name"] for c in FIXTURES["cases"]])
def test_same_tokens_and_scores_as_transformers(model, case):
    s = case["settings"]
    settings = beam_search.BeamSettings(num_beams=s["num_beams"], length_penalty=s.get("length_penalty", 1.0),
                                        early_stopping=s.get("early_stopping", False),
                                        num_return_sequences=s.get("num_return_sequences", 1),
                                        no_repeat_ngram_size=s.get("no_repeat_ngram_size", 0),
                                        repetition_penalty=s.get("repetition_penalty", 1.0))
    got = beam_search.beam_search(case["prompts"], model, case["max_new_tokens"], settings, eos_id=case["eos_id"])
    for hyps, want in zip(got, case["outputs"]):
        assert len(hyps) == len(want)
        for (tokens, score), w in zip(hyps, want):
            padded = tokens + [case["eos_id"]] * (len(w["tokens"]) - len(tokens))  # transformers pads with EOS
            assert padded == w["tokens"]
            # each token's log prob within 1e-4 (the logits' standard), through sum / length ** penalty
            length = len(tokens)
            assert score == pytest.approx(w["score"], abs=1e-4 * length / length ** settings.length_penalty)


def test_the_fixtures_exercise_what_they_claim():
    """Some beams end at EOS before the length limit, so hypotheses of different lengths compete;
    and with early_stopping True one prompt of the batch is done while another runs to the limit."""
    early = [c for c in FIXTURES["cases"] if c["name"].startswith("eos early")]
    lengths = {len([t for t in o["tokens"] if t != c["eos_id"]]) for c in early for out in c["outputs"] for o in out}
    assert len(early) == 9 and len(lengths) > 1
    apart = [c for c in FIXTURES["cases"] if "prompts ending apart" in c["name"]]
    for c in apart:
        ends = [max(len([t for t in o["tokens"] if t != c["eos_id"]]) for o in out) for out in c["outputs"]]
        assert c["settings"]["early_stopping"] is not True or min(ends) < c["max_new_tokens"] == max(ends), c["name"]
    assert len(apart) == 24


def test_one_beam_is_greedy_decoding(model):
    prompts = [p for p in FIXTURES["cases"][0]["prompts"]]
    got = beam_search.beam_search(prompts, model, 10, beam_search.BeamSettings(num_beams=1))
    greedy = batching.generate(batching.requests(prompts, 10, sampling.SamplingSettings(temperature=0.0)), model)[0]
    assert [h[0][0] for h in got] == greedy


@pytest.mark.parametrize("kw, name", [
    ({"num_beams": 0}, "num_beams"), ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ({"early_stopping": "sometimes"}, "early_stopping"), ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
])
def test_bad_settings_are_refused_by_name(model, kw, name):
    """By the setting's name (main.py says which flag; the library knows no flags)."""
    with pytest.raises(sampling.BadSetting) as e:
        beam_search.beam_search([[464]], model, 4, beam_search.BeamSettings(**kw))
    assert e.value.name == name and str(e.value).startswith(name)


def test_past_the_window_is_refused_with_a_reason(model):
    with pytest.raises(ValueError, match="inside GPT-2's 64-token window"):
        beam_search.beam_search([list(range(60))], model, 10, beam_search.BeamSettings(num_beams=2))




@pytest.mark.parametrize("case", FIXTURES["greedy"], ids=lambda c: f"n={c['no_repeat_ngram_size']}")
def test_no_repeat_ngram_size_in_every_decoder_is_transformers_greedy(model, case):
    """The n-gram ban is a sampling setting: plain and speculative greedy decoding (the draft
    sees the ban along its drafts, the target along each verified prefix) both give
    transformers' greedy text, which differs from greedy text without the ban."""
    settings = sampling.SamplingSettings(temperature=0.0, no_repeat_ngram_size=case["no_repeat_ngram_size"])
    reqs = batching.requests(case["prompts"], case["max_new_tokens"], settings)
    plain = batching.generate(reqs, model)[0]
    assert plain == case["outputs"]
    params, hparams = model
    small = speculative.model_drafter((dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)))
    for drafter in (small, speculative.PROMPT_LOOKUP):
        assert speculative.speculative_generate(reqs, model, drafter, speculative.SpeculativeConfig(K=3))[0] == plain
    unbanned = batching.generate(batching.requests(case["prompts"], case["max_new_tokens"],
                                               sampling.SamplingSettings(temperature=0.0)), model)[0]
    assert unbanned != plain
    whole = sampling.SamplingSettings(temperature=0.0, no_repeat_ngram_size=float(case["no_repeat_ngram_size"]))
    assert batching.generate(batching.requests(case["prompts"], case["max_new_tokens"], whole), model)[0] == plain


@pytest.mark.parametrize("n", [2, 3])
def test_sampled_text_never_repeats_an_ngram(model, n):
    settings = sampling.SamplingSettings(temperature=1.5, no_repeat_ngram_size=n)
    prompts = [[464, 464, 2068], [15496, 11, 995]]
    reqs = batching.requests(prompts, 40, settings, seed=3)
    params, hparams = model
    small = speculative.model_drafter((dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)))
    for out in (batching.generate(reqs, model)[0],
                speculative.speculative_generate(reqs, model, small, speculative.SpeculativeConfig(K=3))[0]):
        for prompt, new in zip(prompts, out):
            text = prompt + new
            grams = [tuple(text[i:i + n]) for i in range(len(text) - n + 1)]
            new_grams = grams[len(prompt) - n + 1:] if len(prompt) >= n else grams
            assert all(grams.count(g) == 1 for g in new_grams)


def test_the_trace_draws_the_beams_of_a_run(model, tiny, tmp_path):
    """img/make_beam_tree.py's picture: one box per beam and step, one line per beam that grew on."""
    sys.path.insert(0, os.path.join(ROOT, "img"))
    import make_beam_tree
    trace = []
    got = beam_search.beam_search([[464, 2068]], model, 6, beam_search.BeamSettings(num_beams=3), trace=trace)
    assert len(trace) == 6 and all(0 <= k < 3 for step in trace for k in step["src"][0])
    svg = make_beam_tree.draw("The quick", trace, tiny[0], 3)
    assert svg.count("<rect") == 1 + 6 * 3 and svg.count("<line") == 5 * 3
    assert got[0][0][1] == pytest.approx(trace[-1]["finished"][0][0][0])  # the best finished hypothesis


def test_more_beams_than_the_memory_holds_a_step_of_are_refused(model, monkeypatch):
    """--num_beams 100000 was the OS killing main.py: 100000 rows of 50257 scores, copied a few
    times a step, are 150 GiB."""
    monkeypatch.setattr(layout, "memory", lambda on_gpu=False: ("this machine's", 24 << 30))
    with pytest.raises(sampling.BadSetting, match=r"asks for 100000 beams in all, whose scores \(50257 each, 8 "
                                                  r"copies a step\) take 149\.8 GiB, more than this machine's memory "
                                                  r"\(24\.0 GiB\)"):
        beam_search.beam_search([[1, 2]], model, 3, beam_search.BeamSettings(num_beams=100000))
