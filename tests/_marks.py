"""Marks shared by the test files: what the default set, CI and a full run each take."""

import pytest

# more variants of a check the slow set makes in one: its other dtypes (`python -m pytest -m exhaustive`)
EXHAUSTIVE = (pytest.mark.slow, pytest.mark.exhaustive)


def first_then_exhaustive(values, keep=1):
    """``values`` for a parametrize: the first ``keep`` as they are, the rest exhaustive."""
    values = list(values)
    return values[:keep] + [pytest.param(v, marks=EXHAUSTIVE) for v in values[keep:]]
