"""The CPU's GPU (tests/cuda_on_cpu.py) stops a launch where a GPU would, and gives a kernel
what a GPU leaves undefined as garbage: each check is seen to fail a kernel with the fault it
is for, and to pass the kernel without it. A GPU session is lent rarely and a fault there is
sticky (every later launch of the process fails), so what a CPU can catch, it must."""
import numpy as np
import pytest

import cuda_on_cpu
from kernels import cuda

pytestmark = pytest.mark.skipif(bool(cuda_on_cpu.unavailable()), reason=f"{cuda_on_cpu.unavailable()}")


@pytest.fixture(scope="module")
def cupy():
    return cuda_on_cpu.cupy()


def kernel(cupy, body, name="k", bounds="", before=""):
    """extern "C" k(const float* x, float* y) with body, cuda.SHARED's helpers and `before` ahead."""
    source = cuda.SHARED + before + f'extern "C" __global__ void {bounds} {name}(const float* x, float* y) {{ {body} }}'
    return cupy.RawModule(code=source, options=cuda.OPTIONS).get_function(name)


def launch(cupy, f, blocks, threads, x, shared_mem=0):
    y = cupy.empty(blocks * threads, np.float32)
    f((blocks,), (threads,), (x, y), shared_mem=shared_mem)
    return y.get()


def test_a_vector_load_must_be_aligned_to_its_size(cupy):
    f = kernel(cupy, "float v[4]; load4(x + 4 * threadIdx.x, v); y[threadIdx.x] = v[0] + v[3];")
    x = cupy.asarray(np.arange(132, dtype=np.float32))  # [132]
    assert np.array_equal(launch(cupy, f, 1, 32, x), np.arange(0, 128, 4) * 2 + 3)
    with pytest.raises(AssertionError, match="misaligned address"):
        launch(cupy, f, 1, 32, x[1:])  # 4 bytes past a 16-byte boundary
    half = cupy.RawModule(code=cuda.SHARED + 'extern "C" __global__ void k(const unsigned short* x, float* y) { '
                          'float v[4]; load4(x + 4 * threadIdx.x, v); y[threadIdx.x] = v[3]; }',
                          options=cuda.OPTIONS).get_function("k")
    h = cupy.asarray(np.arange(132, dtype=np.float16))  # [132]
    assert np.array_equal(launch(cupy, half, 1, 32, h), np.arange(3, 128, 4))
    for offset in (1, 2):  # float16 four at a time: 8 bytes
        with pytest.raises(AssertionError, match="misaligned address"):
            launch(cupy, half, 1, 32, h[offset:])


COUNTED = "template <typename T> __device__ T counted() { __shared__ T c; T was = c; c = 7; return was; }\n"


def test_shared_memory_starts_as_garbage_in_every_block(cupy):
    f = kernel(cupy, """__shared__ int n; extern __shared__ float s[];
                        if (threadIdx.x == 0) { y[3 * blockIdx.x] = n; y[3 * blockIdx.x + 1] = s[0];
                                                y[3 * blockIdx.x + 2] = counted<float>(); }
                        __syncthreads(); n = 7; s[0] = 7.0f;""", before=COUNTED)
    got = launch(cupy, f, 3, 32, cupy.asarray(np.zeros(1, np.float32)), shared_mem=4)[:9]
    assert np.array_equal(got[0::3], [-1] * 3) and np.isnan(got[1::3]).all() and np.isnan(got[2::3]).all(), got
    # a template's statics are each library's own: another library's kernel finds garbage, not this one's 7
    other = kernel(cupy, "if (threadIdx.x == 0) y[blockIdx.x] = counted<float>();",
                   before=COUNTED + "__device__ int unlike_the_first;\n")
    assert np.isnan(launch(cupy, other, 2, 32, cupy.asarray(np.zeros(1, np.float32)))[:2]).all()


@pytest.mark.parametrize("body, right", [
    ("__shared__ float s; if (threadIdx.x == 0) s = x[0]; y[i] = s;", [1] * 128),  # no barrier after the write
    ("y[i] = 1.0f; if (threadIdx.x) y[i] = y[i - 1] + 1.0f;", [*range(1, 65)] * 2),  # another thread's
    ("y[i] = blockIdx.x ? y[63] + 1.0f : 1.0f;", [1] * 64 + [2] * 64),  # another block's
], ids=["a-shared-write", "a-thread-before", "a-block-before"])
def test_a_read_of_what_another_thread_writes_without_a_barrier_fails_in_one_of_two_launches(cupy, body, right):
    """right: what the kernel gives with a barrier between the write and the read. Another
    kernel's launches in between: each kernel takes its own turns."""
    module = cupy.RawModule(code=cuda.SHARED + 'extern "C" __global__ void other(float* y) { y[threadIdx.x] = 0; }\n'
                            'extern "C" __global__ void k(const float* x, float* y) { '
                            f'int i = blockIdx.x * 64 + threadIdx.x; {body} }}', options=cuda.OPTIONS)
    f, other = module.get_function("k"), module.get_function("other")
    x = cupy.asarray(np.ones(1, np.float32))
    runs = []
    for _ in range(2):
        other((1,), (32,), (cupy.empty(32, np.float32),))
        runs.append(launch(cupy, f, 2, 64, x))
    assert any(np.array_equal(r, right) for r in runs) and not all(np.array_equal(r, right) for r in runs), runs


