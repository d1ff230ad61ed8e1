"""Sampling on a GPU in two launches: sampling.py's distribution and its draw, row by row;
speculative decoding's verification in two more.

Eagerly, sampling.probabilities is a dozen CuPy operations (temperature, a partition for
top-k, a sort, a cumulative sum and a scatter for top-p, softmaxes) and sampling.sample
another dozen with four waits for the device, each operation ~12 us of the host's time
(`python benchmark.py --backend cupy` prints it): as much as the launches of a recorded
step (cuda_graphs.py). Here, after the penalties, each is one kernel, a block of 1024
threads a row:

- `distribution`: after the penalties (CuPy's operations: they read the host's counts),
  temperature, top-k, top-p and min-p as sampling.py applies them, and the softmax
  (`distribution_rows`: each row under settings of its own, read from the device).
  top-k and top-p need no sort. Both ask for the smallest value w such that the weight of
  the values up to w exceeds a target (top-k: a count, the (n - k)-th value ascending;
  top-p: probability mass, transformers' cumulative sum from the least likely crossing
  1 - top_p), and a radix select answers it in four passes over the row: a histogram of
  each value's next 8 bits (floats ordered as unsigned integers), then the bucket where the
  running weight crosses. Masses are summed as integers (2^-52 units), so the histograms
  come out the same whatever order the threads add in, and a row's distribution the same
  bits every time. Tokens tied with w go in transformers' order (its stable sort: lower ids
  first): a further select, over their ids, finds where the cut falls among them.
- `sample`: sampling.sample's inversion of the CDF at u (float64 running sums, a prefix
  sum across the block), and -1 for a row that is not a distribution.
- `verify`: speculative.verify, the drafts' acceptance tests and the residual max(0, p - q)
  in one launch, then `sample`'s draw from it: two launches (`accept`, which a recorded
  verification holds), one copy each way, where speculative.py's NumPy operations on device
  arrays would be ~25 calls into CuPy.

The distribution's bits can differ from NumPy's in the last place (exp, and sums added in
another order), so a token whose cumulative mass falls within rounding of top_p's cut
may be kept on one and not the other, and a draw at u within rounding of a token's
cumulative mass may take its neighbour. CuPy compiles with flush-to-zero, so a
probability below float32's smallest normal number (1.2e-38) counts as 0 on a GPU.
tests/test_cuda_kernels.py compares the kernels with sampling.py, on a GPU and on a CPU.
"""
import numpy as np

from kernels import cuda

THREADS = 1024  # a block a row: 50257 tokens are 50 a thread
MASS = 2.0 ** 52  # a probability's integer units in the top-p select: sums of <= 1 fit in 64 bits

