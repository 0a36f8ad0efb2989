"""Shared fixtures: the implementations under test, tolerances and random inputs.

The GPU kernels run in numba-cuda's CUDA simulator unless ``NUMBANORM_TEST_GPU=1``
asks for real hardware; the simulator must be switched on before numba.cuda is
first imported, hence here, at collection time.  Without numba-cuda (the test
extra installs it on Linux only) the GPU tests skip: numba's own deprecated
built-in ``numba.cuda`` would otherwise run them, and numbanorm does not target it.
"""

import importlib.util
import os

if os.environ.get("NUMBANORM_TEST_GPU") != "1" and importlib.util.find_spec("numba_cuda"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from numbanorm import operations, registry  # noqa: E402
from numbanorm.machine import cuda_simulated  # noqa: E402
from numbanorm.operations import to_host  # noqa: E402,F401  (the tests import it from here)

ORACLE = registry.get("oracle")
# kernels under test; 'cuda' only where numba-cuda (or its simulator) can run
KERNELS = [n for n in registry.available(include_oracle=False)]
SIMULATED = cuda_simulated()

# numbanorm check's tolerances (numbanorm.operations.TOLERANCE gives the reasons), by scalar type
TOL = {np.dtype(d).type: t for d, t in operations.TOLERANCE.items()}
DTYPES = [np.float16, np.float32, np.float64]
# the table's operations, for parametrising tests over every one of them
OPERATIONS = [pytest.param(op, id=op.name) for op in operations.OPERATIONS]
FUSED = [pytest.param(op, id=op.name) for op in operations.OPERATIONS if op.fused]


def assert_close(actual, expected, dtype, what=""):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    tol = operations.tolerance(dtype)
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def channels_last(a):
    """``a`` (N, C, *spatial) with the same values, laid out in channels-last order,
    (N, *spatial, C): torch's channels_last, which GroupNorm takes as it is on the CPU."""
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)


def impl_params(gpu_marks=()):
    """pytest params over the kernels, the GPU ones marked as simulated (and ``gpu_marks``)."""
    out = []
    for name in KERNELS:
        marks = ([pytest.mark.cudasim] if SIMULATED else []) + list(gpu_marks) if name == "cuda" else []
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.fixture(params=impl_params())
def impl_name(request):
    return request.param


@pytest.fixture
def impl(impl_name):
    return registry.get(impl_name)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_NEVER = 1 << 62  # a threshold no array reaches


def streamed_lines(out):
    """Whole cache lines of ``out`` (C-contiguous, any shape) that a row writer streams,
    row by row (``memory.stream_span``): a test of streamed bits against ordinary ones
    asserts there are some, or it would pass with nothing streamed."""
    from numbanorm.cpu._kernels import memory

    rows = out.reshape(-1, out.shape[-1])
    if rows.itemsize == 2:  # (the kernels' view of 16-bit rows: their bits)
        rows = rows.view(np.uint16)
    spans = [memory.stream_span(rows, i) for i in range(rows.shape[0])]
    return sum(hi - lo for lo, hi in spans) * out.itemsize // 64


def unstreamed(f, *args, **kwargs):
    """``f(*args, **kwargs)`` with every CPU output written by ordinary stores (the
    replayed calls' plans, which keep their choice of store, forgotten before and after):
    what a streamed output is compared with."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import memory

    saved = memory.STREAM_MIN_BYTES
    memory.STREAM_MIN_BYTES = _NEVER
    _backend.plans._plans.clear()
    try:
        return f(*args, **kwargs)
    finally:
        memory.STREAM_MIN_BYTES = saved
        _backend.plans._plans.clear()


# pyproject's addopts run the suite on two pytest-xdist workers, in units handed to whichever
# worker is free (--dist loadscope, its unit chosen here).  The variants of one CPU test
# compile the same kernels, so they are one unit: the two workers never compile a kernel
# twice at once (whoever needs it next loads it from Numba's disk cache).  The GPU kernels'
# tests (the CUDA simulator, NVVM: files test_cuda*, test_gpu*, ids naming cuda) compile
# nothing shared and are a unit each.  (xdist's own loadgroup, which a test's marker drove,
# stopped grouping with pytest 9.2: pytest-xdist#1386.)
_GPU_FILES = ("test_cuda", "test_gpu")


def unit_of_work(nodeid):
    """The unit of work of the test ``nodeid`` (``pytest_xdist_make_scheduler``)."""
    path, _, rest = nodeid.partition("::")
    function, _, params = rest.partition("[")
    if os.path.basename(path).startswith(_GPU_FILES) or "cuda" in params:
        return nodeid
    return f"{path}::{function}"


@pytest.hookimpl(optionalhook=True)  # (a pytest without xdist, as the book's check runs it)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByTest(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return unit_of_work(nodeid)

    config.option.loadscopereorder = False  # (xdist >= 3.6) in collection order, as sorted below
    return ByTest(config, log)


def pytest_collection_modifyitems(items):
    # the launch path's tests (a process each, compiling with NVVM) are the longest units:
    # handed out first, they do not end the run on one worker while the other idles
    items.sort(key=lambda item: item.path.name != "test_cuda_launch.py")


# A CPU call streams its output or takes the parallel kernel only in the tests that ask
# (stream_everything, a threshold the test sets, the markers machine_streaming and
# parallel_kernels): tests/README.md says why.


@pytest.fixture(autouse=True)
def _cpu_paths_where_asked(request, monkeypatch):
    from numbanorm.cpu._kernels import common, memory

    if request.node.get_closest_marker("machine_streaming") is None:
        monkeypatch.setattr(memory, "STREAM_MIN_BYTES", _NEVER)
    if request.node.get_closest_marker("parallel_kernels") is None:
        monkeypatch.setattr(common, "SERIAL_BELOW", _NEVER)


@pytest.fixture
def stream_everything(monkeypatch):
    """Every CPU output streamed, the streaming variants compiled at once so that they run
    (not the plain row function standing in while they compile)."""
    from numbanorm.cpu import _backend
    from numbanorm.cpu._kernels import background, memory

    monkeypatch.setattr(memory, "STREAM_MIN_BYTES", 0)
    _backend.plans._plans.clear()  # plans keep the store chosen when they were learned
    with background.synchronous():
        yield
    _backend.plans._plans.clear()


# The CUDA simulator runs every thread of a block as a Python thread, so a test's time grows
# with the threads it launches, not with its rows.  Where the GPU is one more implementation
# (test_contract, test_fused, test_operations, ...), its blocks are a warp and the column
# sums' blocks 4 x 8 threads: the same kernels and code paths with a few rows each; the
# default mapping and every other one are test_cuda.py's and test_gpu*'s, which keep the knobs.
SIMULATED_KNOBS = {"BLOCK_THREADS": 32, "SUM_SLICES": 4, "SUM_COLS": 8}


@pytest.fixture
def knobs(monkeypatch):
    """Change the GPU mapping's tuning constants (``cuda/_kernels/common.py``) for one test,
    forgetting the configs cached for the old ones (and again after the test)."""
    from numbanorm.cuda._kernels import common as C

    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setattr(C, k, v)
        C.row_config.cache_clear()

    yield set_
    monkeypatch.undo()
    C.row_config.cache_clear()


@pytest.fixture(autouse=True)
def _warp_sized_simulated_blocks(request):
    if SIMULATED and "cuda" in request.node.name and not request.path.name.startswith(_GPU_FILES):
        request.getfixturevalue("knobs")(**SIMULATED_KNOBS)
