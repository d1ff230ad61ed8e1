"""main.py end to end on the tiny GPT-2 laid out as a models dir: offline, through a
local mirror, and every bad input as one clear line with a non-zero exit."""
import json
import os
import struct
import subprocess
import sys
import types

import numpy as np
import pytest

import batching
import beam_search
import checkpoint
import cost_model
import fileserver
import main
import sampling
import speculative
import utils
from conftest import ROOT, make_model_dir
from cli import flags, printing, timing
from kernels import rowwise

GREEDY = ["--temperature", "0", "--n_tokens_to_generate", "12"]


def run_main(capsys, *argv):
    rc = main.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def results(models_dir, *argv):
    """main.run's results for these flags: {decoder: {"texts", "tokens", "stats"}}."""
    return main.run(main.parse_args(["--models_dir", models_dir, *argv]))


def test_greedy_autoregressive_and_speculative_print_the_same_text(capsys, models_dir, monkeypatch):
    # the advice rests on costs timed on this machine; fixed costs make it checkable
    costs = cost_model.Costs(0.1, (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4), 1.5)
    monkeypatch.setattr(timing, "measure_costs", lambda *args, **kwargs: costs)
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--draft_model_size", "124M",
                            "--target_model_size", "355M", "--K", "4", *GREEDY)
    assert rc == 0, err
    assert out.count(main.DEFAULT_PROMPT) == 2 and "greedy texts identical: yes" in out
    assert "acceptance alpha 1.00" in out and "drafts accepted 100.0%" in out and "speedup" in out
    # alpha = 1 (the tiny draft is the target): (K + 1) / (0.1 (K + 0.5) + 1 + 0.2 K) grows with K, so K_max = 7
    assert "advice: at this run's acceptance (alpha = 1.00)" in out
    assert f"K = 7 is expected fastest: {cost_model.speedup(1.0, 7, costs):.2f}x plain decoding" in out
    # the draft is int8 by default where the kernels run it: nothing to advise; the fallback says why not
    assert ("draft 124M int8" in out) == (rowwise.KERNEL == "numba") and "advice: a draft in int8" not in out
    assert ("the draft runs in float32" in out + err) == (rowwise.KERNEL != "numba")


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="narrow weights need the numba row kernel")
@pytest.mark.parametrize("dtype, advised", [("float32", True), ("int8", False)])
def test_a_float32_draft_asked_for_is_advised_the_default(capsys, models_dir, monkeypatch, dtype, advised):
    monkeypatch.setattr(timing, "measure_costs", lambda *args, **kwargs: cost_model.Costs(0.1, (1.0, 1.2), 1.5))
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--draft_model_size", "124M", "--draft_dtype",
                            dtype, "--target_model_size", "355M", "--K", "1", "--K_max", "1", *GREEDY)
    assert rc == 0, err
    assert "advice: at this run's acceptance" in out and "greedy texts identical: yes" in out
    assert ("advice: a draft in int8 (the default: leave out --draft_dtype)" in out) == advised


NO_LOOP_FIRST_USED_WHILE_TIMED = """import json, sys
import main
from cli import printing, timing, warm
from kernels import compiling
timed = []
def timing_no_compile(fn):
    def wrapped(*args, **kwargs):
        before = len(compiling.first_uses)
        out = fn(*args, **kwargs)
        timed.append(compiling.first_uses[before:])
        return out
    return wrapped
printing.decode = timing_no_compile(printing.decode)
timing.measure_costs = timing_no_compile(timing.measure_costs)
warm.compile_ahead = lambda *args: __import__('contextlib').nullcontext()  # the warm-up alone (test_compiling.py checks what compiles ahead)
assert main.main(sys.argv[1:]) == 0
print(json.dumps({"timed": timed, "warmed": compiling.first_uses}))
"""


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="the numba kernels compile; the fallback does not")
@pytest.mark.parametrize("argv", [["--mode", "autoregressive", "--prompt", "a" * 30],
                                  ["--draft_model_size", "124M", "--K", "4"],
                                  ["--draft_model_size", "124M", "--K", "2", "--prompt", "x"]])
