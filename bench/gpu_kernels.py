"""`--backend cupy --only kernels`: each of our GPU kernels alone, as a recorded step runs it.

A decode step is ~5 launches a layer (kernels/cuda_ops.py), and whether it reaches the
weights' bandwidth depends on each. Here a kernel runs LAUNCHES times back to back in one CUDA
graph (as a step's replay runs it: no host between launches), timed by CUDA events: its
device time a launch and, for a product, the bytes of weights it reads over that time (from
memory, as in a step: the launches take turns over copies too many for the L2 cache), and its
time with the weights of fewer k-steps loaded together (cuda_matmul.UNROLL: to be chosen
here); c_attn with the layer norm before it in its launch (as a step runs it) and without,
beside the layer norm's own launch (whether the fold pays). Then the whole decode step of one
row, replayed, beside the sum of its kernels' times: what a graph's launches cost beyond their
kernels, and where a step's time goes. And a long prompt's product, where cuBLAS's tiles would
beat ours: ours two ways beside it, in FLOP/s.
Random weights of the real shapes.
"""
import contextlib
import os

import numpy as np

from bench.common import timed
import kv_cache
import sampling
from kernels import cuda_graphs, cuda_matmul, cuda_ops, layout

LAUNCHES = 20  # a kernel's launches in one recorded graph
SLOTS = (128, 1024)  # attention's keys: a short text, and a full window of 124M-1558M
PROMPT_ROWS = 512  # a prompt's product: the rows of a long prompt's pass
UNROLLS = (1, 2, 4)  # k-steps a product loads the weights of together, beside cuda_matmul.UNROLL
# A layer's matrices (a few MB to 41 MB) fit in an H100's or H200's L2 cache (50 MB), but a step
# reads each once, from memory: a kernel's launches take turns over copies of what it reads,
# at least L2_TIMES the L2's size in all, so that each launch finds its weights gone from it
L2_TIMES = 2
SAMPLED = sampling.SamplingSettings(temperature=0.8, top_p=0.9)  # main.py's defaults


def device_us(cupy, f, reps, launches=LAUNCHES, copies=1):
    """f's device time a launch, in us (the best of reps): launches calls of f recorded as one
    CUDA graph and replayed between two CUDA events. f(i) reads copy i of its inputs, i <
    copies; the launches take turns over them, whole rounds (so a replay's first launch, on
    copy 0, follows the last replay's on the last copy, not one on copies it just read)."""
    launches = -(-launches // copies) * copies
    replay, _, keep = cuda_graphs.record(lambda: [f(i % copies) for i in range(launches)][-1], f(0))  # compiled
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps + 1):  # the first: a warm-up
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / launches)
    return min(times[1:])


def l2_bytes(cupy):
    """The GPU's L2 cache, in bytes."""
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["l2CacheSize"]


