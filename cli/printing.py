"""One decoder's run as main.py prints it: the text as it streams, then its numbers.

`decode` runs a whole batch (gpt2's plain decoding or speculative decoding) and prints
its texts, tokens/s and, for speculative decoding, its acceptance; `serve` runs the
requests through the scheduler (continuous batching) and prints each as it finishes.
"""
import codecs
import sys

from tqdm import tqdm

import batching
import cost_model
from cli import flags
from kernels import rowwise
from serving import prefix_cache, scheduler

GREEN, RESET = "\033[32m", "\033[0m"


def streamer(encoder, colour, write=sys.stdout.write):
    """(show, finish) for one row: show(seq, token, accepted) writes a token's text as
    soon as its UTF-8 bytes are complete, finish() writes whatever is left. Invalid bytes
    become U+FFFD exactly as encoder.decode does, so the stream adds up to the final
    text. Accepted draft tokens are written in colour on a terminal."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def show(seq, token, accepted=False, logits=None):
        text = utf8.decode(encoder.decode_single_token_bytes(token))
        if text:
            write(f"{GREEN}{text}{RESET}" if accepted and colour else text)
            sys.stdout.flush()

    def finish():
        write(utf8.decode(b"", final=True))
    return show, finish


def decode(title, generate, encoder, prompts, args):
    """Print a banner, run generate(callback) (streaming if asked), then the texts and speed."""
    print(f"\n=== {title} ===")
    show, finish = streamer(encoder, sys.stdout.isatty()) if args.stream else (None, None)
    if show:
        print(prompts[0], end="")
    compiled_before = rowwise.seconds_compiling()
    out, stats = generate(show)
    texts = [encoder.decode(o) for o in out]
    if show:
        finish()
        print()
    else:
        for p, t in zip(prompts, texts):
            print(f"{p}{t}" if len(prompts) == 1 else f"--- {p!r}\n{p}{t}")
    print(f"{stats.n_tokens} tokens in {stats.seconds:.2f}s = {stats.tokens_per_s:.1f} tokens/s "
          f"(first token after {stats.ttft_s * 1e3:.0f} ms; KV cache {stats.kv_cache_bytes / 2**20:.1f} MiB)")
    say_compile_time(compiled_before)
    if stats.target_passes:
        alpha = cost_model.estimate_alpha(stats.accepted, stats.rejected)
        print(f"acceptance alpha {alpha:.2f} (the papers': tests passed of tests made); drafts accepted "
              f"{stats.acceptance_rate:.1%} (by draft position: {stats.acceptance_by_position}), "
              f"{stats.tokens_per_target_pass:.2f} tokens per target pass, "
              f"time drafting {stats.draft_s:.2f}s / verifying {stats.verify_s:.2f}s")
    return {"texts": texts, "tokens": out, "tokens_per_s": stats.tokens_per_s, "stats": stats}


def say_compile_time(compiled_before):
    """The times above include a kernel's first compile where this run was the first to use a tile size."""
    seconds = rowwise.seconds_compiling() - compiled_before
    if seconds > 0.5:
        print(f"(of that, {seconds:.1f}s compiling the kernels' loops this run used first: once a machine, later runs "
              "load them from numba's cache)")


def serve(title, decoder, reqs, encoder, args):
    """Serve the requests with continuous batching, printing each one as it finishes."""
    print(f"\n=== {title}, continuous batching of up to {args.max_batch} ===")
    for note in (flags.prefix_cache_note(args), flags.chunked_prefill_note(args)):
        if note:
            print(note)
    compiled_before = rowwise.seconds_compiling()
    out, finished, errors = [None] * len(reqs), [], []
    with tqdm(total=len(reqs), unit="request", leave=False) as bar:
        prefix, stats = prefix_cache.new_prefix_cache(args.prefix_cache_mib << 20), batching.Stats()
        for e in scheduler.serve(reqs, decoder, args.max_batch, prefix=prefix,
                                 max_prefill_tokens=flags.prefill_budget(args), stats=stats):
            if e.kind == "token":
                continue
            if e.kind == "error":
                errors.append(e.error)
                bar.write(f"--- request {e.index}: error: {e.error}")
            else:
                out[e.index] = e.tokens
                finished.append(e)
                m = e.metrics
                bar.write(f"--- request {e.index}: {m['n_tokens']} tokens; queued {m['queue_s']:.2f}s, first token "
                          f"after {m['ttft_s']:.2f}s, inter-token p50 {m['itl_ms_p50']:.0f} ms / p95 "
                          f"{m['itl_ms_p95']:.0f} ms, done after {m['e2e_s']:.2f}s\n"
                          f"{encoder.decode(list(reqs[e.index].prompt))}{encoder.decode(e.tokens)}")
            bar.update()
    s = scheduler.summarize(finished)
    if finished:
        print(f"{s['requests']} requests, {s['tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_s']:.1f} "
              f"tokens/s; first token p50 {s['ttft_s_p50']:.2f}s / p95 {s['ttft_s_p95']:.2f}s, "
              f"request done p50 {s['e2e_s_p50']:.2f}s / p95 {s['e2e_s_p95']:.2f}s; between steps (what a stream in "
              f"flight waits for its next token) p50 {stats.itl_ms(50):.0f} ms / p99 {stats.itl_ms(99):.0f} ms")
    if prefix["hits"]:
        print(f"prefix cache: {prefix['hits']} of {prefix['queries']} prompt tokens "
              f"({prefix['hits'] / prefix['queries']:.0%}) were computed already, and copied")
    say_compile_time(compiled_before)
    if errors:
        raise ValueError(f"{len(errors)} of {len(reqs)} requests were refused; the first: {errors[0]}")
    return {"texts": [encoder.decode(o) if o is not None else None for o in out], "tokens": out,
            "tokens_per_s": s["tokens_per_s"]}