def test_no_kernel_loop_is_first_needed_while_a_decoder_is_timed(models_dir, argv):
    """main.py warms every loop its run will use before it times anything (in a fresh
    process, where no loop is loaded yet): the decoders' stats and the advice's costs never
    include a compile."""
    out = subprocess.run([sys.executable, "-c", NO_LOOP_FIRST_USED_WHILE_TIMED, "--models_dir", models_dir,
                          "--target_model_size", "355M", "--n_tokens_to_generate", "12", *argv],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["warmed"] and got["timed"] and not any(got["timed"]), got


def test_measured_costs_are_in_target_steps(tiny):
    """measure_costs times real passes: one entry per K, verify(1) is a step by definition, and
    a pass over more tokens never costs less than one over fewer (the tiny model's passes take
    about as long whatever their tokens: its verifications' timings are noise around a step)."""
    _, hparams, params = tiny
    costs = timing.measure_costs((params, hparams), (params, hparams), 3, draft_vocab=100)
    assert len(costs.verify) == 4 and costs.verify[0] == 1.0 and list(costs.verify) == sorted(costs.verify)
    assert costs.draft > 0 and costs.catch_up > 0


@pytest.mark.parametrize("n_ctx", [2, 3, 16])
def test_measured_costs_time_a_few_drafts_within_the_window(tiny, n_ctx):
    """A K of 100000 times TIMED_K drafts at most (cost_model extrapolates past them), and a
    checkpoint with a short window is timed within it (each text once ran past wpe)."""
    _, hparams, params = tiny
    short = (dict(params, wpe=params["wpe"][:n_ctx]), dict(hparams, n_ctx=n_ctx))
    costs = timing.measure_costs(short, short, 100000, K=100000)
    assert len(costs.verify) == min(timing.TIMED_K, n_ctx - 2) + 1 and costs.draft > 0 and costs.catch_up > 0
    assert cost_model.best_K(0.9, costs, 100000) >= 1


def test_the_advice_says_so_where_plain_decoding_is_expected_fastest(capsys, models_dir, monkeypatch):
    monkeypatch.setattr(timing, "measure_costs", lambda *args, **kwargs: cost_model.Costs(0.9, (1.0, 1.5), 1.5))
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--draft_model_size", "124M",
                            "--target_model_size", "355M", "--K", "1", "--K_max", "1", *GREEDY)
    expected = cost_model.speedup(1.0, 1, cost_model.Costs(0.9, (1.0, 1.5), 1.5))  # 2 tokens for 0.9 + 1.5 steps
    assert rc == 0 and expected < 1, err
    assert f"plain decoding is expected fastest (K = 1: {expected:.2f}x)" in out and "expected fastest: " not in out


@pytest.mark.parametrize("length", [60, 61, 62, 63, 64, 70])
def test_greedy_texts_agree_at_the_window_edge(models_dir, length):
    """The issue's repro: prompts of 60-63 tokens on the tiny model (n_ctx 64), K 4."""
    prompt = " x" * length  # " x" is one token
    r = results(models_dir, "--prompt", prompt, "--K", "4", "--target_model_size", "124M", *GREEDY)
    assert r["autoregressive"]["tokens"] == r["speculative"]["tokens"]
    assert r["autoregressive"]["texts"][0]


@pytest.mark.parametrize("extra", [["--no_kv_cache"], ["--drafter", "prompt_lookup"], ["--adaptive_K"],
                                   ["--draft_vocab", "3000"], ["--draft_vocab", "3000", "--adaptive_K"],
                                   ["--repetition_penalty", "1.3", "--presence_penalty", "0.5"],
                                   ["--K", "40"], ["--K", "3", "--adaptive_K", "--K_max", "200"]])
