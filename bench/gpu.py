"""`--backend cupy`: the benchmark on an NVIDIA GPU.

Each of our kernels alone (gpu_kernels.py); decode speed at each size and batch, eagerly
through CuPy's operations and with our own kernels, each step replayed as a CUDA graph
(kernels/cuda_graphs.py), greedy and sampled with main.py's default settings on the device
(kernels/cuda_sampling.py), next to transformers on the same GPU (in a process of its own,
peers.py); what one CuPy call costs the host, the GPU's bandwidth, and speculative decoding
through our kernels: its costs, and runs end to end beside plain decoding (the CPU's
controlled drafter, bench/speculation.py). Every model has random weights of its real shape.
"""
import argparse
import contextlib
import json
import sys

import numpy as np

from bench.common import greedy, matmul_weight_bytes, prompt_ids, random_params, timed
from bench.gpu_kernels import kernel_rows, sampling_on_device, table as kernel_table
from bench.speculation import bench_speculative_costs, bench_speculative_end_to_end
import batching
import sampling
from bench import report
from bench.transformers_peer import VARIANTS, transformers_apart
from kernels import cuda_decode_loop, layout

ANCHOR_TIMEOUT_S = 150  # an anchor (transformers another way) that takes longer is its line: "timed out"
SAMPLED = sampling.SamplingSettings(temperature=0.8, top_p=0.9)  # main.py's defaults


def gpu_benchmark(args, command, save=lambda results: None):
    """--backend cupy: decode speed at each size and batch next to transformers on the
    same GPU, what one CuPy call costs the host, and the speculative costs; save(results)
    after each table, so that a run stopped midway keeps what it measured."""
    cupy = layout.gpu_library()
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
    ours_of = {}  # each size in our kernels' layout, in the first dtype (speculative decoding's)
    decoded = args.sizes if "decode" in args.only else []
    timed_kernels = args.sizes if "kernels" in args.only else []
    for size in dict.fromkeys(decoded + timed_kernels + ([args.draft, args.target] if "speculative" in args.only
                                                          else [])):
        params, hparams = random_params(size, seed=len(ours_of))
        for dtype in args.dtype if size in decoded + timed_kernels else args.dtype[:1]:
            first = dtype == args.dtype[0]
            name = size if first else f"{size} {dtype}"  # a row's "model"
            ours = (layout.to_backend(params, "cupy", dtype, kernels=True), hparams)
            if first:
                ours_of[size] = ours
            if size in timed_kernels:
                rows = results.setdefault("kernels", {})[name] = kernel_rows(cupy, ours, args.reps)
                print("\n".join(kernel_table({name: rows})[3:]), flush=True)  # its rows, as they come
                save(results)
            if size in decoded:
                results["models"][name] = decode_rows(name, (params, hparams), ours, dtype, first, args, bandwidth)
                save(results)
        if size in decoded:  # after every dtype's rows: the compiled anchor may take minutes
            alone = argparse.Namespace(**{**vars(args), "batch_sizes": [1]})  # the issue's anchors are batch 1's
            for variant in args.anchors:
                results["models"][size]["anchors"][variant] = transformers_apart(
                    size, alone, "cuda", variant, timeout_s=ANCHOR_TIMEOUT_S, dtype=args.dtype[0])
                save(results)
    if "speculative" in args.only:
        draft, target = ours_of[args.draft], ours_of[args.target]
        with sampling_on_device():  # q and the verification in our kernels, a draft's K tokens one recorded graph
            results["speculative"] = costs = bench_speculative_costs(draft, target, args)
            save(results)
            results["speculative"] = dict(costs, end_to_end=bench_speculative_end_to_end(draft, target, costs, args))
    return results


def decode_rows(name, model, ours, dtype, first, args, bandwidth):
    """One model's decode rows at each batch, ours graphed (greedy and sampled), beside
    transformers in the same dtype; for the first dtype also eagerly through CuPy's
    operations."""
    params, hparams = model
    eager = (layout.to_backend(params, "cupy", dtype, kernels=False), hparams) if first else None
    rows = []
    for B in args.batch_sizes:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        row = {"batch": B}
        for way, m in (("eager_", eager), ("", ours)):  # CuPy's operations; our kernels, graphed
            if m is not None:
                with sampling_on_device() if m is ours else contextlib.nullcontext():  # ours: the draw in the graph
                    stats = decoded_stats(lambda: greedy(prompts, m, args.n_tokens), args.reps)
                row.update({f"{way}end_to_end_tok_s": stats(lambda r: r.tokens_per_s),
                            f"{way}decode_tok_s": stats(lambda r: r.decode_tokens_per_s),
                            f"{way}itl_ms_p50": stats(lambda r: r.itl_ms(50))})
        with sampling_on_device():  # ours again, main.py's default settings, sampled by cuda_sampling.py
            stats = decoded_stats(lambda: batching.generate(batching.requests(prompts, args.n_tokens, SAMPLED),
                                                            ours), args.reps)
        row["sampled_itl_ms_p50"] = stats(lambda r: r.itl_ms(50))
        rows.append(row)
    hbm_ms = 1e3 * matmul_weight_bytes(ours[0]) / (bandwidth * 1e9)
    print(f"  GPT-2 {name}: " + "; ".join(f"batch {r['batch']} a step {r['itl_ms_p50']:.2f} ms, sampled "
                                        f"{r['sampled_itl_ms_p50']:.2f} ms" + (
                                            f" (CuPy's operations {r['eager_itl_ms_p50']:.2f} ms)" if first else "")
                                        for r in rows)
          + f"; its weights at full bandwidth {hbm_ms:.2f} ms", flush=True)  # before the peers, which may hang
    return {"dtype": dtype, "decode": rows, "weights_at_bandwidth_ms": hbm_ms,
            "transformers": transformers_apart(name.split()[0], args, device="cuda", dtype=dtype),
            "anchors": {}}  # the first dtype's: gpu_benchmark's, once every dtype has its rows


