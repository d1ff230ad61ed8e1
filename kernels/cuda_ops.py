"""Layer norm, attention over the cache and the transformer block as GPU kernels: a step
with the same shapes every time.

A CUDA graph (cuda_graphs.py) replays the same launches on the same buffers, so nothing in
a recorded step may depend on data the host would have to look at: not how many keys a
row has, nor which tokens are padding. kv_cache.begin_pass builds a mask and groups rows
by length on the host; here each query reads its own position from a device array instead
(the row_ops.py way: rowwise.attention), and a position of -1 marks a padding token, which
stores nothing and attends to nothing. The keys a query sees are its row's slots
0..position: the cached tokens' and this step's own, which `attend` stores as it reads them.

`layer_norm` is gpt2.layer_norm in one launch instead of eleven (a block a row, statistics
in float32 summed in a fixed tree), now used only for ln_f before the head (the blocks'
layer norms live in the products). `transformer_block` is
gpt2.transformer_block's steps, mha and ffn written out, each product with its tail and the
layer norm before it in its launch (cuda_matmul.linear), and `attend` storing the step's
keys and values as it reads them: 5 launches a layer. NumPy arrays take the NumPy reference
(`attend_reference`, gpt2's functions), so a CPU runs the bookkeeping around these kernels
with the same meaning.

Every other pass of a model in this layout (a prompt, a chunk, a pass of a shape never
recorded) runs the same kernels (`pass_ops`, through kv_cache.kernel_ops): `attention` is
`attend`'s kernel reading every key from the cache, where kv_cache.attend has stored the
pass's. Each kernel treats a row, a query, alone, so a token comes out the same bits in
whichever pass computes it.
"""
import numpy as np

import gpt2
from kernels import cuda, cuda_matmul

THREADS = 256  # a layer norm's block
# An attention block: 32 warps. A decode step at batch 1 has a block a head (12 to 25), so a
# block's loads in flight are all that streams the cache: 256 keys, 64 KiB of float32 at d_head
# 64 (one GPU memory latency a 256 keys, where 8 warps took four)
ATTEND_THREADS = 1024
ATTEND_KEYS = 8  # the keys a warp reads at once
# a row's most slots: its scores fill what its block's 48 KiB of shared memory leave (less the
# query, the warps' partial sums, and the 1 KiB the driver reserves a block from sm_80 on, which
# sm_90's machine code counts in the kernel's static size: whether a launch's 48 KiB count it too
# is not said by CUDA's documentation, so the scores never need it)
RESERVED = 1024
ATTEND_SLOTS = (48 * 1024 - RESERVED) // 4 - (256 + 32 + 256 * ATTEND_THREADS // 32)