SOURCE = f"#define THREADS {THREADS}\n#define MASS {MASS!r}\n" + r"""
#define FULL 0xffffffffu
typedef unsigned long long u64;

// floats as unsigned ints in the same order (-inf lowest), and back
__device__ __forceinline__ unsigned int key_of(float x) {
    unsigned int u = __float_as_uint(x + 0.0f);  // -0 as +0: equal floats, equal keys
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float value_of(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The smallest key w among elements i < n with in(i) whose weights up to w sum past target:
// sum_{in(i), key(i) <= w} weight(i) > target. Returns 0 where none does (the weights of all
// sum to at most target); else 1, with *w and *below = the weight of keys < w. Four passes of
// 8 bits each; hist is 256 u64 of shared memory. Every thread returns the same.
template <typename In, typename Key, typename Weight>
__device__ int select_crossing(int n, In in, Key key, Weight weight, u64 target, u64* hist,
                               unsigned int* w, u64* below) {
    __shared__ unsigned int prefix_s;
    __shared__ u64 below_s;
    __shared__ int crossed_s;
    unsigned int prefix = 0, mask = 0;
    __syncthreads();  // a call before may still be reading the three (a second call of this instantiation)
    if (threadIdx.x == 0) { prefix_s = 0; below_s = 0; crossed_s = 1; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // a thread's run of weights into one bucket goes in one atomic: near values share their
        // top bits, and 50257 atomics on one address would wait on each other
        int run = -1;
        u64 run_weight = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (!in(i)) continue;
            unsigned int k = key(i);
            if ((k & mask) != prefix) continue;
            int bucket = (k >> shift) & 255u;
            if (bucket != run) {
                if (run_weight) atomicAdd(&hist[run], run_weight);  // integers: any order, the same sum
                run = bucket;
                run_weight = 0;
            }
            run_weight += weight(i);
        }
        if (run_weight) atomicAdd(&hist[run], run_weight);
        __syncthreads();
        if (threadIdx.x < 32) {  // a warp finds the bucket: 8 a lane, a scan across lanes
            int lane = threadIdx.x;
            u64 s = 0;
            for (int j = 0; j < 8; j++) s += hist[lane * 8 + j];
            u64 inclusive = s;
            for (int o = 1; o < 32; o <<= 1) {
                u64 t = __shfl_up_sync(FULL, inclusive, o);
                if (lane >= o) inclusive += t;
            }
            u64 base = below_s;
            unsigned int crossing = __ballot_sync(FULL, base + inclusive > target);
            if (crossing == 0) {
                if (lane == 0) crossed_s = 0;
            } else if (lane == __ffs(crossing) - 1) {
                u64 at = base + inclusive - s;
                int b = lane * 8;
                while (at + hist[b] <= target) at += hist[b++];
                prefix_s = prefix | ((unsigned int)b << shift);
                below_s = at;
            }
        }
        __syncthreads();
        if (!crossed_s) return 0;
        prefix = prefix_s;
        mask |= 255u << shift;
    }
    *w = prefix;
    *below = below_s;
    return 1;
}

// the row's largest value and its first index (np.argmax), in every thread
__device__ void block_argmax(const float* x, int n, float t, float* m, int* at) {
    __shared__ float vs[32];
    __shared__ int is[32];
    float v = NEG_INF;
    int i_best = n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float xi = x[i] / t;
        if (xi > v || (i_best == n && xi == v)) { v = xi; i_best = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL, v, o);
        int oi = __shfl_xor_sync(FULL, i_best, o);
        if (ov > v || (ov == v && oi < i_best)) { v = ov; i_best = oi; }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { vs[threadIdx.x / 32] = v; is[threadIdx.x / 32] = i_best; }
    __syncthreads();
    v = NEG_INF;
    i_best = n;
    for (int j = 0; j < blockDim.x / 32; j++)
        if (vs[j] > v || (vs[j] == v && is[j] < i_best)) { v = vs[j]; i_best = is[j]; }
    *m = v;
    *at = i_best;
}

// p[r] = the distribution sampling.probabilities draws from, for logits[r] (penalties applied):
// greedy: one-hot at the first largest; else x = logits / temperature, then top_k (0: off), top-p
// (thr = float32(1 - top_p), 0: off), min_p (0: off), softmax. p holds exp(x - max) on the way.
__device__ void distribution_of(const float* x, float* pr, int n, int greedy, float temperature, int top_k,
                                float thr, float min_p) {
    __shared__ u64 hist[256];
    __shared__ float part[32];
    float m;
    int first;
    block_argmax(x, n, greedy ? 1.0f : temperature, &m, &first);
    if (greedy) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) pr[i] = i == first ? 1.0f : 0.0f;
        return;
    }
    // top-k: keep x >= the k-th largest, the (n - k)-th ascending (0-based)
    unsigned int kth = 0;
    u64 below;
    if (top_k > 0 && top_k < n)
        select_crossing(n, [&](int i) { return true; }, [&](int i) { return key_of(x[i] / temperature); },
                        [&](int i) { return (u64)1; }, (u64)(n - top_k), hist, &kth, &below);
    float z = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float xi = x[i] / temperature;
        float e = key_of(xi) >= kth ? expf(xi - m) : 0.0f;
        pr[i] = e;
        z += e;
    }
    z = block_sum(z, part);  // its barriers order the stores above before the reads below
    if (thr > 0.0f) {  // top-p: drop the least likely while their cumulative mass stays <= thr
        auto key = [&](int i) { return key_of(x[i] / temperature); };
        auto mass = [&](float e) { return (u64)__double2ull_rn((double)(e / z) * MASS); };
        unsigned int w, cut;
        u64 w_below, ids_below;
        unsigned int first_kept = 0;  // the lowest id kept among the tokens tied at w
        u64 target = (u64)__double2ull_rn((double)thr * MASS);
        if (select_crossing(n, [&](int i) { return true; }, key, [&](int i) { return mass(pr[i]); }, target, hist,
                            &w, &w_below)) {
            u64 each = mass(expf(value_of(w) - m));  // the mass of each token tied at w
            u64 dropped = (target - w_below) / each;  // the first ids tied at w
            if (dropped > 0 &&
                select_crossing(n, [&](int i) { return key(i) == w; }, [&](int i) { return (unsigned int)i; },
                                [&](int i) { return (u64)1; }, dropped - 1, hist, &cut, &ids_below))
                first_kept = cut + 1;
        } else {  // everything sums to <= thr: only the last of the ascending order stays (transformers)
            w = key_of(m);
            first_kept = 0;
            __shared__ int last_s;
            if (threadIdx.x == 0) last_s = -1;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x)
                if (key(i) == w) atomicMax(&last_s, i);
            __syncthreads();
            first_kept = last_s;
        }
        float z2 = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned int k = key(i);
            if (k < w || (k == w && (unsigned int)i < first_kept)) pr[i] = 0.0f;
            z2 += pr[i];
        }
        z = block_sum(z2, part);
    }
    if (min_p > 0.0f) {  // drop what is less likely than min_p times the most likely (exp(0) / z)
        float floor_p = min_p * (1.0f / z), z3 = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (pr[i] / z < floor_p) pr[i] = 0.0f;
            z3 += pr[i];
        }
        z = block_sum(z3, part);
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) pr[i] = pr[i] / z;
}

// every row under the same settings
extern "C" __global__ void __launch_bounds__(THREADS) distribution(const float* logits, float* p, int n, int greedy,
                                                                   float temperature, int top_k, float thr,
                                                                   float min_p) {
    size_t r = blockIdx.x;
    distribution_of(logits + r * n, p + r * n, n, greedy, temperature, top_k, thr, min_p);
}

// row r under its own settings[r] = (greedy, temperature, top_k, thr, min_p), as float64 (each exact)
extern "C" __global__ void __launch_bounds__(THREADS) distribution_rows(const float* logits, float* p, int n,
                                                                        const double* settings) {
    size_t r = blockIdx.x;
    const double* s = settings + r * 5;
    distribution_of(logits + r * n, p + r * n, n, (int)s[0], (float)s[1], (int)s[2], (float)s[3], (float)s[4]);
}

// tokens[r] = the first token whose cumulative probability reaches u[r] times the row's total
// (float64 sums), as sampling.sample; -1 where the row holds NaN, inf or a negative, or no mass
extern "C" __global__ void __launch_bounds__(THREADS) sample(const float* p, const double* u, long long* tokens,
                                                             int n) {
    __shared__ double scan[2][THREADS];
    __shared__ int first_s, last_s;
    const float* pr = p + (size_t)blockIdx.x * n;
    int t = threadIdx.x, chunk = (n + THREADS - 1) / THREADS, lo = min(n, t * chunk), hi = min(n, lo + chunk);
    double s = 0.0;
    int bad = 0, last = -1;
    for (int i = lo; i < hi; i++) {
        float v = pr[i];
        if (!(v >= 0.0f) || v == __int_as_float(0x7f800000)) bad = 1;  // NaN, negative, inf
        else if (v > 0.0f) { s += v; last = i; }
    }
    bad = __syncthreads_or(bad);
    int any_mass = __syncthreads_or(last >= 0);
    if (t == 0) { first_s = n; last_s = -1; }
    // an inclusive prefix sum of the threads' sums, in a fixed order (Hillis and Steele)
    int from = 0;
    scan[0][t] = s;
    __syncthreads();
    for (int o = 1; o < THREADS; o <<= 1) {
        double sum = scan[from][t];
        if (t >= o) sum += scan[from][t - o];
        scan[1 - from][t] = sum;
        from = 1 - from;
        __syncthreads();
    }
    // the first token whose running sum reaches the target: a chunk's sum starts from the tree's,
    // which may differ from the chunk before's own in the last bit, so the sums need not rise
    // across chunks; the first crossing is still a token with mass, and the lowest one wins
    double target = u[blockIdx.x] * scan[from][THREADS - 1], cdf = t ? scan[from][t - 1] : 0.0;
    int first = n;
    for (int i = lo; i < hi; i++) {
        float v = pr[i];
        if (v > 0.0f) {
            cdf += v;
            if (cdf >= target) { first = i; break; }
        }
    }
    atomicMin(&first_s, first);
    atomicMax(&last_s, last);
    __syncthreads();
    if (t == 0) tokens[blockIdx.x] = bad || !any_mass ? -1 : first_s < n ? first_s : last_s;
}

// speculative.verify's tests for row b, then the row its last token is drawn from: accepted[b] =
// the drafts before the first i with u_i q_i(d_i) >= p_i(d_i) (float64, as NumPy compares) or
// i = k; out[b] = max(0, p_n - q_n) (q_n = 0 where every draft passed), or p_n where that holds
// no mass or a NaN (NumPy's sum of it is then not > 0). p [B, P, n], q [B, K, n]; draws [B, 2K+2]:
// d_1..d_K, u_1..u_K, k, v (float64, token ids exact); v[b] = the draw for the last token. With
// one_hot, q is not read: q_i is 1 at d_i, 0 elsewhere (a deterministic drafter's).
extern "C" __global__ void __launch_bounds__(THREADS) residual(const float* p, const float* q, const double* draws,
                                                               long long* accepted, float* out, double* v, int P,
                                                               int K, int n, int one_hot) {
    __shared__ int n_s;
    int b = blockIdx.x;
    const double* d = draws + (size_t)b * (2 * K + 2);
    int k = min((int)d[2 * K], K);
    if (threadIdx.x == 0) {
        int i = 0;
        for (; i < k; i++) {
            size_t token = (size_t)d[i];
            double q_d = one_hot ? 1.0 : (double)q[((size_t)b * K + i) * n + token];
            if (!(d[K + i] * q_d < (double)p[((size_t)b * P + i) * n + token]))
                break;
        }
        n_s = i;
        accepted[b] = i;
        v[b] = d[2 * K + 1];
    }
    __syncthreads();
    const float* pn = p + ((size_t)b * P + n_s) * n;
    const float* qn = n_s < k && !one_hot ? q + ((size_t)b * K + n_s) * n : nullptr;
    long long d_n = n_s < k && one_hot ? (long long)d[n_s] : -1;  // one_hot: q_n's token
    float* o = out + (size_t)b * n;
    int mass = 0, nan = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float r = pn[i] - (qn ? qn[i] : i == d_n ? 1.0f : 0.0f);
        r = r < 0.0f ? 0.0f : r;  // a NaN stays, as in np.maximum
        o[i] = r;
        mass |= r > 0.0f;
        nan |= r != r;
    }
    mass = __syncthreads_or(mass);
    nan = __syncthreads_or(nan);
    if (!mass || nan)
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = pn[i];
}
"""