def decoded_stats(decode, reps):
    """Runs decode() (-> (tokens, batching.Stats)) as timed() does; returns f -> the median of
    f(stats) over the runs after the first (its warm-up)."""
    runs = []
    timed(lambda: runs.append(decode()[1]), reps)
    return lambda f: float(np.median([f(r) for r in runs[1:]]))


def markdown(results):
    """The GPU run's tables (report.py's markdown is the CPU's)."""
    dtypes = results["dtype"] if isinstance(results["dtype"], list) else [results["dtype"]]  # (one, before a list)
    lines = [f"GPU: {results['gpu']}, CuPy {results['cupy']}, {' and '.join(dtypes)}, random weights; one-row matmul "
             f"{results['bandwidth_GBs']:.0f} GB/s; one CuPy elementwise op costs {results['launch_us']:.1f} us "
             "of host time.", f"Command: `{results['command']}`"]
    if "kernels" in results:
        lines += kernel_table(results["kernels"])
    if results["models"]:  # --only speculative decodes no size on its own
        lines += decode_table(results["models"], results)
    if "speculative" in results:
        s = results["speculative"]
        lines += [""] + report.speculative_costs_table(s) + (report.end_to_end_table(s) if "end_to_end" in s else [])
    return "\n".join(lines)


def decode_table(models, results):
    """Ours (graphed, and through CuPy's operations) beside transformers, each size and batch;
    then the batch-1 anchors."""
    lines = ["", f"End to end ({results['prompt_len']}-token prompt, {results['n_tokens']} new tokens, prefill "
             "included), greedy, against transformers' generate() on the same GPU, shapes and dtype; ours with its own "
             f"kernels, {cuda_decode_loop.STEPS} steps and their draws replayed as one CUDA graph (a step's ms: a "
             "replay's over its tokens; each run's cache records its graphs anew: a shape's first two uses eager, the "
             "recording in its second), and eagerly through CuPy's operations (in the first "
             "dtype; a model named with its dtype is in another); sampled: ours with "
             f"main.py's default settings (temperature {SAMPLED.temperature}, top-p {SAMPLED.top_p}), sampled by "
             "our kernels on the device (as GPT2_GPU_KERNELS=1 chooses):",
             "", "| model | batch | this project tok/s | transformers tok/s | ratio | step ms (p50) | "
             "sampled step ms (p50) | CuPy ops step ms (p50) | weights at full bandwidth ms |", "|---" * 9 + "|"]
    failed = []
    for size, r in models.items():
        peer = r["transformers"]
        if isinstance(peer, dict):  # its process crashed or refused
            failed.append(f"transformers on GPT-2 {size}: {peer['failed']}")
        theirs = {} if isinstance(peer, dict) else {t["batch"]: t["tok_s"] for t in peer or []}
        for d in r["decode"]:
            t = theirs.get(d["batch"])
            eager, sampled = (f"{d[key]:.2f}" if key in d else "-"  # runs before the column: -
                              for key in ("eager_itl_ms_p50", "sampled_itl_ms_p50"))
            lines.append(f"| {size} | {d['batch']} | {d['end_to_end_tok_s']:.1f} | "
                         + (f"{t:.1f} | {d['end_to_end_tok_s'] / t:.2f}x |" if t else "- | - |")
                         + f" {d['itl_ms_p50']:.2f} | {sampled} | {eager} | "
                         f"{r['weights_at_bandwidth_ms']:.2f} |")
    lines += [""] + failed if failed else []
    return lines + anchors_table(models)


def anchors_table(models):
    """Batch 1, decoding alone (ms a token): ours beside transformers run each way it runs
    (bench/transformers_peer.py's VARIANTS); a peer that failed says why in its cell."""
    def cell(peer):
        if not peer:
            return "-", None
        if isinstance(peer, dict):
            return peer["failed"], None
        ms = 1e3 / peer[0]["decode_tok_s"]
        return f"{ms:.2f}", ms
    rows = []
    for size, r in models.items():
        if "anchors" not in r:
            continue
        ours = 1e3 / r["decode"][0]["decode_tok_s"]
        peers = {"generate": [t for t in r["transformers"] if t["batch"] == 1]
                 if isinstance(r["transformers"], list) else r["transformers"], **r["anchors"]}
        cells = {variant: cell(peers.get(variant)) for variant in VARIANTS}
        static = cells["static"][1]
        rows.append(f"| {size} | {ours:.2f} | " + " | ".join(cells[v][0] for v in VARIANTS)
                    + f" | {f'{static / ours:.2f}x' if static else '-'} |")
    if not rows:
        return []
    return ["", "Batch 1, decoding alone, ms a token: ours (its own kernels, each step a replayed CUDA graph) "
            "beside transformers each way it runs:", "",
            "| model | ours | " + " | ".join(VARIANTS.values()) + " | ours over the compiled |",
            "|---|---|" + "---|" * len(VARIANTS) + "---|"] + rows


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))