def test_greedy_flags_keep_the_texts_identical(models_dir, extra):
    r = results(models_dir, "--target_model_size", "124M", "--n_tokens_to_generate", "70", "--temperature", "0",
                *extra)
    assert r["autoregressive"]["tokens"] == r["speculative"]["tokens"]
    assert len(r["autoregressive"]["tokens"][0]) == 70 or r["autoregressive"]["tokens"][0][-1] == 50256


def test_sampled_texts_are_said_to_differ_as_draws_not_as_a_bug(capsys, models_dir):
    """The users' command samples (temperature 0.8, top-p 0.9): both decoders' texts follow
    the target's distribution, and the run says why they still differ."""
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M",
                            "--n_tokens_to_generate", "8")
    assert rc == 0, err
    assert "sampled: the two texts are different draws" in out and "greedy texts identical" not in out


def test_sampled_modes_run(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--mode",
                            "speculative", "--top_k", "5", "--temperature", "1", "--n_tokens_to_generate", "12")
    assert rc == 0, err
    assert "tokens/s" in out and "greedy texts identical" not in out


def test_same_seed_same_text_with_adaptive_K(models_dir):
    flags = ["--target_model_size", "355M", "--draft_model_size", "124M", "--adaptive_K", "--temperature", "1",
             "--top_k", "40", "--n_tokens_to_generate", "40", "--seed", "3", "--mode", "speculative"]
    a, b = (results(models_dir, *flags)["speculative"]["tokens"] for _ in range(2))
    c = results(models_dir, *flags[:-4], "--seed", "4", "--mode", "speculative")["speculative"]["tokens"]
    assert a == b and a != c


@pytest.mark.parametrize("extra", [["--temperature", "1e-45"], ["--temperature", "1e-30"],
                                   ["--repetition_penalty", "0.01"], ["--frequency_penalty", "2"],
                                   ["--presence_penalty=-2"], ["--top_p", "1e-30"], ["--min_p", "0.999"]])
def test_extreme_settings_in_range_give_sane_text(models_dir, extra):
    r = results(models_dir, "--target_model_size", "124M", "--n_tokens_to_generate", "20", *extra)
    for decoder in r.values():
        tokens = decoder["tokens"][0]
        assert len(tokens) == 20 or tokens[-1] == 50256
        assert tokens != [0] * len(tokens)  # NaN probabilities used to give token 0, "!!!!"


def test_batch_from_prompts_file(capsys, models_dir, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The quick brown fox\n\nHello, world!\nIn a shocking finding\n")
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M",
                            "--prompts_file", str(f), *GREEDY)
    assert rc == 0, err
    assert out.count("--- 'Hello, world!'") == 2 and "greedy texts identical: yes" in out


def test_serving_a_prompts_file_with_continuous_batching(capsys, models_dir, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("".join(f"Prompt number {i} is\n" for i in range(7)))
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--prompts_file",
                            str(f), "--max_batch", "3", *GREEDY)
    assert rc == 0, err
    assert out.count("--- request ") == 14 and "continuous batching of up to 3" in out
    assert "first token after" in out and "7 requests, 84 tokens" in out and "greedy texts identical: yes" in out
    served = results(models_dir, "--target_model_size", "124M", "--prompts_file", str(f), "--max_batch", "3",
                     "--mode", "autoregressive", *GREEDY)
    static = results(models_dir, "--target_model_size", "124M", "--prompts_file", str(f), "--mode",
                     "autoregressive", *GREEDY)
    assert served["autoregressive"]["texts"] == static["autoregressive"]["texts"]


