"""int4 weights times 8-bit activations (int4_kernel.py): the activations are rounded as
the docstring says, and the kernel computes exactly the integer sums of the stored
nibbles, group by group, for any row count, each row as it would be alone."""
import json
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest
import readback
from conftest import ROOT

from kernels import rowwise, weight_formats

pytestmark = pytest.mark.skipif(rowwise.pick_kernel("numba") != "numba", reason="numba is not installed")


@pytest.fixture(scope="module")
def k4():
    from kernels import int4_kernel
    return int4_kernel


def test_activations_round_to_8_bits_per_group_of_32(k4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1600), dtype=np.float32) * rng.uniform(1e-3, 1e3, (3, 1600)).astype(np.float32)
    x[2, 5] = 3e4  # an outlier: only its own group's step grows
    x[1, 64:96] = 0  # a group of zeros
    x8, sx, xsum = k4.to_x8(x, 32)
    assert x8.dtype == np.int8 and sx.dtype == np.float32 and xsum.dtype == np.int32 and sx.shape == (3, 50)
    top = np.abs(x).reshape(3, 50, 32).max(-1)
    np.testing.assert_array_equal(sx, top / np.float32(127))
    assert sx[1, 2] == 0 and not x8[1, 64:96].any()
    groups = x8.reshape(3, 50, 32).astype(np.int64)
    assert (np.abs(groups).max(-1)[top > 0] == 127).all() and np.abs(groups).max() <= 127
    np.testing.assert_array_equal(xsum, groups.sum(-1))
    back = groups * sx[..., None].astype(np.float64)
    assert (np.abs(back - x.reshape(3, 50, 32)) <= sx[..., None] * (0.5 + 1e-3)).all()  # half a step, each


def exact(k4, x, q, sw):
    """The kernel's arithmetic in exact integers, then its float32 steps one by one: per
    group g, t = float32(sw * sx), acc = float32(float(isum) * t + acc), a fused
    multiply-add: the product of two float32 is exact in float64, and the float64 sum
    rounded to float32 is the fma's single rounding unless it lands within 2**-53 of a
    float32 tie (about once in 2**29 sums)."""
    c = weight_formats.int4_group(x.shape[1])
    x8, sx, xsum = k4.to_x8(x, c)
    R, n_out = x.shape[0], q.shape[1]
    isum = np.einsum("rgk,gkj->rgj", x8.reshape(R, -1, c).astype(np.int64),
                     q.reshape(-1, c, n_out).astype(np.int64))  # [R, n_in / c, n_out]: q = u - 8, so 8 xsum is gone
    scale = weight_formats.from_bfloat16(sw)  # [n_in / c, n_out]
    acc = np.zeros((R, n_out), np.float32)
    for g in range(isum.shape[1]):
        t = (scale[g] * sx[:, g:g + 1]).astype(np.float32)  # [R, n_out]
        acc = (isum[:, g] * t.astype(np.float64) + acc).astype(np.float32)
    return acc


@pytest.mark.parametrize("n_in, n_out, worst", [(16, 48, False), (40, 64, False), (48, 64, False),
                                                 (768, 2304, False), (1024, 1000, False), (4096, 1024, False),
                                                 (1024, 128, True)])
def test_the_kernel_is_the_exact_integer_sum_for_1_to_16_rows(k4, n_in, n_out, worst):
    """Groups of 32, 16 (n_in 48) and 8 (n_in 40); worst: every weight and activation at its
    largest magnitude, so each 16-bit lane holds its most (8 pairs of 15 x 127)."""
    from kernels import layout, row_kernel
    rng = np.random.default_rng(n_in)
    w = rng.standard_normal((n_in, n_out), dtype=np.float32)
    if worst:
        w = np.where(w > 0, 1.0, -1.0).astype(np.float32)  # q = +-7 everywhere: u = 15 or 1
    layer = layout.kernel_blocks(w, "int4")
    q = row_kernel.unblocked(readback.unpacked(layer.stored), n_out)  # [n_in, n_out]
    sw = row_kernel.unblocked(layer.scale, n_out)  # [n_in / c, n_out]
    x = rng.standard_normal((16, n_in), dtype=np.float32)
    if worst:
        x = np.ones((16, n_in), np.float32)  # x8 = 127 everywhere
    want = exact(k4, x, q, sw)  # [16, n_out]
    for R in range(1, 17):
        for first in {0, 16 - R}:
            got = rowwise.matmul(x[first:first + R], layer.stored, n_out=n_out, scale=layer.scale)
            assert got.shape == (R, n_out) and got.dtype == np.float32
            assert np.array_equal(got, want[first:first + R]), f"{R} rows from {first}"


def test_the_first_outputs_read_only_their_blocks(k4):
    """A draft's vocabulary subset asks for the head's first n_out outputs: the same numbers."""
    from kernels import layout
    rng = np.random.default_rng(5)
    layer = layout.kernel_blocks(rng.standard_normal((768, 1000), dtype=np.float32), "int4")
    x = rng.standard_normal((3, 768), dtype=np.float32)
    whole = rowwise.matmul(x, layer.stored, n_out=1000, scale=layer.scale)
    assert np.array_equal(rowwise.matmul(x, layer.stored, n_out=100, scale=layer.scale), whole[:, :100])


