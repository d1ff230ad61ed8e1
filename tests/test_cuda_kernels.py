"""Our GPU kernels (kernels/cuda_matmul.py, cuda_ops.py, cuda_sampling.py), each against
NumPy: on a GPU where there is one, and on a CPU always (tests/cuda_on_cpu.py compiles their
CUDA C with g++, a block's threads as fibers), so a machine without a GPU, CI included,
checks what every kernel computes. Only a GPU shows their speed and the races its memory
ordering allows (tests/test_cupy.py runs them there end to end)."""
import functools

import numpy as np
import pytest

import gpt2
import sampling
from kernels import cuda_matmul, cuda_ops, cuda_sampling, layout


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "layer-normed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("R, n_in", [(1, 1600), (3, 1600), (8, 1600), (13, 1600), (64, 1600), (130, 1600), (3, 771),
                                     (130, 771)])
def test_the_few_row_product_matches_numpy_and_each_row_is_as_if_alone(cupy, dtype, R, n_in, norm):
    """n_out 302: a last block of outputs part full, and a warp of the wide kernel with 2 of
    its 4; 130 rows: three blocks of rows, a warp's outputs 4 at a time; n_in 1600 (1558M's
    width: four inputs a load), 771 (one at a time). Each row comes out bitwise as alone, and
    a product of many rows as in passes of ROWS_BLOCK rows (one output a warp); with the
    layer norm before the product in its launch too (each block takes its rows' statistics)."""
    rng = np.random.default_rng(R)
    w = (rng.standard_normal((302, n_in), dtype=np.float32) * 0.02).astype(dtype)  # [n_out, n_in]
    x = (rng.standard_normal((R, n_in), dtype=np.float32) * 3 + 1).astype(dtype)
    ln = {"g": (1 + rng.standard_normal(n_in, dtype=np.float32) * 0.1).astype(dtype),
          "b": (rng.standard_normal(n_in, dtype=np.float32) * 0.1).astype(dtype)} if norm else None

    def product(rows):
        device_ln = None if ln is None else {name: cupy.asarray(a) for name, a in ln.items()}
        return cuda_matmul.launch(cupy.asarray(rows), cupy.asarray(w), None, norm=device_ln)
    got = product(x)
    assert got.dtype == dtype and got.shape == (R, 302)
    inputs = x.astype(np.float32) if ln is None else gpt2.layer_norm(x.astype(np.float32), *(
        a.astype(np.float32) for a in ln.values()))
    want = inputs @ w.astype(np.float32).T
    tolerance = {"atol": 1e-4, "rtol": 0} if dtype == np.float32 else {"atol": 2e-2, "rtol": 1e-2}
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want, **tolerance)
    assert np.array_equal(cupy.asnumpy(got[-1:]), cupy.asnumpy(product(x[-1:])))
    blocks = [product(x[i:i + cuda_matmul.ROWS_BLOCK]) for i in range(0, R, cuda_matmul.ROWS_BLOCK)]
    assert np.array_equal(cupy.asnumpy(got), np.concatenate([cupy.asnumpy(y) for y in blocks]))


@pytest.mark.parametrize("R", [1, 5, 130])
def test_the_products_weights_loaded_more_steps_together_give_the_same_bits(cupy, R):
    """cuda_matmul's few-row kernels loading the weights of 1 or 4 k-steps together, not UNROLL:
    the loads move, each output's sum does not (one row, ROWS rows, the wide kernel beside
    them; n_in 1600: the last load of a lane's k-steps part full)."""
    rng = np.random.default_rng(R)
    w = cupy.asarray(rng.standard_normal((302, 1600), dtype=np.float32) * 0.02)  # [n_out, n_in]
    x = cupy.asarray(rng.standard_normal((R, 1600), dtype=np.float32))  # [R, n_in]
    ln = {"g": cupy.asarray(1 + rng.standard_normal(1600, dtype=np.float32) * 0.1),
          "b": cupy.asarray(rng.standard_normal(1600, dtype=np.float32) * 0.1)}
    for norm in (None, ln):
        got = [cupy.asnumpy(cuda_matmul.launch(x, w, None, norm=norm, code=code))
               for code in (cuda_matmul.SOURCE, cuda_matmul.source(1), cuda_matmul.source(4))]
        assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])


@pytest.mark.parametrize("gelu, residual, norm", [(False, False, False), (True, False, False), (False, True, False),
                                                  (False, False, True), (True, False, True)])
