"""Rows multiply the weights exactly as they would alone (rowwise.py), and so a
request's logits are bitwise the same whatever shares its pass (batch invariance)."""
import numpy as np
import pytest

import batching
import gpt2
import kv_cache
import sampling
import speculative
import readback
from bench import common
from kernels import layout, rowwise, weights
from serving import scheduler

WIDTHS = [(768, 2304), (1024, 4096), (4096, 1024), (1024, 50257)]  # GPT-2's matrices and its head


@pytest.mark.parametrize("order", ["C", "F"])
def test_every_output_of_every_row_is_computed_once(monkeypatch, order):
    """Blocks of 16 outputs and a narrower last one, or (row-major w) a gemv per row."""
    rng = np.random.default_rng(2)
    w = np.asarray(rng.standard_normal((40, 50)), np.float32, order=order)  # [n_in, n_out]
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 16 * 4 * 40)
    for n in (1, 2, 5, 9):
        rows = rng.standard_normal((n, 40)).astype(np.float32)
        out = rowwise.gemv_rows(rows, w)
        assert out.dtype == np.float32 and out.shape == (n, 50)
        np.testing.assert_allclose(out, rows.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_in, n_out", WIDTHS)
def test_each_row_is_bitwise_what_it_is_alone(n_in, n_out):
    rng = np.random.default_rng(n_out)
    w = np.asfortranarray(rng.standard_normal((n_in, n_out), dtype=np.float32))
    rows = rng.standard_normal((12, n_in), dtype=np.float32)
    alone = [rowwise.matmul(rows[i:i + 1], w)[0] for i in range(12)]
    for n in (2, 3, 4, 5, 8, 12):
        out = rowwise.matmul(rows[:n], w)
        assert all(np.array_equal(out[i], alone[i]) for i in range(n)), f"a row of {n} differs from itself alone"
    np.testing.assert_allclose(alone[0], rows[0].astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def test_blas_threads_come_back():
    before = [blas.get_num_threads() for blas in rowwise._blas()]
    assert [blas.get_num_threads() for blas in rowwise._blas()] == before
    with rowwise.blas_threads(1):
        assert all(blas.get_num_threads() == 1 for blas in rowwise._blas())
    assert [blas.get_num_threads() for blas in rowwise._blas()] == before


@pytest.fixture(scope="module")
def wide():
    """A random GPT-2 with 124M's widths (768, 12 heads) but 2 layers and a 256-token
    window: real BLAS kernels, small enough for a test."""
    params, hparams = common.random_params("124M", seed=5, n_ctx=256)
    params = dict(params, blocks=params["blocks"][:2])
    return params, dict(hparams, n_layer=2)


def passes(model, texts_per_step, n_logits_per_step):
    """Run next_logits step by step on one cache; returns each step's logits."""
    cache = kv_cache.init_cache(model[1], len(texts_per_step[0]), 256, like=model[0]["wpe"])
    return [kv_cache.next_logits(model, cache, texts, n_logits)
            for texts, n_logits in zip(texts_per_step, n_logits_per_step)]


def test_a_rows_logits_are_bitwise_the_same_in_any_company(wide):
    """Row A: a 12-token prompt (part of it in a pass of its own), then 1 token, then a
    verification of 4. Beside it: nobody, rows of other lengths, rows verifying more or
    fewer tokens, a row prefilling a long prompt."""
    rng = np.random.default_rng(0)
    A = rng.integers(0, 50257, 12).tolist()
    steps = [A, A + [7], A + [7, 8, 9, 10, 11]]
    n_logits = [1, 1, 4]
    alone = passes(wide, [[s] for s in steps], n_logits)
    others = [rng.integers(0, 50257, n).tolist() for n in (3, 40, 1, 17)]
    companies = [[0, 1], [2, 0], [3, 0, 4, 1]]  # row A's index in each, and the other rows
    for company in companies:
        row_a = company.index(0) if 0 in company else 0
        texts = [[steps[i] if who == 0 else others[who - 1] + [5] * (i * (who + 1)) for who in company]
                 for i in range(3)]
        n_log = [np.array([n_logits[i] if who == 0 else 1 + (who + i) % 5 for who in company]) for i in range(3)]
        got = passes(wide, texts, n_log)
        for i in range(3):
            np.testing.assert_array_equal(got[i][row_a, :n_logits[i]], alone[i][0, :n_logits[i]],
                                          err_msg=f"step {i}, company {company}")


SAMPLED = sampling.SamplingSettings(temperature=1.0, repetition_penalty=1.3)


def requests(n, seed):
    rng = np.random.default_rng(seed)
    return [batching.Request(tuple(rng.integers(0, 50257, rng.integers(1, 30)).tolist()), int(rng.integers(1, 25)),
                             SAMPLED, seed=i) for i in range(n)]


@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
def test_served_sampled_text_equals_the_text_alone(wide, decoder):
    """Full-vocabulary sampling with a repetition penalty, max_batch 2-8, rows joining
    and leaving: every request's text is its text alone (speculative: draft = 1 layer)."""
    assert_served_equals_alone(wide, decoder, requests(12, seed=1), (2, 5, 8))


def assert_served_equals_alone(model, decoder, reqs, max_batches):
    """Every request served among the others (continuous batching at each max_batch)
    gets the text it gets alone; speculative: drafted by the model's own first layer."""
    draft = speculative.model_drafter((dict(model[0], blocks=model[0]["blocks"][:1]), dict(model[1], n_layer=1)))
    config = speculative.SpeculativeConfig(K=3)
    if decoder == "autoregressive":
        serve_with, alone = scheduler.autoregressive(model), lambda r: batching.generate([r], model)[0][0]
    else:
        serve_with = scheduler.speculative_decoder(model, draft, config)
        alone = lambda r: speculative.speculative_generate([r], model, draft, config)[0][0]  # noqa: E731
    want = [alone(r) for r in reqs]
    for max_batch in max_batches:
        finished = {e.index: e.tokens for e in scheduler.serve(reqs, serve_with, max_batch) if e.kind == "finished"}
        assert [finished[i] for i in range(len(reqs))] == want, f"max_batch {max_batch}"


# --- the numba kernel (row_kernel.py): skipped where numba does not import --------------

needs_numba = pytest.mark.skipif(rowwise.pick_kernel("numba") != "numba", reason="numba is not installed")


@needs_numba
@pytest.mark.parametrize("n_in, n_out", WIDTHS + [(16, 48), (1600, 4800), (6400, 1600)])
def test_the_kernel_is_the_product_within_float_rounding(n_in, n_out):
    from kernels import row_kernel
    rng = np.random.default_rng(n_in + n_out)
    w = rng.standard_normal((n_in, n_out), dtype=np.float32)
    rows = rng.standard_normal((5, n_in), dtype=np.float32)
    got = rowwise.matmul(rows, row_kernel.blocked(w), n_out=n_out)
    assert got.dtype == np.float32 and got.shape == (5, n_out)
    want = rows.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))


