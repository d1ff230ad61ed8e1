"""The transformers peer of the decode section (and of the GPU's): Hugging Face's
generate() on the same shapes, randomly initialized, where torch and transformers are
installed.

It runs in a process of its own (peers.py), so that a crash in torch's native code is
this peer's line ("transformers: crashed (SIGSEGV)"), not the end of the run. The file
is named for what it measures, not `transformers.py`, which would shadow the package.
"""
import importlib.util
import time

import numpy as np

from bench import peers
from bench.common import SHAPES, prompt_ids


# how generate() runs (the GPU's anchors): as the decode table always ran it; without an attention
# mask (faster in eager mode); with a static cache, for which generate() compiles the forward
VARIANTS = {"generate": "generate()", "no_mask": "generate() without an attention mask",
            "static": 'generate(cache_implementation="static"), compiled'}


def transformers_apart(size, args, device="cpu", variant="generate", timeout_s=peers.TIMEOUT_S, dtype="float32"):
    """bench_transformers in a process of its own: its rows, None where transformers is not
    installed, or {"failed": why} where the peer crashed, refused or ran past timeout_s."""
    if missing():
        return None  # no process to start for a peer that is not there
    try:
        return peers.run_apart(bench_transformers, size, args, device, variant, dtype, timeout_s=timeout_s)
    except peers.PeerFailed as e:
        print(f"  transformers peer: {e}", flush=True)
        return {"failed": str(e)}


def missing():
    """Whether torch or transformers is not installed (found without importing either)."""
    return any(importlib.util.find_spec(name) is None for name in ("torch", "transformers"))


def bench_transformers(size, args, device="cpu", variant="generate", dtype="float32"):
    """Hugging Face transformers' generate() on the same shapes, if it is installed: end to
    end, and decoding alone as this project's decode_tok_s counts it (the tokens after the
    first over the time after the first): generate(n) - generate(1), prefill and the first
    token being the same in both, timed in turns (the first round a warm-up, which also
    pays a static cache's compilations). variant: a key of VARIANTS; dtype: the weights'."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    n_embd, n_head, n_layer = SHAPES[size]
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: 1558M's random init on a CPU takes half a minute
        model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_head=n_head, n_layer=n_layer)).eval()
    model = model.to(device, dtype=getattr(torch, dtype))
    rows = []
    for B in args.batch_sizes:
        ids = torch.tensor([prompt_ids(args.prompt_len, seed=b) for b in range(B)], device=device)
        times = {1: [], args.n_tokens: []}

        options = {} if variant == "no_mask" else {"attention_mask": torch.ones_like(ids)}
        if variant == "static":
            options["cache_implementation"] = "static"

        def run(n):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **options)
            if device == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - start)
        for rep in range(args.reps + 1):  # the first is a warm-up
            for n in times:
                run(n)
        first, whole = (float(np.median(times[n][1:])) for n in times)
        rows.append({"batch": B, "tok_s": B * args.n_tokens / whole, "first_token_s": first,
                     "decode_tok_s": B * (args.n_tokens - 1) / (whole - first), "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "variant": variant})
    return rows
