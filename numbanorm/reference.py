"""The NumPy oracle: every kernel in numbanorm is tested against these functions.

Plain NumPy, computed in float64 whatever the input dtype, written from the
formulas (the backward from its derivation, see the book's chapter on it), with
the signatures of the public API. Results are float64 arrays; statistics have the
keep-dims shape of the public API (``(N, num_groups)`` for group norm).

The intermediate terms of the backward carry the names the kernels use:

    xhat = (x - mean) * rstd          normalized input
    wdy  = weight * dy                gradient reaching xhat
    c1   = mean(xhat * wdy)           over the normalized elements
    c2   = mean(wdy)                  (layer/group norm only)
    dx   = (wdy - (xhat * c1 + c2)) * rstd
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "layer_norm", "layer_norm_forward", "layer_norm_backward",
    "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "group_norm", "group_norm_forward", "group_norm_backward",
    "add_layer_norm", "add_layer_norm_forward", "add_layer_norm_backward",
    "add_rms_norm", "add_rms_norm_forward", "add_rms_norm_backward",
]


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _silent(f):
    """A row holding inf or NaN gives NaN, and a huge one no overflow, without NumPy's
    RuntimeWarnings: the kernels' behaviour, and torch's."""
    @functools.wraps(f)
    def silent(*args, **kwargs):
        with np.errstate(all="ignore"):
            return f(*args, **kwargs)
    return silent


def _axes(x, normalized_shape):
    k = 1 if np.ndim(normalized_shape) == 0 else len(normalized_shape)
    return tuple(range(x.ndim - k, x.ndim))


def _rms_eps(x_dtype, eps):
    if eps is not None:
        return eps
    acc = np.float64 if np.dtype(x_dtype) == np.float64 else np.float32
    return float(np.finfo(acc).eps)


def _exponent(x, axes):
    """Per row, ``e`` with ``|x| * 2**-e <= 1``: rows are normalized scaled by
    ``2**-e`` (exact), so that no sum of squares overflows where the answer is
    finite (float64 rows near 1e154 and beyond; float32 ones never come close)."""
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    return np.frexp(np.where(np.isfinite(amax), amax, 1.0))[1]


def _moments(x, axes, eps):
    """``(mean, rstd, xhat)`` of the rows of ``x`` (biased variance), overflow-free."""
    e = _exponent(x, axes)
    xs = np.ldexp(x, -e)
    # the corrected two-pass: deviations from a first mean, less their own mean, unrounded
    # (a mean rounded to float64 is off by half an ulp, 1 % of the std of a row with mean 1e8
    # and std 1e-6); a constant row's deviations are then exactly 0 (a rounded mean left
    # deviations of an ulp, which near the float64 limit, where eps no longer counts,
    # normalized to +-1)
    first = xs.mean(axis=axes, keepdims=True)
    d = xs - first
    corr = d.mean(axis=axes, keepdims=True)
    dev_s = d - corr
    mean_s = first + corr
    var_s = (dev_s ** 2).mean(axis=axes, keepdims=True)
    rstd, xhat = _normalized(dev_s, var_s, e, eps)
    return np.ldexp(mean_s, e), rstd, xhat


def _normalized(d_s, var_s, e, eps):
    """``(rstd, d * rstd)`` of rows ``d = d_s * 2**e`` whose variance (RMSNorm: mean square)
    is ``var_s * 4**e``: at the rows' own scale, but where ``var + eps`` leaves float64's
    normal range there (a huge row's variance overflows; a tiny one's, with eps under the
    smallest normal number, underflows: a row of 1e-170 with eps 0 was inf and NaN), at the
    scaled rows', eps taken to their scale (a power of two: exact where it is normal)."""
    var = np.ldexp(var_s, 2 * e)
    scaled = ~np.isfinite(var) | (var + eps < np.finfo(np.float64).tiny)
    rstd_s = 1.0 / np.sqrt(var_s + np.where(scaled, np.ldexp(eps, -2 * e), 0.0))
    plain = 1.0 / np.sqrt(var + eps)
    return (np.where(scaled, np.ldexp(rstd_s, -e), plain),
            np.where(scaled, d_s * rstd_s, np.ldexp(d_s, e) * plain))


def _xhat(x, mean, rstd, axes):
    """``(x - mean) * rstd`` for given statistics, on the scaled rows (overflow-free), with the
    deviations' own mean taken out as ``_moments`` does: the saved ``mean`` is rounded (to
    float32 for 16- and 32-bit inputs), and the kernels' backward corrects it the same way.
    A deviation of 0 gives xhat 0 where rstd times the scale overflows, but NaN where rstd
    itself is inf (a row of one value with eps 0), as that row's y, the kernels' and torch's:
    its terms of dweight are NaN too."""
    e = _exponent(x, axes)
    d = np.ldexp(x, -e) - np.ldexp(mean, -e)
    dev_s = d - d.mean(axis=axes, keepdims=True)
    return np.where((dev_s == 0) & np.isfinite(rstd), 0.0, dev_s * np.ldexp(rstd, e))


# ---------------------------------------------------------------- LayerNorm

