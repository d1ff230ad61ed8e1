"""When the kernels compile: each loop when a run first needs it, or ahead, in other
processes, while the model loads.

numba (https://numba.pydata.org) turns a kernel into machine code the first time it is
called, a few seconds a loop (`python benchmark.py --only kernels`), and keeps the code
in its cache (files in the modules' __pycache__) for every later run, which loads it in
milliseconds. So a machine's first run waits for the compiler; two things shorten that:

- Compile only what the run uses (`when_first_called`): one loop per weight format and
  tile plan, when a call first needs it, so a float32 run never waits for int8's loops.
- Compile while the model loads (`start`): a run knows its loops before it reads its
  checkpoint (its formats and the row counts of its passes: rowwise.loops), and numba
  compiles on one core, under one lock, while the load leaves the other cores idle. So
  other Python processes compile the loops into numba's cache meanwhile, and the run,
  once loaded, finds them there. numba keeps one index file per Python function, which
  two processes must not write at once (each could number its entry the same): each tile
  plan's loop is a function of its own name, and one function's loops (its formats) go
  to the same process.
"""
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
from numba import njit
from numba.core import event

_noticed = threading.Event()
seconds_compiling = 0.0  # this process's time in numba, compiling kernels or loading them from its cache
first_uses = []  # (kernel, dtype, plan) as this process first needed each loop
REGISTRY = {}  # "module.kernel" -> compile(dtype name, plan): what a compiling process can be asked for


def when_first_called(signatures, key, plan=None, **options):
    """@njit(signature, cache=True, nogil=True, **options), one signature of `signatures`
    {dtype name: signature} at a time: the one for the dtype key(*args) gives is compiled (or
    loaded from numba's cache) the first time a call needs it, not at import, so that a
    float32 run never waits for bfloat16's or int8's kernels. Any other dtype, and any
    argument the signature does not match (a float64 array), is refused with a TypeError:
    there is no silent slow path. With `plan`, the decorated function makes the kernel:
    make(plan(*args)) gives the loop to compile for that constant, also when first needed
    (a rows kernel for tiles of 4 or 5 rows never waits for the code of 2-row tiles)."""
    def decorate(make):
        ready = {}  # (dtype, plan) -> its compiled kernel: one dict lookup a call

        def compile_for(dtype, constant):
            global seconds_compiling
            name = np.dtype(dtype).name
            first_uses.append((make.__name__, name, constant))
            if name not in signatures:
                raise TypeError(f"{make.__name__} is compiled for {', '.join(signatures)}, not {name}")
            start = time.perf_counter()
            try:
                py_func = make if plan is None else make(constant)
                if plan is not None:  # a plan's own name: its own index in numba's cache (see `shares`)
                    py_func.__qualname__ += f"_{constant}"
                kernel = njit(signatures[name], cache=True, nogil=True, **options)(py_func)
            finally:
                seconds_compiling += time.perf_counter() - start
            ready[dtype, constant] = kernel
            return kernel

        @functools.wraps(make)
        def call(*args):
            k = key(*args), plan and plan(*args)
            kernel = ready.get(k) or compile_for(*k)
            return kernel(*args)

        REGISTRY[f"{make.__module__}.{make.__name__}"] = \
            lambda dtype, constant: ready.get((np.dtype(dtype), constant)) or compile_for(np.dtype(dtype), constant)
        return call
    return decorate


def say_compiling():
    if not _noticed.is_set():
        _noticed.set()
        print("compiling the CPU kernels this run uses (numba, once: later runs load them from its cache in "
              "under a second)...", file=sys.stderr, flush=True)


announce = say_compiling  # what a compile does as it starts (a compiling process tells its parent)
probing = False  # `cached` is asking numba's cache alone


class NotCached(Exception):
    """A loop that `cached` found numba about to compile: not in its cache."""


class CompileStarts(event.Listener):
    """numba's "numba:compile" event (https://numba.readthedocs.io/en/stable/developer/event_api.html)
    starts when numba compiles, after it looked in its cache: a compile, not a cache load."""

    def on_start(self, e):
        if probing:
            raise NotCached
        announce()

    def on_end(self, e):
        pass


event.register("numba:compile", CompileStarts())


def cached(loops):
    """The loops [(kernel, dtype, plan)] that numba's cache holds, each loaded into this
    process now (milliseconds each, numba's own libraries ~0.3 s the first time); the
    others are left uncompiled."""
    global probing
    found = []
    probing = True
    try:
        for loop in loops:
            try:
                REGISTRY[loop[0]](loop[1], loop[2])
                found.append(loop)
            except NotCached:
                pass
    finally:
        probing = False
    return found


