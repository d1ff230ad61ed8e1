"""How many multiply-adds a CPU can do: the ceiling that a batch of rows meets.

One row (a token) is bound by memory: every weight is read for one multiply-add. At 8
rows every weight does 8, and a step is bound by arithmetic instead. This file measures
the inner loop of each kernel with nothing waiting on memory (4 KiB of weights, in L1,
read again and again, on every thread): the most that loop can do on this CPU. Beside
it, `kernels_pass` times the real kernels at 8 rows over a model's matrices, as a decode
step multiplies them (from memory). Each loop is the tile of 4 rows x 16 columns that
the kernels run at batch 8 (one input, or one pair or quad of inputs, per step):

- float32 (row_kernel.py): 2 loads of weights, 4 broadcasts of x, 8 FMAs (8 multiply-
  adds each): 64 multiply-adds.
- int8 x int16 (int8_kernel.py): 2 loads of weights widened to int16, 4 broadcasts of a
  pair of x16, 8 vpmaddwd (16 multiply-adds each) and 8 vpaddd: 128 multiply-adds.
- int8 x 7 bits: AVX2's vpmaddubsw multiplies 32 unsigned by signed bytes and adds
  pairs into int16 with saturation, so one side must keep to 7 bits for the pairs not
  to clip (fbgemm's and ONNX Runtime's `reduce_range` on CPUs without VNNI); 4-bit
  weights are far inside that, so int4_kernel.py multiplies with it (and adds a group's
  pairs in int16 before widening). 8 vpmaddubsw, 8 vpmaddwd with ones (to int32) and
  8 vpaddd: 256 multiply-adds.

Per multiply instruction vpmaddwd does 16 multiply-adds where an FMA does 8, and
vpmaddubsw 32 (then a vpmaddwd widens its sums); but a tile step is more than its
multiplies (loads, broadcasts, the vpaddd), so what each loop reaches here, not the
instruction's width, bounds int8 over float32 at batch 8. `bench_ceiling` is the section
`python benchmark.py --only ceiling` runs; only the benchmark imports this file (numba).
"""
import platform
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bench.common import in_format, measure_bandwidth
from kernels.int8_kernel import I16x16, I32x8, int16x16, int32x8, izero, load16, madd, pair
from kernels.row_kernel import _address, fma8, load8, store8, zero8

STEPS = 20_000_000  # tile steps per thread: ~0.1-0.4 s


@intrinsic
def load32(typingctx, a, index):
    """32 bytes from a[index] on, as they are (no widening)."""
    def codegen(context, builder, signature, args):
        address = _address(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(address, I16x16.as_pointer()), align=1)
    return int16x16(a, index), codegen


@intrinsic
def maddubs_madd(typingctx, acc, u8, s8, ones):
    """acc + vpmaddwd(vpmaddubsw(u8, s8), ones): x86's own instructions (LLVM intrinsics)."""
    def codegen(context, builder, signature, args):
        i8x32 = ir.VectorType(ir.IntType(8), 32)
        ubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I16x16, [i8x32, i8x32]),
                                             "llvm.x86.avx2.pmadd.ub.sw")
        wd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32x8, [I16x16, I16x16]),
                                            "llvm.x86.avx2.pmadd.wd")
        pairs = builder.call(ubs, [builder.bitcast(args[1], i8x32), builder.bitcast(args[2], i8x32)])
        return builder.add(args[0], builder.call(wd, [pairs, args[3]]))
    return int32x8(int32x8, int16x16, int16x16, int16x16), codegen


@intrinsic
def lanes_sum(typingctx, a):
    """The 8 int32 lanes of a added up (keeps the sums alive)."""
    def codegen(context, builder, signature, args):
        total = builder.extract_element(args[0], ir.IntType(32)(0))
        for lane in range(1, 8):
            total = builder.add(total, builder.extract_element(args[0], ir.IntType(32)(lane)))
        return total
    return types.int32(int32x8), codegen


# Each step reads weights at (i & 63) * stride (4 KiB in all) and x at i & 7, so no two
# steps are the same and the compiler cannot fold them; 8 sums, 8 different products.
@njit(parallel=True)
def float32_tile(w, x, n, out):
    for t in prange(out.shape[0]):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero8()
        for i in range(n):
            k, j = (i & 63) * 16, i & 7
            w0, w1 = load8(w, (k,)), load8(w, (k + 8,))  # 16 columns
            x0, x1, x2, x3 = x[j], x[j + 8], x[j + 16], x[j + 24]  # 4 rows' input
            a0, a1, a2, a3 = fma8(a0, x0, w0), fma8(a1, x0, w1), fma8(a2, x1, w0), fma8(a3, x1, w1)
            a4, a5, a6, a7 = fma8(a4, x2, w0), fma8(a5, x2, w1), fma8(a6, x3, w0), fma8(a7, x3, w1)
        for j, a in enumerate((a0, a1, a2, a3, a4, a5, a6, a7)):
            store8(out, (t, 8 * j), a)  # every sum kept: a sum never stored is not computed


