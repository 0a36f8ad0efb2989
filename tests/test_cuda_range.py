"""The contract's "every finite input gives a finite, correct output" (API.md, Numerics) for
the GPU kernels, in the CUDA simulator: no intermediate (a sum, a sum of squares) may leave
the accumulation dtype's range where the answer itself is representable -- rows at the
top of the range (``[3e38, -3e38, 1, 2]`` normalizes to about ``[1.414, -1.414, 0, 0]``;
elements spread over the whole range; a constant row), rows whose squares overflow
(float32 1e20, float64 1e160), rows whose squares are subnormal or 0 with ``eps=0``
(float32 1e-22, float64 1e-170), float32 rows of subnormal elements -- on every row
operation, forward and backward, and GroupNorm, on the rows held in registers and on
the loop path; rows holding Inf or NaN still give NaN (what the oracle gives), in
their own row alone; a row out of range in a call in place (``out=x``) as well; a
backward handed rstd = 0 gives that row dx = 0, not NaN; and rows (GroupNorm: groups) whose
forward is in range but whose backward sums are not -- x - mean itself overflowing, the
sums of weight * dy, RMSNorm's of x * rstd * weight * dy -- or whose sums are in range
but a term of dx would not be, give the oracle's dx, dweight and dbias, their neighbours'
dx bit for bit as without them.

The CPU kernels keep this (``test_numerics.py``).  The expected values come from the
oracle at the row brought to unit scale: with ``s = 2**-k`` (``k`` the exponent of the
row's largest magnitude), LayerNorm and RMSNorm are scale invariant when eps scales with
``s**2``, ``LN(x, eps) = LN(x * s, eps * s**2)``, so ``y`` is the scaled row's, ``mean =
mean_s / s``, ``rstd = rstd_s * s``, and in the backward ``dx = s * dx_s`` while
``dweight`` and ``dbias`` are unchanged.  ``test_the_expected_values_by_hand`` checks that
route against values worked out by hand.

Each out-of-range row sits among ordinary rows (ordinary, out-of-range, ordinary) in one
call, so a test also shows that its neighbours are unaffected.  Row paths
(``common.row_config``), reached with short rows by shrinking the mapping's knobs
(``REG_ELEMS``, ``MAX_TPR``, ``MAX_VPT``): ``held`` (4 elements, a thread per row),
``held_block`` (rows over two warps, whose reductions go through shared memory), ``loop``
(the loop path: a warp per row, the row staged in shared memory, one block striding over
the rows), ``loop_unstaged`` (the same, the row re-read from global memory),
``loop_block`` (the loop path with two warps a row); and ``loop_real``, the loop path at
its real threshold (float32 rows of 8196 elements, float64 of 4098: 512 threads per row;
the simulator's slowest, about a second a row, so LayerNorm's float32 row in the default
set and the rest ``slow``).
"""

import numpy as np
import pytest

import numbanorm.cuda as nc
from conftest import ORACLE, assert_close, to_host

if not nc.is_available():
    pytest.skip(f"numbanorm.cuda unavailable: {nc.why_unavailable()}", allow_module_level=True)

from numba import cuda  # noqa: E402

from numbanorm.cuda._kernels import common as C  # noqa: E402

F32, F64 = np.float32, np.float64
# results on unit-scale outputs: float32 rows are summed in float32, float64 in float64
TOL = {F32: 1e-5, F64: 1e-12}
SLOW = [pytest.mark.slow]

# ---------------------------------------------------------------- rows


def _ordinary(rng, shape):
    return rng.standard_normal(shape) * 2 + 0.5


def _tiled(values):
    return lambda rng, n: np.resize(np.array(values, np.float64), n)


_TOP32, _TOP64 = float(np.finfo(F32).max) / 2, float(np.finfo(F64).max) / 2

# (dtype, case) -> (the row of n elements, in float64, exactly representable in dtype or
# rounded to it on the cast; eps: None for each operation's default, or 0)
CASES = {
    # the contract's row (tiled over long rows): its squares, and a sum of its elements
    # in a bad order, overflow float32
    (F32, "limit"): (_tiled([3e38, -3e38, 1, 2]), None),
    # elements up to half the float32 range, of both signs: sums of elements overflow
    (F32, "spread"): (lambda rng, n: rng.uniform(-_TOP32, _TOP32, n), None),
    # a constant row at the top of the range: mean top, y = bias, rstd 1 / sqrt(eps)
    (F32, "top"): (lambda rng, n: np.full(n, _TOP32), None),
    # squares overflow (at 1.8e19), the elements' sums do not
    (F32, "squares"): (lambda rng, n: rng.standard_normal(n) * 1e20 + 0.5e20, None),
    # squares subnormal (eps = 0: nothing hides the variance's lost bits)
    (F32, "tiny"): (lambda rng, n: rng.standard_normal(n) * 1e-22 + 0.5e-22, 0.0),
    # the elements themselves subnormal: y is representable, rstd (about 1e40) is not
    (F32, "subnormal"): (lambda rng, n: rng.standard_normal(n) * 1e-40 + 0.5e-40, 0.0),
    (F64, "limit"): (_tiled([1.5e308, -1.5e308, 1, 2]), None),
    (F64, "spread"): (lambda rng, n: rng.uniform(-_TOP64, _TOP64, n), None),
    (F64, "top"): (lambda rng, n: np.full(n, _TOP64), None),
    (F64, "squares"): (lambda rng, n: rng.standard_normal(n) * 1e160, None),
    # squares underflow to 0
    (F64, "tiny"): (lambda rng, n: rng.standard_normal(n) * 1e-170 + 0.5e-170, 0.0),
}

# the row operations: (the call's statistics) -- names as numbanorm.cuda has them
OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]

# ---------------------------------------------------------------- row paths

# The simulator runs a block's threads as Python threads: the paths are reached with short
# rows by shrinking the mapping's knobs (the same kernels, a fraction of the threads), and
# ``loop_real`` takes the loop path at its real threshold (about a second a row).
# The loop path with short rows: threads per row at most 16, two elements each (one for
# float64), so rows past 32 elements (float64 16) loop, with the warp a loop row takes
# anyway; one block of a warp strides over every row (ROW_RESIDENT)
LOOP = {"MAX_TPR": 16, "MAX_VPT": 2, "ROW_RESIDENT": 32}
# ... with two warps a row (up to 64 threads of two elements, one for float64, aimed at)
LOOP_BLOCK = {"REG_ELEMS": 2, "MAX_VPT": 2, "MAX_TPR": 64, "ROW_RESIDENT": 64}
# name -> (knobs, row length by dtype, loop path?, staged?, threads per row at least)
PATHS = {
    "held": ({"BLOCK_THREADS": 32}, {F32: 4, F64: 4}, False, False, 1),       # a block of a warp
    "held_block": ({"REG_ELEMS": 2, "BLOCK_THREADS": 64}, {F32: 68, F64: 36}, False, False, 64),
    "loop": (LOOP, {F32: 68, F64: 36}, True, True, 32),
    "loop_unstaged": ({**LOOP, "STAGE_BYTES": 0}, {F32: 68, F64: 36}, True, False, 32),
    "loop_block": (LOOP_BLOCK, {F32: 132, F64: 132}, True, True, 64),
    "loop_real": ({}, {F32: 8196, F64: 4098}, True, True, 512),
}


def _path(knobs, path, dt, m):
    """Set ``path``'s knobs; the row length that takes it, checked on ``row_config``."""
    kw, lengths, loop, staged, tpr = PATHS[path]
    knobs(**kw)
    n = lengths.get(dt, lengths[F32])  # (16-bit rows: float32's)
    vec = C.vec_width(n, np.empty(n, dt))
    cfg = C.row_config(m, n, dt == F64, vec, C.ROW_RESIDENT, np.dtype(dt).itemsize, 1)
    assert (cfg.loop, cfg.stage > 0, cfg.tpr >= tpr) == (loop, staged, True), (path, cfg)
    return n


def _rows_of(rng, dt, case, n, m=3, at=1):
    """``m`` ordinary rows of ``n`` elements of ``dt``, row ``at`` the case's; and eps."""
    make, eps = CASES[dt, case]
    x = _ordinary(rng, (m, n))
    x[at] = make(rng, n)
    x = x.astype(dt)
    assert np.isfinite(x).all()
    return x, eps


def _exponents(x):
    """Per row of ``x`` (2-D, finite), ``k`` with its largest magnitude in [0.5, 1) * 2**k."""
    amax = np.max(np.abs(np.asarray(x, np.float64)), axis=1)
    return np.frexp(np.where(amax > 0, amax, 1.0))[1]


