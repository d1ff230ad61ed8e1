"""A few rows times a weight matrix on a GPU: each weight read once, each row as if alone.

A decode step multiplies a row per sequence by every weight matrix (a verification, K+1
a sequence), so it is a matrix-vector product (GEMV), bound by reading the weights:
124M's 0.5 GB take 0.2 ms at an H100's 3 TB/s. cuBLAS would do it, but CuPy cannot record
cuBLAS into a CUDA graph (cuda_graphs.py), so the step's products are this kernel of ours.

The weights are stored transposed, w [n_out, n_in], so that each output's weights are one
contiguous run. A warp (32 threads) computes one output j for every row: lane l reads
w[j, 4l..4l+3], then w[j, 4l+128..4l+131], and so on (16 bytes a lane, 512 across the warp
a step: coalesced), multiplies each by every row's inputs there, and keeps one float32
sum per row; at the end the 32 lanes' sums meet in a fixed tree (cuda.warp_sum). So the
weights are read once for up to ROWS rows, and a row's output is summed in the same order
whatever rows share the launch: batch invariant, as the CPU's kernels are. More than ROWS
rows run ROWS at a time (the weights come again, mostly from L2), and a block takes at most
ROWS_BLOCK rows, so a prompt's product spreads over more blocks. Every product of a pass on
a GPU is this kernel, a prompt's too: a token's output is the same bits whichever pass
computes it (a prompt whole or in chunks, a step or a verification), which chunked prefill
and the prefix cache need. The price is a long prompt's speed: cuBLAS would reuse each weight
across its many rows from shared memory, on tensor cores. Over many rows a warp reads each
row's inputs once for each of its outputs, so there a warp takes COLS_WIDE outputs at once,
each summed in the same order as alone: a quarter of the reads of inputs, and a quarter of
the warps, of which a product of more than ROWS_BLOCK rows has plenty.

Memory answers a load after about half a microsecond, so reading at its bandwidth (~4.8 TB/s
on an H200) needs megabytes of loads in flight: a lane issues the loads of UNROLL k-steps'
weights before it uses any (the sm_90 build issues all 8 before its first multiply: `python
benchmark_results/sass_loads.py`). A row alone, a decode step's at batch 1 and every draft's,
has a kernel of its own: one sum a lane instead of ROWS leaves registers for 3 blocks an SM
instead of 2. Which kernel a row meets changes no bit: each sums its outputs in the same order.

`linear` also does, as each output is stored, what gpt2.py does right after a product (its
*tail*): the bias, the GELU of the MLP's first layer, the residual add of a block; and, as
each input is read, the layer norm gpt2.py does before a block's attention and MLP (each
block of the launch first takes its rows' mean and deviation, a warp a row, so a row's
statistics are the same sums whatever shares the launch). Apart, each is a launch of its own
(the GELU alone nine), and a recorded step is bound by launches.
"""
import numpy as np

import gpt2
from kernels import cuda

ROWS = 8  # rows a warp carries at once: 8 float32 sums a lane
ROWS_BLOCK = 64  # rows a block takes: a product of more rows has more blocks
WARPS = 8  # a block's warps (256 threads)
COLS_WIDE = 4  # outputs a warp computes in a product of more than ROWS_BLOCK rows (a prompt's)
# k-steps a lane loads the weights of before it uses any: more keep more bytes in flight, which
# a product of few outputs needs (124M's c_proj: 96 blocks for 132 SMs), and float16 twice, at
# the price of registers. The loads move, the sums do not (NVRTC does not reassociate float sums
# without --use_fast_math), so any value gives the same bits (bench/gpu_kernels.py times others).
UNROLL = 8
UNROLL_WIDE = 2  # a prompt's kernel: its warps are many, and its registers hold COLS_WIDE sums a row

