"""The forward pass against transformers' reference logits, and its float32 hot path."""
import numpy as np
import pytest

import batching
import gpt2
import kv_cache
import sampling

GREEDY = sampling.SamplingSettings(temperature=0.0)


def test_logits_match_transformers_at_every_position(reference, tiny):
    logits = gpt2.gpt2(reference["input_ids"][None], **tiny[2], n_head=tiny[1]["n_head"])  # [1, 20, n_vocab]
    assert logits.shape == (1, 20, 50257)
    np.testing.assert_allclose(logits[0], reference["logits"], atol=1e-4, rtol=0)


def test_every_c_attn_bias_is_loaded_and_matters(reference, tiny):
    """The attention biases are real weights: zeroing them moves the logits far off
    the reference (the first shared reference was made that way by mistake)."""
    params = tiny[2]
    assert all(np.abs(b["attn"]["c_attn"]["b"]).max() > 0.1 for b in params["blocks"])
    blocks = [dict(b, attn=dict(b["attn"], c_attn=dict(b["attn"]["c_attn"], b=0 * b["attn"]["c_attn"]["b"])))
              for b in params["blocks"]]
    zeroed = gpt2.gpt2(reference["input_ids"][None], **dict(params, blocks=blocks), n_head=2)[0]
    assert np.abs(zeroed - reference["logits"]).max() > 0.5


def test_logits_only_where_asked_equal_full_logits(tiny, reference):
    _, hparams, params = tiny
    ids = reference["input_ids"].tolist()
    full = gpt2.gpt2(np.array([ids]), **params, n_head=2)  # [1, T, n_vocab]
    last = kv_cache.next_logits((params, hparams), None, [ids])  # [1, 1, n_vocab]
    np.testing.assert_allclose(last[0, 0], full[0, -1], atol=1e-5)
    last3 = kv_cache.next_logits((params, hparams), None, [ids], n_logits=3)  # [1, 3, n_vocab]
    np.testing.assert_allclose(last3[0], full[0, -3:], atol=1e-5)


def test_no_more_tokens_than_n_ctx_without_a_cache(tiny):
    _, hparams, params = tiny
    gpt2.gpt2(np.zeros((1, hparams["n_ctx"]), np.int64), **params, n_head=hparams["n_head"])  # the whole window runs
    with pytest.raises(AssertionError, match="at most n_ctx tokens"):
        gpt2.gpt2(np.zeros((1, hparams["n_ctx"] + 1), np.int64), **params, n_head=hparams["n_head"])


def test_hot_path_stays_float32(tiny, reference):
    _, hparams, params = tiny
    x = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    assert gpt2.gelu(x).dtype == np.float32
    assert sampling.softmax(x).dtype == np.float32
    assert gpt2.layer_norm(x, np.ones(16, np.float32), np.zeros(16, np.float32)).dtype == np.float32
    logits = gpt2.gpt2(reference["input_ids"][None], **params, n_head=2)
    assert logits.dtype == np.float32
    counts = sampling.token_counts([[1, 2, 2]], 50257)
    s = sampling.SamplingSettings(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                  frequency_penalty=0.3, repetition_penalty=1.2)
    assert sampling.process_logits(logits[:, -1], counts, s).dtype == np.float32
    assert sampling.probabilities(logits[:, -1], counts, s).dtype == np.float32


def test_greedy_generate_reproduces_transformers(reference, tiny):
    prompt = reference["input_ids"].tolist()
    for use_cache in (True, False):
        out, stats = batching.generate(batching.requests([prompt], 20, GREEDY), (tiny[2], tiny[1]), use_cache)
        assert out[0] == reference["greedy_ids"].tolist()
        assert stats.n_tokens == 20 and stats.tokens_per_s > 0


def test_generate_stops_at_eos_and_streams(tiny, reference):
    _, hparams, params = tiny
    prompt = reference["input_ids"].tolist()
    full, _ = batching.generate(batching.requests([prompt], 10, GREEDY), (params, hparams))
    eos = full[0][3]  # pretend the 4th greedy token is end-of-text
    seen = []
    out, _ = batching.generate(batching.requests([prompt], 10, GREEDY, eos_id=eos), (params, hparams),
                           callback=lambda seq, tok, accepted, logits: seen.append((seq.index, tok, accepted)))
    assert out[0] == full[0][:full[0].index(eos) + 1]
    assert seen == [(0, t, False) for t in out[0]]


def test_every_decoder_runs_the_model_that_section_1_teaches(tiny, monkeypatch):
    """gpt2.gpt2 is what runs: with it replaced by a function that fails, every decoder fails
    (plain, cached and uncached; speculative with a draft model, a vocabulary subset and
    prompt lookup; beam search; the scheduler), so none has a way around it; with it
    counted, each pass is a call."""
    import beam_search
    import speculative
    from serving import scheduler
    _, hparams, params = tiny
    model = (params, hparams)
    draft = speculative.model_drafter((dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)))
    reqs = batching.requests([[464, 2068, 7586, 21831, 625, 262, 16931, 3290, 13, 383, 11]], 6, GREEDY)
    decoders = {
        "plain": lambda: batching.generate(reqs, model),
        "uncached": lambda: batching.generate(reqs, model, use_cache=False),
        "draft model": lambda: speculative.speculative_generate(reqs, model, draft),
        "vocabulary subset": lambda: speculative.speculative_generate(
            reqs, model, draft, speculative.SpeculativeConfig(draft_vocab=1000)),
        "prompt lookup": lambda: speculative.speculative_generate(reqs, model, speculative.PROMPT_LOOKUP),
        "beam search": lambda: beam_search.beam_search([reqs[0].prompt], model, 4),
        "scheduler": lambda: list(scheduler.serve(reqs, scheduler.autoregressive(model))),
    }
    real, calls = gpt2.gpt2, []

    def failing(*args, **kwargs):
        raise RuntimeError("gpt2.gpt2 was called")
    for name, run in decoders.items():
        monkeypatch.setattr(gpt2, "gpt2", failing)
        try:
            run()
            raise AssertionError(f"{name} decoded without gpt2.gpt2")
        except RuntimeError as e:
            assert "gpt2.gpt2 was called" in str(e), name
        monkeypatch.setattr(gpt2, "gpt2", lambda *a, **k: calls.append(name) or real(*a, **k))
        run()
        assert calls.count(name) >= 6 or name == "beam search" and calls.count(name) >= 4, name
