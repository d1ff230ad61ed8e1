# Measure as on an AVX2-only CPU (AMD Zen 3, most laptops) from an AVX-512 one:
#     source benchmark_results/avx2.sh && python benchmark.py ...
# numba compiles the row kernel for Haswell's instruction set (without the features list
# it would still use every feature the host has), OpenBLAS runs its Haswell kernels, and
# torch (transformers' comparison) its AVX2 ones. Caches and memory stay the host's.
export NUMBA_CPU_NAME=haswell
export NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt,-avx512f,-avx512bw,-avx512vl,-avx512dq,-avx512cd,-avx512vnni,-avx512bf16,-avx512fp16,-amx-tile"
export OPENBLAS_CORETYPE=Haswell
export ATEN_CPU_CAPABILITY=avx2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export ONEDNN_MAX_CPU_ISA=AVX2
