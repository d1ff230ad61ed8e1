"""A kernel of our own for a few rows times a weight matrix, on a CPU: numba.

Decoding is bound by memory: one row (a token) reads every weight once and does two
flops per four bytes read. A verification, a draft's catch-up, a batch or a beam step
multiplies a few rows by the same weights, and they could share that read. NumPy cannot
say so: its product (sgemm) first copies the weights into panels of its own, which for
a few rows costs several one-row passes, and one gemv per row reads the weights once per
row. So this file writes the loop itself, with numba (https://numba.pydata.org), which
compiles a Python function to machine code through LLVM.

Layout: each weight matrix w [n_in, n_out] is stored once as contiguous blocks of
W = 64 output columns, wb [n_blocks, n_in, W] (`blocked`; the last block padded with
zeros). A block is then one sequential stream of memory, and numba's threads (prange)
share the blocks out.

Registers: the arithmetic is fused multiply-adds on vectors of V = 8 floats (AVX2's
256-bit registers; 16 such registers per core). The cost to beat is not the multiply but
the loads around it: if each row's sums lived in memory, every multiply-add would load
and store a sum and reload a weight, and 8 rows would take as long to add up as the
weights take to arrive. So the sums live in registers. numba has no vector type, so this
file gives it one (`float32x8`, an LLVM <8 x float>) and four operations on it, each a
few lines of LLVM IR: `load8` (8 weights, widened to float32 if they are stored
narrower), `fma8` (acc + x * w in every lane), `store8`, `zero8`. A value of that type
is a register, as a float64 local is.

- One row (`row_times_blocks`): a block's 64 sums are 8 registers; for k = 0..n_in-1
  each gets x[k] * wb[b, k, 8 lanes]. Each weight is loaded once, next to its use.
- Rows (`rows_times_blocks`): a register tile of n rows x 16 columns, n = 3..6 (up to
  12 sums and 2 weight registers): per k, two loads of weights serve 2n multiply-adds.
  The tile walks CHUNK k-steps, then parks its sums in L1 and the next tile (columns,
  rows) takes the same CHUNK steps of the block, now in L1, so each weight still comes
  from memory once for all rows. A pass of 3 tiles or more (13 rows on: a prompt, a
  chunk of one) walks LONG_CHUNK steps, parking 4x less often (its chunk's 8 KiB still
  fit L1): 7-11% off a 355M pass over 64 or 256 tokens. A pair of rows takes tiles of
  2 rows x 32 columns.
  The rows go in as few tiles as hold them: a second tile over the same chunk lets
  memory and arithmetic overlap less. A tile of fewer rows overlaps worse too: 3 rows
  in a tile of their own cost more than 4 rows do, so float32 pads 2 or 3 rows to 4
  with zero rows (faster), and 7 to 8 (3-5% slower than 3 + 4; `padded_rows`): its
  passes then run tile plans 4 and 5 only, two loops to compile instead of three.

Batch invariance by construction: output j of row i is x[i, 0] w[0, j] + x[i, 1] w[1, j]
+ ..., added in that order, one fused multiply-add at a time, in both kernels, whatever
the number of rows, the row's place among them, the block it sits in or the thread that
runs it. So a row's logits are bitwise the same alone or beside any others
(tests/test_rowwise.py).

Why the prefetch: while the core is busy with multiply-adds, fewer loads are in flight,
and the weights arrive later than they could; a pass then costs its memory time plus its
arithmetic. Asking for the weights a few KiB ahead (the `prefetch` intrinsic below,
LLVM's llvm.prefetch) keeps memory busy while the arithmetic runs, so the two overlap.
A register tile reads 16 of a row's 64 weights a k-step, a new cache line each time, so
its loads wait for L2 unless the line was asked into L1 too (`prefetch_l1`, one chunk
ahead; measured in benchmark_results/NOTES.md, "A tile alone asks L1 for its lines").
`python benchmark.py --only rows` measures what a pass over n rows costs (beside a gemv
per row and one sgemm).

Narrow weights (weight_formats.py): the same blocks stored as bfloat16 (uint16), read by
the same two kernels: `load8` widens 8 of them in registers (the 16 bits become a
float32's high half), so the sums and their order are the float32 kernel's and bfloat16
is batch invariant the same way. int8 weights have kernels of their own, in integers
(int8_kernel.py), which reuse this file's vector type and operations.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from kernels import weight_formats
from kernels.compiling import when_first_called

W = 64  # outputs per block: a multiple of every vector width (8 on AVX2, 16 on AVX-512)
V = 8  # floats per vector register (AVX2)
CHUNK = 8  # k-steps a tile takes before the next tile reuses them from L1 ...
LONG_CHUNK = 32  # ... and with 3 tiles or more, whose parking of sums costs more than a long chunk's L1 reads
AHEAD = 8192  # bytes of a block that one row asks memory for ahead of its loads
AHEAD_ROWS = 12288  # the same for a register tile, whose arithmetic takes longer
# float32's tiles hold at least 4 rows (zero rows added): float32 weights arrive slowly
# enough that 4 rows' arithmetic hides under them, so 2 or 3 rows cost less as 4; 7 rows
# as 4 + 4 cost 3-5% more than as 3 + 4 (benchmark_results/NOTES.md) and leave no 3-row
# tile to compile, seconds off a machine's first run. bfloat16 arrives 2x faster: its
# passes are arithmetic, so it takes tiles of its own size, with no zero rows.
FLOAT32_MIN_TILE = 4


def blocked(w):
    """w [n_in, n_out] -> wb [ceil(n_out / W), n_in, W]: each block's weights contiguous,
    the last block padded with zero columns (its extra outputs are cut off by `matmul`).
    The rows kernel takes CHUNK = 8 inputs at a time, unchecked: n_in must be a multiple
    of 8 (it is for every GPT-2)."""
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
    weights (and format) the head multiplies by. int8 blocks [n_blocks, n_in / 2, W, 2]
    (int8_kernel.paired) hold a column's inputs in order too."""
    tokens = np.asarray(tokens)
    cols = wb[tokens // W, :, tokens % W].reshape(len(tokens), -1)  # [n, n_in]
    if wb.dtype == np.uint16:
        return weight_formats.from_bfloat16(cols)
    if wb.dtype == np.int8:
        return weight_formats.from_int8(cols, scale[tokens], axis=1)
    return cols


class Float32x8(types.Type):
    """numba's type for 8 float32 lanes in one vector register (LLVM's <8 x float>)."""
    def __init__(self):
        super().__init__(name="float32x8")


float32x8 = Float32x8()
VECTOR = ir.VectorType(ir.FloatType(), V)


@register_model(Float32x8)
class Float32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, VECTOR)


