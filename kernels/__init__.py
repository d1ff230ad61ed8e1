"""The CPU's kernels and weight formats: the accelerator under gpt2.py's NumPy.

gpt2.py is the model as math; on a CPU its matrix products, and in a cached pass its
layer norm and attention, can run here instead, computing the same functions with every
row summed in a fixed order (each row as if alone):

- rowwise.py: the door. `rowwise.matmul` is where rows meet weights; in a pass that
  `rowwise.fuses`, `rowwise.layer_norm` and `rowwise.attention` replace gpt2.py's;
  `rowwise.use` picks the kernel ("numba", or "numpy": gpt2.py's own NumPy, the reference).
- row_kernel.py, int8_kernel.py, int4_kernel.py, row_ops.py: the numba kernels (float32
  and bfloat16; int8 and int4 in integers; layer norm and attention); compiling.py: when
  they compile (each loop at its first use, or ahead, in other processes, during a load).
- weight_formats.py: bfloat16, int8 and int4 weights; layout.py: the weights laid out once at
  load as the kernels read them, or moved to a GPU.
"""