def test_a_prompts_file_with_a_byte_order_mark_reads_as_without(models_dir, tmp_path):
    """Windows editors start UTF-8 files with a BOM (and end lines with CRLF): it is not text."""
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("Hello, world!\nIn a shocking finding\n", encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbfHello, world!\r\nIn a shocking finding\r\n")
    want, got = (results(models_dir, "--target_model_size", "124M", "--prompts_file", str(f), "--mode",
                         "autoregressive", *GREEDY)["autoregressive"]["texts"] for f in (plain, marked))
    assert got == want


def test_a_prompt_longer_than_the_window_is_served_as_it_is_decoded(capsys, models_dir, tmp_path):
    """80 tokens into the tiny model's 64-token window: with and without --max_batch the
    window slides, the same note is printed, the same text comes out, and the exit is 0."""
    f = tmp_path / "prompts.txt"
    f.write_text(" x" * 80 + "\nHello, world!\n")
    outs = []
    for extra in ([], ["--max_batch", "2"]):
        rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--prompts_file",
                                str(f), *GREEDY, *extra)
        assert rc == 0, err
        assert "note: a prompt is 80 tokens, more than GPT-2's 64-token window" in out and "error" not in out + err
        outs.append(out)
    texts = [[line for line in out.splitlines() if line.startswith(" x x")] for out in outs]
    assert texts[0] == texts[1] and len(texts[0]) == 2  # both decoders, same text in both paths


def test_beam_search_prints_each_prompts_best_texts_with_scores(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--num_beams", "3",
                            "--num_return_sequences", "2", "--n_tokens_to_generate", "8", "--prompt", "Hello",
                            "--prompt", "The quick brown fox")
    assert rc == 0, err
    encoder, hparams, params = utils.load_model_dir(os.path.join(models_dir, "124M"))
    want = beam_search.beam_search([encoder.encode("Hello"), encoder.encode("The quick brown fox")],
                                   (params, hparams), 8, beam_search.BeamSettings(3, num_return_sequences=2),
                                   encoder.eot_token)
    for prompt, hyps in zip(["Hello", "The quick brown fox"], want):
        for rank, (tokens, score) in enumerate(hyps):
            assert f"--- {prompt!r} #{rank + 1}, score {score:.3f}\n{prompt}{encoder.decode(tokens)}\n" in out


def test_beam_search_past_the_window_is_refused(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--num_beams", "2",
                            "--n_tokens_to_generate", "70")
    assert rc == 2 and "inside GPT-2's 64-token window" in err and err.count("\n") == 1


def test_empty_prompt_is_unconditional_generation(models_dir):
    r = results(models_dir, "--prompt", "", "--target_model_size", "124M", *GREEDY)
    assert r["autoregressive"]["tokens"] == r["speculative"]["tokens"] and len(r["autoregressive"]["tokens"][0]) > 0


def test_a_prompt_longer_than_the_window_gets_a_note(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M",
                            "--prompt", " x" * 70, *GREEDY)
    assert rc == 0, err
    assert "note: a prompt is 70 tokens, more than GPT-2's 64-token window: the model sees its last 37" in out
    assert "greedy texts identical: yes" in out


def test_the_drafts_flags_with_autoregressive_mode_get_a_note_that_they_change_nothing(capsys, models_dir):
    """--mode autoregressive (a server's default) with a draft's flags ran without them and
    said nothing: a user who left out --mode speculative believed the draft ran."""
    base = ("--models_dir", models_dir, "--target_model_size", "124M", "--mode", "autoregressive", "--prompt", "x",
            "--n_tokens_to_generate", "3")
    rc, out, err = run_main(capsys, *base, "--K", "7", "--drafter", "prompt_lookup")
    assert rc == 0, err
    assert ("note: --mode autoregressive decodes with the target alone and leaves --K, --drafter unused "
            "(--mode speculative drafts)") in out
    rc, out, err = run_main(capsys, *base)
    assert rc == 0 and "note:" not in out + err


def test_a_draft_models_flags_with_prompt_lookup_get_a_note_that_they_change_nothing(capsys, models_dir):
    """Prompt lookup drafts from the text: no draft model is loaded, so its size, format and
    vocabulary subset change nothing."""
    base = ("--models_dir", models_dir, "--target_model_size", "124M", "--mode", "speculative", "--prompt", "x",
            "--n_tokens_to_generate", "3", "--drafter", "prompt_lookup")
    rc, out, err = run_main(capsys, *base, "--draft_vocab", "100", "--draft_dtype", "float32", "--K", "3")
    assert rc == 0, err
    assert ("note: --drafter prompt_lookup drafts from the text itself and leaves --draft_vocab, --draft_dtype "
            "unused (--drafter model runs the draft model)") in out
    rc, out, err = run_main(capsys, *base, "--K", "3")
    assert rc == 0 and "note:" not in out + err


