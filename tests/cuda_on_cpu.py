"""Our GPU kernels run on a CPU: CuPy's few functions the kernels' Python calls, played by
NumPy, and RawModule's CUDA C compiled by g++ against cuda_on_cpu.h (a block's threads as
fibers: each runs until it waits at a barrier; blocks one at a time, each kernel's launches in
turns the last first and the first first). A machine without a GPU (CI) checks each kernel's
numbers against NumPy with it, as tests/test_cuda_kernels.py does on a GPU; it cannot see
speed, nor races that the GPU's weaker memory ordering alone would expose, nor the GPU's
arithmetic where it differs (flush-to-zero, the last bit of expf). Multiply-adds round as on
the GPU: fused where the source says fmaf, nowhere else (a module must be compiled with
--fmad=false, kernels/cuda.OPTIONS, which makes a GPU do the same).
Where a GPU would stop a launch, it fails the launch: a block whose threads all wait at
barriers that cannot open (a GPU hangs), a load at an address not a multiple of its type's
alignment, a block over its __launch_bounds__ (or 1,024 threads) or over 48 KiB of dynamic
shared memory, an argument not of its parameter's type as CuPy passes it. Where a GPU's value
is undefined, it gives garbage: shared memory at a block's start, a shuffle's value from a
lane that has returned. It does not check registers, nor static shared memory
(test_cuda_graphs reads both from the machine code NVRTC builds)."""
import contextlib
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
import time
import types

import numpy as np

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_on_cpu.h")
BUILD = os.path.join(tempfile.gettempdir(), "gpt2-cuda-on-cpu")
TIMEOUT_S = 300  # a launch here takes up to seconds
MAX_THREADS, MAX_SHARED = 1024, 48 << 10  # a block's, on every GPU since 2010 (more shared memory: an opt-in)
L2_BYTES = 64 << 10  # the "GPU's" L2 cache: small, so that the tiny model's matrices are several times it


