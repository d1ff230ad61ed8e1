#!/usr/bin/env bash
# A GPU session's one prepared run (issue #61): the GPU's tests, then the benchmark's GPU table
# (ours with its own kernels, replayed as CUDA graphs, beside CuPy's operations and transformers
# three ways), each log kept. From the repository root, on the lent machine (the device tool; its
# python3 has CuPy, torch, transformers and numba):   bash benchmark_results/gpu_check.sh
# Output under $OUT (the device tool's folder that comes back: 8 files), else /tmp/gpu-check.
# The timeouts add up to 580 s, inside one device call's 600.
set -o pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py tests/test_cuda_graphs.py
} 2>&1 | tee "$out/tests.txt" | tail -40
# every end-to-end GPU test again, through our kernels and recorded steps
GPT2_GPU_KERNELS=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_cupy.py 2>&1 \
    | tee "$out/tests-our-kernels.txt" | tail -25
for size in 124M 1558M; do
    timeout 165 python3 benchmark.py --backend cupy --only decode --sizes $size --batch_sizes 1 8 --reps 2 \
        --n_tokens 64 --out "$out/bench-$size" 2>&1 | tee -a "$out/bench.txt" | tail -15
done
