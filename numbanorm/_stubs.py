"""The type stubs (``.pyi``) of the generated public functions, written from the table.

The functions of ``numbanorm``, ``numbanorm.cpu``, ``numbanorm.cuda``,
``numbanorm.dask`` and ``numbanorm.torch`` are generated at import from
``numbanorm.operations``, so a type checker or an IDE reading the source finds
none of them; these stubs declare them, with their numpydoc docstrings.
``python -m numbanorm._stubs`` rewrites the files; tests/test_stubs.py checks
that the committed ones are what the table gives.  ``numbanorm.cuda``'s are the top
level's (the same signatures, array types and docstrings), imported.

Array types: NumPy arrays in give NumPy arrays out (the first overload); any
other array the top level takes (a CUDA array: numba's, CuPy's, torch's, or
anything with ``__cuda_array_interface__`` or DLPack) gives the caller's own
array type, which a stub cannot name (``Any``).
"""

from __future__ import annotations

import os

from .operations import KINDS, OPERATIONS, ROLES

HEADER = "# Generated from numbanorm/operations.py by `python -m numbanorm._stubs`: do not edit.\n"

# the types every level's arrays and scalars are declared with
_ARRAYS = '''

class _CudaArray(Protocol):
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class _DLPackArray(Protocol):
    def __dlpack_device__(self) -> tuple[int, int]: ...

# what the top level dispatches on: NumPy arrays to the CPU, CUDA arrays to the GPU
_Array: TypeAlias = NDArray[Any] | _CudaArray | _DLPackArray
_Shape: TypeAlias = SupportsIndex | Sequence[SupportsIndex]
'''

_NUMPY_IMPORTS = ("from collections.abc import Sequence\n"
                  "from typing import Any, Protocol, SupportsFloat, SupportsIndex, TypeAlias, overload\n\n"
                  "from numpy.typing import NDArray\n")

# (imports, array type, its result type, the normalized_shape type) of the one-signature levels
_LEVELS = {
    "cpu": ("from collections.abc import Sequence\nfrom typing import Any, SupportsFloat, SupportsIndex, TypeAlias\n\n"
            "from numpy.typing import NDArray\n\n_Shape: TypeAlias = SupportsIndex | Sequence[SupportsIndex]\n",
            "NDArray[Any]", "NDArray[Any]", "_Shape"),
    "dask": ("from collections.abc import Sequence\nfrom typing import Any, SupportsFloat, SupportsIndex, TypeAlias\n\n"
             "import dask.array as da\nfrom numpy.typing import NDArray\n\n"
             "_Shape: TypeAlias = SupportsIndex | Sequence[SupportsIndex]\n",
             "da.Array | NDArray[Any]", "da.Array", "_Shape"),
    "torch": ("from collections.abc import Sequence\nfrom typing import Any, Literal, NamedTuple, TypeVar, "
              "overload\n\nimport torch\nfrom torch import Tensor\n",
              "Tensor", "Tensor", "int | Sequence[int]"),
}

# what numbanorm/__init__.py, cuda/__init__.py and torch.py define besides the table's functions
_EXTRA = {
    "numbanorm": '''
from . import cpu as cpu, cuda as cuda
from .layers import GroupNorm as GroupNorm, LayerNorm as LayerNorm, RMSNorm as RMSNorm

__version__: str
''',
    "cuda": '''
def is_available() -> bool:
    """True where the GPU kernels can run (a CUDA GPU, or numba's simulator)."""

def why_unavailable() -> str:
    """Why the GPU kernels cannot run here ('' where they can)."""
''',
    "torch": '''
_M = TypeVar("_M", bound=torch.nn.Module)

class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running numbanorm's kernels."""

class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running numbanorm's kernels."""

class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` running numbanorm's kernels."""

class NormReport(NamedTuple):
    """What ``replace_norms`` did: ``(path, class, how)`` per module replaced, ``(path, class, why)``
    per norm left alone."""

    replaced: list[tuple[str, str, str]]
    left_alone: list[tuple[str, str, str]]

@overload
def replace_norms(module: _M, strict: bool = False, *, report: Literal[False] = False) -> _M: ...
@overload
def replace_norms(module: _M, strict: bool = False, *, report: Literal[True]) -> tuple[_M, NormReport]: ...

OPERATORS: tuple[Any, ...]
''',
}

# module -> (its stub's path under numbanorm/, the names of its __all__ after the table's functions)
MODULES = {
    "numbanorm": ("__init__.pyi", ("LayerNorm", "RMSNorm", "GroupNorm")),
    "numbanorm.cpu": ("cpu/__init__.pyi", ()),
    "numbanorm.cuda": ("cuda/__init__.pyi", ("is_available", "why_unavailable")),
    "numbanorm.dask": ("dask.pyi", ()),
    "numbanorm.torch": ("torch.pyi", ("LayerNorm", "RMSNorm", "GroupNorm", "replace_norms", "NormReport")),
}