def test_a_products_tail_in_its_launch_matches_gpt2s_functions(cupy, gelu, residual, norm):
    rng = np.random.default_rng(1)
    x, res = rng.standard_normal((5, 768), dtype=np.float32), rng.standard_normal((5, 300), dtype=np.float32)
    w, b = rng.standard_normal((768, 300), dtype=np.float32) * 0.05, rng.standard_normal(300, dtype=np.float32)
    ln = {"g": 1 + rng.standard_normal(768, dtype=np.float32) * 0.1, "b": rng.standard_normal(768, dtype=np.float32)}
    want = gpt2.linear(gpt2.layer_norm(x, **ln) if norm else x, w, b)
    want = gpt2.gelu(want) if gelu else want
    want = res + want if residual else want
    matrix = cuda_matmul.Matrix(cupy.asarray(np.ascontiguousarray(w.T)))
    got = cuda_matmul.linear(cupy.asarray(x), matrix, cupy.asarray(b), gelu, cupy.asarray(res) if residual else None,
                             {name: cupy.asarray(a) for name, a in ln.items()} if norm else None)
    np.testing.assert_allclose(cupy.asnumpy(got), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_layer_norm_kernel_matches_gpt2s(cupy, dtype):
    rng = np.random.default_rng(0)
    x, g, b = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for shape in ((2, 3, 1600), (1600,), (1600,)))
    got = cuda_ops.layer_norm(*(cupy.asarray(a) for a in (x, g, b)))
    want = gpt2.layer_norm(x.astype(np.float32), g.astype(np.float32), b.astype(np.float32))
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want, atol=1e-5 if dtype == np.float32 else 1e-2)


MOST = cuda_ops.ATTEND_SLOTS


@pytest.mark.parametrize("S, positions, dtype", [(40, [[37, 38, -1], [0, -1, -1]], np.float32),
                                                 (300, [[297, 298, 299], [5, -1, -1]], np.float32),
                                                 (300, [[297, 298, 299], [5, -1, -1]], np.float16),
                                                 (MOST, [[MOST - 3, MOST - 2, MOST - 1], [5, -1, -1]], np.float32)])
def test_the_attention_kernel_matches_numpy_with_padding(cupy, S, positions, dtype):
    """q, k, v as gpt2.mha makes them (views of one array); a row of 2 or 3 tokens after many
    cached (up to the cache's last slot; the most a block's shared memory holds, which a GPU's
    launch refuses if over), a row of 1, padding in between: the same keys
    stored (the kernel stores them as it attends, and reads the step's own from q's array), the
    same outputs (float16: NumPy rounds the probabilities to float16, the kernel keeps float32
    until it stores)."""
    rng = np.random.default_rng(0)
    B, T, H, D = 2, 3, 3, 64
    qkv = rng.standard_normal((B, T, 3 * H * D), dtype=np.float32).astype(dtype)
    q, k, v = qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)  # [B, H, T, D] each
    cached = rng.standard_normal((2, B, H, S, D), dtype=np.float32).astype(dtype)
    positions = np.array(positions)
    cpu = {"k": cached[0].copy(), "v": cached[1].copy()}
    want = cuda_ops.attend_reference(positions, cpu, q, k, v)
    gpu = {"k": cupy.asarray(cached[0]), "v": cupy.asarray(cached[1])}
    d_qkv = cupy.asarray(qkv)
    dq, dk, dv = d_qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)
    got = cuda_ops.attend(cupy.asarray(positions), gpu, dq, dk, dv)
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want.astype(np.float32),
                               atol=1e-5 if dtype == np.float32 else 2e-3, rtol=0)
    assert np.array_equal(cupy.asnumpy(gpu["k"]), cpu["k"]) and np.array_equal(cupy.asnumpy(gpu["v"]), cpu["v"])


