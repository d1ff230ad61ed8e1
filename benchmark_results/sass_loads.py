"""How many weight loads each few-row product kernel (kernels/cuda_matmul.py) has in flight
before its first multiply, read from the machine code NVRTC builds for an H100/H200 (sm_90),
with each kernel's registers and spilled bytes: no GPU needed. A GPU's memory answers a load
after ~0.5 us, so that number, times the warps an SM holds, is what its bandwidth rests on.

    pip install cupy-cuda12x "nvidia-cuda-cuobjdump>=13"   # NVRTC; NVIDIA's disassembler (0.3 MB)
    python benchmark_results/sass_loads.py [UNROLL]

The k-loop is the innermost loop with the most vector loads (LDG.E.128 for float32, .64 for
float16); of its loads before its first FFMA, the weights' are those off one address register,
a load per k-step (+512 bytes each in float32), where the inputs' are a register a row.
"""
import collections
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cupy_backends.cuda.libs import nvrtc  # noqa: E402  (CuPy's NVRTC)

from kernels import cuda, cuda_matmul  # noqa: E402


def cubin(source, arch="sm_90"):
    program = nvrtc.createProgram(cuda.SHARED + source, "k.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *cuda.OPTIONS, "-ftz=true"])  # (CuPy's -ftz)
        elf = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    (at,), (size, count) = struct.unpack_from("<Q", elf, 0x20), struct.unpack_from("<HH", elf, 0x36)
    return elf + b"\0" * max(0, at + size * count - len(elf))  # (the bytes CuPy drops from its end)


def kernels(elf):
    """{name: (registers, stack bytes, [instructions])} of a cubin, by cuobjdump."""
    try:
        import nvidia.cu13  # the wheel's tools: nvidia/cu13/bin (a namespace package)
        tool = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "cuobjdump")
    except ImportError:
        tool = "cuobjdump"  # a CUDA toolkit's, on PATH
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(elf)
        f.flush()
        text = subprocess.run([tool, "-sass", "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = {name: (int(r), int(s)) for name, r, s in re.findall(r"Function (\w+):\n\s*REG:(\d+) STACK:(\d+)", text)}
    code = {}
    for name, body in re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*\.+\n|\n\s*Function : |\Z)", text, re.S):
        code[name] = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    return {name: (*usage[name], code[name]) for name in usage}


def loads_before_first_multiply(code, vector):
    """Weight loads (`vector`: LDG.E.128 for float32, .64 for float16) issued before the first
    FFMA of the k-loop: the innermost loop with the most such loads."""
    loops = [(int(m.group(1), 16), at) for at, i in code for m in [re.search(r"BRA (0x[0-9a-f]+)", i)]
             if m and int(m.group(1), 16) < at]  # backward branches: (loop start, its branch)
    inner = [(lo, hi) for lo, hi in loops if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops)]
    body = max(([i for at, i in code if lo <= at <= hi] for lo, hi in inner), key=lambda b: sum(vector in i for i in b))
    first = next(n for n, i in enumerate(body) if "FFMA" in i)
    addresses = collections.defaultdict(set)  # {address register: its offsets}
    for i in body[:first]:
        if vector in i:
            address = re.search(r"\[(R\d+)\.64(\+0x[0-9a-f]+)?\]", i)
            addresses[address.group(1)].add(address.group(2))
    return max(map(len, addresses.values()), default=0)


if __name__ == "__main__":
    unroll = int(sys.argv[1]) if len(sys.argv) > 1 else cuda_matmul.UNROLL
    found = kernels(cubin(cuda_matmul.source(unroll)))
    print(f"cuda_matmul at UNROLL {unroll}, built for sm_90:")
    for name, (registers, stack, code) in sorted(found.items()):
        if name.startswith(("row_times", "rows_times_columns")):
            print(f"  {name}: {registers} registers, {stack} bytes spilled, "
                  f"{loads_before_first_multiply(code, 'LDG.E.128' if name.endswith('32') else 'LDG.E.64')} "
                  "weight loads before its first multiply")
