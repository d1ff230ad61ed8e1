"""A decode step on a GPU as one CUDA graph: recorded once, replayed with one call.

Eagerly, a GPT-2 step on a GPU is hundreds of launches, each 12-20 us of Python and CuPy
on the host (an H100's run, an H200's), while the GPU finishes each kernel in a few: the
step takes as long as the host takes to ask for it (`python benchmark.py --backend cupy`).
A CUDA graph is a recording of a stream's launches (kernels, copies) with their arguments,
pointers included: while a stream is capturing, what is queued on it becomes the graph's
nodes instead of running. Replaying the graph launches them all from one host call, with
none of the Python in between. The price: everything a graph does must be the same every
time. So a step is shaped for it (after vLLM's and gpt-fast's decode graphs):

- The same buffers: the step's token ids and positions are copied into device arrays the
  graph reads ([2, B, T], one copy per step); the keys and values go to the cache's own
  arrays; the logits come out in an array the graph keeps. Every temporary a graph uses
  comes from a memory pool of its own, alive as long as the graph, so that nothing else
  is given its memory between replays.
- The same shapes: a graph per (rows B, tokens per row T) a cache's steps use, B a power
  of two (`bucket`, as vLLM's decode graphs: a server's batch changes size as requests
  come and go, and meets a few recorded shapes instead of one per size). Its first use
  runs eagerly (every kernel compiles; a prompt's one-off shape stops there), its second
  too (for its logits: a recording runs nothing) and is recorded, and it is replayed from
  the third. A row with fewer than T tokens, and a row past the batch's, is padded with
  tokens of position -1, which store and attend to nothing (cuda_ops.py; their wpe[-1] is
  wpe's last row, unused): the kernels treat each row alone, so padding changes no bit of
  the others. kv_cache.begin_pass keeps padding at its own slot (at most the last read)
  and masks it on the host.
- Nothing the host must wait for or look at: no cuBLAS (CuPy cannot record it; the
  products are cuda_matmul.py's), no mask built on the host, no data-dependent shape.

The model is gpt2.gpt2 as on the CPU, with a pass (kv_cache.Pass's fields) whose positions
are a device array and whose attends (cuda_ops.attend), layer norm and transformer_block
(the same math in 5 launches a layer, a launch being one GPU kernel call) are cuda_ops's.
A pass that does not fit (a prompt: more than TOKENS_MAX tokens; riders; a draft's
vocabulary subset) runs eagerly through kv_cache.begin_pass as on the CPU, on the same
kernels (cuda_ops.pass_ops), so a token comes out the same bits either way. Decoding's draws
join the recording too: plain decoding's steps and draws, a draft's K steps and draws, or a
verification's pass, distributions and tests, are one graph (cuda_decode_loop.py, on this
module's passes).

This path is chosen with --backend cupy and GPT2_GPU_KERNELS=1 (layout.to_backend). A CPU
checks it two ways: the *stand-in*, the same code on NumPy arrays (`layout.device_layout(
params, numpy)`), replay being a plain call, checks the bookkeeping; the *emulation*
(tests/cuda_on_cpu.py: our CUDA C compiled for the CPU, CuPy played by NumPy, graphs
recorded and replayed) checks the kernels and the recording, as a GPU does.
"""
import contextlib
import functools
import gc
import types

import numpy as np

import gpt2
from kernels import cuda_matmul, cuda_ops, weights

TOKENS_MAX = 128  # a static step's most tokens, bucket(B) x T: a longer pass (a prompt's) is run once, eagerly


def fits(model, cache, inputs, riders=()):
    """Whether a pass over inputs [B, T] runs as a static step (`step`): the model in
    layout.device_layout, a cache that keeps graphs (kv_cache.init_cache), no riders, at most
    TOKENS_MAX tokens (bucket(B) x T: the rows of each product)."""
    params = model[0]
    return (cache is not None and cache.get("graphs") is not None and not riders
            and isinstance(params["wte"], weights.Embedding) and isinstance(params["wte"].T, cuda_matmul.Matrix)
            and bucket(inputs.shape[0]) * inputs.shape[1] <= TOKENS_MAX)


def bucket(B):
    """The rows of the static step that runs B rows: the next power of two."""
    return 1 << (B - 1).bit_length()


def step(model, cache, inputs, n_new, n_logits):
    """kv_cache.next_logits's pass over inputs [B, T] (row b: n_new[b] real tokens) on the
    cache's static step for (bucket(B), T): eager the first two times that shape comes,
    recorded as a graph at the second, replayed from the third (the module's docstring says
    why). Returns logits [B, n, n_vocab] at each row's last n_logits[b] tokens (a row with
    fewer repeats its last), the tokens' keys and values stored; the caller advances the cache."""
    B, T = inputs.shape
    slots = cache["lengths"][:, None] + np.arange(T)  # [B, T]: a token's position is its slot
    ids_positions = np.stack([np.zeros((bucket(B), T), np.int64), np.full((bucket(B), T), -1)])  # [2, B', T]: padding
    ids_positions[0, :B], ids_positions[1, :B] = inputs, np.where(np.arange(T) < n_new[:, None], slots, -1)
    static = static_step(model, cache, bucket(B), T)
    # the rows this step writes: a view of the cache's first B' rows or fewer, which starts at
    # the cache's own address, so the pointers the graph was recorded with stay valid; the
    # padding rows past B (position -1) are never read or written
    static["layers"] = cache["layers"]
    copy_in(static["ids_positions"], ids_positions)
    logits = run(static)[:B]  # [B, T, n_vocab]: the batch's rows (a view of the graph's own output)
    n_logits = np.broadcast_to(n_logits, (B,))  # [B]
    at = logits_at(n_new, n_logits, n_logits.max())  # [B, n]
    n = at.shape[1]
    first = at[0, 0] if n else 0
    if (at == first + np.arange(n)).all():  # every row the same tokens' (a step, a verification, a catch-up)
        return (logits if n == T else logits[:, first:first + n]).copy()  # [B, n, n_vocab]: a replay writes over
    return logits[np.asarray(np.arange(B)[:, None], like=logits), np.asarray(at, like=logits)]  # [B, n, n_vocab]


