"""int4 weights, two a byte, multiplied in integers: one instruction does 32 multiply-adds.

Four bits a weight halve int8's bytes again, and batch-1 decoding is bound by the bytes
it reads. But the arithmetic must keep up: at half the bytes a step has half the time
for the same multiply-adds. int8_kernel.py's way (16-bit activations, vpmaddwd: 16
multiply-adds an instruction) plus unpacking the nibbles to 16 bits would take more
instructions per multiply-add than int8 itself, by count. So this kernel uses the
instruction llama.cpp's Q4_0 kernel uses on AVX2: activations rounded to 8 bits, and vpmaddubsw, which
multiplies 32 unsigned bytes by 32 signed bytes and adds neighbouring products into 16
16-bit sums: 32 multiply-adds an instruction. A 355M step at batch 1 then takes 0.76 of
int8's time, 0.24 of float32's (`python benchmark.py --only formats`). Where the CPU has
VNNI (AVX-512 VNNI or AVX-VNNI), vpdpbusd does the same 32 and adds each column's four
products into 32 bits in that instruction (maddubs): the same integers, one step fewer.

The format (weight_formats.to_int4), in groups of 32 inputs (as Q4_0's blocks), each
group and output column with a scale of its own (bfloat16: 8 bits of precision, far finer
than 4-bit weights; stored as uint16, widened exactly in registers as row_kernel does):

    w[k, j] ~ q[k, j] * sw[g, j]    for k in group g,  q in [-7, 7],
    sw[g, j] = max |w[k, j]| over the group / 7,  the byte holds u = q + 8 in [1, 15].

The activations, per group of the same inputs (as int8_kernel.py rounds them, to 8 bits):

    x[k] ~ x8[k] * sx[g],  sx[g] = max |x[k]| over the group / 127,  |x8| <= 127,

and the product, with xsum[g] = sum of x8 over the group (u = q + 8, so the 8s come off):

    y[j] = sum_g  (sum_{k in g} x8[k] * u[k, j]  -  8 xsum[g]) * (sw[g, j] * sx[g]).

Inside a group the sums are integers, exact in any order: vpmaddubsw's pairs are at most
2 x 15 x 127 = 3810 and a group adds 8 of them into a 16-bit lane (30480 < 32767), so no
sum saturates or wraps. Each group's sum becomes a float32 and is added to the output as
acc = fma(float(sum), sw * sx, acc), group after group, whatever the tile a row sits in:
a row's output is bitwise the same alone or beside any others.

Layout: the 64 columns of a block (row_kernel.W) in 4 sets of 16; for each quad of inputs
4t..4t+3 and set, 32 bytes: byte 4m + i holds input 4t + i of column 16s + m in its low
nibble and of column 16s + 8 + m in its high one. One 32-byte load, a mask and a shift
give two vectors of 8 columns x 4 inputs; the row's 4 bytes x8[4t..4t+3], repeated in
every 4-byte lane, meet both (two vpmaddubsw). qb [n_blocks, n_in / 4, 4, 32] uint8
(`packed`), scales [n_blocks, n_in / c, W] uint16 (c = 32, fewer in the test models).
"""
import numpy as np
import llvmlite.binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import config
from numba.extending import intrinsic, models, register_model

from kernels import compiling
from kernels.compiling import when_first_called
from kernels.int8_kernel import I16x16, I32x8, int16x16, int32x8, to_float, to_int16
from kernels.row_kernel import (AHEAD_ROWS, W, _address, fma8, load8, prefetch, prefetch_l1, store8,
                                tile_plan, zero8)
from kernels.weight_formats import INT4_GROUP, from_bfloat16

X8_MAX = 127  # not 128: symmetric, and a vpmaddubsw pair stays within 2 x 15 x 127
if INT4_GROUP // 4 * 2 * 15 * X8_MAX > 32767:  # a group's 16-bit sums would wrap (gpt-fast's 128 would)
    raise ValueError(f"int4 groups of {INT4_GROUP} inputs overflow the kernel's 16-bit sums: at most 32")