def test_a_step_token_out_of_its_rows_run_of_slots_gets_nan_not_another_tokens_keys(cupy):
    """A step's tokens of a row sit in consecutive slots (cuda_graphs.step), which is how the
    kernel finds the keys it has not stored yet: a token placed elsewhere is NaN, loudly, and
    stores nothing; the NumPy stand-in does the same, so a CPU test of the bookkeeping fails too."""
    rng = np.random.default_rng(1)
    B, T, H, D, S = 1, 3, 2, 64, 40
    qkv = cupy.asarray(rng.standard_normal((B, T, 3 * H * D), dtype=np.float32))
    q, k, v = qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)
    layer = {"k": cupy.zeros((B, H, S, D), np.float32), "v": cupy.zeros((B, H, S, D), np.float32)}
    positions = np.array([[20, 22, 22]])  # token 1 out of its run; token 2 reads token 1's key from the step's k
    out = cupy.asnumpy(cuda_ops.attend(cupy.asarray(positions), layer, q, k, v))  # [B, H, T, D]
    assert np.isfinite(out[:, :, ::2]).all() and np.isnan(out[:, :, 1]).all()
    stored = cupy.asnumpy(layer["k"])  # [B, H, S, D]: token 2's key at its slot 22, token 1's nowhere
    assert np.array_equal(stored[0, :, 22], cupy.asnumpy(k)[0, :, 2]) and not stored[:, :, 21].any()
    cpu = {"k": np.zeros((B, H, S, D), np.float32), "v": np.zeros((B, H, S, D), np.float32)}
    want = cuda_ops.attend_reference(positions, cpu, *(cupy.asnumpy(a) for a in (q, k, v)))  # the stand-in: the same
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)  # (NaN where NaN)
    assert np.array_equal(cupy.asnumpy(layer["k"]), cpu["k"])


def sampling_cases():
    """(logits [R, n_vocab], settings): GPT-2's vocabulary, logits like a model's; a draft
    head's -inf columns; a top-p cut inside a run of tied tokens (ids scattered, lower ids
    dropped first); a top-p no token's mass reaches (the last of two tied tokens stays); cuts
    exactly at a boundary (top-p's cumulative sum, min-p's fraction of the top)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 50257), dtype=np.float32) * 3
    cut = logits.copy()
    cut[:, 8192:] = -np.inf
    ties = np.zeros((2, 1000), np.float32)
    ties[:, rng.choice(1000, 10, replace=False)] = 5.0  # 10 tokens of 6.0% each over 990 of 0.04%
    two = np.full((1, 1000), -200.0, np.float32)  # exp(-200) is 0 in float32
    two[0, [100, 900]] = 0.0
    flat = np.zeros((1, 1024), np.float32)  # 2**-10 each: every sum exact, a top-p cut exactly at a token's
    halves = np.log(np.full((1, 1024), 0.01, np.float32))
    halves[0, [3, 500, 1000]] = np.log(np.float32([1.0, 0.5, 0.5]))  # exactly half the top's: min-p's boundary
    S = sampling.SamplingSettings
    return [(logits, S(temperature=0.8, top_p=0.9)), (logits, S(top_k=40)), (logits, S(temperature=0.7, min_p=0.05)),
            (logits, S(temperature=1.3, top_k=200, top_p=0.5, min_p=0.01)), (logits, S(temperature=0.0)),
            (cut, S(temperature=0.8, top_p=0.95, top_k=50000)), (ties, S(top_p=0.33)), (ties, S(top_k=5, top_p=0.55)),
            (two, S(top_p=1e-9)), (flat, S(top_p=0.5)), (halves, S(min_p=0.5))]


@pytest.mark.parametrize("case", range(len(sampling_cases())))
def test_the_sampling_kernel_gives_sampling_pys_distribution(cupy, case):
    """The same tokens kept, the same probabilities to float32's rounding of sums in another order."""
    logits, s = sampling_cases()[case]
    want = sampling.probabilities(logits, None, s)
    got = cupy.asnumpy(cuda_sampling.distribution(cupy.asarray(logits), s))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_each_row_under_its_own_settings_is_that_row_alone_under_them(cupy):
    """distribution_rows (a recorded loop's: each row's settings its data) gives every row what
    `distribution` gives it alone under its settings, bit for bit: every case of the test above,
    the rows of those of one vocabulary side by side in one launch."""
    for n_vocab in (50257, 1000):
        cases = [(logits[:1], s) for logits, s in sampling_cases() if logits.shape[1] == n_vocab]
        rows = np.concatenate([logits for logits, _ in cases])  # [R, n_vocab]
        settings = np.array([cuda_sampling.kernel_settings(s, n_vocab) for _, s in cases])  # [R, 5]
        out = cupy.zeros(rows.shape, np.float32)
        cuda_sampling.distribution_rows(cupy.asarray(rows), cupy.asarray(settings), out)
        for r, (logits, s) in enumerate(cases):
            alone = cupy.asnumpy(cuda_sampling.distribution(cupy.asarray(logits), s))[0]
            assert np.array_equal(cupy.asnumpy(out)[r], alone), s


