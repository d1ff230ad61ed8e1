// CUDA C on a CPU, for tests/cuda_on_cpu.py: what our kernels (kernels/cuda*.py) use of CUDA,
// with a block's threads as std::threads, __syncthreads as a std::barrier, a warp's shuffles
// through a barrier of its 32 threads, atomics as std::atomic_ref. Blocks run one after
// another, so __shared__ (a static here) is the running block's. It checks what a kernel
// computes; not its speed, nor a race the GPU's weaker memory ordering would expose, nor the
// GPU's own arithmetic (flush-to-zero, the last bit of expf).
#pragma once
#include <math.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned int x, y; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
char* dynamic_shared;  // extern __shared__ arrays point here (cuda_on_cpu.py rewrites them)

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __launch_bounds__(threads)

struct Block {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<unsigned long long> lanes;  // each thread's value in a warp's exchange
    std::atomic<int> any{0};
};
Block* block;

inline void __syncthreads() { block->all->arrive_and_wait(); }

inline int __syncthreads_or(int p) {
    __syncthreads();
    if (p) block->any.fetch_or(1);
    __syncthreads();
    int r = block->any.load();
    __syncthreads();
    if (threadIdx.x == 0) block->any.store(0);  // before anyone's next call passes its first barrier
    return r;
}

// thread threadIdx.x's value v, and the one lane `from` of its warp gave
template <typename T> inline T exchange(T v, int from) {
    int warp = threadIdx.x / 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    block->lanes[threadIdx.x] = bits;
    block->warps[warp]->arrive_and_wait();
    bits = block->lanes[warp * 32 + from];
    block->warps[warp]->arrive_and_wait();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) { return exchange(v, (threadIdx.x % 32) ^ o); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int o) {
    int lane = threadIdx.x % 32;
    return exchange(v, lane >= o ? lane - o : lane);
}
inline unsigned int __ballot_sync(unsigned, int p) {
    unsigned int mask = 0;
    for (int lane = 0; lane < 32; lane++)
        if (exchange(p ? 1 : 0, lane)) mask |= 1u << lane;
    return mask;
}

template <typename T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
inline int atomicMin(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old > v && !a.compare_exchange_weak(old, v)) {}
    return old;
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned long long __double2ull_rn(double x) { return (unsigned long long)nearbyint(x); }
inline int __ffs(unsigned int x) { return __builtin_ffs(x); }
using std::max;
using std::min;

// the kernel call f over a grid of gx blocks of bx threads, with shmem bytes of dynamic shared memory
void launch(int gx, int bx, int shmem, std::function<void()> f) {
    std::vector<char> shared(shmem + 16);  // never empty: a kernel without any still gets a pointer
    dynamic_shared = shared.data();
    blockDim.x = bx;
    gridDim.x = gx;
    for (int b = 0; b < gx; b++) {
        Block one;
        one.all = std::make_unique<std::barrier<>>(bx);
        for (int w = 0; w * 32 < bx; w++)
            one.warps.push_back(std::make_unique<std::barrier<>>(std::min(32, bx - w * 32)));
        one.lanes.assign(bx, 0);
        block = &one;
        std::vector<std::thread> threads;
        for (int t = 0; t < bx; t++)
            threads.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = b;
                f();
                block->warps[t / 32]->arrive_and_drop();  // a thread that has returned waits on no barrier
                block->all->arrive_and_drop();
            });
        for (auto& thread : threads) thread.join();
    }
}