def unavailable():
    """Why the kernels cannot run here (not x86-64, no C++20 compiler), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the fibers' switch is x86-64 assembly, this is {platform.machine()}"
    if shutil.which("g++") is None or shutil.which("nm") is None:
        return "g++ or nm (binutils) is not installed"
    probe = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-"], capture_output=True, text=True,
                           input="#include <atomic>\nint i; std::atomic_ref<int> r(i);\n")
    return f"g++ lacks C++20's std::atomic_ref: {probe.stderr.strip()[:200]}" if probe.returncode else None


recording = None  # the graph a stream is recording: what replay runs, in order (None: not recording)


class Device(np.lib.mixins.NDArrayOperatorsMixin):
    """A device array: NumPy's memory, but not a NumPy array, so that our kernels' wrappers
    (whose NumPy branch is the CPU's stand-in) launch the kernels on it. NumPy's functions and
    operators take it over as CuPy's arrays do (NEPs 13 and 18) and give device arrays; the host
    sees its values only when it asks (get, tolist, int(x)), never implicitly, as with CuPy.
    While a stream records (Stream.begin_capture), each operation is kept for replay; as on a
    GPU, kernels and writes into existing memory do not run then, and the host cannot read."""

    def __init__(self, a):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    strides = property(lambda self: self.a.strides)
    itemsize = property(lambda self: self.a.itemsize)
    size = property(lambda self: self.a.size)
    ndim = property(lambda self: self.a.ndim)
    flags = property(lambda self: self.a.flags)
    nbytes = property(lambda self: self.a.nbytes)
    data = property(lambda self: types.SimpleNamespace(ptr=self.a.__array_interface__["data"][0]))
    T = property(lambda self: operation(np.transpose, (self,), {}))

    def __array__(self, *args, **kwargs):  # CuPy's words
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(a, np.ndarray) and a.ndim for a in inputs):  # CuPy's words
            raise TypeError("Unsupported type <class 'numpy.ndarray'>")
        if recording is not None and ufunc is np.matmul:
            raise RuntimeError("cuBLAS cannot be recorded into a CUDA graph by CuPy (cupy issue 6290)")
        return operation(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        if recording is not None and func in (np.dot, np.einsum, np.tensordot, np.inner, np.vdot, np.matmul):
            raise RuntimeError("cuBLAS cannot be recorded into a CUDA graph by CuPy (cupy issue 6290)")
        if recording is not None and func in (np.nonzero, np.flatnonzero, np.argwhere, np.unique, np.extract):
            raise RuntimeError(f"np.{func.__name__}'s shape depends on the data: the host waits while a stream records")
        if "device" in kwargs:  # NumPy 2's np.full, ones, eye (like=) pass device=None; CuPy 14's take none
            raise TypeError(f"{func.__name__}() got an unexpected keyword argument 'device'")
        kwargs = {k: v for k, v in kwargs.items() if k != "like"}
        if func in (np.array, np.asarray, np.asanyarray, np.ascontiguousarray):  # a host array's copy, not a view
            return operation(lambda *a, **k: np.array(func(*a, **k), copy=True), args, kwargs)
        return operation(func, args, kwargs)

    def __getattr__(self, name):  # the methods: x.sum(), x.copy(), x.swapaxes(...)
        if name == "a" or not callable(getattr(np.ndarray, name, None)):
            raise AttributeError(name)
        if recording is not None and name == "dot":
            raise RuntimeError("cuBLAS cannot be recorded into a CUDA graph by CuPy (cupy issue 6290)")
        return lambda *args, **kwargs: operation(lambda a, *rest, **kw: getattr(a, name)(*rest, **kw), (self, *args),
                                                 kwargs)

    def __getitem__(self, index):
        if recording is not None and any(isinstance(i, Device) and i.dtype == bool for i in leaves(index)):
            raise RuntimeError("a boolean mask's shape depends on the data: the host waits while a stream records")
        return operation(lambda a, i: a[i], (self, index), {})

    def __setitem__(self, index, value):
        operation(lambda a, i, v: a.__setitem__(i, v), (self, index, value), {}, in_place=True)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __len__(self):
        return len(self.a)

    def __repr__(self):
        return f"Device({self.a!r})"

    def read(self):
        """The values, to the host: the host waits for the device, which a recording cannot."""
        if recording is not None:
            raise RuntimeError("the host waits for the device's values while a stream records a CUDA graph")
        return self.a

    def get(self):
        return self.read().copy()

    def set(self, values):
        if recording is not None:
            raise RuntimeError("a host array is copied to the device while a stream records a CUDA graph")
        if not isinstance(values, np.ndarray) or (values.dtype, values.shape) != (self.dtype, self.shape):
            raise ValueError("cupy's set takes a NumPy array of the same dtype and shape")  # no cast, no broadcast
        self.a[...] = values

    tolist = lambda self: self.read().tolist()
    item = lambda self: self.read().item()
    __int__ = lambda self: int(self.read())  # (no __index__: CuPy's arrays have none)
    __float__ = lambda self: float(self.read())
    __bool__ = lambda self: bool(self.read())


def operation(f, args, kwargs, in_place=False):
    """f's NumPy on the device arrays' memory; while a stream records, also kept for replay (one
    that writes into memory it did not allocate, only kept: a recording runs nothing)."""
    check_no_host_array((args, kwargs))
    if recording is None:
        return device(f(*host(args), **host(kwargs)))
    if in_place or "out" in kwargs:
        recording.append(functools.partial(run_again, f, args, kwargs, None))
        out = kwargs.get("out")
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    writable = [d for d in leaves((args, kwargs)) if isinstance(d, Device) and d.a.flags.writeable]
    before = [d.a.copy() for d in writable]
    result = device(f(*host(args), **host(kwargs)))
    for d, was in zip(writable, before):  # it wrote into memory it was given (x.partition, np.add.at): undo
        if not np.array_equal(d.a, was, equal_nan=True):
            d.a[...] = was
            in_place = True
    recording.append(functools.partial(run_again, f, args, kwargs, None if in_place else result))
    return result


def run_again(f, args, kwargs, result):
    """A recorded operation at replay: f on the arrays' values now, into the memory it returned."""
    fresh = f(*host(args), **host(kwargs))
    for r, v in zip(leaves(result), leaves(fresh)):
        if isinstance(r, Device) and r.a.flags.writeable and r.a is not v:
            assert r.a.shape == np.shape(v), "a recorded operation's shape changed at replay"
            r.a[...] = v


def check_no_host_array(tree):
    """A host array in a device operation is copied to the device: a copy a recording cannot hold."""
    if recording is not None and any(isinstance(a, np.ndarray) and a.ndim for a in leaves(tree)):
        raise RuntimeError("a host array is copied to the device while a stream records a CUDA graph")


def leaves(tree):
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in leaves(t)]
    if isinstance(tree, dict):
        return [leaf for t in tree.values() for leaf in leaves(t)]
    return [tree]