KERNELS = "".join(f"#define {name} {value}\n" for name, value in
                  (("ROWS", ROWS), ("ROWS_BLOCK", ROWS_BLOCK), ("COLS_WIDE", COLS_WIDE), ("WARPS", WARPS),
                   ("UNROLL_WIDE", UNROLL_WIDE))) + r"""
// y[r, j] = tail(sum_k x[r, k] w[j, k]) for r < R: w [n_out, n_in], x [R, n_in], y [R, n_out].
// The tail is what gpt2.py does next to a product, done as it is stored: + b[j] (if has_bias),
// then gelu (if gelu), then + res[r, j] (if has_res): one launch instead of two to eleven. With LN, x is
// layer-normed on the way in (gamma ln_g, beta ln_b), as gpt2.py does before the block's
// products: each block first takes its rows' mean and 1 / deviation, a warp a row (the same sums
// whatever the block's other rows), then normalizes each input as it loads it. LN is a
// template parameter, not a flag: its code would cost every product registers, and so warps
// in flight. A warp takes COLS outputs from j0 on, RT rows at a time (RT sums an output a lane:
// a kernel for one row has the registers to load more at once); block i takes the outputs
// i % out_blocks of rows ROWS_BLOCK * (i / out_blocks) on. U: k-steps whose weights are loaded together.
template <typename T, int COLS, bool LN, int U, int RT>
__device__ void rows_times_columns(const T* __restrict__ w, const T* __restrict__ x, const T* __restrict__ b,
                                   const T* res, T* y, int R, int n_in, int n_out, int has_bias, int gelu, int has_res,
                                   const T* __restrict__ ln_g, const T* __restrict__ ln_b, float eps) {
    __shared__ float mean[ROWS_BLOCK], rsd[ROWS_BLOCK];  // the layer norm's statistics of the block's rows
    int warps = blockDim.x / 32, out_blocks = (n_out + warps * COLS - 1) / (warps * COLS);
    int j0 = (blockIdx.x % out_blocks * warps + threadIdx.x / 32) * COLS, lane = threadIdx.x % 32;
    int r_first = blockIdx.x / out_blocks * ROWS_BLOCK, r_end = min(R, r_first + ROWS_BLOCK);
    if (LN) {  // gpt2.layer_norm's statistics, in float32: the mean, then the deviations from it
        for (int r = r_first + threadIdx.x / 32; r < r_end; r += warps) {
            const T* xr = x + (size_t)r * n_in;
            float s = 0.0f, v = 0.0f;
            for (int k = lane; k < n_in; k += 32) s += load(xr + k);
            float mu = warp_sum(s) / n_in;
            for (int k = lane; k < n_in; k += 32) { float d = load(xr + k) - mu; v += d * d; }
            float inverse = 1.0f / sqrtf(warp_sum(v) / n_in + eps);  // once a row: a multiply an input, not a divide
            if (lane == 0) { mean[r - r_first] = mu; rsd[r - r_first] = inverse; }
        }
        __syncthreads();  // (before any warp leaves: every thread must reach it)
    }
    if (j0 >= n_out) return;  // the whole warp: no lane is left waiting in a shuffle
    int m = min(COLS, n_out - j0);  // the warp's outputs
    const T* wj = w + (size_t)j0 * n_in;
    // the input of row r (of the block's) at k: x, or gpt2.layer_norm's g * ((x - mean) / sd) + b (times 1 / sd)
    auto normed = [&](float xk, int r, float g, float beta) {
        return LN ? g * ((xk - mean[r]) * rsd[r]) + beta : xk;
    };
    for (int r0 = r_first; r0 < r_end; r0 += RT) {
        int n = min(RT, r_end - r0);
        const T* xr = x + (size_t)r0 * n_in;
        float acc[RT][COLS];
        #pragma unroll
        for (int r = 0; r < RT; r++)
            #pragma unroll
            for (int c = 0; c < COLS; c++) acc[r][c] = 0.0f;
        int n4 = n_in % 4 ? 0 : n_in;  // four inputs a load where rows stay aligned to them (every GPT-2)
        // U k-steps at a time (a warp reads 512 bytes of float32 weights an output a step): their
        // weights loaded first, all U in flight together, then each multiplied in k's order
        for (int k0 = 4 * lane; k0 < n4; k0 += 128 * U) {
            float wk[U][COLS][4];
            #pragma unroll
            for (int u = 0; u < U; u++)
                #pragma unroll
                for (int c = 0; c < COLS; c++) {
                    if (c < m && k0 + 128 * u < n4) load4(wj + (size_t)c * n_in + k0 + 128 * u, wk[u][c]);
                    else wk[u][c][0] = wk[u][c][1] = wk[u][c][2] = wk[u][c][3] = 0.0f;
                }
            #pragma unroll
            for (int u = 0; u < U; u++) {
                int k = k0 + 128 * u;
                if (k >= n4) break;  // (a lane's last steps: no shuffle until the loop ends)
                float xk[4], gk[4] = {1.0f, 1.0f, 1.0f, 1.0f}, bk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if (LN) { load4(ln_g + k, gk); load4(ln_b + k, bk); }
                #pragma unroll
                for (int r = 0; r < RT; r++) {
                    if (r < n) {
                        load4(xr + (size_t)r * n_in + k, xk);
                        #pragma unroll
                        for (int i = 0; i < 4; i++) xk[i] = normed(xk[i], r0 - r_first + r, gk[i], bk[i]);
                        #pragma unroll
                        for (int c = 0; c < COLS; c++)
                            #pragma unroll
                            for (int i = 0; i < 4; i++) acc[r][c] = fmaf(wk[u][c][i], xk[i], acc[r][c]);
                    }
                }
            }
        }
        for (int k = n4 + lane; k < n_in; k += 32) {  // any other width: one input a load
            float wk[COLS];
            #pragma unroll
            for (int c = 0; c < COLS; c++) wk[c] = c < m ? load(wj + (size_t)c * n_in + k) : 0.0f;
            #pragma unroll
            for (int r = 0; r < RT; r++) {
                if (r < n) {
                    float xk = load(xr + (size_t)r * n_in + k);
                    if (LN) xk = normed(xk, r0 - r_first + r, load(ln_g + k), load(ln_b + k));
                    #pragma unroll
                    for (int c = 0; c < COLS; c++) acc[r][c] = fmaf(wk[c], xk, acc[r][c]);
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < RT; r++) {
            if (r >= n) break;  // the same for the whole warp
            #pragma unroll
            for (int c = 0; c < COLS; c++) {
                float s = warp_sum(acc[r][c]);
                if (lane == 0 && c < m) {
                    size_t at = (size_t)(r0 + r) * n_out + j0 + c;
                    if (has_bias) s += load(b + j0 + c);
                    if (gelu) s = 0.5f * s * (1.0f + tanhf(0.7978845608028654f * (s + 0.044715f * s * s * s)));
                    if (has_res) s = load(res + at) + s;
                    store(y + at, s);
                }
            }
        }
    }
}
#define ROWS_TIMES_COLUMNS(T, COLS, LN, U, RT, BOUNDS, NAME) extern "C" __global__ void BOUNDS NAME(const T* w,  \
    const T* x, const T* b, const T* res, T* y, int R, int n_in, int n_out, int has_bias, int gelu,        \
    int has_res, const T* ln_g, const T* ln_b, float eps) {                                                \
    rows_times_columns<T, COLS, LN, U, RT>(w, x, b, res, y, R, n_in, n_out, has_bias, gelu, has_res, ln_g, ln_b, eps); }
#define ROWS_TIMES_COLUMNS_ALL(COLS, U, RT, BOUNDS, NAME)                         \
    ROWS_TIMES_COLUMNS(float, COLS, false, U, RT, BOUNDS, NAME##_f32)             \
    ROWS_TIMES_COLUMNS(unsigned short, COLS, false, U, RT, BOUNDS, NAME##_f16)    \
    ROWS_TIMES_COLUMNS(float, COLS, true, U, RT, BOUNDS, NAME##_ln_f32)           \
    ROWS_TIMES_COLUMNS(unsigned short, COLS, true, U, RT, BOUNDS, NAME##_ln_f16)
// A decode step's products (registers: benchmark_results/sass_loads.py): one row's keeps 3
// blocks an SM (at most 85 registers a thread; sm_90 builds take 56-72): c_attn and c_fc of
// 124M are 288 and 384 blocks, one wave on an H200's 132 SMs. ROWS rows' keeps 2 (at most 128;
// 80-106): in 85, 8 steps' weights beside ROWS sums and inputs a lane spill, and 2 blocks of 8
// steps in flight are more bytes than 3 of 2. None spills. A prompt's (wide) kernel is left
// unbounded: bounded, it spills.
ROWS_TIMES_COLUMNS_ALL(1, UNROLL, 1, __launch_bounds__(32 * WARPS, 3), row_times_columns)
ROWS_TIMES_COLUMNS_ALL(1, UNROLL, ROWS, __launch_bounds__(32 * WARPS, 2), rows_times_columns)
ROWS_TIMES_COLUMNS_ALL(COLS_WIDE, UNROLL_WIDE, ROWS, , rows_times_wide_columns)
"""


