"""The kernels and weight formats under gpt2.py's NumPy: the CPU's, and a GPU's own.

gpt2.py is the model as math, and it never asks what runs it. On a CPU the kernels enter
through the weights and the cache, computing the same functions with every row summed in
a fixed order (each row as if alone):

- weights.py: the way in. Laid out at load (layout.py), a weight matrix is a `Matrix` that
  multiplies itself: gpt2.py's `x @ w` runs `rowwise.matmul`, and `wte[tokens]` / `wte.T`
  read the tied embedding from the head's stored matrix. A cached pass attends through
  kv_cache.attend, which runs `rowwise.attention` (row_ops.py) where the layout allows.
- rowwise.py: where rows meet weights (`matmul`), which kernel runs (`use`: "numba", or
  "numpy": the fallback's per-row gemvs), and BLAS's threads.
- row_kernel.py, int8_kernel.py, int4_kernel.py, row_ops.py: the numba kernels (float32
  and bfloat16; int8 and int4 in integers; attention); compiling.py: when they compile
  (each loop at its first use, or ahead, in other processes, during a load).
- weight_formats.py: bfloat16, int8 and int4 weights; layout.py: the weights laid out once at
  load as the kernels read them, or moved to a GPU, and the memory either has.

A GPU's kernels of our own (opt-in: GPT2_GPU_KERNELS=1) enter the same two ways and two
more: cuda_matmul.py's Matrix, whose __rmatmul__ launches a few-row product on device
memory; cuda_ops.py's layer norm, attention and transformer block, which a step's pass
brings; kv_cache.next_logits, which hands cuda_graphs.py the passes that fit its static
step, recorded once as a CUDA graph and replayed; and sampling.py, whose distribution and
draw on device arrays are cuda_sampling.py's two kernels (speculative.verify's too, and two
more). cuda_decode_loop.py records a pass with its draws as one graph (a plain step, a
draft's K passes, a verification), which batching.py and speculative.py ask first. cuda.py
compiles their CUDA C (NVRTC).
"""