SOURCE = f"#define WARPS {ATTEND_THREADS // 32}\n#define KEYS {ATTEND_KEYS}\n" + r"""
template <typename T>
__device__ void layer_norm_rows(const T* x, const T* g, const T* b, T* y, int n, float eps) {
    __shared__ float part[32];
    const T* xr = x + (size_t)blockIdx.x * n;
    T* yr = y + (size_t)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += load(xr + i);
    float mean = block_sum(s, part) / n;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { float d = load(xr + i) - mean; v += d * d; }
    float sd = sqrtf(block_sum(v, part) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        store(yr + i, load(g + i) * ((load(xr + i) - mean) / sd) + load(b + i));
}

// out[b, t, h] = softmax(q k^T / sqrt(D)) v over slots 0..positions[b, t] of row b's cache;
// a block a query (blockIdx.x = (b * n_tok + t) * H + h), scores in shared memory [S]. Its warps
// take the keys KEYS at a time in turn, for the scores and for the values alike: a decode step
// has a block a head, so many keys' reads must be in flight within a block for the cache to
// stream at all. With FRESH, k_new and v_new (strides as q's) are this step's keys and
// values, not yet in the cache: each block stores its own token's head in its slot (the step's
// KV write, in this launch rather than one of its own) and reads the step's tokens from k_new
// and v_new, since the blocks that store them run in no set order. A row's real tokens sit in
// consecutive slots from its first token's (cuda_graphs.step places them so): slot s >= first
// is token s - first (a query placed otherwise gets NaN). Without, every key comes from the
// cache (kv_cache.attend stored them). FRESH is a template parameter, not a flag: its code
// would cost the other kernel registers.
template <typename T, bool FRESH>
__device__ void attend(const T* q, const T* k_new, const T* v_new, long long sb, long long sh, long long st,
                       T* ck, T* cv, const long long* positions, T* out, int n_tok, int H, int S, int D,
                       float scale) {
    extern __shared__ float scores[];
    __shared__ float qs[256], part[32], sums[WARPS][256];
    int h = blockIdx.x % H, bt = blockIdx.x / H, b = bt / n_tok, t = bt % n_tok;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    long long position = positions[bt];
    T* o = out + (size_t)blockIdx.x * D;
    if (position < 0 || position >= S) {  // padding: zeros (later layers compute on them; no logits are taken there)
        for (int d = threadIdx.x; d < D; d += blockDim.x) store(o + d, 0.0f);
        return;
    }
    int p = (int)position;  // (slots in an int: fewer registers than 64-bit ones, S is at most 3,552)
    size_t at = b * sb + h * sh;  // row b's head h in q, k_new, v_new
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load(q + at + t * st + d);
    T* kc = ck + ((size_t)b * H + h) * S * D;
    T* vc = cv + ((size_t)b * H + h) * S * D;
    int first = FRESH ? (int)positions[(size_t)b * n_tok] : S;  // slots from first on: this step's tokens
    if (FRESH && p - first != t) {  // not where the step's tokens must be: NaN, loud, not another token's keys
        for (int d = threadIdx.x; d < D; d += blockDim.x) store(o + d, __int_as_float(0x7fc00000));  // NaN
        return;
    }
    auto key = [&](int s) -> const T* { return !FRESH || s < first ? kc + s * D : k_new + at + (s - first) * st; };
    auto value = [&](int s) -> const T* { return !FRESH || s < first ? vc + s * D : v_new + at + (s - first) * st; };
    if (FRESH)
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            kc[(size_t)p * D + d] = k_new[at + t * st + d];
            vc[(size_t)p * D + d] = v_new[at + t * st + d];
        }
    __syncthreads();
    for (int s0 = warp * KEYS; s0 <= p; s0 += n_warps * KEYS) {  // a warp KEYS keys at once, its lanes
        float dot[KEYS];                                              // reading each key's D values together
        #pragma unroll
        for (int k = 0; k < KEYS; k++) dot[k] = 0.0f;
        if (!FRESH || s0 + KEYS <= first) {  // all from the cache: one pointer for the KEYS keys
            const T* k0 = kc + (size_t)s0 * D;
            for (int d = lane; d < D; d += 32) {
                #pragma unroll
                for (int k = 0; k < KEYS; k++)
                    if (s0 + k <= p) dot[k] = fmaf(qs[d], load(k0 + k * D + d), dot[k]);
            }
        } else {  // this step's among them: a key at a time, from where it is (the same sums, in the same order)
            for (int k = 0; k < KEYS; k++) {
                if (s0 + k > p) break;
                const T* ks = key(s0 + k);
                for (int d = lane; d < D; d += 32) dot[k] = fmaf(qs[d], load(ks + d), dot[k]);
            }
        }
        #pragma unroll
        for (int k = 0; k < KEYS; k++) {
            float score = warp_sum(dot[k]);
            if (lane == 0 && s0 + k <= p) scores[s0 + k] = score * scale;
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int s = threadIdx.x; s <= p; s += blockDim.x) m = fmaxf(m, scores[s]);
    m = block_max(m, part);
    float z = 0.0f;
    for (int s = threadIdx.x; s <= p; s += blockDim.x) { float e = expf(scores[s] - m); scores[s] = e; z += e; }
    z = block_sum(z, part);  // its barriers also order the exponentials' stores before the reads below
    for (int s = threadIdx.x; s <= p; s += blockDim.x) scores[s] /= z;
    __syncthreads();
    float acc[8];  // lane's d = lane + 32 j, j < 8: D <= 256
    #pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
    for (int s0 = warp * KEYS; s0 <= p; s0 += n_warps * KEYS) {  // as for the scores: KEYS keys a warp
        #pragma unroll
        for (int k = 0; k < KEYS; k++) {
            if (s0 + k > p) break;
            const T* vs = value(s0 + k);
            #pragma unroll
            for (int j = 0; j < 8; j++)
                if (lane + 32 * j < D) acc[j] = fmaf(scores[s0 + k], load(vs + lane + 32 * j), acc[j]);
        }
    }
    #pragma unroll
    for (int j = 0; j < 8; j++)
        if (lane + 32 * j < D) sums[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {  // the warps' sums, in the order of the warps
        float total = 0.0f;
        for (int w = 0; w < n_warps; w++) total += sums[w][d];
        store(o + d, total);
    }
}

#define OPS(T, S)                                                                                          \
extern "C" __global__ void layer_norm##S(const T* x, const T* g, const T* b, T* y, int n, float eps) {     \
    layer_norm_rows<T>(x, g, b, y, n, eps); }                                                              \
extern "C" __global__ void __launch_bounds__(32 * WARPS) attend##S(const T* q, const T* k_new,             \
    const T* v_new, long long sb, long long sh, long long st, T* ck, T* cv, const long long* positions,     \
    T* out, int n_tok, int H, int S_, int D, float scale) {                                                \
    attend<T, true>(q, k_new, v_new, sb, sh, st, ck, cv, positions, out, n_tok, H, S_, D, scale); }          \
extern "C" __global__ void __launch_bounds__(32 * WARPS) attend_stored##S(const T* q, const T* k_new,      \
    const T* v_new, long long sb, long long sh, long long st, T* ck, T* cv, const long long* positions,     \
    T* out, int n_tok, int H, int S_, int D, float scale) {                                                \
    attend<T, false>(q, k_new, v_new, sb, sh, st, ck, cv, positions, out, n_tok, H, S_, D, scale); }
OPS(float, _f32)
OPS(unsigned short, _f16)
"""


