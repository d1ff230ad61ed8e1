"""The benchmark's command line: every speed number in the README comes from here
(bench/report.py turns the measurements into the tables and plots).

    python benchmark.py                 # 124M and 355M on the CPU: decoding, costs, speculative, serving
    python benchmark.py --quick         # tiny shapes, seconds (the test suite runs this)
    python benchmark.py --backend cupy  # on an NVIDIA GPU: all four sizes, next to transformers there

Speed does not depend on weight values, so models that are not in --models_dir
run with random weights of the real shapes (the output says which). Random
weights cannot tell how often a draft is accepted, so speculative decoding is
measured with a controlled drafter: the real draft model runs (its cost is
real), then each proposal is replaced by the target's own next token with
probability a (exactly a of them in shuffled blocks of 20). Each number is the
median of --reps runs after a warm-up, with the spread beside it where it
matters, and every ratio comes from this one run. An optional peer (llama.cpp,
transformers) runs in a process of its own: where it crashes, its line in the
results says so, and the rest of the run goes on.
"""
import argparse
import json
import os
import resource
import sys

import utils
from bench import plots, report
from bench.beams import bench_beams
from bench.chunked import STREAMS, bench_chunked
from bench.common import SHAPES, bandwidth_probe, in_format, load_or_random, machine_info, measure_bandwidth
from bench.decode import bench_context, bench_decode, bench_layout, time_memmap_load
from bench.formats import bench_formats, tiny_model_agreement
from bench.gpu import gpu_benchmark, markdown as gpu_markdown
from bench.rows import bench_kernels, bench_rows, kernel_start_s
from bench.prefix import bench_prefix
from bench.serve import bench_http, bench_serving
from bench.speculation import (bench_breakdown, bench_self_draft, bench_speculative_costs,
                               bench_speculative_end_to_end, subset_coverage)
from bench.transformers_peer import transformers_apart
from cli import flags
from kernels import rowwise, weight_formats