def _address(context, builder, array_type, array, index):
    """LLVM pointer to array[index] (index: a tuple of ints, unchecked)."""
    array = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer2(context, builder, data=array.data,
                                     shape=cgutils.unpack_tuple(builder, array.shape),
                                     strides=cgutils.unpack_tuple(builder, array.strides),
                                     layout=array_type.layout, inds=cgutils.unpack_tuple(builder, index),
                                     wraparound=False)


@intrinsic
def load8(typingctx, a, index):
    """a[index], a[index] + 1, ..., 8 consecutive elements of the last axis as float32
    lanes: float32 as they are, bfloat16 bits (uint16) shifted into a float32's high
    half (exact)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        dtype = signature.args[0].dtype
        if dtype == types.float32:
            return builder.load(builder.bitcast(address, VECTOR.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(address, ir.VectorType(ir.IntType(16), V).as_pointer()), align=2)
        i32 = ir.VectorType(ir.IntType(32), V)
        return builder.bitcast(builder.shl(builder.zext(bits, i32), ir.Constant(i32, [16] * V)), VECTOR)
    if a.dtype not in (types.float32, types.uint16):
        return None
    return float32x8(a, index), codegen


@intrinsic
def store8(typingctx, a, index, value):
    """a[index], ..., a[index] + 7 = the 8 lanes of value (a: float32)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(address, VECTOR.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(a, index, value), codegen


@intrinsic
def fma8(typingctx, acc, x, w):
    """acc + x * w in every lane (x a float32, the same for all 8, or 8 lanes of its own):
    llvm.fmuladd, one fused multiply-add where the CPU has one, one rounding either way,
    the same in both kernels."""
    def codegen(context, builder, signature, args):
        xs = args[1]
        if signature.args[1] == types.float32:  # x in every lane
            lanes = ir.Constant(ir.VectorType(ir.IntType(32), V), [0] * V)
            xs = builder.insert_element(ir.Constant(VECTOR, ir.Undefined), xs, ir.IntType(32)(0))
            xs = builder.shuffle_vector(xs, ir.Constant(VECTOR, ir.Undefined), lanes)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VECTOR, [VECTOR] * 3),
                                                 "llvm.fmuladd.v8f32")
        return builder.call(fmuladd, [xs, args[2], args[0]])
    if x not in (types.float32, float32x8):
        return None
    return float32x8(float32x8, x, float32x8), codegen