def streamed_and_printed(tiny, model, decode):
    """What the streamer writes, and the final decode of the same tokens."""
    encoder = tiny[0]
    written = []
    show, finish = printing.streamer(encoder, colour=False, write=written.append)
    out, _ = decode(show)
    finish()
    return "".join(written), encoder.decode(out[0])


def test_stream_equals_the_printed_text_over_many_seeds(tiny):
    """Random tokens split UTF-8 characters (and make invalid bytes) all the time: the
    streamed text must still add up to the final text, replacement characters included."""
    _, hparams, params = tiny
    model = (params, hparams)
    draft = speculative.model_drafter((dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)))
    s = sampling.SamplingSettings(temperature=1.5)
    replaced = 0
    for seed in range(40):
        reqs = batching.requests([[464, 2068]], 30, s, seed)
        streamed, printed = streamed_and_printed(tiny, model, lambda cb: batching.generate(reqs, model, callback=cb))
        assert streamed == printed
        config = speculative.SpeculativeConfig(K=3)
        streamed, printed = streamed_and_printed(
            tiny, model, lambda cb: speculative.speculative_generate(reqs, model, draft, config, callback=cb))
        assert streamed == printed
        replaced += "\ufffd" in printed
    assert replaced > 5  # the seeds did produce invalid bytes


def test_stream_prints_tokens_without_colour_when_not_a_terminal(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--stream", *GREEDY)
    assert rc == 0, err
    assert "\033[" not in out and "greedy texts identical: yes" in out


def test_stream_colours_accepted_drafts_on_a_terminal(tiny):
    enc = tiny[0]
    written = []
    show, finish = printing.streamer(enc, colour=True, write=written.append)
    for tok, acc in zip(enc.encode("Hello, world!"), [False, True, True, False]):
        show(None, tok, acc)
    for tok in enc.encode("🤖"):  # one emoji, several byte-level tokens
        show(None, tok, False)
    show(None, enc.encode("é")[0], False)
    show(None, enc.encode("😀")[0], False)  # a partial character at the end
    finish()
    text = "".join(written)
    assert text == f"Hello{printing.GREEN},{printing.RESET}{printing.GREEN} world{printing.RESET}!🤖é\ufffd"
    assert text.replace(printing.GREEN, "").replace(printing.RESET, "") == enc.decode(
        enc.encode("Hello, world!🤖é") + enc.encode("😀")[:1])


def test_downloads_through_a_local_mirror_then_runs(capsys, tmp_path):
    make_model_dir(str(tmp_path / "srv" / "124M"), "tiny-openai")
    os.remove(tmp_path / "srv" / "124M" / "vocab.bpe")
    make_model_dir(str(tmp_path / "srv" / "124M"), "tiny-openai")
    server = fileserver.start(str(tmp_path / "srv"))
    try:
        rc, out, err = run_main(capsys, "--models_dir", str(tmp_path / "models"), "--target_model_size", "124M",
                                "--draft_model_size", "124M", "--base_url", server.url, *GREEDY)
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path / "models" / "124M")) == sorted(utils.OPENAI_FILES)
    assert "greedy texts identical: yes" in out


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.fixture(scope="module")
def odd_vocab_models(tmp_path_factory):
    """124M: the tiny GPT-2; 355M: a tiny GPT-2 with a tokenizer of 50000 tokens (GPT-2's
    first 49743 merges) and as many rows of wte."""
    root = tmp_path_factory.mktemp("odd")
    make_model_dir(str(root / "124M"), "tiny-openai")
    d = make_model_dir(str(root / "355M"), "tiny-hf")
    with open(os.path.join(d, "vocab.bpe"), encoding="utf-8") as f:
        merges = f.read().split("\n")
    with open(os.path.join(d, "vocab.bpe"), "w", encoding="utf-8") as f:
        f.write("\n".join(merges[:1 + 50000 - 257]) + "\n")  # a version line, then the merges
    encoder = json.load(open(os.path.join(d, "encoder.json"), encoding="utf-8"))
    json.dump({k: v for k, v in encoder.items() if v < 50000 - 1}, open(os.path.join(d, "encoder.json"), "w"))
    t = {k: np.asarray(v) for k, v in checkpoint.load_safetensors(os.path.join(d, "model.safetensors")).items()}
    t["wte.weight"] = t["wte.weight"][:50000]
    write_safetensors(os.path.join(d, "model.safetensors"), t)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(cfg, vocab_size=50000), open(os.path.join(d, "config.json"), "w"))
    return str(root)


