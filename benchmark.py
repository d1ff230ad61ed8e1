"""benchmark.py: every speed number in the README comes from here (benchmark_report.py
turns the measurements into the tables and plots).

    python benchmark.py                 # 124M and 355M on the CPU: decoding, costs, speculative, serving
    python benchmark.py --quick         # tiny shapes, seconds (the test suite runs this)
    python benchmark.py --backend cupy  # on an NVIDIA GPU: all four sizes, next to transformers there

Speed does not depend on weight values, so models that are not in --models_dir
run with random weights of the real shapes (the output says which). Random
weights cannot tell how often a draft is accepted, so speculative decoding is
measured with a controlled drafter: the real draft model runs (its cost is
real), then each proposal is replaced by the target's own next token with
probability a (exactly a of them in shuffled blocks of 20). Each number is the median of --reps runs after a warm-up, with
the spread beside it where it matters, and every ratio comes from this one run.
"""
import argparse
import contextlib
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import batching
import benchmark_llamacpp
import benchmark_report
import checkpoint
import cost_model
import gpt2
import sampling
import speculative
import utils
from kernels import layout, rowwise, weight_formats
from serving import scheduler

SHAPES = {  # n_embd, n_head, n_layer of OpenAI's releases
    "124M": (768, 12, 12), "355M": (1024, 16, 24), "774M": (1280, 20, 36), "1558M": (1600, 25, 48),
    "tiny": (64, 4, 2),  # --quick
}
GREEDY = sampling.SamplingSettings(temperature=0.0)


