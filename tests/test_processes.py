"""numbanorm in the process models its users run it in (contract, "Where it runs").

Each case runs in a fresh interpreter under one Numba threading layer (both
OpenMP and workqueue, the layers without a third-party library), because
what failed was the process itself: a forked child killed by GNU OpenMP, a
``multiprocessing.Pool`` hung on its dead workers, the workqueue layer aborting
on two threads at once.  Every result must equal, bit for bit, the one the
parent computed on Numba's threads before (forked children and concurrent callers
run the same row functions on their own thread, with the same bits).
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # (the default test set leaves this file out: tests/README.md)

LAYERS = ["omp", "workqueue"]

# Defines `work(seed)`: forward and backward of every family on inputs large
# enough for the parallel kernels (common.SERIAL_BELOW), returning all outputs.
_PRELUDE = """
import os, sys
import numpy as np
import numba
import numbanorm as nn

def work(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    r = rng.standard_normal((256, 512)).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float32)
    g = rng.standard_normal((8, 16, 512)).astype(np.float32)
    y, mean, rstd = nn.layer_norm_forward(x, 512, w, b)
    out = [y, mean, rstd, *nn.layer_norm_backward(y, x, mean, rstd, 512, w)]
    y, rs = nn.rms_norm_forward(x, 512, w)
    out += [y, rs, *nn.rms_norm_backward(y, x, rs, 512, w)]
    y, gm, gr = nn.group_norm_forward(g, 4, w[:16], b[:16])
    out += [y, gm, gr, *nn.group_norm_backward(y, g, gm, gr, w[:16])]
    out += list(nn.add_layer_norm(x, r, 512, w, b)) + list(nn.add_rms_norm(x, r, 512, w))
    return out

def same(a, b):
    return len(a) == len(b) and all(np.array_equal(p, q, equal_nan=True) for p, q in zip(a, b))

FIRST = {s: work(s) for s in range(4)}  # (where a kernel is not cached yet, on this thread)
from numbanorm.cpu._kernels import background
background.wait()
REF = {s: work(s) for s in range(4)}   # on Numba's threads: the parent uses numbanorm first
assert all(same(FIRST[s], REF[s]) for s in range(4))
assert numba.threading_layer() == os.environ["NUMBA_THREADING_LAYER"], numba.threading_layer()
"""

CASES = {
    "fork": """
        pid = os.fork()
        if pid == 0:
            os._exit(0 if all(same(work(s), REF[s]) for s in range(4)) else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert same(work(0), REF[0])  # and the parent still works
    """,
    "pool": """
        import multiprocessing as mp
        with mp.get_context("fork").Pool(2) as pool:
            got = pool.map(work, range(4))
        assert all(same(got[s], REF[s]) for s in range(4))
    """,
    "dataloader": """
        import torch
        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, s):
                return work(s)[0]
        loader = torch.utils.data.DataLoader(Data(), batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
        got = [t.numpy() for t in loader]
        assert all(np.array_equal(got[s], REF[s][0]) for s in range(4))
    """,
    "threads": """
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(work, [s % 4 for s in range(16)]))
        assert all(same(g, REF[s % 4]) for s, g in enumerate(got))
    """,
    "dask": """
        import dask
        import dask.array as da
        import numbanorm.dask as nd
        x = np.random.default_rng(5).standard_normal((4096, 512)).astype(np.float32)
        want = nn.layer_norm(x, 512)
        xd = da.from_array(x, chunks=(256, 512))
        for _ in range(3):
            got = nd.layer_norm(xd, 512).compute(scheduler="threads", num_workers=4)
            assert np.array_equal(got, want)
    """,
}


# The first calls of a process with an empty cache: its parallel kernels compiled on a
# thread of their own (numbanorm/cpu/_kernels/background.py)
_FRESH = """
import os, sys, time
import numpy as np
import numbanorm as nn
from numbanorm import reference as ref
from numbanorm.cpu._kernels import background, layer_norm


x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)  # parallel: >= SERIAL_BELOW
w = np.linspace(0.5, 1.5, 512, dtype=np.float32)


def wait_for(pid):  # a forked child's clean exit, within 300 s: one that inherited a held lock hangs
    for _ in range(3000):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the forked child hung at its first call")
    assert os.waitstatus_to_exitcode(status) == 0, status