def test_the_same_reads_behind_a_barrier_pass_in_either_order(cupy):
    f = kernel(cupy, "__shared__ float s; if (threadIdx.x == 0) s = x[0]; __syncthreads(); "
                     "y[blockIdx.x * 64 + threadIdx.x] = s;")
    x = cupy.asarray(np.ones(1, np.float32))
    for _ in range(2):
        assert np.array_equal(launch(cupy, f, 2, 64, x), np.ones(128))


def test_a_shuffle_gets_garbage_from_a_lane_that_has_returned_and_its_vote_is_zero(cupy):
    x = cupy.asarray(np.ones(64, np.float32))
    whole = kernel(cupy, "y[threadIdx.x] = warp_sum(x[threadIdx.x]);")
    assert np.array_equal(launch(cupy, whole, 1, 64, x), np.full(64, 32.0))
    got = launch(cupy, kernel(cupy, "if (threadIdx.x == 40) return; y[threadIdx.x] = warp_sum(x[threadIdx.x]);"),
                 1, 64, x)
    assert np.array_equal(got[:32], np.full(32, 32.0)) and np.isnan(np.delete(got[32:], 8)).all(), got
    assert np.isnan(launch(cupy, whole, 1, 48, x)[32:48]).all()  # a warp of 16 lanes: the other 16 do not exist
    votes = kernel(cupy, "if (threadIdx.x % 32 >= 16) return; "
                         "y[threadIdx.x] = __ballot_sync(0xffffffffu, 1) == 0xffffu;")
    assert np.array_equal(launch(cupy, votes, 1, 64, x).reshape(2, 32)[:, :16], np.ones((2, 16)))


def test_a_block_over_its_launch_bounds_or_a_gpus_limits_is_not_launched(cupy):
    x = cupy.asarray(np.ones(1, np.float32))
    bounded = kernel(cupy, "y[threadIdx.x] = x[0];", bounds="__launch_bounds__(2 * 64, 3)")
    assert np.array_equal(launch(cupy, bounded, 1, 128, x), np.ones(128))
    with pytest.raises(RuntimeError, match="at most 128 threads"):
        launch(cupy, bounded, 1, 160, x)
    unbounded = kernel(cupy, "y[threadIdx.x] = x[0];")
    with pytest.raises(RuntimeError, match="at most 1024 threads"):
        launch(cupy, unbounded, 1, 1056, x)
    with pytest.raises(RuntimeError, match="49152 bytes"):
        launch(cupy, unbounded, 1, 32, x, shared_mem=48 * 1024 + 4)


def test_a_kernels_arguments_must_be_of_its_parameters_types_as_cupy_passes_them(cupy):
    f = cupy.RawModule(code='extern "C" __global__ void k(const float* x, int n, float* y) { y[0] = x[0] * n; }',
                       options=cuda.OPTIONS).get_function("k")
    x, y = cupy.asarray(np.full(1, 3, np.float32)), cupy.empty(1, np.float32)
    f((1,), (32,), (x, np.int32(2), y))
    assert y.get()[0] == 6
    with pytest.raises(TypeError, match="CuPy passes 2 as int64"):  # 8 bytes where the kernel reads 4
        f((1,), (32,), (x, 2, y))
    with pytest.raises(TypeError, match="n is int"):
        f((1,), (32,), (x, np.float32(2), y))
    with pytest.raises(TypeError, match="x is const float"):
        f((1,), (32,), (x.astype(np.float16), np.int32(2), y))
    wide = cupy.RawModule(code='extern "C" __global__ void k(unsigned long long n, unsigned short h, float* y) '
                          '{ y[0] = n >> 32; y[1] = n & 0xffffffffull; y[2] = h; }', options=cuda.OPTIONS
                          ).get_function("k")
    wide((1,), (32,), (np.uint64(5 << 32 | 7), np.float16(1.0), y3 := cupy.empty(3, np.float32)))
    assert np.array_equal(y3.get(), [5, 7, 0x3c00])  # (float16's 1.0 is the bits 0x3c00)


def test_a_multiply_add_rounds_twice_unless_the_source_says_fmaf(cupy):
    """(1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 (a tie, to even): less that, 0 when
    rounded twice, 2^-24 when fused. NVRTC would fuse the first too but for --fmad=false."""
    f = kernel(cupy, "y[0] = x[0] * x[1] + x[2]; y[1] = fmaf(x[0], x[1], x[2]);")
    a = np.float32(1 + 2.0 ** -12)
    x = cupy.asarray(np.array([a, a, -(a * a)], np.float32))
    assert launch(cupy, f, 1, 32, x)[:2].tolist() == [0.0, 2.0 ** -24]
    with pytest.raises(ValueError, match="--fmad=false only"):  # a module that a GPU would round otherwise
        cupy.RawModule(code=cuda.SHARED + 'extern "C" __global__ void k(float* y) { }')
