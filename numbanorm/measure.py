"""What ``numbanorm bench`` times, and how: the core the repository's benchmark suite
(``benchmarks/measure.py``) builds on, handing its longer table of peers to ``build_runners``,
``run_case`` and ``sweep`` (``peer_calls``).  The machine, versions and load that the bench
reports are ``numbanorm.machine``'s.

A :class:`Case` is one norm, direction, shape and dtype on one device; :class:`Inputs`
holds its arrays on one :class:`HostSide` or GPU side; :func:`build_runners` makes
zero-argument calls over them (the registry's kernel implementations, forward into a
preallocated ``out=`` and allocating; the peers of ``PEER_CALLS``: ``torch.nn.functional``,
the NumPy oracle, the ``np.copyto`` bandwidth floor), and :func:`time_runners` times
them round-robin: first call alone, the faster of two warm calls to size the samples,
then rounds that start one runner later each, medians and 20/80 % quantiles.
``Case.bytes`` counts x and y forward, x, dy and dx backward (``KERNEL_ARRAYS``); the
floor moves ``FLOOR_ARRAYS``.  On a GPU every sample ends with a device synchronisation.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .machine import cuda_simulated, gpu_name, torch_or_none
from .operations import BY_NAME, OPERATIONS

# Benchmarked norms: the table's unfused operations (benchmarks/fused.py times the
# fused ones), and instance norm: group norm with one group per channel.
VARIANTS = {"instance_norm": "group_norm"}
NORMS = tuple(op.name for op in OPERATIONS if not op.fused) + tuple(VARIANTS)
DIRECTIONS = ("forward", "backward")


def operation_of(norm):
    """The table's operation a benchmarked norm runs."""
    return BY_NAME[VARIANTS.get(norm, norm)]


