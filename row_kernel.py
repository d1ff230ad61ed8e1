"""A kernel of our own for a few rows times a weight matrix, on a CPU: numba.

Decoding is bound by memory: one row (a token) reads every weight once and does two
flops per four bytes read. A verification, a draft's catch-up, a batch or a beam step
multiplies a few rows by the same weights, and they could share that read. NumPy cannot
say so: its product (sgemm) first copies the weights into panels of its own, which for
2-8 rows costs 2-3 one-row passes, and one gemv per row reads the weights once per row.
So this file writes the loop itself, with numba (https://numba.pydata.org), which
compiles a Python function to machine code through LLVM.

Layout: each weight matrix w [n_in, n_out] is stored once as contiguous blocks of
W = 64 output columns, wb [n_blocks, n_in, W] (`blocked`; the last block padded with
zeros). A block is then one sequential stream of memory. For each block, the kernel
walks k = 0..n_in-1 and, for every row i, adds x[i, k] * wb[b, k, :] to that row's 64
sums: each weight comes from memory once, and every row uses it while it is in cache.
The W columns are independent, so the compiler turns the inner loop into vector
instructions (8 floats on AVX2, 16 on AVX-512) with no reordering of any sum.

Batch invariance by construction: output j of row i is x[i, 0] w[0, j] + x[i, 1] w[1, j]
+ ..., added in that order, one fused multiply-add at a time, whatever the number of
rows, the row's place among them, the block it sits in or the thread that runs it. So a
row's logits are bitwise the same alone or beside any others (tests/test_rowwise.py).
Four k per iteration, written as one left-to-right sum, keep that order (the sum is
((acc + x0 w0) + x1 w1) + ...) while touching the accumulators a quarter as often.

Why the prefetch: while the core is busy with multiply-adds, fewer loads are in flight,
and the weights arrive later than they could; a pass then costs its memory time plus its
arithmetic. Asking for the weights PREFETCH k-steps ahead (the `prefetch` intrinsic below,
LLVM's llvm.prefetch) keeps memory busy while the arithmetic runs, so the two overlap.
`python benchmark.py --only rows` measures what a pass over n rows costs.

Narrow weights (weight_formats.py): the same blocks stored as bfloat16 (uint16) or int8,
read by two more kernels that first widen a few k-steps of the block to float32 in a
small scratch (in L1: a few KiB), then run the very loop above over it for every row.
Widening once per weight, not once per row and weight, keeps batches as cheap as the
float32 kernel's. A single row has nothing to share, and widens each weight right where
it multiplies it (`row_times_*`: 7-25% faster than through the scratch). The sums and
their order are those of the float32 kernel in every case, so each format is batch
invariant the same way (tested: a row alone, through the one-row kernel, is bitwise the
row among others). int8 multiplies each output by its column's scale once, after the
sum. Eight k-steps per widening suit int8 (its 8 weights of a column share a load),
four suit bfloat16: measured on a 355M pass, 1-8 rows.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import weight_formats

W = 64  # outputs per block: a multiple of every vector width (8 on AVX2, 16 on AVX-512)
PREFETCH = 8  # k-steps ahead (8 rows of a block: 2 KiB) that the kernel asks memory for


def blocked(w):
    """w [n_in, n_out] -> wb [ceil(n_out / W), n_in, W]: each block's weights contiguous,
    the last block padded with zero columns (its extra outputs are cut off by `matmul`).
    The kernels take 4 or 8 inputs a step, unchecked: n_in must be a multiple of 8 (it is
    for every GPT-2)."""
    n_in, n_out = w.shape
    if n_in % 8:
        raise ValueError(f"the row kernel needs a multiple of 8 inputs, got a {n_in} x {n_out} matrix")
    n_blocks = -(-n_out // W)
    wb = np.zeros((n_blocks, n_in, W), np.float32)  # [n_blocks, n_in, W]
    for b in range(n_blocks):  # block by block: a whole-matrix transposing copy strides through memory
        cols = w[:, b * W:(b + 1) * W]  # [n_in, <= W]
        wb[b, :, :cols.shape[1]] = cols
    return wb


def unblocked(wb, n_out):
    """The inverse of `blocked`: wb [n_blocks, n_in, W] -> w [n_in, n_out]."""
    n_blocks, n_in, _ = wb.shape
    return np.ascontiguousarray(wb.transpose(1, 0, 2).reshape(n_in, n_blocks * W)[:, :n_out])  # [n_in, n_out]


def columns(wb, tokens, scale=None):
    """Columns `tokens` of the matrix stored as blocks wb, as float32 rows [n, n_in]: the
    tied head's blocks hold wte.T, so these are the tokens' embeddings, read from the very
    weights (and format) the head multiplies by."""
    tokens = np.asarray(tokens)
    cols = wb[tokens // W, :, tokens % W]  # [n, n_in]
    if wb.dtype == np.uint16:
        return weight_formats.from_bfloat16(cols)
    if wb.dtype == np.int8:
        return weight_formats.from_int8(cols, scale[tokens], axis=1)
    return cols


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bits are `bits` (uint32): a bitcast, no conversion."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(inline="always")
def widen(bits):
    """A bfloat16's bits (uint16) -> its float32: the 16 bits become the high half."""
    return as_float32(np.uint32(bits) << 16)


