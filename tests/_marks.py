"""Marks shared by the test files: what the default set, CI and a full run each take."""

import numpy as np
import pytest

# more variants of a check the slow set makes in one: its other dtypes (`python -m pytest -m exhaustive`)
EXHAUSTIVE = (pytest.mark.slow, pytest.mark.exhaustive)


def first_then_exhaustive(values, keep=1):
    """``values`` for a parametrize: the first ``keep`` as they are, the rest exhaustive."""
    values = list(values)
    return values[:keep] + [pytest.param(v, marks=EXHAUSTIVE) for v in values[keep:]]


def slow_where(cases, slow):
    """pytest params of ``cases`` (tuples of argument values; ids from them, dtypes by name),
    those for which ``slow(*case)`` holds marked slow."""
    name = lambda v: np.dtype(v).name if isinstance(v, type) else str(v)  # noqa: E731
    return [pytest.param(*c, marks=[pytest.mark.slow] if slow(*c) else [], id="-".join(map(name, c)))
            for c in cases]
