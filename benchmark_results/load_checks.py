"""What a load's checks cost beside the rest of the load, on 124M's real index (its 148
tensors' shapes and offsets) over random bytes of its size, read from the page cache: the
crc32c of every tensor (checkpoint.tf_tensors), check_params' float32 sums, and the layout
copy in float32 and int8 (kernels/layout.decode_layout). No checkpoint needed.

    python benchmark_results/load_checks.py [REPS]
"""
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
from bench import common  # noqa: E402
from kernels import layout  # noqa: E402

INDEX = os.path.join(ROOT, "tests", "fixtures", "gpt2-124M-real-index", checkpoint.TF_INDEX)


def main(reps=5):
    entries = checkpoint.read_checked_index(INDEX)
    size = max(e["offset"] + e["size"] for e in entries.values())
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, checkpoint.TF_DATA)
        np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32).tofile(data)
        tensors = {name: np.memmap(data, dtype="<f4", mode="r", offset=e["offset"], shape=e["shape"])
                   for name, e in entries.items()}
        params = checkpoint.params_from_openai_names(tensors, 12)
        steps = {"crc32c of every tensor": lambda: [checkpoint.masked_crc32c(t) for t in tensors.values()],
                 "check_params' float32 sums": lambda: [t.sum(dtype=np.float32) for t in tensors.values()],
                 "decode_layout, float32": lambda: layout.decode_layout(params),
                 "decode_layout, int8": lambda: layout.decode_layout(params, dtype="int8")}
        print(common.machine_info())
        print(f"124M's tensors, {size / 1e6:.0f} MB of random bytes; ms over {reps} reps after one warm-up:")
        for name, step in steps.items():
            step()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - start))
            print(f"  {name}: min {min(times):.0f}, median {sorted(times)[len(times) // 2]:.0f}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
