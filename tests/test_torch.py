"""numbanorm.torch: gradcheck, drop-in modules in real models, state_dict, memory sharing."""

import contextlib
import copy
import inspect
import re
import warnings
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbanorm.torch as nt  # noqa: E402
from conftest import ORACLE, TOL  # noqa: E402

F = torch.nn.functional


def t64(*shape, seed=0, requires_grad=True, low=None):
    g = torch.Generator().manual_seed(seed)
    if low is not None:
        a = torch.rand(*shape, generator=g, dtype=torch.float64) + low
    else:
        a = torch.randn(*shape, generator=g, dtype=torch.float64)
    return a.requires_grad_(requires_grad)


AFFINE = ["none", "weight", "bias", "both"]


def affine(shape, which, seed=1):
    w = t64(*shape, seed=seed, low=0.5) if which in ("weight", "both") else None
    b = t64(*shape, seed=seed + 1) if which in ("bias", "both") else None
    return w, b


# ------------------------------------------------------------ gradcheck (float64)

@pytest.mark.parametrize("which", AFFINE)
def test_gradcheck_layer_norm(which):
    x = t64(3, 4, 5)
    w, b = affine((4, 5), which)
    assert torch.autograd.gradcheck(lambda x, w, b: nt.layer_norm(x, (4, 5), w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: nt.layer_norm(x, 5, w[0] if w is not None else None,
                                                                  b[0] if b is not None else None), (x, w, b))


@pytest.mark.parametrize("which", ["none", "weight"])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_gradcheck_rms_norm(which, eps):
    x = t64(4, 7)
    w, _ = affine((7,), which)
    assert torch.autograd.gradcheck(lambda x, w: nt.rms_norm(x, [7], w, eps), (x, w))


@pytest.mark.parametrize("which", AFFINE)
@pytest.mark.parametrize("shape,groups", [((2, 6, 5), 3), ((2, 4, 3, 2), 4), ((3, 4), 1)])
def test_gradcheck_group_norm(which, shape, groups):
    x = t64(*shape)
    w, b = affine((shape[1],), which)
    assert torch.autograd.gradcheck(lambda x, w, b: nt.group_norm(x, groups, w, b), (x, w, b))


def test_gradcheck_group_norm_channels_last():
    """The CPU's channels-last kernels, and the second derivative's formula on their outputs."""
    x = t64(2, 4, 3, 5).detach().to(memory_format=torch.channels_last).requires_grad_()
    w, b = affine((4,), "both")
    f = lambda x, w, b: nt.group_norm(x, 2, w, b)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w, b)) and torch.autograd.gradgradcheck(f, (x, w, b))


@pytest.mark.parametrize("which", AFFINE)
def test_gradcheck_add_layer_norm(which):
    x, r = t64(3, 9), t64(3, 9, seed=5)
    w, b = affine((9,), which)
    # both outputs, y and s, are checked: s's gradient reaches x and r as ds
    assert torch.autograd.gradcheck(lambda x, r, w, b: nt.add_layer_norm(x, r, 9, w, b), (x, r, w, b))


@pytest.mark.parametrize("which", ["none", "weight"])
def test_gradcheck_add_rms_norm(which):
    x, r = t64(2, 3, 8), t64(2, 3, 8, seed=5)
    w, _ = affine((3, 8), which)
    assert torch.autograd.gradcheck(lambda x, r, w: nt.add_rms_norm(x, r, (3, 8), w), (x, r, w))


# ------------------------------------------------------------ against torch.nn.functional

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_functional_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 10, generator=g, dtype=dtype)
    w = torch.rand(6, 10, generator=g, dtype=dtype) + 0.5
    b = torch.randn(6, 10, generator=g, dtype=dtype)
    tol = TOL[np.float32 if dtype == torch.float32 else np.float64]
    close = dict(rtol=tol, atol=tol)
    torch.testing.assert_close(nt.layer_norm(x, (6, 10), w, b), F.layer_norm(x, (6, 10), w, b), **close)
    torch.testing.assert_close(nt.rms_norm(x, [10], w[0]), F.rms_norm(x, [10], w[0]), **close)
    torch.testing.assert_close(nt.group_norm(x, 3, w[:, 0], b[:, 0]), F.group_norm(x, 3, w[:, 0], b[:, 0]), **close)
    y, s = nt.add_layer_norm(x, b.expand_as(x), 10, w[0], b[0])
    torch.testing.assert_close(s, x + b)
    torch.testing.assert_close(y, F.layer_norm(x + b, (10,), w[0], b[0]), **close)


def test_bfloat16_functional_matches_torch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 10, generator=g).to(torch.bfloat16)
    w = (torch.rand(10, generator=g) + 0.5).to(torch.bfloat16)
    b = torch.randn(10, generator=g).to(torch.bfloat16)
    tol = dict(rtol=torch.finfo(torch.bfloat16).eps, atol=torch.finfo(torch.bfloat16).eps)
    for ours, theirs in [(nt.layer_norm(x, 10, w, b), F.layer_norm(x.float(), (10,), w.float(), b.float())),
                         (nt.rms_norm(x, 10, w), F.rms_norm(x.float(), (10,), w.float()))]:
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.to(torch.bfloat16).float(), **tol)


def test_weight_grads_only_when_required():
    x = t64(3, 8)
    w = t64(8, seed=3, low=0.5, requires_grad=False)
    b = t64(8, seed=4)
    nt.layer_norm(x, 8, w, b).sum().backward()
    assert w.grad is None and b.grad is not None and x.grad is not None
    x2 = t64(3, 8, requires_grad=False)
    w2 = t64(8, seed=3, low=0.5)
    nt.layer_norm(x2, 8, w2).square().sum().backward()
    assert x2.grad is None and w2.grad is not None


def test_fused_grads_when_only_one_output_is_used():
    x, r, w = t64(3, 8), t64(3, 8, seed=1), t64(8, seed=2, low=0.5)
    y, s = nt.add_rms_norm(x, r, 8, w)
    (s * 3).sum().backward()  # y unused: dx = ds, no weight gradient
    torch.testing.assert_close(x.grad, torch.full_like(x, 3))
    torch.testing.assert_close(r.grad, torch.full_like(r, 3))
    assert w.grad is None
    x.grad = r.grad = None
    y, s = nt.add_layer_norm(x, r, 8, w)
    ty = F.layer_norm(x + r, (8,), w)
    g = t64(3, 8, seed=9, requires_grad=False)
    want = torch.autograd.grad((ty * g).sum(), (x, r, w))
    got = torch.autograd.grad((y * g).sum(), (x, r, w))  # s unused: ds is None
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_cpu_tensors_cross_without_copies(monkeypatch):
    """What numbanorm receives is a view of the tensor, what comes back is the kernel's own buffer."""
    import numbanorm

    seen = {}
    real = numbanorm.add_layer_norm_forward

    def spy(x, residual, *args):
        out = real(x, residual, *args)
        seen.update(x=x, residual=residual, y=out[0], s=out[1])
        return out

    monkeypatch.setattr(numbanorm, "add_layer_norm_forward", spy)
    x, r = torch.randn(5, 16), torch.randn(5, 16, requires_grad=True)
    keep = x.clone()
    y, s = nt.add_layer_norm(x, r, 16)
    assert isinstance(seen["x"], np.ndarray) and seen["x"].ctypes.data == x.data_ptr()
    assert seen["residual"].ctypes.data == r.data_ptr()
    assert y.data_ptr() == seen["y"].ctypes.data and s.data_ptr() == seen["s"].ctypes.data
    assert y.dtype == s.dtype == torch.float32 and y.requires_grad and s.requires_grad
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(x, keep, rtol=0, atol=0)
    x_nc = torch.randn(16, 5).t()  # non-contiguous input
    torch.testing.assert_close(nt.layer_norm(x_nc, 16), nt.layer_norm(x_nc.contiguous(), 16), rtol=0, atol=0)


