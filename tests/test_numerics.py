"""The contract's numerics at their edges, on the CPU: long rows with a large offset
and huge finite values, every function, forward and backward, against the oracle."""

import numpy as np
import pytest

import numbanorm as nn
from conftest import ORACLE

LONG = 1 << 22


def _offset_rows(rng, rows, n, mean=1e4, std=1e-2):
    return (mean + std * rng.standard_normal((rows, n))).astype(np.float32)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# ---------------------------------------------------------------- long rows

@pytest.fixture(scope="module")
def long_row():
    return _offset_rows(np.random.default_rng(5), 1, LONG)


@pytest.fixture(scope="module")
def long_dy():
    return np.random.default_rng(6).standard_normal((1, LONG)).astype(np.float32)


def test_layer_norm_long_row(long_row, long_dy):
    x, dy = long_row, long_dy
    y, mean, rstd = nn.layer_norm_forward(x, LONG)
    yr, mr, rr = ORACLE.layer_norm_forward(x, LONG)
    assert _rel(rstd, rr) < 1e-3, (rstd, rr)
    assert np.max(np.abs(y - yr)) < 2e-3
    # the contract's words: unit variance within 1e-3 (eps=0, else eps shrinks it)
    y0 = nn.layer_norm(x, LONG, eps=0.0)
    assert np.isfinite(y0).all() and abs(float(np.std(y0.astype(np.float64))) - 1) < 1e-3
    dx, dw, db = nn.layer_norm_backward(dy, x, mean, rstd, LONG)
    dxr, dwr, dbr = ORACLE.layer_norm_backward(dy, x, mean, rstd, LONG)
    assert _rel(dx, dxr) < 1e-3 and _rel(dw, dwr) < 1e-3 and _rel(db, dbr) < 1e-5


def test_add_layer_norm_long_row(long_row, long_dy):
    res = np.full_like(long_row, 0.5)
    y, s, mean, rstd = nn.add_layer_norm_forward(long_row, res, LONG)
    yr, mr, rr = ORACLE.layer_norm_forward(s, LONG)
    assert _rel(rstd, rr) < 1e-3 and np.max(np.abs(y - yr)) < 2e-3
    dx = nn.add_layer_norm_backward(long_dy, long_dy, s, mean, rstd, LONG)[0]
    dxr = ORACLE.add_layer_norm_backward(long_dy, long_dy, s, mean, rstd, LONG)[0]
    assert _rel(dx, dxr) < 1e-3


def test_rms_norm_long_row(long_row, long_dy):
    # RMSNorm has no mean to subtract: its sum of squares is the long reduction
    x, dy = long_row, long_dy
    y, rstd = nn.rms_norm_forward(x, LONG)
    yr, rr = ORACLE.rms_norm_forward(x, LONG)
    assert _rel(rstd, rr) < 1e-5 and _rel(y, yr) < 1e-5
    dx, dw = nn.rms_norm_backward(dy, x, rstd, LONG)
    dxr, dwr = ORACLE.rms_norm_backward(dy, x, rstd, LONG)
    assert _rel(dx, dxr) < 1e-3 and _rel(dw, dwr) < 1e-4
    y, s, rstd = nn.add_rms_norm_forward(x, np.zeros_like(x), LONG)
    assert _rel(rstd, rr) < 1e-5


def test_group_norm_long_group(long_row, long_dy):
    x = long_row.reshape(1, 4, LONG // 4)
    dy = long_dy.reshape(1, 4, LONG // 4)
    w = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    y, mean, rstd = nn.group_norm_forward(x, 1, w)
    yr, mr, rr = ORACLE.group_norm_forward(x, 1, w)
    assert _rel(rstd, rr) < 1e-3, (rstd, rr)
    assert np.max(np.abs(y - yr)) < 4e-3
    dx, dw, db = nn.group_norm_backward(dy, x, mean, rstd, w)
    dxr, dwr, dbr = ORACLE.group_norm_backward(dy, x, mean, rstd, w)
    assert _rel(dx, dxr) < 1e-3 and _rel(dw, dwr) < 1e-3 and _rel(db, dbr) < 1e-5


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 3 * 4096 + 5])
def test_block_edges(n):
    """Rows just around the accumulation block, offset: every block boundary case."""
    x = _offset_rows(np.random.default_rng(n), 3, n)
    y, mean, rstd = nn.layer_norm_forward(x, n)
    yr, mr, rr = ORACLE.layer_norm_forward(x, n)
    assert _rel(rstd, rr) < 1e-3 and np.max(np.abs(y - yr)) < 2e-3
    np.testing.assert_allclose(mean, mr, rtol=1e-7)
