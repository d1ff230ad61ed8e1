"""What main.py and server.py share: the flags that name the models and how they decode,
and one line for a bad flag (cli/loading.py loads the models they name).

Both build their parsers from these, so a flag means the same thing in each (the
benchmark's own, bench/cli.py, take lists: several sizes, dtypes, K); serving imports
this, never main.py.
"""
import argparse

import utils
from kernels import layout, rowwise, weight_formats

DTYPES = weight_formats.DTYPES + ("float16",)  # float16: CuPy's
# the library names its settings; the command line calls some of them differently
FLAG_OF = {"draft": "draft_model_size", "max_new_tokens": "n_tokens_to_generate", "adaptive": "adaptive_K"}




class OneLineParser(argparse.ArgumentParser):
    """argparse's checks, but a bad flag is one line (main prints it), not usage + error."""

    def error(self, message):
        raise ValueError(message)


def add_decoder_flags(ap, modes, default):
    """The models and how they decode (main.py and server.py share these)."""
    ap.add_argument("--target_model_size", default="355M", choices=utils.MODEL_SIZES,
                    help="the model whose text is generated")
    ap.add_argument("--draft_model_size", default="124M", choices=utils.MODEL_SIZES,
                    help="the model that drafts for it (speculative decoding; the same size: a self-draft)")
    ap.add_argument("--mode", choices=modes, default=default,
                    help="how to decode" + (f" (default: {default})" if default else
                                            " (default: both, compared; beams with --num_beams)"))
    ap.add_argument("--K", type=int, default=4, help="draft tokens per target pass")
    ap.add_argument("--adaptive_K", action="store_true",
                    help="each row picks its K before each step from its acceptance so far (up to --K_max)")
    ap.add_argument("--K_max", type=int, help="the bound for --adaptive_K (default: max(K, 7))")
    ap.add_argument("--drafter", choices=["model", "prompt_lookup"], default="model",
                    help="who drafts: the draft model, or prompt lookup (copies what followed the text's last "
                         "n-gram earlier on)")
    ap.add_argument("--draft_vocab", type=int, default=0,
                    help="the draft model computes logits only for the first N token ids (roughly the most "
                         "frequent) and the text's own (a cheaper draft step; still exact); 0 = all")
    ap.add_argument("--draft_dtype", choices=DTYPES,
                    help="the draft's weights (default: int8 for a smaller draft model on the CPU's kernel, else "
                         "--dtype); the draft's precision never changes the text, only how often its guesses are "
                         "accepted. With --draft_model_size equal to --target_model_size, --draft_dtype int8 "
                         "(or int4) drafts with the target's own int8 (int4) copy")


DRAFT_FLAGS = ("draft_model_size", "K", "adaptive_K", "K_max", "drafter", "draft_vocab", "draft_dtype")
MODEL_DRAFT_FLAGS = ("draft_model_size", "draft_vocab", "draft_dtype")  # what prompt lookup has no use for


def draft_flags_note(args, defaults):
    """Why some of the draft's flags change nothing: --mode autoregressive (a server's
    default) drafts nothing, and prompt lookup has no draft model (None where every flag
    given counts)."""
    def given(names):
        return [f"--{name}" for name in names if getattr(args, name) != getattr(defaults, name)]
    if args.mode == "autoregressive" and given(DRAFT_FLAGS):
        return (f"note: --mode autoregressive decodes with the target alone and leaves {', '.join(given(DRAFT_FLAGS))} "
                "unused (--mode speculative drafts)")
    if args.mode != "autoregressive" and args.drafter == "prompt_lookup" and given(MODEL_DRAFT_FLAGS):
        return (f"note: --drafter prompt_lookup drafts from the text itself and leaves "
                f"{', '.join(given(MODEL_DRAFT_FLAGS))} unused (--drafter model runs the draft model)")
    return None


PREFIX_CACHE_MIB = 1024  # the default budget: 5,000 tokens' keys and values of 355M, 14,000 of 124M


def add_prefix_cache_flag(ap):
    """--prefix_cache_mib (main.py's --max_batch and server.py: serving/prefix_cache.py)."""
    ap.add_argument("--prefix_cache_mib", type=int, default=PREFIX_CACHE_MIB,
                    help="memory for the keys and values of prompts already computed, reused by requests that "
                         "begin the same way (0: keep none; the choices of one prompt still compute it once)")


def check_prefix_cache(args):
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix_cache_mib must be >= 0 (0 keeps none), got {args.prefix_cache_mib}")
    # the blocks live beside the KV cache: in the GPU's memory with --backend cupy (serving/prefix_cache.allocate)
    where, memory = layout.memory(on_gpu=args.backend == "cupy")
    if memory and args.prefix_cache_mib << 20 > memory:
        raise ValueError(f"--prefix_cache_mib {args.prefix_cache_mib} is more than {where} memory "
                         f"({memory >> 20} MiB): give it a part of that")


def same_bits(args):
    """Whether every pass runs kernels whose tokens come out the same bits whatever the pass
    (kv_cache.kernel_ops): the CPU's numba kernels, or a GPU's own (GPT2_GPU_KERNELS=1)."""
    return layout.gpu_kernels() if args.backend == "cupy" else rowwise.KERNEL == "numba"


