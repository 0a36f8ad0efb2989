"""The table of operations (numbanorm.operations) against what the package exposes."""

import inspect

import pytest

import numbanorm
from numbanorm import operations, registry
from numbanorm.operations import KINDS, OPERATIONS


def _params(sig):
    """(name, default, kind) of each parameter but ``out`` (the oracle has none)."""
    return [(p.name, p.default, p.kind) for p in sig.parameters.values() if p.name != "out"]


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: op.name)
def test_top_level_functions_are_the_tables(op):
    for kind in KINDS:
        fn = getattr(numbanorm, op.function(kind))
        assert inspect.signature(fn) == op.signature(kind)
        assert fn.__doc__ == op.doc(kind) and fn.__name__ == op.function(kind)
        assert fn.__module__ == "numbanorm"


@pytest.mark.parametrize("name", list(registry.IMPLEMENTATIONS))
def test_every_implementation_has_the_tables_functions_and_parameters(name):
    mod = registry.get(name)
    for op in OPERATIONS:
        for kind in KINDS:
            got = _params(inspect.signature(getattr(mod, op.function(kind))))
            assert got == _params(op.signature(kind)), (name, op.function(kind))


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