I8x32 = ir.VectorType(ir.IntType(8), 32)


class Int8x32(types.Type):
    """32 int8 lanes (LLVM's <32 x i8>): 8 columns x 4 inputs of nibbles, or a row's 4 x8 x 8."""
    def __init__(self):
        super().__init__(name="int8x32")


int8x32 = Int8x32()


@register_model(Int8x32)
class Int8x32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, I8x32)


def _splat(builder, value, vector_type):
    """value (an integer argument) in every lane of vector_type."""
    value = builder.trunc(value, vector_type.element)
    lanes = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.IntType(32)(0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count), [0] * vector_type.count)  # every lane: lane 0
    return builder.shuffle_vector(lanes, ir.Constant(vector_type, ir.Undefined), zeros)


def _nibbles(builder, address, mask, shift=None):
    """The 32 bytes at address, shifted right by `shift` bits in 16-bit lanes, & mask. The
    kernels pass mask = 15 and shift = 4 as arguments, not constants: seeing them, LLVM
    would prove that maddubs's pairs can never saturate, drop the saturation, and with it
    the very pattern it knows as vpmaddubsw (it multiplies with vpmullw instead, slower)."""
    bytes32 = builder.load(builder.bitcast(address, I8x32.as_pointer()), align=1)
    if shift is not None:
        i16x16 = ir.VectorType(ir.IntType(16), 16)
        bytes32 = builder.bitcast(builder.lshr(builder.bitcast(bytes32, i16x16), _splat(builder, shift, i16x16)), I8x32)
    return builder.and_(bytes32, _splat(builder, mask, I8x32))


@intrinsic
def low_nibbles(typingctx, a, index, mask):
    """The low 4 bits (mask = 15) of the 32 bytes from a[index] on: columns 16s..16s+7 x 4 inputs."""
    def codegen(context, builder, signature, args):
        return _nibbles(builder, _address(context, builder, signature.args[0], args[0], args[1]), args[2])
    return (int8x32(a, index, mask), codegen) if a.dtype == types.uint8 else None


@intrinsic
def high_nibbles(typingctx, a, index, mask, shift):
    """The high 4 bits (shift = 4) of the same 32 bytes: columns 16s+8..16s+15 x 4 inputs."""
    def codegen(context, builder, signature, args):
        return _nibbles(builder, _address(context, builder, signature.args[0], args[0], args[1]), args[2], args[3])
    return (int8x32(a, index, mask, shift), codegen) if a.dtype == types.uint8 else None


@intrinsic
def quad(typingctx, a, index):
    """a[index], ..., a[index] + 3 (four int8) in every 4-byte lane (vpbroadcastd)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        four = builder.load(builder.bitcast(address, ir.IntType(32).as_pointer()), align=1)
        lanes = builder.insert_element(ir.Constant(I32x8, ir.Undefined), four, ir.IntType(32)(0))
        lanes = builder.shuffle_vector(lanes, ir.Constant(I32x8, ir.Undefined), ir.Constant(I32x8, [0] * 8))
        return builder.bitcast(lanes, I8x32)
    return (int8x32(a, index), codegen) if a.dtype == types.int8 else None


def targets_avx2():
    """Whether numba compiles for an x86 CPU with AVX2: NUMBA_CPU_FEATURES (as
    benchmark_results/avx2.sh sets them), else this CPU's own features."""
    features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return llvm.get_process_triple().startswith("x86_64") and "+avx2" in features.split(",")