def _outputs(op, kind):
    return {"plain": op.plain_outputs, "forward": op.forward_outputs, "backward": op.backward_outputs}[kind]


def _result(op, kind, array):
    outs = _outputs(op, kind)
    return array if len(outs) == 1 else f"tuple[{', '.join([array] * len(outs))}]"


def _def(name, params, result, doc=None):
    """``def name(params) -> result:`` and the docstring, or ``...``; one parameter a line when long."""
    line = f"def {name}({', '.join(params)}) -> {result}:"
    if len(line) > 100:
        line = f"def {name}(\n" + "".join(f"    {p},\n" for p in params) + f") -> {result}:"
    return f"{line}\n{doc}" if doc else f"{line} ...\n"


def _params(op, kind, array, shape, names=None, out="array", eps="SupportsFloat"):
    """The annotated parameters of ``kind``; ``out``: its type (``array``: the arrays'), or None to
    leave it out; ``eps``: eps's type."""
    names = names or {}
    parts, keyword_only = [], False
    for p in op.signature(kind).parameters.values():
        if p.name == "out" and out is None:
            continue
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        if p.name in ("normalized_shape",):
            t = shape
        elif p.name == "num_groups":
            t = "int"
        elif p.name == "eps":  # (a NumPy float32 eps too: numbers.Real and NumPy's floats, API.md)
            t = eps if p.default is not None else f"{eps} | None"
        elif p.name == "out" and out != "array":
            t = out
        else:  # an array role: None where it has a default, or where the table says so (ds)
            optional = p.default is not p.empty or ROLES[p.name][0].endswith(" or None")
            t = f"{array} | None" if optional else array
        default = "" if p.default is p.empty else f" = {p.default!r}"
        parts.append(f"{names.get(p.name, p.name)}: {t}{default}")
    return parts


def _docstring(doc, indent="    "):
    lines = doc.rstrip("\n").splitlines()
    body = "\n".join(indent + line if line else "" for line in lines)
    return f'{indent}"""{body.lstrip()}\n{indent}"""\n'


def _functions(level, ops, array, result, shape, names=None, out="array", doc_level="numbanorm", leading=None):
    """The stub text of ``ops``' functions; with ``leading`` (the numpy overload's array type),
    two overloads each: NumPy arrays in give NumPy arrays out, any other array ``Any``."""
    text = []
    for op in ops:
        for kind in (KINDS if level != "torch" else ("plain",)):
            name = op.function(kind)
            doc = _docstring(op.doc(kind, doc_level))
            if leading is None:  # the fused functions keep numbanorm's names in numbanorm.torch too
                params = _params(op, kind, array, shape, None if op.fused else names, out,
                                 "float" if level == "torch" else "SupportsFloat")  # (torch's own: float)
                text.append(_def(name, params, _result(op, kind, result), doc))
                continue
            text.append("@overload\n" + _def(name, _params(op, kind, leading, shape), _result(op, kind, leading), doc)
                        + "@overload\n" + _def(name, _params(op, kind, array, shape), _result(op, kind, "Any")))
    return "\n".join(text)


def render(module):
    """The stub text of ``module`` (a key of ``MODULES``)."""
    level = module.rpartition(".")[2]
    _, extra_names = MODULES[module]
    ops = [op for op in OPERATIONS if not (level == "dask" and op.fused)]  # dask has no fused forms
    if level in _LEVELS:
        imports, array, result, shape = _LEVELS[level]
        torch = level == "torch"
        body = _functions(level, ops, array, result, shape, names={"x": "input"} if torch else None,
                          out={"torch": None, "dask": "None"}.get(level, "array"),
                          doc_level=level if level != "cpu" else "numbanorm")
    elif level == "cuda":  # the top level's functions, the same signatures and docstrings
        names = "".join(f"    {f} as {f},\n" for op in ops for f in op.functions)
        imports, body = f"from numbanorm import (\n{names})\n", ""
    else:  # the top level: NumPy in, NumPy out; a CUDA array in, its own type out
        imports = _NUMPY_IMPORTS
        body = _functions(level, ops, "_Array", "Any", "_Shape", leading="NDArray[Any]")
    functions = [op.name if level == "torch" else f for op in ops for f in
                 ((op.name,) if level == "torch" else op.functions)]
    names = "".join(f'    "{n}",\n' for n in (*functions, *extra_names))
    types = "" if level in _LEVELS or level == "cuda" else _ARRAYS
    return f"{HEADER}\n{imports}{_EXTRA.get(level, '')}{types}\n__all__ = [\n{names}]\n\n{body}"


def path(module):
    """Where ``module``'s stub lives in the package."""
    return os.path.join(os.path.dirname(__file__), MODULES[module][0])


def main():
    for module in MODULES:
        with open(path(module), "w") as f:
            f.write(render(module))
        print(f"wrote {path(module)}")


if __name__ == "__main__":
    main()
