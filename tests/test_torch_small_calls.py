"""numbanorm.torch's small CPU calls by their tensors' addresses (``numbanorm._torch_addressed``):
the full path's bits, forward and backward, and every call a plan must not take."""

import linecache
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numbanorm  # noqa: E402
import numbanorm.torch as nt  # noqa: E402
from numbanorm import _torch_addressed  # noqa: E402
from numbanorm.cpu._kernels import background  # noqa: E402

slow = pytest.mark.slow
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _bits(t):
    return None if t is None else t.detach().contiguous().view(torch.uint8).numpy().copy()


def _same(a, b):
    for s, t in zip(a, b):
        assert (s is None) == (t is None)
        if s is not None:
            assert s.dtype == t.dtype and s.shape == t.shape
            np.testing.assert_array_equal(_bits(s), _bits(t))


def _no_full_path(monkeypatch):
    """From here on, a call that takes the full path (a tensor seen as a NumPy array) fails,
    except while the returned dict's "allowed" is true."""
    state = {"allowed": False}
    real = nt._arr

    def refuse(t):
        if not state["allowed"]:
            raise AssertionError("the full path ran")
        return real(t)

    monkeypatch.setattr(nt, "_arr", refuse)
    return state


def _learned(call):
    """``call()``'s results from the full path, after which its plan's entry is compiled."""
    first = call()
    call()  # (the plan's first use: its entry is handed to the compile thread, the full path answers)
    background.wait()
    return first


def _on_threads(work, count):
    """What ``work(k)`` (a generator of the wrong results it met) yields on ``count`` threads at
    once, ``k`` each thread's number, and any AssertionError it raised (the full path ran)."""
    bad = []

    def run(k):
        try:
            bad.extend(work(k))
        except AssertionError as e:
            bad.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bad


FUSED = ("add_layer_norm", "add_rms_norm")


