"""One prepared run on a GPU machine: correctness, compute-sanitizer, speed, host cost,
CUDA graphs, the static model against the measurement, and CPU scaling -- one JSON.

    python -m benchmarks.gpu_check --out $OUT/gpu-h100.json          # everything, at most 5.5 min
    python -m benchmarks.gpu_check --only correctness sanitizer --out X.json
    python -m benchmarks.gpu_check --skip speed --budget correctness=60 --out X.json

Sections (``--only``/``--skip``; each has a time budget, ``--budget NAME=SECONDS``, and the
whole run a deadline, ``--deadline``; the JSON is rewritten after every section and every
batch of results, so a section that fails or runs out of time never loses the others):

* ``correctness``: every public function (forward, backward, fused) in float16, bfloat16,
  float32 and float64 against the oracle (``numbanorm.reference``; tolerances of
  ``numbanorm.operations``, bfloat16's the float16 one scaled by the ratio of their ulps) on
  numba, CuPy and torch arrays: N = 1, odd N, N on both sides of every staging and
  shared-memory boundary of the launch code (found by recording the launches the public
  functions make, ``boundaries``, not written down here: registers -> staged loop, the
  48 KB of shared memory a block gets without opting in -- the launch code's static
  scratch bound beside the dynamic bytes, and the dynamic bytes alone --, the last staged row,
  the re-reading loop beyond), rows striding over the persistent grid, non-contiguous
  inputs, views 2/4/8 bytes off alignment, ``out=`` that is x, overlaps x, or overlaps the
  weight, torch on a side stream behind a sleeping kernel, bfloat16 inputs of more than
  2**31 elements (rows of 8192, and one row), and extreme inputs (``RANGE_VARIANTS``: rows
  whose squares overflow or underflow, dy near the largest value; the kernels' paths that
  redo a row out of range); every case is called three times (the first compiles or loads,
  the second takes the direct launch, the third a replay where the backend replays that
  array type), each call checked, the three bit-identical;
* ``sanitizer``: compute-sanitizer's memcheck, racecheck, synccheck and initcheck over a
  small case of every kernel in every dtype, and float32's extreme inputs (this script
  again, ``--sanitize-case``, on numba arrays);
* ``speed``: CUDA events around calls queued behind a sleep kernel (the GPU's time per
  call; the host's beside it), round-robin in one process per case: LayerNorm and RMSNorm
  forward and backward at 32768 x N, N in {1024, 2048, 4096, 8192}, bfloat16, float16,
  float32; the fused add forms; GroupNorm forward and backward at (8, 512, 64, 64) and
  (16, 256, 128, 128) in 32 groups; each against a device-to-device copy of the same
  bytes, ``torch.nn.functional`` eager, ``torch.compile`` and Liger-Kernel (when importable);
* ``host``: host time per public call on torch CUDA tensors at (1, 4096) and (8, 4096)
  against torch eager's; ``graph``: a small torch model whose norms ``replace_norms``
  swapped, captured with ``torch.cuda.graph``, replayed, compared with eager;
* ``model``: beside each measured fraction of the copy's bandwidth, the static model's
  (``benchmarks/results/gpu-model.json``: memory clocks over max(memory, issue) clocks of
  the main launch, as the book's roofline reads it);
* ``cpu_scaling``: LayerNorm/RMSNorm forward into ``out=`` and backward, float32 and
  bfloat16, at 1, 2, 4, 8, 16 threads against a copy on the same threads (one process,
  ``numba.set_num_threads``).

Compiles run in parallel: a pool of worker processes (``--jobs``; one less than the cores)
takes the correctness cases and the warm-up of every timed case (numba-cuda kernels, then,
after every case's, the torch.compile graphs and Liger's Triton kernels, on the same
worker) in priority order until the correctness budget is spent; the timed parts then run
one at a time, each on the worker that warmed it, the GPU otherwise idle.  A correctness
case that finished before its worker was killed at phase 1's end keeps its result, and the
cases its job had left are not run (``correctness.not_run``; ``--resume`` runs them).
Workers share a numba cache directory (``NUMBA_CACHE_DIR``, default
``/tmp/gpucheck-numba``) whose writes are serialised by a file lock, so the sanitizer's runs
and the CPU section load what the workers compiled.

Needs numbanorm[cuda] on a CUDA GPU (PyTorch with CUDA for speed, host and graph; CuPy for
its cases; compute-sanitizer on the PATH or under CUDA_HOME for the sanitizer).  Without a
GPU, a section that needs one is skipped and says why; in numba's CUDA simulator the
correctness section runs (``--tiny``: small shapes; tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

import numpy as np

# numba-cuda puts itself under numba.cuda from a .pth file, which Python reads only in site
# directories: where it is installed with pip --target (the device machine's recipe), not read
with contextlib.suppress(ImportError):
    import _numba_cuda_redirector  # noqa: F401

from benchmarks import gpu_bench, gpu_model, measure  # noqa: E402
from numbanorm.operations import BY_NAME, OPERATIONS, relative_error, tolerance  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECTIONS = ("correctness", "sanitizer", "speed", "host", "graph", "model", "cpu_scaling", "tune")
DEFAULT_SECTIONS = SECTIONS[:-1]  # tune: only when asked for (--only tune)
# seconds per section (the correctness budget is the parallel phase: its cases and the warm-up
# of what the timed sections run); --deadline cuts every section at the run's end
BUDGET_S = {"correctness": 120, "sanitizer": 45, "speed": 70, "host": 10, "graph": 15, "model": 5,
            "cpu_scaling": 35, "tune": 150}
DEADLINE_S = 330  # an H100's 15 minutes: a machine's start, this run, and a second one
KILL_MARGIN_S = 20  # phase 1 starts no case in its last seconds before its busy workers are killed
DTYPES = ("float16", "bfloat16", "float32", "float64")
LIBS = ("numba", "cupy", "torch")
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TOOL_FLAGS = {"memcheck": ["--leak-check", "no"], "racecheck": [], "synccheck": [],
              "initcheck": []}  # (--track-unused-memory is a bare flag there, off by default)
BIG = ("x", "residual", "dy", "ds", "s")  # the roles shaped like x
CALLS = 3  # each case: compile (or load), direct launch, replay
SPEED_ROWS = 32768
SPEED_NS = (4096, 8192, 1024, 2048)  # in the order they are timed: the budget cuts the last
SPEED_DTYPES = ("bfloat16", "float16", "float32")
GN_SHAPES, GN_GROUPS = gpu_model.GN_SHAPES, gpu_model.GN_GROUPS  # (the model has records of these)
HOST_SHAPES = ((1, 4096), (8, 4096))
CPU_SHAPE = (16384, 4096)
CPU_THREADS = (1, 2, 4, 8, 16)
# the issue's targets
TARGET_COPY = {"16-bit": 0.85, "float32": 0.80, "group_norm": 0.70}
TARGET_HOST_US = 15.0
TARGET_CPU_RATIO = 1.15
STICKY = ("ILLEGAL_ADDRESS", "illegal memory access", "LAUNCH_FAILED", "unspecified launch failure",
          "MISALIGNED", "ILLEGAL_INSTRUCTION", "HARDWARE_STACK_ERROR", "device-side assert")




def _simulated():
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _torch_cuda():
    """torch, when it is installed with CUDA and sees a GPU (never under the simulator)."""
    if _simulated():
        return None
    torch = measure.torch_or_none()
    return torch if torch is not None and torch.cuda.is_available() else None


def _why_no_torch_cuda():
    if _simulated():
        return "numba's CUDA simulator: no GPU to time or capture on"
    torch = measure.torch_or_none()
    if torch is None:
        return "PyTorch is not installed"
    return "" if torch.cuda.is_available() else "PyTorch sees no CUDA GPU"


# ---------------------------------------------------------------- the JSON, written as it grows

class Report:
    """The results file: the issue's keys, plus ``sections`` (what ran, for how long, what was
    skipped and why) and ``targets``; rewritten whole (through a temporary file) at every save."""

    def __init__(self, path):
        self.path = path
        self.data = {"device": None, "driver": None, "versions": {},
                     "correctness": {"passed": 0, "failed": 0, "not_run": 0, "cases": []},
                     "sanitizer": {"tools": {}, "errors": None},
                     "speed": [], "host_us": {"numbanorm": {}, "torch": {}, "shape": [list(s) for s in HOST_SHAPES]},
                     "cuda_graph": {"captured": False, "max_abs_diff": None},
                     "model": [], "cpu_scaling": [], "sections": {}, "targets": {}}

    def save(self):
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
            f.write("\n")
        os.replace(tmp, self.path)

    def add_cases(self, cases):
        c = self.data["correctness"]
        c["cases"] += cases
        c["passed"] = sum(x["status"] == "pass" for x in c["cases"])
        c["failed"] = sum(x["status"] in ("fail", "error") for x in c["cases"])
        c["not_run"] = sum(x["status"] == "not run" for x in c["cases"])  # (a later run's --resume takes them)


def _jsonable(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, tuple):
        return list(v)
    return str(v)


def _finite(v):
    """A float for the JSON (NaN and infinities as strings, which JSON lacks)."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


class Run:
    """The sections chosen, their budgets and the run's deadline."""

    def __init__(self, args, report):
        self.args, self.report = args, report
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.budget = dict(BUDGET_S, **args.budget)
        chosen = args.only or DEFAULT_SECTIONS
        self.sections = [s for s in SECTIONS if s in chosen and s not in args.skip]

    def left(self):
        return self.deadline - time.monotonic()

    def wants(self, name):
        return name in self.sections

    def section_deadline(self, name):
        return min(self.deadline, time.monotonic() + self.budget[name])

    def phase1_deadlines(self):
        """Phase 1's end (the correctness budget's) and when a worker still busy then is killed
        (a minute later): the kill no later than the run's deadline less the budgets of the
        sections after it, which time what phase 1 warmed (an H200 run's warm-ups, each
        compiling torch.compile's graphs, once ran a minute past their budget into the speed
        section's); in a run of correctness cases, the end at least KILL_MARGIN_S before the
        kill, so that a case started just before the end has time to finish (a speed warm-up
        cut short loses its compiled peers only: ``Pool.phase2`` times its cases on another
        worker, which warms them eagerly)."""
        after = sum(self.budget[s] for s in self.sections if s != "correctness")
        hard = self.deadline - after
        end = min(self.section_deadline("correctness"), hard - KILL_MARGIN_S * self.wants("correctness"))
        return end, max(time.monotonic(), min(end + 60, hard))

    @contextlib.contextmanager
    def section(self, name):
        """Record ``name``'s status and time; an exception ends the section, not the run."""
        info = {"status": "ran", "seconds": None}
        self.report.data["sections"][name] = info
        t0 = time.monotonic()
        try:
            yield info
        except Skip as e:
            info.update(status="skipped", reason=str(e))
        except Exception as e:  # a broken section is reported and the run goes on
            info.update(status="error", reason=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc()[-4000:])
            print(f"gpu_check: section {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            info["seconds"] = round(time.monotonic() - t0, 1)
            self.report.save()
            print(f"gpu_check: {name}: {info['status']} in {info['seconds']} s"
                  + (f" ({info['reason']})" if info.get("reason") else ""), flush=True)


class Skip(Exception):
    """A section that cannot run here, and why."""


# ---------------------------------------------------------------- environment

def package_sources():
    """sha256 of every source file of the numbanorm package (the launch code too)."""
    import hashlib

    import numbanorm

    h, top = hashlib.sha256(), os.path.dirname(os.path.abspath(numbanorm.__file__))
    for folder, dirs, files in sorted(os.walk(top)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, top).encode() + b"\0" + f.read())
    return h.hexdigest()


# what must match for a case that passed in an earlier run to count again (--resume)
RESUME_KEYS = ("numbanorm", "numba", "numba-cuda", "kernel_sources_sha256", "package_sources_sha256")


def resumable(path, data):
    """``(passed cases of the run in path, why not)``: its passed correctness cases when it
    ran on the same device with the same kernels, package sources (where it recorded
    them) and numba versions as this run (``data``), else ``({}, the difference)``; a run
    that left no file (a fresh machine has none of the lease's earlier runs) is nothing to
    resume."""
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        return {}, f"no such file: {path}"
    if old.get("device") != data.get("device"):
        return {}, f"another device: {old.get('device')}"
    ov, nv = old.get("versions", {}), data["versions"]
    for key in RESUME_KEYS:
        if key == "package_sources_sha256" and key not in ov:
            continue  # (runs before it was recorded: their kernels' hash only)
        if ov.get(key) != nv.get(key):
            return {}, f"{key} differs: {ov.get(key)} there, {nv.get(key)} here"
    return {c["id"]: c for c in old["correctness"]["cases"] if c["status"] == "pass"}, ""


