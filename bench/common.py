"""What every benchmark section shares: models of the real shapes with random weights,
timing (a function's median, one cached pass, the memory bandwidth), prompts, plain
greedy decoding, and the machine the numbers come from.

Speed does not depend on weight values, so a model that is not in --models_dir runs with
random weights of its real shapes; every section says which.
"""
import concurrent.futures
import os
import platform
import time

import numpy as np

import batching
import sampling
import utils
from kernels import layout, rowwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: fixtures, README.md
TOKENIZER_DIR = os.path.join(ROOT, "tests", "fixtures", "gpt2-tokenizer")
SHAPES = {  # n_embd, n_head, n_layer of OpenAI's releases
    "124M": (768, 12, 12), "355M": (1024, 16, 24), "774M": (1280, 20, 36), "1558M": (1600, 25, 48),
    "tiny": (64, 4, 2),  # --quick
}
GREEDY = sampling.SamplingSettings(temperature=0.0)


def random_params(size, seed=0, n_vocab=50257, n_ctx=1024, dtype="float32"):
    """GPT-2 params of the real shapes, random values (N(0, 0.02), like GPT-2's init),
    the matrices stored in dtype (weight_formats.py)."""
    n_embd, n_head, n_layer = SHAPES[size]
    layer = [(n_embd,), (n_embd,),  # ln_1's and ln_2's biases, then attn's c_attn and c_proj, mlp's c_fc and c_proj
             (n_embd, 3 * n_embd), (3 * n_embd,), (n_embd, n_embd), (n_embd,),
             (n_embd, 4 * n_embd), (4 * n_embd,), (4 * n_embd, n_embd), (n_embd,)]
    r = iter(normals(seed, [(n_vocab, n_embd), (n_ctx, n_embd), (n_embd,)] + layer * n_layer))  # in the order used

    def ln():  # its gain 1, its bias drawn
        return {"g": np.ones(n_embd, np.float32), "b": next(r)}

    def linear():
        return {"w": next(r), "b": next(r)}
    params = {"wte": next(r), "wpe": next(r), "ln_f": ln()}
    params["blocks"] = [{"ln_1": ln(), "ln_2": ln(), "attn": {"c_attn": linear(), "c_proj": linear()},
                         "mlp": {"c_fc": linear(), "c_proj": linear()}} for _ in range(n_layer)]
    hparams = {"n_vocab": n_vocab, "n_ctx": n_ctx, "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer}
    return layout.decode_layout(params, dtype=dtype), hparams  # the memory order a loaded model has


BLOCK = 1 << 22  # the values one generator draws


def cores():
    """The cores this process may run on (taskset, a container's cpuset), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def normals(seed, shapes):
    """float32 arrays of these shapes, N(0, 0.02): drawn in blocks of BLOCK values, each by a
    generator of its own (spawned from seed), on every core at once (NumPy's generators draw
    without the GIL): the same values whatever the number of cores."""
    arrays = [np.empty(shape, np.float32) for shape in shapes]
    blocks = [a.reshape(-1)[i:i + BLOCK] for a in arrays for i in range(0, a.size, BLOCK)]

    def draw(part, seq):
        np.random.default_rng(seq).standard_normal(out=part, dtype=np.float32)
        part *= np.float32(0.02)
    with concurrent.futures.ThreadPoolExecutor(cores()) as pool:
        list(pool.map(draw, blocks, np.random.SeedSequence(seed).spawn(len(blocks))))
    return arrays


def load_or_random(size, models_dir, seed):
    """Real weights when models_dir holds them (timing the load), else random."""
    model_dir = os.path.join(models_dir, size)
    if size in utils.MODEL_SIZES and utils.is_complete(model_dir):
        t = time.perf_counter()
        _, hparams, params = utils.load_model_dir(model_dir)
        return params, hparams, {"weights": "real", "load_s": time.perf_counter() - t}
    params, hparams = random_params(size, seed)
    return params, hparams, {"weights": "random", "load_s": None}  # timed by the command after the decoding runs


def in_format(model, dtype):
    """(model with its matrices stored in dtype, seconds the conversion took): from the
    float32 matrices, as loading a checkpoint in that format converts them."""
    if dtype == "float32":
        return model, 0.0
    plain = layout.plain_layout(model[0])
    start = time.perf_counter()
    params = layout.decode_layout(plain, "numba", dtype)
    return (params, model[1]), time.perf_counter() - start


def matmul_weight_bytes(params):
    """Bytes a one-token decode step must stream: every matmul weight once as stored (the head
    reads all of wte, in the kernels' layout padded to 64 columns; wpe contributes one row, left out)."""
    blocks = sum(w.nbytes for b in params["blocks"] for m in ("attn", "mlp") for lin in b[m].values()
                 for w in lin.values())
    return blocks + params["wte"].nbytes


def timed(fn, reps, warmup=1):
    """Run fn warmup + reps times; (median, min, max) seconds of the timed runs."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(min(ts)), float(max(ts))


def settle():
    """Before timing another way: OpenBLAS's workers spin for up to ~0.1 s after a call
    that used them, on the cores the next way's threads need; let them fall asleep."""
    time.sleep(0.2)


def bandwidth_probe(n=8192):
    return np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)  # [n, n]: 256 MiB


def measure_bandwidth(probe, reps=5):
    """GB/s of a large one-row matmul: the memory roofline of batch-1 decoding."""
    x = np.ones((1, probe.shape[0]), np.float32)
    med, _, _ = timed(lambda: x @ probe, reps)
    return probe.nbytes / med / 1e9


def prompt_ids(n, seed=1):
    return np.random.default_rng(seed).integers(0, 50000, n).tolist()


def greedy(prompts, model, n, use_cache=True):
    """Plain greedy decoding: (new tokens, batching.Stats)."""
    return batching.generate(batching.requests(prompts, n, GREEDY), model, use_cache)


def machine_info():
    """The CPU and the instruction sets each library runs on it, printed beside every result:
    OpenBLAS picks its kernels by CPU (threadpoolctl reports which), numba compiles the row
    kernel for the CPU that LLVM sees (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES can ask for
    another, e.g. haswell for AVX2 only)."""
    flags, model = set(), platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    from threadpoolctl import threadpool_info
    blas = [f"{i['internal_api']} {i['version']} ({i.get('architecture')}, {i['num_threads']} threads)"
            for i in threadpool_info() if i["user_api"] == "blas"]
    info = {"cpu": model, "cpu_count": cores(),
            "simd": [s for s in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni") if s in flags],
            "platform": platform.platform(), "numpy": np.__version__, "blas": blas, "row_kernel": rowwise.KERNEL}
    if rowwise.KERNEL == "numba":
        import llvmlite.binding
        import numba

        from kernels import int4_kernel
        features = numba.config.CPU_FEATURES or llvmlite.binding.get_host_cpu_features().flatten()
        info.update(numba=numba.__version__, numba_cpu=numba.config.CPU_NAME or llvmlite.binding.get_host_cpu_name(),
                    numba_simd=[s for s in ("avx2", "fma", "avx512f", "avx512vnni", "avxvnni")
                                if f"+{s}" in features.split(",")],
                    numba_threads=numba.get_num_threads(),
                    # what the int4 loops multiply with
                    int4_madd=("vpdpbusd" if int4_kernel.targets_vnni() else "vpmaddubsw")
                    if int4_kernel.targets_avx2() else "LLVM's choice")
    return info


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
