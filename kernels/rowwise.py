"""How a few rows multiply the weights on a CPU: fast, and each row exactly as if alone.

A decode step multiplies one row (a token) by every weight matrix; a verification, a
draft's catch-up pass, a batch or a beam step multiplies a few. Reading the weights from
memory is the cost, so n rows should cost little more than one, and a request's logits
should not depend on which other rows share its pass (else its sampled text would depend
on its batch). `matmul` is the one place where rows meet weights, with two kernels:

- "numba" (the default, row_kernel.py): the weights stored as contiguous blocks of 64
  output columns (in float32, bfloat16, int8 or int4: weight_formats.py), and a kernel
  of our own that reads each weight once for all rows and sums every output in the same
  order whatever the rows (int8 and int4 in integers: int8_kernel.py, int4_kernel.py).
  A pass over 2-6 rows costs little more than one (`python benchmark.py --only rows`).
- "numpy" (the fallback, when numba is missing or GPT2_ROW_KERNEL=numpy): BLAS alone.
  Its matrix product (sgemm) repacks the weights first, which for 2-8 rows costs 2-3
  one-row passes, and rounds a row differently depending on how many rows share it. So
  each row of a pass is its own matrix-vector product (gemv), block by block: the
  weights are cut into contiguous blocks of output columns that fit in a core's L2 cache
  (views of a column-major matrix), every row multiplies a block while it is there, and
  two threads of ours take half of the blocks each while OpenBLAS is held to one thread.
  Each gemv output is summed in an order that depends only on the row and that output's
  weights (`gemv_is_exact` checks this on the machine at hand). One row alone is one
  gemv over the whole matrix with OpenBLAS's own threads: the same numbers.

Each kernel is batch invariant, long prompts included; the two round differently from
each other. The weights reach `matmul` through gpt2.py's `x @ w` (weights.py).
"""
import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    from kernels import compiling  # when the kernels compile: at first use, or ahead in other processes
    from kernels import int4_kernel  # int4 weights, two a byte, times 8-bit activations
    from kernels import int8_kernel  # int8 weights times 16-bit activations
    from kernels import row_kernel  # float32 and bfloat16 weights
    from kernels import row_ops  # layer norm and attention for the kernel's passes
except ImportError:  # no numba: the NumPy fallback
    compiling = int4_kernel = int8_kernel = row_kernel = row_ops = None
    NUMBA_PROBLEM = None
except ValueError as e:  # numba refused its own settings (NUMBA_NUM_THREADS=0)
    compiling = int4_kernel = int8_kernel = row_kernel = row_ops = None
    NUMBA_PROBLEM = f"numba cannot start ({e}): fix its NUMBA_* settings, or run the NumPy kernels (--kernel numpy)"
else:
    import numba
    NUMBA_PROBLEM = ("NUMBA_DISABLE_JIT=1 leaves the kernels as Python, which their registers' intrinsics cannot "
                     "run: unset it, or run the NumPy kernels (--kernel numpy)") if numba.config.DISABLE_JIT else None

KERNEL_ENV = "GPT2_ROW_KERNEL"
KERNELS = ("numba", "numpy")


def pick_kernel(asked):
    """The kernel asked for, or "numpy" when numba cannot be imported."""
    if asked not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={asked!r}: set it to numba or numpy (or unset it)")
    return "numpy" if asked == "numba" and row_kernel is None else asked


try:  # main.py, server.py and benchmark.py print KERNEL_ERROR as one line
    KERNEL, KERNEL_ERROR = pick_kernel(os.environ.get(KERNEL_ENV, "numba")), None
    if os.environ.get(KERNEL_ENV, "numba") == "numba" and NUMBA_PROBLEM:
        KERNEL, KERNEL_ERROR = "numpy", NUMBA_PROBLEM
except ValueError as e:
    KERNEL, KERNEL_ERROR = "numpy", str(e)


def use(kernel):
    """Run `kernel` from now on (the commands' --kernel, before any model is loaded: a model's
    layout at load decides which kernel runs it). "numpy": gpt2.py's own NumPy layer norm
    and kv_cache.attend's NumPy attention, each product a gemv per row (gemv_rows), the
    reference a reader can trust; "numba": the kernels, where numba imports."""
    global KERNEL, KERNEL_ERROR
    if kernel == "numba" and NUMBA_PROBLEM:
        raise ValueError(NUMBA_PROBLEM)
    if kernel == "numba" and row_kernel is None:
        raise ValueError("--kernel numba needs numba: pip install numba (or use --kernel numpy)")
    KERNEL, KERNEL_ERROR = pick_kernel(kernel), None

BLOCK_BYTES = 256 << 10  # a block stays in a core's L2 (512 KiB or more) while every row uses it
_second_thread = ThreadPoolExecutor(1)


