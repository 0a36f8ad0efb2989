"""The table of operations (numbanorm.operations) against what the package exposes."""

import inspect

import pytest

import numbanorm
from numbanorm import operations, registry
from numbanorm.operations import KINDS, OPERATIONS


def _params(sig, drop=()):
    """(name, default, kind) of each parameter but those in ``drop`` (annotations aside)."""
    return [(p.name, p.default, p.kind) for p in sig.parameters.values() if p.name not in drop]


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.name)
def test_top_level_functions_are_the_tables(op):
    for kind in KINDS:
        fn = getattr(numbanorm, op.function(kind))
        assert inspect.signature(fn) == op.signature(kind)
        assert fn.__doc__ == op.doc(kind) and fn.__name__ == op.function(kind)
        assert fn.__module__ == "numbanorm"


def _levels():
    """``(module name, module, the table's operations it has)`` for every level that exposes them."""
    levels = [("numbanorm", numbanorm, OPERATIONS), ("numbanorm.cpu", numbanorm.cpu, OPERATIONS),
              ("numbanorm.cuda", numbanorm.cuda, OPERATIONS)]
    try:
        import numbanorm.dask as nd
    except ImportError:  # dask is an optional extra
        pass
    else:
        levels.append(("numbanorm.dask", nd, [op for op in OPERATIONS if not op.fused]))
    return levels


@pytest.mark.parametrize("level", _levels(), ids=lambda level: level[0])
def test_one_signature_per_name_at_every_level(level):
    """A name takes the same parameters (names, kinds, defaults) everywhere: ``out=`` on the
    plain functions only, the forward and backward without it (the API contract's)."""
    name, mod, ops = level
    for op in ops:
        for kind in KINDS:
            fn = getattr(mod, op.function(kind))
            assert _params(inspect.signature(fn)) == _params(op.signature(kind)), (name, op.function(kind))
        assert "out" not in inspect.signature(getattr(mod, op.function("forward"))).parameters


def test_torch_functions_take_torch_nn_functionals_parameters():
    """numbanorm.torch's norms follow ``torch.nn.functional``'s signatures by contract (``input``,
    no ``out=``), parameter for parameter; the fused ones, which torch lacks, the top level's."""
    torch = pytest.importorskip("torch")
    import numbanorm.torch as nt

    for op in OPERATIONS:
        got = _params(inspect.signature(getattr(nt, op.name)))
        if op.fused:
            assert got == _params(op.signature("plain")), op.name
        else:
            assert got == _params(inspect.signature(getattr(torch.nn.functional, op.torch))), op.name
            # the top level's but for x's name and out=
            assert [n for n, *_ in got] == ["input", *op.forward_roles[1:]], op.name


@pytest.mark.parametrize("name", list(registry.IMPLEMENTATIONS))
def test_every_implementation_has_the_tables_functions_and_parameters(name):
    mod = registry.get(name)
    drop = ("out",) if name == "oracle" else ()  # the oracle returns fresh float64 arrays: no out=
    for op in OPERATIONS:
        for kind in KINDS:
            got = _params(inspect.signature(getattr(mod, op.function(kind))))
            assert got == _params(op.signature(kind), drop), (name, op.function(kind))


def _sections(doc):
    """numpydoc ``{section: [entry names]}`` of ``doc`` (an entry: an unindented ``name : type`` line)."""
    out, lines, current = {}, doc.splitlines(), None
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and lines[i + 1] and set(lines[i + 1]) == {"-"} and len(lines[i + 1]) == len(line):
            current = out.setdefault(line, [])
        elif current is not None and line and not line.startswith(" ") and set(line) != {"-"}:
            current.append(line.split(" : ")[0])
    return out


def _documented():
    """``(level, module, [(operation, kind, function name)])``: every public function of the table."""
    out = [(name, mod, [(op, kind, op.function(kind)) for op in ops for kind in KINDS]) for name, mod, ops in _levels()]
    try:
        import numbanorm.torch as nt
    except ImportError:  # torch is an optional extra
        pass
    else:
        out.append(("numbanorm.torch", nt, [(op, "plain", op.name) for op in OPERATIONS]))
    return out


@pytest.mark.parametrize("level", _documented(), ids=lambda level: level[0])
def test_every_public_function_documents_its_parameters_results_and_errors(level):
    """numpydoc sections for every function at every level: each parameter of its signature
    in order, each result the table names, and the errors it raises."""
    import pydoc

    name, mod, functions = level
    for op, kind, function in functions:
        fn = getattr(mod, function)
        sections = _sections(fn.__doc__)
        assert sections["Parameters"] == list(inspect.signature(fn).parameters), (name, fn.__name__)
        outputs = {"plain": op.plain_outputs, "forward": op.forward_outputs, "backward": op.backward_outputs}
        assert sections["Returns"] == list(outputs[kind]), (name, fn.__name__)
        assert sections["Raises"][:2] == ["TypeError", "ValueError"], (name, fn.__name__)
        shown = pydoc.render_doc(fn)  # what help() prints
        assert all(f"{p} : " in shown for p in inspect.signature(fn).parameters), (name, fn.__name__)


def _x_entry(fn):
    """The text of a docstring's entry of x (input at the torch level) on one line; None where
    the function takes no x (a fused backward)."""
    lines = fn.__doc__.split("----------\n", 1)[1].splitlines()
    at = next((i for i, t in enumerate(lines) if t.split(" : ")[0] in ("x", "input")), None)
    if at is None:
        return None
    end = next(i for i, t in enumerate(lines[at + 1:], at + 1) if not t.startswith(" "))
    return " ".join(line.strip() for line in lines[at + 1:end])