@pytest.mark.parametrize("grad", [False, True], ids=["eager-no-grad", "operator"])
def test_bfloat16_cpu_tensors_cross_without_copies(monkeypatch, grad):
    """bfloat16 reaches numbanorm as an ml_dtypes view of the tensor's bytes, and comes back
    the same way: through the operator (a weight that needs a gradient) and without it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numbanorm

    seen = {}

    def spy(x, normalized_shape, weight=None, eps=None):  # the kernel's part left out: crossing only
        seen.update(x=x, weight=weight)
        y = (x.astype(np.float32) * 2).astype(ml_dtypes.bfloat16)
        seen["y"] = y
        return y, np.ones(x.shape[:-1] + (1,), np.float32)

    # the operator runs rms_norm_forward; an eager call without autograd, the plain rms_norm
    monkeypatch.setattr(numbanorm, "rms_norm_forward", spy)
    monkeypatch.setattr(numbanorm, "rms_norm", lambda *a: spy(*a)[0])
    x = torch.randn(8, 5, dtype=torch.bfloat16).t()  # strided
    w = torch.rand(8, dtype=torch.bfloat16).requires_grad_(grad)
    y = nt.rms_norm(x, 8, w)
    assert y.requires_grad is grad
    assert seen["x"].dtype == ml_dtypes.bfloat16 and seen["weight"].dtype == ml_dtypes.bfloat16
    assert seen["x"].ctypes.data == x.data_ptr() and seen["x"].strides == (2, 10)
    assert seen["weight"].ctypes.data == w.data_ptr()
    np.testing.assert_array_equal(seen["x"].astype(np.float32), x.float().numpy())
    assert y.dtype == torch.bfloat16 and y.data_ptr() == seen["y"].ctypes.data
    torch.testing.assert_close(y, x * 2, rtol=0, atol=0)


# ------------------------------------------------------------ eager calls without the operator

def _operator_refused(monkeypatch):
    """Make every numbanorm operator raise: a call that reaches one fails."""
    def refused(*args):
        raise AssertionError("the custom operator ran")

    for name in list(nt._OPERATORS):
        monkeypatch.setitem(nt._OPERATORS, name, (refused, refused))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_eager_call_skips_the_operator(monkeypatch, dtype):
    """A decoder's per-token norm: plain tensors.  It runs the operator's implementation
    without the operator's dispatch (about 100 us a call), with the same bits; where
    autograd records a graph (w requires grad), around the same implementation."""
    if dtype is torch.bfloat16:
        pytest.importorskip("ml_dtypes")
    ops = torch.ops.numbanorm
    x = torch.randn(3, 64).to(dtype)
    w = torch.nn.Parameter((torch.rand(64) + 0.5).to(dtype))
    b = torch.randn(64).to(dtype)
    with torch.no_grad():
        expected = (ops.layer_norm_forward(x, [64], w, b, 1e-5)[0], ops.rms_norm_forward(x, [64], w, None)[0],
                    ops.group_norm_forward(x.reshape(3, 8, 8), 2, w[:8], b[:8], 1e-5)[0],
                    ops.add_rms_norm_forward(x, x, [64], w, None)[:2])
    _operator_refused(monkeypatch)
    graph = nt.layer_norm(x, 64, w, b)  # grad mode on and w requires grad: a graph, no operator
    assert graph.requires_grad and graph.grad_fn is not None
    torch.testing.assert_close(graph.detach(), expected[0], rtol=0, atol=0)
    with torch.no_grad():
        y = nt.layer_norm(x, 64, w, b)
        got = (y, nt.rms_norm(x, 64, w), nt.group_norm(x.reshape(3, 8, 8), 2, w[:8], b[:8]), nt.add_rms_norm(x, x, 64, w))
    assert not y.requires_grad and y.dtype == dtype
    for a, e in zip(got[:3], expected[:3]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert isinstance(got[3], tuple) and len(got[3]) == 2
    for a, e in zip(got[3], expected[3]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(nt.LayerNorm(64).to(dtype)(x), nt.layer_norm(x, 64, torch.ones(64, dtype=dtype),
                                                                                torch.zeros(64, dtype=dtype)))


@pytest.mark.parametrize("general", [False, True], ids=["eager", "general"])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "group_norm"])
def test_an_inference_tensor_is_normalized_by_a_layer_that_learns(name, general):
    """A frozen model's features, made under torch.inference_mode, through a norm whose
    weight learns: autograd cannot save an inference tensor, and torch's own rms_norm saves
    none there, so numbanorm's norms take it too, with the gradients of an ordinary copy.
    (``general``: an eps of NumPy's type, whose call goes through every check first.)"""
    g = torch.Generator().manual_seed(5)
    op = nt.BY_NAME[name]
    shape, c, size = ((3, 4, 5), 4, 2) if op.layout == "groups" else ((3, 6), 6, (6,))
    with torch.inference_mode():
        x = torch.randn(*shape, generator=g)
    weight = (torch.rand(c, generator=g) + 0.5).requires_grad_()
    bias = torch.randn(c, generator=g).requires_grad_()
    eps = np.float32(1e-5) if general else 1e-5
    args = {"layer_norm": (size, weight, bias, eps), "rms_norm": (size, weight, eps),
            "group_norm": (size, weight, bias, eps)}[name]
    got = getattr(nt, name)(x, *args)
    expected = getattr(nt, name)(x.clone(), *args)
    assert x.is_inference() and got.requires_grad and not got.is_inference()
    dy = torch.randn(got.shape, generator=g)
    params = [a for a in args if isinstance(a, torch.Tensor)]
    for a, e in zip(torch.autograd.grad(got, params, dy), torch.autograd.grad(expected, params, dy)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    module = {"layer_norm": lambda: nt.LayerNorm(c), "rms_norm": lambda: nt.RMSNorm(c),
              "group_norm": lambda: nt.GroupNorm(size, c)}[name]()
    module(x).sum().backward()
    assert module.weight.grad is not None


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in nt.OPERATIONS])
def test_an_eager_graph_has_the_operators_bits_forward_and_backward(op):
    """The eager call that records a graph (autograd.Function around the implementation)
    against the forward and backward operators themselves, through their autograd formula."""
    g = torch.Generator().manual_seed(3)
    shape = (4, 6, 5) if op.layout == "groups" else (4, 2, 5)
    c = shape[1] if op.layout == "groups" else shape[-1]
    values = {"x": torch.randn(*shape, generator=g), "residual": torch.randn(*shape, generator=g),
              op.shape_role: 3 if op.layout == "groups" else [5], "weight": torch.rand(c, generator=g) + 0.5,
              "bias": torch.randn(c, generator=g), "eps": op.eps}
    args = [values[r] for r in op.forward_roles]
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    grads, nodes = [], []
    for run in (lambda *a: getattr(nt, op.name)(*a), lambda *a: nt._OPERATORS[op.name][0](*a)):
        ins = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        out = run(*ins)
        out = out[:len(op.plain_outputs)] if isinstance(out, tuple) else (out,)
        nodes.append(type(out[0].grad_fn).__name__)
        ws = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(out)]
        grads.append([o.detach() for o in out] + list(torch.autograd.grad(out, [a for a in ins if isinstance(
            a, torch.Tensor)], ws)))
    assert nodes[0] == f"{op.name}_graphBackward" and "numbanorm" in nodes[1], nodes
    assert len(grads[0]) == len(op.plain_outputs) + len(leaves)
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_the_backward_of_an_eager_graph_skips_the_operator(monkeypatch):
    """Autograd's backward of an eager graph runs the backward's implementation directly too,
    with the bits of the backward operator."""
    x = t64(4, 16)
    w, b = affine((16,), "both")
    y = nt.layer_norm(x, 16, w, b)
    g = torch.randn_like(y)
    with torch.no_grad():
        _, mean, rstd = torch.ops.numbanorm.layer_norm_forward(x, [16], w, b, 1e-5)
        want = torch.ops.numbanorm.layer_norm_backward(g, x, mean, rstd, [16], w)
    _operator_refused(monkeypatch)
    got = torch.autograd.grad(y, (x, w, b), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_modes_and_functorch_see_the_operator():
    """Under a dispatch mode (a FLOP counter's, say) the call reaches the operator, so the
    mode sees numbanorm's op; so does torch's profiler, and so do a call under a torch
    function mode and torch.func's wrapped tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 16)
    with torch.no_grad(), Record() as rec:
        nt.layer_norm(x, 16)
    assert any("numbanorm.layer_norm_forward" in o for o in rec.ops), rec.ops
    class Watching(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watching():  # a torch function mode
        assert not nt._direct((x,))
    with torch.no_grad(), torch.device("cpu"), Watching():  # one beside a device context
        assert not nt._direct((x,))
    with torch.no_grad(), torch.profiler.profile() as prof:
        nt.layer_norm(x, 16)
    assert any(e.name == "numbanorm::layer_norm_forward" for e in prof.events())
    # torch.func wraps its tensors (vmap's batched ones here): those go to the operator
    seen = []
    torch.func.vmap(lambda t: seen.append(nt._direct((t,))) or t)(x)
    assert seen == [False] and nt._direct((x,))


@pytest.mark.parametrize("default", [False, True], ids=["with-device", "set_default_device"])
@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in nt.OPERATIONS])
def test_a_device_context_alone_skips_the_operator(monkeypatch, op, default):
    """``with torch.device(...)`` and ``torch.set_default_device`` push a torch function
    mode that only names a device for factory calls: a call under it skips the operator,
    as outside, with the same bits forward and backward, its results beside its inputs
    (the context's device, meta, is not theirs), the context back after it; a tensor
    subclass's ``__torch_function__`` still sees its call."""
    g = torch.Generator().manual_seed(4)
    for shape in ((1, 2, 16), (3, 4, 6)):  # (a small call by its plan, a call by the full path)
        c = shape[1] if op.layout == "groups" else shape[-1]
        values = {"x": torch.randn(*shape, generator=g), "residual": torch.randn(*shape, generator=g),
                  op.shape_role: 2 if op.layout == "groups" else [c], "weight": torch.rand(c, generator=g) + 0.5,
                  "bias": torch.randn(c, generator=g), "eps": op.eps}
        args = [values[r] for r in op.forward_roles]
        runs = []

        def call(ins):  # outputs, a call without gradients, the gradients of the outputs' sum
            out = getattr(nt, op.name)(*ins)
            out = out if isinstance(out, tuple) else (out,)
            with torch.no_grad():
                plain = getattr(nt, op.name)(*ins)
            grads = torch.autograd.grad(out, [a for a in ins if isinstance(a, torch.Tensor)],
                                        [torch.ones(o.shape, device="cpu") for o in out])
            return out, plain, grads

        for context in (False, True):
            ins = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            with contextlib.ExitStack() as stack:
                if context:
                    with monkeypatch.context() as refused:
                        refused.setattr(nt, "_OPERATORS", dict(nt._OPERATORS))
                        _operator_refused(refused)
                        if default:
                            torch.set_default_device("meta")
                            stack.callback(torch.set_default_device, None)
                        else:
                            stack.enter_context(torch.device("meta"))
                        out, plain, grads = call(ins)
                        assert torch.empty(1).device.type == "meta"  # the context still in force
                else:
                    out, plain, grads = call(ins)
            plain = plain if isinstance(plain, tuple) else (plain,)
            assert all(t.device.type == "cpu" for t in (*out, *plain, *grads))
            runs.append([o.detach() for o in out] + list(plain) + list(grads))
        assert torch.empty(1).device.type == "cpu"
        for a, e in zip(*runs):
            torch.testing.assert_close(a, e, rtol=0, atol=0)

    class Seen(torch.Tensor):
        calls = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    x = values["x"].as_subclass(Seen)  # (the last shape's)
    with torch.no_grad(), torch.device("meta"):
        getattr(nt, op.name)(*[x if r == "x" else values[r] for r in op.forward_roles])
    assert Seen.calls, "the subclass's __torch_function__ saw nothing"


# a call of each function and module as torch.jit.trace takes it, on x of shape (3, 8)
TRACED = {
    "LayerNorm in eval mode": nt.LayerNorm(8).eval(),
    "RMSNorm without affine": nt.RMSNorm(8, elementwise_affine=False),
    "layer_norm": lambda x: nt.layer_norm(x, 8),
    "rms_norm": lambda x: nt.rms_norm(x, 8),
    "group_norm": lambda x: nt.group_norm(x.reshape(3, 4, 2), 2),
    "add_layer_norm": lambda x: nt.add_layer_norm(x, x.flip(0), 8),
    "add_rms_norm": lambda x: nt.add_rms_norm(x, x.flip(0), 8),
}


@pytest.mark.parametrize("name", list(TRACED))
def test_jit_trace_records_the_operators(name):
    """torch.jit.trace records the operators, not the tensors a call without them returned
    (a constant: the traced function's output whatever its input) where no graph is recorded."""
    f = TRACED[name]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit's)
        warnings.simplefilter("error", torch.jit.TracerWarning)  # (a tensor crossing to NumPy warns)
        traced = torch.jit.trace(f, torch.randn(3, 8), check_trace=False)
        x = torch.randn(3, 8)
        got, want = traced(x), f(x)
    assert "numbanorm::" in str(traced.graph)
    for a, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_jit_script_says_numbanorms_modules_cannot_be_scripted():
    """TorchScript compiles no call of a Python custom operator: a model holding one of
    numbanorm's modules (its own, torch.nn's subclasses replace_norms made, a Hugging Face
    RMSNorm's) gets numbanorm's RuntimeError naming the module and what takes it, not
    TorchScript's on the generated code (GroupNorm's read "has no attribute '_op'")."""
    class Llamaish(torch.nn.Module):  # (Llama's RMSNorm arithmetic)
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(x.dtype)

    class Sub(torch.nn.LayerNorm):
        pass

    replaced = nt.replace_norms(torch.nn.Sequential(torch.nn.Linear(8, 8), Llamaish(), Sub(8)))
    for module in (nt.LayerNorm(8), nt.RMSNorm(8), nt.GroupNorm(2, 8), replaced[1], torch.nn.Sequential(replaced[2])):
        with warnings.catch_warnings(), pytest.raises(RuntimeError, match="numbanorm's and cannot be scripted"):
            warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit's)
            torch.jit.script(module)


class _Exported(torch.nn.Module):
    """One of each norm and a fused one, as a model that torch.export takes."""
    def __init__(self):
        super().__init__()
        self.ln, self.rms, self.gn = nt.LayerNorm(8), nt.RMSNorm(8), nt.GroupNorm(2, 4)

    def forward(self, x):
        h = self.ln(x)
        y, s = nt.add_rms_norm(h, x, 8, self.rms.weight)
        return self.gn(y.reshape(3, 4, 2)), s


def test_torch_export_saves_the_operators_and_a_process_that_imports_numbanorm_torch_loads_them(tmp_path):
    """torch.export records numbanorm's operators (not the tensors one call returned), and the
    program saved by torch.export.save runs, with the same bits, in a fresh process that
    imports numbanorm.torch before torch.export.load (which registers them: the README says so)."""
    import os
    import subprocess
    import sys

    model = _Exported().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    x = torch.randn(3, 8)
    program = torch.export.export(model, (x,))
    assert "numbanorm." in str(program.graph)
    x2 = torch.randn(3, 8)  # (another input: a recorded tensor would not follow it)
    with torch.no_grad():
        want = model(x2)
    for a, e in zip(program.module()(x2), want):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    torch.export.save(program, tmp_path / "model.pt2")
    torch.save({"x": x2, "want": want}, tmp_path / "io.pt")
    script = (
        "import sys, torch\n"
        "import numbanorm.torch\n"
        "program = torch.export.load(sys.argv[1])\n"
        "io = torch.load(sys.argv[2])\n"
        "for a, e in zip(program.module()(io['x']), io['want']):\n"
        "    torch.testing.assert_close(a, e, rtol=0, atol=0)\n"
        "print('same')\n")
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt2"), str(tmp_path / "io.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


def test_fx_and_fake_tensors_trace_the_calls():
    """torch.fx's symbolic tracing records a call of numbanorm's function (which its graph
    module calls again); under FakeTensorMode the operators' fake implementations answer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = nt.LayerNorm(8)
    fused = lambda x, r: nt.add_rms_norm(x, r, 8)[1] * 2  # noqa: E731
    for f, args in ((m, (torch.randn(3, 8),)), (fused, (torch.randn(3, 8), torch.randn(3, 8)))):
        gm = torch.fx.symbolic_trace(f)
        assert any(n.op == "call_function" and n.target in (nt.layer_norm, nt.add_rms_norm) for n in gm.graph.nodes)
        torch.testing.assert_close(gm(*args), f(*args), rtol=0, atol=0)
    with FakeTensorMode():
        x = torch.randn(3, 8)
        for y in (nt.LayerNorm(8)(x), nt.rms_norm(x, 8), nt.add_layer_norm(x, x, 8)[0]):
            assert type(y).__name__ == "FakeTensor" and y.shape == x.shape


@pytest.mark.parametrize("op", [pytest.param(op, id=op.name) for op in nt.OPERATIONS])
def test_meta_tensors_in_meta_tensors_out(op):
    """As torch.nn's: meta tensors give meta outputs and gradients of the right shapes and
    dtypes (the operators' fake implementations), the functions and the modules alike."""
    groups = op.layout == "groups"
    shape = (4, 6, 5) if groups else (4, 2, 6)

    def meta(*s, dtype=torch.float16):
        return torch.empty(*s, device="meta", dtype=dtype).requires_grad_()

    values = {"x": meta(*shape), "residual": meta(*shape), op.shape_role: 3 if groups else [6],
              "weight": meta(6, dtype=torch.float32), "bias": meta(6, dtype=torch.float32), "eps": op.eps}
    args = [values[r] for r in op.forward_roles]
    fn = getattr(nt, op.name)
    with torch.no_grad():
        plain = fn(*args)
    out = fn(*args)
    plain, out = ((o if isinstance(o, tuple) else (o,)) for o in (plain, out))
    for y in (*plain, *out):
        assert y.is_meta and y.shape == shape and y.dtype == torch.float16
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    grads = torch.autograd.grad(out, leaves, [torch.ones_like(y) for y in out])
    for g, a in zip(grads, leaves):
        assert g.is_meta and g.shape == a.shape and g.dtype == a.dtype
    module = {"layer_norm": lambda: nt.LayerNorm(6, device="meta"), "rms_norm": lambda: nt.RMSNorm(6, device="meta"),
              "group_norm": lambda: nt.GroupNorm(3, 6, device="meta")}.get(op.name)
    if module is not None:
        y = module()(torch.empty(*shape, device="meta"))
        assert y.is_meta and y.shape == shape and y.requires_grad


BAD_CALLS = {  # a call with a bad argument, on tensors made by t(*shape, dtype=...)
    "normalized_shape": lambda t: nt.layer_norm(t(2, 8), (7,)),
    "weight's shape": lambda t: nt.layer_norm(t(2, 8), (8,), t(5)),
    "int64 x": lambda t: nt.layer_norm(t(2, 8, dtype=torch.int64), (8,)),
    "int64 bias": lambda t: nt.layer_norm(t(2, 8), (8,), t(8), t(8, dtype=torch.int64)),
    "num_groups": lambda t: nt.group_norm(t(2, 6, 3), 4),
    "group_norm's weight": lambda t: nt.group_norm(t(2, 6, 3), 3, t(3)),
    "residual's dtype": lambda t: nt.add_rms_norm(t(2, 8), t(2, 8, dtype=torch.float64), 8),
    "residual's shape": lambda t: nt.add_layer_norm(t(2, 8), t(3, 8), 8),
    "negative eps": lambda t: nt.rms_norm(t(2, 8), 8, None, -1.0),
    "backward's dy": lambda t: torch.ops.numbanorm.layer_norm_backward(t(3, 8), t(2, 8), t(2, 1), t(2, 1), [8], None),
    "backward's statistics": lambda t: torch.ops.numbanorm.group_norm_backward(t(2, 6, 3), t(2, 6, 3), t(2, 2),
                                                                              t(2, 3), None),
}


@pytest.mark.parametrize("call", BAD_CALLS)
def test_meta_and_fake_tensors_get_the_errors_of_real_ones(call):
    """A bad argument on meta tensors, or under FakeTensorMode (torch.compile's tracing), raises
    what the same call on CPU tensors raises (numbanorm's validation, on shapes and dtypes);
    the fake implementations checked nothing and returned an output (an int64 one for int64 x)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def on(device):
        return lambda *s, dtype=torch.float32: torch.ones(*s, dtype=dtype, device=device)

    with pytest.raises((TypeError, ValueError)) as real:
        BAD_CALLS[call](on("cpu"))
    with pytest.raises(real.type, match=re.escape(str(real.value).split(" ")[0])):  # (what it names)
        BAD_CALLS[call](on("meta"))
    with FakeTensorMode(), pytest.raises(real.type):
        BAD_CALLS[call](on("cpu"))


def test_meta_tensors_with_cpu_ones_are_type_errors():
    """Meta and CPU tensors in one call: numbanorm's TypeError for tensors of two kinds of
    device (as for CPU and CUDA ones), whichever is x; a meta x gave a meta output."""
    for x, w in ((torch.empty(2, 8, device="meta"), torch.ones(8)), (torch.ones(2, 8), torch.empty(8, device="meta"))):
        with pytest.raises(TypeError, match="meta"):
            nt.layer_norm(x, (8,), w)
    with pytest.raises(TypeError, match="`residual` is on cpu but `x` is on meta"):
        nt.add_layer_norm(torch.empty(2, 8, device="meta"), torch.ones(2, 8), 8)


def test_nested_tensors_are_type_errors(monkeypatch):
    """Nested tensors, strided or jagged, get a TypeError that says so before anything runs."""
    pieces = [torch.randn(2, 5), torch.randn(3, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the strided layout's "prototype" warning)
        nested = [torch.nested.nested_tensor(pieces), torch.nested.nested_tensor(pieces, layout=torch.jagged)]
    _operator_refused(monkeypatch)
    monkeypatch.setattr(nt, "_arr", None)  # nothing crosses to NumPy either
    w, b = torch.nn.Parameter(torch.ones(5)), torch.zeros(5)
    for x in nested:
        for call in (lambda: nt.layer_norm(x, (5,), w, b), lambda: nt.LayerNorm(5)(x), lambda: nt.rms_norm(x, 5),
                     lambda: nt.group_norm(x, 1), lambda: nt.add_rms_norm(torch.randn(2, 5), x, 5)):
            with pytest.raises(TypeError, match="`(input|residual)` is a nested tensor"):
                call()


def test_a_nested_weight_and_sparse_tensors_get_one_type_error_on_every_path():
    """A nested weight, or a sparse input, weight or residual, in a call that takes the eager
    fast path (normalized_shape a tuple of ints) got torch's RuntimeError from the small
    calls' key, or DLPack's BufferError, naming nothing; the general path's TypeError now,
    with or without a gradient recorded."""
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the strided nested layout's, CSR's: "prototype", "beta")
        nested = torch.nested.nested_tensor([torch.randn(8)])
        csr = x.to_sparse_csr()
    cases = [(lambda s, g: nt.layer_norm(g(x), s, nested), "`weight` is a nested tensor"),
             (lambda s, g: nt.layer_norm(g(x.to_sparse()), s), "`input` is a torch.Tensor of layout torch.sparse_coo"),
             (lambda s, g: nt.layer_norm(csr, s), "`input` is a torch.Tensor of layout torch.sparse_csr"),
             (lambda s, g: nt.rms_norm(g(x), s, torch.randn(8).to_sparse()), "`weight` is a torch.Tensor of layout"),
             (lambda s, g: nt.add_rms_norm(g(x), x.to_sparse(), s), "`residual` is a torch.Tensor of layout")]
    for call, says in cases:
        for shape in ((8,), [8]):  # the fast path, then the general one
            for grad in (lambda t: t, lambda t: t.clone().requires_grad_()):  # (a recorded call: the operator's)
                with pytest.raises(TypeError, match=re.escape(says)):
                    call(shape, grad)


def test_errors_cross_unchanged():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        nt.layer_norm(x, 7)
    with pytest.raises(ValueError, match="residual"):
        nt.add_layer_norm(x, torch.randn(3, 8, dtype=torch.float64), 8)
    with pytest.raises(TypeError, match="int64"):
        nt.rms_norm(torch.ones(3, 8, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="num_groups"):
        nt.group_norm(torch.randn(2, 6, 3), 4)


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_errors_name_the_input_as_the_signature_does(grad):
    """torch.nn.functional's names: the input is ``input`` in these functions' signatures and
    in their errors (which said `x`, a keyword they refuse), on every path; the fused ones keep
    numbanorm's ``x``."""
    x = torch.randn(2, 3, 4, requires_grad=grad)
    cases = [(lambda: nt.layer_norm(x.detach().int(), 4), TypeError, "`input` has dtype int32"),
             (lambda: nt.layer_norm(x, 5), ValueError, "dimensions of input of shape"),
             (lambda: nt.LayerNorm(5)(x), ValueError, "dimensions of input of shape"),
             (lambda: nt.rms_norm(x, ()), ValueError, "for input of shape"),
             (lambda: nt.group_norm(x, 2), ValueError, "channels of input of shape"),
             (lambda: nt.group_norm(x[0, 0], 1), ValueError, "expects input of shape"),
             (lambda: nt.add_rms_norm(x, x[:1], 4), ValueError, "expected x's shape")]
    for call, exc, says in cases:
        with pytest.raises(exc) as info:
            call()
        assert says in str(info.value)


def test_a_missing_input_is_numbanorms_type_error():
    """None for the input (or the residual) was an AttributeError from deep inside the call
    ('NoneType' object has no attribute 'is_inference')."""
    x = torch.randn(3, 8)
    for call, name in [(lambda: nt.layer_norm(None, 8), "input"), (lambda: nt.rms_norm(None, 8), "input"),
                       (lambda: nt.group_norm(None, 2), "input"), (lambda: nt.LayerNorm(8)(None), "input"),
                       (lambda: nt.add_rms_norm(None, x, 8), "x"),
                       (lambda: nt.add_layer_norm(x, None, 8), "residual")]:
        with pytest.raises(TypeError, match=f"`{name}` must be a tensor, got None"):
            call()


SECOND = {  # each operation as a function of its differentiable arguments, float64
    "layer_norm": (lambda x, r, w, b: nt.layer_norm(x, (8,), w, b), True),
    "rms_norm": (lambda x, r, w, b: nt.rms_norm(x, (8,), w), False),
    "rms_norm eps None": (lambda x, r, w, b: nt.rms_norm(x, (8,), w, None), False),
    "group_norm": (lambda x, r, w, b: nt.group_norm(x.reshape(3, 4, 2), 2, w[:4], b[:4]), True),
    "add_layer_norm": (lambda x, r, w, b: nt.add_layer_norm(x, r, 8, w, b), True),
    "add_rms_norm": (lambda x, r, w, b: nt.add_rms_norm(x, r, 8, w), False),
}


@pytest.mark.parametrize("name", SECOND)
def test_second_derivatives(name):
    """A backward that records its own graph (create_graph=True) is differentiable again:
    gradgradcheck, every operation (it raised: the backward was once_differentiable)."""
    f, bias = SECOND[name]
    x, r, w, b = t64(3, 8), t64(3, 8, seed=2), t64(8, seed=3, low=0.5), t64(8, seed=4)
    args = (x, r, w, b) if bias else (x, r, w)
    call = (lambda x, r, w, b: f(x, r, w, b)) if bias else (lambda x, r, w: f(x, r, w, None))
    assert torch.autograd.gradgradcheck(call, args)


BATCHED = {  # each operation as a function of its differentiable arguments, and their shapes
    "layer_norm": (lambda x, w, b: nt.layer_norm(x, (8,), w, b), [(3, 8), (8,), (8,)]),
    "rms_norm": (lambda x, w: nt.rms_norm(x, (8,), w), [(3, 8), (8,)]),
    "group_norm": (lambda x, w, b: nt.group_norm(x, 3, w, b), [(2, 6, 4), (6,), (6,)]),
    "add_layer_norm": (lambda x, r, w, b: nt.add_layer_norm(x, r, 8, w, b), [(3, 8), (3, 8), (8,), (8,)]),
    "add_rms_norm": (lambda x, r, w: nt.add_rms_norm(x, r, 8, w), [(3, 8), (3, 8), (8,)]),
}


@pytest.mark.parametrize("name", BATCHED)
def test_batched_gradients(name):
    """Gradients that torch batches with its legacy vmap (autograd.grad's is_grads_batched,
    jacobian(vectorize=True), gradcheck's check_batched_grad) are those of one call per
    grad_output, to the bit; they raised (no batching rule for aten::detach)."""
    f, shapes = BATCHED[name]
    inputs = [t64(*s, seed=i, low=0.5 if i == len(shapes) - 1 and name.endswith("rms_norm") else None)
              for i, s in enumerate(shapes)]
    outs = f(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    vs = [t64(5, *o.shape, seed=10 + k, requires_grad=False) for k, o in enumerate(outs)]
    got = torch.autograd.grad(outs, inputs, vs, is_grads_batched=True, retain_graph=True)
    for i in range(5):
        want = torch.autograd.grad(outs, inputs, [v[i] for v in vs], retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w, rtol=0, atol=0)
    detached = tuple(a.detach() for a in inputs)
    torch.testing.assert_close(torch.autograd.functional.jacobian(f, detached, vectorize=True),
                               torch.autograd.functional.jacobian(f, detached), rtol=0, atol=0)
    assert torch.autograd.gradcheck(f, inputs, check_batched_grad=True)


@pytest.mark.parametrize("shape", [(3, 8), (1, 16)])  # (1, 16): a small call by its plan, recorded
def test_a_gradient_penalty_matches_torchs(shape):
    """d/dx of |d(sum y^3)/dx|^2 through LayerNorm, as a WGAN-GP or a Hessian-vector product
    takes it, against torch's own LayerNorm; repeated, so that later calls run by their plan."""
    n = shape[1]
    w, b = t64(n, seed=3, low=0.5), t64(n, seed=4)
    got = []
    for fn in (nt.layer_norm, F.layer_norm, nt.layer_norm):
        x = t64(*shape)
        (gx,) = torch.autograd.grad(fn(x, (n,), w, b).pow(3).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        got.append(x.grad)
    torch.testing.assert_close(got[0], got[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2], got[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["layer_norm", "group_norm", "add_layer_norm"])
def test_a_recorded_backward_sums_dbias_in_the_bias_dtype(name, dtype):
    """create_graph=True gives a float32 bias of a 16-bit x the dbias of create_graph=False,
    in float32: to the bit where the float32 sums of dy are exact (dy on a coarse grid), else
    to float32's rounding of them (the kernels and torch's sum add in different orders); the
    recorded backward rounded the sums to dy's 16-bit dtype (off by 0.03 in bfloat16)."""
    g = torch.Generator().manual_seed(0)
    shape = (16, 32, 4) if name == "group_norm" else (64, 32)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w, b = torch.rand(32, generator=g).add(0.5).requires_grad_(), torch.randn(32, generator=g).requires_grad_()
    f = {"layer_norm": lambda: nt.layer_norm(x, (32,), w, b), "group_norm": lambda: nt.group_norm(x, 8, w, b),
         "add_layer_norm": lambda: nt.add_layer_norm(x, x.detach().cos(), 32, w, b)[0]}[name]
    dy = torch.randn(*shape, generator=g)
    for dy, exact in (((dy * 16).round() / 16).to(dtype), True), (dy.to(dtype), False):
        db = [torch.autograd.grad(f(), b, dy, create_graph=graph)[0] for graph in (False, True)]
        assert db[0].dtype == db[1].dtype == torch.float32
        if exact:
            torch.testing.assert_close(db[1], db[0], rtol=0, atol=0)
            torch.testing.assert_close(db[0].double(), dy.double().sum([d for d in range(x.dim()) if d != 1]),
                                       rtol=0, atol=0)
        else:
            torch.testing.assert_close(db[1], db[0])


def test_eps_as_a_0_d_tensor_is_its_value():
    """eps as a 0-d tensor, which torch.nn.functional's layer_norm, rms_norm and group_norm take
    as its value: the same output as the float (it was a TypeError); a tensor torch refuses
    (one that requires grad, or of one dimension) and a bool stay TypeErrors."""
    x = torch.randn(2, 6, 4)
    for fn in (lambda e: nt.layer_norm(x, (4,), eps=e), lambda e: nt.rms_norm(x, (4,), eps=e),
               lambda e: nt.group_norm(x, 3, eps=e), lambda e: nt.add_layer_norm(x, x, 4, eps=e)[0]):
        for e in (torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64)):
            torch.testing.assert_close(fn(e), fn(0.25), rtol=0, atol=0)
        torch.testing.assert_close(fn(torch.tensor(1)), fn(1.0), rtol=0, atol=0)
        for e in (torch.tensor(0.25, requires_grad=True), torch.tensor([0.25]), torch.tensor(True)):
            with pytest.raises(TypeError, match="eps"):
                fn(e)


def test_non_tensor_arguments_are_type_errors():
    x = torch.randn(3, 8)
    with pytest.raises(TypeError, match="`weight` is a numpy.ndarray.*torch tensors"):
        nt.layer_norm(x, (8,), np.ones(8))
    with pytest.raises(TypeError, match="`residual` is a list"):
        nt.add_rms_norm(x, [1.0] * 8, 8)
    with pytest.raises(TypeError, match="eps"):
        nt.rms_norm(x, 8, eps="small")


@pytest.mark.parametrize("call", [
    lambda x: nt.layer_norm(x, 64.0), lambda x: nt.layer_norm(x, (64.0,)), lambda x: nt.rms_norm(x, [Fraction(64)]),
    lambda x: nt.layer_norm(x, "ab"), lambda x: nt.group_norm(x.reshape(4, 8, 8), 2.0),
    lambda x: nt.group_norm(x.reshape(4, 8, 8), True), lambda x: nt.add_rms_norm(x, x, 64.0),
], ids=["64.0", "(64.0,)", "[Fraction]", "str", "groups 2.0", "groups True", "fused 64.0"])
def test_a_call_gets_one_answer_on_every_path(call):
    """The same arguments get numbanorm's TypeError whether the call runs its operator (x
    requires grad) or not; the operator's schema would refuse a float otherwise, and take
    a bool as a group count."""
    x = torch.randn(4, 64)
    answers = set()
    for grad in (False, True):
        with pytest.raises(TypeError, match="normalized_shape|num_groups") as e:
            call(x.clone().requires_grad_(grad))
        answers.add(str(e.value))
    assert len(answers) == 1, answers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 8, 5, 6), (2, 8, 3, 4, 5), (1, 8, 5, 6)], ids=["4d", "5d", "one-sample"])
def test_group_norm_keeps_channels_last(shape, dtype):
    """A channels_last x stays channels_last through GroupNorm on the CPU, forward and backward,
    as in torch.nn.functional.group_norm: the CPU kernels take it in that order (no copy).  The
    operators' fake outputs have the real ones' strides (opcheck), so a compiled call agrees."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = torch.randn(shape).to(dtype=dtype, memory_format=fmt).requires_grad_()
    w, b = (torch.randn(8, dtype=dtype, requires_grad=True) for _ in range(2))
    y, yt = nt.group_norm(x, 4, w, b), F.group_norm(x, 4, w, b)
    assert y.is_contiguous(memory_format=fmt) and yt.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(y, yt)
    g = torch.randn(shape, dtype=dtype)
    got, want = torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(yt, (x, w, b), g)
    assert got[0].is_contiguous(memory_format=fmt)
    if dtype == torch.bfloat16:  # torch's bfloat16 dweight strays past 2e-2 on some draws: the oracle's
        f64 = [t.detach().double().numpy() for t in (g, x, w, b)]
        _, mean, rstd = ORACLE.group_norm_forward(f64[1], 4, f64[2], f64[3])
        want = [torch.from_numpy(np.asarray(r)).reshape(a.shape).to(dtype)
                for r, a in zip(ORACLE.group_norm_backward(f64[0], f64[1], mean, rstd, f64[2]), got)]
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))
    ops, xd, wd, bd = torch.ops.numbanorm, x.detach(), w.detach(), b.detach()
    torch.library.opcheck(ops.group_norm_forward, (x, 4, w, b, 1e-5))
    _, mean, rstd = ops.group_norm_forward(xd, 4, wd, bd, 1e-5)
    torch.library.opcheck(ops.group_norm_backward, (g, xd, mean, rstd, wd))
    f = torch.compile(lambda x, w, b: nt.group_norm(x, 4, w, b) * 2, fullgraph=True)
    yc = f(x, w, b)
    assert yc.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(yc, 2 * y, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(yc, (x, w, b), g), tuple(2 * a for a in got), rtol=0, atol=0)


# ------------------------------------------------------------ custom operators, torch.compile

def _opcheck_cases(xdt, wdt):
    """(operator, args) for every operator numbanorm registers, x non-contiguous."""
    ops = torch.ops.numbanorm
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype=xdt, grad=True):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    x = t(5, 4, 3).transpose(0, 2)  # (3, 4, 5), strided
    r, dy = t(3, 4, 5), t(3, 4, 5, grad=False)
    w, b = t(4, 5, dtype=wdt), t(4, 5, dtype=wdt)
    with torch.no_grad():
        _, mean, rstd = ops.layer_norm_forward(x, [4, 5], w, b, 1e-5)
        _, rrstd = ops.rms_norm_forward(x, [5], w[0], None)
        _, gmean, grstd = ops.group_norm_forward(x, 2, w[:, 0], b[:, 0], 1e-5)
        _, s, amean, arstd = ops.add_layer_norm_forward(x, r, [5], w[0], b[0], 1e-5)
        _, s2, arrstd = ops.add_rms_norm_forward(x, r, [5], w[0], 1e-6)
    xd, w0, wc = x.detach(), w[0].detach(), w[:, 0].detach()
    return [
        (ops.layer_norm_forward, (x, [4, 5], w, b, 1e-5)),
        (ops.layer_norm_backward, (dy, xd, mean, rstd, [4, 5], w.detach())),
        (ops.rms_norm_forward, (x, [5], w0.clone().requires_grad_(), None)),
        (ops.rms_norm_backward, (dy, xd, rrstd, [5], None)),
        (ops.group_norm_forward, (x, 2, wc.clone().requires_grad_(), None, 1e-5)),
        (ops.group_norm_backward, (dy, xd, gmean, grstd, wc)),
        (ops.add_layer_norm_forward, (x, r, [5], w0.clone().requires_grad_(), b[0].detach(), 1e-5)),
        (ops.add_layer_norm_backward, (dy, 2 * dy, s, amean, arstd, [5], w0)),
        (ops.add_rms_norm_forward, (x, r, [5], None, 1e-6)),
        (ops.add_rms_norm_backward, (dy, None, s2, arrstd, [5], w0)),
    ]


@pytest.mark.parametrize("xdt,wdt", [(torch.float64, torch.float64), (torch.float16, torch.float32)],
                         ids=["f64", "f16-w32"])
def test_opcheck_every_operator(xdt, wdt):
    """Schema, autograd registration, fake shapes/dtypes/strides against the real ones, AOT dispatch."""
    cases = _opcheck_cases(xdt, wdt)
    assert {op._qualified_op_name for op, _ in cases} == {op._qualname for op in nt.OPERATORS}
    for op, args in cases:
        torch.library.opcheck(op, args)


class AllNorms(torch.nn.Module):
    """Every numbanorm module and fused function in one block."""

    def __init__(self, d=16):
        super().__init__()
        self.ln = nt.LayerNorm(d, dtype=torch.float64)
        self.rms = nt.RMSNorm(d, dtype=torch.float64)
        self.gn = nt.GroupNorm(4, d, dtype=torch.float64)
        self.lin = torch.nn.Linear(d, d, dtype=torch.float64)

    def forward(self, x, r):
        h = self.lin(self.ln(x))
        y, s = nt.add_rms_norm(h, r, h.shape[-1], self.rms.weight)
        y, s = nt.add_layer_norm(y, s, h.shape[-1], self.ln.weight, self.ln.bias)
        g = self.gn(y.transpose(1, 2)).transpose(1, 2)
        return self.rms(g + s)


def test_compile_fullgraph_forward_and_backward():
    """Before the custom operators, dynamo stopped at NumPy inside the autograd functions."""
    torch.manual_seed(0)
    block = AllNorms()
    _perturb(block)
    with torch.no_grad():
        block.ln.weight.add_(0.3 * torch.randn_like(block.ln.weight))
        block.rms.weight.add_(0.3 * torch.randn_like(block.rms.weight))
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    x, r = t64(2, 5, 16), t64(2, 5, 16, seed=3)
    xc, rc = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    y, yc = block(x, r), compiled(xc, rc)
    torch.testing.assert_close(yc, y)
    g = t64(2, 5, 16, seed=4, requires_grad=False)
    params = list(block.parameters())
    want = torch.autograd.grad((y * g).sum(), [x, r, *params])
    got = torch.autograd.grad((yc * g).sum(), [xc, rc, *params])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_a_bool_size_is_a_type_error_under_compile_too():
    """torch.compile skips the size checks that would pin a traced size, and a bool
    ``normalized_shape`` or ``num_groups`` (read as 1) ran there; eagerly it is a TypeError."""
    x = torch.randn(3, 4, 5)
    for call, name in ((lambda x: nt.layer_norm(x[..., :1], (True,)), "normalized_shape"),
                       (lambda x: nt.group_norm(x, True), "num_groups")):
        with pytest.raises(TypeError, match=name):
            call(x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"`{name}` must be an int"):  # (Dynamo's error, naming it)
            torch.compile(call, backend="eager", fullgraph=True)(x)


# ------------------------------------------------------------ modules

@pytest.mark.parametrize("ours,theirs,args,kwargs", [
    (nt.LayerNorm, torch.nn.LayerNorm, ((4, 6),), {"eps": 1e-6}),
    (nt.LayerNorm, torch.nn.LayerNorm, (6,), {"bias": False}),
    (nt.LayerNorm, torch.nn.LayerNorm, (6,), {"elementwise_affine": False}),
    (nt.RMSNorm, torch.nn.RMSNorm, (6,), {}),
    (nt.RMSNorm, torch.nn.RMSNorm, ([4, 6],), {"eps": 1e-5, "elementwise_affine": False}),
    (nt.GroupNorm, torch.nn.GroupNorm, (2, 4), {}),
    (nt.GroupNorm, torch.nn.GroupNorm, (4, 4), {"affine": False}),
])
def test_modules_are_their_namesakes(ours, theirs, args, kwargs):
    a = ours(*args, **kwargs, dtype=torch.float64, device="cpu")
    ref = theirs(*args, **kwargs, dtype=torch.float64, device="cpu")
    assert isinstance(a, theirs)
    assert repr(a) == repr(ref).replace(theirs.__name__, ours.__name__, 1)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with torch.no_grad():  # non-trivial parameters, then a state_dict round trip both ways
        for p in ref.parameters():
            p.copy_(torch.rand_like(p) + 0.5)
    a.load_state_dict(ref.state_dict())
    ref2 = theirs(*args, **kwargs, dtype=torch.float64)
    ref2.load_state_dict(a.state_dict())
    x = t64(2, 4, 6)
    ya, yr = a(x), ref(x)
    torch.testing.assert_close(ya, yr)
    torch.testing.assert_close(ref2(x), yr)
    name = list(inspect.signature(theirs.forward).parameters)[1]  # torch's name for the input: by keyword too
    assert list(inspect.signature(ours.forward).parameters) == ["self", name]
    torch.testing.assert_close(a(**{name: x}), ya, rtol=0, atol=0)
    g = t64(2, 4, 6, seed=7, requires_grad=False)
    ga = torch.autograd.grad((ya * g).sum(), [x, *a.parameters()])
    gr = torch.autograd.grad((yr * g).sum(), [x, *ref.parameters()])
    for u, v in zip(ga, gr):
        torch.testing.assert_close(u, v)
    a.reset_parameters()
    ref.reset_parameters()
    for p, q in zip(a.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


class Block(torch.nn.Module):
    """A pre-norm transformer block without attention: norm, MLP, residual; twice."""

    def __init__(self, d, dtype):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(d, dtype=dtype)
        self.mlp1 = torch.nn.Sequential(torch.nn.Linear(d, 4 * d, dtype=dtype), torch.nn.GELU(),
                                        torch.nn.Linear(4 * d, d, dtype=dtype))
        self.norm2 = torch.nn.RMSNorm(d, dtype=dtype)
        self.mlp2 = torch.nn.Linear(d, d, dtype=dtype)
        self.norm_out = torch.nn.LayerNorm(d, dtype=dtype)

    def forward(self, x):
        x = x + self.mlp1(self.norm1(x))
        x = x + self.mlp2(self.norm2(x))
        return self.norm_out(x)


class ConvNet(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, dtype=dtype), torch.nn.GroupNorm(2, 8, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1, dtype=dtype), torch.nn.GroupNorm(8, 8, dtype=dtype),  # instance
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5, dtype=dtype))

    def forward(self, x):
        return self.net(x)


def _perturb(model):
    """Norm weights and biases away from ones/zeros, so their gradients are exercised."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm)):
                for p in m.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("make,shape", [(lambda dt: Block(32, dt), (4, 7, 32)),
                                        (lambda dt: ConvNet(dt), (3, 3, 9, 9))], ids=["block", "convnet"])
def test_models_with_swapped_norms(dtype, make, shape):
    torch.manual_seed(0)
    ref = make(dtype)
    _perturb(ref)
    ours = nt.replace_norms(copy.deepcopy(ref))
    kinds = {type(m) for m in ours.modules()}
    assert kinds & {nt.LayerNorm, nt.RMSNorm, nt.GroupNorm}
    assert not kinds & {torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm}
    x = torch.randn(*shape, dtype=dtype)
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yr = ours(xa), ref(xr)
    tol = TOL[np.float32 if dtype == torch.float32 else np.float64]
    # float32: ulp-level differences in the norms pass through a few layers
    close = dict(rtol=10 * tol, atol=10 * tol)
    torch.testing.assert_close(ya, yr, **close)
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yr * g).sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad, **close)
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **close, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("shape", [(4, 7, 32), (40, 40, 32)], ids=["small calls", "large calls"])
def test_activation_checkpointing(shape, reentrant):
    """torch.utils.checkpoint around a block of swapped norms, three steps (a first call, then
    calls by their plan): the gradients are torch's.  Without reentrance, checkpointing counts
    the tensors a forward saves and its recomputation saves again; a LayerNorm's first call
    saved its statistics and its calls by plan kept them on ctx, and the first step raised."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ref = Block(32, torch.float64)
    _perturb(ref)
    ours = nt.replace_norms(copy.deepcopy(ref))
    for step in range(3):
        x = torch.randn(*shape, dtype=torch.float64)
        got = []
        for model in (ours, ref):
            model.zero_grad()
            xx = x.clone().requires_grad_()
            checkpoint(model, xx, use_reentrant=reentrant).pow(2).sum().backward()
            got.append([xx.grad, *(p.grad for p in model.parameters())])
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class _Positive(torch.nn.Module):
    def forward(self, w):
        return w.abs() + 0.5


@pytest.mark.parametrize("make,shape", [(lambda: torch.nn.LayerNorm(8, dtype=torch.float64), (3, 8)),
                                        (lambda: torch.nn.RMSNorm(8, dtype=torch.float64), (3, 8)),
                                        (lambda: torch.nn.GroupNorm(2, 4, dtype=torch.float64), (3, 4, 5))],
                         ids=["LayerNorm", "RMSNorm", "GroupNorm"])
def test_parametrized_norms_are_replaced(make, shape):
    """A norm whose weight torch.nn.utils.parametrize computes (its parametrizations are its
    children) was skipped without a word: neither replaced nor reported.  Now replaced: the
    same outputs and gradients (to the parametrization's original too), the same
    state_dict, deepcopy, and removing the parametrization leaves numbanorm's class."""
    parametrize = torch.nn.utils.parametrize
    torch.manual_seed(0)
    ref = make()
    parametrize.register_parametrization(ref, "weight", _Positive())
    model = torch.nn.Sequential(copy.deepcopy(ref))
    ours, report = nt.replace_norms(model, report=True)
    norm = ours[0]
    assert [r[0] for r in report.replaced] == ["0"] and report.left_alone == []
    assert isinstance(norm, (nt.LayerNorm, nt.RMSNorm, nt.GroupNorm)) and parametrize.is_parametrized(norm)
    assert isinstance(norm, type(ref).__bases__[0])
    x = t64(*shape)
    for m in (norm, copy.deepcopy(norm)):
        torch.testing.assert_close(m(x), ref(x))
    g = t64(*shape, seed=7, requires_grad=False)
    got = torch.autograd.grad((norm(x) * g).sum(), [x, *norm.parameters()])
    want = torch.autograd.grad((ref(x) * g).sum(), [x, *ref.parameters()])
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v)
    assert list(norm.state_dict()) == list(ref.state_dict())
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) in (nt.LayerNorm, nt.RMSNorm, nt.GroupNorm)
    torch.testing.assert_close(norm(x), ref(x))


