"""Compiling the kernels ahead, in other processes, while a model loads (kernels/compiling.py):
the loops a run's warm-up will use are exactly the ones compiled ahead, none is compiled
twice into one cache index at once, and a cached start starts no process."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from kernels import rowwise

pytestmark = pytest.mark.skipif(rowwise.KERNEL != "numba", reason="the numba kernels compile; the fallback does not")

AHEAD_THEN_WARM = """import json, sys
from numba.core import event
import utils
from cli import loading
from kernels import compiling, rowwise, weight_formats
rows = {1, 7, 9}
models = {d: utils.load_encoder_hparams_and_params("124M", sys.argv[1], dtype=d)[1:] for d in weight_formats.DTYPES}
loops = set().union(*(rowwise.loops(rows, weight_formats.STORED_AS[d]) for d in models))
running = compiling.start(loops)
compiling.wait(running)

class Count(event.Listener):
    compiles = 0
    def on_start(self, e):
        Count.compiles += 1
    def on_end(self, e):
        pass

with event.install_listener("numba:compile", Count()):
    for hparams, params in models.values():
        loading.warm((params, hparams), rows)
print(json.dumps({"processes": len(running), "compiles here": Count.compiles, "loops": sorted(map(str, loops)),
                  "cached": len(compiling.cached(loops))}))
"""


def ahead_then_warm(models_dir, cache_dir):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", AHEAD_THEN_WARM, models_dir], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_what_compiles_ahead_is_what_the_warm_up_uses(models_dir, tmp_path):
    """An empty numba cache: every format's loops compile in other processes, and this
    process's warm-up then compiles nothing (numba's compile event never starts: each loop
    comes from the cache the processes wrote). Run again: no process starts, no notice."""
    first, err = ahead_then_warm(models_dir, tmp_path)
    assert first["processes"] >= 2 and first["compiles here"] == 0, first
    assert err.count("compiling the CPU kernels") == 1, err
    assert first["cached"] == len(first["loops"]), first
    again, err = ahead_then_warm(models_dir, tmp_path)
    assert again["processes"] == 0 and again["compiles here"] == 0 and "compiling" not in err, (again, err)


def test_one_index_one_process():
    """numba's index file is per Python function (a kernel's plan): two processes adding
    entries to one at once could number them alike. So a plan's formats (and to_x8 with
    the to_int16 it compiles) go to one process, the heavier first, to the least loaded."""
    from kernels import compiling
    loops = [("a.rows", "float32", 3), ("a.rows", "float32", 5), ("a.rows", "uint16", 4), ("a.row", "float32", None),
             ("kernels.int8_kernel.to_int16", "int8", None), ("kernels.int4_kernel.to_x8", "uint8", None),
             ("b.rows", "int8", 2), ("b.rows", "int8", 4)]
    shares = compiling.shares(loops, 2)
    assert sorted(sum(shares, [])) == sorted(loops) and len(shares) == 2
    owner = {(loop[0], loop[2]): i for i, share in enumerate(shares) for loop in share}
    assert all(owner[loop[0], loop[2]] == i for i, share in enumerate(shares) for loop in share)
    assert owner["kernels.int8_kernel.to_int16", None] == owner["kernels.int4_kernel.to_x8", None]
    users = [("kernels.row_kernel.rows_times_blocks", "float32", 5), ("kernels.int8_kernel.rows_times_pairs", "int8", 4),
             ("kernels.int8_kernel.rows_times_pairs", "int8", 2), ("kernels.int8_kernel.row_times_pairs", "int8", None),
             ("kernels.int8_kernel.to_int16", "int8", None)]  # what the users' command compiles after a float32 run
    assert sorted(map(sorted, compiling.shares(users, 2))) == sorted([sorted(users[::3] + users[4:]), sorted(users[1:3])])
    assert [len(s) for s in compiling.shares(loops[:3], 4)] == [1, 1, 1]
    assert len(compiling.shares([("a.rows", "float32", 4), ("a.rows", "uint16", 4)], 4)) == 1  # one index