def takes(x):
    """Whether these kernels sample from x: a device array where the GPU's kernels of our own
    are chosen (layout.GPU_KERNELS_ENV); everything else takes sampling.py's operations."""
    if isinstance(x, np.ndarray):
        return False
    from kernels import layout  # here: layout imports the CPU's kernels, which sampling.py does not need
    return layout.gpu_kernels()


def distribution(logits, s):
    """sampling.probabilities on the device after the penalties: logits [..., n_vocab] (their
    penalties applied) to the distribution (float32) under settings s, in one launch."""
    import cupy
    n = logits.shape[-1]
    rows = cupy.ascontiguousarray(logits.reshape(-1, n), dtype=np.float32)  # [R, n_vocab]
    p = cupy.empty_like(rows)  # [R, n_vocab]
    greedy, temperature, top_k, thr, min_p = kernel_settings(s, n)
    if rows.shape[0]:
        cuda.function(SOURCE, "distribution")((rows.shape[0],), (THREADS,), (
            rows, p, np.int32(n), np.int32(greedy), np.float32(temperature), np.int32(top_k), np.float32(thr),
            np.float32(min_p)))
    return p.reshape(logits.shape)  # [..., n_vocab]


def distribution_rows(logits, settings, out):
    """`distribution` of logits [R, n_vocab], row r under its own settings[r] (kernel_settings,
    a float64 device array [R, 5]), into out [R, n_vocab]: one launch, nothing the host waits
    for (a recorded graph's: cuda_decode_loop.py)."""
    import cupy
    R, n = logits.shape
    logits = cupy.ascontiguousarray(logits, dtype=np.float32)  # (a float16 model's: converted)
    if R:
        cuda.function(SOURCE, "distribution_rows")((R,), (THREADS,), (logits, out, np.int32(n), settings))