def n_copies(nbytes, l2):
    """How many copies of nbytes a kernel's launches take turns over: L2_TIMES the L2 in all."""
    return max(1, -(-L2_TIMES * l2 // nbytes))


def kernel_rows(cupy, model, reps, launches=LAUNCHES, prompt=PROMPT_ROWS):
    """[{kernel, shape, rows, us, GB_s or TFLOP_s}] for a model in our kernels' layout (its
    shapes, its dtype; a prompt of `prompt` rows), then its step's row. Each product reads its
    weights from memory, as in a step (L2_TIMES); the layer norm and sampling read what the
    kernel before them wrote, from L2, as in a step."""
    weights, hparams = model
    l2 = l2_bytes(cupy)
    block, dtype = weights["blocks"][0], weights["wpe"].dtype
    n_embd, n_head, n_vocab = hparams["n_embd"], hparams["n_head"], hparams["n_vocab"]
    rng = np.random.default_rng(0)

    def rand(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    rows, per_step = [], {}
    products = [("c_attn", block["attn"]["c_attn"], {"norm": block["ln_1"]}),  # as a step runs each:
                ("attn c_proj", block["attn"]["c_proj"], {}),  # c_attn and c_fc with the layer norm
                ("c_fc", block["mlp"]["c_fc"], {"norm": block["ln_2"], "gelu": True}),  # before them
                ("mlp c_proj", block["mlp"]["c_proj"], {}),
                ("head", {"w": weights["wte"].T, "b": None}, {}),
                ("c_attn, its layer norm apart", block["attn"]["c_attn"], {})]  # what the norm costs in it
    for name, layer, tail in products:
        w = layer["w"]
        ws = [w] + [cuda_matmul.Matrix(w.stored.copy()) for _ in range(n_copies(w.nbytes, l2) - 1)]
        for R in (1, 8):
            x = rand(R, w.shape[0])
            product = (lambda i: cuda_matmul.matmul(x, ws[i].stored)) if layer["b"] is None else (
                lambda i: cuda_matmul.linear(x, ws[i], layer["b"], **tail))
            us = device_us(cupy, product, reps, launches, len(ws))
            rows.append({"kernel": name, "shape": f"{w.shape[0]} x {w.shape[1]}", "rows": R, "us": us,
                         "GB_s": w.nbytes / us / 1e3, "copies": len(ws),
                         "unrolled_us": unrolled_us(cupy, x, ws, layer, tail, reps, launches)})
            per_step[name] = per_step.get(name, us)  # a step's row: R = 1
        del ws
    rows += prompt_rows(cupy, block["mlp"]["c_fc"], rand(prompt, n_embd), reps, launches)
    x, g, b = rand(1, n_embd), block["ln_1"]["g"], block["ln_1"]["b"]
    rows.append({"kernel": "layer norm", "shape": f"{n_embd}", "rows": 1,
                 "us": device_us(cupy, lambda i: cuda_ops.layer_norm(x, g, b), reps, launches)})
    per_step["layer norm"] = rows[-1]["us"]
    D = n_embd // n_head
    for S in SLOTS:  # each layer's cache is its own: from memory, as the weights
        caches = [{"k": rand(1, n_head, S, D), "v": rand(1, n_head, S, D)}
                  for _ in range(n_copies(2 * n_head * S * D * np.dtype(dtype).itemsize, l2))]
        qkv = rand(1, 1, 3, n_head, D).transpose(2, 0, 3, 1, 4)  # [3, 1, n_head, 1, D]: as gpt2.mha views it
        positions = cupy.asarray(np.array([[S - 1]]))  # [1, 1]: the last slot, every key read
        rows.append({"kernel": "attention", "shape": f"{S} keys, {n_head} heads", "rows": 1, "copies": len(caches),
                     "us": device_us(cupy, lambda i: cuda_ops.attend(positions, caches[i], *qkv), reps, launches,
                                     len(caches))})
        del caches
    per_step["attention"] = rows[-len(SLOTS)]["us"]
    logits = rand(1, n_vocab).astype(np.float32)
    with sampling_on_device():  # temperature, top-p and the softmax: cuda_sampling.py's one launch
        rows.append({"kernel": "sampling", "shape": f"{n_vocab} tokens", "rows": 1,
                     "us": device_us(cupy, lambda i: sampling.probabilities(logits, None, SAMPLED), reps, launches)})
    n_layer = hparams["n_layer"]
    kernels_us = n_layer * (per_step["c_attn"] + per_step["attention"] + per_step["attn c_proj"] + per_step["c_fc"]
                            + per_step["mlp c_proj"]) + per_step["layer norm"] + per_step["head"]  # ln_f's alone
    rows.append({"kernel": f"a decode step ({SLOTS[0]} keys)", "shape": "its kernels' sum", "rows": 1,
                 "us": kernels_us, "step_us": step_us(cupy, model, reps)})
    return rows


def unrolled_us(cupy, x, ws, layer, tail, reps, launches):
    """{unroll: us a launch} of the product x @ layer["w"] (with its tail, as the step runs it;
    its launches taking turns over the copies ws) loading the weights of `unroll` k-steps
    together, each of UNROLLS (the same sums: a choice of speed alone); none on the NumPy
    stand-in."""
    if isinstance(x, np.ndarray):
        return {}
    b = layer["b"]
    return {u: device_us(cupy, lambda i, code=cuda_matmul.source(u): cuda_matmul.launch(
        x, ws[i].stored, b, tail.get("gelu", False), norm=tail.get("norm"), code=code), reps, launches, len(ws))
        for u in UNROLLS}


def prompt_rows(cupy, layer, x, reps, launches):
    """A prompt's c_fc (x [R, n_in] @ w + b, its GELU): ours, its outputs COLS_WIDE a warp;
    ours in launches of ROWS_BLOCK rows, one output a warp (the same bits); cuBLAS's product
    alone (no bias, no GELU), eagerly (it cannot be recorded), timed by events around
    `launches` calls."""
    w, bias = layer["w"], layer["b"]
    R, flops = x.shape[0], 2 * x.size * w.shape[1]
    blocks = [x[i:i + cuda_matmul.ROWS_BLOCK] for i in range(0, R, cuda_matmul.ROWS_BLOCK)]
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def cublas_us():
        times = []
        for _ in range(reps + 1):  # the first: a warm-up
            start.record()
            for _ in range(launches):
                x @ w.stored.T
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / launches)
        return min(times[1:])
    ways = [(f"c_fc, {cuda_matmul.COLS_WIDE} outputs a warp",
             device_us(cupy, lambda i: cuda_matmul.linear(x, w, bias, gelu=True), reps, launches)),
            (f"c_fc in {len(blocks)} launches, an output a warp",
             device_us(cupy, lambda i: [cuda_matmul.linear(b, w, bias, gelu=True) for b in blocks][-1], reps,
                       launches)),
            ("c_fc by cuBLAS (its product alone), eagerly", cublas_us())]
    return [{"kernel": name, "shape": f"{w.shape[0]} x {w.shape[1]}", "rows": R, "us": us,
             "TFLOP_s": flops / us / 1e6} for name, us in ways]


@contextlib.contextmanager
def sampling_on_device():
    """Sampling through cuda_sampling.py's kernels, which GPT2_GPU_KERNELS=1 chooses for a whole
    process: set only around the runs that sample, since this process also loads models for
    CuPy's operations (layout.to_backend reads the same switch)."""
    before = os.environ.get(layout.GPU_KERNELS_ENV)
    os.environ[layout.GPU_KERNELS_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[layout.GPU_KERNELS_ENV]
        else:
            os.environ[layout.GPU_KERNELS_ENV] = before


def step_us(cupy, model, reps):
    """One row's decode step at SLOTS[0] cached tokens, replayed (host time included): the
    median us of reps steps, after the eager ones that compile and record it."""
    params, hparams = model
    cache = kv_cache.init_cache(hparams, 1, hparams["n_ctx"], like=params["wpe"])
    text = list(range(SLOTS[0]))
    kv_cache.next_logits(model, cache, [text])  # the prompt
    for _ in range(2):  # eager twice, recorded at the second
        text.append(1)
        kv_cache.next_logits(model, cache, [text])

    def step():
        kv_cache.rollback(cache, [len(text) - 1])  # the same slot each time: the same keys read
        cupy.asnumpy(kv_cache.next_logits(model, cache, [text])[0, 0, :1])  # the host waits for the step
    return timed(step, reps)[0] * 1e6


def table(kernels):
    """The markdown of each size's rows."""
    lines = ["", f"Each kernel alone, device time a launch ({LAUNCHES} launches in one CUDA graph, the best of the "
             f"reps); GB/s: the weights it reads over that time, from memory (its launches take turns over copies of "
             f"them, {L2_TIMES}x the L2 cache in all); a product's us loading the weights of "
             f"{'/'.join(map(str, UNROLLS))} k-steps together, not {cuda_matmul.UNROLL}; a prompt's product of "
             f"{PROMPT_ROWS} rows three ways, in TFLOP/s; the last row of a size: its kernels' sum for a "
             "decode step of one row beside the step replayed (host time included, median):", "",
             "| model | kernel | shape | rows | us | GB/s |", "|---|---|---|---|---|---|"]
    for size, rows in kernels.items():
        for r in rows:
            extra = f" (step {r['step_us']:.0f} us)" if "step_us" in r else (
                f" ({r['TFLOP_s']:.1f} TFLOP/s)" if "TFLOP_s" in r else "") + "".join(
                f"; unrolled {u}: {us:.1f}" for u, us in r.get("unrolled_us", {}).items())
            lines.append(f"| {size} | {r['kernel']} | {r['shape']} | {r['rows']} | {r['us']:.1f}{extra} | "
                         + (f"{r['GB_s']:.0f} |" if "GB_s" in r else "- |"))
    return lines
