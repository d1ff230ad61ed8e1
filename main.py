"""Generate text with GPT-2 two ways and compare: plain autoregressive decoding with
the target model, and speculative decoding with a draft model (or prompt lookup).

    python main.py --draft_model_size 124M --target_model_size 355M --K 4

Downloads whatever is missing into --models_dir, then prints each decoder's text,
time and tokens/s, and for speculative decoding its acceptance (alpha), tokens per
target pass and speedup. With --temperature 0 both decoders are greedy and must
print the same text: speculative decoding changes the speed, never the output.

Penalties count the text so far: --repetition_penalty every token of it, prompt
included (as transformers does); --presence_penalty and --frequency_penalty the
generated tokens only (as the OpenAI API and vLLM do), unless --penalize_prompt.
"""
import argparse
import sys
import time

import batching
import beam_search
import kv_cache
import sampling
import speculative
import utils
from cli import flags, loading, printing, timing, warm
from serving import scheduler

DEFAULT_PROMPT = "Alan Turing theorized that computers would one day become"
def parse_args(argv=None):
    ap = flags.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", action="append", help="a prompt ('' = unconditional); repeat the flag for a batch")
    ap.add_argument("--prompts_file", help="a file with one prompt per line (a batch; blank lines are skipped)")
    ap.add_argument("--n_tokens_to_generate", type=int, default=40, help="new tokens per prompt")
    flags.add_decoder_flags(ap, modes=("autoregressive", "speculative", "both"), default=None)  # None: both, or beams
    ap.add_argument("--temperature", type=float, default=0.8, help=f"0 (or below {sampling.GREEDY_BELOW}) = greedy")
    ap.add_argument("--top_k", type=int, default=0, help="0 = off")
    ap.add_argument("--top_p", type=float, default=0.9, help="in (0, 1]; 1 = off")
    ap.add_argument("--min_p", type=float, default=0.0, help="in [0, 1); 0 = off")
    ap.add_argument("--presence_penalty", type=float, default=0.0,
                    help="in [-2, 2]: logit -= p * (count > 0), counting generated tokens")
    ap.add_argument("--frequency_penalty", type=float, default=0.0,
                    help="in [-2, 2]: logit -= f * count, counting generated tokens")
    ap.add_argument("--repetition_penalty", type=float, default=1.0,
                    help="in [0.01, 100]; 1 = off: divides positive logits and multiplies negative ones "
                         "of every token in the text, prompt included (transformers)")
    ap.add_argument("--penalize_prompt", action="store_true",
                    help="presence and frequency penalties count the prompt's tokens too")
    ap.add_argument("--seed", type=int, default=0, help="same seed, same text; prompt i of a batch uses seed + i")
    ap.add_argument("--ignore_eos", action="store_true", help="keep going past <|endoftext|>")
    ap.add_argument("--no_kv_cache", action="store_true", help="recompute the whole window every token")
    ap.add_argument("--stream", action="store_true",
                    help="print tokens as they come (one prompt; on a terminal, accepted drafts in green)")
    ap.add_argument("--max_batch", type=int,
                    help="serve the prompts with continuous batching, at most this many at once, and print each "
                         "request with its timings as it finishes")
    flags.add_prefix_cache_flag(ap)
    flags.add_prefill_flag(ap)
    ap.add_argument("--num_beams", type=int, default=1, help="> 1: beam search with this many beams (deterministic)")
    ap.add_argument("--length_penalty", type=float, default=1.0,
                    help="beam search: a finished text scores sum(log p) / length ** this (> 0 favours long texts)")
    ap.add_argument("--early_stopping", choices=["True", "False", "never"], default="False",
                    help="beam search stops: True once num_beams texts are done, False by a heuristic, never: exact")
    ap.add_argument("--num_return_sequences", type=int, default=1, help="beam search: texts printed per prompt")
    ap.add_argument("--no_repeat_ngram_size", type=int, default=0,
                    help="every decoder: no n-gram of this size appears twice in a text, prompt included (0 = off)")
    flags.add_model_flags(ap)
    return ap.parse_args(argv)


