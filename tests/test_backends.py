"""The backend contract (numbanorm._api.Backend) and the CUDA call context."""

import inspect

import numpy as np
import pytest

import numbanorm
from numbanorm import _api
from numbanorm import _validate as V
from conftest import SIMULATED


def _backends():
    import numbanorm.cpu._backend as cpu_backend

    out = [pytest.param(cpu_backend, id="cpu")]
    if numbanorm.cuda.is_available():
        from numbanorm.cuda import _backend as cuda_backend

        out.append(pytest.param(cuda_backend, id="cuda", marks=[pytest.mark.cudasim] if SIMULATED else []))
    return out


@pytest.mark.parametrize("backend", _backends())
def test_both_backends_implement_the_protocol(backend):
    assert isinstance(backend, _api.Backend)
    for name, member in vars(_api.Backend).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        want = list(inspect.signature(member).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(backend, name)).parameters) == want, name


def test_each_plan_cache_implements_its_protocol():
    """The CPU's plans and CUDA's replays answer the frontend through one protocol
    (``_api.PlanCache``), the same signatures; the simulator has none (every call takes
    the full path)."""
    import numbanorm.cpu._backend as cpu_backend

    caches = [cpu_backend.plans]
    if numbanorm.cuda.is_available():
        from numbanorm.cuda import _backend as cuda_backend

        if SIMULATED:
            assert cuda_backend.plans is None
        else:
            caches.append(cuda_backend.plans)
        caches.append(cuda_backend.Replays())  # (its methods need no GPU to be looked at)
    for cache in caches:
        assert isinstance(cache, _api.PlanCache)
        for name, member in vars(_api.PlanCache).items():
            if name.startswith("_") or not inspect.isfunction(member):
                continue
            want = list(inspect.signature(member).parameters)[1:]
            assert list(inspect.signature(getattr(cache, name)).parameters) == want, (type(cache), name)


def _count_side_checks(monkeypatch):
    calls = []
    real = V.common_side

    def counting(**arrays):
        calls.append(sorted(arrays))
        return real(**arrays)

    monkeypatch.setattr(V, "common_side", counting)
    return calls


def test_host_call_checks_the_sides_once(monkeypatch):
    calls = _count_side_checks(monkeypatch)
    x = np.ones((3, 8), np.float32)
    numbanorm.layer_norm(x, 8)
    assert len(calls) == 1


@pytest.mark.cudasim
def test_device_call_checks_the_sides_once(monkeypatch):
    if not numbanorm.cuda.is_available():
        pytest.skip("numbanorm.cuda is not usable here")
    from numba import cuda

    calls = _count_side_checks(monkeypatch)
    x = cuda.to_device(np.ones((3, 8), np.float32))
    numbanorm.layer_norm(x, 8)
    assert len(calls) == 1
    with pytest.raises(TypeError, match="weight"):
        numbanorm.layer_norm(x, 8, np.ones(8, np.float32))  # still rejected: by the top level


def _launch_streams(monkeypatch):
    from numbanorm.cuda._kernels import common as C

    seen = []
    real = C.launch

    def recording(kernel, grid, block, stream, *args, **kwargs):
        seen.append(stream)
        return real(kernel, grid, block, stream, *args, **kwargs)

    monkeypatch.setattr(C, "launch", recording)
    return seen


@pytest.mark.cudasim
def test_the_call_runs_on_the_stream_of_the_array_whose_type_the_results_take(monkeypatch):
    """x's in a backward, s's in the fused backward: never dy's (which used to win there)."""
    if not numbanorm.cuda.is_available():
        pytest.skip("numbanorm.cuda is not usable here")
    from numba import cuda

    rng = np.random.default_rng(0)
    a, b = cuda.stream(), cuda.stream()
    host = rng.standard_normal((4, 16)).astype(np.float32)
    y, s, mean, rstd = numbanorm.cuda.add_layer_norm_forward(host, host, 16)
    dy = cuda.to_device(host).bind(a)  # the simulator's to_device drops the stream; bind keeps it
    x = cuda.to_device(host).bind(b)
    s_dev = cuda.to_device(s).bind(b)
    mean_dev, rstd_dev = cuda.to_device(mean), cuda.to_device(rstd)

    seen = _launch_streams(monkeypatch)
    numbanorm.layer_norm_backward(dy, x, mean_dev, rstd_dev, 16)
    assert seen and all(st is b for st in seen)
    seen.clear()
    numbanorm.add_layer_norm_backward(dy, None, s_dev, mean_dev, rstd_dev, 16)
    assert seen and all(st is b for st in seen)


@pytest.mark.parametrize("backend", _backends())
def test_a_copy_is_new_memory_with_the_values_shape_and_type(backend):
    """``Backend.copy`` (a layer's saved x) of a strided view: the same values in a fresh array
    of the caller's type, which later writes to the source leave alone."""
    host = np.random.default_rng(1).standard_normal((3, 5, 2)).astype(np.float32)
    a, want = host[..., 0], host[..., 0].copy()
    if backend.name == "cuda":
        from numba import cuda

        a = cuda.to_device(host)[..., 0]
    got = backend.copy(backend.call_context(a), a)
    assert type(got) is type(a) and got.shape == a.shape and got.dtype == a.dtype
    if backend.name == "cuda":
        a[:] = cuda.to_device(np.zeros((3, 5), np.float32))
        got = got.copy_to_host()
    else:
        a[...] = 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.cudasim
def test_a_layer_copies_its_input_on_the_inputs_stream(monkeypatch):
    """The copy a layer keeps of a numba device array for its backward is made on that
    array's stream, as its forward runs (it ran on the default stream)."""
    if not numbanorm.cuda.is_available():
        pytest.skip("numbanorm.cuda is not usable here")
    from numba import cuda

    from numbanorm.cuda import _backend

    stream = cuda.stream()
    x = cuda.to_device(np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)).bind(stream)
    seen = _launch_streams(monkeypatch)
    copies = []
    real = _backend.copy_into
    monkeypatch.setattr(_backend, "copy_into", lambda ctx, dst, src: (copies.append(ctx.stream), real(ctx, dst, src)))
    layer = numbanorm.LayerNorm(16)
    layer.weight = layer.bias = None
    layer(x)
    assert copies == [stream] and seen and all(st is stream for st in seen)


def test_a_torch_tensors_side_is_decided_without_its_cuda_array_interface():
    """PyTorch builds a tensor's ``__cuda_array_interface__`` whole on every access, and the
    side of every argument was decided by asking for it (several times a call): on an H200's
    host the costliest part of a repeated public call on CUDA tensors. ``is_cuda`` decides."""
    torch = pytest.importorskip("torch")
    asked = []

    class Probe(torch.Tensor):
        on_gpu = False

        @property
        def is_cuda(self):
            return self.on_gpu

        @property
        def __cuda_array_interface__(self):
            asked.append(1)
            return {}

    host = torch.zeros(3).as_subclass(Probe)
    device = torch.zeros(3).as_subclass(Probe)
    device.on_gpu = True
    assert V.side_of(host) == V.HOST and V.side_of(device) == V.DEVICE
    assert V.common_side(x=device, weight=device) == V.DEVICE
    assert V.side_of(torch.zeros(3)) == V.HOST
    assert asked == []
