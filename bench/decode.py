"""`--only decode`: how fast one model decodes, and why.

Tokens/s at each batch size next to the memory roofline (every weight read once a step),
batch 1 without the KV cache, the cost of a token at growing context, the row kernel's
weight layout against the checkpoint's, and how long loading the model takes.
"""
import json
import os
import struct
import tempfile
import time

import numpy as np

import checkpoint
import gpt2
from bench.common import greedy, matmul_weight_bytes, measure_bandwidth, prompt_ids, timed
from cli.timing import pass_seconds
from kernels import layout


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


def bench_context(params, hparams, args):
    """Per-token cost at growing context: one cached step vs recomputing the window."""
    rows = []
    for L in args.contexts:
        cached = pass_seconds((params, hparams), L, reps=args.reps)
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
                ms[name].append(1e3 * pass_seconds(model, args.prompt_len, T, reps=args.reps))
        checkpoint_ms, decode_ms = float(np.median(ms["checkpoint"])), float(np.median(ms["decode"]))
        rows.append({"tokens": T, "checkpoint_ms": checkpoint_ms, "decode_ms": decode_ms,
                     "speedup": checkpoint_ms / decode_ms})
    return rows


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
