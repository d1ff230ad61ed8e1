"""A prefix cache: never compute the same beginning twice.

Requests that share a beginning are the common case of serving: n samples of one prompt,
a few-shot template with a new question at its end, a fixed instruction before each
document, a conversation that sends its whole transcript again every turn. A token's keys
and values depend only on the tokens up to it (attention looks backwards), so a prefix
computed once can be copied into every later request that starts with it, and only the
rest of its prompt runs through the model. vLLM's automatic prefix caching (blocks of
tokens found by a hash of everything before them, https://docs.vllm.ai), SGLang's
RadixAttention (a radix tree of cached prefixes, https://arxiv.org/abs/2312.07104) and
llama.cpp's `cache_prompt` do this.

Here it is exact to the bit: with the row kernel every row's numbers are independent of
what shares its pass, and every pass (a prompt's too: kv_cache.prefill_alone) runs
attention as the kernels' per-query loop, so a token's keys and values come out bitwise
the same whichever request, pass or batch computed them (on a GPU, its own kernels do the
same: kv_cache.kernel_ops). A request served from the cache gets the very logits, logprobs
and text it would have computed itself. Without such kernels (the NumPy fallback, CuPy's
own operations) the cache is off (the scheduler's `any_beginning`), and only the choices
of one prompt share it (their passes would be identical).

Storage: a text's first BLOCK tokens, its next BLOCK, ... each block stored once, its keys
and values copied out of a row of the batch's cache as [n_layer, 2, n_head, BLOCK, d_head]
per model (a speculative decoder keeps its draft model's too). A block is found by its key,
(the id of the block before it, its own tokens): a hash chain, as vLLM's, in which a key
names every token before the block's end, and the stored tokens are compared, so no hash
collision can ever hand a request another text's numbers (ids are never reused). A lookup
walks the chain from the first block and copies the longest run it finds into the
request's row.

Bounded: the pool holds its budget of bytes in blocks, and a new block with no free one
evicts the least recently used. A lookup touches a chain from its last block to its first,
so a block is always less recent than the blocks before it, and eviction takes a chain's
end before its start (a block whose predecessor is gone could never be found again).
"""
import collections
import mmap

import numpy as np

BLOCK = 16  # tokens a block: a prefix is reused in whole blocks


def new_prefix_cache(budget_bytes):
    """An empty cache that holds at most budget_bytes of keys and values, for one decoder's
    models. 0 keeps none: the scheduler then shares only among the choices of one prompt."""
    return {"blocks": collections.OrderedDict(),  # key -> block, least recently used first
            "budget": budget_bytes, "bytes": 0, "next_id": 1,
            "pool": None, "free": [], "block_bytes": 0,  # the blocks' memory (`pool`), its free slots
            "queries": 0, "hits": 0,  # prompt tokens looked up, and copied, not computed (from here or a row)
            "refused": None}  # why the OS gave it no memory, if it did not (it is off then)


def block_bytes(caches):
    """The bytes of one block's keys and values, in every model's cache."""
    return sum(2 * len(kv["layers"]) * BLOCK * kv["layers"][0]["k"][0, :, 0].nbytes for kv in caches.values())


def pool(cache, caches):
    """The cache's memory, made at its first block: per model, slots [n, n_layer, 2, n_head,
    BLOCK, d_head] for the n blocks the budget holds. Allocated once and reused (vLLM's block
    pool): a block evicted frees its slot for the next, so a busy cache neither allocates nor
    frees, and the OS backs a slot's pages only once it is first written."""
    if cache["pool"] is None:
        n = cache["budget"] // block_bytes(caches)
        cache["pool"] = {name: allocate((n, len(kv["layers"]), 2, kv["layers"][0]["k"].shape[1], BLOCK,
                                         kv["layers"][0]["k"].shape[3]), kv["layers"][0]["k"])
                         for name, kv in caches.items()}
        cache["free"], cache["block_bytes"] = list(range(n - 1, -1, -1)), block_bytes(caches)
    return cache["pool"]


def allocate(shape, like):
    """The blocks' memory beside the KV cache like: a GPU's (where the copies in and out stay),
    or the host's, in large pages."""
    if isinstance(like, np.ndarray):
        return in_large_pages(shape, like.dtype)
    return np.empty(shape, like.dtype, like=like)


