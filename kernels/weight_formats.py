"""Fewer bytes per weight: bfloat16, int8 and int4 copies of GPT-2's float32 matrices.

Decoding one token reads every weight once and does two flops with each, so a CPU
spends its time waiting for memory: the time of a step is the bytes of weights over
the memory bandwidth (the roofline's memory-bound side). Storing a weight in 2 bytes
(bfloat16) or 1 (int8) instead of 4 divides that time by up to 2 or 4, as long as the
kernel that reads them widens them back to float32 in the core, where arithmetic is
nearly free (row_kernel.py). Activations, layer norms, biases and attention stay
float32; only the stored matrices change (and int8's products, below).

- bfloat16 (https://cloud.google.com/tpu/docs/bfloat16): a float32 with the low 16 bits
  of its mantissa rounded away (to nearest, ties to even). Same exponent range, so no
  scale is needed; 8 bits of precision (a relative error up to 2**-8). Widening is
  exact: the 16 bits shifted back up are a float32.
- int8, weight-only, symmetric, one scale per output column (as LLM.int8's vector-wise
  quantization without its outliers, https://arxiv.org/abs/2208.07339, and ctranslate2's
  int8): w[k, j] ~ q[k, j] * scale[j] with q in [-127, 127] and scale[j] = max_k
  |w[k, j]| / 127. A column's error is at most scale[j] / 2 per weight. Since the scale
  is per output, x @ w = (x @ q) * scale: the kernel sums x[k] * q[k, j] and scales
  each output once at the end. It sums in integers, the activations rounded to 16 bits
  per block of 64 (int8_kernel.py: an error a few hundred times below the weights').
- int4, weight-only, symmetric, in groups of 32 inputs with a scale per group and
  output column (blocks of 32 as llama.cpp's Q4_0, which keeps 16 levels, -8..7, with a
  float16 scale; gpt-fast's groupwise int4 takes 32-256): w[k, j] ~ q[k, j] *
  sw[g, j] with q in [-7, 7] and sw[g, j] = max |w[k, j]| over group g / 7, stored as
  bfloat16 (its 8 bits are far finer than the 4 of q). Two weights a byte plus a scale
  for 32 of them: 4.5 bits a weight. With only 15 levels a group, a step is 1/7 of the
  group's largest weight (int8's is 1/127 of a column's), so int4 moves the logits far
  more than int8; a small group keeps an outlier's coarse step to its own 32 weights.
  The kernel (int4_kernel.py) rounds the activations to 8 bits per group and sums in
  integers.

All are approximations of the float32 model (plain decoding's text can differ); as a
speculative draft they cost nothing in exactness, since rejection sampling keeps the
output the float32 target's (speculative.py). `python benchmark.py --only formats`
measures how far the logits move.
"""
import numpy as np

DTYPES = ("float32", "bfloat16", "int8", "int4")
STORED_AS = {"float32": "float32", "bfloat16": "uint16", "int8": "int8", "int4": "uint8"}  # the kernels' arrays
INT4_GROUP = 32  # inputs per int4 scale (Q4_0's block)


def to_bfloat16(w):
    """float32 array -> its bfloat16 bits as uint16, rounded to nearest, ties to even."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32)
    lsb = (u >> 16) & 1  # 1 where the kept part is odd: a tie then rounds up, to even
    return ((u + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)


def from_bfloat16(h):
    """uint16 bfloat16 bits -> float32, exactly."""
    return (h.astype(np.uint32) << 16).view(np.float32)


def to_int8(w, axis=0):
    """float32 w -> (q int8, scale float32): q * scale ~ w, one scale per slice along
    every axis but `axis` (the inputs k: one scale per output column). A column of zeros
    gets scale 0 (the padding of the head's last block)."""
    scale = (np.abs(w).max(axis=axis, keepdims=True) / np.float32(127)).astype(np.float32)
    q = np.rint(np.divide(w, scale, out=np.zeros(w.shape, np.float32), where=scale > 0))
    return q.astype(np.int8), np.squeeze(scale, axis)


def from_int8(q, scale, axis=0):
    """(q, scale) -> float32 q * scale, the weights int8 decoding uses."""
    return q.astype(np.float32) * np.expand_dims(scale, axis)


def int4_group(n_in):
    """Inputs per int4 group: INT4_GROUP, or the largest power of two below it that divides
    n_in (the test models)."""
    return int(np.gcd(n_in, INT4_GROUP))


def to_int4(w):
    """float32 w [..., n_in, n_out] -> (q int8 in [-7, 7] of w's shape, sw [..., n_in / c,
    n_out] bfloat16 bits): q * sw ~ w, a scale per group of c = int4_group(n_in) inputs and
    column, rounded to bfloat16 before q is rounded against it. A group of zeros gets 0."""
    *lead, n_in, n_out = w.shape
    c = int4_group(n_in)
    groups = w.reshape(*lead, n_in // c, c, n_out)  # [..., n_in / c, c, n_out]
    sw = to_bfloat16(np.abs(groups).max(axis=-2) / np.float32(7))  # [..., n_in / c, n_out]
    scale = from_bfloat16(sw)[..., None, :]  # [..., n_in / c, 1, n_out]
    q = np.rint(np.divide(groups, scale, out=np.zeros(groups.shape, np.float32), where=scale > 0))
    # a guard: bfloat16's rounding can leave |w| / scale at 7.03, which rint still makes 7
    return np.clip(q, -7, 7).astype(np.int8).reshape(w.shape), sw


def stored(wb, dtype):
    """Float32 blocks [n_blocks, n_in, W] (row_kernel.blocked) in the format `dtype`, as
    the params keep them: {"w": blocks} (uint16 for bfloat16), plus for int8 "scale"
    [n_blocks * W], one per output column, for int4 (q in int8 until the kernel packs them,
    kernels/layout.py) "scale" [n_blocks, n_in / c, W], one per group and column."""
    if dtype == "float32":
        return {"w": wb}
    if dtype == "bfloat16":
        return {"w": to_bfloat16(wb)}
    if dtype == "int4":
        q, sw = to_int4(wb)  # [n_blocks, n_in, W], [n_blocks, n_in / c, W]
        return {"w": q, "scale": sw}
    q, scale = to_int8(wb, axis=1)  # [n_blocks, n_in, W], [n_blocks, W]
    return {"w": q, "scale": scale.reshape(-1)}