def test_a_replaced_parametrized_norm_is_freed_with_its_model():
    """torch's parametrize makes a class per module, whose properties' closures hold the
    module: a replacement class kept by numbanorm for each kept every replaced parametrized
    norm, its parameters and their parametrizations alive for the life of the process."""
    import gc
    import weakref

    parametrize = torch.nn.utils.parametrize
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    parametrize.register_parametrization(model[1], "weight", _Positive())
    original = weakref.ref(model[1].parametrizations.weight.original)
    nt.replace_norms(model)
    assert isinstance(model[1], nt.LayerNorm)
    model(torch.randn(3, 8)).sum().backward()
    del model
    gc.collect()
    assert original() is None, "the replaced norm's parameter outlived its model"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_leaves_its_tensors_storage_resizable(dtype):
    """A CPU tensor crosses to NumPy without ``Tensor.numpy()``, which marks its storage
    unresizable for good (FSDP frees a parameter's unsharded storage by resizing it): after
    a first call's forward and backward (the full path), a large one's, and the top level's
    on tensors, every input's storage still resizes, as after torch's own norm."""
    if dtype is torch.bfloat16:
        pytest.importorskip("ml_dtypes")
    import numbanorm

    for shape in ((3, 8), (300, 1024)):
        x = torch.randn(shape).to(dtype).requires_grad_()
        w, b = (torch.rand(shape[-1]).to(dtype).requires_grad_() for _ in range(2))
        nt.layer_norm(x, shape[-1:], w, b).sum().backward()
        with torch.no_grad():
            nt.rms_norm(x, shape[-1:], w)
        numbanorm.layer_norm(x.detach(), shape[-1], w.detach(), b.detach())
        for t in (x, w, b):
            t.untyped_storage().resize_(0)  # RuntimeError: Trying to resize storage that is not resizable
    with pytest.raises(TypeError, match="`x` is a torch.Tensor on meta"):  # (torch's NotImplementedError)
        numbanorm.layer_norm(torch.empty(2, 3, device="meta"), 3)


