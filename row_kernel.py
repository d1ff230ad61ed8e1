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
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

W = 64  # outputs per block: a multiple of every vector width (8 on AVX2, 16 on AVX-512)
PREFETCH = 8  # k-steps ahead (8 rows of a block: 2 KiB) that the kernel asks memory for


def blocked(w):
    """w [n_in, n_out] -> wb [ceil(n_out / W), n_in, W]: each block's weights contiguous,
    the last block padded with zero columns (its extra outputs are cut off by `matmul`)."""
    n_in, n_out = w.shape
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


def matmul(rows, wb, n_out):
    """rows [n, n_in] @ w -> [n, n_out], w given as its blocks wb [n_blocks, n_in, W];
    only the blocks that hold the first n_out outputs are read (a draft's vocabulary subset
    reads the head's first blocks only)."""
    wb = wb[:-(-n_out // W)]  # [needed blocks, n_in, W]
    out = np.empty((rows.shape[0], wb.shape[0] * W), np.float32)  # [n, n_blocks * W]
    rows_times_blocks(np.ascontiguousarray(rows, dtype=np.float32), wb, out)
    return out[:, :n_out]  # [n, n_out]