def device(tree):
    """NumPy's results as device arrays (a reduction's scalar, or np.array_equal's answer, as a
    0-d array, as CuPy gives them)."""
    if isinstance(tree, (np.ndarray, np.generic, bool)):
        return Device(np.asarray(tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(device(t) for t in tree)
    return tree


def host(tree):
    if isinstance(tree, Device):
        return tree.a
    if isinstance(tree, (tuple, list)):
        return type(tree)(host(t) for t in tree)
    if isinstance(tree, dict):
        return {k: host(v) for k, v in tree.items()}
    return tree


def copy_to_device(a, dtype=None, contiguous=False):
    """cupy.asarray / ascontiguousarray: a host array's copy (not while recording; asarray's
    alone: ascontiguousarray takes device arrays only, CuPy's TypeError), or a device array as
    it is where it already is what is asked, else its converted copy."""
    if isinstance(a, Device):
        if (dtype is None or a.dtype == dtype) and (not contiguous or a.flags.c_contiguous):
            return a
        return operation(lambda x: np.array(x, dtype=dtype, order="C"), (a,), {})
    if contiguous:  # CuPy's words (cupy issue 3511)
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, got "
                        f"{type(a).__module__}.{type(a).__name__})")
    check_no_host_array((a,))
    return Device(np.array(a, dtype=dtype, order="C" if contiguous else "K"))


class Stream:
    """cupy.cuda.Stream: one stream here; begin_capture starts a recording, end_capture
    returns it as a graph whose launch() replays it."""

    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        global recording
        assert recording is None, "a stream already records"
        recording = []

    def end_capture(self):
        global recording
        graph, recording = recording, None
        if None in graph:
            raise RuntimeError("memory was freed (a MemoryPool) while capturing: a GPU may lose the capture "
                               "(cudaErrorStreamCaptureInvalidated)")
        return types.SimpleNamespace(launch=lambda: [run() for run in graph])


class MemoryPool:
    """cupy.cuda.MemoryPool: freeing one frees its memory (cudaFree), a call CUDA counts as
    unsafe while a stream captures (PyTorch's allocator defers its frees until a capture ends):
    here end_capture fails, as where a GPU loses the capture. A graph's pool is freed with its
    graph, by Python's collector where a cycle holds it: a collection inside a capture would."""
    malloc = None

    def __del__(self):
        if recording is not None:
            recording.append(None)  # end_capture's cue: the capture was lost


class Event:
    """cupy.cuda.Event: when it was recorded (the host's clock: here the device is the host)."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def get_elapsed_time(start, end):
    """cupy.cuda.get_elapsed_time: ms from start to end."""
    return (end.t - start.t) * 1e3


def cupy():
    """A module standing in for cupy: what the model, the decoders and kernels/cuda*.py call of it."""
    module = types.ModuleType("cupy")
    cuda = types.SimpleNamespace(
        Stream=Stream, MemoryPool=MemoryPool, Event=Event,
        get_elapsed_time=get_elapsed_time,
        using_allocator=lambda malloc: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0, getDeviceProperties=lambda i: {
            "name": b"our kernels on the CPU", "l2CacheSize": L2_BYTES}),
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    module.__dict__.update(
        RawModule=RawModule, ndarray=Device, cuda=cuda, asnumpy=lambda a: a.get() if isinstance(a, Device) else a,
        asarray=lambda a, dtype=None: copy_to_device(a, dtype),
        ascontiguousarray=lambda a, dtype=None: copy_to_device(a, dtype, contiguous=True),
        empty=lambda shape, dtype=np.float32: Device(garbage(shape, dtype)),
        empty_like=lambda a: Device(garbage(a.shape, a.dtype)),
        zeros=lambda shape, dtype=np.float32: operation(np.zeros, (shape, dtype), {}))
    return module


def garbage(shape, dtype):
    """Memory as cupy.empty gives it: here NaN or -7, so that an output a kernel fails to write shows."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype)


def kernels(source):
    """{name: (its parameters [(C type, name)], the most threads a block of it may have)} of
    source's extern "C" __global__ functions, its macros expanded (g++ -E)."""
    expanded = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True,
                              check=True).stdout
    found = {}
    signature = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\(([^)]*)\)\s+)?(\w+)\s*\(([^)]*)\)'
    for bounds, name, params in re.findall(signature, expanded):
        most = bounds.split(",")[0].strip() or str(MAX_THREADS)  # __launch_bounds__(threads, blocks an SM)
        assert re.fullmatch(r"[\d\s*+()-]+", most), f"{name}'s launch bounds: {bounds}"
        found[name] = ([re.match(r"(.*?)(\w+)$", p.strip()).groups() for p in params.split(",") if p.strip()],
                       eval(most, {"__builtins__": {}}))  # an arithmetic of integers, checked above
    return found


