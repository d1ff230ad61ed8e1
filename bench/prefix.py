"""`--only prefix`: the prefix cache (serving/prefix_cache.py) on and off, in turns.

Three workloads through continuous batching (scheduler.serve, max_batch 8, every request
arriving at once, 32 new tokens each, greedy):
- templates: 64 requests over 4 templates of ~500 tokens, each plus a question of its own
  (~30 tokens): a few-shot prompt, or a fixed instruction before each document;
- choices: 8 prompts of ~500 tokens, n = 4 choices each (32 requests, sampled);
- unique: 64 prompts that share nothing, to show what the cache costs when it never hits.
"on": --prefix_cache_mib's default; "off": --prefix_cache_mib 0 (the choices of one prompt
still share it); "none": no sharing at all, as every request ran before the cache.
"""
import numpy as np

import batching
import sampling
from bench.common import GREEDY, settle
from cli import flags
from serving import prefix_cache, scheduler

WAYS = {"on": flags.PREFIX_CACHE_MIB << 20, "off": 0, "none": None}


def workloads(args):
    """{name: (requests, which ways run it)}, seeded."""
    rng = np.random.default_rng(0)

    def ids(n):
        return rng.integers(0, 50000, n).tolist()
    L, Q, new = args.prefix_len, args.question_len, args.prefix_new_tokens
    templates = [ids(L) for _ in range(4)]
    sampled = sampling.SamplingSettings(temperature=1.0, top_k=50)
    prompts = [ids(L) for _ in range(8)]
    return {
        "templates": ([batching.Request(tuple(templates[i % 4] + ids(Q)), new, GREEDY, seed=i) for i in range(64)],
                      ("on", "off")),
        "choices": ([batching.Request(tuple(p), new, sampled, seed=4 * j + c) for j, p in enumerate(prompts)
                     for c in range(4)], ("on", "off", "none")),
        "unique": ([batching.Request(tuple(ids(L + Q)), new, GREEDY, seed=i) for i in range(64)], ("on", "off")),
    }


def serve_once(reqs, model, way, max_batch):
    """(summary, all choices' first token per prompt: its median in s, hit rate) of one run."""
    prefix = None if WAYS[way] is None else prefix_cache.new_prefix_cache(WAYS[way])
    finished = [e for e in scheduler.serve(reqs, scheduler.autoregressive(model), max_batch, prefix=prefix)
                if e.kind == "finished"]
    by_prompt = {}
    for e in finished:
        by_prompt.setdefault(reqs[e.index].prompt, []).append(e.metrics["ttft_s"])
    all_first = float(np.median([max(t) for t in by_prompt.values()]))
    hits = prefix["hits"] / prefix["queries"] if prefix and prefix["queries"] else 0.0
    return scheduler.summarize(finished), all_first, hits


def bench_prefix(model, args, size):
    """Each workload's ways in turns, args.reps times: tokens/s, TTFT p50 / p95, all choices'
    first token (median over prompts), the share of prompt tokens copied; medians of reps,
    and each way's ratios over "off" (and "none") paired within a rep."""
    rows = []
    for name, (reqs, ways) in workloads(args).items():
        if name not in args.prefix_workloads:
            continue
        runs = {way: [] for way in ways}
        for _ in range(args.reps):
            for way in ways:
                settle()
                runs[way].append(serve_once(reqs, model, way, args.prefix_max_batch))
        for way in ways:
            s = [r[0] for r in runs[way]]
            row = {"size": size, "workload": name, "way": way, "requests": len(reqs),
                   "tokens_per_s": float(np.median([x["tokens_per_s"] for x in s])),
                   "ttft_s_p50": float(np.median([x["ttft_s_p50"] for x in s])),
                   "ttft_s_p95": float(np.median([x["ttft_s_p95"] for x in s])),
                   "all_choices_first_s": float(np.median([r[1] for r in runs[way]])),
                   "hit_rate": float(np.median([r[2] for r in runs[way]]))}
            for base in ("off", "none"):
                if base in runs and way != base:  # paired within each rep
                    pairs = list(zip(runs[way], runs[base]))
                    row[f"tok_s_over_{base}"] = float(np.median([a[0]["tokens_per_s"] / b[0]["tokens_per_s"]
                                                                 for a, b in pairs]))
                    row[f"ttft_p50_{base}_over"] = float(np.median([b[0]["ttft_s_p50"] / a[0]["ttft_s_p50"]
                                                                    for a, b in pairs]))
                    row[f"all_first_{base}_over"] = float(np.median([b[1] / a[1] for a, b in pairs]))
            rows.append(row)
            print(f"  prefix {size} {name} {way}: {row['tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_s_p50']:.2f}s "
                  f"/ p95 {row['ttft_s_p95']:.2f}s, hits {row['hit_rate']:.0%}", flush=True)
    return rows
