"""bench/report.py: benchmark.py's measurements as the README's tables (the plots are
plots.py's).

    python -m bench.report benchmark_results/decode/results.json   # the tables again, and the plots

Nothing here measures: every function reads the results dict that benchmark.py wrote.
Plots need matplotlib (optional: pip install matplotlib).
"""
import json
import statistics
import sys


def decode_tables(size, r):
    what = "their checkpoint" if r["weights"] == "real" else "as a real-size model.safetensors"
    load = f"{r['load_s'] * 1e3:.0f} ms to memmap {what} and copy the matrices into the row kernel's layout"
    lines = [f"### GPT-2 {size} ({r['weights']} weights; load {load})", "",
             "| batch | KV cache | decode tok/s (min-max) | bandwidth GB/s | roofline tok/s | of roofline | "
             "TTFT ms | ITL p50 / p90 ms | KV cache at n_ctx |", "|---|---|---|---|---|---|---|---|---|"]
    for d in r["decode"]:
        spread = f" ({d['decode_tok_s_min']:.1f}-{d['decode_tok_s_max']:.1f})" if d["cache"] else ""
        p90 = f" / {d['itl_ms_p90']:.1f}" if d["cache"] else ""
        lines.append(f"| {d['batch']} | {'on' if d['cache'] else 'off'} | {d['decode_tok_s']:.1f}{spread} | "
                     f"{d['bandwidth_GBs']:.1f} | {d['roofline_tok_s']:.1f} | {d['fraction_of_roofline']:.0%} | "
                     f"{d['ttft_ms']:.0f} | {d['itl_ms_p50']:.1f}{p90} | "
                     + (f"{d['kv_cache_bytes_n_ctx'] / 2**20:.0f} MiB |" if d["cache"] else "- |"))
    if isinstance(r.get("transformers"), dict):  # its process crashed or refused
        lines += ["", f"transformers' generate() on the same shapes: {r['transformers']['failed']}"]
    elif r.get("transformers"):
        ours = {d["batch"]: d for d in r["decode"] if d["cache"]}
        t0 = r["transformers"][0]
        lines += ["", f"Against transformers' generate() on the same shapes (torch {t0['torch']}, {t0['threads']} "
                  "threads, float32, greedy): end to end (prefill included), and decoding alone (the tokens after "
                  "the first; transformers: generate(n) - generate(1)):", "",
                  "| batch | end to end tok/s | transformers | ratio | decode tok/s | transformers | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for t in r["transformers"]:
            e2e, decode = ours[t["batch"]]["end_to_end_tok_s"], ours[t["batch"]]["decode_tok_s"]
            theirs = t.get("decode_tok_s")
            lines.append(f"| {t['batch']} | {e2e:.1f} | {t['tok_s']:.1f} | {e2e / t['tok_s']:.2f}x | {decode:.1f} | "
                         + (f"{theirs:.1f} | {decode / theirs:.2f}x |" if theirs else "- | - |"))
    lines += ["", "| context | cached step ms | uncached pass ms | cache speedup |", "|---|---|---|---|"]
    lines += [f"| {c['context']} | {c['cached_ms']:.1f} | {c['uncached_ms']:.1f} | {c['speedup']:.1f}x |"
              for c in r["context"]]
    lines += ["", "| weight layout: cached pass over | checkpoint (row-major) ms | decode_layout ms | speedup |",
              "|---|---|---|---|"]
    lines += [f"| {x['tokens']} token{'s' if x['tokens'] > 1 else ''} | {x['checkpoint_ms']:.1f} | "
              f"{x['decode_ms']:.1f} | {x['speedup']:.2f}x |" for x in r["layout"]]
    return lines + [""]


def rows_table(rows):
    ways = [w for w in ("kernel", "gemv", "product") if w in rows["by_n"][0]]
    names = {"kernel": "numba kernel (used)", "gemv": "each row its own gemv (fallback)",
             "product": "one BLAS product (not batch invariant)"}
    ones = {w: rows["by_n"][0][w] for w in ways}
    lines = [f"### Rows: a whole cached {rows['target']} pass over n tokens, in one-token steps of each way", "",
             "one-token step: " + ", ".join(f"{w} {ones[w]:.1f} ms" for w in ways), "",
             "| n | " + " | ".join(names[w] for w in ways) + " | best |", "|---|" + "---|" * len(ways) + "---|"]
    lines += [f"| {r['n']} | " + " | ".join(f"{r[w] / ones[w]:.2f}" for w in ways) + f" | {r['best']} |"
              for r in rows["by_n"]]
    return lines + [""]


def kernels_table(rows):
    lines = ["### Plain decoding: the numba kernel against the NumPy fallback (the code before the kernel), and "
             "against the kernel with NumPy's layer norm and attention (the code before row_ops.py), in turns",
             "", "| model | batch | kernel tok/s | fallback tok/s | kernel / fallback (min-max) | "
             "TTFT ms kernel / fallback | NumPy small ops tok/s | row_ops / NumPy small ops (min-max) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ops = (f"{r['numpy_ops_tok_s']:.1f} | {r['row_ops_ratio']:.2f}x ({r['row_ops_ratio_min']:.2f}-"
               f"{r['row_ops_ratio_max']:.2f})" if "row_ops_ratio" in r else "- | -")
        lines.append(f"| {r['size']} | {r['batch']} | {r['numba_tok_s']:.1f} | {r['numpy_tok_s']:.1f} | "
                     f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
                     f"{r.get('numba_ttft_ms', 0):.0f} / {r.get('numpy_ttft_ms', 0):.0f} | {ops} |")
    return lines + [""]


def ceiling_tables(c):
    ceilings, f32 = c["ceilings"], c["ceilings"]["float32"]
    names = {"float32": "float32 FMAs (row_kernel.py)", "int8 x int16": "int8 x int16, vpmaddwd (int8_kernel.py)",
             "int8 x 7 bits": "int8 x 7 bits, vpmaddubsw (int4_kernel.py's multiply)"}
    lines = ["### Ceiling: multiply-adds a second (benchmark_ceiling.py)", "",
             "Each kernel's inner loop (a tile of 4 rows x 16 columns) with its weights in L1, on every thread:", "",
             "| loop | G multiply-adds/s | over float32 |", "|---|---|---|"]
    lines += [f"| {names[k]} | {v / 1e9:.0f} | {v / f32:.2f}x |" for k, v in ceilings.items()]
    lines += ["", f"The kernels over a model's matrices (linear layers and head) from memory, in turns (memory "
              f"{c['bandwidth_GBs']:.1f} GB/s at the start):", "",
              "| model | rows | format | ms | G multiply-adds/s | of its loop's ceiling | weights GB/s |",
              "|---|---|---|---|---|---|---|"]
    ceiling_of = {"float32": ceilings["float32"], "int8": ceilings["int8 x int16"]}
    lines += [f"| {k['size']} | {k['batch']} | {k['dtype']} | {k['ms']:.1f} | {k['multiply_adds_per_s'] / 1e9:.0f} | "
              f"{k['multiply_adds_per_s'] / ceiling_of[k['dtype']]:.0%} | {k['weights_GBs']:.1f} |"
              for k in c["kernels"]]
    return lines + [""]


def kernel_start_table(k):
    """Each loop's first start in a fresh Python, compiled and from numba's cache."""
    lines = [f"Starting the numba kernels of {' and '.join(k['formats'])} weights in a fresh Python, loop by loop "
             f"(numba's own start {k['numba_s']:.2f} s apart): {k['compile_s']:.1f} s the first time (numba "
             f"compiles them), {k['cached_s']:.2f} s from numba's cache. Compiling ahead shares the loops out "
             "between processes by their cost (kernels/compiling.py), about their seconds:", "",
             "| loop | format | tile plan | compiled s | cached s | cost |", "|---|---|---|---|---|---|"]
    for r in k["loops"]:
        kernel, dtype, plan = r["loop"]
        lines.append(f"| {kernel.removeprefix('kernels.')} | {dtype} | {plan or ''} | {r['compile_s']:.2f} | "
                     f"{r['cached_s']:.3f} | {r['cost']:.1f} |")
    return lines + [""]


def machine_line(m):
    """The CPU and the kernels each library runs on it: beside every result."""
    line = f"CPU: {m.get('cpu', '?')} ({m.get('cpu_count')} cores; {'/'.join(m.get('simd', [])) or '?'}); "
    line += f"BLAS: {', '.join(m.get('blas', [])) or '?'}; row kernel: {m.get('row_kernel', 'numpy')}"
    if m.get("numba"):
        line += (f" (numba {m['numba']} for {m['numba_cpu']}, {'/'.join(m['numba_simd'])}, "
                 f"{m['numba_threads']} threads" + (f", int4 with {m['int4_madd']}" if "int4_madd" in m else "") + ")")
    return line


def speculative_costs_table(s):
    c = s["draft_over_target"]
    subsets = ", ".join(f"{N} tokens: {v:.2f}" for N, v in c.items() if N != "0")
    lines = [f"### Speculative decoding: draft {s['draft']} -> target {s['target']}", "",
             f"target step {s['target_step_ms']:.1f} ms; a draft token costs c = {c['0']:.2f} of it with the full head"
             + (f" (vocabulary subset heads, `--draft_vocab`: {subsets})" if subsets else "")
             + f"; the draft's two-token catch-up pass (after a step that accepted every draft) costs "
             f"{s['catch_up']['0']:.2f} draft tokens", "",
             "| K | verify K+1 ms | verify / step | break-even acceptance | "
             + " | ".join(f"predicted a={a}" for a in s["alphas"]) + " |",
             "|---|---|---|---|" + "---|" * len(s["alphas"])]
    for k in s["by_K"]:
        even = f"{k['break_even_alpha']:.2f}" if k["break_even_alpha"] is not None else "never"
        lines.append(f"| {k['K']} | {k['verify_ms']:.1f} | {k['verify_over_step']:.2f} | {even} | "
                     + " | ".join(f"{k[f'predicted_a{a}']:.2f}x" for a in s["alphas"]) + " |")
    return lines


def end_to_end_table(s):
    e2e = s["end_to_end"]
    lines = ["", f"Measured end to end (greedy, controlled drafter: the {s['draft']} draft runs, then each proposal "
             f"is the target's own token with probability a, exactly a of them in shuffled blocks of 20, each "
             f"repetition with its own draws). Each speculative "
             f"run is paired with a plain greedy run right before it (plain decoding: {e2e[0]['tok_s']:.1f} tok/s, "
             "median); the speedup is the median of the paired ratios, with their range. Predicted: by the cost "
             "table above at a, and by costs timed right before and after each run at the acceptance rate the run "
             "drew (median); model error: measured / predicted beside - 1, median over the runs:",
             "", "| a | K | draft vocabulary | tok/s | measured speedup (range) | predicted at a | alpha drawn | "
             "predicted beside | model error | tokens / target pass |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in e2e[1:]:
        vocab = "all" if not e["draft_vocab"] else f"{e['draft_vocab']}"
        lines.append(f"| {e['a']} | {e['K']} | {vocab} | {e['tok_s']:.1f} | {e['speedup']:.2f}x "
                     f"({e['speedup_min']:.2f}-{e['speedup_max']:.2f}) | "
                     f"{e['predicted']:.2f}x | {e['alpha']:.2f} | {e['predicted_beside']:.2f}x | "
                     f"{e['model_error']:+.0%} | {e['tokens_per_target_pass']:.2f} |")
    if s.get("coverage"):
        Ns = [k for k in s["coverage"][0] if k not in ("text", "tokens")]
        lines += ["", "Tokens of real text a vocabulary-subset draft cannot propose (id >= N, not earlier in the "
                  "text): the most acceptance the subset can cost", "",
                  "| text | tokens | " + " | ".join(f"N = {N}" for N in Ns) + " |", "|---|---|" + "---|" * len(Ns)]
        lines += [f"| {c['text']} | {c['tokens']} | " + " | ".join(f"{c[N]:.1%}" for N in Ns) + " |"
                  for c in s["coverage"]]
    return lines


def llamacpp_lines(results):
    """llama.cpp on the same weights at batch 1, timed in the same turns as ours, and a line
    for each of its formats that crashed or refused (each ran in a process of its own)."""
    peers = [f["llama_cpp"] for f in results["formats"] if f.get("llama_cpp")]
    failed = [f"- llama.cpp {x['format']} ({x['size']}), {x['while']}: {x['why']}"
              for p in peers for x in p.get("failed", [])]
    if failed:
        failed = ["", "llama.cpp formats that did not run to the end (the rest of the run went on):", ""] + failed
    if not any(p.get("decode") for p in peers):
        return [f"\nllama.cpp peer: skipped ({p['skipped']})" for p in peers[:1] if "skipped" in p] + failed
    lines = ["", f"llama.cpp on the same weights written as GGUF ({peers[0]['version']}; {peers[0]['threads']} "
             "threads), batch 1, timed in the same turns as ours:", "",
             "| model | ours | tok/s | llama.cpp | tok/s (min-max) | ours / llama.cpp (range of paired ratios) |",
             "|---|---|---|---|---|---|"]
    ours = {(d["size"], d["dtype"]): d for f in results["formats"] for d in f["decode"] if d["batch"] == 1}
    lines += [f"| {d['size']} | {d['ours']} | {ours[d['size'], d['ours']]['decode_tok_s']:.1f} | {d['format']} | "
              f"{d['decode_tok_s']:.1f} ({d['decode_tok_s_min']:.1f}-{d['decode_tok_s_max']:.1f}) | "
              f"{d['ours_over_peer']:.2f}x ({d['ours_over_peer_min']:.2f}-{d['ours_over_peer_max']:.2f}) |"
              for p in peers for d in p["decode"]]
    lines += failed
    lines += ["", "The GGUF files, and llama.cpp's logits for one prompt against ours in float32 (F32 checks that "
              "both run the same model):", "",
              "| model | format | MiB | written in s | logits max error, of the largest | same top token |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {x['size']} | {x['format']} | {x['mib']:.0f} | {x['write_s']:.1f} | "
              f"{x['logits_max_rel_error']:.2%} | {'yes' if x['same_top1'] else 'no'} |"
              for p in peers for x in p["files"]]
    return lines


def formats_tables(results):
    """Weight formats against float32: speed, size, memory, and how far the output moves."""
    lines = ["", "### Weight formats (weight_formats.py): tokens/s against float32, in turns within one run", "",
             "| model | batch | format | decode tok/s (min-max) | over float32 (range of paired ratios) |",
             "|---|---|---|---|---|"]
    for f in results["formats"]:
        lines += [f"| {d['size']} | {d['batch']} | {d['dtype']} | {d['decode_tok_s']:.1f} "
                  f"({d['decode_tok_s_min']:.1f}-{d['decode_tok_s_max']:.1f}) | {d['over_float32']:.2f}x "
                  f"({d['over_float32_min']:.2f}-{d['over_float32_max']:.2f}) |" for d in f["decode"]]
    lines += llamacpp_lines(results)
    lines += ["", "Stored matrices, conversion from float32, and a fresh process that loads the model in the format "
              "(RssAnon: the memory the process itself holds; random weights keep a float32 wte besides):", "",
              "| model | weights | format | matrices MiB | convert s | load s | RssAnon MiB | peak RSS MiB |",
              "|---|---|---|---|---|---|---|---|"]
    for f in results["formats"]:
        for x in f["formats"]:
            mem = (f"{x['load_s']:.1f} | {x['rss_anon_mib']:.0f} | {x['peak_rss_mib']:.0f}" if "load_s" in x
                   else f"{x.get('error', '-')} | - | -")
            lines.append(f"| {x['size']} | {x.get('weights', '-')} | {x['dtype']} | {x['stored_mib']:.0f} | "
                         f"{x['convert_s']:.2f} | {mem} |")
    lines += ["", "The NumPy fallback, one token's matrices: float32 gemvs against int8 widened by NumPy block by "
              "block (256 KiB in L2), then a gemv per block:", ""]
    lines += [f"- {f['decode'][0]['size']}: float32 {f['numpy_fallback']['float32_gemv_s'] * 1e3:.1f} ms, int8 "
              f"{f['numpy_fallback']['int8_widened_gemv_s'] * 1e3:.1f} ms: "
              f"{f['numpy_fallback']['int8_over_float32']:.2f}x" for f in results["formats"]]
    rows = [(x["size"], x) for f in results["formats"] for x in f["formats"] if x["dtype"] != "float32"]
    rows += [("test model (tests/fixtures)", dict(x, dtype=d))
             for d, x in results.get("formats_test_model", {}).items()]
    lines += ["", "How far each format moves the float32 model's output: the logits of one pass (max error, and "
              "relative to the largest logit), the top token at each position, and greedy text from 4 prompts "
              "(tokens before the first difference, mean; positions that agree). Random weights cannot say how a "
              "trained GPT-2 quantizes:", "",
              "| model | format | logits max error (relative) | top-1 agreement | greedy: same tokens before the first "
              "difference | greedy positions agreeing |", "|---|---|---|---|---|---|"]
    lines += [f"| {size} | {x['dtype']} | {x['logits_max_abs_error']:.4f} ({x['logits_max_rel_error']:.2%}) | "
              f"{x['top1_agreement']:.1%} of {x['positions']} | {x['greedy_common_prefix']:.1f} of "
              f"{x['greedy_tokens']} | {x['greedy_agreement']:.1%} |" for size, x in rows]
    return lines


def self_draft_tables(s):
    lines = ["", f"### The self-draft: target {s['target']} drafted by its own {s['dtype']} copy "
             f"(converted in {s['convert_s']:.1f} s)"]
    lines += speculative_costs_table(s)[1:] + end_to_end_table(dict(s, coverage=None))
    # runs before natural_alpha kept drafts accepted of drafts made, which count untested drafts as rejected
    got = (f"alpha {s['natural_alpha']:.2f}" if "natural_alpha" in s
           else f"{s['natural_acceptance']:.1%} of drafts accepted")
    lines += ["", f"The acceptance the {s['dtype']} copy really gets on greedy text of these "
              f"{s['weights']} weights (K = {s['K']}): {got}"
              + (" (random weights: not what a trained GPT-2 gets)." if s["weights"] == "random" else ".")]
    return lines


def breakdown_table(b):
    lines = ["", f"### Where a speculative step's time goes: draft {b['draft']} -> target {b['target']}", "",
             "Controlled drafter, greedy; per decode step after the first, against c, the draft's catch-up pass "
             "and verify(K+1) timed right before and after each run (drafting predicted at the run's alpha):", "",
             "| a | K | target step ms | c | catch-up | verify / step | speculative step ms | "
             "drafting ms (predicted) | verifying ms (predicted) | rest ms | tokens / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['a']} | {r['K']} | {r['target_step_ms']:.1f} | {r['c']:.3f} | {r['catch_up']:.2f} | "
              f"{r['verify_over_step']:.2f} | "
              f"{r['step_ms']:.1f} | {r['draft_ms']:.1f} ({r['draft_ms_predicted']:.1f}) | "
              f"{r['verify_ms']:.1f} ({r['verify_ms_predicted']:.1f}) | "
              f"{r['step_ms'] - r['draft_ms'] - r['verify_ms']:.1f} | {r['tokens_per_step']:.2f} |" for r in b["rows"]]
    return lines


def serving_table(rows):
    lines = ["", f"### Serving: static vs continuous batching ({rows[0]['requests']} requests, 8-256 new tokens, "
             "log-uniform)", "",
             "| model | max_batch | arrivals | batching | tok/s | TTFT p50 / p95 s | request done p50 / p95 s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['max_batch']} | {r['arrivals']} | {r['policy']} | {r['tokens_per_s']:.1f} | "
              f"{r['ttft_s_p50']:.2f} / {r['ttft_s_p95']:.2f} | {r['e2e_s_p50']:.2f} / {r['e2e_s_p95']:.2f} |"
              for r in rows]
    return lines


def prefix_table(rows):
    lines = ["", "### The prefix cache: on (--prefix_cache_mib default), off (0: only the choices of one prompt "
             "share it), none (no sharing, as before the cache); max_batch 8, all requests at once", "",
             "| model | workload | requests | way | prompt tokens copied | tok/s | over off | TTFT p50 / p95 s | "
             "p50 off / this | all choices' first token s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over = f"{r['tok_s_over_off']:.2f}x" if "tok_s_over_off" in r else "-"
        faster = f"{r['ttft_p50_off_over']:.1f}x" if "ttft_p50_off_over" in r else "-"
        first = f"{r['all_choices_first_s']:.2f}" + (f" ({r['all_first_none_over']:.1f}x faster than none)"
                                                      if "all_first_none_over" in r else "")
        lines.append(f"| {r['size']} | {r['workload']} | {r['requests']} | {r['way']} | {r['hit_rate']:.0%} | "
                     f"{r['tokens_per_s']:.1f} | {over} | {r['ttft_s_p50']:.2f} / {r['ttft_s_p95']:.2f} | {faster} | "
                     f"{first} |")
    return lines


def chunked_table(runs):
    lines = ["", f"### Chunked prefill: 7 streams ({runs[0]['stream_tokens']} new tokens each) while "
             f"{runs[0]['long_len']}-token prompts arrive (Poisson), prompts whole vs chunked (--max_prefill_tokens), "
             "and the streams alone (quiet); max_batch 8, in turns", "",
             "| model | way | streams' inter-token p50 / p99 / max ms | p99 over quiet p50 | long prompts' TTFT s "
             "| TTFT over whole | tok/s | over whole |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["rows"]:
            ttft = f"{r['ttft_s']:.2f}" if "ttft_s" in r else "-"
            over = {key: "-" if key not in r else " / ".join(f"{x:.2f}" for x in r[key])
                    for key in ("ttft_over_whole", "tokens_per_s_over_whole")}
            lines.append(f"| {run['size']} | {r['way']} | {r['itl_ms_p50']:.0f} / {r['itl_ms_p99']:.0f} / "
                         f"{r['itl_ms_max']:.0f} | "
                         f"{r['p99_over_quiet_p50']:.1f}x | {ttft} | {over['ttft_over_whole']} | "
                         f"{r['tokens_per_s']:.1f} | {over['tokens_per_s_over_whole']} |")
        lines.append(f"| {run['size']} | (one long prompt's prefill alone: {run['prefill_s']:.2f} s; arrivals at "
                     f"{', '.join(f'{t:.1f}' for t in run['long_at_s'])} s) |||||||")
    return lines


def http_table(h):
    many = [r for r in h["runs"] if "one request" not in r["path"]]
    lone = [r for r in h["runs"] if "one request" in r["path"]]
    lines = [f"\n### The HTTP path: server.py against in-process serve() (GPT-2 {h['size']}, "
             f"{h['n_requests']} requests at once, max_batch {h['max_batch']}, in turns; clients in a process "
             "of their own)\n",
             "| rep | path | tokens/s | TTFT p50 / p95 s | HTTP / in-process throughput | HTTP - in-process p50 TTFT "
             "| requests paused |", "|---|---|---|---|---|---|---|"]
    for inproc, http in zip(many[::2], many[1::2]):
        for r in (inproc, http):
            ratio = f"{http['tokens_per_s'] / inproc['tokens_per_s']:.3f}x" if r is http else ""
            delta = f"{1e3 * (http['ttft_s_p50'] - inproc['ttft_s_p50']):+.0f} ms" if r is http else ""
            lines.append(f"| {r['rep']} | {r['path']} | {r['tokens_per_s']:.1f} | {r['ttft_s_p50']:.2f} / "
                         f"{r['ttft_s_p95']:.2f} | {ratio} | {delta} | {r.get('preemptions', '')} |")
    if lone:
        gaps = [1e3 * (http["ttft_s_p50"] - inproc["ttft_s_p50"]) for inproc, http in zip(lone[::2], lone[1::2])]
        lines.append(f"\nOne request on an idle server, {len(gaps)} times in turns: TTFT in-process "
                     f"{1e3 * statistics.median([r['ttft_s_p50'] for r in lone[::2]]):.1f} ms, over HTTP "
                     f"{1e3 * statistics.median([r['ttft_s_p50'] for r in lone[1::2]]):.1f} ms (median); HTTP adds "
                     f"{statistics.median(gaps):+.1f} ms (range {min(gaps):+.1f} to {max(gaps):+.1f}).")
    if h.get("latency"):
        lat = h["latency"]
        lines.append(f"\nKept-alive connections: GET /health p50 {1e3 * lat['health_s_p50']:.2f} ms; the official "
                     f"openai client's 1-token completion p50 {1e3 * lat['openai_s_p50']:.1f} ms, the same request "
                     f"in-process {1e3 * lat['engine_s_p50']:.1f} ms.")
    if h.get("hostile"):
        lines += ["\n8 clients alone, then beside 8 streams that are never read and 200 connections that send "
                  "nothing (in turns):\n", "| rep | others | tokens/s | TTFT p50 s | beside / alone | stalled streams "
                  "cut off after | requests paused | server RSS before -> after MB |",
                  "|---|---|---|---|---|---|---|---|"]
        for alone, beside in zip(h["hostile"][::2], h["hostile"][1::2]):
            for r in (alone, beside):
                extra = (f"{beside['tokens_per_s'] / alone['tokens_per_s']:.3f}x | {r['stalled_held_s']:.1f} s"
                         if r is beside else " | ")
                lines.append(f"| {r['rep']} | {'8 stalled + 200 idle' if r['hostile'] else 'none'} | "
                             f"{r['tokens_per_s']:.1f} | {r['ttft_s_p50']:.2f} | {extra} | "
                             f"{r.get('preemptions', '')} | {r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} |")
    if h.get("fairness"):
        lines += [f"\nTwo fast clients (100-token streams, back to back, {h['fairness']['seconds']:.0f} s) alone, then "
                  "beside 8 slow readers (1,500 tokens each through a 4 KiB receive buffer, 2-8 s pauses every "
                  "20 KB), in turns; speculative, K = 3, max_batch 4, the draft the model's first block (issue #57):\n",
                  "| rep | slow readers | fast tokens/s | latency p50 / max s | beside / alone tokens/s | slowest "
                  "beside / alone | requests paused |", "|---|---|---|---|---|---|---|"]
        for alone, beside in zip(h["fairness"]["runs"][::2], h["fairness"]["runs"][1::2]):
            for r in (alone, beside):
                ratios = (f"{beside['tokens_per_s'] / alone['tokens_per_s']:.2f}x | "
                          f"{beside['latency_s_max'] / alone['latency_s_max']:.2f}x" if r is beside else " | ")
                lines.append(f"| {r['rep']} | {r['slow_readers']} | {r['tokens_per_s']:.1f} | "
                             f"{r['latency_s_p50']:.2f} / {r['latency_s_max']:.2f} | {ratios} | {r['preemptions']} |")
    return lines


def beams_table(b):
    lines = [f"\n### Beam search: {b['num_beams']} beams against greedy decoding (GPT-2 {b['size']}, "
             f"{b['prompt_len']}-token prompt, {b['n_tokens']} new tokens, in turns)\n",
             "| rep | beam step ms | greedy step ms | beam / greedy | beam search tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {r['beam_step_ms']:.1f} | {r['greedy_step_ms']:.1f} | {r['beam_over_greedy']:.2f} | "
              f"{r['beam_tok_s']:.1f} |" for i, r in enumerate(b["runs"])]
    return lines


def markdown(results):
    """The tables the README quotes."""
    m = results["machine"]
    lines = [f"Machine: {m['cpu_count']} cores, {m['platform']}, NumPy {m['numpy']}; one-row matmul bandwidth "
             f"{m['bandwidth_GBs']:.1f} GB/s at the start (each decode row measures its own before each run).",
             machine_line(m) + ".",
             f"Command: `{results['command']}`", ""]
    for size, r in results["models"].items():
        lines += decode_tables(size, r)
    if "rows" in results:
        lines += rows_table(results["rows"])
    if results.get("kernels"):
        lines += kernels_table(results["kernels"])
    if results.get("kernel_start"):
        lines += kernel_start_table(results["kernel_start"])
    if "formats" in results:
        lines += formats_tables(results)
    if "ceiling" in results:
        lines += ceiling_tables(results["ceiling"])
    if "speculative" in results:
        lines += speculative_costs_table(results["speculative"]) + end_to_end_table(results["speculative"])
    for s in results.get("speculative_beside", []):  # the same command with another draft format
        lines += [""] + speculative_costs_table(s) + end_to_end_table(s)
    if "self_draft" in results:
        lines += self_draft_tables(results["self_draft"])
    if "breakdown" in results:
        lines += breakdown_table(results["breakdown"])
    if "serving" in results:
        lines += serving_table(results["serving"])
    if "prefix" in results:
        lines += prefix_table(results["prefix"])
    if "chunked" in results:
        lines += chunked_table(results["chunked"])
    if "http" in results:
        lines += http_table(results["http"])
    if "beams" in results:
        lines += beams_table(results["beams"])
    lines.append(f"\nPeak RSS {results['peak_rss_mib']:.0f} MiB.")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench import plots
    with open(sys.argv[1]) as f:
        results = json.load(f)
    if "machine" not in results:
        sys.exit(f"{sys.argv[1]} is a GPU run: python -m bench.gpu {sys.argv[1]}")
    print(markdown(results))
    print(plots.plots(results, sys.argv[2] if len(sys.argv) > 2 else "img"))
