// CUDA C on a CPU, for tests/cuda_on_cpu.py: what our kernels (kernels/cuda*.py) use of CUDA.
// A block's threads are fibers on one CPU thread, __syncthreads and a warp's shuffles and
// ballots are barriers between them, atomics are std::atomic_ref. Blocks run one after
// another, so __shared__ (a static here) is the running block's. A GPU runs a block's warps and
// a grid's blocks in no set order, so each kernel's launches take turns: the last block and the
// last thread first, then the first first; a thread that reads what another writes with no
// barrier between them, or a block what another block writes, fails one of the two. Where a
// GPU stops a launch, it fails it (a load at an address not a multiple of its alignment), and
// where a GPU's value is undefined, it gives garbage (shared memory at a block's start, a
// shuffle's value from a lane that has returned). It checks what a kernel computes; not its
// speed, nor a race the GPU's weaker memory ordering alone would expose, nor the GPU's own
// arithmetic (flush-to-zero, the last bit of expf). x86-64 only (the fiber switch).
#pragma once
#include <math.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <cstdint>
#include <vector>
#include <sys/mman.h>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
dim3 threadIdx, blockIdx;  // the running fiber's
dim3 blockDim, gridDim;
char* dynamic_shared;  // extern __shared__ arrays point here (cuda_on_cpu.py rewrites them)