def source(unroll=UNROLL):
    """The kernels' CUDA C, a few rows' loading the weights of `unroll` k-steps together."""
    return f"#define UNROLL {unroll}\n" + KERNELS


SOURCE = source()


def matmul(rows, w):
    """rows [n, n_in] @ w.T -> [n, n_out], w [n_out, n_in] in device memory, both of the
    model's dtype. NumPy arrays (the stand-in a CPU tests the GPU's bookkeeping with)
    take NumPy's product."""
    if isinstance(rows, np.ndarray):
        return rows @ w.T  # [n, n_out]
    return launch(rows, w, None)


def linear(x, w, b, gelu=False, residual=None, norm=None):
    """gpt2.linear(x, w, b), then gpt2.gelu if gelu, then residual + it: x [..., n_in], w a
    Matrix, residual like the output [..., n_out]; norm: a layer norm's {"g", "b"}, x
    normalized by gpt2.layer_norm first. One launch on a GPU (the layer norm done as each
    input is read, the tail as each output is stored); NumPy (the stand-in) runs gpt2.py's
    own functions."""
    rows = x.reshape(-1, x.shape[-1])  # [n, n_in]
    shape = (*x.shape[:-1], w.stored.shape[0])  # [..., n_out]
    if isinstance(rows, np.ndarray):
        y = gpt2.linear(x if norm is None else gpt2.layer_norm(x, **norm), w, b)  # [..., n_out]
        y = gpt2.gelu(y) if gelu else y
        return y if residual is None else residual + y
    res = None if residual is None else residual.reshape(-1, shape[-1])  # [n, n_out]
    return launch(rows, w.stored, b, gelu, res, norm).reshape(shape)  # [..., n_out]