def in_large_pages(shape, dtype):
    """np.empty(shape, dtype) in memory the OS may back with 2 MiB pages (Linux's madvise
    MADV_HUGEPAGE): the first write of each 4 KiB page is a page fault, and a prefix cache
    writes a gigabyte of new pages as it fills: in large pages, a fault each 2 MiB instead
    (what it costs: `python benchmark.py --only prefix`, its workload unique)."""
    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    memory = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype, count=int(np.prod(shape))).reshape(shape)


def longest_prefix(cache, prompt):
    """The blocks of the longest cached prefix of prompt, in order, leaving at least its last
    token to run (the pass that gives the first new token needs one)."""
    chain, parent = [], 0
    for start in range(0, len(prompt) - 1 - BLOCK + 1, BLOCK):
        block = cache["blocks"].get((parent, tuple(prompt[start:start + BLOCK])))
        if block is None:
            break
        chain.append(block)
        parent = block["id"]
    return chain


def reuse(cache, prompt, caches, b):
    """Copy the longest cached prefix of prompt into row b of every model's KV cache
    (caches: name -> kv cache, row b empty); returns how many tokens it holds now."""
    chain = longest_prefix(cache, prompt)
    for i, block in enumerate(chain):
        slots = slice(i * BLOCK, (i + 1) * BLOCK)
        for name, kv in caches.items():
            kept = cache["pool"][name][block["slot"]]  # [n_layer, 2, n_head, BLOCK, d_head]
            for layer, (k, v) in zip(kv["layers"], kept):
                layer["k"][b, :, slots] = k
                layer["v"][b, :, slots] = v
    n = len(chain) * BLOCK
    for kv in caches.values():
        kv["lengths"][b], kv["starts"][b] = n, 0
    touch(cache, chain)
    return n


def store(cache, tokens, caches, b):
    """Keep the whole blocks of text `tokens` that row b of every model's cache holds (a
    prompt just prefilled, or a finished request's text): each new block takes a free slot,
    or the least recently used block's (never one of this text's own). Where the OS refuses
    the cache its memory, the cache is turned off (its budget 0, the reason in "refused") and
    serving goes on without it."""
    if cache["budget"] < block_bytes(caches) or any(kv["starts"][b] for kv in caches.values()):
        return  # nothing fits; or a window restart moved the row's positions, and no prefix starts at 0
    try:
        slots_of = pool(cache, caches)
    except (OSError, MemoryError) as e:
        cache["budget"], cache["refused"] = 0, f"{cache['budget'] >> 20} MiB refused by the OS ({e})"
        return
    n = min(int(kv["lengths"][b]) for kv in caches.values()) // BLOCK * BLOCK
    chain, parent = [], 0
    for start in range(0, n, BLOCK):
        key = (parent, tuple(tokens[start:start + BLOCK]))
        block = cache["blocks"].get(key)
        if block is None:
            if not cache["free"]:
                oldest = next(iter(cache["blocks"].values()))
                if chain and oldest is chain[0]:  # the rest of the chain came after it
                    break  # the text is longer than the whole cache: keep its beginning
                evict(cache, oldest)
            block = {"key": key, "id": cache["next_id"], "slot": cache["free"].pop()}
            for name, kv in caches.items():
                for kept, layer in zip(slots_of[name][block["slot"]], kv["layers"]):  # [2, n_head, BLOCK, d_head]
                    kept[0] = layer["k"][b, :, start:start + BLOCK]
                    kept[1] = layer["v"][b, :, start:start + BLOCK]
            cache["next_id"] += 1
            cache["blocks"][key] = block
        cache["blocks"].move_to_end(key)  # while the text is stored, its blocks are the last to go
        chain.append(block)
        parent = block["id"]
    touch(cache, chain)
    cache["bytes"] = len(cache["blocks"]) * cache["block_bytes"]


def evict(cache, block):
    del cache["blocks"][block["key"]]
    cache["free"].append(block["slot"])


def touch(cache, chain):
    """Mark a chain used now, its last block first: each block stays more recent than the blocks after it."""
    for block in reversed(chain):
        cache["blocks"].move_to_end(block["key"])
