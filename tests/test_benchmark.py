"""benchmark.py --quick runs end to end in seconds, so the benchmark cannot rot."""
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import benchmark
import cost_model
import cuda_on_cpu
import gpt2
import speculative
from bench import cli as bench_cli, common, gpu, gpu_kernels, llamacpp, report, rows, speculation
from cli import timing
from conftest import fixture_path
from kernels import cuda_graphs, cuda_matmul, layout, rowwise


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
    assert [row["n"] for row in r["rows"]["by_n"]] == list(rows.ROW_COUNTS)
    ways = {"kernel", "gemv", "product"} if r["machine"]["row_kernel"] == "numba" else {"gemv", "product"}
    assert all(row["best"] in ways and all(row[w] > 0 for w in ways) for row in r["rows"]["by_n"])
    if r["machine"]["row_kernel"] == "numba":  # the kernel against the fallback, and the kernel's start
        assert [(k["size"], k["batch"]) for k in r["kernels"]] == [("tiny", 1), ("tiny", 2)]
        assert all(k["ratio"] == pytest.approx(k["numba_tok_s"] / k["numpy_tok_s"]) for k in r["kernels"])
        assert all(k["row_ops_ratio_min"] <= k["row_ops_ratio"] <= k["row_ops_ratio_max"] and k["numpy_ops_tok_s"] > 0
                   for k in r["kernels"])
        start = r["kernel_start"]  # each float32 loop compiled in a fresh Python, then loaded from numba's cache
        assert [tuple(k["loop"]) for k in start["loops"]] == sorted(rowwise.loops(range(1, 8), np.float32), key=str)
        assert all(k["compile_s"] > k["cached_s"] > 0 and k["cost"] > 0 for k in start["loops"])
        assert start["compile_s"] == pytest.approx(sum(k["compile_s"] for k in start["loops"]))
    assert "CPU:" in out and "row kernel:" in out
    spec = r["speculative"]
    assert [k["K"] for k in spec["by_K"]] == [1, 2] and spec["verify"][0] == 1.0
    assert set(spec["draft_over_target"]) == {"0", "1000"}
    e2e = spec["end_to_end"]
    assert e2e[0]["decoder"] == "autoregressive" and {e["draft_vocab"] for e in e2e[1:]} == {0, 1000}
    assert all(e["tok_s"] > 0 and e["predicted"] > 0 and e["predicted_beside"] > 0 for e in e2e[1:])
    # --quick: one run per row, so the model's error is that run's measured / predicted beside - 1
    assert all(e["model_error"] == pytest.approx(e["speedup"] / e["predicted_beside"] - 1) for e in e2e[1:])
    policies = {"static", "continuous"} | ({"continuous, NumPy fallback"} if r["machine"]["row_kernel"] == "numba"
                                           else set())
    assert {row["policy"] for row in r["serving"]} == policies and len(r["serving"]) == 2 + len(policies)
    assert all(row["requests"] == 6 for row in r["serving"])
    assert all(len(row["timeline"]) == 6 for row in r["serving"] if row["policy"] != "continuous, NumPy fallback")
    if r["machine"]["row_kernel"] == "numba":  # weight formats, and the self-draft
        f = r["formats"][0]
        assert [(d["dtype"], d["batch"]) for d in f["decode"]] == [(t, b) for b in (1, 2)
                                                                    for t in ("float32", "bfloat16", "int8", "int4")]
        assert all(d["decode_tok_s"] > 0 for d in f["decode"])
        assert all(d["over_float32"] == 1.0 for d in f["decode"] if d["dtype"] == "float32")
        sizes = {x["dtype"]: x["stored_mib"] for x in f["formats"]}
        assert sizes["bfloat16"] == sizes["float32"] / 2 and sizes["int8"] < sizes["float32"] / 3.5
        assert sizes["int4"] < sizes["float32"] / 6
        assert all(x["rss_anon_mib"] > 0 and x["load_s"] > 0 for x in f["formats"])
        # 4 bits move the logits more: a step is 1/7 of a group's largest weight (weight_formats.py)
        bound = {"bfloat16": (0.1, 0.5), "int8": (0.1, 0.5), "int4": (0.4, 0.3)}
        for dtype, x in [(x["dtype"], x) for x in f["formats"][1:]] + list(r["formats_test_model"].items()):
            assert 0 < x["logits_max_rel_error"] < bound[dtype][0] and bound[dtype][1] < x["top1_agreement"] <= 1, (
                dtype, x)
        fallback = f["numpy_fallback"]
        assert fallback["int8_over_float32"] == pytest.approx(fallback["float32_gemv_s"]
                                                              / fallback["int8_widened_gemv_s"])
        self_draft = r["self_draft"]
        assert self_draft["draft"] == "tiny int8" and 0 < self_draft["natural_alpha"] <= 1
        assert [e["a"] for e in self_draft["end_to_end"][1:]] == [0.9] * len(self_draft["end_to_end"][1:])
        assert "### Weight formats" in open(tmp_path / "results.md").read()
        assert set(f["llama_cpp"]) == {"skipped"}  # the test shapes have no GPT-2 tokenizer for llama.cpp
    assert "| batch |" in open(tmp_path / "results.md").read()