def layer_norm(x, g, b, eps=1e-5):
    """gpt2.layer_norm over the last axis of x [..., n] in one launch."""
    if isinstance(x, np.ndarray):
        return gpt2.layer_norm(x, g, b, eps)
    import cupy
    x = cupy.ascontiguousarray(x)
    if g.dtype != x.dtype or b.dtype != x.dtype:  # the kernel reads every array as x's dtype
        raise TypeError(f"layer_norm of {x.dtype} activations with {g.dtype} / {b.dtype} weights: give all one dtype")
    out = cupy.empty_like(x)
    n = x.shape[-1]
    rows = x.size // n  # a block each
    if rows:  # (none: a pass that only caches; CuPy would still launch a block, on empty arrays' null pointers)
        cuda.function(SOURCE, "layer_norm", x.dtype)((rows,), (THREADS,), (x, g, b, out, np.int32(n), np.float32(eps)))
    return out


def attend(positions, layer, q, k, v):
    """One layer's attention in a step of static shapes, in one launch: each query over its
    row's slots up to its position [B, T] (device; -1, or past the cache: padding), its own
    token's k, v [B, n_head, T, d_head] stored in the layer's cache on the way. Returns
    [B, n_head, T, d_head] (a view of [B, T, n_head, d_head], so that gpt2.mha's transpose back
    is free)."""
    if isinstance(q, np.ndarray):
        return attend_reference(positions, layer, q, k, v)
    ck, cv = layer["k"], layer["v"]  # [B, H, S, D]
    if k.strides != q.strides or v.strides != q.strides or q.strides[3] != q.itemsize:
        raise ValueError("attend takes q, k, v as gpt2.mha makes them: views of one [B, T, 3, H, D] array")
    if not (ck.flags.c_contiguous and cv.flags.c_contiguous):
        raise ValueError("attend writes the cache's rows as one contiguous [B, H, S, D] array")
    return attend_stored(q, ck, cv, positions, ck.shape[2], new=(k, v))  # [B, H, T, D]


def attention(q, k, v, positions):
    """A pass's attention where kv_cache.attend has stored its keys (`attend` without the store):
    each query of q [B, H, T, D] over its row's slots 0..positions[b, t] (host [B, T]) of k, v,
    views [B, H, S', D] of a cache's rows (or, without a cache, the pass's own). So a token
    attends in the same bits in an eager pass (a prompt, a chunk) as in a recorded step.
    Returns [B, H, T, D]. Device arrays only (pass_ops gives the NumPy stand-in none)."""
    import cupy
    B, H, T, D = q.shape
    S = k.strides[1] // (D * k.itemsize)  # the cache's slots a row, of which k views the first S'
    if k.strides != v.strides or k.strides != (H * S * D * k.itemsize, S * D * k.itemsize, D * k.itemsize, k.itemsize):
        k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)  # a pass without a cache: its own keys
        S = k.shape[2]
    if q.strides[3] != q.itemsize:
        q = cupy.ascontiguousarray(q)
    positions = cupy.asarray(np.ascontiguousarray(positions, dtype=np.int64))  # [B, T]: the pass's, on the host
    return attend_stored(q, k, v, positions, S)  # [B, H, T, D]


