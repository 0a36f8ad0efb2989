"""The type stubs of the generated public functions (``numbanorm/_stubs.py``) and ``py.typed``."""

import ast
import importlib
import inspect
import os
import textwrap

import pytest

import numbanorm
from numbanorm import _stubs

MODULES = list(_stubs.MODULES)


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError as e:  # dask and torch are optional extras
        pytest.skip(f"{name}: {e}")


@pytest.mark.parametrize("name", MODULES)
def test_the_shipped_stub_is_the_tables(name):
    """The stub in the package (the installed one, in CI) is what the table gives today:
    ``python -m numbanorm._stubs`` rewrites it after a change to the table."""
    with open(_stubs.path(name)) as f:
        assert f.read() == _stubs.render(name), f"{_stubs.path(name)} is stale: run python -m numbanorm._stubs"


def _declared(tree):
    """``{name: [parameter names of each def of that name]}`` and the other names a stub declares."""
    defs, others = {}, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            defs.setdefault(node.name, []).append([p.arg for p in a.posonlyargs + a.args + a.kwonlyargs])
        elif isinstance(node, ast.ClassDef):
            others.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            others.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            others.update(alias.asname for alias in node.names if alias.asname)
    return defs, others


@pytest.mark.parametrize("name", MODULES)
def test_the_stub_declares_what_the_module_defines(name):
    """The stub's ``__all__`` is the module's, every public name is declared, and each function
    (each overload) takes the runtime function's parameters."""
    mod = _module(name)
    with open(_stubs.path(name)) as f:
        tree = ast.parse(f.read())
    stub_all = next(ast.literal_eval(n.value) for n in tree.body
                    if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert sorted(stub_all) == sorted(mod.__all__)
    defs, others = _declared(tree)
    declared = set(defs) | others
    defined_here = {n for n, v in vars(mod).items() if getattr(v, "__module__", None) == name}
    public = {n for n in (*mod.__all__, *defined_here) if not n.startswith("_")}
    assert public <= declared, public - declared
    assert all(hasattr(mod, n) for n in declared if not n.startswith("_")), declared
    for fn, overloads in defs.items():
        want = list(inspect.signature(getattr(mod, fn)).parameters)
        assert all(params == want for params in overloads), (fn, overloads, want)


def test_the_package_is_marked_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(numbanorm.__file__), "py.typed"))


GOOD = """
    import numpy as np
    from numpy.typing import NDArray

    import numbanorm as nn
    import numbanorm.cpu as nc
    import numbanorm.cuda as ncu

    x = np.ones((4, 8), np.float32)
    y: NDArray[np.float32] = nn.layer_norm(x, 8, out=np.empty_like(x))
    y, mean, rstd = nn.layer_norm_forward(x, (8,), None, None, 1e-5)
    dx, dweight, dbias = nn.layer_norm_backward(x, x, mean, rstd, 8)
    y, s = nn.add_rms_norm(x, x, 8, eps=None)
    y, s, mean, rstd = nn.add_layer_norm_forward(x, x, 8, eps=np.float32(1e-5))
    dx, dweight, dbias = nn.add_layer_norm_backward(x, None, s, mean, rstd, 8)  # ds None: zero
    dx, dweight = nc.add_rms_norm_backward(x, None, s, rstd, 8)
    g = nn.group_norm(np.ones((2, 4, 3)), 2, weight=np.ones(4))
    y, rstd = nc.rms_norm_forward(x, 8)
    ok: bool = ncu.is_available()
    y = ncu.rms_norm(x, 8)
    layer = nn.LayerNorm(8)
"""

# each line one mistake a type checker must catch
BAD = """
    import numpy as np
    import numbanorm as nn

    x = np.ones((4, 8), np.float32)
    nn.layer_norm_forward(x, 8, out=x)
    nn.layer_norm(x, "8")
    nn.rms_norm(x, 8, eps="1e-5")
    nn.group_norm(x, 2, 3)
    y, mean = nn.layer_norm_forward(x, 8)
    nn.layer_norm("x", 8)
    nn.rms_norm(x, 8, bias=None)
    nn.layer_norm_backward(x, x, 8)
"""


def test_a_type_checker_accepts_a_users_calls_and_refuses_wrong_ones(tmp_path):
    """mypy, on the stubs as a user's project sees them (``py.typed``): the calls of GOOD
    check, each line of BAD after the imports is an error."""
    api = pytest.importorskip("mypy.api")
    for name, text in (("good", GOOD), ("bad", BAD)):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    args = ["--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context",
            "--show-error-codes", "--no-pretty"]
    out, err, status = api.run([*args, str(tmp_path / "good.py")])
    assert status == 0, out + err
    out, err, status = api.run([*args, str(tmp_path / "bad.py")])
    lines = textwrap.dedent(BAD).splitlines()
    calls = {i for i, line in enumerate(lines, 1) if line.startswith("nn.") or line.startswith("y, mean")}
    flagged = {int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line}
    assert flagged == calls, out + err
