"""torch.compile(fullgraph=True) of every numbanorm.torch module and function, from a fresh process.

Each case runs in its own interpreter, where the compiled call is the first thing numbanorm
does: anything computed lazily on a first call (a cached property, a table filled on
demand) would otherwise be filled by an earlier eager call, or an earlier compiled case,
and a trace that cannot enter it would pass unseen.  A case compiles one module or
function with ``dynamic=True`` or ``dynamic=None`` (the default: static first, dynamic on
the next shape), calls it on several shapes, forward and backward, all before any eager
call, counts its graphs (as torch's functions make them), then compares every output and
gradient with the eager call's bit for bit (both run the same kernels through the same
operators).
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (the default test set leaves this file out: tests/README.md)

pytest.importorskip("torch")

# The case run in the fresh interpreter: argv[1] the family, argv[2] the dynamic mode.
_CASE = r'''
import sys
import torch
import numbanorm.torch as nt
from torch._dynamo.utils import counters


family, dynamic = sys.argv[1], {"True": True, "None": None}[sys.argv[2]]
gen = torch.Generator().manual_seed(0)
torch.set_num_threads(2)  # (not Numba's: NUMBA_NUM_THREADS=1, below)


def rand(*shape, low=None):
    t = torch.rand(*shape, generator=gen) + low if low is not None else torch.randn(*shape, generator=gen)
    return t.requires_grad_()


def module(make, shapes):
    m = make()
    with torch.no_grad():  # parameters away from ones and zeros, so their gradients count
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return m, [(rand(*s),) for s in shapes]


def functional(fn, shapes, eps, residual=False, bias=True, axis=-1):
    """``fn`` and its calls on ``shapes``, weights over ``axis`` of x (GroupNorm's C: 1)."""
    calls = []
    for s in shapes:
        c = s[axis]
        calls.append((rand(*s), *((rand(*s),) if residual else ()), rand(c, low=0.5),
                      *((rand(c),) if bias else ()), eps))
    return fn, calls


ROWS = [(4, 16), (7, 24), (3, 40)]   # the functions take the width from x: it varies too
BATCH = [(4, 16), (7, 16), (3, 16)]  # a module's width is its own
CONV = [(2, 8, 3), (3, 8, 5), (4, 8, 7)]
LN = lambda x, w, b, eps: nt.layer_norm(x, x.shape[-1:], w, b, eps)
RMS = lambda x, w, eps: nt.rms_norm(x, [x.shape[-1]], w, eps)
GN = lambda x, w, b, eps: nt.group_norm(x, 4, w, b, eps)
ALN = lambda x, r, w, b, eps: nt.add_layer_norm(x, r, x.shape[-1], w, b, eps)
ARMS = lambda x, r, w, eps: nt.add_rms_norm(x, r, x.shape[-1], w, eps)
CASES = {
    "LayerNorm": lambda: module(lambda: nt.LayerNorm(16), BATCH),
    "RMSNorm": lambda: module(lambda: nt.RMSNorm(16, eps=1e-6), BATCH),
    "GroupNorm": lambda: module(lambda: nt.GroupNorm(4, 8), CONV),
    "layer_norm": lambda: functional(LN, ROWS, 1e-5),
    "rms_norm": lambda: functional(RMS, ROWS, 1e-6, bias=False),
    "group_norm": lambda: functional(GN, CONV, 1e-5, axis=1),
    "add_layer_norm": lambda: functional(ALN, ROWS, 1e-5, residual=True),
    "add_rms_norm": lambda: functional(ARMS, ROWS, None, residual=True, bias=False),
}


def run(f, args, params):
    """Outputs and the gradients of every tensor input and parameter (grad_outputs fixed)."""
    got = f(*args)
    outs = got if isinstance(got, tuple) else (got,)
    wrt = [a for a in args if isinstance(a, torch.Tensor)] + params
    g = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, wrt, g))


f, calls = CASES[family]()
params = list(f.parameters()) if isinstance(f, torch.nn.Module) else []
compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
got = []
for i, args in enumerate(calls):
    got.append(run(compiled, args, params))
    assert counters["stats"]["unique_graphs"] >= 1, "the first call was not compiled"
graphs = counters["stats"]["unique_graphs"]
# not a graph per shape: a size taken from x's shape and pinned by a check of its type made
# one per width; torch.nn.functional's make one with dynamic=True, a static one and then a
# dynamic one by default (a second with dynamic=True came from the first call's change of
# torch's thread count, which Dynamo guards on)
assert graphs == (1 if dynamic else 2), graphs
for args, want_all in zip(calls, got):  # eager, only now
    fresh = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    for a, b in zip(want_all, run(f, fresh, params)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
print(f"OK {family} dynamic={dynamic}: {len(calls)} shapes, {graphs} graph(s)")
'''

FAMILIES = ["LayerNorm", "RMSNorm", "GroupNorm",
            "layer_norm", "rms_norm", "group_norm", "add_layer_norm", "add_rms_norm"]


@pytest.mark.parametrize("dynamic", ["True", "None"], ids=["dynamic", "default"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compile_in_a_fresh_process(family, dynamic):
    env = dict(os.environ, TORCHDYNAMO_VERBOSE="0", NUMBA_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _CASE, family, dynamic], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    assert f"OK {family}" in done.stdout
