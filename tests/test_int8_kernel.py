"""int8 weights times 16-bit activations (int8_kernel.py): the activations are rounded
as the docstring says, the pairs hold the weights they claim, and the kernels compute
exactly the integer sums of those, block by block."""
import numpy as np
import pytest
import readback

from kernels import rowwise

pytestmark = pytest.mark.skipif(rowwise.pick_kernel("numba") != "numba", reason="numba is not installed")


@pytest.fixture(scope="module")
def ik():
    from kernels import int8_kernel
    return int8_kernel


def test_activations_round_to_16_bits_per_block_of_64(ik):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1600), dtype=np.float32) * rng.uniform(1e-3, 1e3, (3, 1600)).astype(np.float32)
    x[2] = rng.standard_normal(1600, dtype=np.float32)
    x[2, 5] = 3e4  # an outlier: only its own block's step grows
    x[1, 64:128] = 0  # a block of zeros
    x16, sx = ik.to_int16(x, 64)
    assert x16.dtype == np.int16 and sx.dtype == np.float32 and sx.shape == (3, 25)
    top = np.abs(x).reshape(3, 25, 64).max(-1)
    np.testing.assert_array_equal(sx, top / np.float32(32767))
    assert sx[1, 1] == 0 and not x16[1, 64:128].any()
    blocks = x16.reshape(3, 25, 64).astype(np.int64)
    assert (np.abs(blocks).max(-1)[top > 0] == 32767).all() and np.abs(blocks).max() <= 32767
    back = blocks * sx[..., None].astype(np.float64)
    assert (np.abs(back - x.reshape(3, 25, 64)) <= sx[..., None] * (0.5 + 1e-3)).all()  # half a step, each
    assert sx[2, 0] > 1000 * sx[2, 1:].max()  # the outlier's block alone


def test_pairs_put_two_neighbouring_inputs_side_by_side(ik):
    q = np.random.default_rng(1).integers(-127, 128, (3, 16, 64), dtype=np.int8)
    qb = ik.paired(q)
    assert qb.shape == (3, 8, 64, 2) and qb.flags.c_contiguous
    assert qb[2, 5, 17, 0] == q[2, 10, 17] and qb[2, 5, 17, 1] == q[2, 11, 17]
    np.testing.assert_array_equal(readback.unpaired(qb), q)


@pytest.mark.parametrize("n_in, n_out", [(16, 48), (1024, 1000), (1600, 4800), (4096, 1024)])
@pytest.mark.parametrize("R", [1, 2, 5, 8])
def test_the_kernels_sum_the_integer_products_exactly(ik, n_in, n_out, R):
    """Against int64 sums of x16 * q per block of inputs, then the blocks in float64:
    only the float32 rounding of adding the blocks (and of the last scale) remains."""
    from kernels import row_kernel
    rng = np.random.default_rng(n_in + R)
    q = rng.integers(-127, 128, (n_in, n_out), dtype=np.int8)
    scale = rng.uniform(0.001, 0.01, n_out).astype(np.float32)
    qb = ik.paired(row_kernel.blocked(q.astype(np.float32)).astype(np.int8))  # [n_blocks, n_in / 2, 64, 2]
    x = rng.standard_normal((R, n_in), dtype=np.float32)
    got = ik.matmul(x, qb, n_out, np.concatenate([scale, np.zeros(qb.shape[0] * 64 - n_out, np.float32)]))
    c = ik.block_size(n_in)
    x16, sx = ik.to_int16(x, c)
    sums = np.einsum("rbk,bkj->rbj", x16.reshape(R, -1, c).astype(np.int64),
                     q.reshape(-1, c, n_out).astype(np.int64))  # [R, n_in / c, n_out]: exact integers
    terms = sums * sx[..., None].astype(np.float64)  # [R, n_in / c, n_out]
    want = terms.sum(1) * scale  # [R, n_out]
    bound = 2.0 ** -23 * (n_in // c + 2) * (np.abs(terms).sum(1) * scale)  # one float32 rounding a step
    assert got.shape == (R, n_out) and got.dtype == np.float32
    assert (np.abs(got - want) <= bound + 1e-30).all()
