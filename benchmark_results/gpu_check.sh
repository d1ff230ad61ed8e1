#!/usr/bin/env bash
# A GPU session's one prepared run (issue #61): the GPU's tests, then the benchmark's GPU table
# (ours replayed as CUDA graphs and eager, beside transformers), each log kept.
# From the repository root, on the lent machine (the device tool; its python3 has CuPy, torch,
# transformers and numba):   bash benchmark_results/gpu_check.sh
# Output under $OUT (the device tool's folder that comes back), else /tmp/gpu-check.
set -o pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" | tee -a "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py tests/test_cuda_graphs.py 2>&1 \
    | tee "$out/tests.txt" | tail -40
GPT2_GPU_KERNELS=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py 2>&1 \
    | tee "$out/tests-our-kernels.txt" | tail -30  # every end-to-end GPU test through our kernels and graphs
timeout 300 python3 benchmark.py --backend cupy --only decode --sizes 124M 1558M --batch_sizes 1 8 --reps 2 \
    --n_tokens 64 --out "$out/bench" 2>&1 | tee "$out/bench.txt" | tail -30