def kernel_settings(s, n):
    """What the distribution kernels read of settings s over n tokens: (greedy, temperature,
    top_k (0: off), thr = float32(1 - top_p) (0: off; as NumPy compares: float32), min_p)."""
    top_k = int(s.top_k) if 0 < s.top_k < n else 0
    thr = np.float32(1.0 - s.top_p) if s.top_p < 1.0 else np.float32(0.0)
    return int(s.greedy), float(np.float32(s.temperature)), top_k, float(thr), float(np.float32(s.min_p))


def sample(probs, u):
    """sampling.sample on the device: one token per row of probs [B, n_vocab] at u [B], or
    sampling.sample's ValueError for a row that is not a distribution. Returns the ids on the
    host [B]: the host waits for them here, to check them, and they leave the device once."""
    import cupy
    tokens = cupy.empty(probs.shape[0], np.int64)  # [B]
    draw(on_device(probs, np.float32), on_device(u, np.float64), tokens)
    return checked(tokens.get())


def draw(probs, u, tokens):
    """sample's draw into tokens [B] (int64; -1 for a row that is not a distribution), all three
    contiguous device arrays (probs float32 [B, n_vocab], u float64 [B]): one launch, and
    nothing the host waits for, so a recorded graph may hold it (cuda_decode_loop.py)."""
    B, n = probs.shape
    if B:
        cuda.function(SOURCE, "sample")((B,), (THREADS,), (probs, u, tokens, np.int32(n)))


