"""bfloat16, int8 and int4 weights (weight_formats.py, the kernels): the conversions are what
they claim, the kernels multiply what is stored, every row comes out as it would alone,
and a narrow draft leaves speculative decoding exact."""
import os

import numpy as np
import pytest

import cost_model
import gpt2
import kv_cache
import main
import sampling
import utils
import readback
from bench import common
from kernels import rowwise, weight_formats
from test_rowwise import assert_served_equals_alone, requests
from test_speculative import N_CTX, PROMPTS, chi_square_ok, first_tokens, plain, spec
from kernels import layout

needs_numba = pytest.mark.skipif(rowwise.pick_kernel("numba") != "numba", reason="numba is not installed")
NARROW = ["bfloat16", "int8", "int4"]
GREEDY = sampling.SamplingSettings(temperature=0.0)


def test_bfloat16_rounds_to_nearest_ties_to_even():
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
                        np.array([0.0, -0.0, 1.0, -2.5, 3.3e38, 1e-40], np.float32)]).astype(np.float32)
    h = weight_formats.to_bfloat16(w)
    assert h.dtype == np.uint16
    down = weight_formats.from_bfloat16(h).astype(np.float64)
    # the bfloat16 neighbours of each chosen value: none is nearer to w
    for step in (-1, 1):
        other = weight_formats.from_bfloat16((h.astype(np.int64) + step).astype(np.uint16)).astype(np.float64)
        finite = np.isfinite(other)
        err, err_other = np.abs(down - w), np.abs(other - w)
        assert (err[finite] <= err_other[finite]).all()
        tie = finite & (err == err_other)
        assert (h[tie] % 2 == 0).all()  # a tie goes to the even neighbour
    # ties constructed exactly: halfway between two bfloat16 values
    halfway = ((np.arange(1, 200, dtype=np.uint32) << 16) | 0x8000).view(np.float32)
    assert (weight_formats.to_bfloat16(halfway) % 2 == 0).all()
    exact = weight_formats.from_bfloat16(np.arange(0, 0x7F80, 7, dtype=np.uint16))
    np.testing.assert_array_equal(weight_formats.from_bfloat16(weight_formats.to_bfloat16(exact)), exact)


