"""The kernels' stored formats read back (the inverses of int8_kernel.paired,
int4_kernel.packed and weight_formats.to_int4): what the tests compare the kernels with."""
import numpy as np

from kernels.weight_formats import from_bfloat16


def from_int4(q, sw):
    """(q [..., n_in, n_out], sw [..., n_in / c, n_out]) -> float32 q * sw, the weights int4
    decoding uses."""
    c = q.shape[-2] // sw.shape[-2]
    return q.astype(np.float32) * np.repeat(from_bfloat16(sw), c, axis=-2)


def unpaired(qb):
    """The inverse of int8_kernel.paired: [n_blocks, n_in / 2, W, 2] -> [n_blocks, n_in, W]."""
    n_blocks, half, w, _ = qb.shape
    return np.ascontiguousarray(qb.transpose(0, 1, 3, 2).reshape(n_blocks, 2 * half, w))  # [n_blocks, n_in, W]


def unpacked(qb):
    """The inverse of int4_kernel.packed: qb [n_blocks, n_in / 4, 4, 32] -> q [n_blocks, n_in, W] int8."""
    n_blocks, quads, _, _ = qb.shape
    u = qb.reshape(n_blocks, quads, 4, 8, 4)  # [n_blocks, quad, set, m, i]
    both = np.stack([u & 15, u >> 4], axis=-1)  # [n_blocks, quad, set, m, i, half]
    q = both.transpose(0, 1, 4, 2, 5, 3).reshape(n_blocks, 4 * quads, 64)  # [n_blocks, n_in, W]
    return q.astype(np.int8) - 8