def _scaled_eps(eps, k):
    eps_s = float(np.ldexp(eps, -2 * int(k)))
    assert np.isfinite(eps_s)
    return eps_s


# ---------------------------------------------------------------- expected values

def _expected_forward(kind, x, w, b, eps):
    """The oracle's (y, mean_s, rstd, rstd_s, k) for the rows of ``x`` (2-D, float64
    values), row by row at unit scale: ``mean = mean_s * 2**k`` (None for RMSNorm),
    ``rstd`` in the row's units (float64) and ``rstd_s = rstd * 2**k`` at unit scale.  A
    constant row's LayerNorm is worked out directly (y the bias, mean the value, rstd
    ``1 / sqrt(eps)``): at the top of float64's range its scaled eps underflows."""
    k = _exponents(x)
    n = x.shape[1]
    ys, means, rstds = [], [], []
    for i in range(len(x)):
        xs = np.ldexp(np.asarray(x[i:i + 1], np.float64), -k[i])
        eps_s = _scaled_eps(eps, k[i])
        if kind == "layer" and np.ptp(xs) == 0 and eps > 0:
            y = np.zeros_like(xs) * (1 if w is None else w) + (0 if b is None else b)
            ys.append(y[0])
            means.append(xs[0, 0])
            rstds.append(1 / np.sqrt(eps))
            continue
        if kind == "layer":
            y, m, r = ORACLE.layer_norm_forward(xs, n, w, b, eps_s)
            means.append(m[0, 0])
        else:
            y, r = ORACLE.rms_norm_forward(xs, n, w, eps_s)
        ys.append(y[0])
        rstds.append(np.ldexp(r[0, 0], -k[i]))
    rstd = np.array(rstds)
    with np.errstate(over="ignore"):  # (rstd_s of float64's top row: only the backward's, which has none)
        rstd_s = np.ldexp(rstd, k)
    return np.array(ys), (np.array(means) if kind == "layer" else None), rstd, rstd_s, k


def _expected_backward(kind, dy, x, mean_s, rstd_s, k, w):
    """The oracle's (dx_s, dweight, dbias) at the unit-scale rows (``dx = dx_s * 2**-k``)."""
    n = x.shape[1]
    dxs, dw, db = [], 0.0, 0.0
    for i in range(len(x)):
        xs = np.ldexp(np.asarray(x[i:i + 1], np.float64), -k[i])
        if kind == "layer":
            dx, dwi, dbi = ORACLE.layer_norm_backward(dy[i:i + 1], xs, np.array([[mean_s[i]]]),
                                                      np.array([[rstd_s[i]]]), n, w)
            db = db + dbi
        else:
            dx, dwi = ORACLE.rms_norm_backward(dy[i:i + 1], xs, np.array([[rstd_s[i]]]), n, w)
        dxs.append(dx[0])
        dw = dw + dwi
    return np.array(dxs), dw, (db if kind == "layer" else None)


def _rms_eps(dt, eps):
    """The eps a call with ``eps`` uses (None: the accumulation dtype's machine epsilon)."""
    return float(np.finfo(np.float64 if dt == F64 else np.float32).eps) if eps is None else eps


def _ln_eps(eps):
    return 1e-5 if eps is None else eps


# ---------------------------------------------------------------- checks

def _show(a):
    return np.array2string(np.asarray(a, np.float64).ravel()[:6], precision=5, max_line_width=200)


class _Check:
    """Every comparison of a test, the failures reported together (what the kernels gave)."""

    def __init__(self):
        self.failures = []

    def close(self, what, got, want, tol, atol=None):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        atol = tol * max(1.0, float(np.max(np.abs(want)))) if atol is None else atol
        if got.shape != want.shape or not np.allclose(got, want, rtol=tol, atol=atol):
            err = np.abs(got - want).max() if got.shape == want.shape else "shape"
            self.failures.append(f"{what}: got {_show(got)}, want {_show(want)} (max |error| {err:.3g})"
                                 if got.shape == want.shape else f"{what}: shape {got.shape} != {want.shape}")

    def rows(self, what, got, want, tol, labels):
        """Row by row, each at its own scale (``got``, ``want``: 2-D, unit-scale)."""
        for i, label in enumerate(labels):
            self.close(f"{what} row {i} ({label})", got[i], want[i], tol)

    def mean(self, got, mean_s, k, tol, labels):
        """The mean at the row's scale: its float32 (float64) sum of elements of magnitude
        2**k is exact to that magnitude's precision, not to the mean's (``[3e38, -3e38, 1,
        2]``'s mean is 0.75, and 0 or 1.125 after the sum's roundings in another order)."""
        got = np.ldexp(np.asarray(got, np.float64).reshape(-1), -k)
        for i, label in enumerate(labels):
            self.close(f"mean row {i} ({label})", got[i], mean_s[i], tol, atol=tol)

    def rstd(self, got, rstd, dt, tol, labels):
        """rstd relative, where it is representable in the accumulation dtype (float32 for
        float32 rows) within ``tol`` (subnormal rstd included, to that point): float32 rows
        of subnormal elements have an rstd about 1e40, past float32's range, which no
        kernel can return (not compared; y is)."""
        fi = np.finfo(np.float64 if dt == F64 else np.float32)
        got = np.asarray(got, np.float64).reshape(-1)
        for i, label in enumerate(labels):
            if not float(fi.smallest_subnormal) / tol <= rstd[i] <= float(fi.max):
                continue  # the true rstd is outside the accumulation dtype's range
            self.close(f"rstd row {i} ({label})", got[i], rstd[i], tol, atol=0.0)

    def done(self):
        assert not self.failures, "\n".join(self.failures)


def _dev(a):
    return None if a is None else cuda.to_device(a)


def _host(*arrays):
    return [to_host(a) for a in arrays]


def _labels(m, at, case):
    return [case if i == at else "ordinary" for i in range(m)]


def _params(rng, dt, n, affine, kind):
    if not affine:
        return None, None
    w = rng.uniform(0.5, 1.5, n).astype(dt)
    return w, (rng.standard_normal(n).astype(dt) if kind == "layer" else None)


def _residual(rng, x):
    """A residual at each row's scale (a hundredth of it): s = x + residual stays finite."""
    k = _exponents(x)
    return np.ldexp(rng.standard_normal(x.shape) * 0.01, k[:, None]).astype(x.dtype)


def _forward(op, x, res, n, w, b, eps):
    """The kernels' (y, s, mean, rstd) on device arrays, as host arrays (s, mean None where
    the operation has none)."""
    xd, rd, wd, bd = _dev(x), _dev(res), _dev(w), _dev(b)
    if op == "layer_norm":
        y, m, r = nc.layer_norm_forward(xd, n, wd, bd, _ln_eps(eps))
        s = None
    elif op == "add_layer_norm":
        y, s, m, r = nc.add_layer_norm_forward(xd, rd, n, wd, bd, _ln_eps(eps))
    elif op == "rms_norm":
        (y, r), s, m = nc.rms_norm_forward(xd, n, wd, eps), None, None
    else:
        (y, s, r), m = nc.add_rms_norm_forward(xd, rd, n, wd, eps), None
    return _host(y, s, m, r)


def _id(*values):
    return "-".join(np.dtype(v).name if isinstance(v, type) else str(v) for v in values)


def _kind(op):
    return "layer" if op.endswith("layer_norm") else "rms"


# ---------------------------------------------------------------- the route to the expected values

