#!/usr/bin/env bash
# A GPU session's one prepared run (issue #61): the GPU's tests, then the benchmark's GPU tables:
# each of our kernels alone (device time, GB/s; a step's kernels beside the step), then
# ours with its own kernels, replayed as CUDA graphs (greedy, and sampled on the device), beside
# CuPy's operations and transformers' generate() three ways (as the decode table runs it, without
# an attention mask, and compiled with a static cache: the "anchors"). Every step runs and keeps
# its log whatever failed before it (no set -e). From the repository root, on a machine with an
# NVIDIA GPU whose python3 has CuPy, torch, transformers and numba:   bash benchmark_results/gpu_check.sh
# Output under $OUT (our GPU sessions' tool brings back that folder, 8 files at most: these are 8),
# else /tmp/gpu-check.
# The timeouts add up to 570 s, inside one device call's 600.
# A second call, where the device budget still holds ~6 minutes after the first (a warm machine
# waits only briefly for it):   bash benchmark_results/gpu_check.sh speculative
# 124M drafting for 1558M through our kernels: the costs, and runs end to end beside plain decoding
# (issue #61: at least 2x plain at a = 0.8, K = 4).
set -o pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = speculative ]; then
    timeout 300 python3 benchmark.py --backend cupy --only speculative --target 1558M --K_max 6 --draft_vocabs 8192 \
        --draft_vocab 0 --e2e_alphas 0.8 0.9 --reps 2 --n_tokens 64 --out "$out/spec-1558M" 2>&1 \
        | tee "$out/spec.txt" | tail -40
    exit
fi
# our kernels alone first, each against NumPy (-k on-gpu: not their CPU runs): a fault in one (an
# illegal address) is sticky and would fail every later test
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -k on-gpu
} 2>&1 | tee "$out/tests-kernels.txt" | tail -25
# the end-to-end GPU tests on CuPy's own operations (the default), and the recorded steps (not their CPU runs)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py tests/test_cuda_graphs.py -k "not on-cpu" 2>&1 \
    | tee "$out/tests.txt" | tail -25
# every end-to-end GPU test again, through our kernels, recorded steps and sampling on the device
GPT2_GPU_KERNELS=1 timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py 2>&1 \
    | tee "$out/tests-our-kernels.txt" | tail -25
timeout 160 python3 benchmark.py --backend cupy --only kernels decode --sizes 124M --batch_sizes 1 8 --reps 2 \
    --n_tokens 64 --out "$out/bench-124M" 2>&1 | tee "$out/bench.txt" | tail -15
# 1558M without the compiled anchor: its compilations alone would outlast the call
timeout 170 python3 benchmark.py --backend cupy --only kernels decode --sizes 1558M --batch_sizes 1 8 --reps 2 \
    --n_tokens 64 --anchors no_mask --out "$out/bench-1558M" 2>&1 | tee -a "$out/bench.txt" | tail -15