def targets_vnni():
    """Whether numba compiles for an x86 CPU with VNNI on 256-bit vectors: AVX-VNNI, or
    AVX-512 VNNI with AVX-512 VL."""
    features = set((config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(","))
    return targets_avx2() and ("+avxvnni" in features or {"+avx512vnni", "+avx512vl"} <= features)


@intrinsic
def zero_sums(typingctx):
    """Integer 0 in every lane of maddubs's sums: 16 lanes of 16 bits, or VNNI's 8 of 32."""
    vnni = targets_vnni()

    def codegen(context, builder, signature, args):
        return ir.Constant(I32x8, [0] * 8) if vnni else ir.Constant(I16x16, [0] * 16)
    return (int32x8() if vnni else int16x16()), codegen


@intrinsic
def maddubs(typingctx, acc, u, x):
    """acc + (u[0] x[0] + u[1] x[1], u[2] x[2] + u[3] x[3], ...), u unsigned and x signed
    bytes, each pair's sum saturated to 16 bits: vpmaddubsw (and a vpaddw). On x86 with AVX2
    it is named (llvm.x86.avx2.pmadd.ub.sw): from the same plain IR, LLVM's x86 backend
    makes vpmaddubsw for AVX2-only CPUs, but for AVX-512 ones it widens the bytes to 16 bits and
    multiplies with vpmaddwd / vpdpwssd instead, at half the multiply-adds an instruction
    (tests/test_int4_kernel.py compiles the loops for both). Other CPUs get that plain IR,
    whose saturation never acts here (a pair is at most 3810): it only lets LLVM match.
    With VNNI, one vpdpbusd does it all and the columns' sums too: acc + (u[0..3] . x[0..3],
    u[4..7] . x[4..7], ...) in 8 lanes of 32 bits (the same integers: nothing saturates)."""
    if targets_vnni():
        def vpdpbusd(context, builder, signature, args):  # LLVM 21 on declares bytes, and upgrades this
            f = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256",
                                                 fnty=ir.FunctionType(I32x8, [I32x8, I32x8, I32x8]))
            return builder.call(f, [args[0], builder.bitcast(args[1], I32x8), builder.bitcast(args[2], I32x8)])
        return int32x8(int32x8, int8x32, int8x32), vpdpbusd

    def codegen(context, builder, signature, args):
        if targets_avx2():
            pmaddubsw = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw",
                                                         fnty=ir.FunctionType(I16x16, [I8x32, I8x32]))
            return builder.add(args[0], builder.call(pmaddubsw, [args[1], args[2]]))
        i32x16 = ir.VectorType(ir.IntType(32), 16)
        even, odd = (ir.Constant(i32x16, list(range(start, 32, 2))) for start in (0, 1))
        u, x = args[1], args[2]

        def products(lanes):
            return builder.mul(builder.sext(builder.shuffle_vector(x, x, lanes), i32x16),
                               builder.zext(builder.shuffle_vector(u, u, lanes), i32x16))
        total = builder.add(products(even), products(odd))
        high, low = ir.Constant(i32x16, [32767] * 16), ir.Constant(i32x16, [-32768] * 16)
        total = builder.select(builder.icmp_signed(">", total, low), total, low)
        total = builder.select(builder.icmp_signed("<", total, high), total, high)
        return builder.add(args[0], builder.trunc(total, I16x16))
    return int16x16(int16x16, int8x32, int8x32), codegen


@intrinsic
def column_sums(typingctx, s, minus):
    """The 16-bit pair sums s as 8 columns' 32-bit sums (neighbouring lanes added: vpmaddwd
    by ones; VNNI's sums are the columns' already), less `minus` in every lane."""
    def codegen(context, builder, signature, args):
        lanes = builder.insert_element(ir.Constant(I32x8, ir.Undefined), args[1], ir.IntType(32)(0))
        lanes = builder.shuffle_vector(lanes, ir.Constant(I32x8, ir.Undefined), ir.Constant(I32x8, [0] * 8))
        if signature.args[0] == int32x8:
            return builder.sub(args[0], lanes)
        i32x16 = ir.VectorType(ir.IntType(32), 16)
        wide = builder.sext(args[0], i32x16)
        even = builder.shuffle_vector(wide, wide, ir.Constant(I32x8, list(range(0, 16, 2))))
        odd = builder.shuffle_vector(wide, wide, ir.Constant(I32x8, list(range(1, 16, 2))))
        return builder.sub(builder.add(even, odd), lanes)
    return int32x8(s, types.int32), codegen