def layout_of(norm):
    return operation_of(norm).layout

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# Arrays of x's size a kernel must move (forward x, y; backward x, dy, dx) and
# that the floor's copies move (forward x -> y; backward x and dy each copied).
KERNEL_ARRAYS = {"forward": 2, "backward": 3}
FLOOR_ARRAYS = {"forward": 2, "backward": 4}
# eps: every call (numbanorm, oracle, torch) takes the function's default -- 1e-5, and
# the machine epsilon of the accumulation dtype for RMSNorm.


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    """One measurement: norm, direction, input shape, dtype, device.

    ``groups`` is the number of groups for group/instance norm (instance norm
    is group norm with ``groups == C``); layer and RMS norm normalise the last
    axis of a 2-D ``(rows, hidden)`` input.
    """

    norm: str
    direction: str
    shape: tuple
    dtype: str = "float32"
    groups: int | None = None
    device: str = "cpu"

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)}, got {self.dtype!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.op.layout == "groups":
            if len(self.shape) < 2:
                raise ValueError(f"{self.norm} needs (N, C, *spatial), got {self.shape}")
            c = self.shape[1]
            g = c if self.norm == "instance_norm" and self.groups is None else self.groups
            if g is None or c % g:
                raise ValueError(f"{self.norm} on C={c} needs a number of groups dividing C, got {g}")
            if self.norm == "instance_norm" and g != c:
                raise ValueError(f"instance_norm has one group per channel: groups={g}, C={c}")
            object.__setattr__(self, "groups", int(g))
        elif len(self.shape) != 2:
            raise ValueError(f"{self.norm} cases are (rows, hidden), got {self.shape}")

    @property
    def op(self):
        """The operation of the table this case runs."""
        return operation_of(self.norm)

    @property
    def elements(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        """Bytes of one array of x's shape and dtype."""
        return self.elements * ITEMSIZE[self.dtype]

    @property
    def bytes(self):
        """Bytes a kernel must move: forward x + y, backward x + dy + dx."""
        return KERNEL_ARRAYS[self.direction] * self.nbytes

    @property
    def floor_bytes(self):
        """Bytes the floor's copies move: x -> y forward; x and dy copied backward."""
        return FLOOR_ARRAYS[self.direction] * self.nbytes

    @property
    def params(self):
        """Length of weight/bias: hidden for layer/RMS norm, C for group norm."""
        return self.shape[-1] if self.op.layout == "rows" else self.shape[1]

    @property
    def label(self):
        shp = "x".join(map(str, self.shape))
        g = f" G={self.groups}" if self.groups is not None and self.norm not in VARIANTS else ""
        return f"{self.norm} {self.direction} {shp}{g} {self.dtype} {self.device}"


# ------------------------------------------------------------------ where arrays live


class HostSide:
    """NumPy arrays; torch tensors share their memory (``torch.from_numpy``)."""

    name = "cpu"
    simulated = False

    def array(self, a, dtype):
        return np.ascontiguousarray(np.asarray(a, dtype=np.float32 if dtype == "bfloat16" else None),
                                    dtype=host_dtype(dtype))

    def empty_like(self, a):
        return np.empty_like(a)

    def copy(self, dst, src):
        np.copyto(dst, src)

    def sync(self):
        pass

    def to_torch(self, a):
        import torch

        if a.dtype.name == "bfloat16":  # torch.from_numpy knows no ml_dtypes: the same bits, viewed
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def host_dtype(name):
    """The NumPy dtype of ``name``; bfloat16 is ``ml_dtypes.bfloat16`` (what JAX hands to NumPy)."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError("bfloat16 host cases need ml_dtypes (pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


class TorchCudaSide:
    """CUDA torch tensors (every dtype, bfloat16 included); numbanorm takes them as they are."""

    name = "gpu"
    simulated = False

    def __init__(self):
        import torch

        self.torch = torch

    def array(self, a, dtype):
        t = self.torch
        return t.from_numpy(np.ascontiguousarray(a)).to(device="cuda", dtype=getattr(t, dtype)).contiguous()

    def empty_like(self, a):
        return self.torch.empty_like(a)

    def copy(self, dst, src):
        dst.copy_(src)  # device-to-device

    def sync(self):
        self.torch.cuda.synchronize()

    def to_torch(self, a):
        return a


class NumbaCudaSide:
    """numba device arrays (float16/32/64), for machines without a CUDA torch.

    This is also the side the tests drive under numba's CUDA simulator.
    """

    name = "gpu"

    def __init__(self):
        from numba import cuda

        self.cuda = cuda
        self.simulated = cuda_simulated()

    def array(self, a, dtype):
        if dtype == "bfloat16":
            raise ValueError("bfloat16 device arrays need a CUDA build of torch")
        return self.cuda.to_device(np.ascontiguousarray(a, dtype=dtype))

    def empty_like(self, a):
        return self.cuda.device_array_like(a)

    def copy(self, dst, src):
        dst.copy_to_device(src)  # device-to-device

    def sync(self):
        self.cuda.synchronize()

    def to_torch(self, a):
        return None


def side_for(device):
    """The array side for ``'cpu'`` or ``'gpu'``: torch tensors on the GPU when torch has CUDA."""
    if device == "cpu":
        return HostSide()
    torch = torch_or_none()
    if torch is not None and torch.cuda.is_available():
        return TorchCudaSide()
    return NumbaCudaSide()


# ------------------------------------------------------------------ threads and implementations


def set_threads(n=None):
    """Set numba's and torch's thread counts to the same ``n`` (default: all numba threads)."""
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    n = limit if n is None else int(n)
    if not 1 <= n <= limit:
        raise ValueError(f"threads must be in 1..{limit} (NUMBA_NUM_THREADS), got {n}")
    numba.set_num_threads(n)
    torch = torch_or_none()
    if torch is not None:
        torch.set_num_threads(n)
    return n


def kernel_impls(device, names=None, allow_simulator=False):
    """``[(name, module)]``: the registry's kernel implementations that run on ``device``.

    An implementation runs on the GPU when its frontend's backend is 'cuda' (the
    ``_api`` protocol); the simulator counts only when ``allow_simulator``.
    """
    from . import registry

    out = []
    for name in registry.available(include_oracle=False):
        if names is not None and name not in names:
            continue
        mod = registry.get(name)
        dev = {"cuda": "gpu", "cpu": "cpu"}.get(backend_name(mod))
        if dev != device:
            continue
        if dev == "gpu" and not (allow_simulator if cuda_simulated() else gpu_name()):
            continue  # the simulator only when asked for; else a real device must answer
        out.append((name, mod))
    return out


def backend_name(mod):
    fe = getattr(mod, "_frontend", None)
    return getattr(getattr(fe, "backend", None), "name", None)


# ------------------------------------------------------------------ inputs and runners


class Inputs:
    """x, weight, bias (and dy, made on first use) of one shape and dtype on one side."""

    def __init__(self, case, side, seed=0):
        self.shape, self.dtype, self.side, self.seed = case.shape, case.dtype, side, seed
        self._gen = np.float64 if case.dtype == "float64" else np.float32
        rng = np.random.default_rng(seed)
        # mean 0.5, std 1: a realistic activation; the numerics of large offsets are
        # the tests' business, not the benchmark's
        host_x = rng.standard_normal(case.shape, dtype=self._gen)
        host_x += self._gen(0.5)
        self.x = side.array(host_x, case.dtype)
        del host_x
        n = case.params
        self.w = side.array(rng.uniform(0.5, 1.5, n), case.dtype)
        self.b = side.array(0.1 * rng.standard_normal(n), case.dtype)
        self._dy = None

    @property
    def dy(self):
        if self._dy is None:
            rng = np.random.default_rng(self.seed + 1)
            self._dy = self.side.array(rng.standard_normal(self.shape, dtype=self._gen), self.dtype)
        return self._dy


def arguments(case, x, weight, bias):
    """role -> value of the forward's arguments (eps left to each function's default)."""
    op = case.op
    values = {"x": x, op.shape_role: case.shape[-1] if op.layout == "rows" else case.groups, "weight": weight}
    if op.bias:
        values["bias"] = bias
    return values


def numbanorm_calls(mod, case, inp):
    """``{mode: fn}`` calling implementation ``mod`` (public signatures) on ``inp``.

    Backward statistics come from the implementation's own forward, computed once
    here, outside the timing.
    """
    op, values = case.op, arguments(case, inp.x, inp.w, inp.b)
    if case.direction == "forward":
        y = inp.side.empty_like(inp.x)
        return {"out": lambda: op.call(mod, "plain", values, out=y), "alloc": lambda: op.call(mod, "plain", values)}
    back = dict(values, dy=inp.dy, **dict(zip(op.stats, forward_stats(mod, case, inp))))
    return {"alloc": lambda: op.call(mod, "backward", back)}


def forward_stats(mod, case, inp):
    """The statistics (``case.op.stats``: ``(mean, rstd)`` or ``(rstd,)``) of ``mod``'s forward on ``inp``."""
    op = case.op
    return op.call(mod, "forward", arguments(case, inp.x, inp.w, inp.b))[len(op.plain_outputs):]


