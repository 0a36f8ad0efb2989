"""What numbanorm gives numba's CUDA simulator: warp intrinsics (``cuda/_simwarp.py``),
a block's launch (``cuda/_simblock.py``) and shared arrays (``cuda/_simshared.py``).

Known answers for every intrinsic with the hardware's semantics (PTX
``shfl.sync``/``vote.sync``/``match.sync`` as numba-cuda emits them), partial
warps at a block's end, and the cases that hang or are undefined on hardware,
which must raise here instead; the block's barrier and launch with numba-cuda's
semantics, without a poller.
"""

import os

import numpy as np
import pytest

import numbanorm.cuda as nc
from conftest import SIMULATED

if not SIMULATED or not nc.is_available():
    pytest.skip("the simulator's warp intrinsics need NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)

from numba import cuda  # noqa: E402

from numbanorm.cuda import _simwarp  # noqa: E402

pytestmark = pytest.mark.cudasim
FULL = 0xFFFFFFFF


def test_installed_on_import_and_only_once():
    from numba.cuda.simulator import kernelapi

    for name in ("shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "syncwarp", "activemask"):
        assert getattr(kernelapi.FakeCUDAModule, name) is getattr(_simwarp, name)
    assert _simwarp.install() == ()  # everything present: nothing replaced


def test_shuffles_full_warp_known_answers():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        v = np.float32(i * 10)
        out[i, 0] = cuda.shfl_xor_sync(FULL, v, 5)
        out[i, 1] = cuda.shfl_up_sync(FULL, v, 3)
        out[i, 2] = cuda.shfl_down_sync(FULL, v, 3)
        out[i, 3] = cuda.shfl_sync(FULL, v, 7)
        out[i, 4] = cuda.shfl_sync(FULL, v, 39)      # only the low 5 bits: lane 7
        out[i, 5] = cuda.shfl_down_sync(FULL, v, 33)  # delta 33 reads as 1

    out = np.zeros((64, 6), np.float32)
    k[1, 64](out)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    v = np.arange(64) * 10.0
    np.testing.assert_array_equal(out[:, 0], (base + (lane ^ 5)) * 10)
    np.testing.assert_array_equal(out[:, 1], np.where(lane >= 3, v - 30, v))   # out of range: own value
    np.testing.assert_array_equal(out[:, 2], np.where(lane <= 28, v + 30, v))
    np.testing.assert_array_equal(out[:, 3], (base + 7) * 10)
    np.testing.assert_array_equal(out[:, 4], (base + 7) * 10)
    np.testing.assert_array_equal(out[:, 5], np.where(lane <= 30, v + 10, v))


def test_64_bit_values_and_butterfly_sum():
    @cuda.jit
    def k(out, ints):
        i = cuda.threadIdx.x
        v = np.float64(i) + 0.25
        n = np.int64(i) << 40
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL, v, off)
            n += cuda.shfl_xor_sync(FULL, n, off)
            off //= 2
        out[i] = v
        ints[i] = n

    out, ints = np.zeros(32), np.zeros(32, np.int64)
    k[1, 32](out, ints)
    np.testing.assert_array_equal(out, np.arange(32).sum() + 8.0)
    np.testing.assert_array_equal(ints, np.arange(32, dtype=np.int64).sum() << 40)


def test_partial_warp_at_the_end_of_a_block():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        m = cuda.activemask()
        v = np.float32(i)
        out[i, 0] = m
        out[i, 1] = cuda.shfl_down_sync(m, v, 1)
        out[i, 2] = cuda.shfl_xor_sync(m, v, 8)

    out = np.zeros((48, 3), np.float64)
    k[1, 48](out)  # warp 1 has lanes 0..15 only
    np.testing.assert_array_equal(out[:32, 0], FULL)
    np.testing.assert_array_equal(out[32:, 0], 0xFFFF)
    np.testing.assert_array_equal(out[:31, 1], np.arange(1, 32))
    assert out[31, 1] == 31                                     # past lane 31: own value
    np.testing.assert_array_equal(out[32:47, 1], np.arange(33, 48))
    assert np.isnan(out[47, 1])  # lane 16 of warp 1 exists in the warp's range, not in the mask: undefined
    np.testing.assert_array_equal(out[32:, 2], 32 + (np.arange(16) ^ 8))


def test_disjoint_masks_run_side_by_side():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        mask = 0x0000FFFF if i < 16 else 0xFFFF0000
        out[i] = cuda.shfl_sync(mask, np.int32(i * 3), (i // 16) * 16 + 2)

    out = np.zeros(32, np.int32)
    k[1, 32](out)
    np.testing.assert_array_equal(out, np.where(np.arange(32) < 16, 6, 54))


def test_votes_and_matches():
    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        out[i, 0] = cuda.ballot_sync(FULL, i % 3 == 0)
        out[i, 1] = cuda.all_sync(FULL, i < 32)
        out[i, 2] = cuda.any_sync(FULL, i == 5)
        out[i, 3] = cuda.eq_sync(FULL, i < 4)
        out[i, 4] = cuda.match_any_sync(FULL, i % 2)
        cuda.syncwarp(FULL)
        out[i, 5] = cuda.lanemask_lt()

    out = np.zeros((32, 6), np.int64)
    k[1, 32](out)
    ballot = sum(1 << j for j in range(0, 32, 3))
    assert (out[:, 0] == np.int64(np.uint32(ballot).view(np.int32))).all()
    assert (out[:, 1] == 1).all() and (out[:, 2] == 1).all() and (out[:, 3] == 0).all()
    np.testing.assert_array_equal(out[:, 4], np.where(np.arange(32) % 2, 0xAAAAAAAA, 0x55555555))
    np.testing.assert_array_equal(out[:, 5], (1 << np.arange(32)) - 1)


# ---------------------------------------------------------------- what hangs on hardware raises

def test_a_lane_that_raised_is_reported_with_its_own_error():
    """A lane waiting for one that exited names that lane's error where it raised one: the
    simulator reports whichever thread's error it sees first, and "exited without reaching
    it" hid the cause (test_mismatched_operations_raise failed when the waiting lane won)."""
    import types

    started = types.SimpleNamespace(is_set=lambda: True)
    raised = types.SimpleNamespace(_started=started, is_alive=lambda: False,
                                   exception=(_simwarp.WarpError("shfl_xor_sync: ... mismatched warp operations"), None))
    quiet = types.SimpleNamespace(_started=started, is_alive=lambda: False, exception=None)
    me = types.SimpleNamespace(_manager=types.SimpleNamespace(_nn_threads={1: raised, 2: quiet}), thread_id=0)
    assert "mismatched warp operations" in _simwarp._stuck(me, None, 1, 0)
    assert _simwarp._stuck(me, None, 2, 0) == "lane 2 exited without reaching it"


def _raises(kernel, block, match):
    out = np.zeros(block, np.float32)
    with pytest.raises((_simwarp.WarpError, TypeError), match=match):
        kernel[1, block](out)


def test_divergent_shuffle_raises_instead_of_hanging():
    @cuda.jit
    def odd_lanes_only(out):
        i = cuda.threadIdx.x
        if i % 2:
            out[i] = cuda.shfl_xor_sync(FULL, np.float32(i), 1)

    _raises(odd_lanes_only, 32, "exited without reaching it")

    @cuda.jit
    def barrier_instead(out):
        i = cuda.threadIdx.x
        if i < 16:
            out[i] = cuda.shfl_down_sync(FULL, np.float32(i), 1)
        cuda.syncthreads()

    _raises(barrier_instead, 32, "syncthreads instead")


def test_mismatched_operations_raise():
    @cuda.jit
    def two_kinds(out):
        i = cuda.threadIdx.x
        if i == 0:
            cuda.syncwarp(FULL)
        else:
            out[i] = cuda.shfl_xor_sync(FULL, np.float32(i), 1)

    _raises(two_kinds, 32, "mismatched")

    @cuda.jit
    def overlapping_masks(out):
        i = cuda.threadIdx.x
        mask = 0x3 if i == 0 else 0x7
        if i < 3:
            out[i] = cuda.shfl_sync(mask, np.float32(i), 0)

    _raises(overlapping_masks, 32, "mismatched|exited")


def test_bad_masks_and_types_raise():
    @cuda.jit
    def full_mask_on_partial_warp(out):
        i = cuda.threadIdx.x
        out[i] = cuda.shfl_xor_sync(FULL, np.float32(i), 1)

    _raises(full_mask_on_partial_warp, 40, "do not exist")

    @cuda.jit
    def not_in_own_mask(out):
        i = cuda.threadIdx.x
        out[i] = cuda.shfl_xor_sync(0x1, np.float32(i), 1)

    _raises(not_in_own_mask, 32, "not named in its own mask")

    @cuda.jit
    def half(out):
        i = cuda.threadIdx.x
        out[i] = cuda.shfl_xor_sync(FULL, np.float16(i), 1)

    _raises(half, 32, "32- and 64-bit")


def test_shared_array_is_one_array_per_block(monkeypatch):
    """Every thread of a block gets the same shared array even when they reach the
    allocation together (numba's simulator created one per racing thread)."""
    import time

    from numba.cuda.simulator import kernelapi

    # widen the window between the simulator's lookup and its store, as a loaded machine does
    real_empty = np.empty

    def slow_empty(*a, **k):
        time.sleep(0.002)
        return real_empty(*a, **k)

    monkeypatch.setattr(kernelapi.np, "empty", slow_empty)

    @cuda.jit
    def k(out):
        i = cuda.threadIdx.x
        sh = cuda.shared.array(64, np.float32)
        sh[i] = i
        cuda.syncthreads()
        out[i] = sh[63 - i]

    out = np.zeros(64, np.float32)
    k[1, 64](out)
    np.testing.assert_array_equal(out, np.arange(63, -1, -1))


def test_the_block_barrier_is_driven_by_its_threads_and_keeps_numba_cudas_semantics():
    """numbanorm's block loop (``_simblock``) keeps the simulator's semantics -- a
    barrier releases every live thread together, threads that have exited are not
    waited for, an exception in one thread reaches the launch and aborts the
    others -- and the launching thread sleeps instead of polling the block."""
    import time

    from numba.cuda.simulator import kernel

    from numbanorm.cuda import _simblock

    assert kernel.BlockManager.run is _simblock._run
    assert _simblock.install() is False  # once
    # _simwarp's barrier count wraps this barrier (installed first), not numba's
    assert kernel.BlockThread.syncthreads.__wrapped__ is _simblock._syncthreads

    @cuda.jit
    def rotate(out):
        i = cuda.threadIdx.x
        out[i] = i
        cuda.syncthreads()
        v = out[(i + 1) % 64]
        cuda.syncthreads()
        out[i] = v

    out = np.zeros(64, np.int64)
    rotate[2, 64](out)
    np.testing.assert_array_equal(out, (np.arange(64) + 1) % 64)

    @cuda.jit
    def early_exit(out):
        i = cuda.threadIdx.x
        if i >= 24:
            return
        out[i] = i
        cuda.syncthreads()  # the 24 live threads meet; the 8 gone are not awaited
        v = out[23 - i]
        cuda.syncthreads()
        out[i] = v

    out = np.full(32, -1, np.int64)
    early_exit[1, 32](out)
    np.testing.assert_array_equal(out, np.r_[np.arange(23, -1, -1), np.full(8, -1)])

    @cuda.jit
    def fails(out):
        if cuda.threadIdx.x == 5:
            raise ValueError("thread 5")
        cuda.syncthreads()
        out[cuda.threadIdx.x] = 1

    with pytest.raises(ValueError, match="thread 5"):
        fails[1, 32](np.zeros(32, np.int64))

    @cuda.jit
    def barriers(out, rounds):
        i = cuda.threadIdx.x
        for _ in range(rounds):
            out[i] += 1
            cuda.syncthreads()

    # a poller holding the GIL spends a quarter of the launch in the launching
    # thread (the design log); a launcher that sleeps only starts the threads
    out = np.zeros(64, np.int64)
    barriers[1, 64](out, 1)  # the simulator's first call of a kernel
    out[:] = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    barriers[2, 64](out, 100)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    np.testing.assert_array_equal(out, 200)
    assert cpu < 0.1 * wall, (cpu, wall)


def test_a_device_functions_module_is_switched_once_per_launch(monkeypatch):
    """A device function's module sees the launch's fake ``cuda`` from its first call in
    a launch to the launch's end (numba-cuda switched it, under two locks, around every
    call of every thread), and gets ``numba.cuda`` back after the launch."""
    import types

    from numba.cuda.simulator import kernel

    mod = types.ModuleType("devices_elsewhere")
    exec("from numba import cuda\n\n@cuda.jit(device=True)\ndef lane():\n    return cuda.threadIdx.x % 32\n",
         mod.__dict__)
    lane = mod.lane
    switched = []
    real = kernel.swapped_cuda_module

    def counted(fn, fake):
        switched.append(fn.__name__)
        return real(fn, fake)

    monkeypatch.setattr(kernel, "swapped_cuda_module", counted)

    @cuda.jit
    def twice(out):
        i = cuda.threadIdx.x
        out[i] = lane() + 100 * lane()

    out = np.zeros(64, np.int64)
    twice[2, 64](out)
    np.testing.assert_array_equal(out, 101 * (np.arange(64) % 32))
    assert switched == ["twice"]  # the launch's own switch; none for the 256 device calls
    assert mod.cuda is cuda


def test_no_thread_calls_a_device_function_before_its_module_is_switched(monkeypatch):
    """The first thread to call a device function in a launch switches its module's
    ``cuda`` under a lock; a thread that finds the module already recorded must find it
    switched too.  (Recorded first, switched after, the others ran the function with
    ``numba.cuda`` in that window, which has no ``threadIdx`` or shuffles: an
    AttributeError, once in the contract tests.)  The window is widened here by a
    record that sleeps after it is stored."""
    import time
    import types

    from numbanorm.cuda import _simblock

    class Slow(dict):
        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            time.sleep(0.05)  # the block's other threads run meanwhile

    monkeypatch.setattr(_simblock, "_swapped", Slow())
    mod = types.ModuleType("devices_switched_late")
    exec("from numba import cuda\n\n@cuda.jit(device=True)\ndef lane():\n    return cuda.threadIdx.x % 32\n",
         mod.__dict__)
    lane = mod.lane

    @cuda.jit
    def lanes(out):
        out[cuda.threadIdx.x] = lane()

    out = np.full(64, -1, np.int64)
    lanes[1, 64](out)
    np.testing.assert_array_equal(out, np.arange(64) % 32)
    assert mod.cuda is cuda


def test_the_race_check_finds_unordered_shared_accesses_whatever_the_threads_order():
    """``tests/_simrace.py``: a shared word read by another thread in the barrier interval
    it was written in, or overwritten in the interval another thread read it in, is a
    hazard however the simulator's threads happened to interleave; a barrier between them
    orders them; a read of a word no thread of the block wrote is uninitialised."""
    from numbanorm.cuda import _simshared
    from _simrace import racecheck

    @cuda.jit
    def unordered(out):
        sh = cuda.shared.array(64, np.float32)
        i = cuda.threadIdx.x
        sh[i] = i
        out[i] = sh[(i + 1) % 64]

    @cuda.jit
    def rotated(out, barrier):
        sh = cuda.shared.array(64, np.float32)
        i = cuda.threadIdx.x
        sh[i] = i
        cuda.syncthreads()
        v = sh[(i + 1) % 64]
        if barrier:
            cuda.syncthreads()
        sh[i] = -1  # without the barrier, thread i - 1 may not have read it yet
        out[i] = v

    @cuda.jit
    def uninitialised(out):
        sh = cuda.shared.array(64, np.float32)
        out[cuda.threadIdx.x] = sh[cuda.threadIdx.x]

    out = np.zeros(64, np.float32)
    unordered_ok = {"read after write", "write after read", "uninitialised read"}
    for kernel, args, kinds in ((unordered, (), unordered_ok),
                                (rotated, (False,), {"write after read", "read after write"}),
                                (uninitialised, (), {"uninitialised read"}), (rotated, (True,), set())):
        with racecheck() as hazards:
            kernel[2, 64](out, *args)
        found = {h.kind for h in hazards}
        assert (found and found <= kinds) if kinds else not found, (kernel, hazards)
        assert all(h.where.startswith("test_cudasim.py:") for h in hazards), hazards
    np.testing.assert_array_equal(out, (np.arange(64) + 1) % 64)  # with the barrier, the last run
    assert _simshared.view is None  # the check leaves the simulator as it was


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="one CPU, or no affinity to set")
def test_a_blocks_threads_share_one_cpu_and_the_callers_affinity_comes_back():
    """A block's threads take turns at the GIL: they run on the CPU their launch began
    on (a turn then wakes no other CPU, which may be busy), and the launching thread
    gets its own affinity back after the launch."""
    before = os.sched_getaffinity(0)
    seen = {}

    @cuda.jit
    def where(out):
        i = cuda.threadIdx.x
        seen[i] = frozenset(os.sched_getaffinity(0))  # the simulator runs this as Python
        cuda.syncthreads()
        out[i] = 1

    out = np.zeros(64, np.int64)
    where[2, 64](out)
    assert out.all() and len(seen) == 64
    cpus = set(seen.values())
    assert len(cpus) == 1 and len(next(iter(cpus))) == 1 and cpus.pop() <= before
    assert os.sched_getaffinity(0) == before


def test_a_launch_where_affinity_cannot_be_set_runs_unpinned(monkeypatch):
    """A sandbox may refuse ``sched_setaffinity``: the block then runs where it may."""
    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refused, raising=False)

    @cuda.jit
    def ones(out):
        out[cuda.threadIdx.x] = 1
        cuda.syncthreads()

    out = np.zeros(32, np.int64)
    ones[1, 32](out)
    assert out.all()


def test_threads_calling_numbanorm_cuda_at_once():
    """Two threads calling numbanorm.cuda, each compiling its own shapes while the other's
    kernels run: the right results, and ``numba.cuda`` back in the kernels' modules.  While
    a simulated kernel runs, numba-cuda swaps the ``cuda`` of its modules for a fake one,
    which the other thread's host code there saw (``'FakeCUDAModule' object has no
    attribute 'jit'``, or ``'device_array'``)."""
    import threading

    import numbanorm
    from numbanorm.cuda._kernels import common, row_norm

    errors, done = [], []

    def work(n):
        try:
            rng = np.random.default_rng(n)  # (one a thread: a Generator is not thread-safe)
            x = rng.standard_normal((6, n)).astype(np.float32)
            dy = rng.standard_normal((6, n)).astype(np.float32)
            for _ in range(2):
                y, mean, rstd = nc.layer_norm_forward(cuda.to_device(x), n)
                dx = nc.layer_norm_backward(cuda.to_device(dy), cuda.to_device(x), mean, rstd, n)[0]
                np.testing.assert_allclose(y.copy_to_host(), numbanorm.layer_norm(x, n), rtol=1e-5, atol=1e-5)
                want = numbanorm.layer_norm_backward(dy, x, *numbanorm.layer_norm_forward(x, n)[1:], n)[0]
                np.testing.assert_allclose(dx.copy_to_host(), want, rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(nc.rms_norm(cuda.to_device(x), n).copy_to_host(),
                                           numbanorm.rms_norm(x, n), rtol=1e-5, atol=1e-5)
            done.append(n)
        except Exception as e:  # (reported below: an assertion in a thread would be lost)
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(n,)) for n in (40, 72)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(done) == [40, 72]
    assert common.cuda is cuda and row_norm.cuda is cuda