def test_int8_is_symmetric_per_output_column_within_half_a_step():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 70)).astype(np.float32) * rng.uniform(0.01, 5, 70).astype(np.float32)
    w[:, 3] = 0  # a column of zeros (the head's padding)
    q, scale = weight_formats.to_int8(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (70,)
    assert scale[3] == 0 and not q[:, 3].any()
    assert (np.abs(q).max(axis=0)[np.arange(70) != 3] == 127).all() and q.min() >= -127
    back = weight_formats.from_int8(q, scale)
    assert (np.abs(back - w) <= scale / 2 * (1 + 1e-5) + 1e-12).all()


def test_int4_is_symmetric_per_group_of_32_and_column_within_half_a_step():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((320, 70)).astype(np.float32) * rng.uniform(0.01, 5, 70).astype(np.float32)
    w[:, 3] = 0  # a column of zeros (the head's padding)
    w[37, 5] = 100.0  # an outlier: only its own group's step grows
    q, sw = weight_formats.to_int4(w)
    assert q.dtype == np.int8 and sw.dtype == np.uint16 and sw.shape == (10, 70)
    scale = weight_formats.from_bfloat16(sw)  # [10, 70]
    assert (scale[:, 3] == 0).all() and not q[:, 3].any() and np.abs(q).max() == 7
    np.testing.assert_array_equal(sw, weight_formats.to_bfloat16(np.abs(w).reshape(10, 32, 70).max(1) / 7))
    back = readback.from_int4(q, sw)
    step = np.repeat(scale, 32, axis=0)
    assert (np.abs(back - w) <= step / 2 * (1 + 1e-5) + 1e-12).all()  # half a step, each
    assert scale[1, 5] > 10 * np.delete(scale[:, 5], 1).max()  # the outlier's group alone


@needs_numba
def test_int4_packs_two_weights_a_byte_where_the_kernel_reads_them():
    from kernels import int4_kernel
    q = np.random.default_rng(3).integers(-7, 8, (3, 16, 64)).astype(np.int8)
    qb = int4_kernel.packed(q)
    assert qb.shape == (3, 4, 4, 32) and qb.dtype == np.uint8 and qb.flags.c_contiguous
    # quad 2 (inputs 8..11), set 1 (columns 16..31), column 16 + 5 (low nibble) and 16 + 8 + 5 (high)
    assert [qb[1, 2, 1, 4 * 5 + i] & 15 for i in range(4)] == [q[1, 8 + i, 21] + 8 for i in range(4)]
    assert [qb[1, 2, 1, 4 * 5 + i] >> 4 for i in range(4)] == [q[1, 8 + i, 29] + 8 for i in range(4)]
    np.testing.assert_array_equal(readback.unpacked(qb), q)


def narrow_blocks(w, dtype):
    return layout.kernel_blocks(w, dtype)


def widened(stored, n_out):
    """The float32 matrix [n_in, n_out] that stored blocks hold."""
    from kernels import row_kernel
    wb = stored.stored
    if wb.dtype == np.uint8:
        return row_kernel.unblocked(readback.from_int4(readback.unpacked(wb), stored.scale), n_out)
    if wb.ndim == 4:
        wb = readback.unpaired(wb)
    if wb.dtype == np.uint16:
        wb = weight_formats.from_bfloat16(wb)
    elif wb.dtype == np.int8:
        wb = weight_formats.from_int8(wb, stored.scale.reshape(wb.shape[0], -1), axis=1)
    return row_kernel.unblocked(wb, n_out)


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("n_in, n_out", [(16, 48), (768, 2304), (1600, 4800), (4096, 1024)])
def test_the_kernel_multiplies_the_stored_weights(dtype, n_in, n_out):
    rng = np.random.default_rng(n_in + n_out)
    st = narrow_blocks(rng.standard_normal((n_in, n_out), dtype=np.float32), dtype)
    rows = rng.standard_normal((5, n_in), dtype=np.float32)
    got = rowwise.matmul(rows, st.stored, n_out=n_out, scale=st.scale)
    assert got.dtype == np.float32 and got.shape == (5, n_out)
    w = widened(st, n_out).astype(np.float64)  # [n_in, n_out]
    want = rows.astype(np.float64) @ w
    if dtype != "int4":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(n_in))
        return
    # int4's kernel rounds each activation to 8 bits per group: within half its group's step
    c = weight_formats.int4_group(n_in)
    half_step = np.repeat(np.abs(rows).reshape(5, -1, c).max(-1) / 127 / 2, c, axis=1)  # [5, n_in]
    assert (np.abs(got - want) <= half_step @ np.abs(w) * (1 + 1e-3) + 1e-4).all()


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("n_in, n_out", [(768, 2304), (1024, 50257), (4096, 1024)])
def test_a_narrow_row_is_bitwise_the_same_for_any_row_count_and_place(dtype, n_in, n_out):
    rng = np.random.default_rng(7)
    st = narrow_blocks(rng.standard_normal((n_in, n_out), dtype=np.float32), dtype)
    rows = rng.standard_normal((16, n_in), dtype=np.float32)

    def mm(x):
        return rowwise.matmul(x, st.stored, n_out=n_out, scale=st.scale)
    alone = np.concatenate([mm(rows[i:i + 1]) for i in range(16)])  # [16, n_out]
    for n in range(2, 17):
        for first in {0, 16 - n}:
            assert np.array_equal(mm(rows[first:first + n]), alone[first:first + n]), f"{n} rows from {first}"


@needs_numba
@pytest.mark.parametrize("dtype", ["float32"] + NARROW)
def test_embeddings_are_read_from_the_heads_stored_weights(tiny, dtype):
    _, hparams, params = tiny
    fast = layout.decode_layout(layout.plain_layout(params), "numba", dtype)
    ids = np.array([[0, 5, 63, 64, 50256], [1, 2, 3, 4, 40000]])
    got = fast["wte"][ids]  # [2, 5, n_embd]
    want = widened(fast["wte"].T, hparams["n_vocab"]).T[ids]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    if dtype == "float32":
        np.testing.assert_array_equal(got, layout.plain_layout(params)["wte"][ids])