@intrinsic
def zero8(typingctx):
    """8 lanes of 0.0."""
    def codegen(context, builder, signature, args):
        return ir.Constant(VECTOR, [0.0] * V)
    return float32x8(), codegen


def _prefetch_to(locality):
    """LLVM's llvm.prefetch of the line that holds a[index]: read, data, `locality` (3: into
    L1, the closest cache; 2: L2)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        i32 = ir.IntType(32)
        llvm_prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(llvm_prefetch, [address, i32(0), i32(locality), i32(1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def prefetch(typingctx, a, index):
    """Ask the cache (L2) for the line that holds a[index]. A hint: it never faults (even
    past the end of the array) and changes no value, only when the bytes arrive."""
    return types.void(a, index), _prefetch_to(2)


@intrinsic
def prefetch_l1(typingctx, a, index):
    """`prefetch` into L1: for a line wanted soon, a few hundred cycles on."""
    return types.void(a, index), _prefetch_to(3)


FORMATS = ("float32", "uint16")  # float32 and bfloat16's bits (weight_formats.py)


@when_first_called({t: f"void(float32[::1], {t}[:, :, ::1], float32[::1])" for t in FORMATS},
                   key=lambda x, wb, out: wb.dtype, parallel=True)
def row_times_blocks(x, wb, out):
    """out [n_blocks * W] = x [n_in] @ the matrix whose blocks are wb [n_blocks, n_in, W]:
    per block, 64 sums in 8 registers, one multiply-add per weight."""
    n_blocks, n_in, _ = wb.shape
    ahead = AHEAD // (W * wb.itemsize)  # k-steps
    line = 64 // wb.itemsize  # a cache line's elements
    for b in prange(n_blocks):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero8()
        for k in range(n_in):
            for j in range(0, W, line):
                prefetch(wb, (b, k + ahead, j))
            xk = x[k]
            s0 = fma8(s0, xk, load8(wb, (b, k, 0)))
            s1 = fma8(s1, xk, load8(wb, (b, k, 8)))
            s2 = fma8(s2, xk, load8(wb, (b, k, 16)))
            s3 = fma8(s3, xk, load8(wb, (b, k, 24)))
            s4 = fma8(s4, xk, load8(wb, (b, k, 32)))
            s5 = fma8(s5, xk, load8(wb, (b, k, 40)))
            s6 = fma8(s6, xk, load8(wb, (b, k, 48)))
            s7 = fma8(s7, xk, load8(wb, (b, k, 56)))
        c = b * W
        store8(out, (c,), s0)
        store8(out, (c + 8,), s1)
        store8(out, (c + 16,), s2)
        store8(out, (c + 24,), s3)
        store8(out, (c + 32,), s4)
        store8(out, (c + 40,), s5)
        store8(out, (c + 48,), s6)
        store8(out, (c + 56,), s7)


@njit(inline="always")
def tile(x, i, n, wb, b, k0, chunk, acc, ahead, near):
    """Rows i..i+n-1 of x (n = 3..6) times steps k0..k0+chunk-1 of block b, in register
    tiles of n rows x 16 columns: sNv holds row i+N's columns j+8v..j+8v+7 (up to 12
    registers of sums, 2 of weights, 1 for a row's x: 15 of AVX2's 16). The tile starts
    from zero or from acc [R, W], where the previous chunk parked it. Per k, two loads of
    weights serve 2n multiply-adds. n is a constant where this is called (inlined), so
    LLVM drops the rows past n and each n compiles to a tile of its own.
    Each k-step asks L2 for the strip's line `ahead` k-steps on; a tile alone in its pass
    also asks L1 for the line `near` k-steps on (a constant: 0 is none). A strip reads a
    new line every k-step, and waiting for L2 at each was what a pass of a few rows spent
    beyond its memory time. With more tiles, the chunk's later tiles find its lines in L1
    already, and the extra hint made such passes slower; it made a tile of 6 rows slower
    too, which has no register to spare for it."""
    for j in range(0, W, 16):
        s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = s40 = s41 = s50 = s51 = zero8()
        if k0 > 0:
            s00, s01 = load8(acc, (i, j)), load8(acc, (i, j + 8))
            s10, s11 = load8(acc, (i + 1, j)), load8(acc, (i + 1, j + 8))
            s20, s21 = load8(acc, (i + 2, j)), load8(acc, (i + 2, j + 8))
            if n > 3:
                s30, s31 = load8(acc, (i + 3, j)), load8(acc, (i + 3, j + 8))
            if n > 4:
                s40, s41 = load8(acc, (i + 4, j)), load8(acc, (i + 4, j + 8))
            if n > 5:
                s50, s51 = load8(acc, (i + 5, j)), load8(acc, (i + 5, j + 8))
        for k in range(k0, k0 + chunk):
            prefetch(wb, (b, k + ahead, j))
            if near:
                prefetch_l1(wb, (b, k + near, j))
            w0, w1 = load8(wb, (b, k, j)), load8(wb, (b, k, j + 8))  # the tile's 16 weights of step k
            x0, x1, x2 = x[i, k], x[i + 1, k], x[i + 2, k]
            s00, s01 = fma8(s00, x0, w0), fma8(s01, x0, w1)
            s10, s11 = fma8(s10, x1, w0), fma8(s11, x1, w1)
            s20, s21 = fma8(s20, x2, w0), fma8(s21, x2, w1)
            if n > 3:
                x3 = x[i + 3, k]
                s30, s31 = fma8(s30, x3, w0), fma8(s31, x3, w1)
            if n > 4:
                x4 = x[i + 4, k]
                s40, s41 = fma8(s40, x4, w0), fma8(s41, x4, w1)
            if n > 5:
                x5 = x[i + 5, k]
                s50, s51 = fma8(s50, x5, w0), fma8(s51, x5, w1)
        for r, (lo, hi) in enumerate(((s00, s01), (s10, s11), (s20, s21))):
            store8(acc, (i + r, j), lo)
            store8(acc, (i + r, j + 8), hi)
        if n > 3:
            store8(acc, (i + 3, j), s30)
            store8(acc, (i + 3, j + 8), s31)
        if n > 4:
            store8(acc, (i + 4, j), s40)
            store8(acc, (i + 4, j + 8), s41)
        if n > 5:
            store8(acc, (i + 5, j), s50)
            store8(acc, (i + 5, j + 8), s51)


@njit(inline="always")
def two_rows(x, i, wb, b, k0, acc, ahead):
    """Rows i, i+1 as `tile` takes n, in tiles of 2 rows x 32 columns: per k, four loads
    of weights serve 8 multiply-adds (a 2 x 16 tile would have 2 loads serve 4)."""
    for j in range(0, W, 32):
        if k0 == 0:
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero8()
        else:
            s00, s01 = load8(acc, (i, j)), load8(acc, (i, j + 8))
            s02, s03 = load8(acc, (i, j + 16)), load8(acc, (i, j + 24))
            s10, s11 = load8(acc, (i + 1, j)), load8(acc, (i + 1, j + 8))
            s12, s13 = load8(acc, (i + 1, j + 16)), load8(acc, (i + 1, j + 24))
        for k in range(k0, k0 + CHUNK):
            prefetch(wb, (b, k + ahead, j))
            prefetch(wb, (b, k + ahead, j + 16))
            w0, w1 = load8(wb, (b, k, j)), load8(wb, (b, k, j + 8))
            w2, w3 = load8(wb, (b, k, j + 16)), load8(wb, (b, k, j + 24))
            x0, x1 = x[i, k], x[i + 1, k]
            s00, s01, s02, s03 = fma8(s00, x0, w0), fma8(s01, x0, w1), fma8(s02, x0, w2), fma8(s03, x0, w3)
            s10, s11, s12, s13 = fma8(s10, x1, w0), fma8(s11, x1, w1), fma8(s12, x1, w2), fma8(s13, x1, w3)
        for n, (v0, v1, v2, v3) in enumerate(((s00, s01, s02, s03), (s10, s11, s12, s13))):
            store8(acc, (i + n, j), v0)
            store8(acc, (i + n, j + 8), v1)
            store8(acc, (i + n, j + 16), v2)
            store8(acc, (i + n, j + 24), v3)


def padded_rows(R, dtype):
    """The rows a pass over R rows of weights of NumPy dtype `dtype` multiplies: float32
    adds zero rows until its tiles hold FLOAT32_MIN_TILE rows or more (2 or 3 rows -> 4,
    7 -> 8: tiles of 4 + 4, not 3 + 4); other formats, R."""
    if np.dtype(dtype) != np.float32:
        return R
    while R < FLOAT32_MIN_TILE or tile_plan(R) < FLOAT32_MIN_TILE:
        R += 1
    return R


def loop_for(R, dtype):
    """Which compiled loop a pass over R rows of weights in `dtype` runs: 0 for one row,
    else the tile plan of its rows, padded as `matmul` pads them."""
    if R == 1:
        return 0
    return tile_plan(padded_rows(R, dtype))


def tile_plan(R):
    """The rows of a pass go in as few tiles as hold them (at most 6 rows a tile), of sizes
    as even as can be (7 rows: 3 + 4, float32 pads them to 8; 16: 5 + 5 + 6): tiles of n
    or n + 1 rows.
    This n (2..5; 5 also serves tiles all of 6; 1 for one row, where int4_kernel.py tiles
    it too) names the loop that runs them, so a run compiles the tile sizes it uses (a
    prompt of 100 tokens: 5 and 6), not all five."""
    return min(R // -(-R // 6), 5)


@when_first_called({t: f"void(float32[:, ::1], {t}[:, :, ::1], float32[:, ::1])" for t in FORMATS},
                   key=lambda x, wb, out: wb.dtype, plan=lambda x, wb, out: tile_plan(x.shape[0]), parallel=True)
def rows_times_blocks(n):
    """The loop out [R, n_blocks * W] = x [R, n_in] @ the blocks wb, for R >= 2 rows in
    tiles of n or n + 1 rows (`tile_plan`): per block, CHUNK k-steps at a time (LONG_CHUNK
    for 3 tiles or more), tile by tile."""
    def kernel(x, wb, out):
        n_blocks, n_in, _ = wb.shape
        R = x.shape[0]
        ahead = AHEAD_ROWS // (W * wb.itemsize)  # k-steps
        n_tiles = -(-R // 6)
        chunk = LONG_CHUNK if n_tiles >= 3 and n_in % LONG_CHUNK == 0 else CHUNK
        for b in prange(n_blocks):
            acc = np.empty((R, W), np.float32)  # [R, W]: this block's sums, between chunks
            for k0 in range(0, n_in, chunk):
                if n > 2 and R == n:  # a tile alone (of 3-5 rows) asks L1 for its lines a chunk on (see `tile`)
                    tile(x, 0, n, wb, b, k0, chunk, acc, ahead, CHUNK)
                    continue
                i = 0
                for t in range(n_tiles):
                    size = (R - i) // (n_tiles - t)  # n or n + 1, each a constant in its call (see `tile`)
                    if n == 2:  # n is a constant: numba compiles only the branch it takes
                        two_rows(x, i, wb, b, k0, acc, ahead)  # plan 2 is 2 rows alone (7 or more: tiles of 3+)
                    elif size == n:
                        tile(x, i, n, wb, b, k0, chunk, acc, ahead, 0)
                    else:
                        tile(x, i, n + 1, wb, b, k0, chunk, acc, ahead, 0)
                    i += size
            out[:, b * W:(b + 1) * W] = acc
    return kernel


def matmul(rows, wb, n_out):
    """rows [n, n_in] @ w -> [n, n_out], w given as its blocks wb [n_blocks, n_in, W],
    float32 or bfloat16 (as uint16); only the blocks that hold the first n_out outputs
    are read (a draft's vocabulary subset reads the head's first blocks only)."""
    n_blocks = -(-n_out // W)
    wb = wb[:n_blocks]  # [needed blocks, n_in, W]
    n = rows.shape[0]
    if n == 1:
        out = np.empty((1, n_blocks * W), np.float32)  # [1, n_blocks * W]
        row_times_blocks(np.ascontiguousarray(rows[0], dtype=np.float32), wb, out[0])
    else:
        x = np.ascontiguousarray(rows, dtype=np.float32)  # [n, n_in]
        R = padded_rows(n, wb.dtype)
        if R > n:
            x = np.concatenate([x, np.zeros((R - n, x.shape[1]), np.float32)])  # [R, n_in]
        out = np.empty((R, n_blocks * W), np.float32)  # [R, n_blocks * W]
        rows_times_blocks(x, wb, out)
    return out[:n, :n_out]  # [n, n_out]