@pytest.mark.parametrize("level", _documented(), ids=lambda level: level[0])
def test_group_norms_docstring_says_the_layout_its_results_come_back_in(level):
    """A channels-last x: the results' layout is the one the level's docstring names (every
    level said "come back in it", where a Dask array's blocks and a GPU's are C order)."""
    import numpy as np

    name, mod, functions = level
    x = np.random.default_rng(0).standard_normal((2, 3, 3, 6)).astype(np.float32).transpose(0, 3, 1, 2)
    if name == "numbanorm.torch":
        import torch

        y = mod.group_norm(torch.from_numpy(x), 3)
        kept = y.is_contiguous(memory_format=torch.channels_last)
    else:
        y = operations.to_host(np.asarray(mod.group_norm(x, 3))) if name != "numbanorm.dask" else \
            mod.group_norm(x, 3).compute()
        kept = y.strides == x.strides
    told = _x_entry(mod.group_norm)
    # numbanorm.cuda shares the top level's text, which names it among the GPU's
    says = "come back in it" in told and not (name == "numbanorm.cuda" and "(``numbanorm.cuda``" in told)
    assert says == kept == (name in ("numbanorm", "numbanorm.cpu", "numbanorm.torch")), (name, told)
    for op, kind, function in functions:  # what the level has: the backward only where it is public
        told = _x_entry(getattr(mod, function))
        if told is not None:
            assert ("backward takes" in told) == (name != "numbanorm.torch"), (name, function)
            assert ("takes ``s``" in told) == (op.fused and name != "numbanorm.torch"), (name, function)


@pytest.mark.parametrize("level", _levels(), ids=lambda level: level[0])
def test_a_backwards_raises_section_names_its_normalized_shape_refusals(level):
    """A row backward refuses a normalized_shape of floats (TypeError) and one that does not
    match (ValueError), as the forward does: its Raises section says so (it named neither)."""
    import numpy as np

    name, mod, ops = level
    for op in ops:
        if op.layout != "rows":
            continue
        fn = getattr(mod, op.function("backward"))
        values = {"x": np.ones((2, 4), np.float32), "normalized_shape": 4}
        if op.fused:
            values["residual"] = values["x"]
        fwd = dict(zip(op.forward_outputs, op.call(numbanorm.cpu, "forward", values)))
        args = {"dy": values["x"], "ds": None, "s": fwd.get("s"), "x": values["x"], **fwd, "weight": None}
        raises = fn.__doc__.split("Raises\n------\n")[1]
        type_part, value_part = raises.split("ValueError")
        for bad, exc, part in [(4.0, TypeError, type_part), (5, ValueError, value_part)]:
            call = [args[r] if r != "normalized_shape" else bad for r in op.backward_roles]
            with pytest.raises(exc, match="normalized_shape"):
                res = fn(*call)
                if name == "numbanorm.dask":
                    res[0].compute()
            assert "``normalized_shape``" in part, (name, op.function("backward"))


def test_public_names():
    assert set(operations.FUNCTIONS) <= set(numbanorm.__all__)
    assert list(numbanorm.cpu.__all__) == list(operations.FUNCTIONS)
    assert set(operations.FUNCTIONS) <= set(numbanorm.cuda.__all__)


def test_an_implementation_lacking_a_function_is_not_usable(monkeypatch):
    import types
    import sys

    fake = types.ModuleType("numbanorm_fake_impl")
    for f in operations.FUNCTIONS[:-1]:
        setattr(fake, f, getattr(numbanorm.cpu, f))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "fake", fake.__name__)
    ok, why = registry.usable("fake")
    assert not ok and operations.FUNCTIONS[-1] in why


def test_docstring_lines_are_textwraps():
    """The docstrings' own line filling (made at import, so without textwrap's regular
    expressions) gives textwrap.wrap's lines: for every formula and every role's text (at
    the parameters' indent), a line longer than the width, one word and nothing."""
    import textwrap

    from numbanorm import operations as O

    texts = [(O._doc_fields(op)["formula"], "") for op in O.OPERATIONS]
    texts += [(text, "    ") for _, text in O.ROLES.values()]
    texts += [("a " * 60 + "word", ""), ("one", "    "), ("", "")]
    assert len(texts) > 10
    for text, indent in texts:
        want = textwrap.wrap(text, 88 - len(indent), initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)
        assert O._wrapped(text, indent) == want, text


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.name)
def test_the_torch_counterpart_traces_in_one_graph(op):
    """``call_torch`` is what benchmarks.gpu_check compiles as the torch.compile peer (with
    fullgraph=True): Dynamo must trace it without a break (np.ndim on the shape did not:
    every row norm's torch.compile row was skipped on the H200)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    n = 8
    v = {"x": torch.randn(2, n, 3, generator=gen) if op.layout != "rows" else torch.randn(3, n, generator=gen),
         "weight": torch.rand(n, generator=gen) + 0.5, op.shape_role: 2 if op.layout != "rows" else n}
    if op.bias:
        v["bias"] = torch.randn(n, generator=gen)
    if op.fused:
        v["residual"] = torch.randn_like(v["x"])

    def f(**vals):
        return op.call_torch(F, vals)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(compiled(**v), f(**v))