def launch(rows, w, b, gelu=False, res=None, norm=None, code=SOURCE):
    """The kernel over rows [n, n_in] and w [n_out, n_in]: [n, n_out] with its tail, rows
    layer-normed first by norm {"g", "b"} if given (code: the CUDA C, another `source` for
    the benchmark)."""
    import cupy
    n, n_in = rows.shape
    rows = cupy.ascontiguousarray(rows, dtype=w.dtype)
    out = cupy.empty((n, w.shape[0]), w.dtype)  # [n, n_out]
    res = out if res is None else cupy.ascontiguousarray(res, dtype=w.dtype)  # (not read without has_res)
    has_bias, b = b is not None, w if b is None else b  # [n_out] (w: never read by the kernel without has_bias)
    ln = (w, w) if norm is None else (norm["g"], norm["b"])  # (w: never read by the kernel without _ln)
    if any(a.dtype != w.dtype for a in (b, *ln)):  # the kernel reads every array as the weights' dtype
        raise TypeError(f"the bias and layer norm must be of the weights' dtype, {w.dtype}, not "
                        f"{[str(a.dtype) for a in (b, *ln)]}: give all one dtype (layout.device_layout does)")
    cols = COLS_WIDE if n > ROWS_BLOCK else 1  # (each output summed in the same order whichever kernel)
    name = ("rows_times_wide_columns" if cols > 1 else "row_times_columns" if n == 1 else "rows_times_columns") + (
        "" if norm is None else "_ln")
    kernel = cuda.function(code, name, w.dtype)
    blocks = -(-w.shape[0] // (WARPS * cols)) * -(-n // ROWS_BLOCK)  # cols outputs a warp, ROWS_BLOCK rows a block
    if blocks:  # (none: no rows; CuPy would still launch a block)
        kernel((blocks,), (32 * WARPS,), (w, rows, b, res, out, np.int32(n), np.int32(n_in), np.int32(w.shape[0]),
                                          np.int32(has_bias), np.int32(gelu), np.int32(res is not out), *ln,
                                          np.float32(1e-5)))  # gpt2.layer_norm's eps
    return out


class Matrix:
    """A weight matrix [n_in, n_out] as the GPU's kernel reads it: `stored`, its transpose
    [n_out, n_in] in device memory. gpt2.py's `x @ w` runs `matmul` (NumPy and CuPy hand the
    product to __rmatmul__, as for the CPU's weights.Matrix); in a weights.Embedding it is
    also the tied head, whose rows are the token embeddings."""
    __array_ufunc__ = None  # x @ m: NumPy and CuPy return NotImplemented, Python calls m.__rmatmul__(x)

    def __init__(self, stored):
        self.stored = stored  # [n_out, n_in]

    @property
    def shape(self):
        return self.stored.shape[::-1]

    @property
    def dtype(self):
        return self.stored.dtype

    @property
    def nbytes(self):
        return self.stored.nbytes

    def __rmatmul__(self, x):
        """x [..., n_in] @ self -> [..., n_out]."""
        rows = x.reshape(-1, x.shape[-1])  # [n, n_in]
        return matmul(rows, self.stored).reshape(*x.shape[:-1], self.stored.shape[0])  # [..., n_out]

    def first(self, n):
        """The first n columns (a view)."""
        return Matrix(self.stored[:n])

    def columns(self, j):
        """Columns j [n] as rows [n, n_in] (the embeddings of tokens j, for the tied head)."""
        return self.stored[j]