def check_args(args):
    """Everything that can be checked before a model is loaded: (settings, config, prompts)."""
    if args.n_tokens_to_generate < 1:
        raise ValueError(f"--n_tokens_to_generate must be >= 1, got {args.n_tokens_to_generate}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    flags.check_dtypes(args)
    settings = sampling.SamplingSettings(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, penalize_prompt=args.penalize_prompt,
        no_repeat_ngram_size=args.no_repeat_ngram_size)
    config = speculative.SpeculativeConfig(K=args.K, adaptive=args.adaptive_K, K_max=args.K_max,
                                           draft_vocab=args.draft_vocab)
    speculative.check(config)
    prompts = read_prompts(args)
    if args.stream and len(prompts) > 1:
        raise ValueError("--stream shows one prompt at a time: pass a single --prompt")
    if args.max_batch is not None:
        if args.max_batch < 1:
            raise ValueError(f"--max_batch must be >= 1, got {args.max_batch}")
        if args.stream or args.no_kv_cache:
            raise ValueError("--max_batch serves with the KV cache and prints whole requests: "
                             "leave out --stream and --no_kv_cache")
    flags.check_prefix_cache(args)
    flags.check_prefill(args)
    beam_only = changed(args, ONLY_FOR_BEAMS)
    if args.num_beams == 1 and beam_only:
        raise ValueError(f"{', '.join(beam_only)}: only beam search reads them: add --num_beams N (N > 1), "
                         "or leave them out")
    return settings, config, prompts


def read_prompts(args):
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not text
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts_file {args.prompts_file}: {e}")
        if not lines:
            raise ValueError(f"--prompts_file {args.prompts_file} holds no prompt (only blank lines)")
        prompts += lines
    return prompts if args.prompt is not None or args.prompts_file else [DEFAULT_PROMPT]


def tokenize(encoder, prompts, n_ctx):
    """Token ids of each prompt; an empty prompt starts from <|endoftext|>, as OpenAI's
    unconditional GPT-2 samples do. A prompt longer than the window gets a note."""
    ids = [encoder.encode(p, allowed_special={utils.EOT_TOKEN}) or [encoder.eot_token] for p in prompts]
    for i in ids:
        if len(i) > n_ctx:
            seen = len(i) - kv_cache.window_start(len(i), n_ctx)
            print(f"note: a prompt is {len(i)} tokens, more than GPT-2's {n_ctx}-token window: the model sees "
                  f"its last {seen} (the window restarts: README section 3)")
    return ids


# the flags only sampling, speculative decoding and serving read (beam search draws nothing, drafts
# nothing, and runs its prompts together), and those only beam search reads: set for the other
# decoder, each would change nothing
NOT_FOR_BEAMS = ("temperature", "top_k", "top_p", "min_p", "seed", "stream", "max_batch", "no_kv_cache",
                 "presence_penalty", "frequency_penalty", "penalize_prompt", "prefix_cache_mib", "max_prefill_tokens",
                 *flags.DRAFT_FLAGS)
ONLY_FOR_BEAMS = ("length_penalty", "early_stopping", "num_return_sequences")


def changed(args, names):
    """The flags of these names set to other than their defaults."""
    defaults = parse_args([])
    return [f"--{name}" for name in names if getattr(args, name) != getattr(defaults, name)]


def beam_settings(args):
    """--num_beams > 1: the beam search settings, after refusing what beam search cannot combine with."""
    clash = ["--mode speculative/both"] * (args.mode not in (None, "autoregressive")) + changed(args, NOT_FOR_BEAMS)
    if clash:
        raise ValueError(f"--num_beams {args.num_beams} runs beam search alone: leave out {', '.join(clash)}")
    beams = beam_search.BeamSettings(
        num_beams=args.num_beams, length_penalty=args.length_penalty,
        early_stopping={"True": True, "False": False}.get(args.early_stopping, args.early_stopping),
        num_return_sequences=args.num_return_sequences, no_repeat_ngram_size=args.no_repeat_ngram_size,
        repetition_penalty=args.repetition_penalty)
    beam_search.check(beams)
    return beams


def run_beams(args, beams, prompts):
    """Beam search over the prompts together; each prompt's best texts with their scores."""
    args.mode = "autoregressive"
    with loading.compile_ahead(args, [(args.dtype, loading.EVERY_TILE)]):
        encoder, target, _ = loading.load_models(args)
    ids = tokenize(encoder, prompts, target[1]["n_ctx"])
    beam_search.check_window(target[1]["n_ctx"], ids, args.n_tokens_to_generate)
    loading.warm(target, loading.EVERY_TILE)  # beams are rows of every count
    print(f"\n=== beam search: GPT-2 {named(args.target_model_size, args.dtype)}, {beams.num_beams} beams ===")
    start = time.perf_counter()
    results = beam_search.beam_search(ids, target, args.n_tokens_to_generate, beams,
                                      None if args.ignore_eos else encoder.eot_token)
    seconds = time.perf_counter() - start
    for prompt, hyps in zip(prompts, results):
        for rank, (tokens, score) in enumerate(hyps):
            print(f"--- {prompt!r} #{rank + 1}, score {score:.3f}\n{prompt}{encoder.decode(tokens)}")
    print(f"{sum(len(t) for hyps in results for t, _ in hyps[:1])} tokens (best texts) in {seconds:.2f}s")
    return {"beam_search": {"results": results, "texts": [[encoder.decode(t) for t, _ in h] for h in results]}}


def named(size, dtype):
    """ "355M", or "355M int8" for weights stored in another format than float32."""
    return size if dtype == "float32" else f"{size} {dtype}"


def run(args):
    settings, config, prompts = check_args(args)
    if args.num_beams != 1:
        return run_beams(args, beam_settings(args), prompts)
    args.mode = args.mode or "both"
    if note := flags.draft_flags_note(args, parse_args([])):
        print(note)
    encoder, hparams = loading.tokenizer(args)
    speculative.check(config, hparams)  # now with the vocabulary --draft_vocab must fit in
    n_ctx = hparams["n_ctx"]
    ids = tokenize(encoder, prompts, n_ctx)
    with warm.compile_ahead(args, config, ids):  # while the models load
        _, target, drafter = loading.load_models(args)
    warm.warm_up(args, config, target, drafter, ids)
    eos = None if args.ignore_eos else encoder.eot_token
    reqs = batching.requests(ids, args.n_tokens_to_generate, settings, args.seed, eos)
    use_cache = not args.no_kv_cache
    runs = {}  # decoder: (title, generate(callback), the decoder as the scheduler runs it)
    if args.mode in ("autoregressive", "both"):
        runs["autoregressive"] = (f"autoregressive: GPT-2 {named(args.target_model_size, args.dtype)}",
                                  lambda cb: batching.generate(reqs, target, use_cache, cb),
                                  lambda: scheduler.autoregressive(target))
    if args.mode in ("speculative", "both"):
        if config.K >= n_ctx:
            print(f"note: --K {config.K} is more drafts than GPT-2's {n_ctx}-token window holds: "
                  "each step drafts at most what fits before the window restarts")
        draft = named(args.draft_model_size, flags.draft_dtype(args))
        who = f"draft {draft}" if args.drafter == "model" else "prompt lookup"
        runs["speculative"] = (f"speculative: target {named(args.target_model_size, args.dtype)}, {who}, K={config.K}"
                               f"{' (adaptive)' if config.adaptive else ''}",
                               lambda cb: speculative.speculative_generate(reqs, target, drafter, config, use_cache,
                                                                           cb),
                               lambda: scheduler.speculative_decoder(target, drafter, config))
    results = {}
    for name, (title, generate, decoder) in runs.items():
        results[name] = (printing.serve(title, decoder(), reqs, encoder, args) if args.max_batch
                         else printing.decode(title, generate, encoder, prompts, args))
    if "speculative" in results and not args.max_batch:
        resolved = speculative.resolve(config, target, drafter.model)
        timing.advise_K(results["speculative"]["stats"], target, drafter, resolved,
                        args.draft_model_size == args.target_model_size)
    if len(results) == 2:
        ar, sp = results["autoregressive"], results["speculative"]
        print(f"\nspeedup of speculative over autoregressive: {sp['tokens_per_s'] / ar['tokens_per_s']:.2f}x")
        if settings.greedy:
            print("greedy texts identical: " + ("yes" if ar["tokens"] == sp["tokens"] else "NO (this is a bug)"))
        else:  # exact means the same distribution, not the same draws
            print("sampled: the two texts are different draws from the same distribution "
                  "(--temperature 0: both the target's greedy text, token for token)")
    return results


def main(argv=None):
    try:
        run(parse_args(argv))
    except sampling.BadSetting as e:
        print(f"error: --{flags.FLAG_OF.get(e.name, e.name)} {e.problem}", file=sys.stderr)
        return 2
    except (utils.LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
