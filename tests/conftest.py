"""Shared fixtures: the tiny GPT-2 of ../shared (copied into tests/fixtures) laid out as models dirs, and
CuPy on a GPU or played on the CPU (`cupy`)."""
import os
import shutil
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

import cuda_on_cpu  # noqa: E402
from kernels import rowwise  # noqa: E402
import utils  # noqa: E402

# the row kernels this machine can run: numpy always, numba where it imports
KERNELS_HERE = [k for k in rowwise.KERNELS if k == "numpy" or rowwise.pick_kernel(k) == k]


def fixture_path(*parts):
    return os.path.join(FIXTURES, *parts)


def make_model_dir(dst, layout):
    """A models-dir entry: a tiny checkpoint ('tiny-openai' or 'tiny-hf') plus the tokenizer."""
    os.makedirs(dst, exist_ok=True)
    for src in (fixture_path(layout), fixture_path("gpt2-tokenizer")):
        for f in os.listdir(src):
            shutil.copy(os.path.join(src, f), dst)
    return dst


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    """models/124M and models/355M both hold the tiny GPT-2 (one per layout): the
    tiny model stands in for the real sizes so main.py runs offline."""
    root = tmp_path_factory.mktemp("models")
    make_model_dir(os.path.join(root, "124M"), "tiny-openai")
    make_model_dir(os.path.join(root, "355M"), "tiny-hf")
    return str(root)


@pytest.fixture(scope="session")
def tiny(models_dir):
    """(encoder, hparams, params) of the tiny GPT-2."""
    return utils.load_model_dir(os.path.join(models_dir, "124M"))


@pytest.fixture(scope="session")
def reference():
    return dict(np.load(fixture_path("tiny-reference.npz")))


@pytest.fixture(params=["on-gpu", "on-cpu"])
def cupy(request, monkeypatch):
    """CuPy on a GPU, or the CPU's stand-in (cuda_on_cpu.py: our kernels' CUDA C compiled for
    the CPU) as `import cupy` gives it: the tests of kernels/cuda*.py run on both."""
    if request.param == "on-gpu":
        cupy = pytest.importorskip("cupy")
        try:
            cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CuPy installed, but no driver or GPU
            pytest.skip(f"no CUDA GPU: {e}")
    else:
        why = cuda_on_cpu.unavailable()
        if why:
            pytest.skip(f"CUDA C cannot run on this CPU: {why}")
        cupy = cuda_on_cpu.cupy()
        monkeypatch.setitem(sys.modules, "cupy", cupy)
    from kernels import cuda
    cuda.module.cache_clear()  # compiled for one or the other
    cuda.function.cache_clear()
    yield cupy
    cuda.module.cache_clear()
    cuda.function.cache_clear()