def test_the_expected_values_by_hand():
    """The unit-scale route (``_expected_forward``, ``_expected_backward``) against values
    worked out another way: ``[3e38, -3e38, 1, 2]`` (float32) divided by 1e38 in float64
    and normalized by the formulas, forward and backward; the float64 row ``[1, 2, 3, 4] *
    1e-170``'s LayerNorm and RMSNorm, which are ``[1, 2, 3, 4]``'s; a constant row at the
    top of float64's range."""
    x = np.array([[3e38, -3e38, 1, 2]], F32)
    u = x.astype(np.float64) / 1e38                    # [3.0000000054977558, -3.00..., 1e-38, 2e-38]
    mean = 0.75e-38                                    # (x[0] + x[1] is exactly 0)
    var = ((u - mean) ** 2).mean()                     # 4.5000000164932675
    y_hand = (u - mean) / np.sqrt(var)                 # eps 1e-5 / 1e76: nothing
    np.testing.assert_allclose(y_hand[0], [np.sqrt(2), -np.sqrt(2), 0, 0], atol=1e-15)
    y, mean_s, rstd, rstd_s, k = _expected_forward("layer", x.astype(np.float64), None, None, 1e-5)
    np.testing.assert_allclose(y, y_hand, rtol=1e-14, atol=1e-15)
    # the mean to the row's scale: 0.75 exactly, or (the oracle's sum in another order) 1.125
    assert abs(np.ldexp(mean_s, k)[0] - 0.75) <= 1e-15 * 3e38
    np.testing.assert_allclose(rstd, 1 / (np.sqrt(var) * 1e38), rtol=1e-12)
    assert 4.71e-39 < rstd[0] < 4.72e-39 and np.ldexp(rstd_s, -k)[0] == rstd[0]
    y_rms, _, r, _, _ = _expected_forward("rms", x.astype(np.float64), None, None, 1.2e-7)
    rms_hand = np.sqrt((u ** 2).mean()) * 1e38
    np.testing.assert_allclose(r, 1 / rms_hand, rtol=1e-12)
    np.testing.assert_allclose(y_rms[0], x[0] / rms_hand, rtol=1e-14, atol=1e-15)
    # backward: dx = (dy - xhat * mean(dy * xhat) - mean(dy)) * rstd at unit scale (d/du), / 1e38
    dy = np.array([[0.3, -1.2, 0.7, 2.0]])
    xhat = (u - mean) / np.sqrt(var)
    dx_u = (dy - xhat * (dy * xhat).mean() - dy.mean()) / np.sqrt(var)
    dx_s, dw, db = _expected_backward("layer", dy, x.astype(np.float64), mean_s, rstd_s, k, None)
    np.testing.assert_allclose(np.ldexp(dx_s, -k), dx_u / 1e38, rtol=1e-12)
    np.testing.assert_allclose(dw, (dy * xhat)[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(db, dy[0])
    # float64 tiny: the unit row's results, rstd 1e170 times the unit row's
    t = np.array([[1, 2, 3, 4]], F64) * 1e-170
    y, mean_s, rstd, _, k = _expected_forward("layer", t, None, None, 0.0)
    np.testing.assert_allclose(y[0], np.array([-1.5, -0.5, 0.5, 1.5]) / np.sqrt(1.25), rtol=1e-14)
    np.testing.assert_allclose(rstd, 1e170 / np.sqrt(1.25), rtol=1e-14)
    np.testing.assert_allclose(np.ldexp(mean_s, k), 2.5e-170, rtol=1e-14)
    y, _, rstd, _, _ = _expected_forward("rms", t, None, None, 0.0)
    np.testing.assert_allclose(y[0], np.array([1, 2, 3, 4]) / np.sqrt(7.5), rtol=1e-14)
    np.testing.assert_allclose(rstd, 1e170 / np.sqrt(7.5), rtol=1e-14)
    # the constant row at the top of float64's range: y the bias, rstd 1 / sqrt(eps)
    top = np.full((1, 4), _TOP64)
    y, mean_s, rstd, _, k = _expected_forward("layer", top, None, np.arange(4.0), 1e-5)
    np.testing.assert_array_equal(y[0], np.arange(4.0))
    assert np.ldexp(mean_s, k)[0] == _TOP64 and rstd[0] == 1 / np.sqrt(1e-5)
    np.testing.assert_allclose(ORACLE.layer_norm_forward(top, 4, None, np.arange(4.0))[2], 1 / np.sqrt(1e-5))


# ---------------------------------------------------------------- forward

def _forward_cases():
    """(op, dtype, case, path, affine): on the rows held in a thread and the warp-per-row
    loop, every case, operation and affine choice; on the other short-row paths every case
    (held over two warps: the contract's row, squares that overflow or underflow) and
    operation with parameters (without: slow); at the real loop threshold LayerNorm's
    float32 row (the other operations and cases slow; not the cases of the other paths'
    concern: rows spread over the range, the top row, subnormal elements)."""
    out = []
    for op in OPS:
        for (dt, case) in CASES:
            for path in PATHS:
                for affine in (True, False):
                    key = (np.dtype(dt).name, case)
                    if path in ("held", "loop"):
                        slow = False
                    elif path == "held_block":  # (the slowest of the short rows: two warps a row)
                        slow = not affine or case not in ("limit", "squares", "tiny")
                    elif path != "loop_real":
                        slow = not affine
                    else:
                        if case in ("spread", "top", "subnormal") or not affine:
                            continue
                        slow = (op, key) != ("layer_norm", ("float32", "limit"))
                    out.append(pytest.param(op, dt, case, path, affine, marks=SLOW if slow else [],
                                            id=_id(op, dt, case, path, "affine" if affine else "plain")))
    return out


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,case,path,affine", _forward_cases())
def test_forward_of_a_row_out_of_range(knobs, op, dt, case, path, affine):
    """A finite row whose sums (of elements, of squares) leave the accumulation dtype's
    range, between two ordinary rows (before one, at the real loop threshold): y, mean and
    rstd of every row as the oracle's at unit
    scale (``mean`` to the row's own scale, ``rstd`` relative where representable), and
    the fused ``s = x + residual`` exactly."""
    rng = np.random.default_rng(11)
    m, at = (2, 0) if path == "loop_real" else (3, 1)  # (the simulator: about a second per long row)
    n = _path(knobs, path, dt, m)
    x, eps = _rows_of(rng, dt, case, n, m, at)
    kind = _kind(op)
    w, b = _params(rng, dt, n, affine, kind)
    res = _residual(rng, x) if op.startswith("add_") else None
    y, s, mean, rstd = _forward(op, x, res, n, w, b, eps)
    check = _Check()
    s_want = x.astype(np.float64) if res is None else (x + res).astype(np.float64)  # rounded as stored
    if res is not None:
        assert np.isfinite(x + res).all()
        check.close("s", s, s_want, 0.0, atol=0.0)
    eps_oracle = _ln_eps(eps) if kind == "layer" else _rms_eps(dt, eps)
    y_want, mean_s, rstd_want, _, k = _expected_forward(kind, s_want, w, b, eps_oracle)
    labels = _labels(m, at, case)
    tol = TOL[dt]
    check.rows("y", y, y_want, tol, labels)
    if kind == "layer":
        check.mean(mean, mean_s, k, tol, labels)
    check.rstd(rstd, rstd_want, dt, tol, labels)
    check.done()


# ---------------------------------------------------------------- backward

# (dtype, case): the contract's float32 row and the float64 tiny row on every path, the
# rest held in a thread and on the warp-per-row loop (not the rows that have no backward:
# spread over the range, which the forward covers, and subnormal, whose rstd is not
# representable)
BACKWARD_CASES = [(F32, "limit"), (F64, "tiny"), (F32, "squares"), (F32, "tiny"), (F32, "top"),
                  (F64, "limit"), (F64, "squares")]


def _backward_cases():
    """(op, dtype, case, path, affine): with a weight, every case held in a thread and on the
    warp-per-row loop, the contract's float32 row and the float64 tiny row on the other
    short-row paths (the rest slow); without, those two held in a thread (the rest slow);
    at the real loop threshold LayerNorm's float32 row (the other operations and the
    float64 row slow)."""
    out = []
    for op in OPS:
        for (dt, case) in BACKWARD_CASES:
            main = (dt, case) in BACKWARD_CASES[:2]
            for path in PATHS:
                for affine in (True, False):
                    if path == "held":
                        slow = not (affine or main)
                    elif path == "loop":
                        slow = not affine
                    elif path != "loop_real":
                        slow = not (affine and main)
                    else:
                        if not (main and affine):
                            continue
                        slow = (op, dt) != ("layer_norm", F32)
                    out.append(pytest.param(op, dt, case, path, affine, marks=SLOW if slow else [],
                                            id=_id(op, dt, case, path, "weight" if affine else "plain")))
    return out


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,case,path,affine", _backward_cases())
def test_backward_of_a_row_out_of_range(knobs, op, dt, case, path, affine):
    """The backward of such a row, given its forward's own statistics, dy ~ N(0, 1) (and,
    fused, a ds at the row's scale, which the row's dx, of that scale, would otherwise
    drown): dx of every row as the oracle's at unit scale times the scale, dweight and
    dbias (sums over the rows, which the scale leaves alone) as the oracle's."""
    rng = np.random.default_rng(12)
    m, at = (2, 0) if path == "loop_real" else (3, 1)
    n = _path(knobs, path, dt, m)
    x, eps = _rows_of(rng, dt, case, n, m, at)
    kind = _kind(op)
    fused = op.startswith("add_")
    w = rng.uniform(0.5, 1.5, n).astype(dt) if affine else None
    b = rng.standard_normal(n).astype(dt) if affine and kind == "layer" else None
    res = _residual(rng, x) if fused else None
    dy = rng.standard_normal(x.shape).astype(dt)
    _, s, mean, rstd = _forward(op, x, res, n, w, b, eps)
    xin = s if fused else x
    k = _exponents(xin)
    ds = np.ldexp(rng.standard_normal(x.shape), -k[:, None]).astype(dt) if fused else None
    dyd, xd, wd, dsd = _dev(dy), _dev(xin), _dev(w), _dev(ds)
    md, rd = _dev(mean), _dev(rstd)
    if op == "layer_norm":
        got = nc.layer_norm_backward(dyd, xd, md, rd, n, wd)
    elif op == "add_layer_norm":
        got = nc.add_layer_norm_backward(dyd, dsd, xd, md, rd, n, wd)
    elif op == "rms_norm":
        got = (*nc.rms_norm_backward(dyd, xd, rd, n, wd), None)
    else:
        got = (*nc.add_rms_norm_backward(dyd, dsd, xd, rd, n, wd), None)
    dx, dw, db = _host(*got)
    eps_oracle = _ln_eps(eps) if kind == "layer" else _rms_eps(dt, eps)
    x64 = np.asarray(xin, np.float64)
    _, mean_s, _, rstd_s, k = _expected_forward(kind, x64, w, b, eps_oracle)
    dx_s, dw_want, db_want = _expected_backward(kind, dy.astype(np.float64), x64, mean_s, rstd_s, k, w)
    if fused:
        dx_s = dx_s + np.ldexp(ds.astype(np.float64), k[:, None])
    check = _Check()
    labels = _labels(m, at, case)
    tol = TOL[dt]
    check.rows("dx (at unit scale)", np.ldexp(np.asarray(dx, np.float64), k[:, None]), dx_s, tol, labels)
    check.close("dweight", dw, dw_want, tol)
    if kind == "layer":
        check.close("dbias", db, db_want, tol)
    check.done()


# ---------------------------------------------------------------- backward: sums that leave the range

# Rows whose forward is in range but whose backward sums are not: (dtype-free) the row's x
# and dy as fractions of the dtype's largest value (``None``: ordinary).  ``deviation``:
# x - mean itself overflows (the element -0.9 from the mean 0.45); ``dy``: the sums of
# weight * dy overflow (x = +-1, so that |xhat| is 1 and dy * xhat stays in range);
# ``products``: RMSNorm's sum of x * rstd * wdy overflows (x = 0, 1, 2, 3: xhat up to 1.6).
# Two more whose sums stay in range but a term of dx would not (``stats.grad_factors_fn``):
# ``span``: rstd > 1 (x of 1e-3, under eps), dy near constant, wdy * rstd past the range
# where dx is not; ``cancel``: rstd < 1, wdy near the largest value where xhat = 0 and c2 of
# the other sign, wdy - c2 past the range where dx, times rstd, is not.
GRAD_CASES = {
    "deviation": (lambda rng, n: np.resize([0.9, 0.9, -0.9, 0.9], n), None),
    "dy": (lambda rng, n: np.resize([1.0, -1.0], n) / 2 ** 20, lambda rng, n: rng.uniform(0.5, 0.6, n)),
    "products": (lambda rng, n: np.resize([0.0, 1.0, 2.0, 3.0], n) / 2 ** 20, lambda rng, n: np.full(n, 0.5)),
    "span": (lambda rng, n: np.resize([-1.0, 0.0, 1.0, 0.0], n) / 2 ** 30,
             lambda rng, n: (1 + np.resize([0.0, 0.25, 0.0, -0.25], n)) / 290),
    "cancel": (lambda rng, n: np.resize([-2.0, 0.0, 2.0, 0.0], n) / 2 ** 20,
               lambda rng, n: np.resize([-0.5, 0.999, -0.5, -0.009], n)),
}


def _grad_rows(rng, dt, case, n, m=3, at=1):
    """(x, dy): ``m`` ordinary rows, row ``at`` the case's (``GRAD_CASES``)."""
    top = float((np if dt in (F32, F64) else pytest.importorskip("ml_dtypes")).finfo(dt).max)
    make_x, make_dy = GRAD_CASES[case]
    x = _ordinary(rng, (m, n))
    dy = rng.standard_normal((m, n))
    x[at] = make_x(rng, n) * top
    if make_dy is not None:
        x[at] *= 2.0 ** 20 / top  # (x of ordinary size; the fractions keep it exact)
        dy[at] = make_dy(rng, n) * top
    x, dy = x.astype(dt), dy.astype(dt)
    assert np.isfinite(x).all() and np.isfinite(dy).all()
    return x, dy


def _grad_cases():
    """(op, dtype, case, path, affine): float32 and float64, every operation (RMSNorm: the
    products alone, its sums have no x - mean, nor a sum of wdy), with a weight on every
    short-row path, without held in a thread and on the warp-per-row loop (the rest slow)."""
    out = []
    for op in OPS:
        for dt in (F32, F64):
            for case in GRAD_CASES if _kind(op) == "layer" else ("products",):
                for path in ("held", "held_block", "loop", "loop_unstaged", "loop_block"):
                    for affine in (True, False):
                        slow = not affine and path not in ("held", "loop") or (
                            path in ("held_block", "loop_block") and dt == F64)
                        out.append(pytest.param(op, dt, case, path, affine, marks=SLOW if slow else [],
                                                id=_id(op, dt, case, path, "weight" if affine else "plain")))
    return out


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,case,path,affine", _grad_cases())
def test_backward_whose_sums_leave_the_range(knobs, op, dt, case, path, affine):
    """A finite row whose forward is in range but whose backward's sums (of x - mean, of
    weight * dy, of x * rstd * weight * dy) overflow, between two ordinary rows: dx of every
    row as the oracle's at unit scale (x and dy each brought to it, dx linear in dy), the
    ordinary rows' dx bit for bit as without the case's row, dweight and dbias as the
    oracle's."""
    _check_grad_case(knobs, op, dt, case, path, affine, TOL[dt])


@pytest.mark.cudasim
@pytest.mark.parametrize("path", ["held", "loop"])
@pytest.mark.parametrize("op,case", [("layer_norm", "dy"), ("add_layer_norm", "dy"), ("layer_norm", "products"),
                                     ("rms_norm", "products"), ("add_rms_norm", "products")])
def test_bfloat16_backward_whose_sums_leave_the_range(knobs, op, case, path):
    """bfloat16 rows reach float32's largest values: the cases whose dx is not subnormal (the
    deviation case's, about 1e-39, keeps a few bits in bfloat16), to bfloat16's rounding."""
    _check_grad_case(knobs, op, pytest.importorskip("ml_dtypes").bfloat16, case, path, True, 1e-2)


def _check_grad_case(knobs, op, dt, case, path, affine, tol):
    """``test_backward_whose_sums_leave_the_range``'s checks, to ``tol``."""
    rng = np.random.default_rng(21)
    n = _path(knobs, path, dt, 3)
    x, dy = _grad_rows(rng, dt, case, n)
    kind = _kind(op)
    fused = op.startswith("add_")
    w = rng.uniform(0.85, 1.15, n).astype(dt) if affine else None
    _, s, mean, rstd = _forward(op, x, np.zeros_like(x) if fused else None, n, w, None, None)
    kx, kd = _exponents(x), _exponents(dy)
    # fused: a ds at the scale of the row's dx, small beside it
    ds = np.ldexp(rng.standard_normal(x.shape), (kd - kx - 6)[:, None]).astype(dt) if fused else None

    def run(dy):
        dyd, xd, wd, dsd, md, rd = _dev(dy), _dev(x), _dev(w), _dev(ds), _dev(mean), _dev(rstd)
        if op == "layer_norm":
            got = nc.layer_norm_backward(dyd, xd, md, rd, n, wd)
        elif op == "add_layer_norm":
            got = nc.add_layer_norm_backward(dyd, dsd, xd, md, rd, n, wd)
        elif op == "rms_norm":
            got = (*nc.rms_norm_backward(dyd, xd, rd, n, wd), None)
        else:
            got = (*nc.add_rms_norm_backward(dyd, dsd, xd, rd, n, wd), None)
        return _host(*got)

    dx, dw, db = run(dy)
    eps_oracle = _ln_eps(None) if kind == "layer" else _rms_eps(dt, None)
    x64 = x.astype(np.float64)
    _, mean_s, _, rstd_s, k = _expected_forward(kind, x64, w, None, eps_oracle)
    dx_s = np.empty(x.shape)
    dw_want, db_want = 0.0, 0.0
    for i in range(len(x)):  # each row with its dy at unit scale, its dweight and dbias scaled back
        dy_s = np.ldexp(dy[i:i + 1].astype(np.float64), -kd[i])
        ms = None if mean_s is None else mean_s[i:i + 1]
        dxi, dwi, dbi = _expected_backward(kind, dy_s, x64[i:i + 1], ms, rstd_s[i:i + 1], k[i:i + 1], w)
        dx_s[i] = dxi[0]
        dw_want = dw_want + np.ldexp(dwi, kd[i])
        db_want = db_want + (np.ldexp(dbi, kd[i]) if kind == "layer" else 0.0)
    if fused:
        dx_s = dx_s + np.ldexp(ds.astype(np.float64), (kx - kd)[:, None])
    check = _Check()
    labels = _labels(3, 1, case)
    check.rows("dx (at unit scale)", np.ldexp(np.asarray(dx, np.float64), (kx - kd)[:, None]), dx_s, tol, labels)
    check.close("dweight", dw, dw_want, tol)
    if kind == "layer":
        check.close("dbias", db, db_want, tol)
    # the ordinary rows as in a call where the case's row is ordinary too
    calm = dy.copy()
    calm[1] = rng.standard_normal(n).astype(dt)
    dx_calm = run(calm)[0]
    if not np.array_equal(np.asarray(dx)[[0, 2]], np.asarray(dx_calm)[[0, 2]]):
        check.failures.append("the ordinary rows' dx differ from a call without the case's dy")
    check.done()


@pytest.mark.cudasim
@pytest.mark.parametrize("path", ["held", "loop"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_backward_reproducers_of_sums_out_of_range(knobs, op, path):
    """The rows that gave NaN: x = [0.9, 0.9, -0.9] times float32's largest value with dy =
    [1, 2, 3] (x - mean overflows), dy = [3e38, 3e38] on x = [0, 1] (the sum of dy
    overflows), and RMSNorm's x = [0, 1, 2, 3] with dy = 3e38 (x * rstd * dy's sum, and
    xhat * c1, overflow): dx as the oracle's given the kernels' own statistics, finite."""
    if path == "loop":
        knobs(**LOOP)
    top = float(np.finfo(F32).max)
    rows = [([0.9 * top, 0.9 * top, -0.9 * top], [1.0, 2.0, 3.0]), ([0.0, 1.0], [3e38, 3e38]),
            ([0.0, 1.0, 2.0, 3.0], [3e38] * 4)]
    kind = _kind(op)
    for xs, dys in rows:
        if kind == "rms" and len(xs) == 2:
            continue  # (its dx, 4.2e38, is past float32's range)
        reps = 1 if path == "held" else 36 // len(xs) * 2   # (past 32 elements: the loop)
        x = np.array([xs * reps], F32)
        dy = np.array([dys * reps], F32)
        n = x.shape[1]
        res = np.zeros_like(x) if op.startswith("add_") else None
        _, _, mean, rstd = _forward(op, x, res, n, None, None, None)
        if kind == "layer":
            args = (_dev(dy), _dev(x), _dev(mean), _dev(rstd), n)
            if op.startswith("add_"):
                args = args[:1] + (_dev(np.zeros_like(dy)),) + args[1:]
            dx = to_host(getattr(nc, op + "_backward")(*args)[0])
            want = ORACLE.layer_norm_backward(dy.astype(np.float64), x.astype(np.float64),
                                              np.asarray(mean, np.float64), np.asarray(rstd, np.float64), n)[0]
        else:
            dx = to_host(nc.rms_norm_backward(_dev(dy), _dev(x), _dev(rstd), n)[0])
            want = ORACLE.rms_norm_backward(dy.astype(np.float64), x.astype(np.float64),
                                            np.asarray(rstd, np.float64), n)[0]
        assert np.isfinite(dx).all(), (xs, dys, _show(dx))
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(dx, np.float64) / scale, want / scale, rtol=0, atol=1e-5,
                                   err_msg=str((xs, dys)))


# ---------------------------------------------------------------- GroupNorm

# (N, C, S) with 2 groups: the group of sample 0's channels 2, 3 out of range (sample 0's
# group 0 at the real threshold); the forward loops on a group's elements (C / 2 * S), the
# backward on a channel's (S), and takes the same path here
GN_PATHS = {
    "held": (PATHS["held"][0], {F32: (2, 4, 4), F64: (2, 4, 4)}, False, False),
    "loop": (LOOP, {F32: (2, 4, 36), F64: (2, 4, 36)}, True, True),
    "loop_unstaged": ({**LOOP, "STAGE_BYTES": 0}, {F32: (2, 4, 36), F64: (2, 4, 36)}, True, False),
    "loop_block": (LOOP_BLOCK, {F32: (2, 4, 132), F64: (2, 4, 132)}, True, True),
    "loop_real": ({}, {F32: (1, 2, 8196), F64: (1, 2, 4098)}, True, True),
}
GN_CASES = [(F32, "limit"), (F64, "tiny"), (F32, "squares"), (F32, "tiny"), (F64, "squares")]


def _gn_cases():
    """(dtype, case, path, affine): every case held and on the warp-per-row loop with
    parameters, the contract's float32 row and the float64 tiny row on the other paths and
    without parameters; the real loop threshold slow."""
    out = []
    for (dt, case) in GN_CASES:
        main = (dt, case) in GN_CASES[:2]
        for path in GN_PATHS:
            for affine in (True, False):
                if path == "loop_real" and not (main and affine):
                    continue
                slow = path == "loop_real" or not (main or (affine and path in ("held", "loop")))
                out.append(pytest.param(dt, case, path, affine, marks=SLOW if slow else [],
                                        id=_id(dt, case, path, "affine" if affine else "plain")))
    return out


def _gn_expected(x, dy, G, w, b, eps):
    """The oracle group by group at unit scale: (y, mean_s, rstd_s, dx_s) per (sample,
    group) row, dweight, dbias, and each row's exponent ``k`` (``_expected_forward``)."""
    N, Cn, S = x.shape
    Cg = Cn // G
    rows = x.reshape(N * G, Cg * S)
    k = _exponents(rows)
    y_want, dx_s = np.empty(rows.shape), np.empty(rows.shape)
    mean_s, rstd_s = np.empty(N * G), np.empty(N * G)
    dw_want, db_want = np.zeros(Cn), np.zeros(Cn)
    for i in range(N * G):
        j, g = divmod(i, G)
        ch = slice(g * Cg, (g + 1) * Cg)
        xs = np.ldexp(x[j:j + 1, ch].astype(np.float64), -k[i])
        wg = None if w is None else w[ch]
        bg = None if b is None else b[ch]
        yi, mi, ri = ORACLE.group_norm_forward(xs, 1, wg, bg, _scaled_eps(eps, k[i]))
        dxi, dwi, dbi = ORACLE.group_norm_backward(dy[j:j + 1, ch], xs, mi, ri, wg)
        y_want[i], mean_s[i], rstd_s[i], dx_s[i] = yi.ravel(), mi[0, 0], ri[0, 0], dxi.ravel()
        dw_want[ch] += dwi
        db_want[ch] += dbi
    return y_want, mean_s, rstd_s, dx_s, dw_want, db_want, k


@pytest.mark.cudasim
@pytest.mark.parametrize("dt,case,path,affine", _gn_cases())
def test_group_norm_with_a_group_out_of_range(knobs, dt, case, path, affine):
    """GroupNorm, 2 groups, one (sample, group) out of range and the others ordinary:
    forward (y, mean, rstd) and backward given the forward's statistics (dx, dweight,
    dbias) against the oracle at each group's unit scale."""
    kw, shapes, loop, staged = GN_PATHS[path]
    knobs(**kw)
    N, Cn, S = shapes[dt]
    G, Cg = 2, Cn // 2
    L = Cg * S
    vec = C.vec_width(S, np.empty(S, dt), max_bytes=8)
    cfg = C.row_config(N * G, L, dt == F64, vec, C.ROW_RESIDENT, np.dtype(dt).itemsize, 1)
    assert (cfg.loop, cfg.stage > 0) == (loop, staged), cfg
    assert C.row_config(N * Cn, S, dt == F64, vec, C.ROW_RESIDENT).loop == loop  # the backward's rows
    rng = np.random.default_rng(13)
    at = 1 if N * G > 2 else 0
    rows, eps = _rows_of(rng, dt, case, L, N * G, at)   # (sample, group) rows
    x = rows.reshape(N, Cn, S)
    w = rng.uniform(0.5, 1.5, Cn).astype(dt) if affine else None
    b = rng.standard_normal(Cn).astype(dt) if affine else None
    dy = rng.standard_normal(x.shape).astype(dt)
    eps = _ln_eps(eps)
    y, mean, rstd = _host(*nc.group_norm_forward(_dev(x), G, _dev(w), _dev(b), eps))
    dx, dw, db = _host(*nc.group_norm_backward(_dev(dy), _dev(x), _dev(mean), _dev(rstd), _dev(w)))
    y_want, mean_s, rstd_s, dx_s, dw_want, db_want, k = _gn_expected(x, dy, G, w, b, eps)
    check = _Check()
    labels = _labels(N * G, at, case)
    tol = TOL[dt]
    check.rows("y", y.reshape(N * G, L), y_want, tol, labels)
    check.mean(mean, mean_s, k, tol, labels)
    check.rstd(rstd, np.ldexp(rstd_s, -k), dt, tol, labels)
    check.rows("dx (at unit scale)", np.ldexp(dx.reshape(N * G, L).astype(np.float64), k[:, None]), dx_s, tol,
               labels)
    check.close("dweight", dw, dw_want, tol)
    check.close("dbias", db, db_want, tol)
    check.done()


# GroupNorm's backward with a group whose sums leave the range though its forward does not:
# ``deviation`` (x - mean overflows, as ``GRAD_CASES``) and ``dy`` (x = +-1, each channel's
# dy summing to six tenths of the largest value: the group's sums of weight * dy overflow);
# and ``GRAD_CASES``' ``span`` and ``cancel``, whose sums stay in range, over the group.
GN_GRAD_CASES = ("deviation", "dy", "span", "cancel")


def _gn_grad_cases():
    """(dtype, case, path, affine): with a weight every path of ``GN_PATHS`` but the real
    threshold, float32 and float64; without, held and on the loop (the rest slow)."""
    out = []
    for dt in (F32, F64):
        for case in GN_GRAD_CASES:
            for path in ("held", "loop", "loop_unstaged", "loop_block"):
                for affine in (True, False):
                    slow = not affine and path not in ("held", "loop")
                    out.append(pytest.param(dt, case, path, affine, marks=SLOW if slow else [],
                                            id=_id(dt, case, path, "weight" if affine else "plain")))
    return out


@pytest.mark.cudasim
@pytest.mark.parametrize("dt,case,path,affine", _gn_grad_cases())
def test_group_norm_backward_whose_sums_leave_the_range(knobs, dt, case, path, affine):
    """GroupNorm, 2 groups, sample 0's group 1 the case's, the others ordinary: dx as the
    oracle's at each group's unit scale (x and dy each brought to it), the other groups'
    dx bit for bit as without the case's group, dweight and dbias as the oracle's."""
    kw, shapes, loop, staged = GN_PATHS[path]
    knobs(**kw)
    N, Cn, S = shapes[dt]
    G, Cg = 2, Cn // 2
    rng = np.random.default_rng(23)
    top = float(np.finfo(dt).max)
    x = _ordinary(rng, (N, Cn, S))
    dy = rng.standard_normal((N, Cn, S))
    if case == "deviation":
        x[0, Cg:] = np.resize([0.9, 0.9, -0.9, 0.9], (Cg, S)) * top
    elif case == "dy":
        x[0, Cg:] = np.resize([1.0, -1.0], (Cg, S))
        dy[0, Cg:] = 0.6 * top / S
    else:
        make_x, make_dy = GRAD_CASES[case]
        x[0, Cg:] = make_x(rng, Cg * S).reshape(Cg, S) * 2.0 ** 20
        dy[0, Cg:] = make_dy(rng, Cg * S).reshape(Cg, S) * top
    x, dy = x.astype(dt), dy.astype(dt)
    w = rng.uniform(0.85, 1.15, Cn).astype(dt) if affine else None
    _, mean, rstd = _host(*nc.group_norm_forward(_dev(x), G, _dev(w), None))

    def run(x, dy):
        return _host(*nc.group_norm_backward(_dev(dy), _dev(x), _dev(mean), _dev(rstd), _dev(w)))

    dx, dw, db = run(x, dy)
    # the oracle (sample, group) by group, x and dy at unit scale
    kx = _exponents(x.reshape(N * G, -1))
    kd = _exponents(dy.reshape(N * G, -1))
    dx_s = np.empty((N * G, Cg * S))
    dw_want, db_want = np.zeros(Cn), np.zeros(Cn)
    for i in range(N * G):
        j, g = divmod(i, G)
        ch = slice(g * Cg, (g + 1) * Cg)
        xs = np.ldexp(x[j:j + 1, ch].astype(np.float64), -kx[i])
        ys = np.ldexp(dy[j:j + 1, ch].astype(np.float64), -kd[i])
        _, mi, ri = ORACLE.group_norm_forward(xs, 1, None, None, _scaled_eps(1e-5, kx[i]))
        dxi, dwi, dbi = ORACLE.group_norm_backward(ys, xs, mi, ri, None if w is None else w[ch])
        dx_s[i] = dxi.ravel()
        dw_want[ch] += np.ldexp(dwi, kd[i])
        db_want[ch] += np.ldexp(dbi, kd[i])
    check = _Check()
    labels = _labels(N * G, 1, case)
    tol = TOL[dt]
    got = np.ldexp(dx.reshape(N * G, -1).astype(np.float64), (kx - kd)[:, None])
    check.rows("dx (at unit scale)", got, dx_s, tol, labels)
    check.close("dweight", dw, dw_want, tol)
    check.close("dbias", db, db_want, tol)
    calm_x, calm_dy = x.copy(), dy.copy()
    calm_x[0, Cg:] = _ordinary(rng, (Cg, S)).astype(dt)
    calm_dy[0, Cg:] = rng.standard_normal((Cg, S)).astype(dt)
    _, cm, cr = _host(*nc.group_norm_forward(_dev(calm_x), G, _dev(w), None))
    assert np.array_equal(np.delete(cm.ravel(), 1), np.delete(mean.ravel(), 1))
    calm = run(calm_x, calm_dy)[0].reshape(N * G, -1)
    if not np.array_equal(np.delete(dx.reshape(N * G, -1), 1, axis=0), np.delete(calm, 1, axis=0)):
        check.failures.append("the other groups' dx differ from a call without the case's group")
    check.done()


# ---------------------------------------------------------------- in place

# ``out=x``: a row out of range is normalized again from x after the block's rows (held in
# registers) or after its own y pass (the loop), and an in-place call's y overwrites x
# wherever it is written first.  ``tiny`` weights put an ordinary row's y out of range
# itself, which a pass that checks the rows again from memory would take for a row to redo.
IN_PLACE_CASES = [(F32, "limit"), (F64, "tiny"), (F32, "squares")]
_TINY = {F32: -120, F64: -1000}  # the exponent of the tiny weights (y stays normal)


def _in_place_params(rng, dt, n, weights, kind):
    w = rng.uniform(0.5, 1.5, n)
    if weights == "tiny":
        return np.ldexp(w, _TINY[dt]).astype(dt), None
    return w.astype(dt), (rng.standard_normal(n).astype(dt) if kind == "layer" else None)


def _in_place_cases(paths, ops=(None,)):
    """([op,] dtype, case, path, weights), op where ``ops`` names some: the contract's float32
    row on every path, the float64 tiny row held and unstaged, with both kinds of weights;
    the rest slow."""
    out = []
    for op in ops:
        for (dt, case) in IN_PLACE_CASES:
            for path in paths:
                for weights in ("ordinary", "tiny"):
                    slow = not (case == "limit" or case == "tiny" and path in ("held", "loop_unstaged"))
                    values = ((op,) if op else ()) + (dt, case, path, weights)
                    out.append(pytest.param(*values, marks=SLOW if slow else [], id=_id(*values)))
    return out


def _check_in_place(y, y_want, w, weights, dt, case, m, at):
    """y (2-D rows) against the oracle's; with tiny weights both divided by them (unit scale)."""
    y, y_want = np.asarray(y, np.float64), np.asarray(y_want, np.float64)
    if weights == "tiny":
        y, y_want = y / w, y_want / w
    check = _Check()
    check.rows("y", y, y_want, TOL[dt], _labels(m, at, case))
    check.done()


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,case,path,weights",
                         _in_place_cases(("held", "held_block", "loop", "loop_unstaged", "loop_block"),
                                         ("layer_norm", "rms_norm")))
def test_forward_in_place_of_a_row_out_of_range(knobs, op, dt, case, path, weights):
    """``out=x``: a row out of range between two ordinary rows, each row's y as the oracle's."""
    rng = np.random.default_rng(17)
    n = _path(knobs, path, dt, 3)
    x, eps = _rows_of(rng, dt, case, n)
    kind = _kind(op)
    w, b = _in_place_params(rng, dt, n, weights, kind)
    xd = _dev(x)
    if kind == "layer":
        assert nc.layer_norm(xd, n, _dev(w), _dev(b), _ln_eps(eps), out=xd) is xd
        eps_oracle = _ln_eps(eps)
    else:
        assert nc.rms_norm(xd, n, _dev(w), eps, out=xd) is xd
        eps_oracle = _rms_eps(dt, eps)
    y_want = _expected_forward(kind, x.astype(np.float64), w, b, eps_oracle)[0]
    _check_in_place(to_host(xd), y_want, w, weights, dt, case, 3, 1)


@pytest.mark.cudasim
@pytest.mark.parametrize("dt,case,path,weights", _in_place_cases(("held", "loop", "loop_unstaged", "loop_block")))
def test_group_norm_in_place_with_a_group_out_of_range(knobs, dt, case, path, weights):
    """``out=x``, GroupNorm, 2 groups, one (sample, group) out of range: each group's y as
    the oracle's."""
    kw, shapes, loop, staged = GN_PATHS[path]
    knobs(**kw)
    N, Cn, S = shapes[dt]
    G = 2
    rng = np.random.default_rng(19)
    rows, eps = _rows_of(rng, dt, case, Cn // G * S, N * G, 1)
    x = rows.reshape(N, Cn, S)
    w, b = _in_place_params(rng, dt, Cn, weights, "layer")
    xd = _dev(x)
    assert nc.group_norm(xd, G, _dev(w), _dev(b), _ln_eps(eps), out=xd) is xd
    y_want = _gn_expected(x, np.zeros(x.shape, dt), G, w, b, _ln_eps(eps))[0]
    per_row = np.tile(np.repeat(w, S), N).reshape(N * G, -1)  # each (sample, group) row's weights
    _check_in_place(to_host(xd).reshape(N * G, -1), y_want, per_row, weights, dt, case, N * G, 1)


@pytest.mark.cudasim
@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in_place"])
@pytest.mark.parametrize("path", ["held", "loop", "loop_unstaged", "loop_block"])
@pytest.mark.parametrize("side", ["under", "over"])
def test_group_norm_weights_whose_product_with_rstd_leaves_the_range(knobs, side, path, in_place):
    """float32 groups (in range) whose factor per channel, rstd * weight, leaves the range
    where y does not, on each path's own write pass, apart and in place: standard deviation
    1e15 and weights near 2**-120 (the factor underflows), or 1e-15 with eps 0 and weights
    near 2**100 (it overflows: y was inf).  ``test_numerics.py`` has the default path and
    channels-last."""
    kw, shapes, loop, staged = GN_PATHS[path]
    knobs(**kw)
    N, Cn, S = shapes[F32]
    rng = np.random.default_rng(29)
    std, at, eps = (1e15, _TINY[F32], 1e-5) if side == "under" else (1e-15, 100, 0.0)
    x = (rng.standard_normal((N, Cn, S)) * std).astype(F32)
    w = np.ldexp(rng.uniform(0.5, 1.5, Cn), at).astype(F32)
    b = rng.standard_normal(Cn).astype(F32) * np.ldexp(1.0, at)
    xd = _dev(x)
    y = to_host(nc.group_norm(xd, 2, _dev(w), _dev(b), eps, out=xd if in_place else None))
    y_want = _gn_expected(x, np.zeros(x.shape, F32), 2, w, b, eps)[0]
    per_row = np.tile(np.repeat(w, S), N).reshape(N * 2, -1)
    _check_in_place(y.reshape(N * 2, -1), y_want, per_row, "tiny", F32, "ordinary", N * 2, 0)


# ---------------------------------------------------------------- Inf and NaN

def _non_finite_rows(rng, dt, n):
    """8 rows: ordinary ones, and rows holding Inf or NaN -- among ordinary values, among
    values whose squares overflow and among values whose squares underflow (so that a
    rescue of out-of-range rows meets them too)."""
    big, small = (1e20, 1e-22) if dt == F32 else (1e160, 1e-170)
    x = _ordinary(rng, (8, n))
    x[1, 1] = np.inf
    x[3, 2] = np.nan
    x[4, :2] = [np.inf, -np.inf]
    x[5] = rng.standard_normal(n) * big
    x[5, 3 % n] = -np.inf
    x[6] = rng.standard_normal(n) * small
    x[6, 0] = np.nan
    bad = [1, 3, 4, 5, 6]
    return x.astype(dt), bad


def _nan_cases():
    out = []
    for op in OPS + ["group_norm"]:
        for dt in (F32, F64):
            for path in ("held", "loop"):
                out.append(pytest.param(op, dt, path, id=_id(op, dt, path)))
    return out


def _all_outputs(op, x, dy, w, b, eps):
    """Every output of ``op``'s forward and backward (the backward given the forward's
    statistics), as host arrays: {name: array}."""
    n = x.shape[-1]
    if op == "group_norm":
        x3, dy3 = x.reshape(len(x) // 2, 4, -1), dy.reshape(len(x) // 2, 4, -1)
        y, m, r = nc.group_norm_forward(_dev(x3), 2, _dev(w[:4]), _dev(b[:4]), eps)
        dx, dw, db = nc.group_norm_backward(_dev(dy3), _dev(x3), m, r, _dev(w[:4]))
        out = dict(y=y, mean=m, rstd=r, dx=dx, dweight=dw, dbias=db)
        return {k: np.asarray(to_host(v), np.float64).reshape(len(x), -1) if k in ("y", "mean", "rstd", "dx")
                else to_host(v) for k, v in out.items()}
    kind = _kind(op)
    res = np.zeros_like(x) if op.startswith("add_") else None
    y, s, m, r = _forward(op, x, res, n, w, b if kind == "layer" else None, eps)
    xin = x if s is None else s
    args = (_dev(dy), _dev(xin), _dev(m), _dev(r), n, _dev(w)) if kind == "layer" else \
        (_dev(dy), _dev(xin), _dev(r), n, _dev(w))
    if op.startswith("add_"):
        args = args[:1] + (_dev(dy),) + args[1:]
    back = getattr(nc, op + "_backward")(*args)
    out = dict(y=y, rstd=r, dx=back[0], dweight=back[1])
    if kind == "layer":
        out.update(mean=m, dbias=back[2])
    return {k: to_host(v) for k, v in out.items()}


def _oracle_outputs(op, x, dy, w, b, eps):
    n = x.shape[-1]
    if op == "group_norm":
        x3, dy3 = x.reshape(len(x) // 2, 4, -1), dy.reshape(len(x) // 2, 4, -1)
        y, m, r = ORACLE.group_norm_forward(x3, 2, w[:4], b[:4], eps)
        dx, dw, db = ORACLE.group_norm_backward(dy3, x3, m, r, w[:4])
        return dict(y=y.reshape(len(x), -1), mean=m.reshape(len(x), -1), rstd=r.reshape(len(x), -1),
                    dx=dx.reshape(len(x), -1), dweight=dw, dbias=db)
    if _kind(op) == "layer":
        y, m, r = ORACLE.layer_norm_forward(x, n, w, b, eps)
        dx, dw, db = ORACLE.layer_norm_backward(dy, x, m, r, n, w)
        return dict(y=y, mean=m, rstd=r, dx=dx + (dy if op.startswith("add_") else 0), dweight=dw, dbias=db)
    y, r = ORACLE.rms_norm_forward(x, n, w, eps)
    dx, dw = ORACLE.rms_norm_backward(dy, x, r, n, w)
    return dict(y=y, rstd=r, dx=dx + (dy if op.startswith("add_") else 0), dweight=dw)


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,path", _nan_cases())
def test_inf_and_nan_rows_stay_non_finite_and_alone(knobs, op, dt, path):
    """Rows holding Inf or NaN (among ordinary values, values whose squares overflow, values
    whose squares underflow; eps = 0) give what the oracle gives -- NaN in y, dx and the
    statistics (RMSNorm's Inf row: rstd 0, y 0 but NaN at the Inf) -- forward and backward,
    never finite numbers in their place; every other row's results are bit for bit those
    of the same call with the non-finite values replaced by 0, and dbias (sums of dy) too."""
    rng = np.random.default_rng(14)
    if op == "group_norm":  # (4 samples, 4 channels, 2 groups): 8 (sample, group) rows
        kw = PATHS["held"][0] if path == "held" else LOOP
        n = {"held": 4, "loop": 36}[path] * 2   # a group: 2 channels of 4 (36) elements
    else:
        kw = PATHS[path][0]
        n = PATHS[path][1][dt]
    knobs(**kw)
    x, bad = _non_finite_rows(rng, dt, n)
    dy = rng.standard_normal(x.shape).astype(dt)
    w = rng.uniform(0.5, 1.5, n).astype(dt)
    b = rng.standard_normal(n).astype(dt)
    got = _all_outputs(op, x, dy, w, b, 0.0)
    clean = _all_outputs(op, np.where(np.isfinite(x), x, 0).astype(dt), dy, w, b, 0.0)
    want = _oracle_outputs(op, x.astype(np.float64), dy.astype(np.float64), w, b, 0.0)
    good = [i for i in range(len(x)) if i not in bad]
    failures = []
    tol = TOL[dt]
    for name in ("y", "mean", "rstd", "dx"):
        if name not in want:
            continue
        g = np.asarray(got[name], np.float64).reshape(len(x), -1)
        c = np.asarray(clean[name], np.float64).reshape(len(x), -1)
        r = np.asarray(want[name], np.float64).reshape(len(x), -1)
        for i in bad:
            if name in ("y", "dx"):
                assert np.isnan(r[i]).any(), (name, i)  # (the oracle: NaN at least where the row holds it)
            if not (np.array_equal(np.isnan(g[i]), np.isnan(r[i]))
                    and np.allclose(g[i], r[i], rtol=tol, atol=tol * max(1.0, np.nanmax(np.abs(r[i]), initial=0)),
                                    equal_nan=True)):
                failures.append(f"{name} row {i}: got {_show(g[i])}, want {_show(r[i])}")
        if not np.array_equal(g[good], c[good]):
            failures.append(f"{name}: the finite rows {good} differ from the call without Inf/NaN")
    for name in ("dweight", "dbias"):  # column sums over every row: NaN where the oracle's are
        if name in want:
            g, r = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
            if not np.allclose(g, r, rtol=tol, atol=tol * max(1.0, np.nanmax(np.abs(r), initial=0)), equal_nan=True):
                failures.append(f"{name}: got {_show(g)}, want {_show(r)}")
    if "dbias" in want:
        if not np.array_equal(got["dbias"], clean["dbias"]):
            failures.append("dbias (sums of dy alone) differs from the call without Inf/NaN")
    assert not failures, "\n".join(failures)


@pytest.mark.cudasim
@pytest.mark.parametrize("op", OPS)
def test_float16_rows_at_its_limits_need_no_rescue(op):
    """The kernels of float16 rows carry no rescue (``stats.can_leave_range``): at float16's
    largest and smallest magnitudes (eps = 0) the float32 sums stay in range, and every
    result is the oracle's, forward and backward."""
    x = np.array([[65504, -65504, 1, 2], [6e-8, 1.2e-7, 1.8e-7, 0], [65504] * 3 + [-65504]], np.float16)
    n = x.shape[1]
    kind = _kind(op)
    y, s, mean, rstd = _forward(op, x, np.zeros_like(x) if op.startswith("add_") else None, n, None, None, 0.0)
    x64 = x.astype(np.float64)
    if kind == "layer":
        y_want, m_want, r_want = ORACLE.layer_norm_forward(x64, n, None, None, 0.0)
        np.testing.assert_allclose(mean.ravel(), m_want.ravel(), rtol=1e-6, atol=1e-3)
    else:
        y_want, r_want = ORACLE.rms_norm_forward(x64, n, None, 0.0)
    np.testing.assert_allclose(rstd.ravel(), r_want.ravel(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float64), y_want, rtol=2e-3, atol=2e-3)  # (y rounded to float16)
    # (the tiny row's dx is rstd, about 1e7, times dy: a dy of 1e-3 keeps it in float16)
    dy = (np.array([[0.3, -1.2, 0.7, 2.0]] * 3) * np.array([[1], [1e-3], [1]])).astype(np.float16)
    args = (_dev(dy), _dev(x), _dev(mean), _dev(rstd), n) if kind == "layer" else (_dev(dy), _dev(x), _dev(rstd), n)
    if op.startswith("add_"):
        args = args[:1] + (_dev(np.zeros_like(dy)),) + args[1:]
    dx = to_host(getattr(nc, op + "_backward")(*args)[0])
    if kind == "layer":
        dx_want = ORACLE.layer_norm_backward(dy.astype(np.float64), x64, mean.astype(np.float64),
                                             rstd.astype(np.float64), n)[0]
    else:
        dx_want = ORACLE.rms_norm_backward(dy.astype(np.float64), x64, rstd.astype(np.float64), n)[0]
    scale = np.abs(dx_want).max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(dx, np.float64) / scale, dx_want / scale, rtol=0, atol=2e-3)


def _zero_rstd_cases():
    out = []
    for op in OPS + ["group_norm"]:
        for dt in (F32, F64, "bfloat16"):
            for path in ("held", "loop"):
                out.append(pytest.param(op, dt, path, id=_id(op, dt, path)))
    return out


@pytest.mark.cudasim
@pytest.mark.parametrize("op,dt,path", _zero_rstd_cases())
def test_backward_given_a_zero_rstd(knobs, op, dt, path):
    """A backward handed rstd = 0 for a row (which no forward of a finite row returns, but a
    caller may pass) gives that row dx = 0 (fused: ds), dweight's and dbias' sums as the
    oracle's, the other rows untouched: no NaN from dividing by that rstd."""
    if dt == "bfloat16":
        dt = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(15)
    knobs(**PATHS[path][0])
    # GroupNorm: (2 samples, 4 channels, 2 groups), 4 (sample, group) rows of 2 channels of 4 (36)
    n = {"held": 4, "loop": 36}[path] * 2 if op == "group_norm" else PATHS[path][1][F32]
    x = _ordinary(rng, (4, n)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    w = rng.uniform(0.5, 1.5, n).astype(dt)
    b = rng.standard_normal(n).astype(dt)
    if op == "group_norm":
        x3, dy3 = x.reshape(2, 4, -1), dy.reshape(2, 4, -1)
        _, m, r = nc.group_norm_forward(_dev(x3), 2, _dev(w[:4]), _dev(b[:4]))
        m, r = to_host(m), to_host(r).copy()
        r[0, 1] = 0
        back = nc.group_norm_backward(_dev(dy3), _dev(x3), _dev(m), _dev(r), _dev(w[:4]))
        dx_want, *sums = ORACLE.group_norm_backward(dy3.astype(np.float64), x3.astype(np.float64), m, r,
                                                     w[:4].astype(np.float64))
        dx_want = dx_want.reshape(4, -1)
        zero = 1   # (sample 0, group 1)
    else:
        kind = _kind(op)
        fused = op.startswith("add_")
        _, _, m, r = _forward(op, x, np.zeros_like(x) if fused else None, n, w, b if kind == "layer" else None, None)
        r = r.copy()
        r[2] = 0
        zero = 2
        args = (_dev(dy), _dev(x), _dev(m), _dev(r), n, _dev(w)) if kind == "layer" else \
            (_dev(dy), _dev(x), _dev(r), n, _dev(w))
        if fused:
            args = args[:1] + (_dev(dy),) + args[1:]
        back = getattr(nc, op + "_backward")(*args)
        x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
        if kind == "layer":
            dx_want, *sums = ORACLE.layer_norm_backward(dy64, x64, m, r, n, w64)
        else:
            dx_want, *sums = ORACLE.rms_norm_backward(dy64, x64, r, n, w64)
        if fused:
            dx_want = dx_want + dy64
    dx = np.asarray(to_host(back[0]), np.float64).reshape(4, -1)
    want_zero = dy[zero].astype(np.float64) if op.startswith("add_") else np.zeros(n)
    assert np.array_equal(dx[zero], want_zero), _show(dx[zero])
    assert_close(dx, dx_want, dt, "dx")
    for got_sum, want_sum, name in zip(back[1:], sums, ("dweight", "dbias")):
        assert_close(to_host(got_sum), want_sum, dt, name)