def _gloo_group_or_skip():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo needed")
    return dist


def test_fully_sharded_training_matches_torchs_norms(tmp_path):
    """FSDP2 (``fully_shard``, gloo, one rank) frees each unsharded parameter by resizing its
    storage after the forward: a step with numbanorm's norms raised 'Trying to resize storage
    that is not resizable'.  Three steps now give torch's norms' losses and parameters."""
    dist = _gloo_group_or_skip()
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("fully_shard needed")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        runs = []
        for norm in (torch.nn.LayerNorm, nt.LayerNorm):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16, dtype=torch.float64), norm(16, dtype=torch.float64),
                                        torch.nn.Linear(16, 4, dtype=torch.float64))
            fsdp.fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for _ in range(3):
                loss = model(torch.randn(5, 8, dtype=torch.float64)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs.append((losses, [p.full_tensor().detach().clone() for p in model.parameters()]))
    finally:
        dist.destroy_process_group()
    (want, want_params), (got, got_params) = runs
    assert got == pytest.approx(want, rel=1e-12)
    for a, e in zip(got_params, want_params):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_dtensors_of_one_rank(tmp_path):
    """Tensor and sequence parallelism: DTensor inputs raised "Operator
    numbanorm.layer_norm_forward.default does not have a sharding strategy registered".
    Each norm now runs on DTensors split along each dimension, as on plain tensors
    (``_sharded.check``), here on one gloo rank; two ranks: the slow set."""
    dist = _gloo_group_or_skip()
    from torch.distributed.device_mesh import init_device_mesh
    from _sharded import check

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        check(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # (two fresh processes)
def test_dtensors_of_two_ranks(tmp_path):
    """``_sharded.check`` on each of two gloo ranks: each holds half of the split
    dimension, and the weight's gradient is the sum of the two ranks' parts."""
    import os
    import subprocess
    import sys

    _gloo_group_or_skip()
    script = os.path.join(os.path.dirname(__file__), "_sharded.py")
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, script, str(rank), "2", str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [o[-3000:] for o in outs]


def test_replace_norms_shares_parameters():
    model = Block(8, torch.float32)
    params = {n: p for n, p in model.named_parameters()}
    out = nt.replace_norms(model)
    assert out is model and isinstance(model.norm1, nt.LayerNorm) and isinstance(model.norm2, nt.RMSNorm)
    for n, p in model.named_parameters():
        assert p is params[n]
    assert isinstance(nt.replace_norms(torch.nn.GroupNorm(2, 4)), nt.GroupNorm)


def test_a_norm_called_through_its_own_instance_is_left_alone():
    """A norm whose call runs something bound to the instance: ``Module.compile``'s compiled
    call, or a forward set on the instance (accelerate's hooks, which from_pretrained's
    device_map adds, wrap the old forward so).  Copied onto its replacement, either kept
    running the original forward, while the report said replaced; such a norm is now left
    alone, with the reason, and kept.  So is a norm that torch.compile wraps whole, whose
    compiled call runs the original's forward."""
    import functools

    x = torch.randn(3, 8)
    compiled, hooked, plain = torch.nn.RMSNorm(8), torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
    compiled.compile(backend="eager")
    hooked._old_forward = hooked.forward
    hooked.forward = functools.partial(lambda module, x: module._old_forward(x) + 0, hooked)
    model = torch.nn.Sequential(compiled, hooked, plain)
    want = model(x)
    _, report = nt.replace_norms(model, report=True)
    assert [r[0] for r in report.replaced] == ["2"] and model[0] is compiled and model[1] is hooked
    assert [(p, why.split(":")[0].split(",")[0]) for p, _, why in report.left_alone] == [
        ("0", "Module.compile compiled its own forward"), ("1", "its forward is set on the instance (a hook's")]
    assert isinstance(model[2], nt.LayerNorm)
    torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="Module.compile"):
        nt.replace_norms(torch.nn.Sequential(compiled), strict=True)
    wrapped = torch.compile(torch.nn.LayerNorm(8), backend="eager")  # (its _orig_mod: a child)
    _, report = nt.replace_norms(wrapped, report=True)
    assert report.replaced == [] and [p for p, _, _ in report.left_alone] == ["_orig_mod"]
    assert "torch.compile wraps it" in report.left_alone[0][2] and type(wrapped._orig_mod) is torch.nn.LayerNorm


def test_a_norm_under_two_names_is_replaced_under_both():
    """A norm a parent holds under two names (as a norm two parents share) is one numbanorm
    module under each, reported once."""
    model = torch.nn.Module()
    model.a = torch.nn.LayerNorm(8)
    model.b = model.a
    model.c = torch.nn.Sequential(model.a)
    _, report = nt.replace_norms(model, report=True)
    assert isinstance(model.a, nt.LayerNorm) and model.b is model.a and model.c[0] is model.a
    assert [p for p, _, _ in report.replaced] == ["a"]


# ------------------------------------------------------------ torch.func, forward-mode AD

# each operation, ours and torch's, as a function of (x, weight, bias), float64; the fused
# ones return y + s, their residual a function of x (so that vmap maps it with x)
FUNC = {
    "layer_norm": (lambda x, w, b: nt.layer_norm(x, (8,), w, b), lambda x, w, b: F.layer_norm(x, (8,), w, b),
                   (3, 4, 8), (8,)),
    "layer_norm 2-D": (lambda x, w, b: nt.layer_norm(x, (4, 8), w, b), lambda x, w, b: F.layer_norm(x, (4, 8), w, b),
                       (3, 4, 8), (4, 8)),
    "layer_norm of one row": (lambda x, w, b: nt.layer_norm(x, (8,), w, b),
                              lambda x, w, b: F.layer_norm(x, (8,), w, b), (8,), (8,)),
    "rms_norm": (lambda x, w, b: nt.rms_norm(x, (8,), w, 1e-6), lambda x, w, b: F.rms_norm(x, (8,), w, 1e-6),
                 (3, 4, 8), (8,)),
    "group_norm": (lambda x, w, b: nt.group_norm(x, 3, w, b), lambda x, w, b: F.group_norm(x, 3, w, b),
                   (2, 6, 3, 5), (6,)),
    "add_layer_norm": (lambda x, w, b: sum(nt.add_layer_norm(x, x.sin(), (8,), w, b)),
                       lambda x, w, b: F.layer_norm(x + x.sin(), (8,), w, b) + (x + x.sin()), (3, 4, 8), (8,)),
    "add_rms_norm": (lambda x, w, b: sum(nt.add_rms_norm(x, x.cos(), (8,), w)),
                     lambda x, w, b: F.rms_norm(x + x.cos(), (8,), w, torch.finfo(x.dtype).eps) + (x + x.cos()),
                     (3, 4, 8), (8,)),
}
func = torch.func


@contextlib.contextmanager
def batching_rules_only():
    """vmap without its per-sample fallback: an operator with no batching rule raises
    (the fallback gives the same values, one call a sample, and its warning is off by default)."""
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(True)


def _scalar(f):
    return lambda *a: f(*a).sin().sum()


TRANSFORMS = {  # name -> (transform of f, given the arguments (x, w, b))
    "grad": lambda f, x, w, b: func.grad(_scalar(f), argnums=(0, 1, 2))(x, w, b),
    "grad of grad": lambda f, x, w, b: func.grad(lambda x: func.grad(_scalar(f))(x, w, b).pow(2).sum())(x),
    "vjp": lambda f, x, w, b: func.vjp(f, x, w, b)[1](torch.ones_like(f(x, w, b)) / 3),
    "jacrev": lambda f, x, w, b: func.jacrev(f, argnums=(0, 1, 2))(x, w, b),
    "jvp": lambda f, x, w, b: func.jvp(f, (x, w, b), (x.cos(), w.sin(), b.cos())),
    "jacfwd": lambda f, x, w, b: func.jacfwd(f, argnums=(0, 1, 2))(x, w, b),
    "hessian": lambda f, x, w, b: func.hessian(_scalar(f), argnums=(0, 1))(x, w, b),
    "vmap": lambda f, x, w, b: func.vmap(f, in_dims=(0, None, None))(torch.stack([x, 2 * x + 1]), w, b),
    "vmap at dimension 1": lambda f, x, w, b: func.vmap(f, in_dims=(1, None, None))(
        torch.stack([x, 2 * x + 1], 1), w, b),
    "per-sample grad": lambda f, x, w, b: func.vmap(func.grad(_scalar(f), argnums=(0, 1, 2)),
                                                    in_dims=(0, None, None))(torch.stack([x, 2 * x + 1]), w, b),
    "grad of vmap": lambda f, x, w, b: func.grad(lambda x, w, b: func.vmap(f, in_dims=(0, None, None))(x, w, b)
                                                 .sin().sum(), argnums=(0, 1, 2))(torch.stack([x, 2 * x + 1]), w, b),
    "vmap of weights": lambda f, x, w, b: func.vmap(f, in_dims=(None, 0, 0))(x, torch.stack([w, w.cos()]),
                                                                             torch.stack([b, b.sin()])),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", FUNC)
def test_torch_func_transforms_match_torchs(name, transform):
    """torch.func's transforms through every operation, against the same transform of
    torch's functions.  grad, vjp, jacrev and hessian raised (PyTorch's custom operators
    register their autograd without setup_context, which torch.func needs); jvp and
    jacfwd raised (no forward derivative); vmap warned and ran one call a sample."""
    ours, theirs, shape, pshape = FUNC[name]
    x = t64(*shape, requires_grad=False)
    w, b = t64(*pshape, seed=3, low=0.5, requires_grad=False), t64(*pshape, seed=4, requires_grad=False)
    with batching_rules_only():
        got = TRANSFORMS[transform](ours, x, w, b)
    if transform == "hessian":
        # eager autograd's, one row at a time: torch.func.hessian of torch's own layer_norm
        # (torch 2.13) has an x-weight block that finite differences disagree with
        want = torch.autograd.functional.hessian(lambda x, w: _scalar(theirs)(x, w, b), (x, w))
    else:
        want = TRANSFORMS[transform](theirs, x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", FUNC)
def test_forward_mode_ad(name):
    """torch.autograd.forward_ad's dual tensors: the tangent of y, with tangents on x,
    weight and bias; a call on dual tensors dropped the tangent without a word (y had
    none) and now matches torch's."""
    fwad = torch.autograd.forward_ad
    ours, theirs, shape, pshape = FUNC[name]
    x = t64(*shape, requires_grad=False)
    w, b = t64(*pshape, seed=3, low=0.5, requires_grad=False), t64(*pshape, seed=4, requires_grad=False)
    tangents = (x.cos(), w.sin(), b.cos())
    got = []
    for fn in (ours, theirs):
        with fwad.dual_level():
            y = fn(*(fwad.make_dual(a, t) for a, t in zip((x, w, b), tangents)))
            got.append(fwad.unpack_dual(y))
    torch.testing.assert_close(got[0].primal, got[1].primal, rtol=1e-12, atol=1e-12)
    assert got[0].tangent is not None
    torch.testing.assert_close(got[0].tangent, got[1].tangent, rtol=1e-10, atol=1e-12)


def _dual_call(fn, x, w, b, tangents):
    """fn's output tangent on dual tensors, or None where it has none."""
    fwad = torch.autograd.forward_ad
    with fwad.dual_level():
        return fwad.unpack_dual(fn(*(fwad.make_dual(a, t) for a, t in zip((x, w, b), tangents)))).tangent


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "group_norm", "add_layer_norm"])
def test_an_operator_refuses_a_tangent_it_cannot_carry(name):
    """The operators have no forward derivative (PyTorch's custom operators have none):
    called on dual tensors, directly or in a graph that torch.compile traced around a
    dual_level or torch.func.jvp, they dropped the tangent without a word (a tangent of
    None, jvp's of zeros); now they raise, and the public functions' eager forward-mode AD
    still matches torch's."""
    ours, theirs, shape, pshape = FUNC[name]
    x = t64(*shape, requires_grad=False)
    w, b = t64(*pshape, seed=3, low=0.5, requires_grad=False), t64(*pshape, seed=4, requires_grad=False)
    tangents = (x.cos(), w.sin(), b.cos())
    refusal = "has no forward derivative"
    forward = getattr(torch.ops.numbanorm, f"{name}_forward")
    if name == "group_norm":
        raw = lambda x, w, b: forward(x, 3, w, b, 1e-5)[0]  # noqa: E731
    elif name == "add_layer_norm":
        raw = lambda x, w, b: forward(x, x.sin(), [8], w, b, 1e-5)[0]  # noqa: E731
    else:
        raw = lambda x, w, b: forward(x, [8], w, *([b] if name == "layer_norm" else []), 1e-5)[0]  # noqa: E731
    with pytest.raises(NotImplementedError, match=refusal):
        _dual_call(raw, x, w, b, tangents)
    for traced in (lambda *a: _dual_call(ours, *a, tangents), lambda *a: func.jvp(ours, a, tangents)[1]):
        torch._dynamo.reset()
        with pytest.raises(NotImplementedError, match=refusal):
            torch.compile(traced, backend="eager")(x, w, b)
    torch.testing.assert_close(_dual_call(ours, x, w, b, tangents), _dual_call(theirs, x, w, b, tangents),
                               rtol=1e-10, atol=1e-12)
    want = raw(x, w, b)
    with torch.autograd.forward_ad.dual_level():  # no tangent given: nothing refused
        torch.testing.assert_close(raw(x, w, b), want, rtol=0, atol=0)


FUSED = {  # a fused operation and torch's composite of it, as functions of (x, r, w, b): (y, s)
    "add_layer_norm": (lambda x, r, w, b: nt.add_layer_norm(x, r, 8, w, b),
                       lambda x, r, w, b: (F.layer_norm(x + r, (8,), w, b), x + r)),
    "add_rms_norm": (lambda x, r, w, b: nt.add_rms_norm(x, r, 8, w),
                     lambda x, r, w, b: (F.rms_norm(x + r, (8,), w, torch.finfo(x.dtype).eps), x + r)),
}


@pytest.mark.parametrize("name", FUSED)
def test_forward_derivatives_of_the_parameters_alone(name):
    """jvp and hessian of a fused norm with respect to its weight or bias alone, where s has
    no tangent (zeros: s does not depend on them), against torch's composite; it raised
    (autograd's internal assert on the None tangent of s)."""
    x, r = t64(3, 8, requires_grad=False), t64(3, 8, seed=2, requires_grad=False)
    w, b = t64(8, seed=3, low=0.5, requires_grad=False), t64(8, seed=4, requires_grad=False)
    got, want = ([func.jvp(lambda w: f(x, r, w, b), (w,), (w.cos(),)),
                  func.jvp(lambda b: f(x, r, w, b), (b,), (b.sin(),)),
                  func.hessian(lambda w: (f(x, r, w, b)[0] ** 2).sum())(w)] for f in FUSED[name])
    if name == "add_rms_norm":  # (no bias)
        got, want = [got[0], got[2]], [want[0], want[2]]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "group_norm", "add_layer_norm"])
