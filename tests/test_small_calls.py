"""The CPU's small-call path (``cpu/_backend.Plans``): a repeated call replays a plan
learned from its first and gives the full path's bits, still validates, and one call
gets one answer whatever was called before it."""

from fractions import Fraction

import numpy as np
import pytest

import numbanorm as nn
from conftest import channels_last


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_repeated_16_bit_and_out_calls_take_the_small_call_path_with_the_full_paths_bits(dtype):
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 16)).astype(dt)
    x[1, 0, 3] = np.nan  # stays in its row
    w = rng.standard_normal(16).astype(dt)
    w32 = w.astype(np.float32)  # weights of another dtype than x
    plans = _backend.plans._plans
    before = x.copy()
    # the statistics too: the forward functions (no out=) replay as well
    for fwd in (lambda: nn.layer_norm_forward(x, 16, w, w32, 1e-4), lambda: nn.rms_norm_forward(x, 16, w)):
        plans.clear()
        want = [a.copy() for a in fwd()]
        for a, b in zip(fwd(), want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for call in (lambda out=None: nn.layer_norm(x, 16, w, w32, 1e-4, out=out),
                 lambda out=None: nn.rms_norm(x, 16, w, out=out)):
        plans.clear()
        want = call().copy()                 # the full path, which learns the call
        assert len(plans) == 1
        out = np.empty_like(x)
        assert call(out) is out and len(plans) == 2  # full path again (another key: out=)
        for got in (call(), call(out)):     # both replayed
            assert len(plans) == 2 and got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        assert call(out) is out
        f32 = out.astype(np.float32)
        assert np.isnan(f32[1, 0]).all() and not np.isnan(f32[[0, 2]]).any()
        w[0] = w[0] * 2                      # contents changed in place: seen by the replay
        assert not np.array_equal(call(out).astype(np.float32), want.astype(np.float32))
        w[0] = w[0] / 2
        # what the replay cannot learn is checked on every call
        out.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            call(out)
        out.flags.writeable = True
        np.testing.assert_array_equal(call(x.copy()).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))  # inputs unchanged
    # out= overlapping x: the launcher computes apart on a replayed call too
    buf = rng.standard_normal((5, 16)).astype(dt)
    want = nn.layer_norm(buf[:-1].copy(), 16, w)
    nn.layer_norm(buf[:-1], 16, w, out=buf[1:].copy())  # learn the key of (4, 16) x and out
    nn.layer_norm(buf[:-1], 16, w, out=buf[1:])
    np.testing.assert_array_equal(buf[1:].view(np.uint8), want.view(np.uint8))