@njit(cache=True, nogil=True)
def to_x8(x, c):
    """x [R, n_in] float32 -> x8 [R, n_in] int8, sx [R, n_in / c] float32 and xsum
    [R, n_in / c] int32 (each group's sum of x8), groups of c inputs: int8_kernel's
    rounding to 127 levels, x ~ x8 * sx with sx = top / 127, top the group's largest |x|."""
    rounded, sx = to_int16(x, c, X8_MAX)  # [R, n_in] int16 within -127..127, [R, n_in / c]
    R, n_in = x.shape
    xsum = np.empty((R, n_in // c), np.int32)  # [R, n_in / c]
    for r in range(R):
        for g in range(n_in // c):
            total = np.int32(0)
            for k in range(g * c, (g + 1) * c):
                total += np.int32(rounded[r, k])
            xsum[r, g] = total
    return rounded.astype(np.int8), sx, xsum


compiling.REGISTRY["kernels.int4_kernel.to_x8"] = lambda dtype, plan: to_x8(np.zeros((1, 8), np.float32), 8)


@njit(inline="always")
def tile(x8, sx, xsum, i, n, qb, sw, b, g, c, out, ahead, mask, shift, near):
    """Rows i..i+n-1 (n = 1..6, a constant where called) times group g of block b's inputs:
    per set of 16 columns, 2n registers of 16-bit sums over the group's quads (per quad one
    load of weights serves 2n vpmaddubsw), then each row's sums added to out as
    fma(float(sum - 8 xsum), sw * sx, out). A tile alone in its pass also asks L1 for its
    set's weights `near` quads on (a constant, 0: none), as row_kernel.tile does."""
    o = b * W  # the block's first output
    for s in range(4):  # sets of 16 columns
        # per row, two registers of 16 int16 lanes: 8 columns x 2 pair sums (with VNNI 8 int32 lanes:
        # 8 columns), columns 16s.. and 16s+8..
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = zero_sums()
        for t in range(g * c // 4, (g + 1) * c // 4):  # t: the quad of inputs 4t..4t+3
            prefetch(qb, (b, t + ahead, s, 0))
            if near:
                prefetch_l1(qb, (b, t + near, s, 0))
            lo, hi = low_nibbles(qb, (b, t, s, 0), mask), high_nibbles(qb, (b, t, s, 0), mask, shift)
            x0 = quad(x8, (i, 4 * t))
            a00, a01 = maddubs(a00, lo, x0), maddubs(a01, hi, x0)
            if n > 1:
                x1 = quad(x8, (i + 1, 4 * t))
                a10, a11 = maddubs(a10, lo, x1), maddubs(a11, hi, x1)
            if n > 2:
                x2 = quad(x8, (i + 2, 4 * t))
                a20, a21 = maddubs(a20, lo, x2), maddubs(a21, hi, x2)
            if n > 3:
                x3 = quad(x8, (i + 3, 4 * t))
                a30, a31 = maddubs(a30, lo, x3), maddubs(a31, hi, x3)
            if n > 4:
                x4 = quad(x8, (i + 4, 4 * t))
                a40, a41 = maddubs(a40, lo, x4), maddubs(a41, hi, x4)
            if n > 5:
                x5 = quad(x8, (i + 5, 4 * t))
                a50, a51 = maddubs(a50, lo, x5), maddubs(a51, hi, x5)
        for r, (low, high) in enumerate(((a00, a01), (a10, a11), (a20, a21), (a30, a31), (a40, a41), (a50, a51))):
            if r < n:
                minus = 8 * xsum[i + r, g]  # the weights were stored as q + 8: x8 . (q + 8) - 8 sum(x8) = x8 . q
                for half, sums in enumerate((low, high)):  # columns 16s..16s+7, then 16s+8..16s+15
                    j = 16 * s + 8 * half
                    scale = fma8(zero8(), sx[i + r, g], load8(sw, (b, g, j)))  # [8 columns]: sw * sx, one rounding
                    before = zero8() if g == 0 else load8(out, (i + r, o + j))
                    store8(out, (i + r, o + j), fma8(before, to_float(column_sums(sums, minus)), scale))


@njit(inline="always")
def one_row(x8, sx, xsum, i, qb, sw, b, g, c, out, ahead, mask, shift):
    """tile's one row, the 4 sets of 16 columns side by side: per quad, one broadcast of the
    row's 4 inputs serves 8 chains of sums that never wait on each other (a set at a time,
    2 chains of 8 quads each, every multiply-add waits for the one before). The same
    integers, the same float steps per group: bitwise tile's outputs."""
    o = b * W
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = zero_sums()  # set s: a_s0 columns 16s.., a_s1 16s+8..
    for t in range(g * c // 4, (g + 1) * c // 4):
        prefetch(qb, (b, t + ahead, 0, 0))  # the quad's 4 sets: 128 bytes, two cache lines
        prefetch(qb, (b, t + ahead, 2, 0))
        x = quad(x8, (i, 4 * t))
        lo, hi = low_nibbles(qb, (b, t, 0, 0), mask), high_nibbles(qb, (b, t, 0, 0), mask, shift)
        a00, a01 = maddubs(a00, lo, x), maddubs(a01, hi, x)
        lo, hi = low_nibbles(qb, (b, t, 1, 0), mask), high_nibbles(qb, (b, t, 1, 0), mask, shift)
        a10, a11 = maddubs(a10, lo, x), maddubs(a11, hi, x)
        lo, hi = low_nibbles(qb, (b, t, 2, 0), mask), high_nibbles(qb, (b, t, 2, 0), mask, shift)
        a20, a21 = maddubs(a20, lo, x), maddubs(a21, hi, x)
        lo, hi = low_nibbles(qb, (b, t, 3, 0), mask), high_nibbles(qb, (b, t, 3, 0), mask, shift)
        a30, a31 = maddubs(a30, lo, x), maddubs(a31, hi, x)
    minus = 8 * xsum[i, g]
    for s, (low, high) in enumerate(((a00, a01), (a10, a11), (a20, a21), (a30, a31))):
        for half, sums in enumerate((low, high)):
            j = 16 * s + 8 * half
            scale = fma8(zero8(), sx[i, g], load8(sw, (b, g, j)))
            before = zero8() if g == 0 else load8(out, (i, o + j))
            store8(out, (i, o + j), fma8(before, to_float(column_sums(sums, minus)), scale))


@when_first_called({"uint8": "void(int8[:, ::1], float32[:, ::1], int32[:, ::1], uint8[:, :, :, ::1], "
                            "uint16[:, :, ::1], float32[:, ::1], int32, int32)"},
                   key=lambda x8, sx, xsum, qb, sw, out, mask, shift: qb.dtype, parallel=True,
                   plan=lambda x8, sx, xsum, qb, sw, out, mask, shift: tile_plan(x8.shape[0]))
def rows_times_nibbles(n):
    """The loop out [R, n_blocks * W] = x8 [R, n_in] (groups scaled by sx) @ the int4
    weights, for R rows in tiles of n or n + 1 rows (row_kernel.tile_plan): per block of
    weights and group of inputs, tile by tile, so a group's 1 KiB of weights is read from
    memory once for all rows."""
    def kernel(x8, sx, xsum, qb, sw, out, mask, shift):
        n_blocks, quads, _, _ = qb.shape
        R = x8.shape[0]
        c = 4 * quads // sx.shape[1]  # inputs per group
        ahead = AHEAD_ROWS // (4 * 32)  # in quads of inputs (4 sets x 32 bytes each)
        n_tiles = -(-R // 6)
        for b in prange(n_blocks):
            for g in range(4 * quads // c):
                if n > 2 and R == n:  # a tile alone (3-5 rows) asks L1 for the next group's weights
                    tile(x8, sx, xsum, 0, n, qb, sw, b, g, c, out, ahead, mask, shift, INT4_GROUP // 4)
                    continue
                i = 0
                for t in range(n_tiles):
                    size = (R - i) // (n_tiles - t)  # n or n + 1
                    # n is a constant: for plans 1 and 2 (1 or 2 rows alone; 7 or more take tiles of 3+)
                    # numba compiles only this branch
                    if n == 1:
                        one_row(x8, sx, xsum, i, qb, sw, b, g, c, out, ahead, mask, shift)
                    elif n < 3 or size == n:
                        tile(x8, sx, xsum, i, n, qb, sw, b, g, c, out, ahead, mask, shift, 0)
                    else:
                        tile(x8, sx, xsum, i, n + 1, qb, sw, b, g, c, out, ahead, mask, shift, 0)
                    i += size
    return kernel


def packed(q):
    """Signed 4-bit blocks q [n_blocks, n_in, W] (values -7..7) -> qb [n_blocks, n_in / 4,
    4, 32] uint8 as the module docstring lays them out."""
    n_blocks, n_in, w = q.shape
    u = (q.astype(np.int16) + 8).astype(np.uint8)  # [n_blocks, n_in, W]: 1..15
    u = u.reshape(n_blocks, n_in // 4, 4, 4, 2, 8)  # [n_blocks, quad, i, set, half, m]
    u = u.transpose(0, 1, 3, 5, 2, 4)  # [n_blocks, quad, set, m, i, half]
    return np.ascontiguousarray(u[..., 0] | (u[..., 1] << 4)).reshape(n_blocks, n_in // 4, 4, 32)


def matmul(rows, qb, n_out, sw):
    """rows [n, n_in] @ w -> [n, n_out] float32, w stored as int4 qb [n_blocks, n_in / 4, 4,
    32] with its group scales sw [n_blocks, n_in / c, W] (bfloat16 bits); only the blocks
    that hold the first n_out outputs are read."""
    n_blocks = -(-n_out // W)
    qb, sw = qb[:n_blocks], sw[:n_blocks]
    x = np.ascontiguousarray(rows, dtype=np.float32)  # [n, n_in]
    x8, sx, xsum = to_x8(x, x.shape[1] // sw.shape[1])  # [n, n_in], [n, n_in / c], [n, n_in / c]: c as sw's groups
    out = np.empty((len(x), n_blocks * W), np.float32)  # [n, n_blocks * W]
    rows_times_nibbles(x8, sx, xsum, qb, sw, out, 15, 4)  # mask and shift: see _nibbles
    return out[:, :n_out]  # [n, n_out]


def columns(qb, tokens, sw):
    """Columns `tokens` of the int4 matrix (qb, sw) as float32 rows [n, n_in]: the tied
    head's columns are the tokens' embeddings, in the very weights the head multiplies by."""
    tokens = np.asarray(tokens)
    b, col = tokens // W, tokens % W  # the block, the column in it
    s, half, m = col // 16, col % 16 // 8, col % 8  # its set of 16, nibble (low or high), place among 8
    quads = qb[b, :, s].reshape(len(tokens), -1, 8, 4)[np.arange(len(tokens)), :, m]  # [n, n_in / 4, 4]
    u = np.where(half[:, None, None] == 1, quads >> 4, quads & 15).reshape(len(tokens), -1)  # [n, n_in]
    c = u.shape[1] // sw.shape[1]
    scale = from_bfloat16(sw[b, :, col])  # [n, n_in / c]
    return (u.astype(np.int8) - 8).astype(np.float32) * np.repeat(scale, c, axis=1)  # [n, n_in]