def for_cpu(source):
    """source with what only a GPU compiles replaced: float16's PTX conversions, dynamic shared
    memory; and its typed loads `*reinterpret_cast<const T*>(p)` by the header's vector_load."""
    source = source.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));',
                            '_Float16 h; std::memcpy(&h, p, 2); f = (float)h;')
    source = source.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));',
                            '_Float16 g = (_Float16)f; std::memcpy(&h, &g, 2);')
    source = re.sub(r"\*reinterpret_cast<const (\w+)\s*\*>\(", r"vector_load<\1>(", source)  # (checks alignment)
    return re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = (\1*)dynamic_shared;", source)


class RawModule:
    """cupy.RawModule(code=...): compiled for the CPU, each kernel a ctypes function."""

    def __init__(self, code, options=()):
        if tuple(options) != ("--fmad=false",):  # (g++ here: -ffp-contract=off)
            raise ValueError(f"the emulation rounds as NVRTC does with --fmad=false only, not with options {options}")
        code = for_cpu(code)
        self.kernels = kernels(code)
        launchers = [f'int turns_{name};  // its launches so far\nextern "C" int launch_{name}(int gx, int bx, '
                     + ", ".join(["int shmem", *(f"{t} {n}" for t, n in params)])
                     + f") {{ return launch(gx, bx, shmem, turns_{name}++ % 2 == 0, "
                     + f"[=] {{ {name}({', '.join(n for _, n in params)}); }}); }}"
                     for name, (params, _) in self.kernels.items()]
        source = f'#include "{HEADER}"\n{code}\n' + "\n".join(launchers) + "\n"
        library = compiled(source)
        self.lib = ctypes.CDLL(library)
        at, size = shared_statics(library, self.lib, f"launch_{next(iter(self.kernels))}")
        self.lib.cuda_on_cpu_shared((ctypes.c_void_p * len(at))(*at), (ctypes.c_size_t * len(at))(*size), len(at))

    def get_function(self, name):
        params, most_threads = self.kernels[name]
        function = getattr(self.lib, f"launch_{name}")
        function.argtypes = [ctypes.c_int] * 3 + [ctype(t) for t, _ in params]
        function.restype = ctypes.c_int

        def call(grid, block, args, shared_mem=0):
            assert len(grid) == len(block) == 1 and len(args) == len(params), (name, grid, block, len(args))
            if block[0] > most_threads or shared_mem > MAX_SHARED:  # CUDA's launch fails
                raise RuntimeError(f"kernel {name}: a block of {block[0]} threads and {shared_mem} bytes of dynamic "
                                   f"shared memory: at most {most_threads} threads (its __launch_bounds__ or a "
                                   f"GPU's) and {MAX_SHARED} bytes")
            for (t, n), a in zip(params, args):
                check_argument(name, t, n, a)
            values = [pointer(a) if "*" in t else scalar(a) for (t, _), a in zip(params, args)]
            if recording is not None:  # a node of the graph: run at replay, on these pointers and values
                recording.append(functools.partial(run, name, function, grid, block, shared_mem, values, args))
            else:
                run(name, function, grid, block, shared_mem, values)
        return call


hung = []  # a launch that never ended: it still runs on the fibers' shared state


def run(name, function, grid, block, shared_mem, values, keep=()):
    """A launch, in a thread of its own, so that a kernel that loops forever (a bug that would hang a
    GPU too) fails its test instead of hanging the suite. keep: the arrays it points into (a
    recorded launch keeps them alive, as a graph's memory pool does)."""
    assert not hung, f"kernel {hung[0]} never ended, and still runs: no launch after it can be trusted"
    stuck = []
    launch = threading.Thread(target=lambda: stuck.append(function(  # at least a block and a thread, as CuPy
        max(1, int(grid[0])), max(1, int(block[0])), int(shared_mem), *values)), daemon=True)
    launch.start()
    launch.join(TIMEOUT_S)
    if launch.is_alive():
        hung.append(name)
        raise AssertionError(f"kernel {name} still runs after {TIMEOUT_S} s: a loop never ends")
    assert stuck, f"kernel {name}: its launch raised (the thread's traceback above says why)"
    assert stuck == [0], f"kernel {name}: {FAULTS.get(stuck[0], stuck[0])}"