def prefix_cache_note(args):
    """Why a run keeps no prefix cache where it cannot be exact (None where it can, or is off)."""
    if not same_bits(args) and args.prefix_cache_mib:
        return ("note: no prefix cache without the CPU's numba kernels or a GPU's own (GPT2_GPU_KERNELS=1): a "
                "prompt computed in one product is rounded by its length, so a copied prefix could change a bit "
                "(only the choices of one prompt share it)")
    return None


# chunked prefill's budget a step: the largest whose streams kept their p99 gap within ~3x their
# median alone, 124M and 355M on 2 cores (`python benchmark.py --only chunked`, README section 7)
MAX_PREFILL_TOKENS = 24


def add_prefill_flag(ap):
    """--max_prefill_tokens (main.py's --max_batch and server.py: serving/chunking.py)."""
    ap.add_argument("--max_prefill_tokens", type=int,
                    help=f"chunked prefill: tokens computed a step, each decoding request counting one; what they "
                         f"leave goes to prompts, the fewest tokens left first, so a long prompt is spread over "
                         f"steps and never stalls the streams in flight (at least --max_batch; default "
                         f"{MAX_PREFILL_TOKENS}, or --max_batch if larger; with --backend cupy, prompts whole unless "
                         f"given)")


def check_prefill(args):
    least = max(args.max_batch or 1, 1)
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < least:
        raise ValueError(f"--max_prefill_tokens must be >= {least} (--max_batch: each decoding request counts one "
                         f"token of it), got {args.max_prefill_tokens}")


def prefill_budget(args):
    """The budget serving runs with: None (prompts whole) where chunks could change a bit, and
    on a GPU unless asked for: there a step that carries a chunk runs eagerly, not as a
    recorded graph, and a whole prompt stalls the streams for milliseconds, not seconds."""
    if chunked_prefill_note(args):
        return None
    if args.backend == "cupy":
        return args.max_prefill_tokens
    return args.max_prefill_tokens or max(MAX_PREFILL_TOKENS, args.max_batch)


def chunked_prefill_note(args):
    """Why a run computes every prompt whole (None where it chunks them)."""
    if not same_bits(args):
        return ("note: prompts run whole (no chunked prefill) without the CPU's numba kernels or a GPU's own "
                "(GPT2_GPU_KERNELS=1): a prompt computed in chunks is rounded differently from one computed whole, "
                "and chunks must not change a bit")
    return None


def add_model_flags(ap):
    """Where the models come from and what runs them (main.py and server.py share these)."""
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",
                    help="cupy: the same code on an NVIDIA GPU (pip install cupy-cuda12x)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="the weights as stored: bfloat16 / int8 / int4 read 2x / 4x / 7x fewer bytes per token "
                         "(the CPU's numba kernel; an approximation of float32, see README); float16: --backend "
                         "cupy only")
    ap.add_argument("--models_dir", default="models", help="where the checkpoints are (or are downloaded to)")
    ap.add_argument("--source", choices=list(utils.SOURCES), default="openai",
                    help="openai: OpenAI's TensorFlow checkpoints; hf: the Hugging Face safetensors")
    ap.add_argument("--base_url", help=f"download from this mirror instead (or set ${utils.BASE_URL_ENV})")
    ap.add_argument("--kernel", choices=rowwise.KERNELS,
                    help=f"numpy: gpt2.py's own NumPy functions run every pass (the reference; or set "
                         f"${rowwise.KERNEL_ENV}=numpy); numba: the CPU's kernels (the default where numba imports)")


def check_dtypes(args):
    """The kernel --kernel asks for, and each weight format where a kernel for it exists:
    bfloat16, int8 and int4 on the CPU's numba kernel, float16 on a GPU (CuPy); float32 everywhere."""
    if getattr(args, "kernel", None):
        rowwise.use(args.kernel)
    for flag in ("dtype", "draft_dtype"):
        dtype = getattr(args, flag, None)
        if dtype is None or dtype == "float32":
            continue
        if args.backend == "cupy" and dtype != "float16":
            raise ValueError(f"--{flag} {dtype} runs on the CPU's row kernel; with --backend cupy use "
                             "float32 or float16")
        if args.backend == "numpy" and dtype == "float16":
            raise ValueError(f"--{flag} float16 needs --backend cupy (NumPy has no fast float16 matmul); "
                             "on the CPU use bfloat16, int8 or int4")
        if args.backend == "numpy" and rowwise.KERNEL != "numba":
            raise ValueError(f"--{flag} {dtype} needs the numba row kernel (pip install numba, and leave out "
                             f"--kernel numpy and {rowwise.KERNEL_ENV}); the NumPy reference runs float32")


def draft_dtype(args):
    """The draft's weight format: --draft_dtype if given; else int8 for a separate, smaller
    draft model where the CPU's kernels run it (it reads a quarter of float32's bytes, and
    rejection sampling keeps the target's distribution whatever q is); else --dtype. A
    self-draft (the target's own size) is asked for explicitly."""
    if args.draft_dtype:
        return args.draft_dtype
    smaller = utils.MODEL_SIZES.index(args.draft_model_size) < utils.MODEL_SIZES.index(args.target_model_size)
    if smaller and args.backend == "numpy" and rowwise.KERNEL == "numba":
        return "int8"
    return args.dtype