ORACLE_MAX_ELEMENTS = 1 << 20  # the oracle is slow by design (float64 temporaries); larger shapes skip it


def oracle_calls(case, inp):
    """The NumPy oracle (host shapes up to ``ORACLE_MAX_ELEMENTS`` only; it has no ``out=``)."""
    from . import reference as ref

    if case.device != "cpu" or case.elements > ORACLE_MAX_ELEMENTS:
        return {}
    op, values = case.op, arguments(case, inp.x, inp.w, inp.b)
    if case.direction == "forward":
        return {"alloc": lambda: op.call(ref, "plain", values)}
    back = dict(values, dy=inp.dy, **dict(zip(op.stats, forward_stats(ref, case, inp))))
    return {"alloc": lambda: op.call(ref, "backward", back)}


def torch_calls(case, inp, functional=None):
    """``torch.nn.functional`` on the same memory (host) or the same tensors (GPU).

    Forward: the table's counterpart (F.layer_norm / F.rms_norm / F.group_norm)
    on tensors that do not require grad (no graph is recorded); torch has no
    ``out=`` for these, so only the allocating forward is compared.  Instance
    norm runs as F.group_norm with one group per channel: the same arithmetic as
    numbanorm's, and faster than F.instance_norm (which goes through batch_norm
    on a reshaped view).

    Backward: the graph is built ONCE here, outside the timing, and every timed
    call is ``torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True)``.
    So a sample is exactly autograd's backward (the native *_backward kernel
    plus the engine's overhead) -- a fresh graph per repeat would add the
    forward, and ``y.backward(dy)`` would add an accumulation pass into
    ``x.grad`` (one more read and write of dx) from the second repeat on.
    """
    torch = torch_or_none()
    if torch is None:
        return {}
    side = inp.side
    xt = side.to_torch(inp.x)
    if xt is None:
        return {}
    F, op = functional or torch.nn.functional, case.op
    values = arguments(case, xt, side.to_torch(inp.w), side.to_torch(inp.b))
    if case.direction == "forward":
        return {"alloc": lambda: op.call_torch(F, values)}
    leaves = {k: v.detach().requires_grad_(True) for k, v in values.items() if k in ("x", "weight", "bias")}
    y = op.call_torch(F, dict(values, **leaves))
    dyt, grads_of = side.to_torch(inp.dy), list(leaves.values())
    return {"alloc": lambda: torch.autograd.grad(y, grads_of, dyt, retain_graph=True)}