def _inputs(op, shape, nshape, dtype, which, wdtype):
    """x, the residual (fused norms; else None), weight, bias (LayerNorms), all needing a gradient."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    r = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) if op in FUSED else None
    n = tuple(nshape)
    w = (torch.rand(*n, generator=g, dtype=torch.float64) + 0.5).to(wdtype) if which in ("weight", "both") else None
    b = torch.randn(*n, generator=g, dtype=torch.float64).to(wdtype) if which in ("bias", "both") else None
    if "rms" in op:
        b = None
    return tuple(t if t is None else t.requires_grad_() for t in (x, r, w, b))


def _forward(op, x, r, nshape, w, b, eps):
    """The outputs of ``op`` as a tuple: (y,) or (y, s)."""
    f = getattr(nt, op)
    args = {"layer_norm": (x, nshape, w, b), "rms_norm": (x, nshape, w),
            "add_layer_norm": (x, r, nshape, w, b), "add_rms_norm": (x, r, nshape, w)}[op]
    out = f(*args, eps)
    return out if isinstance(out, tuple) else (out,)


# (op, x shape, normalized shape, x dtype, affine, weights' dtype): the default set has one
# case of each kind of entry; the rest in CI's slow set
CASES = [
    ("layer_norm", (3, 5), (5,), "float32", "both", "float32"),
    ("layer_norm", (40, 24), (24,), "float32", "none", "float32"),      # two partial rows in the backward
    ("layer_norm", (2, 3, 8), (3, 8), "bfloat16", "both", "bfloat16"),  # 2-D weights
    ("rms_norm", (4, 33), (33,), "float16", "weight", "float32"),
    ("add_layer_norm", (3, 5), (5,), "float32", "both", "float32"),
    ("add_rms_norm", (4, 33), (33,), "bfloat16", "weight", "float32"),
    ("add_layer_norm", (6, 17), (17,), "bfloat16", "both", "bfloat16"),  # no plan: the launcher widens w
    pytest.param("layer_norm", (1, 768), (768,), "float64", "weight", "float64", marks=slow),
    pytest.param("layer_norm", (6, 17), (17,), "float16", "bias", "float16", marks=slow),
    pytest.param("layer_norm", (6, 17), (17,), "bfloat16", "both", "float32", marks=slow),
    pytest.param("layer_norm", (8, 4096), (4096,), "float32", "both", "float32", marks=slow),  # (parallel in the launcher)
    pytest.param("rms_norm", (5, 40), (40,), "float32", "weight", "float32", marks=slow),
    pytest.param("rms_norm", (5, 40), (40,), "bfloat16", "weight", "bfloat16", marks=slow),
    pytest.param("rms_norm", (3, 9), (9,), "float64", "none", "float64", marks=slow),
    pytest.param("add_layer_norm", (40, 24), (24,), "float16", "none", "float16", marks=slow),
    pytest.param("add_rms_norm", (5, 40), (40,), "float64", "weight", "float64", marks=slow),
]


@pytest.mark.parametrize("op,shape,nshape,dtype,which,wdtype", CASES)
def test_a_call_by_its_plan_has_the_full_paths_bits(monkeypatch, op, shape, nshape, dtype, which, wdtype):
    """Forward without a graph, forward with one, backward: the call by its plan gives every
    bit the full path gave (which gives the NumPy path's: the other tests), and the full path
    does not run where a plan is made: not for the conversions the launcher makes (a
    fused forward's 16-bit weights widened, a backward's dweight narrowed)."""
    eps = None if "rms" in op and which == "none" else 1e-5
    x, r, w, b = _inputs(op, shape, nshape, DTYPES[dtype], which, DTYPES[wdtype])
    g = torch.Generator().manual_seed(3)
    dy, ds = (torch.randn(*shape, generator=g, dtype=torch.float64).to(x.dtype) for _ in range(2))
    wrt = [t for t in (x, r, w, b) if t is not None]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    planned_forward = op not in FUSED or all(t is None or t.dtype == acc for t in (w, b))
    planned_backward = (w.dtype if w is not None else x.dtype) == acc
    full = {"allowed": False}

    def plain():
        full["allowed"] = not planned_forward
        try:
            with torch.no_grad():
                return _forward(op, x, r, nshape, w, b, eps)
        finally:
            full["allowed"] = False

    def graph():
        full["allowed"] = not planned_forward
        try:
            outs = _forward(op, x, r, nshape, w, b, eps)
            full["allowed"] = not planned_backward
            return (*outs, *torch.autograd.grad(outs, wrt, (dy, ds)[:len(outs)]))
        finally:
            full["allowed"] = False

    before = [_learned(plain), _learned(graph)]
    full = _no_full_path(monkeypatch)
    _same(before[0], plain())
    _same(before[1], graph())


def test_a_plan_keeps_the_rows_it_cannot_take_for_the_full_path():
    """A float32 row whose sum of squares overflows is the rescaling variant's: the entry
    leaves it and the call is answered by the full path, the same bits every time."""
    x = torch.full((3, 64), 3e19)
    x[1] = torch.linspace(-1, 1, 64)
    w = torch.rand(64) + 0.5
    first = _learned(lambda: nt.layer_norm(x, (64,), w))
    again = nt.layer_norm(x, (64,), w)
    assert torch.isfinite(first).all()
    _same((first,), (again,))
    _same((first,), (torch.from_numpy(numbanorm.layer_norm(x.numpy(), (64,), w.numpy())),))


def _complex_imag(shape):
    z = torch.complex(torch.randn(*shape), torch.randn(*shape))
    return torch.conj(z).imag  # a float view with the negative bit set


@pytest.mark.parametrize("case", ["transposed", "negative bit", "weight of another dtype", "too large",
                                  "weight on another device"])
def test_a_call_a_plan_cannot_take_runs_the_full_path(monkeypatch, case):
    """Tensors that are not plain C-contiguous CPU tensors of the dtypes the row function reads,
    or too many elements to run on the calling thread: never a plan (the full path answers,
    right, each time); where the full path refuses, a plan learned for the same shapes does
    not answer instead."""
    n = 16
    x, w, b = torch.randn(4, n), torch.rand(n) + 0.5, torch.randn(n)
    _learned(lambda: nt.layer_norm(x, (n,), w, b))  # a plan of these shapes and dtypes
    if case == "transposed":
        x = torch.randn(n, 4).t()
    elif case == "negative bit":
        x = _complex_imag((4, n))
        assert x.is_neg()
    elif case == "weight of another dtype":
        x, w = x.half(), w.bfloat16()
        b = None
    elif case == "too large":
        x = torch.randn(_torch_addressed.MOST // 1024 + 1, 1024)
        w, b = torch.rand(1024) + 0.5, torch.randn(1024)
    elif case == "weight on another device":
        w = torch.empty(n, device="meta")
        for _ in range(2):
            with pytest.raises(TypeError, match="CPU and CUDA tensors"):
                nt.layer_norm(x, (n,), w, b)
        return
    calls = []
    real = nt._arr

    def counted(t):
        calls.append(t)
        return real(t)

    monkeypatch.setattr(nt, "_arr", counted)
    want = torch.from_numpy(numbanorm.layer_norm(real(x).copy(), (x.shape[-1],), None if w is None else real(w).copy(),
                                                 None if b is None else real(b).copy()))
    for _ in range(3):
        calls.clear()
        got = nt.layer_norm(x, (x.shape[-1],), w, b)
        assert calls, "the call took a plan"
        _same((got,), (want,))
        background.wait()


def test_a_call_without_a_plan_is_not_planned_again(monkeypatch):
    """A key the planner refused (here: a backward whose dweight the launcher narrows to
    bfloat16) is kept as refused: its later calls take the full path without planning
    again (which had cost each such call more than torch's whole backward)."""
    planned = []
    plan = _torch_addressed.Calls._plan

    def counted(self, given, results):
        got = plan(self, given, results)
        planned.append((self.kind, got is None))
        return got

    monkeypatch.setattr(_torch_addressed.Calls, "_plan", counted)
    x, _, w, b = _inputs("layer_norm", (2, 24), (24,), torch.bfloat16, "both", torch.bfloat16)
    y = nt.layer_norm(x, (24,), w, b)
    for _ in range(3):
        torch.autograd.grad(y, (x, w, b), torch.ones_like(y), retain_graph=True)
    assert planned.count(("backward", True)) == 1, planned


def test_an_eager_call_keys_its_tensors_once(monkeypatch):
    """A functional call on plain tensors reaches the generated implementation, which makes
    its key once and hands it to the full path on a miss: the full path learns the key of
    shapes a plan may take (then the plan answers, the full path never runs), and a call
    a plan cannot take (a transposed input) reaches the full path with no key, every
    time, learning nothing."""
    learned, fulls = [], []
    learn = _torch_addressed.Calls.learn
    monkeypatch.setattr(_torch_addressed.Calls, "learn",
                        lambda self, key, args, results: learned.append(self.kind) or learn(self, key, args, results))
    real = nt._arr
    monkeypatch.setattr(nt, "_arr", lambda t: fulls.append(1) or real(t))
    w, b = torch.ones(24), torch.zeros(24)
    x = torch.randn(3, 24)
    _learned(lambda: nt.layer_norm(x, (24,), w, b))
    assert learned and set(learned) == {"plain"}, learned
    learned.clear()
    fulls.clear()
    for _ in range(3):
        nt.layer_norm(x, (24,), w, b)
    assert not learned and not fulls  # by the plan
    for _ in range(3):
        fulls.clear()
        nt.layer_norm(torch.randn(24, 3).t(), (24,), w, b)
        assert fulls, "a transposed input took a plan"
    assert not learned, learned  # (handed no key: nothing to learn)


def test_the_generated_implementation_reads_as_its_roles():
    """The implementation of each kind is one generated function of the operator's roles,
    its source in linecache (tracebacks and ``inspect`` show it), its entry called with the
    tensors' addresses in the row function's order; the recording forward saves what
    ``setup_context`` saves."""
    import inspect

    plain = inspect.getsource(nt._IMPLEMENTATIONS["layer_norm", "plain"])
    assert plain.startswith("def layer_norm_plain(x, normalized_shape, weight, bias, eps):")
    assert plain.count("key = (") == 1 and "return FULL(key, (x, normalized_shape, weight, bias, eps,))" in plain
    assert "left = entry(x.data_ptr(),\n" in plain and "y.data_ptr(),\n" in plain
    backward = inspect.getsource(nt._IMPLEMENTATIONS["add_rms_norm", "backward"])
    assert "dx = empty_like(s)" in backward and "0 if ds is None else ds.data_ptr()" in backward
    recorded = inspect.getsource(nt._RECORDING["layer_norm"].__self__.forward)
    assert "ctx.save_for_backward(x, weight)" in recorded and "ctx.stats = stats" in recorded
    assert "stats = spare.pop()" in recorded and "spare.append(stats)" in recorded
    assert "rstd = mean + step" in recorded


def test_the_recording_function_holds_what_apply_looks_up():
    """apply looks these class attributes up by name on every call: each recording Function
    holds torch's own values in its class dict (found there at once, not three classes up
    its MRO), and its setup_context stays torch's placeholder, so its forward takes ctx."""
    from torch.autograd import function

    base = function._SingleLevelFunction.__dict__
    for apply in nt._RECORDING.values():
        own = apply.__self__.__dict__
        for name in ("setup_context", "clear_saved_tensors_on_access", "boxed_grads_call"):
            assert name not in base or own[name] is base[name], name
        assert not function._is_setup_context_defined(apply.__self__.setup_context)


def test_a_recorded_call_writes_no_statistics_a_graph_still_holds(monkeypatch):
    """A recorded LayerNorm forward by its plan takes the statistics tensor of an earlier call
    again (``_torch_addressed.FREE``) only once that call's graph is gone: graphs kept alive
    keep their own, and each backward is torch's; after they are freed the next call reuses
    one (an allocation saved a call)."""
    n = 48
    w = (torch.rand(n) + 0.5).requires_grad_()
    b = torch.randn(n).requires_grad_()
    xs = [torch.randn(2, n, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(4)]
    dy = torch.randn(2, n)
    _learned(lambda: torch.autograd.grad(nt.layer_norm(xs[0], (n,), w, b), (xs[0], w, b), dy))  # both plans
    _no_full_path(monkeypatch)
    ys = [nt.layer_norm(x, (n,), w, b) for x in xs]  # every graph alive at once
    held = [y.grad_fn.stats for y in ys]
    assert len({t.data_ptr() for t in held}) == len(ys)  # none written twice
    for x, y in zip(xs, ys):
        got = torch.autograd.grad(y, (x, w, b), dy)
        want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (n,), w, b), (x, w, b), dy)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    spare = ys[-1].grad_fn.stats.data_ptr()  # the one in the plan's list
    del ys, held, y
    assert nt.layer_norm(xs[0], (n,), w, b).grad_fn.stats.data_ptr() == spare


def test_recorded_calls_on_many_threads_keep_their_own_statistics(monkeypatch):
    """Threads recording graphs by one plan at once, each keeping a few alive before their
    backwards: every gradient is its own (a statistics tensor is taken with list.pop, and
    written only where no graph holds it)."""
    n = 64
    w = (torch.rand(n) + 0.5).requires_grad_()
    b = torch.randn(n).requires_grad_()
    xs = [torch.randn(1, n, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(6)]
    dy = torch.randn(1, n)
    want = [torch.autograd.grad(torch.nn.functional.layer_norm(x, (n,), w, b), x, dy)[0] for x in xs]
    _learned(lambda: torch.autograd.grad(nt.layer_norm(xs[0], (n,), w, b), xs[0], dy))  # both plans
    _no_full_path(monkeypatch)

    def work(k):
        for r in range(100):
            picked = [(k + r + j) % len(xs) for j in range(3)]
            ys = [nt.layer_norm(xs[i], (n,), w, b) for i in picked]
            for i, y in zip(picked, ys):
                if not torch.allclose(torch.autograd.grad(y, xs[i], dy)[0], want[i], rtol=1e-5, atol=1e-5):
                    yield i

    assert not _on_threads(work, 4)


def test_calls_by_plans_on_many_threads(monkeypatch):
    """Threads calling one plan at once each get their own rows' results (each call writes
    outputs of its own; the entry holds no state)."""
    n = 96
    w, b = torch.rand(n) + 0.5, torch.randn(n)
    xs = [torch.randn(2, n, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    want = [nt.layer_norm(x, (n,), w, b) for x in xs]
    _learned(lambda: nt.layer_norm(xs[0], (n,), w, b))
    _no_full_path(monkeypatch)

    def work(k):
        for r in range(200):
            i = (k + r) % len(xs)
            if not torch.equal(nt.layer_norm(xs[i], (n,), w, b), want[i]):
                yield i

    assert not _on_threads(work, 4)


def test_bfloat16_calls_have_plans_in_a_process_that_never_imported_ml_dtypes():
    """NumPy names bfloat16 only once ml_dtypes is imported: the plans' dtype table imports it
    itself (it had no bfloat16 where nothing had imported ml_dtypes before numbanorm.torch)."""
    pytest.importorskip("ml_dtypes")
    code = ("import sys, torch\n"
            "assert 'ml_dtypes' not in sys.modules\n"
            "import numbanorm.torch as nt\n"
            "from numbanorm.cpu._kernels import background\n"
            "x = torch.randn(3, 8).bfloat16()\n"
            "for _ in range(3):\n"
            "    nt.layer_norm(x, (8,))\n"
            "    background.wait()\n"
            "assert nt._IMPLEMENTATIONS['layer_norm', 'plain'].small.plans, 'no plan'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_an_entry_compiles_no_second_row_function(op):
    """An entry calls the row function the launcher compiled, not one compiled again for
    its own argument types (a literal 0 or False was typed Literal[int], Literal[bool]:
    each entry compiled the row function a second time, whose bits had only to agree)."""
    from numbanorm.cpu._kernels import add_norm, layer_norm, rms_norm

    rows = {"layer_norm": (layer_norm.forward_rows, layer_norm.backward_rows),
            "add_rms_norm": (add_norm.rms_norm_rows, rms_norm.backward_rows)}[op]
    x, r, w, b = _inputs(op, (5, 24), (24,), torch.float32, "both", torch.float32)

    def graph():
        outs = _forward(op, x, r, (24,), w, b, 1e-5)
        return torch.autograd.grad(outs, [t for t in (x, r, w, b) if t is not None], outs)

    graph()  # the full path: the launcher's row functions compiled
    before = [set(f.signatures) for f in rows]
    _learned(graph)
    assert [set(f.signatures) for f in rows] == before


def test_an_entry_is_the_row_function_it_names():
    """The generated entry's source calls the row function on arrays at the given addresses;
    its parameters are the row function's arrays (partials by their sums), then m, n and
    (with partials) their count."""
    from numbanorm.cpu._kernels import addressed, layer_norm, rms_norm

    assert addressed.parameters(layer_norm.forward_rows) == ["x", "w", "b", "eps", "y", "mean", "rstd", "m", "n"]
    assert addressed.parameters(layer_norm.forward_rows, ("mean", "rstd")) == ["x", "w", "b", "eps", "y", "m", "n"]
    assert addressed.parameters(rms_norm.backward_rows) == ["dy", "x", "rstd", "w", "ds", "dx", "dweight",
                                                            "m", "n", "blocks"]
    f32 = np.float32
    entry = addressed.entry(rms_norm.backward_rows, f32, dy=f32, x=f32, rstd=f32, w=None, ds=None, dx=f32,
                            dw_part=f32)
    code = entry.py_func.__code__
    assert code.co_varnames[:code.co_argcount] == tuple(addressed.parameters(rms_norm.backward_rows))
    src = "".join(linecache.getlines(code.co_filename))
    assert "    dy = carray(at(dy, T_dy), (m, n))" in src and "    w = None" in src
    assert "    left = ROWS(dy, x, rstd, w, ds, dx, dw_part, NO, ZERO, blocks)" in src
    assert entry.py_func.__qualname__.startswith("backward_rows.addressed_float32_")
    assert entry is addressed.entry(rms_norm.backward_rows, f32, dy=f32, x=f32, rstd=f32, w=None, ds=None,
                                    dx=f32, dw_part=f32)  # made once
