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

from numbanorm import registry  # noqa: E402

ORACLE = registry.get("oracle")
# kernels under test; 'cuda' only where numba-cuda (or its simulator) can run
KERNELS = [n for n in registry.available(include_oracle=False)]
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

# Per-dtype tolerance, relative to the largest magnitude of the reference array:
# float16 outputs are rounded once from float32 (half an ulp is 2**-11 = 4.9e-4
# relative), float32 results carry a few ulps of a length-N reduction, float64
# the same at 1e-16.
TOL = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-11}
DTYPES = [np.float16, np.float32, np.float64]


def assert_close(actual, expected, dtype, what=""):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    tol = TOL[np.dtype(dtype).type]
    scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def impl_params():
    """pytest params over the kernels, the GPU ones marked as simulated."""
    out = []
    for name in KERNELS:
        marks = [pytest.mark.cudasim] if name == "cuda" and SIMULATED else []
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


def to_host(a):
    """Results of any implementation as NumPy arrays."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    return np.asarray(a)
