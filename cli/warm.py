"""What a run of main.py compiles and warms before anything is timed.

The kernels compile one loop per format and tile of rows (kernels/compiling.py). A run
knows the passes it will make from its prompts and flags: `compile_ahead` compiles
their loops in other processes while the models load, and `warm_up` runs a pass of each
kind once, so that no decoder's time includes a compile.
"""
import kv_cache
from cli import flags, loading


def pass_sizes(args, config, ids):
    """How many tokens each pass this run will make holds, of the target and of a draft model
    loaded apart (None without one): a lone prompt makes a pass over its tokens (over all
    but the last, then the last, past kv_cache.ALONE_ABOVE), then one token a step; a draft
    adds its two-token catch-up; verification (and the advice's timings) K + 1 tokens for
    every K; a batch, any count."""
    sizes = {1}
    for i in ids:
        sizes |= {len(i) - 1, 1} if len(i) - 1 > kv_cache.ALONE_ABOVE else {len(i)}
    if len(ids) > 1 or args.max_batch:
        sizes = set(loading.EVERY_TILE)
    if args.mode == "autoregressive":
        return sizes, None
    verify = set(range(2, max(config.K, config.K_max or 7) + 2))
    return sizes | verify, (sizes | {2} if loading.separate_draft(args) else None)


def compile_ahead(args, config, ids):
    """A context in which the kernels' loops of this run's passes compile in other processes."""
    target_sizes, draft_sizes = pass_sizes(args, config, ids)
    return loading.compile_ahead(args, [(args.dtype, target_sizes)] + ([(flags.draft_dtype(args), draft_sizes)]
                                                                       if draft_sizes else []))


def warm_up(args, config, target, drafter, ids):
    """The kernels' loops of this run's passes, compiled (or loaded from numba's cache) before any is timed."""
    target_sizes, draft_sizes = pass_sizes(args, config, ids)
    loading.warm(target, target_sizes)
    if draft_sizes:
        loading.warm(drafter.model, draft_sizes)