# the loops that run, compiled in a fresh Python with an empty numba cache (so numba keeps their
# assembly), for the CPU NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name: what each multiplies with
LOOP_INSTRUCTIONS = """import json, re, sys
from kernels import compiling, rowwise
found = {}
for dtype in ("int8", "uint8"):
    for kernel, _, plan in sorted(rowwise.loops([1, 5], dtype), key=str):
        if "times" in kernel:
            __import__(kernel.rsplit(".", 1)[0])
            asm = "".join(compiling.REGISTRY[kernel](dtype, plan).inspect_asm().values())
            for name in re.findall(r"\\b(vpmaddubsw|vpdpbusd|vpmaddwd|vpdpwssd|vpmullw)\\b", asm):
                found.setdefault(dtype, {}).setdefault(name, 0)
                found[dtype][name] += 1
print(json.dumps(found))"""
with open(os.path.join(ROOT, "benchmark_results", "avx2.sh")) as f:  # the features every AVX2-held run uses
    AVX2_FEATURES = re.search(r'NUMBA_CPU_FEATURES="([^"]+)"', f.read()).group(1)
AVX512_VNNI = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse4.2,+avx512f,"
               "+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vnni")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or rowwise.KERNEL != "numba",
                    reason="x86's instruction names, in numba's loops")
@pytest.mark.parametrize("cpu", ["this CPU", "haswell", "icelake-server"])
def test_the_loops_that_run_multiply_with_the_instruction_they_mean(cpu, tmp_path):
    """int4's loops with vpmaddubsw (32 multiply-adds an instruction; or VNNI's vpdpbusd), int8's
    with vpmaddwd or vpdpwssd, for this CPU and, explicitly, for an AVX2 one (Haswell) and an
    AVX-512 VNNI one (compiled, not run). From plain IR, LLVM gave AVX-512 CPUs' int4 loops
    vpmaddwd / vpdpwssd instead (half the multiply-adds): int4 was no faster than int8 there."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        env.pop(name, None)
    if cpu == "haswell":
        env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=AVX2_FEATURES)
    elif cpu == "icelake-server":
        env.update(NUMBA_CPU_NAME="icelake-server", NUMBA_CPU_FEATURES=AVX512_VNNI)
    out = subprocess.run([sys.executable, "-c", LOOP_INSTRUCTIONS], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.splitlines()[-1])
    int4 = found["uint8"]  # vpmaddwd also adds each group's pair sums into columns, once a group
    assert int4.get("vpmaddubsw", 0) + int4.get("vpdpbusd", 0) > int4.get("vpmaddwd", 0) + int4.get("vpdpwssd", 0)
    assert "vpmullw" not in int4, found
    if cpu == "haswell":
        assert int4.get("vpmaddubsw", 0) > 0 and "vpdpbusd" not in int4, found
    if cpu == "icelake-server":  # VNNI: one vpdpbusd for vpmaddubsw, and for vpmaddwd's columns
        assert int4.get("vpdpbusd", 0) > 0 and not {"vpmaddubsw", "vpmaddwd", "vpdpwssd"} & set(int4), found
    assert found["int8"].get("vpmaddwd", 0) + found["int8"].get("vpdpwssd", 0) > 0, found


# one int4 and one int8 product, printed as bytes, for the CPU the environment names
PRODUCTS = """import hashlib
import numpy as np
from kernels import layout, rowwise
rng = np.random.default_rng(7)
w, x = rng.standard_normal((256, 320), dtype=np.float32), rng.standard_normal((5, 256), dtype=np.float32)
for dtype in ("int4", "int8"):
    layer = layout.kernel_blocks(w, dtype)
    got = np.concatenate([rowwise.matmul(x[:n], layer.stored, n_out=320, scale=layer.scale) for n in (1, 5)])
    print(dtype, hashlib.sha256(got.tobytes()).hexdigest())"""


def host_has_avx2():
    import llvmlite.binding as llvm
    return "+avx2" in llvm.get_host_cpu_features().flatten().split(",")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or rowwise.KERNEL != "numba"
                    or not host_has_avx2(), reason="numba's loops for x86's AVX2, run")
def test_this_cpus_loops_give_the_bits_the_avx2_loops_give(tmp_path):
    """On an AVX-512 (VNNI) CPU the integer loops run other instructions (vpdpbusd, vpdpwssd)
    than held to AVX2: the integer sums are exact and the float order fixed, so the same bits."""
    outputs = []
    for held in (False, True):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / str(held)))
        for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
            env.pop(name, None)
        if held:
            env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=AVX2_FEATURES)
        out = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-2000:]
        outputs.append(out.stdout.split())
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's instruction names")
def test_llvm_turns_maddubs_into_vpmaddubsw(k4):
    """The kernel's speed rests on one instruction that LLVM must recognise in plain IR: with
    the nibbles' mask as a constant it proves the saturation dead and multiplies with
    vpmullw instead (int4_kernel._nibbles). A fresh, uncached function, so that numba keeps
    its assembly, compiled for the CPU numba targets."""
    from numba import njit

    from kernels.row_kernel import store8

    def f(qb, x8, out, mask, shift):
        acc = k4.maddubs(k4.zero_sums(), k4.low_nibbles(qb, (0,), mask), k4.quad(x8, (0,)))
        acc = k4.maddubs(acc, k4.high_nibbles(qb, (0,), mask, shift), k4.quad(x8, (4,)))
        store8(out, (0,), k4.to_float(k4.column_sums(acc, 0)))
    compiled = njit("void(uint8[::1], int8[::1], float32[::1], int32, int32)")(f)
    qb, x8, out = np.full(32, 0x21, np.uint8), np.arange(8, dtype=np.int8), np.empty(8, np.float32)
    compiled(qb, x8, out, 15, 4)
    np.testing.assert_array_equal(out, (1 + 2 + 3) * 1 + (4 + 5 + 6 + 7) * 2)  # every column: low 1, high 2
    asm = next(iter(compiled.inspect_asm().values()))
    assert ("pmaddubsw" in asm or "vpdpbusd" in asm) and "pmullw" not in asm  # VNNI may fuse it further
