"""Generate text with GPT-2 two ways and compare: plain autoregressive decoding with
the target model, and speculative decoding with a draft model (or prompt lookup).

    python main.py --draft_model_size 124M --target_model_size 355M --K 4

Downloads whatever is missing into --models_dir, then prints each decoder's text,
time and tokens/s, and for speculative decoding its acceptance rate, tokens per
target pass and speedup. With --temperature 0 both decoders are greedy and must
print the same text: speculative decoding changes the speed, never the output.
"""
import argparse
import sys

import numpy as np

import gpt2
import sampling
import speculative
import utils

DEFAULT_PROMPT = "Alan Turing theorized that computers would one day become"
GREEN, RESET = "\033[32m", "\033[0m"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", action="append", help="a prompt; repeat the flag for a batch")
    ap.add_argument("--prompts_file", help="a file with one prompt per line (a batch)")
    ap.add_argument("--n_tokens_to_generate", type=int, default=40)
    ap.add_argument("--target_model_size", default="355M", help=f"one of {', '.join(utils.MODEL_SIZES)}")
    ap.add_argument("--draft_model_size", default="124M", help=f"one of {', '.join(utils.MODEL_SIZES)}")
    ap.add_argument("--mode", choices=["autoregressive", "speculative", "both"], default="both")
    ap.add_argument("--K", type=int, default=4, help="draft tokens per target pass")
    ap.add_argument("--adaptive_K", action="store_true",
                    help="choose K each step from the measured acceptance and costs (up to --K_max)")
    ap.add_argument("--K_max", type=int, help="the bound for --adaptive_K (default: max(K, 7))")
    ap.add_argument("--drafter", choices=["model", "prompt_lookup"], default="model")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (deterministic)")
    ap.add_argument("--top_k", type=float, default=0, help="0 = off")
    ap.add_argument("--top_p", type=float, default=0.9)
    ap.add_argument("--min_p", type=float, default=0.0)
    ap.add_argument("--presence_penalty", type=float, default=0.0)
    ap.add_argument("--frequency_penalty", type=float, default=0.0)
    ap.add_argument("--repetition_penalty", type=float, default=1.0)
    ap.add_argument("--penalize_prompt", action="store_true", help="penalties also count the prompt's tokens")
    ap.add_argument("--seed", type=int, default=0, help="same seed, same text")
    ap.add_argument("--ignore_eos", action="store_true", help="keep going past <|endoftext|>")
    ap.add_argument("--no_kv_cache", action="store_true", help="recompute the whole window every token")
    ap.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                    help="cupy: the same code on an NVIDIA GPU (pip install cupy-cuda12x)")
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                    help="float16 halves the weights read per token (GPU only)")
    ap.add_argument("--models_dir", default="models")
    ap.add_argument("--source", choices=list(utils.SOURCES), default="openai",
                    help="openai: OpenAI's TensorFlow checkpoints; hf: the Hugging Face safetensors")
    ap.add_argument("--base_url", help=f"download from this mirror instead (or set ${utils.BASE_URL_ENV})")
    return ap.parse_args(argv)


def settings_from(args):
    return sampling.validate(sampling.SamplingSettings(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, penalize_prompt=args.penalize_prompt))


def read_prompts(args):
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts_file {args.prompts_file}: {e}")
    return prompts or [DEFAULT_PROMPT]


def check_args(args):
    for flag in ("target_model_size", "draft_model_size"):
        if getattr(args, flag) not in utils.MODEL_SIZES:
            raise ValueError(f"--{flag} {getattr(args, flag)!r} is not a GPT-2 size: choose one of "
                             f"{', '.join(utils.MODEL_SIZES)}")
    if args.K < 1:
        raise ValueError(f"--K must be >= 1, got {args.K}")
    if args.K_max is not None and args.K_max < args.K:
        raise ValueError(f"--K_max must be >= --K, got {args.K_max} < {args.K}")
    if args.n_tokens_to_generate < 1:
        raise ValueError(f"--n_tokens_to_generate must be >= 1, got {args.n_tokens_to_generate}")
    if args.dtype != "float32" and args.backend == "numpy":
        raise ValueError(f"--dtype {args.dtype} needs --backend cupy (NumPy has no fast {args.dtype} matmul); "
                         "use --dtype float32")


def load(size, args):
    encoder, hparams, params = utils.load_encoder_hparams_and_params(size, args.models_dir, args.source,
                                                                     args.base_url)
    return encoder, hparams, utils.to_backend(params, args.backend, args.dtype)


