"""Backward against central finite differences of the forward, in float64.

The loss is L = sum(y * g) for a fixed random g, so dL/dy = g and the backward
with dy = g must give dL/dx, dL/dweight, dL/dbias.  Every element of x is
perturbed (the shapes are small), with a step of 1e-6 the central difference is
accurate to ~1e-9 relative, far inside the 1e-6 the test asks for.
"""

import numpy as np
import pytest

from _marks import EXHAUSTIVE
from conftest import impl_params, to_host

H = 1e-6


# The GPU's backward is checked against the oracle's (test_against_oracle); differencing its
# forward in the simulator, a launch per perturbed element, is for a full run
@pytest.fixture(params=impl_params(gpu_marks=EXHAUSTIVE))
def impl_name(request):
    return request.param


def numeric_grad(f, a):
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + H
        up = f()
        flat[i] = old - H
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * H)
    return g


def check(analytic, numeric):
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(numeric).max()))


@pytest.mark.parametrize("shape,k", [((3, 7), 1), ((2, 3, 4), 2), ((1, 1), 1)])
def test_layer_norm_gradients(impl, rng, shape, k):
    ns = shape[-k:]
    x = rng.standard_normal(shape)
    w = rng.uniform(0.5, 1.5, ns)
    b = rng.standard_normal(ns)
    g = rng.standard_normal(shape)

    def loss():
        return float(np.sum(to_host(impl.layer_norm(x, ns, w, b)) * g))

    _, mean, rstd = impl.layer_norm_forward(x, ns, w, b)
    dx, dw, db = map(to_host, impl.layer_norm_backward(g, x, mean, rstd, ns, w))
    check(dx, numeric_grad(loss, x))
    check(dw, numeric_grad(loss, w))
    check(db, numeric_grad(loss, b))


@pytest.mark.parametrize("shape,k", [((3, 7), 1), ((2, 3, 4), 2)])
def test_rms_norm_gradients(impl, rng, shape, k):
    ns = shape[-k:]
    x = rng.standard_normal(shape)
    w = rng.uniform(0.5, 1.5, ns)
    g = rng.standard_normal(shape)

    def loss():
        return float(np.sum(to_host(impl.rms_norm(x, ns, w, 1e-6)) * g))

    _, rstd = impl.rms_norm_forward(x, ns, w, 1e-6)
    dx, dw = map(to_host, impl.rms_norm_backward(g, x, rstd, ns, w))
    check(dx, numeric_grad(loss, x))
    check(dw, numeric_grad(loss, w))


@pytest.mark.parametrize("shape,groups", [((2, 4, 3), 2), ((2, 3, 2, 2), 3), ((1, 2, 5), 1)])
def test_group_norm_gradients(impl, rng, shape, groups):
    x = rng.standard_normal(shape)
    w = rng.uniform(0.5, 1.5, shape[1])
    b = rng.standard_normal(shape[1])
    g = rng.standard_normal(shape)

    def loss():
        return float(np.sum(to_host(impl.group_norm(x, groups, w, b)) * g))

    _, mean, rstd = impl.group_norm_forward(x, groups, w, b)
    dx, dw, db = map(to_host, impl.group_norm_backward(g, x, mean, rstd, w))
    check(dx, numeric_grad(loss, x))
    check(dw, numeric_grad(loss, w))
    check(db, numeric_grad(loss, b))


def test_group_norm_gradients_in_channels_last_order(impl, rng):
    """x (N, C, H, W) laid out as (N, H, W, C): the CPU's channels-last kernels."""
    xl = rng.standard_normal((2, 3, 2, 4))  # perturbed in place (numeric_grad): x is a view of it
    x = np.moveaxis(xl, -1, 1)
    w, b = rng.uniform(0.5, 1.5, 4), rng.standard_normal(4)
    g = rng.standard_normal(x.shape)

    def loss():
        return float(np.sum(to_host(impl.group_norm(x, 2, w, b)) * g))

    _, mean, rstd = impl.group_norm_forward(x, 2, w, b)
    dx, dw, db = map(to_host, impl.group_norm_backward(g, x, mean, rstd, w))
    check(np.moveaxis(dx, 1, -1), numeric_grad(loss, xl))
    check(dw, numeric_grad(loss, w))
    check(db, numeric_grad(loss, b))


def test_gradients_without_weight_are_those_of_unit_weight(impl, rng):
    x = rng.standard_normal((4, 6))
    g = rng.standard_normal((4, 6))
    _, mean, rstd = impl.layer_norm_forward(x, 6)
    a = [to_host(t) for t in impl.layer_norm_backward(g, x, mean, rstd, 6)]
    b = [to_host(t) for t in impl.layer_norm_backward(g, x, mean, rstd, 6, np.ones(6))]
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-14, atol=1e-14)