@pytest.mark.parallel_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_repeated_plain_call_has_the_forwards_bits_where_rows_are_redone(dtype, monkeypatch):
    """A plain call replayed by its plan keeps its unreturned statistics in one scratch
    allocation, by either way into the plans; the rows its rescaling variant redoes are found
    by their rstd there, on the parallel kernel's threads too (40 x 1024 elements), and every
    y is the forward's."""
    from numbanorm.cpu import _backend

    dt = np.dtype(dtype)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 20, 1024)).astype(dt)
    x[0, 3] *= 1e20 if dt == np.float32 else 1e160  # its sums overflow: redone by rescaling
    x[1, 17] *= 1e20 if dt == np.float32 else 1e160
    x[1, 5, 7] = np.nan  # stays in its row
    w = rng.standard_normal(1024).astype(dt)
    small = _backend.plans
    frontend = type(nn.cpu._frontend)
    answer, answered = frontend._answer, []  # the frontend's path, where a call takes it
    monkeypatch.setattr(frontend, "_answer", lambda self, op, *a: answered.append(op.name) or answer(self, op, *a))
    for plain, forward, args in ((nn.layer_norm, nn.layer_norm_forward, (w, w, 1e-5)),
                                 (nn.rms_norm, nn.rms_norm_forward, (w, None))):
        small._plans.clear()
        want = [a.copy() for a in forward(x, 1024, *args)]  # the full path, which learns the call
        assert len(small._plans) == 1
        got = small.shortcut((plain.__name__, "plain"))(x, 1024, *args)
        assert len(got) == 1 and len(small._plans) == 1
        # the shortcut (the top level's and numbanorm.cpu's functions ask it first), and the
        # frontend's own way into the same plans (where the top level goes next), as plain
        ran = small._run[plain.__name__, "forward"]
        asked = []
        answered.clear()
        monkeypatch.setitem(small._run, (plain.__name__, "forward"),
                            lambda plan, a, plain=False, ran=ran: asked.append(plain) or ran(plan, a, plain))
        for y in (got[0], plain(x, 1024, *args), getattr(nn.cpu, plain.__name__)(x, 1024, *args),
                  getattr(nn.cpu._frontend, plain.__name__)(x, 1024, *args)):
            assert y.dtype == dt and y.shape == x.shape
            np.testing.assert_array_equal(y.view(np.uint8), want[0].view(np.uint8))
        # (a shortcut holds the runner it was made with; the frontend looks it up)
        assert asked == [True] and answered == [plain.__name__]
        redone = np.isfinite(want[0][0, 3]).all() and np.isfinite(want[0][1, 17]).all()
        assert redone and np.isnan(want[0][1, 5]).all() and np.isfinite(np.delete(want[0][1], 5, 0)).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_replayed_out_call_apart_from_its_inputs_goes_straight_to_the_kernel(dtype, monkeypatch):
    """A replayed forward into an ``out=`` that shares no memory with x or the weights
    launches the kernel as an allocating replay does, not through the launcher's overlap
    checks, with the same bits; an out= that overlaps x or a weight still goes to the
    launcher, which computes apart."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import layer_norm as ln_kernels
    from numbanorm.cpu._kernels import rms_norm as rms_kernels
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 32)).astype(dt)
    w, b = rng.standard_normal(32).astype(dt), rng.standard_normal(32).astype(np.float32)
    launched = []
    for kernels in (ln_kernels, rms_kernels):
        real = kernels.forward
        monkeypatch.setattr(kernels, "forward", lambda *a, real=real: launched.append(a) or real(*a))
    for call in (lambda out: nn.layer_norm(x, 32, w, b, out=out), lambda out: nn.rms_norm(x, 32, w, out=out)):
        _backend.plans._plans.clear()
        want = call(np.empty_like(x)).copy()      # the full path learns the call
        launched.clear()
        out = np.empty_like(x)
        assert call(out) is out and launched == []
        np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    # out overlapping the weight it reads, replayed: the launcher computes apart
    _backend.plans._plans.clear()
    buf = np.empty((4, 32), dt)
    buf[3] = w
    want = nn.layer_norm(x, 32, buf[3].copy(), b)
    nn.layer_norm(x, 32, buf[3].copy(), b, out=np.empty((4, 32), dt))  # learn the key
    launched.clear()
    nn.layer_norm(x, 32, buf[3], b, out=buf)
    assert len(launched) == 1
    np.testing.assert_array_equal(buf.view(np.uint8), want.view(np.uint8))


def test_a_replayed_call_blocks_its_rows_for_the_thread_count_of_the_call(monkeypatch):
    """A plan kept the rows per block of the thread count it was learned at: learned on one
    thread, a (256, 4096) call on sixteen kept blocks of 64 rows, four blocks for sixteen
    threads.  A replay large enough to run on Numba's threads blocks them for the count
    of its own call (the thread count stood in for: ``num_threads``)."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import common
    from numbanorm.cpu._kernels import layer_norm as ln_kernels

    x = np.random.default_rng(3).standard_normal((256, 4096)).astype(np.float32)
    blocks = []
    real = ln_kernels.launch
    monkeypatch.setattr(ln_kernels, "launch", lambda kernel, size, block, *a: blocks.append(block)
                        or real(kernel, size, block, *a))
    _backend.plans._plans.clear()
    for threads in (1, 16):
        monkeypatch.setattr(common, "num_threads", lambda threads=threads: threads)
        nn.layer_norm(x, 4096)  # learned on one thread; replayed on sixteen
    assert blocks[-1] == common.row_block(256) == 4


