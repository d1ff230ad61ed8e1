"""int8 weights multiplied in integers: one instruction does 16 multiply-adds.

An int8 model reads a quarter of float32's bytes, so one row (a token) is up to four
times faster to stream. A batch of rows is not: 8 rows make 8 multiply-adds of every
weight. Were each int8 weight widened to float32 in registers (as row_kernel.py widens
bfloat16), they would be fused multiply-adds, 8 at a time on each of an AVX2 core's two
FMA units, and at 8 rows a 355M step would be bound by them, not by memory: int8 would
gain little over float32 at batch 8.

Integers do twice the work per instruction. AVX2's vpmaddwd multiplies 16 pairs of
16-bit integers and adds neighbouring products into 8 32-bit sums: 16 multiply-adds
where an FMA does 8 (plus a vpaddd to keep the sum). So the activations meet the int8
weights as 16-bit integers (LLM.int8 and ctranslate2 round activations to integers for
the same reason, to 8 bits; https://arxiv.org/abs/2208.07339). With its weights in L1,
the integer tile loop does about 1.8x the float32 loop's multiply-adds per second on
AVX2 (`python benchmark.py --only ceiling`).

The arithmetic, with q the int8 weights and scale their column scales:

    x[k] ~ x16[k] * sx[c]    for k in block c of C = 64 inputs, |x16| <= 32767,
    sx[c] = max |x[k]| over the block / 32767,
    y[j] = scale[j] * sum_c sx[c] * (sum_{k in c} x16[k] * q[k, j]).

A block of 64 keeps an outlier's coarser step to its own block. Each x16 is within
half a step, 2**-16 of its block's largest value, a few hundred times finer than the
weights' own rounding (2**-8 of a column's largest), so int8's logits stay where the
weights put them (`python benchmark.py --only formats`). Inside a block the sums are
integers: exact, whatever order they are added in, below 2**31 (64 x 32767 x 127).
Each block's integer sum becomes a float32 and is added to the output as
acc = fma(float(sum), sx[c], acc), block after block, the same in every kernel here: a
row's output is bitwise the same alone or beside any others, as in the float kernel.

Layout: vpmaddwd adds products of neighbouring lanes, so the weights of two neighbouring
inputs k = 2p, 2p + 1 sit side by side for each column: qb [n_blocks, n_in / 2, W, 2]
(`paired`). 16 bytes are then 8 columns x 2 inputs; widened to 16-bit (vpmovsxbw), one
vpmaddwd with the row's x16[2p], x16[2p + 1] in every pair of lanes adds both products
to 8 columns' sums. The kernels walk the blocks as row_kernel's do: one row (8 column
registers of sums), or tiles of 3-6 rows x 16 columns (a pair of rows: 2 x 32), a block
of C inputs per tile.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from kernels import compiling
from kernels.compiling import when_first_called
from kernels.row_kernel import (AHEAD, AHEAD_ROWS, VECTOR, W, _address, float32x8, fma8, load8, prefetch,
                                prefetch_l1, store8, tile_plan, zero8)

C = 64  # inputs per activation block (fewer where a matrix has fewer: the test models)
X16_MAX = 32767


class Int32x8(types.Type):
    """8 int32 lanes (LLVM's <8 x i32>): 8 columns' integer sums."""
    def __init__(self):
        super().__init__(name="int32x8")


class Int16x16(types.Type):
    """16 int16 lanes (LLVM's <16 x i16>): 8 columns x 2 inputs, or a row's 2 inputs x 8."""
    def __init__(self):
        super().__init__(name="int16x16")


int32x8, int16x16 = Int32x8(), Int16x16()
I32x8, I16x16 = ir.VectorType(ir.IntType(32), 8), ir.VectorType(ir.IntType(16), 16)


@register_model(Int32x8)
class Int32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, I32x8)


@register_model(Int16x16)
class Int16x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, I16x16)


@intrinsic
def load16(typingctx, a, index):
    """16 int8 from a[index] on, widened to int16 (vpmovsxbw): 8 columns x 2 inputs."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        bytes16 = builder.load(builder.bitcast(address, ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
        return builder.sext(bytes16, I16x16)
    if a.dtype != types.int8:
        return None
    return int16x16(a, index), codegen


@intrinsic
def pair(typingctx, a, index):
    """a[index], a[index] + 1 (two int16) in every pair of lanes (vpbroadcastd)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        both = builder.load(builder.bitcast(address, ir.IntType(32).as_pointer()), align=2)
        lanes = builder.insert_element(ir.Constant(I32x8, ir.Undefined), both, ir.IntType(32)(0))
        lanes = builder.shuffle_vector(lanes, ir.Constant(I32x8, ir.Undefined), ir.Constant(I32x8, [0] * 8))
        return builder.bitcast(lanes, I16x16)
    if a.dtype != types.int16:
        return None
    return int16x16(a, index), codegen


@intrinsic
def madd(typingctx, acc, a, b):
    """acc + (a[0] b[0] + a[1] b[1], a[2] b[2] + a[3] b[3], ...): written as plain LLVM
    (widen, multiply, add even lanes to odd ones), which LLVM's x86 backend turns into
    one vpmaddwd and a vpaddd; other CPUs get whatever their backend makes of it."""
    def codegen(context, builder, signature, args):
        i32x16 = ir.VectorType(ir.IntType(32), 16)
        products = builder.mul(builder.sext(args[1], i32x16), builder.sext(args[2], i32x16))
        even = builder.shuffle_vector(products, products, ir.Constant(I32x8, list(range(0, 16, 2))))
        odd = builder.shuffle_vector(products, products, ir.Constant(I32x8, list(range(1, 16, 2))))
        return builder.add(args[0], builder.add(even, odd))
    return int32x8(int32x8, int16x16, int16x16), codegen


@intrinsic
def izero(typingctx):
    """8 lanes of integer 0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(I32x8, [0] * 8)
    return int32x8(), codegen


@intrinsic
def to_float(typingctx, a):
    """8 int32 lanes as float32 (vcvtdq2ps, rounded to nearest)."""
    def codegen(context, builder, signature, args):
        return builder.sitofp(args[0], VECTOR)
    return float32x8(int32x8), codegen


def paired(q):
    """int8 blocks q [n_blocks, n_in, W] -> [n_blocks, n_in / 2, W, 2]: for each column,
    the weights of inputs 2p and 2p + 1 side by side."""
    n_blocks, n_in, w = q.shape
    return np.ascontiguousarray(q.reshape(n_blocks, n_in // 2, 2, w).transpose(0, 1, 3, 2))  # [n_blocks, n_in/2, W, 2]


def block_size(n_in):
    """Inputs per activation block: C, or the largest power of two below it that divides
    n_in (the row kernel needs n_in a multiple of 8)."""
    return math.gcd(n_in, C)


@intrinsic
def abs_max8(typingctx, m, v):
    """max(m, |v|) in every lane."""
    def codegen(context, builder, signature, args):
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VECTOR, [VECTOR]), "llvm.fabs.v8f32")
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VECTOR, [VECTOR] * 2),
                                                "llvm.maxnum.v8f32")
        return builder.call(maxnum, [args[0], builder.call(fabs, [args[1]])])
    return float32x8(float32x8, float32x8), codegen


