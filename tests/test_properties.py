"""Property tests (Hypothesis) of the CPU kernels: what must hold for any input."""

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import numbanorm as nn

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)
matrices = hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                      elements=finite)
SETTINGS = settings(max_examples=60, deadline=None)


def _spread(x):
    """Rows with some spread: a constant row normalizes to 0 (eps dominates), or, with
    eps = 0, to NaN (0 / 0, as torch), and adding a ramp does not rule one out (Hypothesis
    drew [[0.5, 0.0]], which the ramp makes [[0.5, 0.5]])."""
    x = x + np.arange(x.shape[-1]) * 0.5
    assume(x.shape[-1] < 2 or np.ptp(x, axis=-1).min() >= 0.1)
    return x


@SETTINGS
@given(matrices, st.integers(0, 11))
def test_a_row_does_not_depend_on_the_other_rows(x, i):
    i %= x.shape[0]
    whole = nn.layer_norm(x, x.shape[1])
    alone = nn.layer_norm(x[i : i + 1], x.shape[1])
    np.testing.assert_array_equal(whole[i : i + 1], alone)
    np.testing.assert_array_equal(nn.rms_norm(x, x.shape[1])[i : i + 1], nn.rms_norm(x[i : i + 1], x.shape[1]))


@SETTINGS
@given(matrices, st.floats(0.1, 100), st.floats(-100, 100))
def test_layer_norm_is_invariant_to_scale_and_shift(x, a, b):
    x = _spread(x)
    y1 = nn.layer_norm(x, x.shape[1], eps=0.0)
    y2 = nn.layer_norm(a * x + b, x.shape[1], eps=0.0)
    np.testing.assert_allclose(y1, y2, atol=1e-7)


@SETTINGS
@given(matrices)
def test_outputs_without_affine_have_mean_zero_and_unit_variance(x):
    x = _spread(x)
    if x.shape[1] < 2:
        return
    y = nn.layer_norm(x, x.shape[1], eps=0.0)
    np.testing.assert_allclose(y.mean(axis=1), 0, atol=1e-9)
    np.testing.assert_allclose(y.var(axis=1), 1, atol=1e-9)
    r = nn.rms_norm(x, x.shape[1], eps=0.0)
    np.testing.assert_allclose((r * r).mean(axis=1), 1, atol=1e-9)


@SETTINGS
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.sampled_from([2, 4, 6]), st.integers(1, 5)),
                  elements=finite), st.sampled_from([1, 2]))
def test_group_norm_is_layer_norm_over_each_group(x, g):
    x = x + np.arange(x.shape[1] * x.shape[2]).reshape(x.shape[1:]) * 0.25
    n, c, s = x.shape
    y = nn.group_norm(x, g)
    ref = nn.layer_norm(x.reshape(n, g, (c // g) * s), (c // g) * s).reshape(x.shape)
    np.testing.assert_allclose(y, ref, atol=1e-12)


@SETTINGS
@given(matrices)
def test_backward_dx_sums_to_zero_without_weight(x):
    """dx is orthogonal to the constant direction: shifting x leaves y unchanged."""
    x = _spread(x)
    dy = np.cos(np.arange(x.size)).reshape(x.shape)
    _, m, r = nn.layer_norm_forward(x, x.shape[1])
    dx, _, _ = nn.layer_norm_backward(dy, x, m, r, x.shape[1])
    scale = np.abs(dx).max(axis=1) + 1
    np.testing.assert_allclose(dx.sum(axis=1) / scale, 0, atol=1e-9)