def attend_stored(q, ck, cv, positions, S, new=None):
    """The attention kernel: each query of q [B, H, T, D] over its row's slots of ck, cv
    ([B, H, S, D] rows) up to positions [B, T] (device; -1 or past S: padding, zeros). new:
    (k, v) of the pass, laid out as q, which the kernel stores in ck, cv as it reads them
    (`attend`); None where the cache holds them already."""
    import cupy
    B, H, T, D = q.shape
    if D > 256:
        raise ValueError(f"attend holds a query in 256 floats of shared memory: d_head {D} is wider")
    if S > ATTEND_SLOTS:
        raise ValueError(f"attend keeps a row's scores in a block's shared memory: at most {ATTEND_SLOTS} slots, "
                         f"not {S}")
    strides = tuple(np.int64(s // q.itemsize) for s in q.strides[:3])  # of q (and new's), in elements
    sizes = (np.int32(T), np.int32(H), np.int32(S), np.int32(D))
    out = cupy.empty((B, T, H, D), q.dtype)  # [B, T, H, D]
    scale = np.float32(1.0 / np.sqrt(D))
    k, v = (q, q) if new is None else new  # (q: a pointer the kernel never reads without new)
    if B * T:
        kernel = cuda.function(SOURCE, "attend_stored" if new is None else "attend", q.dtype)
        kernel((B * T * H,), (ATTEND_THREADS,),  # a block a query, S scores in shared memory
               (q, k, v, *strides, ck, cv, positions, out, *sizes, scale), shared_mem=4 * S)
    return out.transpose(0, 2, 1, 3)  # [B, H, T, D]


def pass_ops(model):
    """(layer_norm, attention, transformer_block) of these kernels for every pass of a model in
    the GPU's own layout (layout.device_layout, on a GPU): with them and cuda_matmul's products,
    a token's keys, values and logits are the same bits whatever else its pass holds, a prompt
    whole or in chunks, a recorded step or an eager pass (chunked prefill and the prefix cache
    rely on it, as on the CPU: rowwise.row_ops_for). None elsewhere, the NumPy stand-in included."""
    params = model[0]
    if isinstance(params["wpe"], np.ndarray) or not params.get("blocks"):
        return None
    w = params["blocks"][0]["mlp"]["c_fc"]["w"]  # (not wte, which may be a draft's vocabulary subset)
    return (layer_norm, attention, transformer_block) if isinstance(w, cuda_matmul.Matrix) else None


def attend_reference(positions, layer, q, k, v):
    """What `attend` computes, in NumPy: the stand-in on a CPU, and what a GPU test compares
    with. As the kernel: a query at slot p of a row whose step begins at slot `first` sees the
    cache's slots before first and the step's own tokens 0..p - first; one not at first + t
    (its row's run of slots broken) gets NaN and stores nothing."""
    B, H, T, D = q.shape
    out = np.zeros_like(q)  # [B, H, T, D]
    S = layer["k"].shape[2]
    real = [(b, t, int(positions[b, t])) for b in range(B) for t in range(T) if 0 <= positions[b, t] < S]
    for b, t, p in real:
        first = int(positions[b, 0])
        if p - first != t:
            out[b, :, t] = np.nan
            continue
        keys = np.concatenate([layer["k"][b, :, :first], k[b, :, :t + 1]], axis=1)  # [H, p + 1, D]
        values = np.concatenate([layer["v"][b, :, :first], v[b, :, :t + 1]], axis=1)  # [H, p + 1, D]
        # [H, 1, D] against [H, p + 1, D] -> [H, D]; mask 0: the keys are cut at p already
        out[b, :, t] = gpt2.attention(q[b, :, t, None], keys, values, np.float32(0.0))[:, 0]
    for b, t, p in real:  # stored after every query has read (the kernel reads no cache slot past first)
        if p - int(positions[b, 0]) == t:
            layer["k"][b, :, p], layer["v"][b, :, p] = k[b, :, t], v[b, :, t]
    return out


def transformer_block(x, mlp, attn, ln_1, ln_2, n_head, attend, norm=None):
    """gpt2.transformer_block's steps, mha and ffn written out, each product's tail and the
    layer norm before it in the product's own launch (cuda_matmul.linear: the layer norm as
    its inputs are read; the bias, the GELU, the residual add as its outputs are stored): 5
    launches a layer where gpt2.transformer_block, given the layer norm and attention kernels,
    makes about 22; a recorded step is bound by its launches. (norm, the pass's layer norm,
    which gpt2.gpt2 hands every block, is not called: the products normalize.)"""
    B, T, n_embd = x.shape
    qkv = cuda_matmul.linear(x, **attn["c_attn"], norm=ln_1)  # linear(layer_norm(x))  [B, T, 3*n_embd]
    q, k, v = qkv.reshape(B, T, 3, n_head, n_embd // n_head).transpose(2, 0, 3, 1, 4)  # [B, n_head, T, d_head] each
    heads = attend(q, k, v).transpose(0, 2, 1, 3).reshape(B, T, n_embd)  # [B, T, n_embd]
    x = cuda_matmul.linear(heads, **attn["c_proj"], residual=x)  # x + mha(...)  [B, T, n_embd]
    h = cuda_matmul.linear(x, **mlp["c_fc"], gelu=True, norm=ln_2)  # gelu(linear(layer_norm(x)))  [B, T, 4*n_embd]
    return cuda_matmul.linear(h, **mlp["c_proj"], residual=x)  # x + ffn(...)  [B, T, n_embd]
