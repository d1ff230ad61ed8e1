"""An optional peer cannot take the benchmark down (bench/peers.py): each runs in a process
of its own, and its crash or refusal is its own line in the results.

The stand-in peers here are this module's functions, run in the peer's process (they
pickle by name): the benchmark never needs llama.cpp or transformers for these tests.
Imports stay light at the top, since every peer process imports this module.
"""
import json
import os
import resource
import signal

import pytest


def segfault(*_):
    """Die as native code does on a bad pointer (and leave no core file behind)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signal.SIGSEGV)


def stand_in_open(path, n_ctx, n_threads, ids, want):
    """llama.cpp's peer_open, had it loaded the file and found our logits."""
    return {"version": "stand-in llama.cpp", "logits_max_rel_error": 0.0, "same_top1": True}


def stand_in_decode(path, prompt, n_tokens):
    """F32 and Q4_0 decode at 100 tok/s, F16 refuses, Q8_0 dies in its decode."""
    if "Q8_0" in path:
        segfault()
    if "F16" in path:
        raise RuntimeError("no F16 here")
    return 100.0


def stand_in_close(path):
    pass


def test_a_peer_runs_apart_and_its_end_is_one_line():
    from bench import peers
    assert peers.run_apart(os.getpid) != os.getpid()  # another process
    with pytest.raises(peers.PeerFailed, match=r"^crashed \(SIGSEGV\)$"):
        peers.run_apart(segfault)
    with pytest.raises(peers.PeerFailed, match=r"^refused \(RuntimeError: no F16 here\)$"):
        peers.run_apart(stand_in_decode, "gpt2-tiny-F16.gguf", [1], 1)
    with pytest.raises(peers.PeerFailed, match=r"^exited with code 3$"):
        peers.run_apart(os._exit, 3)


def test_a_segfaulting_llama_cpp_leaves_the_other_results_written(models_dir, tmp_path, monkeypatch, capsys):
    """--only formats on the tiny test model (in models_dir as 124M), beside a stand-in
    llama.cpp whose Q8_0 segfaults while decoding and whose F16 refuses: every format of
    ours is measured and written, the F32 peer has its row, and each failure is a line."""
    from kernels import rowwise
    if rowwise.KERNEL != "numba":
        pytest.skip("the formats section needs the numba row kernel")
    import benchmark
    from bench import llamacpp
    monkeypatch.setattr(llamacpp, "MISSING", None)
    monkeypatch.setattr(llamacpp, "write_gguf", lambda path, *_: open(path, "wb").write(b"GGUF"))
    monkeypatch.setattr(llamacpp, "peer_open", stand_in_open)
    monkeypatch.setattr(llamacpp, "peer_decode_tok_s", stand_in_decode)
    monkeypatch.setattr(llamacpp, "peer_close", stand_in_close)
    argv = ["--only", "formats", "--sizes", "124M", "--models_dir", models_dir, "--reps", "1", "--n_tokens", "4",
            "--prompt_len", "8", "--format_batches", "1", "--out", str(tmp_path), "--img_dir", str(tmp_path / "img")]
    assert benchmark.main(argv) == 0
    f = json.load(open(tmp_path / "results.json"))["formats"][0]
    assert [(d["dtype"], d["decode_tok_s"] > 0) for d in f["decode"]] == [("float32", True), ("bfloat16", True),
                                                                          ("int8", True), ("int4", True)]
    assert [x["weights"] for x in f["formats"]] == ["real"] * 4  # the test model, loaded in each format
    peer = f["llama_cpp"]
    assert [(d["format"], d["decode_tok_s"]) for d in peer["decode"]] == [("F32", 100.0), ("Q4_0", 100.0)]
    assert [(x["format"], x["while"], x["why"]) for x in peer["failed"]] == [
        ("F16", "decoding", "refused (RuntimeError: no F16 here)"), ("Q8_0", "decoding", "crashed (SIGSEGV)")]
    md = open(tmp_path / "results.md").read()
    assert "- llama.cpp Q8_0 (124M), decoding: crashed (SIGSEGV)" in md
    assert "- llama.cpp F16 (124M), decoding: refused (RuntimeError: no F16 here)" in md
    assert "| 124M | float32 | " in md and "| F32 | 100.0 (100.0-100.0) |" in md
    assert "llama.cpp Q8_0 (124M), decoding: crashed (SIGSEGV)" in capsys.readouterr().out


def test_a_peer_that_fails_to_load_is_its_line(tmp_path, monkeypatch):
    """A peer that dies loading its file, or whose F32 logits are not ours, times nothing."""
    from bench import llamacpp
    monkeypatch.setattr(llamacpp, "write_gguf", lambda path, *_: open(path, "wb").write(b"GGUF"))
    monkeypatch.setattr(llamacpp, "peer_open", segfault)
    live, record = llamacpp.start_peers({}, {}, "tiny", ["float32", "int8"], str(tmp_path), 16, [1], None)
    assert live == {} and [(x["format"], x["while"], x["why"]) for x in record["failed"]] == [
        ("F32", "loading", "crashed (SIGSEGV)"), ("Q8_0", "loading", "crashed (SIGSEGV)")]


def test_a_crashing_transformers_peer_is_its_line(monkeypatch):
    """transformers' generate() beside ours: a crash is the decode table's line, not the end."""
    from bench import report, transformers_peer
    monkeypatch.setattr(transformers_peer, "missing", lambda: False)  # as if installed
    monkeypatch.setattr(transformers_peer, "bench_transformers", segfault)
    failed = transformers_peer.transformers_apart("tiny", None)
    assert failed == {"failed": "crashed (SIGSEGV)"}
    r = {"weights": "random", "load_s": 0.1, "decode": [], "context": [], "layout": [], "transformers": failed}
    assert "transformers' generate() on the same shapes: crashed (SIGSEGV)" in report.decode_tables("tiny", r)
