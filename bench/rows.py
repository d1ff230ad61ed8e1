"""`--only rows` and `--only kernels`: the numba row kernel against the NumPy fallback.

rows: a whole cached pass over n tokens (a verification of n - 1 drafts) three ways,
by the number of rows. kernels: greedy decoding with the kernel against the fallback and
against the kernel with NumPy's layer norm and attention; and what importing the kernels
costs a fresh Python, loop by loop, compiled and from numba's cache.
"""
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench.common import ROOT, greedy, prompt_ids, settle
from cli.timing import pass_seconds
from kernels import layout, rowwise, weight_formats

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


def kernel_layouts(model):
    """The same weights in each row kernel's layout (layout.decode_layout): "numba" (the
    blocks of row_kernel.py), where numba runs, and "numpy" (column-major: the fallback,
    which is also what decoding ran before the kernel)."""
    params, hparams = model
    plain = layout.plain_layout(params)
    kernels = [k for k in rowwise.KERNELS if k == "numpy" or rowwise.KERNEL == "numba"]
    return {k: (layout.decode_layout(plain, k), hparams) for k in kernels}


def bench_rows(model, args):
    """rowwise.py's measurement: a whole cached pass over n tokens of one request (a
    verification of n - 1 drafts), in ms, three ways in turns: the numba kernel over
    blocks ("kernel"), every row its own gemv block by block ("gemv", the NumPy fallback),
    and one OpenBLAS product (sgemm) per weight matrix ("product", not batch invariant)."""
    layouts = kernel_layouts(model)
    ways = {"gemv": layouts["numpy"], "product": (layout.plain_layout(model[0]), model[1])}  # plain: x @ w is BLAS's
    if "numba" in layouts:
        ways = {"kernel": layouts["numba"], **ways}
    ms = {}
    for _ in range(args.reps):
        for n in ROW_COUNTS:
            for way, laid_out in ways.items():
                settle()
                ms.setdefault((n, way), []).append(1e3 * pass_seconds(laid_out, args.prompt_len, n, reps=1))
    rows = []
    for n in ROW_COUNTS:
        row = {"n": n, **{way: float(np.median(ms[(n, way)])) for way in ways}}
        row["best"] = min(ways, key=lambda way: row[way])
        rows.append(row)
    return rows


# in a fresh Python: numba's own start, then each loop in turn, compiled or loaded from numba's cache
START_EACH = """import json, sys, time
t = time.perf_counter()
from numba import njit
njit(lambda x: x + 1)(1)
seconds = [time.perf_counter() - t]
from kernels import compiling
for kernel, dtype, plan in json.loads(sys.argv[1]):
    __import__(kernel.rsplit(".", 1)[0])
    t = time.perf_counter()
    compiling.REGISTRY[kernel](dtype, plan)
    seconds.append(time.perf_counter() - t)
print(json.dumps(seconds))"""


def kernel_start_s(formats):
    """Seconds each loop the kernels run for weights in `formats` (all that passes over 1-7
    rows reach: rowwise.loops) takes to start in a fresh Python, one after another: first
    with an empty numba cache (compiled), then with the cache that run left (loaded); beside
    each, what compiling ahead weighs it by (compiling.cost, about its seconds)."""
    loops = sorted(set().union(*(rowwise.loops(range(1, 8), weight_formats.STORED_AS[f]) for f in formats)), key=str)
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        runs = [json.loads(subprocess.run([sys.executable, "-c", START_EACH, json.dumps(loops)], env=env, cwd=ROOT,
                                          capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                for _ in range(2)]
    each = [{"loop": list(loop), "compile_s": compiled, "cached_s": cached, "cost": rowwise.compiling.cost(loop)}
            for loop, compiled, cached in zip(loops, runs[0][1:], runs[1][1:])]
    return {"formats": formats, "numba_s": runs[0][0], "compile_s": sum(runs[0][1:]), "cached_s": sum(runs[1][1:]),
            "loops": each}


def bench_kernels(model, args, size):
    """Plain greedy decoding with the numba kernel against the NumPy fallback (the same
    code and layout decoding used before the kernel), and against the kernel with gpt2.py's
    NumPy layer norm and attention in place of row_ops.py's, at each batch size, in turns:
    decode tokens/s and their ratios (the kernel's over each other's), median of reps."""
    layouts = kernel_layouts(model)
    if "numba" not in layouts:
        return []
    ways = {**layouts, "numpy_ops": layouts["numba"]}
    rows = []
    for B in args.batch_sizes:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        tps, ttft = {k: [] for k in ways}, {k: [] for k in ways}
        for rep in range(args.reps + 1):  # the first round warms every way up
            for k, laid_out in ways.items():
                settle()
                with numpy_small_ops(k == "numpy_ops"):
                    stats = greedy(prompts, laid_out, args.n_tokens)[1]
                if rep:
                    tps[k].append(stats.decode_tokens_per_s)
                    ttft[k].append(1e3 * stats.ttft_s)
        ratios = np.divide(tps["numba"], tps["numpy"])
        ops_ratios = np.divide(tps["numba"], tps["numpy_ops"])
        rows.append({"size": size, "batch": B, **{f"{k}_tok_s": float(np.median(v)) for k, v in tps.items()},
                     **{f"{k}_ttft_ms": float(np.median(v)) for k, v in ttft.items()},
                     "ratio": float(np.median(ratios)), "ratio_min": float(ratios.min()),
                     "ratio_max": float(ratios.max()), "row_ops_ratio": float(np.median(ops_ratios)),
                     "row_ops_ratio_min": float(ops_ratios.min()), "row_ops_ratio_max": float(ops_ratios.max())})
    return rows


@contextlib.contextmanager
def numpy_small_ops(on):
    """Inside the with block (if on), passes in the kernel's layout keep gpt2.py's NumPy
    layer norm and attention instead of row_ops.py's: the code before row_ops."""
    row_ops_for = rowwise.row_ops_for
    if on:
        rowwise.row_ops_for = lambda model: None
    try:
        yield
    finally:
        rowwise.row_ops_for = row_ops_for