@intrinsic
def lanes_max(typingctx, m):
    """The largest of m's 8 lanes."""
    def codegen(context, builder, signature, args):
        top = builder.extract_element(args[0], ir.IntType(32)(0))
        for lane in range(1, 8):
            other = builder.extract_element(args[0], ir.IntType(32)(lane))
            top = builder.select(builder.fcmp_ordered(">", other, top), other, top)
        return top
    return types.float32(float32x8), codegen


@intrinsic
def store_int16(typingctx, a, index, v):
    """a[index], ..., a[index] + 7 = v's 8 lanes rounded to the nearest integer (ties to
    even, as np.rint) as int16 (a: int16; each |v| <= 32767)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VECTOR, [VECTOR]), "llvm.rint.v8f32")
        int16x8 = ir.VectorType(ir.IntType(16), 8)
        builder.store(builder.fptosi(builder.call(rint, [args[2]]), int16x8),
                      builder.bitcast(address, int16x8.as_pointer()), align=2)
        return context.get_dummy_value()
    if a.dtype != types.int16:
        return None
    return types.void(a, index, float32x8), codegen


@njit(cache=True, nogil=True)
def to_int16(x, c, most=X16_MAX):
    """x [R, n_in] float32 -> x16 [R, n_in] int16 and sx [R, n_in / c] float32, blocks of
    c inputs (a multiple of 8), 8 lanes at a time: x ~ x16 * sx with sx = top / most and
    x16 = rint(x * (most / top)), top the block's largest |x| (a block of zeros: all 0);
    most = 32767 here, 127 for int4_kernel.py's 8-bit activations."""
    R, n_in = x.shape
    x16 = np.empty((R, n_in), np.int16)  # [R, n_in]
    sx = np.empty((R, n_in // c), np.float32)  # [R, n_in / c]
    for r in range(R):
        for b in range(n_in // c):
            m = zero8()
            for k in range(b * c, (b + 1) * c, 8):
                m = abs_max8(m, load8(x, (r, k)))
            top = lanes_max(m)
            sx[r, b] = top / np.float32(most)
            inverse = np.float32(most) / top if top > 0 else np.float32(0)
            for k in range(b * c, (b + 1) * c, 8):
                store_int16(x16, (r, k), fma8(zero8(), inverse, load8(x, (r, k))))  # 0 + inverse * x: a product
    return x16, sx


# compiled at its first call, as matmul calls it (an array and a Python int)
compiling.REGISTRY["kernels.int8_kernel.to_int16"] = lambda dtype, plan: to_int16(np.zeros((1, 8), np.float32), 8)


@when_first_called({"int8": "void(int16[::1], float32[::1], int8[:, :, :, ::1], float32[::1])"},
                   key=lambda x16, sx, qb, out: qb.dtype, parallel=True)
def row_times_pairs(x16, sx, qb, out):
    """out [n_blocks * W] = one row x16 [n_in] (in blocks scaled by sx) @ q: per block of
    weights, 64 columns' integer sums in 8 registers, added to out a block of inputs at a
    time."""
    n_blocks, half, _, _ = qb.shape
    c = 2 * half // sx.shape[0]  # inputs per activation block
    ahead = AHEAD // (2 * W)  # input pairs
    for b in prange(n_blocks):
        o = b * W
        for kc in range(0, 2 * half, c):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = izero()
            for p in range(kc // 2, (kc + c) // 2):
                prefetch(qb, (b, p + ahead, 0, 0))
                prefetch(qb, (b, p + ahead, W // 2, 0))
                xp = pair(x16, (2 * p,))
                a0 = madd(a0, xp, load16(qb, (b, p, 0, 0)))
                a1 = madd(a1, xp, load16(qb, (b, p, 8, 0)))
                a2 = madd(a2, xp, load16(qb, (b, p, 16, 0)))
                a3 = madd(a3, xp, load16(qb, (b, p, 24, 0)))
                a4 = madd(a4, xp, load16(qb, (b, p, 32, 0)))
                a5 = madd(a5, xp, load16(qb, (b, p, 40, 0)))
                a6 = madd(a6, xp, load16(qb, (b, p, 48, 0)))
                a7 = madd(a7, xp, load16(qb, (b, p, 56, 0)))
            s = sx[kc // c]
            for v, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
                before = zero8() if kc == 0 else load8(out, (o + 8 * v,))
                store8(out, (o + 8 * v,), fma8(before, s, to_float(a)))


@njit(inline="always")
def tile(x16, sx, i, n, qb, b, kc, c, acc, ahead, near):
    """Rows i..i+n-1 (n = 3..6) times inputs kc..kc+c-1 of block b, in tiles of n rows x
    16 columns (up to 12 registers of sums, 2 of weights, 1 for a row's pair of x16):
    per input pair, two loads of weights serve 2n vpmaddwd. Then each sum is added to
    acc [R, W] as fma(float(sum), sx, acc). n is a constant where this is called. A tile
    alone in its pass also asks L1 for its weights `near` pairs on (a constant, 0: none),
    as row_kernel.tile does."""
    for j in range(0, W, 16):
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = izero()
        for p in range(kc // 2, (kc + c) // 2):
            prefetch(qb, (b, p + ahead, j, 0))
            if near:
                prefetch_l1(qb, (b, p + near, j, 0))
            w0, w1 = load16(qb, (b, p, j, 0)), load16(qb, (b, p, j + 8, 0))  # 16 columns x 2 inputs
            x0, x1, x2 = pair(x16, (i, 2 * p)), pair(x16, (i + 1, 2 * p)), pair(x16, (i + 2, 2 * p))
            a00, a01 = madd(a00, x0, w0), madd(a01, x0, w1)
            a10, a11 = madd(a10, x1, w0), madd(a11, x1, w1)
            a20, a21 = madd(a20, x2, w0), madd(a21, x2, w1)
            if n > 3:
                x3 = pair(x16, (i + 3, 2 * p))
                a30, a31 = madd(a30, x3, w0), madd(a31, x3, w1)
            if n > 4:
                x4 = pair(x16, (i + 4, 2 * p))
                a40, a41 = madd(a40, x4, w0), madd(a41, x4, w1)
            if n > 5:
                x5 = pair(x16, (i + 5, 2 * p))
                a50, a51 = madd(a50, x5, w0), madd(a51, x5, w1)
        for r, (lo, hi) in enumerate(((a00, a01), (a10, a11), (a20, a21), (a30, a31), (a40, a41), (a50, a51))):
            if r < n:
                s = sx[i + r, kc // c]
                before_lo = zero8() if kc == 0 else load8(acc, (i + r, j))
                before_hi = zero8() if kc == 0 else load8(acc, (i + r, j + 8))
                store8(acc, (i + r, j), fma8(before_lo, s, to_float(lo)))
                store8(acc, (i + r, j + 8), fma8(before_hi, s, to_float(hi)))


@njit(inline="always")
def two_rows(x16, sx, i, qb, b, kc, c, acc, ahead):
    """Rows i, i+1 as `tile` takes n, in tiles of 2 rows x 32 columns: per input pair,
    four loads of weights serve 8 vpmaddwd (a 2 x 16 tile would have 2 loads serve 4)."""
    for j in range(0, W, 32):
        a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = izero()
        for p in range(kc // 2, (kc + c) // 2):
            prefetch(qb, (b, p + ahead, j, 0))
            w0, w1 = load16(qb, (b, p, j, 0)), load16(qb, (b, p, j + 8, 0))
            w2, w3 = load16(qb, (b, p, j + 16, 0)), load16(qb, (b, p, j + 24, 0))
            x0, x1 = pair(x16, (i, 2 * p)), pair(x16, (i + 1, 2 * p))
            a00, a01, a02, a03 = madd(a00, x0, w0), madd(a01, x0, w1), madd(a02, x0, w2), madd(a03, x0, w3)
            a10, a11, a12, a13 = madd(a10, x1, w0), madd(a11, x1, w1), madd(a12, x1, w2), madd(a13, x1, w3)
        for r, sums in enumerate(((a00, a01, a02, a03), (a10, a11, a12, a13))):
            s = sx[i + r, kc // c]
            for v, a in enumerate(sums):
                before = zero8() if kc == 0 else load8(acc, (i + r, j + 8 * v))
                store8(acc, (i + r, j + 8 * v), fma8(before, s, to_float(a)))


@when_first_called({"int8": "void(int16[:, ::1], float32[:, ::1], int8[:, :, :, ::1], float32[:, ::1])"},
                   key=lambda x16, sx, qb, out: qb.dtype, plan=lambda x16, sx, qb, out: tile_plan(x16.shape[0]),
                   parallel=True)
def rows_times_pairs(n):
    """The loop out [R, n_blocks * W] = x16 [R, n_in] (blocks scaled by sx) @ q, for R >= 2
    rows in tiles of n or n + 1 rows (row_kernel.tile_plan): per block of weights and block
    of inputs, tile by tile, as row_kernel.rows_times_blocks."""
    def kernel(x16, sx, qb, out):
        n_blocks, half, _, _ = qb.shape
        R = x16.shape[0]
        c = 2 * half // sx.shape[1]
        ahead = AHEAD_ROWS // (2 * W)
        n_tiles = -(-R // 6)
        for b in prange(n_blocks):
            acc = np.empty((R, W), np.float32)  # [R, W]: this block's sums, between blocks of inputs
            for kc in range(0, 2 * half, c):
                if n > 2 and R == n:  # a tile alone (3-5 rows) asks L1 for the next block of inputs' weights
                    tile(x16, sx, 0, n, qb, b, kc, c, acc, ahead, C // 2)
                    continue
                i = 0
                for t in range(n_tiles):
                    size = (R - i) // (n_tiles - t)  # n or n + 1
                    if n == 2:  # n is a constant: numba compiles only the branch it takes
                        two_rows(x16, sx, i, qb, b, kc, c, acc, ahead)  # plan 2 is 2 rows alone
                    elif size == n:
                        tile(x16, sx, i, n, qb, b, kc, c, acc, ahead, 0)
                    else:
                        tile(x16, sx, i, n + 1, qb, b, kc, c, acc, ahead, 0)
                    i += size
            out[:, b * W:(b + 1) * W] = acc
    return kernel


def matmul(rows, qb, n_out, scale):
    """rows [n, n_in] @ w -> [n, n_out] float32, w stored as int8 pairs qb
    [n_blocks, n_in / 2, W, 2] with its column scales [n_blocks * W]; only the blocks
    that hold the first n_out outputs are read."""
    n_blocks = -(-n_out // W)
    qb = qb[:n_blocks]  # [needed blocks, n_in / 2, W, 2]
    x = np.ascontiguousarray(rows, dtype=np.float32)  # [n, n_in]
    x16, sx = to_int16(x, block_size(x.shape[1]))  # [n, n_in], [n, n_in / c]
    out = np.empty((len(x), n_blocks * W), np.float32)  # [n, n_blocks * W]
    if len(x) == 1:
        row_times_pairs(x16[0], sx[0], qb, out[0])
    else:
        rows_times_pairs(x16, sx, qb, out)
    out = out[:, :n_out]  # [n, n_out]
    out *= scale[:n_out]  # (x @ q) * scale, one rounding per output
    return out