def verify(p, q, d, k, u, v):
    """speculative.verify on the device (its arguments, read there; q None: one-hot at the
    drafts): the accepted n [B] and the token [B], both on the host, in two launches (`accept`)
    and one copy each way, where NumPy's operations take ~25 calls into CuPy."""
    import cupy
    B, K = d.shape
    out = cupy.empty((2, B), np.int64)  # [2, B]: n, token
    q = None if q is None else on_device(q, np.float32)  # (a drafter's own q may be on the host)
    accept(on_device(p, np.float32), q, cupy.asarray(verify_draws(d, k, u, v)), out)
    accepted, tokens = out.get()  # [B] each
    return accepted, checked(tokens)


def verify_draws(drafts, k, u, v):
    """What `accept` reads of a verification besides p and q, as one float64 array [B, 2K+2]:
    each row's drafts [B, K] (token ids, exact), its draws u [B, K], its k [B] and v [B]."""
    B = len(drafts)
    return np.concatenate([drafts, u, np.reshape(k, (B, 1)), np.reshape(v, (B, 1))], axis=1, dtype=np.float64)


def accept(p, q, draws, out):
    """speculative.verify's n and token into out [2, B] (int64; token -1 for a row that is not
    a distribution), from p [B, K+1, n_vocab] and q [B, K, n_vocab] (float32; None: one-hot at
    the drafts, a deterministic drafter's) and draws (verify_draws), all contiguous device
    arrays: two launches (the tests and the residual, then `sample`'s draw), nothing the host
    waits for (a recorded graph's: cuda_decode_loop.py)."""
    import cupy
    B, P, n_vocab = p.shape
    K = (draws.shape[1] - 2) // 2
    if (q is not None and q.shape != (B, K, n_vocab)) or P <= K or draws.shape != (B, 2 * K + 2):
        raise ValueError(f"verify: p {p.shape}, q {None if q is None else q.shape} and draws {draws.shape} do not "
                         f"fit {K} drafts a row")
    last, v = cupy.empty((B, n_vocab), np.float32), cupy.empty(B, np.float64)  # the row drawn from, its draw
    if B:
        cuda.function(SOURCE, "residual")((B,), (THREADS,), (p, p if q is None else q, draws, out[0], last, v,
                                                             np.int32(P), np.int32(K), np.int32(n_vocab),
                                                             np.int32(q is None)))  # (p: never read as q)
        cuda.function(SOURCE, "sample")((B,), (THREADS,), (last, v, out[1], np.int32(n_vocab)))


def on_device(a, dtype):
    """a (a host or device array) as a contiguous device array of dtype (CuPy's
    ascontiguousarray takes device arrays only)."""
    import cupy
    return cupy.ascontiguousarray(cupy.asarray(a, dtype=dtype))


def checked(tokens):
    """The sampled ids, or sampling.sample's ValueError where a kernel marked a row -1."""
    if (tokens < 0).any():
        raise ValueError("cannot sample: a distribution holds NaN, inf or negative values, or no mass at all")
    return tokens
