"""main.py end to end on the tiny GPT-2 laid out as a models dir: offline, through a
local mirror, and every bad input as one clear line with a non-zero exit."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import fileserver
import main
import utils
from conftest import ROOT, make_model_dir

GREEDY = ["--temperature", "0", "--n_tokens_to_generate", "12"]


def run_main(capsys, *argv):
    rc = main.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def texts_of(out):
    """The generated texts, one per '=== ... ===' section."""
    sections = out.split("=== ")[1:]
    return [s.split("\n")[1] for s in sections]


def test_greedy_autoregressive_and_speculative_print_the_same_text(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--draft_model_size", "124M",
                            "--target_model_size", "355M", "--K", "4", *GREEDY)
    assert rc == 0, err
    ar, sp = texts_of(out)
    assert ar == sp and ar.startswith(main.DEFAULT_PROMPT) and len(ar) > len(main.DEFAULT_PROMPT)
    assert "greedy texts identical: yes" in out and "acceptance rate" in out and "speedup" in out


@pytest.mark.parametrize("extra", [["--no_kv_cache"], ["--drafter", "prompt_lookup"], ["--adaptive_K"],
                                   ["--mode", "speculative", "--top_k", "5", "--temperature", "1"],
                                   ["--repetition_penalty", "1.3", "--presence_penalty", "0.5"]])
def test_modes_and_flags_run(capsys, models_dir, extra):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", *GREEDY, *extra)
    assert rc == 0, err
    assert "tokens/s" in out


def test_batch_from_prompts_file(capsys, models_dir, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("The quick brown fox\n\nHello, world!\nIn a shocking finding\n")
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M",
                            "--prompts_file", str(f), *GREEDY)
    assert rc == 0, err
    assert out.count("--- 'Hello, world!'") == 2 and "greedy texts identical: yes" in out


def test_stream_prints_tokens_without_colour_when_not_a_terminal(capsys, models_dir):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--stream", *GREEDY)
    assert rc == 0, err
    assert "\033[" not in out
    ar, sp = texts_of(out)
    assert ar == sp and len(ar) > len(main.DEFAULT_PROMPT)


def test_stream_colours_accepted_drafts_on_a_terminal(tiny):
    enc = tiny[0]
    import io
    buf = io.StringIO()
    old, sys.stdout = sys.stdout, buf
    try:
        show = main.streamer(enc, colour=True)
        for tok, acc in zip(enc.encode("Hello, world!"), [False, True, True, False]):
            show(0, tok, acc)
        for tok in enc.encode("🤖"):  # one emoji, several byte-level tokens
            show(0, tok, False)
    finally:
        sys.stdout = old
    assert buf.getvalue() == f"Hello{main.GREEN},{main.RESET}{main.GREEN} world{main.RESET}!🤖"


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
    """124M: the tiny GPT-2; 355M: a tiny GPT-2 with a 50000-token vocabulary."""
    root = tmp_path_factory.mktemp("odd")
    make_model_dir(str(root / "124M"), "tiny-openai")
    d = make_model_dir(str(root / "355M"), "tiny-hf")
    t = {k: np.asarray(v) for k, v in utils.load_safetensors(os.path.join(d, "model.safetensors")).items()}
    t["wte.weight"] = t["wte.weight"][:50000]
    write_safetensors(os.path.join(d, "model.safetensors"), t)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(cfg, vocab_size=50000), open(os.path.join(d, "config.json"), "w"))
    return str(root)


@pytest.mark.parametrize("argv, message", [
    (["--target_model_size", "125M"], "--target_model_size '125M' is not a GPT-2 size: choose one of 124M"),
    (["--draft_model_size", "../124M"], "--draft_model_size '../124M' is not a GPT-2 size"),
    (["--K", "0"], "--K must be >= 1"),
    (["--K", "40"], "--K must be below 32"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--top_k", "1.5"], "--top_k must be an integer"),
    (["--min_p", "1"], "--min_p must be in [0, 1)"),
    (["--repetition_penalty", "0"], "--repetition_penalty must be > 0"),
    (["--n_tokens_to_generate", "0"], "--n_tokens_to_generate must be >= 1"),
    (["--prompt", "word " * 70], "but GPT-2's context is 64: shorten it"),
    (["--prompt", ""], "a prompt is empty"),
    (["--prompts_file", "/nonexistent/prompts.txt"], "cannot read --prompts_file"),
    (["--prompt", "a", "--prompt", "b", "--stream"], "--stream shows one prompt at a time"),
    (["--dtype", "float16"], "--dtype float16 needs --backend cupy"),
])
def test_bad_input_is_one_clear_line(capsys, models_dir, argv, message):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", *argv)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_models_with_different_vocabularies_are_refused(capsys, odd_vocab_models):
    rc, out, err = run_main(capsys, "--models_dir", odd_vocab_models, "--target_model_size", "124M",
                            "--draft_model_size", "355M")
    assert rc == 2 and "vocabularies differ" in err and err.count("\n") == 1


def test_no_network_and_no_local_files(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(utils.time, "sleep", lambda s: None)  # skip the retry backoff
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9")
    assert rc == 2 and "could not download http://127.0.0.1:9/355M/checkpoint" in err
    assert err.count("\n") == 1
    assert not [f for f in os.listdir(tmp_path / "355M")]  # nothing half-written


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