// what a GPU would stop the launch for (its error stays with the context: a CUDA error is
// "sticky"), the first of them; launch returns it
enum Fault { NONE, DEADLOCK, NO_STACKS, MISALIGNED };
Fault fault;
inline void fail(Fault f) { if (fault == NONE) fault = f; }

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
// a load is one instruction: its address must be a multiple of its type's alignment (16 bytes
// for a float4). cuda_on_cpu.py rewrites `*reinterpret_cast<const T*>(p)` into this.
template <typename T> inline T vector_load(const void* p) {
    if ((uintptr_t)p % alignof(T)) fail(MISALIGNED);
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
// the library's __shared__ statics (cuda_on_cpu.py finds them in its symbol table, each time
// it loads the library), which each block starts by filling with garbage
std::vector<std::pair<char*, size_t>> shared_statics;
extern "C" void cuda_on_cpu_shared(char** at, size_t* bytes, int n) {
    shared_statics.clear();
    for (int i = 0; i < n; i++) shared_statics.emplace_back(at[i], bytes[i]);
}
#define __launch_bounds__(...)

// A block's threads are fibers: each runs on a stack of its own until it waits at a barrier,
// then hands the CPU to the next (a few instructions: `cuda_on_cpu_switch` below), so a
// barrier costs no system call and a launch starts no thread. Group 0 is the block's barrier
// (__syncthreads), group 1 + w warp w's (its shuffles and ballots).
enum State { RUNNABLE, WAITING, DONE };
struct Fiber { void* sp; State state; int group; };
std::vector<Fiber> fibers;
std::vector<char*> stacks;  // each below a page that faults: a fiber that overflows its stack crashes
std::vector<int> live, arrived;  // per group: its threads still running, and those waiting at its barrier
std::vector<unsigned long long> lanes;  // each thread's value in a warp's exchange
void* scheduler_sp;
int running;
std::function<void()>* kernel;
constexpr size_t STACK_BYTES = 256 * 1024;

// saves the callee-saved registers and the stack pointer in *from, and resumes the fiber whose
// stack pointer is to (the x86-64 System V ABI: what a function call must preserve)
extern "C" void cuda_on_cpu_switch(void** from, void* to);
asm(R"(
.text
.globl cuda_on_cpu_switch
.type cuda_on_cpu_switch, @function
cuda_on_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");

inline void release(int g) {  // a barrier whose every live thread has arrived lets them go on
    if (live[g] > 0 && arrived[g] == live[g]) {
        arrived[g] = 0;
        for (auto& f : fibers)
            if (f.state == WAITING && f.group == g) f.state = RUNNABLE;
    }
}

inline void arrive_and_wait(int g) {
    Fiber& me = fibers[running];
    me.state = WAITING;
    me.group = g;
    arrived[g]++;
    release(g);
    if (me.state == WAITING) cuda_on_cpu_switch(&me.sp, scheduler_sp);
}

[[noreturn]] void fiber_main() {
    (*kernel)();
    Fiber& me = fibers[running];
    me.state = DONE;
    live[0]--;  // a thread that has returned waits on no barrier
    live[1 + running / 32]--;
    release(0);
    release(1 + running / 32);
    void* unused;
    cuda_on_cpu_switch(&unused, scheduler_sp);
    __builtin_unreachable();
}

inline void __syncthreads() { arrive_and_wait(0); }

inline int any_flag = 0;
inline int __syncthreads_or(int p) {
    __syncthreads();
    if (p) any_flag = 1;
    __syncthreads();
    int r = any_flag;
    __syncthreads();
    any_flag = 0;  // by every thread (one may have returned): before anyone's next call passes its first barrier
    return r;
}

inline bool running_lane(int t) { return t < (int)blockDim.x && fibers[t].state != DONE; }

// thread threadIdx.x's value v, and the one lane `from` of its warp gave: garbage where that
// lane has returned or the block has no such thread (undefined on a GPU)
template <typename T> inline T exchange(T v, int from) {
    int warp = threadIdx.x / 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    lanes[threadIdx.x] = bits;
    arrive_and_wait(1 + warp);
    bits = running_lane(warp * 32 + from) ? lanes[warp * 32 + from] : ~0ull;
    arrive_and_wait(1 + warp);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) { return exchange(v, (threadIdx.x % 32) ^ o); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int o) {
    int lane = threadIdx.x % 32;
    return exchange(v, lane >= o ? lane - o : lane);
}
inline unsigned int __ballot_sync(unsigned, int p) {  // a lane that has returned votes 0
    unsigned int mask = 0;
    for (int lane = 0; lane < 32; lane++)
        if (exchange(p ? 1 : 0, lane) == 1 && running_lane(threadIdx.x / 32 * 32 + lane)) mask |= 1u << lane;
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

// the kernel call f over a grid of gx blocks of bx threads, with shmem bytes of dynamic shared
// memory, the last block and thread first or the first first (each kernel's launches take turns:
// the header's comment says why); returns NONE, or the fault that stopped it (DEADLOCK: the
// block's threads all wait at barriers that can never open)
int launch(int gx, int bx, int shmem, bool last_first, std::function<void()> f) {
    std::vector<char> shared(shmem + 16);  // never empty: a kernel without any still gets a pointer
    dynamic_shared = shared.data();
    blockDim.x = bx;
    gridDim.x = gx;
    kernel = &f;
    fault = NONE;
    while ((int)stacks.size() < bx) {
        auto memory = (char*)mmap(nullptr, STACK_BYTES + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                  -1, 0);
        if (memory == MAP_FAILED) return NO_STACKS;
        mprotect(memory, 4096, PROT_NONE);
        stacks.push_back(memory + 4096);
    }
    lanes.assign((bx + 31) / 32 * 32, 0);
    any_flag = 0;
    for (int i = 0; i < gx; i++) {
        blockIdx.x = last_first ? gx - 1 - i : i;
        std::memset(shared.data(), 0xff, shared.size());  // garbage: NaN as float, -1 as an integer
        for (auto [at, bytes] : shared_statics) std::memset(at, 0xff, bytes);
        fibers.assign(bx, Fiber{nullptr, RUNNABLE, 0});
        int warps = (bx + 31) / 32;
        live.assign(1 + warps, 0);
        arrived.assign(1 + warps, 0);
        live[0] = bx;
        for (int t = 0; t < bx; t++) {
            live[1 + t / 32]++;
            // a fresh stack that "returns" into fiber_main, 16-byte aligned as a call leaves it
            auto top = (void**)(((uintptr_t)stacks[t] + STACK_BYTES) & ~(uintptr_t)15);
            top[-1] = nullptr;
            top[-2] = (void*)&fiber_main;
            for (int r = 3; r <= 8; r++) top[-r] = nullptr;  // the six saved registers
            fibers[t].sp = top - 8;
        }
        for (int done = 0; done < bx;) {
            bool ran = false;
            for (int j = 0; j < bx; j++) {
                int t = last_first ? bx - 1 - j : j;
                if (fibers[t].state != RUNNABLE) continue;
                running = t;
                threadIdx.x = t;
                cuda_on_cpu_switch(&scheduler_sp, fibers[t].sp);
                ran = true;
                done += fibers[t].state == DONE;
            }
            if (!ran) return DEADLOCK;
        }
    }
    return fault;
}
