"""The CuPy backend: the same code on a GPU gives the NumPy path's logits, text and
speculative decisions. Skipped where CuPy or a GPU is missing (CI has neither); with
GPT2_GPU_KERNELS=1 every test runs through our kernels. Their recorded steps are checked on
a GPU and on the CPU's emulation of one in tests/test_cuda_graphs.py."""
import numpy as np
import pytest

import batching
import gpt2
import sampling
import speculative
import utils
from kernels import cuda_matmul, layout

cupy = pytest.importorskip("cupy")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # CuPy installed, but no driver or GPU
    pytest.skip(f"no CUDA GPU: {e}", allow_module_level=True)

GREEDY = sampling.SamplingSettings(temperature=0.0)
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262], [36235]]
SAMPLED = sampling.SamplingSettings(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def both(tiny):
    """(hparams, NumPy params, CuPy float32 params) of the tiny GPT-2."""
    _, hparams, params = tiny
    return hparams, params, layout.to_backend(params, "cupy")


def layer_skip(params, hparams):
    return dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)


def all_logits(params, hparams, ids):
    return gpt2.gpt2(np.array([ids]), **params, n_head=hparams["n_head"])[0]  # [T, n_vocab]


def generate(params, hparams, n, settings=GREEDY, seed=0, use_cache=True, eos_id=None, prompts=PROMPTS):
    return batching.generate(batching.requests(prompts, n, settings, seed, eos_id), (params, hparams), use_cache)


def spec(params, hparams, n, K, settings=GREEDY, seed=0, draft_vocab=0):
    return speculative.speculative_generate(batching.requests(PROMPTS, n, settings, seed), (params, hparams),
                                            speculative.model_drafter(layer_skip(params, hparams)),
                                            speculative.SpeculativeConfig(K=K, draft_vocab=draft_vocab))


@pytest.mark.parametrize("kernels", [False, True], ids=["plain", "our-kernels"])
def test_weights_live_on_the_gpu(both, kernels):
    hparams, params, _ = both
    gpu = layout.to_backend(params, "cupy", kernels=kernels)
    leaves = []
    layout.tree_map(leaves.append, dict(gpu, wte=gpu["wte"].T.stored if kernels else gpu["wte"]))
    matrices = [w.stored for w in leaves if isinstance(w, cuda_matmul.Matrix)]
    assert len(matrices) == (4 * hparams["n_layer"] if kernels else 0)
    arrays = [w for w in leaves if not isinstance(w, cuda_matmul.Matrix)] + matrices
    assert all(isinstance(w, cupy.ndarray) and w.dtype == np.float32 for w in arrays)


def test_float32_logits_match_numpy_and_the_reference(both, reference):
    hparams, params, gpu = both
    ids = PROMPTS[1]
    on_gpu = all_logits(gpu, hparams, ids)
    assert isinstance(on_gpu, cupy.ndarray) and on_gpu.dtype == np.float32
    np.testing.assert_allclose(cupy.asnumpy(on_gpu), all_logits(params, hparams, ids), atol=1e-4, rtol=0)
    got = gpt2.gpt2(reference["input_ids"][None], **gpu, n_head=hparams["n_head"])[0]
    np.testing.assert_allclose(cupy.asnumpy(got), reference["logits"], atol=1e-4, rtol=0)


def test_float16_logits_stay_close(both):
    """float16 weights and activations, float32 layer-norm and softmax statistics:
    the error is float16's own (about 3 significant digits). Measured on an H100:
    1.7e-2 at logits up to 20; the bound is 5e-2."""
    hparams, params, _ = both
    half = layout.to_backend(params, "cupy", "float16")
    got = all_logits(half, hparams, PROMPTS[1])
    assert got.dtype == np.float16
    want = all_logits(params, hparams, PROMPTS[1])
    err = np.abs(cupy.asnumpy(got).astype(np.float32) - want).max()
    assert err < 5e-2, err


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_text_equals_numpy_batched(both, use_cache):
    hparams, params, gpu = both
    want, _ = generate(params, hparams, 30, use_cache=use_cache)
    got, stats = generate(gpu, hparams, 30, use_cache=use_cache)
    assert got == want
    assert stats.kv_cache_bytes == (2 * hparams["n_layer"] * len(PROMPTS) * (11 + 30) * hparams["n_embd"] * 4
                                    if use_cache else 0)


