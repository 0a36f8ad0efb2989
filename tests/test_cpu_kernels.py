"""The CPU kernels' own machinery: streaming stores, row blocks, in-place calls, placement.

Large outputs go out through streaming stores (``numbanorm.cpu._kernels.memory``) only
from ``memory.STREAM_MIN_BYTES`` (megabytes), beyond the shapes a test can afford; these
tests lower the threshold so that small odd shapes take that path, and check it
bit for bit against the ordinary one.
"""

import importlib
import platform
from types import SimpleNamespace

import numpy as np
import pytest

import numbanorm as nn
from _marks import first_then_exhaustive
from conftest import ORACLE, assert_close, channels_last, streamed_lines, unstreamed

stream = importlib.import_module("numbanorm.cpu._kernels.memory")
ln_cpu = importlib.import_module("numbanorm.cpu._kernels.layer_norm")
rms_cpu = importlib.import_module("numbanorm.cpu._kernels.rms_norm")
add_cpu = importlib.import_module("numbanorm.cpu._kernels.add_norm")
common = importlib.import_module("numbanorm.cpu._kernels.common")
gn_cpu = importlib.import_module("numbanorm.cpu._kernels.group_norm")
spans = importlib.import_module("numbanorm.cpu._kernels.spans")
background = importlib.import_module("numbanorm.cpu._kernels.background")
stats = importlib.import_module("numbanorm.cpu._kernels.stats")

SHAPES = [(1, 1), (1, 1023), (3, 5, 33), (5, 4099), (64, 768), (70, 7)]


def _line_offset_view(length, dtype, offset):
    """A zeroed (length,) array ``offset`` bytes past a 64-byte line, and its buffer."""
    item = np.dtype(dtype).itemsize
    raw = np.zeros(length * item + 192, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    return raw[start : start + length * item].view(dtype), raw, start


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("dtype,offset", [(dt, off) for dt in (np.float32, np.float64)
                                          for off in range(0, 64, np.dtype(dt).itemsize)])
def test_stream_row_copies_every_element(length, dtype, offset):
    """Every alignment of the destination: unaligned head, streamed middle, tail."""
    dst, raw, at = _line_offset_view(length, dtype, offset)
    src = np.arange(1, length + 1, dtype=dtype)
    stream.stream_row(dst[None], 0, src[None], 0)
    np.testing.assert_array_equal(dst, src)
    assert not raw[:at].any() and not raw[at + dst.nbytes :].any(), "wrote outside dst"


def test_stream_row_unaligned_items():
    """A float32 row at an odd address (NumPy allows it) takes ordinary stores."""
    raw = np.zeros(4 * 50 + 1, np.uint8)
    dst = raw[1:].view(np.float32)
    src = np.linspace(-1, 1, 50, dtype=np.float32)
    stream.stream_row(dst[None], 0, src[None], 0)
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 33, 100, 611])
@pytest.mark.parametrize("dtype,offset", [(dt, off) for dt in (np.uint16, np.float32, np.float64)
                                          for off in range(0, 64, np.dtype(dt).itemsize)])
def test_stream_span_is_every_whole_aligned_line(length, dtype, offset):
    """The span a row writer stores with put_streaming: it starts on a line and holds
    whole lines (the vector streaming stores claim that alignment), and leaves
    less than a line on either side to ordinary stores."""
    dst, _, _ = _line_offset_view(length, dtype, offset)
    lo, hi = stream.stream_span(dst[None], 0)
    item = dst.itemsize
    assert 0 <= lo <= hi <= length
    assert (dst.ctypes.data + lo * item) % 64 == 0 or lo == hi == length
    assert (hi - lo) * item % 64 == 0
    assert lo * item < 64 or lo == length
    assert (length - hi) * item < 64
    # and exactly that span (an empty one, (length, length), met every condition above)
    first = min(length, (-dst.ctypes.data % 64) // item)
    assert (lo, hi) == (first, first + (length - first) * item // 64 * (64 // item))


def test_stream_span_of_an_unaligned_row_is_empty():
    """A float32 row at an odd address takes ordinary stores only."""
    dst = np.zeros(4 * 50 + 1, np.uint8)[1:].view(np.float32)
    assert stream.stream_span(dst[None], 0) == (50, 50)


def _affine(rng, n, dtype, kind):
    w = rng.uniform(0.5, 1.5, n).astype(dtype) if kind != "none" else None
    b = rng.standard_normal(n).astype(dtype) if kind == "both" else None
    return w, b


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", first_then_exhaustive([np.float32, np.float64]))
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_streamed_out_equals_allocating_call(stream_everything, rng, shape, dtype, affine):
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    n = shape[-1]
    w, b = _affine(rng, n, dtype, affine)
    out = np.full_like(x, np.nan)
    nn.layer_norm(x, n, w, b, out=out)
    want = unstreamed(nn.layer_norm, x, n, w, b)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(nn.layer_norm(x, n, w, b), want)  # a fresh output, streamed
    assert_close(out, ORACLE.layer_norm(x, n, w, b), dtype)
    out[...] = np.nan
    nn.rms_norm(x, n, w, out=out)
    want = unstreamed(nn.rms_norm, x, n, w)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(nn.rms_norm(x, n, w), want)
    assert_close(out, ORACLE.rms_norm(x, n, w), dtype)


@pytest.mark.parametrize("offset", first_then_exhaustive([4, 8, 12, 16, 20, 28], keep=2))
def test_streamed_out_at_every_alignment(stream_everything, rng, offset):
    """``out`` rows starting anywhere within a cache line (its rows of 611 floats start
    12 bytes apart: each offset puts the nine rows at nine places in a line)."""
    x = rng.standard_normal((9, 611)).astype(np.float32)
    raw = np.zeros(x.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start : start + x.nbytes].view(np.float32).reshape(x.shape)
    assert streamed_lines(out) > 0 and streamed_lines(out.reshape(9, 13, 47)) > 0
    nn.layer_norm(x, 611, out=out)
    np.testing.assert_array_equal(out, unstreamed(nn.layer_norm, x, 611))
    nn.rms_norm(x, 611, out=out)
    np.testing.assert_array_equal(out, unstreamed(nn.rms_norm, x, 611))
    xg = x.reshape(9, 13, 47)
    nn.group_norm(xg, 13, out=out.reshape(xg.shape))
    np.testing.assert_array_equal(out, unstreamed(nn.group_norm, xg, 13).reshape(x.shape))
    assert not raw[:start].any() and not raw[start + x.nbytes :].any()


@pytest.mark.parametrize("offset", [0, 4, 36, 1, 3])
def test_grouped_streamed_out_at_every_alignment(stream_everything, rng, offset):
    """Streamed rows written in groups span by span (spans.grouping: float32 rows of x,
    weight and bias over any L1 up to 64 KiB) with ``out`` rows starting anywhere within a
    cache line: each span streams only its own whole lines (memory.span_lines), and every
    bit is that of ordinary stores (a streaming store from a span's first element, where
    that is not line-aligned, faults).  Rows off their item size (offsets 1 and 3) stream
    nothing: their spans' lines were once taken to run to the row's end, and faulted."""
    n = 2 * spans.SPAN + 1411  # rows 5507 floats apart: 12 bytes on within a line each row
    assert spans.grouping.py_func(n, 8, 4, True, False)[0] > 1
    x = rng.standard_normal((9, n)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    raw = np.zeros(x.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start : start + x.nbytes].view(np.float32).reshape(x.shape)
    assert (streamed_lines(out) > 0) == (offset % 4 == 0)  # (rows off their item size stream nothing)
    nn.layer_norm(x, n, w, b, out=out)
    np.testing.assert_array_equal(out, unstreamed(nn.layer_norm, x, n, w, b))
    assert not raw[:start].any() and not raw[start + x.nbytes :].any()


@pytest.mark.parametrize("dtype", first_then_exhaustive(["float32", "float16", "bfloat16", "float64"]))
@pytest.mark.parametrize("shape, groups", [((3, 4, 33), 2), ((2, 6, 5, 7), 3), ((1, 2, 611), 1),
                                           ((2, 8, 1537), 8)], ids=str)
@pytest.mark.slow
@pytest.mark.parametrize("affine", ["none", "both"])
def test_streamed_group_norm_equals_ordinary_stores(stream_everything, rng, dtype, shape, groups, affine):
    """GroupNorm streams its channel rows as LayerNorm its rows: a fresh output and an out=
    streamed give the bits of ordinary stores; in place (out=x) it takes ordinary stores,
    and gives the same bits too."""
    from numbanorm.measure import host_dtype
    dt = host_dtype(dtype)
    x = (rng.standard_normal(shape) * 3 + 1).astype(dt)
    w, b = _affine(rng, shape[1], dt, affine)
    want = unstreamed(nn.group_norm, x, groups, w, b)
    bits = want.view(np.uint8)
    np.testing.assert_array_equal(nn.group_norm(x, groups, w, b).view(np.uint8), bits)
    out = np.full_like(x, np.nan)
    assert nn.group_norm(x, groups, w, b, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint8), bits)
    xc = x.copy()
    nn.group_norm(xc, groups, w, b, out=xc)
    np.testing.assert_array_equal(xc.view(np.uint8), bits)
    if dtype != "bfloat16":  # (its oracle comparisons, with their own tolerance: test_half)
        wide = [None if a is None else a.astype(np.float64) for a in (x, w, b)]
        assert_close(want, ORACLE.group_norm(wide[0], groups, *wide[1:]), dt)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", first_then_exhaustive(["float32", "float16", "bfloat16", "float64"]))
@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 33), (5, 611), (4, 1537)], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["ones", "weight"])
def test_streamed_backward_equals_ordinary_stores(stream_everything, monkeypatch, rng, dtype, shape, weighted):
    """A large dx is written as a large y: its rows' whole lines with streaming stores,
    by the same span function as the rest, so the bits are those of ordinary stores, for
    LayerNorm and RMSNorm and their fused residual forms (dx + ds), first call and replay."""
    from numbanorm.measure import host_dtype
    flags = []
    for module in (ln_cpu, rms_cpu):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda k, size, *a, real=real, module=module: (
            flags.append(a[-1]) if k is module._backward else None) or real(k, size, *a))
    dt = host_dtype(dtype)
    n = shape[-1]
    x, dy, ds = ((rng.standard_normal(shape) * 3 + 1).astype(dt) for _ in range(3))
    w = rng.uniform(0.5, 1.5, n).astype(dt) if weighted else None
    _, mean, rstd = nn.layer_norm_forward(x, n, w)
    _, rstd_rms = nn.rms_norm_forward(x, n, w)
    calls = [(nn.layer_norm_backward, (dy, x, mean, rstd, n, w)),
             (nn.rms_norm_backward, (dy, x, rstd_rms, n, w)),
             (nn.add_layer_norm_backward, (dy, ds, x, mean, rstd, n, w)),
             (nn.add_rms_norm_backward, (dy, ds, x, rstd_rms, n, w))]
    for f, args in calls:
        want = unstreamed(f, *args)
        flags.clear()
        for _ in range(2):  # the full path, then the replay of a call seen before
            for got, exp in zip(f(*args), want):
                np.testing.assert_array_equal(got.view(np.uint8), exp.view(np.uint8), err_msg=f.__name__)
        assert flags == [True, True], (f.__name__, flags)  # both streamed