@njit(parallel=True)
def int16_tile(q, x16, n, out):
    for t in prange(out.shape[0]):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = izero()
        for i in range(n):
            k, j = (i & 63) * 32, 2 * (i & 7)
            w0, w1 = load16(q, (k,)), load16(q, (k + 16,))  # 16 columns x 2 inputs
            x0, x1, x2, x3 = pair(x16, (j,)), pair(x16, (j + 16,)), pair(x16, (j + 32,)), pair(x16, (j + 48,))
            a0, a1, a2, a3 = madd(a0, x0, w0), madd(a1, x0, w1), madd(a2, x1, w0), madd(a3, x1, w1)
            a4, a5, a6, a7 = madd(a4, x2, w0), madd(a5, x2, w1), madd(a6, x3, w0), madd(a7, x3, w1)
        out[t, 0] = lanes_sum(a0) + lanes_sum(a1) + lanes_sum(a2) + lanes_sum(a3) + lanes_sum(a4) + \
            lanes_sum(a5) + lanes_sum(a6) + lanes_sum(a7)


@njit(parallel=True)
def byte_tile(q, x16, n, out):
    for t in prange(out.shape[0]):
        ones = pair(x16, (128,))
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = izero()
        for i in range(n):
            k, j = (i & 63) * 64, 2 * (i & 7)
            w0, w1 = load32(q, (k,)), load32(q, (k + 32,))  # 16 columns x 4 inputs
            x0, x1, x2, x3 = pair(x16, (j,)), pair(x16, (j + 16,)), pair(x16, (j + 32,)), pair(x16, (j + 48,))
            a0, a1 = maddubs_madd(a0, w0, x0, ones), maddubs_madd(a1, w1, x0, ones)
            a2, a3 = maddubs_madd(a2, w0, x1, ones), maddubs_madd(a3, w1, x1, ones)
            a4, a5 = maddubs_madd(a4, w0, x2, ones), maddubs_madd(a5, w1, x2, ones)
            a6, a7 = maddubs_madd(a6, w0, x3, ones), maddubs_madd(a7, w1, x3, ones)
        out[t, 0] = lanes_sum(a0) + lanes_sum(a1) + lanes_sum(a2) + lanes_sum(a3) + lanes_sum(a4) + \
            lanes_sum(a5) + lanes_sum(a6) + lanes_sum(a7)


def best_rate(loop, args, multiply_adds, reps):
    """Multiply-adds per second over all threads (a tile step does multiply_adds), the
    best of reps (after a warm-up, which compiles the loop)."""
    out = np.zeros((numba.get_num_threads(), 64), np.float32 if loop is float32_tile else np.int64)
    loop(*args, 10, out)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        loop(*args, STEPS, out)
        best = min(best, time.perf_counter() - start)
    return out.shape[0] * STEPS * multiply_adds / best


def ceilings(reps):
    """{loop: multiply-adds per second} with everything in L1, on every thread."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(64 * 16 + 16, dtype=np.float32)
    x = rng.standard_normal(32, dtype=np.float32)
    q = rng.integers(-127, 128, 64 * 64 + 64).astype(np.int8)
    x16 = np.ones(256, np.int16)  # pair(x16, 128) is then a vector of ones
    rates = {"float32": best_rate(float32_tile, (w, x), 64, reps),
             "int8 x int16": best_rate(int16_tile, (q, x16), 128, reps)}
    if platform.machine().lower() in ("x86_64", "amd64"):
        rates["int8 x 7 bits"] = best_rate(byte_tile, (q, x16), 256, reps)
    return rates


def kernels_pass(params, rows):
    """(multiply-adds, bytes of weights, seconds) of rows (e.g. 8) times every matrix of
    a model in the kernels' layout (the blocks' linear layers and the head), as a decode
    step reads them."""
    layers = [block[part][name]["w"] for block in params["blocks"] for part, names in
              (("attn", ("c_attn", "c_proj")), ("mlp", ("c_fc", "c_proj"))) for name in names]
    layers.append(params["wte"].T)  # weights.Matrix each (kernels/weights.py)
    n_embd = params["wte"].shape[1]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((rows, 4 * n_embd if i % 4 == 3 else n_embd), dtype=np.float32)  # [rows, n_in]
              for i in range(len(layers))]  # every 4th (mlp's c_proj) takes 4 n_embd inputs
    start = time.perf_counter()
    for x, w in zip(inputs, layers):
        x @ w
    seconds = time.perf_counter() - start
    return rows * sum(x.shape[1] * w.n_out for x, w in zip(inputs, layers)), sum(w.nbytes for w in layers), seconds


def bench_ceiling(loaded, args, probe):
    """Each kernel's inner loop with its operands in L1 (the most it can do here), then
    float32 and int8 kernels over each model's matrices at each batch in --format_batches,
    in turns: multiply-adds/s, and the bytes of weights a second."""
    result = {"ceilings": ceilings(args.reps), "kernels": [], "bandwidth_GBs": measure_bandwidth(probe)}
    for size in args.sizes:
        models = {dtype: in_format(loaded[size], dtype)[0][0] for dtype in ("float32", "int8")}
        for B in args.format_batches:
            seconds, stored = {dtype: [] for dtype in models}, {}
            for _ in range(args.reps + 1):  # the first warms up
                for dtype, params in models.items():
                    multiply_adds, stored[dtype], s = kernels_pass(params, B)
                    seconds[dtype].append(s)
            for dtype in models:
                best = min(seconds[dtype][1:])
                result["kernels"].append({"size": size, "batch": B, "dtype": dtype, "ms": 1e3 * best,
                                          "multiply_adds_per_s": multiply_adds / best,
                                          "weights_GBs": stored[dtype] / best / 1e9})
    return result