FAULTS = {  # cuda_on_cpu.h's launch: why it stopped
    1: "a block's threads all wait at barriers that can never open",
    2: "no memory for its threads' stacks",
    3: "misaligned address: a load's address is not a multiple of its type's alignment"}


C_TYPES = {"int": np.int32, "unsigned int": np.uint32, "long long": np.int64, "unsigned long long": np.uint64,
           "u64": np.uint64, "float": np.float32, "double": np.float64, "unsigned short": np.float16, "bool": np.bool_}
CTYPES = {np.int32: ctypes.c_int, np.uint32: ctypes.c_uint, np.int64: ctypes.c_longlong, np.uint64: ctypes.c_ulonglong,
          np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.float16: ctypes.c_ushort, np.bool_: ctypes.c_bool}


def check_argument(kernel, c_type, name, a):
    """A kernel's argument as CuPy hands it over: a device array's address for a pointer (of
    the type's own dtype; float16 is unsigned short to our kernels), a scalar's bytes as they
    are, a Python int as 8 bytes (np.int64) and a float as a double: the kernel reads what its
    parameter's type says, so a scalar of another size shifts every parameter after it."""
    base = c_type.replace("const", "").replace("__restrict__", "").replace("*", "").strip()
    if "*" in c_type:  # (None: a null pointer)
        if a is not None and (not isinstance(a, Device) or a.dtype != C_TYPES.get(base, a.dtype)):
            raise TypeError(f"kernel {kernel}: {name} is {c_type}, given {type(a).__name__} "
                            f"{getattr(a, 'dtype', '')}")
        return
    given = np.dtype(type(a)) if isinstance(a, np.generic) else np.dtype(
        np.int64 if isinstance(a, int) else np.float64 if isinstance(a, float) else object)
    if base not in C_TYPES:
        raise TypeError(f"kernel {kernel}: {name}'s type {c_type} is not one cuda_on_cpu.py knows")
    if given != C_TYPES[base]:
        raise TypeError(f"kernel {kernel}: {name} is {c_type}, but CuPy passes {a!r} as {given}: give "
                        f"np.{np.dtype(C_TYPES[base]).name}(...)")


def pointer(a):
    """A device array's address: null for an empty one or None, as CuPy gives it."""
    return a.a.__array_interface__["data"][0] if a is not None and a.size else None


def scalar(a):
    """A scalar argument's value for ctypes (float16: its bits, as the kernel's unsigned short)."""
    if isinstance(a, np.float16):
        return int(a.view(np.uint16))
    return a.item() if isinstance(a, np.generic) else a


def ctype(t):
    if "*" in t:
        return ctypes.c_void_p
    return CTYPES[C_TYPES[t.replace("const", "").strip()]]


def shared_statics(library, lib, exported):
    """([address], [bytes]) of the library's function-local statics (mangled _ZZ...: __shared__
    is static here; nothing else in a kernel is), from its symbol table (nm), placed where the
    loaded library is (its symbol `exported`'s address, less nm's)."""
    listed = subprocess.run(["nm", "-S", "--defined-only", library], capture_output=True, text=True,
                            check=True).stdout
    symbols = [line.split() for line in listed.splitlines()]
    base = ctypes.cast(getattr(lib, exported), ctypes.c_void_p).value - next(
        int(s[0], 16) for s in symbols if s[-1] == exported)
    statics = [s for s in symbols if len(s) == 4 and s[3].startswith("_ZZ") and s[2] in "bBdDvV"]
    return [base + int(s[0], 16) for s in statics], [int(s[1], 16) for s in statics]


# -fno-gnu-unique: a template's statics stay each library's own (unique ones bind across libraries);
# -ffp-contract=off: a * b + c rounded twice, as --fmad=false makes NVRTC (fmaf once, on both)
FLAGS = ["-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-fno-gnu-unique", "-ffp-contract=off"]


@functools.cache
def compiled(source):
    """A shared library of source, built once per source and header (kept in BUILD)."""
    digest = hashlib.sha256((source + open(HEADER).read() + " ".join(FLAGS)).encode()).hexdigest()[:16]
    library = os.path.join(BUILD, f"{digest}.so")
    if not os.path.exists(library):
        os.makedirs(BUILD, exist_ok=True)
        cpp = os.path.join(BUILD, f"{digest}.cpp")
        with open(cpp, "w") as f:
            f.write(source)
        partial = f"{library}.{os.getpid()}.part"
        built = subprocess.run(["g++", *FLAGS, cpp, "-o", partial], capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(built.stderr[:4000])
        os.replace(partial, library)  # whole, or not at all: another process may be building it too
    return library