"""

FRESH = {
    # the first call runs its row function here and leaves its parallel kernel to the
    # compile thread, then the parallel kernel gives the same bits
    "first_call": """
        y = nn.layer_norm(x, 512, w, w)
        assert not layer_norm._forward.parallel.overloads and background._jobs.unfinished_tasks == 1
        background.wait()
        assert len(layer_norm._forward.parallel.overloads) == 1
        assert np.array_equal(nn.layer_norm(x, 512, w, w), y)
    """,
    # a child forked while the compile thread holds Numba's compiler lock: the fork waits
    # for that compile, and the child (which has no such thread) compiles a kernel of its own
    "fork_while_compiling": """
        y = nn.layer_norm(x, 512, w, w)
        for _ in range(1200):
            if background._job_lock.locked():
                break
            time.sleep(0.05)
        assert background._job_lock.locked(), "the compile thread never started"
        pid = os.fork()
        if pid == 0:
            got = nn.rms_norm(x, 512, w)
            ok = np.allclose(got, ref.rms_norm(x.astype(np.float64), 512, w), atol=1e-5)
            os._exit(0 if ok else 3)
        wait_for(pid)
        assert np.array_equal(nn.layer_norm(x, 512, w, w), y)
    """,
    # a child forked while another thread of the caller's compiles its first call: the fork
    # waits for Numba's compiler lock, which the child would otherwise inherit held by a
    # thread it does not have, and hang at its own first compile
    "fork_while_a_caller_compiles": """
        import threading
        from numba.core.compiler_lock import global_compiler_lock

        def first_call():
            with background.synchronous():  # (compiled on this thread, not the compile thread's)
                nn.add_rms_norm(x, x, 512, w)

        caller = threading.Thread(target=first_call)
        caller.start()
        for _ in range(1200):
            if not global_compiler_lock._lock.acquire(blocking=False):
                break  # held by the caller's thread
            global_compiler_lock._lock.release()
            time.sleep(0.005)
        else:
            raise AssertionError("the caller's thread never compiled")
        pid = os.fork()
        if pid == 0:
            ok = np.allclose(nn.rms_norm(x, 512, w), ref.rms_norm(x.astype(np.float64), 512, w), atol=1e-5)
            os._exit(0 if ok else 3)
        caller.join()
        wait_for(pid)
    """,
    # a child forked while another thread's first call starts Numba's threads (a forward asks
    # their count): the fork waits for the start, whose lock the child would otherwise inherit
    # held by a thread it does not have, and hang on at its first call.  Numba asks
    # multiprocessing's start method holding that lock: held there a second here
    "fork_while_a_caller_starts_numbas_threads": """
        import multiprocessing
        import threading
        from numba.np.ufunc import parallel

        inside, start_method = threading.Event(), multiprocessing.get_start_method

        def slow_start_method(*args, **kwargs):
            if parallel._backend_init_thread_lock._is_owned():
                inside.set()
                time.sleep(1)
            return start_method(*args, **kwargs)

        multiprocessing.get_start_method = slow_start_method
        caller = threading.Thread(target=lambda: nn.layer_norm(x[:1], 512, w))
        caller.start()
        assert inside.wait(300), "the caller's thread never started Numba's threads"
        pid = os.fork()
        if pid == 0:
            ok = np.allclose(nn.rms_norm(x[:1], 512, w), ref.rms_norm(x[:1].astype(np.float64), 512, w), atol=1e-5)
            os._exit(0 if ok else 3)
        caller.join()
        multiprocessing.get_start_method = start_method
        wait_for(pid)
    """,
    # a forked child that dies inside Numba's start of its threads (a worker killed while
    # its compile thread typed a parallel kernel, which asks for them): the parent's next
    # compile of a parallel kernel, which asks too, must not wait on a lock the dead child held
    "a_child_dies_inside_numbas_start": """
        import threading
        import numba
        from numba.np.ufunc import parallel

        nn.layer_norm(x[:1], 512, w)  # (Numba's threads started)
        pid = os.fork()
        if pid == 0:
            class Dies:  # Numba's second lock, taken inside its first (the process-wide one)
                def __enter__(self):
                    os._exit(0)

                def __exit__(self, *exc):
                    pass

            parallel._backend_init_thread_lock = Dies()
            numba.get_num_threads()
            os._exit(3)
        wait_for(pid)
        done = threading.Event()

        def parallel_compile():
            with background.synchronous():  # (the parallel kernel compiled on this thread)
                nn.rms_norm(x, 512, w)
            done.set()

        threading.Thread(target=parallel_compile, daemon=True).start()
        if not done.wait(300):
            sys.stderr.write("the parent hung compiling a parallel kernel\\n")
            sys.stderr.flush()
            os._exit(4)
        from numbanorm.cpu._kernels import rms_norm
        assert rms_norm._forward.parallel.overloads
    """,
    # torch's thread count, set by the user, is kept through the first call, which starts
    # Numba's OpenMP threads: that start set the calling thread's OpenMP count, which torch
    # reads, to Numba's (torch.compile then recompiled what it had compiled)
    "torch_threads": """
        import torch
        import numbanorm.torch as nt
        torch.set_num_threads(1)  # (Numba's: NUMBA_NUM_THREADS=2)
        assert torch.get_num_threads() == 1  # (read before: torch.compile's guards read it so)
        xt, wt = torch.from_numpy(x), torch.from_numpy(w)
        nt.layer_norm(xt[:1], (512,), wt)
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        background.wait()
        assert torch.equal(nt.layer_norm(xt, (512,), wt), nt.layer_norm(xt, (512,), wt))
        assert torch.get_num_threads() == 1, torch.get_num_threads()
    """,
    # float16 weights: a first call widens them by NumPy's cast, and the launchers' loop is
    # compiled on the compile thread once the launch returns (the calling thread compiles
    # only its row function: the compile thread is held off meanwhile); the loop then gives
    # the same bits, a signalling NaN, a subnormal and an Inf among the weights included
    "float16_weights": """
        from numbanorm.cpu._kernels import common
        x16, dy16 = (a[:8].astype(np.float16) for a in (x, x[::-1]))  # a small call
        w16 = w.astype(np.float16)
        w16.view(np.uint16)[:3] = (0x7C01, 0x0001, 0x7C00)
        xg = x[:2].reshape(2, 16, 32).astype(np.float16)
        _, m, r = nn.layer_norm_forward(x16, 512, w16, w16)
        calls = lambda: (*nn.layer_norm_backward(dy16, x16, m, r, 512, w16), nn.group_norm(xg, 4, w16[:16], w16[:16]))
        with background._job_lock:  # (the compile thread waits for it)
            first = calls()
            assert not common._widen_into.overloads and background._jobs.unfinished_tasks >= 1
        background.wait()
        assert common._widen_into.overloads
        for a, b in zip(first, calls()):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    """,
    # threads that all make a first call: each runs, on its own thread, what is compiled
    "threads": """
        from concurrent.futures import ThreadPoolExecutor
        calls = [lambda: nn.layer_norm(x, 512, w, w), lambda: nn.rms_norm(x, 512, w),
                 lambda: nn.layer_norm_forward(x[:3], 512, w, w)[0]]
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda k: calls[k % 3](), range(12)))
        background.wait()
        assert all(np.array_equal(g, calls[k % 3]()) for k, g in enumerate(got))
    """,
}


def _run(case, layer, cases=CASES, prelude=_PRELUDE, **env):
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer, NUMBA_NUM_THREADS="2", **env)
    code = prelude + textwrap.dedent(cases[case])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode and "No threading layer could be loaded" in proc.stderr:
        pytest.skip(f"Numba's {layer} threading layer is not available here")
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", ["fork", "pool", "threads"])
def test_process_models(case, layer):
    _run(case, layer)


@pytest.mark.parametrize("case", list(FRESH))
def test_first_calls_with_an_empty_cache(case, tmp_path):
    _run(case, "omp", FRESH, _FRESH, NUMBA_CACHE_DIR=str(tmp_path))


@pytest.mark.parametrize("layer", LAYERS)
def test_torch_dataloader_workers(layer):
    pytest.importorskip("torch")
    _run("dataloader", layer)


@pytest.mark.parametrize("layer", LAYERS)
def test_dask_threaded_scheduler(layer):
    pytest.importorskip("dask.array")
    _run("dask", layer)
