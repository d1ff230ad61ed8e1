"""Layer norm and attention as numba loops (row_ops.py): within float rounding of gpt2.py's
NumPy functions, and each row bitwise the same whatever rows share its call."""
import numpy as np
import pytest

import gpt2
import kv_cache
from kernels import layout, rowwise

pytestmark = pytest.mark.skipif(rowwise.row_ops is None, reason="numba is not installed")


@pytest.mark.parametrize("n", [16, 768, 1024, 1600])
def test_layer_norm_is_numpys_and_each_row_its_own(n):
    from kernels.row_ops import layer_norm
    rng = np.random.default_rng(n)
    x = rng.standard_normal((6, n), dtype=np.float32) * 3 + 1  # [6, n]
    g, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    got = layer_norm(x[:, None], g, b)[:, 0]  # [6, n]: any leading shape
    np.testing.assert_allclose(got, gpt2.layer_norm(x.astype(np.float64), g, b), rtol=1e-5, atol=1e-5)
    for i in range(6):
        assert np.array_equal(layer_norm(x[i:i + 1], g, b)[0], got[i])


def reference_attention(q, k, v, p):
    """softmax(q . k[:p+1] / sqrt(d)) @ v[:p+1] for one query, in float64."""
    scores = k[:p + 1].astype(np.float64) @ q / np.sqrt(len(q))
    e = np.exp(scores - scores.max())
    return e / e.sum() @ v[:p + 1]


def test_attention_sees_its_own_keys_up_to_itself_and_nothing_else():
    """A verify-like pass: row 0 has 5 tokens cached and 3 new, row 1 two cached and one new
    (its other two queries are padding, past its keys). Every real query is the softmax over
    its row's slots 0..position, and a row's outputs are bitwise those of the row alone."""
    from kernels.row_ops import attention
    rng = np.random.default_rng(0)
    B, H, T, D, S = 2, 3, 3, 16, 8
    q = rng.standard_normal((B, T, 3, H, D), dtype=np.float32).transpose(2, 0, 3, 1, 4)[0]  # a view, as mha's
    k = rng.standard_normal((B, H, 12, D), dtype=np.float32)[:, :, :S]  # the cache's first S slots
    v = rng.standard_normal((B, H, 12, D), dtype=np.float32)[:, :, :S]
    positions = np.array([[5, 6, 7], [2, 3, 4]])
    out = attention(q, k, v, positions).transpose(0, 2, 1, 3)  # [B, T, H, D]
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0)]:
        for h in range(H):
            want = reference_attention(q[b, h, t], k[b, h], v[b, h], positions[b, t])
            np.testing.assert_allclose(out[b, t, h], want, rtol=1e-5, atol=1e-6)
    alone = attention(q[1:, :, :1], k[1:, :, :3], v[1:, :, :3], positions[1:, :1]).transpose(0, 2, 1, 3)
    assert np.array_equal(alone[0, 0], out[1, 0])
    k[1, :, 3:] = np.nan  # slots past row 1's length never reach its real query
    assert np.array_equal(attention(q, k, v, positions).transpose(0, 2, 1, 3)[1, 0], out[1, 0])


def test_a_kernel_pass_runs_them_and_stays_within_rounding_of_numpy(tiny, monkeypatch):
    """The row kernel's layout makes passes norm and attend through row_ops (rowwise.row_ops_for);
    their logits are within float rounding of the same passes with gpt2.py's and kv_cache.attend's NumPy."""
    model = (layout.decode_layout(layout.plain_layout(tiny[2]), "numba"), tiny[1])
    assert rowwise.row_ops_for(model) and not rowwise.row_ops_for((layout.plain_layout(tiny[2]), tiny[1]))
    texts = [[464, 2068, 7586, 21831, 18045], [464, 3290]]

    def two_steps():
        cache = kv_cache.init_cache(model[1], 2, 16, like=model[0]["wpe"])
        kv_cache.next_logits(model, cache, texts)
        return kv_cache.next_logits(model, cache, [t + [11] for t in texts], n_logits=2)

    from kernels import row_ops
    calls = []
    for name in ("layer_norm", "attention"):
        monkeypatch.setattr(row_ops, name, lambda *a, f=getattr(row_ops, name), name=name: calls.append(name) or f(*a))
    fused = two_steps()
    assert {"layer_norm", "attention"} <= set(calls)  # the passes ran through row_ops
    calls.clear()
    monkeypatch.setattr(rowwise, "row_ops_for", lambda model: None)
    np.testing.assert_allclose(fused, two_steps(), rtol=1e-5, atol=1e-5)
    assert not calls


def test_d_head_64_keeps_the_query_and_the_sum_in_registers_for_the_same_bits():
    """attend's path for d_head 64 (every GPT-2) computes the general loops' sums in their order:
    each helper pair gives the same bits, over keys that fill and do not fill the cache."""
    from numba import njit

    from kernels.row_ops import scores, scores_64, values, values_64

    @njit
    def both(q, k, v, S, scale):
        w, w64, acc, acc64 = (np.zeros(k.shape[2], np.float32), np.zeros(k.shape[2], np.float32),
                              np.zeros(64, np.float32), np.zeros(64, np.float32))
        scores(q, k, 1, 2, 0, S, scale, w)
        scores_64(q, k, 1, 2, 0, S, scale, w64)
        values(v, 1, 2, S, w, acc)
        values_64(v, 1, 2, S, w, acc64)
        return w, w64, acc, acc64

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, n, 64), dtype=np.float32) for n in (1, 40, 40))
    for S in (1, 7, 40):
        w, w64, acc, acc64 = both(q, k, v, S, np.float32(0.125))
        assert np.array_equal(w[:S], w64[:S]) and np.array_equal(acc, acc64) and np.any(acc != 0)
