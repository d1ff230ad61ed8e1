"""The rest of a decode step in numba: layer norm, and attention over the KV cache.

Once the row kernel (row_kernel.py) reads the weights at memory speed, a decode step
is its matrix products plus many small operations: per layer two layer norms and the
attention of each new token over its row's cached keys and values. gpt2.py writes them
in NumPy, a dozen calls each of a few microseconds on arrays of a few KiB, and after
the weights have streamed through the caches their small inputs come from memory. Here
each is one numba call over all rows of the pass, in the row kernel's registers
(float32x8, load8, fma8). With the row kernel's layout a pass brings them along
(kv_cache.begin_pass) and gpt2.gpt2 calls them in place of its own NumPy ones, which stay
the reference and the fallback's.

Batch invariance, as in the row kernel: every output is a sum in an order fixed by its
own row and never by the rows beside it. Layer norm sums a row's n_embd values in 8
lanes, 8 at a time, then the lanes in order; attention gives each query the scores of
its own keys 0..position (its row's cache up to itself: the causal mask, with nothing
to hide past it), each a dot product summed the same way, and sums their values in
order. The two implementations round differently (within 1e-6 of each other).
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels.compiling import when_first_called
from kernels.row_kernel import V, float32x8, fma8, load8, store8, zero8


@intrinsic
def hsum8(typingctx, a):
    """The 8 lanes of a added up, lane 0 first."""
    def codegen(context, builder, signature, args):
        total = builder.extract_element(args[0], ir.IntType(32)(0))
        for lane in range(1, V):
            total = builder.fadd(total, builder.extract_element(args[0], ir.IntType(32)(lane)))
        return total
    return types.float32(float32x8), codegen


PARAM = types.Array(types.float32, 1, "C", readonly=True)  # g and b, often read-only memmaps of the checkpoint


@when_first_called({"float32": types.void(types.float32[:, ::1], PARAM, PARAM, types.float32, types.float32[:, ::1])},
                   key=lambda x, g, b, eps, out: x.dtype)
def layer_norm_rows(x, g, b, eps, out):
    """out [R, n] = g * (x - mean) / sqrt(variance + eps) + b, row by row (n a multiple of 8)."""
    R, n = x.shape
    one = np.float32(1.0)
    for r in range(R):
        total = zero8()
        for i in range(0, n, V):
            total = fma8(total, one, load8(x, (r, i)))  # total + x: 1 * x is exact
        mean = hsum8(total) / np.float32(n)
        for i in range(n):
            out[r, i] = x[r, i] - mean
        square = zero8()
        for i in range(0, n, V):
            h = load8(out, (r, i))
            square = fma8(square, h, h)
        inv = np.float32(1.0) / np.sqrt(hsum8(square) / np.float32(n) + eps)
        for i in range(n):
            out[r, i] = g[i] * (out[r, i] * inv) + b[i]


def layer_norm(x, g, b, eps=1e-5):
    """gpt2.layer_norm for float32 activations x [..., n_embd], as one numba call."""
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])  # [n, n_embd]
    out = np.empty_like(rows)  # [n, n_embd]
    layer_norm_rows(rows, g, b, np.float32(eps), out)
    return out.reshape(x.shape)


QKV = "float32[:, :, :, :]"  # views of the pass's q and the cache's k, v: any strides, rows of d_head contiguous


@njit(inline="always")
def scores(q, k, b, h, t, S, scale, weights):
    """weights[s] = q[b, h, t] . k[b, h, s] * scale for s < S: 8 lanes summed along d_head, then
    the lanes in order (hsum8)."""
    for s in range(S):
        dot = zero8()
        for d in range(0, q.shape[3], V):
            dot = fma8(dot, load8(q, (b, h, t, d)), load8(k, (b, h, s, d)))
        weights[s] = hsum8(dot) * scale


@njit(inline="always")
def scores_64(q, k, b, h, t, S, scale, weights):
    """`scores` for d_head 64 (every GPT-2's), the query in 8 registers: the same sums in the
    same order, so the same bits, without reloading the query for every key."""
    q0, q1, q2, q3 = load8(q, (b, h, t, 0)), load8(q, (b, h, t, 8)), load8(q, (b, h, t, 16)), load8(q, (b, h, t, 24))
    q4, q5, q6, q7 = load8(q, (b, h, t, 32)), load8(q, (b, h, t, 40)), load8(q, (b, h, t, 48)), load8(q, (b, h, t, 56))
    for s in range(S):
        dot = fma8(fma8(fma8(fma8(zero8(), q0, load8(k, (b, h, s, 0))), q1, load8(k, (b, h, s, 8))),
                        q2, load8(k, (b, h, s, 16))), q3, load8(k, (b, h, s, 24)))
        dot = fma8(fma8(fma8(fma8(dot, q4, load8(k, (b, h, s, 32))), q5, load8(k, (b, h, s, 40))),
                        q6, load8(k, (b, h, s, 48))), q7, load8(k, (b, h, s, 56)))
        weights[s] = hsum8(dot) * scale


@njit(inline="always")
def values(v, b, h, S, weights, acc):
    """acc = sum over s < S of weights[s] * v[b, h, s], s in order."""
    acc[:] = 0.0
    for s in range(S):
        for d in range(0, v.shape[3], V):
            store8(acc, (d,), fma8(load8(acc, (d,)), weights[s], load8(v, (b, h, s, d))))


@njit(inline="always")
def values_64(v, b, h, S, weights, acc):
    """`values` for d_head 64, the sums in 8 registers instead of acc's memory: the same bits."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero8()
    for s in range(S):
        w = weights[s]
        a0, a1 = fma8(a0, w, load8(v, (b, h, s, 0))), fma8(a1, w, load8(v, (b, h, s, 8)))
        a2, a3 = fma8(a2, w, load8(v, (b, h, s, 16))), fma8(a3, w, load8(v, (b, h, s, 24)))
        a4, a5 = fma8(a4, w, load8(v, (b, h, s, 32))), fma8(a5, w, load8(v, (b, h, s, 40)))
        a6, a7 = fma8(a6, w, load8(v, (b, h, s, 48))), fma8(a7, w, load8(v, (b, h, s, 56)))
    for d, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
        store8(acc, (8 * d,), a)


@when_first_called({"float32": f"void({QKV}, {QKV}, {QKV}, int64[:, ::1], float32, {QKV})"},
                   key=lambda q, k, v, positions, scale, out: q.dtype, parallel=True)
def attend(q, k, v, positions, scale, out):
    """out[b, h, t] = softmax(q[b, h, t] . k[b, h, s] * scale over s = 0..p) @ v[b, h, 0..p],
    p = positions[b, t]: each query over its own row's keys up to itself. Rows and heads
    are shared out between the threads; d_head a multiple of 8."""
    B, H, T, D = q.shape
    for bh in prange(B * H):
        b, h = bh // H, bh % H
        weights = np.empty(k.shape[2], np.float32)  # [S]: exp(score - max score)
        acc = np.empty(D, np.float32)  # [d_head]: the weighted sum of values
        for t in range(T):
            S = min(positions[b, t] + 1, k.shape[2])  # a padding query's slot may lie past the cache's
            if D == 64:
                scores_64(q, k, b, h, t, S, scale, weights)
            else:
                scores(q, k, b, h, t, S, scale, weights)
            top = np.float32(-np.inf)
            for s in range(S):
                top = max(top, weights[s])
            total = np.float32(0.0)
            for s in range(S):
                weights[s] = math.exp(weights[s] - top)
                total += weights[s]
            if D == 64:
                values_64(v, b, h, S, weights, acc)
            else:
                values(v, b, h, S, weights, acc)
            for d in range(D):
                out[b, h, t, d] = acc[d] / total


def attention(q, k, v, positions):
    """gpt2.attention over a pass of cached rows, as one numba call: q [B, n_head, T, d_head],
    k, v the layer's cache [B, n_head, S, d_head] (this pass's keys and values already in
    it), positions [B, T] the queries' slots. Returns [B, n_head, T, d_head], a view of
    heads side by side in memory, so that gpt2.mha's merge of the heads copies nothing."""
    B, n_head, T, d_head = q.shape
    out = np.empty((B, T, n_head, d_head), np.float32)  # [B, T, n_head, d_head]
    attend(q, k, v, np.ascontiguousarray(positions), np.float32(1.0 / math.sqrt(d_head)), out.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3)  # [B, n_head, T, d_head]