def test_vmap_is_one_call_of_the_samples_rows(name, dtype):
    """vmap folds the mapped dimension into the rows, one kernel call for the batch: y and,
    through a per-sample gradient (the kernels' backward: nothing differentiates it again),
    dx are to the bit those of calling each sample alone; each sample's dweight and dbias
    (PyTorch's sums on the saved statistics) within the dtype's tolerance of its own call's."""
    ours, _, shape, pshape = FUNC[name]
    xs = torch.stack([t64(*shape, seed=s, requires_grad=False) for s in range(3)]).to(dtype)
    w, b = t64(*pshape, seed=3, low=0.5, requires_grad=False).to(dtype), t64(*pshape, seed=4, requires_grad=False)
    b = b.to(dtype)
    grads = func.vmap(func.grad(lambda x, w, b: ours(x, w, b).float().sin().sum(), argnums=(0, 1, 2)),
                      in_dims=(0, None, None))
    with batching_rules_only():
        y = func.vmap(ours, in_dims=(0, None, None))(xs, w, b)
        dx, dw, db = grads(xs, w, b)
    tol = TOL[np.float32] if dtype == torch.float32 else 1e-2
    for i, x in enumerate(xs):
        assert torch.equal(y[i], ours(x, w, b))
        one = [t.requires_grad_() for t in (x.clone(), w.clone(), b.clone())]
        ours(*one).float().sin().sum().backward()
        if name != "add_layer_norm":  # (its dx carries the residual's sin, taken by PyTorch under vmap)
            assert torch.equal(dx[i], one[0].grad)
        torch.testing.assert_close(dw[i], one[1].grad, rtol=tol, atol=tol)
        if one[2].grad is not None:  # (RMSNorm has no bias: torch.func gives zeros, autograd None)
            torch.testing.assert_close(db[i], one[2].grad, rtol=tol, atol=tol)