def logits_at(n_new, n_logits, n):
    """Which tokens' logits a pass gives, as kv_cache.begin_pass picks them: row b's last
    n_logits[b] of its n_new[b] real tokens, then its last repeated up to n. [B, n]."""
    at = n_new[:, None] - n_logits[:, None] + np.arange(n)  # [B, n]
    return np.clip(at, 0, (n_new - 1).clip(0)[:, None])


def run(static):
    """static["forward"]() (a static step's, or cuda_decode_loop's): eager its first two times,
    recorded at the second, replayed from the third. Returns its output: once recorded, the
    graph's own, which its next replay overwrites."""
    static["uses"] += 1
    if static["replay"] is not None:
        static["replay"]()
        return static["output"]
    output = static["forward"]()
    if static["uses"] == 2:
        static["replay"], static["output"], static["graph"] = record(static["forward"], output)
    return output


def static_step(model, cache, B, T):
    """The step of B rows x T tokens over this cache (views of its first rows share it), made
    at first use: {"ids_positions": the buffer it reads [2, B, T], "forward": the pass over
    the cache rows "layers" (`step` sets them), "uses", and once recorded "replay", its
    "output" (the logits) and the "graph" with what it needs kept alive}."""
    params = model[0]
    key = (id(params), pointer(cache["layers"][0]["k"]), B, T)
    if key not in cache["graphs"]:
        wpe = params["wpe"]
        ids_positions = np.zeros((2, B, T), np.int64, like=wpe)  # [2, B, T]
        static = cache["graphs"][key] = {"ids_positions": ids_positions, "layers": cache["layers"], "uses": 0,
                                         "replay": None, "output": None, "graph": None,
                                         "params": params}  # kept: id(params) stays theirs

        def forward():
            return pass_over(model, static["layers"], ids_positions[0], ids_positions[1], None)  # [B, T, n_vocab]
        static["forward"] = forward
    return cache["graphs"][key]


def pass_over(model, layers, ids, positions, logits_at):
    """gpt2.gpt2 over ids [B, T] at positions [B, T] (device arrays; -1: padding), storing and
    attending over the cache's layers: logits [B, n, n_vocab] at the tokens logits_at [B, n]
    (None: [B, T, n_vocab], every token's: no gather, which CuPy makes in five launches)."""
    params, hparams = model
    state = types.SimpleNamespace(  # what gpt2.gpt2 reads of a pass (kv_cache.Pass)
        positions=positions, layer_norm=cuda_ops.layer_norm, transformer_block=cuda_ops.transformer_block,
        attends=[functools.partial(cuda_ops.attend, positions, layer) for layer in layers], logits_at=logits_at)
    return gpt2.gpt2(ids, **params, n_head=hparams["n_head"], state=state)  # [B, n, n_vocab]


def copy_in(buffer, values):
    """values (the host's, or the device's) into a device buffer a graph reads, as its dtype:
    one copy (the stand-in: NumPy's)."""
    if isinstance(buffer, np.ndarray) or not isinstance(values, np.ndarray):
        buffer[...] = values
    else:
        buffer.set(np.ascontiguousarray(values, dtype=buffer.dtype))  # (set takes its own dtype only)


def pointer(a):
    """Where an array's data starts (a graph is bound to its buffers' addresses)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]


@contextlib.contextmanager
def no_collection():
    """Python's cyclic collector paused: the graphs of a dropped cache are freed by it (a
    cache's steps and their forward hold each other), and freeing device memory while a
    stream captures may lose the capture (CUDA counts cudaFree among the unsafe calls)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def record(forward, like):
    """(replay, output, what to keep alive): forward() recorded as a CUDA graph where `like`
    (an output it gave eagerly, so every kernel is compiled and loaded) is a CuPy array, on
    a stream of its own with a memory pool of its own; nothing runs until replay. With
    NumPy, replay runs forward again into the output."""
    if isinstance(like, np.ndarray):
        out = np.empty_like(like)

        def replay():
            out[...] = forward()
        return replay, out, None
    import cupy
    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    with no_collection(), cupy.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            out = forward()
        except Exception as error:
            with contextlib.suppress(Exception):  # a capture the error invalidated fails to end: forward's
                stream.end_capture()  # error is the one to see; the stream must not stay capturing either way
            raise error
        graph = stream.end_capture()
    return graph.launch, out, (pool, stream, graph)