@pytest.fixture(scope="module")
def wide_formats():
    """wide (test_rowwise.py: 124M's widths, 2 layers) in every format."""
    params, hparams = common.random_params("124M", seed=5, n_ctx=256)
    plain_params = layout.plain_layout(dict(params, blocks=params["blocks"][:2]))
    hparams = dict(hparams, n_layer=2)
    return {dtype: (layout.decode_layout(plain_params, "numba", dtype), hparams) for dtype in ["float32"] + NARROW}


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
def test_a_narrow_models_logits_are_bitwise_the_same_in_any_company(wide_formats, dtype):
    """Row A decoded alone, then beside rows of other lengths and logit counts."""
    model = wide_formats[dtype]
    rng = np.random.default_rng(0)
    A = rng.integers(0, 50257, 12).tolist()
    others = [rng.integers(0, 50257, n).tolist() for n in (3, 40, 1, 17)]

    def step(texts, n_logits):
        cache = kv_cache.init_cache(model[1], len(texts), 256, like=model[0]["wpe"])
        return kv_cache.next_logits(model, cache, texts, n_logits)
    alone = step([A], np.array([3]))[0]
    for company in ([A] + others[:1], others[1:3] + [A], others + [A]):
        got = step(company, np.array([3 if t is A else 1 + len(t) % 4 for t in company]))
        np.testing.assert_array_equal(got[company.index(A), :3], alone)


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_logits_stay_near_float32_and_keep_the_hot_path_float32(wide_formats, dtype):
    ids = np.random.default_rng(2).integers(0, 50257, (1, 40))
    full = gpt2.gpt2(ids, **wide_formats["float32"][0], n_head=12)
    got = gpt2.gpt2(ids, **wide_formats[dtype][0], n_head=12)
    assert got.dtype == np.float32
    rel = np.abs(got - full).max() / np.abs(full).max()
    assert 0 < rel < {"bfloat16": 0.02, "int8": 0.05, "int4": 0.35}[dtype]  # int4 measured 0.23: 4 bits' step
    assert (got.argmax(-1) == full.argmax(-1)).mean() > {"bfloat16": 0.5, "int8": 0.5, "int4": 0.4}[dtype]


@pytest.fixture(scope="module")
def self_drafts(tiny):
    """The tiny GPT-2 (float32, the target) and its own copies in each narrow format."""
    _, hparams, params = tiny
    plain_params = layout.plain_layout(params)
    return (params, hparams), {d: (layout.decode_layout(plain_params, "numba", d), hparams) for d in NARROW}


@needs_numba
@pytest.mark.parametrize("dtype, share", [("bfloat16", 0.5), ("int8", 0.25), ("int4", (0.5 + 2 / 16) / 4)])
def test_a_narrow_self_drafts_estimated_cost_is_its_share_of_the_bytes(self_drafts, dtype, share):
    """Adaptive K's default costs: the same weights in fewer bytes are a cheaper draft (as
    parameters alone, c would be 1 and K would fall to 1)."""
    target, drafts = self_drafts
    costs = cost_model.default_costs(target, drafts[dtype])
    assert costs.draft == share
    assert cost_model.best_K(0.9, costs, 7) >= 3


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("K", [1, 4, 7])
def test_greedy_with_a_narrow_self_draft_is_greedy_float32(self_drafts, dtype, K):
    target, drafts = self_drafts
    want = [plain([p], target, 30)[0] for p in PROMPTS]
    out, stats = spec(PROMPTS, target, drafts[dtype], 30, K)
    assert out == want and stats.accepted > 0


@needs_numba
@pytest.mark.parametrize("K", [2, 5])
def test_greedy_with_an_int8_self_draft_across_the_window_edge(self_drafts, K):
    """Prompts ending 0-3 tokens before the window's edge, on it and past it, 45 new
    tokens each, batched: the int8 self-draft gives the float32 greedy text."""
    target, drafts = self_drafts
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, n).tolist() for n in (N_CTX - 3, N_CTX - 1, N_CTX, 80)]
    assert spec(prompts, target, drafts["int8"], 45, K)[0] == plain(prompts, target, 45)


@needs_numba
@pytest.mark.parametrize("decoder", ["autoregressive", "speculative"])
def test_an_int8_models_sampled_text_is_its_text_alone_among_others(wide_formats, decoder):
    """Full-vocabulary sampling, max_batch 2 and 5, rows joining and leaving: each
    request's text from the int8 model (speculative: drafted by its own first layer)
    is its text alone."""
    assert_served_equals_alone(wide_formats["int8"], decoder, requests(8, seed=2), (2, 5))


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
def test_a_narrow_target_with_a_float32_draft_is_greedy_narrow(self_drafts, dtype):
    """The exactness is the target's, whatever it stores: an int8 target verified against
    a float32 draft decodes as the int8 model does alone."""
    target, drafts = self_drafts
    want = [plain([p], drafts[dtype], 30)[0] for p in PROMPTS]
    assert spec(PROMPTS, drafts[dtype], target, 30, 4)[0] == want


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
def test_first_token_with_a_narrow_self_draft_is_distributed_as_the_target(self_drafts, dtype):
    """Chi-square: the first token of 2000 sampled requests (temperature 1.3, top-k 8)
    follows the float32 target's processed distribution p, with its own narrow copy as
    the draft (K = 2)."""
    target, drafts = self_drafts
    s = sampling.SamplingSettings(temperature=1.3, top_k=8)
    prompt = PROMPTS[1]
    p = sampling.probabilities(gpt2.gpt2(np.array([prompt]), **target[0], n_head=2)[:, -1], None, s)[0]
    out, accepted = first_tokens(prompt, target, drafts[dtype], 3, 2, s)
    assert accepted > 0
    ok, chi2, dof = chi_square_ok(np.bincount([o[0] for o in out], minlength=p.size), p.astype(np.float64), len(out))
    assert ok, (chi2, dof)


