"""CUDA C of our own, compiled where it runs: what the GPU's kernels share.

On a GPU every CuPy call costs the host 12-20 us to launch (an H100, an H200), and a GPT-2
step is hundreds of them, so the host, not the GPU, sets the pace. The cure
(cuda_graphs.py) is to record a whole step once as a CUDA graph and replay it with one
call. A few of a step's operations are kernels of our own for it, in CUDA C: the products
(cuda_matmul.py), since CuPy switches cuBLAS off while a stream is recording
(cupy/cupy#6290); attention (cuda_ops.py), since kv_cache.attend shapes it on the host
from each row's length; and layer norm and each product's bias, GELU and residual, so that
a dozen launches become one. Each is source text that NVRTC, CUDA's runtime compiler,
compiles on first use (CuPy's RawModule; it caches the result on disk).

This file holds what they share: float16 loaded and stored through float32 (every sum is
float32, as in gpt2.py), and sums across a warp or a block in a fixed tree, so that a
row's outputs are the same bits whatever else the launch computes. NVRTC is a library, so
`check` compiles a source without a GPU: a test catches a typo on any machine that has
CuPy, before a GPU ever sees it.
"""
import functools

import numpy as np

ARCH = "compute_80"  # the virtual architecture a check compiles for: A100, H100 and H200 run it
# NVRTC fuses a * b + c into one rounding (an FMA) wherever it sees fit unless told not to, and
# where it does may differ between a kernel's variants (a row alone, rows together) or from the
# CPU's emulation of them. Every multiply-add a sum's order rests on is written as fmaf; nothing
# else is fused, so each kernel rounds as its source reads, in every variant and on a CPU.
OPTIONS = ("--fmad=false",)

SHARED = r"""
#define NEG_INF __int_as_float(0xff800000)  // -infinity, without math.h
// float16 as its bits (unsigned short) so that no header is needed; arithmetic in float32
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const unsigned short* p) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p)); return f;
}
__device__ __forceinline__ void store(float* p, float f) { *p = f; }
__device__ __forceinline__ void store(unsigned short* p, float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); *p = h;
}

// four consecutive values (16 bytes of float32, 8 of float16) in one load: p aligned to them
__device__ __forceinline__ void load4(const float* p, float* f) {
    float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}
__device__ __forceinline__ void load4(const unsigned short* p, float* f) {
    uint2 v = *reinterpret_cast<const uint2*>(p);
    unsigned short h[4] = {(unsigned short)(v.x & 0xffffu), (unsigned short)(v.x >> 16),
                           (unsigned short)(v.y & 0xffffu), (unsigned short)(v.y >> 16)};
    for (int i = 0; i < 4; i++) f[i] = load(h + i);
}

// the sum of a warp's 32 values, in every lane: the same tree of additions every time
__device__ __forceinline__ float warp_sum(float s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}
__device__ __forceinline__ float warp_max(float s) {
    for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
}

// the sum (max) of a block's values, in every thread; part: 32 floats of shared memory.
// Every warp adds the same parts in the same order, so every thread holds the same bits.
__device__ float block_sum(float s, float* part) {
    int lane = threadIdx.x % 32, n_warps = (blockDim.x + 31) / 32;
    s = warp_sum(s);
    __syncthreads();  // part may still be read by an earlier call
    if (lane == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    return warp_sum(lane < n_warps ? part[lane] : 0.0f);
}
__device__ float block_max(float s, float* part) {
    int lane = threadIdx.x % 32, n_warps = (blockDim.x + 31) / 32;
    s = warp_max(s);
    __syncthreads();
    if (lane == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    return warp_max(lane < n_warps ? part[lane] : NEG_INF);
}
"""


def suffix(dtype):
    """The kernel name's ending for the activations' dtype: _f32 or _f16."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float16):
        raise TypeError(f"the GPU's kernels run float32 and float16, not {dtype}")
    return "_f32" if dtype == np.float32 else "_f16"


@functools.cache
def module(source):
    """source (SHARED is prepended) compiled for this GPU: a cupy.RawModule."""
    import cupy
    return cupy.RawModule(code=SHARED + source, options=OPTIONS)


@functools.cache
def function(source, name, dtype=None):
    """The kernel `name` from source, for activations of dtype where it has one for each
    (looked up once: a lookup costs the host a driver call)."""
    return module(source).get_function(name if dtype is None else name + suffix(dtype))


def check(source):
    """Compile source with NVRTC for ARCH, on any machine (no GPU or driver needed); a
    RuntimeError carries NVRTC's log. Needs CuPy's NVRTC (pip install cupy-cuda12x)."""
    from cupy_backends.cuda.libs import nvrtc
    program = nvrtc.createProgram(SHARED + source, "check.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={ARCH}", *OPTIONS])
    except Exception as e:
        raise RuntimeError(f"{e}\n{nvrtc.getProgramLog(program)}") from None
    finally:
        nvrtc.destroyProgram(program)