def parse_args(argv=None):
    """The flags, with the defaults that depend on --backend filled in; --quick shrinks all."""
    ap = flags.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                             "beams", "ceiling", "prefix", "chunked"],
                    help="run only these parts (default: all but breakdown, ceiling, prefix and chunked)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models_dir", default="models")
    ap.add_argument("--out", default="benchmark_results")
    ap.add_argument("--img_dir", default="img")
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    ap.add_argument("--dtype", nargs="+", choices=["float32", "float16"], default=["float32"],
                    help="cupy: each in turn, the first also through CuPy's operations, beside transformers' "
                    "anchors and for speculative decoding (float16: cupy only)")
    ap.add_argument("--anchors", nargs="*", choices=["no_mask", "static"], default=["no_mask", "static"],
                    help="cupy: transformers at batch 1 also without an attention mask and compiled with a static "
                         "cache (each a process of its own, at most ANCHOR_TIMEOUT_S)")
    ap.add_argument("--dtypes", nargs="+", choices=weight_formats.DTYPES, default=list(weight_formats.DTYPES),
                    help="formats: the weight formats measured against float32")
    ap.add_argument("--format_batches", nargs="+", type=int, default=[1, 8], help="formats: batch sizes")
    ap.add_argument("--draft_dtype", nargs="+", choices=weight_formats.DTYPES,
                    help="speculative: the --draft model's weight formats, each measured in turn, the first in the "
                         "main table (default: int8, as main.py drafts, then float32 beside it; float32 alone "
                         "without the numba kernel)")
    ap.add_argument("--self_draft", choices=weight_formats.DTYPES[1:] + ("none",), default="int8",
                    help="speculative: also the target's own copy in this format as its draft")
    ap.add_argument("--self_draft_alphas", nargs="+", type=float, default=[0.8, 0.9, 0.95])
    ap.add_argument("--prefix_sizes", nargs="+", choices=list(SHAPES), default=["124M", "355M"],
                    help="prefix: the models")
    ap.add_argument("--prefix_len", type=int, default=500, help="prefix: tokens of a template, or a prompt")
    ap.add_argument("--question_len", type=int, default=30, help="prefix: tokens after a template")
    ap.add_argument("--prefix_new_tokens", type=int, default=32, help="prefix: new tokens a request")
    ap.add_argument("--prefix_max_batch", type=int, default=8, help="prefix: rows in flight")
    ap.add_argument("--prefix_workloads", nargs="+", choices=["templates", "choices", "unique"],
                    default=["templates", "choices", "unique"], help="prefix: the workloads")
    ap.add_argument("--chunked_sizes", nargs="+", choices=list(SHAPES), default=["124M", "355M"],
                    help="chunked: the models")
    ap.add_argument("--chunked_budgets", nargs="+", type=int, default=[16, 24, 32],
                    help="chunked: the --max_prefill_tokens measured (24: the default), each in its turn")
    ap.add_argument("--chunked_long_prompts", type=int, default=4, help="chunked: long prompts a turn")
    ap.add_argument("--chunked_long_len", type=int, default=1000, help="chunked: tokens of a long prompt")
    ap.add_argument("--chunked_stream_tokens", type=int, default=256, help="chunked: new tokens of a stream")
    ap.add_argument("--chunked_streams", type=int, default=21, help="chunked: streams a turn, 7 at a time")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens: a smoke test")
    args = ap.parse_args(argv)
    gpu = args.backend == "cupy"
    defaults = {"sizes": list(SHAPES)[:4] if gpu else ["124M", "355M"], "batch_sizes": [1, 8] if gpu else [1, 8, 32],
                "n_tokens": 128 if gpu else 32, "target": "1558M" if gpu else "355M", "serve_sizes": ["124M"],
                "only": ["decode", "formats", "kernels", "rows", "speculative", "serving", "http", "beams"]}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype != ["float32"] and not gpu:
        ap.error(f"--dtype {' '.join(args.dtype)} needs --backend cupy")
    if args.draft_dtype is None:
        args.draft_dtype = ["int8", "float32"] if rowwise.KERNEL == "numba" and not gpu else ["float32"]
    narrow = [t for t in args.draft_dtype if t != "float32"]
    if narrow and (gpu or rowwise.KERNEL != "numba"):
        ap.error(f"--draft_dtype {narrow[0]} needs the numba row kernel on the CPU")
    if args.quick:
        args.sizes, args.draft, args.target, args.serve_sizes = ["tiny"], "tiny", "tiny", ["tiny"]
        args.batch_sizes, args.n_tokens, args.prompt_len, args.contexts, args.reps = [1, 2], 4, 8, [16], 1
        args.K, args.K_max, args.e2e_alphas, args.draft_vocabs, args.draft_vocab = 2, 2, [0.8], [1000], 1000
        args.n_requests, args.max_batches, args.format_batches, args.self_draft_alphas = 6, [2], [1, 2], [0.9]
        args.prefix_sizes, args.prefix_len, args.question_len, args.prefix_new_tokens = ["tiny"], 40, 6, 3
        args.chunked_sizes, args.chunked_budgets, args.chunked_long_prompts = ["tiny"], [8], 2
        args.chunked_long_len, args.chunked_stream_tokens, args.chunked_streams = 40, 8, 14
    check(args)
    return args


AT_LEAST_ONE = ("reps", "n_tokens", "prompt_len", "K", "K_max", "n_requests", "prefix_len", "question_len",
                "prefix_new_tokens", "prefix_max_batch", "chunked_long_prompts", "chunked_long_len",
                "chunked_stream_tokens", "chunked_streams", "batch_sizes", "max_batches", "format_batches",
                "draft_vocabs", "contexts")
FRACTIONS = ("alphas", "e2e_alphas", "self_draft_alphas")


