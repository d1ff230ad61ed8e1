"""Our GPU kernels run on a CPU: CuPy's few functions the kernels' Python calls, played by
NumPy, and RawModule's CUDA C compiled by g++ against cuda_on_cpu.h (a block's threads as
fibers: each runs until it waits at a barrier). A machine without a GPU (CI) checks each
kernel's numbers against NumPy with it, as tests/test_cuda_kernels.py does on a GPU; it
cannot see speed, nor races that the GPU's weaker memory ordering alone would expose, nor the
GPU's arithmetic where it differs (flush-to-zero, fused multiply-adds, the last bit of expf).
A block whose threads all wait at barriers that cannot open fails its launch, as a GPU would
hang. It is lenient where a GPU is undefined or strict: a lane that has returned still
answers a shuffle, shared memory starts zeroed, and no launch limit (threads, registers,
48 KiB of shared memory) is checked."""
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import types

import numpy as np

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_on_cpu.h")
BUILD = os.path.join(tempfile.gettempdir(), "gpt2-cuda-on-cpu")
TIMEOUT_S = 300  # a launch here takes up to seconds


def unavailable():
    """Why the kernels cannot run here (not x86-64, no C++20 compiler), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the fibers' switch is x86-64 assembly, this is {platform.machine()}"
    if shutil.which("g++") is None:
        return "g++ is not installed"
    probe = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
                           input="#include <atomic>\nint i; std::atomic_ref<int> r(i);\n", capture_output=True, text=True)
    return f"g++ lacks C++20's std::atomic_ref: {probe.stderr.strip()[:200]}" if probe.returncode else None


class Device:
    """A device array: NumPy's memory, but not a NumPy array, so that our kernels' wrappers
    (whose NumPy branch is the CPU's stand-in) launch the kernels on it."""

    def __init__(self, a):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    strides = property(lambda self: self.a.strides)
    itemsize = property(lambda self: self.a.itemsize)
    size = property(lambda self: self.a.size)
    ndim = property(lambda self: self.a.ndim)
    flags = property(lambda self: self.a.flags)

    def reshape(self, *shape):
        return Device(self.a.reshape(*shape))

    def transpose(self, *axes):
        return Device(self.a.transpose(*axes))

    def astype(self, dtype, copy=True):
        return Device(self.a.astype(dtype, copy=copy))

    def __getitem__(self, index):
        return Device(self.a[index])

    def __iter__(self):
        return (Device(a) for a in self.a)

    def get(self):
        return self.a.copy()


def host(a):
    return a.a if isinstance(a, Device) else np.asarray(a)


def cupy():
    """A module standing in for cupy: what kernels/cuda*.py call of it."""
    module = types.ModuleType("cupy")
    module.__dict__.update(
        RawModule=RawModule, ndarray=Device, asnumpy=lambda a: host(a).copy(),
        asarray=lambda a, dtype=None: Device(np.array(host(a), dtype=dtype)),
        ascontiguousarray=lambda a, dtype=None: Device(np.ascontiguousarray(host(a), dtype=dtype)),
        empty=lambda shape, dtype=np.float32: Device(garbage(shape, dtype)),
        empty_like=lambda a: Device(garbage(a.shape, a.dtype)), zeros=lambda shape, dtype=np.float32: Device(
            np.zeros(shape, dtype)))
    return module


def garbage(shape, dtype):
    """Memory as cupy.empty gives it: here NaN or -7, so that an output a kernel fails to write shows."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype)


def kernels(source):
    """{name: its parameters [(C type, name)]} of source's extern "C" __global__ functions,
    its macros expanded (g++ -E)."""
    expanded = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True,
                              check=True).stdout
    found, signature = {}, r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(\w+\)\s+)?(\w+)\s*\(([^)]*)\)'
    for name, params in re.findall(signature, expanded):
        found[name] = [re.match(r"(.*?)(\w+)$", p.strip()).groups() for p in params.split(",") if p.strip()]
    return found


def for_cpu(source):
    """source with what only a GPU compiles replaced: float16's PTX conversions, dynamic shared memory."""
    source = source.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));',
                            '_Float16 h; std::memcpy(&h, p, 2); f = (float)h;')
    source = source.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));',
                            '_Float16 g = (_Float16)f; std::memcpy(&h, &g, 2);')
    return re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = (\1*)dynamic_shared;", source)


class RawModule:
    """cupy.RawModule(code=...): compiled for the CPU, each kernel a ctypes function."""

    def __init__(self, code):
        code = for_cpu(code)
        self.params = kernels(code)
        launchers = [f'extern "C" int launch_{name}(int gx, int bx, int shmem, '
                     + ", ".join(f"{t} {n}" for t, n in params)
                     + f") {{ return launch(gx, bx, shmem, [=] {{ {name}({', '.join(n for _, n in params)}); }}); }}"
                     for name, params in self.params.items()]
        source = f'#include "{HEADER}"\n{code}\n' + "\n".join(launchers) + "\n"
        self.lib = ctypes.CDLL(compiled(source))

    def get_function(self, name):
        params = self.params[name]
        function = getattr(self.lib, f"launch_{name}")
        function.argtypes = [ctypes.c_int] * 3 + [ctype(t) for t, _ in params]
        function.restype = ctypes.c_int

        def call(grid, block, args, shared_mem=0):
            assert len(grid) == len(block) == 1 and len(args) == len(params), (name, grid, block, len(args))
            values = [pointer(a) if "*" in t else (a.item() if hasattr(a, "item") else a)
                      for (t, _), a in zip(params, args)]
            # in a thread of its own, so that a kernel that loops forever (a bug that would hang a GPU
            # too) fails its test instead of hanging the suite
            stuck = []
            launch = threading.Thread(target=lambda: stuck.append(function(
                int(grid[0]), int(block[0]), int(shared_mem), *values)), daemon=True)
            launch.start()
            launch.join(TIMEOUT_S)
            assert not launch.is_alive(), f"kernel {name} still runs after {TIMEOUT_S} s: a loop never ends"
            assert stuck == [0], f"kernel {name}: a block's threads all wait at barriers that can never open"
        return call


def pointer(a):
    assert isinstance(a, Device), f"a kernel got {type(a).__name__} where a device array goes"
    return a.a.__array_interface__["data"][0]


def ctype(t):
    if "*" in t:
        return ctypes.c_void_p
    return {"long long": ctypes.c_longlong, "double": ctypes.c_double, "float": ctypes.c_float,
            "unsigned int": ctypes.c_uint}.get(t.replace("const", "").strip(), ctypes.c_int)


@functools.cache
def compiled(source):
    """A shared library of source, built once per source and header (kept in BUILD)."""
    digest = hashlib.sha256((source + open(HEADER).read()).encode()).hexdigest()[:16]
    library = os.path.join(BUILD, f"{digest}.so")
    if not os.path.exists(library):
        os.makedirs(BUILD, exist_ok=True)
        cpp = os.path.join(BUILD, f"{digest}.cpp")
        with open(cpp, "w") as f:
            f.write(source)
        partial = f"{library}.{os.getpid()}.part"
        built = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", cpp, "-o", partial],
                               capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(built.stderr[:4000])
        os.replace(partial, library)  # whole, or not at all: another process may be building it too
    return library
