"""int4 weights times 8-bit activations (int4_kernel.py): the activations are rounded as
the docstring says, and the kernel computes exactly the integer sums of the stored
nibbles, group by group, for any row count, each row as it would be alone."""
import numpy as np
import pytest

from kernels import rowwise, weight_formats

pytestmark = pytest.mark.skipif(rowwise.pick_kernel("numba") != "numba", reason="numba is not installed")


@pytest.fixture(scope="module")
def k4():
    from kernels import int4_kernel
    return int4_kernel


def test_activations_round_to_8_bits_per_group_of_32(k4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1600), dtype=np.float32) * rng.uniform(1e-3, 1e3, (3, 1600)).astype(np.float32)
    x[2, 5] = 3e4  # an outlier: only its own group's step grows
    x[1, 64:96] = 0  # a group of zeros
    x8, sx, xsum = k4.to_int8(x, 32)
    assert x8.dtype == np.int8 and sx.dtype == np.float32 and xsum.dtype == np.int32 and sx.shape == (3, 50)
    top = np.abs(x).reshape(3, 50, 32).max(-1)
    np.testing.assert_array_equal(sx, top / np.float32(127))
    assert sx[1, 2] == 0 and not x8[1, 64:96].any()
    groups = x8.reshape(3, 50, 32).astype(np.int64)
    assert (np.abs(groups).max(-1)[top > 0] == 127).all() and np.abs(groups).max() <= 127
    np.testing.assert_array_equal(xsum, groups.sum(-1))
    back = groups * sx[..., None].astype(np.float64)
    assert (np.abs(back - x.reshape(3, 50, 32)) <= sx[..., None] * (0.5 + 1e-3)).all()  # half a step, each


def exact(k4, x, q, sw):
    """The kernel's arithmetic in exact integers, then its float32 steps one by one: per
    group g, t = float32(sw * sx), acc = float32(float(isum) * t + acc) (a fused
    multiply-add: the product of two float32 is exact in float64)."""
    c = weight_formats.int4_group(x.shape[1])
    x8, sx, xsum = k4.to_int8(x, c)
    R, n_out = x.shape[0], q.shape[1]
    isum = np.einsum("rgk,gkj->rgj", x8.reshape(R, -1, c).astype(np.int64),
                     q.reshape(-1, c, n_out).astype(np.int64))  # [R, n_in / c, n_out]: q = u - 8, so 8 xsum is gone
    scale = weight_formats.from_bfloat16(sw)  # [n_in / c, n_out]
    acc = np.zeros((R, n_out), np.float32)
    for g in range(isum.shape[1]):
        t = (scale[g] * sx[:, g:g + 1]).astype(np.float32)  # [R, n_out]
        acc = (isum[:, g] * t.astype(np.float64) + acc).astype(np.float32)
    return acc


@pytest.mark.parametrize("n_in, n_out", [(16, 48), (768, 2304), (1024, 1000), (4096, 1024)])
def test_the_kernel_is_the_exact_integer_sum_for_1_to_16_rows(k4, n_in, n_out):
    from kernels import layout, row_kernel
    rng = np.random.default_rng(n_in)
    layer = layout.kernel_blocks(rng.standard_normal((n_in, n_out), dtype=np.float32), "int4")
    q = row_kernel.unblocked(k4.unpacked(layer["w"]), n_out)  # [n_in, n_out]
    sw = row_kernel.unblocked(layer["scale"], n_out)  # [n_in / c, n_out]
    x = rng.standard_normal((16, n_in), dtype=np.float32)
    want = exact(k4, x, q, sw)  # [16, n_out]
    for R in range(1, 17):
        for first in {0, 16 - R}:
            got = rowwise.matmul(x[first:first + R], layer["w"], n_out=n_out, scale=layer["scale"])
            assert got.shape == (R, n_out) and got.dtype == np.float32
            assert np.array_equal(got, want[first:first + R]), f"{R} rows from {first}"