def check(args):
    """A ValueError naming the first flag a run could not use, before anything is measured:
    a run of an hour must not fail midway (nor at its end: check_folders)."""
    if rowwise.KERNEL_ERROR:
        raise ValueError(rowwise.KERNEL_ERROR)
    for name in AT_LEAST_ONE:
        for value in getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]:
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
    for name in FRACTIONS:
        if not all(0.0 <= a <= 1.0 for a in getattr(args, name)):
            raise ValueError(f"--{name} are acceptance rates: each in [0, 1], got {getattr(args, name)}")
    if max(args.contexts) >= 1024:
        raise ValueError(f"--contexts must be below GPT-2's 1024-token window (a step after them), got "
                         f"{max(args.contexts)}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft_vocab must be >= 0 (0: the whole vocabulary), got {args.draft_vocab}")
    if min(args.chunked_budgets) < STREAMS + 1:  # (chunking.check_budget: each decoding row counts one token)
        raise ValueError(f"--chunked_budgets must each be >= {STREAMS + 1}, the run's rows, "
                         f"got {min(args.chunked_budgets)}")


def check_folders(args):
    """A ValueError where --out or --img_dir cannot take what the run writes at its end."""
    for name in ("out", "img_dir"):
        writable_folder(getattr(args, name), f"--{name}")
    for name in ("results.json", "results.md"):
        if os.path.isdir(os.path.join(args.out, name)):
            raise ValueError(f"--out {args.out} holds a folder named {name}, where the results go: pick another --out")


def writable_folder(path, flag):
    """A ValueError unless path is a folder this process can write in, or one it can make."""
    at = os.path.abspath(path)
    while not os.path.exists(at):
        at = os.path.dirname(at)
    if not os.path.isdir(at) or not os.access(at, os.W_OK | os.X_OK):
        why = "not writable" if os.path.isdir(at) else "not a folder"
        raise ValueError(f"{flag} {path}: cannot write there ({at} is {why}); pick another {flag}")