@pytest.mark.parametrize("argv, message", [
    (["--target_model_size", "125M"], "argument --target_model_size: invalid choice: '125M'"),
    (["--draft_model_size", "../124M"], "argument --draft_model_size: invalid choice: '../124M'"),
    (["--K", "0"], "--K must be >= 1"),
    (["--K", "four"], "argument --K: invalid int value: 'four'"),
    (["--K", "5", "--adaptive_K", "--K_max", "4"], "--K_max must be >= K"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--top_k", "1.5"], "argument --top_k: invalid int value: '1.5'"),
    (["--min_p", "1"], "--min_p must be in [0, 1)"),
    (["--repetition_penalty", "0"], "--repetition_penalty must be in [0.01, 100]"),
    (["--repetition_penalty", "1e-40"], "--repetition_penalty must be in [0.01, 100]"),
    (["--frequency_penalty", "1e39"], "--frequency_penalty must be in [-2, 2]"),
    (["--presence_penalty=-1e39"], "--presence_penalty must be in [-2, 2]"),
    (["--n_tokens_to_generate", "0"], "--n_tokens_to_generate must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--prompts_file", "/nonexistent/prompts.txt"], "cannot read --prompts_file"),
    (["--prompt", "a", "--prompt", "b", "--stream"], "--stream shows one prompt at a time"),
    (["--dtype", "float16"], "--dtype float16 needs --backend cupy"),
    (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["--max_batch", "0"], "--max_batch must be >= 1"),
    (["--draft_vocab", "-5"], "--draft_vocab must be >= 0"),
    (["--max_batch", "4", "--stream"], "leave out --stream and --no_kv_cache"),
    (["--prefix_cache_mib", "-1"], "--prefix_cache_mib must be >= 0"),
    (["--max_prefill_tokens", "0"], "--max_prefill_tokens must be >= 1"),
    (["--max_batch", "8", "--max_prefill_tokens", "4"], "--max_prefill_tokens must be >= 8 (--max_batch"),
    (["--num_beams", "0"], "--num_beams must be an integer >= 1"),
    (["--num_beams", "2", "--num_return_sequences", "3"], "--num_return_sequences must be in [1, num_beams = 2]"),
    (["--num_beams", "2", "--mode", "speculative"], "leave out --mode speculative/both"),
    (["--num_beams", "2", "--stream", "--presence_penalty", "0.5"], "leave out --stream, --presence_penalty"),
    (["--num_beams", "2", "--early_stopping", "sometimes"], "argument --early_stopping: invalid choice"),
    (["--num_beams", "2", "--temperature", "0.5", "--seed", "3"], "leave out --temperature, --seed"),
    (["--num_beams", "2", "--K", "6", "--drafter", "prompt_lookup"], "leave out --K, --drafter"),
    (["--num_beams", "3", "--draft_dtype", "int8", "--max_prefill_tokens", "32"],
     "leave out --max_prefill_tokens, --draft_dtype"),
    (["--num_return_sequences", "0"], "--num_return_sequences: only beam search reads them: add --num_beams N"),
    (["--length_penalty", "2", "--early_stopping", "never"], "--length_penalty, --early_stopping: only beam search"),
    (["--no_repeat_ngram_size", "-1"], "--no_repeat_ngram_size must be an integer >= 0"),
])
def test_bad_input_is_one_clear_line_before_anything_loads(capsys, tmp_path, argv, message):
    """An empty --models_dir: a model would have to be downloaded, so the flags are
    checked before that."""
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9", *argv)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not os.listdir(tmp_path)  # nothing was downloaded or created