def test_rows_that_finish_and_the_restarting_window_match_numpy(both):
    """EOS moves rows within the GPU cache (kv_cache.move_row), and 100 tokens on the
    tiny model (n_ctx 64) restart the cached window: both as on the CPU."""
    hparams, params, gpu = both
    eos = generate(params, hparams, 3, prompts=PROMPTS[:1])[0][0][2]
    for n, eos_id in ((12, eos), (100, None)):
        want, _ = generate(params, hparams, n, eos_id=eos_id)
        got, _ = generate(gpu, hparams, n, eos_id=eos_id)
        assert got == want
        assert (min(map(len, got)) < n) == (eos_id is not None)  # rows did end early, or ran past n_ctx


def test_sampled_text_equals_numpy_with_the_same_seed(both):
    """u is drawn on the host, so penalties, top-k/p and the draw agree across backends."""
    hparams, params, gpu = both
    want, _ = generate(params, hparams, 30, SAMPLED, seed=7)
    got, _ = generate(gpu, hparams, 30, SAMPLED, seed=7)
    assert got == want


@pytest.mark.parametrize("K", [1, 4, 7])
def test_speculative_greedy_equals_plain_greedy_on_the_gpu(both, K):
    hparams, _, gpu = both
    want, _ = generate(gpu, hparams, 30)
    got, stats = spec(gpu, hparams, 30, K)
    assert got == want and 0 < stats.acceptance_rate < 1


def test_a_draft_head_over_part_of_the_vocabulary_decides_as_numpy_does(both):
    """--draft_vocab: the draft's head fills -inf logits past its N tokens on the GPU too."""
    hparams, params, gpu = both
    (want, s_cpu), (got, s_gpu) = (spec(p, hparams, 30, 4, SAMPLED, seed=5, draft_vocab=40) for p in (params, gpu))
    assert got == want and s_gpu.accepted == s_cpu.accepted


def test_speculative_sampling_decides_as_numpy_does(both):
    """Same seed, same accept/reject decisions and residual draws, on either backend."""
    hparams, params, gpu = both
    (want, s_cpu), (got, s_gpu) = (spec(p, hparams, 30, 4, SAMPLED, seed=3) for p in (params, gpu))
    assert got == want and s_gpu.accepted == s_cpu.accepted


def test_verify_on_device_arrays_matches_numpy():
    rng = np.random.default_rng(0)
    B, K, V = 64, 5, 50
    p = rng.dirichlet(np.ones(V), (B, K + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32)
    drafts = rng.integers(0, V, (B, K))
    k = rng.integers(0, K + 1, B)
    u, v = 1.0 - rng.random((B, K)), 1.0 - rng.random(B)
    want = speculative.verify(p, q, drafts, k, u, v)
    got = speculative.verify(cupy.asarray(p), cupy.asarray(q), drafts, k, u, v)
    # CuPy's operations leave n and the token on the device; our kernels (cuda_sampling.verify) bring them out
    assert all(isinstance(g, np.ndarray if layout.gpu_kernels() else cupy.ndarray) for g in got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(cupy.asnumpy(g), w)


def test_main_runs_on_the_gpu_and_greedy_texts_agree(capsys, models_dir):
    import main
    rc = main.main(["--models_dir", models_dir, "--target_model_size", "124M", "--draft_model_size", "355M",
                    "--temperature", "0", "--n_tokens_to_generate", "20", "--backend", "cupy"])
    out = capsys.readouterr().out
    assert rc == 0 and "greedy texts identical: yes" in out


def test_too_little_gpu_memory_is_one_clear_error(both, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0)
    monkeypatch.setattr(cupy, "asarray", out_of_memory)
    with pytest.raises(utils.LoadError, match="too little free memory .* try --dtype float16"):
        layout.to_backend(both[1], "cupy")


def test_main_runs_in_float16(capsys, models_dir):
    import main
    rc = main.main(["--models_dir", models_dir, "--target_model_size", "124M", "--draft_model_size", "355M",
                    "--n_tokens_to_generate", "10", "--backend", "cupy", "--dtype", "float16"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("tokens/s") == 2