@pytest.mark.slow
@pytest.mark.parametrize("dtype", first_then_exhaustive(["float32", "float16", "bfloat16", "float64"]))
@pytest.mark.parametrize("shape, groups", [((3, 4, 33), 2), ((2, 6, 5, 7), 6), ((2, 8, 1537), 4)], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["ones", "weight"])
def test_streamed_group_norm_backward_equals_ordinary_stores(stream_everything, monkeypatch, rng, dtype, shape,
                                                            groups, weighted):
    """GroupNorm's dx streams its channel rows as its forward's y: the bits of ordinary
    stores, dx and the parameter gradients alike."""
    from numbanorm.measure import host_dtype
    flags = []
    real = gn_cpu.launch
    monkeypatch.setattr(gn_cpu, "launch", lambda k, size, *a: (
        flags.append(a[-1]) if k is gn_cpu._backward else None) or real(k, size, *a))
    dt = host_dtype(dtype)
    x, dy = ((rng.standard_normal(shape) * 3 + 1).astype(dt) for _ in range(2))
    w = rng.uniform(0.5, 1.5, shape[1]).astype(dt) if weighted else None
    _, mean, rstd = nn.group_norm_forward(x, groups, w)
    want = unstreamed(nn.group_norm_backward, dy, x, mean, rstd, w)
    flags.clear()
    for got, exp in zip(nn.group_norm_backward(dy, x, mean, rstd, w), want):
        np.testing.assert_array_equal(got.view(np.uint8), exp.view(np.uint8))
    assert flags == [True]


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction names")
@pytest.mark.parametrize("module", [ln_cpu, rms_cpu, gn_cpu], ids=["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int16], ids=["float32", "float16", "bfloat16"])
def test_a_streamed_backward_compiles_to_non_temporal_vector_stores(module, dtype):
    """The backward's streamed dx span vectorizes with its non-temporal mark, as the
    forward's (test_a_streamed_forward_compiles_to_non_temporal_vector_stores)."""
    import re
    from numba import njit

    f = np.float32(0.5)
    if module is ln_cpu:
        def span(dy, x, w, dx, dwp, lo, hi):
            ln_cpu.backward_span(dy, x, 0, f, f, f, w, None, f, f, f, f, dx, dwp, dwp, lo, hi, True)
    elif module is rms_cpu:
        def span(dy, x, w, dx, dwp, lo, hi):
            rms_cpu.backward_span(dy, x, 0, f, w, None, f, f, f, dx, dwp, lo, hi, True)
    else:
        def span(dy, x, w, dx, dwp, lo, hi):
            gn_cpu.dx_span(dy, x, 0, f, f, f, f, f, f, f, f, dx, lo, hi, True)
    span = njit(inline="always")(span)

    def write(dy, x, w, dx, dwp):
        common.wide_vectors(dy)  # as backward_rows
        lo, hi = stream.stream_span(dx, 0)
        span(dy, x, w, dx, dwp, lo, hi)
    rows = module.dx_channels if module is gn_cpu else module.backward_rows
    options = {k: v for k, v in rows.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = njit(**options)(write)  # not cached: inspectable
    x = np.zeros((1, 256), dtype)
    fresh(x, x, np.ones(256, np.float32), np.empty_like(x), np.zeros(256, np.float32))
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert re.search(r"\bv?movnt(?:dq|ps|pd)\s", asm), "no non-temporal vector store"


@pytest.mark.parametrize("dtype", first_then_exhaustive(["float32", "float16", "bfloat16", "float64"]))
@pytest.mark.parametrize("shape, groups", [((2, 32, 9, 7), 4), ((3, 40, 3, 11), 8), ((2, 6, 5, 5), 3),
                                           ((1, 64, 4, 2, 3), 16)], ids=str)
@pytest.mark.parametrize("offset", first_then_exhaustive([0, 4, 2, 36], keep=2))
def test_streamed_channels_last_group_norm_equals_ordinary_stores(stream_everything, monkeypatch, rng, dtype,
                                                                  shape, groups, offset):
    """An x too large for the cache, in channels-last order: its sums read each step's four
    rows one after another (last_sums' STREAMING variant) and y streams each position's whole lines
    (last_write), with the bits (y, mean, rstd) of the in-cache path, into a fresh y and an
    out= starting anywhere in a line (rows of 40 channels start at several places in a
    line, rows of 6 hold no whole line, offsets off the item size stream nothing), and in
    place (its sums' rows read one after another, y written by ordinary stores)."""
    from numbanorm.measure import host_dtype
    flags = []
    real = gn_cpu.launch
    monkeypatch.setattr(gn_cpu, "launch", lambda k, size, *a: (
        flags.append((k.rows.py_func.__name__, a[-2])) if k in (gn_cpu._last_sums, gn_cpu._last_write)
        else None) or real(k, size, *a))
    bits = lambda a: np.ascontiguousarray(a).view(np.uint8)  # noqa: E731
    dt = host_dtype(dtype)
    x = channels_last((rng.standard_normal(shape) * 3 + 1).astype(dt))
    w, b = _affine(rng, shape[1], dt, "both")
    want = unstreamed(nn.group_norm_forward, x, groups, w, b)
    flags.clear()
    got = nn.group_norm_forward(x, groups, w, b)
    assert flags == [("last_sums", True), ("last_write", True)]
    for g, e in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(e))
    raw = np.zeros(x.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = np.moveaxis(raw[start : start + x.nbytes].view(dt).reshape(shape[0], *shape[2:], shape[1]), -1, 1)
    assert nn.group_norm(x, groups, w, b, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(want[0]))
    assert not raw[:start].any() and not raw[start + x.nbytes :].any()
    xc = x.copy(order="K")
    flags.clear()
    nn.group_norm(xc, groups, w, b, out=xc)
    assert flags == [("last_sums", True), ("last_write", False)]
    np.testing.assert_array_equal(bits(xc), bits(want[0]))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction names")
@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int16], ids=["float32", "float16", "bfloat16"])
def test_a_streamed_channels_last_position_compiles_to_non_temporal_vector_stores(dtype):
    """last_write's streamed position (last_span) keeps put_streaming's mark in its vector
    stores, as the rows' writers (test_a_streamed_forward_compiles_to_non_temporal_vector_stores)."""
    import re
    from numba import njit

    def write(x, k, y):
        common.wide_vectors(x)  # as last_write
        lo, hi = stream.stream_span(y, 0)
        gn_cpu.last_span(x, 0, 0, k, k, k, k, y, 0, lo, hi, True)
    options = {k: v for k, v in gn_cpu.last_write.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = njit(**options)(write)  # not cached: inspectable
    x = np.zeros((1, 1, 256), dtype)
    fresh(x, np.ones(256, np.float32), np.empty((1, 256), dtype))
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert re.search(r"\bv?movnt(?:dq|ps|pd)\s", asm), "no non-temporal vector store"


def _dtypes():
    out = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)]
    try:
        import ml_dtypes
    except ImportError:
        return out
    return out + [np.dtype(ml_dtypes.bfloat16)]