@needs_numba
@pytest.mark.parametrize("n_in, n_out", [(768, 2304), (1024, 50257), (4096, 1024), (808, 200)])
def test_a_kernel_row_is_bitwise_the_same_for_any_row_count_and_place(n_in, n_out):
    """Row r of 1-16 rows, wherever it sits, equals row r multiplied alone (13 rows on: long
    chunks, where n_in allows them; 808 does not)."""
    from kernels import row_kernel
    rng = np.random.default_rng(7)
    wb = row_kernel.blocked(rng.standard_normal((n_in, n_out), dtype=np.float32))
    rows = rng.standard_normal((16, n_in), dtype=np.float32)
    alone = np.concatenate([rowwise.matmul(rows[i:i + 1], wb, n_out=n_out) for i in range(16)])  # [16, n_out]
    for n in range(2, 17):
        for first in {0, 16 - n}:
            got = rowwise.matmul(rows[first:first + n], wb, n_out=n_out)
            assert np.array_equal(got, alone[first:first + n]), f"{n} rows from {first}"


@needs_numba
def test_the_kernel_takes_float32_only():
    """No silent float64 path: the kernels are compiled for float32 activations and float32 or
    bfloat16 weights (int8: int16 activations; int4: int8), and refuse anything else, compiled or not."""
    from kernels import int4_kernel, int8_kernel, row_kernel, row_ops
    wb = row_kernel.blocked(np.ones((8, 64), np.float32))
    for kernel in (row_kernel.rows_times_blocks, row_kernel.row_times_blocks):
        with pytest.raises(TypeError):
            kernel(np.ones((1, 8)), wb, np.empty((1, 64), np.float32))
        with pytest.raises(TypeError):
            kernel(np.ones((1, 8), np.float32), wb.astype(np.float64), np.empty((1, 64), np.float32))
    with pytest.raises(TypeError):
        int8_kernel.rows_times_pairs(np.ones((2, 8), np.int16), np.ones((2, 1), np.float32),
                                     np.ones((1, 4, 64, 2), np.float64), np.empty((2, 64), np.float32))
    with pytest.raises(TypeError):
        int4_kernel.rows_times_nibbles(np.ones((2, 8), np.int8), np.ones((2, 1), np.float64),
                                       np.ones((2, 1), np.int32), np.ones((1, 2, 4, 32), np.uint8),
                                       np.ones((1, 1, 64), np.uint16), np.empty((2, 64), np.float32), 15, 4)
    with pytest.raises(TypeError):
        row_ops.layer_norm(np.ones((2, 8)), np.ones(8, np.float32), np.zeros(8, np.float32))


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_padded_head_columns_are_never_logits(tiny, dtype):
    """The head's blocks pad the vocabulary to a multiple of 64. Fill the padding with huge
    weights: if any padded column reached the logits it would win every argmax."""
    params, hparams = layout.decode_layout(layout.plain_layout(tiny[2]), "numba", dtype), tiny[1]
    head = params["wte"].T  # a weights.Matrix
    assert head.stored.shape[0] * 64 > hparams["n_vocab"]
    w, scale = head.stored.copy(), None if head.scale is None else head.scale.copy()
    if dtype == "int4":  # the padded columns' nibbles all 15 (q = 7), their scales 1e6 in bfloat16
        from kernels import int4_kernel
        q = readback.unpacked(w)
        q[-1, :, hparams["n_vocab"] % 64:] = 7
        w = int4_kernel.packed(q)
        scale[-1, :, hparams["n_vocab"] % 64:] = 0x4974
    else:
        w[-1, :, hparams["n_vocab"] % 64:] = {"float32": 1e6, "bfloat16": 0x4974, "int8": 127}[dtype]
    if dtype == "int8":
        scale[hparams["n_vocab"]:] = 1e6
    poisoned = dict(params, wte=weights.Embedding(weights.Matrix(w, hparams["n_vocab"], scale)))
    ids = np.array([[464, 2068, 7586, 21831]])
    clean = gpt2.gpt2(ids, **params, n_head=hparams["n_head"])  # [1, 4, n_vocab]
    logits = gpt2.gpt2(ids, **poisoned, n_head=hparams["n_head"])
    assert logits.shape == (1, 4, hparams["n_vocab"])
    np.testing.assert_array_equal(logits, clean)
    cache = kv_cache.init_cache(hparams, 1, 16, like=params["wpe"])
    step = kv_cache.next_logits((poisoned, hparams), cache, [ids[0].tolist()])
    assert step.shape == (1, 1, hparams["n_vocab"]) and step.max() < 1e3


