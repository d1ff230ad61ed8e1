"""The weights as the kernels read them: laid out once at load, in the format asked for.

A checkpoint stores each matrix [n_in, n_out] row-major. The numba kernels read blocks
of 64 output columns (row_kernel.py), narrowed to bfloat16, int8 or int4 (weight_formats.py);
the NumPy fallback reads column-major matrices (rowwise.gemv_rows); a GPU (CuPy) takes
plain matrices. `decode_layout` makes the CPU's layout, `to_backend` moves the params to
the array library that runs them.
"""
import os

import numpy as np

from checkpoint import LoadError
from kernels import cuda_matmul, rowwise, weight_formats, weights


def decode_layout(params, kernel=None, dtype="float32"):
    """params with every weight matrix of the blocks, and the tied embedding, copied into
    the layout that the kernels read fastest (rowwise.py), each as a weights.Matrix that
    multiplies itself (`x @ w` runs the kernel); wpe and the other tensors stay
    memory-mapped as the checkpoint stores them. Shapes of activations do not change.

    kernel "numba" (row_kernel.py): each matrix w [n_in, n_out] becomes its blocks of 64
    output columns, [n_blocks, n_in, 64], in the format dtype (weight_formats.py:
    float32, bfloat16, int8 with a scale per column or int4 with one per group of 32
    inputs), and wte becomes a weights.Embedding over the blocks of its transpose, the
    tied head (the vocabulary padded to a multiple of 64, as nanoGPT pads it; the padding
    is cut off the logits): the embeddings are read from the head's blocks, so a narrow
    model keeps one copy of its embedding, the narrow one.
    kernel "numpy": each matrix column-major (Fortran order), so that the fallback's blocks
    of output columns are contiguous runs of memory; the head wte.T is column-major already.
    The price either way: a copy of the matrices at load (most of the model's bytes).
    """
    kernel = kernel or rowwise.KERNEL
    if dtype not in weight_formats.DTYPES:
        raise LoadError(f"--dtype {dtype}: the CPU runs {', '.join(weight_formats.DTYPES)}")
    if kernel != "numba":
        if dtype != "float32":
            raise LoadError(f"--dtype {dtype} needs the numba row kernel (pip install numba, and leave "
                            f"{rowwise.KERNEL_ENV} unset); the NumPy fallback runs --dtype float32")
        out = map_linear(params, lambda layer: {**layer, "w": weights.Matrix(column_major(layer["w"]),
                                                                              layer["w"].shape[1])})
        return {**out, "wte": weights.Embedding(weights.Matrix(params["wte"].T, params["wte"].shape[0]))}
    out = map_linear(params, lambda layer: {**layer, "w": kernel_blocks(layer["w"], dtype)})
    return {**out, "wte": weights.Embedding(kernel_blocks(params["wte"].T, dtype))}


NARROW_CHUNK = 16  # blocks a narrow format converts at a time: a few MB of float32, no copy of the whole matrix


def kernel_blocks(w, dtype):
    """A matrix w [n_in, n_out] as the numba kernels read it: a weights.Matrix of its blocks
    of 64 columns [n_blocks, n_in, 64] in the format dtype, with a scale for int8 and int4,
    int8's blocks with each column's weights in pairs of inputs [n_blocks, n_in / 2, 64, 2]
    (int8_kernel.py), int4's two a byte [n_blocks, n_in / 4, 4, 32] (int4_kernel.py).
    Every scale belongs to one column, so a narrow format converts NARROW_CHUNK blocks
    at a time: its float32 temporaries stay small, never a copy of the whole matrix."""
    if dtype == "float32":
        return weights.Matrix(rowwise.row_kernel.blocked(w), w.shape[1])
    width = NARROW_CHUNK * rowwise.row_kernel.W
    parts = [narrow_blocks(w[:, lo:lo + width], dtype) for lo in range(0, w.shape[1], width)]
    joined = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return weights.Matrix(joined["w"], w.shape[1], joined.get("scale"))


def narrow_blocks(w, dtype):
    """kernel_blocks of w [n_in, n_out] in a format narrower than float32."""
    layer = weight_formats.stored(rowwise.row_kernel.blocked(w), dtype)
    if dtype == "int8":
        layer["w"] = rowwise.int8_kernel.paired(layer["w"])
    if dtype == "int4":
        layer["w"] = rowwise.int4_kernel.packed(layer["w"])
    return layer


def map_linear(params, f):
    """params with f(layer) in place of every linear layer {"w", "b"} of the blocks."""
    blocks = [{**block, "attn": {name: f(block["attn"][name]) for name in ("c_attn", "c_proj")},
               "mlp": {name: f(block["mlp"][name]) for name in ("c_fc", "c_proj")}} for block in params["blocks"]]
    return {**params, "blocks": blocks}


def column_major(w, rows=256):
    """np.asfortranarray(w), but faster on big matrices: a whole-matrix transposing copy
    strides through memory on one side, while 256 rows at a time stay in cache on both."""
    out = np.empty(w.shape, w.dtype, order="F")
    for i in range(0, w.shape[0], rows):
        out[i:i + rows] = w[i:i + rows]
    return out


