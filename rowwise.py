"""How a few rows multiply the weights on a CPU: fast, and each row exactly as if alone.

A decode step multiplies one row (a token) by every weight matrix; a verification, a
draft's catch-up pass or a batch multiplies a few. Reading the weights from memory is
the cost, so n rows should cost little more than one. BLAS offers two ways:

- One matrix product (sgemm). OpenBLAS first copies ("packs") the weights into panels
  of its own, which for 2-8 rows costs 2-3 one-row passes; and which of its kernels a
  row lands in depends on how many rows share the product, so the same row rounds
  differently (by ~1e-6) beside different neighbours. A sampled token that falls in a
  distribution's tail then changes: a request's text would depend on its batch.
- One matrix-vector product (gemv) per row. Nothing is packed, and each output is
  summed in an order that depends only on the row and that output's own weights, not
  on the other rows, on which other outputs the call computes, or on the number of
  threads (`gemv_is_exact` checks this on the machine at hand).

So `matmul` runs each row of a pass that several requests share as its own gemv, block
by block: the weights are cut into contiguous blocks of output columns that fit in a
core's L2 cache (views of a column-major matrix: no copy), every row multiplies a block
while it is there, and only the first row reads it from memory. Two threads of ours
take half of the blocks each (NumPy releases the GIL inside matmul) while OpenBLAS is
held to one thread (its idle workers would otherwise spin on the second core). One row
alone is one gemv over the whole matrix with OpenBLAS's own threads: the same numbers,
as fast as BLAS goes. A pass that belongs to a single request (the part of its prompt
that needs no logits) may instead run as one product, fastest for many rows, since its
rounding then depends on that request alone.

Where a BLAS has an unpacked small-matrix kernel (OpenBLAS's "direct" sgemm, AVX-512
only) a product of a few rows could cost about one row; the benchmark's row table
measures it (`python benchmark.py --only rows`), and it is used only where it keeps each
row independent of its neighbours, which this file's strategy never gives up.
"""
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK_BYTES = 256 << 10  # a block stays in a core's L2 (512 KiB on Zen 3) while every row uses it
STRATEGIES = ("rows", "product")  # each row its own gemv (batch invariant); one sgemm (the benchmark's baseline)
STRATEGY = "rows"
_second_thread = ThreadPoolExecutor(1)


def matmul(rows, w, shared=True):
    """rows [n, n_in] @ w [n_in, n_out] -> [n, n_out]. shared: the rows belong to a pass
    that several requests share, so each row must come out as it would alone."""
    if not isinstance(rows, np.ndarray) or not shared or STRATEGY == "product":
        return rows @ w  # a GPU (CuPy), or a pass of one request's own: one product
    if rows.shape[0] == 1 and gemv_is_exact():
        return gemv_one(rows, w)
    return gemv_rows(rows, w)


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
    out[:, whole:] = row @ w[:, whole:]
    return out


def gemv_rows(rows, w):
    """Each row of rows [n, n_in] times w, one gemv per row and block of output columns,
    the blocks split between two threads. w column-major (utils.decode_layout) makes each
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


@functools.cache
def _blas():
    """OpenBLAS's (or another BLAS's) thread control, through threadpoolctl; None if none found."""
    from threadpoolctl import ThreadpoolController
    found = ThreadpoolController().select(user_api="blas").lib_controllers
    return found[0] if found else None


@contextlib.contextmanager
def blas_threads(n):
    """Hold the BLAS to n threads inside the with block (about a microsecond each way)."""
    blas = _blas()
    saved = blas.get_num_threads() if blas else None
    if blas:
        blas.set_num_threads(n)
    try:
        yield
    finally:
        if blas:
            blas.set_num_threads(saved)


@functools.cache
def gemv_is_exact():
    """Whether gemv_one (OpenBLAS's threads over the whole blocks) gives the same bits as
    gemv_rows's block-by-block gemvs on our threads, at GPT-2's widths and a ragged one
    like the head's 50257. If not, a lone row goes through gemv_rows too."""
    rng = np.random.default_rng(0)
    for n_in, n_out in ((768, 2304), (1024, 4096), (1280, 3840), (1600, 4800), (4096, 1024), (6400, 1600),
                         (1024, 4097)):
        w = np.asfortranarray(rng.standard_normal((n_in, n_out), dtype=np.float32))
        rows = rng.standard_normal((3, n_in), dtype=np.float32)
        if not np.array_equal(gemv_one(rows[:1], w), gemv_rows(rows, w)[:1]):
            return False
    return True


@contextlib.contextmanager
def strategy(name):
    """Run every shared pass with another strategy inside a with block ("rows" or
    "product"); the benchmark measures both."""
    global STRATEGY
    saved, STRATEGY = STRATEGY, name
    try:
        yield
    finally:
        STRATEGY = saved