def run_main(capsys, *argv):
    rc = main.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@needs_numba
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_main_self_draft_prints_the_float32_greedy_text(capsys, models_dir, dtype):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M",
                            "--draft_model_size", "124M", "--draft_dtype", dtype, "--temperature", "0",
                            "--n_tokens_to_generate", "20")
    assert rc == 0, err
    assert "loaded GPT-2 124M as float32" in out and f"loaded GPT-2 124M as {dtype}" in out
    assert f"draft 124M {dtype}" in out and "greedy texts identical: yes" in out


@needs_numba
def test_main_with_an_int4_draft_model_prints_the_targets_greedy_text(capsys, models_dir):
    """The users' command with --draft_dtype int4: the tiny models stand in for 124M (the
    draft, in int4) and 355M (the target, float32)."""
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "355M",
                            "--draft_model_size", "124M", "--draft_dtype", "int4", "--temperature", "0",
                            "--n_tokens_to_generate", "20", "--K", "4")
    assert rc == 0, err
    assert "loaded GPT-2 124M as int4" in out and "draft 124M int4" in out and "greedy texts identical: yes" in out


@needs_numba
@pytest.mark.parametrize("dtype", NARROW)
def test_main_decodes_in_a_narrow_format(capsys, models_dir, dtype):
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--dtype", dtype,
                            "--mode", "autoregressive", "--n_tokens_to_generate", "8")
    assert rc == 0, err
    assert f"loaded GPT-2 124M as {dtype}" in out and f"GPT-2 124M {dtype}" in out


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8", "--backend", "cupy"], "--dtype int8 runs on the CPU's row kernel"),
    (["--draft_dtype", "bfloat16", "--backend", "cupy"], "--draft_dtype bfloat16 runs on the CPU's row kernel"),
    (["--draft_dtype", "float16"], "--draft_dtype float16 needs --backend cupy"),
    (["--dtype", "int2"], "argument --dtype: invalid choice: 'int2'"),
    (["--draft_dtype", "int4", "--backend", "cupy"], "--draft_dtype int4 runs on the CPU's row kernel"),
])
def test_bad_format_combinations_are_one_line(capsys, tmp_path, argv, message):
    rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--base_url", "http://127.0.0.1:9", *argv)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not os.listdir(tmp_path)


def test_the_numpy_fallback_refuses_narrow_formats_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(rowwise, "KERNEL", "numpy")
    for dtype in ("int8", "int4"):
        rc, out, err = run_main(capsys, "--models_dir", str(tmp_path), "--dtype", dtype)
        assert rc == 2 and err.count("\n") == 1 and f"--dtype {dtype} needs the numba row kernel" in err, err
    with pytest.raises(utils.LoadError, match="--dtype bfloat16 needs the numba row kernel"):
        layout.decode_layout({"wte": np.zeros((64, 8), np.float32), "blocks": []}, "numpy", "bfloat16")


@needs_numba
def test_the_server_serves_the_self_draft_with_the_float32_targets_text(models_dir, capsys):
    """server.py with --draft_dtype int8: a greedy completion is main.py's float32 greedy text."""
    from serving import server
    from test_server import client, start
    httpd, engine, url = start(models_dir, "--mode", "speculative", "--draft_model_size", "124M",
                               "--draft_dtype", "int8")
    try:
        got = client(url).completions.create(model="gpt2", prompt="Alan Turing", max_tokens=12, temperature=0)
    finally:
        server.stop(httpd, engine)
    assert "loaded GPT-2 124M as int8" in capsys.readouterr().err
    rc, out, err = run_main(capsys, "--models_dir", models_dir, "--target_model_size", "124M", "--mode",
                            "autoregressive", "--prompt", "Alan Turing", "--temperature", "0",
                            "--n_tokens_to_generate", "12", "--ignore_eos")
    assert rc == 0 and "Alan Turing" + got.choices[0].text in out