def matmul(rows, w, n_out=None, scale=None):
    """rows [n, n_in] @ w -> [n, n_out], each row as it would come out alone. w: a matrix
    [n_in, n_out] (column-major: the fallback's layout), or its blocks [n_blocks, n_in, 64]
    for the numba kernel (row_kernel.py; n_out then says how many outputs are real),
    float32, bfloat16 (uint16), int8 or int4 (uint8) with its scales. The kernel is faster
    than OpenBLAS held to one thread (see kernel_pass) at every row count
    (`python benchmark.py --only kernels`)."""
    if w.dtype == np.uint8:  # int4, two a byte (int4_kernel.py)
        return int4_kernel.matmul(rows, w, n_out or w.shape[0] * row_kernel.W, scale)
    if w.ndim == 4:  # int8 in pairs of inputs (int8_kernel.py)
        return int8_kernel.matmul(rows, w, n_out or w.shape[0] * row_kernel.W, scale)
    if w.ndim == 3:
        return row_kernel.matmul(rows, w, n_out or w.shape[0] * row_kernel.W)
    if not isinstance(rows, np.ndarray):
        return rows @ w  # a GPU (CuPy)
    if rows.shape[0] == 1 and gemv_is_exact():
        return gemv_one(rows, w)
    return gemv_rows(rows, w)


def n_inputs(wb):
    """n_in of a matrix stored as the kernels' blocks: float32 and bfloat16 [n_blocks, n_in,
    64], int8 [n_blocks, n_in / 2, 64, 2], int4 [n_blocks, n_in / 4, 4, 32]."""
    return wb.shape[1] * (4 if wb.dtype == np.uint8 else 2 if wb.ndim == 4 else 1)


def layer_norm(x, g, b):
    """gpt2.layer_norm as the kernels' loop (row_ops.py): each row's statistics in a fixed order."""
    return row_ops.layer_norm(x, g, b)


def attention(q, k, v, positions):
    """gpt2.attention over each row's own keys up to each query's position, as one loop of
    the kernels' (row_ops.py): q [B, n_head, T, d_head], k, v [B, n_head, S, d_head]."""
    return row_ops.attention(q, k, v, positions)  # [B, n_head, T, d_head]


def in_blocks(params):
    """Whether params are laid out for the numba kernels (layout.py): matrices in blocks."""
    w = params["blocks"][0]["mlp"]["c_fc"]["w"] if params.get("blocks") else None
    return getattr(getattr(w, "stored", None), "ndim", 2) > 2


def row_ops_for(model):
    """The loops a pass of this model runs for layer norm and attention, (layer_norm,
    attention) of row_ops.py, where the model is in the row kernel's layout with heads a
    multiple of 8 floats wide; else None (gpt2.py's NumPy and kv_cache.attend's)."""
    params, hparams = model
    if in_blocks(params) and hparams["n_embd"] // hparams["n_head"] % row_kernel.V == 0:
        return layer_norm, attention
    return None


def warm_passes(row_counts, dtype):
    """The fewest tokens a pass over which runs the loops that passes over row_counts tokens
    run, in weights of `dtype`: the kernels compile one loop per format and tile plan, and
    the first 7 row counts reach every one, so a warm-up over these compiles what a run
    will use at little cost. Without the kernels: one token (nothing to compile)."""
    if KERNEL != "numba":
        return [1]
    loops = {row_kernel.loop_for(R, dtype) for R in row_counts}
    return sorted({min(r for r in range(1, 8) if row_kernel.loop_for(r, dtype) == loop) for loop in loops})


# each stored dtype's loops, as `matmul` dispatches: (one row, rows, the activations' rounding)
LOOPS = {"float32": ("row_kernel.row_times_blocks", "row_kernel.rows_times_blocks", None),
         "uint16": ("row_kernel.row_times_blocks", "row_kernel.rows_times_blocks", None),
         "int8": ("int8_kernel.row_times_pairs", "int8_kernel.rows_times_pairs", "int8_kernel.to_int16"),
         "uint8": (None, "int4_kernel.rows_times_nibbles", "int4_kernel.to_x8")}  # int4 tiles one row too


def loops(row_counts, dtype):
    """The kernels' loops (kernel, dtype, tile plan) that warm passes over row_counts tokens
    (`warm_passes`, each with one row of logits) run in weights stored as `dtype`: what
    compiling.start compiles in other processes while the model loads."""
    if KERNEL != "numba":
        return set()
    dtype = np.dtype(dtype)
    one, rows, rounding = LOOPS[dtype.name]
    found = {("kernels.row_ops.layer_norm_rows", "float32", None), ("kernels.row_ops.attend", "float32", None)}
    if rounding:
        found.add((f"kernels.{rounding}", dtype.name, None))
    for R in set(warm_passes(row_counts, dtype)) | {1}:
        if R == 1 and one:
            found.add((f"kernels.{one}", dtype.name, None))
        else:
            found.add((f"kernels.{rows}", dtype.name, row_kernel.tile_plan(row_kernel.padded_rows(R, dtype))))
    return found