def environment(report):
    d = report.data
    d["versions"] = {n: gpu_bench._version(n) for n in (
        "numba", "numba-cuda", "llvmlite", "numpy", "ml_dtypes", "torch", "triton", "cupy-cuda13x",
        "cupy-cuda12x", "liger-kernel", "cuda-bindings", "cuda-core", "cuda-pathfinder")}
    import numbanorm

    d["versions"].update(numbanorm=numbanorm.__version__, python=platform.python_version(),
                         kernel_sources_sha256=gpu_model.kernel_sources(),
                         package_sources_sha256=package_sources())
    d["machine"] = {"cpu": measure.cpu_model(), "cores": os.cpu_count(), "simulator": _simulated()}
    import numbanorm.cuda as nc

    if not nc.is_available():
        d["device"] = f"none: {nc.why_unavailable()}"
        return
    from numba import cuda

    d["versions"]["numba.cuda_from"] = os.path.dirname(getattr(cuda, "__file__", "") or "")

    if _simulated():
        d["device"] = "numba CUDA simulator"
        return
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    d["device"] = name
    d["machine"].update(compute_capability=list(dev.compute_capability), sms=dev.MULTIPROCESSOR_COUNT,
                        shared_per_block=dev.MAX_SHARED_MEMORY_PER_BLOCK,
                        shared_per_block_optin=_attr(dev, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
                        memory_gib=round(cuda.current_context().get_memory_info()[1] / 2**30, 1))
    smi = shutil.which("nvidia-smi")
    driver = None
    if smi:
        try:
            driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = None
    api = gpu_bench._driver_version(cuda)
    d["driver"] = f"{driver} (CUDA {api})" if driver else f"CUDA {api}"


def _free_gpu_bytes():
    """The GPU memory free now, or None (the simulator, or no answer)."""
    if _simulated():
        return None
    try:
        from numba import cuda

        return cuda.current_context().get_memory_info()[0]
    except Exception:  # no GPU: the warm-ups share what HEAVY_AT_ONCE says
        return None


def _attr(dev, name):
    try:
        return getattr(dev, name)
    except Exception:  # an attribute this numba-cuda or driver does not know
        return None


def shared_limits():
    """(bytes of shared memory a block gets without opting in, the most it may opt in to):
    the device's answer, else (the simulator) the launch code's own constants."""
    from numbanorm.cuda._kernels import common as C

    if not _simulated():
        from numba import cuda

        dev = cuda.get_current_device()
        optin = _attr(dev, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        return dev.MAX_SHARED_MEMORY_PER_BLOCK, optin or C.SHARED_OPTIN
    return C.SHARED_DEFAULT, C.SHARED_OPTIN


# ---------------------------------------------------------------- the launches a call makes

class _Log(list):
    """Recorded launches, and the row mappings (``common.row_config``) chosen for them."""

    def __init__(self):
        super().__init__()
        self.configs = []


_FRONTEND = []


def frontend():
    """``gpu_model.frontend()`` (every call through the full path), made once."""
    if not _FRONTEND:
        _FRONTEND.append(gpu_model.frontend())
    return _FRONTEND[0]


@contextlib.contextmanager
def recording():
    """The launch code with its launches recorded instead of made (``gpu_model.Launch``),
    and every array it allocates, like the inputs the public functions are called with
    here, a stand-in over no memory: what grid, block, kernel and dynamic shared memory
    each launch of any shape would get, at no cost."""
    from numbanorm.cuda._kernels import common as C

    launches = _Log()
    row_config = C.row_config

    def record(kernel, grid, block, stream, *args, shared=0):
        launches.append(gpu_model.Launch(kernel, grid, block, args, shared))

    def config(*args, **kwargs):  # the row mappings the launchers chose (rows per block, grid)
        cfg = row_config(*args, **kwargs)
        launches.configs.append(cfg)
        return cfg

    patches = [(C, "launch", record), (C, "device_empty", _stand_in), (gpu_model, "_device_empty", _stand_in),
               (C, "row_config", config)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    try:
        yield launches
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def _stand_in(shape, dtype=np.float64, *args, **kwargs):
    """A C-contiguous array of ``shape`` over 64 bytes, 16-byte aligned like a device
    allocation, that the CUDA backend takes for a numba device array (never touched)."""
    dt = measure.host_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    shape = (shape,) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    buf = np.zeros(64, np.uint8)
    start = -buf.ctypes.data % 16
    strides = tuple(int(np.prod(shape[k + 1:])) * dt.itemsize for k in range(len(shape)))
    a = np.lib.stride_tricks.as_strided(buf[start:start + dt.itemsize].view(dt), shape, strides)
    return a.view(gpu_model._DeviceLike)


def _group_args(fn, dtype, shape, groups):
    """Stand-in arguments of GroupNorm's public ``fn`` for x of ``shape``."""
    acc = np.float64 if dtype == "float64" else np.float32
    x, c = _stand_in(shape, dtype), shape[1]
    stats = _stand_in((shape[0], groups), acc)
    if fn.endswith("_backward"):
        return (_stand_in(shape, dtype), x, stats, stats, _stand_in((c,), dtype))
    return (x, groups, _stand_in((c,), dtype), _stand_in((c,), dtype))


def launches_of(fe, launches, fn, dtype, shape, groups=None):
    """The launches of public function ``fn`` (a forward or backward) on x of ``shape``."""
    op = BY_NAME[fn.rsplit("_", 1)[0]]
    del launches.configs[:]
    if op.layout == "rows":
        return gpu_model.capture(fe, launches, fn, dtype, shape[0], shape[1])
    del launches[:]
    getattr(fe, fn)(*_group_args(fn, dtype, shape, groups))
    return list(launches)


class Probe:
    """What the launch code does for one public function and dtype, as a function of the
    row length (rows) or the spatial size (groups): the features the boundaries are found by."""

    def __init__(self, fe, launches, fn, dtype, shape_of):
        self.fe, self.launches, self.fn, self.dtype, self.shape_of = fe, launches, fn, dtype, shape_of
        self.groups = 2 if BY_NAME[fn.rsplit("_", 1)[0]].layout == "groups" else None
        self._memo = {}

    def __call__(self, n):
        if n not in self._memo:
            ls = launches_of(self.fe, self.launches, self.fn, self.dtype, self.shape_of(n), self.groups)
            self._memo[n] = (tuple(id(ln.kernel) for ln in ls), max((ln.shared for ln in ls), default=0))
        return self._memo[n]


def first_true(pred, lo, hi, step):
    """The smallest n in lo, lo + step, ... <= hi with pred(n), for a pred false then true
    along the lattice; None if pred(hi) is false."""
    if not pred(hi):
        return None
    k_lo, k_hi = 0, (hi - lo) // step
    if pred(lo):
        return lo
    while k_hi - k_lo > 1:
        mid = (k_lo + k_hi) // 2
        if pred(lo + mid * step):
            k_hi = mid
        else:
            k_lo = mid
    return lo + k_hi * step


def boundaries(fe, launches, op, dtype, tiny=False):
    """``[(n, label)]``: row lengths (rows) or spatial sizes (groups) on both sides of every
    boundary where the launch code changes what a forward or backward does: registers ->
    a long row staged in shared memory, 48 KB of shared memory (static scratch + dynamic,
    and dynamic alone), the last staged row -> the loop that re-reads; for layouts without
    staging, the register -> loop boundary.  On two lattices: lengths in whole 16-byte words,
    and odd lengths (single elements)."""
    from numbanorm.cuda._kernels import common as C

    default, _ = shared_limits()
    scratch = getattr(C, "SCRATCH_BYTES", None)  # the launch code's bound on a row kernel's static shared memory
    item = measure.ITEMSIZE[dtype]
    big = 1 << (12 if tiny else 21)
    out = []
    for fn in op.functions[1:]:
        if op.layout == "rows":
            probe = Probe(fe, launches, fn, dtype, lambda n: (2, n))
        else:  # one channel per group: the group's length is its channel's
            probe = Probe(fe, launches, fn, dtype, lambda n: (2, 2, n))
        for step, lo in ((max(1, 16 // item), max(1, 16 // item)), (2, 1)):
            top = lo + step * ((big - lo) // step)
            name = f"{fn.rsplit('_', 1)[1]}, {'words' if lo > 1 else 'odd'}"
            beyond = probe(top)[0]  # the kernel of rows far past every boundary: the loop that re-reads
            enter = first_true(lambda n: probe(n)[1] > 0 or probe(n)[0] == beyond, lo, top, step)
            if enter is None or enter == lo:
                continue
            staged = probe(enter)[1] > 0
            out += [(enter - step, f"last in registers ({name})"),
                    (enter, f"{'first staged' if staged else 'first loop'} ({name})")]
            if not staged:
                continue
            unstaged = first_true(lambda n: probe(n)[1] == 0, enter, top, step)
            last = top if unstaged is None else unstaged - step
            if unstaged is not None:
                out += [(last, f"last staged ({name})"), (unstaged, f"first re-read loop ({name})")]
            limits = [(default, "dynamic")]
            if scratch is not None:  # static + dynamic over the default, dynamic alone not yet
                limits.insert(0, (default - scratch, f"dynamic + {scratch} B static scratch"))
            for limit, what in limits:
                over = first_true(lambda n: probe(n)[1] > limit, enter, last, step)
                if over is not None and over > enter:
                    out += [(over - step, f"{what} <= {default} B ({name})"),
                            (over, f"{what} > {default} B ({name})")]
    labels = {}  # one case per n, with every reason for it
    for n, label in out:
        if n >= 1:
            labels.setdefault(n, []).append(label)
    return sorted((n, "; ".join(ls)) for n, ls in labels.items())


def striding_rows(fe, launches, op, dtype, shape_of, groups=None):
    """``(grid, rows)``: the persistent grid of ``op``'s forward and backward (their row
    mappings at many rows, ``common.row_config``) and rows enough for each block to take
    two rounds of rows (groups) and a bit."""
    grid, most = 0, 3
    for fn in op.functions[1:]:
        launches_of(fe, launches, fn, dtype, shape_of(1 << 24), groups)
        for cfg in launches.configs:
            grid = max(grid, cfg.grid)
            most = max(most, 2 * cfg.grid * cfg.rows + 1)
    return grid, most


# ---------------------------------------------------------------- array libraries

class Lib:
    """Making device arrays of one library from host values, in a given layout, and back."""

    name = ""

    def why_not(self, dtype):
        return ""

    def layout(self, host, how):
        """A device array holding ``host``'s values in layout ``how`` ('contiguous',
        'offsetB' (B bytes past an aligned start), 'rows_strided', 'cols_padded',
        'last_strided'); other elements of its parent are NaN."""
        dt = host.dtype
        if how == "contiguous":
            return self.put(host)
        if how.startswith("offset"):
            k = int(how[6:]) // dt.itemsize
            flat = np.full(host.size + k, np.nan, np.float32).astype(dt)
            flat[k:] = host.ravel()
            return self.reshape(self.put(flat)[k:], host.shape)
        lead = (slice(None),) * (host.ndim - 1)  # (numba's device arrays take no Ellipsis)
        sl = {"rows_strided": (slice(None, None, 2),),
              "cols_padded": lead + (slice(0, host.shape[-1]),),
              "last_strided": lead + (slice(None, None, 2),)}[how]
        grow = {"rows_strided": (2 * host.shape[0],) + host.shape[1:],
                "cols_padded": host.shape[:-1] + (host.shape[-1] + 3,),
                "last_strided": host.shape[:-1] + (2 * host.shape[-1],)}[how]
        parent = np.full(grow, np.nan, np.float32).astype(dt)
        parent[sl] = host
        return self.put(parent)[sl]


class NumbaLib(Lib):
    name = "numba"

    def __init__(self):
        from numba import cuda

        from numbanorm.cuda import _backend
        from numbanorm.cuda._kernels import common

        self.cuda, self.backend, self.C = cuda, _backend, common

    def put(self, host):
        return self.backend.to_device(np.ascontiguousarray(host))  # (bfloat16 as its bits)

    def host(self, a):
        if not a.is_c_contiguous():  # numba copies only whole buffers: gather on the device first
            c = self.cuda.device_array(a.shape, a.dtype)
            self.C.kview(c)[:] = self.C.kview(a)
            a = c
        return self.backend.to_host(a)

    def reshape(self, a, shape):
        return a.reshape(shape)

    def fill(self, a, host):
        host = np.ascontiguousarray(host)
        if host.dtype.name == "bfloat16":
            a, host = a.view(np.uint16), host.view(np.uint16)
        a.copy_to_device(host)

    def sync(self):
        self.cuda.synchronize()


class CupyLib(Lib):
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy

    def why_not(self, dtype):
        if dtype == "bfloat16":
            try:
                self.put(np.zeros(2, measure.host_dtype("bfloat16")))
            except Exception as e:  # a CuPy without ml_dtypes' bfloat16
                return f"CuPy makes no bfloat16 array: {type(e).__name__}: {e}"[:200]
        return ""

    def put(self, host):
        host = np.ascontiguousarray(host)
        if host.dtype.name == "bfloat16":
            return self.cp.asarray(host.view(np.uint16)).view(host.dtype)
        return self.cp.asarray(host)

    def host(self, a):
        if a.dtype.name == "bfloat16":
            return self.cp.asnumpy(a.view(np.uint16)).view(a.dtype)
        return self.cp.asnumpy(a)

    def reshape(self, a, shape):
        return a.reshape(shape)

    def fill(self, a, host):
        src = self.put(host)
        if a.dtype.name == "bfloat16":
            a, src = a.view(np.uint16), src.view(np.uint16)
        a[...] = src

    def sync(self):
        self.cp.cuda.Device().synchronize()


class TorchLib(Lib):
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def put(self, host):
        return measure.HostSide().to_torch(np.ascontiguousarray(host)).to("cuda")

    def host(self, a):
        t = a.detach()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).cpu().numpy().view(measure.host_dtype("bfloat16"))
        return t.cpu().numpy()

    def reshape(self, a, shape):
        return a.view(shape)

    def fill(self, a, host):
        a.copy_(self.put(host))

    def sync(self):
        self.torch.cuda.synchronize()


def libs(names):
    """``{name: Lib or the reason it cannot run}`` for the libraries asked for."""
    out = {}
    for name in names:
        try:
            if name == "numba":
                import numbanorm.cuda as nc

                out[name] = NumbaLib() if nc.is_available() else nc.why_unavailable()
            elif name == "torch":
                out[name] = TorchLib() if _torch_cuda() else _why_no_torch_cuda()
            elif name == "cupy":
                if _simulated():
                    out[name] = "numba's CUDA simulator: CuPy arrays need a GPU"
                else:
                    import cupy  # noqa: F401

                    out[name] = CupyLib()
        except Exception as e:  # not installed, or no GPU for it
            out[name] = f"{type(e).__name__}: {e}"[:200]
    return out


# ---------------------------------------------------------------- correctness cases

def _case(op, dtype, lib, shape, label, tier, groups=None, layout="contiguous", variant="standard"):
    shp = "x".join(map(str, shape)) + (f" G={groups}" if groups else "")
    return {"id": f"{op}|{dtype}|{lib}|{shp}|{layout}|{variant}", "op": op, "dtype": dtype, "lib": lib,
            "shape": list(shape), "groups": groups, "layout": layout, "variant": variant, "label": label,
            "tier": tier}


def plan(ops, dtypes, lib_names, tiny=False, select=None):
    """The correctness cases, in priority order (``tier``): 0, every function on every
    library at the basic shapes; 1, the boundaries, long rows, rows striding over the grid,
    layouts and out= overlaps on numba arrays; 2, the same on torch (and torch's side
    stream); 3, on CuPy.  ``select``: a regular expression a case's id or label must match.
    The bfloat16 inputs over 2**31 elements are planned apart (``big_cases``)."""
    fe = frontend()
    cases, seen = [], set()
    with recording() as launches:
        for opname in ops:
            for dtype in dtypes:
                for c in _op_cases(fe, launches, BY_NAME[opname], dtype, lib_names, tiny):
                    if c["id"] not in seen and (not select or re.search(select, f"{c['id']} {c['label']}")):
                        seen.add(c["id"])
                        cases.append(c)
    return sorted(cases, key=lambda c: c["tier"])


def _op_cases(fe, launches, op, dtype, lib_names, tiny):
    item = measure.ITEMSIZE[dtype]
    word = max(1, 16 // item)
    odd, mid_n = (101, 64) if tiny else (1001, 4096)
    found = boundaries(fe, launches, op, dtype, tiny)
    last = max((n for n, _ in found), default=mid_n)
    if op.layout == "rows":
        def shape_of(n, m=2):
            return (m, n)

        groups = {}
        odd_shape = (3, odd)
        basic = [((7, 1), "N = 1"), ((5, 33), "odd N, short rows"), (odd_shape, "odd N")]
        extra = [((2, 4 * last + 1), "a long row: the loop that re-reads (odd)")]
        staged = [n for n, label in found if "first staged" in label and n % word == 0]
        layout_ns = [mid_n] + staged[:1]
        many = [33, odd, mid_n] + staged[:1]
        channels = []
    else:
        def shape_of(n, m=2):
            return (m, 2, n)

        odd_shape = (2, 4, odd)
        groups = {(2, 4, 1): 2, (1, 3, 1, 1): 3, (3, 6, 7, 5): 3, (2, 8, 33): 8, odd_shape: 1}
        basic = [((2, 4, 1), "groups of 2 elements"), ((1, 3, 1, 1), "groups of 1 element"),
                 ((3, 6, 7, 5), "odd spatial size, 2 channels per group"), ((2, 8, 33), "instance norm (G = C)"),
                 (odd_shape, "one group (G = 1)")]
        extra = [((1, 2, 4 * last + 1), "a long group: the loop (odd)"),
                 ((2, 8, 2 * last + 2), "groups of 4 channels past the loop boundary")]
        layout_ns = [mid_n]
        many = [33, odd]
        # staged groups of 2 channels of an odd number of words: a thread's words in the y
        # pass, channel by channel, are not the ones it copied
        first = [n for n, label in found if "first staged (forward" in label]
        words = [n // (2 * word) + 1 for n in first[:1] if op.name == "group_norm"]  # 2 channels past it
        channels = [word * (k + 1 - k % 2) for k in words]
    # extreme inputs: a short row (registers) and the first staged one (the long-row kernel)
    range_ns = [odd] + [n for n, label in found if "first staged" in label][:1]
    gof = lambda s: groups.get(tuple(s), 2) if op.layout == "groups" else None  # noqa: E731
    cases = []
    for lib in lib_names:
        tier = {"numba": 1, "torch": 2, "cupy": 3}[lib]
        for shape, label in basic:
            cases.append(_case(op.name, dtype, lib, shape, label, 0, gof(shape)))
        for shape, label in [(shape_of(n), label) for n, label in found] + extra:
            cases.append(_case(op.name, dtype, lib, shape, label, tier, gof(shape)))
        for n in (many if lib == "numba" else []):  # more rows than the grid holds: blocks stride over rows
            grid, m = striding_rows(fe, launches, op, dtype, lambda m: shape_of(n, m), gof(shape_of(n)))
            cases.append(_case(op.name, dtype, lib, shape_of(n, m), f"rows stride over a grid of {grid}", tier,
                               gof(shape_of(n, m))))
        for n in (range_ns if lib == "numba" else []):  # extreme inputs, at shapes of the cases above
            shape = odd_shape if n == odd else shape_of(n)
            for variant, label in RANGE_VARIANTS.items():
                if _range_applies(op, dtype, variant):
                    cases.append(_case(op.name, dtype, lib, shape, label, tier, gof(shape), variant=variant))
        for c in (channels if lib == "numba" else []):
            grid, m = striding_rows(fe, launches, op, dtype, lambda m: (m, 4, c), 2)
            cases.append(_case(op.name, dtype, lib, (m, 4, c), "staged groups of 2 channels of an odd number of "
                               f"words, rows stride over a grid of {grid}", tier, 2))
        for n in (layout_ns if lib == "numba" else layout_ns[:1]):
            shape = shape_of(n)
            for b in (2, 4, 8):
                if b % item == 0:
                    cases.append(_case(op.name, dtype, lib, shape, f"views {b} bytes off alignment", tier,
                                       gof(shape), layout=f"offset{b}"))
            for how in ("rows_strided", "cols_padded", "last_strided"):
                cases.append(_case(op.name, dtype, lib, shape, "non-contiguous", tier, gof(shape), layout=how))
            if item == 2:  # float32 weight and bias, dy in float32, statistics in float64: the casts
                cases.append(_case(op.name, dtype, lib, shape, "parameters, dy and statistics of other dtypes",
                                   tier, gof(shape), variant="mixed"))
            if op.has_out:
                for variant in ("out_is_x", "out_shift", "out_weight"):
                    cases.append(_case(op.name, dtype, lib, shape, "out= overlapping an input", tier, gof(shape),
                                       variant=variant))
        if lib == "torch":
            shape = shape_of(mid_n)
            cases.append(_case(op.name, dtype, lib, shape, "torch side stream behind a sleeping kernel", 2,
                               gof(shape), variant="side_stream"))
    return cases


def big_cases(dtypes, tiny=False):
    """bfloat16 x of more than 2**31 elements on torch: rows of 8192 (LayerNorm, RMSNorm), and
    one row of 2**31 + 33 elements (LayerNorm); rows repeat with a period of 17, which divides
    no power of two, so a row read at an index wrapped by 32 bits reads another pattern."""
    if "bfloat16" not in dtypes or tiny:
        return []
    rows = 17 * ((1 << 31) // (17 * 8192) + 1)
    return [_case("layer_norm", "bfloat16", "torch", (rows, 8192), "x over 2**31 elements, rows of 8192", 1,
                  variant="big"),
            _case("rms_norm", "bfloat16", "torch", (rows, 8192), "x over 2**31 elements, rows of 8192", 1,
                  variant="big"),
            _case("layer_norm", "bfloat16", "torch", (1, (1 << 31) + 33), "one row of 2**31 + 33 elements", 1,
                  variant="big")]


def _seed(case):
    return zlib.crc32(case["id"].encode())


def _host_inputs(op, case):
    rng = np.random.default_rng(_seed(case))
    shape = tuple(case["shape"])
    return op.inputs(rng, shape, measure.host_dtype(case["dtype"]), case["groups"])


def _oracle(op, values):
    """The oracle's forward and backward on host ``values``: its backward on its own
    forward's statistics in the accumulation dtype and s in x's (as ``operations.compare``),
    the fused ones' statistics those of s as rounded to x's dtype (x + residual is not
    always exact in bfloat16: a row of one element would turn the difference into
    (s - mean) * 316)."""
    from numbanorm import reference

    ref_f = op.call(reference, "forward", values)
    xdt = values["x"].dtype
    acc = np.float64 if xdt == np.float64 else np.float32
    back, stats_of = dict(values), ref_f
    if op.fused:
        s = ref_f[op.forward_outputs.index("s")].astype(xdt)
        stats_of = op.call(reference, "forward", dict(values, x=s, residual=np.zeros_like(s)))
    for name, a, st in zip(op.forward_outputs, ref_f, stats_of):
        back[name] = (st if name in op.stats else a).astype(acc if name in op.stats else xdt)
    return ref_f, back, op.call(reference, "backward", back)


def _check(lib, names, got, want, tol):
    """``(worst output, its error)`` and whether every output is within ``tol``."""
    errs = [(n, relative_error(lib.host(g), w)) for n, g, w in zip(names, got, want)]
    worst = max(errs, key=lambda e: (not e[1] <= tol, e[1]))
    return worst, all(e <= tol for _, e in errs)


def _same_bits(lib, a, b):
    return all(np.array_equal(lib.host(x).view(np.uint8), lib.host(y).view(np.uint8)) for x, y in zip(a, b))


def run_case(case, lib):
    """Run one correctness case; returns its record (``status`` pass, fail, error or skip)."""
    import numbanorm

    rec = {k: case[k] for k in CASE_KEYS}
    if isinstance(lib, str):
        return dict(rec, status="skip", why=lib)
    why = lib.why_not(case["dtype"])
    if why:
        return dict(rec, status="skip", why=why)
    op, tol = BY_NAME[case["op"]], tolerance(case["dtype"])
    rec.update(tol=tol, errors={}, worst={})
    t0 = time.perf_counter()
    try:
        if case["variant"] == "big":
            ok = _run_big(case, lib, rec)
        else:
            ok = _run_standard(op, case, lib, rec, numbanorm)
        rec["status"] = "pass" if ok else "fail"
    except Exception as e:  # a crash is a failed case, with its reason
        rec.update(status="error", why=f"{type(e).__name__}: {e}"[:600])
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    try:
        rec["launches"] = _launch_info(case)
    except Exception as e:  # the record says so; the case's result stands
        rec["launches"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def _on_device(lib, vals, roles, layout="contiguous"):
    """``vals`` with the arrays of ``roles`` on the device (those shaped like x in ``layout``),
    the scalars as they are, the other arrays left out."""
    return {r: (lib.layout(v, layout) if r in BIG else lib.put(v)) if isinstance(v, np.ndarray) else v
            for r, v in vals.items() if r in roles or not isinstance(v, np.ndarray)}


# Extreme inputs, for the kernels' out-of-range paths (a row or group whose sums leave the
# accumulation dtype's range is redone from memory at a scale), every output in range:
# variant -> its label
RANGE_VARIANTS = {
    "huge": "extreme inputs: x times a power of two whose squares overflow",
    "tiny": "extreme inputs: x times a power of two whose squares underflow, eps = 0",
    "dy_huge": "extreme inputs: dy near the largest value on one row, the sums of weight * dy overflow",
}
# the power of two x (and the residual) is scaled by: exact, so the fused forms' x + residual
# stays exact; float16's reaches 4e4 (its accumulation in float32 cannot overflow); no float64
# tiny rows, whose variance the oracle takes to 0 (its rows are scaled against overflow alone)
RANGE_EXPONENT = {"huge": {"float16": 11, "bfloat16": 100, "float32": 100, "float64": 600},
                  "tiny": {"bfloat16": -100, "float32": -100}}


def _range_applies(op, dtype, variant):
    """Whether ``op`` in ``dtype`` has the extreme case ``variant``: dy near the largest value
    on the row operations alone (GroupNorm's dweight sums a channel's dy over its group,
    out of range), not in float64 (past the range of the oracle's float64 sums)."""
    if variant == "dy_huge":
        return op.layout == "rows" and dtype != "float64"
    return dtype in RANGE_EXPONENT[variant]


def _out_of_range(op, case, values):
    """``values`` made extreme as ``case['variant']`` says (``RANGE_VARIANTS``): x (and the
    residual) scaled by a power of two, with eps = 0 where its squares underflow; or row 1's
    dy between 0.5 and 0.6 of the dtype's largest value, its x +-1 (LayerNorm: |xhat| 1)
    or 0, 1, 2, 3 (RMSNorm), the residual 0, so that dx, dweight and dbias stay in range."""
    v, dt = dict(values), values["x"].dtype
    if case["variant"] == "dy_huge":
        rng = np.random.default_rng(_seed(case) + 1)
        n = v["x"].shape[-1]
        top = float(_finfo(dt).max)
        x, dy = v["x"].copy(), v["dy"].copy()
        x[1] = np.resize([1.0, -1.0] if op.bias else [0.0, 1.0, 2.0, 3.0], n)
        dy[1] = (rng.uniform(0.5, 0.6, n) if op.bias else np.full(n, 0.5)) * top
        v.update(x=x, dy=dy)
        if op.fused:
            v["residual"] = v["residual"].copy()
            v["residual"][1] = 0
        return v
    k = RANGE_EXPONENT[case["variant"]][case["dtype"]]
    for r in ("x", "residual"):
        if r in v:
            v[r] = np.ldexp(v[r].astype(np.float64), k).astype(dt)
    if case["variant"] == "tiny":
        v["eps"] = 0.0
    return v


def _finfo(dt):
    """np.finfo, bfloat16's from ml_dtypes."""
    if dt.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def _case_values(op, case):
    """``(values, forward oracle, backward values, backward oracle)`` of a case on the host;
    the 'mixed' variant has float32 parameters, dy in float32 and statistics in float64
    (the same values, exactly: what the kernels read after their casts is unchanged); the
    extreme ones, ``RANGE_VARIANTS``, their inputs as ``_out_of_range`` makes them."""
    values = _host_inputs(op, case)
    if case["variant"] in RANGE_VARIANTS:
        values = _out_of_range(op, case, values)
    ref_f, back, ref_b = _oracle(op, values)
    if case["variant"] == "mixed":
        values = dict(values, **{r: values[r].astype(np.float32) for r in op.params})
        back = dict(back, dy=back["dy"].astype(np.float32), **{r: back[r].astype(np.float64) for r in op.stats},
                    **{r: values[r] for r in op.params})
    return values, ref_f, back, ref_b


def _run_standard(op, case, lib, rec, numbanorm):
    values, ref_f, back, ref_b = _case_values(op, case)
    layout, variant = case["layout"], case["variant"]
    ok = True

    def record(fn, k, worst, good):
        rec["errors"].setdefault(fn, []).append(_finite(worst[1]))
        rec["worst"][fn] = worst[0]
        return good

    if variant in ("out_is_x", "out_shift", "out_weight"):
        return _run_out_overlap(op, case, lib, rec, values, ref_f[0], tol=rec["tol"])
    if variant == "side_stream":
        return _run_side_stream(op, case, lib, rec, values, ref_f, tol=rec["tol"])
    fwd_vals = _on_device(lib, values, op.forward_arrays, layout)
    results = []
    for k in range(CALLS):  # forward, keeping the statistics
        got = op.call(numbanorm, "forward", fwd_vals)
        worst, good = _check(lib, op.forward_outputs, got, ref_f, rec["tol"])
        ok &= record(op.functions[1], k, worst, good)
        results.append(got)
    rec["bitwise_repeat"] = _same_bits(lib, results[0], results[-1]) and _same_bits(lib, results[1], results[-1])
    if op.has_out:  # the plain function into an out= of NaN (in x's layout)
        nan = np.full(tuple(case["shape"]), np.nan, np.float32).astype(values["x"].dtype)
        for k in range(CALLS):
            out = lib.layout(nan, layout)
            got = op.call(numbanorm, "plain", fwd_vals, out=out)
            worst, good = _check(lib, ("returned", "out"), (got, out), (ref_f[0], ref_f[0]), rec["tol"])
            ok &= record(op.functions[0] + "(out=)", k, worst, good)
    else:
        for k in range(CALLS):
            got = op.call(numbanorm, "plain", fwd_vals)
            worst, good = _check(lib, op.plain_outputs, got, ref_f[:len(op.plain_outputs)], rec["tol"])
            ok &= record(op.functions[0], k, worst, good)
    bwd_vals = _on_device(lib, back, op.backward_arrays, layout)
    results = []
    for k in range(CALLS):
        got = op.call(numbanorm, "backward", bwd_vals)
        worst, good = _check(lib, op.backward_outputs, got, ref_b, rec["tol"])
        ok &= record(op.functions[2], k, worst, good)
        results.append(got)
    rec["bitwise_repeat"] &= _same_bits(lib, results[0], results[-1]) and _same_bits(lib, results[1], results[-1])
    return ok and rec["bitwise_repeat"]


def _run_out_overlap(op, case, lib, rec, values, want, tol):
    """The plain function with out= x, out= shifted one leading slice into x's buffer, or
    out= over the weight: as if every input were read first.  The buffer is refilled
    before each call (the last one wrote over its inputs)."""
    import numbanorm

    shape, x, w = tuple(case["shape"]), values["x"], values["weight"]
    n, lead = x.size, x.size // shape[0]
    if case["variant"] == "out_is_x":
        parent = x.ravel()
    elif case["variant"] == "out_shift":
        parent = np.concatenate([x.ravel(), np.full(lead, np.nan, np.float32).astype(x.dtype)])
    else:
        parent = np.full(n + x.size, np.nan, np.float32).astype(x.dtype)
        parent[n:] = x.ravel()
        parent[:w.size] = w
    buf = lib.put(parent)
    if case["variant"] == "out_weight":
        xa, out, wa = lib.reshape(buf[n:], shape), lib.reshape(buf[:n], shape), buf[:w.size]
    else:
        xa = lib.reshape(buf[:n], shape)
        out = xa if case["variant"] == "out_is_x" else lib.reshape(buf[lead:lead + n], shape)
        wa = lib.put(w)
    vals = dict(values, x=xa, weight=wa, **{r: lib.put(values[r]) for r in op.params if r != "weight"})
    ok = True
    for _ in range(CALLS):
        lib.fill(buf, parent)
        got = op.call(numbanorm, "plain", vals, out=out)
        worst, good = _check(lib, ("y",), (got,), (want,), tol)
        rec["errors"].setdefault(op.functions[0] + "(out=)", []).append(_finite(worst[1]))
        ok &= good
    return ok


def _run_side_stream(op, case, lib, rec, values, ref_f, tol):
    """torch on a side stream: x is written there behind a long sleeping kernel, then the
    call; a call that ran on another stream would read x before it is written (NaN)."""
    import numbanorm

    torch = lib.torch
    side = torch.cuda.Stream()
    ok = True
    for _ in range(CALLS):
        vals = _on_device(lib, values, op.forward_arrays)
        xs = {r: torch.full_like(vals[r], float("nan")) for r in op.forward_arrays if r in BIG}
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz
            for r, t in xs.items():
                t.copy_(vals[r])
            got = op.call(numbanorm, "forward", dict(vals, **xs))
        side.synchronize()
        worst, good = _check(lib, op.forward_outputs, got, ref_f, tol)
        rec["errors"].setdefault(op.functions[1], []).append(_finite(worst[1]))
        ok &= good
    return ok


def _periodic_error(torch, got, want):
    """max |got - want| relative to max(1, max |want|), ``got`` (any shape, flattened) being
    ``want`` (1-D) repeated (the last repetition may be cut short); in chunks on the GPU."""
    w = torch.as_tensor(np.asarray(want, np.float64).ravel(), device="cuda")
    flat, p, err = got.reshape(-1), w.numel(), 0.0
    chunk = p * max(1, (1 << 26) // p)
    for lo in range(0, flat.numel(), chunk):
        part = flat[lo:lo + chunk]
        k = part.numel() // p * p
        if k:
            err = max(err, float((part[:k].view(-1, p).double() - w).abs().max()))
        if k < part.numel():
            err = max(err, float((part[k:].double() - w[:part.numel() - k]).abs().max()))
    return err / max(1.0, float(w.abs().max()))


PERIOD = 17  # divides no power of two: an index wrapped by 32 bits lands on another pattern


def _run_big(case, lib, rec):
    """x of more than 2**31 bfloat16 elements, 17 distinct rows repeated (or one row of a
    17-periodic pattern, without weight and bias): the oracle runs on one period, and every
    output element is compared with it on the GPU."""
    import numbanorm

    torch, op, P = lib.torch, BY_NAME[case["op"]], PERIOD
    M, N = case["shape"]
    free, need = torch.cuda.mem_get_info()[0], (10 if M == 1 else 7) * M * N * 2
    if free < need:
        raise MemoryError(f"needs about {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB free")
    rng = np.random.default_rng(_seed(case))
    bf16 = measure.host_dtype("bfloat16")
    if M > 1:  # rows repeating every 17: the oracle on the 17 rows
        host = {"x": (3.0 + 2.0 * rng.standard_normal((P, N))).astype(bf16), op.shape_role: N,
                "weight": rng.uniform(0.5, 1.5, N).astype(bf16), "dy": rng.standard_normal((P, N)).astype(bf16)}
        if op.bias:
            host["bias"] = (0.1 * rng.standard_normal(N)).astype(bf16)
        ref_f, _, ref_b = _oracle(op, host)
        reps = M // P
        ref_b = [ref_b[0]] + [r * reps for r in ref_b[1:]]  # dweight, dbias: M / 17 periods' sums
        x, dy = lib.put(host["x"]).repeat(reps, 1), lib.put(host["dy"]).repeat(reps, 1)
        vals = {"x": x, op.shape_role: N, **{r: lib.put(host[r]) for r in op.params}}
    else:  # one row: x[j] = pattern[j % 17]; the statistics counted per residue
        pat = (3.0 + 2.0 * rng.standard_normal(P)).astype(bf16)
        dpat = rng.standard_normal(P).astype(bf16)
        counts = np.array([N // P + (r < N % P) for r in range(P)], np.float64)
        xf, df = pat.astype(np.float64), dpat.astype(np.float64)
        mean = (counts * xf).sum() / N
        rstd = 1 / np.sqrt((counts * (xf - mean) ** 2).sum() / N + 1e-5)
        xhat = (xf - mean) * rstd
        c1, c2 = (counts * xhat * df).sum() / N, (counts * df).sum() / N
        ref_f = [xhat, [mean], [rstd]]
        ref_b = [(df - (xhat * c1 + c2)) * rstd, df * xhat, df]
        x = lib.put(pat).repeat(N // P + 1)[:N].view(1, N)
        dy = lib.put(dpat).repeat(N // P + 1)[:N].view(1, N)
        vals = {"x": x, op.shape_role: N}
    ok = True
    for _ in range(CALLS):
        outs = op.call(numbanorm, "forward", vals)
        e = max(_periodic_error(torch, g, w) for g, w in zip(outs, ref_f))
        rec["errors"].setdefault(op.functions[1], []).append(_finite(e))
        ok &= e <= rec["tol"]
        back = dict(vals, dy=dy, **dict(zip(op.stats, outs[len(op.plain_outputs):])))
        del outs
        grads = op.call(numbanorm, "backward", back)
        e = max(_periodic_error(torch, g, w) for g, w in zip(grads, ref_b))
        rec["errors"].setdefault(op.functions[2], []).append(_finite(e))
        ok &= e <= rec["tol"]
        del grads, back
    torch.cuda.empty_cache()
    return ok


def _launch_info(case):
    """The launches a case's forward and backward make (kernel function, grid, block, dynamic
    shared bytes, and on a GPU the static shared bytes of the compiled kernel)."""
    if case["variant"] == "big":
        return None
    fe = frontend()
    info = []
    with recording() as launches:
        for fn in BY_NAME[case["op"]].functions[1:]:
            for ln in launches_of(fe, launches, fn, case["dtype"], tuple(case["shape"]), case["groups"]):
                static = None
                if not _simulated():
                    sizes = [k.shared_mem_per_block for k in getattr(ln.kernel, "overloads", {}).values()]
                    static = max(sizes) if sizes else None
                info.append([fn, getattr(ln.kernel, "__name__", str(ln.kernel)), ln.grid, ln.block, ln.shared,
                             static])
    return info


# ---------------------------------------------------------------- speed

def speed_cases(tiny=False):
    """The timed cases in the order they run (a budget cuts the last ones)."""
    out = []
    ns = (64, 128) if tiny else SPEED_NS
    rows = 64 if tiny else SPEED_ROWS
    for n in ns:
        for dtype in SPEED_DTYPES:
            for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
                for p in ("forward", "backward"):
                    out.append({"norm": name, "pass": p, "dtype": dtype, "shape": [rows, n], "groups": None})
        if n == ns[0]:
            for shape in (((2, 16, 4, 4),) if tiny else GN_SHAPES):
                for dtype in SPEED_DTYPES:
                    for p in ("forward", "backward"):
                        out.append({"norm": "group_norm", "pass": p, "dtype": dtype, "shape": list(shape),
                                    "groups": 4 if tiny else GN_GROUPS})
    return out


def _speed_label(case, impl=""):
    return f"{case['norm']} {case['pass']} {case['dtype']} {'x'.join(map(str, case['shape']))} {impl}".strip()


def _x_bytes(case):
    return math.prod(case["shape"]) * measure.ITEMSIZE[case["dtype"]]


def _arrays_moved(op, p):
    """Arrays of x's size a call must move: forward x (+ residual) in, y (+ s) out; backward
    dy, x or s (+ ds) in, dx out."""
    if p == "forward":
        return 2 * (1 + op.fused)
    return 3 + op.fused


COMPILE_BACKEND = "inductor"  # torch.compile's default; a test counts compiles with its own


def _compiled(torch, f):
    """``torch.compile(f)``, full graph, static shapes.  Every case's ``f`` is one code object
    (``SpeedCase._torch_fn``'s closure), on which Dynamo counts recompiles: past its limit (8 a
    process) it runs ``f`` eagerly, which would time torch eager under torch.compile's name.
    So the limit is lifted, and a hit raises (the case then skips torch.compile, saying why)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 4096)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
    cfg.fail_on_recompile_limit_hit = True
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # the 15 workers fill the cores: no compile pool each
    return torch.compile(f, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)


PEERS = ("torch", "torch.compile", "liger")
COMPILED_PEERS = ("torch.compile", "liger")  # whose warm-up compiles (inductor's and Liger's Triton kernels)
EAGER_PEERS = tuple(p for p in PEERS if p not in COMPILED_PEERS)  # warmed with numbanorm and the copy


class SpeedCase:
    """One timed case's callables (numbanorm, copy, and ``peers``: torch, torch.compile,
    liger), over tensors made on the GPU; ``warm`` makes them once (compiles), ``time``
    makes fresh tensors and times them with CUDA events, round-robin."""

    device = "cuda"

    def __init__(self, case, peers=PEERS):
        import torch

        self.case, self.torch, self.peers = case, torch, tuple(peers or ())
        self.op = BY_NAME[case["norm"]]
        self.compiled = None  # torch.compile's function, kept between warm and time
        self.skipped = {}  # impl -> why it is not timed

    def _tensors(self):
        torch, op, c = self.torch, self.op, self.case
        dt = getattr(torch, c["dtype"])
        shape = tuple(c["shape"])
        dev = self.device
        g = torch.Generator(device=dev).manual_seed(zlib.crc32(repr(c).encode()))
        n = shape[-1] if op.layout == "rows" else shape[1]

        def randn(*s):
            return (torch.randn(s, device=dev, generator=g) + 0.5).to(dt)

        v = {"x": randn(*shape), op.shape_role: n if op.layout == "rows" else c["groups"],
             "weight": (torch.rand(n, device=dev, generator=g) + 0.5).to(dt)}
        if op.bias:
            v["bias"] = (0.1 * torch.randn(n, device=dev, generator=g)).to(dt)
        if op.fused:
            v["residual"] = randn(*shape)
        grads = {"dy": randn(*shape)}
        if op.fused:
            grads["ds"] = randn(*shape)
        return v, grads

    def _torch_fn(self):
        """``f(x, weight, bias, residual) -> outputs`` of torch.nn.functional: the fused forms
        as add + the norm (their table's unfused row of the same torch function), returning s too."""
        F = self.torch.nn.functional
        op = self.op
        plain = next(o for o in OPERATIONS if not o.fused and o.torch == op.torch)

        def f(x, weight, bias=None, residual=None):
            vals = {"x": x, "weight": weight, op.shape_role: self._shape_arg()}
            if bias is not None:
                vals["bias"] = bias
            if residual is not None:
                s = x + residual
                return plain.call_torch(F, dict(vals, x=s)), s
            return plain.call_torch(F, vals)

        return f

    def _shape_arg(self):
        c = self.case
        return c["shape"][-1] if self.op.layout == "rows" else c["groups"]

    def _liger(self):
        """Liger-Kernel's function for this norm, ``f(x, weight, bias, residual)``, or the reason there is none."""
        try:
            from liger_kernel import ops as L
        except Exception as e:  # not installed, or its Triton missing
            return f"Liger-Kernel not importable: {type(e).__name__}: {e}"[:200]
        name, eps = self.op.name, 1e-5
        rms_eps = float(np.finfo(np.float32).eps)
        if name == "layer_norm":
            return lambda x, w, b=None, r=None: L.LigerLayerNormFunction.apply(x, w, b, eps)
        if name == "rms_norm":
            # in_place=False: Liger's default writes dx over dy, which every implementation here is
            # timed on (each Liger backward scaled it, to inf in float16 within a case's calls)
            return lambda x, w, b=None, r=None: L.LigerRMSNormFunction.apply(x, w, rms_eps, 0.0, "llama", False)
        if name == "add_rms_norm":
            return lambda x, w, b=None, r=None: L.LigerFusedAddRMSNormFunction.apply(x, r, w, rms_eps)
        if name == "group_norm":
            c, g = self.case["shape"][1], self.case["groups"]
            return lambda x, w, b=None, r=None: L.LigerGroupNormFunction.apply(x, w, b, c, g, eps)
        return "Liger-Kernel has no fused add + LayerNorm"

    def calls(self, v, grads):
        """``{impl: callable}`` for this case's pass over tensors ``v`` and ``grads``."""
        import numbanorm

        torch, op, c = self.torch, self.op, self.case
        args = (v["x"], v["weight"], v.get("bias"), v.get("residual"))
        out = {}
        nbytes = _arrays_moved(op, c["pass"]) * v["x"].numel() * v["x"].element_size()
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        out["copy"] = lambda: dst.copy_(src)
        peers = {}
        torch_f = self._torch_fn()
        if "torch" in self.peers:
            peers["torch"] = torch_f
        if "torch.compile" in self.peers:
            if self.compiled is None:
                self.compiled = _compiled(torch, torch_f)
            peers["torch.compile"] = self.compiled
        if "liger" in self.peers:
            liger = self._liger()
            if callable(liger):
                peers["liger"] = liger
            else:
                self.skipped.setdefault("liger", liger)
        if c["pass"] == "forward":
            out["numbanorm"] = lambda: op.call(numbanorm, "plain", v)
            for name, f in peers.items():
                out[name] = (lambda f=f: f(*args))
            return out
        stats = op.call(numbanorm, "forward", v)[len(op.plain_outputs):]
        back = dict(v, **grads, **dict(zip(op.stats, stats)))
        if op.fused:
            back["s"] = v["x"] + v["residual"]
        out["numbanorm"] = lambda: op.call(numbanorm, "backward", back)
        for name, f in peers.items():
            leaves = [a.detach().requires_grad_(True) if a is not None else None for a in args]
            try:
                res = f(*leaves)  # (torch.compile compiles here, forward and backward)
            except Exception as e:  # one peer failing leaves the others timed
                self.skipped.setdefault(name, f"{type(e).__name__}: {e}"[:300])
                continue
            res = res if isinstance(res, tuple) else (res,)
            wrt = [a for a in leaves if a is not None]
            gs = (grads["dy"], grads["ds"]) if len(res) == 2 else (grads["dy"],)
            out[name] = (lambda res=res, wrt=wrt, gs=gs: torch.autograd.grad(res, wrt, gs, retain_graph=True))
        return out

    def warm(self, only=None):
        """Each callable (those named in ``only``, if given) called twice."""
        v, grads = self._tensors()
        for name, f in self.calls(v, grads).items():
            if only is not None and name not in only:
                continue
            try:
                f()
                f()
            except Exception as e:  # one peer failing leaves the others timed
                self.skipped[name] = f"{type(e).__name__}: {e}"[:300]
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    clock = staticmethod(time.perf_counter)  # the host's clock, seconds (a test's timeline replaces it)

    def _queued(self, f, number, sleep_ms, cycles_per_ms):
        """``number`` calls of ``f`` between two CUDA events, queued behind a sleep kernel of
        ``sleep_ms`` on an idle GPU: ``(device ms per call, host ms per call, queued, slept
        ms)``, where ``queued`` says the host enqueued them all before the sleep ended, the
        sleep as the GPU timed it (an event before it: a clock that rose since
        ``cycles_per_ms`` was timed sleeps less than asked, and the GPU idles between calls)."""
        torch = self.torch
        torch.cuda.synchronize()
        es, e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        es.record()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        t0 = self.clock()
        e0.record()
        for _ in range(number):
            f()
        e1.record()
        host_ms = (self.clock() - t0) * 1e3
        e1.synchronize()
        slept = es.elapsed_time(e0)
        return e0.elapsed_time(e1) / number, host_ms / number, host_ms < slept, slept

    def _cycles_per_ms(self):
        """The sleep kernel's clock cycles per millisecond, timed."""
        torch = self.torch
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        torch.cuda._sleep(1_000_000)
        e1.record()
        e1.synchronize()
        return 1_000_000 / max(e0.elapsed_time(e1), 1e-3)

    def time(self, rounds=10, min_ms=1.0):
        """Rows of each impl's device time per call (median of ``rounds``, round-robin), and
        its host time per call. Each sample's calls wait behind a sleep kernel long enough for
        the host to enqueue them all: a call shorter on the GPU than on the host is timed by
        the GPU, not by its launch cost (GroupNorm's, about 0.03 ms of GPU time, were timed
        at their 0.06-0.1 ms of host time before; ``host_ms`` keeps that cost)."""
        torch, c = self.torch, self.case
        v, grads = self._tensors()
        calls = {k: f for k, f in self.calls(v, grads).items() if k not in self.skipped}
        for k, f in list(calls.items()):
            try:
                f()
            except Exception as e:  # one peer failing leaves the others timed
                self.skipped[k] = f"{type(e).__name__}: {e}"[:300]
                del calls[k]
        cpm = cpm0 = self._cycles_per_ms()
        number, host = {}, {}
        for k, f in calls.items():  # calls per sample: at least min_ms of GPU time
            ms, host[k], _, _ = self._queued(f, 3, 5.0, cpm)
            number[k] = int(min(50, max(1, math.ceil(min_ms / max(ms, 1e-3)))))
        names = list(calls)
        samples = {k: [] for k in names}
        hosts = {k: [] for k in names}
        unqueued = {k: 0 for k in names}
        for r in range(rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                sleep_ms = 1.5 * host[k] * number[k] + 0.2
                ms, h, queued, slept = self._queued(calls[k], number[k], sleep_ms, cpm)
                samples[k].append(ms)
                hosts[k].append(h)
                unqueued[k] += not queued
                # the clock as it is now, for the next sample's sleep (within a GPU's range of clocks)
                cpm = min(8 * cpm0, max(cpm0 / 8, int(sleep_ms * cpm) / max(slept, 1e-3)))
        nbytes = _arrays_moved(self.op, c["pass"]) * v["x"].numel() * v["x"].element_size()
        rows = []
        for k in names:
            ms = float(np.median(samples[k]))
            rows.append({"norm": c["norm"], "pass": c["pass"], "dtype": c["dtype"], "shape": c["shape"],
                         "impl": k, "gbps": round(nbytes / ms / 1e6, 1), "ms": round(ms, 5),
                         "host_ms": round(float(np.median(hosts[k])), 5), "unqueued_samples": unqueued[k]})
        del v, grads, calls
        torch.cuda.empty_cache()
        return rows, dict(self.skipped)


# ---------------------------------------------------------------- tune

# The launch code's knobs (numbanorm.cuda._kernels.common) tried against the cases the H200
# run found furthest from the copy, and RMSNorm's forward (the nearest) for comparison
TUNE_CASES = (("layer_norm", "forward", "bfloat16", (32768, 4096), None),
              ("rms_norm", "forward", "bfloat16", (32768, 4096), None),
              ("layer_norm", "backward", "bfloat16", (32768, 4096), None),
              ("group_norm", "forward", "bfloat16", (8, 512, 64, 64), 32),
              ("group_norm", "backward", "bfloat16", (8, 512, 64, 64), 32))
TUNE_KNOBS = ({}, {"ROW_RESIDENT": 768}, {"ROW_RESIDENT": 1024}, {"REG_ELEMS": 32, "MAX_VPT": 32},
              {"REG_ELEMS": 8}, {"MAX_ROWS_IN_FLIGHT": 1}, {"STAGE_BYTES": 0}, {"MAX_TPR": 1024})


TUNE_KNOBS_NAMES = ("REG_ELEMS", "MAX_VPT", "MAX_TPR", "BLOCK_THREADS", "ROW_RESIDENT", "MIN_RESIDENT",
                    "MAX_ROWS_IN_FLIGHT", "STAGE_BYTES", "SM_BYTES_IN_FLIGHT")


def set_knobs(knobs):
    """Set launch-code knobs in this process, before any kernel is built (a knob that is not
    one of ``common``'s tuning constants is a ValueError)."""
    from numbanorm.cuda._kernels import common as C

    for name, value in knobs.items():
        if name not in TUNE_KNOBS_NAMES or not isinstance(getattr(C, name, None), int):
            raise ValueError(f"not a tuning knob: {name}")
        setattr(C, name, int(value))
    C.row_config.cache_clear()


def tune_one(knobs, cases=TUNE_CASES, rounds=10):
    """In a process of its own (knobs are compiled into kernels, and numba's disk cache keys
    a kernel on neither its launch bounds nor these constants): numbanorm against the copy
    for each case, with ``knobs`` set.  Rows of ``{knobs, norm, pass, dtype, shape, groups,
    fraction_of_copy, ms}`` (``error`` instead where the case failed)."""
    set_knobs(knobs)
    rows = []
    for norm, p, dtype, shape, groups in cases:
        case = {"norm": norm, "pass": p, "dtype": dtype, "shape": list(shape), "groups": groups}
        sc = SpeedCase(case, peers=False)
        try:
            sc.warm()
            timed, _ = sc.time(rounds=rounds)
        except Exception as e:  # a knob the launch code cannot take: recorded, the others go on
            rows.append(dict(case, knobs=knobs, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        by = {r["impl"]: r["ms"] for r in timed}
        rows.append(dict(case, knobs=knobs, ms=by.get("numbanorm"),
                         fraction_of_copy=round(by["copy"] / by["numbanorm"], 3) if "numbanorm" in by else None))
    return rows


def tune(deadline, cache_root):
    """Each knob setting of TUNE_KNOBS in a fresh process with a fresh numba cache, one at a
    time (the GPU otherwise idle), until ``deadline``."""
    out, not_run = [], []
    for k, knobs in enumerate(TUNE_KNOBS):
        left = deadline - time.monotonic()
        if left < 10:
            not_run.append(knobs)
            continue
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache_root, f"tune-{k}"),
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--tune-one", json.dumps(knobs)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("[")]
            out += json.loads(lines[-1]) if lines else [{"knobs": knobs, "error": done.stderr[-600:]}]
        except subprocess.TimeoutExpired:
            not_run.append(knobs)
    return {"rows": out, "not_run": not_run}


# ---------------------------------------------------------------- host cost

HOST_FUNCTIONS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


def host_cost(calls=200, rounds=15, warm_only=False):
    """Host time per call (microseconds, median over rounds of ``calls`` calls each, no
    synchronisation inside a round) of the public forward on bfloat16 torch CUDA tensors, and
    of torch eager's counterpart (the fused forms: add + norm)."""
    import numbanorm
    import torch

    F = torch.nn.functional
    res = {"numbanorm": {}, "torch": {}, "shape": [list(s) for s in HOST_SHAPES], "dtype": "bfloat16",
           "how": f"median over {rounds} rounds of the wall time of {calls} back-to-back calls / {calls}"}
    for name in HOST_FUNCTIONS:
        op = BY_NAME[name]
        for who in ("numbanorm", "torch"):
            res[who][name] = []
        for shape in HOST_SHAPES:
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            v = {"x": x, op.shape_role: shape[-1], "weight": torch.ones(shape[-1], device="cuda", dtype=x.dtype)}
            if op.bias:
                v["bias"] = torch.zeros_like(v["weight"])
            if op.fused:
                v["residual"] = torch.randn_like(x)
            fns = {"numbanorm": lambda: op.call(numbanorm, "plain", v),
                   "torch": lambda: op.call_torch(F, v)}
            for who, f in fns.items():
                for _ in range(20):
                    f()
                torch.cuda.synchronize()
                if warm_only:
                    continue
                per = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    per.append((time.perf_counter() - t0) / calls * 1e6)
                    torch.cuda.synchronize()
                res[who][name].append(round(float(np.median(per)), 2))
            if not warm_only and shape == HOST_SHAPES[0]:
                res.setdefault("profile", {})[name] = host_profile(fns["numbanorm"], calls)
    return res


def host_profile(f, calls, top=15):
    """Where ``calls`` calls of ``f`` spend their host time: cProfile's functions by own
    time, as ``[where, calls per call, own us per call, cumulative us per call]`` (the
    profiler's overhead inflates every figure; their order is what to read)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        f()
    prof.disable()
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
        where = f"{os.path.basename(os.path.dirname(file))}/{os.path.basename(file)}:{line}({fn})"
        rows.append([where, round(ncalls / calls, 2), round(tottime / calls * 1e6, 2),
                     round(cumtime / calls * 1e6, 2)])
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


# ---------------------------------------------------------------- CUDA graph

def cuda_graph(warm_only=False):
    """A small float32 model (LayerNorm, RMSNorm, GroupNorm between linear layers), its norms
    swapped by ``replace_norms``, forward captured with ``torch.cuda.graph`` and replayed on new
    inputs; and a training step (forward and backward) captured the same way."""
    import copy

    import torch

    import numbanorm.torch as nt

    torch.manual_seed(0)
    d, groups = 256, 8

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
            self.l2, self.rms = torch.nn.Linear(d, d), torch.nn.RMSNorm(d)
            self.gn, self.l3 = torch.nn.GroupNorm(groups, d), torch.nn.Linear(d, d)

        def forward(self, x):  # x (B, T, d)
            h = torch.nn.functional.gelu(self.ln(self.l1(x)))
            h = self.rms(self.l2(h))
            h = self.gn(h.transpose(1, 2).contiguous()).transpose(1, 2)
            return self.l3(h)

    eager = Small().cuda()
    model = nt.replace_norms(copy.deepcopy(eager))
    static_x = torch.randn(4, 64, d, device="cuda")
    res = {"captured": False, "max_abs_diff": None, "dtype": "float32"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    if warm_only:
        return res
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(graph):
            static_y = model(static_x)
    res["captured"] = True
    diffs, vs_ours = [], []
    with torch.no_grad():
        for k in range(3):
            x = torch.randn_like(static_x)
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            diffs.append(float((static_y - eager(x)).abs().max()))
            vs_ours.append(float((static_y - model(x)).abs().max()))
        scale = float(eager(x).abs().max())
    res.update(max_abs_diff=max(diffs), max_abs_diff_vs_numbanorm_eager=max(vs_ours), output_scale=scale,
               replays=3)
    # a training step: forward, loss, backward, captured whole (gradients into .grad)
    try:
        params = list(model.parameters())
        opt_x = torch.randn(4, 64, d, device="cuda")
        with torch.cuda.stream(side):
            for _ in range(3):
                model(opt_x).square().mean().backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in params:
            p.grad = None
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            loss = model(opt_x).square().mean()
            loss.backward()
        g2.replay()
        torch.cuda.synchronize()
        got = [p.grad.clone() for p in params]
        for p in eager.parameters():
            p.grad = None
        eager(opt_x).square().mean().backward()
        res["train_step_captured"] = True
        res["train_step_max_abs_grad_diff"] = max(float((a - p.grad).abs().max())
                                                  for a, p in zip(got, eager.parameters()))
    except Exception as e:  # the forward's result stands; the step's failure is reported
        res["train_step_captured"] = False
        res["train_step_error"] = f"{type(e).__name__}: {e}"[:400]
    # per-sample gradients by torch.func (vmap of grad of functional_call), not captured:
    # numbanorm's vmap rules and backward on CUDA tensors, against the eager model's
    try:
        res["per_sample_grad_max_abs_diff"] = per_sample_grad_diff(model, eager, torch.randn(4, 64, d, device="cuda"))
    except Exception as e:
        res["per_sample_grad_error"] = f"{type(e).__name__}: {e}"[:400]
    return res


def per_sample_grad_diff(model, eager, xs):
    """The largest difference between two models' per-sample gradients of every parameter
    (``torch.func.vmap(torch.func.grad(...))`` over the first dimension of ``xs``)."""
    import torch

    func = torch.func
    got = []
    for m in (model, eager):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(params, x, m=m):
            return func.functional_call(m, params, (x[None],)).square().mean()

        got.append(func.vmap(func.grad(loss), in_dims=(None, 0))(params, xs))
    return max(float((got[0][k] - got[1][k]).abs().max()) for k in got[1])


# ---------------------------------------------------------------- CPU scaling

CPU_NORMS = ("layer_norm", "rms_norm")
CPU_DTYPES = ("float32", "bfloat16")


def cpu_scaling(deadline, shape=CPU_SHAPE, threads=CPU_THREADS, dtypes=CPU_DTYPES, warm_only=False):
    """numbanorm on the CPU (forward into out=, backward) against a copy of the same arrays
    on the same threads (``measure.parallel_copy``), over thread counts."""
    import numba

    import numbanorm

    limit = numba.config.NUMBA_NUM_THREADS
    rows = []
    for dtype in dtypes:
        inp = None  # one set of arrays per dtype (LayerNorm and RMSNorm take the same)
        for norm in CPU_NORMS:
            for direction in measure.DIRECTIONS:
                case = measure.Case(norm, direction, shape, dtype, device="cpu")
                inp = inp or measure.Inputs(case, measure.HostSide())
                calls = measure.numbanorm_calls(numbanorm, case, inp)
                mode = "out" if direction == "forward" else "alloc"
                runners = [measure.Runner("numbanorm", mode, calls[mode]),
                           measure.Runner("copy", "out", measure.threaded_floor_calls(case, inp)["out"])]
                if warm_only:
                    for r in runners:
                        r.fn()
                    continue
                for n in threads:
                    if n > limit or time.monotonic() > deadline:
                        continue
                    measure.set_threads(n)
                    measure.time_runners(runners, budget_s=0.2, max_repeats=10, min_repeats=3)
                    kernel, copy = (r.quantiles()[1] for r in runners)
                    k_gbps, c_gbps = case.bytes / kernel / 1e9, case.floor_bytes / copy / 1e9
                    rows.append({"norm": norm, "pass": direction, "mode": mode, "dtype": dtype, "shape": list(shape),
                                 "threads": n, "ms": round(kernel * 1e3, 4), "gbps": round(k_gbps, 2),
                                 "copy_ms": round(copy * 1e3, 4), "copy_gbps": round(c_gbps, 2),
                                 "vs_copy": round(c_gbps / k_gbps, 3)})
                    for r in runners:
                        r.samples = []
    measure.set_threads(None)
    return rows


# ---------------------------------------------------------------- the static model beside the measurement

def model_rows(speed):
    """For each numbanorm speed row: its measured fraction of the copy's GB/s and the static
    model's for the same kernel, dtype and N (memory clocks / max(memory, issue) clocks of
    the main launch: the bandwidth it can keep busy), where the model has that record, and
    the model calibrated on the committed device run (``gpu_model.calibration``).
    GroupNorm's rows, from the model's records at their shape: the main launch's memory
    clocks over the sum of max(memory, issue) clocks of every launch of the call (the
    backward reads x and dy in two launches), and the curve's fraction for a call of one
    launch (the forward) alone."""
    path = os.path.join(HERE, "results", "gpu-model.json")
    try:
        with open(path) as f:
            model = json.load(f)
    except OSError:
        model = {"records": []}
    current = model.get("kernel_sources_sha256") == gpu_model.kernel_sources()
    try:
        with open(os.path.join(HERE, "results", gpu_model.CALIBRATION_RUN)) as f:
            cal = gpu_model.calibration(json.load(f))
    except OSError:
        cal = None
    recs = {(r["kernel"], r["dtype"], r["N"]): r for r in model.get("records", [])
            if r.get("launch") == "main" and r.get("M") == SPEED_ROWS}
    shaped = {}  # (kernel, dtype, shape) -> every launch's record
    for r in model.get("group_shapes_records", []):
        shaped.setdefault((r["kernel"], r["dtype"], tuple(r["shape"])), []).append(r)
    copy = {(r["norm"], r["pass"], r["dtype"], tuple(r["shape"])): r for r in speed if r["impl"] == "copy"}
    out = []
    for r in speed:
        if r["impl"] != "numbanorm":
            continue
        c = copy.get((r["norm"], r["pass"], r["dtype"], tuple(r["shape"])))
        row = {"norm": r["norm"], "pass": r["pass"], "dtype": r["dtype"], "shape": r["shape"],
               "measured_fraction_of_copy": round(r["gbps"] / c["gbps"], 3) if c else None,
               "model_fraction": None, "model_issue_memory_ratio": None, "calibrated_fraction": None,
               "single_launch": None, "model_of_current_kernels": current}
        kernel = f"{r['norm']}_{r['pass']}"
        if BY_NAME[r["norm"]].layout == "rows":
            m = recs.get((kernel, r["dtype"], r["shape"][1]))
            launches = [m] if m else []
        else:
            launches = shaped.get((kernel, r["dtype"], tuple(r["shape"])), [])
            m = next((x for x in launches if x["launch"] == "main"), None)
        if m:
            busy = sum(max(x["memory_clocks_per_row"], x["issue_clocks_per_row"]) for x in launches)  # (count in)
            row["model_fraction"] = round(m["memory_clocks_per_row"] / busy, 3)
            row["model_issue_memory_ratio"] = m["issue_memory_ratio"]
            row["single_launch"] = len(launches) == 1  # (the calibration fits these only)
            if cal and len(launches) == 1:  # (fitted on the committed device run: out of sample for any other)
                row["calibrated_fraction"] = round(gpu_model.calibrated_fraction(m["issue_memory_ratio"],
                                                                                 cal["a"]), 3)
        out.append(row)
    return out


# ---------------------------------------------------------------- compute-sanitizer

def sanitize_cases(ops, tiny=False):
    """A small case of every kernel: per operation and dtype, short rows, a row in
    registers, a staged row and one past staging (GroupNorm: its shapes and the loop), on
    numba arrays, at the shapes of correctness cases (their kernels compiled); forward,
    plain out= and backward each once.  bfloat16 (the 16-bit path) and float32 first,
    float16 and float64 after them (a budget cut leaves the dtypes whose kernels share
    the others' code), then float32's extreme inputs (``RANGE_VARIANTS``)."""
    fe = frontend()
    out = []
    with recording() as launches:
        for dtype in ("bfloat16", "float32", "float16", "float64"):
            for name in ops:
                op = BY_NAME[name]
                found = boundaries(fe, launches, op, dtype, tiny)
                picks = [n for n, label in found if any(f"{what} ({kind}, words)" in label for what in (
                    "first staged", "first re-read loop", "first loop") for kind in ("forward", "backward"))]
                mid = 64 if tiny else 4096  # the shapes of correctness cases: their kernels are compiled
                if op.layout == "rows":
                    shapes = [((5, 33), None), ((2, mid), None)] + [((2, n), None) for n in picks]
                else:
                    shapes = [((2, 8, 33), 8), ((2, 4, 101 if tiny else 1001), 1)] + [((2, 2, n), 2) for n in picks]
                for shape, groups in shapes:
                    out.append(_case(name, dtype, "numba", shape, "sanitizer", 0, groups))
                if measure.ITEMSIZE[dtype] == 2:  # the cast kernel, and parameters of another dtype
                    shape = (2, mid) if op.layout == "rows" else (2, 2, mid)
                    out.append(_case(name, dtype, "numba", shape, "sanitizer", 0, 2 if op.layout == "groups" else None,
                                     variant="mixed"))
    # the paths that redo a row or group out of range: float32's extreme correctness cases
    return out + [dict(c, label="sanitizer", tier=0) for c in plan(ops, ["float32"], ["numba"], tiny)
                  if c["variant"] in RANGE_VARIANTS]


def run_sanitize_cases(cases):
    """The child's side (``--sanitize-case``): each case's forward, plain (out=) and backward
    once on numba arrays, nothing copied back; one line per case."""
    import numbanorm

    lib = NumbaLib()
    for case in cases:
        op = BY_NAME[case["op"]]
        values, _, back, _ = _case_values(op, case)
        fwd = _on_device(lib, values, op.forward_arrays)
        op.call(numbanorm, "forward", fwd)
        if op.has_out:
            op.call(numbanorm, "plain", fwd, out=lib.put(np.zeros(values["x"].shape, values["x"].dtype)))
        op.call(numbanorm, "backward", _on_device(lib, back, op.backward_arrays))
        lib.sync()
        print(f"sanitize-case done {case['id']}", flush=True)


def _sanitizer():
    """compute-sanitizer's path: on the PATH, else under CUDA_HOME or /usr/local/cuda."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            p = os.path.join(root, "compute-sanitizer", "compute-sanitizer")
            if os.path.exists(p):
                return p
            p = os.path.join(root, "bin", "compute-sanitizer")
            if os.path.exists(p):
                return p
    return None


def sanitizer(run, ops, env):
    """Each tool in its own process (in parallel) over ``sanitize_cases``; a tool still
    running at the section's end is killed with the Python it instruments (each tool in a
    session of its own: killing compute-sanitizer alone left its child on the GPU and the
    CPU into the sections after)."""
    tool = _sanitizer()
    if _simulated():
        raise Skip("numba's CUDA simulator: compute-sanitizer needs a GPU")
    if tool is None:
        raise Skip("compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda)")
    cases = sanitize_cases(ops)
    deadline = run.section_deadline("sanitizer")
    work = tempfile.mkdtemp(prefix="gpucheck-sanitize-")
    listing = os.path.join(work, "cases.json")
    with open(listing, "w") as f:
        json.dump(cases, f)
    procs = {}
    # a run ended by the lease's timeout (SIGTERM) still kills the tools' sessions, on the way out
    term = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        for name in run.args.sanitize_tools:
            log = open(os.path.join(work, f"{name}.log"), "w")
            cmd = [tool, "--tool", name, "--print-limit", "20", *TOOL_FLAGS[name], sys.executable, "-m",
                   "benchmarks.gpu_check", "--sanitize-case", listing]
            procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True), log)
        tools, total = {}, 0
        for name, (p, log) in procs.items():
            timed_out = False
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_session(p)
                timed_out = True
            log.close()
            with open(log.name, errors="replace") as f:
                text = f.read()
            errors = summary_errors(text)
            done = text.count("sanitize-case done")
            tools[name] = {"errors": errors, "cases_run": done, "cases": len(cases), "exit": p.returncode,
                           "timed_out": timed_out,
                           "first_errors": [ln for ln in text.splitlines() if ln.startswith("========= ")
                                            and "SUMMARY" not in ln][:40],
                           "tail": text[-1500:] if errors is None or p.returncode else ""}
            total += errors or 0
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                _kill_session(p)
        signal.signal(signal.SIGTERM, term)
    return {"tools": tools, "errors": total if all(t["errors"] is not None for t in tools.values()) else None,
            "cases": [c["id"] for c in cases]}


def _kill_session(p):
    """Kill process ``p``, started in a session of its own, and every process of its group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def summary_errors(text):
    """The errors a compute-sanitizer log reports, or None without its summary line:
    memcheck, synccheck and initcheck print "ERROR SUMMARY: N errors", racecheck
    "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" (every hazard counts)."""
    m = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(r"RACECHECK SUMMARY: (\d+) hazard", text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- worker processes

def _lock_numba_caches():
    """Serialise numba's cache writes and reads across processes (a file lock beside each
    index): two processes saving kernels of the same function at once could otherwise give
    two kernels one data file.  False where the cache classes are not the known ones."""
    import fcntl

    patched = False
    for modname in ("numba.core.caching", "numba.cuda.core.caching"):
        try:
            mod = __import__(modname, fromlist=["IndexDataCacheFile"])
            cls = mod.IndexDataCacheFile
        except (ImportError, AttributeError):
            continue
        if getattr(cls, "_gpucheck_locked", False):
            patched = True
            continue
        for meth, mode in (("save", fcntl.LOCK_EX), ("load", fcntl.LOCK_SH)):
            orig = getattr(cls, meth)

            def locked(self, *a, _orig=orig, _mode=mode, **k):
                path = getattr(self, "_index_path", None)
                if path is None:
                    return _orig(self, *a, **k)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + ".lock", "a") as lk:
                    fcntl.flock(lk, _mode)
                    try:
                        return _orig(self, *a, **k)
                    finally:
                        fcntl.flock(lk, fcntl.LOCK_UN)

            setattr(cls, meth, locked)
        cls._gpucheck_locked = patched = True
    return patched


class Jobs:
    """What a worker does: ``kind`` -> (phase-1 function, phase-2 function or None); each
    takes the job and the worker's state (what phase 1 kept for phase 2)."""

    @staticmethod
    def correctness(job, state):
        lib_objs = state.setdefault("libs", {})
        part = state.get("part", _no_part)  # each case as it finishes: a worker killed later keeps it
        out = []
        for case in job["cases"]:
            if time.time() > job["deadline"]:
                out += _unrun([case], "not run", "the correctness budget ran out")
                continue
            if case["lib"] not in lib_objs:
                lib_objs.update(libs([case["lib"]]))
            rec = run_case(case, lib_objs[case["lib"]])
            out.append(rec)
            part(rec)
            if rec["status"] == "error" and any(s in rec.get("why", "") for s in STICKY):
                state["sticky"] = rec["why"]
                break
        return out

    @staticmethod
    def speed_warm(job, state):
        """A timed case's cheap part, first for every case: numbanorm, the copy and torch
        eager (numbanorm's kernels compile, from numba's cache where a run filled it); the
        compiled peers come after every case's (``speed_peers``), on this worker."""
        keep = state.setdefault("speed", {})
        res = []
        for case in job["cases"]:
            if time.time() > job.get("deadline", math.inf):  # (speed_time warms it, eagerly)
                res.append({})
                continue
            sc = SpeedCase(case, peers=EAGER_PEERS)
            try:
                with _gpu_memory(state.get("heavy"), _x_bytes(case)):
                    sc.warm()
            except Exception as e:  # its own loss: the job's other case kept; speed_time tries again
                res.append({"warm-up": f"{type(e).__name__}: {e}"[:300]})
                _release()
                continue
            keep[json.dumps(case, sort_keys=True)] = sc
            res.append(sc.skipped)
        return res

    @staticmethod
    def speed_peers(job, state):
        """The compiled peers of cases this worker warmed (``speed_warm``): torch.compile's
        graphs and Liger's Triton kernels, the slow part of a warm-up (on an H200 a case's
        whole warm-up took tens of seconds, three at a time, and the N = 1024 and 2048 rows,
        warmed last, never ran)."""
        keep = state.get("speed", {})
        for case in job["cases"]:
            if time.time() > job.get("deadline", math.inf):  # no compile begun past phase 1's end
                break
            sc = keep.get(json.dumps(case, sort_keys=True))
            if sc is None:  # its cheap part failed: nothing to time
                continue
            new = [p for p in COMPILED_PEERS if p not in sc.peers]
            before = sc.peers
            sc.peers += tuple(new)
            try:
                with _gpu_memory(state.get("heavy"), _x_bytes(case)):
                    sc.warm(only=new)
            except Exception:  # the case is timed without them, not compiled in the timed phase
                sc.peers = before
                raise
        return None

    @staticmethod
    def speed_time(job, state):
        rows, skipped = [], {}
        for case in job["cases"]:
            if time.time() > job["deadline"]:
                skipped[_speed_label(case)] = "the speed budget ran out"
                continue
            sc = state.get("speed", {}).get(json.dumps(case, sort_keys=True))
            try:
                if sc is None:  # (no compiled peer: their compiles would take the timed phase's time)
                    sc = SpeedCase(case, peers=EAGER_PEERS)
                    sc.warm()
                r, s = sc.time()
            except Exception as e:  # (an out-of-memory on an H200, twice): the job's other case kept
                skipped[_speed_label(case)] = f"{type(e).__name__}: {e}"[:300]
                _release()
                continue
            rows += r
            for k, why in s.items():
                skipped[_speed_label(case, k)] = why
            for k in PEERS:
                if k not in sc.peers:
                    skipped[_speed_label(case, k)] = "not warmed within phase 1"
        return {"rows": rows, "skipped": skipped}

    @staticmethod
    def big(job, state):
        """The inputs over 2**31 elements, early in the parallel phase (when they ran after
        it, the timed cases' warm-ups held all but 25 GiB of an H200 and two were refused):
        their kernels first, on small inputs of the same mappings, then the cases."""
        lib = TorchLib()
        part = state.get("part", _no_part)
        for case in job["cases"]:
            small = dict(case, variant="standard", shape=[3, case["shape"][1]] if case["shape"][0] > 1
                         else [1, (1 << 21) + 33])
            run_case(small, lib)
        out = []
        for case in job["cases"]:
            out.append(run_case(case, lib))
            part(out[-1])
        return out


def _no_part(item):
    """Where a job runs in this process, nothing is sent ahead of its result."""


PHASES = {"correctness": (Jobs.correctness, None), "speed": (Jobs.speed_warm, Jobs.speed_time),
          "speed_peers": (Jobs.speed_peers, None),
          "host": (lambda job, state: host_cost(warm_only=True), lambda job, state: host_cost()),
          "graph": (lambda job, state: cuda_graph(warm_only=True), lambda job, state: cuda_graph()),
          "cpu": (lambda job, state: cpu_scaling(0, warm_only=True), None), "big": (Jobs.big, None)}


PART = "part"  # a worker's message in place of a phase: one item of a job's result, sent as it is ready

# timed cases whose x is this large warm up a few at a time, as the GPU's free memory holds them
# (a backward's tensors and three peers' graphs: about HEAVY_ARRAYS arrays of x's size)
HEAVY_BYTES = 128 << 20
HEAVY_ARRAYS = 15
HEAVY_AT_ONCE = 3  # of the largest, where the free memory is not known


def _units(nbytes):
    """The GiB a warm-up of a timed case whose x has ``nbytes`` holds (0 below HEAVY_BYTES)."""
    return math.ceil(HEAVY_ARRAYS * nbytes / 2**30) if nbytes >= HEAVY_BYTES else 0


def heavy_units(free_bytes, tiny=False):
    """The GiB the timed cases' warm-ups may hold at once: 60 % of the GPU memory free as
    the workers start (the rest for their contexts and the cases below HEAVY_BYTES: an
    H100 warms three of the largest at once, an H200 five), or HEAVY_AT_ONCE of the largest
    case where that is not known; at least the largest."""
    largest = _units(max(_x_bytes(c) for c in speed_cases(tiny))) or 1
    if free_bytes is None:
        return HEAVY_AT_ONCE * largest
    return max(largest, int(free_bytes * 0.6) >> 30)


@contextlib.contextmanager
def _gpu_memory(heavy, nbytes):
    """Hold a warm-up's share of the GPU memory (``Pool``'s ``heavy``: a semaphore of GiB, a
    gate, their number) while it runs; a case below HEAVY_BYTES takes none."""
    n = _units(nbytes)
    if heavy is None or not n:
        yield
        return
    units, gate, total = heavy
    n = min(n, total)
    with gate:  # one taker at a time: two holding part of what each needs could wait on each other
        for _ in range(n):
            units.acquire()
    try:
        yield
    finally:
        for _ in range(n):
            units.release()


def _worker(wid, tasks, results, cache_dir, heavy):
    """A worker process: phase 1 and phase 2 functions of the jobs it is sent, in order."""
    import numba

    os.environ["NUMBA_CACHE_DIR"] = cache_dir
    numba.config.reload_config()
    _lock_numba_caches()
    state = {"heavy": heavy}
    while True:
        msg = tasks.get()
        if msg is None:
            return
        phase, job = msg
        state["part"] = lambda item, jid=job["id"]: results.send((wid, jid, PART, item, None, 0.0))
        t0 = time.time()
        try:
            res, err = PHASES[job["kind"]][phase](job, state), None
        except Exception as e:  # reported with the job; a sticky CUDA error ends the worker
            res, err = None, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        results.send((wid, job["id"], phase, res, err, round(time.time() - t0, 2)))
        if "sticky" in state or (err and any(s in err for s in STICKY)):
            return
        _release()


def _release():
    """Hand the memory the libraries' pools keep back to the device (the workers share it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    # numba frees device arrays late: not before ten are pending or a fifth of the device's
    # memory is (28 GiB on an H200), so a few large arrays can stay with each worker (in the
    # H200's runs, warm-ups were refused while other workers held 3-19 GiB each)
    cuda = sys.modules.get("numba.cuda")
    if cuda is not None and not _simulated() and cuda.is_available():
        cuda.current_context().deallocations.clear()


def _error():
    return f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}\n{traceback.format_exc()[-2000:]}"


class Pool:
    """Worker processes (``spawn``) each with its own task queue, so that phase 2 of a job
    runs on the worker that did its phase 1, as does a job ``on`` another; ``n == 0`` runs
    everything in this process.  ``heavy``: the GiB of GPU memory the timed cases' warm-ups
    share (``heavy_units``)."""

    def __init__(self, n, cache_dir, heavy=None):
        self.n, self.cache_dir = n, cache_dir
        self.state = {"heavy": None}  # in-process mode
        self.owner = {}  # job id -> worker id that ran phase 1
        self.workers = {}
        if n:
            import multiprocessing as mp

            self.ctx = mp.get_context("spawn")
            # a pipe of its own from each worker, not one queue: a worker killed while sending
            # (its queue's feeder holding the lock every writer shares) left the lock held, and
            # every other worker's results waited for it for good
            self.results = {}  # worker id -> the receiving end of its pipe
            heavy = heavy or heavy_units(None)  # (the GiB of GPU memory the timed cases' warm-ups share)
            self.heavy = (self.ctx.BoundedSemaphore(heavy), self.ctx.Lock(), heavy)
            self._next = 0
            # inductor compiles in the worker (the workers are the parallelism)
            os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
            for _ in range(n):
                self._start()

    def _start(self):
        wid = self._next
        self._next += 1
        q = self.ctx.Queue()
        receive, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_worker, args=(wid, q, send, self.cache_dir, self.heavy), daemon=True)
        p.start()
        send.close()  # (the worker's end: its reader sees EOF when the worker is gone)
        self.results[wid] = receive
        self.workers[wid] = (p, q)
        return wid

    def _get(self, timeout):
        """The next message of any worker, or None after ``timeout`` seconds."""
        from multiprocessing.connection import wait

        end = time.monotonic() + timeout
        while self.results:
            ready = wait(list(self.results.values()), max(0.0, end - time.monotonic()))
            if not ready:
                return None
            for wid, conn in list(self.results.items()):
                if conn in ready:
                    try:
                        return conn.recv()
                    except (EOFError, OSError):  # its worker is gone (its last message, if cut, too)
                        conn.close()
                        del self.results[wid]
        time.sleep(min(timeout, 0.1))  # (no worker left to hear from)
        return None

    def phase1(self, jobs, deadline, on_result, kill_at=None):
        """Run each job's phase 1 on the first idle worker, in order, until ``deadline``;
        ``on_result(job, result, error, killed)`` as they finish.  A worker still busy at
        ``kill_at`` (a minute after ``deadline`` unless given) is killed, ``killed`` True; a
        job that failed, or whose worker was killed or died, has as ``result`` the items its
        worker sent ahead (``PART``: a correctness job's cases as each finished).  Returns
        the jobs not started."""
        late_at = min(deadline + 60, kill_at) if kill_at is not None else deadline + 60
        pending = list(jobs)
        if not self.n:
            while pending and time.monotonic() < deadline:
                job = pending.pop(0)
                try:
                    res, err = PHASES[job["kind"]][0](job, self.state), None
                except Exception:  # as a worker reports it
                    res, err = None, _error()
                on_result(job, res, err, False)
            return pending
        busy, by_id, parts = {}, {}, {}  # wid -> (job, started); job id -> job; job id -> items sent ahead
        while pending or busy:
            for wid in [w for w in self.workers if w not in busy]:
                if not pending or time.monotonic() >= deadline:
                    break
                job = self.next_job(pending, wid)
                if job is None:
                    continue
                pending.remove(job)
                by_id[job["id"]] = job
                busy[wid] = (job, time.monotonic())
                self.workers[wid][1].put((0, job))
            if not busy:
                break
            msg = self._get(2.0)
            if msg is not None:
                wid, jid, phase, res, err, _ = msg
                if phase == PART:
                    if wid in busy and busy[wid][0]["id"] == jid:
                        parts.setdefault(jid, []).append(res)
                else:
                    busy.pop(wid, None)
                    ahead = parts.pop(jid, [])
                    self.owner[jid] = wid
                    on_result(by_id[jid], ahead if err else res, err, False)
            for wid, (job, _) in list(busy.items()):
                p = self.workers[wid][0]
                late = time.monotonic() > late_at
                if p.is_alive() and not late:
                    continue
                if late:
                    p.kill()
                busy.pop(wid)
                self.workers.pop(wid)
                on_result(job, parts.pop(job["id"], []),
                          "worker " + (f"killed {late_at - deadline:.0f} s after phase 1's deadline" if late
                                       else f"died (exit code {p.exitcode})"), late)
                if time.monotonic() < deadline:
                    self._start()
            for wid in [w for w, (p, _) in self.workers.items() if not p.is_alive() and w not in busy]:
                self.workers.pop(wid)  # it ended itself after a sticky CUDA error
                if time.monotonic() < deadline:
                    self._start()
        return pending

    def next_job(self, pending, wid):
        """The first of ``pending`` that worker ``wid`` may take: a job ``on`` another (the
        compiled peers of the cases that one warmed) goes to the worker that ran it, once it has;
        None if there is none."""
        return next((j for j in pending if "on" not in j or self.owner.get(j["on"]) == wid), None)

    def phase2(self, job, timeout):
        """Phase 2 of ``job`` on the worker that ran its phase 1: ``(result, error)``."""
        if not self.n:
            try:
                return PHASES[job["kind"]][1](job, self.state), None
            except Exception:  # as a worker reports it
                return None, _error()
        wid = self.owner.get(job["id"])
        if wid not in self.workers:
            # killed at phase 1's end (mid-compile, as a rule): another worker, or a new one,
            # warms what it times itself (a speed case without its compiled peers)
            wid = min(self.workers) if self.workers else self._start()
            self.owner[job["id"]] = wid
        p, q = self.workers[wid]
        q.put((1, job))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            msg = self._get(min(2.0, max(0.1, end - time.monotonic())))
            if msg is not None and msg[1] == job["id"] and msg[2] != PART:
                return msg[3], msg[4]
            if msg is None and not p.is_alive():
                return None, f"worker died (exit code {p.exitcode})"
        p.kill()
        self.workers.pop(wid, None)
        return None, f"timed out after {timeout:.0f} s (worker killed)"

    def close(self):
        for p, q in self.workers.values():
            q.put(None)
        for p, q in self.workers.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.workers = {}
        for conn in getattr(self, "results", {}).values():
            conn.close()
        self.results = {}


# ---------------------------------------------------------------- the run

def _chunks(seq, n):
    return [seq[i:i + n] for i in range(0, len(seq), n)]


def build_jobs(run, ops, dtypes, lib_names):
    """Phase-1 jobs in priority order: the basic correctness cases, the warm-up of the timed
    sections (host and graph before speed), then the rest of the correctness cases by tier."""
    args, jobs = run.args, []
    wall = time.time() + (run.phase1_deadlines()[0] - time.monotonic())
    correctness = []
    if run.wants("correctness"):
        cases = plan(ops, dtypes, lib_names, args.tiny, args.select)
        done = {}
        if args.resume:
            done, why = resumable(args.resume, run.report.data)
            run.report.data["resumed"] = {"from": os.path.basename(args.resume), "carried": 0, "why_not": why}
            carried = [dict(done[c["id"]], carried_from=os.path.basename(args.resume))
                       for c in cases if c["id"] in done]
            run.report.add_cases(carried)
            run.report.data["resumed"]["carried"] = len(carried)
            cases = [c for c in cases if c["id"] not in done]
        # chunks of cases of one operation, dtype and library, in the order planned
        groups = {}
        for c in cases:
            groups.setdefault((c["tier"], c["op"], c["dtype"], c["lib"]), []).append(c)
        for key, cs in groups.items():
            for chunk in _chunks(cs, 6 if key[0] else 12):
                correctness.append({"kind": "correctness", "cases": chunk, "deadline": wall, "tier": key[0]})
    jobs += [j for j in correctness if j["tier"] == 0]
    torch_ok = not _why_no_torch_cuda()
    if run.wants("correctness") and torch_ok and "torch" in lib_names:
        big = [c for c in big_cases(dtypes, args.tiny) if c["id"] not in done]
        if big:
            jobs.append({"kind": "big", "cases": big})
    # host and graph first: two cheap jobs that the 54 speed warm-ups would otherwise push past phase 1
    if torch_ok and run.wants("host"):
        jobs.append({"kind": "host"})
    if torch_ok and run.wants("graph"):
        jobs.append({"kind": "graph"})
    if torch_ok and run.wants("speed"):  # every case's cheap part, then the compiled peers, each on its worker
        warm = [{"kind": "speed", "cases": chunk, "deadline": wall} for chunk in _chunks(speed_cases(args.tiny), 2)]
        jobs += warm + [{"kind": "speed_peers", "cases": j["cases"], "after": j, "deadline": wall} for j in warm]
    if run.wants("cpu_scaling") and not args.tiny:
        jobs.append({"kind": "cpu"})
    jobs += [j for j in correctness if j["tier"]]
    for k, j in enumerate(jobs):
        j["id"], j["seq"] = f"{j['kind']}-{k}", k
    for j in jobs:
        if "after" in j:
            j["on"] = j.pop("after")["id"]
    return jobs


CASE_KEYS = ("id", "op", "dtype", "lib", "shape", "groups", "layout", "variant", "label")


def _unrun(cases, status, why):
    return [dict({k: c[k] for k in CASE_KEYS}, status=status, why=why) for c in cases]


def job_records(job, res, err, killed):
    """A correctness job's case records, from what ``Pool.phase1`` reports: its result, and
    the cases it did not reach.  Where its worker was killed at phase 1's end, the cases it
    finished (sent ahead) and the rest not run, as a budget that ran out leaves them
    (``--resume`` runs them); where it failed or died, the case it was on an error and the
    rest not run; where a sticky CUDA error ended it early, the rest not run."""
    done = list(res or [])
    finished = {r["id"] for r in done}
    rest = [c for c in job["cases"] if c["id"] not in finished]
    if not rest:
        return done
    if killed:
        return done + _unrun(rest, "not run", f"the correctness budget ran out ({err})")
    if err:
        return done + _unrun(rest[:1], "error", err[:600]) + _unrun(rest[1:], "not run", "an earlier case of its "
                                                                       "job ended its worker")
    return done + _unrun(rest, "not run", "an earlier case's CUDA error ended its worker")


def main(argv=None):
    args = parse(argv)
    if args.tune_one:
        print(json.dumps(tune_one(json.loads(args.tune_one))), flush=True)
        return 0
    if args.sanitize_case:
        _lock_numba_caches()
        with open(args.sanitize_case) as f:
            run_sanitize_cases(json.load(f))
        return 0
    report = Report(args.out)
    run = Run(args, report)
    jobs_n = args.jobs if args.jobs is not None else (0 if _simulated() else max(1, (os.cpu_count() or 2) - 1))
    cache_dir = os.environ.get("NUMBA_CACHE_DIR") or args.cache_dir
    if jobs_n:  # the workers, the sanitizer's runs and this process share one cache
        import numba

        os.environ["NUMBA_CACHE_DIR"] = cache_dir
        numba.config.reload_config()
    _lock_numba_caches()
    environment(report)
    report.save()
    print(f"gpu_check: {report.data['device']}; sections {', '.join(run.sections)}; "
          f"deadline {args.deadline:.0f} s", flush=True)
    import numbanorm.cuda as nc

    gpu = nc.is_available()
    ops = args.ops or [op.name for op in OPERATIONS]
    lib_status = libs(args.libs) if gpu else {}
    lib_names = [n for n in args.libs if not isinstance(lib_status.get(n), str)]
    report.data["libraries"] = {n: (v if isinstance(v, str) else "ok") for n, v in lib_status.items()}
    pool, phase2 = None, []  # phase2: the jobs whose timed part waits for phase 1 to end
    try:
        name = "correctness" if run.wants("correctness") else "warm-up"
        with run.section(name) as info:
            if not gpu:
                raise Skip(f"no GPU kernels here: {nc.why_unavailable()}")
            pooled = any(run.wants(x) for x in ("correctness", "speed", "host", "graph", "cpu_scaling"))
            heavy = heavy_units(_free_gpu_bytes(), args.tiny)
            pool = Pool(jobs_n if pooled else 0, cache_dir, heavy)  # the workers import while the cases are planned
            jobs = build_jobs(run, ops, args.dtypes, lib_names)
            info.update(jobs=len(jobs), workers=jobs_n, warm_up_gib=heavy,
                        libraries_skipped={n: v for n, v in lib_status.items() if isinstance(v, str)})

            def on_result(job, res, err, killed):
                if job["kind"] in ("correctness", "big"):
                    report.add_cases(job_records(job, res, err, killed))
                    report.save()
                elif err:
                    info.setdefault("warm_errors", {})[job["id"]] = err[:1500]
                else:
                    if job["kind"] == "speed" and res:
                        job["warm_skipped"] = res
                    phase2.append(job)

            end, kill_at = run.phase1_deadlines()
            left = pool.phase1(jobs, end, on_result, kill_at=kill_at)
            report.add_cases(_unrun([c for j in left if j["kind"] in ("correctness", "big") for c in j["cases"]],
                                    "not run", "the correctness budget ran out"))
            info["jobs_not_started"] = [j["id"] for j in left]
        _timed_sections(run, report, pool, phase2)
    finally:
        if pool is not None:
            pool.close()
    if run.wants("sanitizer"):
        with run.section("sanitizer"):
            if not gpu:
                raise Skip(f"no GPU: {nc.why_unavailable()}")
            env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir,
                       PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
            report.data["sanitizer"] = sanitizer(run, ops, env)
    if run.wants("cpu_scaling"):
        with run.section("cpu_scaling"):
            small = dict(shape=(256, 512), threads=(1, 2), dtypes=("float32",)) if args.tiny else {}
            report.data["cpu_scaling"] = cpu_scaling(run.section_deadline("cpu_scaling"), **small)
    if run.wants("tune"):
        with run.section("tune"):
            why = _why_no_torch_cuda()
            if why:
                raise Skip(why)
            report.data["tune"] = tune(run.section_deadline("tune"), cache_dir)
    if run.wants("model"):
        with run.section("model"):
            if not report.data["speed"]:
                raise Skip("no speed rows to set the model beside")
            report.data["model"] = model_rows(report.data["speed"])
    report.data["targets"] = targets(report.data)
    report.data["seconds"] = round(time.monotonic() - run.t0, 1)
    report.save()
    print(summary(report.data))
    return 0


def _timed_sections(run, report, pool, phase2):
    """The timed parts, one at a time on the worker that warmed each (the GPU otherwise idle)."""
    for name, kind in (("speed", "speed"), ("host", "host"), ("graph", "graph")):
        if not run.wants(name):
            continue
        with run.section(name) as info:
            why = _why_no_torch_cuda()
            if why:
                raise Skip(why)
            jobs = sorted((j for j in phase2 if j["kind"] == kind), key=lambda j: j["seq"])  # in planned order
            if not jobs:
                raise Skip("nothing was warmed within the correctness budget")
            deadline = run.section_deadline(name)
            wall = time.time() + (deadline - time.monotonic())
            for job in jobs:
                job["deadline"] = wall
                if time.monotonic() > deadline:
                    info.setdefault("not_run", []).append(job["id"])
                    continue
                res, err = pool.phase2(job, timeout=max(5.0, deadline - time.monotonic() + 30))
                if err:
                    info.setdefault("errors", {})[job["id"]] = err[:1500]
                    continue
                if kind == "speed":
                    report.data["speed"] += res["rows"]
                    info.setdefault("skipped", {}).update(res["skipped"])
                    for case, why in zip(job["cases"], job.get("warm_skipped", [])):
                        for impl, reason in why.items():
                            info.setdefault("skipped", {})[_speed_label(case, impl)] = reason
                elif kind == "host":
                    report.data["host_us"] = res
                else:
                    report.data["cuda_graph"] = res
                report.save()
            if kind == "speed":
                warmed = sum(len(j["cases"]) for j in jobs)
                info["cases_not_warmed"] = len(speed_cases(run.args.tiny)) - warmed
                info["cases_without_compiled_peers"] = warmed - sum(len(j["cases"]) for j in phase2
                                                                    if j["kind"] == "speed_peers")


# ---------------------------------------------------------------- targets and summary

def _copy_target(row):
    if row["norm"] == "group_norm":
        return TARGET_COPY["group_norm"]
    return TARGET_COPY["float32"] if row["dtype"] == "float32" else TARGET_COPY["16-bit"]


def targets(d):
    """Which of the issue's targets hold in this run (None: not measured here)."""
    t = {}
    c = d["correctness"]
    not_run = sum(x["status"] == "not run" for x in c["cases"])
    t["correctness"] = {"holds": (c["failed"] == 0 and not_run == 0) if c["cases"] else None,
                        "passed": c["passed"], "failed": c["failed"], "not_run": not_run,
                        "skipped": sum(x["status"] == "skip" for x in c["cases"])}
    s = d["sanitizer"]
    t["sanitizer"] = {"holds": None if s.get("errors") is None else s["errors"] == 0
                      and all(v["cases_run"] == v["cases"] for v in s["tools"].values()), "errors": s.get("errors")}
    speed = d["speed"]
    by_case = {}
    for r in speed:
        by_case.setdefault((r["norm"], r["pass"], r["dtype"], tuple(r["shape"])), {})[r["impl"]] = r
    frac_ok, frac_all, worst, peers = 0, 0, [], {}
    for key, impls in by_case.items():
        nb, cp = impls.get("numbanorm"), impls.get("copy")
        if not nb:
            continue
        if cp and (key[0] in ("layer_norm", "rms_norm", "group_norm")):
            frac = nb["gbps"] / cp["gbps"]
            need = _copy_target(nb)
            frac_all += 1
            frac_ok += frac >= need
            if frac < need:
                worst.append((round(frac, 3), need, " ".join(map(str, key))))
        for peer in ("torch", "torch.compile", "liger"):
            if peer in impls:
                p = peers.setdefault(peer, [0, 0])
                p[1] += 1
                p[0] += nb["ms"] <= impls[peer]["ms"]
    t["copy_fraction"] = {"holds": (frac_ok == frac_all) if frac_all else None, "met": frac_ok, "of": frac_all,
                          "misses": sorted(worst)[:12]}
    t["vs_peers"] = {"holds": all(a == b for a, b in peers.values()) if peers else None,
                     **{k: {"as_fast": a, "of": b} for k, (a, b) in peers.items()}}
    host = d["host_us"].get("numbanorm") or {}
    worst_us = max((v for vs in host.values() for v in vs), default=None)
    t["host"] = {"holds": None if worst_us is None else worst_us <= TARGET_HOST_US, "worst_us": worst_us}
    g = d["cuda_graph"]
    if g.get("max_abs_diff") is None:
        t["cuda_graph"] = {"holds": None}
    else:
        rel = g["max_abs_diff"] / max(1.0, g.get("output_scale", 1.0))
        t["cuda_graph"] = {"holds": bool(g["captured"] and rel <= tolerance("float32")), "relative_diff": rel}
    cpu = [r for r in d["cpu_scaling"] if r["norm"] == "layer_norm" and r["pass"] == "forward"
           and r["dtype"] == "float32" and r["threads"] == 16]
    t["cpu"] = {"holds": cpu[0]["vs_copy"] <= TARGET_CPU_RATIO if cpu else None,
                "vs_copy_16_threads": cpu[0]["vs_copy"] if cpu else None}
    return t


def summary(d):
    """A few lines: per section run, what it found and whether the issue's target holds."""
    t, ran = d["targets"], d["sections"]
    word = {True: "HOLDS", False: "FAILS", None: "not measured"}
    lines = [f"gpu_check: {d['device']} (driver {d['driver']}), {d.get('seconds')} s"]
    if "correctness" in ran:
        c = t["correctness"]
        lines.append(f"  correctness  {c['passed']} passed, {c['failed']} failed, {c['not_run']} not run, "
                     f"{c['skipped']} skipped -> every case passes: {word[c['holds']]}")
    if "sanitizer" in ran:
        tools = ", ".join(f"{k} {v['errors']} ({v['cases_run']}/{v['cases']} cases)"
                          for k, v in d["sanitizer"].get("tools", {}).items())
        lines.append(f"  sanitizer    {tools or '-'} -> 0 errors: {word[t['sanitizer']['holds']]}")
    if "speed" in ran:
        f, p = t["copy_fraction"], t["vs_peers"]
        lines.append(f"  speed        {f['met']}/{f['of']} at >= 85% (16-bit) / 80% (float32) / 70% (GroupNorm) "
                     f"of the copy -> {word[f['holds']]}")
        lines += [f"               {what}: {frac:.2f} of the copy (target {need})" for frac, need, what in f["misses"][:6]]
        peers = ", ".join(f"{k} {v['as_fast']}/{v['of']}" for k, v in p.items() if isinstance(v, dict))
        lines.append(f"  vs peers     as fast as {peers or '-'} -> {word[p['holds']]}")
    if "host" in ran:
        h = t["host"]
        lines.append(f"  host         worst {h['worst_us']} us per call (target {TARGET_HOST_US:g}) -> {word[h['holds']]}")
    if "graph" in ran:
        g = d["cuda_graph"]
        lines.append(f"  cuda graph   captured {g.get('captured')}, max |diff| {g.get('max_abs_diff')} "
                     f"-> {word[t['cuda_graph']['holds']]}")
    if "cpu_scaling" in ran:
        cp = t["cpu"]
        lines.append(f"  cpu          LayerNorm forward out= float32, 16 threads: {cp['vs_copy_16_threads']}x the "
                     f"copy's time (target {TARGET_CPU_RATIO}) -> {word[cp['holds']]}")
    for name, info in ran.items():
        if info["status"] != "ran":
            lines.append(f"  [{name}: {info['status']}: {info.get('reason', '')[:160]}]")
    return "\n".join(lines)


def _budget(s):
    name, _, sec = s.partition("=")
    if name not in SECTIONS or not sec:
        raise argparse.ArgumentTypeError(f"--budget NAME=SECONDS with NAME in {SECTIONS}, got {s!r}")
    return name, float(sec)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the JSON file (rewritten as results arrive)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=None)
    ap.add_argument("--skip", nargs="+", choices=SECTIONS, default=[])
    ap.add_argument("--budget", nargs="+", type=_budget, default=[], help="NAME=SECONDS per section")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (0: in this process)")
    ap.add_argument("--ops", nargs="+", choices=[op.name for op in OPERATIONS], default=None)
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--libs", nargs="+", choices=LIBS, default=list(LIBS))
    ap.add_argument("--sanitize-tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--tiny", action="store_true", help="small shapes (the simulator's test)")
    ap.add_argument("--select", help="correctness: only the cases whose id or label this regular expression finds")
    ap.add_argument("--resume", metavar="JSON", help="correctness: count the cases that passed in this earlier "
                    "run (same device, kernels, package sources and numba versions) and run the rest")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "gpucheck-numba"),
                    help="NUMBA_CACHE_DIR when unset: shared by the workers and the sanitizer's runs")
    ap.add_argument("--tune-one", help=argparse.SUPPRESS)  # a tune child: its knobs, a JSON object
    ap.add_argument("--sanitize-case", help=argparse.SUPPRESS)  # the child under compute-sanitizer: a JSON list
    args = ap.parse_args(argv)
    args.budget = dict(args.budget)
    return args


if __name__ == "__main__":
    sys.exit(main())