def floor_call(side, x, dy=None, copy=None):
    """The bandwidth floor: copy ``x`` (forward), or ``x`` and ``dy`` (backward), into buffers
    allocated once and reused by every call (their pages mapped by the warm-up).

    It moves ``FLOOR_ARRAYS`` arrays of x's size: 2 forward, 4 backward.  ``copy(dst, src)``
    is the side's own copy unless given (the benchmark suite's threaded copy, say).
    """
    copy = copy or side.copy
    if dy is None:
        y = side.empty_like(x)
        return lambda: copy(y, x)
    a, b = side.empty_like(x), side.empty_like(x)

    def copy_both():
        copy(a, x)
        copy(b, dy)

    return copy_both


def floor_calls(case, inp, copy=None):
    dy = None if case.direction == "forward" else inp.dy
    return {"out": floor_call(inp.side, inp.x, dy, copy)}


@dataclass
class Runner:
    impl: str            # 'numbanorm.cpu', 'numbanorm.cuda', 'torch', 'oracle', 'floor'
    mode: str            # 'out' (preallocated output) or 'alloc'
    fn: object = field(repr=False)
    first_call_s: float = math.nan
    number: int = 1
    samples: list = field(default_factory=list, repr=False)

    def quantiles(self):
        """``(q20, median, q80)`` of the per-call times in seconds."""
        if not self.samples:
            return (math.nan,) * 3
        return tuple(float(v) for v in np.quantile(self.samples, [0.2, 0.5, 0.8]))


# peer -> (its runners' name, the function making its calls); benchmarks/measure.py adds its own
PEER_CALLS = {"torch": ("torch", torch_calls), "oracle": ("oracle", oracle_calls), "floor": ("floor", floor_calls)}
PEERS = tuple(PEER_CALLS)


def build_runners(case, inp, impls, peers=PEERS, peer_calls=PEER_CALLS):
    """Runners for ``case`` over inputs ``inp``: ``impls`` is ``[(name, module)]``, then ``peers``
    in ``peer_calls``' order."""
    runners = [Runner(f"numbanorm.{name}", mode, fn)
               for name, mod in impls for mode, fn in numbanorm_calls(mod, case, inp).items()]
    for peer, (impl, calls) in peer_calls.items():
        if peer in peers:
            runners += [Runner(impl, mode, fn) for mode, fn in calls(case, inp).items()]
    return runners


# ------------------------------------------------------------------ timing


def _warm_call(fn, sync, clock):
    t0 = clock()
    fn()
    sync()
    return max(clock() - t0, 1e-9)


def compiled_in_background():
    """Wait for the CPU's parallel kernels that first calls handed to a compile thread (until
    they are compiled, those calls run on one thread: not what is timed)."""
    background = sys.modules.get("numbanorm.cpu._kernels.background")
    if background is not None:
        background.wait()