def streamer(encoder, colour):
    """A callback that prints one row's tokens as they arrive, holding back the bytes
    of a UTF-8 character that GPT-2's byte-level tokens split; accepted draft tokens
    are shown in colour on a terminal."""
    pending = bytearray()

    def show(row, token, accepted=False):
        pending.extend(encoder.decode_single_token_bytes(token))
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError:
            return  # wait for the rest of the character
        pending.clear()
        sys.stdout.write(f"{GREEN}{text}{RESET}" if accepted and colour else text)
        sys.stdout.flush()
    return show


def run(args):
    check_args(args)
    settings = settings_from(args)
    prompts = read_prompts(args)
    if args.stream and len(prompts) > 1:
        raise ValueError("--stream shows one prompt at a time: pass a single --prompt")
    speculative_mode = args.mode in ("speculative", "both")
    encoder, t_hparams, t_params = load(args.target_model_size, args)
    draft = None
    if speculative_mode and args.drafter == "model":
        if args.draft_model_size == args.target_model_size:
            draft = (t_params, t_hparams)
        else:
            _, d_hparams, d_params = load(args.draft_model_size, args)
            speculative.check_same_vocabulary(t_hparams, d_hparams)
            draft = (d_params, d_hparams)
    if speculative_mode and args.K >= t_hparams["n_ctx"] // 2:
        raise ValueError(f"--K must be below {t_hparams['n_ctx'] // 2} for this model's context")
    ids = [encoder.encode(p, allowed_special={utils.EOT_TOKEN}) for p in prompts]
    for p, i in zip(prompts, ids):
        if len(i) >= t_hparams["n_ctx"]:
            raise ValueError(f"a prompt is {len(i)} tokens, but GPT-2's context is {t_hparams['n_ctx']}: "
                             f"shorten it (it starts {p[:40]!r})")
        if not i:
            raise ValueError("a prompt is empty: give GPT-2 some text to continue")
    eos = None if args.ignore_eos else encoder.eot_token
    colour = sys.stdout.isatty()
    common = dict(use_cache=not args.no_kv_cache, eos_id=eos)
    results = {}
    if args.mode in ("autoregressive", "both"):
        print(f"\n=== autoregressive: GPT-2 {args.target_model_size} ===")
        cb = streamer(encoder, colour) if args.stream else None
        if cb:
            print(prompts[0], end="")
        out, stats = gpt2.generate(ids, t_params, t_hparams, args.n_tokens_to_generate, settings,
                                   np.random.default_rng(args.seed), callback=cb, **common)
        results["autoregressive"] = report(encoder, prompts, out, stats, args.stream)
    if speculative_mode:
        who = f"draft {args.draft_model_size}" if args.drafter == "model" else "prompt lookup"
        print(f"\n=== speculative: target {args.target_model_size}, {who}, K={args.K}"
              f"{' (adaptive)' if args.adaptive_K else ''} ===")
        cb = streamer(encoder, colour) if args.stream else None
        if cb:
            print(prompts[0], end="")
            if colour:
                print(f"  [{GREEN}green{RESET}: accepted drafts]", end="")
        out, stats = speculative.speculative_generate(
            ids, (t_params, t_hparams), draft, args.n_tokens_to_generate, args.K, settings,
            np.random.default_rng(args.seed), callback=cb, drafter=args.drafter,
            adaptive_K=args.adaptive_K, K_max=args.K_max or max(args.K, 7), **common)
        results["speculative"] = report(encoder, prompts, out, stats, args.stream)
        print(f"acceptance rate {stats['acceptance_rate']:.1%} "
              f"(by draft position: {stats['acceptance_by_position']}), "
              f"{stats['tokens_per_target_pass']:.2f} tokens per target pass, "
              f"time drafting {stats['draft_s']:.2f}s / verifying {stats['verify_s']:.2f}s")
        if "autoregressive" in results:
            ar, sp = results["autoregressive"], results["speculative"]
            print(f"\nspeedup of speculative over autoregressive: {sp['tokens_per_s'] / ar['tokens_per_s']:.2f}x")
            if args.temperature == 0:
                same = ar["texts"] == sp["texts"]
                print("greedy texts identical: " + ("yes" if same else "NO (this is a bug)"))
    return results


def report(encoder, prompts, out, stats, streamed):
    texts = [encoder.decode(o) for o in out]
    if streamed:
        print()
    else:
        for p, t in zip(prompts, texts):
            print(f"{p}{t}" if len(prompts) == 1 else f"--- {p!r}\n{p}{t}")
    print(f"{stats['n_tokens']} tokens in {stats['seconds']:.2f}s = {stats['tokens_per_s']:.1f} tokens/s "
          f"(first token after {stats['ttft_s'] * 1e3:.0f} ms; KV cache {stats['kv_cache_bytes'] / 2**20:.1f} MiB)")
    return dict(stats, texts=texts)


def main(argv=None):
    try:
        run(parse_args(argv))
    except (utils.LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
