"""Row functions called with the addresses of their arrays: a small call from PyTorch
without NumPy arrays in between.

A one-row LayerNorm through ``numbanorm.torch`` spent several times its kernel's time
making NumPy views of its tensors and tensors of its results (``Tensor.numpy()``,
``torch.from_numpy``: the book's design log).  An *addressed entry* takes each
array as an integer address (``Tensor.data_ptr()``) with the row count ``m`` and length
``n``, makes the arrays there (``numba.carray``) and calls the very row function
``common.launch`` runs on the calling thread, compiled for the same argument types: the
same bits.  One entry is generated per row function and per dtype of each array (None:
the argument is None), like ``common.in_blocks``'s parallel kernels, and cached beside
the row function's module.

An entry of a backward (a row function with dweight partials, ``common.in_partials``)
takes the addresses of dweight (and dbias) instead of the partials, and their count
(the launcher's ``n_chunks(m, n)``): it makes the partial rows itself and sums them in
NumPy's order (``ndarray.sum(axis=0)``: from 0, row after row), as the launcher does.

The caller owns every check: C-contiguous arrays of these dtypes and shapes, alive for
the call, outputs apart from inputs.  An entry returns what the row function returns,
the rows left to its rescaling variant: a caller that gets a nonzero count runs the call
again by the launcher, which rescues them.
"""

import functools
import inspect
import linecache

import numpy as np
from numba import carray, types
from numba.extending import intrinsic

from . import background
from .cache import GENERATED, njit

# each array argument's shape, from the entry's m (rows) and n (row length)
SHAPES = {"x": "(m, n)", "r": "(m, n)", "y": "(m, n)", "s": "(m, n)", "dy": "(m, n)", "dx": "(m, n)",
          "ds": "(m, n)", "w": "(n,)", "b": "(n,)", "mean": "(m,)", "rstd": "(m,)"}
# a backward's partials, made by the entry, and the sums they go to (the entry's arguments)
PARTIALS = {"dw_part": "dweight", "db_part": "dbias"}


@intrinsic
def at(typingctx, address, dtype):
    """A pointer to ``dtype`` at the integer ``address``."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    pointer = types.CPointer(dtype.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, dtype), codegen


def parameters(rows, dropped=()):
    """The arguments of ``rows``' entry, in order: its own (a partial replaced by its sum,
    ``stream`` and the ``dropped`` outputs left out), then the sizes: ``m``, ``n`` and, for
    a row function with partials, ``blocks`` (``common.n_chunks(m, n)``, the launcher's count)."""
    own = list(inspect.signature(rows.py_func).parameters)[:-2]
    names = [PARTIALS.get(p, p) for p in own if p != "stream" and p not in dropped]
    return names + ["m", "n"] + (["blocks"] if set(own) & set(PARTIALS) else [])


@functools.lru_cache(maxsize=None)
def entry(rows, acc, dropped=(), **dtypes):
    """The addressed entry of row function ``rows`` (a Numba dispatcher) for arrays of
    ``dtypes`` (parameter name -> NumPy dtype as the row function reads it, or None for an
    argument that is None; every array parameter named), accumulation dtype ``acc``.
    ``dropped``: outputs the entry makes itself and drops (a plain forward's statistics),
    which it then takes no address of (:func:`parameters`).

    Compiled on the compile thread (``background``): until it is, a call raises
    ``background.NotCompiled`` and its caller takes the launcher's path."""
    params = list(inspect.signature(rows.py_func).parameters)[:-2]
    assert set(dtypes) == {p for p in params if p in SHAPES or p in PARTIALS}, (params, dtypes)
    env = {"carray": carray, "at": at, "np": np, "ROWS": rows, "ACC": np.dtype(acc).type,
           **{f"T_{p}": np.dtype(d).type for p, d in dtypes.items() if d is not None}}
    body, call = [], []
    for p in params:
        if p in dropped:
            body.append(f"    {p} = np.empty({SHAPES[p]}, T_{p})")
        elif p in SHAPES:
            body.append(f"    {p} = None" if dtypes[p] is None else f"    {p} = carray(at({p}, T_{p}), {SHAPES[p]})")
        elif p in PARTIALS:
            body.append(f"    {p} = np.empty((blocks, n), ACC)")
        elif p == "eps":
            body.append("    eps = ACC(eps)")  # (as the launcher: acc.type(eps))
        call.append("NO" if p == "stream" else p)
    partials = [p for p in params if p in PARTIALS]
    # a literal False or 0 here would be typed Literal[bool], Literal[int]: a second compile of
    # the row function for them, beside the launcher's (bool, int64, int64)
    body.append("    NO, ZERO = np.bool_(False), np.int64(0)")
    bounds = "ZERO, blocks" if partials else "ZERO, m"
    body.append(f"    left = ROWS({', '.join(call)}, {bounds})")
    for p in partials:
        s = PARTIALS[p]
        body += [f"    {s} = carray(at({s}, ACC), (n,))",
                 "    for j in range(n):",
                 "        total = ACC(0)",  # (NumPy's add.reduce starts from its identity: -0.0 sums to +0.0)
                 "        for k in range(blocks):",
                 f"            total += {p}[k, j]",
                 f"        {s}[j] = total"]
    body.append("    return left")
    name = "_".join(["addressed", np.dtype(acc).name] + [f"{p}_{np.dtype(d).name}" for p, d in dtypes.items()
                                                          if d is not None and p not in dropped]
                    + [f"no_{p}" for p in dropped])
    src = f"def entry({', '.join(parameters(rows, dropped))}):\n" + "\n".join(body) + "\n"
    source = rows.py_func.__code__.co_filename
    filename = f"{source} <addressed entry {name} of {rows.py_func.__qualname__}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    GENERATED[filename] = source
    exec(compile(src, filename, "exec"), env)
    f = env["entry"]
    f.__qualname__ = f"{rows.py_func.__qualname__}.{name}"  # its cache file's name: one per entry
    f.__module__ = rows.py_func.__module__
    return njit(cache=True, nogil=True, dispatcher=background.Dispatcher)(f)