def test_vmap_alone_calls_the_operator(monkeypatch):
    """vmap with no gradient to record runs the operator and its vmap rule, without the
    Function whose generated rule doubled a (32, 128, 768) forward's time; under grad, the
    Function (the operator's autograd cannot be transformed)."""
    calls = []
    function = nt._TRANSFORMABLE["layer_norm"]
    monkeypatch.setitem(nt._TRANSFORMABLE, "layer_norm", lambda *a: calls.append(1) or function(*a))
    xs, w = torch.randn(3, 4, 8), torch.rand(8) + 0.5
    with batching_rules_only():
        y = func.vmap(lambda x: nt.layer_norm(x, (8,), w))(xs)
        assert calls == []
        torch.testing.assert_close(y, F.layer_norm(xs, (8,), w))
        func.vmap(func.grad(lambda x: nt.layer_norm(x, (8,), w).sum()))(xs)
    assert calls == [1]


def test_per_sample_gradients_of_a_model():
    """Per-sample gradients of every parameter of a model whose norms replace_norms swapped,
    by torch.func.functional_call under vmap(grad), as torch's tutorial computes them,
    against the same model with torch's norms."""
    torch.manual_seed(0)
    ref = Block(16, torch.float64)
    _perturb(ref)
    ours = nt.replace_norms(copy.deepcopy(ref))
    x, target = torch.randn(4, 5, 16, dtype=torch.float64), torch.randn(4, 5, 16, dtype=torch.float64)
    got = []
    for model in (ours, ref):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(params, x, target, model=model):
            y = func.functional_call(model, params, (x.unsqueeze(0),))
            return (y.squeeze(0) - target).pow(2).mean()

        got.append(func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, target))
    for k in got[1]:
        torch.testing.assert_close(got[0][k], got[1][k], rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_a_second_derivative_of_a_single_row():
    """create_graph=True through a 1-D input (its normalized dimensions are all it has):
    dbias came out summed to a scalar (sum over an empty list of dimensions sums all), and
    autograd refused it."""
    x, w, b = t64(8), t64(8, seed=3, low=0.5), t64(8, seed=4)
    assert torch.autograd.gradgradcheck(lambda x, w, b: nt.layer_norm(x, (8,), w, b), (x, w, b))


# ------------------------------------------------------------ GPU (real hardware only)

@pytest.mark.gpu
def test_float16_autocast_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import os

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("numba's CUDA simulator cannot take torch CUDA tensors (set NUMBANORM_TEST_GPU=1)")
    torch.manual_seed(0)
    ref = Block(64, torch.float32).cuda()
    _perturb(ref)
    ours = nt.replace_norms(copy.deepcopy(ref))
    x = torch.randn(8, 16, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        ya, yr = ours(x), ref(x)
    torch.testing.assert_close(ya.float(), yr.float(), rtol=2e-2, atol=2e-2)
    xh = x.half().requires_grad_()
    y, s = nt.add_layer_norm(xh, xh, 64, ref.norm_out.weight, ref.norm_out.bias)
    assert y.dtype == s.dtype == torch.float16 and y.device.type == "cuda"
    torch.testing.assert_close(y.float(), F.layer_norm(2 * x, (64,), ref.norm_out.weight, ref.norm_out.bias),
                               rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert xh.grad is not None and xh.grad.dtype == torch.float16


# ------------------------------------------------------------------ the cost per call

def test_the_per_call_measurement_gives_every_target_its_row():
    """benchmarks/torch_calls.py times numbanorm.torch against torch for the function and
    the module, without and with a graph, forward and backward: each of the targets of
    benchmarks/targets.py on numbanorm.torch's calls finds its row and its ratio."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's benchmarks/
    from benchmarks import targets, torch_calls

    shape = targets.TORCH_CALLS[0]
    rows = torch_calls.rows(1, shapes=(shape,), repeats=2, number=1)
    assert len(rows) == 2 * len(torch_calls.PASSES)
    mine = [t for t in targets.TARGETS if t.mode in {m for _, m in torch_calls.PASSES}]
    assert len(mine) == 6 * len(targets.TORCH_CALLS)
    ev = [e for e in targets.evaluate({"rows": rows}) if e["rule"].startswith("torch ") and "1x768" in e["case"]]
    assert len(ev) == 6 and all(e["status"] in ("PASS", "FAIL") and e["value"] > 0 for e in ev), ev
    assert "1x768 backward module_grad" in torch_calls.table(rows)


def test_the_per_call_rows_merge_into_a_targets_file(tmp_path):
    """``python -m benchmarks.torch_calls --merge STEM`` re-measures numbanorm.torch's rows of
    a targets file and keeps the rest of it (its other rows, its cold starts, its earlier
    metadata): what a change to numbanorm.torch alone re-runs."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import harness, torch_calls

    old = torch_calls.rows(1, shapes=((1, 768),), repeats=1, number=1)
    kept = dict(old[0], impl="numbanorm", mode="out", median_s=1.0)  # a kernel's row
    for r in old:
        r["median_s"] = 123.0
    harness.write_results({"meta": harness.metadata(1, note="before"), "rows": [kept, *old],
                           "cold_start": {"import_s": 0.2}}, "targets-test", tmp_path)
    assert torch_calls.main(["--threads", "1", "--budget", "0.001", "--min-repeats", "1",
                             "--merge", "targets-test", "--dir", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "targets-test.json").read_text())
    mine = [r for r in got["rows"] if r["impl"] in torch_calls.IMPLS]
    assert len(mine) == 2 * len(torch_calls.PASSES) * len(torch_calls.SHAPES)
    assert all(r["median_s"] != 123.0 for r in mine)  # every old row re-measured
    assert [r["median_s"] for r in got["rows"] if r["impl"] == "numbanorm"] == [1.0]
    assert got["cold_start"] == {"import_s": 0.2}
    assert got["meta"]["merged"][0]["note"] == "before"