@intrinsic
def prefetch(typingctx, wb, b, k, j):
    """Ask the cache for the line that holds wb[b, k, j]. A hint: it never faults (even
    past the end of the array) and changes no value, only when the bytes arrive."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        array = context.make_array(array_type)(context, builder, args[0])
        address = cgutils.get_item_pointer2(context, builder, data=array.data,
                                            shape=cgutils.unpack_tuple(builder, array.shape),
                                            strides=cgutils.unpack_tuple(builder, array.strides),
                                            layout=array_type.layout, inds=args[1:], wraparound=False)
        i32 = ir.IntType(32)
        llvm_prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(llvm_prefetch, [address, i32(0), i32(2), i32(1)])  # read, keep in L2, data
        return context.get_dummy_value()
    return types.void(wb, b, k, j), codegen


@njit("void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1])", parallel=True, fastmath={"contract"},
      cache=True, nogil=True)
def rows_times_blocks(x, wb, out):
    """out [R, n_blocks * W] = x [R, n_in] @ the matrix whose blocks are wb [n_blocks, n_in, W].
    n_in must be a multiple of 4. The blocks are shared among numba's threads (prange).
    fastmath "contract" only: a * b + c may become one fused multiply-add, but no sum is
    ever reordered, so every output is summed over k in order, row by row the same."""
    n_blocks, n_in, width = wb.shape
    R = x.shape[0]
    for b in prange(n_blocks):
        acc = np.zeros((R, width), np.float32)  # [R, W]: this block's outputs for every row
        for k in range(0, n_in, 4):
            for ahead in range(k + PREFETCH, k + PREFETCH + 4):
                for j in range(0, width, 16):  # a cache line holds 16 floats
                    prefetch(wb, b, ahead, j)
            w0, w1, w2, w3 = wb[b, k], wb[b, k + 1], wb[b, k + 2], wb[b, k + 3]  # [W] each
            for i in range(R):
                x0, x1, x2, x3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
                a = acc[i]
                for j in range(width):
                    a[j] = a[j] + x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j]
        out[:, b * width:(b + 1) * width] = acc


@njit("void(float32[:, ::1], uint16[:, :, ::1], float32[:, ::1])", parallel=True, fastmath={"contract"},
      cache=True, nogil=True)
def rows_times_bfloat16_blocks(x, wb, out):
    """rows_times_blocks for bfloat16 blocks (uint16 bits): four k-steps of the block are
    widened (shifted into a float32's high half) into f, then every row adds them up
    exactly as rows_times_blocks does."""
    n_blocks, n_in, _ = wb.shape
    R = x.shape[0]
    for b in prange(n_blocks):
        acc = np.zeros((R, W), np.float32)  # [R, W]
        f = np.empty((4, W), np.float32)  # [4, W]: k..k+3 of this block, widened
        for k in range(0, n_in, 4):
            for ahead in range(k + 2 * PREFETCH, k + 2 * PREFETCH + 4):
                prefetch(wb, b, ahead, 0)  # 64 bfloat16 columns: two cache lines
                prefetch(wb, b, ahead, W // 2)
            for t in range(4):
                for j in range(W):
                    f[t, j] = widen(wb[b, k + t, j])
            w0, w1, w2, w3 = f[0], f[1], f[2], f[3]
            for i in range(R):
                x0, x1, x2, x3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
                a = acc[i]
                for j in range(W):
                    a[j] = a[j] + x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j]
        out[:, b * W:(b + 1) * W] = acc


@njit("void(float32[:, ::1], int8[:, :, ::1], float32[::1], float32[:, ::1])", parallel=True, fastmath={"contract"},
      cache=True, nogil=True)
def rows_times_int8_blocks(x, wb, scale, out):
    """out = (x @ q) * scale for int8 blocks q and one scale per output column: eight
    k-steps widened into f at a time (n_in must be a multiple of 8), every row summed as
    rows_times_blocks sums, each output scaled once at the end."""
    n_blocks, n_in, _ = wb.shape
    R = x.shape[0]
    for b in prange(n_blocks):
        acc = np.zeros((R, W), np.float32)  # [R, W]
        f = np.empty((8, W), np.float32)  # [8, W]: k..k+7 of this block, widened
        for k in range(0, n_in, 8):
            for ahead in range(k + 4 * PREFETCH, k + 4 * PREFETCH + 8):
                prefetch(wb, b, ahead, 0)  # 64 int8 columns: one cache line
            for t in range(8):
                for j in range(W):
                    f[t, j] = np.float32(wb[b, k + t, j])
            for i in range(R):
                x0, x1, x2, x3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
                x4, x5, x6, x7 = x[i, k + 4], x[i, k + 5], x[i, k + 6], x[i, k + 7]
                a = acc[i]
                for j in range(W):
                    a[j] = (a[j] + x0 * f[0, j] + x1 * f[1, j] + x2 * f[2, j] + x3 * f[3, j]
                            + x4 * f[4, j] + x5 * f[5, j] + x6 * f[6, j] + x7 * f[7, j])
        for i in range(R):
            for j in range(W):
                out[i, b * W + j] = acc[i, j] * scale[b * W + j]


@njit("void(float32[::1], uint16[:, :, ::1], float32[::1])", parallel=True, fastmath={"contract"}, cache=True,
      nogil=True)
def row_times_bfloat16_blocks(x, wb, out):
    """One row: no scratch, each weight widened where it is used (once either way), so
    the loop is all loads and multiply-adds. The same sums in the same order as above."""
    n_blocks, n_in, _ = wb.shape
    for b in prange(n_blocks):
        acc = np.zeros(W, np.float32)  # [W]
        w = wb[b]  # [n_in, W]
        for k in range(0, n_in, 4):
            for ahead in range(k + 2 * PREFETCH, k + 2 * PREFETCH + 4):
                prefetch(wb, b, ahead, 0)
                prefetch(wb, b, ahead, W // 2)
            x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            for j in range(W):
                acc[j] = (acc[j] + x0 * widen(w[k, j]) + x1 * widen(w[k + 1, j])
                          + x2 * widen(w[k + 2, j]) + x3 * widen(w[k + 3, j]))
        out[b * W:(b + 1) * W] = acc


@njit("void(float32[::1], int8[:, :, ::1], float32[::1], float32[::1])", parallel=True, fastmath={"contract"},
      cache=True, nogil=True)
def row_times_int8_blocks(x, wb, scale, out):
    """One row of rows_times_int8_blocks, each weight widened where it is used."""
    n_blocks, n_in, _ = wb.shape
    for b in prange(n_blocks):
        acc = np.zeros(W, np.float32)  # [W]
        w = wb[b]  # [n_in, W]
        for k in range(0, n_in, 8):
            for ahead in range(k + 4 * PREFETCH, k + 4 * PREFETCH + 8):
                prefetch(wb, b, ahead, 0)
            x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            x4, x5, x6, x7 = x[k + 4], x[k + 5], x[k + 6], x[k + 7]
            for j in range(W):
                acc[j] = (acc[j] + x0 * np.float32(w[k, j]) + x1 * np.float32(w[k + 1, j])
                          + x2 * np.float32(w[k + 2, j]) + x3 * np.float32(w[k + 3, j])
                          + x4 * np.float32(w[k + 4, j]) + x5 * np.float32(w[k + 5, j])
                          + x6 * np.float32(w[k + 6, j]) + x7 * np.float32(w[k + 7, j]))
        for j in range(W):
            out[b * W + j] = acc[j] * scale[b * W + j]


def matmul(rows, wb, n_out, scale=None):
    """rows [n, n_in] @ w -> [n, n_out], w given as its blocks wb [n_blocks, n_in, W] in
    any format (float32, bfloat16 as uint16, int8 with its scale [n_blocks * W]); only the
    blocks that hold the first n_out outputs are read (a draft's vocabulary subset reads
    the head's first blocks only)."""
    n_blocks = -(-n_out // W)
    wb = wb[:n_blocks]  # [needed blocks, n_in, W]
    x = np.ascontiguousarray(rows, dtype=np.float32)  # [n, n_in]
    out = np.empty((rows.shape[0], n_blocks * W), np.float32)  # [n, n_blocks * W]
    if wb.dtype == np.uint16:
        (row_times_bfloat16_blocks(x[0], wb, out[0]) if len(x) == 1 else rows_times_bfloat16_blocks(x, wb, out))
    elif wb.dtype == np.int8:
        scale = scale[:n_blocks * W]
        (row_times_int8_blocks(x[0], wb, scale, out[0]) if len(x) == 1 else rows_times_int8_blocks(x, wb, scale, out))
    else:
        rows_times_blocks(x, wb, out)
    return out[:, :n_out]  # [n, n_out]