DTYPES = _dtypes()
# every row length to 128 (each vector width's and unroll's remainders), then a
# spread to 600 (on main, 123 pairs of these differed for float32 LayerNorm alone),
# then long rows: across SUM_BLOCK, one that a call of its own runs serially (20000)
# and one that runs in parallel even alone (40000)
# every remainder of the vector loops (1..64), then a sparse sweep and the block edges
ROW_LENGTHS = (list(range(1, 65)) + list(range(67, 601, 17))
               + [1023, 4095, 4096, 4097, 8193, 20000, 40000])
FAMILIES = ["layer_norm", "rms_norm", "group_norm", "add_layer_norm", "add_rms_norm"]


def _family_rows(family, rng, n, dtype):
    """For rows of length ``n``: ``call(lo, hi)``, every output of forward and
    backward that belongs to the rows (samples) lo..hi of one call of them alone."""
    # enough rows that the whole call takes Numba's threads (common.SERIAL_BELOW)
    m = max(3, -(-common.SERIAL_BELOW // n) + 1)
    if family == "group_norm":
        shape = (m, 4, n)  # 2 groups of 2 channels: a group is 2n contiguous elements
        p = 4
    else:
        shape = (m, n)
        p = n
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    r = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, p).astype(dtype)
    b = rng.standard_normal(p).astype(dtype)

    def call(lo, hi):
        xs, rs, dys = x[lo:hi], r[lo:hi], dy[lo:hi]
        if family == "layer_norm":
            y, mean, rstd = nn.layer_norm_forward(xs, n, w, b)
            return [y, mean, rstd, nn.layer_norm_backward(dys, xs, mean, rstd, n, w)[0]]
        if family == "rms_norm":
            y, rstd = nn.rms_norm_forward(xs, n, w)
            return [y, rstd, nn.rms_norm_backward(dys, xs, rstd, n, w)[0]]
        if family == "group_norm":
            y, mean, rstd = nn.group_norm_forward(xs, 2, w, b)
            return [y, mean, rstd, nn.group_norm_backward(dys, xs, mean, rstd, w)[0]]
        if family == "add_layer_norm":
            y, s, mean, rstd = nn.add_layer_norm_forward(xs, rs, n, w, b)
            return [y, s, mean, rstd, nn.add_layer_norm_backward(dys, dys, s, mean, rstd, n, w)[0]]
        y, s, rstd = nn.add_rms_norm_forward(xs, rs, n, w)
        return [y, s, rstd, nn.add_rms_norm_backward(dys, dys, s, rstd, n, w)[0]]

    return m, call


@pytest.mark.parallel_kernels
@pytest.mark.slow
@pytest.mark.parametrize("dtype", first_then_exhaustive(DTYPES), ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_does_not_depend_on_the_call(rng, family, dtype):
    """A row's outputs are the same bits whether it is computed in a call of its own
    (the serial kernel, on the calling thread) or among many rows (the parallel
    kernel, on Numba's threads, in some row block): contract, determinism."""
    differ = []
    for n in ROW_LENGTHS:
        m, call = _family_rows(family, rng, n, dtype)
        with background.synchronous():  # (the parallel kernels, compiled by the call)
            whole = call(0, m)
        for i in (0, m - 1):
            alone = call(i, i + 1)
            for k, (a, b) in enumerate(zip(alone, whole)):
                if a.view(np.uint8).tobytes() != b[i : i + 1].view(np.uint8).tobytes():
                    differ.append((n, i, k))
    assert not differ, f"{len(differ)} (row length, row, output) differ, e.g. {differ[:10]}"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_in_place_equals_out_of_place(rng, dtype):
    x = rng.standard_normal((40, 257)).astype(dtype)
    w = rng.uniform(0.5, 1.5, 257).astype(dtype)
    for fn, args in ((nn.layer_norm, (257, w, w)), (nn.rms_norm, (257, w))):
        want = fn(x, *args)
        y = x.copy()
        assert fn(y, *args, out=y) is y
        np.testing.assert_array_equal(y, want)
    x4 = x.reshape(40, 1, 257)[:, :, :256].reshape(40, 16, 16).copy()
    want = nn.group_norm(x4, 4)
    nn.group_norm(x4, 4, out=x4)
    np.testing.assert_array_equal(x4, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_out_overlapping_x_by_a_row_gives_the_out_of_place_result(rng, dtype):
    """``out`` one row past ``x`` in the same buffer: a kernel writing row i
    straight into it would overwrite row i + 1 of x before reading it."""
    buf = rng.standard_normal((41, 257)).astype(dtype)
    x, out = buf[:40], buf[1:]
    w = rng.uniform(0.5, 1.5, 257).astype(dtype)
    for fn, args in ((nn.layer_norm, (257, w, w)), (nn.rms_norm, (257, w))):
        x0 = buf[:40].copy()
        want = fn(x0, *args)
        assert fn(x, *args, out=out) is out
        np.testing.assert_array_equal(out, want)
        buf[:40] = x0
    b4 = rng.standard_normal((5, 16, 16)).astype(dtype)
    x4, out4 = b4[:4], b4[1:]
    want = nn.group_norm(x4.copy(), 4)
    nn.group_norm(x4, 4, out=out4)
    np.testing.assert_array_equal(out4, want)


def _fake_sysfs(folder, entries):
    """A Linux ``cpu0/cache`` folder: ``entries`` maps index names to their files, and a
    ``uevent`` file sits beside them as in the real one."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "uevent").write_text("")
    for name, files in entries.items():
        (folder / name).mkdir()
        for field, text in files.items():
            (folder / name / field).write_text(text + "\n")
    return str(folder)


XEON_VM = {"index0": {"level": "1", "type": "Data", "size": "48K", "shared_cpu_list": "0"},
           "index1": {"level": "1", "type": "Instruction", "size": "32K", "shared_cpu_list": "0"},
           "index2": {"level": "2", "type": "Unified", "size": "2048K", "shared_cpu_list": "0"},
           "index3": {"level": "3", "type": "Unified", "size": "307200K", "shared_cpu_list": "0-1"}}


def test_the_last_level_cache_is_read_past_files_that_are_not_caches(tmp_path, monkeypatch):
    """The folder holds a ``uevent`` file beside the ``index*`` ones: reading a size under
    it raised, and the one handler around the whole loop gave up there, so the cache read
    was 32 MiB (the default) where listdir named ``uevent`` first -- the Xeon VM's 300 MiB
    L3 read as 32 MiB."""
    folder = _fake_sysfs(tmp_path, XEON_VM)
    real = stream.os.listdir
    monkeypatch.setattr(stream.os, "listdir", lambda p: sorted(real(p), key=lambda n: n != "uevent"))
    assert stream.last_level_cache(folder) == (300 << 20, {0, 1})


def test_a_cache_entry_that_cannot_be_read_is_skipped_alone(tmp_path):
    entries = dict(XEON_VM, index4={"level": "4", "type": "Unified"})  # no size
    entries["index2"] = {"level": "2", "type": "Unified", "size": "1M"}  # no shared_cpu_list
    assert stream.last_level_cache(_fake_sysfs(tmp_path, entries)) == (300 << 20, {0, 1})
    del entries["index3"], entries["index4"]
    assert stream.last_level_cache(_fake_sysfs(tmp_path / "l2", entries)) == (1 << 20, None)
    assert stream.last_level_cache(str(tmp_path / "missing")) == stream._DEFAULT_CACHE


def test_the_first_level_data_cache_is_read_past_the_instruction_cache(tmp_path):
    """memory.first_level_cache (spans.grouping's bound for streamed rows): level 1's data
    cache, not its instruction cache beside it; the default where none can be read."""
    assert stream.first_level_cache(_fake_sysfs(tmp_path, XEON_VM)) == 48 << 10
    zen4 = dict(XEON_VM, index0={"level": "1", "type": "Data", "size": "32K", "shared_cpu_list": "0"},
                index1={"level": "1", "type": "Instruction", "size": "64K", "shared_cpu_list": "0"})
    assert stream.first_level_cache(_fake_sysfs(tmp_path / "zen4", zen4)) == 32 << 10
    assert stream.first_level_cache(str(tmp_path / "missing")) == stream._DEFAULT_L1


def test_cpu_lists_are_parsed_as_linux_writes_them():
    assert stream.cpu_list("0-1") == {0, 1}
    assert stream.cpu_list("0,4-6,9\n") == {0, 4, 5, 6, 9}
    assert stream.cpu_list("") == set()


@pytest.mark.parametrize("cache, cpus, share", [
    (300 << 20, 2, 16 << 20),   # the Xeon VM: the host's whole L3 shown to 2 vCPUs
    (32 << 20, 2, 16 << 20),    # the EPYC VM: a Zen 3 CCX's L3 to 2 vCPUs
    (32 << 20, 16, 32 << 20),   # the whole CCX on bare metal: all of it
    (300 << 20, 128, 300 << 20),
    (1 << 20, 0, 1 << 20),      # no CPU counted: one
])
def test_the_cache_counted_on_is_the_whole_cache_or_a_share_per_cpu(cache, cpus, share):
    assert stream.cache_share(cache, cpus, per_cpu=8 << 20) == share


@pytest.mark.machine_streaming
def test_the_threshold_is_a_fraction_of_the_cache_counted_on_in_whole_lines():
    from fractions import Fraction

    assert stream.stream_min_bytes(16 << 20, Fraction(1)) == 16 << 20
    assert stream.stream_min_bytes(16 << 20, Fraction(1, 4)) == 4 << 20
    assert stream.stream_min_bytes(1000, Fraction(1, 3)) == 320  # 333 down to whole 64-byte lines
    # the module's own, from this machine's cache and CPUs
    assert stream.CACHE_BYTES == stream.cache_share(stream.LAST_LEVEL_CACHE, stream.CACHE_CPUS)
    assert stream.STREAM_MIN_BYTES == stream.stream_min_bytes(stream.CACHE_BYTES, stream.STREAM_FRACTION)
    assert not stream.should_stream(SimpleNamespace(nbytes=stream.STREAM_MIN_BYTES - 1))
    assert stream.should_stream(SimpleNamespace(nbytes=stream.STREAM_MIN_BYTES))


def test_each_cpus_streaming_fraction_is_where_its_sweep_found_the_write_and_read_no_slower_streamed():
    """memory.STREAM_FRACTIONS holds, for each CPU a committed sweep
    (benchmarks/results/stream-sweep-<kind>.json) measured, the fraction of the cache from
    which a forward and a read of its y were no slower streamed, capped at the whole cache
    (where no size was, as on a CPU whose sweep found streaming and ordinary stores within
    noise of each other from the cache up, the whole cache too); a CPU without a sweep
    streams from the whole cache; the module's own is its host's."""
    import json
    from fractions import Fraction
    from pathlib import Path

    sweeps = sorted((Path(__file__).parent.parent / "benchmarks" / "results").glob("stream-sweep-*.json"))
    swept = set()
    for path in sweeps:
        run = json.loads(path.read_text())
        cpu = run["meta"]["machine"]["cpu_target"]["llvm_cpu"]
        at = run["crossover_then_read_of_cache"]
        found = Fraction(1) if at is None else min(Fraction(1), Fraction(at).limit_denominator(64))
        assert stream.stream_fraction(cpu) == found, path.name
        swept.add(cpu)
    assert swept and set(stream.STREAM_FRACTIONS) <= swept
    assert stream.stream_fraction("a cpu no sweep measured") == 1
    from llvmlite import binding

    assert stream.STREAM_FRACTION == stream.stream_fraction(binding.get_host_cpu_name())


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("out", [False, True], ids=["fresh", "out"])
def test_a_large_output_is_streamed_fresh_or_given(name, out, stream_everything, monkeypatch):
    """Streaming stores into a fresh output took 0.83-0.97x the time of ordinary ones
    (``streaming-xeon.json``); the first call (the full path) and a repeat (its replay,
    ``Plans``) both stream, with ``out=`` or without."""
    from numbanorm.cpu import _backend
    module = ln_cpu if name == "layer_norm" else rms_cpu
    flags = []
    real = module.launch
    monkeypatch.setattr(module, "launch", lambda k, size, *a: flags.append(a[-1]) or real(k, size, *a))
    _backend.plans._plans.clear()
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 96, dtype=np.float32)
    for _ in range(2):
        y = getattr(nn, name)(x, (96,), w, **({"out": np.empty_like(x)} if out else {}))
        assert_close(y, getattr(ORACLE, name)(x, (96,), w), np.float32)
    assert flags == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "plain"])  # (common.STREAMING)
@pytest.mark.parametrize("module", [ln_cpu, rms_cpu, gn_cpu], ids=["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("dtype", first_then_exhaustive([np.float32, np.uint16, np.int16]))  # int16: bfloat16 bits
def test_a_streamed_forward_updates_no_reference_count_per_row(module, dtype, streaming):
    """Each NRT incref is an atomic, and an atomic drains the write-combining buffers of
    the streaming stores: with the row writer inlined once per branch, Numba increfed
    x, w, b and the destination for every row, and LayerNorm forward out= at
    (65536, 768) took 1.3x its time without (book, chapter 5).  Every array may be
    increfed once per call of the row function, none once per row.  GroupNorm's channel
    writer failed this inlined in the loop over groups (xc and yc increfed per channel).
    The row functions without the streaming stores, which most calls run, the same:
    an atomic per row on x's count, which every thread updates."""
    import re
    from numba import njit

    # GroupNorm's streaming stores are in its channel writer, called once a group
    rows = module.write_channels if module is gn_cpu else module.forward_rows
    # the variant (common.STREAMING), not cached: inspectable
    options = {k: v for k, v in rows.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = njit(**options)(common.with_flags(rows, STREAMING=streaming))
    M, N = 4, 64
    if module is gn_cpu:  # 4 channel rows of 16; the group's mean 0, rstd 1
        x, w, f = np.zeros((M, 16), dtype), np.ones(M, np.float32), np.float32(0)
        fresh(x, np.empty_like(x), 0, M, 0, f, f, f + 1, w, w, f, True, x.reshape(1, -1), 0, 1)
    else:
        x = np.zeros((M, N), dtype)
        w = np.ones(N, np.float32)
        st = np.zeros(M, np.float32)
        args = (x, w, w) if module is ln_cpu else (x, w)
        stats = (st, st.copy()) if module is ln_cpu else (st,)
        fresh(*args, np.float32(1e-5), np.empty_like(x), *stats, True, 0, M)
    llvm = fresh.inspect_llvm(fresh.signatures[0])
    body = llvm[llvm.index("define"):]
    body = body[: body.index("\ndefine", 1)]
    increfs = re.findall(r"call void @NRT_incref\(ptr (?:nonnull )?(%[^)]+)\)", body)
    # (the group's writer has none, nor, it may be, a plain row function)
    assert increfs or module is gn_cpu or not streaming, "the pattern matched no incref"
    assert all(increfs.count(v) == 1 for v in increfs), sorted(increfs)
    # streamed, a row (a group) asks for the next as it is written (memory.ask_ahead)
    assert ("call void @llvm.prefetch" in body) == streaming, "the streamed writer asks for none of the next row"


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "plain"])
@pytest.mark.parametrize("module", [ln_cpu, rms_cpu, gn_cpu], ids=["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("dtype", first_then_exhaustive([np.float32, np.uint16]))
def test_a_streamed_backward_updates_no_reference_count_per_row(module, dtype, streaming):
    """As the forward's (above): with its three dx spans inlined in one branch and its
    plain span in the other, Numba increfed dy, x, w, dx and the partials every row.
    (dy and x are increfed again on the path of a row whose sums overflowed, rare.)
    GroupNorm's dx writer, called once a group, increfs no array at all.

    Its streamed span asks for the next row as the forward's does (memory.ask_ahead):
    without, float16 LayerNorm backward at (16384, 4096) into dx took 1.2x as long."""
    import re
    from numba import njit

    M, N = 4, 64
    x, w, st = np.zeros((M, N), dtype), np.ones(N, np.float32), np.ones(M, np.float32)
    f = np.float32(0.5)
    if module is gn_cpu:  # 4 channel rows of 64
        fresh = njit(nogil=True)(common.with_flags(module.dx_channels, STREAMING=streaming))  # not cached: inspectable
        fresh(x, x, 0, M, 0, f, f, f, w, f, f, f, np.empty_like(x), True)
    else:
        fresh = njit(nogil=True)(common.with_flags(module.backward_rows, STREAMING=streaming))
        part = np.zeros((1, N), np.float32)
        stats = (st, st.copy()) if module is ln_cpu else (st,)
        parts = (part, part.copy()) if module is ln_cpu else (part,)
        fresh(x, x, *stats, w, None, np.empty_like(x), *parts, True, 0, 1)  # one block of M rows
    llvm = fresh.inspect_llvm(fresh.signatures[0])
    body = llvm[llvm.index("define"):]
    body = body[: body.index("\ndefine", 1)]
    increfs = re.findall(r"call void @NRT_incref\(ptr (?:nonnull )?(%[^)]+)\)", body)
    # GroupNorm's asks for no next group (group_norm.dx_channels says why)
    assert ("call void @llvm.prefetch" in body) == (streaming and module is not gn_cpu), "next row asked or not"
    if module is gn_cpu:
        assert not increfs, sorted(increfs)
        return
    assert "%arg.dx.0" in increfs, "the pattern matched no incref of dx"
    once = [v for v in increfs if v not in ("%arg.dy.0", "%arg.x.0")]
    assert all(once.count(v) == 1 for v in once), sorted(increfs)
    assert increfs.count("%arg.dy.0") <= 2 and increfs.count("%arg.x.0") <= 2, sorted(increfs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_the_sums_compiled_on_their_own_update_no_reference_count(dtype):
    """The reductions a row function calls rather than inlines (stats.row_stats says why)
    run once a row: an incref of x there is an atomic a row, on a count every thread
    updates.  row_stats written as a while loop around its sums left two."""
    import re
    from numba import njit

    x, w, z = np.ones((4, 64), dtype), np.ones(64, np.float32), np.float32(0)
    for fn, args in ((stats.row_stats, (x, 0, z)), (stats.row_sum_squares, (x, 0, z)),
                     (ln_cpu.backward_sums, (x, x, 0, z, z, w, z)), (rms_cpu.backward_sum, (x, x, 0, z, w, z)),
                     (gn_cpu.channel_sums, (x, x, 0, z, z, z, 0.0))):
        options = {k: v for k, v in fn.targetoptions.items() if k not in ("cache", "nopython")}
        fresh = njit(**options)(fn.py_func)  # not cached: inspectable
        fresh(*args)
        llvm = fresh.inspect_llvm(fresh.signatures[0])
        body = llvm[llvm.index("define"):]
        body = body[: body.index("\ndefine", 1)]
        assert "NRT_incref" not in body, fn.py_func.__qualname__


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction names")
@pytest.mark.parametrize("module", [ln_cpu, rms_cpu, gn_cpu], ids=["layer_norm", "rms_norm", "group_norm"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int16], ids=["float32", "float16", "bfloat16"])
def test_a_streamed_forward_compiles_to_non_temporal_vector_stores(module, dtype):
    """put_streaming's mark survives to the machine code of a streamed row writer
    for every dtype (the integer views are 16-bit floats: halves).  A narrowing that
    ends in a plain truncation is folded by LLVM with the store into a truncating
    store (vpmovdw), which has no non-temporal form: the bfloat16 narrowing, which
    truncates once after its NaN select, streamed its rows with ordinary stores, each
    line read for ownership first, and every other test passed.  Where AVX512-FP16
    makes vectors of half legal, a float16 span whose streamed stores were of LLVM's
    half was not vectorized at all (vmovsh, element by element).  put_streaming's
    opaque OR keeps both integers (this test failed without it, for each)."""
    import re
    from numba import njit

    # forward_rows's streamed chunk alone (its staged rows are copied out by stream_row)
    if module is ln_cpu:
        def span(x, w, out, o, lo, hi, nt):
            spans.normalize_span(x, 0, np.float32(0), np.float32(0), np.float32(1), w, w, out, o, lo, hi, nt)
    elif module is rms_cpu:
        def span(x, w, out, o, lo, hi, nt):
            spans.scale_span(x, 0, np.float32(1), w, out, o, lo, hi, nt)
    else:
        def span(x, w, out, o, lo, hi, nt):
            gn_cpu.scale_shift_span(x, 0, np.float32(0), np.float32(0), np.float32(1), np.float32(0),
                                    out, o, lo, hi, nt)
    span = njit(inline="always")(span)

    def write(x, w, y):
        common.wide_vectors(x)  # as every row function (512 bits wide where WIDE_VECTORS)
        lo, hi = stream.stream_span(y, 0)  # whole aligned lines, as put_streaming claims
        span(x, w, y, 0, lo, hi, True)
    rows = module.forward_groups if module is gn_cpu else module.forward_rows
    options = {k: v for k, v in rows.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = njit(**options)(write)  # not cached: inspectable
    x = np.zeros((1, 256), dtype)
    fresh(x, np.ones(256, np.float32), np.empty_like(x))
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert re.search(r"\bv?movnt(?:dq|ps|pd)\s", asm), "no non-temporal vector store"


def test_every_row_function_asks_for_wide_vectors():
    """Every function whose loops do a kernel's arithmetic calls common.wide_vectors:
    one that did not would be vectorized 256 bits wide where 512 pay (AVX512-FP16),
    and every result would still be right."""
    rows = {k.rows for mod in (ln_cpu, rms_cpu, gn_cpu, add_cpu) for k in vars(mod).values()
            if isinstance(k, common.Kernel)}
    assert len(rows) >= 8, rows  # LayerNorm and RMSNorm (and fused), GroupNorm, forward and backward
    # the group norm's per-channel loops, and the sums (compiled on their own: stats.row_stats)
    for f in rows | {gn_cpu.write_channels, gn_cpu.dx_channels, gn_cpu.channel_sums, stats.row_stats,
                     stats.row_sum_squares, ln_cpu.backward_sums, rms_cpu.backward_sum}:
        assert "wide_vectors" in f.py_func.__code__.co_names, f.py_func.__qualname__


@pytest.mark.parametrize("wide", [False, True])
def test_wide_vectors_set_the_vector_width_of_the_calling_function(monkeypatch, wide):
    """The attribute that makes LLVM vectorize 512 bits wide is on a row function where
    WIDE_VECTORS holds its input's element type (forced here, so that both ways run on
    any machine), and an AVX-512 machine then computes in 512-bit registers."""
    from numba import njit, types
    from llvmlite import binding

    monkeypatch.setattr(common, "WIDE_VECTORS", (types.uint16,) if wide else ())
    options = {k: v for k, v in ln_cpu.forward_rows.targetoptions.items() if k not in ("cache", "nopython")}
    fresh = njit(**options)(ln_cpu.forward_rows.py_func)  # not cached: compiled with the flag as set
    st = np.zeros(2, np.float32)
    for dtype in (np.uint16, np.float32):  # float16 bits, and an element type never listed
        x = np.ones((2, 256), dtype)
        fresh(x, None, None, np.float32(1e-5), np.empty_like(x), st, st.copy(), False, 0, 2)
    for sig, on in zip(fresh.signatures, (wide, False)):
        llvm = fresh.inspect_llvm(sig)
        define = next(line for line in llvm.splitlines() if line.startswith("define") and "forward_rows" in line)
        group = define.rsplit("#", 1)[-1].split()[0] if "#" in define else None
        listed = define + "".join(line for line in llvm.splitlines()
                                  if group and line.startswith(f"attributes #{group} "))
        assert ('"prefer-vector-width"="512"' in listed) == on, (sig, listed)
    if wide and "+avx512f" in binding.get_host_cpu_features().flatten().split(","):
        assert "zmm" in fresh.inspect_asm(fresh.signatures[0])


@pytest.mark.parametrize("features, name, wide", [
    ("+avx512f,+avx512bw,+avx512fp16", "sapphirerapids", True),
    # a VM that hides AVX512-FP16 on an Emerald Rapids host (the feature alone said 256 bits)
    ("+avx512f,+avx512bw,-avx512fp16,-avx512bf16", "emeraldrapids", True),
    ("+avx512f,+avx512bw,-avx512fp16", "icelake-server", False),  # before Sapphire Rapids: LLVM's width
    ("+avx2,+f16c", "emeraldrapids", False),  # AVX-512 hidden whole
    ("+avx512f,+avx512bw,+avx512fp16", "generic", True),
])
def test_sixteen_bit_rows_ask_for_512_bits_from_sapphire_rapids_on(monkeypatch, features, name, wide):
    from numbanorm.cpu._kernels import halves

    monkeypatch.setattr(halves, "NATIVE_HALF", True)  # F16C: the features listed say so
    assert halves.wide_halves(tuple(features.split(",")), name) is wide


_NO_AVX_CHILD = """
import json, sys
import ml_dtypes, numpy as np, numbanorm as nn
from numbanorm.cpu._kernels import halves
bf = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
x, dy = rng.standard_normal((2, 5, 40)).astype(bf)
w, b = rng.uniform(0.5, 1.5, (2, 40)).astype(bf)
y, m, r = nn.layer_norm_forward(x, 40, w, b)
dx = nn.layer_norm_backward(dy, x, m, r, 40, w)[0]
yr = nn.rms_norm(x, 40, w)
np.savez(sys.argv[1], *(a.view(np.int16) for a in (y, dx, yr)))
print(json.dumps([halves.BFLOAT16_BY_INSTRUCTION, halves.WIDE_HALVES]))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86's AVX")
def test_bfloat16_where_numba_compiles_without_avx(tmp_path):
    """With NUMBA_ENABLE_AVX=0 (or a CPU name for which Numba turns AVX off itself) Numba
    compiles without AVX: the 16-bit rows read the features Numba compiles with, so
    bfloat16 runs by integer code with this process's bits.  Before, on a host with
    AVX512-BF16, the vcvtneps2bf16 intrinsic met a target without it and LLVM aborted the
    process ("Do not know how to promote this operator!"), and info said AVX-512 yes."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, NUMBA_ENABLE_AVX="0", NUMBA_NUM_THREADS="1", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NUMBA_CPU_FEATURES", None), env.pop("NUMBA_CPU_NAME", None)
    out = tmp_path / "out.npz"
    done = subprocess.run([sys.executable, "-c", _NO_AVX_CHILD, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [False, False]
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 5, 40)).astype(bf)
    w, b = rng.uniform(0.5, 1.5, (2, 40)).astype(bf)
    y, m, r = nn.layer_norm_forward(x, 40, w, b)
    want = (y, nn.layer_norm_backward(dy, x, m, r, 40, w)[0], nn.rms_norm(x, 40, w))
    got = np.load(out)
    for i, a in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], a.view(np.int16))
    info = subprocess.run([sys.executable, "-m", "numbanorm", "info"], env=env, capture_output=True, text=True,
                          timeout=300)
    line = next(s for s in info.stdout.splitlines() if s.startswith("cpu target"))
    assert "AVX off" in line and "AVX-512 no" in line and "AVX2 no" in line and line.endswith("integer code")


def test_backward_dx_of_a_row_does_not_depend_on_the_others(rng):
    """A row's dx is the same bits alone or among others, wherever it falls in a block."""
    x = (rng.standard_normal((37, 129)) + 3).astype(np.float32)
    dy = rng.standard_normal((37, 129)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 129).astype(np.float32)
    _, m, r = nn.layer_norm_forward(x, 129, w)
    dx = nn.layer_norm_backward(dy, x, m, r, 129, w)[0]
    _, rr = nn.rms_norm_forward(x, 129, w)
    dxr = nn.rms_norm_backward(dy, x, rr, 129, w)[0]
    for i in (0, 1, 17, 36):
        one = slice(i, i + 1)
        np.testing.assert_array_equal(nn.layer_norm_backward(dy[one], x[one], m[one], r[one], 129, w)[0], dx[one])
        np.testing.assert_array_equal(nn.rms_norm_backward(dy[one], x[one], rr[one], 129, w)[0], dxr[one])


def _placed(buf, rows, n, gap):
    """``(x, out)`` views of ``buf``: out ``gap`` elements after x's end, or before x."""
    k = rows * n
    if gap < 0:
        return buf[64 - gap + k : 64 - gap + 2 * k].reshape(rows, n), buf[64 : 64 + k].reshape(rows, n)
    return buf[:k].reshape(rows, n), buf[k + gap : 2 * k + gap].reshape(rows, n)


@pytest.mark.parametrize("block", [1, 64])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n", [7, 33, 100, 300, 1023])
def test_results_do_not_depend_on_where_the_arrays_lie(monkeypatch, rng, n, rows, block):
    """Outputs right next to the inputs, on either side, give the same bits.

    LLVM guards a vectorized loop that stores with a run-time overlap check and
    falls back to its scalar copy; a reduction made in such a loop sums in
    another order there.  An earlier forward summed the next row in the loop
    that wrote the current one: with a (3, 7) output 0 to 17 elements past its
    input, the scalar copy ran, and for some inputs the bits changed.  Whether
    the two orders round apart depends on the values, hence several draws.
    """
    for mod in (ln_cpu, rms_cpu, add_cpu):
        monkeypatch.setattr(mod, "row_block", lambda rows: block)
    buf = np.empty(2 * rows * n + 256, np.float32)
    for _ in range(8 if rows * n < 100 else 1):
        x0 = (rng.standard_normal((rows, n)) * 2 + 0.5).astype(np.float32)
        dy0 = rng.standard_normal((rows, n)).astype(np.float32)
        r0 = rng.standard_normal((rows, n)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, n).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        y_ln, m, r = nn.layer_norm_forward(x0, n, w, b)
        y_rms, rr = nn.rms_norm_forward(x0, n, w)
        dx_ln = nn.layer_norm_backward(dy0, x0, m, r, n, w)[0]
        dx_rms = nn.rms_norm_backward(dy0, x0, rr, n, w)[0]
        y_add, _ = nn.add_layer_norm(x0, r0, n, w, b)
        dw, db, s = np.empty(n, np.float32), np.empty(n, np.float32), np.empty_like(x0)
        for gap in range(-40, 41):
            x, out = _placed(buf, rows, n, gap)
            x[...] = x0
            nn.layer_norm(x, n, w, b, out=out)
            np.testing.assert_array_equal(out, y_ln, err_msg=f"layer_norm, gap {gap}")
            nn.rms_norm(x, n, w, out=out)
            np.testing.assert_array_equal(out, y_rms, err_msg=f"rms_norm, gap {gap}")
            ln_cpu.backward(dy0, x, m.ravel(), r.ravel(), w, out, dw, db)
            np.testing.assert_array_equal(out, dx_ln, err_msg=f"layer_norm backward, gap {gap}")
            rms_cpu.backward(dy0, x, rr.ravel(), w, out, dw)
            np.testing.assert_array_equal(out, dx_rms, err_msg=f"rms_norm backward, gap {gap}")
            add_cpu.layer_norm_forward(x, r0, w, b, 1e-5, out, s, m.ravel().copy(), r.ravel().copy())
            np.testing.assert_array_equal(out, y_add, err_msg=f"add_layer_norm, gap {gap}")


@pytest.mark.parallel_kernels
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 64])  # the serial kernel (one small row) and the parallel one
def test_eps_zero_on_a_constant_row_gives_ieee_values_not_an_exception(dtype, rows):
    """var = 0 and eps = 0: rstd is inf and y is NaN (0 * inf), as the oracle and IEEE say.
    Row functions compiled with Python's error model raised ZeroDivisionError (ch4 of the
    book failed to build)."""
    import numbanorm as nn
    from numbanorm import reference as ref

    x = np.full((rows, 768), 3.7, dtype)
    with np.errstate(divide="ignore", invalid="ignore"), background.synchronous():
        y, mean, rstd = nn.layer_norm_forward(x, 768, eps=0.0)
        y_ref, _, rstd_ref = ref.layer_norm_forward(x, 768, eps=0.0)
        assert np.isposinf(rstd).all() and np.isposinf(rstd_ref).all()
        np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
        z = np.zeros((rows, 768), dtype)
        y, rstd = nn.rms_norm_forward(z, 768, eps=0.0)
        assert np.isposinf(rstd).all() and np.isnan(y).all()
        g = nn.group_norm(x.reshape(rows, 4, 192), 2, eps=0.0)
        assert np.isnan(g).all()
        y, s = nn.add_layer_norm(x, np.zeros_like(x), 768, eps=0.0)
        assert np.isnan(y).all() and (s == x).all()
        y, s = nn.add_rms_norm(z, z, 768, eps=0.0)
        assert np.isnan(y).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_one_pass_statistics_hold_for_a_first_element_two_deviations_out(rng, dtype):
    """The shift is the mean of a row's first SHIFT_SAMPLE elements, not its first
    element: a row whose first element lies 2 standard deviations from the mean (one
    row in 20 of N(0, 1)) keeps the one pass.  Shifted by that element, it failed
    one_pass_ok and took a second statistics pass (10-20% of a row's time in cache)."""
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    x[0, 0] = x.mean() + 2 * x.std()
    view = x.astype(dtype).view(np.uint16) if dtype == np.float16 else x
    from numbanorm.cpu._kernels.sums import deviation_sums

    k = stats.shift(view, 0, np.float32(0))
    s1, s2 = deviation_sums(view, 0, k, np.float32(0))
    assert stats.one_pass_ok(s1 / 4096, s2 / 4096)
    mu, corr, _ = stats.row_stats(view, 0, np.float32(0))
    assert mu == k  # the one pass's split of the mean
    np.testing.assert_allclose(mu + np.float64(corr), x.astype(dtype).astype(np.float64).mean(), atol=1e-6)


@pytest.mark.parametrize("first", [1e4, -3e3, 0.5])
def test_forward_rows_whose_first_element_is_far_from_the_mean(rng, first):
    """LayerNorm's statistics take one pass over the deviations from a shift (the
    mean of a row's first elements) where it lies within a standard deviation of the
    mean, and the two-pass elsewhere: with the one pass trusted for a shift of x[0]
    = 1e4 among N(0, 1) (64 standard deviations out), y was up to 3e-2 off; a first
    element of 1e4 still puts the shift far out."""
    from numbanorm import reference as ref

    x = rng.standard_normal((3, 4096)).astype(np.float32)
    x[:, 0] = first
    x[1] += 1e4  # an offset row too: its first element is near or far as the others
    w = rng.uniform(0.5, 1.5, 4096).astype(np.float32)
    y, mean, rstd = nn.layer_norm_forward(x, 4096, w, None)
    y_ref, mean_ref, rstd_ref = ref.layer_norm_forward(x, 4096, w, None)
    assert_close(y, y_ref, np.float32, "y")
    assert_close(mean, mean_ref, np.float32, "mean")
    assert_close(rstd, rstd_ref, np.float32, "rstd")


# ------------------------------------------------------------------ what a first call compiles


def test_generated_kernels_name_their_own_source_and_cache_beside_their_row_function():
    """A parallel kernel is compiled from generated source under a file name of its own,
    whose lines ``linecache`` (so a traceback) shows, and is cached beside its row
    function's module.  They were compiled under common.py's name: a traceback through
    one showed common.py's first lines."""
    import linecache

    for module in (ln_cpu, rms_cpu, gn_cpu, add_cpu):
        for kernel in (k for k in vars(module).values() if isinstance(k, common.Kernel)):
            code = kernel.parallel.py_func.__code__
            source = kernel.rows.py_func.__code__.co_filename
            assert code.co_filename.startswith(source + " <parallel kernel of "), code.co_filename
            assert linecache.getline(code.co_filename, code.co_firstlineno).startswith("def kernel(block, ")
            assert "ROWS(" in "".join(linecache.getlines(code.co_filename))
            assert kernel.parallel._cache.cache_path == kernel.rows._cache.cache_path


def test_a_kernel_found_only_after_numbas_refresh_still_loads(tmp_path, monkeypatch):
    """``KernelCache.load_overload`` looks without Numba's refresh of its target context
    first; where that finds nothing (an index key hashes the function's closure, which a
    refresh could change), Numba's own load, refresh included, looks again: a cached
    kernel is loaded, never compiled a second time."""
    import numba

    from numbanorm.cpu._kernels import cache

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    def plus_one(v):
        return v + 1

    assert cache.njit(cache=True)(plus_one)(1) == 2  # compiled, saved
    again = cache.njit(cache=True)(plus_one)
    real, looks = again._cache._load_overload, []

    def found_second(sig, target_context):  # as a key that matches after the refresh alone
        looks.append(sig)
        return real(sig, target_context) if len(looks) > 1 else None

    monkeypatch.setattr(again._cache, "_load_overload", found_second)
    assert again(1) == 2
    assert len(looks) == 2 and sum(again.stats.cache_hits.values()) == 1 and not again.stats.cache_misses


@pytest.mark.parallel_kernels
def test_a_row_function_is_one_compiled_function_for_both_paths():
    """The calling thread and the parallel kernel run one compiled row function: parfors
    typed the prange index of the backward's blocks unsigned, and the row function
    called with it was compiled a second time (a second compile, and a second function
    whose bits had only to agree).  Every row function's bounds are int64 either way."""
    x = np.linspace(-2, 3, 300 * 128, dtype=np.float32).reshape(300, 128)  # parallel: >= SERIAL_BELOW
    with background.synchronous():
        for a in (x, x[:3]):
            _, mean, rstd = nn.layer_norm_forward(a, 128)
            nn.layer_norm_backward(a, a, mean, rstd, 128)
            _, rstd = nn.rms_norm_forward(a, 128)
            nn.rms_norm_backward(a, a, rstd, 128)
            _, mean, rstd = nn.group_norm_forward(a.reshape(-1, 8, 16), 4)
            nn.group_norm_backward(a.reshape(-1, 8, 16), a.reshape(-1, 8, 16), mean, rstd)
            last = np.moveaxis(a.reshape(-1, 4, 4, 8), -1, 1)  # (N, 8, 4, 4) in channels-last order
            _, mean, rstd = nn.group_norm_forward(last, 4)
            nn.group_norm_backward(last, last, mean, rstd)
    for module in (ln_cpu, rms_cpu, gn_cpu):
        for kernel in (k for k in vars(module).values() if isinstance(k, common.Kernel)):
            assert kernel.rows.signatures and kernel.parallel.signatures
            assert all(tuple(map(str, s[-2:])) == ("int64", "int64") for s in kernel.rows.signatures), \
                kernel.rows.signatures


@pytest.mark.parallel_kernels
def test_threads_share_a_call_only_in_more_than_one_block(monkeypatch, rng):
    """A call worth sharing (common.SERIAL_BELOW) takes Numba's threads only where its
    parallel loop has two blocks or more (one block on the pool is the row function's
    work plus the pool's wake-up), and a backward of a few long rows is cut into
    blocks to share (``n_chunks``: it was one block below 32 rows, whatever their
    length; now 16 rows a block or fewer rows longer than 4096, and a call of 65536
    elements two blocks at least).  Each case's outputs are the calling thread's, bit
    for bit."""
    tasks = []
    for kernel in (ln_cpu._backward, rms_cpu._backward, ln_cpu._forward):
        def spy(block, *args, kernel=kernel, parallel=kernel.parallel):
            tasks.append((kernel, -(-kernel._count(args) // block)))
            return parallel(block, *args)
        monkeypatch.setattr(kernel, "parallel", spy)

    def backward(dy, x, w, threads):
        n = x.shape[1]
        _, mean, rstd = nn.layer_norm_forward(x, n, w)
        _, rr = nn.rms_norm_forward(x, n, w)
        with monkeypatch.context() as mp:
            if not threads:
                mp.setattr(common, "SERIAL_BELOW", 1 << 62)
            with background.synchronous():
                return nn.layer_norm_backward(dy, x, mean, rstd, n, w) + nn.rms_norm_backward(dy, x, rr, n, w)

    assert common.n_chunks(8, 4096) == 1 and common.n_chunks(16, 4096) == 2 and common.n_chunks(64, 4096) == 4
    assert common.n_chunks(16, 8192) == 2 and common.n_chunks(3, 40000) == 2 and common.n_chunks(4, 32768) == 2
    assert common.n_chunks(32, 768) == 2 and common.n_chunks(1, 10 ** 6) == 1 and common.n_chunks(4096, 8) == 64
    for m, n, shared in ((8, 4096, 0), (16, 4096, 2), (32, 8192, 4), (3, 40000, 2)):
        x, dy = (rng.standard_normal((m, n)).astype(np.float32) for _ in range(2))
        w = rng.uniform(0.5, 1.5, n).astype(np.float32)
        tasks.clear()
        got, want = backward(dy, x, w, True), backward(dy, x, w, False)
        assert [t for k, t in tasks if k is not ln_cpu._forward] == ([shared] * 2 if shared else []), (m, n, tasks)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    tasks.clear()
    x = rng.standard_normal((1, 40000)).astype(np.float32)  # one row over SERIAL_BELOW: one block
    with background.synchronous():
        nn.layer_norm(x, 40000)
        nn.layer_norm(x.reshape(2, 20000), 20000)  # two rows: two blocks
    assert [t for k, t in tasks] == [2], tasks


def test_a_row_function_compiles_no_rare_path():
    """A row function's compile leaves out what its rows rarely or never need: the float64
    rescaling of rows whose sums overflowed (a variant of the row function compiled
    when a row first needs it: Kernel.rescue), and Numba's formatted message for an
    array assignment whose shapes disagree (the backward's partials, written element by
    element).  Both were compiled into every backward's first call."""
    from numba import njit
    from numba.core import event

    compiled = []

    class Names(event.Listener):
        def on_start(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)

        def on_end(self, ev):
            pass

    M, N = 4, 64
    x, st = np.ones((M, N), np.float32), np.ones(M, np.float32)
    part = np.zeros((1, N), np.float32)
    with event.install_listener("numba:compile", Names()):
        for rows, args in ((ln_cpu.forward_rows, (x, None, None, np.float32(1e-5), x.copy(), st, st.copy(), False)),
                           (ln_cpu.backward_rows, (x, x, st, st, None, None, x.copy(), part, part.copy(), False)),
                           (gn_cpu.backward_groups, None)):
            if args is None:  # GroupNorm: one sample of 4 channels in 2 groups
                xc, g = x.reshape(4, N), x.reshape(2, 2 * N)
                stats = np.ones((1, 2), np.float32)
                args = (g, g, stats, stats, None, g.copy(), xc, xc, xc.copy(), np.zeros((1, 4), np.float32),
                        np.zeros((1, 4), np.float32), False)
            options = {k: v for k, v in rows.targetoptions.items() if k not in ("cache", "nopython")}
            fresh = njit(**options)(rows.py_func)  # not cached: compiled here
            fresh(*args, 0, 1)
    assert not [f for f in compiled if f.startswith(("scaled_", "row_scale"))], compiled
    assert not [f for f in compiled if "shape_context" in f or f.startswith(("integer_str", "unicode"))], compiled


@pytest.mark.parallel_kernels
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_whose_sums_overflowed_in_a_parallel_call_in_place_and_not(dtype):
    """The row functions leave a finite row whose sums overflowed to their rescaling
    variant (Kernel.rescue): a forward's such rows alone, marked in rstd, since the
    others are written already (in place, over x); a backward's whole call again.
    Among enough rows for the parallel kernels, in place and not, every row is the
    bits of its own call."""
    rng = np.random.default_rng(7)
    m, n = -(-common.SERIAL_BELOW // 64) + 3, 64
    x = rng.standard_normal((m, n)).astype(dtype)
    huge = 1e20 if dtype == np.float32 else 1e155
    for i in (1, m // 2, m - 1):
        x[i] *= huge
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    dy = rng.standard_normal((m, n)).astype(dtype)
    with background.synchronous():  # (the parallel kernels, compiled here)
        calls = {"layer_norm": lambda a, **k: nn.layer_norm(a, n, w, w, **k),
                 "rms_norm": lambda a, **k: nn.rms_norm(a, n, w, **k),
                 "group_norm": lambda a, **k: nn.group_norm(a.reshape(-1, 4, n // 4), 2, w[:4], w[:4],
                                                            **{key: v.reshape(-1, 4, n // 4) for key, v in k.items()})}
        for name, f in calls.items():
            whole = f(x).reshape(m, n)
            inplace = x.copy()
            f(inplace, out=inplace)
            np.testing.assert_array_equal(inplace, whole, err_msg=name)
            for i in (0, 1, m // 2, m - 1):
                np.testing.assert_array_equal(f(x[i:i + 1]).reshape(1, n), whole[i:i + 1], err_msg=f"{name} {i}")
            assert np.isfinite(whole).all(), name
        y, s = nn.add_layer_norm(x, np.zeros_like(x), n, w, w)
        np.testing.assert_array_equal(y, nn.layer_norm(x, n, w, w))
        _, mean, rstd = nn.layer_norm_forward(x, n, w)
        dx, dw, db = nn.layer_norm_backward(dy, x, mean, rstd, n, w)
        want = ORACLE.layer_norm_backward(dy, x, mean, rstd, n, w)
        for got, exp in zip((dx, dw, db), want):
            assert np.isfinite(got).all()
            assert_close(got, exp, dtype)


def test_rows_are_grouped_where_a_row_with_its_weights_fills_l1(monkeypatch):
    """spans.grouping: rows of x, y, weight and bias over 48 KiB are written in groups of
    rows, span by span, and streamed rows (y out of the cache) where x, weight and bias
    take more than the L1 data cache; rows without weights, shorter ones and staged ones
    whole."""
    g = spans.grouping.py_func
    monkeypatch.setitem(g.__globals__, "L1_DATA_BYTES", 32 << 10)  # (read when a row function compiles)
    assert g(4096, 8, 8, False, False) == (spans.GROUP_ROWS, spans.SPAN)  # float32, weight and bias: 64 KiB
    assert g(8192, 4, 8, False, False) == (spans.GROUP_ROWS, spans.SPAN)  # weight alone: 96 KiB
    assert g(4096, 4, 8, False, False) == (1, 4096)                       # weight alone: 48 KiB
    assert g(2048, 8, 8, False, False) == (1, 2048)                       # 32 KiB
    assert g(8192, 0, 8, False, False) == (1, 8192)                       # nothing to keep in L1
    assert g(4096, 8, 4, True, False) == (spans.GROUP_ROWS, spans.SPAN)   # streamed, float32: 48 KiB
    assert g(4096, 4, 4, True, False) == (1, 4096)                        # streamed, weight alone: 32 KiB
    assert g(4096, 4, 2, True, False) == (1, 4096)                        # streamed, 16-bit: 24 KiB
    assert g(4096, 8, 4, True, True) == (1, 4096)                         # staged (out=x): whole rows
    monkeypatch.setitem(g.__globals__, "L1_DATA_BYTES", 48 << 10)
    assert g(4096, 8, 4, True, False) == (1, 4096)                        # streamed, 48 KiB in a 48 KiB L1


@pytest.mark.parallel_kernels
@pytest.mark.parametrize("dtype", first_then_exhaustive([np.float32, np.float16, np.float64]))
def test_grouped_rows_with_overflowed_and_nan_rows_among_them(stream_everything, rng, dtype):
    """Rows written in groups (spans.grouping), a group's statistics before its writes: a
    row whose sums overflowed is left to the rescaling variant and skipped by its group's
    writes, a NaN row stays in its row, the last group is short and the last span too.
    Every row the bits of its own call, streamed (grouped too, where x, weight and bias
    overflow L1) and in place (staged: whole rows)."""
    m, n = 2 * spans.GROUP_ROWS + 3, 4 * spans.SPAN + 7  # float16 with its 16-bit weight: 48 KiB + 42 bytes
    x = rng.standard_normal((m, n)).astype(dtype)
    w = rng.uniform(0.5, 1.5, n).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    if dtype != np.float16:  # (float16 sums are float32: they do not overflow)
        x[[1, spans.GROUP_ROWS + 2, m - 1]] *= 1e20 if dtype == np.float32 else 1e155
    x[5, 7] = np.nan
    size = np.dtype(dtype).itemsize
    calls = {"layer_norm": (lambda a, **k: nn.layer_norm(a, n, w, b, **k), 2),
             "rms_norm": (lambda a, **k: nn.rms_norm(a, n, w, **k), 1)}
    for name, (f, params) in calls.items():
        assert spans.grouping.py_func(n, params * size, 2 * size, False, False)[0] > 1
        if size >= 4:  # streamed too, on any L1 up to 64 KiB (float16 rows this long fit 48 KiB)
            assert spans.grouping.py_func(n, params * size, size, True, False)[0] > 1
        whole = unstreamed(f, x)  # grouped
        assert np.isnan(whole[5]).all() and np.isfinite(np.delete(whole, 5, axis=0)).all(), name
        for i in range(m):
            np.testing.assert_array_equal(unstreamed(f, x[i:i + 1]), whole[i:i + 1], err_msg=f"{name} {i}")
        inplace = x.copy()
        unstreamed(f, inplace, out=inplace)
        np.testing.assert_array_equal(inplace, whole, err_msg=name)
        np.testing.assert_array_equal(f(x), whole, err_msg=f"{name} streamed")
        inplace = x.copy()
        f(inplace, out=inplace)
        np.testing.assert_array_equal(inplace, whole, err_msg=f"{name} streamed in place")


def test_the_row_functions_scratch_arrays_are_freed():
    """Every array Numba's runtime allocates in a backward or a forward (the partial rows
    and a group's kept statistics of ``common.empty_row``, an allocation written out by
    hand) is freed: across repeated calls, on the calling thread and on Numba's,
    allocations and frees balance.  The runtime counts them only when asked before it
    starts, hence a process of its own."""
    import os
    import subprocess
    import sys

    code = """
import numpy as np, numbanorm as nn
from numba.core.runtime import rtsys
from numbanorm.cpu._kernels import background
rng = np.random.default_rng(0)
for rows, n in ((8, 300), (256, 300), (8, 4100)):  # the calling thread's row function, the parallel
    x, dy = rng.standard_normal((2, rows, n), dtype=np.float32)  # kernel; rows in groups (spans.grouping)
    w = np.ones(n, np.float32)
    _, m, r = nn.layer_norm_forward(x, n, w, w)
    _, r2 = nn.rms_norm_forward(x, n, w)
    calls = lambda: (nn.layer_norm_backward(dy, x, m, r, n, w), nn.rms_norm_backward(dy, x, r2, n, w),
                     nn.layer_norm_forward(x, n, w, w), nn.rms_norm_forward(x, n, w))
    with background.synchronous():
        calls()
    before = rtsys.get_allocation_stats()
    for _ in range(20):
        calls()
    after = rtsys.get_allocation_stats()
    assert after.alloc - before.alloc > 0, "nothing counted"
    assert after.alloc - before.alloc == after.free - before.free, (before, after)
    assert after.mi_alloc - before.mi_alloc == after.mi_free - before.mi_free, (before, after)
print("ok")
"""
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
