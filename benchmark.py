"""benchmark.py: every speed number in the README comes from here.

    python benchmark.py                 # 124M and 355M shapes, a few minutes on 2 cores
    python benchmark.py --quick         # tiny shapes, seconds (the test suite runs this)
    python benchmark.py --backend cupy  # on an NVIDIA GPU: all four sizes, next to transformers there

Speed does not depend on weight values, so models that are not in --models_dir
run with random weights of the real shapes (the output says which). Each number
is the median of --reps runs after a warm-up, with the spread (min-max) beside
it, and every ratio is taken within this one run. Results go to
<out>/results.json and <out>/results.md; with matplotlib installed, plots go
to img/.
"""
import argparse
import json
import os
import platform
import resource
import struct
import sys
import tempfile
import time

import numpy as np

import batching
import checkpoint
import gpt2
import kv_cache
import sampling
import speculative
import utils

SHAPES = {  # n_embd, n_head, n_layer of OpenAI's releases
    "124M": (768, 12, 12), "355M": (1024, 16, 24), "774M": (1280, 20, 36), "1558M": (1600, 25, 48),
    "tiny": (64, 4, 2),  # --quick
}
GREEDY = sampling.SamplingSettings(temperature=0.0)


def random_params(size, seed=0, n_vocab=50257, n_ctx=1024):
    """GPT-2 params of the real shapes, random values (N(0, 0.02), like GPT-2's init)."""
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
    return utils.decode_layout(params), hparams  # the memory order a loaded model has


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
    tensor, check shapes, copy wte and the MLP down-projections into column-major order
    (utils.decode_layout). The file was just written, so it is read from the page cache.
    Seconds, whatever the weights are."""
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
        utils.decode_layout(loaded)
        return time.perf_counter() - t


def matmul_weight_bytes(params):
    """Bytes a one-token decode step must stream: every matmul weight once (the head
    reads all of wte; wpe contributes one row and is left out)."""
    blocks = sum(w.nbytes for b in params["blocks"] for m in ("attn", "mlp") for lin in b[m].values()
                 for w in lin.values())
    return blocks + params["wte"].nbytes


def summary(stats):
    """The numbers of a batching.Stats that the tables below read."""
    return {"seconds": stats.seconds, "ttft_s": stats.ttft_s, "n_tokens": stats.n_tokens,
            "tokens_per_s": stats.tokens_per_s, "itl_ms_median": stats.itl_ms(50), "itl_ms_p90": stats.itl_ms(90),
            "acceptance_rate": stats.acceptance_rate, "tokens_per_target_pass": stats.tokens_per_target_pass,
            "draft_s": stats.draft_s, "verify_s": stats.verify_s}


def greedy(prompts, model, n, use_cache=True):
    """Plain greedy decoding: (new tokens, summary of its stats)."""
    out, stats = gpt2.generate(batching.requests(prompts, n, GREEDY), model, use_cache)
    return out, summary(stats)


def wait(x):
    """Block until x is computed: CuPy runs asynchronously, so a timer must wait for the GPU."""
    x[(0,) * x.ndim].tolist()


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


def bench_decode(params, hparams, args, probe):
    """Prefill, decode tokens/s at each batch size (cache on), and batch 1 without cache,
    each run next to its roofline. The machine's bandwidth drifts by 20% over minutes
    (other tenants), so it is measured right before every timed run, and the fraction
    of the roofline is the median of those paired ratios."""
    rows = []
    weight_bytes = matmul_weight_bytes(params)
    prompt = prompt_ids(args.prompt_len)
    for B in args.batch_sizes:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        results, bandwidths = [], []

        def run():
            bandwidths.append(measure_bandwidth(probe))
            results.append(greedy(prompts, (params, hparams), args.n_tokens)[1])
        timed(run, args.reps)
        results, bandwidths = results[1:], bandwidths[1:]  # drop the warm-up
        # after the first token (prefill), each row decodes n_tokens - 1 more in seconds - ttft
        tps = [B * (args.n_tokens - 1) / (r["seconds"] - r["ttft_s"]) for r in results]
        rooflines = [B * bw * 1e9 / weight_bytes for bw in bandwidths]
        rows.append({"batch": B, "cache": True, "decode_tok_s": float(np.median(tps)),
                     # prefill included, as transformers' generate() is timed below
                     "end_to_end_tok_s": float(np.median([r["n_tokens"] / r["seconds"] for r in results])),
                     "decode_tok_s_min": min(tps), "decode_tok_s_max": max(tps),
                     "bandwidth_GBs": float(np.median(bandwidths)),
                     "roofline_tok_s": float(np.median(rooflines)),
                     "fraction_of_roofline": float(np.median(np.divide(tps, rooflines))),
                     "ttft_ms": 1e3 * float(np.median([r["ttft_s"] for r in results])),
                     "itl_ms_p50": float(np.median([r["itl_ms_median"] for r in results])),
                     "itl_ms_p90": float(np.median([r["itl_ms_p90"] for r in results])),
                     "kv_cache_bytes_n_ctx": 2 * hparams["n_layer"] * B * hparams["n_ctx"] * hparams["n_embd"] * 4})
    bandwidth = measure_bandwidth(probe)
    _, stats = greedy([prompt], (params, hparams), max(4, args.n_tokens // 4), use_cache=False)
    roofline = bandwidth * 1e9 / weight_bytes
    rows.append({"batch": 1, "cache": False, "decode_tok_s": stats["tokens_per_s"], "bandwidth_GBs": bandwidth,
                 "roofline_tok_s": roofline, "fraction_of_roofline": stats["tokens_per_s"] / roofline,
                 "itl_ms_p50": stats["itl_ms_median"], "ttft_ms": stats["ttft_s"] * 1e3})
    return rows


def decode_step_time(params, hparams, context, T=1, reps=5):
    """Median seconds of one cached pass over T new tokens after `context` cached tokens."""
    model = (params, hparams)
    cache = kv_cache.init_cache(hparams, 1, context + T, like=params["wte"])
    text = prompt_ids(context)
    gpt2.next_logits(model, cache, [text])
    text += prompt_ids(T, seed=2)

    def step():
        cache["lengths"][:] = context  # roll back, so every rep sees the same context
        wait(gpt2.next_logits(model, cache, [text], n_logits=T))
    return timed(step, reps)[0]


def bench_context(params, hparams, args):
    """Per-token cost at growing context: one cached step vs recomputing the window."""
    rows = []
    for L in args.contexts:
        cached = decode_step_time(params, hparams, L, reps=args.reps)
        ids = np.array([prompt_ids(L + 1)])
        uncached = timed(lambda: gpt2.gpt2(ids, **params, n_head=hparams["n_head"]), max(1, args.reps // 2))[0]
        rows.append({"context": L, "cached_ms": cached * 1e3, "uncached_ms": uncached * 1e3,
                     "speedup": uncached / cached})
    return rows


def checkpoint_layout(params):
    """The params as the checkpoint stores them (every matrix row-major): what
    utils.decode_layout changed, undone, to measure what it buys."""
    def mlp(m):
        return {**m, "c_proj": {**m["c_proj"], "w": np.ascontiguousarray(m["c_proj"]["w"])}}
    blocks = [{**block, "mlp": mlp(block["mlp"])} for block in params["blocks"]]
    return {**params, "wte": np.ascontiguousarray(params["wte"]), "blocks": blocks}


def bench_layout(params, hparams, args):
    """A cached pass over 1 token (decoding) and 8 tokens (verifying K = 7 drafts)
    with the checkpoint's row-major weights and with utils.decode_layout's, taken
    in turns so that both see the same machine."""
    layouts = {"checkpoint": checkpoint_layout(params), "decode": params}
    rows = []
    for T in (1, 8):
        ms = {name: [] for name in layouts}
        for _ in range(args.reps):
            for name, p in layouts.items():
                ms[name].append(1e3 * decode_step_time(p, hparams, args.prompt_len, T=T, reps=args.reps))
        checkpoint, decode = float(np.median(ms["checkpoint"])), float(np.median(ms["decode"]))
        rows.append({"tokens": T, "checkpoint_ms": checkpoint, "decode_ms": decode, "speedup": checkpoint / decode})
    return rows


def bench_speculative_costs(draft, target, args):
    """The three costs that decide speculative speed, and the speedup they predict."""
    (d_params, d_hparams), (t_params, t_hparams) = draft, target
    L = args.prompt_len
    t_draft = decode_step_time(d_params, d_hparams, L, reps=args.reps)
    t_step = decode_step_time(t_params, t_hparams, L, reps=args.reps)
    verify, verify_unpadded = {}, {}
    for K in args.Ks:
        verify[K] = decode_step_time(t_params, t_hparams, L, T=K + 1, reps=args.reps)
        if 1 < K + 1 < gpt2.PAD_ROWS_TO and args.backend == "numpy":  # padding is for OpenBLAS only
            pad, gpt2.PAD_ROWS_TO = gpt2.PAD_ROWS_TO, 1
            verify_unpadded[K] = decode_step_time(t_params, t_hparams, L, T=K + 1, reps=args.reps)
            gpt2.PAD_ROWS_TO = pad
    rows = []
    for K in args.Ks:
        row = {"K": K, "verify_ms": verify[K] * 1e3, "verify_over_step": verify[K] / t_step,
               "verify_unpadded_ms": verify_unpadded[K] * 1e3 if K in verify_unpadded else None,
               "oracle_ceiling": (K + 1) * t_step / verify[K]}
        for alpha in args.alphas:
            tokens = K + 1 if alpha == 1 else (1 - alpha ** (K + 1)) / (1 - alpha)  # E[tokens per pass]
            row[f"predicted_a{alpha}"] = tokens * t_step / (K * t_draft + verify[K])
        rows.append(row)
    return {"draft_step_ms": t_draft * 1e3, "target_step_ms": t_step * 1e3,
            "draft_over_target": t_draft / t_step, "by_K": rows}


def bench_speculative_end_to_end(draft, target, args):
    """Measured tokens/s: plain greedy vs speculative with an oracle drafter (proposes the
    target's own greedy continuation: acceptance 1, drafting free), prompt lookup on an
    input-grounded prompt, and the draft model."""
    (t_params, t_hparams) = target
    n = args.n_tokens * 2
    prompt = prompt_ids(args.prompt_len)
    ar_runs = []
    timed(lambda: ar_runs.append(greedy([prompt], target, n)), args.reps)
    truth = prompt + ar_runs[0][0][0]
    ar_tok_s = float(np.median([s["tokens_per_s"] for _, s in ar_runs[1:]]))
    rows = [{"decoder": "autoregressive", "K": 0, "tok_s": ar_tok_s, "speedup": 1.0, "acceptance": None}]

    def oracle(seq, K):
        return truth[len(seq):len(seq) + K]

    # an input-grounded prompt: the continuation to come is quoted earlier in it, as in
    # summarising, editing code or answering from a document
    grounded = prompt + ar_runs[0][0][0] + prompt
    _, g_stats = greedy([grounded], target, n)
    cases = [("oracle", oracle, prompt, K) for K in args.e2e_Ks]
    cases += [("prompt_lookup (grounded prompt)", "prompt_lookup", grounded, K) for K in args.e2e_Ks]
    cases += [("draft model", "model", prompt, K) for K in args.e2e_Ks]
    for name, drafter, p, K in cases:
        runs = []
        config = speculative.SpeculativeConfig(K=K)
        drafter = draft if drafter == "model" else drafter
        timed(lambda: runs.append(speculative.speculative_generate(
            batching.requests([p], n, GREEDY), target, drafter, config)), args.reps)
        runs = [(o, summary(st)) for o, st in runs]
        out, s = runs[-1]
        base = g_stats["tokens_per_s"] if p is grounded else ar_tok_s
        tok_s = float(np.median([r[1]["tokens_per_s"] for r in runs[1:]]))
        rows.append({"decoder": name, "K": K, "tok_s": tok_s, "speedup": tok_s / base,
                     "acceptance": s["acceptance_rate"], "tokens_per_target_pass": s["tokens_per_target_pass"],
                     "draft_s": s["draft_s"], "verify_s": s["verify_s"]})
    return rows


def bench_transformers(size, args, device="cpu"):
    """Hugging Face transformers' generate() on the same shapes, if it is installed."""
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
        with torch.no_grad():
            def run():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.n_tokens,
                               min_new_tokens=args.n_tokens, do_sample=False, pad_token_id=0)
                if device == "cuda":
                    torch.cuda.synchronize()
            med, lo, hi = timed(run, args.reps)
        rows.append({"batch": B, "tok_s": B * args.n_tokens / med, "torch": torch.__version__,
                     "threads": torch.get_num_threads()})
    return rows