@pytest.mark.parametrize("order", ["C", "last"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_repeated_group_norm_takes_the_small_call_path_with_the_full_paths_bits(dtype, order):
    """GroupNorm's frontend took 22 of a 29 us (1, 8, 4, 4) call; a call seen before goes
    to the launcher, with the full path's bits, and what differs is validated again; x in C
    order or in channels-last order (its outputs too)."""
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 5, 3)).astype(dt)
    if order == "last":
        x = channels_last(x)
    x[1, 2, 0, 1] = np.nan  # stays in its (sample, group)
    w = rng.standard_normal(6).astype(dt)
    b32 = rng.standard_normal(6).astype(np.float32)
    small = _backend.plans
    before = x.copy()

    def same(got, want):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides
            np.testing.assert_array_equal(*(np.ascontiguousarray(c).view(np.uint8) for c in (a, b)))

    small._plans.clear()
    want = [a.copy(order="K") for a in nn.group_norm_forward(x, 3)]  # the full path, which learns it
    assert _backend.order_of(want[0]) == order
    assert small.shortcut(("group_norm", "forward"))(x, 3, None, None, 1e-5) is not None  # (eps as the public default)
    same(nn.group_norm_forward(x, 3), want)
    y = np.asarray(want[0], np.float64)
    assert np.isnan(y[1, 2:4]).all() and not np.isnan(y[0]).any() and not np.isnan(y[1, :2]).any()

    small._plans.clear()
    want = nn.group_norm(x, 3, w, b32, 1e-4).copy(order="K")
    out = np.empty_like(x)  # (x's order)
    assert nn.group_norm(x, 3, w, b32, 1e-4, out=out) is out  # learned as another key
    for got in (nn.group_norm(x, 3, w, b32, 1e-4), nn.group_norm(x, 3, w, b32, 1e-4, out=out), out):
        same((got,), (want,))
    assert small.shortcut(("group_norm", "forward"))(x, 3, w, b32, 1e-4, out=out) is not None
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nn.group_norm(x, 3, w, b32, 1e-4, out=out)
    xc = x.copy(order="K")  # in place, on a key seen before (as out=): the launcher sees that out is x
    nn.group_norm(xc, 3, w, b32, 1e-4, out=xc)
    same((xc,), (want,))
    w[0] = w[0] * 2  # contents changed in place: seen by the replay
    assert not np.array_equal(nn.group_norm(x, 3, w, b32, 1e-4)[0], want[0], equal_nan=True)
    w[0] = w[0] / 2
    with pytest.raises(ValueError, match="num_groups"):
        nn.group_norm(x, 4, w, b32, 1e-4)  # another key: validated
    np.testing.assert_array_equal(np.ascontiguousarray(x).view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_repeated_backward_takes_the_small_call_path_with_the_full_paths_bits(dtype):
    """A backward seen before skips the frontend (its validation and conversions: 33 of a
    134 us (256, 768) float32 call) and gives the full path's bits; a call that needs a
    conversion is never learned, and one that differs from a learned call is validated."""
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 2, 16)).astype(dt)
    x[1, 0, 3] = np.nan  # stays in its row
    dy = rng.standard_normal(x.shape).astype(dt)
    small = _backend.plans
    plans = small._plans
    before = [x.copy(), dy.copy()]
    for w in (rng.standard_normal(16).astype(dt), rng.standard_normal(16).astype(np.float32), None):
        _, mean, rstd = nn.layer_norm_forward(x, 16, w)
        for name, stats, shortcut in (("layer_norm", (mean, rstd), small.shortcut(("layer_norm", "backward"))),
                                      ("rms_norm", nn.rms_norm_forward(x, 16, w)[1:], small.shortcut(("rms_norm", "backward")))):
            bwd = getattr(nn, name + "_backward")
            plans.clear()
            assert shortcut(dy, x, *stats, 16, w) is None  # not seen yet
            want = [a.copy() for a in bwd(dy, x, *stats, 16, w)]  # the full path, which learns it
            assert shortcut(dy, x, *stats, 16, w) is not None
            for got in (bwd(dy, x, *stats, 16, w), shortcut(dy, x, *stats, 16, w)):
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
            dx = np.asarray(want[0], np.float64)
            assert np.isnan(dx[1, 0]).all() and not np.isnan(dx[[0, 2]]).any()
            if w is not None:  # contents changed in place: seen by the replay
                w[0] = w[0] * 2
                assert not np.array_equal(np.asarray(bwd(dy, x, *stats, 16, w)[0], np.float64), dx,
                                          equal_nan=True)
                w[0] = w[0] / 2
            # dy in another dtype is cast by the full path: never learned, the same result
            plans.clear()
            dy2 = dy.astype(np.float32 if dt == np.float64 else np.float64)
            got = bwd(dy2, x, *stats, 16, w)
            assert not plans and shortcut(dy2, x, *stats, 16, w) is None
            np.testing.assert_array_equal(got[0].view(np.uint8),
                                          bwd(dy2.astype(dt), x, *stats, 16, w)[0].view(np.uint8))
            # a call that differs from a learned one is validated again
            bwd(dy, x, *stats, 16, w)
            with pytest.raises(ValueError, match="rstd"):
                bwd(dy, x, *stats[:-1], stats[-1][:2], 16, w)
    for a, b in zip((x, dy), before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_a_repeated_group_norm_backward_takes_the_small_call_path_with_the_full_paths_bits(dtype):
    """GroupNorm's backward frontend took 14 of a 26 us (1, 16, 1, 1) call; a backward seen
    before goes to the launcher with the full path's bits, for a weight in x's dtype, in
    another, or none; a call that needs a conversion is never learned, and one that
    differs from a learned call is validated."""
    from numbanorm.cpu import _backend
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 6, 5, 3)).astype(dt)
    x[1, 2, 0, 1] = np.nan  # stays in its (sample, group): channels 2 and 3 of sample 1
    dy = rng.standard_normal(x.shape).astype(dt)
    small = _backend.plans
    shortcut = small.shortcut(("group_norm", "backward"))
    before = [x.copy(), dy.copy()]
    for w in (rng.standard_normal(6).astype(dt), rng.standard_normal(6).astype(np.float32), None):
        _, mean, rstd = nn.group_norm_forward(x, 3, w)
        small._plans.clear()
        assert shortcut(dy, x, mean, rstd, w) is None  # not seen yet
        want = [a.copy() for a in nn.group_norm_backward(dy, x, mean, rstd, w)]  # the full path, which learns it
        assert shortcut(dy, x, mean, rstd, w) is not None
        for got in (nn.group_norm_backward(dy, x, mean, rstd, w), shortcut(dy, x, mean, rstd, w)):
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        dx = np.asarray(want[0], np.float64)
        assert np.isnan(dx[1, 2:4]).all() and not np.isnan(dx[0]).any() and not np.isnan(dx[1, :2]).any()
        if w is not None:  # contents changed in place: seen by the replay
            w[0] = w[0] * 2
            assert not np.array_equal(np.asarray(nn.group_norm_backward(dy, x, mean, rstd, w)[0], np.float64),
                                      dx, equal_nan=True)
            w[0] = w[0] / 2
        # dy in another dtype is cast by the full path: never learned, the same result
        small._plans.clear()
        dy2 = dy.astype(np.float32 if dt == np.float64 else np.float64)
        got = nn.group_norm_backward(dy2, x, mean, rstd, w)
        assert not small._plans and shortcut(dy2, x, mean, rstd, w) is None
        np.testing.assert_array_equal(got[0].view(np.uint8),
                                      nn.group_norm_backward(dy2.astype(dt), x, mean, rstd, w)[0].view(np.uint8))
        # a call that differs from a learned one is validated again
        nn.group_norm_backward(dy, x, mean, rstd, w)
        with pytest.raises(ValueError, match="rstd"):
            nn.group_norm_backward(dy, x, mean, rstd[:1], w)
    for a, b in zip((x, dy), before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_repeated_16_bit_call_goes_straight_to_the_kernel(dtype, monkeypatch):
    """No launcher (which widened the weights with two Numba calls and two
    allocations on every call) for a 16-bit call without out= seen before: the
    kernel reads x, y and 16-bit weights as their integer views."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import layer_norm as ln_cpu, rms_norm as rms_cpu
    from numbanorm.measure import host_dtype

    dt = host_dtype(dtype)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(dt)
    w = rng.standard_normal(64).astype(dt)
    b32 = rng.standard_normal(64).astype(np.float32)
    _backend.plans._plans.clear()
    want = (nn.layer_norm(x, 64, w, b32), nn.rms_norm(x, 64, w))  # learned by the full path

    def launcher_called(*args, **kwargs):
        raise AssertionError("a repeated 16-bit call went through the launcher")

    monkeypatch.setattr(ln_cpu, "forward", launcher_called)
    monkeypatch.setattr(rms_cpu, "forward", launcher_called)
    for got, w_ in zip((nn.layer_norm(x, 64, w, b32), nn.rms_norm(x, 64, w)), want):
        np.testing.assert_array_equal(got.view(np.uint8), w_.view(np.uint8))


@pytest.mark.parametrize("shape, nshape", [((4, 8), (8,)), ((3, 8), (3, 8)), ((1, 24), (24,)), ((2, 3, 8), (3, 8))])
def test_a_repeated_call_returns_what_the_first_did_for_every_layout_of_x(shape, nshape):
    """The small-call path passes an x already of (rows, N) to the kernel as it is,
    and reshapes every other x (a 2-D x over two normalized dimensions too)."""
    from numbanorm.cpu import _backend

    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(np.float32)
    # a weight over two dimensions is not learned (the full path flattens it): none there
    w = rng.standard_normal(nshape).astype(np.float32) if len(nshape) == 1 else None
    _backend.plans._plans.clear()
    for fwd in (lambda: nn.layer_norm_forward(x, nshape, w, w), lambda: nn.rms_norm_forward(x, nshape, w)):
        first = fwd()
        assert len(_backend.plans._plans) >= 1
        for a, b in zip(first, fwd()):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        assert first[0].shape == shape


def test_a_repeated_call_takes_the_small_call_path_and_still_validates():
    from numbanorm.cpu import _backend

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    plans = _backend.plans._plans
    first = nn.layer_norm_forward(x, (8,), w, w, 1e-3)
    assert any(k[0] == ("layer_norm", "forward") and k[1] == x.shape for k in plans)  # learned from the full path
    again = nn.layer_norm_forward(x, (8,), w, w, 1e-3)
    for a, b in zip(first, again):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    y, r = nn.rms_norm_forward(x, 8, w)
    y2, r2 = nn.rms_norm_forward(x, 8, w)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(r, r2)
    # anything that differs from a learned call is validated again
    with pytest.raises(ValueError, match="eps"):
        nn.layer_norm(x, (8,), w, w, -1e-3)
    with pytest.raises(ValueError, match="weight"):
        nn.layer_norm(x, (8,), w[:4], w, 1e-3)
    with pytest.raises(TypeError, match="eps"):
        nn.rms_norm(x, 8, w, True)
    with pytest.raises(ValueError, match="out"):
        nn.layer_norm(x, (8,), w, w, 1e-3, out=np.empty((2, 3, 7), np.float32))
    # a weight over two normalized dimensions is flattened by the full path
    w2 = rng.standard_normal((3, 8)).astype(np.float32)
    first2 = nn.layer_norm(x, (3, 8), w2, None)
    np.testing.assert_array_equal(nn.layer_norm(x, (3, 8), w2, None), first2)
    # a strided x of the same shape is a different call: same values
    xs = np.repeat(x, 2, axis=-1)[..., ::2]
    np.testing.assert_array_equal(nn.layer_norm(xs, (8,), w, w, 1e-3), first[0])


def _outcome(call):
    """What a call gives: its results' bytes, or its exception's type and message."""
    try:
        got = call()
    except Exception as e:  # noqa: BLE001  (the outcome is the exception)
        return type(e), str(e)
    return tuple(np.asarray(a).tobytes() for a in (got if isinstance(got, tuple) else (got,)))


_X64 = np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32)
_D64 = np.random.default_rng(10).standard_normal((4, 64)).astype(np.float32)


def _stats():
    return nn.layer_norm_forward(_X64, 64)[1:]


@pytest.mark.parametrize("learned, asked", [
    (lambda: nn.layer_norm(_X64, 64), lambda: nn.layer_norm(_X64, 64.0)),
    (lambda: nn.layer_norm(_X64, (64,)), lambda: nn.layer_norm(_X64, (64.0,))),
    (lambda: nn.layer_norm(_X64, 64), lambda: nn.layer_norm(_X64, Fraction(64))),
    (lambda: nn.layer_norm(_X64, (64,)), lambda: nn.layer_norm(_X64, (Fraction(64),))),
    (lambda: nn.rms_norm(_X64, 64), lambda: nn.rms_norm(_X64, 64.0)),
    (lambda: nn.rms_norm(_X64, (64,)), lambda: nn.rms_norm(_X64, (64.0,))),
    (lambda: nn.group_norm(_X64.reshape(4, 8, 8), 2), lambda: nn.group_norm(_X64.reshape(4, 8, 8), 2.0)),
    (lambda: nn.group_norm(_X64.reshape(4, 8, 8), 1), lambda: nn.group_norm(_X64.reshape(4, 8, 8), True)),
    (lambda: nn.layer_norm_backward(_D64, _X64, *_stats(), (64,), None),
     lambda: nn.layer_norm_backward(_D64, _X64, *_stats(), (64.0,), None)),
    (lambda: nn.rms_norm_backward(_D64, _X64, _stats()[1], (64,), None),
     lambda: nn.rms_norm_backward(_D64, _X64, _stats()[1], (64.0,), None)),
], ids=["64.0", "(64.0,)", "Fraction", "(Fraction,)", "rms 64.0", "rms (64.0,)", "groups 2.0", "groups True",
        "backward (64.0,)", "rms backward (64.0,)"])
def test_a_call_gets_one_answer_whatever_was_called_before(learned, asked):
    """The small-call path keys a call by what the full path decides on: a call equal to a
    learned one (64.0 == 64, True == 1) but of another type gets the full path's answer."""
    from numbanorm.cpu import _backend

    _backend.plans._plans.clear()
    first = _outcome(asked)
    assert first[0] is TypeError, first  # what the full path says of it
    learned()
    learned()  # (the second call is the small-call path's)
    assert _backend.plans._plans
    assert _outcome(asked) == first


@pytest.mark.parametrize("x_order, out_order", [("channels_last", "C"), ("C", "channels_last")])
def test_a_repeated_group_norm_fills_an_out_of_the_other_memory_order(x_order, out_order):
    """A group norm's plan is learned only where ``out`` has x's memory order: a plan that
    took any order (the check removed) wrote from the second call on into a copy and left
    ``out`` as it was, the first call (the full path) correct; every call fills ``out``."""
    from numbanorm.cpu import _backend

    _backend.plans._plans.clear()
    x = np.random.default_rng(0).standard_normal((2, 4, 3, 5)).astype(np.float32)
    as_order = {"C": np.ascontiguousarray, "channels_last": channels_last}
    xs = as_order[x_order](x)
    want = nn.group_norm(np.ascontiguousarray(x), 2)
    for _ in range(3):
        out = as_order[out_order](np.zeros_like(x))
        assert nn.group_norm(xs, 2, out=out) is out
        np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)  # (the two orders' sums: to rounding)
    _backend.plans._plans.clear()


def test_the_plan_cache_is_bounded():
    """More distinct calls than the cache holds leave it at its bound, not growing with every
    shape a process has seen."""
    from numbanorm.cpu import _backend

    plans = _backend.plans
    saved = plans.MAX_PLANS
    plans._plans.clear()
    try:
        plans.MAX_PLANS = 2
        for n in (5, 6, 7, 8):
            x = np.ones((3, n), np.float32)
            nn.layer_norm(x, n)
            nn.layer_norm(x, n)
            assert 0 < len(plans._plans) <= 2
    finally:
        plans.MAX_PLANS = saved
        plans._plans.clear()