def random_params(size, seed=0, n_vocab=50257, n_ctx=1024, dtype="float32"):
    """GPT-2 params of the real shapes, random values (N(0, 0.02), like GPT-2's init),
    the matrices stored in dtype (weight_formats.py)."""
    n_embd, n_head, n_layer = SHAPES[size]
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    def ln():
        return {"g": np.ones(n_embd, np.float32), "b": r(n_embd)}

    blocks = [{"ln_1": ln(), "ln_2": ln(),
               "attn": {"c_attn": {"w": r(n_embd, 3 * n_embd), "b": r(3 * n_embd)},
                        "c_proj": {"w": r(n_embd, n_embd), "b": r(n_embd)}},
               "mlp": {"c_fc": {"w": r(n_embd, 4 * n_embd), "b": r(4 * n_embd)},
                       "c_proj": {"w": r(4 * n_embd, n_embd), "b": r(n_embd)}}} for _ in range(n_layer)]
    hparams = {"n_vocab": n_vocab, "n_ctx": n_ctx, "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer}
    params = {"wte": r(n_vocab, n_embd), "wpe": r(n_ctx, n_embd), "blocks": blocks, "ln_f": ln()}
    return layout.decode_layout(params, dtype=dtype), hparams  # the memory order a loaded model has


def load_or_random(size, models_dir, seed):
    """Real weights when models_dir holds them (timing the load), else random."""
    model_dir = os.path.join(models_dir, size)
    if size in utils.MODEL_SIZES and utils.is_complete(model_dir):
        t = time.perf_counter()
        _, hparams, params = utils.load_model_dir(model_dir)
        return params, hparams, {"weights": "real", "load_s": time.perf_counter() - t}
    params, hparams = random_params(size, seed)
    return params, hparams, {"weights": "random", "load_s": None}  # timed by main() after the decoding runs


def time_memmap_load(params, hparams):
    """Write the params as a real-size model.safetensors (Hugging Face names) in a temp
    dir and time loading it as utils.load_model_dir does: parse the header, memmap every
    tensor, check shapes, copy the weight matrices into the row kernel's layout
    (layout.decode_layout). The file was just written, so it is read from the page cache.
    Seconds, whatever the weights are."""
    params = layout.plain_layout(params)
    tensors = {"wte.weight": params["wte"], "wpe.weight": params["wpe"],
               "ln_f.weight": params["ln_f"]["g"], "ln_f.bias": params["ln_f"]["b"]}
    for i, b in enumerate(params["blocks"]):
        for ln in ("ln_1", "ln_2"):
            tensors[f"h.{i}.{ln}.weight"], tensors[f"h.{i}.{ln}.bias"] = b[ln]["g"], b[ln]["b"]
        for m, lin in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
            tensors[f"h.{i}.{m}.{lin}.weight"], tensors[f"h.{i}.{m}.{lin}.bias"] = b[m][lin]["w"], b[m][lin]["b"]
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            h = json.dumps(header).encode()
            f.write(struct.pack("<Q", len(h)) + h)
            for a in tensors.values():
                f.write(np.ascontiguousarray(a).tobytes())
        t = time.perf_counter()
        loaded = checkpoint.load_params(d, hparams["n_layer"])
        checkpoint.check_params(loaded, hparams)
        layout.decode_layout(loaded)
        return time.perf_counter() - t


def matmul_weight_bytes(params):
    """Bytes a one-token decode step must stream: every matmul weight once (the head
    reads all of wte; wpe contributes one row and is left out)."""
    blocks = sum(w.nbytes for b in params["blocks"] for m in ("attn", "mlp") for lin in b[m].values()
                 for w in lin.values())
    return blocks + params["wte"].nbytes


def timed(fn, reps, warmup=1):
    """Run fn warmup + reps times; (median, min, max) seconds of the timed runs."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(min(ts)), float(max(ts))


def bandwidth_probe(n=8192):
    return np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)  # [n, n]: 256 MiB


def measure_bandwidth(probe, reps=5):
    """GB/s of a large one-row matmul: the memory roofline of batch-1 decoding."""
    x = np.ones((1, probe.shape[0]), np.float32)
    med, _, _ = timed(lambda: x @ probe, reps)
    return probe.nbytes / med / 1e9


def prompt_ids(n, seed=1):
    return np.random.default_rng(seed).integers(0, 50000, n).tolist()


def greedy(prompts, model, n, use_cache=True):
    """Plain greedy decoding: (new tokens, batching.Stats)."""
    return gpt2.generate(batching.requests(prompts, n, GREEDY), model, use_cache)


def bench_decode(params, hparams, args, probe):
    """Decode tokens/s at each batch size (cache on), and batch 1 without cache, each
    run next to its roofline. The machine's bandwidth drifts by 20% over minutes
    (other tenants), so it is measured right before every timed run, and the fraction
    of the roofline is the median of those paired ratios."""
    rows = []
    weight_bytes = matmul_weight_bytes(params)
    for B in args.batch_sizes:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        runs, bandwidths = [], []

        def run():
            bandwidths.append(measure_bandwidth(probe))
            runs.append(greedy(prompts, (params, hparams), args.n_tokens)[1])
        timed(run, args.reps)
        runs, bandwidths = runs[1:], bandwidths[1:]  # drop the warm-up
        tps = [r.decode_tokens_per_s for r in runs]
        rooflines = [B * bw * 1e9 / weight_bytes for bw in bandwidths]
        rows.append({"batch": B, "cache": True, "decode_tok_s": float(np.median(tps)),
                     "end_to_end_tok_s": float(np.median([r.tokens_per_s for r in runs])),  # prefill included
                     "decode_tok_s_min": min(tps), "decode_tok_s_max": max(tps),
                     "bandwidth_GBs": float(np.median(bandwidths)), "roofline_tok_s": float(np.median(rooflines)),
                     "fraction_of_roofline": float(np.median(np.divide(tps, rooflines))),
                     "ttft_ms": 1e3 * float(np.median([r.ttft_s for r in runs])),
                     "itl_ms_p50": float(np.median([r.itl_ms(50) for r in runs])),
                     "itl_ms_p90": float(np.median([r.itl_ms(90) for r in runs])),
                     "kv_cache_bytes_n_ctx": 2 * hparams["n_layer"] * B * hparams["n_ctx"] * hparams["n_embd"] * 4})
    bandwidth = measure_bandwidth(probe)
    n = max(4, args.n_tokens // 4)
    stats = greedy([prompt_ids(args.prompt_len)], (params, hparams), n, use_cache=False)[1]
    roofline = bandwidth * 1e9 / weight_bytes
    rows.append({"batch": 1, "cache": False, "decode_tok_s": stats.decode_tokens_per_s, "bandwidth_GBs": bandwidth,
                 "roofline_tok_s": roofline, "fraction_of_roofline": stats.decode_tokens_per_s / roofline,
                 "itl_ms_p50": stats.itl_ms(50), "ttft_ms": stats.ttft_s * 1e3})
    return rows


def in_format(model, dtype):
    """(model with its matrices stored in dtype, seconds the conversion took): from the
    float32 matrices, as loading a checkpoint in that format converts them."""
    if dtype == "float32":
        return model, 0.0
    plain = layout.plain_layout(model[0])
    start = time.perf_counter()
    params = layout.decode_layout(plain, "numba", dtype)
    return (params, model[1]), time.perf_counter() - start


def stored_mib(params):
    """MiB of the matrices as stored (blocks and head; biases, norms and wpe left out)."""
    layers = [layer for block in params["blocks"] for part in ("attn", "mlp") for layer in block[part].values()]
    return sum(a.nbytes for layer in layers + [params["lm_head"]] for name, a in layer.items() if name != "b") / 2**20


def agreement(model, other, n_positions=256, n_tokens=64, n_prompts=4):
    """How far `other` (a narrow copy) moves model's (float32) output: the logits of one
    pass over n_positions tokens (max error, relative to the largest logit, and how often
    the top token agrees), and greedy text over n_tokens for a few prompts (the tokens
    before the first difference, and the share of positions that agree)."""
    ids = np.array([prompt_ids(n_positions, seed=9)])
    want = gpt2.gpt2(ids, **model[0], n_head=model[1]["n_head"])[0]  # [n_positions, n_vocab]
    got = gpt2.gpt2(ids, **other[0], n_head=model[1]["n_head"])[0]
    prompts = [prompt_ids(8, seed=20 + i) for i in range(n_prompts)]
    a, b = greedy(prompts, model, n_tokens)[0], greedy(prompts, other, n_tokens)[0]
    same = [np.equal(x, y) for x, y in zip(a, b)]
    return {"logits_max_abs_error": float(np.abs(got - want).max()),
            "logits_max_rel_error": float(np.abs(got - want).max() / np.abs(want).max()),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()), "positions": n_positions,
            "greedy_common_prefix": float(np.mean([np.argmin(m) if not m.all() else len(m) for m in same])),
            "greedy_agreement": float(np.mean(same)), "greedy_tokens": n_tokens}


def format_load(size, dtype, models_dir):
    """In a process of its own, so that memory is this format's alone: load GPT-2 size in
    dtype (the checkpoint, or random weights of its shape) and report the seconds and the
    memory: RssAnon (what the process itself holds: the matrices and, for random weights,
    wte) and the peak (VmHWM: ru_maxrss would carry the parent's peak across exec)."""
    code = ("import json, time, benchmark, utils, os\n"
            f"t = time.perf_counter(); d = os.path.join({models_dir!r}, {size!r})\n"
            f"real = {size!r} in utils.MODEL_SIZES and utils.is_complete(d)\n"
            f"m = (utils.load_model_dir(d, dtype={dtype!r}) if real\n"
            f"     else benchmark.random_params({size!r}, dtype={dtype!r}))\n"
            "load = time.perf_counter() - t\n"
            "status = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status')\n"
            "          if l.startswith(('RssAnon', 'VmHWM'))}\n"
            "print(json.dumps({'load_s': load, 'weights': 'real' if real else 'random', "
            "'rss_anon_mib': status['RssAnon'] / 1024, 'peak_rss_mib': status['VmHWM'] / 1024}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_model_agreement():
    """agreement() on the test suite's tiny GPT-2 (tests/fixtures), where present."""
    model_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures", "tiny-openai")
    if not os.path.exists(model_dir):
        return {}
    hparams = utils.load_hparams(model_dir)
    plain = checkpoint.load_params(model_dir, hparams["n_layer"])
    model = (layout.decode_layout(plain, "numba"), hparams)
    n = min(256, hparams["n_ctx"] - 8)
    return {dtype: agreement(model, (layout.decode_layout(plain, "numba", dtype), hparams), n, min(64, n - 8))
            for dtype in weight_formats.DTYPES[1:]}


def fallback_widening(model, reps):
    """What int8 would cost the NumPy fallback, over one token's matrices (the blocks' and
    the head's): seconds of float32 gemvs, and of int8 widened by NumPy block by block
    (256 KiB of float32, in L2) with a gemv per block. (float32 s, int8 s), the best of reps."""
    plain = layout.plain_layout(model[0])
    mats = [layout.column_major(layer["w"]) for block in plain["blocks"] for part in ("attn", "mlp")
            for layer in block[part].values()] + [np.asarray(plain["wte"]).T]  # [n_in, n_out] each
    quantized = [(np.asfortranarray(q), scale) for q, scale in map(weight_formats.to_int8, mats)]  # column-major q
    x = np.random.default_rng(0).standard_normal(max(w.shape[0] for w in mats), dtype=np.float32)

    def float32():
        for w in mats:
            x[:w.shape[0]] @ w

    def int8():
        for q, scale in quantized:
            n_in, n_out = q.shape
            step = (256 << 10) // (4 * n_in)
            buf = np.empty((n_in, step), np.float32, order="F")  # [n_in, step]
            for j in range(0, n_out, step):
                widened = buf[:, :min(step, n_out - j)]
                np.copyto(widened, q[:, j:j + step], casting="unsafe")
                (x[:n_in] @ widened) * scale[j:j + step]
    return timed(float32, reps)[1], timed(int8, reps)[1]


def bench_formats(model, args, size):
    """Each weight format against float32 on one model: decode tokens/s at each batch
    size (the formats in turns, each rep; the ratio is the median of the paired ratios),
    the stored matrices' size, the conversion time, memory in a process of its own, and
    how far the output moves (agreement); what int8 would cost the NumPy fallback; and at
    batch 1 llama.cpp on the same weights where it is installed (benchmark_llamacpp.py)."""
    models, convert_s = {}, {}
    for dtype in args.dtypes:
        models[dtype], convert_s[dtype] = in_format(model, dtype)
    with benchmark_llamacpp.scratch_dir() as workdir:
        peers, peer = llamacpp_peers(model, args, size, workdir)
        rows = format_decode_rows(models, peers, peer, args, size)
        for llm in peers.values():
            llm.close()  # before its file goes
    formats = []
    for dtype in args.dtypes:
        formats.append({"size": size, "dtype": dtype, "stored_mib": stored_mib(models[dtype][0]),
                        "convert_s": convert_s[dtype], **format_load(size, dtype, args.models_dir),
                        **(agreement(models["float32"], models[dtype]) if dtype != "float32" else {})})
    f32_s, int8_s = fallback_widening(model, args.reps)
    fallback = {"float32_gemv_s": f32_s, "int8_widened_gemv_s": int8_s, "int8_over_float32": f32_s / int8_s}
    return {"decode": rows, "formats": formats, "numpy_fallback": fallback, "llama_cpp": peer}


def format_decode_rows(models, peers, peer, args, size):
    """Decode tokens/s of each format at each batch size, in turns each rep, and at batch 1
    llama.cpp's formats in the same turns (peer gets its rows)."""
    rows = []
    for B in args.format_batches:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        tps = {dtype: [] for dtype in args.dtypes}
        peer_tps = {dtype: [] for dtype in peers} if B == 1 else {}
        for _ in range(args.reps + 1):
            for dtype in args.dtypes:
                tps[dtype].append(greedy(prompts, models[dtype], args.n_tokens)[1].decode_tokens_per_s)
                if dtype in peer_tps:
                    peer_tps[dtype].append(benchmark_llamacpp.greedy_decode_tok_s(peers[dtype], prompts[0],
                                                                                  args.n_tokens))
        for dtype in args.dtypes:
            runs = tps[dtype][1:]  # the first rep warms up
            ratios = np.divide(runs, tps["float32"][1:]) if "float32" in tps else [float("nan")]
            rows.append({"size": size, "dtype": dtype, "batch": B, "decode_tok_s": float(np.median(runs)),
                         "decode_tok_s_min": min(runs), "decode_tok_s_max": max(runs),
                         "over_float32": float(np.median(ratios)), "over_float32_min": float(np.min(ratios)),
                         "over_float32_max": float(np.max(ratios))})
            print(f"  {size} {dtype} batch {B}: {rows[-1]['decode_tok_s']:.1f} tok/s, "
                  f"{rows[-1]['over_float32']:.2f}x float32", flush=True)
        for dtype, runs in peer_tps.items():
            ours = np.divide(tps[dtype][1:], runs[1:])
            peer["decode"].append({"size": size, "format": benchmark_llamacpp.PEER_FORMATS[dtype], "ours": dtype,
                                   "decode_tok_s": float(np.median(runs[1:])), "decode_tok_s_min": min(runs[1:]),
                                   "decode_tok_s_max": max(runs[1:]), "ours_over_peer": float(np.median(ours)),
                                   "ours_over_peer_min": float(np.min(ours)), "ours_over_peer_max": float(np.max(ours))})
            print(f"  {size} llama.cpp {peer['decode'][-1]['format']} batch 1: {peer['decode'][-1]['decode_tok_s']:.1f}"
                  f" tok/s; ours ({dtype}) {peer['decode'][-1]['ours_over_peer']:.2f}x", flush=True)
    return rows


def llamacpp_peers(model, args, size, workdir):
    """({our format: a llama.cpp context on the same weights in its format of that width},
    what to record of them), or ({}, why not): written as GGUF, loaded, and checked: the
    logits llama.cpp gives on its F32 file must be ours (else we would time another model)."""
    if benchmark_llamacpp.MISSING or args.quick:
        why = benchmark_llamacpp.MISSING or "--quick: the test shapes have no GPT-2 tokenizer"
        print(f"  llama.cpp peer: skipped ({why})", flush=True)
        return {}, {"skipped": why}
    params, hparams = layout.plain_layout(model[0]), model[1]
    encoder_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures", "gpt2-tokenizer")
    ids = prompt_ids(args.prompt_len, seed=5)
    want = gpt2.gpt2(np.array([ids]), **model[0], n_head=hparams["n_head"])[0, -1]  # [n_vocab]
    peers, peer = {}, {"version": benchmark_llamacpp.version(), "threads": os.cpu_count(), "files": [], "decode": []}
    for dtype in args.dtypes:
        fmt = benchmark_llamacpp.PEER_FORMATS[dtype]
        path = os.path.join(workdir, f"gpt2-{size}-{fmt}.gguf")
        start = time.perf_counter()
        benchmark_llamacpp.write_gguf(path, params, hparams, encoder_dir, fmt)
        write_s = time.perf_counter() - start
        peers[dtype] = benchmark_llamacpp.load(path, args.prompt_len + args.n_tokens + 8, os.cpu_count())
        got = benchmark_llamacpp.last_logits(peers[dtype], ids)
        error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        peer["files"].append({"size": size, "format": fmt, "mib": os.path.getsize(path) / 2**20, "write_s": write_s,
                              "logits_max_rel_error": error, "same_top1": bool(np.argmax(got) == np.argmax(want))})
        if fmt == "F32" and error > 1e-2:  # llama.cpp rounds its own way (its GELU is a float16 table): 0.06% measured
            raise RuntimeError(f"llama.cpp's logits on the F32 file are not ours ({error:.2%} off): the GGUF is wrong")
    print(f"  llama.cpp peer: {peer['version']}", flush=True)
    return peers, peer


def bench_context(params, hparams, args):
    """Per-token cost at growing context: one cached step vs recomputing the window."""
    rows = []
    for L in args.contexts:
        cached = gpt2.pass_seconds((params, hparams), L, reps=args.reps)
        ids = np.array([prompt_ids(L + 1)])
        uncached = timed(lambda: gpt2.gpt2(ids, **params, n_head=hparams["n_head"]), max(1, args.reps // 2))[0]
        rows.append({"context": L, "cached_ms": cached * 1e3, "uncached_ms": uncached * 1e3,
                     "speedup": uncached / cached})
    return rows


def bench_layout(params, hparams, args):
    """A cached pass over 1 token (decoding) and 8 tokens (verifying K = 7 drafts)
    with the checkpoint's row-major weights and with layout.decode_layout's, taken
    in turns so that both see the same machine."""
    layouts = {"checkpoint": (layout.plain_layout(params), hparams), "decode": (params, hparams)}
    rows = []
    for T in (1, 8):
        ms = {name: [] for name in layouts}
        for _ in range(args.reps):
            for name, model in layouts.items():
                ms[name].append(1e3 * gpt2.pass_seconds(model, args.prompt_len, T, reps=args.reps))
        checkpoint_ms, decode_ms = float(np.median(ms["checkpoint"])), float(np.median(ms["decode"]))
        rows.append({"tokens": T, "checkpoint_ms": checkpoint_ms, "decode_ms": decode_ms,
                     "speedup": checkpoint_ms / decode_ms})
    return rows


ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


def kernel_layouts(model):
    """The same weights in each row kernel's layout (layout.decode_layout): "numba" (the
    blocks of row_kernel.py), where numba runs, and "numpy" (column-major: the fallback,
    which is also what decoding ran before the kernel)."""
    params, hparams = model
    plain = layout.plain_layout(params)
    kernels = [k for k in rowwise.KERNELS if k == "numpy" or rowwise.KERNEL == "numba"]
    return {k: (layout.decode_layout(plain, k), hparams) for k in kernels}


def settle():
    """Before timing another way: OpenBLAS's workers spin for up to ~0.1 s after a call
    that used them, on the cores the next way's threads need; let them fall asleep."""
    time.sleep(0.2)


def bench_rows(model, args):
    """rowwise.py's measurement: a whole cached pass over n tokens of one request (a
    verification of n - 1 drafts), in ms, three ways in turns: the numba kernel over
    blocks ("kernel"), every row its own gemv block by block ("gemv", the NumPy fallback),
    and one OpenBLAS product (sgemm) per weight matrix ("product", not batch invariant)."""
    layouts = kernel_layouts(model)
    ways = {"gemv": (layouts["numpy"], "rows"), "product": (layouts["numpy"], "product")}
    if "numba" in layouts:
        ways = {"kernel": (layouts["numba"], "rows"), **ways}
    ms = {}
    for _ in range(args.reps):
        for n in ROW_COUNTS:
            for way, (layout, strategy) in ways.items():
                settle()
                with rowwise.strategy(strategy):
                    ms.setdefault((n, way), []).append(1e3 * gpt2.pass_seconds(layout, args.prompt_len, n, reps=1))
    rows = []
    for n in ROW_COUNTS:
        row = {"n": n, **{way: float(np.median(ms[(n, way)])) for way in ways}}
        row["best"] = min(ways, key=lambda way: row[way])
        rows.append(row)
    return rows


def bench_ceiling(loaded, args, probe):
    """benchmark_ceiling.py: each kernel's inner loop with its operands in L1 (the most it
    can do here), then float32 and int8 kernels over each model's matrices at each batch
    in --format_batches, in turns: multiply-adds/s, and the bytes of weights a second."""
    import benchmark_ceiling  # only this section needs it
    result = {"ceilings": benchmark_ceiling.ceilings(args.reps), "kernels": [],
              "bandwidth_GBs": measure_bandwidth(probe)}
    for size in args.sizes:
        models = {dtype: in_format(loaded[size], dtype)[0][0] for dtype in ("float32", "int8")}
        for B in args.format_batches:
            seconds, stored = {dtype: [] for dtype in models}, {}
            for _ in range(args.reps + 1):  # the first warms up
                for dtype, params in models.items():
                    multiply_adds, stored[dtype], s = benchmark_ceiling.kernels_pass(params, B)
                    seconds[dtype].append(s)
            for dtype in models:
                best = min(seconds[dtype][1:])
                result["kernels"].append({"size": size, "batch": B, "dtype": dtype, "ms": 1e3 * best,
                                          "multiply_adds_per_s": multiply_adds / best,
                                          "weights_GBs": stored[dtype] / best / 1e9})
    return result


def kernel_start_s():
    """Seconds to import the numba kernels (row_kernel, int8_kernel, row_ops) in a fresh
    Python: first with an empty numba cache (the kernels are compiled), then with the
    cache that run left (they are loaded); each includes Python's and numba's own start."""
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        code = ("import time; t = time.perf_counter(); import row_kernel, int8_kernel, row_ops; "
                "print(time.perf_counter() - t)")
        here = os.path.dirname(os.path.abspath(__file__))
        runs = [float(subprocess.run([sys.executable, "-c", code], env=env, cwd=here, capture_output=True, text=True,
                                     check=True).stdout) for _ in range(2)]
    return {"compile_s": runs[0], "cached_s": runs[1]}


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
            for k, layout in ways.items():
                settle()
                with numpy_small_ops(k == "numpy_ops"):
                    stats = greedy(prompts, layout, args.n_tokens)[1]
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
    fuses = rowwise.fuses
    if on:
        rowwise.fuses = lambda model: False
    try:
        yield
    finally:
        rowwise.fuses = fuses


def break_even_alpha(costs, K):
    """The acceptance rate at which speculative decoding with this K just pays (bisection)."""
    lo, hi = 0.0, 1.0
    if cost_model.speedup(hi, K, costs) < 1:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost_model.speedup(mid, K, costs) < 1 else (lo, mid)
    return hi


def paired(measure, step, reps):
    """measure() / step(), each measure taken between two steps and divided by their
    mean, so that both see the same machine (its bandwidth drifts by 20% over
    minutes); the median over reps."""
    ratios = []
    for _ in range(reps):
        before, x, after = step(), measure(), step()
        ratios.append(x / ((before + after) / 2))
    return float(np.median(ratios))


def bench_speculative_costs(draft, target, args):
    """The costs that decide speculative speed, each paired with target steps: verify(K+1)
    for K = 1..K_max and one draft token with the full head and with vocabulary subsets,
    in target steps (and the draft's two-token catch-up pass, in draft tokens); the
    speedups they predict, and the acceptance rate at which each K breaks even. Each
    pass is the best of 3 (a single pass strays by 10-20% here, enough to rank K wrong)."""
    L = args.prompt_len

    def step():
        return gpt2.pass_seconds(target, L, reps=3)
    verify = (1.0,) + tuple(paired(lambda: gpt2.pass_seconds(target, L, K + 1, reps=3), step, args.reps)
                            for K in range(1, args.K_max + 1))
    drafts, catch_up = {}, {}
    for N in [0] + args.draft_vocabs:
        head = speculative.vocab_subset_head(draft[0], [prompt_ids(L)], N) if N else None
        drafts[N] = paired(lambda: gpt2.pass_seconds(draft, L, head=head, reps=3), step, args.reps)
        catch_up[N] = paired(lambda: gpt2.pass_seconds(draft, L, 2, head, reps=3, n_logits=1),
                             lambda: gpt2.pass_seconds(draft, L, head=head, reps=3), args.reps)
    step_s = float(np.median([step() for _ in range(args.reps)]))
    rows = []
    for K in range(1, args.K_max + 1):
        costs = cost_model.Costs(drafts[0], verify, catch_up[0])
        row = {"K": K, "verify_ms": verify[K] * step_s * 1e3, "verify_over_step": verify[K],
               "break_even_alpha": break_even_alpha(costs, K)}
        for a in args.alphas:
            row[f"predicted_a{a}"] = cost_model.speedup(a, K, costs)
        rows.append(row)
    return {"draft": args.draft, "target": args.target, "target_step_ms": step_s * 1e3, "verify": verify,
            "draft_over_target": {str(N): c for N, c in drafts.items()},
            "catch_up": {str(N): x for N, x in catch_up.items()}, "by_K": rows, "alphas": args.alphas}


def acceptance_draws(a, rng):
    """The controlled drafter's accept (True) / reject outcomes, one per draft verified:
    i.i.d. draws would put 64 tokens' acceptance anywhere in 0.73-0.87 at a = 0.8 (10th-90th
    percentile), and the same seeds in every run the same way (0.77), so they come in
    shuffled blocks of L outcomes with exactly a L acceptances (blocked randomization; L = 20,
    or the first multiple of 20 that a L is whole in): each run's acceptance lands near a
    (sd 0.014 at a = 0.8 over 64 tokens, i.i.d.: 0.054), and the tokens a
    target pass yields average within 1% of what i.i.d. draws give (64-token runs: -0.1%;
    an endless stream: +0.7%, since a block drawn without replacement owes its acceptances
    back after a reject)."""
    L = next((L for L in range(20, 2001, 20) if abs(a * L - round(a * L)) < 1e-6), 2000)
    while True:
        yield from rng.permutation(np.arange(L) < round(a * L)).tolist()


def controlled_drafter(draft, truth, a, vocab=0, seed=0):
    """A drafter whose acceptance rate is a, for a greedy target: the draft model runs
    (so drafting costs what it really costs), then its proposals are replaced by the
    target's own next tokens (truth) while acceptance_draws says accept, and by another
    token at the first reject (and after it: those are never looked at, but the target
    still verifies all k). q is one-hot, so a proposal is accepted exactly when it is the
    truth. (The draft's cache keeps its own tokens where the text has the replacements;
    its proposals are discarded anyway.)"""
    draws = acceptance_draws(a, np.random.default_rng(seed))
    n_vocab = draft[1]["n_vocab"]

    def steer(text, K):
        proposals, accepting = [], True
        for t in truth[len(text):len(text) + K]:
            accepting = accepting and next(draws)
            proposals.append(t if accepting else (t + 1) % n_vocab)
        return proposals

    def propose(batch, k):
        speculative.draft_with_model(batch, draft, k, vocab)
        return speculative.draft_deterministic(batch, steer, k)
    return propose


def controlled_run(draft, target, truth, a, config, n, seed=0):
    """One greedy speculative run with the controlled drafter: its Stats."""
    prompt = truth[:len(truth) - n]
    drafter = controlled_drafter(draft, truth, a, config.draft_vocab, seed)
    config = speculative.resolve(config, target, draft)
    out, stats = batching.run(batching.requests([prompt], n, GREEDY), {"target": target, "draft": draft},
                              lambda batch: speculative.speculative_step(batch, target, drafter, config))
    assert out[0] == truth[len(prompt):], "speculative decoding must reproduce the target's greedy text"
    return stats


def typical_pass(model, L, T=1, head=None, n_logits=None, reps=3):
    """The median of reps single passes, each after a warm-up: what a pass inside a run
    takes. The best of a few passes is the best case, about 10% less than a 1558M run's
    passes take (breakdown-1558M)."""
    return float(np.median([gpt2.pass_seconds(model, L, T, head, 1, n_logits) for _ in range(reps)]))


def costs_beside(draft, target, L, K, head=None):
    """(target step seconds, Costs) timed right before or after a run, so that the run and
    its prediction see the same machine: c, verify(K+1) (the only entry of the verify table
    that is filled in, at index K) and the draft's catch-up pass, typical passes each."""
    step = typical_pass(target, L)
    draft_step = typical_pass(draft, L, head=head)
    verify = typical_pass(target, L, K + 1) / step
    catch_up = typical_pass(draft, L, 2, head, n_logits=1) / draft_step
    return step, cost_model.Costs(draft_step / step, (1.0,) + (float("nan"),) * (K - 1) + (verify,), catch_up)


def mean_costs(before, after):
    """The mean of two costs_beside results: what the run between them saw."""
    (s0, c0), (s1, c1) = before, after
    verify = tuple((x + y) / 2 for x, y in zip(c0.verify, c1.verify))
    return (s0 + s1) / 2, cost_model.Costs((c0.draft + c1.draft) / 2, verify, (c0.catch_up + c1.catch_up) / 2)


def bench_speculative_end_to_end(draft, target, costs, args):
    """Measured speedup of speculative decoding with the controlled drafter at each
    acceptance rate a, at K = args.K and at the K the measured costs recommend: each
    speculative run is timed right after a plain greedy run of the same text, and the
    speedup is the median of those paired ratios. Each repetition draws its own
    acceptances (seed), since 64 tokens are few draws. Next to it, what the cost model
    predicts: from the cost table at a, and from the costs timed right before and after
    each run at the acceptance rate that run drew (the model's own error, without the
    machine's drift between the table and the run)."""
    n, L = args.n_tokens * 2, args.prompt_len
    prompt = prompt_ids(L)
    truth = prompt + greedy([prompt], target, n)[0][0]
    plain_runs = []

    def plain():
        plain_runs.append(greedy([prompt], target, n)[1].decode_tokens_per_s)
        return plain_runs[-1]
    rows = []
    for vocab in dict.fromkeys([0, args.draft_vocab]):
        measured = cost_model.Costs(costs["draft_over_target"][str(vocab)], costs["verify"],
                                     costs["catch_up"][str(vocab)])
        head = speculative.vocab_subset_head(draft[0], [prompt], vocab) if vocab else None
        for a in args.e2e_alphas:
            for K in dict.fromkeys([args.K, cost_model.best_K(a, measured, args.K_max)]):
                config = speculative.SpeculativeConfig(K=K, draft_vocab=vocab)
                runs, ratios, beside = [], [], []
                controlled_run(draft, target, truth, a, config, n)  # warm-up
                for rep in range(args.reps):
                    before = costs_beside(draft, target, L, K, head)
                    base = plain()
                    runs.append(controlled_run(draft, target, truth, a, config, n, seed=rep))
                    ratios.append(runs[-1].decode_tokens_per_s / base)
                    alpha = cost_model.estimate_alpha(runs[-1].accepted, runs[-1].rejections)
                    beside.append(cost_model.speedup(alpha, K, mean_costs(before, costs_beside(
                        draft, target, L, K, head))[1]))
                alpha = float(np.median([cost_model.estimate_alpha(s.accepted, s.rejections) for s in runs]))
                rows.append({"decoder": "speculative", "a": a, "K": K, "draft_vocab": vocab,
                             "tok_s": float(np.median([s.decode_tokens_per_s for s in runs])),
                             "speedup": float(np.median(ratios)), "speedup_min": min(ratios),
                             "speedup_max": max(ratios), "predicted": cost_model.speedup(a, K, measured),
                             "alpha": alpha, "predicted_beside": float(np.median(beside)),
                             "model_error": float(np.median([r / b - 1 for r, b in zip(ratios, beside)])),
                             "tokens_per_target_pass": float(np.median([s.tokens_per_target_pass for s in runs]))})
                print(f"  a={a} K={K} draft_vocab={vocab}: {rows[-1]['speedup']:.2f}x measured, "
                      f"{rows[-1]['predicted']:.2f}x predicted by the table, {rows[-1]['predicted_beside']:.2f}x by "
                      f"the costs beside each run at its alpha (median {alpha:.2f})", flush=True)
    plain_tok_s = float(np.median(plain_runs))
    return [{"decoder": "autoregressive", "a": None, "K": 0, "draft_vocab": None, "tok_s": plain_tok_s,
             "speedup": 1.0}] + rows


def bench_self_draft(target, args, weights):
    """The target's own copy in args.self_draft (int8) as its draft: the costs and the
    controlled end-to-end speedups as for the other draft (at args.self_draft_alphas), and
    the acceptance rate the copy really gets on greedy text. On random weights that rate
    says little about a trained GPT-2 (it is labelled with the weights it came from)."""
    draft, convert_s = in_format(target, args.self_draft)
    label = f"{args.target} {args.self_draft}"
    sub = argparse.Namespace(**dict(vars(args), draft=label, e2e_alphas=args.self_draft_alphas))
    costs = bench_speculative_costs(draft, target, sub)
    end_to_end = bench_speculative_end_to_end(draft, target, costs, sub)
    prompts = [prompt_ids(args.prompt_len, seed=30 + i) for i in range(4)]
    reqs = batching.requests(prompts, args.n_tokens * 2, GREEDY)
    natural = speculative.speculative_generate(reqs, target, draft, speculative.SpeculativeConfig(K=args.K))[1]
    return dict(costs, end_to_end=end_to_end, K=args.K, draft_vocab=args.draft_vocab, dtype=args.self_draft,
                convert_s=convert_s, natural_acceptance=natural.acceptance_rate, weights=weights)


def bench_breakdown(draft, target, args):
    """Where a speculative step's time goes, against the cost model with costs timed in
    the same minute: per decode step (the first, with both prefills, left out), the
    seconds drafting and verifying, and what c, the draft's catch-up pass and verify(K+1),
    timed right before and after the run, predict for them (drafting at the run's
    alpha). Each K and a from --K and --e2e_alphas."""
    n, L = args.n_tokens * 2, args.prompt_len
    prompt = prompt_ids(L)
    truth = prompt + greedy([prompt], target, n)[0][0]
    rows = []
    for a in args.e2e_alphas:
        config = speculative.SpeculativeConfig(K=args.K)
        controlled_run(draft, target, truth, a, config, n)  # warm-up
        for rep in range(args.reps):
            before = costs_beside(draft, target, L, args.K)
            s = controlled_run(draft, target, truth, a, config, n, seed=rep)
            step, costs = mean_costs(before, costs_beside(draft, target, L, args.K))
            steps = s.n_steps - 1
            alpha = cost_model.estimate_alpha(s.accepted, s.rejections)
            verify = costs.verify[args.K]
            rows.append({"a": a, "K": args.K, "target_step_ms": step * 1e3, "c": costs.draft,
                         "verify_over_step": verify, "catch_up": costs.catch_up, "alpha": alpha,
                         "step_ms": (s.seconds - s.ttft_s) / steps * 1e3,
                         "draft_ms": (s.draft_s - s.first_draft_s) / steps * 1e3,
                         "verify_ms": (s.verify_s - s.first_verify_s) / steps * 1e3,
                         "draft_ms_predicted": cost_model.draft_cost(alpha, args.K, costs) * step * 1e3,
                         "verify_ms_predicted": verify * step * 1e3,
                         "tokens_per_step": (s.n_tokens - s.first_step_tokens) / steps})
            print(f"  a={a} K={args.K}: step {rows[-1]['step_ms']:.0f} ms, drafting {rows[-1]['draft_ms']:.0f} "
                  f"({rows[-1]['draft_ms_predicted']:.0f} predicted), verifying {rows[-1]['verify_ms']:.0f} "
                  f"({rows[-1]['verify_ms_predicted']:.0f} predicted)", flush=True)
    return {"draft": args.draft, "target": args.target, "rows": rows}


def subset_coverage(Ns):
    """How often real text needs a token that a vocabulary-subset draft cannot propose
    (id >= N and not earlier in the text): an upper bound on the acceptance the subset
    loses, from GPT-2's tokenizer on English text found on this machine."""
    encoder = utils.load_encoder(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures",
                                              "gpt2-tokenizer"))
    sources = [p for p in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")) if os.path.exists(p)]
    rows = []
    for path in sources:
        ids = encoder.encode(open(path, encoding="utf-8", errors="replace").read(), disallowed_special=())
        seen, missing = set(), {N: 0 for N in Ns}
        for t in ids:
            for N in Ns:
                missing[N] += t >= N and t not in seen
            seen.add(t)
        rows.append({"text": os.path.basename(path), "tokens": len(ids),
                     **{str(N): missing[N] / len(ids) for N in Ns}})
    return rows


def serving_workload(n, seed, prompt_len=(16, 64), new_tokens=(8, 256)):
    """n greedy requests: prompts of 16-64 tokens, and output lengths spread log-uniformly
    over 8-256 tokens (many short answers, a few long ones), seeded."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(new_tokens[0]), np.log(new_tokens[1])
    return [batching.Request(tuple(prompt_ids(int(rng.integers(*prompt_len)), seed=seed * 1000 + i)),
                             int(np.exp(rng.uniform(lo, hi))), GREEDY, seed=i) for i in range(n)]


def serve_once(reqs, model, max_batch, static):
    finished = [e for e in scheduler.serve(reqs, scheduler.autoregressive(model), max_batch, static=static)
                if e.kind == "finished"]
    return scheduler.summarize(finished), [e.metrics for e in finished]


def bench_serving(model, args, size):
    """Static vs continuous batching on one workload, all requests at once and as a
    Poisson stream at 70% of the capacity continuous batching measured at once; and, where
    the numba kernel runs, continuous batching at once on the NumPy fallback too."""
    reqs = serving_workload(args.n_requests, seed=0)
    fallback = kernel_layouts(model)["numpy"] if rowwise.KERNEL == "numba" else None
    rows = []
    for max_batch in args.max_batches:
        at_once = {}
        for static in (True, False):
            at_once[static] = serve_once(reqs, model, max_batch, static)
            rows.append({"size": size, "max_batch": max_batch, "arrivals": "all at once",
                         "policy": "static" if static else "continuous", **at_once[static][0],
                         "timeline": at_once[static][1]})
        if fallback:  # the same run on the NumPy fallback's layout (the code before the kernel), right after
            settle()
            summary = serve_once(reqs, fallback, max_batch, False)[0]
            rows.append({"size": size, "max_batch": max_batch, "arrivals": "all at once",
                         "policy": "continuous, NumPy fallback", **summary, "timeline": []})
            print(f"  serving {size} max_batch {max_batch}: kernel / fallback throughput "
                  f"{at_once[False][0]['tokens_per_s'] / summary['tokens_per_s']:.2f}x", flush=True)
        rate = 0.7 * len(reqs) / at_once[False][0]["seconds"]  # requests/s
        gaps = np.random.default_rng(1).exponential(1 / rate, len(reqs))
        stream = [batching.Request(r.prompt, r.max_new_tokens, r.settings, r.seed, arrival_s=float(t))
                  for r, t in zip(reqs, np.cumsum(gaps) - gaps[0])]
        for static in (True, False):
            summary, timeline = serve_once(stream, model, max_batch, static)
            rows.append({"size": size, "max_batch": max_batch, "arrivals": f"Poisson {rate:.2f}/s (70%)",
                         "policy": "static" if static else "continuous", **summary, "timeline": timeline})
        print(f"  serving {size} max_batch {max_batch}: continuous / static throughput "
              f"{at_once[False][0]['tokens_per_s'] / at_once[True][0]['tokens_per_s']:.2f}x at once; "
              f"p95 TTFT static / continuous {rows[-2]['ttft_s_p95'] / rows[-1]['ttft_s_p95']:.1f}x on the stream",
              flush=True)
    return rows


def bench_http(model, args, size):
    """The serving workload (all at once, continuous batching) through server.py over
    loopback HTTP, one streaming client thread per request, against scheduler.serve in
    this process, in turns: what the HTTP path adds to throughput and time to first token."""
    from serving import server  # only this section needs it
    encoder = utils.load_encoder(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "fixtures",
                                              "gpt2-tokenizer"))
    max_batch = args.max_batches[0]
    reqs = serving_workload(args.n_requests, seed=0)
    flags = ["--target_model_size", size if size in utils.MODEL_SIZES else "124M", "--max_batch", str(max_batch),
             "--port", "0",
             "--max_queue", str(len(reqs) + 8), "--max_model_len", str(10 ** 7)]  # + the 8 stalled streams
    httpd, engine = server.start(server.parse_args(flags), loaded=(encoder, model, None))
    port = httpd.address[1]
    rows = []
    try:
        for rep in range(args.reps):
            summary, _ = serve_once(reqs, model, max_batch, static=False)
            rows.append({"path": "in-process serve()", "rep": rep, "tokens_per_s": summary["tokens_per_s"],
                         "ttft_s_p50": summary["ttft_s_p50"], "ttft_s_p95": summary["ttft_s_p95"]})
            before = engine["metrics"]["num_preemptions_total"]
            rows.append({"path": "HTTP (server.py)", "rep": rep, **http_clients(reqs, port)})
            rows[-1]["preemptions"] = engine["metrics"]["num_preemptions_total"] - before
            print(f"  HTTP / in-process: throughput {rows[-1]['tokens_per_s'] / rows[-2]['tokens_per_s']:.3f}x, "
                  f"p50 TTFT {1e3 * (rows[-1]['ttft_s_p50'] - rows[-2]['ttft_s_p50']):+.1f} ms", flush=True)
        lone = reqs[0]
        for rep in range(5 * args.reps):  # one request on an idle server: what HTTP adds to its first token
            summary, _ = serve_once([lone], model, max_batch, static=False)
            rows.append({"path": "in-process serve(), one request", "rep": rep, **summary})
            rows.append({"path": "HTTP (server.py), one request", "rep": rep,
                         **http_clients([lone], port)})
        latency = http_pool(http_latency, port, list(lone.prompt))  # kept-alive /health; the openai client
        alone = [serve_once([batching.Request(lone.prompt, 1, lone.settings, lone.seed)], model, max_batch,
                            static=False)[0]["ttft_s_p50"] for _ in range(len(latency["openai_s"]))]
        latency["engine_s_p50"] = float(np.median(alone))
        print(f"  kept-alive GET /health p50 {1e3 * latency['health_s_p50']:.2f} ms; openai client, 1 token: "
              f"{1e3 * latency['openai_s_p50']:.1f} ms, the engine alone {1e3 * latency['engine_s_p50']:.1f} ms",
              flush=True)
        hostile = []
        few = [(list(r.prompt), r.max_new_tokens, r.seed) for r in reqs[:max_batch]]
        for rep in range(args.reps):  # 8 normal clients alone, then beside stalled readers and idle connections
            for others in (False, True):
                rss_before, before = rss_mb(), engine["metrics"]["num_preemptions_total"]
                hostile.append({"rep": rep, "hostile": others, **http_pool(http_beside_hostile, few, port, others),
                                "rss_before_mb": rss_before,
                                "preemptions": engine["metrics"]["num_preemptions_total"] - before})
                deadline = time.monotonic() + 30  # the stalled readers are cut off (--write_timeout_s) and freed
                while (engine["running"] or engine["outboxes"]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                hostile[-1]["rss_after_mb"] = rss_mb()
            print(f"  8 clients beside 8 stalled readers + 200 idle connections: throughput "
                  f"{hostile[-1]['tokens_per_s'] / hostile[-2]['tokens_per_s']:.3f}x alone; stalled readers cut "
                  f"off after {hostile[-1]['stalled_held_s']:.1f} s; server RSS {hostile[-1]['rss_before_mb']:.0f} "
                  f"-> {hostile[-1]['rss_after_mb']:.0f} MB", flush=True)
    finally:
        server.stop(httpd, engine)
    return {"size": size, "max_batch": max_batch, "n_requests": len(reqs), "runs": rows, "latency": latency,
            "hostile": hostile}


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def http_pool(fn, *fn_args):
    """fn in a process of its own, as real clients are: in this one, client threads would
    take turns with the server's engine for Python's interpreter lock."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, fn_args)


def http_latency(port, prompt, n=200):
    """Kept-alive GET /health (one connection), and the official openai client's 1-token
    completions (it keeps its connection alive too): seconds per call, median."""
    import http.client
    import openai
    conn, health = http.client.HTTPConnection("127.0.0.1", port), []
    for _ in range(n):
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        health.append(time.perf_counter() - start)
    client, calls = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), []
    for i in range(n // 4):
        start = time.perf_counter()
        client.completions.create(model="gpt2", prompt=prompt, max_tokens=1, seed=i, temperature=0)
        calls.append(time.perf_counter() - start)
    return {"health_s_p50": float(np.median(health[n // 10:])), "openai_s_p50": float(np.median(calls[2:])),
            "openai_s": calls[2:]}


def http_beside_hostile(reqs, port, hostile):
    """http_run, with (hostile) 8 streams that are never read and 200 connections that send
    nothing opened first; the stalled streams are held until the server cuts them off (then
    "stalled_held_s", how long the last was held: its rows decoded for nobody that long)."""
    import select
    import socket
    held, started = [], time.perf_counter()
    if hostile:
        body = json.dumps({"prompt": [464], "max_tokens": 10 ** 6, "ignore_eos": True, "stream": True}).encode()
        for _ in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            held.append(sock)
        held += [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        result = http_run(reqs, port)
        if hostile:  # wait (without reading) until the server has reset each stalled stream
            poll = select.poll()
            for sock in held[:8]:
                poll.register(sock, select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0))
            cut = set()
            while len(cut) < 8 and time.perf_counter() - started < 300:
                cut |= {fd for fd, _ in poll.poll(100)}
            result["stalled_held_s"] = time.perf_counter() - started
        return result
    finally:
        for sock in held:
            sock.close()


def http_clients(reqs, port):
    return http_pool(http_run, [(list(r.prompt), r.max_new_tokens, r.seed) for r in reqs], port)


def http_run(reqs, port):
    """Every request (prompt, max_tokens, seed) as a streaming POST, sent in order from one
    thread (so the server admits them in the order serve() does) and read on one thread
    each: tokens/s over the run, TTFT percentiles."""
    import http.client
    ttft, tokens = [None] * len(reqs), [0] * len(reqs)
    start = time.perf_counter()
    conns = []
    for prompt, max_tokens, seed in reqs:
        conns.append(http.client.HTTPConnection("127.0.0.1", port, timeout=600))
        conns[-1].request("POST", "/v1/completions", json.dumps({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}))

    def read(k):
        for line in conns[k].getresponse():
            if line.startswith(b"data: {") and ttft[k] is None:
                ttft[k] = time.perf_counter() - start
            if line.startswith(b"data: {") and b'"usage"' in line:
                tokens[k] = json.loads(line[6:])["usage"]["completion_tokens"]
        conns[k].close()
    threads = [threading.Thread(target=read, args=(k,)) for k in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(tokens) / seconds, "ttft_s_p50": float(np.percentile(ttft, 50)),
            "ttft_s_p95": float(np.percentile(ttft, 95)), "tokens": sum(tokens)}


def bench_beams(model, args, size, num_beams=4):
    """Beam search with num_beams beams against greedy decoding on one prompt, in turns: a
    beam step is one cached pass over num_beams rows plus the search's own bookkeeping."""
    import beam_search  # only this section needs it
    prompt, n = prompt_ids(args.prompt_len, seed=0), args.n_tokens
    rows = []
    for rep in range(args.reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        beam_search.beam_search([prompt], model, n, beam_search.BeamSettings(num_beams=num_beams))
        beam_s = time.perf_counter() - start
        start = time.perf_counter()
        greedy([prompt], model, n)
        greedy_s = time.perf_counter() - start
        if rep:
            rows.append({"beam_step_ms": 1e3 * beam_s / n, "greedy_step_ms": 1e3 * greedy_s / n,
                         "beam_over_greedy": beam_s / greedy_s, "beam_tok_s": n / beam_s})
    ratio = float(np.median([r["beam_over_greedy"] for r in rows]))
    print(f"  beam search ({num_beams} beams) on {size}: a step costs {ratio:.2f} greedy steps", flush=True)
    return {"size": size, "num_beams": num_beams, "n_tokens": n, "prompt_len": args.prompt_len, "runs": rows}


def bench_transformers(size, args, device="cpu"):
    """Hugging Face transformers' generate() on the same shapes, if it is installed: end to
    end, and decoding alone as this project's decode_tok_s counts it (the tokens after the
    first over the time after the first): generate(n) - generate(1), prefill and the first
    token being the same in both, timed in turns."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    n_embd, n_head, n_layer = SHAPES[size]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_head=n_head, n_layer=n_layer)).eval()
    model = model.to(device, dtype=getattr(torch, args.dtype))
    rows = []
    for B in args.batch_sizes:
        ids = torch.tensor([prompt_ids(args.prompt_len, seed=b) for b in range(B)], device=device)
        times = {1: [], args.n_tokens: []}

        def run(n):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - start)
        for rep in range(args.reps + 1):  # the first is a warm-up
            for n in times:
                run(n)
        first, whole = (float(np.median(times[n][1:])) for n in times)
        rows.append({"batch": B, "tok_s": B * args.n_tokens / whole, "first_token_s": first,
                     "decode_tok_s": B * (args.n_tokens - 1) / (whole - first), "torch": torch.__version__,
                     "threads": torch.get_num_threads()})
    return rows




def gpu_benchmark(args, command):
    """--backend cupy: decode speed at each size and batch next to transformers on the
    same GPU, what one CuPy call costs the host, and the speculative costs."""
    layout.to_backend({}, "cupy")  # CuPy and a GPU are there, or one clear line says what is missing
    import cupy
    x = cupy.ones(1024, np.float32)

    def thousand_ops():
        for _ in range(1000):
            y = x + 1.0
        float(y[0])
    launch_s = timed(thousand_ops, args.reps)[0] / 1000
    probe = cupy.ones((16384, 16384), np.float32)  # 1 GiB: long enough to hide the launch
    row = cupy.ones((1, probe.shape[0]), np.float32)
    bandwidth = probe.nbytes / timed(lambda: float((row @ probe)[0, 0]), args.reps)[0] / 1e9
    results = {"command": command, "backend": "cupy", "dtype": args.dtype, "prompt_len": args.prompt_len,
               "n_tokens": args.n_tokens, "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "cupy": cupy.__version__, "launch_us": launch_s * 1e6, "bandwidth_GBs": bandwidth, "models": {}}
    print(f"{results['gpu']}: one-row matmul {bandwidth:.0f} GB/s, one CuPy op {launch_s * 1e6:.1f} us of host time",
          flush=True)
    loaded = {}
    for size in dict.fromkeys(args.sizes + ([] if args.no_speculative else [args.draft, args.target])):
        params, hparams = random_params(size, seed=len(loaded))
        loaded[size] = (layout.to_backend(params, "cupy", args.dtype), hparams)
        if size not in args.sizes:
            continue
        rows = []
        for B in args.batch_sizes:
            prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
            runs = []
            timed(lambda: runs.append(greedy(prompts, loaded[size], args.n_tokens)[1]), args.reps)
            rows.append({"batch": B, "end_to_end_tok_s": float(np.median([r.tokens_per_s for r in runs[1:]])),
                         "decode_tok_s": float(np.median([r.decode_tokens_per_s for r in runs[1:]])),
                         "itl_ms_p50": float(np.median([r.itl_ms(50) for r in runs[1:]]))})
        hbm_ms = 1e3 * matmul_weight_bytes(loaded[size][0]) / (bandwidth * 1e9)
        results["models"][size] = {"decode": rows, "weights_at_bandwidth_ms": hbm_ms,
                                   "transformers": bench_transformers(size, args, device="cuda")}
        print(f"  GPT-2 {size}: batch-1 {rows[0]['end_to_end_tok_s']:.0f} tok/s, a step {rows[0]['itl_ms_p50']:.2f} ms "
              f"(its weights at full bandwidth: {hbm_ms:.2f} ms)", flush=True)
    if not args.no_speculative:
        results["speculative"] = bench_speculative_costs(loaded[args.draft], loaded[args.target], args)
    return results


def machine_info():
    """The CPU and the instruction sets each library runs on it, printed beside every result:
    OpenBLAS picks its kernels by CPU (threadpoolctl reports which), numba compiles the row
    kernel for the CPU that LLVM sees (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES can ask for
    another, e.g. haswell for AVX2 only)."""
    flags, model = set(), platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    from threadpoolctl import threadpool_info
    blas = [f"{i['internal_api']} {i['version']} ({i.get('architecture')}, {i['num_threads']} threads)"
            for i in threadpool_info() if i["user_api"] == "blas"]
    info = {"cpu": model, "cpu_count": os.cpu_count(), "simd": [s for s in ("avx2", "fma", "avx512f") if s in flags],
            "platform": platform.platform(), "numpy": np.__version__, "blas": blas, "row_kernel": rowwise.KERNEL}
    if rowwise.KERNEL == "numba":
        import llvmlite.binding
        import numba
        features = numba.config.CPU_FEATURES or llvmlite.binding.get_host_cpu_features().flatten()
        info.update(numba=numba.__version__, numba_cpu=numba.config.CPU_NAME or llvmlite.binding.get_host_cpu_name(),
                    numba_simd=[s for s in ("avx2", "fma", "avx512f") if f"+{s}" in features.split(",")],
                    numba_threads=numba.get_num_threads())
    return info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=list(SHAPES), help="default: 124M 355M (cupy: all four)")
    ap.add_argument("--batch_sizes", nargs="+", type=int, help="default: 1 8 32 (cupy: 1 8)")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--n_tokens", type=int, help="default: 32 (cupy: 128); speculative runs generate twice as many")
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1000])
    ap.add_argument("--draft", default="124M", choices=list(SHAPES))
    ap.add_argument("--target", choices=list(SHAPES), help="default: 355M (cupy: 1558M)")
    ap.add_argument("--K", type=int, default=4, help="the K of the users' command")
    ap.add_argument("--K_max", type=int, default=8, help="verification costs for K = 1..K_max")
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.6, 0.7, 0.8, 0.9, 1.0])
    ap.add_argument("--e2e_alphas", nargs="+", type=float, default=[0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--draft_vocabs", nargs="+", type=int, default=[4096, 8192, 16384])
    ap.add_argument("--draft_vocab", type=int, default=8192, help="the subset the end-to-end runs also use")
    ap.add_argument("--n_requests", type=int, default=64, help="serving: requests per workload")
    ap.add_argument("--max_batches", nargs="+", type=int, default=[8, 16], help="serving: rows in flight")
    ap.add_argument("--serve_sizes", nargs="+", choices=list(SHAPES), help="serving: default 124M (none with --target "
                    "only runs)")
    ap.add_argument("--only", nargs="+",
                    choices=["decode", "formats", "kernels", "rows", "speculative", "serving", "breakdown", "http",
                             "beams", "ceiling"],
                    help="run only these parts (default: all but breakdown and ceiling)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models_dir", default="models")
    ap.add_argument("--out", default="benchmark_results")
    ap.add_argument("--img_dir", default="img")
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="float16: cupy only")
    ap.add_argument("--dtypes", nargs="+", choices=weight_formats.DTYPES, default=list(weight_formats.DTYPES),
                    help="formats: the weight formats measured against float32")
    ap.add_argument("--format_batches", nargs="+", type=int, default=[1, 8], help="formats: batch sizes")
    ap.add_argument("--draft_dtype", choices=weight_formats.DTYPES, default="float32",
                    help="speculative: the --draft model's weight format")
    ap.add_argument("--self_draft", choices=weight_formats.DTYPES[1:] + ("none",), default="int8",
                    help="speculative: also the target's own copy in this format as its draft")
    ap.add_argument("--self_draft_alphas", nargs="+", type=float, default=[0.8, 0.9, 0.95])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens: a smoke test")
    args = ap.parse_args(argv)
    gpu = args.backend == "cupy"
    defaults = {"sizes": list(SHAPES)[:4] if gpu else ["124M", "355M"], "batch_sizes": [1, 8] if gpu else [1, 8, 32],
                "n_tokens": 128 if gpu else 32, "target": "1558M" if gpu else "355M", "serve_sizes": ["124M"],
                "only": ["decode", "formats", "kernels", "rows", "speculative", "serving", "http", "beams"]}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype != "float32" and not gpu:
        ap.error(f"--dtype {args.dtype} needs --backend cupy")
    if args.draft_dtype != "float32" and (gpu or rowwise.KERNEL != "numba"):
        ap.error(f"--draft_dtype {args.draft_dtype} needs the numba row kernel on the CPU")
    if args.quick:
        args.sizes, args.draft, args.target, args.serve_sizes = ["tiny"], "tiny", "tiny", ["tiny"]
        args.batch_sizes, args.n_tokens, args.prompt_len, args.contexts, args.reps = [1, 2], 4, 8, [16], 1
        args.K, args.K_max, args.e2e_alphas, args.draft_vocabs, args.draft_vocab = 2, 2, [0.8], [1000], 1000
        args.n_requests, args.max_batches, args.format_batches, args.self_draft_alphas = 6, [2], [1, 2], [0.9]
    return args


def main(argv=None):
    args = parse_args(argv)
    command = ("python benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.backend == "cupy":
        try:
            results = gpu_benchmark(args, command)
        except utils.LoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return write_results(results, benchmark_report.gpu_markdown(results), args)
    probe = bandwidth_probe(1024 if args.quick else 8192)
    bandwidth = measure_bandwidth(probe)
    results = {"command": command, "prompt_len": args.prompt_len, "n_tokens": args.n_tokens,
               "machine": dict(machine_info(), bandwidth_GBs=bandwidth), "models": {},
               "gemv_is_exact": rowwise.gemv_is_exact()}
    print(f"{benchmark_report.machine_line(results['machine'])}\none-row matmul bandwidth: {bandwidth:.1f} GB/s",
          flush=True)
    wanted = list(args.sizes) if {"decode", "kernels", "formats", "ceiling"} & set(args.only) else []
    wanted += [args.target] if "rows" in args.only else []
    wanted += [args.target, args.draft] if {"speculative", "breakdown"} & set(args.only) else []
    wanted += args.serve_sizes if {"serving", "http", "beams"} & set(args.only) else []
    loaded, weights = {}, {}
    for size in dict.fromkeys(wanted):
        params, hparams, info = load_or_random(size, args.models_dir, seed=len(loaded))
        loaded[size], weights[size] = (params, hparams), info["weights"]
        print(f"GPT-2 {size}: {info['weights']} weights", flush=True)
        if size not in args.sizes or "decode" not in args.only:
            continue
        r = dict(info, decode=bench_decode(params, hparams, args, probe), context=bench_context(params, hparams, args),
                 layout=bench_layout(params, hparams, args),
                 transformers=None if args.quick else bench_transformers(size, args))
        results["models"][size] = r
        print(f"  batch-1 decode {r['decode'][0]['decode_tok_s']:.1f} tok/s "
              f"({r['decode'][0]['fraction_of_roofline']:.0%} of roofline)", flush=True)
    if "formats" in args.only:
        if rowwise.KERNEL != "numba" or "float32" not in args.dtypes:
            print("formats: skipped (bfloat16 and int8 need the numba row kernel; --dtypes must hold float32)")
        else:
            results["formats"] = [bench_formats(loaded[size], args, size) for size in args.sizes]
            results["formats_test_model"] = test_model_agreement()
    if "rows" in args.only:
        results["rows"] = {"target": args.target, "by_n": bench_rows(loaded[args.target], args)}
    if "ceiling" in args.only:
        if rowwise.KERNEL != "numba":
            print("ceiling: skipped (it measures the numba kernels)")
        else:
            results["ceiling"] = bench_ceiling(loaded, args, probe)
    if "kernels" in args.only:
        results["kernels"] = [row for size in args.sizes for row in bench_kernels(loaded[size], args, size)]
        if rowwise.KERNEL == "numba":
            results["kernel_start"] = kernel_start_s()
    if "speculative" in args.only:
        draft, target = in_format(loaded[args.draft], args.draft_dtype)[0], loaded[args.target]
        costs = bench_speculative_costs(draft, target, args)
        results["speculative"] = dict(costs, end_to_end=bench_speculative_end_to_end(draft, target, costs, args),
                                      coverage=subset_coverage(args.draft_vocabs), K=args.K,
                                      draft_vocab=args.draft_vocab)
        if args.draft_dtype != "float32":
            results["speculative"]["draft"] += f" {args.draft_dtype}"
        if args.self_draft != "none" and rowwise.KERNEL == "numba":
            results["self_draft"] = bench_self_draft(target, args, weights[args.target])
    if "breakdown" in args.only:
        results["breakdown"] = bench_breakdown(loaded[args.draft], loaded[args.target], args)
    if "serving" in args.only:
        results["serving"] = [row for size in args.serve_sizes for row in bench_serving(loaded[size], args, size)]
    if "http" in args.only:
        results["http"] = bench_http(loaded[args.serve_sizes[0]], args, args.serve_sizes[0])
    if "beams" in args.only:
        results["beams"] = bench_beams(loaded[args.serve_sizes[0]], args, args.serve_sizes[0])
    for size, r in results["models"].items():
        if r["load_s"] is None:
            # last: writing a GB-sized temp file leaves the OS flushing and reclaiming for
            # seconds afterwards, which measurably slowed the decode runs that followed it
            r["load_s"] = time_memmap_load(*loaded[size])
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    code = write_results(results, benchmark_report.markdown(results), args)
    print("\n" + (benchmark_report.plots(results, args.img_dir) if not args.quick else "plots skipped in --quick mode"))
    return code


def write_results(results, table, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)
    print(f"results: {args.out}/results.json, {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
