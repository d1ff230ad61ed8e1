"""benchmark.py --quick runs end to end in seconds, so the benchmark cannot rot."""
import json
import sys

import benchmark


def test_quick_benchmark_writes_every_measurement(tmp_path, capsys):
    assert benchmark.main(["--quick", "--out", str(tmp_path), "--models_dir", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "random weights" in out and "plots skipped" in out
    r = json.load(open(tmp_path / "results.json"))
    assert r["machine"]["bandwidth_GBs"] > 0
    tiny = r["models"]["tiny"]
    assert tiny["weights"] == "random"
    assert [d["batch"] for d in tiny["decode"]] == [1, 2, 1]
    assert all(d["decode_tok_s"] > 0 and d["roofline_tok_s"] > 0 and d["bandwidth_GBs"] > 0 for d in tiny["decode"])
    assert tiny["context"][0]["cached_ms"] > 0
    assert [x["tokens"] for x in tiny["layout"]] == [1, 8] and all(x["speedup"] > 0 for x in tiny["layout"])
    spec = r["speculative"]
    assert [k["K"] for k in spec["costs"]["by_K"]] == [1, 2]
    assert {e["decoder"] for e in spec["end_to_end"]} == {"autoregressive", "oracle",
                                                         "prompt_lookup (grounded prompt)", "draft model"}
    oracle = [e for e in spec["end_to_end"] if e["decoder"] == "oracle"][0]
    assert oracle["acceptance"] == 1.0  # the oracle proposes the target's own greedy tokens
    assert "| batch |" in open(tmp_path / "results.md").read()


def test_random_params_have_the_real_shapes():
    params, hparams = benchmark.random_params("124M")
    assert hparams["n_layer"] == 12 and len(params["blocks"]) == 12
    # GPT-2 small's 124,439,808 parameters, less wpe and the layer norms' gains and biases
    assert benchmark.matmul_weight_bytes(params) == 4 * (124_439_808 - 1024 * 768 - 12 * 4 * 768 - 2 * 768)


def test_gpu_benchmark_without_cupy_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without CuPy: import cupy fails
    assert benchmark.main(["--backend", "cupy", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --backend cupy needs CuPy and an NVIDIA GPU") and err.count("\n") == 1
    assert not (tmp_path / "results.json").exists()