def seconds_compiling():
    """Seconds this process has spent compiling kernels (or loading them from numba's cache):
    a run's first use of a format or a tile size compiles its loops, once a machine."""
    return compiling.seconds_compiling if compiling else 0.0


def columns(wb, tokens, scale=None):
    """Columns `tokens` [n] of a matrix stored as the kernels' blocks, as float32 rows [n, n_in]."""
    if wb.dtype == np.uint8:
        return int4_kernel.columns(wb, tokens, scale)
    return row_kernel.columns(wb, tokens, scale)


def block_width(w):
    """Outputs per block: a power of two, so that blocks start where gemv's own groups of
    outputs do, and as many as fit in BLOCK_BYTES."""
    nb = 16
    while nb * 2 * w.itemsize * w.shape[0] <= BLOCK_BYTES:
        nb *= 2
    return nb


def gemv_one(row, w):
    """One row [1, n_in]: one gemv over the whole blocks with OpenBLAS's threads (they
    split it at a whole block), and the narrower last block exactly as gemv_rows runs it."""
    whole = w.shape[1] // block_width(w) * block_width(w)
    if whole == w.shape[1] or not w.T.flags.c_contiguous:
        return row @ w
    out = np.empty((1, w.shape[1]), row.dtype)  # [1, n_out]
    out[:, :whole] = row @ w[:, :whole]
    with blas_threads(1):  # as gemv_rows runs it: OpenBLAS may split even 17 columns among its threads
        out[:, whole:] = row @ w[:, whole:]
    return out


def gemv_rows(rows, w):
    """Each row of rows [n, n_in] times w, one gemv per row and block of output columns,
    the blocks split between two threads. w column-major (kernels/layout.py) makes each
    block a contiguous run of memory; any other w falls back to one gemv per row."""
    (n, n_in), n_out = rows.shape, w.shape[1]
    if not w.T.flags.c_contiguous:
        return np.matmul(rows[:, None, :], w)[:, 0]  # [n, n_out]: per row, w read n times
    wT = w.T  # [n_out, n_in]: row j holds output j's weights
    nb = block_width(w)
    n_blocks = n_out // nb
    out = np.empty((n, n_out), rows.dtype)  # [n, n_out]
    x = rows[None, :, :, None]  # [1, n, n_in, 1]

    def part(lo, hi, width):  # outputs lo..hi-1 in blocks of width: [blocks, n rows] gemvs, block by block
        blocks = wT[lo:hi].reshape(-1, width, n_in)  # [n_blk, width, n_in], a view
        y = np.matmul(blocks[:, None], x)  # [n_blk, n, width, 1]
        out[:, lo:hi] = y[..., 0].transpose(1, 0, 2).reshape(n, hi - lo)

    def second_half():
        part(mid, n_blocks * nb, nb)
        if n_out > n_blocks * nb:
            part(n_blocks * nb, n_out, n_out - n_blocks * nb)  # the last, narrower block

    mid = n_blocks // 2 * nb
    with blas_threads(1):
        other = _second_thread.submit(second_half)
        if mid:
            part(0, mid, nb)
        other.result()
    return out


@contextlib.contextmanager
def kernel_pass(params):
    """Around one model pass. With the numba kernel's layout, numba's threads do the
    parallel work and OpenBLAS is left with attention's small products: it is held to one
    thread, so that no worker of its ever spins on a core numba's threads need. Any other
    layout keeps the BLAS as it is."""
    if in_blocks(params):
        with blas_threads(1):
            yield
    else:
        yield


@functools.cache
def _blas():
    """Every BLAS loaded in this process (NumPy's OpenBLAS, and SciPy's where something
    imported it), through threadpoolctl: NumPy's is not always the first one found."""
    from threadpoolctl import ThreadpoolController
    return ThreadpoolController().select(user_api="blas").lib_controllers


@contextlib.contextmanager
def blas_threads(n):
    """Hold every BLAS to n threads inside the with block (about a microsecond each way)."""
    saved = [blas.get_num_threads() for blas in _blas()]
    for blas in _blas():
        blas.set_num_threads(n)
    try:
        yield
    finally:
        for blas, threads in zip(_blas(), saved):
            blas.set_num_threads(threads)


@functools.cache
def gemv_is_exact():
    """Whether gemv_one (OpenBLAS's threads over the whole blocks) gives the same bits as
    gemv_rows's block-by-block gemvs on our threads, at GPT-2's widths and a ragged one
    like the head's 50257 (17 outputs past its last whole block). If not, a lone row goes
    through gemv_rows too."""
    rng = np.random.default_rng(0)
    for n_in, n_out in ((768, 2304), (1024, 4096), (1280, 3840), (1600, 4800), (4096, 1024), (6400, 1600),
                         (1024, 4096 + 17)):
        w = np.asfortranarray(rng.standard_normal((n_in, n_out), dtype=np.float32))
        rows = rng.standard_normal((3, n_in), dtype=np.float32)
        if not np.array_equal(gemv_one(rows[:1], w), gemv_rows(rows, w)[:1]):
            return False
    return True