def test_the_sampling_kernel_draws_sampling_pys_token(cupy):
    """Rows with zeros, a one-hot row at u = 1, u near 0: sampling.sample's tokens; a row
    with NaN is refused as sampling.sample refuses it."""
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.full(50257, 0.1), 12).astype(np.float32)  # [12, n_vocab]
    probs[:6, rng.random(50257) < 0.5] = 0.0
    probs[6] = 0.0
    probs[6, 777] = 1.0
    u = 1.0 - rng.random(12)
    u[[0, 6]] = 1e-12, 1.0
    want = sampling.sample(probs, u)
    got = cuda_sampling.sample(cupy.asarray(probs), u)
    assert isinstance(got, np.ndarray) and np.array_equal(got, want)  # the ids on the host
    probs[3, 5] = np.nan
    with pytest.raises(ValueError, match="cannot sample"):
        cuda_sampling.sample(cupy.asarray(probs), u)


def test_sampling_py_hands_device_arrays_to_the_kernels_where_ours_are_chosen(cupy, monkeypatch):
    """GPT2_GPU_KERNELS=1: sampling.probabilities and sampling.sample on device arrays are the
    kernels' (the distribution a device array, the ids on the host), with sampling.py's results."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    logits, s = sampling_cases()[0]
    u = 1.0 - np.random.default_rng(3).random(len(logits))
    p = sampling.probabilities(cupy.asarray(logits), None, s)
    tokens = sampling.sample(p, u)
    assert isinstance(p, cupy.ndarray) and isinstance(tokens, np.ndarray)
    want = sampling.probabilities(logits, None, s)
    assert np.array_equal(cupy.asnumpy(p) > 0, want > 0)
    assert np.array_equal(tokens, sampling.sample(want, u))


def verify_case(V=3000, K=4):
    """speculative.verify's arguments, a row for each way a step ends: (p, q, drafts, k, u, v)."""
    rng = np.random.default_rng(4)
    B = 7
    p = rng.dirichlet(np.full(V, 0.05), (B, K + 1)).astype(np.float32)  # [B, K+1, V]
    q = rng.dirichlet(np.full(V, 0.05), (B, K)).astype(np.float32)  # [B, K, V]
    q[:, :, rng.random(V) < 0.3] = 0.0  # tokens a draft cannot propose (a vocabulary subset)
    drafts = np.array([[rng.choice(V, p=q[b, i] / q[b, i].sum()) for i in range(K)] for b in range(B)])  # [B, K]
    k = np.array([K, K, 2, K, K, 0, K])
    u, v = 1.0 - rng.random((B, K)), 1.0 - rng.random(B)
    best = p[:, :K].argmax(axis=-1)  # [B, K]: the target's likeliest, accepted at u near 0
    drafts[1], u[1] = best[1], 1e-9  # row 1: every draft passes
    drafts[2], u[2] = best[2], 1e-9  # row 2: both of its 2 drafts pass
    drafts[3, 0], u[3, 0] = best[3, 0], 1e-9  # row 3: the first passes; the second is rejected (u = 1) where
    q[3, 1], u[3, 1] = p[3, 1], 1.0  # q = p: no residual mass
    drafts[4, 0], q[4, 0, 8], q[4, 0, 7], u[4, 0] = 8, 1.0, np.nan, 1.0  # row 4: rejected, a NaN in the residual
    return p, q, drafts, k, u, v