def test_a_prefix_cache_larger_than_the_gpu_is_refused_with_backend_cupy(monkeypatch):
    """With --backend cupy the prefix cache's blocks live in the GPU's memory (beside its KV
    cache), so that is what its budget is checked against, not the host's."""
    runtime = types.SimpleNamespace(memGetInfo=lambda: (1 << 29, 1 << 30))  # (free, total): a 1 GiB GPU
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    with pytest.raises(ValueError, match=r"--prefix_cache_mib 2048 is more than this GPU's memory \(1024 MiB\)"):
        flags.check_prefix_cache(types.SimpleNamespace(prefix_cache_mib=2048, backend="cupy"))
    flags.check_prefix_cache(types.SimpleNamespace(prefix_cache_mib=2048, backend="numpy"))  # the host holds 2 GiB
    flags.check_prefix_cache(types.SimpleNamespace(prefix_cache_mib=1024, backend="cupy"))


def test_a_prompts_file_of_blank_lines_is_refused(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n   \n\n")
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path / "m"), "--prompts_file", str(f))
    assert rc == 2 and "holds no prompt (only blank lines)" in err and err.count("\n") == 1


def test_models_with_different_vocabularies_are_refused(capsys, odd_vocab_models):
    rc, out, err = run_main(capsys, "--models_dir", odd_vocab_models, "--target_model_size", "124M",
                            "--draft_model_size", "355M")
    assert rc == 2 and err.startswith("error: --draft_model_size vocabulary (50000 tokens) differs")
    assert err.count("\n") == 1


def test_a_draft_vocab_past_the_vocabulary_is_refused_before_the_weights_download(capsys, tmp_path):
    """--draft_vocab is bounded by the target's vocabulary, which its small files give: so the
    run stops before it would fetch the weights (here from nowhere), not after the first decoder."""
    model_dir = make_model_dir(str(tmp_path / "355M"), "tiny-openai")
    for f in os.listdir(model_dir):
        if f not in utils.SMALL_FILES:
            os.remove(os.path.join(model_dir, f))
    small = sorted(os.listdir(model_dir))
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9",
                            "--draft_vocab", "50258")
    assert rc == 2
    assert err == "error: --draft_vocab must be at most the vocabulary's 50257 tokens (0 = all of them), got 50258\n"
    assert sorted(os.listdir(model_dir)) == small and sorted(os.listdir(tmp_path)) == ["355M"]  # nothing fetched


def test_a_vocabulary_unlike_its_tokenizers_is_refused_before_the_weights_download(capsys, tmp_path):
    """A model of fewer tokens than its tokenizer makes would leave ids that index nothing."""
    model_dir = make_model_dir(str(tmp_path / "355M"), "tiny-openai")
    for f in os.listdir(model_dir):
        if f not in utils.SMALL_FILES:
            os.remove(os.path.join(model_dir, f))
    path = os.path.join(model_dir, "hparams.json")
    json.dump(dict(json.load(open(path)), n_vocab=1000), open(path, "w"))
    small = sorted(os.listdir(model_dir))
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {model_dir}: the model has 1000 tokens, its tokenizer 50257: delete")
    assert sorted(os.listdir(model_dir)) == small  # nothing fetched


