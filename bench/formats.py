"""`--only formats`: each weight format (weight_formats.py) against float32 on one model.

Decode tokens/s in turns, the stored size, the conversion, the memory of a process that
loads the model in the format, how far the output moves; what int8 would cost the NumPy
fallback; and llama.cpp on the same weights in its formats of the same widths, each in a
process of its own (llamacpp.py, peers.py).
"""
import json
import os
import subprocess
import sys

import numpy as np

import checkpoint
import gpt2
import utils
from bench import llamacpp
from bench.common import ROOT, greedy, in_format, prompt_ids, timed
from kernels import layout, weight_formats


def bench_formats(model, args, size):
    """Each weight format against float32 on one model: decode tokens/s at each batch
    size (the formats in turns, each rep; the ratio is the median of the paired ratios),
    the stored matrices' size, the conversion time, memory in a process of its own, and
    how far the output moves (agreement); what int8 would cost the NumPy fallback; and at
    batch 1 llama.cpp on the same weights where it is installed (llamacpp.py)."""
    models, convert_s = {}, {}
    for dtype in args.dtypes:
        models[dtype], convert_s[dtype] = in_format(model, dtype)
    with llamacpp.scratch_dir() as workdir:
        live, peer = llamacpp_peers(model, args, size, workdir)
        try:
            rows = format_decode_rows(models, live, peer, args, size)
        finally:
            llamacpp.stop_peers(live)  # before their files go
    formats = []
    for dtype in args.dtypes:
        formats.append({"size": size, "dtype": dtype, "stored_mib": stored_mib(models[dtype][0]),
                        "convert_s": convert_s[dtype], **format_load(size, dtype, args.models_dir),
                        **(agreement(models["float32"], models[dtype]) if dtype != "float32" else {})})
    f32_s, int8_s = fallback_widening(model, args.reps)
    fallback = {"float32_gemv_s": f32_s, "int8_widened_gemv_s": int8_s, "int8_over_float32": f32_s / int8_s}
    return {"decode": rows, "formats": formats, "numpy_fallback": fallback, "llama_cpp": peer}


def llamacpp_peers(model, args, size, workdir):
    """({our format: its llama.cpp peer on the same weights}, what to record of them)
    (llamacpp.start_peers), or ({}, why not)."""
    if llamacpp.MISSING or args.quick:
        why = llamacpp.MISSING or "--quick: the test shapes have no GPT-2 tokenizer"
        print(f"  llama.cpp peer: skipped ({why})", flush=True)
        return {}, {"skipped": why}
    ids = prompt_ids(args.prompt_len, seed=5)
    want = gpt2.gpt2(np.array([ids]), **model[0], n_head=model[1]["n_head"])[0, -1]  # [n_vocab]
    return llamacpp.start_peers(layout.plain_layout(model[0]), model[1], size, args.dtypes, workdir,
                                args.prompt_len + args.n_tokens + 8, ids, want)


def format_decode_rows(models, live, peer, args, size):
    """Decode tokens/s of each format at each batch size, in turns each rep, and at batch 1
    llama.cpp's formats (live) in the same turns (peer gets its rows)."""
    rows = []
    for B in args.format_batches:
        prompts = [prompt_ids(args.prompt_len, seed=b) for b in range(B)]
        tps = {dtype: [] for dtype in args.dtypes}
        peer_tps = {dtype: [] for dtype in live} if B == 1 else {}
        for _ in range(args.reps + 1):
            for dtype in args.dtypes:
                tps[dtype].append(greedy(prompts, models[dtype], args.n_tokens)[1].decode_tokens_per_s)
                if dtype in peer_tps:
                    tok_s = llamacpp.decode_turn(live, peer, dtype, size, prompts[0], args.n_tokens)
                    if tok_s is None:  # that peer failed: its line says so, and it has no row
                        del peer_tps[dtype]
                    else:
                        peer_tps[dtype].append(tok_s)
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
            peer["decode"].append({"size": size, "format": llamacpp.PEER_FORMATS[dtype], "ours": dtype,
                                   "decode_tok_s": float(np.median(runs[1:])), "decode_tok_s_min": min(runs[1:]),
                                   "decode_tok_s_max": max(runs[1:]), "ours_over_peer": float(np.median(ours)),
                                   "ours_over_peer_min": float(np.min(ours)),
                                   "ours_over_peer_max": float(np.max(ours))})
            print(f"  {size} llama.cpp {peer['decode'][-1]['format']} batch 1: {peer['decode'][-1]['decode_tok_s']:.1f}"
                  f" tok/s; ours ({dtype}) {peer['decode'][-1]['ours_over_peer']:.2f}x", flush=True)
    return rows


def stored_mib(params):
    """MiB of the matrices as stored (blocks and head; biases, norms and wpe left out)."""
    layers = [layer["w"] for block in params["blocks"] for part in ("attn", "mlp") for layer in block[part].values()]
    return sum(w.nbytes for w in layers + [params["wte"].T]) / 2**20


def agreement(model, other, n_positions=256, n_tokens=64, n_prompts=4):
    """How far `other` (a narrow copy) moves model's (float32) output: the logits of one
    pass over n_positions tokens (max error, relative to the largest logit, and how often
    the top token agrees), and greedy text over n_tokens for a few prompts (the tokens
    before the first difference, and the share of positions that agree). A model with a
    short window (the test suite's) gets as many as fit in it."""
    n_positions = min(n_positions, model[1]["n_ctx"] - 8)
    n_tokens = min(n_tokens, n_positions - 8)
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
    code = ("import json, time, utils, os\n"
            "from bench import common\n"
            f"t = time.perf_counter(); d = os.path.join({models_dir!r}, {size!r})\n"
            f"real = {size!r} in utils.MODEL_SIZES and utils.is_complete(d)\n"
            f"m = (utils.load_model_dir(d, dtype={dtype!r}) if real\n"
            f"     else common.random_params({size!r}, dtype={dtype!r}))\n"
            "load = time.perf_counter() - t\n"
            "status = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status')\n"
            "          if l.startswith(('RssAnon', 'VmHWM'))}\n"
            "print(json.dumps({'load_s': load, 'weights': 'real' if real else 'random', "
            "'rss_anon_mib': status['RssAnon'] / 1024, 'peak_rss_mib': status['VmHWM'] / 1024}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_model_agreement():
    """agreement() on the test suite's tiny GPT-2 (tests/fixtures), where present."""
    model_dir = os.path.join(ROOT, "tests", "fixtures", "tiny-openai")
    if not os.path.exists(model_dir):
        return {}
    hparams = utils.load_hparams(model_dir)
    plain = checkpoint.load_params(model_dir, hparams["n_layer"])
    model = (layout.decode_layout(plain, "numba"), hparams)
    return {dtype: agreement(model, (layout.decode_layout(plain, "numba", dtype), hparams))
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