def time_runners(runners, sync=lambda: None, *, repeats=None, budget_s=1.0, min_repeats=5,
                 max_repeats=50, max_s=None, min_sample_s=2e-3, max_number=1000, number=None):
    """Time ``runners`` in place (``first_call_s``, ``number``, ``samples``); returns the rounds run.

    ``repeats`` fixes the number of round-robin rounds.  Otherwise rounds go on
    until ``budget_s`` seconds of them have run (at least ``min_repeats``, at
    most ``max_repeats``); ``max_s`` (default ``5 * budget_s``) cuts a case
    short after 3 rounds when a loaded machine makes every call slow.
    ``number`` fixes the calls per sample (else the faster warm call picks it).
    """
    clock = time.perf_counter
    for r in runners:
        t0 = clock()
        r.fn()
        sync()
        r.first_call_s = clock() - t0
    compiled_in_background()
    # the calls per sample come from the faster of two warm calls: the first call may
    # compile, and so may the first warm one (a repeated 16-bit small call loads a
    # specialization of its own), or fault in a fresh output's pages; a call of a
    # second or more is warmed once
    warm = [_warm_call(r.fn, sync, clock) for r in runners]
    # the first warm call may hand a kernel to the compile thread too (a small numbanorm.torch
    # call asks for its plan's entry on its second call): timed before it is compiled, every
    # sample took the full path while the compile shared the cores
    compiled_in_background()
    for r, one in zip(runners, warm):
        if min_sample_s > 0 and one < 1.0:
            one = min(one, _warm_call(r.fn, sync, clock))
        r.number = number or int(min(max_number, max(1, math.ceil(min_sample_s / one))))
    if max_s is None:
        max_s = 5 * budget_s
    gc_was_on = gc.isenabled()
    gc.disable()
    k, rounds, start = len(runners), 0, clock()
    try:
        while True:
            if repeats is not None:
                if rounds >= repeats:
                    break
            else:
                spent = clock() - start
                if rounds >= max_repeats or (rounds >= min_repeats and spent >= budget_s) or (
                        rounds >= 3 and spent >= max_s):
                    break
            for r in runners[rounds % k:] + runners[: rounds % k]:
                fn, n = r.fn, r.number
                t0 = clock()
                for _ in range(n):
                    fn()
                sync()
                r.samples.append((clock() - t0) / n)
            rounds += 1
    finally:
        if gc_was_on:
            gc.enable()
    return rounds


def result_rows(case, runners, threads):
    """One dict per runner: times, GB/s and ratios to the floor and each peer.

    ``x_floor`` is this runner's median over the floor's; ``x_torch`` and
    ``x_oracle`` compare with that peer in the same mode (torch has no ``out=``,
    so preallocated rows have no torch ratio).  Floor rows count the bytes their
    copies move (``floor_bytes``), so their GB/s is the machine's copy bandwidth.
    """
    med = {}
    for r in runners:
        med[(r.impl, r.mode)] = r.quantiles()[1]
    floor = next((v for (impl, _), v in med.items() if impl == "floor"), None)
    floor_threads = next((v for (impl, _), v in med.items() if impl == "floor_threads"), None)
    rows = []
    for r in runners:
        q20, m, q80 = r.quantiles()
        nbytes = case.floor_bytes if r.impl.startswith("floor") else case.bytes
        row = {
            "norm": case.norm, "direction": case.direction, "mode": r.mode,
            "dtype": case.dtype, "shape": list(case.shape), "groups": case.groups,
            "device": case.device, "impl": r.impl, "threads": threads,
            "elements": case.elements, "bytes": nbytes,
            "median_s": m, "q20_s": q20, "q80_s": q80,
            "repeats": len(r.samples), "number": r.number, "first_call_s": r.first_call_s,
            "gbps": nbytes / m / 1e9 if m > 0 else math.nan,
            "x_floor": m / floor if floor else None,
            "x_floor_threads": m / floor_threads if floor_threads else None,
        }
        for peer in ("torch", "oracle"):
            p = med.get((peer, r.mode))
            row[f"x_{peer}"] = m / p if p else None
        rows.append(row)
    return rows


