"""Loading the models the flags name (`load_models`), and readying the kernels' loops their
passes will use: compiled in other processes while the weights load (`compile_ahead`,
kernels/compiling.py), then each pass run once (`warm`). main.py asks cli/warm.py which
passes its run makes; the server readies every loop before it listens.
"""
import contextlib
import time

import kv_cache
import speculative
import utils
from cli import flags
from kernels import layout, rowwise, weight_formats


def load(size, args, dtype, log=print):
    """(encoder, (params, hparams)) of GPT-2 `size` with its weights in `dtype`. The CPU
    converts them as it lays them out; a GPU copies float32 over and converts there."""
    if rowwise.KERNEL_ERROR:
        raise utils.LoadError(rowwise.KERNEL_ERROR)
    log(f"loading GPT-2 {size} as {dtype}...")  # a newcomer's first run reads (or downloads) for a while
    start = time.perf_counter()
    encoder, hparams, params = utils.load_encoder_hparams_and_params(
        size, args.models_dir, args.source, args.base_url, dtype=dtype if args.backend == "numpy" else "float32")
    params = layout.to_backend(params, args.backend, dtype)
    log(f"loaded GPT-2 {size} as {dtype} in {time.perf_counter() - start:.1f}s")
    return encoder, (params, hparams)


EVERY_TILE = range(1, 8)  # passes over 1-7 tokens reach every loop of the kernels (rowwise.warm_passes)


def warm(model, sizes):
    """Passes like those over `sizes` tokens, before anything is timed: the kernels' loops
    they use are loaded from numba's cache (where `compile_ahead` compiled them during the
    load) or compiled now, saying so (kernels/compiling.py). A run warms the passes it will
    make (main.py); the server every loop before it listens: no request waits for a compile."""
    params, hparams = model
    w = params["blocks"][0]["mlp"]["c_fc"]["w"]
    dtype = getattr(w, "stored", w).dtype  # a weights.Matrix: the format it stores
    for n in rowwise.warm_passes(sizes, dtype):
        cache = kv_cache.init_cache(hparams, 1, n, like=params["wpe"])
        kv_cache.next_logits(model, cache, [[0] * n])


def tokenizer(args):
    """(encoder, hparams) of the target, before its weights download or load (fetching its
    small files first): a run knows its prompts' lengths, so the loops its passes will use,
    and compiles them meanwhile."""
    model_dir = utils.download_model(args.target_model_size, args.models_dir, args.source, args.base_url,
                                     only=utils.SMALL_FILES)
    try:
        encoder, hparams = utils.load_encoder(model_dir), utils.load_hparams(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise utils.LoadError(f"cannot read the tokenizer or hparams.json / config.json in {model_dir} ({e}): "
                              "delete it and run again to re-download")
    utils.check_vocabulary(model_dir, hparams, encoder)
    return encoder, hparams


def separate_draft(args):
    """Whether the run loads a draft model apart from the target: a smaller one, or the
    target's size in another format (the self-draft)."""
    return (args.mode != "autoregressive" and args.drafter == "model"
            and (args.draft_model_size, flags.draft_dtype(args)) != (args.target_model_size, args.dtype))


def compile_ahead(args, passes):
    """A context in which the kernels' loops that passes [(format, their sizes in tokens)] will use
    compile in other processes, while the models load (kernels/compiling.py). Nothing to
    compile without the kernels."""
    if args.backend != "numpy" or rowwise.KERNEL != "numba":
        return contextlib.nullcontext()
    loops = set().union(*(rowwise.loops(sizes, weight_formats.STORED_AS[dtype]) for dtype, sizes in passes))
    return rowwise.compiling.ahead(loops)


def load_models(args, log=print):
    """(encoder, target, drafter): the drafter (speculative.Drafter) drafts with the draft
    model or by prompt lookup; None where no mode drafts. A draft of the target's own size
    and format is the target itself; of its size in another format (the self-draft), a
    second copy of the same checkpoint in that format. log takes a line per model loaded
    (the server's go to stderr, with its other logs)."""
    encoder, target = load(args.target_model_size, args, args.dtype, log)
    if rowwise.KERNEL == "numpy":
        rowwise.gemv_is_exact()  # the fallback's one-time probe (under a second) belongs to loading
    drafter = speculative.PROMPT_LOOKUP if args.drafter == "prompt_lookup" else None
    if args.mode != "autoregressive" and args.drafter == "model":
        dtype = flags.draft_dtype(args)
        drafter = speculative.model_drafter(load(args.draft_model_size, args, dtype, log)[1] if separate_draft(args)
                                          else target)
        if dtype == "float32" and not args.draft_dtype and args.backend == "numpy" and rowwise.KERNEL != "numba":
            log("note: the draft runs in float32: an int8 draft (4x fewer bytes a token) needs the numba kernel "
                "(pip install numba, and leave out --kernel numpy)")
    return encoder, target, drafter