@_silent
def layer_norm_forward(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    x = _f64(x)
    axes = _axes(x, normalized_shape)
    mean, rstd, y = _moments(x, axes, eps)
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y, mean, rstd


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return layer_norm_forward(x, normalized_shape, weight, bias, eps)[0]


@_silent
def layer_norm_backward(dy, x, mean, rstd, normalized_shape, weight=None):
    dy, x, mean, rstd = _f64(dy), _f64(x), _f64(mean), _f64(rstd)
    axes = _axes(x, normalized_shape)
    batch = tuple(range(x.ndim - len(axes)))
    mean = mean.reshape(x.shape[: x.ndim - len(axes)] + (1,) * len(axes))
    rstd = rstd.reshape(mean.shape)
    xhat = _xhat(x, mean, rstd, axes)
    wdy = dy if weight is None else dy * _f64(weight)
    c1 = (xhat * wdy).mean(axis=axes, keepdims=True)
    c2 = wdy.mean(axis=axes, keepdims=True)
    dx = (wdy - (xhat * c1 + c2)) * rstd
    dweight = (dy * xhat).sum(axis=batch)
    dbias = dy.sum(axis=batch)
    return dx, dweight, dbias


# ---------------------------------------------------------------- RMSNorm

@_silent
def rms_norm_forward(x, normalized_shape, weight=None, eps=None):
    eps = _rms_eps(np.asarray(x).dtype, eps)
    x = _f64(x)
    axes = _axes(x, normalized_shape)
    e = _exponent(x, axes)
    xs = np.ldexp(x, -e)
    ms_s = (xs * xs).mean(axis=axes, keepdims=True)
    rstd, y = _normalized(xs, ms_s, e, eps)
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd


def rms_norm(x, normalized_shape, weight=None, eps=None):
    return rms_norm_forward(x, normalized_shape, weight, eps)[0]


@_silent
def rms_norm_backward(dy, x, rstd, normalized_shape, weight=None):
    dy, x, rstd = _f64(dy), _f64(x), _f64(rstd)
    axes = _axes(x, normalized_shape)
    batch = tuple(range(x.ndim - len(axes)))
    rstd = rstd.reshape(x.shape[: x.ndim - len(axes)] + (1,) * len(axes))
    xhat = x * rstd
    wdy = dy if weight is None else dy * _f64(weight)
    c1 = (xhat * wdy).mean(axis=axes, keepdims=True)
    dx = (wdy - xhat * c1) * rstd
    dweight = (dy * xhat).sum(axis=batch)
    return dx, dweight


# ---------------------------------------------------------------- GroupNorm

def _channel(v, ndim):
    """A per-channel vector shaped to broadcast against (N, C, *spatial)."""
    return _f64(v).reshape((1, -1) + (1,) * (ndim - 2))


@_silent
def group_norm_forward(x, num_groups, weight=None, bias=None, eps=1e-5):
    x = _f64(x)
    n = x.shape[0]
    xg = x.reshape(n, num_groups, -1)
    mean, rstd, xhat = _moments(xg, (2,), eps)
    y = xhat.reshape(x.shape)
    if weight is not None:
        y = y * _channel(weight, x.ndim)
    if bias is not None:
        y = y + _channel(bias, x.ndim)
    return y, mean[:, :, 0], rstd[:, :, 0]


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    return group_norm_forward(x, num_groups, weight, bias, eps)[0]


@_silent
def group_norm_backward(dy, x, mean, rstd, weight=None):
    dy, x, mean, rstd = _f64(dy), _f64(x), _f64(mean), _f64(rstd)
    n, g = mean.shape
    reduce_axes = (0,) + tuple(range(2, x.ndim))
    xhat = _xhat(x.reshape(n, g, -1), mean[:, :, None], rstd[:, :, None], (2,)).reshape(x.shape)
    wdy = dy if weight is None else dy * _channel(weight, x.ndim)
    xhat_g, wdy_g = xhat.reshape(n, g, -1), wdy.reshape(n, g, -1)
    c1 = (xhat_g * wdy_g).mean(axis=2, keepdims=True)
    c2 = wdy_g.mean(axis=2, keepdims=True)
    dx = ((wdy_g - (xhat_g * c1 + c2)) * rstd[:, :, None]).reshape(x.shape)
    dweight = (dy * xhat).sum(axis=reduce_axes)
    dbias = dy.sum(axis=reduce_axes)
    return dx, dweight, dbias


# ---------------------------------------------------------------- fused residual add

@_silent
def add_layer_norm_forward(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    s = _f64(x) + _f64(residual)
    y, mean, rstd = layer_norm_forward(s, normalized_shape, weight, bias, eps)
    return y, s, mean, rstd


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    return add_layer_norm_forward(x, residual, normalized_shape, weight, bias, eps)[:2]


@_silent
def add_layer_norm_backward(dy, ds, s, mean, rstd, normalized_shape, weight=None):
    dx, dweight, dbias = layer_norm_backward(dy, s, mean, rstd, normalized_shape, weight)
    return (dx if ds is None else dx + _f64(ds)), dweight, dbias


@_silent
def add_rms_norm_forward(x, residual, normalized_shape, weight=None, eps=None):
    eps = _rms_eps(np.asarray(x).dtype, eps)
    s = _f64(x) + _f64(residual)
    y, rstd = rms_norm_forward(s, normalized_shape, weight, eps)
    return y, s, rstd


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None):
    return add_rms_norm_forward(x, residual, normalized_shape, weight, eps)[:2]


@_silent
def add_rms_norm_backward(dy, ds, s, rstd, normalized_shape, weight=None):
    dx, dweight = rms_norm_backward(dy, s, rstd, normalized_shape, weight)
    return (dx if ds is None else dx + _f64(ds)), dweight
