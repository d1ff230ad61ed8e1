#!/usr/bin/env bash
# A GPU session's one prepared run (issue #61), as one device call: the GPU's tests, then the
# benchmark's GPU tables in float32 and float16: each of our kernels alone (device time, GB/s; a
# step's kernels beside the step), ours with its own kernels, replayed as CUDA graphs (greedy, and
# sampled on the device), beside CuPy's operations and transformers' generate() (as the decode
# table runs it, without an attention mask, and compiled with a static cache: the "anchors"), and
# 124M drafting for 1558M through our kernels (issue #61: at least 2x plain at a = 0.8, K = 4).
# From the repository root, on a machine with an NVIDIA GPU whose python3 has CuPy, torch,
# transformers and numba:   bash benchmark_results/gpu_check.sh
# The steps run in the order of what a session most needs to learn, each under a timeout of its
# own cap or the time left before the deadline (GPU_CHECK_S, 570 s: inside one device call's 600,
# since a session's 15 minutes hold one call and the machine's start; the caps add up to it less
# 15 s for the probes, a test checks: caps guessed from the H200 run of 2026-11-26, 39 s of
# test_cupy.py, as no GPU has run the rest yet); a step with under 20 s left is skipped, and says so. Every
# step keeps its log whatever failed before it (no set -e), and the benchmark writes its results
# after each table, so a step cut off keeps what it measured.
# Output under $OUT (our GPU sessions' tool brings back that folder, 8 files at most: these are 8),
# else /tmp/gpu-check.
set -o pipefail
out=${OUT:-/tmp/gpu-check}
deadline=${GPU_CHECK_S:-570}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

run() {  # run CAP LOG COMMAND...: COMMAND under min(CAP, the time left), its output added to $out/LOG
    local cap=$1 log=$2 left=$((deadline - SECONDS))
    shift 2
    if ((left < cap)); then cap=$left; fi
    if ((cap < 20)); then
        echo "skipped, ${left} s left before the deadline: $*" | tee -a "$out/$log"
        return
    fi
    echo "\$ $* (timeout ${cap} s, at ${SECONDS} s)" >>"$out/$log"
    timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$out/$log" | tail -25
}

bench=(python3 benchmark.py --backend cupy --batch_sizes 1 8 --reps 2 --n_tokens 64 --dtype float32 float16)
{ timeout -k 5 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout -k 5 30 python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__,
      'nvrtc', cupy.cuda.nvrtc.getVersion(), 'runtime', cupy.cuda.runtime.runtimeGetVersion())"
  # what the kernels' sizes assume (cuda_ops.ATTEND_SLOTS: a block's 48 KiB less its static shared memory)
  timeout -k 5 30 python3 -c "import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); print({k: p.get(k) for k in (
      'sharedMemPerBlock', 'sharedMemPerBlockOptin', 'reservedSharedMemPerBlock', 'sharedMemPerMultiprocessor',
      'l2CacheSize', 'multiProcessorCount', 'regsPerBlock', 'major', 'minor')})"
} 2>&1 | tee "$out/tests-kernels.txt"
# our kernels alone first, each against NumPy (-k on-gpu: not their CPU runs): a fault in one (an
# illegal address) is sticky and would fail every later test
run 60 tests-kernels.txt python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k on-gpu
# 124M: the step targets, both dtypes, batch 1 and 8, then every anchor (the compiled one last
# of all: its warm-up may take minutes, and results are written after each table)
run 160 bench.txt "${bench[@]}" --only kernels decode --sizes 124M --out "$out/bench-124M"
# the recorded steps against eager and the CPU on the GPU (-k on-gpu: not their runs on the CPU's
# emulation or NumPy stand-in, which CI runs: ~60 s of a CPU's time here)
run 75 tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k on-gpu
# every end-to-end GPU test (main.py, speculative, batches) through our kernels
run 60 tests-our-kernels.txt env GPT2_GPU_KERNELS=1 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py
# 1558M at batch 1 (the targets), without the anchors (their compilations alone would outlast
# the call), then 124M drafting for it: the costs, and runs end to end beside plain decoding (float32,
# the first dtype)
run 140 bench.txt "${bench[@]}" --only kernels decode speculative --sizes 1558M --batch_sizes 1 --anchors \
    --K_max 6 --draft_vocabs 8192 --draft_vocab 0 --e2e_alphas 0.8 0.9 --out "$out/bench-1558M"
# the same end-to-end tests on CuPy's own operations (the default; 16 of them passed in 39 s on an H200,
# 2026-11-26: cupy-h200/124M-1558M/test_cupy.txt)
run 60 tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py
# a results file left half-written where a step was cut off (the benchmark writes each aside,
# then renames it): a ninth file, past the 8 the device tool returns
find "$out" -name '*.part' -delete