def run_case(case, impls=None, peers=PEERS, threads=None, *, inputs=None, allow_simulator=False,
             peer_calls=PEER_CALLS, **timing):
    """Measure one case: build inputs and runners, time them, return the result rows.

    ``impls`` is a list of registry names (default: every kernel implementation
    that runs on ``case.device``).  ``timing`` goes to :func:`time_runners`.
    """
    threads = set_threads(threads)
    chosen = kernel_impls(case.device, impls, allow_simulator=allow_simulator)
    if inputs is None:
        inputs = Inputs(case, side_for(case.device))
    runners = build_runners(case, inputs, chosen, peers, peer_calls)
    time_runners(runners, inputs.side.sync, **timing)
    return result_rows(case, runners, threads)


# ------------------------------------------------------------------ progress


def progress(total, desc="", disable=False):
    """A progress bar on stderr: tqdm's where it is installed, else a line per case.

    The object has ``update(n=1)``, ``set_postfix_str(s)`` and ``close()``.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, desc, None if disable else sys.stderr)
    # (disable=None: none where stderr is no terminal, a log's frames of carriage returns)
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=True if disable else None)


class _Lines:
    """tqdm's small interface as one line per case started (``set_postfix_str``)."""

    def __init__(self, total, desc, stream):
        self.total, self.desc, self.stream, self.n = total, desc, stream, 0

    def set_postfix_str(self, s):
        if self.stream is not None:
            print(f"{self.desc} {self.n + 1}/{self.total} {s}", file=self.stream, flush=True)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass


# ------------------------------------------------------------------ a sweep and its table


def sweep(cases, impls=None, peers=PEERS, threads=None, show_progress=True, desc="bench",
          allow_simulator=False, peer_calls=PEER_CALLS, **timing):
    """Run ``cases`` in order with a progress bar; returns the result rows.

    Consecutive cases of the same shape and dtype (forward then backward) share
    their inputs, which are generated once.
    """
    threads = set_threads(threads)
    rows, bar = [], progress(len(cases), desc, disable=not show_progress)
    inputs = None
    try:
        for case in cases:
            bar.set_postfix_str(case.label)
            key = (case.norm, case.shape, case.dtype, case.groups, case.device)
            if inputs is None or inputs[0] != key:
                inputs = None  # free the last case's arrays before allocating new ones
                inputs = (key, Inputs(case, side_for(case.device)))
            t0 = time.perf_counter()
            new = run_case(case, impls, peers, threads, inputs=inputs[1],
                           allow_simulator=allow_simulator, peer_calls=peer_calls, **timing)
            for r in new:  # what the case cost, warm-ups included: for planning sweeps
                r["case_wall_s"] = round(time.perf_counter() - t0, 3)
            rows += new
            bar.update(1)
    finally:
        bar.close()
    return rows


def _fmt_time(s):
    if s is None or not math.isfinite(s):
        return "-"
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _fmt_ratio(v):
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}x"


def format_rows(rows):
    """A fixed-width text table of result rows (the ``numbanorm bench`` output)."""
    with_torch = any(r["impl"] == "torch" for r in rows)
    head = ("case", "impl", "mode", "median", "20-80%", "GB/s", "x floor", "x torch")[:8 if with_torch else 7]
    lines = []
    for r in rows:
        shp = "x".join(map(str, r["shape"]))
        g = f" G={r['groups']}" if r["groups"] is not None and r["norm"] not in VARIANTS else ""
        case = f"{r['norm']} {r['direction']} {shp}{g} {r['dtype']}"
        spread = f"{_fmt_time(r['q20_s'])}..{_fmt_time(r['q80_s'])}"
        lines.append((case, r["impl"], r["mode"], _fmt_time(r["median_s"]), spread,
                      f"{r['gbps']:.1f}", _fmt_ratio(r["x_floor"]), _fmt_ratio(r["x_torch"]))[:len(head)])
    widths = [max(len(head[i]), *(len(line[i]) for line in lines)) if lines else len(head[i])
              for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head)] + [fmt.format(*line) for line in lines])
