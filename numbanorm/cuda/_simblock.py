"""The simulator's launch, driven by the block's threads instead of a poller.

numba's CUDA simulator runs a block's threads as Python threads, and its
``BlockManager.run`` polls them in a loop, holding the GIL, until every thread
has exited, releasing a ``syncthreads`` when it sees every live thread blocked at
one.  The threads then run only when the interpreter's switch interval forces
the poller to drop the GIL, so a kernel's time swings with that interval and
with the machine's load.  ``install()`` replaces the poller with a barrier the
threads drive themselves: the last live thread to arrive at ``syncthreads``
releases the others, a thread that exits is no longer waited for (releasing
the others if it was the last one missing), and the launching thread sleeps on
a condition until the block has finished or a thread has raised.  It also
switches a device function's module to the launch's fake ``cuda`` once per
launch instead of around every call, and keeps a block's threads on the CPU
its launch began on (the launching thread's affinity, restored after the block).
A GPU's arithmetic on inf and NaN is silent, and so is the block's threads' NumPy
arithmetic here: no RuntimeWarning from a kernel's line.

The semantics are numba-cuda 0.30's: a barrier releases when every thread that
has not exited is blocked at one; the first exception aborts the block's other
threads (which raise at their next barrier) and reaches the launch; each
thread's ``syncthreads_blocked`` is set while it waits.  Nothing is replaced
where numba-cuda's functions do not have that version's signatures.
"""

import contextlib
import inspect
import os
import threading

import numpy as np


class _Block:
    """One block's barrier: how many threads are alive and how many wait at it."""

    def __init__(self, nthreads):
        lock = threading.Lock()
        self.barrier = threading.Condition(lock)  # the block's threads wait here
        self.finished = threading.Condition(lock)  # the launching thread waits here
        self.alive = nthreads
        self.waiting = []  # threads blocked at the current barrier
        self.generation = 0  # barriers released so far
        self.failed = None  # the first thread that raised

    def release_if_complete(self):
        """Release the barrier when every live thread waits at it (lock held)."""
        if self.waiting and len(self.waiting) == self.alive:
            for t in self.waiting:
                t.syncthreads_blocked = False
            self.waiting = []
            self.generation += 1
            self.barrier.notify_all()


def _syncthreads(self):
    """``cuda.syncthreads()`` in a simulated thread."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._nn_block
    with block.barrier:
        generation = block.generation
        self.syncthreads_blocked = True
        block.waiting.append(self)
        block.release_if_complete()
        while block.generation == generation and not self.abort:
            block.barrier.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _current_cpu():
    """The CPU the calling thread runs on (Linux), or None."""
    try:
        with open("/proc/thread-self/stat", "rb") as f:
            cpu = int(f.read().rsplit(b")", 1)[1].split()[36])  # field 39, "processor"
        return cpu if cpu in os.sched_getaffinity(0) else None
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@contextlib.contextmanager
def _on_this_cpu():
    """Keep the calling thread, and the threads it starts, on the CPU it runs on: the
    block's threads take turns at the GIL, and on one CPU a turn passes without waking
    another CPU, which may be busy with other work."""
    cpu, saved = _current_cpu(), None
    if cpu is not None:
        try:
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, (cpu,))  # the calling thread's; a thread it starts inherits it
        except OSError:  # not allowed here (a sandbox): the threads run where they may
            saved = None
    try:
        yield
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def _run(self, grid_point, *args):
    """numba-cuda's ``BlockManager.run``: one block's threads, started and awaited."""
    with _on_this_cpu():
        _run_block(self, grid_point, args)


def _run_block(self, grid_point, args):
    from numba.cuda.simulator.kernel import BlockThread

    points = list(np.ndindex(*self._block_dim))
    block = self._nn_block = _Block(len(points))

    def target():
        me = threading.current_thread()
        failed = False
        try:
            with np.errstate(all="ignore"):  # (a GPU raises no floating-point exceptions)
                self._f(*args)
        except BaseException:
            failed = True
            raise  # BlockThread.run records it with the thread's coordinates
        finally:
            with block.barrier:
                block.alive -= 1
                if failed and block.failed is None:
                    block.failed = me
                block.release_if_complete()
                block.finished.notify()

    threads = []
    for block_point in points:
        t = BlockThread(target, self, grid_point, block_point, self._debug)
        threads.append(t)
        t.start()
    with block.barrier:
        while block.alive and block.failed is None:
            block.finished.wait()
        failed = block.failed
        if failed is not None:
            # abort every other thread; do not join them (as numba-cuda)
            for t in threads:
                t.abort = True
                t.syncthreads_blocked = False
            block.barrier.notify_all()
    if failed is not None:
        failed.join()  # BlockThread.run stores the exception after the target returns
        raise failed.exception[0].with_traceback(failed.exception[1])
    for t in threads:
        t.join()


_swapped = {}  # id(module globals) -> (globals, {name: numba.cuda}) swapped in this launch
_swap_lock = threading.Lock()


def _device_call(call):
    """``FakeCUDAKernel.__call__`` with a device function's module switched to the
    launch's fake ``cuda`` once per launch, not at every call (numba-cuda switches
    it and back under two locks per call, which the block's threads queue on)."""
    from numba.cuda.simulator import kernel

    def __call__(self, *args):
        context = kernel._kernel_context
        if context is None:
            if self._device:
                return call(self, *args)  # outside a launch: as numba-cuda
            try:
                return call(self, *args)  # a launch
            finally:
                with _swap_lock:
                    for module, names in _swapped.values():
                        module.update(names)
                    _swapped.clear()
        module = self.fn.__globals__
        if id(module) not in _swapped:
            from numba import cuda

            with _swap_lock:
                if id(module) not in _swapped:
                    names = {k: v for k, v in module.items() if v is cuda}
                    # switched before recorded: a thread that sees the record skips the lock
                    module.update(dict.fromkeys(names, context))
                    _swapped[id(module)] = (module, names)
        return self.fn(*args)

    return __call__


def install():
    """Replace the simulator's ``BlockManager.run``, ``BlockThread.syncthreads`` and the
    device-function path of ``FakeCUDAKernel.__call__`` (once; a no-op off the
    simulator or where numba-cuda's are not the ones this module reproduces).
    Install before anything that wraps ``syncthreads``."""
    from numba import cuda

    if not cuda.config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernel

    manager, thread, fake = kernel.BlockManager, kernel.BlockThread, kernel.FakeCUDAKernel
    if manager.run is _run:
        return False
    if (list(inspect.signature(manager.run).parameters) != ["self", "grid_point", "args"]
            or list(inspect.signature(thread.syncthreads).parameters) != ["self"]
            or list(inspect.signature(fake.__call__).parameters) != ["self", "args"]
            or not hasattr(kernel, "_kernel_context")
            or getattr(thread, "_nn_tracked", False)):
        return False
    manager.run = _run
    thread.syncthreads = _syncthreads
    fake.__call__ = _device_call(fake.__call__)
    return True