# to_x8's compile compiles to_int16 inside it, into to_int16's index: the two go to one process
SAME_INDEX = {"kernels.int4_kernel.to_x8": "kernels.int8_kernel.to_int16"}
MAX_PROCESSES = 4  # each holds numba and LLVM (~100 MB)


def cost(loop):
    """About the seconds a loop takes to compile (`python benchmark.py --only kernels`
    prints both): a tile plan's loop ~1 s of numba's passes and ~0.2 s for each row of its
    tiles; the other loops 0.2-1.3 s."""
    n = loop[2]
    if not n:
        return 0.5
    # plans 1 and 2 are one tile; plan n >= 3 has tiles of n and n + 1, and n again for a tile alone
    tile_rows = n if n <= 2 else 2 * n + (n + 1)
    return 1 + 0.2 * tile_rows


def shares(loops, n):
    """loops [(kernel, dtype, plan)] cut into at most n lists, the loops of one index in
    numba's cache (a kernel's plan, its formats) in one, the heaviest first to the least
    loaded list."""
    by_index = {}
    for loop in sorted(loops, key=str):
        by_index.setdefault((SAME_INDEX.get(loop[0], loop[0]), loop[2]), []).append(loop)
    out = [[] for _ in range(min(n, len(by_index)))]
    for group in sorted(by_index.values(), key=lambda g: -sum(map(cost, g))):
        min(out, key=lambda share: sum(map(cost, share))).extend(group)
    return out


def start(loops):
    """Load `loops` [(kernel, dtype, plan)] from numba's cache, and compile the rest in
    other processes, one for each core but the one that loads the model (at least two);
    returns them for `wait`. A process that starts compiling prints say_compiling's line
    through this one (once)."""
    found = cached(loops)
    loops = [loop for loop in loops if loop not in found]
    if not loops:
        return []
    # the cores this process may run on (taskset, cgroups), not the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    n = min(max(2, cores - 1), MAX_PROCESSES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ahead of a "kernels" folder where we run
    running = []
    for share in shares(loops, n):
        try:
            process = subprocess.Popen([sys.executable, "-c", WORKER, root, json.dumps(share)],
                                       stdout=subprocess.PIPE, text=True)
        except OSError:
            continue  # its loops compile here, when first used
        listener = threading.Thread(target=listen, args=(process,), daemon=True)
        listener.start()
        running.append((process, listener))
    return running


# Ctrl-C reaches the whole terminal's group: a compiling process ignores it and is stopped by its
# parent between loops (numba writes a loop's cache entry whole; a kill could leave half of one)
WORKER = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); sys.path.insert(0, sys.argv[1]); "
          "from kernels import compiling; compiling.work(sys.argv[2])")


def listen(process):
    for line in process.stdout:
        if line.strip() == "compiling":
            say_compiling()


def wait(running):
    """Wait for the processes `start` began. One that failed leaves its loops to this
    process, which compiles whatever it does not find in numba's cache."""
    for process, listener in running:
        if process.wait():
            print(f"note: a process compiling the kernels failed (exit {process.returncode}); they compile "
                  "here instead", file=sys.stderr)
        listener.join()


@contextlib.contextmanager
def ahead(loops):
    """`loops` compile in other processes (`start`) while the block runs (a model loads);
    leaving it waits for them, or, where the block failed, stops them after their loop."""
    running = start(loops)
    try:
        yield
        wait(running)
    finally:
        for process, _ in running:
            if process.poll() is None:
                process.terminate()


def tell_parent():
    """A compiling process's notice: one line on the pipe its parent listens to."""
    try:
        os.write(1, b"compiling\n")  # unbuffered: nothing left to flush if the pipe has closed
    except OSError:
        pass  # the parent has gone (it stops this process): nobody to tell


def work(share):
    """A compiling process: compile (or load) each loop of `share`, a JSON list of [kernel,
    dtype, plan], telling the parent on stdout when a compile starts; SIGTERM stops it
    before its next loop."""
    global announce
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    announce = tell_parent
    for kernel, dtype, plan in json.loads(share):
        if stop.is_set():
            break
        module, _ = kernel.rsplit(".", 1)
        __import__(module)  # registers its kernels in REGISTRY
        REGISTRY[kernel](dtype, plan)