def gpu_benchmark(args, command):
    """--backend cupy: decode speed at each size and batch next to transformers on the
    same GPU, what one CuPy call costs the host, and the speculative costs."""
    utils.to_backend({}, "cupy")  # CuPy and a GPU are there, or one clear line says what is missing
    import cupy
    x = cupy.ones(1024, np.float32)

    def thousand_ops():
        for _ in range(1000):
            y = x + 1.0
        wait(y)
    launch_s = timed(thousand_ops, args.reps)[0] / 1000
    probe = cupy.ones((16384, 16384), np.float32)  # 1 GiB: long enough to hide the launch
    row = cupy.ones((1, probe.shape[0]), np.float32)
    bandwidth = probe.nbytes / timed(lambda: wait(row @ probe), args.reps)[0] / 1e9
    results = {"command": command, "backend": "cupy", "dtype": args.dtype, "prompt_len": args.prompt_len,
               "n_tokens": args.n_tokens, "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "cupy": cupy.__version__, "launch_us": launch_s * 1e6, "bandwidth_GBs": bandwidth, "models": {}}
    print(f"{results['gpu']}: one-row matmul {bandwidth:.0f} GB/s, one CuPy op {launch_s * 1e6:.1f} us of host time",
          flush=True)
    loaded = {}
    for size in dict.fromkeys(args.sizes + ([] if args.no_speculative else [args.draft, args.target])):
        params, hparams = random_params(size, seed=len(loaded))
        params = utils.to_backend(params, "cupy", args.dtype)
        loaded[size] = (params, hparams)
        if size not in args.sizes:
            continue
        rows = []
        for B in args.batch_sizes:
            prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
            runs = []
            timed(lambda: runs.append(greedy(prompts, (params, hparams), args.n_tokens)[1]), args.reps)
            runs = runs[1:]
            rows.append({"batch": B, "end_to_end_tok_s": float(np.median([r["tokens_per_s"] for r in runs])),
                         "decode_tok_s": float(np.median([B * (args.n_tokens - 1) / (r["seconds"] - r["ttft_s"])
                                                          for r in runs])),
                         "itl_ms_p50": float(np.median([r["itl_ms_median"] for r in runs]))})
        hbm_ms = 1e3 * matmul_weight_bytes(params) / (bandwidth * 1e9)
        results["models"][size] = {"decode": rows, "weights_at_bandwidth_ms": hbm_ms,
                                   "transformers": bench_transformers(size, args, device="cuda")}
        print(f"  GPT-2 {size}: batch-1 {rows[0]['end_to_end_tok_s']:.0f} tok/s, a step {rows[0]['itl_ms_p50']:.2f} ms "
              f"(its weights at full bandwidth: {hbm_ms:.2f} ms)", flush=True)
    if not args.no_speculative:
        results["speculative"] = {"draft": args.draft, "target": args.target, "alphas": args.alphas,
                                  "costs": bench_speculative_costs(loaded[args.draft], loaded[args.target], args)}
    return results


def gpu_markdown(results):
    lines = [f"GPU: {results['gpu']}, CuPy {results['cupy']}, {results['dtype']}, random weights; one-row matmul "
             f"{results['bandwidth_GBs']:.0f} GB/s; one CuPy elementwise op costs {results['launch_us']:.1f} us "
             "of host time.", f"Command: `{results['command']}`", "",
             f"End to end ({args_prompt(results)}, prefill included), greedy, against transformers' generate() "
             "on the same GPU, shapes and dtype:", "",
             "| model | batch | this project tok/s | transformers tok/s | ratio | step ms (p50) | weights at full bandwidth ms |",
             "|---|---|---|---|---|---|---|"]
    for size, r in results["models"].items():
        theirs = {t["batch"]: t["tok_s"] for t in r["transformers"] or []}
        for d in r["decode"]:
            t = theirs.get(d["batch"])
            lines.append(f"| {size} | {d['batch']} | {d['end_to_end_tok_s']:.1f} | "
                         + (f"{t:.1f} | {d['end_to_end_tok_s'] / t:.2f}x |" if t else "- | - |")
                         + f" {d['itl_ms_p50']:.2f} | {r['weights_at_bandwidth_ms']:.2f} |")
    if "speculative" in results:
        lines += [""] + speculative_costs_table(results["speculative"])
    return "\n".join(lines)


def speculative_costs_table(s):
    c = s["costs"]
    lines = [f"### Speculative decoding: draft {s['draft']} -> target {s['target']}", "",
             f"draft step {c['draft_step_ms']:.1f} ms, target step {c['target_step_ms']:.1f} ms "
             f"(c = draft/target = {c['draft_over_target']:.2f})", "",
             "| K | verify K+1 ms | verify / step | unpadded verify ms | oracle ceiling | "
             + " | ".join(f"predicted a={a}" for a in s["alphas"]) + " |",
             "|---|---|---|---|---|" + "---|" * len(s["alphas"])]
    for k in c["by_K"]:
        unp = f"{k['verify_unpadded_ms']:.1f}" if k["verify_unpadded_ms"] else "-"
        lines.append(f"| {k['K']} | {k['verify_ms']:.1f} | {k['verify_over_step']:.2f} | {unp} | "
                     f"{k['oracle_ceiling']:.2f}x | " + " | ".join(f"{k[f'predicted_a{a}']:.2f}x"
                                                                  for a in s["alphas"]) + " |")
    return lines


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def markdown(results):
    """The tables the README quotes."""
    m = results["machine"]
    lines = [f"Machine: {m['cpu_count']} cores, {m['platform']}, NumPy {m['numpy']}; "
             f"one-row matmul bandwidth {m['bandwidth_GBs']:.1f} GB/s at the start (each decode row below "
             "measures its own, right before each of its runs).", f"Command: `{results['command']}`", ""]
    for size, r in results["models"].items():
        what = "their checkpoint" if r["weights"] == "real" else "as a real-size model.safetensors"
        load = f"{r['load_s'] * 1e3:.0f} ms to memmap {what} and copy wte + MLP c_proj to column-major"
        lines += [f"### GPT-2 {size} ({r['weights']} weights; load {load})", "",
                  "| batch | KV cache | decode tok/s (min-max) | bandwidth GB/s | roofline tok/s | of roofline | "
                  "TTFT ms | ITL p50 / p90 ms | KV cache at n_ctx |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d in r["decode"]:
            spread = f" ({d['decode_tok_s_min']:.1f}-{d['decode_tok_s_max']:.1f})" if d["cache"] else ""
            p90 = f" / {d['itl_ms_p90']:.1f}" if d["cache"] else ""
            lines.append(f"| {d['batch']} | {'on' if d['cache'] else 'off'} | {d['decode_tok_s']:.1f}{spread} | "
                         f"{d['bandwidth_GBs']:.1f} | {d['roofline_tok_s']:.1f} | {d['fraction_of_roofline']:.0%} | "
                         f"{d['ttft_ms']:.0f} | "
                         f"{d['itl_ms_p50']:.1f}{p90} | "
                         + (f"{d['kv_cache_bytes_n_ctx'] / 2**20:.0f} MiB |" if d["cache"] else "- |"))
        if r.get("transformers"):
            ours = {d["batch"]: d["end_to_end_tok_s"] for d in r["decode"] if d["cache"]}
            lines += ["", f"End to end ({args_prompt(results)}, prefill included), against transformers' generate() "
                      f"on the same shapes (torch {r['transformers'][0]['torch']}, "
                      f"{r['transformers'][0]['threads']} threads, float32, greedy):", "",
                      "| batch | this project tok/s | transformers tok/s | ratio |", "|---|---|---|---|"]
            lines += [f"| {t['batch']} | {ours[t['batch']]:.1f} | {t['tok_s']:.1f} | {ours[t['batch']] / t['tok_s']:.2f}x |"
                      for t in r["transformers"]]
        lines += ["", "| context | cached step ms | uncached pass ms | cache speedup |", "|---|---|---|---|"]
        lines += [f"| {c['context']} | {c['cached_ms']:.1f} | {c['uncached_ms']:.1f} | {c['speedup']:.1f}x |"
                  for c in r["context"]]
        lines += ["", "| weight layout: cached pass over | checkpoint (row-major) ms | decode_layout ms | speedup |",
                  "|---|---|---|---|"]
        lines += [f"| {x['tokens']} token{'s' if x['tokens'] > 1 else ''} | {x['checkpoint_ms']:.1f} | "
                  f"{x['decode_ms']:.1f} | {x['speedup']:.2f}x |" for x in r["layout"]]
        lines.append("")
    if "speculative" in results:
        s = results["speculative"]
        lines += speculative_costs_table(s)
        lines += ["", "| decoder | K | tok/s | speedup | acceptance | tokens/target pass |", "|---|---|---|---|---|---|"]
        for e in s["end_to_end"]:
            acc = f"{e['acceptance']:.0%}" if e["acceptance"] is not None else "-"
            tpp = f"{e['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in e else "1"
            lines.append(f"| {e['decoder']} | {e['K'] or '-'} | {e['tok_s']:.1f} | {e['speedup']:.2f}x | {acc} | {tpp} |")
    lines.append(f"\nPeak RSS {results['peak_rss_mib']:.0f} MiB.")
    return "\n".join(lines)


def args_prompt(results):
    return f"{results['prompt_len']}-token prompt, {results['n_tokens']} new tokens"


def plots(results, img_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped (pip install matplotlib)"
    os.makedirs(img_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for size, r in results["models"].items():
        d = [x for x in r["decode"] if x["cache"]]
        ax.plot([x["batch"] for x in d], [x["end_to_end_tok_s"] for x in d], "o-", label=f"{size} (this project)")
        if r.get("transformers"):
            ax.plot([t["batch"] for t in r["transformers"]], [t["tok_s"] for t in r["transformers"]], "x--",
                    label=f"{size} (transformers)")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s, prefill included",
           title=f"Throughput vs batch ({args_prompt(results)})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(img_dir, "tokens_per_s_vs_batch.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for size, r in results["models"].items():
        ax.plot([c["context"] for c in r["context"]], [c["cached_ms"] for c in r["context"]], "o-", label=f"{size} cache")
        ax.plot([c["context"] for c in r["context"]], [c["uncached_ms"] for c in r["context"]], "x--",
                label=f"{size} no cache")
    ax.set(yscale="log", xlabel="context length", ylabel="ms per token", title="KV cache vs recomputation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(img_dir, "cache_vs_context.png"), dpi=120)
    if "speculative" in results:
        s = results["speculative"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        Ks = [k["K"] for k in s["costs"]["by_K"]]
        a1.plot(Ks, [k["oracle_ceiling"] for k in s["costs"]["by_K"]], "k--", label="oracle ceiling")
        for a in s["alphas"]:
            a1.plot(Ks, [k[f"predicted_a{a}"] for k in s["costs"]["by_K"]], "o-", label=f"acceptance {a}")
        a1.axhline(1, color="grey", lw=0.5)
        a1.set(xlabel="K", ylabel="predicted speedup", title=f"{s['draft']} -> {s['target']} on this CPU")
        a1.legend(fontsize=7)
        a2.bar([str(k) for k in Ks], [k["verify_over_step"] for k in s["costs"]["by_K"]])
        a2.axhline(1, color="grey", lw=0.5)
        a2.set(xlabel="K", ylabel="verify(K+1) / one decode step", title="Cost of verifying K+1 tokens")
        fig.tight_layout()
        fig.savefig(os.path.join(img_dir, "speculative_speedup_vs_K.png"), dpi=120)
    plt.close("all")
    return f"plots written to {img_dir}/"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=list(SHAPES), help="default: 124M 355M (cupy: all four)")
    ap.add_argument("--batch_sizes", nargs="+", type=int, help="default: 1 8 32 (cupy: 1 8)")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--n_tokens", type=int, help="default: 32 (cupy: 128)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1000])
    ap.add_argument("--draft", default="124M", choices=list(SHAPES))
    ap.add_argument("--target", choices=list(SHAPES), help="default: 355M (cupy: 1558M)")
    ap.add_argument("--Ks", nargs="+", type=int, default=list(range(1, 9)))
    ap.add_argument("--e2e_Ks", nargs="+", type=int, default=[2, 4, 7])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.6, 0.8, 0.9, 1.0])
    ap.add_argument("--no_speculative", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models_dir", default="models")
    ap.add_argument("--out", default="benchmark_results")
    ap.add_argument("--img_dir", default="img")
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="float16: cupy only")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens: a smoke test")
    args = ap.parse_args(argv)
    gpu = args.backend == "cupy"
    defaults = {"sizes": list(SHAPES)[:4] if gpu else ["124M", "355M"], "batch_sizes": [1, 8] if gpu else [1, 8, 32],
                "n_tokens": 128 if gpu else 32, "target": "1558M" if gpu else "355M"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype != "float32" and not gpu:
        ap.error(f"--dtype {args.dtype} needs --backend cupy")
    if args.quick:
        args.sizes, args.draft, args.target = ["tiny"], "tiny", "tiny"
        args.batch_sizes, args.n_tokens, args.prompt_len = [1, 2], 4, 8
        args.contexts, args.Ks, args.e2e_Ks, args.reps = [16], [1, 2], [2], 1
    return args


def main(argv=None):
    args = parse_args(argv)
    command = "python benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.backend == "cupy":
        try:
            results = gpu_benchmark(args, command.strip())
        except utils.LoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return write_results(results, gpu_markdown(results), args)
    probe = bandwidth_probe(1024 if args.quick else 8192)
    bandwidth = measure_bandwidth(probe)
    results = {"command": command.strip(), "prompt_len": args.prompt_len, "n_tokens": args.n_tokens, "machine": {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "numpy": np.__version__,
        "bandwidth_GBs": bandwidth}, "models": {}}
    print(f"one-row matmul bandwidth: {bandwidth:.1f} GB/s", flush=True)
    loaded = {}
    for size in dict.fromkeys(args.sizes + ([] if args.no_speculative else [args.draft, args.target])):
        params, hparams, info = load_or_random(size, args.models_dir, seed=len(loaded))
        loaded[size] = (params, hparams)
        print(f"GPT-2 {size}: {info['weights']} weights", flush=True)
        if size not in args.sizes:
            continue
        r = dict(info)
        r["decode"] = bench_decode(params, hparams, args, probe)
        r["context"] = bench_context(params, hparams, args)
        r["layout"] = bench_layout(params, hparams, args)
        r["transformers"] = bench_transformers(size, args) if not args.quick else None
        results["models"][size] = r
        print(f"  batch-1 decode {r['decode'][0]['decode_tok_s']:.1f} tok/s "
              f"({r['decode'][0]['fraction_of_roofline']:.0%} of roofline)", flush=True)
    if not args.no_speculative:
        draft, target = loaded[args.draft], loaded[args.target]
        results["speculative"] = {"draft": args.draft, "target": args.target, "alphas": args.alphas,
                                  "costs": bench_speculative_costs(draft, target, args),
                                  "end_to_end": bench_speculative_end_to_end(draft, target, args)}
    for size, r in results["models"].items():
        if r["load_s"] is None:
            # last: writing a GB-sized temp file leaves the OS flushing and reclaiming for
            # seconds afterwards, which measurably slowed the decode runs that followed it
            r["load_s"] = time_memmap_load(*loaded[size])
    results["peak_rss_mib"] = peak_rss_mib()
    code = write_results(results, markdown(results), args)
    print("\n" + (plots(results, args.img_dir) if not args.quick else "plots skipped in --quick mode"))
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
