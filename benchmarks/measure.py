"""The benchmark suite's measurement: ``numbanorm.measure`` (what ``numbanorm bench``
times, and how), ``numbanorm.machine`` (what the machine is) and what only the suite
adds to them.

Every name of ``numbanorm.measure`` and ``numbanorm.machine`` is here too, so the
suite's scripts import this module alone; ``sweep``, ``run_case`` and ``build_runners``
here know the suite's peers as well, and ``machine_info`` adds the CPU target.

What one measurement is
-----------------------
A :class:`Case` is one norm, direction, shape and dtype on one device.  For it
:func:`build_runners` makes zero-argument callables ("runners") over the same
input arrays:

* ``numbanorm.<name>`` for every kernel implementation of the registry
  (``numbanorm.registry``) that runs on the case's device -- forward both
  allocating (``mode='alloc'``) and into a preallocated ``out=``
  (``mode='out'``);
* ``torch`` -- ``torch.nn.functional`` on the same thread count (CPU) or on
  the GPU; its backward goes through autograd (see :func:`torch_calls`);
* ``oracle`` -- the NumPy reference, on small host shapes only (it is slow by
  design: float64 temporaries, several passes);
* ``floor`` -- the bandwidth floor: ``np.copyto`` of the same bytes on the host
  (forward: x into y; backward: x and dy into two buffers), a device-to-device
  copy on the GPU.  ``np.copyto`` runs on one thread; on a machine whose
  memory bandwidth one core cannot saturate, a multi-threaded kernel can beat
  it, which shows up as a ratio below 1;
* ``floor_threads`` (the suite's) -- the same copies split over every numba
  thread (:func:`parallel_copy`, host only), the floor of a kernel that uses them all;
* ``numbanorm.torch`` (the suite's, peer ``adapter``) -- numbanorm's kernels
  through its PyTorch functions, on tensors over the same memory (host).

Byte accounting (``Case.bytes``): forward reads x and writes y (2 arrays of
x's size), backward reads x and dy and writes dx (3 arrays).  The O(N) weight,
bias and statistics traffic is left out (below 1/rows of the total).  The
floor copies ``Case.floor_bytes``: 2 arrays forward, 4 backward (each copy
reads one array and writes another); ``KERNEL_ARRAYS`` and ``FLOOR_ARRAYS``
hold those counts, for every benchmark.

How it is timed (:func:`time_runners`)
--------------------------------------
1. each runner's first call is timed alone (``first_call_s``: numba's compile
   or cache load for the first case of a signature, torch's lazy set-up);
2. the faster of two more (warm) calls, timed, picks ``number``, the calls per
   sample, so a sample lasts at least ``min_sample_s`` (timer resolution and call
   overhead amortised);
3. ``repeats`` rounds, round-robin over the runners (each round starting one
   runner later), so machine noise -- other jobs, frequency changes -- hits
   every implementation alike; the garbage collector is off meanwhile;
4. median and 20/80 % quantiles of the per-call times of the samples.

On the GPU every sample ends with a device synchronisation, so the time is
that of the queued kernels, launch overhead included.
"""

import numpy as np

from numbanorm import machine as _machine, measure as _core
from numbanorm.machine import *  # noqa: F401,F403  (the machine's description, for the suite's scripts)
from numbanorm.machine import torch_or_none
from numbanorm.measure import *  # noqa: F401,F403  (the core's names, for the suite's scripts)
from numbanorm.measure import floor_calls, torch_calls

_PARALLEL_COPY = None
COPY_BLOCK_BYTES = 1 << 18  # a quarter MiB per task: many tasks per thread, each a long stream


def parallel_copy(dst, src):
    """The floor on every numba thread: ``dst[...] = src`` split into blocks over ``prange``.

    ``np.copyto`` runs on one thread; a kernel on two threads may move more bytes per
    second than one core can, so it is also compared with the same copy spread like its own
    work.  The arrays are viewed as bytes (any dtype, one compiled copy).
    """
    global _PARALLEL_COPY
    if _PARALLEL_COPY is None:
        import numba

        @numba.njit(parallel=True)
        def copy_blocks(d, s, block):  # d, s: (nbytes,) uint8; block: bytes per task
            n = s.shape[0]
            for b in numba.prange((n + block - 1) // block):
                lo = b * block
                hi = min(lo + block, n)
                d[lo:hi] = s[lo:hi]  # a slice copy: an element loop over bytes is not vectorized

        _PARALLEL_COPY = copy_blocks
    _PARALLEL_COPY(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8), COPY_BLOCK_BYTES)


def threaded_floor_calls(case, inp):
    """The floor's copies on every numba thread (host arrays only)."""
    return floor_calls(case, inp, parallel_copy) if inp.side.name == "cpu" else {}


def adapter_calls(case, inp):
    """``numbanorm.torch``'s functions on torch tensors over the same memory (host), with
    autograd for the backward as :func:`torch_calls` does: what a PyTorch user of numbanorm gets."""
    torch = torch_or_none()
    if torch is None or case.device != "cpu" or inp.side.to_torch(inp.x) is None:
        return {}
    import numbanorm.torch as nt

    return torch_calls(case, inp, nt)


# the core's peers and the suite's, in the order their runners are timed
_CORE = _core.PEER_CALLS
PEER_CALLS = {"torch": _CORE["torch"], "oracle": _CORE["oracle"], "adapter": ("numbanorm.torch", adapter_calls),
              "floor": _CORE["floor"], "floor_threads": ("floor_threads", threaded_floor_calls)}
PEERS = tuple(PEER_CALLS)


def build_runners(case, inp, impls, peers=PEERS):
    return _core.build_runners(case, inp, impls, peers, PEER_CALLS)


def run_case(case, impls=None, peers=PEERS, threads=None, **kwargs):
    return _core.run_case(case, impls, peers, threads, peer_calls=PEER_CALLS, **kwargs)


def sweep(cases, impls=None, peers=PEERS, threads=None, **kwargs):
    return _core.sweep(cases, impls, peers, threads, peer_calls=PEER_CALLS, **kwargs)


def cpu_target():
    """LLVM's name for the CPU Numba compiles for, the AVX-512 16-bit features it sees
    (a VM may hide some), whether the 16-bit row functions run 512 bits wide there, and
    whether bfloat16 is narrowed by vcvtneps2bf16 (halves.BFLOAT16_BY_INSTRUCTION)."""
    from numbanorm.cpu._kernels import halves

    features = halves.X86_FEATURES or ()
    return {"llvm_cpu": halves._cpu_name(),
            "avx512": {f: f"+{f}" in features for f in ("avx512bw", "avx512fp16", "avx512bf16")},
            "wide_16bit_rows": bool(halves.WIDE_HALVES),
            "bfloat16_by_instruction": bool(halves.BFLOAT16_BY_INSTRUCTION)}


def machine_info(include_gpu=True):
    """numbanorm.machine's description and the CPU target, for a results file."""
    return dict(_machine.machine_info(include_gpu), cpu_target=cpu_target())
