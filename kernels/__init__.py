"""The CPU's kernels and weight formats: the accelerator under gpt2.py's NumPy.

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
  load as the kernels read them, or moved to a GPU.

A GPU's kernels of our own enter the same two ways (with GPT2_GPU_KERNELS=1 until a GPU
has run their tests): cuda_matmul.py's Matrix, whose __rmatmul__ launches a few-row product
on device memory, and cuda_ops.py's layer norm and attention, which a step's pass calls;
cuda_graphs.py records such a step as one CUDA graph and replays it (kv_cache.next_logits
hands it the passes it can take); cuda.py compiles their CUDA C (NVRTC).
"""