def test_breakdown_splits_each_step_into_drafting_and_verifying(tmp_path):
    assert benchmark.main(["--quick", "--only", "breakdown", "--out", str(tmp_path),
                           "--models_dir", str(tmp_path / "none")]) == 0
    rows = json.load(open(tmp_path / "results.json"))["breakdown"]["rows"]
    assert [(r["a"], r["K"]) for r in rows] == [(0.8, 2)]  # --quick: one a, K = 2, one run
    for r in rows:
        assert 0 < r["draft_ms"] and 0 < r["verify_ms"] and r["draft_ms"] + r["verify_ms"] < r["step_ms"]
        caught_up = r["alpha"] ** 2 * (r["catch_up"] - 1)  # the two-token pass after a step that accepted all
        assert r["draft_ms_predicted"] == pytest.approx((2 + caught_up) * r["c"] * r["target_step_ms"])
        assert 1 <= r["tokens_per_step"] <= 3
    assert "### Where a speculative step's time goes" in open(tmp_path / "results.md").read()


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="the ceiling measures the numba kernels")
def test_ceiling_counts_every_multiply_add(tmp_path):
    """--only ceiling: the loops' rates, and the kernels over the test model's matrices with
    the multiply-adds and bytes a step really has (12 n_embd^2 a layer and the head)."""
    assert benchmark.main(["--quick", "--only", "ceiling", "--out", str(tmp_path),
                           "--models_dir", str(tmp_path / "none")]) == 0
    c = json.load(open(tmp_path / "results.json"))["ceiling"]
    assert {"float32", "int8 x int16"} <= set(c["ceilings"]) and min(c["ceilings"].values()) > 0
    n_embd, _, n_layer = common.SHAPES["tiny"]
    per_row = n_layer * 12 * n_embd ** 2 + 50257 * n_embd
    padded_head = -(-50257 // 64) * 64 * n_embd
    for k in c["kernels"]:
        assert k["multiply_adds_per_s"] * k["ms"] / 1e3 == pytest.approx(k["batch"] * per_row, rel=1e-9)
        weight_bytes = k["weights_GBs"] * 1e9 * k["ms"] / 1e3
        if k["dtype"] == "float32":
            assert weight_bytes == pytest.approx(4 * (per_row - 50257 * n_embd + padded_head), rel=1e-9)
        else:  # one byte a weight and a float32 scale a column
            assert weight_bytes == pytest.approx(per_row - 50257 * n_embd + padded_head + 4 * (
                n_layer * 9 * n_embd + padded_head // n_embd), rel=1e-9)
    assert [(k["batch"], k["dtype"]) for k in c["kernels"]] == [(1, "float32"), (1, "int8"),
                                                                (2, "float32"), (2, "int8")]
    assert "### Ceiling" in open(tmp_path / "results.md").read()


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="narrow weights need the numba row kernel")
def test_speculative_drafts_as_main_does_and_in_float32_beside(tmp_path):
    """By default the draft's matrices in int8 (as main.py runs the users' command), then
    float32 beside it, each named so in the results; the controlled runs still reproduce
    the target's greedy text (controlled_run asserts it)."""
    assert benchmark.main(["--quick", "--only", "speculative", "--self_draft", "none",
                           "--out", str(tmp_path), "--models_dir", str(tmp_path / "none")]) == 0
    r = json.load(open(tmp_path / "results.json"))
    s, beside = r["speculative"], r["speculative_beside"]
    assert s["draft"] == "tiny int8" and s["end_to_end"][1]["speedup"] > 0  # the default: as main.py drafts
    assert [b["draft"] for b in beside] == ["tiny"] and beside[0]["end_to_end"][1]["speedup"] > 0
    md = open(tmp_path / "results.md").read()
    assert "draft tiny int8 -> target tiny" in md and "draft tiny -> target tiny" in md


def test_decode_table_sets_decoding_beside_transformers_decoding():
    """transformers' decode rate (generate(n) - generate(1)) beside ours, and end to end."""
    decode = [{"batch": 8, "cache": True, "decode_tok_s": 300.0, "end_to_end_tok_s": 200.0, "decode_tok_s_min": 1,
               "decode_tok_s_max": 1, "bandwidth_GBs": 1, "roofline_tok_s": 1, "fraction_of_roofline": 1,
               "ttft_ms": 1, "itl_ms_p50": 1, "itl_ms_p90": 1, "kv_cache_bytes_n_ctx": 1}]
    r = {"weights": "random", "load_s": 1, "decode": decode, "context": [], "layout": [],
         "transformers": [{"batch": 8, "tok_s": 100.0, "decode_tok_s": 120.0, "torch": "x", "threads": 2}]}
    assert "| 8 | 200.0 | 100.0 | 2.00x | 300.0 | 120.0 | 2.50x |" in report.decode_tables("124M", r)


def test_controlled_drafter_hits_its_acceptance_rate(tiny):
    """The benchmark's drafter: each draft is accepted with probability a (the papers'
    alpha, estimated over ~400 tokens: within 0.02, where i.i.d. draws stray by 0.026 a
    run), and the text is the target's greedy text."""
    _, hparams, params = tiny
    model = (params, hparams)
    prompt = common.prompt_ids(8)
    truth = prompt + common.greedy([prompt], model, 400)[0][0]
    for seed in range(3):
        stats = speculation.controlled_run(model, model, truth, 0.7, speculative.SpeculativeConfig(K=3), 400, seed)
        assert abs(cost_model.estimate_alpha(stats.accepted, stats.rejected) - 0.7) < 0.02


@pytest.mark.parametrize("a", [0.6, 0.8, 0.83, 0.95])
def test_acceptance_draws_come_in_exact_blocks_and_keep_the_geometric_mean(a):
    """Every block holds exactly a of its outcomes as acceptances, and a step that draws up
    to its first reject (K = 4) yields on average what i.i.d. draws give: (1 - a^(K+1)) / (1 - a)
    tokens a target pass (the papers' expectation)."""
    rng = np.random.default_rng(0)
    L = 100 if a == 0.83 else 20
    draws = speculation.acceptance_draws(a, rng)
    for _ in range(50):
        assert sum(next(draws) for _ in range(L)) == round(a * L)
    K, tokens = 4, []
    for _ in range(20000):
        n = 0
        while n < K and next(draws):
            n += 1
        tokens.append(n + 1)
    assert np.mean(tokens) == pytest.approx((1 - a ** (K + 1)) / (1 - a), rel=0.01)


def test_break_even_alpha():
    costs = cost_model.Costs(0.5, (1.0, 1.5, 2.0))
    a = speculation.break_even_alpha(costs, 1)
    assert cost_model.speedup(a, 1, costs) == pytest.approx(1.0, abs=1e-6)
    assert speculation.break_even_alpha(cost_model.Costs(1.0, (1.0, 3.0)), 1) is None  # never pays


def test_speedup_counts_the_drafts_catch_up_pass():
    """After a step that accepted all K drafts (probability alpha^K) the draft's next
    pass reads two tokens: with catch_up = 2, that pass costs one more draft token."""
    plain, caught = cost_model.Costs(0.5, (1.0, 1.5, 2.0)), cost_model.Costs(0.5, (1.0, 1.5, 2.0), catch_up=2.0)
    assert cost_model.draft_cost(0.8, 2, caught) == pytest.approx(0.5 * (2 + 0.8 ** 2))
    assert cost_model.speedup(0.8, 2, caught) == pytest.approx(
        cost_model.expected_tokens(0.8, 2) / (0.5 * (2 + 0.64) + 2.0))
    assert cost_model.speedup(0.0, 2, caught) == cost_model.speedup(0.0, 2, plain)  # never all accepted


def test_random_params_have_the_real_shapes():
    params, hparams = common.random_params("124M")
    assert hparams["n_layer"] == 12 and len(params["blocks"]) == 12
    # GPT-2 small's 124,439,808 parameters, less wpe and the layer norms' gains and biases
    padding = 4 * 768 * (-(-50257 // 64) * 64 - 50257) if rowwise.in_blocks(params) else 0  # the head's blocks
    assert common.matmul_weight_bytes(params) == 4 * (124_439_808 - 1024 * 768 - 12 * 4 * 768 - 2 * 768) + padding


def test_random_weights_are_the_same_drawn_on_one_core_or_many(monkeypatch):
    shapes = [(3, common.BLOCK + 5), (7,), (2 * common.BLOCK,)]  # blocks that cross rows' ends, and a small one
    many = common.normals(3, shapes)
    monkeypatch.setattr(common, "cores", lambda: 1)
    one = common.normals(3, shapes)
    assert all(a.dtype == np.float32 and a.shape == s and np.array_equal(a, b) for a, b, s in zip(many, one, shapes))
    drawn = np.concatenate([a.reshape(-1) for a in many])
    assert abs(drawn.std() / 0.02 - 1) < 1e-3 and abs(drawn.mean()) < 2e-5  # N(0, 0.02): 6 and 4 sigma
    blocks = drawn[:common.BLOCK], drawn[common.BLOCK:2 * common.BLOCK]
    assert abs(np.corrcoef(*blocks)[0, 1]) < 3e-3  # each block its own stream (6 sigma)


def test_pass_seconds_times_one_cached_pass(tiny):
    """The benchmark's unit of cost (cli/timing.py): the seconds of a cached pass over T
    tokens, a decode step (T = 1) and a verification of 7 drafts (T = 8)."""
    _, hparams, params = tiny
    step = timing.pass_seconds((params, hparams), 16, reps=2)
    verify = timing.pass_seconds((params, hparams), 16, T=8, reps=2)
    assert 0 < step < 10 and 0 < verify < 10


def test_gpu_benchmark_without_cupy_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without CuPy: import cupy fails
    assert benchmark.main(["--backend", "cupy", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --backend cupy needs CuPy and an NVIDIA GPU") and err.count("\n") == 1
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--n_tokens", "0"], "--n_tokens must be >= 1, got 0"),
    (["--batch_sizes", "1", "0"], "--batch_sizes must be >= 1, got 0"),
    (["--prompt_len", "-3"], "--prompt_len must be >= 1, got -3"),
    (["--contexts", "100000"], "--contexts must be below GPT-2's 1024-token window"),
    (["--draft_vocab", "-1"], "--draft_vocab must be >= 0 (0: the whole vocabulary), got -1"),
    (["--n_requests", "0"], "--n_requests must be >= 1, got 0"),
    (["--max_batches", "0"], "--max_batches must be >= 1, got 0"),
    (["--prefix_len", "0"], "--prefix_len must be >= 1, got 0"),
    (["--e2e_alphas", "1.5"], "--e2e_alphas are acceptance rates: each in [0, 1], got [1.5]"),
    (["--K", "0"], "--K must be >= 1, got 0"),
    (["--chunked_budgets", "0"], "--chunked_budgets must each be >= 8, the run's rows, got 0"),
    (["--sizes", "7B"], "argument --sizes: invalid choice: '7B'"),
])
def test_a_flag_the_benchmark_cannot_use_is_one_line_before_anything_runs(tmp_path, capsys, argv, message):
    """Each once ran (a hang, a traceback midway, or a result of nothing); now one line, exit 2."""
    assert benchmark.main(argv + ["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and not out
    assert not (tmp_path / "out").exists()


def test_an_out_folder_the_results_cannot_go_in_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "out" / "results.json").mkdir(parents=True)
    for out, message in ((tmp_path / "a_file", "is not a folder"), (tmp_path / "a_file" / "sub", "is not a folder"),
                         (tmp_path / "out", "holds a folder named results.json")):
        assert benchmark.main(["--quick", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_results_cut_short_leave_no_part_file(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)
    args = benchmark.parse_args(["--quick", "--out", str(tmp_path)])
    with pytest.raises(OSError):
        bench_cli.write_results({}, "table", args)
    assert os.listdir(tmp_path) == []


def test_a_damaged_checkpoint_in_the_models_dir_is_one_line(tmp_path, capsys):
    """The CPU's run let checkpoint.LoadError through as a traceback (only the GPU's caught it)."""
    from conftest import make_model_dir
    d = make_model_dir(str(tmp_path / "models" / "124M"), "tiny-openai")
    with open(os.path.join(d, "model.ckpt.data-00000-of-00001"), "r+b") as f:
        f.truncate(100)
    assert benchmark.main(["--sizes", "124M", "--only", "decode", "--models_dir", str(tmp_path / "models"),
                           "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "re-download" in err and err.count("\n") == 1


def test_a_row_kernel_the_environment_names_wrongly_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(rowwise, "KERNEL_ERROR", "GPT2_ROW_KERNEL must be numba or numpy, got 'bad'")
    assert benchmark.main(["--quick"]) == 2
    assert capsys.readouterr().err == "error: GPT2_ROW_KERNEL must be numba or numpy, got 'bad'\n"


def numpy_as_cupy():
    """A stand-in for CuPy made of NumPy: the GPU benchmark's own code (bench/gpu.py, its
    report) runs on a CPU, so it cannot rot between the sessions that are lent a GPU."""
    import types
    fake = types.ModuleType("cupy")
    fake.__dict__.update({name: getattr(np, name) for name in ("ones", "asarray", "ndarray", "float32")})
    fake.__version__, fake.asnumpy = "NumPy stand-in", np.asarray
    fake.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {
            "name": b"no GPU", "l2CacheSize": 1 << 20}),
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError), Event=cuda_on_cpu.Event,
        get_elapsed_time=cuda_on_cpu.get_elapsed_time)
    return fake


def test_gpu_benchmark_runs_end_to_end(tmp_path, capsys, monkeypatch):
    """Each dtype in turn: the first also through CuPy's operations and, once every dtype has
    its rows, beside transformers' anchors (the compiled one may take minutes)."""
    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    peers = []  # as where transformers is missing: None
    monkeypatch.setattr(gpu, "transformers_apart", lambda size, args, device, variant="generate", timeout_s=0,
                        dtype=None: peers.append((size, variant, dtype)))
    argv = ["--backend", "cupy", "--quick", "--dtype", "float32", "float16", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    r = json.load(open(tmp_path / "results.json"))
    assert r["gpu"] == "no GPU" and r["bandwidth_GBs"] > 0 and r["launch_us"] > 0
    assert list(r["models"]) == ["tiny", "tiny float16"] and list(r["kernels"]) == ["tiny", "tiny float16"]
    assert [m["dtype"] for m in r["models"].values()] == ["float32", "float16"]
    for m in r["models"].values():
        assert [d["batch"] for d in m["decode"]] == [1, 2]
        assert all(d["decode_tok_s"] > 0 and d["sampled_itl_ms_p50"] > 0 for d in m["decode"])
    assert all("eager_itl_ms_p50" in d for d in r["models"]["tiny"]["decode"])
    assert not any("eager_itl_ms_p50" in d for d in r["models"]["tiny float16"]["decode"])
    assert peers == [("tiny", "generate", "float32"), ("tiny", "generate", "float16"),  # the anchors after both
                     ("tiny", "no_mask", "float32"), ("tiny", "static", "float32")]
    assert [row["K"] for row in r["speculative"]["by_K"]] == [1, 2]
    e2e = r["speculative"]["end_to_end"]  # through our kernels' recorded steps (each run checks its text is greedy's)
    assert e2e[0]["decoder"] == "autoregressive" and e2e[0]["tok_s"] > 0
    assert {(e["a"], e["draft_vocab"]) for e in e2e[1:]} == {(0.8, 0), (0.8, 1000)}
    assert all(e["speedup"] > 0 and e["tok_s"] > 0 for e in e2e[1:])
    text = (tmp_path / "results.md").read_text()
    assert "Speculative decoding: draft tiny -> target tiny" in text and "Measured end to end" in text
    kernels = r["kernels"]["tiny"]
    assert [k["kernel"] for k in kernels[:2]] == ["c_attn", "c_attn"] and all(k["us"] > 0 for k in kernels)
    assert kernels[-1]["step_us"] > 0 and "| tiny | head | 64 x 50257 | 8 |" in text


def test_a_gpu_run_stopped_midway_keeps_what_it_measured(tmp_path, monkeypatch):
    """A GPU session's call has a deadline: results.json and results.md hold each model's tables
    as soon as they are measured, whole, before what comes after fails or is cut off."""
    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    monkeypatch.setattr(gpu, "transformers_apart", lambda *a, **k: None)

    def cut_off(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(gpu, "bench_speculative_costs", cut_off)
    with pytest.raises(KeyboardInterrupt):
        benchmark.main(["--backend", "cupy", "--quick", "--only", "decode", "speculative", "--out", str(tmp_path)])
    r = json.load(open(tmp_path / "results.json"))
    assert [d["batch"] for d in r["models"]["tiny"]["decode"]] == [1, 2] and "speculative" not in r
    assert "| tiny | 2 |" in (tmp_path / "results.md").read_text() and sorted(os.listdir(tmp_path)) == [
        "results.json", "results.md"]


def test_each_gpu_kernel_is_timed_in_a_recorded_graph(cupy, monkeypatch):
    """The kernel table's code through our kernels (on a GPU, or the CPU's emulation of one):
    every kernel recorded and replayed, the step replayed; a decode product's launches take
    turns over copies of its weights, L2_TIMES the L2 cache in all, in whole rounds, so that
    each reads them from memory."""
    params, hparams = common.random_params("tiny", n_vocab=512, n_ctx=160)
    model = (layout.device_layout(layout.plain_layout(params), cupy), hparams)
    timings = []  # [{(n_out, n_in): {the weights' address: launches}}]: each timing's launches of a few rows
    launch, device_us = cuda_matmul.launch, gpu_kernels.device_us

    def watched(rows, w, *args, **kwargs):
        if rows.shape[0] <= cuda_matmul.ROWS:
            timings[-1].setdefault(w.shape, collections.Counter())[cuda_graphs.pointer(w)] += 1
        return launch(rows, w, *args, **kwargs)

    def timing(*args, **kwargs):
        timings.append({})
        return device_us(*args, **kwargs)
    monkeypatch.setattr(cuda_matmul, "launch", watched)
    monkeypatch.setattr(gpu_kernels, "device_us", timing)
    rows = gpu_kernels.kernel_rows(cupy, model, reps=1, launches=5, prompt=130)
    l2, itemsize = gpu_kernels.l2_bytes(cupy), np.dtype(np.float32).itemsize
    products = timings[:6 * 2 * (1 + len(gpu_kernels.UNROLLS))]  # each product at 1 and 8 rows, as is and unrolled
    assert all(len(t) == 1 for t in products)
    timed_rows = [r for r in rows[:12] for _ in range(1 + len(gpu_kernels.UNROLLS))]  # its own loads, then UNROLLS
    for (shape, read), r in zip((next(iter(t.items())) for t in products), timed_rows):
        copies = r["copies"]
        assert len(read) == copies == -(-gpu_kernels.L2_TIMES * l2 // (shape[0] * shape[1] * itemsize)), r
        rounds = -(-5 // copies)  # each copy as often in the graph (the first once more: its eager call)
        assert sorted(read.values()) == [rounds] * (copies - 1) + [rounds + 1], (r, read)
    assert rows[0]["copies"] == 3 and rows[2]["copies"] == 8  # (the emulation's L2: 64 KiB)
    assert [r["kernel"] for r in rows] == ["c_attn"] * 2 + ["attn c_proj"] * 2 + ["c_fc"] * 2 + ["mlp c_proj"] * 2 + [
        "head"] * 2 + ["c_attn, its layer norm apart"] * 2 + [
        "c_fc, 4 outputs a warp", "c_fc in 3 launches, an output a warp", "c_fc by cuBLAS (its product alone), eagerly",
        "layer norm", "attention", "attention", "sampling", "a decode step (128 keys)"]
    assert all(r["us"] > 0 for r in rows) and rows[-1]["step_us"] > 0 and rows[-3]["shape"] == "1024 keys, 4 heads"
    assert [r["rows"] for r in rows[12:15]] == [130] * 3 and all(r["TFLOP_s"] > 0 for r in rows[12:15])
    assert all(list(r["unrolled_us"]) == list(gpu_kernels.UNROLLS) and min(r["unrolled_us"].values()) > 0
               for r in rows[:12])  # each product with its loop unrolled otherwise


def test_gpu_benchmark_only_speculative_decodes_nothing_else(tmp_path, capsys, monkeypatch):
    """--only speculative on a GPU: the speculative costs and runs alone (no decode table, no
    transformers), so a GPU session can spend a call on them."""
    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    peers = []
    monkeypatch.setattr(gpu, "transformers_apart", lambda *a, **k: peers.append(a))
    assert benchmark.main(["--backend", "cupy", "--quick", "--only", "speculative", "--out", str(tmp_path)]) == 0
    r = json.load(open(tmp_path / "results.json"))
    e2e = r["speculative"]["end_to_end"]  # plain, then a = 0.8 with each draft vocabulary (at K and at the best K)
    assert r["models"] == {} and not peers and {(e["a"], e["draft_vocab"]) for e in e2e} == {
        (None, None), (0.8, 0), (0.8, 1000)}
    text = (tmp_path / "results.md").read_text()
    assert "transformers tok/s" not in text and "Measured end to end" in text


@pytest.mark.parametrize("peer_format", ["F32", "F16", "Q8_0", "Q4_0"])
def test_gguf_for_llama_cpp_holds_the_same_weights(tiny, tmp_path, peer_format):
    """The llama.cpp peer reads what we wrote: every matrix transposed to GGUF's [n_out, n_in],
    widened back within its format's rounding; norms, biases and positions exact."""
    gguf = pytest.importorskip("gguf")
    params, hparams = layout.plain_layout(tiny[2]), tiny[1]
    path = str(tmp_path / f"tiny-{peer_format}.gguf")
    llamacpp.write_gguf(path, params, hparams, fixture_path("gpt2-tokenizer"), peer_format)
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    written = dict(llamacpp.gguf_tensors(params))
    assert set(stored) == set(written) and len(written) == 2 + 12 * hparams["n_layer"] + 2
    n_embd = hparams["n_embd"]  # llama.cpp's shapes, fastest-varying first: matrices {n_in, n_out}
    assert [list(stored[name].shape) for name in ("token_embd.weight", "blk.0.attn_qkv.weight",
                                                   "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")] == \
        [[n_embd, hparams["n_vocab"]], [n_embd, 3 * n_embd], [n_embd, 4 * n_embd], [4 * n_embd, n_embd]]
    quantized = []
    for name, want in written.items():
        t = stored[name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        if want.ndim == 1 or name == "position_embd.weight" or peer_format == "F32":
            np.testing.assert_array_equal(got, want)
        elif t.tensor_type == gguf.GGMLQuantizationType.F16:  # also Q8_0's rows of fewer than 32
            assert peer_format == "F16" or want.shape[-1] % 32
            np.testing.assert_allclose(got, want, rtol=2 ** -11, atol=2 ** -24)
        else:  # blocks of 32 along a row, a step max/127 (Q8_0) or max/8 each: half a step off, plus the
            # step's float16 rounding; Q4_0 puts the largest |w| at -8, so the other sign's +8 clips to +7: a step
            assert t.tensor_type == getattr(gguf.GGMLQuantizationType, peer_format)
            quantized.append(name)
            levels, off = {"Q8_0": (127, 0.5), "Q4_0": (8, 1.0)}[peer_format]
            blocks = np.abs(want).reshape(-1, 32).max(axis=1, keepdims=True)
            assert np.all(np.abs(got - want).reshape(-1, 32) <= blocks / levels * (off + levels * 2 ** -11))
    assert bool(quantized) == (peer_format in ("Q8_0", "Q4_0"))  # the tiny model's c_proj rows are 64 wide
    model = dict((f.name, f) for f in reader.fields.values())
    assert bytes(model["general.architecture"].parts[-1]).decode() == "gpt2"
    assert int(model["gpt2.block_count"].parts[-1][0]) == hparams["n_layer"]


def test_llama_cpp_computes_our_logits_from_the_gguf(tiny, tmp_path):
    """Where llama-cpp-python is installed: the peer runs our model, not another one."""
    pytest.importorskip("llama_cpp")
    params, hparams = tiny[2], tiny[1]
    path = str(tmp_path / "tiny-F32.gguf")
    llamacpp.write_gguf(path, layout.plain_layout(params), hparams, fixture_path("gpt2-tokenizer"), "F32")
    llm = llamacpp.load(path, hparams["n_ctx"], 1)
    try:
        for ids in ([464], [464, 2068, 7586, 21831, 18045]):
            want = gpt2.gpt2(np.array([ids]), **params, n_head=hparams["n_head"])[0, -1]  # [n_vocab]
            got = llamacpp.last_logits(llm, ids)
            assert np.max(np.abs(got - want)) < 1e-3 * np.max(np.abs(want))  # llama.cpp's GELU: a float16 table
    finally:
        llm.close()


def test_costs_wait_until_the_target_step_settles():
    times, calls = iter([2.0, 1.5, 1.2, 1.0, 1.01, 5.0]), []
    speculation.settle(lambda: calls.append(1) or next(times))
    assert len(calls) == 5  # 1.0 then 1.01: within 5%
    never = []
    speculation.settle(lambda: never.append(1) or 2.0 ** len(never), tries=7)  # doubling: never settles
    assert len(never) == 8


def test_the_gpu_table_sets_ours_beside_transformers_each_way_it_runs():
    """Batch 1 in ms a token: ours, generate() with and without a mask, and compiled with a
    static cache; a peer that failed is its cell's words, not the end of the table."""
    decode = [{"batch": 1, "end_to_end_tok_s": 500.0, "decode_tok_s": 1000.0, "itl_ms_p50": 1.0,
               "sampled_itl_ms_p50": 1.1, "eager_end_to_end_tok_s": 50.0, "eager_decode_tok_s": 60.0, "eager_itl_ms_p50": 17.0}]
    peer = [{"batch": 1, "tok_s": 80.0, "decode_tok_s": 100.0}]
    results = {"gpu": "H100", "cupy": "14.2", "dtype": "float32", "bandwidth_GBs": 3000.0, "launch_us": 12.0,
               "command": "python benchmark.py --backend cupy", "prompt_len": 16, "n_tokens": 64,
               "models": {"124M": {"decode": decode, "weights_at_bandwidth_ms": 0.2, "transformers": peer,
                                   "anchors": {"no_mask": [{"batch": 1, "decode_tok_s": 200.0}],
                                               "static": [{"batch": 1, "decode_tok_s": 400.0}]}},
                          "1558M": {"decode": decode, "weights_at_bandwidth_ms": 2.8, "transformers": peer,
                                    "anchors": {"no_mask": None, "static": {"failed": "crashed (SIGSEGV)"}}}}}
    text = gpu.markdown(results)
    assert "| 124M | 1 | 500.0 | 80.0 | 6.25x | 1.00 | 1.10 | 17.00 | 0.20 |" in text
    assert "| 124M | 1.00 | 10.00 | 5.00 | 2.50 | 2.50x |" in text
    assert "| 1558M | 1.00 | 10.00 | - | crashed (SIGSEGV) | - |" in text


def test_chunked_prefill_section_measures_every_way(tmp_path, capsys):
    """--only chunked: whole, each budget and quiet in turns, each with its latencies and tokens/s."""
    assert benchmark.main(["--quick", "--only", "chunked", "--out", str(tmp_path)]) == 0
    r = json.load(open(tmp_path / "results.json"))
    if rowwise.KERNEL != "numba":
        assert "chunked" not in r and "chunked: skipped" in capsys.readouterr().out
        return
    (run,) = r["chunked"]
    assert [row["way"] for row in run["rows"]] == ["whole", "chunked 8", "quiet"]
    for row in run["rows"]:
        assert 0 < row["itl_ms_p50"] <= row["itl_ms_p99"] <= row["itl_ms_max"] and row["tokens_per_s"] > 0
        if row["way"] != "quiet":  # the quiet turn has no long prompts to time
            assert row["ttft_s"] > 0
    assert "| tiny | chunked 8 |" in open(tmp_path / "results.md").read()


def test_a_long_prompt_is_timed_from_when_its_client_sent_it(tiny, monkeypatch):
    """A prompt sent while another's whole prefill runs is read only when that prefill ends; its
    time to first token counts the wait. The first long prefill is made to take 0.3 s, and the
    second prompt is sent 0.05 s in: its first token comes at least 0.25 s after it was sent."""
    from bench import chunked
    from serving import scheduler
    model, slept = (tiny[2], tiny[1]), []
    step = scheduler.autoregressive(model)[0]

    def slow_first_long_prefill(batch):
        if not slept and any(len(seq.tokens) >= 40 for seq in batch.seqs):
            slept.append(time.sleep(0.3))
        step(batch)
    monkeypatch.setattr(scheduler, "autoregressive", lambda model: (slow_first_long_prefill, {"target": model}))
    gaps, ttft, tokens, seconds = chunked.run_turn(model, [0.0, 0.05], None, 0, 40, 4, 1)
    assert slept and len(ttft) == 2 and min(ttft) >= 0.25


def test_the_gpu_sessions_prepared_run_asks_only_for_what_exists(tmp_path):
    """benchmark_results/gpu_check.sh is a GPU session's one run: a flag the benchmark no longer
    takes, a -k that selects no test, or a probe that does not parse would cost that session its
    15 minutes, as would steps whose caps outlast its deadline (the last cut off). Run with
    `timeout` played by a script that records each command instead, every command it would run
    is checked here: the caps fit, the benchmark's flags parse, each test file exists and each
    -k selects tests, each python -c compiles."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    fake = bin_dir / "timeout"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", os.path.join(root, "benchmark_results", "gpu_check.sh")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in calls.read_text().splitlines()]  # "-k", N, the cap, the command
    steps = [int(c[2]) for c in calls if c[3] != "nvidia-smi" and c[3:5] != ["python3", "-c"]]
    assert sum(steps) <= 570 - 15, steps  # GPU_CHECK_S's deadline: every step runs whole if the probes take 15 s
    commands = [c[3:] for c in calls]
    probes = [c for c in commands if c[:2] == ["python3", "-c"]]
    for command in probes:
        compile(command[2], "python3 -c", "exec")
    commands = [c for c in commands if c not in probes and c[0] != "nvidia-smi"]
    benches = [c[2:] for c in commands if c[:2] == ["python3", "benchmark.py"]]
    tests = [c[c.index("pytest") + 1:] for c in commands if "pytest" in c]
    assert len(benches) == 2 and len(tests) == 4 and len(benches) + len(tests) == len(commands), commands
    for argv in benches:
        assert benchmark.parse_args(argv).backend == "cupy"
    for argv in tests:
        assert all(os.path.isfile(os.path.join(root, a)) for a in argv if a.endswith(".py")), argv
        if "-k" in argv:  # (test_cupy.py, which runs whole, skips itself here: no CuPy)
            collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *argv], cwd=root,
                                       capture_output=True, text=True, timeout=120)
            assert collected.returncode == 0, (argv, collected.stdout[-2000:])