def plain_layout(params):
    """decode_layout undone: every weight matrix [n_in, n_out] and wte [n_vocab, n_embd]
    plain row-major arrays, as the checkpoint stores them (CuPy multiplies plain matrices;
    the benchmark measures what the layout buys)."""
    def plain(w):
        if not isinstance(w, weights.Matrix):
            return w
        if w.stored.dtype != np.float32:
            raise LoadError(f"a {w.stored.dtype} model has no plain float32 layout: load it as --dtype float32")
        if w.stored.ndim == 3:
            return np.ascontiguousarray(rowwise.row_kernel.unblocked(w.stored, w.n_out))  # [n_in, n_out]
        return np.ascontiguousarray(w.stored)  # [n_in, n_out]
    wte = params["wte"]
    wte = plain(wte.T).T.copy() if isinstance(wte, weights.Embedding) else wte  # [n_vocab, n_embd]
    return {**map_linear(params, lambda layer: {**layer, "w": plain(layer["w"])}), "wte": wte}


GPU_KERNELS_ENV = "GPT2_GPU_KERNELS"  # 1: the GPU's own kernels and recorded steps (cuda_graphs.py)


def gpu_kernels():
    """Whether a GPU runs our own kernels (GPU_KERNELS_ENV=1), not CuPy's operations (0, or
    unset); any other value is a ValueError (the commands' one line), not a silent 0."""
    value = os.environ.get(GPU_KERNELS_ENV, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{GPU_KERNELS_ENV}={value!r}: set it to 1 (the GPU's own kernels) or 0 (CuPy's "
                         "operations), or unset it")
    return value == "1"


def memory(on_gpu=False):
    """(where, bytes) of the machine's memory, or the GPU's; bytes None where the OS or CUDA
    does not say (no CuPy, no GPU: loading the model says so)."""
    if on_gpu:
        try:
            import cupy
            return "this GPU's", cupy.cuda.runtime.memGetInfo()[1]  # (free, total)
        except Exception:  # no CuPy, no driver, no GPU
            return "this GPU's", None
    try:
        return "this machine's", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return "this machine's", None


def check_memory(need, what, like, fix):
    """A ValueError where `what` takes more bytes than the memory like's arrays live in: past
    it the OS would kill the process midway, without a word of why."""
    where, have = memory(on_gpu=type(like).__module__.startswith("cupy"))
    if have and need > have:
        raise ValueError(f"{what} take {need / 2**30:.1f} GiB, more than {where} memory ({have / 2**30:.1f} GiB): "
                         f"{fix}")


def to_backend(params, backend="numpy", dtype="float32", kernels=None):
    """The params on the array library that runs them. NumPy keeps them as they are
    (memory-mapped, or laid out in their format at load); CuPy copies every tensor to the
    GPU once, as `dtype` (float32 or float16). From then on the model runs wherever its
    weights are (gpt2.py says how). kernels (None: GPT2_GPU_KERNELS=1 in the environment):
    each matrix transposed for the GPU's own kernels, whose steps are recorded as CUDA
    graphs (device_layout, cuda_graphs.py), instead of plain arrays for CuPy's operations and
    cuBLAS, the default: the path tests/test_cupy.py has checked on a GPU.
    CuPy is imported only here, so the NumPy path never needs it."""
    if backend == "numpy":
        if dtype == "float16":
            raise LoadError("--dtype float16 needs --backend cupy (NumPy has no fast float16 matmul)")
        return params  # bfloat16, int8 and int4 were converted as they were laid out (decode_layout)
    cupy = gpu_library()
    if kernels is None:
        kernels = gpu_kernels()
    try:
        if kernels:
            return device_layout(plain_layout(params), cupy, dtype)
        return tree_map(lambda w: cupy.asarray(w.astype(dtype, copy=False)), plain_layout(params))
    except cupy.cuda.memory.OutOfMemoryError as e:
        raise LoadError(f"the GPU has too little free memory for these weights ({e}): "
                        "try --dtype float16, a smaller model, or --backend numpy")


def device_layout(params, xp=np, dtype="float32"):
    """Plain params (plain_layout) as the GPU's own kernels read them, on xp in dtype: every
    weight matrix a cuda_matmul.Matrix, its transpose [n_out, n_in]; wte a weights.Embedding
    over one Matrix, the tied head (wte [n_vocab, n_embd] is the head's transpose already).
    With xp NumPy: the stand-in a CPU tests the GPU's bookkeeping with."""
    def move(a):
        return xp.asarray(np.asarray(a).astype(dtype, copy=False))
    rest = {name: tensor for name, tensor in params.items() if name != "wte"}
    transposed = map_linear(rest, lambda layer: {**layer, "w": cuda_matmul.Matrix(
        move(np.ascontiguousarray(np.asarray(layer["w"]).T)))})  # [n_out, n_in] each
    moved = tree_map(lambda a: a if isinstance(a, cuda_matmul.Matrix) else move(a), transposed)
    return {**moved, "wte": weights.Embedding(cuda_matmul.Matrix(move(params["wte"])))}


def gpu_library():
    """CuPy, or one clear LoadError saying what is missing (CuPy, a driver, a GPU)."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, or no CUDA driver or GPU
        raise LoadError(f"--backend cupy needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e}): "
                        "pip install cupy-cuda12x (or cupy-cuda13x), or use --backend numpy")
    return cupy


def tree_map(f, tree):
    """f applied to every array of a nested dict/list of params."""
    if isinstance(tree, dict):
        return {k: tree_map(f, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_map(f, v) for v in tree]
    return f(tree)