@needs_numba
def test_blocks_refuse_an_input_width_the_kernels_would_read_past():
    from kernels import row_kernel
    with pytest.raises(ValueError, match="multiple of 8 inputs, got a 12 x 64 matrix"):
        row_kernel.blocked(np.ones((12, 64), np.float32))


@pytest.mark.skipif(rowwise.KERNEL != "numba", reason="only the numba kernels compile loops to warm")
def test_each_pass_runs_one_tile_plan_and_the_server_warms_them_all():
    """A pass over R rows splits them into tiles of n or n + 1 rows, n = tile_plan(R): the
    loop compiled for n runs it. A warm-up over a few tokens compiles the loops of the passes
    asked for; the server's reaches every loop, so that no request waits for a compile.
    float32 pads its rows until every tile holds 4 or more (2 or 3 rows to 4, 7 to 8): it
    compiles two tile plans, not four."""
    from cli import loading
    from kernels import row_kernel
    for R in range(2, 300):
        n_tiles, n = -(-R // 6), row_kernel.tile_plan(R)
        sizes, i = [], 0
        for t in range(n_tiles):  # as rows_times_blocks splits them
            sizes.append((R - i) // (n_tiles - t))
            i += sizes[-1]
        assert sum(sizes) == R and set(sizes) <= {n, n + 1} and max(sizes) <= 6 and 2 <= n <= 5, R
        assert n > 2 or sizes == [n], R  # plan 2 compiles its one tile only (int4: plans 1 and 2)
    assert row_kernel.tile_plan(1) == 1
    assert [row_kernel.padded_rows(R, np.float32) for R in range(2, 10)] == [4, 4, 4, 5, 6, 8, 8, 9]
    assert row_kernel.padded_rows(0, np.dtype("float32")) == 4
    assert {row_kernel.loop_for(R, np.float32) for R in range(1, 300)} == {0, 4, 5}
    assert [row_kernel.padded_rows(R, np.uint16) for R in range(2, 10)] == list(range(2, 10))
    for dtype in (np.float32, np.uint16, np.int8, np.uint8):  # what a warm-up over EVERY_TILE compiles reaches every pass
        loops = {row_kernel.loop_for(R, dtype) for R in range(1, 300)}
        assert {row_kernel.loop_for(r, dtype) for r in rowwise.warm_passes(loading.EVERY_TILE, dtype)} == loops
        assert {row_kernel.loop_for(r, dtype) for r in rowwise.warm_passes([1, 9, 100], dtype)} == {
            row_kernel.loop_for(R, dtype) for R in (1, 9, 100)}


@pytest.mark.skipif(rowwise.row_kernel is None, reason="numba is not installed")
@pytest.mark.parametrize("setting, problem", [("NUMBA_NUM_THREADS=0", "numba cannot start (Number of threads"),
                                              ("NUMBA_DISABLE_JIT=1", "NUMBA_DISABLE_JIT=1 leaves the kernels")])
def test_numbas_own_settings_that_stop_its_kernels_are_one_line_naming_them(setting, problem):
    """They were a traceback at import, or one at the first pass; --kernel numpy still runs."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    name, value = setting.split("=")
    env = {**os.environ, name: value}
    env.pop(rowwise.KERNEL_ENV, None)
    script = ("from kernels import rowwise; print(rowwise.KERNEL, rowwise.KERNEL_ERROR); "
              "rowwise.use('numpy'); print(rowwise.KERNEL, rowwise.KERNEL_ERROR)")
    got = subprocess.run([sys.executable, "-c", script],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    first, second = got.stdout.splitlines()
    assert first.startswith(f"numpy {problem}") and "--kernel numpy" in first and second == "numpy None", got


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), ("yes", None), ("true", None)])
def test_the_gpu_kernels_setting_is_1_or_0(monkeypatch, value, on):
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, value)
    if on is None:
        with pytest.raises(ValueError, match=f"GPT2_GPU_KERNELS='{value}': set it to 1 .* or 0"):
            layout.gpu_kernels()
    else:
        assert layout.gpu_kernels() is on
