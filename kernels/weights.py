"""Weights that multiply themselves: how the kernels enter gpt2.py without a branch in it.

gpt2.py's `linear` is picoGPT's `x @ w + b`, and its head is `x @ wte.T`. On a CPU the
matrices are not stored as the checkpoint stores them (layout.py): the numba kernels read
blocks of 64 output columns in float32, bfloat16, int8 or int4, and the NumPy fallback
reads column-major matrices one row at a time. A `Matrix` holds such a stored matrix
and is what `w` is in `x @ w`: NumPy sees that it sets `__array_ufunc__ = None` and
hands the product to its `__rmatmul__` (NEP 13: the protocol CuPy's arrays use to take
over NumPy's functions), which runs rowwise.matmul: every row of x comes out as it
would alone. `Embedding` is the tied wte: `wte[tokens]` reads the tokens' embeddings and
`wte.T` is the head, both from the one stored matrix, so a narrow model keeps one copy.

The format and the kernel are chosen once, at load; a pass never asks which runs. A GPU's
kernels enter the same way: cuda_matmul.Matrix, of device memory, whose __rmatmul__
launches them.
"""
import numpy as np

from kernels import rowwise


class Matrix:
    """A weight matrix [n_in, n_out] as the CPU's kernels store it: `stored`, the blocks
    [n_blocks, n_in, 64] (int8: paired, int4: packed) or a column-major matrix; `scale`
    for int8 and int4; `n_out`, the real outputs (the last block is padded)."""
    __array_ufunc__ = None  # x @ m: NumPy returns NotImplemented, Python calls m.__rmatmul__(x)

    def __init__(self, stored, n_out, scale=None):
        self.stored, self.n_out, self.scale = stored, n_out, scale

    @property
    def shape(self):
        n_in = self.stored.shape[0] if self.stored.ndim == 2 else rowwise.n_inputs(self.stored)
        return n_in, self.n_out

    dtype = np.dtype(np.float32)  # what it multiplies and returns, whatever it stores

    @property
    def nbytes(self):
        return self.stored.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def __rmatmul__(self, x):
        """x [..., n_in] @ self -> [..., n_out], each row of x as if alone."""
        rows = x.reshape(-1, x.shape[-1])  # [n, n_in]
        if rows.shape[0] == 0:  # a pass that only fills the cache asks its head for no logits
            return np.zeros((*x.shape[:-1], self.n_out), np.float32)
        return rowwise.matmul(rows, self.stored, self.n_out, self.scale).reshape(*x.shape[:-1], self.n_out)

    def first(self, n):
        """The first n columns (a view: the kernels stop at n outputs)."""
        if self.stored.ndim == 2:
            return Matrix(self.stored[:, :n], n)
        return Matrix(self.stored, n, self.scale)

    def columns(self, j):
        """Columns j [n] as float32 rows [n, n_in]."""
        if self.stored.ndim == 2:
            return self.stored[:, j].T
        return rowwise.columns(self.stored, j, self.scale)


class Embedding:
    """The tied token embedding wte [n_vocab, n_embd], stored once as its transpose, the
    head (a Matrix [n_embd, n_vocab]): wte[tokens] reads its columns, wte.T is the head,
    wte[:n] the first n tokens' (a draft's smaller head: speculative.py)."""
    __array_ufunc__ = None

    def __init__(self, head):
        self.T = head

    @property
    def shape(self):
        n_embd, n_vocab = self.T.shape
        return n_vocab, n_embd

    dtype = np.dtype(np.float32)

    @property
    def nbytes(self):
        return self.T.nbytes

    def __getitem__(self, tokens):
        if isinstance(tokens, slice):
            if tokens.start not in (None, 0) or tokens.step not in (None, 1):
                raise IndexError("an Embedding gives its first n tokens (wte[:n]), no other slice")
            return Embedding(self.T.first(len(range(self.shape[0])[tokens])))
        tokens = tokens if hasattr(tokens, "reshape") else np.asarray(tokens)  # a list, or an array (a GPU's too)
        rows = self.T.columns(tokens.reshape(-1))  # [n, n_embd]
        return rows.reshape(*tokens.shape, rows.shape[-1])  # [*tokens.shape, n_embd]