def main(argv=None):
    try:
        return run(argv)
    except (ValueError, utils.LoadError) as e:  # a bad flag, or a checkpoint in --models_dir that is not one
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(argv):
    args = parse_args(argv)
    check_folders(args)
    command = ("python benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.backend == "cupy":
        results = gpu_benchmark(args, command, save=lambda r: write_results(r, gpu_markdown(r), args, show=False))
        return write_results(results, gpu_markdown(results), args)
    probe = bandwidth_probe(1024 if args.quick else 8192)
    bandwidth = measure_bandwidth(probe)
    results = {"command": command, "prompt_len": args.prompt_len, "n_tokens": args.n_tokens,
               "machine": dict(machine_info(), bandwidth_GBs=bandwidth), "models": {},
               "gemv_is_exact": rowwise.gemv_is_exact()}
    print(f"{report.machine_line(results['machine'])}\none-row matmul bandwidth: {bandwidth:.1f} GB/s",
          flush=True)
    loaded, weights = load_and_decode(results, args, probe)
    run_sections(results, loaded, weights, args, probe)
    for size, r in results["models"].items():
        if r["load_s"] is None:
            # last: writing a GB-sized temp file leaves the OS flushing and reclaiming for
            # seconds afterwards, which measurably slowed the decode runs that followed it
            r["load_s"] = time_memmap_load(*loaded[size])
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    code = write_results(results, report.markdown(results), args)
    print("\n" + (plots.plots(results, args.img_dir) if not args.quick else "plots skipped in --quick mode"))
    return code


def wanted_sizes(args):
    """The model sizes the sections asked for need, each once, in the order they are loaded."""
    wanted = list(args.sizes) if {"decode", "kernels", "formats", "ceiling"} & set(args.only) else []
    wanted += [args.target] if "rows" in args.only else []
    wanted += [args.target, args.draft] if {"speculative", "breakdown"} & set(args.only) else []
    wanted += args.serve_sizes if {"serving", "http", "beams"} & set(args.only) else []
    wanted += args.prefix_sizes if "prefix" in args.only else []
    wanted += args.chunked_sizes if "chunked" in args.only else []
    return list(dict.fromkeys(wanted))


def load_and_decode(results, args, probe):
    """Load each size the sections need ({size: model}, {size: "real" or "random"}), and
    run the decode section on each of --sizes right after its load (into results)."""
    loaded, weights = {}, {}
    for size in wanted_sizes(args):
        params, hparams, info = load_or_random(size, args.models_dir, seed=len(loaded))
        loaded[size], weights[size] = (params, hparams), info["weights"]
        print(f"GPT-2 {size}: {info['weights']} weights", flush=True)
        if size not in args.sizes or "decode" not in args.only:
            continue
        r = dict(info, decode=bench_decode(params, hparams, args, probe), context=bench_context(params, hparams, args),
                 layout=bench_layout(params, hparams, args),
                 transformers=None if args.quick else transformers_apart(size, args))
        results["models"][size] = r
        print(f"  batch-1 decode {r['decode'][0]['decode_tok_s']:.1f} tok/s "
              f"({r['decode'][0]['fraction_of_roofline']:.0%} of roofline)", flush=True)
    return loaded, weights


def run_sections(results, loaded, weights, args, probe):
    """Every section of --only but decode, in this order, each into results."""
    if "formats" in args.only:
        if rowwise.KERNEL != "numba" or "float32" not in args.dtypes:
            print("formats: skipped (bfloat16 and int8 need the numba row kernel; --dtypes must hold float32)")
        else:
            results["formats"] = [bench_formats(loaded[size], args, size) for size in args.sizes]
            results["formats_test_model"] = tiny_model_agreement()
    if "rows" in args.only:
        results["rows"] = {"target": args.target, "by_n": bench_rows(loaded[args.target], args)}
    if "ceiling" in args.only:
        if rowwise.KERNEL != "numba":
            print("ceiling: skipped (it measures the numba kernels)")
        else:
            from bench import ceiling  # only this section needs it (numba's intrinsics)
            results["ceiling"] = ceiling.bench_ceiling(loaded, args, probe)
    if "kernels" in args.only:
        results["kernels"] = [row for size in args.sizes for row in bench_kernels(loaded[size], args, size)]
        if rowwise.KERNEL == "numba":
            formats = ["float32"] if args.quick else list(dict.fromkeys(["float32", *args.draft_dtype]))
            results["kernel_start"] = kernel_start_s(formats)
    if "speculative" in args.only:
        target = loaded[args.target]
        runs = []
        for dtype in args.draft_dtype:
            draft = in_format(loaded[args.draft], dtype)[0]
            costs = bench_speculative_costs(draft, target, args)
            runs.append(dict(costs, end_to_end=bench_speculative_end_to_end(draft, target, costs, args),
                             coverage=subset_coverage(args.draft_vocabs) if not runs else None, K=args.K,
                             draft_vocab=args.draft_vocab, draft_dtype=dtype))
            runs[-1]["draft"] += f" {dtype}" if dtype != "float32" else ""
        results["speculative"], results["speculative_beside"] = runs[0], runs[1:]
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
    if "prefix" in args.only:
        results["prefix"] = [row for size in args.prefix_sizes for row in bench_prefix(loaded[size], args, size)]
    if "chunked" in args.only:
        if rowwise.KERNEL != "numba":
            print("chunked: skipped (prompts run whole without the numba kernels: chunks would change bits)")
        else:
            results["chunked"] = [bench_chunked(loaded[size], args, size) for size in args.chunked_sizes]


def write_results(results, table, args, show=True):
    """results.json and results.md (the tables) in --out, each whole (written aside, then
    renamed), the tables on the screen too where show."""
    os.makedirs(args.out, exist_ok=True)
    for name, text in (("results.json", json.dumps(results, indent=1)), ("results.md", table + "\n")):
        path = os.path.join(args.out, name)
        try:
            with open(path + ".part", "w") as f:
                f.write(text)
            os.replace(path + ".part", path)
        finally:
            if os.path.exists(path + ".part"):  # a write cut short (a full disk): nothing half-written stays
                os.remove(path + ".part")
    if not show:
        return 0
    print("\n" + table)
    print(f"results: {args.out}/results.json, {args.out}/results.md")
    return 0