def test_the_verification_kernel_accepts_and_draws_as_speculative_py(cupy, monkeypatch):
    """Rows that reject at the first draft, accept every draft (the bonus token from p_{K+1}),
    draft fewer than K, reject where q = p (the residual holds no mass: p_n), meet a NaN in q,
    or draft nothing: speculative.verify's n and token, handed to the kernels on device arrays
    (q also on the host, and None: one-hot at the drafts, as prompt lookup gives it, the kernel
    reading it so); a NaN in p is refused as sampling.sample refuses it."""
    import speculative
    p, q, drafts, k, u, v = verify_case()
    want_n, want_token = speculative.verify(p, q, drafts, k, u, v)
    assert want_n.tolist()[:6] == [0, 4, 2, 1, 0, 0]  # the cases are what they say
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    n, token = speculative.verify(cupy.asarray(p), cupy.asarray(q), drafts, k, u, v)
    assert isinstance(n, np.ndarray) and isinstance(token, np.ndarray)
    assert np.array_equal(n, want_n) and np.array_equal(token, want_token)
    n, token = speculative.verify(cupy.asarray(p), q, drafts, k, u, v)  # q on the host: a drafter's own
    assert np.array_equal(n, want_n) and np.array_equal(token, want_token)
    q_det = speculative.one_hot(drafts, k, p.shape[-1])  # a deterministic drafter's q, and its None
    want = [a.tolist() for a in speculative.verify(p, q_det, drafts, k, u, v)]
    assert [a.tolist() for a in speculative.verify(p, None, drafts, k, u, v)] == want
    assert [a.tolist() for a in speculative.verify(cupy.asarray(p), None, drafts, k, u, v)] == want
    p[0, want_n[0], 5] = np.nan
    with pytest.raises(ValueError, match="cannot sample"):
        speculative.verify(cupy.asarray(p), cupy.asarray(q), drafts, k, u, v)


def test_a_transformer_block_of_kernels_is_the_stand_ins(cupy):
    """cuda_ops.transformer_block (the recorded step's layer: the products with their tails,
    layer norm, attention over the cache, and the reshapes between them) on device arrays
    gives what it gives on NumPy arrays, where gpt2.py's functions and attend_reference run
    (tests/test_cuda_graphs.py checks that against the CPU's model). Two rows: two tokens
    after five cached, and one token (its first) beside a padding token."""
    rng = np.random.default_rng(2)
    B, T, n_embd, n_head, S = 2, 2, 64, 2, 8

    def linear(n_in, n_out):
        return {"w": rng.standard_normal((n_in, n_out), dtype=np.float32) * 0.1,
                "b": rng.standard_normal(n_out, dtype=np.float32) * 0.1}
    block = {"mlp": {"c_fc": linear(n_embd, 4 * n_embd), "c_proj": linear(4 * n_embd, n_embd)},
             "attn": {"c_attn": linear(n_embd, 3 * n_embd), "c_proj": linear(n_embd, n_embd)},
             "ln_1": {"g": 1 + rng.standard_normal(n_embd, dtype=np.float32) * 0.1, "b": np.zeros(n_embd, np.float32)},
             "ln_2": {"g": 1 + rng.standard_normal(n_embd, dtype=np.float32) * 0.1, "b": np.zeros(n_embd, np.float32)}}
    x = rng.standard_normal((B, T, n_embd), dtype=np.float32)
    positions = np.array([[5, 6], [0, -1]])
    cached = rng.standard_normal((2, B, n_head, S, n_embd // n_head), dtype=np.float32)

    def run(move):
        def laid_out(tree):  # each weight matrix a cuda_matmul.Matrix of its transpose, as layout.device_layout
            if "w" in tree:
                return {"w": cuda_matmul.Matrix(move(np.ascontiguousarray(tree["w"].T))), "b": move(tree["b"])}
            return {name: laid_out(t) if isinstance(t, dict) else move(t) for name, t in tree.items()}
        layer = {"k": move(cached[0].copy()), "v": move(cached[1].copy())}
        attend = functools.partial(cuda_ops.attend, move(positions), layer)
        out = cuda_ops.transformer_block(move(x), **laid_out(block), n_head=n_head, attend=attend,
                                         norm=cuda_ops.layer_norm)
        return (to_host(out), to_host(layer["k"]), to_host(layer["v"]))

    def to_host(a):
        return a if isinstance(a, np.ndarray) else cupy.asnumpy(a)
    want, got = run(lambda a: a), run(cupy.asarray)
    np.testing.assert_allclose(got[0][positions >= 0], want[0][positions >= 0], atol=2e-5, rtol=0)
    stored = np.zeros((B, S), bool)  # the slots the step's tokens go to; the rest stay as they were
    stored[0, [5, 6]] = stored[1, 0] = True
    for ours, theirs, before in zip(got[1:], want[1:], cached):
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)  # [B, n_head, S, d_head]
        assert np.array_equal(ours.transpose(0, 2, 1, 3)[~stored], before.transpose(0, 2, 1, 3)[~stored])
        assert not np.array_equal(theirs.transpose(0, 2, 1, 3)[stored], before.transpose(0, 2, 1, 3)[stored])