def test_no_network_and_no_local_files(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(utils.time, "sleep", lambda s: None)  # skip the retry backoff
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9")
    assert rc == 2 and "could not download http://127.0.0.1:9/355M/encoder.json" in err  # the small files first
    assert err.count("\n") == 1
    assert not (tmp_path / "355M").exists()  # nothing half-written, not even an empty folder


def test_unwritable_models_dir(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path / "file" / "models"))
    assert rc == 2 and "cannot write to" in err and "pass a writable --models_dir" in err


def test_corrupt_checkpoint_from_the_command_line_has_no_traceback(tmp_path):
    d = make_model_dir(str(tmp_path / "124M"), "tiny-openai")
    with open(os.path.join(d, "model.ckpt.data-00000-of-00001"), "r+b") as f:
        f.truncate(1000)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "--models_dir", str(tmp_path),
                        "--target_model_size", "124M", "--draft_model_size", "124M"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "truncated" in r.stderr and r.stderr.count("\n") == 1


def test_cupy_backend_without_cupy_is_one_clear_line(capsys, models_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without CuPy: import cupy fails
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--backend", "cupy")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --backend cupy needs CuPy and an NVIDIA GPU") and "pip install cupy" in err


def test_a_bad_row_kernel_setting_is_one_line(capsys, models_dir, monkeypatch):
    with pytest.raises(ValueError, match="GPT2_ROW_KERNEL='cuda': set it to numba or numpy"):
        rowwise.pick_kernel("cuda")
    monkeypatch.setattr(rowwise, "KERNEL_ERROR", "GPT2_ROW_KERNEL='cuda': set it to numba or numpy (or unset it)")
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--mode",
                            "autoregressive")
    assert rc == 2 and err.strip() == "error: GPT2_ROW_KERNEL='cuda': set it to numba or numpy (or unset it)"


def kernels_forbidden(monkeypatch):
    """Every function of the numba kernels raises if called (without numba there are none)."""
    if rowwise.row_kernel is None:
        return
    from kernels import int8_kernel, row_kernel, row_ops
    for module in (row_ops, row_kernel, int8_kernel):
        for name, value in vars(module).items():
            if callable(value) and getattr(value, "__module__", "").startswith("kernels."):
                monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} was called"))


def test_kernel_numpy_runs_gpt2s_own_numpy_and_its_greedy_text_is_transformers(models_dir, reference,
                                                                               monkeypatch, capsys):
    """--kernel numpy: every pass is gpt2.py's NumPy (a numba kernel called fails the test),
    plain and speculative, cached and not, and the greedy tokens are transformers' own."""
    encoder = utils.load_encoder(os.path.join(models_dir, "124M"))
    prompt = encoder.decode(reference["input_ids"].tolist())
    monkeypatch.setattr(rowwise, "KERNEL", rowwise.KERNEL)  # restored after the test
    argv = ["--prompt", prompt, "--target_model_size", "124M", "--draft_model_size", "355M", "--K", "3",
            "--n_tokens_to_generate", "20", "--ignore_eos", "--temperature", "0"]
    if rowwise.row_kernel is not None:  # the guard works: the kernels' own run trips it
        with monkeypatch.context() as m:
            kernels_forbidden(m)
            with pytest.raises(pytest.fail.Exception):
                results(models_dir, *argv, "--kernel", "numba")
    kernels_forbidden(monkeypatch)
    for extra in ([], ["--no_kv_cache"]):
        r = results(models_dir, *argv, "--kernel", "numpy", *extra)
        assert rowwise.KERNEL == "numpy"
        for decoder in ("autoregressive", "speculative"):
            assert r[decoder]["tokens"][0] == reference["greedy_ids"].tolist()


def test_kernel_numba_without_numba_is_one_line(capsys, models_dir, monkeypatch):
    monkeypatch.setattr(rowwise, "row_kernel", None)  # as where numba cannot be imported
    monkeypatch.setattr(rowwise, "KERNEL", rowwise.KERNEL)
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--kernel", "numba")
    assert rc == 2 and err.count("\n") == 1 and "--kernel numba needs numba" in err
